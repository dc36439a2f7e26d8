"""Router replicas: routing quality, the store's cost and a store outage, measured on the service.

``.venv/bin/python bench/replicas.py [--quick] [--traces synthetic,conversation,sessions]
[--stages quality,cost,kill] [--rounds N]`` writes ``bench/out/replicas.json`` and
``bench/out/replicas.md`` (tables for docs/benchmarks/).

Everything is real processes over loopback sockets: mock vLLM engines (``sim.fleet``: HTTP, KV events
over ZeroMQ, LRU caches), ``kvrouter serve`` subprocesses, a ``redis-server`` subprocess, and a
round-robin L4 (TCP) balancer written here (each accepted connection is piped to the next router in
turn, as a Kubernetes Service or an NLB spreads connections). The load generator is the live
replay's (``sim.driver``), pointed at the balancer.

Stages:

- ``quality``: per trace, on fresh engines each time, the arms ``one`` (one router behind the
  balancer), ``three-alone`` (three replicas, nothing shared), ``three-shared (view only)`` (three
  replicas over the store, ``assume_concurrent_decisions = false``), ``three-shared`` (the
  defaults) and, on the sessions trace, ``three-shared+sessions`` (session affinity on the trace's
  session ids). Rows: hit ratio as the engines count it, TTFT p50/p90/p99 in trace seconds, spread,
  and from the routers' /metrics: decision latency p99, sharing lag, traffic per request, CPU.
- ``cost``: a fast fleet at a higher request rate, three replicas alone vs shared at several
  ``publish_interval_s``: decision latency p99, client TTFT, lag and traffic per request.
- ``kill``: the shared arm on the synthetic trace with the store SIGKILLed mid-run and restarted
  empty 10 s later: failed requests, time until every replica is reconnected and sees its peers,
  and quality of the requests sent from 5 s after the store's return against the same requests in
  an uninterrupted shared run.

Bounded: every run stops issuing requests after ``--deadline`` seconds and every process started
here is stopped at the end; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from sim.driver import DriverConfig, RequestResult, run, scrape_engines
from sim.engine import EngineConfig
from sim.fleet import Fleet
from sim.replay import scaled_engine, trace_window
from sim.report import Row, from_live
from sim.routerproc import RouterProcess, free_port, router_config
from sim.traces import load_trace
from sim.workload import Request

OUT = Path(__file__).resolve().parent / "out"
CHILDREN: list[Any] = []
"""Every router and redis process started here, stopped when the run ends however it ends."""
SESSION_HEADER = "x-session-id"


# ---- the L4 balancer -----------------------------------------------------------------------------------


class L4Balancer:
    """Round-robin TCP balancer on 127.0.0.1: connection i goes to upstream i mod n, bytes piped both
    ways unchanged (half-closes passed on), at most ``max_connections`` at once."""

    def __init__(self, upstreams: Sequence[tuple[str, int]], max_connections: int = 4096) -> None:
        self.upstreams = list(upstreams)
        self.sem = asyncio.Semaphore(max_connections)
        self.turn = 0
        self.per_upstream = [0] * len(self.upstreams)
        self.server: asyncio.Server | None = None
        self.port = 0
        self.handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.handlers.add(task)
            task.add_done_callback(self.handlers.discard)
        async with self.sem:
            i = self.turn % len(self.upstreams)
            self.turn += 1
            self.per_upstream[i] += 1
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstreams[i])
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
            for w in (writer, up_writer):
                w.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        handlers = list(self.handlers)
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
        dst.close()


ROUTER_CPUS: set[int] | None = None
"""With ``--pin``: the CPUs of every router and the store; the bench process (the simulated engines
and the load generator) keeps the others."""


def pin(proc: subprocess.Popen[bytes] | None) -> None:
    """Move every thread of a child process onto ``ROUTER_CPUS`` (threads it starts later inherit)."""
    if ROUTER_CPUS is None or proc is None:
        return
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), ROUTER_CPUS)


# ---- redis ----------------------------------------------------------------------------------------------


class RedisProcess:
    """redis-server on a loopback port (same port across restarts), no persistence."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
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
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    pin(self.proc)  # (with --pin: beside the routers, at every start)
                    return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# ---- Prometheus text ------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """(name, label text) -> value."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def total(samples: dict[tuple[str, str], float], name: str, has: str = "") -> float:
    """Sum of a family's samples whose labels contain ``has``."""
    return sum(v for (n, labels), v in samples.items() if n == name and has in labels)


def hist_quantile(samples: Sequence[dict[tuple[str, str], float]], name: str, q: float) -> float | None:
    """Quantile of a histogram summed over several scrapes (linear within a bucket, as PromQL does)."""
    buckets: dict[float, float] = {}
    for s in samples:
        for (n, labels), v in s.items():
            if n == name + "_bucket":
                le = re.search(r'le="([^"]+)"', labels)
                if le:
                    bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
                    buckets[bound] = buckets.get(bound, 0.0) + v
    if not buckets or buckets.get(math.inf, 0.0) == 0:
        return None
    bounds = sorted(buckets)
    rank = q * buckets[math.inf]
    prev_b, prev_c = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == math.inf:
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_b, prev_c = b, c
    return prev_b


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# ---- one arm ------------------------------------------------------------------------------------------


@dataclass
class Arm:
    label: str
    replicas: int
    shared: bool = False
    sessions: bool = False
    publish_interval_s: float | None = None
    assume: bool = True
    """``cluster.assume_concurrent_decisions`` (the default); False: the view alone."""
    balanced: int = 0
    """Routers behind the balancer (0: all); the others run, share and ingest, but get no requests
    (a control for the box's CPU: the replicas' cost without their split of the traffic)."""
    stagger: bool | None = None
    """``cluster.stagger_bursts`` (None: the default, on)."""


@dataclass
class Workload:
    name: str
    requests: list[Request]
    bound: float
    engine: EngineConfig
    speedup: float
    engines: int
    concurrency: int = 256
    deadline_s: float = 60.0
    trace_time: bool = True
    """TTFT in trace seconds (x speedup); False: wall seconds (the cost stage)."""


@dataclass
class ArmResult:
    row: Row
    results: list[RequestResult]
    extra: dict[str, Any] = field(default_factory=dict)


def cluster_toml(arm: Arm, redis_url: str | None) -> str:
    lines = ["", "[cluster]"]
    if arm.shared and redis_url:
        lines.append(f'redis_url = "{redis_url}"')
        if arm.publish_interval_s is not None:
            lines.append(f"publish_interval_s = {arm.publish_interval_s}")
        if not arm.assume:
            lines.append("assume_concurrent_decisions = false")
        if arm.stagger is not None:
            lines.append(f"stagger_bursts = {str(arm.stagger).lower()}")
    if arm.sessions:
        lines.append(f'session_header = "{SESSION_HEADER}"')
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


async def wait_peers(urls: Sequence[str], peers: int, timeout_s: float = 30.0) -> float:
    """Seconds until every router is connected to the store and sees ``peers`` peers."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            ok = True
            for url in urls:
                try:
                    c = (await client.get(url + "/debug/index")).json()["cluster"]
                except (httpx.HTTPError, KeyError, ValueError):
                    ok = False
                    break
                if not c.get("connected") or len(c.get("peers", [])) != peers:
                    ok = False
                    break
            if ok:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"routers did not all see {peers} peers within {timeout_s:.0f} s")
            await asyncio.sleep(0.05)


async def run_arm(
    work: Workload,
    arm: Arm,
    tmp: Path,
    redis: RedisProcess | None,
    kill_at: tuple[float, float] | None = None,
) -> ArmResult:
    """Fresh fleet and routers for one arm, the replay through the balancer, the figures."""
    fleet = Fleet.uniform(work.engines, work.engine)
    await fleet.start()
    routers: list[RouterProcess] = []
    lb: L4Balancer | None = None
    extra: dict[str, Any] = {}
    try:
        for i in range(arm.replicas):
            port = free_port()
            path = tmp / f"{work.name}-{arm.label}-{i}.toml"
            path.write_text(
                router_config(fleet, "kv", port, 16, None, {})
                + cluster_toml(arm, redis.url if redis else None)
            )
            r = RouterProcess(path, tmp / f"{work.name}-{arm.label}-{i}.log", port)
            CHILDREN.append(r)
            r.start()
            routers.append(r)
        for r in routers:
            await r.wait_ready(120.0)
            pin(r.proc)
        if arm.shared:
            await wait_peers([r.url for r in routers], arm.replicas - 1)
        lb = L4Balancer([("127.0.0.1", r.port) for r in routers[: arm.balanced or len(routers)]])
        await lb.start()
        cpu0 = [cpu_seconds(r.proc.pid) if r.proc else 0.0 for r in routers]
        dcfg = DriverConfig(
            base_url=lb.url,
            model=work.engine.model,
            concurrency=work.concurrency,
            speedup=work.speedup,
            session_mode=False,
            deadline_s=work.deadline_s,
            session_header=SESSION_HEADER if arm.sessions else None,
        )
        killer = None
        if kill_at is not None and redis is not None:
            killer = asyncio.get_running_loop().create_task(
                _outage(redis, [r.url for r in routers], kill_at, extra)
            )
        t0, own0 = time.monotonic(), time.process_time()
        results = await run(work.requests, dcfg)
        wall = time.monotonic() - t0
        extra["bench_cpu_s"] = time.process_time() - own0  # the engines' and the load generator's
        if killer is not None:
            await killer
        each = [(cpu_seconds(r.proc.pid) if r.proc else 0.0) - c for r, c in zip(routers, cpu0, strict=True)]
        extra["router_cpu_s"] = sum(each)
        extra["router_cpu_each_s"] = each
        extra["wall_s"] = wall
        extra["balancer_connections"] = list(lb.per_upstream)
        scrapes = []
        async with httpx.AsyncClient(timeout=10) as client:
            for r in routers:
                scrapes.append(parse_metrics((await client.get(r.url + "/metrics")).text))
        routed = sum(total(s, "kvrouter_requests_total") for s in scrapes)
        extra["routed"] = routed
        dp99 = hist_quantile(scrapes, "kvrouter_route_decision_seconds", 0.99)
        dp50 = hist_quantile(scrapes, "kvrouter_route_decision_seconds", 0.5)
        extra["decision_p50_ms"] = dp50 * 1e3 if dp50 is not None else None
        extra["decision_p99_ms"] = dp99 * 1e3 if dp99 is not None else None
        extra["cpu_ms_per_request"] = extra["router_cpu_s"] * 1e3 / routed if routed else None
        held = sum(total(s, "kvrouter_cluster_held_decisions_total", 'unit="decisions"') for s in scrapes)
        held_s = sum(total(s, "kvrouter_cluster_held_decisions_total", 'unit="seconds"') for s in scrapes)
        extra["held_decisions"] = held
        extra["held_ms_mean"] = held_s * 1e3 / held if held else None
        if arm.shared:
            sent_msgs = sum(total(s, "kvrouter_cluster_messages_total", 'direction="sent"') for s in scrapes)
            sent_bytes = sum(total(s, "kvrouter_cluster_bytes_total", 'direction="sent"') for s in scrapes)
            recv_msgs = sum(
                total(s, "kvrouter_cluster_messages_total", 'direction="received"') for s in scrapes
            )
            recv_bytes = sum(
                total(s, "kvrouter_cluster_bytes_total", 'direction="received"') for s in scrapes
            )
            extra |= {
                "sent_messages_per_request": sent_msgs / routed if routed else None,
                "sent_bytes_per_request": sent_bytes / routed if routed else None,
                "received_messages_per_request": recv_msgs / routed if routed else None,
                "received_bytes_per_request": recv_bytes / routed if routed else None,
                "lag_p50_ms": _ms(hist_quantile(scrapes, "kvrouter_cluster_lag_seconds", 0.5)),
                "lag_p99_ms": _ms(hist_quantile(scrapes, "kvrouter_cluster_lag_seconds", 0.99)),
                "failures": sum(total(s, "kvrouter_cluster_failures_total") for s in scrapes),
                "predicted_keys_sent": sum(
                    total(s, "kvrouter_cluster_predicted_keys_total", 'direction="sent"') for s in scrapes
                ),
            }
        if arm.sessions:
            extra["affinity"] = {
                res: sum(total(s, "kvrouter_session_affinity_total", f'result="{res}"') for s in scrapes)
                for res in ("new", "kept", "steered", "overloaded", "unavailable")
            }
        extra["bursts"] = burst_placement(work.requests, results, work.engines)
        row = await trace_row(arm.label, results, fleet.urls, work, rates=True)
        return ArmResult(row, results, extra)
    finally:
        if lb is not None:
            await lb.stop()
        for r in routers:
            r.stop()
        await fleet.stop()


def _ms(v: float | None) -> float | None:
    return v * 1e3 if v is not None else None


async def _outage(
    redis: RedisProcess, urls: list[str], at: tuple[float, float], extra: dict[str, Any]
) -> None:
    """Kill the store at ``at[0]`` s into the run, restart it (empty) at ``at[1]``, time the resync."""
    t0 = time.monotonic()
    await asyncio.sleep(at[0])
    redis.kill()
    extra["killed_at_s"] = time.monotonic() - t0
    await asyncio.sleep(max(0.0, at[1] - (time.monotonic() - t0)))
    redis.start()
    extra["restarted_at_s"] = time.monotonic() - t0
    extra["resync_s"] = await wait_peers(urls, len(urls) - 1, 60.0)


# ---- stages ------------------------------------------------------------------------------------------


TRACES: dict[str, dict[str, Any]] = {
    # the setting: 4 engines with 2,000-block LRU caches, ~1,500 requests in ~60 s
    "synthetic": {"load": {"limit": 1500}, "tpb": 16, "speedup": 6.8},
    "conversation": {"load": {"limit": 1500}, "tpb": 16, "speedup": 8.5},
    "sessions": {"load": {"max_sessions": 32, "session_rate": 1.0}, "tpb": 4, "speedup": 10.0},
}


def workload(
    name: str,
    quick: bool,
    deadline_s: float,
    capacity_blocks: int,
    engine_speed: float = 1.0,
    limit: int | None = None,
) -> Workload:
    """``limit``: that many requests of the trace instead of its spec's (``quick``: 300)."""
    spec = TRACES[name]
    load = dict(spec["load"])
    if limit is not None:
        load["limit"] = limit
    if quick:
        load["limit"] = 300
    trace = load_trace(name, tokens_per_block=spec["tpb"], max_input_tokens=200_000, **load)
    speedup = spec["speedup"]
    base = EngineConfig(model="toy-model", time_scale=1.0 / (speedup * engine_speed))
    engine = scaled_engine(base, trace.scale, capacity_blocks)
    requests, bound = trace_window(trace, engine, speedup, deadline_s)
    return Workload(name, requests, bound, engine, speedup, 4, deadline_s=deadline_s)


async def trace_row(
    label: str, results: Sequence[RequestResult], urls: Sequence[str], work: Workload, rates: bool = False
) -> Row:
    """An arm's row from the engines' counters, its TTFTs in trace seconds (x ``work.speedup``)
    unless the workload runs in wall seconds; ``rates``: its throughput figures too."""
    row = from_live(label, results, await scrape_engines(urls), work.bound, label=label)
    if work.trace_time:
        for attr in ("ttft_p50", "ttft_p90", "ttft_p99"):
            setattr(row, attr, getattr(row, attr) * work.speedup)
        if rates:
            row.throughput_rps /= work.speedup
            row.output_tps /= work.speedup
    return row


def quality_arms(name: str, only: str = "") -> list[Arm]:
    arms = [
        Arm("one", 1),
        Arm("three-alone", 3),
        Arm("three-shared (view only)", 3, shared=True, assume=False),
        Arm("three-shared", 3, shared=True),
    ]
    if only:  # on request only: the assumption unstaggered; controls (one router takes every request)
        arms.append(Arm("three-shared (no stagger)", 3, shared=True, stagger=False))
        arms.append(Arm("one+2idle", 3, shared=True, balanced=1))
        arms.append(Arm("one+2idle-alone", 3, balanced=1))  # the same without sharing: ingest only
    if name == "sessions":
        arms.append(Arm("three-shared+sessions", 3, shared=True, sessions=True))
    if only:
        keep = {a.strip() for a in only.split(",")}
        arms = [a for a in arms if a.label in keep]
    return arms


def burst_placement(
    requests: Sequence[Request], results: Sequence[RequestResult], engines: int
) -> dict[str, Any]:
    """How evenly each burst (requests with one arrival time) was spread: per burst of n, the
    requests the busiest engine got beyond ceil(n / engines), summed; and the share of bursts
    with any such excess. One router placing a burst in turn keeps this near 0 when load decides."""
    at = {i: r.at_s for i, r in enumerate(requests)}
    groups: dict[float, list[str]] = {}
    for res in results:
        if res.ok and res.backend is not None:
            groups.setdefault(at.get(res.index, -1.0), []).append(res.backend)
    excess = uneven = n_bursts = 0
    for backends in groups.values():
        if len(backends) < 2:
            continue
        n_bursts += 1
        most = max(backends.count(b) for b in set(backends))
        over = most - -(-len(backends) // engines)
        excess += max(over, 0)
        uneven += over > 0
    return {"bursts": n_bursts, "excess": excess, "uneven_share": uneven / n_bursts if n_bursts else 0.0}


def window_quality(results: Sequence[RequestResult], since_s: float, speedup: float) -> dict[str, float]:
    """Hit ratio and TTFT p50/p90 (trace seconds) of the requests sent from ``since_s`` on."""
    ok = [r for r in results if r.ok and r.sent_s >= since_s]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] * speedup if ttft else 0.0

    return {
        "requests": len(ok),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50": pct(0.5),
        "ttft_p90": pct(0.9),
    }


PARTIAL: Path | None = None
"""Where records are written as they come (a crash late in a long run keeps the earlier ones)."""
_SO_FAR: list[dict[str, Any]] = []


def record(rec: dict[str, Any], res: ArmResult) -> dict[str, Any]:
    rec.update(row=msgspec.to_builtins(res.row), extra=res.extra)
    _SO_FAR.append(rec)
    if PARTIAL is not None:
        PARTIAL.write_text(json.dumps({"records": _SO_FAR}, indent=1))
    r = res.row
    print(
        f"  {rec['stage']:<8} {rec['trace']:<12} {r.label:<24} hit {r.hit_ratio:.3f} "
        f"ttft p50/p90/p99 {r.ttft_p50:.3f}/{r.ttft_p90:.3f}/{r.ttft_p99:.3f} s errors {r.errors} "
        f"decision p99 {res.extra.get('decision_p99_ms') or 0:.2f} ms "
        + (
            f"lag p50/p99 {res.extra.get('lag_p50_ms') or 0:.2f}/{res.extra.get('lag_p99_ms') or 0:.2f} ms "
            f"sent {res.extra.get('sent_messages_per_request') or 0:.2f} msg "
            f"{res.extra.get('sent_bytes_per_request') or 0:.0f} B/request"
            if "lag_p50_ms" in res.extra
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    return rec


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    stages = set(args.stages.split(","))
    with tempfile.TemporaryDirectory(prefix="kvrouter-replicas-") as tmpdir:
        tmp = Path(tmpdir)
        redis = RedisProcess(tmp)
        CHILDREN.append(redis)
        redis.start()
        try:
            for rnd in range(args.rounds):
                if "quality" in stages:
                    for name in args.traces.split(","):
                        work = workload(
                            name, args.quick, args.deadline, args.capacity_blocks, args.engine_speed
                        )
                        for arm in quality_arms(name, args.arms):
                            res = await run_arm(work, arm, tmp, redis)
                            out.append(record({"stage": "quality", "round": rnd, "trace": name}, res))
                if "cost" in stages:
                    # a fast, lightly loaded fleet at ~75 requests/s: what the routers add is the story
                    spec = TRACES["synthetic"]
                    fast = 20.0  # 25 s of requests at 20x the trace's rate
                    work = workload(
                        "synthetic", args.quick, 25.0 * fast / spec["speedup"], args.capacity_blocks, 10.0
                    )
                    work.speedup = fast
                    work.deadline_s = 25.0
                    work.engine = msgspec.structs.replace(
                        work.engine, time_scale=1.0 / (spec["speedup"] * args.engine_speed * 10.0)
                    )
                    work.trace_time = False
                    arms = [Arm("three-alone", 3)] + [
                        Arm(f"three-shared@{iv * 1e3:g}ms", 3, shared=True, publish_interval_s=iv)
                        for iv in (0.0, 0.002, 0.01)
                    ]
                    for arm in arms:
                        res = await run_arm(work, arm, tmp, redis)
                        out.append(record({"stage": "cost", "round": rnd, "trace": "synthetic fast"}, res))
                if "kill" in stages:
                    work = workload(
                        "synthetic", args.quick, args.deadline, args.capacity_blocks, args.engine_speed
                    )
                    base = await run_arm(work, Arm("three-shared", 3, shared=True), tmp, redis)
                    kill_at, back_at = (args.deadline / 3, args.deadline / 3 + 10.0)
                    res = await run_arm(
                        work,
                        Arm("three-shared, store killed", 3, shared=True),
                        tmp,
                        redis,
                        (kill_at, back_at),
                    )
                    since = res.extra["restarted_at_s"] + 5.0
                    res.extra["after_return"] = window_quality(res.results, since, work.speedup)
                    res.extra["same_requests_uninterrupted"] = window_quality(
                        [
                            r
                            for r in base.results
                            if r.index in {x.index for x in res.results if x.sent_s >= since}
                        ],
                        0.0,
                        work.speedup,
                    )
                    out.append(record({"stage": "kill", "round": rnd, "trace": "synthetic"}, base))
                    out.append(record({"stage": "kill", "round": rnd, "trace": "synthetic"}, res))
                    keys = ("killed_at_s", "restarted_at_s", "resync_s", "after_return")
                    shown = {k: res.extra[k] for k in (*keys, "same_requests_uninterrupted")}
                    print(f"  kill: {json.dumps(shown)}", file=sys.stderr)
        finally:
            redis.stop()
    return out


def markdown(records: list[dict[str, Any]]) -> str:
    lines = ["# Router replicas", ""]
    head = (
        "| stage | trace | arm | round | hit ratio | TTFT p50 s | p90 | p99 | errors | spread "
        "| decision p99 ms | lag p50/p99 ms | sent msg/req | sent B/req | recv B/req | router CPU ms/req |"
    )
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    for rec in records:
        r, e = rec["row"], rec["extra"]
        lag = f"{e['lag_p50_ms']:.2f}/{e['lag_p99_ms']:.2f}" if e.get("lag_p50_ms") is not None else ""
        lines.append(
            f"| {rec['stage']} | {rec['trace']} | {r['label']} | {rec['round']} | {r['hit_ratio']:.3f} "
            f"| {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} | {r['ttft_p99']:.3f} | {r['errors']} "
            f"| {r['spread_tokens']:.2f} | {_f(e.get('decision_p99_ms'))} | {lag} "
            f"| {_f(e.get('sent_messages_per_request'))} | {_f(e.get('sent_bytes_per_request'), 0)} "
            f"| {_f(e.get('received_bytes_per_request'), 0)} | {_f(e.get('cpu_ms_per_request'))} |"
        )
    return "\n".join(lines) + "\n"


def _f(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="300 requests per trace")
    p.add_argument("--traces", default="synthetic,conversation,sessions")
    p.add_argument("--stages", default="quality,cost,kill")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=64_000,
        help="KV cache per engine in real 16-token blocks, as `kvrouter bench replay --capacity-blocks` "
        "(64,000 = 2,000 engine blocks on the Mooncake traces)",
    )
    p.add_argument(
        "--engine-speed",
        type=float,
        default=2.0,
        help="engines this much faster than the trace's arrival rate implies (1 = the mock engine's "
        "A100-class timing, which the full-length Mooncake prompts overload)",
    )
    p.add_argument("--deadline", type=float, default=60.0, help="seconds of requests per run")
    p.add_argument("--arms", default="", help="quality arms to run, by label (comma-separated; default all)")
    p.add_argument(
        "--pin",
        action="store_true",
        help="routers and the store on the last CPU, this process (the engines, the load) on the others",
    )
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global PARTIAL, ROUTER_CPUS
    PARTIAL = out / "replicas.partial.json"
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        ROUTER_CPUS = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))
    started = time.strftime("%Y-%m-%d %H:%M")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        records = asyncio.run(main_async(args))
    finally:
        for child in CHILDREN:
            with contextlib.suppress(Exception):
                child.stop()
    meta = {"started": started, "args": vars(args), "load": os.getloadavg()}
    (out / "replicas.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / "replicas.md").write_text(markdown(records))
    print(markdown(records))
    _summary(records)
    return 0


def _summary(records: list[dict[str, Any]]) -> None:
    """Ratios to the one-router arm of the same trace and round."""
    base = {
        (r["trace"], r["round"]): r["row"]
        for r in records
        if r["stage"] == "quality" and r["row"]["label"] == "one"
    }
    for r in records:
        b = base.get((r["trace"], r["round"]))
        if r["stage"] != "quality" or b is None or r["row"]["label"] == "one":
            continue
        row = r["row"]
        print(
            f"{r['trace']:<12} {row['label']:<24} round {r['round']}: "
            f"hit {row['hit_ratio'] - b['hit_ratio']:+.3f}, "
            f"TTFT p50 x{row['ttft_p50'] / b['ttft_p50']:.2f}, p90 x{row['ttft_p90'] / b['ttft_p90']:.2f}",
        )


if __name__ == "__main__":
    sys.exit(main())
