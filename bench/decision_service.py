"""Decision cost against fleet width through the service: ``kvrouter serve`` over real sockets.

Per width (8, 64, 256, 1,024 candidates: backends x 8 DP ranks on one zero-latency upstream,
``bench/zero_mock.py``) and per arm (``alone``: one replica; ``pair``: a second replica beside it,
sharing nothing; ``cluster``: the same two on one Redis), each replica's keep-alive client sends
completions with a 1,024-token prompt of token ids (an 8-block prefix shared, the rest each
request's own) at a fixed concurrency. Measured on the first replica: its CPU (``/proc/<pid>/stat``
utime + stime) per proxied request over ``--count`` requests after a warm-up, the client's request
latency p50/p99, and the replica's garbage collections in that window
(``kvrouter_gc_pause_seconds``: full collections and the longest pause's bucket). Each replica's
window ends when its own client is done (the other's may run on). Before it, ``--idle-s`` seconds
with no request give each process's idle CPU (probes, heartbeats, the peer's quiet messages):
``cpu_us_per_request_net`` is the window's CPU less that rate over the window's length, per
request; ``pair_cpu_us_per_request_net`` the same for both replicas together, over all their
requests: what sharing costs is the cluster arm's less the pair arm's. One replica's figure alone
does not tell it: with ``cluster.stagger_bursts`` the replica ranked second (ids are random, so
either one) holds nearly every decision of this steady traffic (``held_share``), takes a third of
its peer's requests and applies all the peer's messages. The index follows no event stream here
(the mock publishes none): what grows with width is the router's own work.

``--pin``: the measured replica on one CPU, everything else (this client, the upstream, Redis, the
second replica) on the other, so the tail shows the router's own pauses rather than the scheduler
sharing two cores between the client and the router.

Several trees side by side in one run (each router runs from its tree, with its extensions built
in place)::

    python bench/decision_service.py --trees new=.,old=<old tree> --rounds 2 \
      --out bench/out/decision-service.json

Bounded: ``--count`` requests per arm, every wait has a deadline, every process started here is
stopped at the end; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening within {timeout:.0f} s")


def get(port: int, path: str) -> tuple[int, bytes]:
    """A blocking GET (readiness and debug pages only)."""
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


_GC_LINE = re.compile(
    rb'^kvrouter_gc_pause_seconds_(count|sum|bucket)\{generation="(\d)"(?:,le="([^"]+)")?\} (\S+)', re.M
)


_HELD_LINE = re.compile(rb'^kvrouter_cluster_held_decisions_total\{unit="decisions"\} (\S+)$', re.M)


def metrics_text(port: int) -> bytes:
    """The replica's /metrics (HTTP/1.0: one unchunked body)."""
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: b\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def held_decisions(port: int) -> float:
    """Decisions the replica held so far (``cluster.stagger_bursts``; 0 alone)."""
    m = _HELD_LINE.search(metrics_text(port))
    return float(m.group(1)) if m else 0.0


def gc_stats(port: int) -> dict[tuple[str, str, float], float]:
    """The replica's collections so far (``kvrouter_gc_pause_seconds``): (kind, generation, bucket
    bound) -> value."""
    data = metrics_text(port)
    out: dict[tuple[str, str, float], float] = {}
    for m in _GC_LINE.finditer(data):
        kind, gen, le, value = m.groups()
        out[(kind.decode(), gen.decode(), float(le) if le else 0.0)] = float(value)
    return out


def gc_window(
    before: dict[tuple[str, str, float], float], after: dict[tuple[str, str, float], float]
) -> dict[str, float]:
    """What the replica collected between two :func:`gc_stats`: collections and seconds per
    generation, and the smallest bucket bound holding every pause of the window (inf: above all)."""

    def delta(key: tuple[str, str, float]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    row = {f"gc{g}_collections": delta(("count", g, 0.0)) for g in "012"}
    row |= {f"gc{g}_seconds": delta(("sum", g, 0.0)) for g in "012"}
    total = sum(row[f"gc{g}_collections"] for g in "012")
    bounds = sorted({k[2] for k in after if k[0] == "bucket" and k[2] != float("inf")})
    held = (b for b in bounds if sum(delta(("bucket", g, b)) for g in "012") >= total)
    row["gc_max_pause_le_s"] = next(held, float("inf"))
    return row


def wait_for(cond: Any, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            if cond():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {timeout:.0f} s")


def config(port: int, upstream: int, width: int, redis_url: str | None, cluster_extra: str = "") -> str:
    backends = max(width // 8, 1)
    dp = width // backends
    lines = ["block_size = 16", "[server]", f"port = {port}", 'log_level = "warning"']
    for i in range(backends):
        lines += ["[[backends]]", f'name = "e{i}"', f'url = "http://127.0.0.1:{upstream}"']
        lines += ['models = ["m"]', f"dp_size = {dp}"]
    if redis_url:
        lines += ["[cluster]", f'redis_url = "{redis_url}"']
        lines += [kv.strip() for kv in cluster_extra.split(",") if kv.strip()]
    return "\n".join(lines) + "\n"


class Client:
    """Keep-alive HTTP/1.1 connections sending pre-encoded requests (little CPU of its own)."""

    def __init__(self, port: int, bodies: list[bytes]) -> None:
        self.port = port
        self.requests = [
            b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(b)}\r\n\r\n".encode()
            + b
            for b in bodies
        ]

    async def run(self, count: int, concurrency: int, seed: int) -> list[float]:
        rng = random.Random(seed)
        order = [rng.randrange(len(self.requests)) for _ in range(count)]
        spans: list[float] = []
        it = iter(order)

        async def one_conn() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                for i in it:
                    t0 = time.perf_counter()
                    writer.write(self.requests[i])
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                    if not head.startswith(b"HTTP/1.1 200"):
                        raise RuntimeError(head[:200].decode(errors="replace"))
                    fields = (h.partition(b":") for h in head.split(b"\r\n"))
                    length = next(int(v) for k, _, v in fields if k.lower() == b"content-length")
                    await reader.readexactly(length)
                    spans.append(time.perf_counter() - t0)
            finally:
                writer.close()

        await asyncio.gather(*(one_conn() for _ in range(concurrency)))
        return spans


def bodies(n: int = 64, tokens: int = 1024) -> list[bytes]:
    rng = random.Random(1)
    prefix = [rng.randrange(1, 30000) for _ in range(128)]
    out = []
    for _ in range(n):
        prompt = prefix + [rng.randrange(1, 30000) for _ in range(tokens - 128)]
        out.append(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode())
    return out


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(cwd)}
        with open(log, "wb") as f:
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p)


def router(
    procs: Procs,
    tree: Path,
    tmp: Path,
    name: str,
    upstream: int,
    width: int,
    redis: str | None,
    cluster_extra: str = "",
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(config(port, upstream, width, redis, cluster_extra))
    p = procs.start([PY, "-m", "router.cli", "serve", "--config", str(cfg)], tree, tmp / f"{name}.log")
    wait_port(port, p)
    wait_for(lambda: get(port, "/ready")[0] == 200, f"{name} ready")
    return p, port


def arm(
    procs: Procs,
    tree: Path,
    tmp: Path,
    upstream: int,
    width: int,
    redis: str | None,
    args: argparse.Namespace,
    which: str,
) -> dict[str, Any]:
    """One replica measured; ``pair``: a second one beside it taking the same traffic, sharing
    nothing; ``cluster``: the same two on the store at ``redis``."""
    tag = f"{tree.name}-{width}-{which}"
    a, port_a = router(procs, tree, tmp, tag + "-a", upstream, width, redis, args.cluster_set)
    b = None
    try:
        ports = [port_a]
        if which != "alone":
            b, port_b = router(procs, tree, tmp, tag + "-b", upstream, width, redis, args.cluster_set)
            ports.append(port_b)
        if redis:

            def peers_seen() -> bool:
                return all(len(json.loads(get(p, "/debug/index")[1])["cluster"]["peers"]) == 1 for p in ports)

            wait_for(peers_seen, "replicas see each other")
        reqs = bodies(tokens=args.prompt_tokens)

        procs_ab = [a] + ([b] if b is not None else [])

        async def drive(count: int, seed: int) -> list[tuple[list[float], float, float]]:
            """Both replicas' clients at once; per replica, its client's spans and the replica's CPU
            and wall time until its own client finished (the other's may still be running: that
            tail is not its)."""

            async def one(i: int, port: int) -> tuple[list[float], float, float]:
                t0, c0 = time.monotonic(), cpu_seconds(procs_ab[i].pid)
                spans = await Client(port, reqs).run(count, args.concurrency, seed + i)
                return spans, cpu_seconds(procs_ab[i].pid) - c0, time.monotonic() - t0

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(ports))))

        if args.pin:
            for p, cpus in ((a, {1}), (b, {0})):
                if p is not None:
                    for tid in os.listdir(f"/proc/{p.pid}/task"):  # (every thread of it)
                        os.sched_setaffinity(int(tid), cpus)
        asyncio.run(drive(args.warmup, 1))
        # each replica's CPU with no request (probes, heartbeats, the peer's quiet messages), so that
        # what a request costs can be told from what the process spends per second anyway
        idle0, t_idle = [cpu_seconds(p.pid) for p in procs_ab], time.monotonic()
        time.sleep(args.idle_s)
        idle_s = time.monotonic() - t_idle
        idle_rates = [(cpu_seconds(p.pid) - c) / idle_s for p, c in zip(procs_ab, idle0, strict=True)]
        idle_rate = idle_rates[0]
        gc0, held0 = gc_stats(port_a), held_decisions(port_a)
        spy = None
        if args.profile is not None:  # py-spy on the measured replica over the window (explains only)
            folded = args.out.with_name(f"{args.out.stem}-{tag}-r{args.round}.folded")
            folded.parent.mkdir(parents=True, exist_ok=True)
            spy_cmd = [args.profile, "record", "-p", str(a.pid), "-r", "250", "-f", "raw", "-o", str(folded)]
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        measured = asyncio.run(drive(args.count, 2))
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        gc_row = gc_window(gc0, gc_stats(port_a))
        spans, cpu, wall = measured[0]
        # both replicas together: their CPU (each less its idle rate) over all their requests, the
        # cost of a request to the pair whichever replica took it (a held replica, ranked second,
        # takes fewer requests than its peer and applies all the peer's messages)
        pair_net = sum(c - r * w for (_, c, w), r in zip(measured, idle_rates, strict=True))
        pair_count = sum(len(m[0]) for m in measured)
        spans.sort()
        return {
            "tree": tree.name if args.names is None else args.names[str(tree)],
            "candidates": width,
            "arm": which,
            "cpu_us_per_request": cpu / len(spans) * 1e6,
            "idle_cpu_share": idle_rate,
            "requests_per_s": len(spans) / wall,
            "cpu_us_per_request_net": (cpu - idle_rate * wall) / len(spans) * 1e6,
            "pair_cpu_us_per_request_net": pair_net / pair_count * 1e6,
            "held_share": (held_decisions(port_a) - held0) / len(spans),
            "p50_ms": statistics.median(spans) * 1e3,
            "p99_ms": spans[int(len(spans) * 0.99) - 1] * 1e3,
            "p99_over_p50": spans[int(len(spans) * 0.99) - 1] / statistics.median(spans),
            "requests": len(spans),
            "pinned": bool(args.pin),
        } | gc_row
    finally:
        if b is not None:
            procs.stop(b)
        procs.stop(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="new=.", help="name=path,... (each router runs from its tree)")
    ap.add_argument("--widths", default="8,64,256,1024")
    ap.add_argument("--arms", default="alone,pair,cluster")
    ap.add_argument("--count", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="token ids per prompt (128 shared)")
    ap.add_argument("--rounds", type=int, default=1, help="each arm this many times, in turn; medians")
    ap.add_argument("--out", type=Path, default=Path("bench/out/decision-service.json"))
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU read before each window")
    ap.add_argument("--pin", action="store_true", help="the measured replica on CPU 1, the rest on CPU 0")
    ap.add_argument("--cluster-set", default="", help="extra [cluster] lines, e.g. stagger_bursts=false")
    ap.add_argument("--profile", help="a py-spy binary: record the measured replica's window (folded)")
    args = ap.parse_args()
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--pin needs two CPUs")
        os.sched_setaffinity(0, {0})  # (this client; the upstream and Redis started below inherit it)
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in args.trees.split(","))]
    args.names = {str(p): n for n, p in trees}
    procs = Procs()
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="decision-service-"))
    redis_bin = shutil.which("redis-server")
    try:
        upstream = free_port()
        mock = procs.start([PY, str(ROOT / "bench" / "zero_mock.py"), str(upstream)], ROOT, tmp / "mock.log")
        wait_port(upstream, mock)
        redis_url = None
        if "cluster" in args.arms:
            if redis_bin is None:
                raise SystemExit("redis-server is not installed")
            rport = free_port()
            cmd = [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
            rp = procs.start(cmd, tmp, tmp / "redis.log")
            wait_port(rport, rp)
            redis_url = f"redis://127.0.0.1:{rport}/0"
        for r in range(args.rounds):
            for width in (int(w) for w in args.widths.split(",")):
                for which in args.arms.split(","):
                    for _, tree in trees:  # (the trees side by side, per width and arm)
                        url = redis_url if which == "cluster" else None
                        args.round = r
                        row = arm(procs, tree, tmp, upstream, width, url, args, which) | {"round": r}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": rows, "medians": medians(rows)}, indent=1))
    for m in medians(rows):
        print(json.dumps(m))


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (tree, candidates, arm): the median of each figure over the rounds."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["tree"], row["candidates"], row["arm"]), []).append(row)
    out = []
    for (tree, width, which), rs in groups.items():
        figures: tuple[str, ...] = ("cpu_us_per_request", "cpu_us_per_request_net", "idle_cpu_share")
        figures += ("pair_cpu_us_per_request_net", "held_share")
        figures += ("requests_per_s", "p50_ms", "p99_ms", "p99_over_p50")
        figures += ("gc2_collections", "gc_max_pause_le_s")
        out.append({"tree": tree, "candidates": width, "arm": which, "rounds": len(rs)})
        out[-1] |= {f: statistics.median(r[f] for r in rs) for f in figures}
    return out


if __name__ == "__main__":
    main()
