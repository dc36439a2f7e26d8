"""A real Redis server for the tests: Debian's ``redis-server`` on a 127.0.0.1 ephemeral port.

No persistence, no config file; ``kill()`` SIGKILLs it (what a crashed store looks like to clients)
and ``start()`` brings it back on the same port, empty, as a restarted store without persistence.
CI installs the package when missing (``.ci/run``); elsewhere the tests that need it skip, in CI
they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

TIMEOUT = 30.0


def redis_binary() -> str:
    """The redis-server path, or skip (fail in CI) when it is not installed."""
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs Debian's redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up (with a password: still up)
    except OSError:
        return False


class RedisServer:
    """One redis-server process; start/kill/stop, same port across restarts."""

    def __init__(self, workdir: Path, extra_args: list[str] | None = None) -> None:
        self.extra_args = list(extra_args or [])
        self.binary = redis_binary()
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or restart) the server and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        for _ in range(5):
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        "--port",
                        str(self.port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(self.workdir),
                        *self.extra_args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                if _ping(self.port):
                    return self
                if self.proc.poll() is not None:
                    break  # e.g. the port was taken meanwhile: try another
                time.sleep(0.02)
            self.kill()
            self.port = _free_port()
        raise RuntimeError(f"redis-server did not start: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: the store vanishes without closing anything cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(TIMEOUT)

    def stop(self) -> None:
        """Terminate and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)
