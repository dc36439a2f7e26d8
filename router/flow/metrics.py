"""Flow-control series: queue depth per band (read at scrape time), wait, dispatches, rejections,
and, with a reserve for higher bands, the requests it held back.

Recorded by the controller in the request path's lean counters (:mod:`router.observe.metrics`) and
exported with the router's other series. Label values are bounded: ``band`` is a configured
priority (at most :data:`router.flow.config.MAX_BANDS`), ``reason`` one of :data:`REASONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from router.observe.exposition import Family, GaugeFamily
from router.observe.metrics import LeanCounter, LeanHistogram

REASONS = ("ttl", "queue_full", "bytes_full", "disconnect")
"""Why a request left the queue without being dispatched: waited ``flow.ttl_s``, arrived at a band
holding ``max_band_requests`` or ``max_band_bytes``, its client went away while it waited."""

WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FlowMetrics:
    """The four flow-control families."""

    def __init__(self, depth: Callable[[], dict[int, int]], reserve: bool = False) -> None:
        """``reserve``: ``flow.higher_band_reserve`` holds some band back, so
        ``kvrouter_flow_reserve_held`` is exported too (without it the series could only read 0)."""
        self._depth = depth
        self.wait = LeanHistogram(
            "kvrouter_flow_wait_seconds",
            "Time a request waited in the router's admission queue, by band (0: not queued)",
            ["band"],
            WAIT_BUCKETS,
        )
        self.dispatched = LeanCounter(
            "kvrouter_flow_dispatched",
            "Requests that left the admission queue to be decided and sent, by band",
            ["band"],
        )
        self.rejected = LeanCounter(
            "kvrouter_flow_rejected",
            "Requests that left the admission queue unsent, by band and reason (ttl, queue_full, "
            "bytes_full: answered 429 or 503; disconnect: the client left)",
            ["band", "reason"],
        )
        self.reserve_held = LeanCounter(
            "kvrouter_flow_reserve_held",
            "Requests that queued on arrival while their model had room, because the room left was "
            "reserved for higher bands (flow.higher_band_reserve), by band",
            ["band"],
        )
        self.series: list[LeanCounter | LeanHistogram] = [self.wait, self.dispatched, self.rejected]
        if reserve:
            self.series.append(self.reserve_held)

    def collect(self) -> Iterable[Family]:
        """``kvrouter_flow_queue_depth{band}``, read now."""
        fam = GaugeFamily(
            "kvrouter_flow_queue_depth", "Requests waiting in the admission queue, by band", ["band"]
        )
        for band, n in sorted(self._depth().items()):
            fam.add_metric([str(band)], n)
        yield fam


__all__ = ["REASONS", "WAIT_BUCKETS", "FlowMetrics"]
