"""Prefill/decode metrics: per leg (``leg="prefill"|"decode"``), skips and fallbacks.

Recorded by the P/D exchange around the proxy (never inside the policy), in the same lean counters
as the rest of the request path (:mod:`router.observe.metrics`), exported with the router's other
series and summed over worker processes like them. The skip ratio is
``sum(rate(kvrouter_pd_requests_total{mode="skipped"})) / sum(rate(kvrouter_pd_requests_total))``;
the dashboard shows it since start.
"""

from __future__ import annotations

from typing import Any

from router.decision.pd import SKIP_REASONS
from router.observe.metrics import LeanCounter, LeanHistogram

LEGS = ("prefill", "decode")
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STATUS_CLASS = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}

FALLBACK_REASONS = ("connect", "timeout", "protocol", "upstream_5xx", "status", "no_params")
"""Why a prefill leg fell back to the decode engine: unreachable, no answer within
``pd.prefill_timeout_s``, broke HTTP, answered 5xx, answered another non-200 status outside 400-451,
answered 200 without transfer parameters."""

NAMES = frozenset(
    {
        "kvrouter_pd_requests",
        "kvrouter_pd_skips",
        "kvrouter_pd_fallbacks",
        "kvrouter_pd_legs",
        "kvrouter_pd_leg_first_byte_seconds",
        "kvrouter_pd_prompt_tokens",
        "kvrouter_pd_matched_tokens",
    }
)
"""Family names (without ``_total``), summed over worker processes like the request-path series."""


def status_class(status: int) -> str:
    """``2xx`` etc.; ``error`` for a leg that got no status at all (0)."""
    if status <= 0:
        return "error"
    return _STATUS_CLASS.get(status // 100) or f"{status // 100}xx"


class PDMetrics:
    """The P/D series and the cumulative figures the dashboard shows."""

    def __init__(self) -> None:
        self.requests = LeanCounter(
            "kvrouter_pd_requests",
            "Requests for disaggregated models by mode (disaggregated: prefill leg then decode leg; "
            "skipped: the decode engine prefilled itself)",
            ["mode"],
        )
        self.skips = LeanCounter(
            "kvrouter_pd_skips",
            "Prefill legs skipped, by reason (cached, saturated, no_prefill, no_decode)",
            ["reason"],
        )
        self.fallbacks = LeanCounter(
            "kvrouter_pd_fallbacks",
            "Prefill legs that failed, so that the decode engine computed the prefill itself, by prefill "
            "backend and reason (connect, timeout, protocol, upstream_5xx, status, no_params)",
            ["backend", "reason"],
        )
        self.legs = LeanCounter(
            "kvrouter_pd_legs",
            "Legs of disaggregated requests by leg, backend and status class (error: no status)",
            ["leg", "backend", "status"],
        )
        self.first_byte = LeanHistogram(
            "kvrouter_pd_leg_first_byte_seconds",
            "Dispatch of a leg to its first response byte (a prefill leg's answer comes whole)",
            ["leg"],
            _BUCKETS,
        )
        self.prompt_tokens = LeanCounter(
            "kvrouter_pd_prompt_tokens", "Prompt tokens sent on each leg", ["leg"]
        )
        self.matched_tokens = LeanCounter(
            "kvrouter_pd_matched_tokens",
            "Of which cached on the leg's engine when routed (events only, not predictions): the hit "
            "ratio of each pool",
            ["leg"],
        )
        self.series: list[LeanCounter | LeanHistogram] = [
            self.requests,
            self.skips,
            self.fallbacks,
            self.legs,
            self.first_byte,
            self.prompt_tokens,
            self.matched_tokens,
        ]

    def decided(self, mode: str, skip: str | None) -> None:
        """One request of a disaggregated model is being sent."""
        self.requests.inc((mode,))
        if skip is not None:
            self.skips.inc((skip,))

    def tokens(self, leg: str, prompt: int, matched: int) -> None:
        """Prompt tokens of one leg and how many its engine caches."""
        self.prompt_tokens.inc((leg,), prompt)
        self.matched_tokens.inc((leg,), min(matched, prompt))

    def leg(self, leg: str, backend: str, status: int, first_byte_s: float | None) -> None:
        """One leg ended (status 0: it got no answer)."""
        self.legs.inc((leg, backend, status_class(status)))
        if first_byte_s is not None:
            self.first_byte.observe((leg,), first_byte_s)

    def fallback(self, backend: str, reason: str) -> None:
        """A prefill leg failed; the decode engine computes the prefill."""
        self.fallbacks.inc((backend, reason))

    def dashboard(self) -> dict[str, Any]:
        """Cumulative figures for ``/dashboard/data`` (``pd``)."""
        requests = {k[0]: v for k, v in self.requests.values.items()}
        legs: dict[str, dict[str, float]] = {leg: {} for leg in LEGS}
        by_backend: dict[str, dict[str, float]] = {}
        for (leg, backend, status), n in list(self.legs.values.items()):
            legs[leg][status] = legs[leg].get(status, 0.0) + n
            per = by_backend.setdefault(backend, {})
            per[leg] = per.get(leg, 0.0) + n
        first = {}
        for (leg,), s in list(self.first_byte.series.items()):
            count = sum(s[:-1])
            first[leg] = {"count": count, "sum_s": s[-1]}
        return {
            "requests": requests,
            "skips": {r: self.skips.values.get((r,), 0.0) for r in SKIP_REASONS},
            "fallbacks": sum(self.fallbacks.values.values()),
            "fallbacks_by_reason": {
                r: sum(v for (_, reason), v in self.fallbacks.values.items() if reason == r)
                for r in FALLBACK_REASONS
            },
            "legs": legs,
            "legs_by_backend": by_backend,
            "first_byte": first,
            "prompt_tokens": {leg: self.prompt_tokens.values.get((leg,), 0.0) for leg in LEGS},
            "matched_tokens": {leg: self.matched_tokens.values.get((leg,), 0.0) for leg in LEGS},
        }


def merge_dashboards(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the ``pd`` dashboard figures of several worker processes (every value is a count or a
    sum, nested at most two levels)."""

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a.get(k, 0.0), b.get(k, 0.0)) for k in a.keys() | b.keys()}
        if isinstance(a, dict):
            return a
        if isinstance(b, dict):
            return b
        return float(a or 0.0) + float(b or 0.0)

    out: dict[str, Any] = {}
    for p in parts:
        out = add(out, p) if out else dict(p)
    return out


__all__ = ["FALLBACK_REASONS", "LEGS", "NAMES", "PDMetrics", "merge_dashboards", "status_class"]
