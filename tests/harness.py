"""Real servers for end-to-end tests: uvicorn on 127.0.0.1 ephemeral ports in background threads.

`FakeEngine` is a scriptable OpenAI-compatible backend written for the tests: it records what it
receives (headers included), can fail, stall or stream slowly on demand, and owns one real
vLLM-layout KV event publisher per DP rank on consecutive ports (vLLM's port + rank rule), through
which tests announce exactly the blocks they want the router to see.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from index.keys import prompt_keys
from sim.publisher import BlockStored, KVEventPublisher

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""The headless browser the dashboard tests drive (CI installs Debian's chromium)."""
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""Under CI, what a test needs must be there: a missing tool fails instead of skipping."""

TIMEOUT = 30.0


def wait_for(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll a condition with a generous deadline (never a fixed sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class ThreadedServer:
    """uvicorn in a thread, bound to 127.0.0.1:0; stop() shuts it down and joins."""

    def __init__(self, app: Any) -> None:
        self.config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        self.thread.start()
        wait_for(lambda: self.server.started, "server start")
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)


def consecutive_publishers(ctx: zmq.Context[Any], n: int) -> list[KVEventPublisher]:
    """n publishers whose PUB and ROUTER ports are base + rank (retrying until a free run is found)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 * n >= 65535:
            continue
        pubs: list[KVEventPublisher] = []
        try:
            for r in range(n):
                pubs.append(
                    KVEventPublisher(
                        endpoint=f"tcp://127.0.0.1:{base + r}",
                        replay_endpoint=f"tcp://127.0.0.1:{base + n + r}",
                        dp_rank=r,
                        ctx=ctx,
                    )
                )
            return pubs
        except zmq.ZMQError:
            for p in pubs:
                p.close()
    raise RuntimeError("no run of free ports found")


class FakeEngine:
    """A scriptable OpenAI backend with KV event publishers (one per DP rank)."""

    def __init__(self, name: str, ctx: zmq.Context[Any], model: str = "toy", dp_size: int = 1) -> None:
        self.name = name
        self.model = model
        self.dp_size = dp_size
        self.requests: list[dict[str, Any]] = []
        self.mode = "ok"  # ok | error500 | error400 | stall | slow_stream | held_stream | broken_stream | ...
        self.release = False
        """held_stream: the stream ends once this is set (and then streamed `streamed` words)."""
        self.streamed = 0
        self.pd_params: dict[str, Any] | None = None
        """Answer prefill legs (kv_transfer_params.do_remote_decode) with these transfer parameters."""
        self.delay_s = 0.0
        self.prefill_s = 0.0
        """Streams: seconds between the response headers and the first chunk (vLLM's prefill)."""
        self.disconnected = 0
        self.publishers = consecutive_publishers(ctx, dp_size)
        self._hashes = 0
        self.server = ThreadedServer(self._app()).start()

    # --- KV events -----------------------------------------------------------------------------
    def announce(self, tokens: list[int], block_size: int, rank: int = 0, medium: str = "GPU") -> int:
        """Publish BlockStored for every full block of ``tokens`` on one rank; returns the block count."""
        n = len(tokens) // block_size
        if n == 0:
            return 0
        hashes = [self._next_hash() for _ in range(n)]
        self.publishers[rank].publish(
            [BlockStored(hashes, None, tokens[: n * block_size], block_size, None, medium, None)]
        )
        return n

    def _next_hash(self) -> int:
        self._hashes += 1
        return (hash(self.name) * 1_000_003 + self._hashes) % 2**64

    @property
    def kv_events(self) -> str:
        return self.publishers[0].endpoint

    @property
    def kv_replay(self) -> str:
        rep = self.publishers[0].replay_endpoint
        assert rep is not None
        return rep

    @property
    def url(self) -> str:
        return self.server.url

    def backend_toml(self, role: str = "both") -> str:
        return (
            f'[[backends]]\nname = "{self.name}"\nurl = "{self.url}"\nkv_events = "{self.kv_events}"\n'
            f'kv_replay = "{self.kv_replay}"\ndp_size = {self.dp_size}\nrole = "{role}"\n'
        )

    def close(self) -> None:
        self.server.stop()
        for p in self.publishers:
            p.close()

    # --- HTTP ----------------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": engine.model, "object": "model", "parent": None}]}

        async def handle(request: Request, chat: bool) -> Response:
            body = await request.json()
            engine.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if engine.mode == "error500":
                return JSONResponse(
                    {"error": {"message": "boom", "type": "internal", "code": 500}}, status_code=500
                )
            if engine.mode == "error400":
                return JSONResponse(
                    {
                        "error": {
                            "message": "bad prompt",
                            "type": "BadRequestError",
                            "param": "prompt",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            if engine.mode == "stall":  # no headers for up to 30 s, like vLLM generating a non-stream reply
                for _ in range(600):
                    await asyncio.sleep(0.05)
                    if engine.mode != "stall":
                        break  # released by the test
                    if await request.is_disconnected():
                        engine.disconnected += 1
                        return Response(status_code=499)
            if engine.delay_s:
                await asyncio.sleep(engine.delay_s)
            rid = uuid.uuid4().hex
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            params = body.get("kv_transfer_params")
            transfer = (
                engine.pd_params if isinstance(params, dict) and params.get("do_remote_decode") else None
            )
            if body.get("stream"):
                return StreamingResponse(engine._chunks(rid, chat, request), media_type="text/event-stream")
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"hello from {engine.name}"},
                    "finish_reason": "stop",
                }
                return JSONResponse(
                    {
                        "id": rid,
                        "object": "chat.completion",
                        "created": 1,
                        "model": engine.model,
                        "choices": [choice],
                        "usage": usage,
                        "kv_transfer_params": transfer,
                    }
                )
            choice = {
                "index": 0,
                "text": f"hello from {engine.name}",
                "finish_reason": "length",
                "logprobs": None,
            }
            return JSONResponse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": 1,
                    "model": engine.model,
                    "choices": [choice],
                    "usage": usage,
                    "kv_transfer_params": transfer,
                }
            )

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await handle(request, chat=True)

        return app

    def _held_words(self) -> Iterator[str]:
        self.streamed = 0
        while not self.release:
            self.streamed += 1
            yield f" w{self.streamed}"

    async def _chunks(self, rid: str, chat: bool, request: Request) -> AsyncIterator[bytes]:
        repeat = {"slow_stream": 200, "short_stream": 10}.get(self.mode, 1)
        words = ["hello", " from", f" {self.name}"] * repeat
        held = self.mode == "held_stream"  # a word every 20 ms until the test sets `release`
        try:
            if self.prefill_s:
                await asyncio.sleep(self.prefill_s)
            for i, w in enumerate(self._held_words() if held else words):
                if self.mode == "broken_stream" and i == 2:
                    raise RuntimeError("engine crashed mid-stream")
                if chat:
                    chunk = {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": 1,
                        "model": self.model,
                        "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
                    }
                else:
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": 1,
                        "model": self.model,
                        "choices": [{"index": 0, "text": w, "finish_reason": None, "logprobs": None}],
                    }
                event = f"data: {json.dumps(chunk)}\n\n".encode()
                if self.mode == "broken_mid_event" and i == 1:
                    yield event[:20]  # half an event, then the engine dies
                    await asyncio.sleep(0.05)  # (a separate chunk on the wire)
                    raise RuntimeError("engine crashed mid-event")
                yield event
                if self.mode in ("slow_stream", "short_stream"):
                    await asyncio.sleep(0.05)
                elif held:
                    await asyncio.sleep(0.02)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnected += 1
            raise


class NativeServer:
    """`kvrouter serve`'s HTTP server (uvicorn with kvrouter's limits) in a thread with its own event loop,
    on 127.0.0.1:0; stop() drains, shuts the router down and joins."""

    def __init__(self, app: Any) -> None:
        from router.http.uvicorn_server import HttpServer, loop_factory

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.server = HttpServer(app, sock=self.sock)
        self._factory = loop_factory()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.server.start()
            self.started.set()
            try:
                await self._stop.wait()
            finally:
                await self.server.stop()

        try:
            with asyncio.Runner(loop_factory=self._factory) as runner:
                runner.run(body())
        except BaseException as exc:  # surfaced by start()/stop()
            self.error = exc
            self.started.set()

    def start(self) -> NativeServer:
        self.thread.start()
        wait_for(self.started.is_set, "router start")
        if self.error is not None:
            raise self.error
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(TIMEOUT)
        self.sock.close()
        if self.thread.is_alive():  # where it hangs, for the report
            import sys
            import traceback

            frame = sys._current_frames().get(self.thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            tasks = ""
            if self._loop is not None:
                tasks = "\n".join(repr(t) for t in asyncio.all_tasks(self._loop))
            raise AssertionError(f"router thread did not stop:\n{stack}\ntasks:\n{tasks}")


class RouterRunner:
    """The real router (KVRouter on `kvrouter serve`'s HTTP server, as `kvrouter serve` runs it) for a
    TOML config written by the test; ``asgi=True`` runs the same router under uvicorn instead
    (``AsgiApp(KVRouter)``)."""

    def __init__(self, toml: str, tmp: Path, asgi: bool = False, config_file: bool = False) -> None:
        from router.app import KVRouter
        from router.config import load_config
        from router.http.asgi import AsgiApp

        path = tmp / f"fleet-{uuid.uuid4().hex[:6]}.toml"
        path.write_text(toml)
        self.path = path
        """The config file (reloaded on change when ``config_file``)."""
        self.app = KVRouter(load_config(path), config_path=path if config_file else None)
        self.server: NativeServer | ThreadedServer = (
            ThreadedServer(AsgiApp(self.app)).start() if asgi else NativeServer(self.app).start()
        )

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def keys_for(tokens: list[int], block_size: int) -> int:
    """Number of full blocks (for readability in assertions)."""
    return len(prompt_keys(tokens, block_size))


class MockFleet:
    """Mock vLLM engines (sim.engine, real HTTP and KV events) on their own event loop in a thread."""

    def __init__(self, configs: list[Any]) -> None:
        from sim.fleet import Fleet

        self.fleet = Fleet(configs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self._loop).result(TIMEOUT)

    def backend_toml(self, i: int, name: str, replay: bool = True) -> str:
        e = self.fleet.engines[i]
        out = f'[[backends]]\nname = "{name}"\nurl = "{e.url}"\nkv_events = "{e.kv_endpoints[0]}"\n'
        if replay and e.replay_endpoints[0]:
            out += f'kv_replay = "{e.replay_endpoints[0]}"\n'
        return out + f"dp_size = {e.config.dp_size}\n"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the fleet's loop (engines are not thread-safe) and return its result."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(TIMEOUT)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fleet.stop(), self._loop).result(TIMEOUT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(TIMEOUT)
        self._loop.close()


class OneEngineRouters:
    """Routers in front of one mock engine each (``e``), made by a test and all stopped at its end
    (the fixture's teardown calls :meth:`close`)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.made: list[RouterRunner | MockFleet] = []

    def make(self, config: Any, head: str, replay: bool = True) -> tuple[RouterRunner, MockFleet]:
        """A mock engine of ``config`` and a router whose TOML is ``head`` plus that backend."""
        fleet = MockFleet([config])
        self.made.append(fleet)
        router = RouterRunner(head + fleet.backend_toml(0, "e", replay=replay), self.tmp_path)
        self.made.append(router)
        return router, fleet

    def close(self) -> None:
        for thing in reversed(self.made):
            thing.stop() if isinstance(thing, RouterRunner) else thing.close()
