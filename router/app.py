"""Assembles the router: index, backends, policy, tokenizer, proxy, metrics and the HTTP endpoints.

The ASGI entry point sends the two proxied POST paths to the lean :class:`router.http.proxy.ProxyHandler`
and everything else to a FastAPI app: ``/health``, ``/ready``, ``/v1/models``, ``/route``,
``/debug/index``, ``/metrics``, ``/dashboard`` and ``/dashboard/data``. All objects are created here
and passed in explicitly; nothing is module-global, so tests can run several routers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import logging
import os
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

import httpx
import msgspec
import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from index.kvindex import KVIndex
from router.config import RouterConfig
from router.decision.pd import PDPlanner
from router.decision.policy import Policy
from router.decision.service import Endpoint, RouterService
from router.decision.tokenizer import ChatTokenizer, RequestTokenizer
from router.fleet.load import BoardView, LoadTracker
from router.fleet.runtime import FleetRuntime
from router.http.asgi import Receive, Scope, Send
from router.http.errors import ApiError, bad_request, unauthorized, unavailable
from router.http.proxy import PATHS, ProxyHandler, read_body
from router.http.upstream import UpstreamPool
from router.observe.metrics import RouterMetrics, dashboard_data
from router.pd.exchange import PDExchange
from router.pd.metrics import PDMetrics, merge_dashboards
from router.workers.stats import SnapshotWriter, families_of, merge_dashboard, read_snapshots, render_merged
from router.workers.supervisor import WorkerContext

log = logging.getLogger("kvrouter")


class KVRouter:
    """The router's objects and its ASGI entry point."""

    def __init__(
        self,
        config: RouterConfig,
        zmq_context: zmq.Context[Any] | None = None,
        worker: WorkerContext | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        """Set when this router is one of several worker processes (:mod:`router.workers.supervisor`)."""
        index_cfg = msgspec.structs.replace(config.index, block_size=config.block_size)
        self.index = KVIndex(index_cfg, ctx=zmq_context)
        srv = config.server
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=64,  # health checks and /tokenize only; the proxy has its own pool
                keepalive_expiry=60.0,
            ),
            timeout=httpx.Timeout(srv.read_timeout_s, connect=srv.connect_timeout_s),
        )
        self.loads = LoadTracker([BoardView(worker.board(), worker.index)] if worker else [])
        self.fleet = FleetRuntime(
            self.index, self.loads, self.client, config.health, config.membership, config.kv_topic
        )
        self.membership = self.fleet.membership
        self.health = self.fleet.health
        self.policy = Policy(config.policy)
        # one ChatTokenizer (and one segment cache) per distinct path, however many models share it
        cache = int(config.tokenizer_cache_mib * (1 << 20))
        loaded = {
            p: ChatTokenizer.from_path(p, cache_bytes=cache)
            for p in [*config.tokenizers.values(), *([config.tokenizer] if config.tokenizer else [])]
        }
        local = {m: loaded[p] for m, p in config.tokenizers.items()}
        default = loaded[config.tokenizer] if config.tokenizer else None
        self.tokenizer = RequestTokenizer(
            local,
            default=default,
            client=self.client if config.remote_tokenize else None,
            backend_for=self._tokenize_backend if config.remote_tokenize else None,
        )
        self.service = RouterService(
            self.index,
            self.membership,
            self.loads,
            self.policy,
            self.tokenizer,
            config.recent_decisions,
            pd=PDPlanner(config.pd, config.policy),
        )
        caches = [t.segments for t in loaded.values()]
        self.metrics = RouterMetrics(self.index, self.membership, self.loads, caches)
        self.pd_metrics = PDMetrics()
        self.metrics.add_series(self.pd_metrics.series)
        self.pool = UpstreamPool(
            srv.connect_timeout_s, srv.read_timeout_s, srv.max_connections, srv.keepalive_expiry_s
        )
        self.proxy = ProxyHandler(
            self.service,
            self.pool,
            self.metrics,
            self.loads,
            srv,
            self.authorize,
            self.health,
            pd=PDExchange(config.pd, self.pool, self.loads, self.pd_metrics, self.health),
        )
        self._keys = [k.encode() for k in config.api_keys]
        self._tasks: list[asyncio.Task[None]] = []
        self.api = self._build_api()

    # --- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PATHS:
            await self.proxy(scope, receive, send)
        else:
            await self.api(scope, receive, send)

    def authorize(self, scope: Scope) -> None:
        """Raise 401 unless the request carries an accepted bearer key (when keys are configured)."""
        if not self._keys:
            return
        if self.config.auth_exempt_probes and scope.get("path") in ("/health", "/ready"):
            return
        token = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
                break
        if not token and scope.get("path", "").startswith("/dashboard"):
            # the page is opened in a browser, which cannot set headers: accept ?key=
            keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
            if keys:
                token = keys[0].encode()
        if not token or not any(hmac.compare_digest(token, k) for k in self._keys):
            raise unauthorized()

    def _tokenize_backend(self, model: str) -> str | None:
        healthy = self.membership.routable_for(model)
        return healthy[0].url if healthy else None

    # --- lifecycle -----------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start ingestion, the static fleet and health checks; the first probe round completes (and
        healthy backends finish their index bootstrap) before serving."""
        self.index.start()
        self.membership.reconcile("config", self.config.backends, "in the config file")
        await self.health.check_all()
        await self.fleet.settle()
        self.fleet.start()
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._housekeeping(), name="kvrouter-housekeeping")
        )
        if self.worker is not None:
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._publish_stats(self.worker), name="kvrouter-stats"
                )
            )
        healthy = self._healthy_names()
        log.info(
            "kvrouter ready: policy=%s, %d/%d backends healthy (%s), %d event sources",
            self.config.policy.name,
            len(healthy),
            len(self.membership.members),
            ", ".join(healthy) or "none",
            len(self.index.status()),
        )

    async def shutdown(self) -> None:
        """Stop background work and close connections (in-flight requests were drained by the server)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.fleet.stop()
        self.index.stop()
        self.tokenizer.close()
        self.pool.close()
        await self.client.aclose()

    async def _publish_stats(self, worker: WorkerContext) -> None:
        """Publish this worker's figures for the merged /metrics and dashboard
        (:mod:`router.workers.stats`)."""
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
        )
        data["pd"] = self.pd_metrics.dashboard()  # P/D panel (router/pd/metrics.py)
        return data

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            self.index.purge_predictions()

    # --- the FastAPI part ----------------------------------------------------------------------
    def _build_api(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self.startup()
            try:
                yield
            finally:
                await self.shutdown()

        api = FastAPI(title="kvrouter", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @api.exception_handler(ApiError)
        async def _api_error(_: Request, exc: ApiError) -> Response:
            return Response(exc.body(), status_code=exc.status, media_type="application/json")

        @api.exception_handler(RequestValidationError)
        async def _validation(_: Request, exc: RequestValidationError) -> Response:
            err = bad_request(f"invalid request: {exc.errors()}")
            return Response(err.body(), status_code=400, media_type="application/json")

        @api.exception_handler(StarletteHTTPException)
        async def _http(_: Request, exc: StarletteHTTPException) -> Response:
            err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error", "not_found")
            return Response(err.body(), status_code=exc.status_code, media_type="application/json")

        @api.middleware("http")
        async def _auth(request: Request, call_next: Any) -> Response:
            try:
                self.authorize(request.scope)
            except ApiError as err:
                return Response(err.body(), status_code=err.status, media_type="application/json")
            response: Response = await call_next(request)
            return response

        @api.get("/health")
        async def health() -> dict[str, Any]:
            if self.worker is not None:
                return {"status": "ok", "worker": self.worker.index, "pid": os.getpid()}
            return {"status": "ok"}

        @api.get("/ready")
        async def ready() -> Response:
            if not self.membership.any_routable():
                raise unavailable("no healthy backend")
            return JSONResponse({"status": "ready", "healthy_backends": self._healthy_names()})

        @api.get("/v1/models")
        async def models() -> dict[str, Any]:
            data = []
            for model, backends in self.membership.models().items():
                parent = next((b.lora_parents[model] for b in backends if model in b.lora_parents), None)
                card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvrouter"}
                if parent:
                    card["parent"] = parent
                card["backends"] = [b.name for b in backends]
                data.append(card)
            return {"object": "list", "data": data}

        @api.post("/route")
        async def route(request: Request) -> Response:
            try:
                raw = await read_body(request.scope, request.receive, self.config.server.max_body_bytes)
            except asyncio.CancelledError:
                return Response(status_code=499)
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError as exc:
                raise bad_request(f"The body is not valid JSON: {exc}") from None
            endpoint: Endpoint
            q = request.query_params.get("endpoint")
            if q in ("chat", "completions"):
                endpoint = q  # type: ignore[assignment]
            else:
                endpoint = "chat" if isinstance(body, dict) and "messages" in body else "completions"
            decided = await self.service.decide(endpoint, body, dry_run=True)
            return Response(msgspec.json.encode(decided.explain()), media_type="application/json")

        @api.get("/debug/index")
        async def debug_index() -> Response:
            out = {
                "worker": self.worker.index if self.worker is not None else None,
                "block_size": self.config.block_size,
                "residencies": self.index.store.total,
                "max_residencies": self.index.config.max_residencies,
                "evictions": self.index.evictions,
                "predicted_blocks": self.index.predicted_blocks(),
                "sources": [msgspec.to_builtins(s) for s in self.index.status()],
                "backends": [
                    {**b.describe(self.loads.local_active(b.targets)), "models": sorted(b.models)}
                    for b in list(self.membership.members.values())
                ],
                "membership": {
                    "counts": self.membership.counts(),
                    "transitions": [msgspec.to_builtins(t) for t in self.membership.transitions],
                },
            }
            return Response(msgspec.json.encode(out), media_type="application/json")

        @api.get("/metrics")
        async def metrics() -> Response:
            if self.worker is not None:
                text = render_merged(read_snapshots(self.worker.run_dir))
            else:
                text = self.metrics.render()
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        page = _dashboard_page()

        @api.get("/dashboard")
        async def dashboard() -> HTMLResponse:
            return HTMLResponse(page)

        @api.get("/dashboard/data")
        async def dashboard_json() -> Response:
            data = self._dashboard_live()
            if self.worker is not None:
                snaps = read_snapshots(self.worker.run_dir)
                data = merge_dashboard(data, snaps)
                data["pd"] = merge_dashboards([s.dashboard.get("pd") or {} for s in snaps])  # P/D panel
            return Response(msgspec.json.encode(data), media_type="application/json")

        return api

    def _healthy_names(self) -> list[str]:
        return [b.name for b in self.membership.members.values() if b.routable]


def _dashboard_page() -> str:
    try:
        return (importlib.resources.files("router") / "static" / "dashboard.html").read_text()
    except (FileNotFoundError, OSError):
        return "<!doctype html><title>kvrouter</title><p>dashboard page missing from the package</p>"


def create_app(config: RouterConfig) -> KVRouter:
    """The ASGI application for a configuration."""
    return KVRouter(config)


__all__ = ["KVRouter", "create_app"]
