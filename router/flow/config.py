"""The ``[flow]`` table: flow control (admission queue, priority bands, per-flow fairness).

Kept in its own module so that :mod:`router.config` only embeds it; the checks msgspec's types cannot
express are in :func:`validate_flow`. Off by default: with ``enabled = false`` the router routes every
request the moment it arrives, exactly as without this table.
"""

from __future__ import annotations

import math

import msgspec

MAX_BANDS = 16
"""Distinct priorities (bands) at most: each band has its own bounded queue and metric series."""


MAX_RESERVE = 0.9
"""``higher_band_reserve`` at most: beyond it a band below the highest keeps almost no room at all
(a single slot per target), which is what a sheddable band is for, not a reserve."""


class FlowError(ValueError):
    """A ``[flow]`` key is unusable; the message names it."""


class FlowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When a request waits in the router instead of in an engine (docs/flow-control.md)."""

    enabled: bool = False
    """Hold requests in the router while every candidate of their model is saturated."""
    # --- saturation, per (backend, DP rank) ---
    max_active: int = 256
    """A target with this many requests in flight (the router's own count, plus other workers' and
    replicas' where shared) is saturated: vLLM's ``max_num_seqs`` is 256 by default, past which the
    engine queues them itself. 0: not a criterion."""
    max_pending_prefill_tokens: int = 65536
    """A target whose dispatched requests still have this many uncached prompt tokens to compute is
    saturated (eight 8,192-token prefill steps queued ahead of a new request). 0: not a criterion."""
    max_engine_waiting: float = 5.0
    """``vllm:num_requests_waiting`` per rank at or above this saturates a target; read only when
    ``health.scrape_metrics`` is on (as stale as ``health.interval_s``). 0: not a criterion."""
    max_kv_usage: float = 0.8
    """``vllm:kv_cache_usage_perc`` (0..1) at or above this saturates a target; read only when
    ``health.scrape_metrics`` is on. 0: not a criterion."""
    restrict_to_room: bool = False
    """True: a request let through is decided among the targets with room for its band only, so no
    engine ever passes ``max_active``, nor a band its ceiling under ``higher_band_reserve`` (the
    strict bound). False (the default): among every candidate, the policy
    weighing their load as always, so a long cached prefix may still send a request to a busy engine
    while another has room; the queue then bounds the fleet's total in flight. On the saturated
    Mooncake replay the strict mode lost three quarters of the hit ratio (every dispatch went to
    whichever engine freed first) and this one gained on flow control off (docs/benchmarks/flow.md)."""
    # --- the queue ---
    ttl_s: float = 60.0
    """Longest a request waits in the queue; then 429 (sheddable band) or 503, with Retry-After."""
    max_band_requests: int = 5000
    """Requests queued per band at most (across models); one more is rejected at once."""
    max_band_bytes: int = 512 << 20
    """Request body bytes queued per band at most (the bodies stay in memory while they wait)."""
    default_priority: int = 0
    """The band of a request that names no known objective and no ``x-kvrouter-priority``."""
    priorities: list[int] = []
    """More bands, besides the default one and the objectives' (a ``x-kvrouter-priority`` value goes
    to the highest band at or below it, else the lowest band)."""
    objectives: dict[str, int] = {}
    """``x-gateway-inference-objective`` name -> priority (as an InferenceObjective names one)."""
    higher_band_reserve: float = 0.0
    """Share of a target's room each band leaves to the bands above it (trunk reservation): a band
    with k configured bands above it is saturated at ``max_active * (1 - higher_band_reserve)**k``
    requests in flight (rounded down, at least 1) and at that share of
    ``max_pending_prefill_tokens``, so a higher band's request finds a free slot at once instead of
    waiting for lower bands' requests to end, and its engine batches it with fewer of theirs. The
    highest band (and a lone band) keeps the full room. 0 (the default): every band fills the whole
    room and strict priority only orders the queue, as without this key. Not on by default because
    the share worth holding is the share of each engine the higher bands' concurrent requests need,
    which the router cannot know, and whatever is held sits idle while they do not use it (it
    costs the lower bands that much throughput). At most 0.9."""
    recheck_s: float = 0.05
    """While requests wait, capacity is also re-checked this often: load freed by other worker
    processes or replicas, and scraped engine figures, come with no local signal."""


def validate_flow(cfg: FlowConfig) -> None:
    """Checks msgspec's types cannot express; raises :class:`FlowError` naming the key."""
    if cfg.max_active < 0 or cfg.max_pending_prefill_tokens < 0:
        raise FlowError("flow.max_active and flow.max_pending_prefill_tokens: must be >= 0 (0: not used)")
    if not cfg.max_engine_waiting >= 0 or not 0 <= cfg.max_kv_usage <= 1:
        raise FlowError("flow.max_engine_waiting must be >= 0 and flow.max_kv_usage within 0..1")
    if not (0 < cfg.ttl_s <= 3600) or not math.isfinite(cfg.ttl_s):
        raise FlowError("flow.ttl_s: must be within (0, 3600]")
    if cfg.max_band_requests < 1 or cfg.max_band_bytes < 1:
        raise FlowError("flow.max_band_requests and flow.max_band_bytes: must be at least 1")
    if not 0.001 <= cfg.recheck_s <= 10:
        raise FlowError("flow.recheck_s: must be within 0.001..10")
    if not 0 <= cfg.higher_band_reserve <= MAX_RESERVE:
        raise FlowError(f"flow.higher_band_reserve: must be within 0..{MAX_RESERVE} (0: no reserve)")
    if len(bands_of(cfg)) > MAX_BANDS:
        raise FlowError(f"flow: at most {MAX_BANDS} distinct priorities (default, priorities, objectives)")
    for name in cfg.objectives:
        if not name or len(name) > 253:
            raise FlowError("flow.objectives: names must be 1..253 characters")


def bands_of(cfg: FlowConfig) -> list[int]:
    """Every band's priority, highest first."""
    return sorted({cfg.default_priority, *cfg.priorities, *cfg.objectives.values()}, reverse=True)


__all__ = ["MAX_BANDS", "MAX_RESERVE", "FlowConfig", "FlowError", "bands_of", "validate_flow"]
