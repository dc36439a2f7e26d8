"""Index micro-benchmarks: ingest rate, lookup latency, memory per residency.

Run: ``.venv/bin/python bench/index_bench.py [--quick]`` (``make bench`` runs it). Prints a JSON
document and a markdown table; the figures in docs/benchmarks/index.md come from here.

- ingest: vLLM-layout msgpack batches of 1..64 BlockStored blocks (block_size 16) plus the
  BlockRemoved traffic of a full cache, decoded and applied in subscriber-sized chunks, one core.
- lookup: an index of 1M residencies over 8 or 64 sources; prompts of 1k/8k/32k tokens whose first
  half is cached on some sources; hash + match per call (KVIndex.match), p50/p99.
- memory: RSS growth per residency while indexing 1M blocks (the store's kernels are loaded first:
  the first index's fixed cost is reported apart, as ``fixed_bytes``).

``--store dict`` runs everything on the dict store (:mod:`index.store_dict`) instead of the compact
one; ``--ab`` compares the two in one process: ingest runs interleaved, and both indexes built side
by side with their lookups interleaved on the same prompts (the machine is shared: compare within
one run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import index.kvindex
from index.ingest import Ingestor
from index.kvindex import IndexConfig, KVIndex
from index.store import PrefixStore
from index.store_dict import DictPrefixStore
from sim.publisher import BlockRemoved, BlockStored, encode_batch

BS = 16
STORES: dict[str, Any] = {"compact": PrefixStore, "dict": DictPrefixStore}
_store_cls: Any = PrefixStore


def use_store(name: str) -> None:
    """Select the store class for everything this module builds (KVIndex included)."""
    global _store_cls
    _store_cls = STORES[name]
    index.kvindex.PrefixStore = _store_cls  # type: ignore[attr-defined]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_stream(n_blocks: int, rng: random.Random, capacity: int) -> list[bytes]:
    """Encoded batches: chains of 1..64 new blocks, evicting the oldest beyond ``capacity`` blocks."""
    payloads: list[bytes] = []
    live: list[int | bytes] = []
    next_hash = 1
    made = 0
    parent: int | bytes | None = None
    while made < n_blocks:
        n = rng.randint(1, 64)
        events: list[Any] = []
        if len(live) + n > capacity:
            doomed, live = live[:n], live[n:]
            events.append(BlockRemoved(doomed, "GPU"))
        if rng.random() < 0.3:
            parent = None  # a new conversation
        hashes: list[int | bytes] = list(range(next_hash, next_hash + n))
        next_hash += n
        tokens = [rng.randrange(150_000) for _ in range(n * BS)]
        events.append(BlockStored(hashes, parent, tokens, BS, None, "GPU", None))
        parent = hashes[-1]
        live += hashes
        made += n
        payloads.append(encode_batch(events, time.time(), 0))
    return payloads


def bench_ingest(n_blocks: int, chunk: int = 64) -> dict[str, Any]:
    rng = random.Random(1)
    payloads = make_stream(n_blocks, rng, capacity=200_000)
    runs = []
    cpu = []
    for _ in range(3):
        store = _store_cls()
        ing = Ingestor(store, BS)
        sidx = ing.add_source(("e", 0))
        gc.collect()
        t0 = time.perf_counter()
        c0 = time.process_time()
        for i in range(0, len(payloads), chunk):
            ing.apply_chunk([(sidx, p) for p in payloads[i : i + chunk]])  # raw, as the subscriber
        runs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = statistics.median(runs)
    return {
        "blocks": n_blocks,
        "batches": len(payloads),
        "blocks_per_s_median": round(n_blocks / best),
        # CPU time of this process: on a shared machine, closer to what one free core would do
        "blocks_per_s_cpu_median": round(n_blocks / statistics.median(cpu)),
        "blocks_per_s_runs": [round(n_blocks / r) for r in runs],
    }


def build_index(n_res: int, sources: int, keep_docs: bool = True) -> tuple[KVIndex, list[list[int]]]:
    """An index with ``n_res`` residencies spread over ``sources``; returns the documents' tokens."""
    idx = KVIndex(IndexConfig(block_size=BS, max_residencies=10 * n_res))
    sidxs = [idx.ingestor.add_source((f"e{s}", 0)) for s in range(sources)]
    rng = random.Random(2)
    docs: list[list[int]] = []
    made = 0
    s = 0
    while made < n_res:
        tokens = [rng.randrange(150_000) for _ in range(64 * BS)]
        if keep_docs:
            docs.append(tokens)
        hashes: list[int | bytes] = [rng.getrandbits(64) for _ in range(64)]
        payload = encode_batch([BlockStored(hashes, None, tokens, BS, None, "GPU", None)], 1.0, 0)
        idx.ingestor.apply_chunk([(sidxs[s % sources], payload)])
        made += 64
        s += 1
    return idx, docs


def bench_lookup(n_res: int, sources: int, reps: int) -> dict[str, Any]:
    idx, docs = build_index(n_res, sources)
    cands = [(f"e{s}", 0) for s in range(sources)]
    rng = random.Random(3)
    out: dict[str, Any] = {"sources": sources, "residencies": idx.store.total}
    for tokens_n in (1024, 8192, 32768):
        times = []
        for _ in range(reps):
            doc = docs[rng.randrange(len(docs))]
            prompt = (doc * (tokens_n // len(doc) + 1))[: tokens_n // 2] + [
                rng.randrange(150_000) for _ in range(tokens_n // 2)
            ]
            t0 = time.perf_counter()
            rep = idx.match(prompt, cands)
            times.append(time.perf_counter() - t0)
            assert max(m.blocks for m in rep.matches.values()) >= 1
        times.sort()
        out[f"{tokens_n}"] = {
            "p50_us": round(times[len(times) // 2] * 1e6, 1),
            "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
        }
    return out


def bench_ab(n_res: int, sources: int, reps: int) -> dict[str, Any]:
    """Both stores fed the same blocks in one process; ``KVIndex.match`` timed interleaved on the same
    prompts (which store goes first alternates), so both see the same machine load."""
    idxs = {}
    for name in STORES:
        use_store(name)
        idxs[name], docs = build_index(n_res, sources)
    use_store("compact")
    cands = [(f"e{s}", 0) for s in range(sources)]
    rng = random.Random(3)
    out: dict[str, Any] = {"sources": sources, "residencies": n_res, "reps": reps}
    for tokens_n in (1024, 8192, 32768):
        times: dict[str, list[float]] = {name: [] for name in idxs}
        for i in range(reps):
            doc = docs[rng.randrange(len(docs))]
            prompt = (doc * (tokens_n // len(doc) + 1))[: tokens_n // 2] + [
                rng.randrange(150_000) for _ in range(tokens_n // 2)
            ]
            reports = {}
            for name in list(idxs) if i % 2 else list(reversed(idxs)):
                t0 = time.perf_counter()
                reports[name] = idxs[name].match(prompt, cands)
                times[name].append(time.perf_counter() - t0)
            assert reports["dict"].matches == reports["compact"].matches
        for name, ts in times.items():
            ts.sort()
            out[f"{tokens_n} {name}"] = {
                "p50_us": round(ts[len(ts) // 2] * 1e6, 1),
                "p99_us": round(ts[int(len(ts) * 0.99)] * 1e6, 1),
            }
    return out


def bench_ab_ingest(n_blocks: int, chunk: int = 64, runs: int = 3) -> dict[str, Any]:
    """Ingest (decode + keys + store) of the same stream into each store, runs interleaved."""
    payloads = make_stream(n_blocks, random.Random(1), capacity=200_000)
    rates: dict[str, list[float]] = {name: [] for name in STORES}
    for r in range(runs):
        for name in list(STORES) if r % 2 else list(reversed(STORES)):
            ing = Ingestor(STORES[name](), BS)
            sidx = ing.add_source(("e", 0))
            gc.collect()
            t0 = time.perf_counter()
            for i in range(0, len(payloads), chunk):
                ing.apply_chunk([(sidx, p) for p in payloads[i : i + chunk]])  # raw, as the subscriber
            rates[name].append(n_blocks / (time.perf_counter() - t0))
    return {
        f"{name} blocks_per_s": {"median": round(statistics.median(v)), "runs": [round(x) for x in v]}
        for name, v in rates.items()
    }


def bench_memory(n_res: int, store: str = "compact") -> dict[str, Any]:
    """In a fresh process: memory freed by earlier steps would otherwise be reused and flatter it."""
    import subprocess

    code = (
        f"import json, index_bench as b; b.use_store({store!r}); print(json.dumps(b._memory_here({n_res})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(__file__),
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _memory_here(n_res: int) -> dict[str, Any]:
    gc.collect()
    start = rss_bytes()
    build_index(64, 2)[0].match(list(range(64)), [("e0", 0)])  # the first index (fixed cost)
    gc.collect()
    before = rss_bytes()
    idx, _ = build_index(n_res, 8, keep_docs=False)
    gc.collect()
    after = rss_bytes()
    total = idx.store.total
    return {
        "residencies": total,
        "bytes_per_residency": round((after - before) / total, 1),
        "fixed_bytes": before - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--store", choices=list(STORES), default="compact", help="the store to measure")
    ap.add_argument("--ab", action="store_true", help="only the interleaved A/B of both stores")
    args = ap.parse_args()
    n = 100_000 if args.quick else 1_000_000
    if args.ab:
        reps = 200 if args.quick else 1000
        ab = {
            "ingest": bench_ab_ingest(n // 2 if args.quick else 1_000_000),
            "lookup": [bench_ab(n, s, reps) for s in (8, 64)],
        }
        print(json.dumps(ab, indent=2))
        return
    use_store(args.store)
    result = {
        "store": args.store,
        "ingest": bench_ingest(n // 2 if args.quick else 1_000_000),
        "memory": bench_memory(n, args.store),
        "lookup": [bench_lookup(n, s, 200 if args.quick else 1000) for s in (8, 64)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
