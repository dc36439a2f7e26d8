"""When a candidate (backend, DP rank) is saturated, and how many more requests it may take.

A target is saturated when any configured threshold is reached: the requests in flight there, the
uncached prompt tokens its dispatched requests still have to compute (both from the load tracker:
this router's own figures plus other worker processes' and, with ``[cluster]`` on, other replicas'),
and, where ``health.scrape_metrics`` reads them, the engine's own ``vllm:num_requests_waiting`` and
KV cache usage. The router's figures move at every dispatch and first byte; the scraped ones only at
each health round, so they serve as a brake on an engine whose queue the router cannot see (other
clients, a restart), not as the primary signal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from router.fleet.load import LoadTracker, Target, TargetLoad
from router.flow.config import FlowConfig

UNBOUNDED = 1 << 30
"""The room of an unsaturated target when ``max_active`` is off (only the other criteria apply)."""


class Saturation:
    """Per-target room from the load tracker's figures (plain reads; no state of its own)."""

    def __init__(self, cfg: FlowConfig, loads: LoadTracker) -> None:
        self.cfg = cfg
        self.loads = loads

    def room(self, load: TargetLoad) -> int:
        """Requests this target may still take: 0 when saturated."""
        cfg = self.cfg
        if cfg.max_pending_prefill_tokens and load.pending_prefill_tokens >= cfg.max_pending_prefill_tokens:
            return 0
        if cfg.max_engine_waiting and load.engine_waiting >= cfg.max_engine_waiting:
            return 0
        if cfg.max_kv_usage and load.engine_kv_usage >= cfg.max_kv_usage:
            return 0
        if cfg.max_active:
            return max(cfg.max_active - load.active, 0)
        return UNBOUNDED

    def headroom(self, targets: Iterable[Target]) -> int:
        """Requests the targets may take together (0: every one is saturated)."""
        get = self.loads.get
        room = self.room
        total = 0
        for t in targets:
            total += room(get(t))
        return total

    def reasons(self, load: TargetLoad) -> list[str]:
        """Which thresholds a target has reached (for ``/route``'s "would queue")."""
        cfg = self.cfg
        out = []
        if cfg.max_active and load.active >= cfg.max_active:
            out.append(f"active {load.active} >= max_active {cfg.max_active}")
        if cfg.max_pending_prefill_tokens and load.pending_prefill_tokens >= cfg.max_pending_prefill_tokens:
            out.append(
                f"pending prefill tokens {load.pending_prefill_tokens} >= max_pending_prefill_tokens "
                f"{cfg.max_pending_prefill_tokens}"
            )
        if cfg.max_engine_waiting and load.engine_waiting >= cfg.max_engine_waiting:
            out.append(
                f"engine waiting {load.engine_waiting:g} >= max_engine_waiting {cfg.max_engine_waiting:g}"
            )
        if cfg.max_kv_usage and load.engine_kv_usage >= cfg.max_kv_usage:
            out.append(f"engine KV usage {load.engine_kv_usage:.2f} >= max_kv_usage {cfg.max_kv_usage:g}")
        return out

    def explain(self, targets: Iterable[Target]) -> list[dict[str, Any]]:
        """Every target's room and, when saturated, why."""
        get = self.loads.get
        out = []
        for t in targets:
            load = get(t)
            room = self.room(load)
            entry: dict[str, Any] = {"backend": t[0], "dp_rank": t[1], "room": min(room, UNBOUNDED)}
            if room == 0:
                entry["saturated"] = self.reasons(load)
            out.append(entry)
        return out


__all__ = ["UNBOUNDED", "Saturation"]
