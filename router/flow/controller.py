"""Flow control's one entry point for the front ends: ``await flow.admit(meta) -> Ticket | Rejection``.

The proxy (and ``/route``, and a gateway's endpoint picker) call :meth:`FlowController.admit` before
the decision, never after: a request that has to wait is *decided when it leaves the queue*, against
the index and the load as they are then (late binding), not when it arrived. A :class:`Ticket` holds
one unit of room on the model's targets from its grant until the front end has taken the request's
load ticket (:meth:`Ticket.release`, right after the decision), so one freed slot never lets the
whole queue through.

What wakes the queue: the load tracker's first byte and finish of any request (prefill work and
requests in flight drop), a ticket's release (its decision is counted as load now), and, while
anything waits, a re-check every ``flow.recheck_s`` for what comes with no local signal (other worker
processes' and replicas' load, scraped engine figures, a backend joining). A KV event does not free
capacity, so it wakes nothing; it changes the decision, which is taken late for that reason.

With ``[cluster]`` on, saturation reads the shared load (the load tracker sums the replicas'), but
every replica keeps its own queue: priority and fairness hold among the requests one replica holds,
and across replicas only as far as the balancer spreads each flow's requests evenly over them.
"""

from __future__ import annotations

import asyncio
import math
import time
from _blake2 import blake2b
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from router.fleet.load import LoadTracker, Target
from router.fleet.membership import Member
from router.flow.config import FlowConfig, bands_of
from router.flow.metrics import FlowMetrics
from router.flow.queue import ModelQueue, Waiter
from router.flow.saturation import UNBOUNDED, Saturation

OBJECTIVE_HEADER = b"x-gateway-inference-objective"
PRIORITY_HEADER = b"x-kvrouter-priority"
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
MAX_FLOW_ID = 128
"""Characters of a flow id kept (a longer header is cut: the id only has to tell flows apart)."""


class FlowMeta(msgspec.Struct):
    """What admission needs of a request: its model's candidates, its band, its flow, its size."""

    model: str
    priority: int
    flow: str
    size: int


class Ticket:
    """One dispatched request's hold on its model's room, until its decision is counted as load."""

    __slots__ = ("_owner", "model", "priority", "released", "waited_s")

    def __init__(self, owner: FlowController, model: str, priority: int, waited_s: float) -> None:
        self._owner = owner
        self.model = model
        self.priority = priority
        self.waited_s = waited_s
        self.released = False

    def release(self) -> None:
        """The request was decided (its load ticket taken) or failed: give its room back."""
        if not self.released:
            self.released = True
            self._owner._released(self.model)


class Rejection:
    """A request the queue turned away: 429 (sheddable band) or 503, OpenAI-shaped, with Retry-After."""

    __slots__ = ("priority", "reason", "retry_after", "status")

    def __init__(self, priority: int, reason: str, retry_after: int) -> None:
        self.priority = priority
        self.reason = reason
        self.retry_after = retry_after
        self.status = 429 if priority < 0 else 503

    def body(self) -> bytes:
        """The error as OpenAI shapes it."""
        what = {
            "ttl": "waited longer than flow.ttl_s in the router's queue",
            "queue_full": "the router's queue for this priority is full",
            "bytes_full": "the router's queue for this priority holds its maximum of request bytes",
        }.get(self.reason, self.reason)
        kind = "rate_limit_error" if self.status == 429 else "service_unavailable"
        message = f"Every backend for this model is saturated and the request {what}; retry later"
        return msgspec.json.encode(
            {"error": {"message": message, "type": kind, "param": None, "code": f"flow_{self.reason}"}}
        )

    def headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after).encode()),
        ]


class FlowController:
    """The admission queues of every model, their bounds, and the dispatch when room frees."""

    def __init__(
        self,
        cfg: FlowConfig,
        loads: LoadTracker,
        targets_for: Callable[[str], list[Target]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``targets_for(model)``: the (backend, rank) pairs a decision for ``model`` would consider
        now (empty when nobody may serve it: then nothing waits, the decision answers 404/503)."""
        self.cfg = cfg
        self.sat = Saturation(cfg, loads)
        self.targets_for = targets_for
        self.clock = clock
        self.bands = bands_of(cfg)
        self._lowest = self.bands[-1]
        self._queues: dict[str, ModelQueue] = {}
        self._granted: dict[str, int] = {}
        self._band_len = dict.fromkeys(self.bands, 0)
        self._band_bytes = dict.fromkeys(self.bands, 0)
        self._labels = {p: (str(p),) for p in self.bands}
        self._reserved = {p for p in self.bands if self.sat.limits[p] != self.sat.limits[self.bands[0]]}
        """The bands whose room the reserve for higher bands makes smaller than the highest's."""
        self._pump_soon = False
        self._recheck: asyncio.TimerHandle | None = None
        self._rate = 0.0
        self._window = (clock(), 0)
        self.metrics = FlowMetrics(lambda: dict(self._band_len), reserve=bool(self._reserved))
        loads.on_free = self.capacity_freed

    # --- what the front ends call ---------------------------------------------------------------
    def meta(self, headers: Iterable[tuple[bytes, bytes]], body: Any, size: int) -> FlowMeta:
        """A request's model, band and flow (``x-gateway-inference-fairness-id``, else its API key,
        else the body's ``user``, else one shared anonymous flow)."""
        objective = priority = fairness = token = None
        for name, value in headers:
            if name == OBJECTIVE_HEADER:
                objective = value
            elif name == PRIORITY_HEADER:
                priority = value
            elif name == FAIRNESS_HEADER:
                fairness = value
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
        model = body.get("model") if isinstance(body, dict) else None
        if fairness:
            flow = "id:" + fairness[:MAX_FLOW_ID].decode("latin-1")
        elif token:  # (a digest: flow ids are shown on the dashboard)
            flow = "key:" + blake2b(token, digest_size=6).hexdigest()
        else:
            user = body.get("user") if isinstance(body, dict) else None
            flow = "user:" + user[:MAX_FLOW_ID] if isinstance(user, str) and user else ""
        return FlowMeta(
            model if isinstance(model, str) else "", self.band_of(objective, priority), flow, size
        )

    def band_of(self, objective: bytes | None, priority: bytes | None) -> int:
        """The band: a configured objective's priority, else ``x-kvrouter-priority`` (the highest band
        at or below it, else the lowest band), else ``flow.default_priority``."""
        if objective is not None:
            p = self.cfg.objectives.get(objective.decode("latin-1"))
            if p is not None:
                return p
        if priority is not None and len(priority) <= 12:
            try:
                want = int(priority)
            except ValueError:
                return self.cfg.default_priority
            return next((b for b in self.bands if b <= want), self._lowest)
        return self.cfg.default_priority

    async def admit(self, meta: FlowMeta) -> Ticket | Rejection:
        """A :class:`Ticket` once the request may be decided (at once when its model has room and
        nothing waits for it), or a :class:`Rejection`. A client that leaves while its request
        waits cancels the awaiting task: the request leaves the queue then and there."""
        model = meta.model
        q = self._queues.get(model)
        if q is None:
            targets = self.targets_for(model) if model else None
            if not targets or self.sat.headroom(targets, meta.priority) > self._granted.get(model, 0):
                return self._grant(model, meta.priority, 0.0)
        p = meta.priority
        if self._band_len[p] >= self.cfg.max_band_requests:
            return self._reject(p, "queue_full")
        if self._band_bytes[p] + meta.size > self.cfg.max_band_bytes:
            return self._reject(p, "bytes_full")
        if q is None:
            q = self._queues[model] = ModelQueue(self.bands)
        loop = asyncio.get_running_loop()
        now = self.clock()
        w = Waiter(q.by_priority[p], meta.flow, model, meta.size, loop.create_future(), now)
        q.push(w)
        self._band_len[p] += 1
        self._band_bytes[p] += meta.size
        w.deadline = now + self.cfg.ttl_s
        w.timer = loop.call_later(self.cfg.ttl_s, self._expire, w)
        self._pump()  # (a higher band's arrival, or room freed since the last wake-up)
        if w.alive and p in self._reserved and self._room(model) > 0:
            self.metrics.reserve_held.inc(self._labels[p])  # (room, but only a higher band's)
        self._arm_recheck()
        try:
            result: Ticket | Rejection = await w.future
            return result
        except asyncio.CancelledError:
            if w.alive:
                self._drop(w, "disconnect")
            elif w.future.done() and not w.future.cancelled():
                granted = w.future.result()
                if isinstance(granted, Ticket):
                    granted.release()  # dispatched just as its client left
            raise

    def open_members(self, backends: list[Member], band: int | None = None) -> list[Member]:
        """``restrict_to_room``: the candidates a decision may take, the backends with a rank with
        room for ``band`` (below the band's ceiling under ``higher_band_reserve``; None: the full
        room), or all of them when none has (a request let through without room, because the fleet
        changed meanwhile). A backend's ranks stay together: the decision's candidate plans are
        per set of backends."""
        get = self.sat.loads.get
        room = self.sat.room
        open_ = [m for m in backends if any(room(get(t), band) > 0 for t in m.targets)]
        return open_ if len(open_) != len(backends) and open_ else backends

    def would_queue(self, meta: FlowMeta) -> dict[str, Any]:
        """What :meth:`admit` would do with this request now (``/route``): ``would_queue`` and why."""
        targets = self.targets_for(meta.model) if meta.model else []
        q = self._queues.get(meta.model)
        p = meta.priority
        room = self._room(meta.model, p, targets)
        waiting = q.live if q is not None else 0
        out: dict[str, Any] = {"band": p, "flow": meta.flow, "queued": waiting}
        if not targets:
            out["would_queue"] = False
            return out
        # (the requests it would wait behind: its own band's and the bands above; a lower band's
        # wait for room this one may have, as the reserve for higher bands makes them do)
        ahead = sum(b.live for b in q.bands if b.priority >= p) if q is not None else 0
        out["would_queue"] = ahead > 0 or room <= 0
        out["room"] = max(min(room, UNBOUNDED), 0)
        if p in self._reserved:
            out["reserved"] = max(min(self._room(meta.model, None, targets), UNBOUNDED), 0) - out["room"]
        if out["would_queue"]:
            if ahead and room > 0:
                out["reason"] = f"{ahead} requests already wait for this model"
            elif p in self._reserved and out["reserved"] > 0:
                out["reason"] = "the room left is reserved for higher bands (flow.higher_band_reserve)"
            else:
                out["reason"] = "every candidate is saturated"
            out["targets"] = self.sat.explain(targets, p)
        return out

    def _room(self, model: str, band: int | None = None, targets: list[Target] | None = None) -> int:
        """Requests ``model``'s candidates may still take for ``band`` (None: the highest band's,
        the full room), less those let through whose decision is not yet counted as load."""
        if targets is None:
            targets = self.targets_for(model)
        if not targets:
            return UNBOUNDED
        return self.sat.headroom(targets, band) - self._granted.get(model, 0)

    # --- capacity signals -------------------------------------------------------------------------
    def capacity_freed(self) -> None:
        """A request's first byte or end (the load tracker's hook): wake the queue soon, once."""
        if self._queues and not self._pump_soon:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _released(self, model: str) -> None:
        n = self._granted.get(model, 0) - 1
        if n > 0:
            self._granted[model] = n
        else:
            self._granted.pop(model, None)
        self.capacity_freed()  # (called soon: by then the decided request counts as load)

    def _wake(self) -> None:
        self._pump_soon = False
        self._pump()

    def _arm_recheck(self) -> None:
        if self._recheck is None and self._queues:
            self._recheck = asyncio.get_running_loop().call_later(self.cfg.recheck_s, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self._pump()
        self._arm_recheck()

    # --- the queue --------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Dispatch waiting requests while their band has room on their model: highest band first,
        fairest flow first. A band's room is never more than the band above's (the reserve only
        takes from lower bands), so the first band left waiting for room stops its model's round."""
        for model, q in list(self._queues.items()):
            targets = self.targets_for(model)
            now = self.clock()
            for band in q.bands:
                if not band.live:
                    continue
                room = self._room(model, band.priority, targets)
                while room > 0 and band.live:
                    w = q.pop_band(band)
                    if w is None:
                        break
                    self._left(w)
                    if not w.future.done():
                        w.future.set_result(self._grant(model, band.priority, now - w.enqueued))
                        room -= 1
                if band.live:
                    break
            if not q.live:
                del self._queues[model]
        if not self._queues and self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None

    def _left(self, w: Waiter) -> None:
        p = w.band.priority
        self._band_len[p] -= 1
        self._band_bytes[p] -= w.size
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None

    def _drop(self, w: Waiter, reason: str) -> None:
        q = self._queues.get(w.model)
        if q is not None:
            q.remove(w)
            if not q.live:
                del self._queues[w.model]
        self._left(w)
        self.metrics.rejected.inc((self._labels[w.band.priority][0], reason))

    def _expire(self, w: Waiter) -> None:
        w.timer = None
        if w.alive:
            self._drop(w, "ttl")
            if not w.future.done():
                w.future.set_result(Rejection(w.band.priority, "ttl", self._retry_after()))

    def _grant(self, model: str, priority: int, waited: float) -> Ticket:
        self._granted[model] = self._granted.get(model, 0) + 1
        labels = self._labels.get(priority) or (str(priority),)
        self.metrics.dispatched.inc(labels)
        self.metrics.wait.observe(labels, waited)
        if waited:
            start, n = self._window
            now = self.clock()
            if now - start >= 1.0:
                self._rate = 0.5 * self._rate + 0.5 * (n + 1) / (now - start)
                self._window = (now, 0)
            else:
                self._window = (start, n + 1)
        return Ticket(self, model, priority, waited)

    def _reject(self, priority: int, reason: str) -> Rejection:
        self.metrics.rejected.inc((self._labels[priority][0], reason))
        return Rejection(priority, reason, self._retry_after())

    def _retry_after(self) -> int:
        """Seconds until the queue might have room: what waits over the recent dispatch rate,
        1..``ttl_s``."""
        waiting = sum(self._band_len.values())
        if self._rate <= 0:
            return 1
        return max(1, min(math.ceil(waiting / self._rate), math.ceil(self.cfg.ttl_s)))

    # --- inspection -------------------------------------------------------------------------------
    def depth(self) -> dict[int, int]:
        """Requests waiting per band (every model)."""
        return dict(self._band_len)

    def top_flows(self, n: int = 10) -> list[dict[str, Any]]:
        """The flows with the most requests waiting (the dashboard)."""
        rows: dict[tuple[int, str], int] = {}
        for q in self._queues.values():
            for band in q.bands:
                for flow, count in band.top_flows(n):
                    rows[(band.priority, flow)] = rows.get((band.priority, flow), 0) + count
        ranked = sorted(rows.items(), key=lambda kv: -kv[1])[:n]
        return [{"band": b, "flow": f or "(anonymous)", "queued": c} for (b, f), c in ranked]

    def describe(self) -> dict[str, Any]:
        """The dashboard's and /debug's view."""
        return {
            "depth": {str(b): n for b, n in self._band_len.items()},
            "bytes": sum(self._band_bytes.values()),
            "granted": sum(self._granted.values()),
            "top_flows": self.top_flows(),
        }

    def close(self) -> None:
        """Stop the re-check timer (requests still waiting expire by their own timers)."""
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None


__all__ = [
    "FAIRNESS_HEADER",
    "OBJECTIVE_HEADER",
    "PRIORITY_HEADER",
    "FlowController",
    "FlowMeta",
    "Rejection",
    "Ticket",
]
