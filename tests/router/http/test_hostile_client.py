"""Hostile clients cannot stall or exhaust the router: slowloris heads, trickled, tiny-chunked and
pipelined input, bodies without a key, connection floods at the file descriptor limit, and a chat
request whose 10k tools a template renders (its large body decoded in pieces, as msgspec does).

Each attack runs against a real ``kvrouter serve`` process (its memory and file descriptors are
its own, and it can be given a low descriptor limit) in front of a fake engine. A probe process (its
own GIL: nothing the test process does delays it) asks ``GET /health`` without pause over one
keep-alive connection: its longest answer, less the time the router's threads and the probe itself
waited for a CPU (the scheduler's statistics: other processes keep this machine busy), is the
longest the router's event loop stalled. It also sends a well-behaved completion request every
50 ms, which must keep succeeding.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import random
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from harness import TIMEOUT, FakeEngine, wait_for

from router.config import ConfigError, parse_config
from sim.routerproc import free_port

KEY = "sk-test"
AUTH = f"authorization: Bearer {KEY}\r\n"
EXTRA_ENV: dict[str, str] = {}
MAX_STALL_S = 0.05
"""The longest the event loop may stall during an attack (the probe's longest /health answer)."""

PROBE = r"""
import json, os, socket, sys, threading, time

port, key, pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
stop = threading.Event()


def ending():
    # the block ended: stop once the figures have their minimum (a short block must not leave the
    # probe too few answers to judge; up to 30 s more)
    sys.stdin.read()
    deadline = time.monotonic() + 30
    while (out["health"] < 50 or out["ok"] < 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()


def connect():
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def exchange(s, request):
    s.sendall(request)
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("closed")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("closed")
        rest += data
    return int(head.split(b" ")[1])


health = b"GET /health HTTP/1.1\r\nhost: probe\r\n\r\n"
body = json.dumps({"model": "toy", "prompt": "the cache and the router", "max_tokens": 4}).encode()
completion = (
    b"POST /v1/completions HTTP/1.1\r\nhost: probe\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
)
out = {"health": 0, "max_s": 0.0, "max_latency_s": 0.0, "slow": [], "ok": 0, "failed": [], "reconnects": 0}
threading.Thread(target=ending, daemon=True).start()


warm = threading.Barrier(3)


def waits():
    # nanoseconds each of the router's threads waited for a CPU (runnable, not running), and this
    # thread's own wait, from the scheduler's statistics
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                out[tid] = int(f.read().split()[1])
        except OSError:
            pass
    with open("/proc/thread-self/schedstat") as f:
        out["self"] = int(f.read().split()[1])
    return out


def starved(before, after):
    # of a request's time, how long the router (its longest-waiting thread) and this probe waited
    # for a CPU: not the router's doing, on a machine other processes keep busy
    router = max((after[t] - before[t] for t in after if t in before and t != "self"), default=0)
    return (router + after["self"] - before["self"]) / 1e9


def loop(request, pause, record):
    s = connect()
    exchange(s, request)  # (the first answers, before the attack: warm paths)
    warm.wait()
    while not stop.is_set():
        before = waits() if record is probed else None
        t0 = time.perf_counter()
        try:
            status = exchange(s, request)
        except (OSError, ConnectionError, ValueError, IndexError) as exc:
            out["failed"].append("%r" % exc)
            out["reconnects"] += 1
            s = connect()
            continue
        took = time.perf_counter() - t0
        record(status, took, starved(before, waits()) if before is not None else 0.0)
        stop.wait(pause)


def probed(status, took, starved):
    out["health"] += 1
    out["max_latency_s"] = max(out["max_latency_s"], took)
    stall = max(took - starved, 0.0)
    out["max_s"] = max(out["max_s"], stall)
    if took > 0.02:
        out["slow"].append((round(took, 4), round(stall, 4)))
    if status != 200:
        out["failed"].append("health %d" % status)


def completed(status, took, starved):
    if status == 200:
        out["ok"] += 1
    else:
        out["failed"].append("completion %d" % status)


threads = [
    threading.Thread(target=loop, args=(health, 0, probed)),
    threading.Thread(target=loop, args=(completion, 0.05, completed)),
]
for t in threads:
    t.start()
warm.wait()
print("ready", flush=True)
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
"""


class Probe:
    """The probe process (see the module docstring); :meth:`result` stops it and reads its figures."""

    def __init__(self, port: int, pid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(port), KEY, str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def result(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = json.loads(self.proc.stdout.readline())
        self.proc.wait(TIMEOUT)
        return out  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)


class Router:
    """``kvrouter serve`` as a child process, its descriptor limit set by ``nofile`` (soft, hard)."""

    def __init__(self, tmp: Path, toml: str, nofile: tuple[int, int] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"router-{self.port}.toml"
        path.write_text(toml.replace("[server]", f"[server]\nport = {self.port}", 1))
        self.log_path = tmp / f"router-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **EXTRA_ENV),
            preexec_fn=limit,
            start_new_session=True,
        )

        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "kvrouter serve ready", timeout=90)

    def rss(self) -> int:
        """Resident memory, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str) -> float:
        """One sample of /metrics (the first line starting with ``name``)."""
        text = httpx.get(
            self.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=TIMEOUT
        ).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def settles(self, limit: int, timeout: float = 20.0) -> None:
        """Resident memory comes down to ``limit`` bytes within ``timeout`` seconds."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen.append(self.rss())
            if seen[-1] <= limit:
                return
            time.sleep(0.2)
        raise AssertionError(f"RSS {seen[-1] >> 20} MiB (lowest {min(seen) >> 20}), above {limit >> 20} MiB")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


@pytest.fixture
def engine(ctx: zmq.Context[Any]) -> Iterator[FakeEngine]:
    e = FakeEngine("e", ctx)
    yield e
    e.close()


@pytest.fixture
def start(tmp_path: Path, tokdir: Path, engine: FakeEngine) -> Iterator[Callable[..., Router]]:
    """Start a router in front of the engine: ``start(server_keys, nofile=..., tokenizer=...)``."""
    made: list[Router] = []

    def make(
        server: str = "", nofile: tuple[int, int] | None = None, tokenizer: Path | None = None
    ) -> Router:
        toml = (
            f'block_size = 16\ntokenizer = "{tokenizer or tokdir}"\ntokenizer_cache_mib = 0\n'
            f'api_keys = ["{KEY}"]\n[server]\n{server}\n{engine.backend_toml()}'
        )
        router = Router(tmp_path, toml, nofile)
        made.append(router)
        return router

    yield make
    for r in made:
        r.stop()


@contextlib.contextmanager
def probing(router: Router) -> Iterator[dict[str, Any]]:
    """Probe the router while the block runs; the figures are in the dict afterwards."""
    probe = Probe(router.port, router.proc.pid)
    out: dict[str, Any] = {}
    try:
        yield out
        out.update(probe.result())
    finally:
        probe.close()


def assert_served(figures: dict[str, Any]) -> None:
    """The loop never stalled past MAX_STALL_S and the well-behaved client was answered throughout."""
    assert not figures["failed"], figures
    assert figures["ok"] >= 1 and figures["health"] >= 50, figures
    assert figures["max_s"] <= MAX_STALL_S, figures


def connect(router: Router) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=TIMEOUT)


def read_answer(s: socket.socket, timeout: float = TIMEOUT) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A whole error answer (status, headers, JSON body); fails unless it comes within ``timeout``."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        assert data, f"closed before an answer: {buf!r}"
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        data = s.recv(65536)
        assert data, "closed inside the answer"
        rest += data
    return int(lines[0].split()[1]), headers, json.loads(rest)


def closed_within(s: socket.socket, seconds: float) -> bool:
    """The router closes the connection within ``seconds`` (what is still in flight is read)."""
    deadline = time.monotonic() + seconds
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if not s.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:  # (a reset after the linger: closed too)
            return True
    return False


# --- slowloris -----------------------------------------------------------------------------------


def test_slowloris_heads_are_cut_at_the_head_deadline(start: Callable[..., Router]) -> None:
    """400 connections sending a head a byte at a time are each answered 408 and closed at
    ``head_timeout_s`` from their first byte (before the fix the idle timer restarted on every
    byte: never), a connection that sends nothing is closed then too, and meanwhile the probe and
    the well-behaved client are served as usual."""
    router = start("head_timeout_s = 1.0")
    head = b"POST /v1/completions HTTP/1.1\r\nhost: slow\r\n" + AUTH.encode() + b"x-pad: " + b"a" * 400
    base = router.rss()
    with probing(router) as figures:
        silent = connect(router)
        conns = [connect(router) for _ in range(400)]
        started = time.monotonic()
        answered: dict[int, tuple[int, dict[str, Any]]] = {}
        buffers: dict[int, bytes] = {}
        sent = 0
        while len(answered) < len(conns) and time.monotonic() - started < 6.0:
            if sent < len(head):
                for s in conns:
                    with contextlib.suppress(OSError):
                        s.send(head[sent : sent + 1])
                sent += 1
            ready, _, _ = select.select([s for s in conns if s.fileno() not in answered], [], [], 0.1)
            for s in ready:
                with contextlib.suppress(OSError):
                    buffers[s.fileno()] = buffers.get(s.fileno(), b"") + s.recv(65536)
                data = buffers.get(s.fileno(), b"")
                if b"\r\n\r\n" in data:
                    status = int(data.split(b" ")[1])
                    answered[s.fileno()] = (status, json.loads(data.partition(b"\r\n\r\n")[2] or b"{}"))
        took = time.monotonic() - started
        assert len(answered) == len(conns), f"{len(answered)} of {len(conns)} answered in {took:.1f} s"
        assert took < 4.0, took
        assert {status for status, _ in answered.values()} == {408}
        err = next(iter(answered.values()))[1]["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error", err
        assert all(closed_within(s, 4.0) for s in conns[:20])
        assert closed_within(silent, 2.0)  # (sent nothing: closed at the deadline, no answer)
        growth = router.rss() - base
        for s in [silent, *conns]:
            s.close()
    assert growth < 30 << 20, growth
    assert_served(figures)
    assert router.metric("kvrouter_client_limit_hits_total") >= 400


# --- bodies --------------------------------------------------------------------------------------


def _chunked_head(auth: bool) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n" + (AUTH.encode() if auth else b"") + b"\r\n"
    )


def _tiny_chunks(payload: int) -> bytes:
    """``payload`` bytes of a JSON string's inside in 2-byte chunks (7 bytes each on the wire)."""
    return b"2\r\naa\r\n" * (payload // 2)


def test_a_trickled_body_is_cut_at_the_body_deadline(start: Callable[..., Router]) -> None:
    """A body sent two bytes at a time is answered 408 at ``body_timeout_s`` after its head and
    the connection closed (before: held as long as the client kept sending)."""
    router = start("body_timeout_s = 1.5")
    with probing(router) as figures, connect(router) as s:
        s.sendall(_chunked_head(auth=True) + b'5\r\n{"a":\r\n')
        started = time.monotonic()
        s.settimeout(0.1)
        answer = b""
        while b"\r\n\r\n" not in answer and time.monotonic() - started < 5.0:
            with contextlib.suppress(OSError):
                s.send(b"2\r\naa\r\n")
            with contextlib.suppress(TimeoutError):
                answer += s.recv(65536)
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), (took, answer[:200])
        assert 1.3 < took < 3.0, took
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert closed_within(s, 4.0)
    assert_served(figures)


def test_a_body_without_a_key_is_refused_from_its_head(start: Callable[..., Router]) -> None:
    """16 MiB in 2-byte chunks without an API key: 401 at once, before the client has sent its
    body, and nothing of it held (before: the whole body was read first, +448 MB); a
    content-length body without a key is refused before a byte of it is sent."""
    router = start()
    base = router.rss()
    with probing(router) as figures:
        with connect(router) as s:
            s.sendall(_chunked_head(auth=False) + b'5\r\n{"a":\r\n')
            assert read_answer(s, timeout=2.0)[0] == 401
            with contextlib.suppress(OSError):  # the router reads and drops the rest, then closes
                s.sendall(_tiny_chunks(16 << 20))
        growth = router.rss() - base
        with connect(router) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (16 << 20)
            )
            status, _, body = read_answer(s, timeout=2.0)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert growth < 8 << 20, growth
    assert_served(figures)


def test_tiny_chunks_are_counted_in_the_bytes_they_hold(start: Callable[..., Router]) -> None:
    """With a key, 2-byte chunks up to past ``max_body_bytes`` (4 MiB): 413 when the bytes held
    pass it, the memory held meanwhile the limit and a constant (before: 28 times the payload,
    ~110 MB here), and back near the baseline after."""
    router = start(f"max_body_bytes = {4 << 20}")
    base = router.rss()
    peak = 0
    with probing(router) as figures, connect(router) as s:
        s.sendall(_chunked_head(auth=True) + b'6\r\n{"a":"\r\n')
        chunk = _tiny_chunks(256 << 10)
        s.settimeout(TIMEOUT)
        answer = b""
        for _ in range(32):  # 8 MiB of payload in all
            try:
                s.sendall(chunk)
            except OSError:
                break
            peak = max(peak, router.rss() - base)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(65536)
            s.setblocking(True)
            if answer:
                break
        s.settimeout(TIMEOUT)
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer:
                data = s.recv(65536)
                if not data:
                    break
                answer += data
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert peak < (4 << 20) * 1.25 + (12 << 20), peak
    assert_served(figures)
    router.settles(base + (8 << 20))


# --- connections ---------------------------------------------------------------------------------


def test_a_connection_flood_at_the_fd_limit_is_refused_with_503(start: Callable[..., Router]) -> None:
    """A router started with a soft descriptor limit of 128 (hard 256) raises it to 256 and takes
    at most (256 - 64) / 2 = 96 client connections: 300 idle ones (more than its descriptors)
    get a 503 with Retry-After past that and are closed, the established connections keep being
    served, and a new connection is served once the flood is gone (before: no cap, the limit left
    at 128, accept() failed and new clients were reset unanswered)."""
    router = start("head_timeout_s = 30", nofile=(128, 256))
    flood: list[socket.socket] = []
    with probing(router) as figures:
        try:
            for _ in range(300):
                flood.append(connect(router))
            answers: list[tuple[int, dict[str, str], dict[str, Any]]] = []
            kept = list(flood)
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < 1.0:  # until a second passes with no answer
                ready, _, _ = select.select(kept, [], [], 0.2)
                for s in ready:
                    kept.remove(s)
                    quiet_since = time.monotonic()
                    try:
                        answers.append(read_answer(s, timeout=2.0))
                    except (OSError, AssertionError):
                        answers.append((0, {}, {}))  # (reset unanswered: a burst past the descriptors)
            # the probe's 2 connections are within the cap: 96 - 2 of the flood are kept
            assert len(kept) == 94, len(kept)
            answered = [a for a in answers if a[0]]
            statuses = collections.Counter(a[0] for a in answers)
            assert len(answered) >= 150 and set(statuses) <= {0, 503}, statuses
            assert answered[0][1]["retry-after"] == "1"
            assert answered[0][2]["error"]["code"] == "too_many_connections"
            assert len(os.listdir(f"/proc/{router.proc.pid}/fd")) < 200
        finally:
            for s in flood:
                s.close()
        wait_for(lambda: router.metric("kvrouter_client_connections") <= 3, "the flood gone")
        assert router.metric("kvrouter_open_fds") < 100
        r = httpx.post(
            router.url + "/v1/completions",
            json={"model": "toy", "prompt": "after the flood", "max_tokens": 2},
            headers={"authorization": f"Bearer {KEY}"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
    assert_served(figures)
    assert router.metric("kvrouter_fd_limit") == 256
    assert router.metric("kvrouter_max_client_connections") == 96
    assert router.metric("kvrouter_client_limit_hits_total") >= 300 - 96


def test_pipelined_requests_are_answered_a_few_at_a_time(start: Callable[..., Router]) -> None:
    """20k requests pipelined in 1 MB (50 reads of them queued at once): all answered in order, the
    loop never stalled past 50 ms (before: every request of a read was parsed and answered in one
    callback, and libuv hands a connection up to 32 reads in a row)."""
    router = start()
    request = b"GET /v1/models HTTP/1.1\r\nhost: t\r\n" + AUTH.encode() + b"\r\n"
    count = (1 << 20) // len(request)
    with probing(router) as figures, connect(router) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sender = threading.Thread(target=s.sendall, args=(request * count,))
        sender.start()
        got = b""
        while got.count(b"HTTP/1.1 200 OK") < count:
            data = s.recv(1 << 20)
            assert data, "closed"
            got += data
        sender.join(TIMEOUT)
    assert got.count(b"HTTP/1.1 ") == count
    assert_served(figures)


# --- a chat request whose tools the template renders ---------------------------------------------

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{% for tool in tools %}{% set f = tool.function %}"
    "{{ f.name }}({{ f.parameters.properties | list | join(', ') }}): {{ f.description }}\n{% endfor %}"
    "{{ eos_token }}\n{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Every tool as a signature line, as some templates write them (one with the whole schema in
JSON costs the toy tokenizer seconds more to encode, to no other effect)."""


def _tool(i: int) -> dict[str, Any]:
    props = {f"p{j}": {"type": "string", "description": f"argument {j} of tool {i}"} for j in range(9)}
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "looks things up " * 8,
            "parameters": {"type": "object", "properties": props, "required": ["p0"]},
        },
    }


def test_a_chat_with_10k_tools_is_tokenized_off_the_loop(
    start: Callable[..., Router], tokdir: Path, tmp_path: Path, engine: FakeEngine
) -> None:
    """10k tools (8 MB) through the official client, with a template that renders every tool:
    answered, while the loop never stalls past 50 ms (before: for seconds, the inline-or-thread
    choice counting the messages' text only), and the memory back within 10% of what it was before
    the request (taken after three such requests, two at once: the tokenizer library keeps what it
    allocated for a prompt of a million tokens, ~50 MB per worker thread, for the next one)."""
    tokenizer = tmp_path / "tools-tokenizer"
    tokenizer.mkdir()
    shutil.copy(tokdir / "tokenizer.json", tokenizer / "tokenizer.json")
    config = json.loads((tokdir / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    router = start(tokenizer=tokenizer)
    tools = [_tool(i) for i in range(10_000)]
    assert len(msgspec.json.encode(tools)) > 8_000_000
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def ask() -> None:
        answer = client.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "which tool?"}],
            tools=tools,  # type: ignore[arg-type]
        )
        assert answer.choices[0].message.content == "hello from e"

    # The tokenizer library keeps ~50 MB per worker thread after a ~1M-token prompt: two requests at
    # once warm both worker threads (one after the other, both could land on the same thread, and the
    # measured one on the other: +50 MB), then one more alone.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: ask(), range(2)))
    ask()
    base = router.rss()
    with probing(router) as figures:
        ask()
    chats = [r for r in engine.requests if r["path"] == "/v1/chat/completions"]
    assert len(chats[-1]["body"]["tools"]) == 10_000
    assert_served(figures)
    dashboard = httpx.get(
        router.url + "/dashboard/data", headers={"authorization": f"Bearer {KEY}"}, timeout=TIMEOUT
    ).json()
    chat = [d for d in dashboard["recent_decisions"] if d["endpoint"] == "chat"][-1]
    assert chat["prompt_tokens"] > 500_000, chat  # (tokenized: the tools are in the prompt)
    router.settles(int(base * 1.1))


# --- large bodies decoded in pieces --------------------------------------------------------------


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth > 3 or kind < 0.3:
        leaves = [rng.randrange(-(10**12), 10**12), rng.random() * 1e6, 's\u00e9"\\\n' * rng.randrange(3)]
        return rng.choice([*leaves, None, True])
    if kind < 0.65:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {f"k{rng.randrange(40)}\u00e9": _value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _documents(rng: random.Random) -> Iterator[bytes]:
    """Bodies larger than one piece: random nested values, long lists, a huge member, duplicates."""
    for _ in range(10):
        doc = {"model": "m", "tools": [_value(rng, 0) for _ in range(rng.randrange(600, 1500))]}
        yield msgspec.json.encode(doc)
    yield msgspec.json.encode({"x": list(range(100_000)), "y": {"z": "a" * 200_000}})
    yield b'{"a": 1, "big": [' + b",".join(b"[[%d], {}]" % i for i in range(30_000)) + b'], "a": 2}'
    yield b" \r\n[ " + b" , ".join(b'{"k" :  "v%d"}' % i for i in range(20_000)) + b" ] \n"


def _mutated(rng: random.Random, raw: bytes) -> bytes:
    i = rng.randrange(len(raw))
    return rng.choice(
        [
            raw[:i],
            raw[:i] + rng.choice([b",", b"]", b"}", b'"', b":", b"\x00", b"\xff", b"01", b" x"]) + raw[i:],
            raw[:i] + raw[i + 1 :],
            raw + b",",
            raw + b" {}",
        ]
    )


def test_large_bodies_decode_in_pieces_to_what_msgspec_decodes() -> None:
    """The piecewise decoder gives msgspec's very result for bodies larger than a piece, and fails
    exactly where msgspec fails (mutated bodies: cut, a byte added or removed)."""
    from router.net.body import LARGE_BODY_BYTES, decode_json, release

    rng = random.Random(30)
    for raw in _documents(rng):
        assert len(raw) > LARGE_BODY_BYTES
        expected = msgspec.json.decode(raw)
        got = decode_json(raw)
        assert got == expected and list(_keys(got)) == list(_keys(expected))
        release(got)
        for _ in range(5):
            bad = _mutated(rng, raw)
            try:
                expected = msgspec.json.decode(bad)
            except (msgspec.DecodeError, ValueError, RecursionError):
                with pytest.raises((msgspec.DecodeError, ValueError, RecursionError)):
                    release(decode_json(bad))
                continue
            got = decode_json(bad)
            assert got == expected
            release(got)


def _keys(value: Any) -> Iterator[str]:
    """Every key in document order (a dict's == ignores order; the decoded body's order matters)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def test_a_large_requests_tojson_renders_the_same_text(tokdir: Path, tmp_path: Path) -> None:
    """``tojson`` of a large request (its pure-Python encoder, whose C calls are short) writes what
    json.dumps writes, for every argument templates pass it."""
    from router.decision.chat import ChatTokenizer

    d = tmp_path / "tojson"
    d.mkdir()
    shutil.copy(tokdir / "tokenizer.json", d / "tokenizer.json")
    template = (
        "{% for t in tools %}{{ t | tojson }}|{{ t | tojson(indent=4) }}|{{ t | tojson(indent='  ') }}|"
        "{{ t | tojson(sort_keys=true, separators=(',', ':')) }}|{{ t | tojson(ensure_ascii=true) }}\n"
        "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    ct = ChatTokenizer.from_path(d)
    tools = [_tool(i) for i in range(3)]
    tools[0]["function"]["parameters"]["properties"]["p0"].update(
        {"enum": ["\u00e9", "<&>", 'a"b', "\U0001f600"], "default": 1.5e-7, "max": 2**70, "x": None}
    )
    msgs = [{"role": "user", "content": "hi"}]
    small = ct.render_chat(msgs, tools=tools)
    assert ct.render_chat(msgs, tools=tools, large=True) == small
    assert '"\\u00e9"' in small and "1.5e-07" in small


def test_a_prompt_over_tokenizer_max_chars_is_routed_on_load(tokdir: Path) -> None:
    """Prompt text over ``tokenizer_max_chars`` (completions as sent, chat as rendered) is not
    tokenized (~300 bytes of memory per token while it runs): routed on load only."""
    import asyncio

    from router.decision.chat import ChatTokenizer
    from router.decision.tokenizer import RequestTokenizer, RequestTokenizerConfig, TokenizerUnavailable

    svc = RequestTokenizer(
        {"toy": ChatTokenizer.from_path(tokdir)}, config=RequestTokenizerConfig(max_chars=1000)
    )

    async def main() -> None:
        assert await svc.tokenize("completions", {"prompt": "a " * 500}, "toy")
        with pytest.raises(TokenizerUnavailable, match="tokenizer_max_chars"):
            await svc.tokenize("completions", {"prompt": "a " * 501}, "toy")
        chat = {"messages": [{"role": "user", "content": "a " * 480}]}
        assert await svc.tokenize("chat", chat, "toy")
        chat = {"messages": [{"role": "user", "content": "a " * 500}]}  # (and the template's text)
        with pytest.raises(TokenizerUnavailable, match="tokenizer_max_chars"):
            await svc.tokenize("chat", chat, "toy")

    try:
        asyncio.run(main())
    finally:
        svc.close()


def test_the_new_limits_are_validated() -> None:
    base = {"backends": [{"name": "e", "url": "http://127.0.0.1:1"}]}
    for key, bad in (("head_timeout_s", 0), ("body_timeout_s", -1.0), ("max_client_connections", 0)):
        with pytest.raises(ConfigError, match=f"server.{key}"):
            parse_config({**base, "server": {key: bad}})
    with pytest.raises(ConfigError, match="tokenizer_max_chars"):
        parse_config({**base, "tokenizer_max_chars": 0})
    cfg = parse_config(base)
    srv = cfg.server
    assert (srv.head_timeout_s, srv.body_timeout_s, srv.max_client_connections) == (10.0, 60.0, 10_000)
    assert cfg.tokenizer_max_chars == 2 << 20


def test_a_long_flat_prompt_decodes_at_once_and_a_container_rich_body_in_pieces() -> None:
    """A long prompt (32k token ids, ~200 KB; few containers) decodes in one call on the event loop
    and is dropped as usual; a body of the same size made of many small containers is decoded in
    pieces and freed step by step; past FLAT_BODY_BYTES every body takes the pieces."""
    from router.net.body import (
        FLAT_BODY_BYTES,
        LARGE_BODY_BYTES,
        decode_json,
        decoded_in_pieces,
        decodes_at_once,
        release,
    )

    flat = msgspec.json.encode({"model": "m", "prompt": list(range(100_000, 132_000)), "max_tokens": 1})
    assert LARGE_BODY_BYTES < len(flat) <= FLAT_BODY_BYTES
    assert decodes_at_once(flat)
    body = decode_json(flat)
    assert not decoded_in_pieces(body) and body == msgspec.json.decode(flat)
    rich = msgspec.json.encode({"model": "m", "tools": [{"n": i} for i in range(len(flat) // 10)]})
    assert LARGE_BODY_BYTES < len(rich) <= FLAT_BODY_BYTES
    assert not decodes_at_once(rich)
    body = decode_json(rich)
    assert decoded_in_pieces(body) and body == msgspec.json.decode(rich)
    release(body)
    assert not decoded_in_pieces(body)
    huge = msgspec.json.encode({"prompt": "x" * FLAT_BODY_BYTES})
    assert not decodes_at_once(huge)
    body = decode_json(huge)
    assert decoded_in_pieces(body)
    release(body)
