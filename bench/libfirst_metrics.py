"""kvrouter's Prometheus text renderer and lean instruments against prometheus-client, side by side.

Why: a hand-written replacement of a maintained library stays only where it buys at least 1.5x on
a workload like production's. Two costs matter: a scrape (every 15 s or so) of a fleet's series,
and the request path's metric updates (about ten per proxied request).

- scrape: the families a router exports per backend (request, error, decision, token counters;
  upstream latency and TTFT histograms of 15 buckets; the per-target state gauges), for 64 and
  1,024 backends, built and rendered with ``router.observe.exposition`` and with prometheus-client's
  families and ``generate_latest``; the two texts are checked to be the same bytes. Milliseconds per
  scrape, median of ``--rounds``.
- hot path: the updates of one proxied request (what ``RouterMetrics.routed``, ``finished`` and
  ``observe_ttft`` do) with ``LeanCounter``/``LeanHistogram`` and with prometheus-client's
  ``Counter``/``Histogram`` ``.labels(...).inc/observe``, over 64 backends. Microseconds per request.

    flock HEAVY_LOCK .venv/bin/python bench/libfirst_metrics.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PCounter
from prometheus_client import Histogram as PHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from router.observe import exposition as ex
from router.observe.metrics import LeanCounter, LeanHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
GAUGES = ("kvrouter_blocks", "kvrouter_load_running", "kvrouter_load_waiting", "kvrouter_kv_usage")


def fleet(n: int) -> dict[str, Any]:
    """Per-backend series as a busy router holds them (counts that look like hours of traffic)."""
    names = [f"engine-{i:04d}" for i in range(n)]
    hist = {b: [float(3 + (i * 7 + k) % 50) for k in range(len(BUCKETS) + 1)] for i, b in enumerate(names)}
    return {
        "names": names,
        "requests": {(b, "llama", s): float(1000 + i) for i, b in enumerate(names) for s in ("2xx", "5xx")},
        "decisions": {
            (b, "0", o): float(500 + i) for i, b in enumerate(names) for o in ("prefix", "load", "fallback")
        },
        "tokens": {(b,): float(123456 + i) for i, b in enumerate(names)},
        "matched": {(b, m): float(65432 + i) for i, b in enumerate(names) for m in ("GPU", "PREDICTED")},
        "hist": hist,
        "gauges": {g: {(b, "0"): float(i % 97) for i, b in enumerate(names)} for g in GAUGES},
    }


def ours(f: dict[str, Any]) -> bytes:
    fams: list[ex.Family] = []
    for name, labels, key in (
        ("kvrouter_requests", ["backend", "model", "status"], "requests"),
        ("kvrouter_route_decisions", ["backend", "dp_rank", "outcome"], "decisions"),
        ("kvrouter_prompt_tokens", ["backend"], "tokens"),
        ("kvrouter_matched_tokens", ["backend", "medium"], "matched"),
    ):
        c = ex.CounterFamily(name, name.replace("_", " "), labels)
        for lv, v in f[key].items():
            c.add_metric(list(lv), v)
        fams.append(c)
    for name in ("kvrouter_upstream_latency_seconds", "kvrouter_ttft_seconds"):
        h = ex.HistogramFamily(name, name.replace("_", " "), ["backend"])
        for b, counts in f["hist"].items():
            h.add_counts([b], BUCKETS, counts, 12.5)
        fams.append(h)
    for g in GAUGES:
        gf = ex.GaugeFamily(g, g.replace("_", " "), ["backend", "dp_rank"])
        for lv, v in f["gauges"][g].items():
            gf.add_metric(list(lv), v)
        fams.append(gf)
    return ex.render(fams)


class _PC:
    def __init__(self, f: dict[str, Any]) -> None:
        self.f = f

    def collect(self) -> Iterable[Any]:
        f = self.f
        for name, labels, key in (
            ("kvrouter_requests", ["backend", "model", "status"], "requests"),
            ("kvrouter_route_decisions", ["backend", "dp_rank", "outcome"], "decisions"),
            ("kvrouter_prompt_tokens", ["backend"], "tokens"),
            ("kvrouter_matched_tokens", ["backend", "medium"], "matched"),
        ):
            c = CounterMetricFamily(name, name.replace("_", " "), labels=labels)
            for lv, v in f[key].items():
                c.add_metric(list(lv), v)
            yield c
        les = [ex.number(b) for b in (*BUCKETS, float("inf"))]
        for name in ("kvrouter_upstream_latency_seconds", "kvrouter_ttft_seconds"):
            h = HistogramMetricFamily(name, name.replace("_", " "), labels=["backend"])
            for b, counts in f["hist"].items():
                cum, total = [], 0.0
                for le, n in zip(les, counts, strict=True):
                    total += n
                    cum.append((le, total))
                h.add_metric([b], cum, 12.5)
            yield h
        for g in GAUGES:
            gf = GaugeMetricFamily(g, g.replace("_", " "), labels=["backend", "dp_rank"])
            for lv, v in f["gauges"][g].items():
                gf.add_metric(list(lv), v)
            yield gf


def pc(f: dict[str, Any]) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_PC(f))
    return generate_latest(reg)


def timed(fn: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def hot_path(rounds: int, n: int = 20_000) -> dict[str, list[float]]:
    """us per request of one request's metric updates, lean vs prometheus-client."""
    backends = [f"engine-{i:02d}" for i in range(64)]
    lean: dict[str, Any] = {
        "req": LeanCounter("r", "r", ["backend", "model", "status"]),
        "dec": LeanCounter("d", "d", ["backend", "dp_rank", "outcome"]),
        "tok": LeanCounter("t", "t", ["backend"]),
        "mat": LeanCounter("m", "m", ["backend", "medium"]),
        "dsec": LeanHistogram("ds", "ds", [], BUCKETS),
        "ratio": LeanHistogram("mr", "mr", [], BUCKETS),
        "up": LeanHistogram("u", "u", ["backend"], BUCKETS),
        "ttft": LeanHistogram("tt", "tt", ["backend"], BUCKETS),
    }
    reg = CollectorRegistry(auto_describe=False)
    p: dict[str, Any] = {
        "req": PCounter("r", "r", ["backend", "model", "status"], registry=reg),
        "dec": PCounter("d", "d", ["backend", "dp_rank", "outcome"], registry=reg),
        "tok": PCounter("t", "t", ["backend"], registry=reg),
        "mat": PCounter("m", "m", ["backend", "medium"], registry=reg),
        "dsec": PHistogram("ds", "ds", buckets=BUCKETS, registry=reg),
        "ratio": PHistogram("mr", "mr", buckets=BUCKETS, registry=reg),
        "up": PHistogram("u", "u", ["backend"], buckets=BUCKETS, registry=reg),
        "ttft": PHistogram("tt", "tt", ["backend"], buckets=BUCKETS, registry=reg),
    }

    def lean_req(i: int) -> None:
        b = backends[i & 63]
        lean["dsec"].observe((), 0.0003)
        lean["dec"].inc((b, "0", "prefix"))
        lean["tok"].inc((b,), 812)
        lean["mat"].inc((b, "GPU"), 512)
        lean["ratio"].observe((), 0.6)
        lean["ttft"].observe((b,), 0.045)
        lean["req"].inc((b, "llama", "2xx"))
        lean["up"].observe((b,), 0.38)

    def pc_req(i: int) -> None:
        b = backends[i & 63]
        p["dsec"].observe(0.0003)
        p["dec"].labels(b, "0", "prefix").inc()
        p["tok"].labels(b).inc(812)
        p["mat"].labels(b, "GPU").inc(512)
        p["ratio"].observe(0.6)
        p["ttft"].labels(b).observe(0.045)
        p["req"].labels(b, "llama", "2xx").inc()
        p["up"].labels(b).observe(0.38)

    out: dict[str, list[float]] = {"lean": [], "prometheus-client": []}
    for r in range(rounds):
        for name, fn in (("lean", lean_req), ("prometheus-client", pc_req))[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            out[name].append((time.perf_counter() - t0) / n * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fleets", default="64,1024")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
    }
    for n in (int(x) for x in args.fleets.split(",")):
        f = fleet(n)
        a, b = ours(f), pc(f)
        same = a == b
        reps = max(3, 2000 // n)
        rows: dict[str, list[float]] = {"kvrouter": [], "prometheus-client": []}
        for r in range(args.rounds):
            for name, fn in (("kvrouter", ours), ("prometheus-client", pc))[:: 1 if r % 2 == 0 else -1]:
                rows[name].append(timed(functools.partial(fn, f), reps) * 1e3)
        med = {k: round(statistics.median(v), 3) for k, v in rows.items()}
        result[f"scrape {n} backends"] = {
            "ms": med,
            "bytes": len(a),
            "same_text": same,
            "ratio": round(med["prometheus-client"] / med["kvrouter"], 2),
        }
    hp = hot_path(args.rounds)
    med = {k: round(statistics.median(v), 3) for k, v in hp.items()}
    result["hot path us per request"] = {**med, "ratio": round(med["prometheus-client"] / med["lean"], 2)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
