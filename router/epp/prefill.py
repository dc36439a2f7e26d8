"""When a request's prefill is over, for a picker that does not see the response's first byte.

The load the policy scores is, per target, the uncached prompt tokens dispatched there whose first
response byte has not come yet (router.fleet.load): what a new request waits behind. The proxy
reads the first byte off the stream. The picker behind Envoy with the response body mode ``NONE``
(deploy/gateway's configuration: no gRPC message per SSE chunk) sees only the response headers,
and a vLLM stream sends those when the engine takes the request, before its prefill: released
there, every target's pending prefill stays near zero and the policy balances on request counts
alone (measured: docs/benchmarks/epp.md).

So the picker estimates it. The responses whose body it does see (one in
``epp.response_body_every``, asked for with a ``mode_override``; every one in the streamed modes)
give the real time from the decision to the first SSE byte, and the prefill work the target had at
that decision (its pending tokens, this request's included); per target, the ratio of their moving
averages is the target's prefill rate. A response seen without its body releases its prefill
``work / rate`` seconds after its decision (at once when that has passed, and at the latest at the
response's end); a target with no measured response yet is released at the headers, as before.
"""

from __future__ import annotations

from router.fleet.load import Target

_ALPHA = 0.1
"""Weight of a new measurement in the moving averages (~10 responses' memory)."""
_MAX_TARGETS = 4096
"""Targets remembered at most (the oldest forgotten first): a bound under membership churn."""


class PrefillClock:
    """Per target: moving averages of (prefill work at the decision, seconds to the first byte)."""

    def __init__(self) -> None:
        self._seen: dict[Target, list[float]] = {}

    def learn(self, target: Target, work_tokens: int, seconds: float) -> None:
        """A response whose first byte came ``seconds`` after the decision that found
        ``work_tokens`` pending at ``target`` (its own included)."""
        if work_tokens <= 0 or seconds <= 0:
            return  # (nothing to compute: says nothing about the rate)
        avg = self._seen.get(target)
        if avg is None:
            if len(self._seen) >= _MAX_TARGETS:
                del self._seen[next(iter(self._seen))]
            self._seen[target] = [float(work_tokens), seconds]
            return
        avg[0] += _ALPHA * (work_tokens - avg[0])
        avg[1] += _ALPHA * (seconds - avg[1])

    def seconds(self, target: Target, work_tokens: int) -> float | None:
        """Estimated seconds from the decision to the end of a prefill that found ``work_tokens``
        pending at ``target``; None before any measurement there."""
        avg = self._seen.get(target)
        if avg is None:
            return None
        return work_tokens * avg[1] / avg[0]
