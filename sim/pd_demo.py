"""`kvrouter demo --pd` and the P/D scenario of the routing-quality benchmark (``bench/quality.py
--stages pd``): prefill/decode disaggregation on a simulated fleet, against an aggregated fleet of
the same size, on the same workload.

Each *arm* gets fresh mock engines and a fresh router: the engines run in ``kvrouter mock-engine``
subprocesses with the NIXL connector (one process per pool, so a decode engine pulls its blocks
from a prefill engine in another process, over the side channel), the router is ``kvrouter serve``
(its own subprocess) with a generated config, and the seeded chat workload is replayed through it
by the live driver. Arms:

- ``aggregated``: 4 ordinary engines, ``[policy] kv``;
- ``pd-kv``: 2 prefill + 2 decode engines, KV-aware prefill placement, the ``[pd]`` defaults
  (conditional disaggregation);
- ``pd-rr``: the same with round-robin prefill placement (``pd.prefill_policy = "round_robin"``);
- ``pd-always-kv``: KV-aware, ``pd.min_uncached_tokens = 0`` (every request takes both legs), and
  ``pd-always-rr``.

(Names without spaces or commas: they head progress lines and name the arms' log files.)

Reported per arm: TTFT p50/p90 (all requests, and follow-up turns of conversations alone),
inter-token latency (every gap between two streamed output chunks of every request: p50/p90/p99;
the JSON also has the time per output token, per request),
the prefix-cache hit ratio of each pool as its engines count it (``vllm:prefix_cache_hits`` /
``queries``; tokens a decode engine pulled are not hits), the share of requests whose prefill leg
was skipped, and the fallbacks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec

from sim.driver import DriverConfig, EngineCounters, RequestResult, run, scrape_engines
from sim.routerproc import MODEL, ProgressLine, RouterProcess, free_port, router_available
from sim.workload import Request, WorkloadConfig, demo_config, generate, summary


class PDArm(msgspec.Struct, frozen=True, kw_only=True):
    """One fleet shape and its P/D settings."""

    label: str
    prefill: int = 0
    """Engines with ``role = "prefill"``."""
    decode: int = 0
    """Engines with ``role = "decode"``."""
    both: int = 0
    """Ordinary engines."""
    pd: dict[str, Any] = {}
    """``[pd]`` keys (the defaults otherwise)."""

    def describe(self) -> str:
        """What the arm is, in words (the legend under a run's header)."""
        if not self.prefill:
            return f"{self.label} = {self.both} ordinary engines"
        placement = "round-robin" if self.pd.get("prefill_policy") == "round_robin" else "KV-aware"
        when = "every request" if self.pd.get("min_uncached_tokens") == 0 else "long uncached prompts"
        return (
            f"{self.label} = {self.prefill} prefill + {self.decode} decode engines, {when} disaggregated, "
            f"{placement} prefill placement"
        )


ARMS: tuple[PDArm, ...] = (
    PDArm(label="aggregated", both=4),
    PDArm(label="pd-kv", prefill=2, decode=2),
    PDArm(label="pd-rr", prefill=2, decode=2, pd={"prefill_policy": "round_robin"}),
    PDArm(label="pd-always-kv", prefill=2, decode=2, pd={"min_uncached_tokens": 0}),
    PDArm(
        label="pd-always-rr",
        prefill=2,
        decode=2,
        pd={"min_uncached_tokens": 0, "prefill_policy": "round_robin"},
    ),
)


class PDScenario(msgspec.Struct, frozen=True, kw_only=True):
    """Engines, workload and replay settings shared by every arm."""

    workload: WorkloadConfig = msgspec.field(default_factory=demo_config)
    arms: tuple[PDArm, ...] = ARMS
    num_gpu_blocks: int = 640
    """Per engine: 10k tokens, so that scattering conversations and documents evicts them."""
    time_scale: float = 1.0
    token_scale: float = 1.0
    """One token of the workload stands for this many real ones (trace replays: ``mock-engine
    --token-scale``)."""
    speedup: float = 1.0
    session_mode: bool = True
    """Turns wait for the previous turn's answer (generated workloads); False: every request at its
    own arrival time (trace replays, whose prompts are fixed)."""
    concurrency: int = 64
    deadline_s: float = 40.0
    ready_timeout_s: float = 90.0


def quick_scenario(seed: int = 0) -> PDScenario:
    """The CI-sized run: the quick workload, three arms."""
    return PDScenario(
        workload=demo_config(quick=True, seed=seed),
        arms=(ARMS[0], ARMS[1], ARMS[3]),
        num_gpu_blocks=512,
        time_scale=0.5,
        deadline_s=20.0,
    )


def long_sessions(seed: int = 0) -> WorkloadConfig:
    """Agent-like sessions: long shared instructions, then turns that each add hundreds of tokens
    (tool output, files), so a session's context grows to several thousand tokens and every turn
    has more new tokens than ``pd.min_uncached_tokens``: every request takes both legs, and the
    prefill pool's caches hold only part of the live contexts."""
    return WorkloadConfig(
        seed=seed,
        duration_s=20.0,
        session_rate=0.6,
        turns=(5, 9),
        think_s=1.0,
        system_prompt_tokens=(1500, 2500),
        system_prompt_weights=(0.5, 0.5),
        user_tokens=(250, 700),
        answer_tokens=48,
        doc_rate=0.0,
    )


def conversations(seed: int = 0) -> WorkloadConfig:
    """A conversation-heavy workload for the benchmark: many multi-turn chats over long system
    prompts, longer answers (inter-token latency matters), a few document questions."""
    return WorkloadConfig(
        seed=seed,
        duration_s=20.0,
        session_rate=1.6,
        turns=(3, 6),
        think_s=1.0,
        answer_tokens=48,
        doc_rate=0.5,
        num_docs=6,
    )


TRACE_WORKLOADS: dict[str, dict[str, Any]] = {
    # the replicas benchmark's settings (bench/replicas.py): ~1,500 Mooncake requests in ~60 s,
    # 32 agentic coding sessions
    "conversation": {"load": {"limit": 1500}, "tokens_per_block": 16, "speedup": 8.5},
    "sessions": {"load": {"max_sessions": 32, "session_rate": 1.0}, "tokens_per_block": 4, "speedup": 10.0},
}
"""Public multi-turn traces of the P/D trace stage, as the live replays load them."""

TRACE_DEADLINE_S = 40.0
"""Seconds of requests per arm of the P/D trace stage (and the window ``bench/pd_ceiling.py`` reads)."""

PD_THRESHOLD_TOKENS = 128
"""The ``pd.min_uncached_tokens`` default in real tokens, scaled to a trace's simulated ones."""


def trace_scenario(
    name: str,
    *,
    capacity_blocks: int = 64_000,
    engine_speed: float = 4.0,
    deadline_s: float = TRACE_DEADLINE_S,
    prefill: int = 2,
    decode: int = 2,
) -> tuple[PDScenario, list[Request], float]:
    """A public multi-turn trace (``TRACE_WORKLOADS``) as a P/D scenario, its requests and their
    infinite-cache hit ratio (the bound of any placement).

    Prompts are the trace's block ids as token ids, scaled down like every live replay (a simulated
    token stands for ``trace.scale`` real ones; the engines' costs are scaled to match, ``--token-
    scale``), each request at its own arrival time (the prompts are fixed, so no turn waits for an
    answer). ``capacity_blocks`` is the KV cache per engine in real 16-token blocks; the engines run
    ``engine_speed`` times faster than the trace's arrivals imply (1 = the A100-class timing model,
    which the full-length Mooncake prompts overload; the replicas benchmark runs 4 aggregated
    engines at 2, and 4 here gives a pool of 2 prefill engines the prefill capacity those 4 had).
    The conditional arms skip the prefill leg below ``PD_THRESHOLD_TOKENS`` real tokens."""
    # optional: the trace replay's modules only with a trace
    from sim.engine import EngineConfig
    from sim.replay import scaled_engine, trace_window
    from sim.traces import load_trace

    spec = TRACE_WORKLOADS[name]
    tpb = spec["tokens_per_block"]
    trace = load_trace(name, tokens_per_block=tpb, max_input_tokens=200_000, **spec["load"])
    speedup = float(spec["speedup"])
    engine = scaled_engine(EngineConfig(), trace.scale, capacity_blocks)
    requests, bound = trace_window(trace, engine, speedup, deadline_s)
    threshold = math.ceil(PD_THRESHOLD_TOKENS / trace.scale)
    always = {"min_uncached_tokens": 0}
    cond = {"min_uncached_tokens": threshold}
    rr = {"prefill_policy": "round_robin"}
    pools = {"prefill": prefill, "decode": decode}
    arms = (
        PDArm(label="aggregated", both=prefill + decode),
        PDArm(label="pd-kv", **pools, pd=cond),
        PDArm(label="pd-rr", **pools, pd={**cond, **rr}),
        PDArm(label="pd-always-kv", **pools, pd=always),
        PDArm(label="pd-always-rr", **pools, pd={**always, **rr}),
    )
    scn = PDScenario(
        arms=arms,
        num_gpu_blocks=engine.num_gpu_blocks,
        time_scale=1.0 / (speedup * engine_speed),
        token_scale=trace.scale,
        speedup=speedup,
        session_mode=False,
        concurrency=256,
        deadline_s=deadline_s,
    )
    return scn, requests, bound


class PDRow(msgspec.Struct, kw_only=True):
    """One arm's figures (seconds)."""

    label: str
    requests: int = 0
    errors: int = 0
    followups: int = 0
    ttft_p50: float = math.nan
    ttft_p90: float = math.nan
    followup_ttft_p50: float = math.nan
    followup_ttft_p90: float = math.nan
    first_turn_ttft_p50: float = math.nan
    itl_p50: float = math.nan
    itl_p90: float = math.nan
    itl_p99: float = math.nan
    """Inter-token latency: every gap between two output chunks of every request."""
    tpot_p50: float = math.nan
    """Time per output token after the first, per request (median over requests)."""
    hit_ratio: float | None = None
    """All engines."""
    prefill_hit_ratio: float | None = None
    decode_hit_ratio: float | None = None
    skip_ratio: float | None = None
    fallbacks: int = 0
    prefill_legs: int = 0
    wall_s: float = 0.0


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _hit(counters: Sequence[EngineCounters]) -> float | None:
    queries = sum(c.queries for c in counters)
    return sum(c.hits for c in counters) / queries if queries else None


def tpot(r: RequestResult) -> float | None:
    """A request's mean time per output token after the first."""
    if r.ttft_s is None or r.e2e_s is None or r.completion_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


def row_of(
    label: str,
    requests: Sequence[Request],
    results: Sequence[RequestResult],
    prefill: Sequence[EngineCounters],
    decode: Sequence[EngineCounters],
    pd: dict[str, Any] | None,
) -> PDRow:
    """The figures of one arm from the driver's results, the engines' counters and the router's."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    follow = [r.ttft_s for r in ok if r.ttft_s is not None and requests[r.index].turn > 0]
    first = [r.ttft_s for r in ok if r.ttft_s is not None and requests[r.index].turn == 0]
    tpots = [x for r in ok if (x := tpot(r)) is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    row = PDRow(
        label=label,
        requests=len(ok),
        errors=sum(1 for r in results if not r.ok and not r.skipped),
        followups=len(follow),
        ttft_p50=_pct(ttft, 0.5),
        ttft_p90=_pct(ttft, 0.9),
        followup_ttft_p50=_pct(follow, 0.5),
        followup_ttft_p90=_pct(follow, 0.9),
        first_turn_ttft_p50=_pct(first, 0.5),
        itl_p50=_pct(gaps, 0.5),
        itl_p90=_pct(gaps, 0.9),
        itl_p99=_pct(gaps, 0.99),
        tpot_p50=_pct(tpots, 0.5),
        hit_ratio=_hit([*prefill, *decode]),
        prefill_hit_ratio=_hit(prefill) if prefill else None,
        decode_hit_ratio=_hit(decode),
    )
    if pd:
        modes = pd.get("requests") or {}
        total = sum(modes.values())
        row.skip_ratio = modes.get("skipped", 0.0) / total if total else None
        row.fallbacks = int(pd.get("fallbacks") or 0)
        row.prefill_legs = int(modes.get("disaggregated", 0.0))
    return row


# ---- engines in their own processes -------------------------------------------------------------------


class EngineProcess:
    """``kvrouter mock-engine`` with N engines in a subprocess; its endpoints read from ``--json``."""

    def __init__(self, n: int, flags: Sequence[str], log_path: Path) -> None:
        self.n = n
        self.flags = list(flags)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.engines: list[dict[str, Any]] = []

    async def start(self, timeout_s: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "router.cli", "mock-engine", "--engines", str(self.n)]
        cmd += ["--port", "0", "--kv-port", "0", "--replay-port", "0", "--json", *self.flags]
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed below (the child keeps its copy)
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1")
            )
        finally:
            log.close()
        assert self.proc.stdout is not None
        text = b""
        deadline = time.monotonic() + timeout_s
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
            if not line:
                raise RuntimeError(
                    f"mock engines exited: {self.log_path.read_text(errors='replace')[-2000:]}"
                )
            text += line
            if line.startswith(b"}"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("mock engines did not report their endpoints in time")
        self.engines = json.loads(text)["engines"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def router_toml(
    port: int, tokenizer: str, pools: Sequence[tuple[str, Sequence[dict[str, Any]]]], pd: dict[str, Any]
) -> str:
    """The router's config: every engine of every (role, engines) pool, and the ``[pd]`` keys."""

    def q(v: Any) -> str:
        return json.dumps(v)  # a JSON string, number or bool is a TOML one too

    lines = [
        f"block_size = 16\ntokenizer = {q(tokenizer)}",
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
    ]
    lines += ['log_level = "warning"', "[policy]", 'name = "kv"', "[pd]"]
    lines += [f"{k} = {q(v)}" for k, v in pd.items()]
    for role, engines in pools:
        for i, e in enumerate(engines):
            lines += ["[[backends]]", f"name = {q(f'{role}-{i}')}", f"url = {q(e['url'])}"]
            lines += [f"kv_events = {q(e['kv_endpoints'][0])}", f"kv_replay = {q(e['replay_endpoints'][0])}"]
            lines += [f"role = {q(role)}", f"models = [{q(MODEL)}]"]
    return "\n".join(lines) + "\n"


async def run_arm(
    arm: PDArm,
    requests: Sequence[Request],
    scn: PDScenario,
    workdir: Path,
    tokenizer_dir: str,
    *,
    out: IO[str],
) -> PDRow:
    """Fresh engines and router for one arm, the replay, the counters."""
    started = time.monotonic()
    flags = ["--model", MODEL, "--tokenizer", tokenizer_dir, "--gpu-blocks", str(scn.num_gpu_blocks)]
    flags += ["--max-model-len", str(scn.num_gpu_blocks * 16), "--time-scale", str(scn.time_scale)]
    flags += ["--token-scale", str(scn.token_scale), "--kv-connector", "NixlConnector"]
    tag = arm.label
    procs = [
        (role, EngineProcess(n, flags, workdir / f"engines-{tag}-{role}.log"))
        for role, n in (("prefill", arm.prefill), ("decode", arm.decode), ("both", arm.both))
        if n
    ]
    router: RouterProcess | None = None
    try:
        await asyncio.gather(*(p.start() for _, p in procs))
        port = free_port()
        path = workdir / f"router-{tag}.toml"
        path.write_text(router_toml(port, tokenizer_dir, [(role, p.engines) for role, p in procs], arm.pd))
        router = RouterProcess(path, workdir / f"router-{tag}.log", port)
        router.start()
        await router.wait_ready(scn.ready_timeout_s)
        out.write(f"  {arm.label}: router up, dashboard at {router.url}/dashboard\n")
        out.flush()
        bar = ProgressLine(arm.label, len(requests), out)
        dcfg = DriverConfig(
            base_url=router.url,
            model=MODEL,
            concurrency=scn.concurrency,
            speedup=scn.speedup,
            session_mode=scn.session_mode,
            deadline_s=scn.deadline_s,
            echo_answers=False,
        )
        results = await run(requests, dcfg, progress=bar.update)
        bar.close()
        by_role = {role: [e["url"] for e in p.engines] for role, p in procs}
        prefill = await scrape_engines(by_role.get("prefill", []))
        decode = await scrape_engines(by_role.get("decode", []) + by_role.get("both", []))
        async with httpx.AsyncClient(timeout=10) as c:
            pd = (await c.get(router.url + "/dashboard/data")).json().get("pd")
        row = row_of(arm.label, requests, results, prefill, decode, pd if arm.prefill else None)
        failed = [r for r in results if not r.ok and not r.skipped]
        if failed:
            out.write(f"  {arm.label}: {len(failed)} request(s) failed, first: {failed[0].error}\n")
        row.wall_s = time.monotonic() - started
        return row
    finally:
        if router is not None:
            router.stop()
        for _, p in procs:
            p.stop()


def _ms(v: float) -> str:
    return "-" if not math.isfinite(v) else f"{v * 1000:.0f} ms"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


COLUMNS = (
    "arm",
    "TTFT p50",
    "p90",
    "follow-up p50",
    "p90",
    "ITL p50",
    "p90",
    "p99",
    "hit prefill pool",
    "hit decode pool",
    "skipped",
    "fallbacks",
)


def _cells(r: PDRow) -> list[str]:
    name = r.label + (f" ({r.errors} errors)" if r.errors else "")
    return [
        name,
        _ms(r.ttft_p50),
        _ms(r.ttft_p90),
        _ms(r.followup_ttft_p50),
        _ms(r.followup_ttft_p90),
        f"{r.itl_p50 * 1000:.1f} ms" if math.isfinite(r.itl_p50) else "-",
        f"{r.itl_p90 * 1000:.1f} ms" if math.isfinite(r.itl_p90) else "-",
        f"{r.itl_p99 * 1000:.1f} ms" if math.isfinite(r.itl_p99) else "-",
        _ratio(r.prefill_hit_ratio),
        _ratio(r.decode_hit_ratio),
        "-" if r.skip_ratio is None else f"{r.skip_ratio:.0%}",
        str(r.fallbacks) if r.skip_ratio is not None else "-",
    ]


def table(rows: Sequence[PDRow]) -> str:
    """The comparison as aligned plain text."""
    body = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    lines = []
    for k, line in enumerate(body):
        lines.append(
            "  ".join(
                [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(rows: Sequence[PDRow], title: str = "") -> str:
    """The same table in markdown (docs/benchmarks/)."""
    lines = [f"**{title}**\n"] if title else []
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|")
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


async def run_scenario(
    scn: PDScenario,
    *,
    out: IO[str] | None = None,
    title: str = "",
    json_path: str | None = None,
    requests: Sequence[Request] | None = None,
) -> list[PDRow]:
    """Every arm of a scenario on the same workload (``requests``, else the scenario's generated
    one); prints and returns the rows."""
    out = out or sys.stdout
    # optional: HF tokenizers only for the toy tokenizer's build
    from sim.toy_tokenizer import build_toy_tokenizer

    if requests is None:
        requests = generate(scn.workload)
    s = summary(requests)
    follow = sum(1 for r in requests if r.turn > 0)
    out.write(
        f"{title or 'P/D disaggregation'}: {int(s['requests'])} requests ({follow} follow-up turns) in "
        f"{int(s['sessions'])} sessions over {s['span_s']:.0f} s; engines of {scn.num_gpu_blocks} KV blocks; "
        f"arms: {', '.join(a.label for a in scn.arms)}\n"
    )
    out.writelines(f"  {arm.describe()}\n" for arm in scn.arms)
    out.flush()
    rows: list[PDRow] = []
    with tempfile.TemporaryDirectory(prefix="kvrouter-pd-") as tmp:
        workdir = Path(tmp)
        tok_dir = str(build_toy_tokenizer(workdir / "tokenizer"))
        for arm in scn.arms:
            rows.append(await run_arm(arm, requests, scn, workdir, tok_dir, out=out))
    out.write("\n" + table(rows) + "\n")
    out.flush()
    if json_path:
        doc = {"scenario": msgspec.to_builtins(scn), "rows": msgspec.to_builtins(rows)}
        Path(json_path).write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    return rows


def summary_lines(rows: Sequence[PDRow]) -> list[str]:
    """The issue's three P/D questions, answered from one run's rows (when the arms are there)."""
    by = {r.label: r for r in rows}
    out = []
    kv, rr = by.get("pd-kv"), by.get("pd-rr")
    akv, arr = by.get("pd-always-kv"), by.get("pd-always-rr")
    for a, b, what in ((kv, rr, "conditional"), (akv, arr, "always")):
        if a and b and a.prefill_hit_ratio is not None and b.prefill_hit_ratio:
            out.append(
                f"KV-aware vs round-robin prefill placement ({what}): prefill-pool hit ratio "
                f"{a.prefill_hit_ratio:.3f} vs {b.prefill_hit_ratio:.3f} "
                f"({a.prefill_hit_ratio / b.prefill_hit_ratio:.2f}x), "
                f"TTFT p90 {_ms(a.ttft_p90)} vs {_ms(b.ttft_p90)}"
            )
    if kv and akv:
        out.append(
            f"conditional vs always-disaggregate: follow-up TTFT p50 {_ms(kv.followup_ttft_p50)} vs "
            f"{_ms(akv.followup_ttft_p50)}; ITL p99 {kv.itl_p99 * 1000:.1f} vs {akv.itl_p99 * 1000:.1f} ms"
        )
    agg = by.get("aggregated")
    if agg and kv:
        out.append(
            f"pd-kv vs aggregated: TTFT p50 {_ms(kv.ttft_p50)} vs {_ms(agg.ttft_p50)}, ITL p99 "
            f"{kv.itl_p99 * 1000:.1f} vs {agg.itl_p99 * 1000:.1f} ms"
        )
    return out


def run_command(args: argparse.Namespace) -> int:
    """`kvrouter demo --pd`."""
    why = router_available()
    if why:
        print(f"kvrouter demo: {why}", file=sys.stderr)
        return 2
    scn = quick_scenario(args.seed) if args.quick else PDScenario(workload=demo_config(seed=args.seed))
    started = time.monotonic()
    try:
        rows = asyncio.run(run_scenario(scn, json_path=args.json, title="kvrouter demo --pd"))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"kvrouter demo --pd failed: {exc}", file=sys.stderr)
        return 1
    for line in summary_lines(rows):
        print(line)
    print(f"(demo took {time.monotonic() - started:.0f} s)")
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    return 0


__all__ = [
    "ARMS",
    "EngineProcess",
    "PDArm",
    "PDRow",
    "PDScenario",
    "conversations",
    "long_sessions",
    "markdown",
    "quick_scenario",
    "row_of",
    "run_arm",
    "run_command",
    "run_scenario",
    "summary_lines",
    "table",
]
