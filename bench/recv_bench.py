"""Receiving only: what a live message costs the subscriber thread, C loop against Python loop.

``.venv/bin/python bench/recv_bench.py [--messages 200000]``: one PUB socket queues N single-event
BlockStored messages (vLLM's layout, pre-encoded) into a SUB socket over TCP on 127.0.0.1, then the
receive step alone drains them, as ``EventSubscriber._drain_live`` does (chunks of ``max_chunk``,
nothing ingested), with the C loop, with the Python loop on index/zsock.py's binding, and with the
Python loop on pyzmq's own sockets (the library the binding replaces), alternating, three rounds.
Reports CPU microseconds per message (the thread's CPU time: ZMQ's I/O thread is not counted).
An explanation of the service figures (bench/service_bench.py), not a substitute for them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import zmq

from index import zsock
from index.ingest import Ingestor
from index.store import PrefixStore
from index.subscriber import EventSubscriber, SourceConfig, SubscriberConfig
from sim.publisher import BlockStored, encode_batch


def payloads(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        ev = BlockStored([10_000 + i], None if i == 0 else 9_999 + i, list(range(16)), 16, None, "GPU", None)
        out.append(encode_batch([ev], 1000.0 + i, None, "map"))
    return out


def one_drain(ctx: zmq.Context[Any], msgs: list[bytes], native: bool, pyzmq: bool = False) -> float:
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    cfg = SubscriberConfig(native_receive=native, rcvhwm=0)
    real = zsock.backend
    if pyzmq:  # (the subscriber takes its socket library when it is made: pyzmq's for this one)
        zsock.backend = lambda: zmq
    try:
        sub = EventSubscriber(Ingestor(PrefixStore(), 16), config=cfg, ctx=ctx)
    finally:
        zsock.backend = real
    try:
        sub.add_source(SourceConfig("e", 0, endpoint, None))
        src = sub._sources[("e", 0)]
        assert src.sub is not None
        assert pub.poll(10_000)
        pub.recv()
        for i, p in enumerate(msgs):
            pub.send_multipart([b"", i.to_bytes(8, "big"), p], copy=False)
        # wait until everything sits in the SUB socket's queue
        deadline = time.monotonic() + 60
        while not src.sub.poll(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        got = 0
        t0 = time.thread_time()
        while got < len(msgs):
            chunk: list[Any] = []
            sub._drain_live(src, chunk)
            got += len(chunk)
            if not chunk and time.monotonic() > deadline:
                raise RuntimeError(f"only {got} of {len(msgs)} messages arrived")
        return (time.thread_time() - t0) / len(msgs) * 1e6
    finally:
        sub.stop()
        pub.close(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    msgs = payloads(args.messages)
    ctx: zmq.Context[Any] = zmq.Context()
    res: dict[str, list[float]] = {"C": [], "Python": [], "pyzmq": []}
    try:
        for r in range(args.rounds):
            sides = [("C", True, False), ("Python", False, False), ("pyzmq", False, True)]
            for name, native, py in sides if r % 2 == 0 else sides[::-1]:
                res[name].append(one_drain(ctx, msgs, native, py))
    finally:
        ctx.term()
    for k, v in res.items():
        print(
            f"{k:<7} receive loop: {statistics.median(v):.2f} us CPU per message (rounds: "
            + ", ".join(f"{x:.2f}" for x in v)
            + ")"
        )
    c = statistics.median(res["C"])
    print(f"ratio Python / C: {statistics.median(res['Python']) / c:.1f}x")
    print(f"ratio pyzmq / C: {statistics.median(res['pyzmq']) / c:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
