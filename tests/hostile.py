"""Hostile engines for the tests of the router's upstream side: a raw-socket engine writing exactly
the bytes a test scripts, the real ``kvrouter serve`` in a subprocess in front of it (so that its
memory and its event loop are its own to measure), a raw keep-alive HTTP/1.1 client, and a probe of
the router's responsiveness.

The engine answers ``GET /health`` and ``GET /v1/models`` like vLLM and every POST by the first word
of its ``prompt`` (``"<attack> <token>"``): the test registers what each word does, and the engine
records every POST it read (word, token, connection, position on that connection).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httptools
from harness import TIMEOUT, wait_for

from sim.demo import free_port

ROOT = Path(__file__).resolve().parent.parent


class Post:
    """One POST the engine read."""

    def __init__(self, path: str, body: dict[str, Any], conn: int, index: int) -> None:
        self.path = path
        self.body = body
        self.conn = conn
        """The engine's connection number (0, 1, ...: accepted order)."""
        self.index = index
        """Position of this request on its connection (0: the first)."""
        prompt = body.get("prompt")
        if not isinstance(prompt, str):  # chat: the last message
            prompt = str(body.get("messages", [{}])[-1].get("content", ""))
        self.word, _, self.token = prompt.partition(" ")


Attack = Callable[[socket.socket, Post], bool]
"""Writes an answer (or anything else) on the socket; True keeps the connection for the next request."""


def framed(status: str, body: bytes, headers: str = "content-type: application/json\r\n") -> bytes:
    """A complete response with a content-length."""
    return f"HTTP/1.1 {status}\r\n{headers}content-length: {len(body)}\r\n\r\n".encode() + body


def completion(token: str, extra: dict[str, Any] | None = None) -> bytes:
    """An OpenAI completion whose text is ``token`` (so a client can tell its own answer)."""
    body = {
        "id": f"cmpl-{token}",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": token, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        **(extra or {}),
    }
    return json.dumps(body).encode()


def sse_event(token: str) -> bytes:
    chunk = {
        "id": f"cmpl-{token}",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": token, "finish_reason": None, "logprobs": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "hostile",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}
"""What the engine answers a P/D prefill leg with (``kv_transfer_params.do_remote_decode``)."""


def answer_ok(sock: socket.socket, post: Post) -> bool:
    """What a sound engine does: the completion (or a stream of it) for the request's token, with
    transfer parameters when it is a prefill leg."""
    params = post.body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_decode"):
        sock.sendall(framed("200 OK", completion(post.token, {"kv_transfer_params": TRANSFER_PARAMS})))
    elif post.body.get("stream"):
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        body = chunk(sse_event(post.token)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        sock.sendall(head + body)
    else:
        sock.sendall(framed("200 OK", completion(post.token)))
    return True


def send_for(sock: socket.socket, piece: bytes, total: int) -> int:
    """Send ``piece`` again and again, ``total`` bytes at most, until the peer stops reading it
    (closes); returns the bytes sent."""
    sent = 0
    view = memoryview(piece)
    with contextlib.suppress(OSError):
        while sent < total:
            sock.sendall(view)
            sent += len(piece)
    return sent


class HostileEngine:
    """A raw-socket engine on 127.0.0.1:0 (threads: one accepting, one per connection)."""

    def __init__(self, attacks: dict[str, Attack]) -> None:
        self.attacks = {"ok": answer_ok, **attacks}
        self.posts: list[Post] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts_of(self, token: str) -> list[Post]:
        with self.lock:
            return [p for p in self.posts if p.token == token]

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                n = self.accepted
                self.accepted += 1
                self.conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn, n), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        buf = b""
        index = 0
        try:
            conn.settimeout(TIMEOUT)
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                if method == "GET":
                    if path.startswith("/v1/models"):
                        models = {"object": "list", "data": [{"id": "toy", "object": "model"}]}
                        conn.sendall(framed("200 OK", json.dumps(models).encode()))
                    else:
                        conn.sendall(framed("200 OK", b'{"status": "ok"}'))
                    index += 1
                    continue
                post = Post(path, json.loads(body), n, index)
                index += 1
                with self.lock:
                    self.posts.append(post)
                if not self.attacks[post.word](conn, post):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept: closing alone does not)
        self.sock.close()
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self.thread.join(TIMEOUT)
        for t in self.threads:
            t.join(TIMEOUT)


class RouterProcess:
    """``kvrouter serve`` for a TOML config with a ``[server]`` table (the port is added to it: a
    free one), ready once ``backends`` backends are healthy; its output goes to a log in ``tmp``."""

    def __init__(self, toml: str, tmp: Path, backends: int = 1) -> None:
        assert "[server]\n" in toml
        self.port = free_port()
        path = tmp / f"router-{self.port}.toml"
        path.write_text(toml.replace("[server]\n", f"[server]\nport = {self.port}\n", 1))
        self.log_path = tmp / f"router-{self.port}.log"
        self.log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(lambda: self._ready(backends), "the router and its backends ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self, backends: int) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the router exited: {self.log_path.read_text()[-2000:]}")
        try:
            with RawClient(self.port, timeout=5) as c:
                r = c.request("GET", "/ready")
        except OSError:
            return False
        return r.status == 200 and len(json.loads(r.body)["healthy_backends"]) == backends

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status_kb(self, field: str) -> int:
        """A ``/proc/<pid>/status`` figure in kB (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def reset_peak(self) -> None:
        """Start VmHWM (the peak resident size) again from the current size."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series of the router's /metrics (0 when absent)."""
        with RawClient(self.port) as c:
            text = c.request("GET", "/metrics").body.decode()
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(w in line for w in want):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(TIMEOUT)
        self.log.close()


class _Overrun(Exception):
    """Bytes after the end of the answer: the start of something nobody asked for."""


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.head_done = False
        self.complete = False
        self.upgrade = False
        self.cut = False
        """The router closed the connection before the answer's end (a body the engine broke)."""

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name]

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Overrun

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class RawClient:
    """One keep-alive HTTP/1.1 connection to the router: requests one after another on it, each
    answer parsed exactly (bytes past its end are kept in ``extra``, never read as part of it)."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.extra = b""
        """Bytes received after the last complete answer (the start of nothing we asked for)."""
        self.received = b""
        """Every byte this connection received."""

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
        allow_cut: bool = False,
    ) -> Response:
        """Send one request and read its whole answer (AssertionError after ``timeout``, or when the
        router closes the connection first: unless ``allow_cut`` and the head had arrived)."""
        data = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nhost: router\r\n"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + data)
        resp = Response()
        parser = httptools.HttpResponseParser(resp)
        deadline = time.monotonic() + (timeout or self.timeout)
        pending, self.extra = self.extra, b""
        while not resp.complete:
            if not pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no complete answer to {method} {path} in time: {resp.body[:200]!r}"
                    )
                self.sock.settimeout(left)
                try:
                    pending = self.sock.recv(1 << 20)
                except TimeoutError:
                    continue
                if not pending:
                    if allow_cut and resp.head_done:
                        resp.cut = True
                        break
                    raise AssertionError(f"the router closed the connection: {resp.body[:200]!r}")
                self.received += pending
            try:
                parser.feed_data(pending)
                pending = b""
            except httptools.HttpParserUpgrade as exc:  # (a 101 passed on: nothing after it is HTTP)
                resp.upgrade = True
                resp.status = parser.get_status_code()
                self.extra = pending[int(exc.args[0]) :]
                return resp
            except httptools.HttpParserError as exc:
                if not resp.complete:
                    raise AssertionError(
                        f"malformed answer from the router: {exc}: {pending[:300]!r}"
                    ) from None
                self.extra = pending  # (the read that held the answer's end and more after it)
                pending = b""
        resp.status = parser.get_status_code()
        return resp

    def unread(self, wait: float = 0.1) -> bytes:
        """Whatever else arrives on the connection within ``wait`` (nothing, for a sound server)."""
        out = self.extra
        self.sock.settimeout(wait)
        with contextlib.suppress(TimeoutError, OSError):
            while data := self.sock.recv(1 << 16):
                out += data
        return out

    def close(self) -> None:
        self.sock.close()


class Watch:
    """While a block runs: the router's peak resident memory over its size before, and the longest
    answer time of ``GET /health`` asked continuously (on a connection of its own) meanwhile, which
    is the longest its event loop was stalled plus a round trip."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.rss_before_kb = 0
        self.peak_growth_kb = 0
        self.rss_after_kb = 0
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        with RawClient(self.router.port, timeout=TIMEOUT) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.request("GET", "/health").status == 200
                self.latencies.append(time.perf_counter() - t0)

    @property
    def longest_stall(self) -> float:
        return max(self.latencies)

    @contextlib.contextmanager
    def running(self) -> Iterator[Watch]:
        self.router.reset_peak()
        self.rss_before_kb = self.router.status_kb("VmRSS")
        self._thread.start()
        wait_for(lambda: len(self.latencies) >= 3, "the /health probe running")
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(TIMEOUT)
        self.peak_growth_kb = self.router.status_kb("VmHWM") - self.rss_before_kb
        self.rss_after_kb = self.router.status_kb("VmRSS")
