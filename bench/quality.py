"""Routing quality on the public traces: policies and PolicyConfig sweeps in the offline simulator.

``.venv/bin/python bench/quality.py [--quick] [--traces conversation,synthetic,sessions] [--jobs N]``
writes ``bench/out/quality.json`` (every run, with its full config) and ``bench/out/quality.md``
(tables for docs/benchmarks/). Traces are read from ``../shared/data/traces`` beside the repository
(``$KVROUTER_TRACE_DIR``).

Stages, each on every selected trace:

1. ``policies``: kv (PolicyConfig defaults), round_robin, least_loaded, random, at every capacity;
2. ``knobs``: one PolicyConfig field at a time around the defaults (load_weight, decode_weight,
   min_match_blocks, min_match_ratio, temperature; predict-on-route off), at the smallest capacity;
3. ``cpu``: ``cpu_credit`` with a CPU offload tier (conversation only);
4. ``recommended``: ``RECOMMENDED`` (the defaults with the changes this benchmark argues for) and
   ``BASELINE`` (the defaults before the sweeps) at every capacity, and both with round_robin at 2x
   arrival speed;
5. ``pd``: prefill/decode disaggregation, live (mock engines in their own processes, the real
   ``kvrouter serve``): 2 prefill + 2 decode engines against 4 aggregated ones on the same
   workloads (the demo's chat mix, a conversation-heavy one, agent-like long sessions),
   KV-aware vs round-robin prefill placement, conditional vs always-disaggregate
   (``sim/pd_demo.py``), written to
   ``bench/out/pd.json`` and ``pd.md``; ``pd_threshold`` (not run by default) sweeps
   ``pd.min_uncached_tokens``, the measurement behind its default, and ``pd_capacity`` (not run by
   default) repeats the P/D arms with smaller and larger engine caches; ``pd_wide`` (not run by
   default) runs the P/D arms with 4 prefill + 2 decode engines, where round-robin prefill
   placement finds the engine that computed a conversation's previous turn one time in four, and
   ``pd_wide_pressure`` (not run by default) the same on conversations with 320 blocks per engine.

Capacities are real 16-token KV blocks per engine (32k blocks = 512k tokens: the README's 1,000-block
LRU row for Mooncake). Mooncake runs scale a 512-token block to 128 tokens and sessions a 64-token
block to 16 (``sim.traces``: 1 simulated token = 4 real ones, timing and policy units adjusted).
A full run (105 simulations) took ~2 hours of one core on the shared 2-vCPU box: the runs where
round-robin thrashes on the sessions trace are the slowest; ``--jobs 2`` halves it and ``--quick``
runs a fraction of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from router.decision.policy import PolicyConfig
from sim.engine import EngineConfig
from sim.offline import PreparedWorkload, SimConfig, SimResult, simulate
from sim.report import Row, from_sim, markdown
from sim.traces import Trace, load_trace

OUT = Path(__file__).resolve().parent / "out"

RECOMMENDED: dict[str, Any] = {}
"""PolicyConfig changes over the current defaults that this benchmark argues for (none pending: its
first full run moved ``load_weight`` from 1.0 to 0.25, now the default; docs/benchmarks/quality.md)."""
BASELINE: dict[str, Any] = {"load_weight": 1.0}
"""The defaults before the first sweep, kept as the reference row."""


@dataclass(frozen=True)
class Scenario:
    """A trace and the fleet sizes it is run at."""

    trace: str
    tokens_per_block: int
    capacities: tuple[int, ...]
    limit: int | None = None
    max_sessions: int | None = None
    engines: int = 8


SCENARIOS = {
    "conversation": Scenario("conversation", 128, (32_000, 128_000, 512_000)),
    "synthetic": Scenario("synthetic", 128, (32_000, 128_000, 512_000)),
    "sessions": Scenario("sessions", 16, (32_000, 128_000), max_sessions=40),
}
QUICK = {
    "conversation": Scenario("conversation", 128, (32_000, 512_000), limit=3000),
    "synthetic": Scenario("synthetic", 128, (32_000, 512_000)),
    "sessions": Scenario("sessions", 16, (32_000,), max_sessions=20),
}

KNOBS: list[tuple[str, dict[str, Any]]] = [
    ("load_weight=0.125", {"load_weight": 0.125}),
    ("load_weight=0.5", {"load_weight": 0.5}),
    ("load_weight=1", {"load_weight": 1.0}),
    ("load_weight=2", {"load_weight": 2.0}),
    ("decode_weight=0", {"decode_weight": 0.0}),
    ("decode_weight=16", {"decode_weight": 16.0}),
    ("decode_weight=64", {"decode_weight": 64.0}),
    ("min_match_blocks=32", {"min_match_blocks": 32}),
    ("min_match_blocks=128", {"min_match_blocks": 128}),
    ("min_match_ratio=0.1", {"min_match_ratio": 0.1}),
    ("min_match_ratio=0.3", {"min_match_ratio": 0.3}),
    ("temperature=0.05", {"temperature": 0.05}),
    ("temperature=0.2", {"temperature": 0.2}),
    ("min_match_ratio=0.1 decode_weight=16", {"min_match_ratio": 0.1, "decode_weight": 16.0}),
    ("no predict-on-route", {"_sim": {"predict_ttl_s": 0.0}}),
    ("event lag 50 ms", {"_sim": {"event_lag_s": 0.05}}),
]
QUICK_KNOBS = [k for k in KNOBS if k[0] in ("load_weight=1", "load_weight=2", "min_match_ratio=0.1")]


class Job(msgspec.Struct, frozen=True):
    """One simulation: a scenario, a capacity, a policy config and simulator overrides."""

    stage: str
    trace: str
    capacity: int
    label: str
    policy: dict[str, Any]
    sim: dict[str, Any] = {}
    speedup: float = 1.0
    cpu_blocks: int = 0


@functools.lru_cache(maxsize=4)
def _load(scn: Scenario) -> tuple[Trace, PreparedWorkload]:
    trace = load_trace(
        scn.trace,
        tokens_per_block=scn.tokens_per_block,
        limit=scn.limit,
        max_sessions=scn.max_sessions,
        max_input_tokens=200_000,
    )
    return trace, PreparedWorkload(trace.requests, trace_bound=trace.infinite_hit_ratio(), label=trace.name)


def run_job(job: Job, scn: Scenario) -> dict[str, Any]:
    """Run one job (in a worker process); returns a JSON-able record."""
    trace, work = _load(scn)
    engine = EngineConfig(
        num_gpu_blocks=max(16, int(job.capacity / trace.scale)),
        cpu_blocks=int(job.cpu_blocks / trace.scale),
        max_model_len=1 << 30,
    )
    cfg = SimConfig(engines=scn.engines, engine=engine, token_scale=trace.scale, speedup=job.speedup)
    if job.sim:
        cfg = msgspec.structs.replace(cfg, **job.sim)
    pcfg = msgspec.convert(job.policy, PolicyConfig)
    res: SimResult = simulate(work, pcfg, cfg, label=job.label)
    row = from_sim(res)
    return {
        "job": msgspec.to_builtins(job),
        "requests_loaded": len(trace.requests),
        "scale": trace.scale,
        "row": msgspec.to_builtins(row) | {"ratio_to_bound": row.ratio_to_bound},
    }


def jobs_for(name: str, scn: Scenario, quick: bool) -> list[Job]:
    """Every job of the four stages for one trace."""
    out: list[Job] = []
    small = scn.capacities[0]
    for cap in scn.capacities:
        for p in ("kv", "round_robin", "least_loaded", "random"):
            out.append(Job("policies", name, cap, p, {"name": p}))
    for label, knob in QUICK_KNOBS if quick else KNOBS:
        sim = knob.get("_sim", {})
        pol = {k: v for k, v in knob.items() if k != "_sim"}
        out.append(Job("knobs", name, small, label, {"name": "kv", **pol}, sim))
    if name == "conversation":
        for credit in (0.25, 0.5, 0.75, 1.0):
            out.append(
                Job(
                    "cpu",
                    name,
                    small,
                    f"cpu_credit={credit}",
                    {"name": "kv", "cpu_credit": credit},
                    cpu_blocks=small * 4,
                )
            )
        out.append(Job("cpu", name, small, "round_robin", {"name": "round_robin"}, cpu_blocks=small * 4))
    rec: dict[str, Any] = {"name": "kv", **RECOMMENDED}
    base: dict[str, Any] = {"name": "kv", **BASELINE}
    for cap in scn.capacities:
        if RECOMMENDED:
            out.append(Job("recommended", name, cap, "kv recommended", rec))
        out.append(Job("recommended", name, cap, "kv baseline", base))
    fast: list[tuple[dict[str, Any], str]] = [
        (rec, "kv recommended" if RECOMMENDED else "kv"),
        (base, "kv baseline"),
        ({"name": "round_robin"}, "round_robin"),
    ]
    for pol, label in fast:
        out.append(Job("recommended", name, small, f"{label} @2x", pol, speedup=2.0))
    return out


def _worker(args: tuple[Job, Scenario]) -> dict[str, Any]:
    job, scn = args
    t = time.perf_counter()
    rec = run_job(job, scn)
    rec["wall_s"] = time.perf_counter() - t
    return rec


def write_markdown(records: list[dict[str, Any]], path: Path) -> None:
    """Tables grouped by trace, stage, capacity and speed."""
    lines = ["# Routing quality (offline simulator)", ""]
    groups: dict[tuple[str, str, int, float, int], list[dict[str, Any]]] = {}
    for rec in records:
        j = rec["job"]
        groups.setdefault((j["trace"], j["stage"], j["capacity"], j["speedup"], j["cpu_blocks"]), []).append(
            rec
        )
    order = {"policies": 0, "knobs": 1, "cpu": 2, "recommended": 3}
    traces = {"conversation": 0, "synthetic": 1, "sessions": 2}

    def key(item: tuple[tuple[str, str, int, float, int], list[dict[str, Any]]]) -> tuple[Any, ...]:
        t, st, c, sp, cp = item[0]
        return (traces.get(t, 9), t, order.get(st, 9), sp, c, cp)

    for (trace, stage, cap, speed, cpu), recs in sorted(groups.items(), key=key):
        rows = [
            msgspec.convert({k: v for k, v in r["row"].items() if k != "ratio_to_bound"}, Row) for r in recs
        ]
        extra = rows[0].extra
        title = (
            f"{trace} / {stage}: {recs[0]['requests_loaded']} requests, 8 engines x {cap:,} blocks "
            f"({cap * 16 / 1e6:.1f}M tokens)"
            + (f" + CPU {cpu:,} blocks" if cpu else "")
            + f", speed x{speed:g}; "
            f"pooled-LRU bound {extra.get('pooled_bound', 0):.3f}, "
            f"trace bound {extra.get('trace_bound') or 0:.3f}"
        )
        lines.append(markdown(rows, title))
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smaller traces, fewer capacities and knobs")
    p.add_argument("--traces", default="conversation,synthetic,sessions")
    p.add_argument("--stages", default="policies,knobs,cpu,recommended,pd,pd_traces")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (the box has 2 shared cores)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--markdown-only", action="store_true", help="rewrite quality.md from quality.json")
    p.add_argument("--pd-repeat", type=int, default=1, help="run the live P/D stages this many times")
    args = p.parse_args(argv)
    if args.markdown_only:
        out = Path(args.out)
        write_markdown(json.loads((out / "quality.json").read_text())["records"], out / "quality.md")
        return 0
    scenarios = QUICK if args.quick else SCENARIOS
    stages = set(args.stages.split(","))
    todo: list[tuple[Job, Scenario]] = []
    for name in args.traces.split(","):
        scn = scenarios[name]
        todo += [(j, scn) for j in jobs_for(name, scn, args.quick) if j.stage in stages]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    print(f"{len(todo)} simulations, {args.jobs} worker(s)", file=sys.stderr)
    # jobs of one trace stay together so each worker loads a trace once
    with multiprocessing.Pool(max(1, args.jobs), maxtasksperchild=None) as pool:
        for i, rec in enumerate(pool.imap(_worker, todo)):
            records.append(rec)
            r, j = rec["row"], rec["job"]
            print(
                f"[{i + 1}/{len(todo)} {time.perf_counter() - started:6.0f} s] "
                f"{j['trace']:<12} {j['stage']:<11} "
                f"cap={j['capacity']:<7} x{j['speedup']:g} {j['label']:<22} hit={r['hit_ratio']:.3f} "
                f"bound={r['bound']:.3f} ttft p50/p90={r['ttft_p50']:.2f}/{r['ttft_p90']:.2f} "
                f"spread={r['spread_tokens']:.2f} ({rec['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            (out / "quality.json").write_text(json.dumps({"records": records}, indent=1))
    if records:
        write_markdown(records, out / "quality.md")
        print(f"wrote {out / 'quality.json'} and {out / 'quality.md'}", file=sys.stderr)
    if stages & {"pd", "pd_threshold", "pd_capacity", "pd_wide", "pd_wide_pressure", "pd_traces"}:  # live
        run_pd(out, stages, args.quick, args.pd_repeat)
    return 0


PD_CAPACITIES = (320, 1280, 2560)
"""KV blocks per engine of the ``pd_capacity`` stage (``pd`` runs 640)."""
PD_TRACE_RUNS = (
    ("sessions", 64_000, 2),
    ("conversation", 64_000, 2),
    ("conversation", 128_000, 2),
    ("conversation", 128_000, 4),
)
"""(trace, KV cache per engine in real 16-token blocks, prefill engines) of the ``pd_traces`` stage:
64,000 blocks = 1M tokens per engine, the replicas benchmark's size; 128,000 = 2M tokens."""
PD_THRESHOLDS = (0, 64, 128, 256, 512, 1024, 1_000_000)
"""``pd.min_uncached_tokens`` values of the ``pd_threshold`` sweep (1,000,000: never disaggregate)."""


def run_pd(out: Path, stages: set[str], quick: bool, repeat: int = 1) -> None:
    """The live P/D stages: every arm on each workload (``pd``), the threshold sweep (``pd_threshold``)."""
    import asyncio

    from sim.pd_demo import (
        ARMS,
        PDArm,
        PDScenario,
        conversations,
        long_sessions,
        markdown,
        quick_scenario,
        run_scenario,
        summary_lines,
        trace_scenario,
    )
    from sim.workload import Request, demo_config, generate

    runs: list[tuple[str, PDScenario]] = []
    traces: dict[str, tuple[list[Request], float]] = {}  # title -> the trace's requests and their bound
    if "pd" in stages:
        if quick:
            runs.append(("chat (quick)", quick_scenario()))
        else:
            runs.append(("chat", PDScenario(workload=demo_config())))
            runs.append(("conversations", PDScenario(workload=conversations())))
            runs.append(("long sessions", PDScenario(workload=long_sessions(), deadline_s=60.0)))
    if "pd_capacity" in stages:  # where KV-aware prefill placement pays: cache pressure
        for blocks in PD_CAPACITIES:
            scn = PDScenario(workload=conversations(), arms=ARMS[1:], num_gpu_blocks=blocks)
            runs.append((f"conversations, {blocks} blocks per engine", scn))
        scn = PDScenario(workload=long_sessions(), arms=ARMS[1:], num_gpu_blocks=1280, deadline_s=60.0)
        runs.append(("long sessions, 1280 blocks per engine", scn))
    if "pd_wide" in stages:  # a wider prefill pool: round-robin finds a turn's engine 1 time in 4
        wide = tuple(msgspec.structs.replace(a, label=f"{a.label}, 4P+2D", prefill=4) for a in ARMS[1:])
        runs.append(("chat, 4 prefill + 2 decode", PDScenario(workload=demo_config(), arms=wide)))
        runs.append(("conversations, 4 prefill + 2 decode", PDScenario(workload=conversations(), arms=wide)))
        scn = PDScenario(workload=long_sessions(), arms=wide, deadline_s=60.0)
        runs.append(("long sessions, 4 prefill + 2 decode", scn))
    if "pd_wide_pressure" in stages:  # both: four prefill engines and half the cache per engine
        wide = tuple(msgspec.structs.replace(a, label=f"{a.label}, 4P+2D", prefill=4) for a in ARMS[1:])
        # (conversations only: the long sessions' prompts outgrow a 320-block engine, 5,120 tokens)
        scn = PDScenario(workload=conversations(), arms=wide, num_gpu_blocks=320)
        runs.append(("conversations, 4 prefill + 2 decode, 320 blocks per engine", scn))
    if "pd_traces" in stages:  # the public multi-turn traces (sim/traces.py)
        for name, blocks, prefill in PD_TRACE_RUNS[:1] if quick else PD_TRACE_RUNS:
            scn, reqs, bound = trace_scenario(
                name, capacity_blocks=blocks, prefill=prefill, **({"deadline_s": 25.0} if quick else {})
            )
            title = f"{name} trace, {prefill} prefill + 2 decode, {blocks:,} real blocks per engine"
            if prefill != 2:  # (the aggregated arm is the 2 + 2 runs' 4 engines)
                scn = msgspec.structs.replace(scn, arms=scn.arms[1:])
            runs.append((title, scn))
            traces[title] = (reqs, bound)
    if "pd_threshold" in stages:
        arms = tuple(
            PDArm(label=f"min_uncached_tokens={t}", prefill=2, decode=2, pd={"min_uncached_tokens": t})
            for t in PD_THRESHOLDS
        )
        for name, workload in (("chat", demo_config()), ("conversations", conversations())):
            runs.append((f"{name}, pd.min_uncached_tokens", PDScenario(workload=workload, arms=arms)))
    md: list[str] = ["# Prefill/decode disaggregation (live)", ""]
    doc: list[dict[str, Any]] = []
    for k, (name, scn) in enumerate(runs * max(1, repeat)):
        reqs, bound = traces.get(name, (None, None))
        title = f"{name} (run {k // len(runs) + 1})" if repeat > 1 else name
        rows = asyncio.run(run_scenario(scn, title=f"P/D, {title}", out=sys.stderr, requests=reqs))
        n = len(reqs) if reqs is not None else len(generate(scn.workload))
        bound_note = f", infinite-cache hit ratio {bound:.3f}" if bound is not None else ""
        md += [markdown(rows, f"{title}: {n} requests{bound_note}"), ""]
        md += [f"- {line}" for line in summary_lines(rows)] + [""]
        doc.append(
            {
                "title": title,
                "scenario": msgspec.to_builtins(scn),
                "bound": bound,
                "rows": msgspec.to_builtins(rows),
            }
        )
        (out / "pd.json").write_text(json.dumps(doc, indent=1))
        (out / "pd.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'pd.json'} and {out / 'pd.md'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
