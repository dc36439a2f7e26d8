"""Hostile engines for the tests of the router's upstream side: a raw-socket engine writing exactly
the bytes a test scripts (sim/hostile.py, shared with the chaos soak), the real ``kvrouter serve``
in a subprocess in front of it (so that its memory and its event loop are its own to measure), a raw
keep-alive HTTP/1.1 client, and a probe of the router's responsiveness.

The engine answers ``GET /health`` and ``GET /v1/models`` like vLLM and every POST by the first word
of its ``prompt`` (``"<attack> <token>"``): the test registers what each word does (any other word
gets the sound answer), and the engine records every POST it read (word, token, connection,
position on that connection).
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
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httptools
from harness import TIMEOUT, wait_for

from sim.procs import reset_peak, status_kb
from sim.routerproc import free_port

ROOT = Path(__file__).resolve().parent.parent


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
        return status_kb(self.proc.pid, field)

    def reset_peak(self) -> None:
        """Start VmHWM (the peak resident size) again from the current size."""
        reset_peak(self.proc.pid)

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
                before = self._waits()
                t0 = time.perf_counter()
                assert c.request("GET", "/health").status == 200
                took = time.perf_counter() - t0
                # less the time the router and this probe waited for a CPU (the scheduler's own
                # count): on a box other processes keep busy, not the router's stall
                self.latencies.append(max(took - self._starved(before, self._waits()), 0.0))

    def _waits(self) -> dict[str, int]:
        """Nanoseconds each router thread, and this one, spent runnable but not running."""
        out: dict[str, int] = {}
        task = f"/proc/{self.router.proc.pid}/task"
        for tid in os.listdir(task) if os.path.isdir(task) else ():
            with contextlib.suppress(OSError), open(f"{task}/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        with contextlib.suppress(OSError), open("/proc/thread-self/schedstat") as f:
            out["self"] = int(f.read().split()[1])
        return out

    @staticmethod
    def _starved(before: dict[str, int], after: dict[str, int]) -> float:
        router = max((after[t] - before[t] for t in after if t in before and t != "self"), default=0)
        return (router + after.get("self", 0) - before.get("self", 0)) / 1e9

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
