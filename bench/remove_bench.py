"""Pods leaving at run time: removing a source that holds 1M blocks, while the router's event loop
runs lookups, and the memory coming back.

``.venv/bin/python bench/remove_bench.py [--blocks 1000000] [--rounds 5]`` (``make bench`` runs it
with the service benchmark). In one fresh process: the index is filled with one source's blocks
(vLLM-layout payloads through the C ingest), the subscriber thread is started, and an asyncio loop
runs a probe task (1 ms sleeps, the longest gap over 1 ms is the stall) and a task doing 8k-token
lookups back to back, while ``KVIndex.remove_source`` drops the source. Reported: the longest loop
stall, the time until the source's blocks are gone, RSS before the source joined, with it, and
after the removal (the payloads are generated first, so their memory is in every figure alike);
then ``--rounds`` sources of a fifth of the size join and leave, and RSS and the number of source
slots after each round show that nothing grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from service_bench import Stream, chain_tokens, make_stream  # noqa: E402

from index.kvindex import IndexConfig, KVIndex  # noqa: E402
from index.subscriber import SourceConfig  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fill(index: KVIndex, name: str, stream: Stream) -> tuple[float, list[int]]:
    """Add a source (subscribed to a port nobody publishes on) and ingest a stream into it."""
    index.add_source(SourceConfig(name, 0, f"tcp://127.0.0.1:{free_port()}"))
    deadline = time.monotonic() + 30
    while (sidx := index.store.source_index((name, 0))) is None:  # (added by the subscriber thread)
        if time.monotonic() > deadline:
            raise RuntimeError("source not added")
        time.sleep(0.01)
    t = time.perf_counter()
    items = [(sidx, p) for p in stream.payloads[0]]
    for i in range(0, len(items), 512):
        index.ingestor.apply_chunk(items[i : i + 512])
    c = stream.long["8k"]
    return time.perf_counter() - t, chain_tokens(c.family, c.seed, c.blocks)


async def remove_while_looking_up(index: KVIndex, name: str, tokens: list[int]) -> dict[str, float]:
    stop = asyncio.Event()
    stall = 0.0
    lookups = 0

    async def probe() -> None:
        nonlocal stall
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stall = max(stall, time.perf_counter() - t - 0.001)

    async def lookup() -> None:
        nonlocal lookups
        while not stop.is_set():
            index.match(tokens, [(name, 0)])
            lookups += 1
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(probe()), asyncio.create_task(lookup())]
    await asyncio.sleep(0.2)
    stall = 0.0
    t0 = time.perf_counter()
    index.remove_source((name, 0))
    while index.store.source_index((name, 0)) is not None or index.store.total:
        await asyncio.sleep(0.001)
    gone = time.perf_counter() - t0
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks)
    return {"removal_s": round(gone, 3), "longest_loop_stall_ms": round(stall * 1e3, 2), "lookups": lookups}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    random.seed(1)
    # the payloads are made first: their own memory is in every RSS figure alike
    big = make_stream(1, args.blocks, True, seed=5)
    small = [make_stream(1, args.blocks // 5, True, seed=100 + r) for r in range(args.rounds)]
    index = KVIndex(IndexConfig(block_size=16))
    index.start()
    try:
        time.sleep(0.3)
        out: dict[str, object] = {"rss_before_mb": round(rss_mb(), 1)}
        took, tokens = fill(index, "big", big)
        out["blocks"] = index.store.total
        out["ingest_s"] = round(took, 3)
        out["rss_with_source_mb"] = round(rss_mb(), 1)
        out.update(asyncio.run(remove_while_looking_up(index, "big", tokens)))
        time.sleep(0.5)  # the subscriber trims the heap once idle
        out["rss_after_removal_mb"] = round(rss_mb(), 1)
        rounds = []
        for r in range(args.rounds):
            fill(index, f"pod{r}", small[r])
            index.remove_source((f"pod{r}", 0))
            deadline = time.monotonic() + 60
            while index.store.total and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            rounds.append({"rss_mb": round(rss_mb(), 1), "slots": len(index.store._sources)})
        out["join_leave_rounds"] = rounds
    finally:
        index.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
