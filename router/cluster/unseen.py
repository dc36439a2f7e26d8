"""Decisions the other replicas are making right now, which this one cannot see yet.

A peer's decision reaches this replica one publish interval plus one store round trip after it is
made (``kvrouter_cluster_lag_seconds``). Requests that arrive together (a burst split by the balancer
across the replicas) are therefore decided by every replica on the *same* shared view, and the
same view with the same policy gives the same answer: each replica sends its first request of the
burst to the engine that looks least loaded, its second to the next one, and so on, so the engines
at the head of that order get N requests each where one router would have given them one. With
sharing on, the views are the same; without it they differ, which is why three unshared replicas
collided less than three shared ones on bursty traffic in the replica benchmark.

What a single router does with a burst is place its requests one after another, each seeing the
ones before. This module lets the replicas approximate that order without talking to each other
on the request path: the replicas (one per process: sibling workers see each other's load at once)
are ranked by their ids, which every replica knows from the store, and a replica assumes that the
decisions the burst's order puts before its own have been made where they would go, on the least
loaded candidates. Those assumed requests count as load when the policy scores the candidates:

- in a burst (this replica decided ``k >= 1`` requests within the last visibility window), the
  ``k * (N - 1) + r`` peer decisions made before this one in a round-robin interleaving of the
  burst, ``r`` being this replica's rank among the ``N``;
- at a burst's first request (``k = 0``), ``r`` of them, weighted by the share of this replica's
  recent requests that came in bursts: traffic that never bursts keeps every replica on the
  cheapest candidate, as before.

An assumed request weighs what this replica's recent requests cost a target on average (their
uncached blocks plus the policy's per-request term), so a cached prefix still wins over an assumed
request's load as it would over a real one. Nothing is sent and nothing is waited for; the
window is the replica's measured lag plus the publish interval, so a peer's decision is assumed
only until it can have arrived. ``/route`` shows each candidate's assumed load
(``assumed_blocks``).

Guessing where the peers' requests went was not enough on bursty traffic (three replicas stayed
15-19% behind one router on the Mooncake conversation trace): the
guess places average requests on the least loaded engines, while the peers' real requests go where
their prefixes are cached. ``stagger_bursts`` (the default) replaces the guess with an order: in a
burst the replica ranked r holds its decision r x (publish interval + lag), at most
:attr:`UnseenPeers.MAX_HOLD_S`, so the decisions of the replicas ranked before it have arrived when
it decides, and it assumes nothing. The hold is a wait on the replica's own clock, never on the
store; a peer counts only while it is routing (``Cluster.replica_keys``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

from router.decision.policy import Candidate, Policy


class UnseenPeers:
    """Assumed peer decisions for one replica (pure state; the clock and the peer ranks come in)."""

    MAX_ASSUMED = 64
    """At most this many assumed requests per decision (a long burst of many replicas)."""

    def __init__(
        self,
        ranks: Callable[[], tuple[int, int]],
        window_s: Callable[[], float],
        *,
        burst_alpha: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        stagger: bool = False,
    ) -> None:
        self.ranks = ranks
        """(this replica's rank, number of replicas), the processes sharing one store."""
        self.window_s = window_s
        """How long a peer's decision stays unseen here (publish interval + lag)."""
        self.burst_alpha = burst_alpha
        self.clock = clock
        self.stagger = stagger
        """Hold burst decisions by rank instead of assuming the peers' (``stagger_bursts``)."""
        self.held = 0
        """Decisions held (a metric)."""
        self.held_s = 0.0
        """Seconds they were held, summed (a metric)."""
        self.burst_share = 0.0
        """Moving share of this replica's decisions made within a window of its previous one."""
        self.request_blocks = 0.0
        """Moving mean of the uncached blocks a decision here left to its target."""
        self._recent: collections.deque[float] = collections.deque(maxlen=self.MAX_ASSUMED)
        self.assumed_total = 0.0
        """Assumed peer decisions over every decision (a metric: how much of the routing is guessed)."""

    MAX_HOLD_S = 0.02
    """The longest a staggered decision waits."""

    def _within_window(self, now: float) -> bool:
        """Whether this replica made a decision within the window before ``now``."""
        return bool(self._recent) and now - self._recent[-1] <= self.window_s()

    def in_burst(self, now: float | None = None) -> bool:
        """Whether the next decision here is likely part of a burst: another one was made within the
        window, or (at a first one) most of this replica's recent decisions came in bursts."""
        return self._within_window(self.clock() if now is None else now) or self.burst_share >= 0.5

    def note_hold(self, seconds: float) -> None:
        """Count a decision held for ``seconds`` (the metric's two figures)."""
        self.held += 1
        self.held_s += seconds

    def hold_s(self, now: float | None = None) -> float:
        """How long to hold a decision so that the replicas ranked before this one are seen deciding
        first (``stagger_bursts``): rank x (publish interval + lag) in a burst, else 0."""
        if not self.stagger:
            return 0.0
        rank, n = self.ranks()
        if n <= 1 or rank == 0 or not self.in_burst(now):
            return 0.0
        return min(rank * self.window_s(), self.MAX_HOLD_S)

    def assumed(self, now: float | None = None) -> float:
        """How many peer decisions to assume made before the one this replica is about to make."""
        if self.stagger:
            return 0.0  # (staggered: the replicas before this one are seen, the ones after see it)
        rank, n = self.ranks()
        if n <= 1:
            return 0.0
        now = self.clock() if now is None else now
        window = self.window_s()
        recent = self._recent
        while recent and now - recent[0] > window:
            recent.popleft()
        k = len(recent)
        if k:
            return float(min(k * (n - 1) + rank, self.MAX_ASSUMED))
        return min(rank * self.burst_share, float(self.MAX_ASSUMED))

    def decided(self, uncached_blocks: float, now: float | None = None) -> None:
        """Note a decision made here (not a dry run) and the uncached blocks it left to its target."""
        now = self.clock() if now is None else now
        burst = 1.0 if self._within_window(now) else 0.0
        a = self.burst_alpha
        self.burst_share += a * (burst - self.burst_share)
        self.request_blocks += a * (uncached_blocks - self.request_blocks)
        self._recent.append(now)

    def spread_args(self, policy: Policy, count: float, candidates: int) -> tuple[float, float] | None:
        """What :meth:`router.decision.policy.Policy.decide` places for ``count`` assumed requests
        over that many candidates: (count, blocks each), or None for none; counted as assumed."""
        if count <= 0 or candidates < 2:
            return None
        self.assumed_total += count
        return count, self.request_blocks + policy.config.decode_weight

    def spread(self, policy: Policy, candidates: Sequence[Candidate], block_size: int, count: float) -> None:
        """Place ``count`` assumed requests, one at a time, on the least loaded candidates (by the
        policy's load terms, these requests' own included) and set each candidate's
        ``assumed_blocks``. Whole requests first, a fractional one last."""
        if count <= 0 or len(candidates) < 2:
            return
        self.assumed_total += count
        per = self.request_blocks + policy.config.decode_weight
        terms = [policy.load_terms(c, block_size) for c in candidates]
        left = count
        while left > 1e-9:
            w = min(left, 1.0)
            i = min(range(len(candidates)), key=terms.__getitem__)
            terms[i] += per * w
            candidates[i].assumed_blocks += per * w
            left -= w


def replica_ranks(own: str, others: Callable[[], Sequence[str]]) -> Callable[[], tuple[int, int]]:
    """``ranks`` for :class:`UnseenPeers` from this process's key and the live peers' keys (a
    process's key is its worker group, or its replica id when it runs one worker)."""

    def ranks() -> tuple[int, int]:
        keys = set(others())
        keys.add(own)
        ordered = sorted(keys)
        return ordered.index(own), len(ordered)

    return ranks


__all__ = ["UnseenPeers", "replica_ranks"]
