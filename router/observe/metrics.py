"""Prometheus metrics and the plain counters behind the dashboard.

Metrics are added around the core, not threaded through it: request metrics are recorded by the
proxy, and the index and event-stream figures are read from `KVIndex.status()` at scrape time by a
custom collector, so the ingest path pays for nothing but one histogram observation (event lag).
Each app gets its own :class:`router.observe.exposition.Registry` (no globals), and every label is
bounded: backend, DP rank, model, medium, source, status class, outcome; never a per-request value.

The request-path series are plain Python counters and bucket lists (:class:`LeanCounter`,
:class:`LeanHistogram`) exported at scrape time, not prometheus-client objects: its children take a
lock and walk several layers per update, and the seven updates a proxied request made cost ~20 us of
CPU per request in the live router, a tenth of the router's whole cost. Each is
written by one thread only (the event loop's; the event-lag histogram: the ingest thread's), and a
scrape copies a series in one C call.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from index.kvindex import PREDICTED, KVIndex
from router.decision.segments import SegmentCache
from router.fleet.load import LoadTracker
from router.fleet.membership import Membership
from router.observe.checks import ERROR_BUCKETS
from router.observe.exposition import (
    Collector,
    CounterFamily,
    Family,
    GaugeFamily,
    HistogramFamily,
    Registry,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_STATUS_CLASS = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


MAX_OBJECTIVES = 32
"""Distinct objective names with their own label on kvrouter_decisions_by_objective_total."""


class LeanCounter:
    """A labelled counter as a dict of floats (label values -> total), exported at scrape time."""

    __slots__ = ("doc", "labelnames", "name", "values")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = list(labelnames)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        """Add ``amount`` to the series of ``labels`` (one value per label name, in order)."""
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> CounterFamily:
        """The Prometheus family of every series so far."""
        fam = CounterFamily(self.name, self.doc, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            fam.add_metric(list(labels), value)
        return fam


class LeanHistogram:
    """A labelled histogram as per-series bucket counts (``le`` semantics) and sums.

    An unlabelled histogram is exported from the start, all zero, as prometheus-client does.
    """

    __slots__ = ("bounds", "doc", "labelnames", "name", "series")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = list(labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        # label values -> [count per bucket..., count above the last bound, sum]
        self.series: dict[tuple[str, ...], list[float]] = {}
        if not self.labelnames:
            self.series[()] = [0.0] * (len(self.bounds) + 2)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        """Count ``value`` in the first bucket whose bound is >= it."""
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        s[bisect.bisect_left(self.bounds, value)] += 1
        s[-1] += value

    def family(self) -> HistogramFamily:
        """The Prometheus family: cumulative buckets, ``+Inf``, sum and count."""
        fam = HistogramFamily(self.name, self.doc, labels=self.labelnames)
        for labels, s in list(self.series.items()):
            counts = list(s)  # (one copy: a writer on another thread may go on meanwhile)
            fam.add_counts(labels, self.bounds, counts[:-1], counts[-1])
        return fam


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

    def __init__(
        self,
        index: KVIndex,
        membership: Membership,
        loads: LoadTracker,
        segment_caches: Sequence[SegmentCache] = (),
    ) -> None:
        self.registry = Registry()
        r = self.registry
        self.requests = LeanCounter(
            "kvrouter_requests", "Requests by backend, model and status", ["backend", "model", "status"]
        )
        self.errors = LeanCounter(
            "kvrouter_request_errors", "Failed requests by backend and kind", ["backend", "kind"]
        )
        self.decision_seconds = LeanHistogram(
            "kvrouter_route_decision_seconds",
            "Route decision latency: tokenize + keys + lookup + policy",
            [],
            _DECISION_BUCKETS,
        )
        self.decisions = LeanCounter(
            "kvrouter_route_decisions",
            "Routing decisions by target and outcome (prefix|load|fallback)",
            ["backend", "dp_rank", "outcome"],
        )
        self.matched_ratio = LeanHistogram(
            "kvrouter_matched_prefix_ratio",
            "Share of the prompt's blocks cached on the chosen target",
            [],
            _RATIO_BUCKETS,
        )
        self.prompt_tokens = LeanCounter(
            "kvrouter_prompt_tokens", "Prompt tokens routed, by backend", ["backend"]
        )
        self.matched_tokens = LeanCounter(
            "kvrouter_matched_tokens",
            "Prompt tokens cached on the chosen target when routed, by backend and medium "
            "(medium PREDICTED: predicted-on-route, not yet confirmed by events; not in hit ratios)",
            ["backend", "medium"],
        )
        self.upstream_latency = LeanHistogram(
            "kvrouter_upstream_latency_seconds",
            "Dispatch to the end of the backend's response",
            ["backend"],
            _LATENCY_BUCKETS,
        )
        self.ttft = LeanHistogram(
            "kvrouter_ttft_seconds",
            "Dispatch to the first response byte from the backend",
            ["backend"],
            _LATENCY_BUCKETS,
        )
        self.report_mode_removed = LeanCounter(
            "kvrouter_kv_report_mode_removed",
            "Requests whose vllm_xargs.kv_cache_report_mode was removed before proxying "
            "(server.forward_kv_report_mode)",
            [],
        )
        self.client_fields_removed = LeanCounter(
            "kvrouter_client_fields_removed",
            "Request body fields only the router sets for the engines, removed from a client's "
            "request before proxying (trusted_api_keys exempts a key)",
            ["field"],
        )
        self.objectives = LeanCounter(
            "kvrouter_decisions_by_objective",
            'Decisions by the request\'s x-gateway-inference-objective ("": none; the first '
            f'{MAX_OBJECTIVES} names seen keep their own label, later ones count as "other")',
            ["objective"],
        )
        self._objective_names: set[str] = set()
        self._lean: list[LeanCounter | LeanHistogram] = [
            self.objectives,
            self.report_mode_removed,
            self.client_fields_removed,
            self.requests,
            self.errors,
            self.decision_seconds,
            self.decisions,
            self.matched_ratio,
            self.prompt_tokens,
            self.matched_tokens,
            self.upstream_latency,
            self.ttft,
        ]
        # observed on the ingest thread only; a scrape copies its one series in one C call
        self.event_lag = LeanHistogram(
            "kvrouter_kv_event_lag_seconds",
            "From a KV event batch's timestamp to its application in the index",
            [],
            _LAG_BUCKETS,
        )
        index.ingestor.lag_observer = functools.partial(self.event_lag.observe, ())
        self._lean.append(self.event_lag)
        r.register(_LeanCollector(self._lean))
        r.register(_StateCollector(index, membership, loads))
        r.register(_TokenizerCollector(segment_caches))
        self.per_backend: dict[str, BackendCounters] = {}
        self.departed = BackendCounters()
        """What removed backends served (their own entries are dropped with them)."""
        self.total_requests = 0
        self.total_errors = 0
        self.started = time.time()

    def add_collector(self, collector: Collector) -> None:
        """Another part's figures, read at scrape time (membership sources, the cluster store, ...)."""
        self.registry.register(collector)

    def add_series(self, series: Sequence[LeanCounter | LeanHistogram]) -> None:
        """Export more request-path series with these (a feature's own, e.g. router/pd/metrics.py)."""
        self._lean.extend(series)

    def backend(self, name: str) -> BackendCounters:
        """Cumulative counters of one backend."""
        c = self.per_backend.get(name)
        if c is None:
            c = self.per_backend[name] = BackendCounters()
        return c

    def classed(self, objective: str | None) -> None:
        """Count a decision under its objective; the label's values are bounded
        (:data:`MAX_OBJECTIVES` names, then "other"): the header is the client's to set."""
        name = objective or ""
        names = self._objective_names
        if name not in names:
            if len(names) >= MAX_OBJECTIVES:
                name = "other"
            else:
                names.add(name)
        self.objectives.inc((name,))

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
        self.decision_seconds.observe((), decision_s)
        self.decisions.inc((backend, str(dp_rank), outcome))
        self.prompt_tokens.inc((backend,), prompt_tokens)
        matched_blocks = 0
        for medium, blocks in matched.items():
            if blocks:
                self.matched_tokens.inc((backend, medium), blocks * block_size)
                if medium != PREDICTED:  # a guess, not a cache hit: visible by its label only
                    matched_blocks += blocks
        if prompt_blocks:
            self.matched_ratio.observe((), min(matched_blocks / prompt_blocks, 1.0))
        c = self.backend(backend)
        c.prompt_tokens += prompt_tokens
        c.matched_tokens += min(matched_blocks * block_size, prompt_tokens)

    def finished(self, backend: str, model: str, status: int, latency_s: float) -> None:
        """Record a completed (or failed) upstream exchange."""
        self.requests.inc((backend, model, _STATUS_CLASS.get(status // 100) or f"{status // 100}xx"))
        self.upstream_latency.observe((backend,), latency_s)
        c = self.backend(backend)
        c.requests += 1
        self.total_requests += 1
        if status >= 500:
            c.errors += 1
            self.total_errors += 1

    def forget_backend(self, name: str) -> None:
        """Drop a removed backend's series: with pod churn (new names at every rollout) they would
        grow /metrics and memory without bound. (Prometheus sees the series end; rates stop.)"""
        self.forget_backends({name})

    def forget_backends(self, names: set[str]) -> None:
        """:meth:`forget_backend` of several, in one pass over each series."""
        for name in names:
            gone = self.per_backend.pop(name, None)
            if gone is not None:  # (the dashboard's totals since start keep what it served)
                d = self.departed
                d.requests += gone.requests
                d.errors += gone.errors
                d.prompt_tokens += gone.prompt_tokens
                d.matched_tokens += gone.matched_tokens
        for series in self._lean:
            if "backend" not in series.labelnames:
                continue
            at = series.labelnames.index("backend")
            values = series.values if isinstance(series, LeanCounter) else series.series
            for labels in [k for k in values if k[at] in names]:
                del values[labels]

    def error(self, backend: str, kind: str) -> None:
        """Record a failure that produced no upstream status (connect error, timeout, cancel)."""
        self.errors.inc((backend, kind))

    def observe_ttft(self, backend: str, seconds: float) -> None:
        """Dispatch to the first response byte."""
        self.ttft.observe((backend,), seconds)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return self.registry.render()


class _LeanCollector:
    """Exports the request-path series kept by :class:`LeanCounter` / :class:`LeanHistogram`."""

    def __init__(self, series: list[LeanCounter | LeanHistogram]) -> None:
        self.series = series

    def collect(self) -> Iterable[Family]:
        for s in self.series:
            yield s.family()


class _StateCollector:
    """Index, event-stream, health and in-flight figures, read at scrape time."""

    def __init__(self, index: KVIndex, membership: Membership, loads: LoadTracker) -> None:
        self.index = index
        self.membership = membership
        self.loads = loads

    def collect(self) -> Iterable[Family]:
        status = self.index.status()
        blocks = GaugeFamily(
            "kvrouter_index_blocks", "Indexed blocks per source and medium", labels=["source", "medium"]
        )
        connected = GaugeFamily(
            "kvrouter_kv_source_connected", "Event stream connected (1) or not", labels=["source"]
        )
        age = GaugeFamily(
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
        families = {k: CounterFamily(n, h, labels=["source"]) for k, (n, h) in counters.items()}
        events = CounterFamily("kvrouter_kv_events", "Events applied by type", labels=["source", "type"])
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
        evictions = CounterFamily("kvrouter_index_evictions", "Residencies evicted by the memory cap")
        evictions.add_metric([], self.index.evictions)
        yield evictions
        res = self.index.resources()
        for name, doc, key in (
            ("kvrouter_event_sockets", "ZeroMQ sockets the event streams hold", "sockets"),
            (
                "kvrouter_event_socket_limit",
                "The event streams' ZeroMQ socket cap (ZMQ_MAX_SOCKETS)",
                "socket_limit",
            ),
            (
                "kvrouter_event_sources_failing",
                "Event sources whose sockets could not be opened (retried)",
                "sources_failing",
            ),
        ):
            value = res.get(key)
            if value is not None:
                gauge = GaugeFamily(name, doc)
                gauge.add_metric([], value)
                yield gauge
        open_errors = CounterFamily(
            "kvrouter_event_source_open_errors", "Failed tries to open an event source's sockets"
        )
        open_errors.add_metric([], res.get("open_errors") or 0)
        yield open_errors
        inflight = GaugeFamily(
            "kvrouter_inflight_requests", "Requests in flight", labels=["backend", "dp_rank"]
        )
        for (backend, rank), load in self.loads.all().items():
            inflight.add_metric([backend, str(rank)], load.active)
        yield inflight
        healthy = GaugeFamily(
            "kvrouter_backend_healthy", "Backend passes health checks (1) or not", labels=["backend"]
        )
        members = list(self.membership.members.values())
        for b in members:
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
        yield healthy
        states = GaugeFamily("kvrouter_backends", "Backends by membership state", labels=["state"])
        for state, n in self.membership.counts().items():
            states.add_metric([state], n)
        yield states
        changes = CounterFamily(
            "kvrouter_membership_changes",
            "Membership changes (joined, ready, draining, drained, removed, replaced, updated, readmitted)"
            " by origin (config, admin, kubernetes)",
            labels=["change", "origin"],
        )
        for (change, origin), n in sorted(self.membership.changes.items()):
            changes.add_metric([change, origin], n)
        yield changes


class BreakerCollector:
    """Passive ejections and the retry budget (router.fleet.breaker), read at scrape time."""

    def __init__(self, breakers: Any, membership: Membership) -> None:
        self.breakers = breakers
        self.membership = membership

    def collect(self) -> Iterable[Family]:
        ejections = CounterFamily(
            "kvrouter_backend_ejections",
            "Backends ejected by their breaker after failed requests",
            labels=["backend"],
        )
        for name, n in sorted(self.breakers.ejected_total.items()):
            ejections.add_metric([name], n)
        yield ejections
        ejected = GaugeFamily(
            "kvrouter_backend_ejected", "Backend's breaker is open (1) or not (0)", labels=["backend"]
        )
        for name in list(self.membership.members):
            ejected.add_metric([name], 1.0 if self.breakers.state(name) == "open" else 0.0)
        yield ejected
        retries = CounterFamily(
            "kvrouter_retries",
            "Retries on another backend: allowed by the retry budget, or refused by it",
            labels=["result"],
        )
        retries.add_metric(["allowed"], self.breakers.retries_allowed)
        retries.add_metric(["refused"], self.breakers.retries_refused)
        yield retries


class UpstreamCollector:
    """Engine answers that broke the upstream client's framing rules or limits, read at scrape time
    (router/net/upstream.py counts them by reason)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterable[Family]:
        violations = CounterFamily(
            "kvrouter_upstream_violations",
            "Engine answers refused or cut, and their connection closed: trailing_bytes (after a "
            "complete response), framing, upgrade, malformed, head_too_large, too_many_headers, "
            "head_timeout, unframed_bytes, sse_event_too_large",
            labels=["reason"],
        )
        for reason, n in sorted(self.pool.violations.items()):
            violations.add_metric([reason], n)
        yield violations


class ChecksCollector:
    """Prediction checks (router.observe.checks), read at scrape time."""

    def __init__(self, checks: Any) -> None:
        self.checks = checks

    def collect(self) -> Iterable[Family]:
        c = self.checks
        results = CounterFamily(
            "kvrouter_prediction_checks",
            "Predicted cached tokens compared with the engine's usage.prompt_tokens_details.cached_tokens:"
            " exact, within_block, over (predicted more), under (predicted less), no_usage",
            labels=["backend", "result"],
        )
        for (backend, result), n in sorted(c.counts.items()):
            results.add_metric([backend, result], n)
        yield results
        errors = HistogramFamily(
            "kvrouter_prediction_error_tokens",
            "Engine's cached tokens minus the router's prediction, per checked request",
        )
        errors.add_counts([], ERROR_BUCKETS, c.error_buckets, c.error_sum)
        yield errors
        mismatch = CounterFamily(
            "kvrouter_prompt_tokens_mismatch",
            "Requests whose prompt token count differed from the engine's (tokenizer or chat template)",
            labels=["backend"],
        )
        for backend, n in sorted(c.mismatched_prompts.items()):
            mismatch.add_metric([backend], n)
        yield mismatch
        diagnosed = GaugeFamily(
            "kvrouter_prediction_diagnosis",
            "A backend's predictions are systematically off (1; /debug/index names the cause)",
            labels=["backend"],
        )
        for backend in sorted(c.diagnoses()):
            diagnosed.add_metric([backend], 1.0)
        yield diagnosed


class SourcesCollector:
    """Membership sources: config reloads and Kubernetes discovery, read at scrape time."""

    def __init__(self, config_watcher: Any | None, pods: Any | None) -> None:
        self.config_watcher = config_watcher
        self.pods = pods

    def collect(self) -> Iterable[Family]:
        reloads = CounterFamily(
            "kvrouter_config_reloads",
            "Config file reloads by result (applied, rejected: invalid file kept out, unchanged)",
            labels=["result"],
        )
        if self.config_watcher is not None:
            for result, n in self.config_watcher.results.items():
                reloads.add_metric([result], n)
        yield reloads
        if self.pods is None:
            return
        skipped = CounterFamily(
            "kvrouter_discovery_skipped",
            "Pods discovery could not turn into a backend (missing_port, bad_annotation, invalid, "
            "name_taken, bad_pod)",
            labels=["reason"],
        )
        for reason, n in sorted(self.pods.skipped.items()):
            skipped.add_metric([reason], n)
        yield skipped
        events = CounterFamily(
            "kvrouter_discovery_events", "Kubernetes watch events by type", labels=["type"]
        )
        for kind, n in sorted(self.pods.events.items()):
            events.add_metric([kind], n)
        yield events
        failures = CounterFamily(
            "kvrouter_discovery_failures", "List or watch failures (each retried after a backoff)"
        )
        failures.add_metric([], self.pods.failures)
        yield failures
        connected = GaugeFamily(
            "kvrouter_discovery_connected", "The Kubernetes watch is established (1) or not (0)"
        )
        connected.add_metric([], 1.0 if self.pods.connected else 0.0)
        yield connected


class _TokenizerCollector:
    """The segment token caches' counters, read at scrape time."""

    def __init__(self, caches: Sequence[SegmentCache]) -> None:
        self.caches = list(caches)

    def collect(self) -> Iterable[Family]:
        tokens = CounterFamily(
            "kvrouter_tokenizer_cache_tokens",
            "Prompt tokens taken from the segment cache (hit) or tokenized and stored (miss)",
            labels=["result"],
        )
        tokens.add_metric(["hit"], sum(c.hit_tokens for c in self.caches))
        tokens.add_metric(["miss"], sum(c.miss_tokens for c in self.caches))
        yield tokens
        resident = GaugeFamily(
            "kvrouter_tokenizer_cache_bytes", "Estimated memory held by the segment caches"
        )
        resident.add_metric([], sum(c.bytes for c in self.caches))
        yield resident
        off = GaugeFamily(
            "kvrouter_tokenizer_cache_disabled",
            "Segment caches switched off after a sampled check found a difference (should be 0)",
        )
        off.add_metric([], sum(1 for c in self.caches if c.max_bytes > 0 and not c.enabled))
        yield off


def dashboard_data(
    metrics: RouterMetrics,
    index: KVIndex,
    membership: Membership,
    loads: LoadTracker,
    policy: str,
    recent: Iterable[dict[str, Any]],
    diagnoses: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON the built-in dashboard polls (cumulative counters; the page derives rates)."""
    backends = []
    # totals over every backend ever routed to, so that a backend leaving does not lower them
    counters = [*metrics.per_backend.values(), metrics.departed]
    total_prompt = sum(c.prompt_tokens for c in counters)
    total_matched = sum(c.matched_tokens for c in counters)
    all_loads = loads.all()
    for b in list(membership.members.values()):
        c = metrics.backend(b.name)
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
                "state": b.state,
                "origin": b.origin,
                "role": b.spec.role,
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
        "membership": {
            "counts": membership.counts(),
            "transitions": [msgspec.to_builtins(t) for t in list(membership.transitions)[-20:]],
        },
        "sources": sources,
        "recent_decisions": list(recent),
        "diagnoses": diagnoses or {},
    }
