"""The C receive loop (index/_kvrecv.h) against the Python one, over real ZeroMQ sockets.

The C loop takes only the common message and hands every other one back whole, so both loops must
leave the same per-source state and the same index after any stream: this sends one stream holding
every odd case the subscriber knows (duplicates, a foreign topic, malformed frames, a non-finite
timestamp, undecodable payloads, a gap, a restart, both payload layouts) through each and compares.
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import zmq
from harness import TIMEOUT, wait_for

from index.kvindex import IndexConfig, KVIndex
from index.subscriber import SourceConfig, SubscriberConfig
from index.zsock import native_receive
from sim.publisher import BlockStored, encode_batch

BS = 4
TOPIC = b"kv"


def stored(first: int, n: int, parent: int | None) -> BlockStored:
    toks = list(range(first * BS, (first + n) * BS))
    return BlockStored([1000 + first + i for i in range(n)], parent, toks, BS, None, "GPU", None)


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def stream() -> list[list[bytes]]:
    """One source's messages, in order; the expected outcome is in the test."""
    ts = 1000.0
    a = encode_batch([stored(0, 2, None)], ts, None, "map")
    b = encode_batch([stored(2, 2, 1001)], ts + 1, None, "array")
    good = encode_batch([stored(4, 1, 1003)], ts + 2, None, "map")
    return [
        [TOPIC, seq(0), a],
        [TOPIC, seq(1), b],
        [TOPIC, seq(1), b],  # the same batch again: a duplicate
        [TOPIC + b"x", seq(2), good],  # passes the prefix filter, not the topic
        [TOPIC, seq(2)],  # two frames
        [TOPIC, seq(2), good, b"extra"],  # four frames
        [TOPIC, b"\x00" * 7, good],  # a short seq frame
        [TOPIC, seq(2), encode_batch([], float("nan"), None, "map")],  # readable seq: advances
        [TOPIC, seq(3), b"\xc0"],  # not a batch: advances too
        [TOPIC, seq(4), msgspec.msgpack.encode({"ts": ts + 3, "events": []})],  # not vLLM's layout
        [TOPIC, seq(6), good],  # seq 5 never came: lost (no replay endpoint)
        [TOPIC, seq(7), encode_batch([stored(5, 1, 1004)], ts + 4, None, "map")],
        [TOPIC, seq(0), encode_batch([stored(100, 3, None)], ts + 10, None, "map")],  # restarted
        [TOPIC, seq(1), encode_batch([stored(103, 1, 1102)], ts + 11, None, "array")],
    ]


def random_stream(seed: int, n: int = 400) -> list[list[bytes]]:
    """Mostly well-formed messages with seqs that step, repeat, jump and go back, among odd ones."""
    rng = random.Random(seed)
    out: list[list[bytes]] = []
    s, ts = 0, 1000.0
    for block in range(n):
        r = rng.random()
        ts += 1
        if r < 0.70:
            s += 1
        elif r < 0.78:
            s += rng.randint(2, 4)  # a gap
        elif r < 0.84:
            s = max(0, s - rng.randint(0, 3))  # a duplicate (ts re-used below) or a restart
        payload = encode_batch(
            [stored(block, 1, None)],
            ts if r >= 0.80 or r < 0.78 else ts - 5,
            None,
            rng.choice(["map", "array"]),
        )
        frames = [TOPIC, seq(s), payload]
        k = rng.random()
        if k < 0.03:
            frames = frames[: rng.randint(1, 2)]
        elif k < 0.05:
            frames = [*frames, b"x"]
        elif k < 0.07:
            frames[0] = TOPIC + b"!"
        elif k < 0.09:
            frames[2] = payload[: rng.randint(0, len(payload))]
        elif k < 0.10:
            frames[1] = frames[1][:7]
        out.append(frames)
    # the end marker: a restart to seq 0 and one more message, as in stream()
    out.append([TOPIC, seq(0), encode_batch([stored(100_000, 3, None)], ts + 10, None, "map")])
    out.append([TOPIC, seq(1), encode_batch([stored(100_003, 1, 1000 + 100_002)], ts + 11, None, "map")])
    return out


def xpub(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], str]:
    """A publisher on an ephemeral port: XPUB, so the subscription's arrival is a message and
    nothing is sent before it (a PUB drops what it sends until then)."""
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:0")
    return pub, pub.getsockopt_string(zmq.LAST_ENDPOINT)


def subscription(pub: zmq.Socket[Any]) -> bytes:
    """Wait for the subscriber's subscription message."""
    assert pub.poll(int(TIMEOUT * 1000)), "no subscription arrived"
    return pub.recv()


def run_stream(
    ctx: zmq.Context[Any], native: bool, messages: list[list[bytes]] | None = None
) -> tuple[dict[str, Any], dict[str, set[bytes]], bool]:
    pub, endpoint = xpub(ctx)
    cfg = IndexConfig(block_size=BS, subscriber=SubscriberConfig(native_receive=native))
    idx = KVIndex(cfg, ctx=ctx)
    try:
        idx.add_source(SourceConfig("e", 0, endpoint, None, topic=TOPIC.decode()))
        idx.start()
        assert subscription(pub) == b"\x01" + TOPIC
        for frames in messages or stream():
            pub.send_multipart(frames)
        # every stream ends with a restart to seq 0 and seq 1, whose chain is unique: once it is
        # matchable, everything before it was applied
        end = list(range(100 * BS, 104 * BS)) if messages is None else list(range(100_000 * BS, 100_004 * BS))
        wait_for(
            lambda: idx.match(end, [("e", 0)]).matches[("e", 0)].blocks == 4,
            "the whole stream applied",
        )
        st = msgspec.to_builtins(next(s for s in idx.status() if s.source == "e/dp0"))
        st.pop("last_event_age_s")
        st.pop("endpoint")  # (an ephemeral port of its own)
        keys = {m: set(ks) for m, ks in idx.source_keys(("e", 0)).items()}
        return st, keys, idx.subscriber._native
    finally:
        idx.stop()
        pub.close(0)


def test_the_c_loop_is_bound_where_ci_runs() -> None:
    """On Linux with pyzmq's wheels (CI), the C loop must be in use; otherwise the comparison below
    would compare the Python loop with itself."""
    assert native_receive()


def test_c_and_python_receive_loops_agree_on_every_odd_case(ctx: zmq.Context[Any]) -> None:
    native, native_keys, was_native = run_stream(ctx, native=True)
    python, python_keys, was_python = run_stream(ctx, native=False)
    assert was_native and not was_python
    assert native == python
    assert native_keys == python_keys
    # and what both say is what the stream holds
    assert native["duplicates"] == 1
    assert native["foreign_topic"] == 1
    assert native["decode_errors"] == 6
    assert native["lost_batches"] == 1 and native["gaps"] == 1
    assert native["restarts"] == 1 and native["last_seq"] == 1
    assert native["blocks"] == {"GPU": 4}  # the restart dropped the first five blocks


@pytest.mark.parametrize("native", [True, False])
def test_a_long_stream_of_common_messages(ctx: zmq.Context[Any], native: bool) -> None:
    """Thousands of messages, more than one receive budget (max_chunk): every block indexed, no
    gap, whichever loop receives them."""
    pub, endpoint = xpub(ctx)
    cfg = IndexConfig(block_size=BS, subscriber=SubscriberConfig(native_receive=native, max_chunk=64))
    idx = KVIndex(cfg, ctx=ctx)
    n = 3000
    try:
        idx.add_source(SourceConfig("e", 0, endpoint, None))
        idx.start()
        subscription(pub)
        t0 = time.time()
        for i in range(n):
            parent = None if i == 0 else 1000 + i - 1
            pub.send_multipart([b"", seq(i), encode_batch([stored(i, 1, parent)], t0 + i, None, "map")])
        wait_for(
            lambda: idx.status()[0].last_seq == n - 1 and idx.status()[0].blocks.get("GPU") == n, "all in"
        )
        st = idx.status()[0]
        assert (st.gaps, st.lost_batches, st.decode_errors, st.batches) == (0, 0, 0, n)
        assert idx.match(list(range(n * BS)), [("e", 0)]).matches[("e", 0)].blocks == n
    finally:
        idx.stop()
        pub.close(0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_c_and_python_receive_loops_agree_on_random_streams(ctx: zmq.Context[Any], seed: int) -> None:
    messages = random_stream(seed)
    native, native_keys, _ = run_stream(ctx, True, messages)
    python, python_keys, _ = run_stream(ctx, False, messages)
    assert native == python
    assert native_keys == python_keys
    assert native["decode_errors"] > 0 and native["gaps"] > 0 and native["restarts"] > 0  # it did vary
