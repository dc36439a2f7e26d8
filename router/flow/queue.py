"""The bounded admission queue: strict priority bands, and fair queuing between flows inside a band.

**Bands.** Each configured priority is a band; the highest non-empty band always dispatches first
(strict priority, as GIE's flow control does: a band below waits while the one above has requests).

**Fairness inside a band: start-time fair queuing** (virtual time), not deficit round robin. Each
request gets a start tag ``max(V, finish of its flow's previous request)`` and a finish tag one unit
later; the request with the smallest start tag leaves first, and ``V`` becomes its tag. A flow that
queues 1,000 requests at once gets tags V..V+999, so a flow arriving after it is interleaved with it
from its first request: every backlogged flow gets an equal share of the dispatches, whatever its
rate, and an idle flow banks no credit. One heap per band orders every request (tags within a flow
only grow), so a dispatch is O(log n) whatever the number of flows, and removal is O(1) (marked;
the heap is compacted when dead entries outnumber live ones). Deficit round robin needs a ring of
flows and a quantum tuned to request sizes; with a unit cost both give the same shares.

**The unit is one request**: the prompt's tokens are not known before the decision (which happens
when the request leaves the queue), and body bytes mis-measure chat with media. So fairness is over
dispatches, which is what the band's capacity (requests in flight per target) is counted in.

A flow's state is dropped when it has nothing queued: the flow table is bounded by the queued
requests, and a returning flow starts at the current virtual time.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any

_COMPACT_SLACK = 64


class Waiter:
    """One queued request."""

    __slots__ = ("alive", "band", "deadline", "enqueued", "flow", "future", "model", "size", "timer")

    def __init__(
        self, band: Band, flow: str, model: str, size: int, future: asyncio.Future[Any], enqueued: float
    ) -> None:
        self.band = band
        self.flow = flow
        self.model = model
        self.size = size
        self.future = future
        self.enqueued = enqueued
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.alive = True


class Band:
    """The queued requests of one priority, for one model, in start-tag order."""

    __slots__ = ("_dead", "_heap", "_seq", "flows", "live", "priority", "vtime")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self._heap: list[tuple[float, int, Waiter]] = []
        self._seq = 0
        self._dead = 0
        self.live = 0
        self.vtime = 0.0
        self.flows: dict[str, list[float]] = {}
        """flow -> [finish tag of its last request, requests queued]."""

    def push(self, w: Waiter) -> None:
        """Queue ``w`` behind its flow's earlier requests."""
        st = self.flows.get(w.flow)
        if st is None:
            st = self.flows[w.flow] = [self.vtime, 0.0]
        start = st[0] if st[0] > self.vtime else self.vtime
        st[0] = start + 1.0
        st[1] += 1
        self._seq += 1
        heapq.heappush(self._heap, (start, self._seq, w))
        self.live += 1

    def pop(self) -> Waiter | None:
        """The live request with the smallest start tag (None if none)."""
        heap = self._heap
        while heap:
            start, _, w = heapq.heappop(heap)
            if not w.alive:
                self._dead -= 1
                continue
            self.vtime = start
            self._left(w)
            return w
        return None

    def remove(self, w: Waiter) -> None:
        """Take ``w`` out (expired, or its client left); the heap entry goes lazily."""
        self._left(w)
        self._dead += 1
        if self._dead > self.live + _COMPACT_SLACK:
            self._heap = [e for e in self._heap if e[2].alive]
            heapq.heapify(self._heap)
            self._dead = 0

    def _left(self, w: Waiter) -> None:
        w.alive = False
        self.live -= 1
        st = self.flows[w.flow]
        st[1] -= 1
        if st[1] <= 0:
            del self.flows[w.flow]

    def top_flows(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` flows with the most requests queued, with their counts."""
        ranked = sorted(self.flows.items(), key=lambda kv: -kv[1][1])[:n]
        return [(f, int(st[1])) for f, st in ranked]


class ModelQueue:
    """One model's bands, highest priority first (a model's requests only wait for its own targets)."""

    __slots__ = ("bands", "by_priority", "live")

    def __init__(self, priorities: list[int]) -> None:
        self.bands = [Band(p) for p in sorted(priorities, reverse=True)]
        self.by_priority = {b.priority: b for b in self.bands}
        self.live = 0

    def push(self, w: Waiter) -> None:
        w.band.push(w)
        self.live += 1

    def pop(self) -> Waiter | None:
        """The next request: the highest non-empty band's fairest."""
        for band in self.bands:
            if band.live:
                w = band.pop()
                if w is not None:
                    self.live -= 1
                    return w
        return None

    def pop_band(self, band: Band) -> Waiter | None:
        """The next request of one of this model's bands (the dispatch checks each band's room)."""
        w = band.pop()
        if w is not None:
            self.live -= 1
        return w

    def remove(self, w: Waiter) -> None:
        w.band.remove(w)
        self.live -= 1


__all__ = ["Band", "ModelQueue", "Waiter"]
