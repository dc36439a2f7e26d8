"""How long the interpreter's garbage collections hold the process, by generation
(``kvrouter_gc_pause_seconds{generation}``).

A collection stops every thread that needs the interpreter, the event loop included: a full one over
a large heap is a latency spike on every request in flight, invisible in the decision's own timers.
The router keeps the request path free of them (bounded records, bodies freed off the loop); this
histogram is how an operator, or a benchmark, sees that it holds. Timed from ``gc.callbacks``
("start" to "stop"), ~1 us per collection. Collections never overlap (the interpreter runs one at a
time), so the histogram has one writer at a time whichever thread triggered it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from typing import Any

from router.observe.exposition import Family, GaugeFamily
from router.observe.metrics import LeanHistogram

__all__ = ["FrozenObjects", "GcPauses", "freeze_start_up"]

_PAUSE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_GENERATIONS = (("0",), ("1",), ("2",))


class GcPauses:
    """Times this process's collections while installed (``install`` / ``remove``)."""

    def __init__(self) -> None:
        self.histogram = LeanHistogram(
            "kvrouter_gc_pause_seconds",
            "Garbage collection pauses of the router process, by generation (2: full)",
            ["generation"],
            _PAUSE_BUCKETS,
        )
        for labels in _GENERATIONS:  # (every generation exported from the start, at zero)
            self.histogram.series[labels] = [0.0] * (len(self.histogram.bounds) + 2)
        self._started = 0.0

    def install(self) -> None:
        """Start timing (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        """Stop timing (idempotent)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            gen = info.get("generation", 2)
            labels = _GENERATIONS[gen if 0 <= gen < 3 else 2]
            self.histogram.observe(labels, time.perf_counter() - self._started)


def freeze_start_up() -> None:
    """Collect once, then move every object left out of the collector's reach (``gc.freeze``): what
    a serving process built before it listens (the fleet's members, the index's tables, the
    decision plans, the imported modules) lives as long as the process, and a full collection
    later walks only what came after. Without it, the first full collection under traffic walked
    all of start-up: 13-21 ms on the loop at 1,024 candidates, in every measured window of the
    decision bench. Objects freed by reference counting are still freed; only a cycle among them
    would now outlive its use. For a serving process only: a test process starting many routers
    would keep each one's cycles."""
    gc.collect()
    gc.freeze()


class FrozenObjects:
    """``kvrouter_gc_frozen_objects``: what :func:`freeze_start_up` moved out of the collector's
    reach (0: nothing was, e.g. a router run inside another program)."""

    def collect(self) -> Iterable[Family]:
        frozen = GaugeFamily(
            "kvrouter_gc_frozen_objects",
            "Objects built at start-up and left out of garbage collections (gc.freeze)",
        )
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen
