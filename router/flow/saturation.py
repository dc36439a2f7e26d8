"""When a candidate (backend, DP rank) is saturated, and how many more requests it may take.

A target is saturated when any configured threshold is reached: the requests in flight there, the
uncached prompt tokens its dispatched requests still have to compute (both from the load tracker:
this router's own figures plus other worker processes' and, with ``[cluster]`` on, other replicas'),
and, where ``health.scrape_metrics`` reads them, the engine's own ``vllm:num_requests_waiting`` and
KV cache usage. The router's figures move at every dispatch and first byte; the scraped ones only at
each health round, so they serve as a brake on an engine whose queue the router cannot see (other
clients, a restart), not as the primary signal.

**The reserve for higher bands** (``higher_band_reserve``, trunk reservation): a band with k
configured bands above it counts a target as saturated at the two router-side thresholds scaled by
``(1 - reserve)**k``; the scraped engine figures are brakes on the engine as a whole and stay the
same for every band. The load counted is every band's (a lower band stops where the total in flight
reaches its ceiling), so the room above that ceiling is only ever granted to a higher band.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from router.fleet.load import LoadTracker, Target, TargetLoad
from router.flow.config import FlowConfig, bands_of

UNBOUNDED = 1 << 30
"""The room of an unsaturated target when ``max_active`` is off (only the other criteria apply)."""


class Saturation:
    """Per-target room from the load tracker's figures (plain reads; no state of its own beyond each
    band's thresholds, fixed by the config)."""

    def __init__(self, cfg: FlowConfig, loads: LoadTracker) -> None:
        self.cfg = cfg
        self.loads = loads
        self.limits: dict[int, tuple[int, int]] = {}
        """band -> (``max_active``, ``max_pending_prefill_tokens``) less ``higher_band_reserve``
        once per configured band above it; an unknown band has the full thresholds."""
        share = 1.0 - cfg.higher_band_reserve
        for k, band in enumerate(bands_of(cfg)):
            scale = share**k
            self.limits[band] = (
                _scaled(cfg.max_active, scale),
                _scaled(cfg.max_pending_prefill_tokens, scale),
            )
        self._full = (cfg.max_active, cfg.max_pending_prefill_tokens)

    def room(self, load: TargetLoad, band: int | None = None) -> int:
        """Requests this target may still take for ``band`` (None: the highest band's, the full
        room): 0 when saturated."""
        max_active, max_pending = self._full if band is None else self.limits.get(band, self._full)
        return self._room(load, max_active, max_pending)

    def _room(self, load: TargetLoad, max_active: int, max_pending: int) -> int:
        cfg = self.cfg
        if max_pending and load.pending_prefill_tokens >= max_pending:
            return 0
        if cfg.max_engine_waiting and load.engine_waiting >= cfg.max_engine_waiting:
            return 0
        if cfg.max_kv_usage and load.engine_kv_usage >= cfg.max_kv_usage:
            return 0
        if max_active:
            return max(max_active - load.active, 0)
        return UNBOUNDED

    def headroom(self, targets: Iterable[Target], band: int | None = None) -> int:
        """Requests the targets may take together for ``band`` (0: every one is saturated)."""
        max_active, max_pending = self._full if band is None else self.limits.get(band, self._full)
        get = self.loads.get
        room = self._room
        total = 0
        for t in targets:
            total += room(get(t), max_active, max_pending)
        return total

    def reasons(self, load: TargetLoad, band: int | None = None) -> list[str]:
        """Which thresholds a target has reached for ``band`` (for ``/route``'s "would queue")."""
        cfg = self.cfg
        max_active, max_pending = self._full if band is None else self.limits.get(band, self._full)
        out = []
        if max_active and load.active >= max_active:
            out.append(f"active {load.active} >= {self._named('max_active', max_active, cfg.max_active)}")
        if max_pending and load.pending_prefill_tokens >= max_pending:
            out.append(
                f"pending prefill tokens {load.pending_prefill_tokens} >= "
                + self._named("max_pending_prefill_tokens", max_pending, cfg.max_pending_prefill_tokens)
            )
        if cfg.max_engine_waiting and load.engine_waiting >= cfg.max_engine_waiting:
            out.append(
                f"engine waiting {load.engine_waiting:g} >= max_engine_waiting {cfg.max_engine_waiting:g}"
            )
        if cfg.max_kv_usage and load.engine_kv_usage >= cfg.max_kv_usage:
            out.append(f"engine KV usage {load.engine_kv_usage:.2f} >= max_kv_usage {cfg.max_kv_usage:g}")
        return out

    @staticmethod
    def _named(key: str, limit: int, full: int) -> str:
        if limit == full:
            return f"{key} {full}"
        return f"{limit} ({key} {full} less higher_band_reserve for the bands above)"

    def explain(self, targets: Iterable[Target], band: int | None = None) -> list[dict[str, Any]]:
        """Every target's room for ``band`` and, when saturated for it, why."""
        get = self.loads.get
        out = []
        for t in targets:
            load = get(t)
            room = self.room(load, band)
            entry: dict[str, Any] = {"backend": t[0], "dp_rank": t[1], "room": min(room, UNBOUNDED)}
            if room == 0:
                entry["saturated"] = self.reasons(load, band)
            out.append(entry)
        return out


def _scaled(limit: int, share: float) -> int:
    """A threshold times a band's share, rounded down (a hair of slack against float error, so
    8 * 0.75 stays 6), at least 1 so that no band is shut out of an idle target; 0 stays 0 (off)."""
    if not limit:
        return 0
    return max(1, math.floor(limit * share + 1e-9))


__all__ = ["UNBOUNDED", "Saturation"]
