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
from typing import Any

from router.observe.metrics import LeanHistogram

__all__ = ["GcPauses"]

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
