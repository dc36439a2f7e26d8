"""A fleet that keeps changing under a running router, with a steady client: the churn soak.

Mock engines run as their own processes (`kvrouter mock-engine`), so that a "vanish" is a real
SIGKILL: connections reset, nothing is announced. Every ``interval_s`` the driver does one of:

- **join**: start an engine and add it through the router's admin API (``PUT /admin/backends``);
- **drain**: ``DELETE /admin/backends/NAME``, wait until the router removed it, then stop the engine;
- **vanish**: SIGKILL an engine without telling the router first (as a node failure does), and remove
  it from the membership a little later (as Kubernetes does once the pod object goes).

Meanwhile ``clients`` coroutines send a steady mix of chat and completions, streaming and not, short
and longer prompts. Every response is classified:

- ``ok``: a complete response (a JSON body, or an SSE stream that ends with ``[DONE]``);
- ``killed_mid_stream``: an SSE stream that ended with a clean error event because the engine it was
  on was killed while it streamed (allowed: nothing can save those);
- ``failed``: anything else (a 5xx, a truncated body, a malformed stream, a timeout): the count that
  must stay zero.

Bounded: the run lasts ``seconds``, the fleet stays between ``min_engines`` and ``max_engines``
engines on 127.0.0.1, and every request has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from sim.procs import EngineProc


class ChurnConfig(msgspec.Struct, kw_only=True):
    """One soak run."""

    seconds: float = 30.0
    interval_s: float = 2.0
    """One membership change this often."""
    min_engines: int = 2
    max_engines: int = 5
    clients: int = 4
    """Concurrent client loops (each sends its next request when the last one ended)."""
    stream_share: float = 0.5
    chat_share: float = 0.5
    request_timeout_s: float = 30.0
    time_scale: float = 0.05
    """The mock engines' time scale (0.05: a 16-token answer in about 25 ms)."""
    max_tokens: int = 16
    seed: int = 0
    pattern: list[str] = []
    """Membership changes to cycle through ("join", "drain", "vanish"); empty: random. A change the
    engine bounds forbid at that moment is replaced by an allowed one."""
    tokenizer: str | None = None
    """A tokenizer directory both the engines and the router use (sim.toy_tokenizer)."""
    model: str = "mock-model"


@dataclass
class ChurnReport:
    """What happened, and the counts that matter."""

    requests: int = 0
    ok: int = 0
    killed_mid_stream: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    joins: int = 0
    drains: int = 0
    vanishes: int = 0
    served_by: dict[str, int] = field(default_factory=dict)
    first_request_s: list[float] = field(default_factory=list)
    """Per join: seconds from the PUT to the first request the new engine served."""
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        firsts = sorted(self.first_request_s)
        return {
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "ok": self.ok,
            "killed_mid_stream": self.killed_mid_stream,
            "failed": self.failed,
            "joins": self.joins,
            "drains": self.drains,
            "vanishes": self.vanishes,
            "engines_served": len(self.served_by),
            "join_to_first_request_s": {
                "n": len(firsts),
                "p50": round(firsts[len(firsts) // 2], 3) if firsts else None,
                "max": round(firsts[-1], 3) if firsts else None,
            },
            "first_failures": self.failures[:10],
        }


class Churn:
    """Drives one soak run against a router (its URL and admin key)."""

    def __init__(
        self, router_url: str, admin_key: str, cfg: ChurnConfig, client_key: str | None = None
    ) -> None:
        self.url = router_url.rstrip("/")
        self.admin = {"authorization": f"Bearer {admin_key}"}
        self.client_headers = {"authorization": f"Bearer {client_key}"} if client_key else {}
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.engines: dict[str, EngineProc] = {}
        self.gone: dict[str, EngineProc] = {}
        self.report = ChurnReport()
        self._n = 0
        self._changes = 0
        self._joined_at: dict[str, float] = {}
        self._stop = asyncio.Event()

    # --- engines ---------------------------------------------------------------------------------
    async def _spawn(self) -> EngineProc:
        self._n += 1
        args = ["--time-scale", str(self.cfg.time_scale), "--model", self.cfg.model, "--gpu-blocks", "4096"]
        if self.cfg.tokenizer:
            args += ["--tokenizer", self.cfg.tokenizer]
        e = EngineProc(f"churn-{self._n}", args)
        await e.start()
        return e

    async def _members(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        r = await client.get(f"{self.url}/admin/backends", headers=self.admin)
        r.raise_for_status()
        return {b["name"]: b for b in r.json()["backends"]}

    async def join(self, client: httpx.AsyncClient) -> None:
        e = await self._spawn()
        body = {"url": e.url, "kv_events": e.kv_events, "kv_replay": e.kv_replay, "models": [self.cfg.model]}
        self._joined_at[e.name] = time.monotonic()
        r = await client.put(f"{self.url}/admin/backends/{e.name}", json=body, headers=self.admin)
        if r.status_code != 201:
            raise RuntimeError(f"PUT {e.name}: {r.status_code} {r.text}")
        self.engines[e.name] = e
        self.report.joins += 1

    async def drain(self, client: httpx.AsyncClient, name: str) -> None:
        e = self.engines.pop(name)
        r = await client.delete(f"{self.url}/admin/backends/{name}", headers=self.admin)
        if r.status_code != 200:
            raise RuntimeError(f"DELETE {name}: {r.status_code} {r.text}")
        deadline = time.monotonic() + 60
        while name in await self._members(client):  # its requests finish, then it is removed
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not removed within 60 s")
            await asyncio.sleep(0.05)
        await e.stop()
        self.gone[name] = e
        self.report.drains += 1

    async def vanish(self, client: httpx.AsyncClient, name: str) -> None:
        e = self.engines.pop(name)
        e.killed_at = time.monotonic()
        self.gone[name] = e  # before the kill: its streams may end while we wait for the process
        await e.stop(kill=True)
        self.report.vanishes += 1
        await asyncio.sleep(self.cfg.interval_s / 2)  # the router notices by itself meanwhile
        await client.delete(f"{self.url}/admin/backends/{name}", headers=self.admin)

    # --- the client ------------------------------------------------------------------------------
    def _body(self, i: int) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        long = rng.random() < 0.3
        words = " ".join(f"w{rng.randrange(500)}" for _ in range(rng.randrange(200, 400) if long else 12))
        shared = "You are a helpful assistant for the churn soak. " * (4 if long else 1)
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": self.cfg.max_tokens}
        if rng.random() < self.cfg.stream_share:
            body["stream"] = True
        if rng.random() < self.cfg.chat_share:
            body["messages"] = [
                {"role": "system", "content": shared},
                {"role": "user", "content": f"{i} {words}"},
            ]
            return "/v1/chat/completions", body
        body["prompt"] = f"{shared}{i} {words}"
        return "/v1/completions", body

    def _fail(self, why: str) -> None:
        self.report.failed += 1
        if len(self.report.failures) < 50:
            self.report.failures.append(why)

    def _served(self, backend: str) -> None:
        self.report.served_by[backend] = self.report.served_by.get(backend, 0) + 1
        joined = self._joined_at.pop(backend, None)
        if joined is not None:
            self.report.first_request_s.append(time.monotonic() - joined)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        path, body = self._body(i)
        self.report.requests += 1
        try:
            if body.get("stream"):
                await self._stream(client, path, body)
            else:
                r = await client.post(f"{self.url}{path}", json=body, headers=self.client_headers)
                if r.status_code != 200:
                    return self._fail(f"{path} -> {r.status_code} {r.text[:200]}")
                data = r.json()  # a truncated body would not decode
                if not data.get("choices"):
                    return self._fail(f"{path} -> 200 without choices: {r.text[:200]}")
                self._served(r.headers.get("x-kvrouter-backend", "?"))
                self.report.ok += 1
        except (httpx.HTTPError, ValueError) as exc:
            self._fail(f"{path} -> {type(exc).__name__}: {exc}")

    async def _stream(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        async with client.stream("POST", f"{self.url}{path}", json=body, headers=self.client_headers) as r:
            if r.status_code != 200:
                await r.aread()
                return self._fail(f"{path} stream -> {r.status_code} {r.text[:200]}")
            backend = r.headers.get("x-kvrouter-backend", "?")
            raw = b""
            async for chunk in r.aiter_raw():
                raw += chunk
        events = [e for e in raw.decode("utf-8", "replace").split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]" or not all(e.startswith("data: ") for e in events):
            return self._fail(f"{path} stream from {backend} malformed: ...{raw[-200:]!r}")
        for e in events[:-1]:
            obj = json.loads(e[6:])
            if "error" in obj:
                killed = self.gone.get(backend)
                if killed is not None and killed.killed_at is not None:
                    self.report.killed_mid_stream += 1
                    return None
                return self._fail(f"{path} stream from {backend} ended with an error: {obj['error']}")
        self._served(backend)
        self.report.ok += 1
        return None

    async def _client_loop(self, client: httpx.AsyncClient, k: int) -> None:
        i = k
        while not self._stop.is_set():
            await self._one(client, i)
            i += self.cfg.clients

    # --- the run ---------------------------------------------------------------------------------
    async def run(self) -> ChurnReport:
        cfg = self.cfg
        timeout = httpx.Timeout(cfg.request_timeout_s)
        limits = httpx.Limits(max_connections=cfg.clients + 4, max_keepalive_connections=cfg.clients + 4)
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            try:
                for _ in range(cfg.min_engines):
                    await self.join(client)
                await self._wait_ready(client)
                self._joined_at.clear()
                loops = [asyncio.create_task(self._client_loop(client, k)) for k in range(cfg.clients)]
                deadline = time.monotonic() + cfg.seconds
                while time.monotonic() < deadline:
                    await asyncio.sleep(cfg.interval_s)
                    await self._change(client)
                self._stop.set()
                await asyncio.gather(*loops)
            finally:
                self._stop.set()
                for e in list(self.engines.values()):
                    await e.stop()
                self.engines.clear()
        self.report.seconds = time.monotonic() - started
        return self.report

    async def _wait_ready(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 60
        while not all(m["state"] == "ready" for m in (await self._members(client)).values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the first engines did not become ready")
            await asyncio.sleep(0.05)

    async def _change(self, client: httpx.AsyncClient) -> None:
        n = len(self.engines)
        choices = []
        if n < self.cfg.max_engines:
            choices.append("join")
        if n > self.cfg.min_engines:
            choices += ["drain", "vanish"]
        action = self.rng.choice(choices)
        if self.cfg.pattern:
            wanted = self.cfg.pattern[self._changes % len(self.cfg.pattern)]
            action = wanted if wanted in choices else action
        self._changes += 1
        if action == "join":
            await self.join(client)
        else:
            name = self.rng.choice(sorted(self.engines))
            await (self.drain(client, name) if action == "drain" else self.vanish(client, name))


def write_router_config(
    path: Path, port: int, admin_key: str, tokenizer: str | None, extra: str = ""
) -> None:
    """A router config for a soak: no static backends, the admin API on, quick health checks."""
    tok = f'tokenizer = "{tokenizer}"\n' if tokenizer else ""
    path.write_text(
        f'{tok}admin_keys = ["{admin_key}"]\n'
        f"[server]\nport = {port}\nread_timeout_s = 30\n"
        "[health]\ninterval_s = 1.0\nunhealthy_after = 1\n"
        "[membership]\ndrain_timeout_s = 30\n" + extra
    )


@contextlib.contextmanager
def soak_router(
    workdir: Path, admin_key: str, tokenizer: str | None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A `kvrouter serve` process on an ephemeral port with :func:`write_router_config`'s config,
    up (``/health`` answers) before it is yielded as (url, process); SIGTERMed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg_path = workdir / "router.toml"
    write_router_config(cfg_path, port, admin_key, tokenizer)
    root = Path(__file__).resolve().parents[1]
    with (workdir / "router.log").open("wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline or router.poll() is not None:
                    raise RuntimeError(f"router did not start (log: {workdir / 'router.log'})")
                time.sleep(0.1)  # (polling pace; the condition is the router answering)
            yield url, router
        finally:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(60)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(10)


__all__ = ["Churn", "ChurnConfig", "ChurnReport", "soak_router", "write_router_config"]
