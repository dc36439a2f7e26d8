"""The router under the simulator's commands: its TOML config for a simulated or a real fleet,
`kvrouter serve` as a child process, and a progress line; shared by `demo`, `pd-demo` and `replay`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec

from sim.fleet import Fleet

MODEL = "toy-model"


class ProgressLine:
    """A progress bar: ``\\r`` updates on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stdout
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_print = 0.0
        self._done = 0

    def update(self, done: int, total: int | None = None) -> None:
        """Record progress (called by the driver after each request)."""
        if total:
            self.total = max(total, 1)
        self._done = done
        now = time.monotonic()
        if self.tty:
            if now - self._last_print >= 0.1 or done >= self.total:
                self._last_print = now
                self.stream.write("\r" + self._render(now))
                self.stream.flush()
        elif now - self._last_print >= 5.0 or done >= self.total:
            self._last_print = now
            self.stream.write(self._render(now) + "\n")
            self.stream.flush()

    def _render(self, now: float) -> str:
        frac = min(1.0, self._done / self.total)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return f"  {self.label:<13} [{bar}] {self._done:>4}/{self.total} requests  {now - self.start:5.1f} s"

    def close(self) -> None:
        """End the line on a terminal."""
        if self.tty:
            self.stream.write("\r" + self._render(time.monotonic()) + "\n")
            self.stream.flush()


# ---- router subprocess --------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the router binds it by itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _q(value: str) -> str:
    """A TOML basic string (JSON escapes are valid TOML escapes)."""
    return msgspec.json.encode(value).decode()


def router_config(
    fleet: Fleet,
    policy: str,
    port: int,
    block_size: int,
    tokenizer: str | None,
    extra_policy: dict[str, Any] | None = None,
) -> str:
    """The router's TOML config for ``fleet`` (see the contract in the README)."""
    backends: list[str] = []
    for i, e in enumerate(fleet.engines):
        backends += ["", "[[backends]]", f"name = {_q(f'engine-{i}')}", f"url = {_q(e.url)}"]
        kv = e.kv_endpoints
        if kv:
            backends.append(f"kv_events = {_q(kv[0])}")
        replay = e.replay_endpoints
        if replay and replay[0]:
            backends.append(f"kv_replay = {_q(replay[0])}")
        backends += [f"dp_size = {e.config.dp_size}", f"models = [{_q(e.config.model)}]"]
    return router_toml(backends, policy, port, block_size, tokenizer, extra_policy)


def vllm_router_config(
    urls: Sequence[str], model: str, policy: str, port: int, block_size: int, tokenizer: str
) -> str:
    """The router's TOML config for real engines: each lists its own event streams
    (``kv_events = "auto"``: ``GET /kv_event_sources``), so only their URLs are given."""
    backends: list[str] = []
    for i, url in enumerate(urls):
        backends += ["", "[[backends]]", f"name = {_q(f'engine-{i}')}", f"url = {_q(url)}"]
        backends += ['kv_events = "auto"', f"models = [{_q(model)}]"]
    return router_toml(backends, policy, port, block_size, tokenizer)


def router_toml(
    backends: Sequence[str],
    policy: str,
    port: int,
    block_size: int,
    tokenizer: str | None,
    extra_policy: dict[str, Any] | None = None,
) -> str:
    """The router's TOML config around ``backends`` (their ``[[backends]]`` tables' lines)."""
    lines = [f"block_size = {block_size}"]
    if tokenizer:
        lines.append(f"tokenizer = {_q(tokenizer)}")
    lines += ["", "[server]", 'host = "127.0.0.1"', f"port = {port}", "", "[policy]", f"name = {_q(policy)}"]
    for k, v in (extra_policy or {}).items():
        lines.append(f"{k} = {_q(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}")
    return "\n".join([*lines, *backends]) + "\n"


def router_available() -> str | None:
    """None when the router can be started, else why not (the lead is still writing it)."""
    try:
        # optional: whether the router imports at all is the question
        import router.app
        import router.serve  # noqa: F401
    except ImportError as exc:
        return f"the router is not available yet ({exc})"
    return None


class RouterProcess:
    """``kvrouter serve --config FILE`` as a child process, with its output in a log file."""

    def __init__(self, config_path: Path, log_path: Path, port: int) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll ``GET /ready`` until 200; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the router exited with code {self.proc.returncode}:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    resp = await client.get(self.url + "/ready")
                    if resp.status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router was not ready within {timeout_s:.0f} s:\n{self.tail()}")
                await asyncio.sleep(0.1)

    def tail(self, lines: int = 20) -> str:
        """The end of the router's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
