"""Many synthetic vLLM event publishers in one process: a fleet's worth of sources for scale tests.

One :class:`sim.publisher.KVEventPublisher` per source costs a replay thread each, so thousands of
them do not fit on a small machine. Here every source is an XPUB socket (a PUB that also reports
its subscriptions) and, for a share of them, a replay ROUTER, all served by one thread: a source
publishes its first batch as soon as a subscription reaches it (so nothing is lost to the slow
joiner), and a source with replay buffers a batch before that, which only a bootstrap replay can
bring. Messages are vLLM's wire format (``[topic, seq, payload]``, msgpack map events).

Run as ``python -m sim.many --sources N --replay-every K`` (a helper subprocess): it prints one
JSON line ``{"sources": [[endpoint, replay endpoint or null], ...]}``, then reads commands on
stdin, one a line, answering each with a JSON line:

- ``subscribed`` -> ``{"subscribed": n}``: sources whose subscription arrived;
- ``steady <batches/s> <active sources> <blocks/batch> <seconds>`` -> ``{"batches": n, "blocks": m}``:
  publish at that rate, round-robin over the first ``active`` sources (the rest stay idle);
- ``quit`` (or end of input): close everything and exit.

``--pub-port P --replay-port R`` bind source n at consecutive ports (P + n, R + n), as the ranks of
a data-parallel engine are (a router config names rank 0's port). Source ``i``'s first blocks are
:func:`first_blocks` (the same function tells a test what to look up).
"""

from __future__ import annotations

import argparse
import json
import queue
import resource
import sys
import threading
import time
from typing import Any

import zmq

from sim.publisher import END_SEQ, BlockStored, encode_batch

BLOCK_SIZE = 16
TOKENS_PER_SOURCE = 1 << 20
"""Token id space per source (its blocks never collide with another source's)."""


def first_blocks(i: int, blocks: int = 2) -> list[int]:
    """The tokens of source ``i``'s first ``blocks`` blocks (unique to it)."""
    base = 1000 + (i % 4000) * 256 + (i // 4000) * TOKENS_PER_SOURCE
    return [base + k for k in range(blocks * BLOCK_SIZE)]


def _stored(i: int, first: int, count: int, tokens: list[int], parent: int | bytes | None) -> BlockStored:
    hashes: list[int | bytes] = [i * 1_000_003 + first + k + 1 for k in range(count)]
    return BlockStored(hashes, parent, tokens, BLOCK_SIZE, None, "GPU", None)


class _Source:
    __slots__ = ("blocks", "buffer", "i", "last_hash", "pub", "router", "seq", "subscribed")

    def __init__(self, i: int, pub: Any, router: Any) -> None:
        self.i = i
        self.pub = pub
        self.router = router
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.subscribed = False
        self.blocks = 0
        self.last_hash: int | bytes | None = None

    def batch(self, count: int, tokens: list[int] | None = None) -> bytes:
        if tokens is None:
            tokens = [(self.i * 7919 + self.blocks * 31 + k) % 50_000 for k in range(count * BLOCK_SIZE)]
        ev = _stored(self.i, self.blocks, count, tokens, self.last_hash)
        self.blocks += count
        self.last_hash = ev.block_hashes[-1]
        payload = encode_batch([ev], time.time(), 0)
        seq = self.seq
        self.seq += 1
        if self.router is not None:
            self.buffer.append((seq, payload))
            del self.buffer[:-64]  # (a bounded replay buffer, as vLLM's buffer_steps)
        return payload

    def send(self, payload: bytes) -> None:
        self.pub.send_multipart([b"", (self.seq - 1).to_bytes(8, "big"), payload])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sources", type=int, required=True)
    ap.add_argument("--first", type=int, default=0, help="index of the first source (several helpers)")
    ap.add_argument("--replay-every", type=int, default=1, help="every k-th source has replay (0: none)")
    ap.add_argument("--pub-port", type=int, default=0, help="bind source n's PUB at this port + n (0: any)")
    ap.add_argument("--replay-port", type=int, default=0, help="and its replay ROUTER at this port + n")
    args = ap.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, min(ctx.get(zmq.SOCKET_LIMIT), 3 * args.sources + 16))
    sources: list[_Source] = []
    for n in range(args.sources):
        i = args.first + n
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(f"tcp://127.0.0.1:{args.pub_port + n if args.pub_port else 0}")
        router = None
        if args.replay_every and i % args.replay_every == 0:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(f"tcp://127.0.0.1:{args.replay_port + n if args.replay_port else 0}")
        src = _Source(i, pub, router)
        tokens = first_blocks(i)
        if router is not None:  # the first block before anyone listens: only a bootstrap brings it
            src.batch(1, tokens[:BLOCK_SIZE])
        sources.append(src)
    print(
        json.dumps(
            {
                "sources": [
                    [
                        s.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                        s.router.getsockopt_string(zmq.LAST_ENDPOINT) if s.router is not None else None,
                    ]
                    for s in sources
                ]
            }
        ),
        flush=True,
    )
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("quit")

    threading.Thread(target=read, daemon=True).start()
    poller = zmq.Poller()
    by_sock: dict[Any, tuple[str, _Source]] = {}
    for s in sources:
        poller.register(s.pub, zmq.POLLIN)
        by_sock[s.pub] = ("pub", s)
        if s.router is not None:
            poller.register(s.router, zmq.POLLIN)
            by_sock[s.router] = ("router", s)
    steady: tuple[float, int, int, float] | None = None
    sent = blocks_sent = 0
    next_at = 0.0
    rr = 0
    try:
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                cmd = ""
            if cmd == "quit":
                return 0
            if cmd == "subscribed":
                print(json.dumps({"subscribed": sum(s.subscribed for s in sources)}), flush=True)
            elif cmd.startswith("steady"):
                words = cmd.split()
                steady = (float(words[1]), int(words[2]), int(words[3]), time.monotonic() + float(words[4]))
                sent = blocks_sent = 0
                next_at = time.monotonic()
            timeout = 50
            if steady is not None:
                rate, active, per, until = steady
                now = time.monotonic()
                while next_at <= now and now < until:
                    s = sources[rr % max(1, min(active, len(sources)))]
                    rr += 1
                    s.send(s.batch(per))
                    sent += 1
                    blocks_sent += per
                    next_at += 1.0 / rate
                if now >= until:
                    print(json.dumps({"batches": sent, "blocks": blocks_sent}), flush=True)
                    steady = None
                else:
                    timeout = max(0, int((next_at - now) * 1000))
            for sock, _ in poller.poll(timeout):
                kind, s = by_sock[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if kind == "pub":
                        if frames and frames[0][:1] == b"\x01" and not s.subscribed:
                            s.subscribed = True
                            tokens = first_blocks(s.i)
                            if s.router is not None:  # its second block, live
                                s.send(s.batch(1, tokens[BLOCK_SIZE:]))
                            else:
                                s.send(s.batch(2, tokens))
                    elif len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
                        start = int.from_bytes(frames[2], "big")
                        for seq, payload in s.buffer:
                            if seq >= start:
                                sock.send_multipart([frames[0], b"", b"", seq.to_bytes(8, "big"), payload])
                        sock.send_multipart([frames[0], b"", b"", END_SEQ, b""])
    finally:
        for s in sources:
            s.pub.close(0)
            if s.router is not None:
                s.router.close(0)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
