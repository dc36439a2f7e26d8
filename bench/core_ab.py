"""Two builds of the compiled core (``index/_kvcore*.so``) ingesting the same payloads in one process,
run by run in turn: the CPU seconds of ``Ingestor.apply_chunk`` over raw payloads, as the service's
ingest thread spends them.

Why: the service benchmark's drains move by +-30% between runs on the shared 2-core box (the
scheduler's share, not the code), which hides a change worth 10% of the ingest thread. In one
process, alternating the two builds on identical payloads, the box's slow and fast minutes weigh on
both alike and the ratio of each pair says what the change did.

    .venv/bin/python bench/core_ab.py --a OLD/_kvcore.cpython-311-x86_64-linux-gnu.so \\
        --b index/_kvcore.cpython-311-x86_64-linux-gnu.so [--blocks 500000] [--sources 8] \\
        [--events 1] [--pairs 16]

An old build: ``git show REV:index/_kvcore.c > D/index/_kvcore.c`` (and its headers), then
``gcc -shared -fPIC -O2 -std=gnu11 -fno-strict-aliasing -I$(python -c 'import sysconfig;
print(sysconfig.get_paths()["include"])') D/index/_kvcore.c -ldl -o D/_kvcore.so``. Both builds
must share the Python API of ``index.store`` (this module swaps ``index.store._kvcore``).

Payloads: BlockStored events of 1-31 blocks (block size 16, token ids uniform below 150,000 as a
128k-152k vocabulary gives), ``--events`` per payload, spread round-robin over ``--sources``; half the
events name the block before them as parent. Prints one JSON line: the medians and the median and
range of the per-pair ratios b/a.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BS = 16


def load(path: str) -> ModuleType:
    """A build of the core as a module of its own (a different file: dlopen gives another copy)."""
    spec = importlib.util.spec_from_file_location("index._kvcore", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def payloads(blocks: int, sources: int, events: int, vllm_fields: bool = False) -> list[tuple[int, bytes]]:
    from sim.publisher import BlockStored, encode_batch

    rng = random.Random(1)
    out: list[tuple[int, bytes]] = []
    made, h = 0, 1
    while made < blocks:
        evs = []
        for _ in range(events):
            n = rng.randint(1, 31)
            toks = [rng.randrange(150_000) for _ in range(n * BS)]
            parent = h - 1 if h > 1 and rng.random() < 0.5 else None
            ev = BlockStored(list(range(h, h + n)), parent, toks, BS, None, "GPU", None)
            if vllm_fields:  # what vLLM >= 0.24 sends with every event of a one-group engine
                ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind = [None] * n, 0, "full_attention"
            evs.append(ev)
            h += n
            made += n
        out.append((len(out) % sources, encode_batch(evs, 1.0, 0)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the build before (a _kvcore .so)")
    ap.add_argument("--b", required=True, help="the build after")
    ap.add_argument("--blocks", type=int, default=500_000)
    ap.add_argument("--sources", type=int, default=8)
    ap.add_argument("--events", type=int, default=1, help="events per payload")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument(
        "--vllm-fields",
        action="store_true",
        help="events carry extra_keys, group_idx and kv_cache_spec_kind as vLLM >= 0.24 sends them",
    )
    args = ap.parse_args()
    mods = {"a": load(args.a), "b": load(args.b)}
    sys.modules["index._kvcore"] = mods["b"]
    import index.store as store_module
    from index.ingest import Ingestor

    items = payloads(args.blocks, args.sources, args.events, args.vllm_fields)

    def run(build: str) -> float:
        store_module._kvcore = mods[build]  # type: ignore[attr-defined]
        ing = Ingestor(store_module.PrefixStore(), BS)
        sidx = [ing.add_source((f"e{s}", 0)) for s in range(args.sources)]
        c0 = time.process_time()
        for i in range(0, len(items), 64):  # the subscriber's chunks
            ing.apply_chunk([(sidx[s], p) for s, p in items[i : i + 64]])
        return time.process_time() - c0

    cpu: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(args.pairs):
        for build in ("a", "b") if r % 2 else ("b", "a"):
            cpu[build].append(run(build))
    ratios = [b / a for a, b in zip(cpu["a"], cpu["b"], strict=True)]
    print(
        json.dumps(
            {
                "blocks": args.blocks,
                "sources": args.sources,
                "events_per_payload": args.events,
                "pairs": args.pairs,
                "cpu_s_median": {k: round(statistics.median(v), 4) for k, v in cpu.items()},
                "b_over_a_median": round(statistics.median(ratios), 3),
                "b_over_a_range": [round(min(ratios), 3), round(max(ratios), 3)],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
