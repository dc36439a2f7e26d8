"""`kvrouter demo`: what KV-aware routing buys, shown on a simulated fleet in about a minute.

For each policy (kv, round_robin, least_loaded, random) the demo starts a fresh fleet of mock vLLM
engines in this process (``sim.fleet``: empty caches, counters at zero), starts the real router as a
subprocess (``kvrouter serve --config <generated TOML>`` with that ``[policy] name``), replays the same
seeded chat workload (``sim.workload``: shared system prompts, growing conversations, popular
documents) through it with the live driver, reads the engines' counters, stops both, and finally
prints one comparison table. Nothing is downloaded: the tokenizer is the toy tokenizer, built into a
temporary directory that is removed at the end.

``--quick`` runs a tiny version (a few seconds per policy) for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec

from router.decision.chat import ChatTokenizer
from router.decision.policy import POLICIES
from sim.commands import COMMANDS
from sim.driver import DriverConfig, EngineCounters, run, scrape_engines
from sim.engine import EngineConfig
from sim.fleet import Fleet
from sim.kvgroups import PRESETS, KVGroupsSpec, is_plain, parse_kv_groups
from sim.offline import chat_tokenizer, token_bound
from sim.report import Row, from_live, table, to_json
from sim.workload import Request, WorkloadConfig, demo_config, generate, summary

MODEL = "toy-model"


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


class ProgressLine:
    """A progress bar: ``\\r`` updates on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stdout
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_print = 0.0
        self._done = 0

    def update(self, done: int, total: int | None = None) -> None:
        """Record progress (called by the driver after each request)."""
        if total:
            self.total = max(total, 1)
        self._done = done
        now = time.monotonic()
        if self.tty:
            if now - self._last_print >= 0.1 or done >= self.total:
                self._last_print = now
                self.stream.write("\r" + self._render(now))
                self.stream.flush()
        elif now - self._last_print >= 5.0 or done >= self.total:
            self._last_print = now
            self.stream.write(self._render(now) + "\n")
            self.stream.flush()

    def _render(self, now: float) -> str:
        frac = min(1.0, self._done / self.total)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return f"  {self.label:<13} [{bar}] {self._done:>4}/{self.total} requests  {now - self.start:5.1f} s"

    def close(self) -> None:
        """End the line on a terminal."""
        if self.tty:
            self.stream.write("\r" + self._render(time.monotonic()) + "\n")
            self.stream.flush()


# ---- router subprocess --------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the router binds it by itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _q(value: str) -> str:
    """A TOML basic string (JSON escapes are valid TOML escapes)."""
    return msgspec.json.encode(value).decode()


def router_config(
    fleet: Fleet,
    policy: str,
    port: int,
    block_size: int,
    tokenizer: str | None,
    extra_policy: dict[str, Any] | None = None,
) -> str:
    """The router's TOML config for ``fleet`` (see the contract in the README)."""
    lines = [f"block_size = {block_size}"]
    if tokenizer:
        lines.append(f"tokenizer = {_q(tokenizer)}")
    lines += ["", "[server]", 'host = "127.0.0.1"', f"port = {port}", "", "[policy]", f"name = {_q(policy)}"]
    for k, v in (extra_policy or {}).items():
        lines.append(f"{k} = {_q(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}")
    for i, e in enumerate(fleet.engines):
        lines += ["", "[[backends]]", f"name = {_q(f'engine-{i}')}", f"url = {_q(e.url)}"]
        kv = e.kv_endpoints
        if kv:
            lines.append(f"kv_events = {_q(kv[0])}")
        replay = e.replay_endpoints
        if replay and replay[0]:
            lines.append(f"kv_replay = {_q(replay[0])}")
        lines += [f"dp_size = {e.config.dp_size}", f"models = [{_q(e.config.model)}]"]
    return "\n".join(lines) + "\n"


def router_available() -> str | None:
    """None when the router can be started, else why not (the lead is still writing it)."""
    try:
        import router.app
        import router.serve  # noqa: F401
    except ImportError as exc:
        return f"the router is not available yet ({exc})"
    return None


class RouterProcess:
    """``kvrouter serve --config FILE`` as a child process, with its output in a log file."""

    def __init__(self, config_path: Path, log_path: Path, port: int) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll ``GET /ready`` until 200; raises if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the router exited with code {self.proc.returncode}:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    resp = await client.get(self.url + "/ready")
                    if resp.status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router was not ready within {timeout_s:.0f} s:\n{self.tail()}")
                await asyncio.sleep(0.1)

    def tail(self, lines: int = 20) -> str:
        """The end of the router's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None


# ---- one policy -------------------------------------------------------------------------------------------


class Kept:
    """The last policy's fleet and router, which `kvrouter demo --keep` leaves up after the table
    (each policy's lives only while it runs, on a port of its own) until Ctrl-C or SIGTERM."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        """Stops them when it closes."""
        self.policy = ""
        self.url = ""

    async def wait(self, out: IO[str]) -> None:
        """Say where they are and how to use them, then wait for SIGINT or SIGTERM."""
        body = msgspec.json.encode({"model": MODEL, "prompt": "hello", "max_tokens": 8}).decode()
        out.write(
            f"\nkept up (--keep): {self.policy}'s fleet and router at {self.url}; Ctrl-C stops them\n"
            f"  dashboard: {self.url}/dashboard\n"
            f"  try it:    curl -s {self.url}/v1/completions -H 'content-type: application/json' "
            f"-d '{body}'\n"
            f"  why there: curl -s {self.url}/route -d '{body}'\n"
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
    """Fresh fleet + router for ``policy``, replay, counters; returns the table row. With ``keep``
    the fleet and router stay up until it closes (``kvrouter demo --keep``)."""
    engine_cfg = EngineConfig(
        model=MODEL,
        num_gpu_blocks=cfg.num_gpu_blocks,
        time_scale=cfg.time_scale,
        tokenizer=tokenizer_dir,
        max_model_len=cfg.num_gpu_blocks * 16,
        kv_groups=cfg.kv_groups,
    )
    fleet = Fleet.uniform(cfg.engines, engine_cfg)
    router: RouterProcess | None = None
    await fleet.start()
    kept = False
    try:
        if direct:
            base = fleet.urls[0]
            out.write(f"  {policy}: no router (--direct): every request goes to {base}\n")
        else:
            port = free_port()
            path = workdir / f"router-{policy}.toml"
            path.write_text(router_config(fleet, policy, port, engine_cfg.block_size, tokenizer_dir))
            router = RouterProcess(path, workdir / f"router-{policy}.log", port)
            router.start()
            await router.wait_ready(cfg.ready_timeout_s)
            base = router.url
            out.write(f"  {policy}: router up, dashboard at {router.url}/dashboard (while it runs)\n")
        out.flush()
        bar = ProgressLine(policy, len(requests), out)
        dcfg = DriverConfig(
            base_url=base,
            model=MODEL,
            concurrency=cfg.concurrency,
            speedup=cfg.speedup,
            deadline_s=cfg.deadline_s,
            echo_answers=cfg.echo_answers,
        )
        results = await run(requests, dcfg, progress=bar.update)
        bar.close()
        counters: list[EngineCounters] = await scrape_engines(fleet.urls)
        row = from_live(policy, results, counters)
        failed = [r for r in results if not r.ok and not r.skipped]
        if failed:
            out.write(f"  {policy}: {len(failed)} request(s) failed, first: {failed[0].error}\n")
        if keep is not None:
            keep.stack.push_async_callback(fleet.stop)
            if router is not None:
                keep.stack.callback(router.stop)  # (callbacks run last first: the router stops first)
            keep.policy, keep.url = policy, base
            kept = True
        return row
    finally:
        if not kept:
            if router is not None:
                router.stop()
            await fleet.stop()


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
    from sim.toy_tokenizer import build_toy_tokenizer

    requests = generate(cfg.workload)
    s = summary(requests)
    groups = "" if is_plain(parse_kv_groups(cfg.kv_groups)) else f", KV cache groups {cfg.kv_groups}"
    out.write(
        f"kvrouter demo: {cfg.engines} mock vLLM engines ({cfg.num_gpu_blocks} KV blocks of 16 tokens each"
        f"{groups}), "
        f"{int(s['requests'])} chat requests in {int(s['sessions'])} sessions over {s['span_s']:.0f} s, "
        f"policies: {', '.join(cfg.policies)}\n"
    )
    out.flush()
    rows: list[Row] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrouter-demo-") as tmp:  # (the kept router reads it)
        async with contextlib.AsyncExitStack() as stack:
            kept = Kept(stack) if keep else None
            workdir = Path(tmp)
            tok_dir = str(build_toy_tokenizer(workdir / "tokenizer"))
            tok = ChatTokenizer.from_path(tok_dir)
            bound = token_bound([chat_tokenizer(tok)(r) for r in requests], 16)
            for i, policy in enumerate(cfg.policies):
                last = kept if i == len(cfg.policies) - 1 else None
                row = await run_policy(
                    policy, requests, cfg, workdir, tok_dir, out=out, direct=direct, keep=last
                )
                row.bound = bound
                rows.append(row)
            _summary(rows, started, out, kept is not None)
            if json_path:
                Path(json_path).write_bytes(to_json(rows, {"demo": msgspec.to_builtins(cfg)}))
            if kept is not None:
                await kept.wait(out)
    return rows


def _summary(rows: Sequence[Row], started: float, out: IO[str], kept: bool) -> None:
    """The table, kv against round_robin, and how to try the router afterwards."""
    out.write("\n" + table(rows, title="Routing policies on the same workload (fresh caches each):") + "\n")
    by = {r.policy: r for r in rows}
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
    p.add_argument("--engines", type=int, default=None, help="number of mock engines")
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
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: 2 prefill + 2 decode engines vs 4 aggregated (sim/pd_demo.py)",
    )
    p.add_argument(
        "--kv-groups",
        default="llama",
        help=f"the engines' KV cache groups: {', '.join(PRESETS)} (default llama: one full-attention "
        "group; gemma3 and qwen3_next are hybrid models, sim/kvgroups.py)",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """DemoConfig from parsed flags."""
    cfg = quick_demo(args.seed) if args.quick else DemoConfig(workload=demo_config(seed=args.seed))
    changes: dict[str, Any] = {}
    kv_groups = getattr(args, "kv_groups", "llama")
    try:
        parse_kv_groups(kv_groups)
    except ValueError as exc:
        raise SystemExit(f"--kv-groups: {exc}") from None
    if kv_groups != "llama":
        changes["kv_groups"] = kv_groups
    if args.engines:
        changes["engines"] = args.engines
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
        if getattr(args, "kv_groups", "llama") != "llama":
            print("kvrouter demo: --pd runs plain engines only (--kv-groups llama)", file=sys.stderr)
            return 2
        if getattr(args, "keep", False):
            print("kvrouter demo: --keep is for the policy demo, not --pd", file=sys.stderr)
            return 2
        from sim import pd_demo

        return pd_demo.run_command(args)
    cfg = config_from_args(args)
    if not args.direct:
        why = router_available()
        if why:
            print(f"kvrouter demo: {why}", file=sys.stderr)
            return 2
    try:
        asyncio.run(run_demo(cfg, json_path=args.json, direct=args.direct, keep=getattr(args, "keep", False)))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"kvrouter demo failed: {exc}", file=sys.stderr)
        return 1
    return 0


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
