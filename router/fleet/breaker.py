"""Passive outlier ejection (a circuit breaker per backend) and a retry budget.

Health probes say whether a backend answers ``/health``; they do not see a backend that answers its
probe but fails requests (5xx, resets, timeouts). The breaker watches the requests themselves:

- **closed**: requests flow; ``eject_after`` consecutive failures open it;
- **open** (ejected): no request is sent there for a cooldown (``eject_s``, doubled at every
  ejection in a row up to ``max_eject_s``); the backend's index and membership are kept;
- **half-open**: after the cooldown the backend is a candidate again, on trial: the first request
  that succeeds closes the breaker (and resets the cooldown), the first that fails opens it again at
  once, with a doubled cooldown. (Requests are not held back to one at a time on trial: in the
  milliseconds a trial takes, the policy's load terms already spread the others.)

When every candidate of a request is ejected, they are used anyway (the "panic" rule of Envoy's
outlier detection): a fleet that is failing as a whole is probed by the traffic, not refused.

A failure is anything that kept the backend from answering: no connection, a broken response before
its first byte, a timeout, a 5xx status. A 4xx is the client's problem and counts as a success.

The retry budget keeps a failing fleet from being hit by a retry storm: the proxy retries (on the
next-best candidate, only while nothing has been sent to the client) only when the budget allows it:
a token bucket filled by ``retry_ratio`` of a token per request plus ``retry_min_per_s`` tokens per
second, capped, and emptied by one token per retry. Counted when a retry is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec


class BreakerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[health.breaker]``: passive ejection of backends that fail requests."""

    eject_after: int = 3
    """Consecutive failed requests that eject a backend; 0 turns ejection off."""
    eject_s: float = 5.0
    """First cooldown of an ejected backend (doubled per ejection in a row)."""
    max_eject_s: float = 60.0
    """Longest cooldown."""
    retry_ratio: float = 0.2
    """Retries allowed per request, on average (the budget's refill per request)."""
    retry_min_per_s: float = 5.0
    """Retries allowed per second whatever the traffic (so a quiet router can still fail over)."""


class _State:
    __slots__ = ("ejections", "failures", "open_until")

    def __init__(self) -> None:
        self.failures = 0
        self.ejections = 0
        self.open_until = 0.0


class Breakers:
    """One breaker per backend name, plus the retry budget (all on the event loop: no locks)."""

    def __init__(
        self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or BreakerConfig()
        self.clock = clock
        self._states: dict[str, _State] = {}
        self.ejected_total: dict[str, int] = {}
        """backend -> ejections, for kvrouter_backend_ejections_total."""
        cfg = self.config
        self._cap = max(cfg.retry_min_per_s, 1.0) * 10
        self._tokens = self._cap
        self._refilled = clock()
        self.retries_allowed = 0
        self.retries_refused = 0

    # --- the breaker -----------------------------------------------------------------------------
    def available(self, name: str) -> bool:
        """May a new request go to this backend now (closed, or open past its cooldown: on trial)."""
        st = self._states.get(name)
        return st is None or st.open_until == 0.0 or self.clock() >= st.open_until

    def blocked(self) -> frozenset[str]:
        """The backends not :meth:`available` now (open, within their cooldown): O(breakers that
        ever opened), not O(fleet); what a cached candidate list is keyed by."""
        now = self.clock()
        return frozenset(n for n, st in self._states.items() if st.open_until and now < st.open_until)

    def any_open(self) -> bool:
        """Some breaker is open or half-open (else every backend is :meth:`available`)."""
        return any(st.open_until for st in self._states.values())

    def state(self, name: str) -> str:
        """closed | open | half_open, for /debug/index and the dashboard."""
        st = self._states.get(name)
        if st is None or st.open_until == 0.0:
            return "closed"
        return "half_open" if self.clock() >= st.open_until else "open"

    def success(self, name: str) -> None:
        """A request got an answer (any status below 500)."""
        st = self._states.get(name)
        if st is None:
            return
        if st.open_until or st.failures:
            st.failures = 0
            st.open_until = 0.0
            st.ejections = 0

    def failure(self, name: str) -> bool:
        """A request failed on this backend; True if that ejected it."""
        cfg = self.config
        if cfg.eject_after <= 0:
            return False
        st = self._states.get(name)
        if st is None:
            st = self._states[name] = _State()
        st.failures += 1
        on_trial = st.open_until and self.clock() >= st.open_until
        if on_trial or (not st.open_until and st.failures >= cfg.eject_after):
            st.ejections += 1
            # (the exponent capped: 2.0 ** 1024 overflows, after ~17 h of a backend failing every
            # trial at the default cap, and the raise left it half-open for good)
            cooldown = min(cfg.eject_s * 2.0 ** min(st.ejections - 1, 60), cfg.max_eject_s)
            st.open_until = self.clock() + cooldown
            self.ejected_total[name] = self.ejected_total.get(name, 0) + 1
            return True
        return False

    def forget(self, name: str) -> None:
        """The backend left the fleet."""
        self._states.pop(name, None)

    # --- the retry budget ------------------------------------------------------------------------
    def request(self) -> None:
        """A request arrived: it earns the budget ``retry_ratio`` of a retry."""
        self._tokens = min(self._tokens + self.config.retry_ratio, self._cap)

    def allow_retry(self) -> bool:
        """Take one retry from the budget, if there is one."""
        now = self.clock()
        self._tokens = min(self._tokens + (now - self._refilled) * self.config.retry_min_per_s, self._cap)
        self._refilled = now
        if self._tokens >= 1.0 - 1e-9:  # (sums of 0.1 fall a hair short of whole numbers)
            self._tokens -= 1.0
            self.retries_allowed += 1
            return True
        self.retries_refused += 1
        return False


__all__ = ["BreakerConfig", "Breakers"]
