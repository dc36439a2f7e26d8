"""What a fleet's cache capacity lets any router reach on a trace, without engines or timing.

The flow-control goal asks a hit ratio of the trace replay's fleet (4 engines, 2,000-block LRU caches,
the first 3,500 requests of the Mooncake synthetic trace). Routing only chooses which engine's cache
a request meets; the engines' LRU decides what stays. This replays the trace's block ids (512 tokens
each) through cache models and prints the hit ratio each reaches (cached tokens over prompt tokens,
a hit capped at ``input_length - 1``, as vLLM computes the last token):

- ``infinite``: every block ever computed stays (the bound the goal was set against);
- ``pooled LRU``: one LRU of the whole fleet's capacity, prefix rule (a hit ends at the first miss):
  what one engine with all four caches would keep, load ignored;
- ``4 x LRU, longest prefix``: four LRU caches, each request sent where its prefix is longest (ties
  to the engine with the fewest blocks cached), load ignored: affinity alone, which piles hot
  prefixes on one engine and evicts there (one placement, not a bound);
- ``Belady``: one cache of the fleet's capacity that evicts the block used farthest in the future,
  every block hit counted (no prefix rule): no placement over LRU engines reaches it.

    .venv/bin/python bench/cache_bound.py [--limit 3500] [--capacity 2000 --engines 4]
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sim.traces import TRACE_FILES, trace_dir

TRACE = trace_dir() / TRACE_FILES["synthetic"]
BLOCK_TOKENS = 512


def load(path: Path, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with gzip.open(path, "rt") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= limit:
                break
    return out


def cached_tokens(req: dict[str, Any], blocks: int) -> int:
    return int(min(blocks * BLOCK_TOKENS, req["input_length"] - 1))


def prefix_in(cache: Any, ids: list[int]) -> int:
    n = 0
    for h in ids:
        if h not in cache:
            break
        n += 1
    return n


def infinite(reqs: list[dict[str, Any]]) -> float:
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        hit += cached_tokens(r, prefix_in(seen, r["hash_ids"]))
        seen.update(r["hash_ids"])
    return hit / sum(r["input_length"] for r in reqs)


def touch(cache: OrderedDict[int, None], ids: list[int], capacity: int) -> None:
    for h in ids:
        cache[h] = None
        cache.move_to_end(h)
    while len(cache) > capacity:
        cache.popitem(last=False)


def pooled_lru(reqs: list[dict[str, Any]], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for r in reqs:
        hit += cached_tokens(r, prefix_in(cache, r["hash_ids"]))
        touch(cache, r["hash_ids"], capacity)
    return hit / sum(r["input_length"] for r in reqs)


def routed_lru(reqs: list[dict[str, Any]], engines: int, capacity: int) -> float:
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    hit = 0
    for r in reqs:
        ids = r["hash_ids"]
        best = max(range(engines), key=lambda e: (prefix_in(caches[e], ids), -len(caches[e])))
        hit += cached_tokens(r, prefix_in(caches[best], ids))
        touch(caches[best], ids, capacity)
    return hit / sum(r["input_length"] for r in reqs)


def belady(reqs: list[dict[str, Any]], capacity: int) -> float:
    seq = [(i, h) for i, r in enumerate(reqs) for h in r["hash_ids"]]
    nxt = [0.0] * len(seq)
    last: dict[int, float] = {}
    for j in range(len(seq) - 1, -1, -1):
        nxt[j] = last.get(seq[j][1], float("inf"))
        last[seq[j][1]] = j
    cache: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = [0] * len(reqs)
    for j, (i, h) in enumerate(seq):
        if h in cache:
            hits[i] += 1
        elif len(cache) >= capacity:
            while True:  # the block used farthest ahead (stale heap entries skipped)
                neg, b = heapq.heappop(heap)
                if cache.get(b) == -neg:
                    break
            del cache[b]
        cache[h] = nxt[j]
        heapq.heappush(heap, (-nxt[j], h))
    return sum(cached_tokens(r, n) for r, n in zip(reqs, hits, strict=True)) / sum(
        r["input_length"] for r in reqs
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int, default=3500)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=2000, help="blocks of 512 tokens per engine")
    args = ap.parse_args()
    reqs = load(args.trace, args.limit)
    fleet = args.engines * args.capacity
    print(f"first {len(reqs)} requests, {args.engines} engines x {args.capacity} blocks")
    print("| cache model | hit ratio |")
    print("|---|---|")
    print(f"| infinite | {infinite(reqs):.3f} |")
    for mult in (1, 2, 4):
        ratio = pooled_lru(reqs, fleet * mult)
        print(f"| pooled LRU of {mult}x the fleet ({fleet * mult:,} blocks) | {ratio:.3f} |")
    print(f"| {args.engines} x LRU, longest prefix | {routed_lru(reqs, args.engines, args.capacity):.3f} |")
    print(f"| Belady, the fleet's capacity | {belady(reqs, fleet):.3f} |")


if __name__ == "__main__":
    main()
