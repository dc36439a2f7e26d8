"""Mock engines as their own processes (`kvrouter mock-engine`), for soaks that kill them for real.

In-process engines (sim.fleet) cannot be SIGKILLed or SIGSTOPped: a soak that tests what a router does
when an engine dies or hangs needs real processes. Each engine here is one `kvrouter mock-engine
--engines 1` process in its own session (so a kill reaches nothing else), on ports the caller picks (0
for ephemeral ones), restartable on the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineProc:
    """One mock engine process and its endpoints."""

    name: str
    args: list[str]
    proc: asyncio.subprocess.Process | None = None
    url: str = ""
    kv_events: str = ""
    kv_replay: str | None = None
    ports: tuple[int, int, int] = (0, 0, 0)
    """(http, kv, replay) as bound (fixed after the first start, so a restart keeps them)."""
    killed_at: float | None = None
    history: list[str] = field(default_factory=list)

    async def start(self, timeout: float = 60.0) -> None:
        """Start (or start again on the same ports) and read the endpoints it prints."""
        http, kv, replay = self.ports
        cmd = [
            sys.executable, "-m", "router.cli", "mock-engine", "--engines", "1", "--json",
            "--port", str(http), "--kv-port", str(kv), "--replay-port", str(replay), *self.args,
        ]  # fmt: skip
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True
        )
        assert self.proc.stdout is not None
        text = b""
        deadline = time.monotonic() + timeout
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), max(deadline - time.monotonic(), 0.1))
            if not line:
                raise RuntimeError(f"mock engine {self.name} exited before printing its endpoints")
            text += line
            with contextlib.suppress(json.JSONDecodeError):
                info = json.loads(text)["engines"][0]
                break
        self.url = info["url"]
        self.kv_events = info["kv_endpoints"][0]
        self.kv_replay = info["replay_endpoints"][0]
        self.ports = (
            int(self.url.rsplit(":", 1)[1]),
            int(self.kv_events.rsplit(":", 1)[1]),
            int(self.kv_replay.rsplit(":", 1)[1]) if self.kv_replay else 0,
        )
        self.killed_at = None

    def signal(self, sig: int) -> None:
        """Send a signal to the engine's process group."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) and wait; SIGKILL after 10 s."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if kill:
            self.killed_at = time.monotonic()
        self.signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()


async def stop_group(proc: asyncio.subprocess.Process | None, timeout: float = 30.0) -> None:
    """SIGTERM to the process group a process leads (started with ``start_new_session``) and wait;
    SIGKILL after ``timeout``."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def status_kb(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in kB (VmRSS: resident now; VmHWM: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start VmHWM (the peak resident size) again from the current size."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


__all__ = ["EngineProc", "reset_peak", "status_kb", "stop_group"]
