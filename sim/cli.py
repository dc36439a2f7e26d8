"""`kvrouter mock-engine`: run a fleet of mock vLLM engines until SIGINT/SIGTERM.

`kvrouter` finds the simulation commands through their entry points (sim/commands.py), each
registered from its own module; `register(subparsers)` adds all of them to another parser.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from sim.commands import BENCH, COMMANDS, DEMO, MOCK_ENGINE
from sim.engine import EngineConfig, token_scaled
from sim.fleet import Fleet
from sim.kvgroups import PRESETS, check_engine_groups


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add every simulation subcommand (`mock-engine`, `demo`, `bench replay`) to a parser."""
    for command in (MOCK_ENGINE, DEMO, BENCH):
        command.register(subparsers)


def register_mock_engine(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `kvrouter mock-engine`."""
    d = EngineConfig()
    p = subparsers.add_parser(
        "mock-engine",
        help=COMMANDS["mock-engine"],
        description="Engine i serves HTTP on PORT+i; its DP rank r publishes KV events on "
        "KV_PORT + i*DP_SIZE + r and answers replay on REPLAY_PORT + i*DP_SIZE + r.",
    )
    p.add_argument("--engines", type=int, default=1, help="number of engines (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP and KV host (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8000, help="HTTP port of engine 0 (default 8000; 0 = ephemeral)"
    )
    p.add_argument("--kv-port", type=int, default=5557, help="KV event PUB base port (default 5557)")
    p.add_argument("--replay-port", type=int, default=5657, help="replay ROUTER base port (default 5657)")
    p.add_argument("--no-replay", action="store_true", help="do not open replay sockets")
    p.add_argument(
        "--kv-connect",
        action="store_true",
        help="connect the PUB sockets to KV_PORT (the subscriber binds) instead of binding them",
    )
    p.add_argument("--model", default=d.model, help=f"served model name (default {d.model})")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument(
        "--kv-groups",
        default=d.kv_groups,
        help=f"the model's KV cache groups: a preset ({', '.join(PRESETS)}; default {d.kv_groups}: one "
        "full-attention group) or kind[:window],... e.g. sliding_window:64,full_attention (sim/kvgroups.py)",
    )
    p.add_argument("--gpu-blocks", type=int, default=d.num_gpu_blocks, help="GPU KV blocks per DP rank")
    p.add_argument(
        "--cpu-blocks", type=int, default=d.cpu_blocks, help="CPU offload blocks per DP rank (0 = off)"
    )
    p.add_argument("--hashes-per-chunk", type=int, default=d.hashes_per_chunk, help="blocks per CPU chunk")
    p.add_argument("--dp-size", type=int, default=d.dp_size, help="data-parallel ranks per engine")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="multiply all modelled durations")
    p.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="one token stands for this many real ones: per-token, per-step and per-block costs are "
        "multiplied by it (scaled-down trace replays, sim/traces.py)",
    )
    p.add_argument("--hash-seed", type=int, default=d.hash_seed)
    p.add_argument("--topic", default=d.topic)
    p.add_argument(
        "--encoding", choices=["map", "array"], default=d.encoding, help="event shape (vLLM >=0.24 / <=0.23)"
    )
    p.add_argument("--replay-frames", type=int, choices=[3, 2], default=d.replay_frames)
    p.add_argument("--hash-bytes", action="store_true", help="send block hashes as bytes instead of uint64")
    p.add_argument(
        "--tokenizer", default=None, help="HF tokenizer dir or tokenizer.json (default: UTF-8 bytes)"
    )
    p.add_argument(
        "--kv-connector",
        choices=["NixlConnector"],
        default=None,
        help="play vLLM's NIXL roles for P/D disaggregation (prefill and decode legs, sim/nixl.py)",
    )
    p.add_argument(
        "--kv-side-channel-port",
        type=int,
        default=0,
        help="NIXL side channel of engine i rank r at PORT + i*DP_SIZE + r (default 0: ephemeral)",
    )
    p.add_argument("--json", action="store_true", help="print the endpoints as one JSON document")
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV event (events off)")
    p.add_argument("--lose-events", type=float, default=0.0, help="share of event batches lost for good")
    p.add_argument(
        "--no-prompt-tokens-details", action="store_true", help="usage without prompt_tokens_details"
    )
    p.add_argument("--chat-template-file", default=None, help="the engine's own chat template (Jinja)")
    p.set_defaults(func=run_mock_engine)


def _config(args: argparse.Namespace) -> EngineConfig:
    if args.token_scale <= 0:
        raise SystemExit("--token-scale must be > 0")
    try:
        check_engine_groups(args.kv_groups, args.cpu_blocks, args.kv_connector)
    except ValueError as exc:
        raise SystemExit(f"--kv-groups: {exc}") from None
    cfg = EngineConfig(
        model=args.model,
        host=args.host,
        block_size=args.block_size,
        kv_groups=args.kv_groups,
        num_gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        hashes_per_chunk=args.hashes_per_chunk,
        dp_size=args.dp_size,
        kv_host=args.host,
        kv_bind=not args.kv_connect,
        topic=args.topic,
        encoding=args.encoding,
        replay_frames=args.replay_frames,
        hash_bytes=args.hash_bytes,
        hash_seed=args.hash_seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        tokenizer=args.tokenizer,
        kv_events=not args.no_kv_events,
        lose_events=args.lose_events,
        prompt_tokens_details=not args.no_prompt_tokens_details,
        chat_template=Path(args.chat_template_file).read_text() if args.chat_template_file else None,
        kv_connector=args.kv_connector,
        kv_side_channel_port=args.kv_side_channel_port,
    )
    return token_scaled(cfg, args.token_scale)


def _check_ports(args: argparse.Namespace) -> str | None:
    """The fixed port ranges (HTTP, KV, replay) must not overlap; returns an error message if they do."""
    n, dp = args.engines, args.dp_size
    ranges = [("--port", args.port, n), ("--kv-port", args.kv_port, n * dp)]
    if args.kv_connector:
        ranges.append(("--kv-side-channel-port", args.kv_side_channel_port, n * dp))
    if not args.no_replay:
        ranges.append(("--replay-port", args.replay_port, n * dp))
    fixed = [(name, lo, lo + size) for name, lo, size in ranges if lo]
    for i, (a, alo, ahi) in enumerate(fixed):
        if ahi > 65536:
            return f"{a} range {alo}..{ahi - 1} exceeds 65535"
        for b, blo, bhi in fixed[i + 1 :]:
            if alo < bhi and blo < ahi:
                return f"{a} range {alo}..{ahi - 1} overlaps {b} range {blo}..{bhi - 1}"
    return None


def run_mock_engine(args: argparse.Namespace) -> int:
    """Entry point of `kvrouter mock-engine`."""
    if args.engines < 1 or args.dp_size < 1:
        print("--engines and --dp-size must be >= 1", file=sys.stderr)
        return 2
    problem = _check_ports(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 130


async def _serve(args: argparse.Namespace) -> int:
    fleet = Fleet.uniform(
        args.engines,
        _config(args),
        port=args.port,
        kv_port=args.kv_port,
        replay_port=None if args.no_replay else args.replay_port,
        side_channel_port=args.kv_side_channel_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await fleet.start()
    except OSError as exc:
        print(f"cannot start the mock engines: {exc}", file=sys.stderr)
        return 1
    try:
        info = fleet.describe()
        if args.json:
            print(json.dumps({"engines": info}, indent=2))
        else:
            for i, e in enumerate(info):
                shape = f"model={e['model']} dp_size={e['dp_size']} block_size={e['block_size']}"
                if e["kv_groups"] != "llama":
                    shape += f" kv_groups={e['kv_groups']}"
                print(f"engine {i}: {e['url']}  {shape}")
                for rank, (kv, replay) in enumerate(
                    zip(e["kv_endpoints"], e["replay_endpoints"], strict=True)
                ):
                    print(f"  dp rank {rank}: kv events {kv}  replay {replay or '-'}")
                for rank, side in enumerate(e["side_channels"]):
                    print(f"  dp rank {rank}: NIXL side channel {side}")
            print("serving; Ctrl-C to stop", flush=True)
        sys.stdout.flush()
        await stop.wait()
    finally:
        await fleet.stop()
    return 0
