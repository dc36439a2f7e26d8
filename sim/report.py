"""The policy comparison table (plain text, aligned), a markdown variant, and a JSON dump.

One :class:`Row` per policy, whether it comes from the offline simulator (virtual seconds) or from a
live replay through the router (wall seconds), so both print the same table and a benchmark page can
quote either. Plain text because the demo runs in any terminal and CI log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from sim.driver import EngineCounters, RequestResult
from sim.offline import SimResult


class Row(msgspec.Struct, kw_only=True):
    """One policy's figures."""

    policy: str
    label: str = ""
    requests: int = 0
    errors: int = 0
    hit_ratio: float = 0.0
    """Cached / prompt tokens, as the engines report them."""
    bound: float | None = None
    """Infinite-cache hit ratio of the same workload, when known."""
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    ttft_p99: float = 0.0
    throughput_rps: float = 0.0
    output_tps: float = 0.0
    spread_tokens: float = 0.0
    """max / mean prompt tokens per engine (1.0 = perfectly even)."""
    spread_requests: float = 0.0
    """max / mean requests per engine."""
    per_engine_requests: list[int] = []
    extra: dict[str, Any] = {}

    @property
    def ratio_to_bound(self) -> float | None:
        """Hit ratio over the bound (None when the bound is unknown or zero)."""
        if not self.bound:
            return None
        return self.hit_ratio / self.bound


def from_sim(r: SimResult) -> Row:
    """A row from an offline simulation result."""
    return Row(
        policy=r.policy,
        label=r.label,
        requests=r.requests,
        hit_ratio=r.hit_ratio,
        bound=r.bound,
        ttft_p50=r.ttft_p50,
        ttft_p90=r.ttft_p90,
        ttft_p99=r.ttft_p99,
        throughput_rps=r.throughput_rps,
        output_tps=r.output_tps,
        spread_tokens=r.load_spread_tokens,
        spread_requests=r.load_spread_requests,
        per_engine_requests=list(r.per_engine_requests),
        extra={
            "decisions": r.decisions,
            "preemptions": r.preemptions,
            "evicted_blocks": r.evicted_blocks,
            "makespan_s": r.makespan_s,
            "trace_bound": r.trace_bound,
            "pooled_bound": r.pooled_bound,
            "wall_s": r.wall_s,
            "config": r.config,
        },
    )


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _spread(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def from_live(
    policy: str,
    results: Sequence[RequestResult],
    engines: Sequence[EngineCounters] = (),
    bound: float | None = None,
    label: str = "",
) -> Row:
    """A row from a live replay: hit ratio from the responses' usage, spread from engine counters."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    ends = [r.sent_s + r.e2e_s for r in ok if r.e2e_s is not None]
    span = (max(ends) - min(r.sent_s for r in ok)) if ends else 0.0
    per_req = [round(e.requests) for e in engines]
    per_tok = [e.prompt_tokens for e in engines]
    return Row(
        policy=policy,
        label=label or policy,
        requests=len(ok),
        errors=sum(1 for r in results if not r.ok and not r.skipped),
        hit_ratio=cached / prompt if prompt else 0.0,
        bound=bound,
        ttft_p50=_pct(ttft, 0.5),
        ttft_p90=_pct(ttft, 0.9),
        ttft_p99=_pct(ttft, 0.99),
        throughput_rps=len(ok) / span if span > 0 else 0.0,
        output_tps=sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0,
        spread_tokens=_spread(per_tok) if per_tok else 0.0,
        spread_requests=_spread([float(x) for x in per_req]) if per_req else 0.0,
        per_engine_requests=per_req,
        extra={
            "skipped": sum(1 for r in results if r.skipped),
            "engine_hit_ratio": (sum(e.hits for e in engines) / q)
            if (q := sum(e.queries for e in engines))
            else None,
        },
    )


def _fmt_time(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if v < 1.0:
        return f"{v * 1000:.0f} ms"
    return f"{v:.2f} s"


COLUMNS = (
    "policy",
    "hit ratio",
    "vs bound",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "req/s",
    "spread tok",
    "spread req",
)


SPREAD_NOTE = (
    "spread tok / req: the busiest engine's prompt tokens / requests over the mean per engine "
    "(1.00 = even; the fleet's size = all on one)"
)
"""The line under the table that says what its spread columns are."""


def _cells(row: Row) -> list[str]:
    r2b = row.ratio_to_bound
    name = row.label or row.policy
    if row.errors:
        name += f" ({row.errors} errors)"
    skipped = row.extra.get("skipped", 0) if isinstance(row.extra, dict) else 0
    if skipped:  # (past the run's deadline: its ratios are over fewer requests than the bound's)
        name += f" ({skipped} skipped at the deadline)"
    return [
        name,
        f"{row.hit_ratio:.3f}",
        f"{r2b * 100:.0f}%" if r2b is not None else "-",
        _fmt_time(row.ttft_p50),
        _fmt_time(row.ttft_p90),
        _fmt_time(row.ttft_p99),
        f"{row.throughput_rps:.2f}",
        f"{row.spread_tokens:.2f}",
        f"{row.spread_requests:.2f}",
    ]


def table(rows: Sequence[Row], title: str | None = None) -> str:
    """The comparison as aligned plain text (first column left-aligned, numbers right-aligned)."""
    body = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]

    def fmt(line: list[str]) -> str:
        parts = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(fmt(body[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(fmt(line) for line in body[1:])
    bound = next((r.bound for r in rows if r.bound), None)
    if bound:
        out.append(f"infinite-cache bound (one shared cache, same units): {bound:.3f}")
    out.append(SPREAD_NOTE)
    return "\n".join(out)


def markdown(rows: Sequence[Row], title: str | None = None) -> str:
    """The same table in GitHub markdown, for docs/benchmarks/."""
    lines = []
    if title:
        lines.append(f"**{title}**\n")
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|")
    for r in rows:
        lines.append("| " + " | ".join(_cells(r)) + " |")
    return "\n".join(lines)


def to_json(rows: Sequence[Row], meta: dict[str, Any] | None = None) -> bytes:
    """A JSON document ``{"meta": ..., "rows": [...]}`` (pretty-printed)."""
    doc = {
        "meta": meta or {},
        "rows": [msgspec.to_builtins(r) | {"ratio_to_bound": r.ratio_to_bound} for r in rows],
    }
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)
