"""Prometheus metrics and the plain counters behind the dashboard.

Metrics are added around the core, not threaded through it: request metrics are recorded by the
proxy, and the index and event-stream figures are read from `KVIndex.status()` at scrape time by a
custom collector, so the ingest path pays for nothing but one histogram observation (event lag).
Each app gets its own ``CollectorRegistry`` (no globals), and every label is bounded: backend,
DP rank, model, medium, source, status class, outcome; never a per-request value.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from index.kvindex import PREDICTED, KVIndex
from router.backends import BackendRegistry
from router.load import LoadTracker

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class BackendCounters:
    """Cumulative per-backend figures for the dashboard (the page derives rates itself)."""

    __slots__ = ("errors", "matched_tokens", "prompt_tokens", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.matched_tokens = 0


class RouterMetrics:
    """Request-path metrics (recorded by the proxy) plus a collector for index/stream state."""

    def __init__(self, index: KVIndex, registry: BackendRegistry, loads: LoadTracker) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide; *_created add nothing
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvrouter_requests",
            "Requests by backend, model and status",
            ["backend", "model", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvrouter_request_errors", "Failed requests by backend and kind", ["backend", "kind"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvrouter_route_decision_seconds",
            "Route decision latency: tokenize + keys + lookup + policy",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvrouter_route_decisions",
            "Routing decisions by target and outcome (prefix|load|fallback)",
            ["backend", "dp_rank", "outcome"],
            registry=r,
        )
        self.matched_ratio = Histogram(
            "kvrouter_matched_prefix_ratio",
            "Share of the prompt's blocks cached on the chosen target",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvrouter_prompt_tokens", "Prompt tokens routed, by backend", ["backend"], registry=r
        )
        self.matched_tokens = Counter(
            "kvrouter_matched_tokens",
            "Prompt tokens cached on the chosen target when routed, by backend and medium "
            "(medium PREDICTED: predicted-on-route, not yet confirmed by events; not in hit ratios)",
            ["backend", "medium"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "kvrouter_upstream_latency_seconds",
            "Dispatch to the end of the backend's response",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvrouter_ttft_seconds",
            "Dispatch to the first response byte from the backend",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.event_lag = Histogram(
            "kvrouter_kv_event_lag_seconds",
            "From a KV event batch's timestamp to its application in the index",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        index.ingestor.lag_observer = self.event_lag.observe
        r.register(_StateCollector(index, registry, loads))
        self.per_backend: dict[str, BackendCounters] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.total_requests = 0
        self.total_errors = 0
        self.started = time.time()

    def backend(self, name: str) -> BackendCounters:
        """Cumulative counters of one backend."""
        c = self.per_backend.get(name)
        if c is None:
            c = self.per_backend[name] = BackendCounters()
        return c

    def routed(
        self,
        backend: str,
        dp_rank: int,
        outcome: str,
        prompt_tokens: int,
        matched: dict[str, int],
        block_size: int,
        prompt_blocks: int,
        decision_s: float,
    ) -> None:
        """Record a decision that is being sent upstream."""
        self.decision_seconds.observe(decision_s)
        self._child(self.decisions, backend, str(dp_rank), outcome).inc()
        self._child(self.prompt_tokens, backend).inc(prompt_tokens)
        matched_blocks = 0
        for medium, blocks in matched.items():
            if blocks:
                self._child(self.matched_tokens, backend, medium).inc(blocks * block_size)
                if medium != PREDICTED:  # a guess, not a cache hit: visible by its label only
                    matched_blocks += blocks
        if prompt_blocks:
            self.matched_ratio.observe(min(matched_blocks / prompt_blocks, 1.0))
        c = self.backend(backend)
        c.prompt_tokens += prompt_tokens
        c.matched_tokens += min(matched_blocks * block_size, prompt_tokens)

    def finished(self, backend: str, model: str, status: int, latency_s: float) -> None:
        """Record a completed (or failed) upstream exchange."""
        self._child(self.requests, backend, model, f"{status // 100}xx").inc()
        self._child(self.upstream_latency, backend).observe(latency_s)
        c = self.backend(backend)
        c.requests += 1
        self.total_requests += 1
        if status >= 500:
            c.errors += 1
            self.total_errors += 1

    def error(self, backend: str, kind: str) -> None:
        """Record a failure that produced no upstream status (connect error, timeout, cancel)."""
        self._child(self.errors, backend, kind).inc()

    def observe_ttft(self, backend: str, seconds: float) -> None:
        """Dispatch to the first response byte."""
        self._child(self.ttft, backend).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: prometheus-client's labels() costs microseconds per call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Index, event-stream, health and in-flight figures, read at scrape time."""

    def __init__(self, index: KVIndex, registry: BackendRegistry, loads: LoadTracker) -> None:
        self.index = index
        self.backends = registry
        self.loads = loads

    def collect(self) -> Iterable[Metric]:
        status = self.index.status()
        blocks = GaugeMetricFamily(
            "kvrouter_index_blocks", "Indexed blocks per source and medium", labels=["source", "medium"]
        )
        connected = GaugeMetricFamily(
            "kvrouter_kv_source_connected", "Event stream connected (1) or not", labels=["source"]
        )
        age = GaugeMetricFamily(
            "kvrouter_kv_last_event_age_seconds",
            "Seconds since the source's last applied batch",
            labels=["source"],
        )
        counters: dict[str, tuple[str, str]] = {
            "batches": ("kvrouter_kv_batches", "Event batches applied"),
            "decode_errors": ("kvrouter_kv_decode_errors", "Malformed messages skipped"),
            "gaps": ("kvrouter_kv_gaps", "Sequence gaps detected"),
            "replays": ("kvrouter_kv_replays", "Replay requests sent"),
            "restarts": ("kvrouter_kv_restarts", "Engine restarts detected (seq went back)"),
            "unknown_parents": (
                "kvrouter_kv_unknown_parents",
                "BlockStored events whose parent was never seen",
            ),
            "lost_batches": (
                "kvrouter_kv_lost_batches",
                "Batches that neither arrived nor could be replayed",
            ),
        }
        families = {k: CounterMetricFamily(n, h, labels=["source"]) for k, (n, h) in counters.items()}
        events = CounterMetricFamily(
            "kvrouter_kv_events", "Events applied by type", labels=["source", "type"]
        )
        stats = self.index.ingestor.stats
        for s in status:
            for medium, n in s.blocks.items():
                blocks.add_metric([s.source, medium], n)
            connected.add_metric([s.source], 1.0 if s.connected else 0.0)
            if s.last_event_age_s is not None:
                age.add_metric([s.source], s.last_event_age_s)
            for key, fam in families.items():
                fam.add_metric([s.source], getattr(s, key))
        for sidx, st in list(stats.items()):
            name = self.index.ingestor.source_name(sidx)
            events.add_metric([name, "BlockStored"], st.stored_events)
            events.add_metric([name, "BlockRemoved"], st.removed_events)
            events.add_metric([name, "AllBlocksCleared"], st.cleared)
        yield blocks
        yield connected
        yield age
        yield from families.values()
        yield events
        evictions = CounterMetricFamily("kvrouter_index_evictions", "Residencies evicted by the memory cap")
        evictions.add_metric([], self.index.evictions)
        yield evictions
        inflight = GaugeMetricFamily(
            "kvrouter_inflight_requests", "Requests in flight", labels=["backend", "dp_rank"]
        )
        for (backend, rank), load in self.loads.all().items():
            inflight.add_metric([backend, str(rank)], load.active)
        yield inflight
        healthy = GaugeMetricFamily(
            "kvrouter_backend_healthy", "Backend passes health checks (1) or not", labels=["backend"]
        )
        for b in self.backends.backends.values():
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
        yield healthy

    def describe(self) -> Iterable[Metric]:
        return []


def dashboard_data(
    metrics: RouterMetrics,
    index: KVIndex,
    registry: BackendRegistry,
    loads: LoadTracker,
    policy: str,
    recent: Iterable[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON the built-in dashboard polls (cumulative counters; the page derives rates)."""
    backends = []
    total_prompt = total_matched = 0
    all_loads = loads.all()
    for b in registry.backends.values():
        c = metrics.backend(b.name)
        total_prompt += c.prompt_tokens
        total_matched += c.matched_tokens
        ranks = []
        for r in range(b.cfg.dp_size):
            ld = all_loads.get((b.name, r))
            ranks.append(
                {"dp_rank": r, "inflight": ld.active if ld else 0, "requests": ld.total if ld else 0}
            )
        backends.append(
            {
                "name": b.name,
                "url": b.url,
                "healthy": b.healthy,
                "models": sorted(b.models),
                "requests": c.requests,
                "errors": c.errors,
                "inflight": sum(x["inflight"] for x in ranks),
                "prompt_tokens": c.prompt_tokens,
                "matched_tokens": c.matched_tokens,
                "ranks": ranks,
            }
        )
    sources = []
    for s in index.status():
        sources.append(
            {
                "source": s.source,
                "backend": s.instance,
                "dp_rank": s.dp_rank,
                "connected": s.connected,
                "last_seq": s.last_seq,
                "last_event_age_s": s.last_event_age_s,
                "batches": s.batches,
                "gaps": s.gaps,
                "replays": s.replays,
                "restarts": s.restarts,
                "decode_errors": s.decode_errors,
                "unknown_parents": s.unknown_parents,
                "lost_batches": s.lost_batches,
                "blocks": s.blocks,
            }
        )
    now = time.time()
    return {
        "time": now,
        "policy": policy,
        "uptime_s": round(now - metrics.started, 1),
        "totals": {
            "requests": metrics.total_requests,
            "errors": metrics.total_errors,
            "prompt_tokens": total_prompt,
            "matched_tokens": total_matched,
        },
        "backends": backends,
        "sources": sources,
        "recent_decisions": list(recent),
    }
