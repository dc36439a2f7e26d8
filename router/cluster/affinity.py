"""Session affinity: a conversation's requests go where its first one went, within a load bound.

The session header's value (hashed: :func:`router.cluster.wire.session_id`) pins the conversation to
the (backend, DP rank) its first request was routed to. Later requests go there while it is a
candidate (ready, healthy, serving the model) and not overloaded; otherwise the policy decides and
the conversation is pinned to its choice (its next turn's prefix will be cached there). Each request
renews the pin for ``session_ttl_s``.

Overload bound (consistent hashing with bounded loads): with ``n`` candidates holding ``L`` requests
in flight in total (every replica's, as the load tracker sees them), the pinned target is used while
``its in-flight + 1 <= ceil(session_load_factor * (L + 1) / n)``. At the default factor 2 a pinned
target may carry up to twice the mean load before its conversations spill over.

Pins live in a local, bounded map (least recently used first out) that the cluster keeps in step
with the other replicas (each pin is published; the store holds a copy for replicas that start or
reconnect later), so a lookup never waits for the network.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

from router.cluster.wire import session_id
from router.decision.record import Decision
from router.fleet.load import Target

Result = Literal["new", "kept", "steered", "overloaded", "unavailable"]
"""new: no pin yet (pinned to the decision); kept: the policy chose the pinned target anyway;
steered: the pin changed the choice; overloaded / unavailable: the pinned target was over the bound
or not a candidate, so the policy decided and the conversation was re-pinned."""
RESULTS: tuple[Result, ...] = ("new", "kept", "steered", "overloaded", "unavailable")

PinListener = Callable[[int, Target, float], None]
"""Called with (session id, target, ttl seconds) when this replica pins or renews a conversation."""


class SessionAffinity:
    """The pin map and the steering rule."""

    def __init__(
        self,
        header: str,
        ttl_s: float,
        load_factor: float,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.header = header.lower().encode("latin-1")
        self.ttl_s = ttl_s
        self.load_factor = load_factor
        self.max_sessions = max_sessions
        self.clock = clock
        self.pins: dict[int, tuple[Target, float]] = {}
        """session id -> (target, expiry on this replica's monotonic clock), least recently used first."""
        self.listener: PinListener | None = None
        self.results: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.evicted = 0

    def session_of(self, headers: object) -> int | None:
        """The session id of a request's headers (ASGI-style (name, value) byte pairs), if it has one."""
        name = self.header
        for k, v in headers:  # type: ignore[attr-defined]
            if k == name:
                value = v.strip()
                return session_id(value) if value else None
        return None

    def pinned(self, session: int) -> Target | None:
        """The live pin of a session, if any."""
        entry = self.pins.get(session)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self.pins[session]
            return None
        return entry[0]

    def pin(self, session: int, target: Target, ttl_s: float | None = None, *, announce: bool = True) -> None:
        """Pin (or renew) a session; ``announce`` tells the listener (False for pins heard from peers)."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        pins = self.pins
        pins.pop(session, None)  # re-inserted last: most recently used
        if len(pins) >= self.max_sessions:
            self.purge()
            while len(pins) >= self.max_sessions:
                del pins[next(iter(pins))]
                self.evicted += 1
        pins[session] = (target, self.clock() + ttl)
        if announce and self.listener is not None:
            self.listener(session, target, ttl)

    def steer(self, session: int, decision: Decision, *, dry_run: bool = False) -> Result:
        """Apply the pin of ``session`` to a policy's decision (changing its choice when the pin holds)
        and pin the outcome (unless ``dry_run``); returns what happened."""
        target = self.pinned(session)
        result: Result
        if target is None:
            result = "new"
        else:
            i = decision.index_of(target)
            if i is None:
                result = "unavailable"
            elif not self._within_bound(decision.inflight_of(i), decision.total_inflight(), decision.size):
                result = "overloaded"
            elif (decision.backend, decision.dp_rank) == target:
                result = "kept"
            else:
                decision.choose_index(i)
                result = "steered"
        if not dry_run:
            self.results[result] += 1
            self.pin(session, (decision.backend, decision.dp_rank))
        return result

    def _within_bound(self, pinned: int, total: int, n: int) -> bool:
        """The pinned target's in-flight requests plus this one fit its share of the load bound."""
        capacity = math.ceil(self.load_factor * (total + 1) / n)
        return pinned + 1 <= capacity

    def purge(self, limit: int = 10_000) -> None:
        """Drop expired pins from the least recently used end, up to ``limit`` of them (pins share one
        TTL, so that end expires first; lookups drop any other expired pin they meet)."""
        pins = self.pins
        now = self.clock()
        for _ in range(min(limit, len(pins))):
            sid = next(iter(pins))
            if pins[sid][1] > now:
                return
            del pins[sid]


__all__ = ["RESULTS", "PinListener", "Result", "SessionAffinity"]
