"""Memory per residency, lookups and drains against the number of sources: two builds of the core.

    .venv/bin/python bench/memory_scale.py --old OLD/_kvcore.so [--new index/_kvcore*.so] \\
        [--sources 64,512,1024,4096] [--residencies 1000000,5000000] [--reps 60] [--drain-pairs 5]

Why one process and both builds: the box is shared (2 cores, up to 8 jobs), so lookup and drain
times move between runs; alternating the two builds call by call on the same data makes their
ratio say what the layout did. An old build: ``git show REV:index/_kvcore.c`` (and its three headers)
into a directory, then ``gcc -shared -fPIC -O2 -std=gnu11 -fno-strict-aliasing -I<python include>
D/index/_kvcore.c -ldl -o D/_kvcore.so`` (as bench/core_ab.py).

Per (sources N, residencies R), both builds' stores are filled with the same residencies, built
the way a fleet's caches look: a 16-block system prompt every source holds, then documents of 496
blocks, each held by 1, 2 or 3 random sources (probabilities 0.5, 0.3, 0.2), GPU only, until R.
Reported per build: the RSS the store added (tables are mapped and written at once, so RSS is what
they cost) and the tables' own bytes (``nbytes``), both per residency; the p50 of
``Store.lookup`` over every source as candidates (as the service asks) for 1k- and 8k-token prompts
along a stored document (its holders hit the whole prompt); the calls alternate old/new.

Drains: bench/core_ab.py's payloads (BlockStored events of 1-31 blocks, round-robin over 8 or 64
sources) through ``Ingestor.apply_chunk`` in chunks of 64, CPU seconds, builds alternating; blocks/s
medians. Prints JSON lines, then a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from core_ab import BS, load, payloads  # noqa: E402

SYS_BLOCKS = 16
DOC_BLOCKS = 496
PROMPTS = {"1k": 1024 // BS, "8k": 8192 // BS}


def rss() -> int:
    """The process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload(n_src: int, n_res: int, seed: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per source, the keys it holds (system prompt first); and the documents' key chains."""
    rng = np.random.default_rng(seed)
    sys_keys = rng.integers(0, 2**64, SYS_BLOCKS, dtype=np.uint64, endpoint=False)
    per: list[list[np.ndarray]] = [[sys_keys] for _ in range(n_src)]
    docs: list[np.ndarray] = []
    left = n_res - SYS_BLOCKS * n_src
    while left > 0:
        keys = rng.integers(0, 2**64, DOC_BLOCKS, dtype=np.uint64, endpoint=False)
        h = int(rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]))
        for s in rng.choice(n_src, size=min(h, n_src), replace=False):
            per[int(s)].append(keys)
            left -= DOC_BLOCKS
        docs.append(np.concatenate([sys_keys, keys]))
    return [np.concatenate(p) for p in per], docs


def fill(mod: ModuleType, per: list[np.ndarray]) -> Any:
    """A store of one build holding every source's keys (engine hash = key: maps are per source)."""
    store = mod.Store(10**12, 1)
    for _ in per:
        store.new_slot()
    for s, keys in enumerate(per):  # the system prompt first: the old layout's columns while small
        store.store(s, 0, keys[:SYS_BLOCKS], keys[:SYS_BLOCKS])
    step = 4096
    longest = max(len(k) for k in per)
    for lo in range(SYS_BLOCKS, longest, step):  # sources interleaved, as streams arrive
        for s, keys in enumerate(per):
            part = keys[lo : lo + step]
            if len(part):
                store.store(s, 0, part, part)
    return store


def scale(mods: dict[str, ModuleType], n_src: int, n_res: int, reps: int) -> dict[str, Any]:
    """Memory and lookups of both builds for one (sources, residencies)."""
    per, docs = workload(n_src, n_res)
    stores: dict[str, Any] = {}
    out: dict[str, Any] = {"sources": n_src}
    for name, mod in mods.items():
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        stores[name] = fill(mod, per)
        built = time.perf_counter() - t0
        total = stores[name].total
        out["residencies"] = total
        out[name] = {
            "rss_b_per_res": round((rss() - before) / total, 1),
            "table_b_per_res": round(stores[name].nbytes() / total, 1),
            "fill_s": round(built, 2),
        }
    cands = list(range(n_src))
    rng = np.random.default_rng(2)
    picks = [docs[int(i)] for i in rng.integers(0, len(docs), reps)]
    for label, nb in PROMPTS.items():
        times: dict[str, list[float]] = {name: [] for name in mods}
        results: dict[str, Any] = {}
        for r, doc in enumerate(picks):
            keys = doc[:nb].tobytes()
            for name in list(mods) if r % 2 else list(mods)[::-1]:
                t0 = time.perf_counter_ns()
                res = stores[name].lookup(keys, cands)
                times[name].append((time.perf_counter_ns() - t0) / 1000)
                results[name] = res
            first = list(results.values())
            assert all(x == first[0] for x in first), "the builds disagree"
        for name in mods:
            out[name][f"lookup_{label}_p50_us"] = round(statistics.median(times[name]), 1)
    del stores
    gc.collect()
    return out


def drain(mods: dict[str, ModuleType], n_src: int, blocks: int, pairs: int) -> dict[str, Any]:
    """Drain CPU of both builds on the same payloads, builds alternating."""
    sys.modules["index._kvcore"] = mods["new"]
    import index.store as store_module
    from index.ingest import Ingestor

    items = payloads(blocks, n_src, 1)

    def run(name: str) -> float:
        store_module._kvcore = mods[name]  # type: ignore[attr-defined]
        ing = Ingestor(store_module.PrefixStore(), BS)
        sidx = [ing.add_source((f"e{s}", 0)) for s in range(n_src)]
        c0 = time.process_time()
        for i in range(0, len(items), 64):
            ing.apply_chunk([(sidx[s], p) for s, p in items[i : i + 64]])
        return time.process_time() - c0

    cpu: dict[str, list[float]] = {name: [] for name in mods}
    for r in range(pairs):
        for name in list(mods) if r % 2 else list(mods)[::-1]:
            cpu[name].append(run(name))
    ratios = [n / o for o, n in zip(cpu["old"], cpu["new"], strict=True)]
    return {
        "sources": n_src,
        "blocks": blocks,
        **{f"{name}_blocks_per_s": round(blocks / statistics.median(v)) for name, v in cpu.items()},
        "new_over_old_cpu_median": round(statistics.median(ratios), 3),
        "new_over_old_cpu_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the build before (a _kvcore .so)")
    ap.add_argument("--new", default=None, help="the build after (default: the package's)")
    ap.add_argument("--sources", default="64,512,1024,4096")
    ap.add_argument("--residencies", default="1000000,5000000")
    ap.add_argument("--reps", type=int, default=60, help="lookups per prompt size and build")
    ap.add_argument("--drain-sources", default="8,64")
    ap.add_argument("--drain-blocks", type=int, default=200_000)
    ap.add_argument("--drain-pairs", type=int, default=5)
    args = ap.parse_args()
    new = args.new or sorted(glob.glob(str(ROOT / "index" / "_kvcore*.so")))[0]
    mods = {"old": load(args.old), "new": load(new)}
    rows = []
    for n_res in [int(x) for x in args.residencies.split(",")]:
        for n_src in [int(x) for x in args.sources.split(",")]:
            row = scale(mods, n_src, n_res, args.reps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    drains = []
    for n_src in [int(x) for x in args.drain_sources.split(",") if x]:
        d = drain(mods, n_src, args.drain_blocks, args.drain_pairs)
        print(json.dumps(d), flush=True)
        drains.append(d)
    print()
    print(
        "| residencies | sources | RSS B/res old | new | tables B/res old | new "
        "| lookup 1k p50 us old | new | lookup 8k p50 us old | new |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, n = r["old"], r["new"]
        print(
            f"| {r['residencies']:,} | {r['sources']:,} | {o['rss_b_per_res']} | {n['rss_b_per_res']} "
            f"| {o['table_b_per_res']} | {n['table_b_per_res']} "
            f"| {o['lookup_1k_p50_us']} | {n['lookup_1k_p50_us']} "
            f"| {o['lookup_8k_p50_us']} | {n['lookup_8k_p50_us']} |"
        )
    if drains:
        print()
        print("| drain sources | old blocks/s | new blocks/s | new/old CPU (median, range) |")
        print("|---|---|---|---|")
        for d in drains:
            lo, hi = d["new_over_old_cpu_range"]
            print(
                f"| {d['sources']} | {d['old_blocks_per_s']:,} | {d['new_blocks_per_s']:,} "
                f"| {d['new_over_old_cpu_median']} ({lo}-{hi}) |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
