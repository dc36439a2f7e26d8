"""Backends: health, the models each serves (LoRA adapters included), and optional engine metrics.

Active health checks run in one asyncio task: ``GET /health`` every ``interval_s``; a backend is
skipped after ``unhealthy_after`` consecutive failures and comes back at the first success. Its
index entries are kept meanwhile (a brief outage should not cost the cache state). A connection
failure while proxying marks the backend unhealthy at once (passive check), so clients do not wait
for the next probe. Models come from the config or from ``/v1/models``, refreshed with every probe;
a model card with a ``parent`` is a LoRA adapter, whose name salts the block keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from urllib.parse import urlsplit

import httpx

from router.config import BackendConfig, HealthConfig
from router.fleet.load import LoadTracker
from router.http.upstream import UpstreamPool

log = logging.getLogger("kvrouter.backends")

_METRIC_RE = re.compile(
    r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc)"
    r"(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)",
    re.MULTILINE,
)


class Backend:
    """Runtime state of one backend."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.url = cfg.url.rstrip("/")
        self.upstream_key = UpstreamPool.key_of(self.url)
        self.base_path = urlsplit(self.url).path.rstrip("/")
        self.healthy = False
        self.failures = 0
        self.checked_at = 0.0
        self.last_error = ""
        self.models: set[str] = set(cfg.models or [])
        self.lora_parents: dict[str, str] = {}
        """LoRA adapter name -> base model, from /v1/models."""

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may go here."""
        return model in self.models

    @property
    def auth_headers(self) -> dict[str, str]:
        """Authorization towards the backend (never the client's key)."""
        return {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}


class BackendRegistry:
    """All backends, their health and models; owns the health-check task."""

    def __init__(
        self,
        backends: list[BackendConfig],
        health: HealthConfig,
        client: httpx.AsyncClient,
        loads: LoadTracker | None = None,
    ) -> None:
        self.backends = {b.name: Backend(b) for b in backends}
        self.health = health
        self.client = client
        self.loads = loads
        self._task: asyncio.Task[None] | None = None
        self.checks = 0

    # --- queries -------------------------------------------------------------------------------
    def get(self, name: str) -> Backend:
        """A backend by name."""
        return self.backends[name]

    def models(self) -> dict[str, list[Backend]]:
        """Every model served by the fleet -> the backends serving it (healthy or not)."""
        out: dict[str, list[Backend]] = {}
        for b in self.backends.values():
            for m in sorted(b.models):
                out.setdefault(m, []).append(b)
        return out

    def known(self, model: str) -> bool:
        """Any backend (healthy or not) serves this model."""
        return any(b.serves(model) for b in self.backends.values())

    def healthy_for(self, model: str) -> list[Backend]:
        """Healthy backends serving ``model``."""
        return [b for b in self.backends.values() if b.healthy and b.serves(model)]

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter name when ``model`` is one (its blocks are salted by it), else None."""
        for b in self.backends.values():
            if model in b.lora_parents:
                return model
        return None

    def any_healthy(self) -> bool:
        """At least one backend is healthy."""
        return any(b.healthy for b in self.backends.values())

    # --- checks --------------------------------------------------------------------------------
    def mark_failed(self, backend: Backend, error: str) -> None:
        """A proxied request could not reach the backend: skip it until a probe succeeds."""
        if backend.healthy:
            log.warning("backend %s marked unhealthy: %s", backend.name, error)
        backend.healthy = False
        backend.failures = max(backend.failures, self.health.unhealthy_after)
        backend.last_error = error

    async def check(self, backend: Backend) -> None:
        """One probe: /health, then /v1/models (and /metrics when scraping)."""
        timeout = self.health.timeout_s
        try:
            r = await self.client.get(f"{backend.url}/health", timeout=timeout, headers=backend.auth_headers)
            ok = r.status_code == 200
            error = "" if ok else f"/health answered {r.status_code}"
            if ok and backend.cfg.models is None:
                await self._refresh_models(backend, timeout)
            if ok and self.health.scrape_metrics and self.loads is not None:
                await self._scrape(backend, timeout)
        except (httpx.HTTPError, ValueError) as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        backend.checked_at = time.time()
        if ok:
            if not backend.healthy:
                log.info(
                    "backend %s is healthy (models: %s)",
                    backend.name,
                    ", ".join(sorted(backend.models)) or "-",
                )
            backend.healthy = bool(backend.models)
            backend.failures = 0
            backend.last_error = "" if backend.models else "serves no model"
        else:
            backend.failures += 1
            backend.last_error = error
            if backend.healthy and backend.failures >= self.health.unhealthy_after:
                log.warning("backend %s is unhealthy: %s", backend.name, error)
                backend.healthy = False

    async def _refresh_models(self, backend: Backend, timeout: float) -> None:
        r = await self.client.get(f"{backend.url}/v1/models", timeout=timeout, headers=backend.auth_headers)
        r.raise_for_status()
        payload = r.json()
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            raise ValueError("/v1/models did not return {'data': [...]}")
        models = set()
        parents = {}
        for card in data:
            if not isinstance(card, dict):
                continue
            mid = card.get("id")
            if not isinstance(mid, str):
                continue
            models.add(mid)
            parent = card.get("parent")
            if isinstance(parent, str) and parent and parent != mid:
                parents[mid] = parent
        backend.models = models
        backend.lora_parents = parents

    async def _scrape(self, backend: Backend, timeout: float) -> None:
        assert self.loads is not None
        r = await self.client.get(f"{backend.url}/metrics", timeout=timeout, headers=backend.auth_headers)
        if r.status_code != 200:
            return
        values: dict[str, float] = {}
        for name, _labels, value in _METRIC_RE.findall(r.text):
            with contextlib.suppress(ValueError):
                values[name] = values.get(name, 0.0) + float(value)
        ranks = backend.cfg.dp_size
        usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
        for rank in range(ranks):  # vLLM reports the engine as a whole; spread evenly across ranks
            self.loads.set_engine_metrics(
                (backend.name, rank),
                values.get("vllm:num_requests_waiting", 0.0) / ranks,
                values.get("vllm:num_requests_running", 0.0) / ranks,
                usage / ranks,
            )

    async def check_all(self) -> None:
        """Probe every backend concurrently."""
        await asyncio.gather(*(self.check(b) for b in self.backends.values()))
        self.checks += 1

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug in one probe must not end health checking
                log.exception("health check round failed")
            await asyncio.sleep(self.health.interval_s)

    def start(self) -> None:
        """Start the periodic health checks."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvrouter-health")

    async def stop(self) -> None:
        """Stop the health checks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
