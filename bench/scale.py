"""The service at fleet widths: ``kvrouter serve`` following 8 to 4,096 event sources over real sockets.

A source is one engine x DP rank: widths are engines x DP 8 (8 sources: one engine), every source
with a replay endpoint. Publishers are synthetic (sim/many.py helper processes: vLLM's wire format,
one replay buffer per source, at most 1,024 sources per helper so that each stays within its
descriptor limit); every backend's URL is one cheap mock (bench/zero_mock.py), health checks
hourly. Per width, one fresh router:

- start-up: exec to listening, and to every source followed with its bootstrap done;
- idle CPU: the router's CPU over ``--idle-s`` with every source subscribed and silent;
- fill: ``--fill-blocks`` blocks spread over every source, then RSS per residency (RSS growth over
  the residencies indexed; the key table's layout decides how it grows with sources);
- steady ingest: ``--rate`` batches/s of ``--per-batch`` blocks over ``--active`` sources (the rest
  idle) for ``--steady-s``: the router's CPU above idle, per block and per batch, and whether every
  batch was applied.

``--old PATH``: a second ``kvrouter`` executable (an older build) run at each width too, side by
side in the same run (``--old-widths``: the widths it can follow). Results: a table on stdout and
JSON in bench/out/scale.json.

Hooks: ``WIDTH_HOOKS`` (callables taking the running :class:`Router` and the width, returning a
dict merged into the width's row) let another benchmark (decision CPU per width,
bench/decision_scale.py) measure on the same routers.

``make bench-scale`` runs it with the defaults (docs/benchmarks/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DP = 8
PER_HELPER = 1024
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def get_json(port: int, path: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


class Helpers:
    """sim/many.py processes publishing ``sources`` sources at consecutive ports from a base."""

    def __init__(self, sources: int, pub_base: int, replay_base: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        for first in range(0, sources, PER_HELPER):
            n = min(PER_HELPER, sources - first)
            cmd = [PY, "-m", "sim.many", "--sources", str(n), "--first", str(first), "--replay-every", "1"]
            cmd += ["--pub-port", str(pub_base + first), "--replay-port", str(replay_base + first)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for proc in self.procs:
            assert proc.stdout is not None
            if not proc.stdout.readline():
                self.close()
                raise RuntimeError("a publisher helper did not start (ports taken?)")

    def ask(self, command: str) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        out = []
        for proc in self.procs:
            assert proc.stdout is not None
            out.append(json.loads(proc.stdout.readline()))
        return out

    def steady(self, rate: float, active: int, per: int, seconds: float) -> tuple[int, int]:
        """Publish over the first ``active`` sources of each helper, the rate split between them."""
        share = max(1, active // len(self.procs))
        res = self.ask(f"steady {rate / len(self.procs)} {share} {per} {seconds}")
        return sum(r["batches"] for r in res), sum(r["blocks"] for r in res)

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Router:
    """One ``kvrouter serve`` over ``engines`` backends x DP 8, following every source with replay."""

    def __init__(
        self, exe: str, engines: int, pub_base: int, replay_base: int, mock_port: int, tmp: Path
    ) -> None:
        self.port = free_port()
        lines = [
            "block_size = 16",
            "remote_tokenize = false",
            "[server]",
            'host = "127.0.0.1"',
            f"port = {self.port}",
            'log_level = "warning"',
            "[health]",
            "interval_s = 3600.0",
        ]
        for e in range(engines):
            lines += [
                "[[backends]]",
                f'name = "e{e}"',
                f'url = "http://127.0.0.1:{mock_port}"',
                f'kv_events = "tcp://127.0.0.1:{pub_base + DP * e}"',
                f'kv_replay = "tcp://127.0.0.1:{replay_base + DP * e}"',
                f"dp_size = {DP}",
                'models = ["default"]',
            ]
        cfg = tmp / f"scale-{self.port}.toml"
        cfg.write_text("\n".join(lines) + "\n")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [exe, "serve", "--config", str(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"router-{self.port}.log", "wb"),  # noqa: SIM115 (the process's life)
        )

    def wait_listening(self, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the router exited")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return time.perf_counter() - self.t0
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("the router never listened")

    def debug(self) -> Any:
        return get_json(self.port, "/debug/index", timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


WIDTH_HOOKS: list[Callable[[Router, int], dict[str, Any]]] = []
"""Further measurements per width on the running router (e.g. decision CPU)."""


def measure(exe: str, sources: int, args: argparse.Namespace, mock_port: int, tmp: Path) -> dict[str, Any]:
    engines = max(1, sources // DP)
    sources = engines * DP
    pub_base, replay_base = args.port_base, args.port_base + 5000
    helpers = Helpers(sources, pub_base, replay_base)
    row: dict[str, Any] = {"sources": sources, "engines": engines}
    router = Router(exe, engines, pub_base, replay_base, mock_port, tmp)
    try:
        row["listening_s"] = round(router.wait_listening(), 3)
        deadline = time.monotonic() + args.bootstrap_timeout_s
        while True:
            d = router.debug()
            srcs = d["sources"]
            done = sum(1 for s in srcs if s["bootstrap"] == "done")
            if done == sources or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        row["bootstrap_s"] = round(time.perf_counter() - router.t0, 3)
        row["followed"] = len(srcs)
        row["bootstraps_done"] = done
        row["bootstraps_pending"] = sum(1 for s in srcs if s["bootstrap"] == "pending")
        row["errors"] = sum(1 for s in srcs if s.get("error"))
        row["event_streams"] = d.get("event_streams")
        pid = router.proc.pid
        time.sleep(1.0)  # (settle: the bootstrap's last chunks, the first heap trim)
        c0, t0 = cpu_s(pid), time.perf_counter()
        time.sleep(args.idle_s)
        idle = (cpu_s(pid) - c0) / (time.perf_counter() - t0)
        row["idle_cpu_pct"] = round(100 * idle, 2)
        # fill: blocks over every source, for RSS per residency
        res0, rss0 = d["residencies"], rss_bytes(pid)
        per = 16
        batches = max(1, args.fill_blocks // per)
        helpers.steady(batches / args.fill_s, sources, per, args.fill_s)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            d = router.debug()
            if d["residencies"] >= res0 + batches * per * 0.99:
                break
            time.sleep(0.2)
        row["residencies"] = d["residencies"]
        row["rss_mb"] = round(rss_bytes(pid) / 1e6, 1)
        added = d["residencies"] - res0
        row["rss_per_residency_b"] = round((rss_bytes(pid) - rss0) / added, 1) if added > 0 else None
        # steady ingest, most sources idle
        applied0 = sum(s["batches"] for s in d["sources"])
        c0, t0 = cpu_s(pid), time.perf_counter()
        sent, blocks = helpers.steady(args.rate, min(args.active, sources), args.per_batch, args.steady_s)
        time.sleep(0.2)  # (the last batches' ingest; /debug/index below is not ingest and not counted)
        wall = time.perf_counter() - t0
        busy = cpu_s(pid) - c0 - idle * wall
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            applied = sum(s["batches"] for s in router.debug()["sources"]) - applied0
            if applied >= sent:
                break
            time.sleep(0.1)
        row["steady_batches"] = sent
        row["steady_applied"] = applied
        row["us_per_block"] = round(1e6 * busy / max(1, blocks), 2)
        row["us_per_batch"] = round(1e6 * busy / max(1, sent), 1)
        for hook in WIDTH_HOOKS:
            row.update(hook(router, sources))
    finally:
        router.stop()
        helpers.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="8,64,256,1024,4096")
    ap.add_argument("--old", default=None, help="an older kvrouter executable, run side by side")
    ap.add_argument("--old-widths", default="8,64,256", help="widths the old build is run at")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--fill-blocks", type=int, default=200_000)
    ap.add_argument("--fill-s", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=1000.0, help="steady batches/s")
    ap.add_argument("--active", type=int, default=64, help="sources publishing in the steady phase")
    ap.add_argument("--per-batch", type=int, default=4)
    ap.add_argument("--steady-s", type=float, default=5.0)
    ap.add_argument("--bootstrap-timeout-s", type=float, default=120.0)
    ap.add_argument("--port-base", type=int, default=21000, help="consecutive ports used by the publishers")
    args = ap.parse_args(argv)
    exe = shutil.which("kvrouter", path=str(Path(PY).parent)) or "kvrouter"
    tmp = Path(tempfile.mkdtemp(prefix="kvscale-"))
    mock_port = free_port()
    mock = subprocess.Popen(
        [PY, str(ROOT / "bench" / "zero_mock.py"), str(mock_port)], stdout=subprocess.DEVNULL
    )
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(0.5)
        old_widths = {int(w) for w in args.old_widths.split(",")} if args.old else set()
        for width in [int(w) for w in args.widths.split(",")]:
            sides = [("new", exe)] + ([("old", args.old)] if width in old_widths else [])
            for side, path in sides:
                row = {"side": side, **measure(path, width, args, mock_port, tmp)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        mock.terminate()
        mock.wait(10)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(rows, indent=1))
    cols = [
        "side", "sources", "followed", "bootstraps_done", "listening_s", "bootstrap_s", "idle_cpu_pct",
        "rss_per_residency_b", "us_per_block", "us_per_batch", "steady_applied", "steady_batches",
    ]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
