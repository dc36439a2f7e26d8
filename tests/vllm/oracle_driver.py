"""vLLM's own prefix cache as the oracle: drives vLLM's real ``Scheduler`` (its ``KVCacheManager``,
block pool, hybrid coordinator, block hasher and event encoding) through a workload, with no model.

Runs under the vLLM venv's interpreter (tests/vllm/install.sh), never under the router's: it imports
only vLLM, torch, msgspec and the standard library. A step of the loop is one ``schedule()`` and one
``update_from_output()`` with a made-up sampled token per request that finished its prefill, so
chunked prefill, preemption (a KV cache too small for what runs) and eviction happen as in the
engine. Every call of ``KVCacheManager.get_computed_blocks`` (each admission attempt, a preempted
request's resume included) is recorded with the request's tokens and the hit vLLM found, after the
events the manager emitted before it are taken and recorded as an encoded batch (what
``ZmqEventPublisher`` would send; batches the scheduler publishes itself are recorded too, in order).
``tests/vllm/vllm_oracle.py`` replays the record into the router's index and compares.

    python tests/vllm/oracle_driver.py --kind gemma3 --model-dir DIR --out trace.msgpack

The record is msgpack: ``{"kind", "block_size", "groups", "records": [...]}`` where a record is
``["batch", payload bytes]`` or ``["lookup", request id, token ids, vLLM's hit in tokens]``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import torch
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

LAYERS = 4
HEADS, HEAD = 2, 32
WINDOW = 64


def layer_specs(kind: str, block_size: int, mamba_block: int) -> dict[str, Any]:
    """Per-layer KV specs of a model shaped like ``kind``: 4 layers, the family's pattern."""
    dt = torch.float16
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=dt)
    window = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=dt, sliding_window=WINDOW
    )
    if kind == "llama":
        return {f"l.{i}": full for i in range(LAYERS)}
    if kind == "gemma3":  # windows alternating with full attention
        return {f"l.{i}": (full if i % 2 else window) for i in range(LAYERS)}
    if kind == "mistral":  # every layer a window
        return {f"l.{i}": window for i in range(LAYERS)}
    if kind == "qwen3_next":  # 3 linear-attention (Mamba-style state) layers per full-attention one
        mamba = MambaSpec(
            block_size=mamba_block,
            shapes=((3, 64), (HEADS, HEAD, HEAD)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        )
        return {f"l.{i}": (full if i % 4 == 3 else mamba) for i in range(LAYERS)}
    raise SystemExit(f"unknown kind {kind!r}")


class Recorder:
    """Stands in for the scheduler's publisher: encodes each batch as ZmqEventPublisher does."""

    def __init__(self, records: list[list[Any]]) -> None:
        self.records = records
        self.pack = msgspec.msgpack.Encoder()

    def publish(self, batch: KVEventBatch) -> None:
        self.records.append(["batch", self.pack.encode(batch)])

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> None:
        return None


def build(args: argparse.Namespace) -> tuple[Scheduler, int, list[str]]:
    mc = ModelConfig(model=str(args.model_dir), max_model_len=args.max_model_len)
    cache = CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=True,
        prefix_cache_retention_interval=None if args.dense else 0,
        mamba_cache_mode="align" if args.kind == "qwen3_next" else "none",
    )
    cache.kv_cache_layout = "LBNHC"
    vc = VllmConfig(
        model_config=mc,
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=args.batch_tokens,
            max_num_seqs=args.max_seqs,
            max_model_len=args.max_model_len,
            is_encoder_decoder=False,
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    specs = layer_specs(args.kind, args.block_size, args.mamba_block)
    per_block = sum(s.page_size_bytes for s in specs.values())
    kcc = get_kv_cache_configs(vc, [specs], [per_block * args.blocks])[0]
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kcc, vc)
    sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=sched_bs, hash_block_size=hash_bs)
    groups = [type(g.kv_cache_spec).__name__ + f"/{g.kv_cache_spec.block_size}" for g in kcc.kv_cache_groups]
    return sched, hash_bs, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", required=True, choices=["llama", "gemma3", "mistral", "qwen3_next"])
    ap.add_argument("--model-dir", type=Path, required=True, help="a tiny model directory (config only)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=96, help="KV cache size in blocks (eviction)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mamba-block", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=128, help="tokens a step (chunked prefill)")
    ap.add_argument("--max-seqs", type=int, default=6)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=24, help="longest generation (preemption)")
    ap.add_argument("--scale", type=int, default=1, help="prompt lengths times this (large blocks)")
    ap.add_argument("--dense", action="store_true", help="prefix_cache_retention_interval None")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    records: list[list[Any]] = []
    sched, hash_bs, groups = build(args)
    sched.kv_event_publisher = Recorder(records)  # type: ignore[assignment]
    kvm = sched.kv_cache_manager
    pack = msgspec.msgpack.Encoder()
    lookup = kvm.get_computed_blocks

    def recorded(request: Request) -> Any:
        events = kvm.take_events()
        if events:
            records.append(["batch", pack.encode(KVEventBatch(ts=time.time(), events=events))])
        out = lookup(request)
        hashes = [bytes(h) for h in request.block_hashes]  # (where each engine hash sits: analysis)
        records.append(["lookup", request.request_id, list(request.all_token_ids), out[1], hashes])
        return out

    kvm.get_computed_blocks = recorded  # type: ignore[method-assign]
    init_none_hash(sha256)
    hasher = get_request_block_hasher(hash_bs, sha256)
    rng = random.Random(args.seed)
    bases = [
        [rng.randrange(5, 2000) for _ in range(rng.randrange(8 * args.scale, 200 * args.scale))]
        for _ in range(6)
    ]
    talks: list[list[int]] = []
    pending: deque[Request] = deque()
    done: dict[str, int] = {}
    ceiling = args.max_model_len - 40
    for i in range(args.requests):
        if talks and rng.random() < 0.5:
            k = rng.randrange(len(talks))
            prompt = talks[k] + [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 60 * args.scale))]
        else:
            k = len(talks)
            talks.append([])
            prompt = rng.choice(bases) + [
                rng.randrange(5, 2000) for _ in range(rng.randrange(0, 60 * args.scale))
            ]
        prompt = prompt[-ceiling:]
        n = rng.randrange(1, args.max_tokens + 1)
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        req = Request(f"r{i}", prompt, params, None, block_hasher=hasher)
        req.kvr_talk = k  # type: ignore[attr-defined]
        pending.append(req)
    steps = 0
    while pending or sched.requests:
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            if pending:
                sched.add_request(pending.popleft())
        if not sched.requests:
            continue
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            r = sched.requests[rid]
            full = r.num_computed_tokens + out.num_scheduled_tokens[rid] >= r.num_tokens
            sampled.append([rng.randrange(5, 2000)] if full else [])
        index = {r: j for j, r in enumerate(ids)}
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index=index, sampled_token_ids=sampled)
        before = dict(sched.requests)
        sched.update_from_output(out, mro)
        for rid, r in before.items():
            if rid not in sched.requests:
                talks[r.kvr_talk] = list(r.all_token_ids)  # type: ignore[attr-defined]
                done[rid] = r.num_preemptions
        steps += 1
    lookups = sum(1 for r in records if r[0] == "lookup")
    preempted = sum(1 for n in done.values() if n)
    args.out.write_bytes(
        msgspec.msgpack.encode(
            {
                "kind": args.kind,
                "block_size": hash_bs,
                "groups": groups,
                "steps": steps,
                "preempted": preempted,
                "records": records,
            }
        )
    )
    print(f"{args.kind}: groups {groups}, hash block {hash_bs}, {steps} steps, {lookups} lookups")


if __name__ == "__main__":
    main()
