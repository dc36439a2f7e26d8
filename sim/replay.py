"""`kvrouter bench replay`: a public trace through the policies, live (mock engines + the real router)
or offline (the discrete-event simulator, ``--offline``).

Both paths use the same trace loader and the same scaling (``--tokens-per-block``, see
``sim.traces``): with ``s = trace block size / tokens per block`` a simulated token stands for ``s``
real ones, so the engines' per-token and per-step costs are multiplied by ``s``, outputs are divided
by ``s`` and ``--capacity-blocks`` (real 16-token blocks per engine) becomes ``capacity / s``
simulated blocks. The live replay additionally runs the engines ``--speedup`` times faster
(``time_scale = 1 / speedup``, arrivals compressed alike; its TTFT and throughput are converted back
to trace seconds) and is bounded by ``--limit``, ``--max-tokens`` and ``--deadline`` so that it
finishes in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from router.decision.policy import POLICIES, PolicyConfig
from sim.commands import COMMANDS
from sim.driver import DriverConfig, run, scrape_engines
from sim.engine import EngineConfig, token_scaled
from sim.fleet import Fleet
from sim.offline import PreparedWorkload, SimConfig, simulate, token_bound
from sim.report import Row, from_live, from_sim, markdown, table, to_json
from sim.traces import Trace, load_trace
from sim.workload import Request

BLOCK_SIZE = 16


def parse_policy_overrides(text: str | None) -> dict[str, Any]:
    """``"load_weight=2,min_match_ratio=0.1"`` -> PolicyConfig field values (validated)."""
    out: dict[str, Any] = {}
    if not text:
        return out
    fields = {f.name: f for f in msgspec.structs.fields(PolicyConfig)}
    for item in text.split(","):
        if not item.strip():
            continue
        key, _, raw = item.partition("=")
        key = key.strip()
        if key not in fields or key == "name":
            raise ValueError(f"unknown PolicyConfig field {key!r}")
        default = fields[key].default
        out[key] = int(raw) if isinstance(default, int) and not isinstance(default, bool) else float(raw)
    msgspec.convert({"name": "kv", **out}, PolicyConfig)
    return out


def policy_configs(names: Sequence[str], kv_overrides: dict[str, Any]) -> list[PolicyConfig]:
    """One config per policy name; the overrides apply to every policy (only kv uses most of them)."""
    return [msgspec.convert({**kv_overrides, "name": n}, PolicyConfig) for n in names]


def scaled_engine(
    base: EngineConfig, scale: float, capacity_blocks: int, cpu_blocks: int = 0
) -> EngineConfig:
    """An engine whose simulated token stands for ``scale`` real ones (see the module docstring)."""
    blocks = max(16, int(capacity_blocks / scale))
    sized = msgspec.structs.replace(
        base,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=blocks,
        cpu_blocks=int(cpu_blocks / scale),
        max_model_len=blocks * BLOCK_SIZE,
    )
    return token_scaled(sized, scale)


def load(args: argparse.Namespace, live: bool) -> Trace:
    """The trace with this command's options (live runs default to heavier scaling)."""
    tpb = args.tokens_per_block
    if tpb is None:
        is_sessions = args.trace == "sessions" or args.trace.endswith((".tar.gz", ".json"))
        tpb = 16 if (live or is_sessions) else 128
    return load_trace(
        args.trace,
        tokens_per_block=tpb,
        limit=args.limit if args.limit else (300 if live else None),
        max_sessions=args.max_sessions,
        session_rate=args.session_rate,
        max_input_tokens=args.max_input_tokens,
        seed=args.seed,
    )


def run_offline(args: argparse.Namespace, trace: Trace, policies: list[PolicyConfig]) -> list[Row]:
    """Every policy through the simulator on fresh engines."""
    reqs = trace.requests
    if args.max_tokens is not None:  # the live run's cap, in simulated tokens, for like-for-like rows
        cap = args.max_tokens * trace.scale
        reqs = [r if r.max_tokens <= cap else dataclasses.replace(r, max_tokens=int(cap)) for r in reqs]
    work = PreparedWorkload(reqs, trace_bound=trace.infinite_hit_ratio(), label=trace.name)
    # the simulator applies token_scale to the timing itself; only the cache is sized here
    engine = EngineConfig(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=max(16, int(args.capacity_blocks / trace.scale)),
        cpu_blocks=int(args.cpu_blocks / trace.scale),
        max_model_len=1 << 30,
    )
    cfg = SimConfig(
        engines=args.engines,
        engine=engine,
        token_scale=trace.scale,
        speedup=args.speedup or 1.0,
        event_lag_s=args.event_lag,
        seed=args.seed,
    )
    rows = []
    for p in policies:
        t = time.perf_counter()
        r = simulate(work, p, cfg)
        rows.append(from_sim(r))
        print(f"  {p.name:<13} hit {r.hit_ratio:.3f}  ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    return rows


def live_requests(
    trace: Trace, engine: EngineConfig, max_tokens: int | None = None
) -> tuple[list[Request], float]:
    """The trace's requests as a live replay sends them (token-id prompts cut to fit the engine's
    context, outputs scaled and capped at ``max_tokens`` simulated tokens, default 32, arrivals from
    0), and their infinite-cache hit ratio."""
    requests = _replayed(trace, engine, max_tokens)
    return requests, token_bound([r.prompt_token_ids or [] for r in requests], BLOCK_SIZE)


def _replayed(trace: Trace, engine: EngineConfig, max_tokens: int | None) -> list[Request]:
    room = engine.max_model_len
    cap = max_tokens if max_tokens is not None else 32
    requests: list[Request] = []
    for r in trace.requests:
        ids = r.token_ids() or [5]
        out = max(1, min(cap, math.ceil(r.max_tokens / trace.scale)))
        ids = ids[: max(1, room - out - 2 * BLOCK_SIZE)]
        requests.append(
            Request(
                at_s=r.at_s - trace.requests[0].at_s,
                session=r.session,
                prompt_token_ids=ids,
                max_tokens=out,
                turn=r.turn,
                kind=r.kind,
            )
        )
    return requests


def trace_window(
    trace: Trace, engine: EngineConfig, speedup: float, deadline_s: float, max_tokens: int = 32
) -> tuple[list[Request], float]:
    """The requests a live replay at ``speedup`` sends before ``deadline_s`` (as
    :func:`live_requests` makes them) and their infinite-cache hit ratio. Only those: the driver
    would otherwise sleep until each later arrival just to skip it (the sessions trace spans
    thousands of seconds)."""
    requests = [r for r in _replayed(trace, engine, max_tokens) if r.at_s / speedup <= deadline_s]
    return requests, token_bound([r.prompt_token_ids or [] for r in requests], BLOCK_SIZE)


async def run_live(args: argparse.Namespace, trace: Trace, policies: list[PolicyConfig]) -> list[Row]:
    """Every policy through a fresh mock fleet and a fresh router subprocess."""
    # optional: the live router's helpers only for a live replay
    from sim.routerproc import ProgressLine, RouterProcess, free_port, router_config

    speedup = args.speedup or 10.0
    base = EngineConfig(model="toy-model", time_scale=1.0 / speedup)
    engine = scaled_engine(base, trace.scale, args.capacity_blocks, args.cpu_blocks)
    requests, bound = live_requests(trace, engine, args.max_tokens)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvrouter-replay-") as tmp:
        for p in policies:
            fleet = Fleet.uniform(args.engines, engine)
            await fleet.start()
            router = None
            try:
                port = free_port()
                extra = {k: v for k, v in msgspec.to_builtins(p).items() if k != "name"}
                path = Path(tmp) / f"router-{p.name}.toml"
                path.write_text(router_config(fleet, p.name, port, BLOCK_SIZE, None, extra))
                router = RouterProcess(path, Path(tmp) / f"router-{p.name}.log", port)
                router.start()
                await router.wait_ready(60.0)
                bar = ProgressLine(p.name, len(requests), sys.stderr)
                dcfg = DriverConfig(
                    base_url=router.url,
                    model=engine.model,
                    concurrency=args.concurrency,
                    speedup=speedup,
                    session_mode=False,
                    deadline_s=args.deadline,
                )
                results = await run(requests, dcfg, progress=bar.update)
                bar.close()
                row = from_live(p.name, results, await scrape_engines(fleet.urls), bound)
                # back to trace time, comparable with --offline: the fleet ran `speedup` times faster
                row.ttft_p50 *= speedup
                row.ttft_p90 *= speedup
                row.ttft_p99 *= speedup
                row.throughput_rps /= speedup
                row.output_tps /= speedup
                rows.append(row)
            finally:
                if router is not None:
                    router.stop()
                await fleet.stop()
    return rows


def run_command(args: argparse.Namespace) -> int:
    """Entry point of `kvrouter bench replay`."""
    try:
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        bad = [n for n in names if n not in POLICIES]
        if bad:
            raise ValueError(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
        policies = policy_configs(names, parse_policy_overrides(args.set))
        trace = load(args, live=not args.offline)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvrouter bench replay: {exc}", file=sys.stderr)
        return 2
    mode = "offline" if args.offline else "live"
    print(
        f"{trace.name}: {len(trace.requests)} requests, {args.engines} engines, "
        f"{args.capacity_blocks} blocks (16 tokens) per engine, "
        f"1 simulated token = {trace.scale:g} real, {mode}",
        file=sys.stderr,
    )
    if args.offline:
        rows = run_offline(args, trace, policies)
    else:
        # optional: the live router's helpers only for a live replay
        from sim.routerproc import router_available

        why = router_available()
        if why:
            print(f"kvrouter bench replay: {why}; use --offline", file=sys.stderr)
            return 2
        rows = asyncio.run(run_live(args, trace, policies))
    title = f"{trace.name} ({mode}, {len(trace.requests)} requests, {args.engines} engines)"
    print(markdown(rows, title) if args.markdown else table(rows, title))
    if args.json:
        meta = {
            "trace": trace.name,
            "mode": mode,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
        }
        Path(args.json).write_bytes(to_json(rows, meta))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvrouter bench replay`."""
    p.add_argument(
        "--trace", required=True, help="conversation | synthetic | sessions | path(s), comma-separated"
    )
    p.add_argument("--offline", action="store_true", help="discrete-event simulation instead of live HTTP")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=32_000, help="real 16-token KV blocks per engine")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier per engine (real blocks)")
    p.add_argument("--limit", type=int, default=0, help="first N requests (live default 300, offline all)")
    p.add_argument("--max-sessions", type=int, default=40, help="kv-cache-tester sessions to read")
    p.add_argument(
        "--session-rate", type=float, default=0.05, help="kv-cache-tester session starts per second"
    )
    p.add_argument("--max-input-tokens", type=int, default=200_000, help="cut longer prompts (real tokens)")
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=None,
        help="simulated tokens per trace block (default: 128 Mooncake offline, 16 otherwise)",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=0.0,
        help=(
            "live (default 10): engines and arrivals both run this much faster, so the load in trace time "
            "is unchanged and TTFTs are converted back to trace seconds; offline (default 1): only "
            "arrivals are compressed, which adds load. Compare a live run at any speed-up with an "
            "offline run without --speedup"
        ),
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--set", default=None, metavar="K=V,...", help="PolicyConfig fields, e.g. load_weight=2")
    p.add_argument(
        "--event-lag", type=float, default=0.0, help="offline: seconds before events reach the index"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap on output tokens per request, in simulated tokens (live default 32; offline: no cap "
        "unless given, so pass the live run's value to compare like for like)",
    )
    p.add_argument("--concurrency", type=int, default=256, help="live: requests in flight at most")
    p.add_argument("--deadline", type=float, default=60.0, help="live: stop issuing after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `kvrouter bench replay`."""
    bench = subparsers.add_parser("bench", help=COMMANDS["bench"])
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "replay",
        help="replay a trace through the policies (live or --offline)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(p)
    p.set_defaults(func=run_command)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sim.replay ...` (same flags as `kvrouter bench replay`)."""
    p = argparse.ArgumentParser(prog="sim.replay")
    add_arguments(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
