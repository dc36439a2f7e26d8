"""Health of the fleet's members: active probes, passive failures, models, optional engine metrics.

Active checks run in one asyncio task: ``GET /health`` every ``interval_s``, each member's probe at
its own jittered moment of the interval and at most :attr:`HealthChecker.max_concurrent` at once
(one burst of every probe held the event loop ~0.3 s per round at 1,000 backends); a member never
probed yet goes first, without waiting for its moment. A member is skipped
after ``unhealthy_after`` consecutive failures and comes back at the first success. Its index entries
are kept meanwhile (a brief outage should not cost the cache state): a failed check is never a
membership change. A connection failure while proxying marks the member unhealthy at once (passive
check), so clients do not wait for the next probe. A member that joins is probed at once, not at the
next round, so it takes requests within milliseconds of its bootstrap. Models come from the spec or
from ``/v1/models``, refreshed with every probe; a model card with a ``parent`` is a LoRA adapter,
whose name salts the block keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable

import msgspec

from router.config import AUTO, BackendConfig, HealthConfig
from router.fleet.load import LoadTracker
from router.fleet.membership import Member, Membership
from router.net.upstream import RouterResourceError, UpstreamError, UpstreamPool

log = logging.getLogger("kvrouter.backends")

_LOGGED = "(went down, logged)"
"""The reason last logged for a member marked unhealthy by a failed request: its next probe's
error, whatever its wording, is the same outage."""

_METRIC_RE = re.compile(
    r"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc)"
    r"(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)",
    re.MULTILINE,
)


class HealthChecker:
    """Probes every member of a :class:`Membership`; owns the health-check task."""

    def __init__(
        self,
        membership: Membership,
        health: HealthConfig,
        client: UpstreamPool,
        loads: LoadTracker | None = None,
        discover: Callable[[Member, bool, float], Awaitable[None]] | None = None,
        *,
        max_concurrent: int = 32,
        rng: random.Random | None = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        """Probes of one round in flight at once, at most."""
        self.rng = rng or random.Random()
        """Draws each probe's moment within its share of the interval (the jitter)."""
        self.membership = membership
        self.health = health
        self.client = client
        self.loads = loads
        self.discover = discover
        """Reads the event streams of a ``kv_events = "auto"`` backend that answered (member, whether
        it comes back after a failed probe or joins, timeout): before the probe marks it healthy,
        so it is subscribed before it can become ready (router/fleet/kvsources.py)."""
        self._task: asyncio.Task[None] | None = None
        self._probes: dict[asyncio.Task[None], tuple[Member, BackendConfig]] = {}
        """Probes started by :meth:`probe_soon`, still running -> whom they probe, and its spec."""
        self.checks = 0
        self._stopped = False
        self._reported: dict[str, str] = {}
        """member -> the probe error last logged while it was not healthy (each reason logged once)."""

    def mark_failed(self, member: Member, error: str) -> None:
        """A proxied request could not reach the member: skip it until a probe succeeds."""
        if member.healthy:
            log.warning("backend %s marked unhealthy: %s", member.name, error)
            self._reported[member.name] = _LOGGED
        member.healthy = False
        member.failures = max(member.failures, self.health.unhealthy_after)
        member.last_error = error

    async def check(self, member: Member) -> None:
        """One probe: /health, then /v1/models (and /metrics when scraping)."""
        spec = member.declared  # results for a spec replaced meanwhile are dropped
        came_back = member.failures > 0 or not member.healthy
        timeout = self.health.timeout_s
        url = member.url
        headers = member.auth_headers
        models: set[str] | None = None
        parents: dict[str, str] = {}
        try:
            status, _ = await self.client.fetch("GET", f"{url}/health", headers, timeout=timeout)
            ok = status == 200
            error = "" if ok else f"/health answered {status}"
            if ok and spec.models is None:
                models, parents = await self._models(url, headers, timeout)
            elif ok:
                # models given in the config: /v1/models only tells which are LoRA adapters (their
                # blocks are salted by the adapter's name; taken for the base model they matched
                # blocks the engine cannot reuse), and its failure is not the backend's
                with contextlib.suppress(UpstreamError, ValueError, msgspec.DecodeError):
                    parents = (await self._models(url, headers, timeout))[1]
            if ok and self.discover is not None and spec.kv_events == AUTO:
                await self.discover(member, came_back, timeout)
            if ok and self.health.scrape_metrics and self.loads is not None:
                await self._scrape(member, url, headers, timeout)
        except RouterResourceError as exc:  # the router's shortage says nothing of the backend
            log.warning("health probe of %s skipped: %s", member.name, exc)
            return
        except (UpstreamError, ValueError) as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        if member.declared is not spec:
            return
        if models is not None:
            member.models = models
            member.models_known = True
            member.lora_parents = parents
        elif parents:
            member.lora_parents = {a: p for a, p in parents.items() if a in member.models}
        member.checked_at = time.time()
        if ok:
            if member.models:
                if not member.healthy:
                    models_list = ", ".join(sorted(member.models))
                    log.info("backend %s is healthy (models: %s)", member.name, models_list)
                self._reported.pop(member.name, None)
            elif self._reported.get(member.name) != "serves no model":
                self._reported[member.name] = "serves no model"
                log.warning("backend %s answers but serves no model: not routable", member.name)
            member.healthy = bool(member.models)
            member.failures = 0
            member.last_error = "" if member.models else "serves no model"
        else:
            member.failures += 1
            member.last_error = error
            reported = self._reported.get(member.name)
            if not member.healthy and reported != error:
                # (e.g. at start, or a backend that never came up: say why, once per reason; the
                # first probe after it went down says nothing the line that said so did not)
                self._reported[member.name] = error
                if reported != _LOGGED:
                    log.warning("backend %s is not healthy: %s", member.name, error)
            if member.healthy and member.failures >= self.health.unhealthy_after:
                log.warning("backend %s is unhealthy: %s", member.name, error)
                self._reported[member.name] = error
                member.healthy = False

    async def _models(
        self, url: str, headers: dict[str, str], timeout: float
    ) -> tuple[set[str], dict[str, str]]:
        status, body = await self.client.fetch("GET", f"{url}/v1/models", headers, timeout=timeout)
        if status != 200:
            raise ValueError(f"/v1/models answered {status}")
        payload = msgspec.json.decode(body)
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
        return models, parents

    async def _scrape(self, member: Member, url: str, headers: dict[str, str], timeout: float) -> None:
        assert self.loads is not None
        status, body = await self.client.fetch("GET", f"{url}/metrics", headers, timeout=timeout)
        if status != 200:
            return
        values: dict[str, float] = {}
        for name, _labels, value in _METRIC_RE.findall(body.decode("utf-8", "replace")):
            with contextlib.suppress(ValueError):
                v = float(value)
                if math.isfinite(v) and v >= 0:  # (a NaN made every cost NaN: no choice, a 500)
                    values[name] = values.get(name, 0.0) + v
        ranks = member.spec.dp_size
        usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
        for target in member.targets:  # vLLM reports the engine as a whole; spread evenly across ranks
            self.loads.set_engine_metrics(
                target,
                values.get("vllm:num_requests_waiting", 0.0) / ranks,
                values.get("vllm:num_requests_running", 0.0) / ranks,
                usage / ranks,
            )

    def probe_soon(self, member: Member) -> None:
        """Probe a member now, outside the periodic round (it just joined)."""
        if self._stopped:
            return  # (a member added while the router stops: nothing probes it any more)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not started yet: the first round probes it
        task = loop.create_task(self._probe_logged(member), name=f"kvrouter-probe-{member.name}")
        self._probes[task] = (member, member.declared)
        task.add_done_callback(lambda t: self._probes.pop(t, None))  # (stop() empties it)

    async def _probe_logged(self, member: Member) -> None:
        try:
            await self.check(member)
        except Exception:
            log.exception("probing %s failed", member.name)

    async def check_all(self, spread_s: float = 0.0) -> None:
        """Probe every member, at most :attr:`max_concurrent` at once. With ``spread_s`` the
        members already probed once start over that many seconds, member i of n at a random moment
        of its slot ``[i, i + 1) * spread_s / n`` (a member gone meanwhile is skipped); the others
        start at once. A member whose probe :meth:`probe_soon` started is still in flight for the
        same spec is not probed twice: that probe is awaited instead (at start-up, every member of
        the config file just joined, and was probed twice)."""
        members = self.membership.members
        for name in [n for n in self._reported if n not in members]:  # (bounded by the fleet)
            del self._reported[name]
        running = {id(m): t for t, (m, spec) in self._probes.items() if m.declared is spec}
        fresh = [m for m in members.values() if not m.checked_at]
        known = [m for m in members.values() if m.checked_at]
        loop = asyncio.get_running_loop()
        start = loop.time()
        slot = spread_s / len(known) if known and spread_s > 0 else 0.0
        started: list[asyncio.Future[None]] = []
        inflight: set[asyncio.Future[None]] = set()
        try:
            for i, m in enumerate(fresh + known):
                if slot and i >= len(fresh):
                    delay = start + (i - len(fresh) + self.rng.random()) * slot - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if members.get(m.name) is not m:
                        continue
                while len(inflight) >= self.max_concurrent:
                    _, pending = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    inflight = set(pending)
                probe: asyncio.Future[None] | None = running.get(id(m))
                if probe is None:
                    probe = loop.create_task(self.check(m), name=f"kvrouter-probe-{m.name}")
                started.append(probe)
                inflight.add(probe)
            await asyncio.gather(*started)
        finally:
            for t in started:  # (cancelled, or one probe failed: the others stop with the round)
                if t not in running.values():
                    t.cancel()
        self.checks += 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            interval = self.health.interval_s
            try:
                await self.check_all(spread_s=interval)
            except Exception:  # a bug in one probe must not end health checking
                log.exception("health check round failed")
            await asyncio.sleep(max(interval - (loop.time() - began), 0.0))

    def start(self) -> None:
        """Start the periodic health checks."""
        self._stopped = False
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvrouter-health")

    async def stop(self) -> None:
        """Stop the health checks and any probe in flight; no probe starts afterwards."""
        self._stopped = True
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        self._probes.clear()


__all__ = ["HealthChecker"]
