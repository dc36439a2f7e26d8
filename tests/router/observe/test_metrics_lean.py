"""The lean request-path metrics and kvrouter's own exposition (router/observe/exposition.py) give
exactly the text prometheus-client renders for its own objects (it is a test dependency only)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from router.observe.exposition import render
from router.observe.metrics import LeanCounter, LeanHistogram

BUCKETS = (25e-6, 1e-3, 0.005, 0.1, 1, 2.5, 300)


def _text(lean: LeanCounter | LeanHistogram) -> bytes:
    return render([lean.family()])


def test_histogram_matches_prometheus_client() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]
    rng = random.Random(7)
    reg = CollectorRegistry()
    ref = Histogram("t_seconds", "doc", ["backend"], buckets=BUCKETS, registry=reg)
    lean = LeanHistogram("t_seconds", "doc", ["backend"], BUCKETS)
    # values on the bounds exercise the `le` (<=) edge; values above the last bound land in +Inf
    values = [*BUCKETS, 0.0, 1e9, *(rng.expovariate(3.0) for _ in range(500))]
    for i, v in enumerate(values):
        name = "ab"[i % 2]
        ref.labels(name).observe(v)
        lean.observe((name,), v)
    assert _text(lean) == generate_latest(reg)


def test_unlabelled_histogram_is_exported_before_any_observation() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]
    reg = CollectorRegistry()
    Histogram("u_ratio", "doc", buckets=(0.0, 0.5, 1.0), registry=reg)
    lean = LeanHistogram("u_ratio", "doc", [], (0.0, 0.5, 1.0))
    assert _text(lean) == generate_latest(reg)
    lean.observe((), 0.5)
    assert b'u_ratio_bucket{le="0.5"} 1.0' in _text(lean)
    assert b'u_ratio_bucket{le="0.0"} 0.0' in _text(lean)


def test_counter_matches_prometheus_client() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]
    reg = CollectorRegistry()
    ref = Counter("t_requests", "doc", ["backend", "status"], registry=reg)
    lean = LeanCounter("t_requests", "doc", ["backend", "status"])
    for backend, status, n in [("a", "2xx", 1), ("b", "5xx", 3), ("a", "2xx", 2.5), ("c", "4xx", 0)]:
        ref.labels(backend, status).inc(n)
        lean.inc((backend, status), n)
    assert _text(lean) == generate_latest(reg)
