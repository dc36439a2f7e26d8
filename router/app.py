"""Assembles the router: index, backends, policy, tokenizer, proxy, metrics and the HTTP endpoints.

The ASGI entry point sends the two proxied POST paths to the lean :class:`router.http.proxy.ProxyHandler`
and everything else to a FastAPI app: ``/health``, ``/ready``, ``/v1/models``, ``/route``,
``/debug/index``, ``/metrics``, ``/dashboard`` and ``/dashboard/data``. All objects are created here
and passed in explicitly; nothing is module-global, so tests can run several routers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib.resources
import logging
import os
from typing import Any
from urllib.parse import parse_qs

import httpx
import msgspec
import zmq

from index._kvcore import json_prompt
from index.keys import TokenBuffer
from index.kvindex import KVIndex
from index.subscriber import SourceConfig
from router.config import RouterConfig, rank_endpoint
from router.decision.policy import Policy
from router.decision.service import Endpoint, RouterService
from router.decision.tokenizer import ChatTokenizer, RequestTokenizer
from router.fleet.backends import BackendRegistry
from router.fleet.load import LoadTracker
from router.http.asgi import Receive, Scope, Send
from router.http.errors import bad_request, unauthorized, unavailable
from router.http.proxy import PATHS, ProxyHandler
from router.http.upstream import UpstreamPool
from router.observe.metrics import RouterMetrics, dashboard_data
from router.workers.stats import SnapshotWriter, families_of, merge_dashboard, read_snapshots, render_merged
from router.workers.supervisor import WorkerContext

log = logging.getLogger("kvrouter")


def event_sources(cfg: RouterConfig) -> list[SourceConfig]:
    """One event source per (backend, DP rank) with KV events configured (vLLM's port+rank rule)."""
    out = []
    for b in cfg.backends:
        if b.kv_events is None:
            continue
        for rank in range(b.dp_size):
            out.append(
                SourceConfig(
                    instance=b.name,
                    dp_rank=rank,
                    endpoint=rank_endpoint(b.kv_events, rank),
                    replay_endpoint=rank_endpoint(b.kv_replay, rank) if b.kv_replay else None,
                    bind=b.kv_bind,
                    topic=b.kv_topic if b.kv_topic is not None else cfg.kv_topic,
                )
            )
    return out


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
        for source in event_sources(config):
            self.index.add_source(source)
        srv = config.server
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=64,  # health checks and /tokenize only; the proxy has its own pool
                keepalive_expiry=60.0,
            ),
            timeout=httpx.Timeout(srv.read_timeout_s, connect=srv.connect_timeout_s),
        )
        self.loads = LoadTracker(worker.board(config), worker.index) if worker else LoadTracker()
        self.registry = BackendRegistry(list(config.backends), config.health, self.client, self.loads)
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
            self.index, self.registry, self.loads, self.policy, self.tokenizer, config.recent_decisions
        )
        caches = [t.segments for t in loaded.values()]
        self.metrics = RouterMetrics(self.index, self.registry, self.loads, caches)
        self.pool = UpstreamPool(
            srv.connect_timeout_s, srv.read_timeout_s, srv.max_connections, srv.keepalive_expiry_s
        )
        self.proxy = ProxyHandler(self.service, self.pool, self.metrics, self.loads, srv, self.authorize)
        self._keys = [k.encode() for k in config.api_keys]
        self._tasks: list[asyncio.Task[None]] = []

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
        healthy = self.registry.healthy_for(model)
        return healthy[0].url if healthy else None

    # --- lifecycle -----------------------------------------------------------------------------
    async def startup(self) -> None:
        """Start ingestion and health checks; the first probe round completes before serving."""
        self.index.start()
        await self.registry.check_all()
        self.registry.start()
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._housekeeping(), name="kvrouter-housekeeping")
        )
        if self.worker is not None:
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._publish_stats(self.worker), name="kvrouter-stats"
                )
            )
        healthy = [b.name for b in self.registry.backends.values() if b.healthy]
        log.info(
            "kvrouter ready: policy=%s, %d/%d backends healthy (%s), %d event sources",
            self.config.policy.name,
            len(healthy),
            len(self.registry.backends),
            ", ".join(healthy) or "none",
            len(event_sources(self.config)),
        )

    async def shutdown(self) -> None:
        """Stop background work and close connections (in-flight requests were drained by the server)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.registry.stop()
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
        return dashboard_data(
            self.metrics,
            self.index,
            self.registry,
            self.loads,
            self.config.policy.name,
            [r.explain() for r in list(self.service.recent)[-20:]],
        )

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            self.index.purge_predictions()

    # --- the FastAPI part ----------------------------------------------------------------------
    @functools.cached_property
    def api(self) -> Any:
        """The FastAPI app (:mod:`router.http.framework`), built on first use: ``kvrouter serve``
        answers every usual endpoint natively and needs it only for odd requests (unknown paths,
        other methods, HEAD), so it is not even imported unless one comes (~30 MB and ~0.4 s of
        start-up); ASGI servers use it for everything."""
        from router.http.framework import build_api

        return build_api(self)

    # --- answers shared by the FastAPI routes and the native ones (router/http/native.py) ----------
    def health_body(self) -> dict[str, Any]:
        """``GET /health``."""
        if self.worker is not None:
            return {"status": "ok", "worker": self.worker.index, "pid": os.getpid()}
        return {"status": "ok"}

    def ready_body(self) -> dict[str, Any]:
        """``GET /ready``; 503 when no backend is healthy."""
        if not self.registry.any_healthy():
            raise unavailable("no healthy backend")
        return {"status": "ready", "healthy_backends": self._healthy_names()}

    def models_body(self) -> dict[str, Any]:
        """``GET /v1/models``: every model some backend serves, with the backends serving it."""
        data = []
        for model, backends in self.registry.models().items():
            parent = next((b.lora_parents[model] for b in backends if model in b.lora_parents), None)
            card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "kvrouter"}
            if parent:
                card["parent"] = parent
            card["backends"] = [b.name for b in backends]
            data.append(card)
        return {"object": "list", "data": data}

    async def route_answer(self, raw: bytes, query: bytes) -> bytes:
        """``POST /route``: the decision for a request body, explained (nothing is sent); raises
        :class:`ApiError` for a bad body."""
        body = _token_prompt_body(raw)
        if body is None:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError as exc:
                raise bad_request(f"The body is not valid JSON: {exc}") from None
        endpoint: Endpoint
        q = parse_qs(query.decode("latin-1")).get("endpoint", [None])[-1] if query else None
        if q in ("chat", "completions"):
            endpoint = q  # type: ignore[assignment]
        else:
            endpoint = "chat" if isinstance(body, dict) and "messages" in body else "completions"
        decided = await self.service.decide(endpoint, body, dry_run=True)
        return msgspec.json.encode(decided.explain())

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
            "backends": [
                {
                    "name": b.name,
                    "url": b.url,
                    "healthy": b.healthy,
                    "failures": b.failures,
                    "last_error": b.last_error,
                    "checked_at": b.checked_at,
                    "models": sorted(b.models),
                    "dp_size": b.cfg.dp_size,
                }
                for b in self.registry.backends.values()
            ],
        }

    def metrics_text(self) -> bytes:
        """``GET /metrics``: Prometheus text (every worker's figures merged when there are several)."""
        if self.worker is not None:
            return render_merged(read_snapshots(self.worker.run_dir))
        return self.metrics.render()

    @functools.cached_property
    def dashboard_page(self) -> str:
        """``GET /dashboard``: the page (static HTML)."""
        return _dashboard_page()

    def dashboard_body(self) -> dict[str, Any]:
        """``GET /dashboard/data``: the live figures the page polls."""
        data = self._dashboard_live()
        if self.worker is not None:
            data = merge_dashboard(data, read_snapshots(self.worker.run_dir))
        return data

    def _healthy_names(self) -> list[str]:
        return [b.name for b in self.registry.backends.values() if b.healthy]


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
        body = msgspec.json.decode(raw[:start] + b"0" + raw[end:])
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    body["prompt"] = TokenBuffer(ids)
    return body


def _dashboard_page() -> str:
    try:
        return (importlib.resources.files("router") / "static" / "dashboard.html").read_text()
    except (FileNotFoundError, OSError):
        return "<!doctype html><title>kvrouter</title><p>dashboard page missing from the package</p>"


def create_app(config: RouterConfig) -> KVRouter:
    """The ASGI application for a configuration."""
    return KVRouter(config)


__all__ = ["KVRouter", "create_app", "event_sources"]
