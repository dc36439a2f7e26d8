"""Flow control: routing quality at saturation with the admission queue on and off, and its own cost.

``.venv/bin/python bench/flow_bench.py [--quick] [--stages trace,overhead] [--max-active 4,8]
[--engine-speed 1.0] [--reserve 0.25,0.5]`` writes ``bench/out/flow.json`` and ``bench/out/flow.md``.

Stages:

- ``trace``: the replicas benchmark's live replay (``bench/replicas.py``: 4 mock vLLM engines over
  HTTP and ZeroMQ with 2,000-block LRU caches, the first 1,500 requests of the Mooncake synthetic
  trace in ~60 s, or ``--limit`` of them: 3,500 reach an infinite-cache bound of 0.58, a
  ``kvrouter serve`` subprocess) at an engine speed where the fleet saturates,
  once with ``[flow]`` off and once per ``--max-active`` with it on, side by side in one run, each arm
  on fresh engines and a fresh router: hit ratio, TTFT p50/p90/p99 (trace seconds), answers that
  were 429/503, the queue's dispatches and waits, router CPU per request.
- ``overhead``: in one process, on a real event loop, the controller against a real load tracker:
  the CPU of :meth:`FlowController.admit` plus its ticket's release when nothing queues (what
  ``[flow]`` on adds to each request; off adds one ``None`` check), and the dispatch latency from a
  request's end (``LoadTracker.finish``, capacity freed) to the next queued request's ``admit``
  returning in its own task.
- ``contention``: 2 mock engines under a closed-loop overload, a router per arm: a high band's TTFT
  alone and beside 48 default-band clients, and three flows' TTFT alone and beside a flow of 40
  clients; with flow control on (also with each ``--reserve`` as ``flow.higher_band_reserve``) and
  off, side by side in one run.

Bounded: each replay stops issuing requests after ``--deadline`` seconds; every process started here
is stopped at the end; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replicas import (
    CHILDREN,
    Workload,
    cpu_seconds,
    hist_quantile,
    parse_metrics,
    total,
    trace_row,
    workload,
)

from router.fleet.load import LoadTracker
from router.flow.config import FlowConfig
from router.flow.controller import FlowController, FlowMeta, Ticket
from sim.demo import RouterProcess, free_port, router_config
from sim.driver import DriverConfig, run
from sim.fleet import Fleet

OUT = Path(__file__).resolve().parent / "out"


def flow_toml(max_active: int, max_pending: int, restrict: bool = True) -> str:
    head = f"\n[flow]\nenabled = true\nrestrict_to_room = {str(restrict).lower()}\n"
    return head + f"max_active = {max_active}\nmax_pending_prefill_tokens = {max_pending}\n"


async def run_arm(work: Workload, label: str, extra_toml: str, tmp: Path) -> dict[str, Any]:
    """Fresh engines and a fresh router with ``extra_toml``; the replay; its figures."""
    fleet = Fleet.uniform(work.engines, work.engine)
    await fleet.start()
    router: RouterProcess | None = None
    try:
        port = free_port()
        path = tmp / f"{label.replace(' ', '_')}.toml"
        path.write_text(router_config(fleet, "kv", port, 16, None, {}) + extra_toml)
        router = RouterProcess(path, tmp / f"{label.replace(' ', '_')}.log", port)
        CHILDREN.append(router)
        router.start()
        await router.wait_ready(120.0)
        cpu0 = cpu_seconds(router.proc.pid) if router.proc else 0.0
        dcfg = DriverConfig(
            base_url=router.url,
            model=work.engine.model,
            concurrency=work.concurrency,
            speedup=work.speedup,
            session_mode=False,
            deadline_s=work.deadline_s,
        )
        t0 = time.monotonic()
        results = await run(work.requests, dcfg)
        wall = time.monotonic() - t0
        cpu = (cpu_seconds(router.proc.pid) if router.proc else 0.0) - cpu0
        async with httpx.AsyncClient(timeout=10) as client:
            scrape = parse_metrics((await client.get(router.url + "/metrics")).text)
        row = await trace_row(label, results, fleet.urls, work)
        routed = total(scrape, "kvrouter_requests_total")
        statuses: dict[str, int] = {}
        for r in results:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        wait_p90 = hist_quantile([scrape], "kvrouter_flow_wait_seconds", 0.9)
        rec = {
            "arm": label,
            "row": msgspec.to_builtins(row),
            "statuses": statuses,
            "wall_s": wall,
            "router_cpu_ms_per_request": cpu * 1e3 / routed if routed else None,
            "flow_dispatched": total(scrape, "kvrouter_flow_dispatched_total"),
            "flow_rejected": total(scrape, "kvrouter_flow_rejected_total"),
            "flow_wait_p90_s": wait_p90 * work.speedup if wait_p90 is not None else None,
        }
        print(
            f"  {label:<28} hit {row.hit_ratio:.3f} ttft p50/p90/p99 {row.ttft_p50:.2f}/{row.ttft_p90:.2f}/"
            f"{row.ttft_p99:.2f} s statuses {statuses} "
            f"cpu {rec['router_cpu_ms_per_request'] or 0:.2f} ms/req",
            file=sys.stderr,
            flush=True,
        )
        return rec
    finally:
        if router is not None:
            router.stop()
        await fleet.stop()


async def trace_stage(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = workload(
        "synthetic", args.quick, args.deadline, args.capacity_blocks, args.engine_speed, args.limit
    )
    out = []
    with tempfile.TemporaryDirectory(prefix="kvrouter-flow-") as tmpdir:
        tmp = Path(tmpdir)
        for rnd in range(args.rounds):
            arms = [("flow off", "")]
            for a in args.max_active:
                if not args.no_strict:
                    arms.append((f"flow on, max_active {a}", flow_toml(a, args.max_pending)))
                if args.loose or args.no_strict:
                    arms.append(
                        (f"flow on, max_active {a}, any target", flow_toml(a, args.max_pending, False))
                    )
            for label, toml in arms:
                rec = await run_arm(work, label, toml, tmp)
                rec["round"] = rnd
                out.append(rec)
    return out


async def overhead_stage(n: int) -> dict[str, Any]:
    """admit + release when nothing queues, and capacity-freed -> dispatched latency."""
    loads = LoadTracker()
    targets = [(f"e{i}", 0) for i in range(4)]
    for t in targets:
        loads.track(t)
    ctl = FlowController(FlowConfig(enabled=True, max_active=1), loads, lambda model: targets)
    meta = FlowMeta("m", 0, "", 100)
    # -- nothing queues: admit + release, the load tracker's start/finish around it as the proxy does
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            grant = await ctl.admit(meta)
            assert isinstance(grant, Ticket)
            grant.release()
        runs.append((time.process_time() - t0) / n * 1e6)
    await asyncio.sleep(0)
    # -- the dispatch latency: every target busy, one request queued; a request's end frees room
    lat = []
    for _ in range(min(n, 2000)):
        tickets = [loads.start(t, 10) for t in targets]
        waiter = asyncio.get_running_loop().create_task(_timed_admit(ctl, meta))
        await asyncio.sleep(0)  # (it queues)
        assert sum(ctl.depth().values()) == 1
        freed = time.perf_counter()
        loads.finish(tickets[0])
        left = await waiter
        lat.append((left - freed) * 1e6)
        for tk in tickets[1:]:
            loads.finish(tk)
        await asyncio.sleep(0)
    lat.sort()
    return {
        "admit_release_us": statistics.median(runs),
        "admit_release_us_runs": runs,
        "dispatch_latency_us_p50": lat[len(lat) // 2],
        "dispatch_latency_us_p99": lat[int(len(lat) * 0.99)],
        "dispatch_samples": len(lat),
    }


# ---- priority and fairness under overload: a closed-loop background load, probes on top -----------


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1 << 30) for _ in range(n)]


async def _one(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], prompt: list[int]
) -> tuple[int, float]:
    """(status, TTFT s) of one streamed completion."""
    body = {"model": "toy-model", "prompt": prompt, "max_tokens": 8, "stream": True}
    t0 = time.perf_counter()
    ttft = -1.0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        async for chunk in r.aiter_raw():
            if ttft < 0 and chunk:
                ttft = time.perf_counter() - t0
    return r.status_code, ttft


async def _loop(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    rng: random.Random,
    stop: float,
    out: list[float],
) -> None:
    while time.monotonic() < stop:
        status, ttft = await _one(client, url, headers, _prompt(rng, 512))
        if status == 200:
            out.append(ttft)


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def contention_arm(
    label: str,
    flow: str,
    loops: dict[str, tuple[int, dict[str, str]]],
    seconds: float,
    tmp: Path,
) -> dict[str, Any]:
    """2 mock engines, a router with ``flow`` (TOML lines, "" = off), closed loops per group
    (name -> (clients, headers)) for ``seconds``: each group's TTFT p50/p90/p99 and answers."""
    from sim.engine import EngineConfig

    fleet = Fleet.uniform(2, EngineConfig(model="toy-model", time_scale=0.25))
    await fleet.start()
    router: RouterProcess | None = None
    try:
        port = free_port()
        path = tmp / f"{label.replace(' ', '_')}.toml"
        path.write_text(router_config(fleet, "kv", port, 16, None, {}) + flow)
        router = RouterProcess(path, tmp / f"{label.replace(' ', '_')}.log", port)
        CHILDREN.append(router)
        router.start()
        await router.wait_ready(120.0)
        results: dict[str, list[float]] = {name: [] for name in loops}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            stop = time.monotonic() + seconds
            tasks = [
                _loop(client, router.url, hdrs, random.Random(f"{name}{i}"), stop, results[name])
                for name, (n, hdrs) in loops.items()
                for i in range(n)
            ]
            await asyncio.gather(*tasks)
        rec: dict[str, Any] = {"arm": label}
        for name, xs in results.items():
            rec[name] = {
                "n": len(xs),
                **{
                    f"p{int(q * 100)}_ms": (v * 1e3 if (v := _pct(xs, q)) else None) for q in (0.5, 0.9, 0.99)
                },
            }
        print(
            f"  {label:<36} {json.dumps({k: v for k, v in rec.items() if k != 'arm'})}",
            file=sys.stderr,
            flush=True,
        )
        return rec
    finally:
        if router is not None:
            router.stop()
        await fleet.stop()


async def contention_stage(seconds: float, reserves: list[float]) -> list[dict[str, Any]]:
    """The priority and fairness arms, with flow control off, on, and on with each
    ``flow.higher_band_reserve`` in ``reserves``, side by side in one run."""
    flow = "\n[flow]\nenabled = true\nmax_active = 4\npriorities = [10]\n"
    high = {"x-kvrouter-priority": "10"}
    bg: tuple[int, dict[str, str]] = (48, {})
    on = [("flow on", flow)] + [
        (f"flow on, reserve {r:g}", flow + f"higher_band_reserve = {r!r}\n") for r in reserves
    ]
    out = []
    with tempfile.TemporaryDirectory(prefix="kvrouter-flow-") as tmpdir:
        tmp = Path(tmpdir)
        # priority: 2 high-band clients alone (the reserve never limits the highest band), then
        # beside 48 default-band ones: flow on (per reserve), then off
        out.append(await contention_arm("priority: high alone", flow, {"high": (2, high)}, seconds, tmp))
        loaded = {"high": (2, high), "default": bg}
        for label, toml in on:
            out.append(await contention_arm(f"priority: loaded, {label}", toml, loaded, seconds, tmp))
        out.append(await contention_arm("priority: loaded, flow off", "", loaded, seconds, tmp))
        # fairness: 3 flows of 4 clients each, alone, then beside a flow of 40 (10x), per setting
        others = {f"flow{i}": (4, {"x-gateway-inference-fairness-id": f"f{i}"}) for i in range(3)}
        flood = {"flood": (40, {"x-gateway-inference-fairness-id": "flood"})}
        for label, toml in on:
            out.append(await contention_arm(f"fairness: others alone, {label}", toml, others, seconds, tmp))
            out.append(
                await contention_arm(
                    f"fairness: with a 10x flood, {label}", toml, {**others, **flood}, seconds, tmp
                )
            )
        out.append(
            await contention_arm(
                "fairness: with a 10x flood, flow off", "", {**others, **flood}, seconds, tmp
            )
        )
    return out


async def _timed_admit(ctl: FlowController, meta: FlowMeta) -> float:
    grant = await ctl.admit(meta)
    left = time.perf_counter()
    assert isinstance(grant, Ticket)
    grant.release()
    return left


def markdown(
    trace: list[dict[str, Any]],
    overhead: dict[str, Any] | None,
    contention: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> str:
    lines = ["# Flow control", ""]
    if contention:
        lines += ["| arm | group | answered | TTFT p50 ms | p90 | p99 |", "|---|---|---|---|---|---|"]
        for r in contention:
            for name, g in r.items():
                if name == "arm":
                    continue
                cells = [f"{g[k]:.0f}" if g[k] is not None else "-" for k in ("p50_ms", "p90_ms", "p99_ms")]
                lines.append(f"| {r['arm']} | {name} | {g['n']} | " + " | ".join(cells) + " |")
        lines.append("")
    if trace:
        lines += [
            "| round | arm | hit ratio | TTFT p50 s | p90 | p99 | answers | queue wait p90 s "
            "| router CPU ms/req |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in trace:
            row = r["row"]
            lines.append(
                f"| {r['round']} | {r['arm']} | {row['hit_ratio']:.3f} | {row['ttft_p50']:.2f} | "
                f"{row['ttft_p90']:.2f} | {row['ttft_p99']:.2f} | {r['statuses']} | "
                f"{'-' if r['flow_wait_p90_s'] is None else round(r['flow_wait_p90_s'], 2)} | "
                f"{r['router_cpu_ms_per_request'] or 0:.2f} |"
            )
        lines.append("")
    if overhead:
        lines.append(
            f"admit + release, nothing queued: {overhead['admit_release_us']:.2f} us (median of 5 runs); "
            f"capacity freed -> dispatched: p50 {overhead['dispatch_latency_us_p50']:.0f} us, "
            f"p99 {overhead['dispatch_latency_us_p99']:.0f} us ({overhead['dispatch_samples']} samples)"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="300 requests")
    p.add_argument("--stages", default="overhead,contention,trace")
    p.add_argument("--contention-s", type=float, default=12.0, help="seconds per contention arm")
    p.add_argument(
        "--reserve",
        default="",
        help="contention: also arms with flow.higher_band_reserve at each of these (e.g. 0.25,0.5)",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--capacity-blocks", type=int, default=64_000, help="as bench/replicas.py (2,000 blocks)")
    p.add_argument(
        "--engine-speed", type=float, default=1.0, help="1: the fleet saturates (bench/replicas.py)"
    )
    p.add_argument("--max-active", default="8", help="flow.max_active of the arms with flow on")
    p.add_argument("--max-pending", type=int, default=0, help="flow.max_pending_prefill_tokens (0: off)")
    p.add_argument("--deadline", type=float, default=60.0)
    p.add_argument(
        "--limit", type=int, help="trace: this many requests (default 1,500; 3,500 reach a bound of 0.57)"
    )
    p.add_argument("--no-strict", action="store_true", help="trace: no restrict_to_room = true arm")
    p.add_argument(
        "--loose", action="store_true", help="also arms with flow.restrict_to_room = false (decide among all)"
    )
    p.add_argument("--n", type=int, default=20000, help="admissions timed in the overhead stage")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    args.max_active = [int(x) for x in args.max_active.split(",") if x]
    args.reserve = [float(x) for x in args.reserve.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    started = time.strftime("%Y-%m-%d %H:%M")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trace: list[dict[str, Any]] = []
    overhead = None
    contention: list[dict[str, Any]] = []
    try:
        if "overhead" in stages:
            overhead = asyncio.run(overhead_stage(args.n))
            print(f"  overhead {json.dumps(overhead)}", file=sys.stderr)
        if "contention" in stages:
            contention = asyncio.run(contention_stage(args.contention_s, args.reserve))
        if "trace" in stages:
            trace = asyncio.run(trace_stage(args))
    finally:
        for child in CHILDREN:
            with contextlib.suppress(Exception):
                child.stop()
    meta = {"started": started, "args": vars(args), "load": os.getloadavg()}
    (out / "flow.json").write_text(
        json.dumps({"meta": meta, "trace": trace, "overhead": overhead, "contention": contention}, indent=1)
    )
    (out / "flow.md").write_text(markdown(trace, overhead, contention))
    print(markdown(trace, overhead, contention))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
