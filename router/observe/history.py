"""The dashboard's recent history, kept by the router so that a page opened now shows it at once.

The page used to derive its "last minute" figures, its backends' shares and its charts from the
snapshots it had polled itself since it was opened: a fresh page showed a "last minute" hit ratio
over a few seconds of traffic and empty charts for minutes. The router instead samples the
cumulative counters the page reads (fleet totals, per backend, per DP rank, per event stream) every
``every_s`` and keeps the last ``keep_s`` of samples (bounded: ``keep_s / every_s`` samples, each
as large as the fleet), and computes the windows (last minute, since start) from them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvrouter.dashboard")

SOURCE_COUNTERS = ("gaps", "replays", "restarts", "decode_errors", "unknown_parents", "lost_batches")
"""The event-stream counters the page shows growth of."""


def sample_of(data: dict[str, Any]) -> dict[str, Any]:
    """The cumulative counters of one dashboard snapshot, in the page's own sample layout."""
    totals = data.get("totals", {})
    backends: dict[str, list[int]] = {}
    ranks: dict[str, int] = {}
    for b in data.get("backends", []):
        backends[b["name"]] = [b.get("requests", 0), b.get("prompt_tokens", 0), b.get("matched_tokens", 0)]
        for r in b.get("ranks", []):
            ranks[f"{b['name']}|{r['dp_rank']}"] = r.get("requests", 0)
    sources = {s["source"]: [s.get(k, 0) for k in SOURCE_COUNTERS] for s in data.get("sources", [])}
    return {
        "t": round(float(data.get("time", time.time())), 3),
        "uptime": data.get("uptime_s", 0.0),
        "requests": totals.get("requests", 0),
        "errors": totals.get("errors", 0),
        "prompt": totals.get("prompt_tokens", 0),
        "matched": totals.get("matched_tokens", 0),
        "backends": backends,
        "ranks": ranks,
        "sources": sources,
    }


def _window(now: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """What happened between sample ``then`` (None: the start, every counter at 0) and ``now``."""
    base = then or {"t": now["t"] - now["uptime"], "requests": 0, "errors": 0, "prompt": 0, "matched": 0}
    old = then["backends"] if then else {}
    prompt = now["prompt"] - base["prompt"]
    matched = now["matched"] - base["matched"]
    return {
        "seconds": round(now["t"] - base["t"], 1),
        "requests": now["requests"] - base["requests"],
        "errors": now["errors"] - base["errors"],
        "prompt_tokens": prompt,
        "matched_tokens": matched,
        "hit_ratio": matched / prompt if prompt > 0 else None,
        "backends": {
            name: {"requests": max(0, v[0] - old.get(name, (0,))[0])} for name, v in now["backends"].items()
        },
    }


class DashboardHistory:
    """A bounded ring of dashboard samples, one every ``every_s``, the last ``keep_s`` of them."""

    def __init__(self, every_s: float = 5.0, keep_s: float = 900.0) -> None:
        self.every_s = every_s
        self.keep_s = keep_s
        self.samples: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(2, int(keep_s / every_s) + 1)
        )

    def record(self, data: dict[str, Any]) -> None:
        """Keep the counters of ``data`` (a dashboard snapshot); a router restart cannot happen in
        one process, so counters only grow (merged workers' too: a dead worker's figures are kept)."""
        s = sample_of(data)
        if self.samples and s["t"] <= self.samples[-1]["t"]:
            return
        self.samples.append(s)

    def windows(self, data: dict[str, Any], minute_s: float = 60.0) -> dict[str, Any]:
        """The last minute and since start, ending at ``data`` (the snapshot being served). The
        minute starts at the oldest sample at most ``minute_s`` old (within one sampling period of
        a minute, said in ``seconds``); a router younger than that counts from its start."""
        now = sample_of(data)
        then = None
        if now["uptime"] > minute_s:
            then = next((s for s in self.samples if s["t"] >= now["t"] - minute_s - 0.5), None)
        return {"last_minute": _window(now, then), "since_start": _window(now, None)}

    def attach(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with ``history`` (the samples, oldest first) and ``windows`` added."""
        out = dict(data)
        out["windows"] = self.windows(data)
        out["history"] = {"every_s": self.every_s, "samples": list(self.samples)}
        return out


async def sample_forever(history: DashboardHistory, snapshot: Callable[[], dict[str, Any]]) -> None:
    """Record ``snapshot()`` every ``history.every_s`` until cancelled (a failed snapshot is skipped:
    the dashboard must not stop the router, and the next turn tries again)."""
    while True:
        try:
            history.record(snapshot())
        except Exception:
            log.exception("dashboard history sample failed; going on")
        await asyncio.sleep(history.every_s)
