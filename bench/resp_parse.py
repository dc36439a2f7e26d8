"""CPU cost of the store client's reply parsing (router/cluster/resp.py) on a normal cluster workload.

The workload is what a replica's two store connections read: channel messages (real wire messages:
a few load rows, now and then predictions and pins) and the replies of its pipelined publishes
(PUBLISH's count, SET's OK, HSET's count). They are fed to ``Connection.data_received`` as the
socket would deliver them, in three ways: one message per read (a quiet link), a few at a time, and
cut at random sizes (a busy link, messages split between reads). Reported: microseconds of CPU per
message, the best of ``--repeats``.

``--baseline REV`` measures the resp.py of that git revision too, in the same process, in turn with
the current one, so the two can be compared on a loaded machine::

    .venv/bin/python bench/resp_parse.py --baseline HEAD~1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.cluster import resp  # noqa: E402
from router.cluster.wire import LoadRow, Message, Pin, Prediction, encode, pack_keys  # noqa: E402


def module_at(rev: str) -> types.ModuleType:
    """router/cluster/resp.py as it was at ``rev``, as a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:router/cluster/resp.py"], check=True, capture_output=True
    ).stdout
    mod = types.ModuleType(f"resp_{rev}")
    sys.modules[mod.__name__] = mod  # (dataclasses look their module up)
    exec(compile(source, f"resp.py@{rev}", "exec"), mod.__dict__)
    return mod


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def workload(n: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """(channel messages as RESP pushes, publish replies), ``n`` of each."""
    rng = random.Random(seed)
    pushes, replies = [], []
    for i in range(n):
        loads = [
            LoadRow(f"engine-{rng.randrange(16)}", 0, rng.randrange(8), rng.randrange(2), 0) for _ in range(3)
        ]
        preds = []
        if i % 4 == 0:
            keys = [rng.getrandbits(64) for _ in range(rng.randrange(8, 64))]
            preds.append(Prediction("engine-1", 0, 16, 2000, pack_keys(keys)))
        pins = [Pin(rng.getrandbits(63), "engine-2", 0, 600_000)] if i % 8 == 0 else []
        msg = encode(Message(replica="a" * 16, seq=i, loads=loads, predictions=preds, pins=pins))
        pushes.append(b"*3\r\n" + bulk(b"message") + bulk(b"kvrouter:cluster") + bulk(msg))
        replies.append(b":3\r\n+OK\r\n" if i % 8 == 0 else b":3\r\n")
    return pushes, replies


def reads(items: list[bytes], mode: str, seed: int = 2) -> list[bytes]:
    """The items as the socket would deliver them."""
    if mode == "single":
        return items
    if mode == "batched":
        return [b"".join(items[i : i + 4]) for i in range(0, len(items), 4)]
    rng = random.Random(seed)
    stream = b"".join(items)
    out, pos = [], 0
    while pos < len(stream):
        cut = rng.randrange(16, 4096)
        out.append(stream[pos : pos + cut])
        pos += cut
    return out


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


def run(mod: Any, chunks: list[bytes], messages: int) -> float:
    """CPU seconds to parse and dispatch ``chunks``."""

    async def main() -> float:
        got = 0

        def on_message(_: bytes) -> None:
            nonlocal got
            got += 1

        conn = mod.Connection(on_message)
        conn.connection_made(_Transport())
        t0 = time.process_time()
        for c in chunks:
            conn.data_received(c)
        spent = time.process_time() - t0
        assert got == messages or messages == 0, (got, messages)
        return spent

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline", default=None, help="a git revision whose resp.py to measure too")
    args = ap.parse_args()
    mods: dict[str, Any] = {"current": resp}
    if args.baseline:
        mods = {args.baseline: module_at(args.baseline), **mods}
    pushes, replies = workload(args.messages)
    print(f"{args.messages} messages of {sum(map(len, pushes)) / len(pushes):.0f} bytes on average")
    for mode in ("single", "batched", "random"):
        for what, items in (("messages", pushes), ("replies", replies)):
            chunks = reads(items, mode)
            best = {name: float("inf") for name in mods}
            for _ in range(args.repeats):  # in turn, so a busy moment weighs on both
                for name, mod in mods.items():
                    best[name] = min(best[name], run(mod, chunks, len(items) if what == "messages" else 0))
            figures = ", ".join(f"{name} {best[name] / len(items) * 1e6:.2f} us" for name in mods)
            print(f"{mode:8s} {what:9s} ({len(chunks)} reads): {figures} per item")


if __name__ == "__main__":
    main()
