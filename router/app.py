"""Assembles the router: index, backends, policy, tokenizer, proxy, metrics and the answers of the
non-proxied endpoints (``/health``, ``/ready``, ``/v1/models``, ``/route``, ``/debug/index``,
``/metrics``, ``/dashboard`` and ``/dashboard/data``).

``KVRouter`` is what the front ends serve (:class:`router.frontend.Endpoints`); it imports none of
them: ``router.http.asgi.AsgiApp`` makes it a complete ASGI application, which ``kvrouter serve``
runs on uvicorn (:mod:`router.http.uvicorn_server`) and any other ASGI server can run too. All
objects are created here and passed in explicitly; nothing is module-global, so tests can run
several routers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec

from index._kvcore import json_prompt
from index.keys import TokenBuffer
from index.kvindex import KVIndex
from router.cluster.replicas import Replicas
from router.config import AUTO, RouterConfig
from router.decision.classes import request_class
from router.decision.pd import PDPlanner
from router.decision.policy import Policy
from router.decision.service import Endpoint, RouterService
from router.decision.tokenizer import RequestTokenizer, RequestTokenizerConfig
from router.errors import ApiError, json_body, unauthorized, unavailable
from router.fleet.load import BoardView, LoadTracker
from router.fleet.membership import Member
from router.fleet.runtime import FleetRuntime
from router.fleet.sources.admin import AdminApi, AdminJournal, admin_auth, bearer_token, compare_digest
from router.fleet.sources.configfile import ConfigWatcher, Stamp
from router.flow.controller import FlowController
from router.net.asgi import Scope
from router.net.body import decode_json, decodes_at_once
from router.net.upstream import UpstreamPool
from router.observe.checks import PredictionChecks, StreamStats
from router.observe.gcpauses import FrozenObjects, GcPauses
from router.observe.history import DashboardHistory, sample_forever
from router.observe.metrics import (
    BreakerCollector,
    ChecksCollector,
    RouterMetrics,
    SourcesCollector,
    UpstreamCollector,
    dashboard_data,
)
from router.pd.exchange import PDExchange
from router.pd.metrics import PDMetrics, merge_dashboards
from router.proxy import ProxyHandler

if TYPE_CHECKING:  # (imported where used: only with Kubernetes discovery / several workers / [epp])
    from router.epp.server import EppServer
    from router.fleet.sources.kubernetes import PodWatcher
    from router.workers.supervisor import WorkerContext

log = logging.getLogger("kvrouter")


class KVRouter:
    """The router's objects and its ASGI entry point."""

    def __init__(
        self,
        config: RouterConfig,
        zmq_context: Any = None,
        worker: WorkerContext | None = None,
        config_path: str | Path | None = None,
        config_file: tuple[RouterConfig, Stamp] | None = None,
    ) -> None:
        """``config_path``: the config file, reloaded on change; ``config_file``: what was read from
        it (:func:`router.fleet.sources.configfile.read_config_file`), else it is read again here."""
        self.config = config
        self.worker = worker
        """Set when this router is one of several worker processes (:mod:`router.workers.supervisor`)."""
        index_cfg = msgspec.structs.replace(config.index, block_size=config.block_size)
        self.index = KVIndex(index_cfg, ctx=zmq_context)
        srv = config.server
        self.pool = UpstreamPool(
            srv.connect_timeout_s,
            srv.read_timeout_s,
            srv.max_connections,
            srv.keepalive_expiry_s,
            max_head_bytes=srv.upstream_max_head_bytes,
            max_header_lines=srv.upstream_max_header_lines,
            head_timeout=srv.upstream_head_timeout_s,
        )
        """Every connection to the backends: proxied requests, health probes, ``/tokenize``."""
        self.loads = LoadTracker([BoardView(worker.board(), worker.index)] if worker else [])
        self.fleet = FleetRuntime(
            self.index, self.loads, self.pool, config.health, config.membership, config.kv_topic
        )
        self.membership = self.fleet.membership
        self.health = self.fleet.health
        self.breakers = self.fleet.breakers
        self.policy = Policy(config.policy)
        # one ChatTokenizer (and one segment cache) per distinct path, however many models share it;
        # Jinja2 and HF tokenizers are imported only when one is configured (router/decision/chat.py)
        cache = int(config.tokenizer_cache_mib * (1 << 20))
        paths = [*config.tokenizers.values(), *([config.tokenizer] if config.tokenizer else [])]
        loaded = {}
        if paths:
            # optional: jinja2 and HF tokenizers only when a tokenizer is configured
            from router.decision.chat import ChatTokenizer

            loaded = {p: ChatTokenizer.from_path(p, cache_bytes=cache) for p in paths}
        local = {m: loaded[p] for m, p in config.tokenizers.items()}
        default = loaded[config.tokenizer] if config.tokenizer else None
        self.tokenizer = RequestTokenizer(
            local,
            default=default,
            client=self.pool if config.remote_tokenize else None,
            backend_for=self._tokenize_backend if config.remote_tokenize else None,
            config=RequestTokenizerConfig(max_chars=config.tokenizer_max_chars),
        )
        self.service = RouterService(
            self.index,
            self.membership,
            self.loads,
            self.policy,
            self.tokenizer,
            config.recent_decisions,
            self.breakers,
            pd=PDPlanner(config.pd, config.policy),
        )
        caches = [t.segments for t in loaded.values()]
        self.metrics = RouterMetrics(self.index, self.membership, self.loads, caches)
        self.pd_metrics = PDMetrics()
        self.metrics.add_series(self.pd_metrics.series)
        self.gc_pauses = GcPauses()
        self.metrics.add_series([self.gc_pauses.histogram])
        self.metrics.add_collector(FrozenObjects())
        self.checks = PredictionChecks(config.checks, self._stream_stats) if config.checks.enabled else None
        self.proxy = ProxyHandler(
            self.service,
            self.pool,
            self.metrics,
            self.loads,
            srv,
            self.authorize,
            self.health,
            self.checks,
            pd=PDExchange(config.pd, self.pool, self.loads, self.pd_metrics, self.health, self.breakers),
        )
        # --- router replicas: session pins, shared load and predictions (router/cluster) ---
        self.replicas = Replicas(
            config.cluster,
            self.index,
            self.loads,
            port=srv.port,
            worker=worker.index if worker else None,
            group=f"{socket.gethostname()}:{worker.run_dir}" if worker else "",
        )
        self.service.affinity = self.proxy.affinity = self.replicas.affinity
        self.service.unseen = self.replicas.unseen
        self.replicas.register(self.metrics.registry)
        self.flow: FlowController | None = None  # --- flow control (router/flow), off by default
        if config.flow.enabled:
            self.flow = FlowController(config.flow, self.loads, self._flow_targets)
            self.proxy.flow = self.flow
            if config.flow.restrict_to_room:
                self.service.flow_open = self.flow.open_members
            self.metrics.add_series(self.flow.metrics.series)
            self.metrics.add_collector(self.flow.metrics)
        self._keys = [k.encode() for k in config.api_keys]
        self._trusted = [k.encode() for k in config.trusted_api_keys]
        self._admin_keys = [k.encode() for k in config.admin_keys]
        self.proxy.trusted = self.trusted
        self.on_config_applied: list[Callable[[], None]] = []
        """Called when a reload is applied, whose keys may differ (a server's kept answers depend on them)."""
        journal = None
        if worker is not None:
            journal = AdminJournal(Path(worker.run_dir) / "admin.journal", f"{worker.index}:{os.getpid()}")
        self.admin = AdminApi(
            self.membership,
            self.loads,
            srv.workers,
            journal,
            (lambda: self.config.backends) if config_path is not None else None,
        )
        self.fleet.tick_hooks.append(self.admin.sync)
        self.config_path = config_path
        self.config_watcher: ConfigWatcher | None = None
        if config_path is not None:
            self.config_watcher = ConfigWatcher(
                config_path,
                config,
                self._apply_config,
                watch=config.membership.watch_config,
                interval_s=config.membership.watch_interval_s,
                restore=self._restore_config_backends,
                loaded=config_file,
            )
        self.pods: PodWatcher | None = None
        if config.membership.kubernetes.enabled:
            # optional: lightkube only with Kubernetes discovery
            from router.fleet.sources.kubernetes import PodWatcher

            self.pods = PodWatcher(config.membership.kubernetes, self.membership, config.kv_topic)
        self.metrics.add_collector(SourcesCollector(self.config_watcher, self.pods))
        self.metrics.add_collector(BreakerCollector(self.breakers, self.membership))
        self.metrics.add_collector(UpstreamCollector(self.pool))
        if self.checks is not None:
            self.metrics.add_collector(ChecksCollector(self.checks))
        self.epp: EppServer | None = None
        """The Envoy ext_proc endpoint picker (``[epp]``, router/epp): the same decisions, for a gateway."""
        if config.epp.enabled:
            self.epp = self._make_epp()
        self._forget = _ForgetRemoved(self)
        self.membership.listeners.append(self._forget)
        self._tasks: list[asyncio.Task[None]] = []
        self.dashboard_history = DashboardHistory()

    def _make_epp(self) -> EppServer:
        try:
            # optional: grpc and the ext_proc protocol only with [epp] (the 'epp' extra)
            from router.epp.picker import Picker
            from router.epp.server import EppServer
        except ImportError as exc:  # (the extra is not installed)
            raise ValueError(
                f"[epp] is enabled but its packages are missing ({exc}): pip install 'kvrouter[epp]'"
            ) from None

        srv = self.config.server
        picker = Picker(
            self.config.epp,
            self.service,
            self.loads,
            self.metrics,
            srv.max_body_bytes,
            self.checks,
            trusted=lambda h: self.trusted(
                [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()]
            ),
            pd=self.proxy.pd,  # (the proxy's prefill legs, their metrics and breakers)
            upstream_headers=self.proxy.upstream_headers,
        )
        self.metrics.add_series(picker.epp_metrics.series)
        picker.flow = self.flow  # (the same queue and rules as the proxy's)
        return EppServer(self.config.epp, picker, srv.max_body_bytes + (1 << 16))

    def authorize(self, scope: Scope) -> None:
        """Raise 401 unless the request carries an accepted bearer key (when keys are configured);
        the admin API has its own keys (404 when off, 401 without an admin key, 403 for a client key)."""
        self.authorize_request(
            scope.get("path", ""), scope.get("headers", ()), scope.get("query_string", b"")
        )

    def authorize_request(
        self, path: str, headers: Iterable[tuple[bytes, bytes]], query: bytes = b""
    ) -> None:
        """:meth:`authorize` from the request's parts (a request refused from its head: no scope dict)."""
        if path.startswith("/admin/") or path == "/admin":
            admin_auth(headers, self._admin_keys, self._keys)
            return
        if not self._keys:
            return
        if self.config.auth_exempt_probes and path in ("/health", "/ready"):
            return
        token = bearer_token(headers)
        if not token and path.startswith("/dashboard"):
            # the page is opened in a browser, which cannot set headers: accept ?key=
            keys = parse_qs(query.decode("latin-1")).get("key")
            if keys:
                token = keys[0].encode()
        if not token or not any(compare_digest(token, k) for k in self._keys):
            raise unauthorized()

    def trusted(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether an authorized request's key is one of ``trusted_api_keys`` (the body fields only
        the router sets for the engines then pass as sent)."""
        if not self._trusted:
            return False
        token = bearer_token(headers)
        return bool(token) and any(compare_digest(token, k) for k in self._trusted)

    def _stream_stats(self, backend: str) -> StreamStats:
        """What the index knows of a backend's event streams (for the prediction checks' diagnosis)."""
        out = StreamStats(configured_block_size=self.config.block_size)
        for s in self.index.status():
            if s.instance == backend:
                out.batches += s.batches
                out.connected = out.connected or s.connected
                out.lost += s.lost_batches
                out.block_size = out.block_size or s.block_size
                out.kv_groups = out.kv_groups or s.kv_groups
                out.group_faults += s.group_faults
        return out

    def _apply_config(self, new: RouterConfig) -> None:
        """A reloaded, valid config file: its backends, client keys (trusted ones too) and admin keys
        take effect."""
        self.membership.reconcile("config", new.backends, "config file reloaded")
        if self.config_watcher is not None:
            self.admin.reloaded(self.config_watcher.version)
        self._keys = [k.encode() for k in new.api_keys]
        self._trusted = [k.encode() for k in new.trusted_api_keys]
        self._admin_keys = [k.encode() for k in new.admin_keys]
        for hook in self.on_config_applied:
            hook()
        self.config = msgspec.structs.replace(
            self.config,
            backends=new.backends,
            api_keys=new.api_keys,
            trusted_api_keys=new.trusted_api_keys,
            admin_keys=new.admin_keys,
        )

    def _restore_config_backends(self, cfg: RouterConfig) -> int:
        """SIGHUP with the file unchanged: the backends it lists that the fleet lacks come back (an
        admin DELETE undone); the others stay as they are (a drained one stays drained)."""
        back = self.membership.restore(cfg.backends, "config", "restored by a reload of the config file")
        if back:
            self.admin.restored(back)
        return len(back)

    def request_reload(self) -> None:
        """SIGHUP: re-read the config file (soon, on the event loop)."""
        if self.config_watcher is not None:
            self.config_watcher.request()
        else:
            log.warning("SIGHUP ignored: the router was not started from a config file")

    def _tokenize_backend(self, model: str) -> str | None:
        healthy = self.membership.routable_for(model)
        return healthy[0].url if healthy else None

    # --- lifecycle -----------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start ingestion, the static fleet and health checks; the first probe round completes (and
        healthy backends finish their index bootstrap) before serving."""
        if self.epp is not None:  # (liveness answers while the rest starts; readiness at the end)
            await self.epp.start()
        self.gc_pauses.install()
        self.index.start()
        self.membership.reconcile("config", self.config.backends, "in the config file")
        await self.health.check_all()
        await self.fleet.settle()
        self.fleet.start()
        if self.config_watcher is not None:
            self.config_watcher.start()
        if self.pods is not None:
            self.pods.start()
        self.replicas.start()
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._housekeeping(), name="kvrouter-housekeeping")
        )
        self._tasks.append(  # (the dashboard's windows and charts, whenever a page is opened)
            asyncio.get_running_loop().create_task(
                sample_forever(self.dashboard_history, self._dashboard_merged), name="kvrouter-dashboard"
            )
        )
        if self.worker is not None:
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._publish_stats(self.worker), name="kvrouter-stats"
                )
            )
        if self.epp is not None:
            await self.epp.ready()
        healthy = self._healthy_names()
        sources = self.index.status()
        # connected ones, as /debug/index shows them; a backend with kv_events = "auto" has none until
        # its engine lists them, counted apart: an unreachable engine reads "0 connected" whichever
        # way its streams are given
        members = self.membership.members.values()
        unlisted = sum(1 for m in members if m.kv_sources not in ("", "listed", "fallback"))
        # (a source the index was just given shows in its status once the subscriber thread took it)
        configured = {
            f"{m.name}/dp{r}"
            for m in members
            if m.spec.kv_events not in (None, AUTO)
            for r in range(m.spec.dp_size)
        }
        log.info(
            "kvrouter ready: policy=%s, %d/%d backends healthy (%s), %d/%d event sources connected%s",
            self.config.policy.name,
            len(healthy),
            len(self.membership.members),
            ", ".join(healthy) or "none",
            sum(1 for s in sources if s.connected),
            len(configured | {s.source for s in sources}),
            f', {unlisted} backend(s) with kv_events = "auto" not listed yet' if unlisted else "",
        )

    async def shutdown(self) -> None:
        """Stop background work and close connections (in-flight requests were drained by the server)."""
        if self.epp is not None:
            await self.epp.stop(self.config.server.drain_timeout_s)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.config_watcher is not None:
            await self.config_watcher.stop()
        if self.pods is not None:
            await self.pods.stop()
        await self.replicas.stop()
        if self.flow is not None:
            self.flow.close()
        await self.fleet.stop()
        self.index.stop()
        self.gc_pauses.remove()
        self.tokenizer.close()
        self.pool.close()

    async def _publish_stats(self, worker: WorkerContext) -> None:
        """Publish this worker's figures for the merged /metrics and dashboard
        (:mod:`router.workers.stats`)."""
        # optional: the workers' figures only with several workers
        from router.workers.stats import SnapshotWriter, families_of

        writer = SnapshotWriter(worker.run_dir, worker.index)
        while True:
            try:
                writer.write(families_of(self.metrics.registry), self._dashboard_live())
            except OSError as exc:
                log.warning("cannot publish worker figures: %s", exc)
            await asyncio.sleep(worker.stats_interval_s)

    def _dashboard_live(self) -> dict[str, Any]:
        data = dashboard_data(
            self.metrics,
            self.index,
            self.membership,
            self.loads,
            self.config.policy.name,
            [r.explain() for r in list(self.service.recent)[-20:]],
            self.checks.diagnoses() if self.checks is not None else {},
        )
        data["cluster"] = self.replicas.describe()
        data["pd"] = self.pd_metrics.dashboard()  # P/D panel (router/pd/metrics.py)
        data["flow"] = self.flow.describe() if self.flow is not None else None  # flow control panel
        return data

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            try:
                self.index.purge_predictions()
                self._forget.sweep(every=30.0)
            except Exception:  # (logged; the next turn runs: a dead task would stop both for good)
                log.exception("housekeeping failed; going on")

    # --- answers shared by the FastAPI routes and the native ones (router/http/native.py) ----------
    def health_body(self) -> dict[str, Any]:
        """``GET /health``."""
        if self.worker is not None:
            return {"status": "ok", "worker": self.worker.index, "pid": os.getpid()}
        return {"status": "ok"}

    def ready_body(self) -> dict[str, Any]:
        """``GET /ready``; 503 when no backend is healthy."""
        if not self.membership.any_routable():
            raise unavailable("no healthy backend")
        return {"status": "ready", "healthy_backends": self._healthy_names()}

    def models_body(self) -> dict[str, Any]:
        """``GET /v1/models``: every model some backend serves, with the backends serving it."""
        data = []
        for model, backends in self.membership.models().items():
            parent = next((b.lora_parents[model] for b in backends if model in b.lora_parents), None)
            card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvrouter"}
            if parent:
                card["parent"] = parent
            card["backends"] = [b.name for b in backends]
            data.append(card)
        return {"object": "list", "data": data}

    def _flow_targets(self, model: str) -> list[tuple[str, int]]:
        """The targets a decision for ``model`` would consider now (none: nobody may serve it)."""
        try:
            return [t for m in self.service.candidates_for(model) for t in m.targets]
        except ApiError:
            return []

    async def route_answer(self, raw: bytes, query: bytes, headers: Any = ()) -> bytes:
        """``POST /route``: the decision for a request body, explained (nothing is sent); raises
        :class:`ApiError` for a bad body."""
        body = await self.service.read_json(raw, _route_body)
        try:
            endpoint, session = self._route_args(body, query, headers)
            classed = request_class(headers)
            meta = self.flow.meta(headers, body, len(raw)) if self.flow is not None else None
            decided = await self.service.decide(
                endpoint,
                body,
                dry_run=True,
                session=session,
                size=len(raw),
                request_class=classed,
                band=meta.priority if meta is not None else None,
            )
            if self.flow is not None and meta is not None:  # flow: whether the proxy would hold it, and why
                flow = self.flow.would_queue(meta)
                return decided.explain_json()[:-1] + b',"flow":' + msgspec.json.encode(flow) + b"}"
            return decided.explain_json()
        finally:
            self.service.release(body, len(raw))

    def route_answer_now(self, raw: bytes, query: bytes, headers: Any = ()) -> bytes | None:
        """:meth:`route_answer` when it needs no await (a prompt of token ids), else None; raises
        :class:`ApiError` like it. Such a lookup is decided without an await: external schedulers
        call ``/route`` per request. (Not a body decoded in pieces: its work is done off the event
        loop.)"""
        if self.flow is not None or not decodes_at_once(raw):  # (flow: route_answer says more)
            return None
        body = _token_prompt_body(raw)
        if body is None:
            return None
        endpoint, session = self._route_args(body, query, headers)
        classed = request_class(headers)
        answer = self.service.explain_json_now(endpoint, body, session=session, request_class=classed)
        if answer is not None:
            return answer
        decided = self.service.explain_now(endpoint, body, session=session, request_class=classed)
        return decided.explain_json() if decided is not None else None

    def _route_args(self, body: Any, query: bytes, headers: Any) -> tuple[Endpoint, int | None]:
        """``/route``'s endpoint (``?endpoint=``, else the body's shape) and session (affinity)."""
        endpoint: Endpoint
        q = parse_qs(query.decode("latin-1")).get("endpoint", [None])[-1] if query else None
        if q in ("chat", "completions"):
            endpoint = q  # type: ignore[assignment]
        else:
            endpoint = "chat" if isinstance(body, dict) and "messages" in body else "completions"
        affinity = self.replicas.affinity
        return endpoint, affinity.session_of(headers) if affinity is not None else None

    def debug_index_body(self) -> dict[str, Any]:
        """``GET /debug/index``: the index and every source's stream health, the backends."""
        return {
            "worker": self.worker.index if self.worker is not None else None,
            "block_size": self.config.block_size,
            "residencies": self.index.store.total,
            "max_residencies": self.index.config.max_residencies,
            "evictions": self.index.evictions,
            "predicted_blocks": self.index.predicted_blocks(),
            "sources": [msgspec.to_builtins(s) for s in self.index.status()],
            "event_streams": self.index.resources(),
            "backends": [
                {
                    **b.describe(self.loads.local_active(b.targets)),
                    "models": sorted(b.models),
                    "breaker": self.breakers.state(b.name),
                }
                for b in list(self.membership.members.values())
            ],
            "membership": self._membership_status(),
            "predictions": self.checks.status() if self.checks is not None else None,
            "cluster": self.replicas.describe(),
        }

    def metrics_text(self) -> bytes:
        """``GET /metrics``: Prometheus text (every worker's figures merged when there are several)."""
        if self.worker is not None:
            # optional: the workers' figures only with several workers
            from router.workers.stats import read_snapshots, render_merged

            return render_merged(read_snapshots(self.worker.run_dir))
        return self.metrics.render()

    @functools.cached_property
    def dashboard_page(self) -> str:
        """``GET /dashboard``: the page (static HTML)."""
        return _dashboard_page()

    def dashboard_body(self) -> dict[str, Any]:
        """``GET /dashboard/data``: the live figures the page polls, with the router's recent
        history and its last-minute and since-start windows (router/observe/history.py)."""
        return self.dashboard_history.attach(self._dashboard_merged())

    def _dashboard_merged(self) -> dict[str, Any]:
        """The live figures, every worker's merged when there are several."""
        data = self._dashboard_live()
        if self.worker is not None:
            # optional: the workers' figures only with several workers
            from router.workers.stats import merge_dashboard, read_snapshots

            snaps = read_snapshots(self.worker.run_dir)
            data = merge_dashboard(data, snaps)
            data["pd"] = merge_dashboards([s.dashboard.get("pd") or {} for s in snaps])  # P/D panel
        return data

    def _membership_status(self) -> dict[str, Any]:
        """Counts, transitions and the state of every membership source (for /debug/index)."""
        cw, pods = self.config_watcher, self.pods
        return {
            "counts": self.membership.counts(),
            "transitions": [msgspec.to_builtins(t) for t in self.membership.transitions],
            "config_file": None
            if cw is None
            else {
                "path": str(cw.path),
                "watch": cw.watch,
                "reloads": cw.results,
                "last_error": cw.last_error,
            },
            "admin_api": bool(self._admin_keys),
            "kubernetes": None
            if pods is None
            else {
                "namespace": pods.namespace,
                "label_selector": pods.selector_text,
                "inference_pool": None
                if pods.pool is None
                else {
                    "name": pods.pool.name,
                    "exists": pods.pool.exists,
                    "connected": pods.pool.connected,
                    "target_port": pods.http_port,
                    "resource_version": pods.pool.resource_version,
                    "events": pods.pool.events,
                    "changes": pods.pool.changes,
                    "relists": pods.pool.relists,
                },
                "connected": pods.connected,
                "resource_version": pods.resource_version,
                "pods": len(pods.pods),
                "events": pods.events,
                "relists": pods.relists,
                "skipped": pods.skipped,
                "failures": pods.failures,
                "last_error": pods.last_error,
            },
        }

    def _healthy_names(self) -> list[str]:
        return [b.name for b in self.membership.members.values() if b.routable]


def _token_prompt_body(raw: bytes) -> dict[str, Any] | None:
    """A /route body whose top-level ``prompt`` is a JSON array of token ids, with that array
    parsed straight into uint64s (:class:`index.keys.TokenBuffer`) and the rest by msgspec: decoding
    a 32k-token array into Python ints was ~0.8 ms of a ~1.5 ms decision. Any other body (or any
    doubt) returns None and takes the generic path, so answers and errors are unchanged (the native
    endpoint test compares both)."""
    found = json_prompt(raw)
    if found is None:
        return None
    start, end, ids = found
    try:
        body = decode_json(raw[:start] + b"0" + raw[end:])
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None  # (the generic path words the 400)
    if not isinstance(body, dict):
        return None
    body["prompt"] = TokenBuffer(ids)
    return body


def _route_body(raw: bytes) -> Any:
    """A /route body: :func:`_token_prompt_body`, else decoded as any other (or a 400)."""
    body = _token_prompt_body(raw)
    return json_body(raw) if body is None else body


class _ForgetRemoved:
    """Frees what a removed backend held outside the fleet runtime (a MembershipListener): its
    prediction-check window, its metric series and ejection count, and the idle connections to its
    address when no other member uses it. Pod churn names new backends at every rollout: kept,
    these grew without bound. (A re-join under the same name keeps them: the name goes on.)"""

    def __init__(self, app: KVRouter) -> None:
        self.app = app
        self.recent: dict[str, tuple[float, tuple[str, str, int]]] = {}
        """Backends removed lately: name -> (when, address), for :meth:`sweep`."""
        self._swept = 0.0

    def joined(self, member: Member) -> None:
        if self.recent.pop(member.name, None) is not None:
            # removed lately, here again: what its old requests wrote since (an open breaker from
            # a failure after the removal) is not the new member's
            self.app.breakers.forget(member.name)

    def left(self, member: Member) -> None:
        if member.state != "gone":  # a re-join: the same name goes on, its check window anew
            if self.app.checks is not None:
                self.app.checks.forget(member.name)
            return
        if len(self.recent) >= 10_000:
            self.recent.pop(next(iter(self.recent)))  # (bounded: the oldest removal first)
        self.recent[member.name] = (time.monotonic(), member.upstream_key)
        self._clear({member.name}, {member.upstream_key})

    def sweep(self, every: float = 0.0) -> None:
        """What requests still in flight at a removal wrote after it (a drain that timed out, a
        stream that outlived it): the series, counters, prediction checks, breaker state and idle
        connections of backends removed in the last :data:`_STRAGGLERS_S`, forgotten again (at
        most once per ``every`` seconds: one pass over the series), so the leftovers of a removal
        live seconds, not for good. The dashboard's totals keep what they served."""
        now = time.monotonic()
        if not self.recent or now - self._swept < every:
            return
        self._swept = now
        app = self.app
        members = app.membership.members
        for name in [n for n, (t, _) in self.recent.items() if now - t > _STRAGGLERS_S or n in members]:
            del self.recent[name]  # (a name that joined again keeps what it writes from now on)
        if not self.recent:
            return
        self._clear(set(self.recent), {key for _, key in self.recent.values()})

    def _clear(self, names: set[str], keys: set[tuple[str, str, int]]) -> None:
        """Forget removed backends: their series and counters, prediction checks, breaker state and
        ejection counts, and the idle connections to addresses no member uses."""
        app = self.app
        app.metrics.forget_backends(names)
        for name in names:
            app.breakers.forget(name)
            app.breakers.ejected_total.pop(name, None)
            if app.checks is not None:
                app.checks.forget(name, removed=True)
        used = {m.upstream_key for m in app.membership.members.values()}
        for key in keys & app.pool.idle_keys() - used:
            app.pool.close_idle(key)


_HOUSEKEEPING_S = 5.0
"""Seconds between housekeeping turns (expired predictions, the removal sweep)."""

_STRAGGLERS_S = 3600.0
"""How long after a removal what its last requests write is swept up (a stream longer than this,
after a drain that timed out, leaves its last counts until the name joins and leaves again)."""


def _dashboard_page() -> str:
    import importlib.resources  # optional: at the first /dashboard, not at start-up

    try:
        return (importlib.resources.files("router") / "static" / "dashboard.html").read_text()
    except (FileNotFoundError, OSError):
        return "<!doctype html><title>kvrouter</title><p>dashboard page missing from the package</p>"


__all__ = ["KVRouter"]
