"""The simulated KV event publisher against vLLM's wire format: real sockets, real bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from sim.publisher import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventPublisher,
    decode_batch,
    decode_legacy_batch,
    encode_batch,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sim_vllm_frames.json"
TIMEOUT_MS = 10_000


def _stored(hashes: list[ExternalBlockHash], parent: int | None = None) -> BlockStored:
    tokens = list(range(4 * len(hashes)))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def _sub(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:  # type: ignore[type-arg]
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock  # type: ignore[no-any-return]


def _warm_up(pub: KVEventPublisher, sub: zmq.Socket) -> None:  # type: ignore[type-arg]
    """Beat the PUB slow-joiner: send probe batches until one arrives, then restart the seq space."""
    sub.setsockopt(zmq.RCVTIMEO, 50)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish_raw(b"probe")
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("subscriber never joined")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    pub.restart()


def _recv(sub: zmq.Socket) -> list[bytes]:  # type: ignore[type-arg]
    """Next live message, skipping warm-up probes still in flight."""
    while True:
        frames: list[bytes] = sub.recv_multipart()
        if frames[2] != b"probe":
            return frames


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:  # type: ignore[type-arg]
    """A DEALER client (a REQ client cannot read multi-message replies); returns frames after b""."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            out.append(frames[1:])
            if END_SEQ in frames[1:3]:
                return out
    finally:
        dealer.close(linger=0)


def test_captured_vllm_payloads_round_trip_byte_exact() -> None:
    frames = json.loads(FIXTURES.read_text())["frames"]
    assert len(frames) >= 8
    for frame in frames:
        payload = bytes.fromhex(frame["payload_hex"])
        batch = decode_batch(payload)
        assert encode_batch(batch.events, batch.ts, batch.data_parallel_rank) == payload, frame


def test_encoding_shapes() -> None:
    clear = encode_batch([AllBlocksCleared()], 1.0, None)
    assert clear.hex() == "93cb3ff0000000000000" + "9181a474797065b0416c6c426c6f636b73436c6561726564" + "c0"
    big = 2**64 - 1
    raw = msgspec.msgpack.decode(encode_batch([_stored([big, 7]), BlockRemoved([big], "GPU")], 2.5, 3))
    assert raw[0] == 2.5 and raw[2] == 3
    first = raw[1][0]
    assert next(iter(first)) == "type" and first["type"] == "BlockStored"
    assert first["block_hashes"] == [big, 7] and first["parent_block_hash"] is None
    assert "kv_cache_spec_sliding_window" not in first  # defaults omitted, required None kept
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [big], "medium": "GPU"}
    arr = msgspec.msgpack.decode(
        encode_batch([_stored([1]), BlockRemoved([1], "GPU"), AllBlocksCleared()], 1.0, 0, "array")
    )
    assert arr[1][0][:4] == ["BlockStored", [1], None, [0, 1, 2, 3]]
    assert arr[1][1][:3] == ["BlockRemoved", [1], "GPU"]
    assert arr[1][2] == ["AllBlocksCleared"]
    legacy = decode_legacy_batch(encode_batch([_stored([1])], 1.0, 0, "array"))
    assert legacy.events[0].block_hashes == [1]  # type: ignore[union-attr]


def test_bytes_hashes_encode_as_bin() -> None:
    event = _stored([1])
    event.block_hashes = [b"\x01" * 32]
    raw = msgspec.msgpack.decode(encode_batch([event], 1.0, 0))
    assert raw[1][0]["block_hashes"] == [b"\x01" * 32]


def test_live_frames_seq_and_topic(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    with KVEventPublisher(topic="kv", dp_rank=2, ctx=ctx) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        sub = _sub(ctx, pub.endpoint)
        try:
            _warm_up(pub, sub)
            assert pub.publish([_stored([11, 12])], ts=5.0) == 0
            assert pub.publish([BlockRemoved([11], "GPU")]) == 1
            f0, f1 = _recv(sub), _recv(sub)
            assert f0[0] == b"kv" and f0[1] == (0).to_bytes(8, "big")
            assert f1[1] == (1).to_bytes(8, "big")
            b0 = decode_batch(f0[2])
            assert b0.ts == 5.0 and b0.data_parallel_rank == 2
            assert b0.events == [_stored([11, 12])]
            assert decode_batch(f1[2]).events == [BlockRemoved([11], "GPU")]
        finally:
            sub.close(linger=0)


def test_connect_mode_subscriber_binds(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with KVEventPublisher(endpoint=endpoint, replay_endpoint=None, bind=False, ctx=ctx) as pub:
            assert pub.endpoint == endpoint and pub.replay_endpoint is None
            _warm_up(pub, sub)
            pub.publish([AllBlocksCleared()])
            frames = _recv(sub)
            assert frames[1] == bytes(8) and decode_batch(frames[2]).events == [AllBlocksCleared()]
    finally:
        sub.close(linger=0)


@pytest.mark.parametrize("shape", [3, 2])
def test_replay_and_drop(ctx: zmq.Context, shape: int) -> None:  # type: ignore[type-arg]
    with KVEventPublisher(topic="t", ctx=ctx, replay_frames=shape) as pub:  # type: ignore[arg-type]
        assert pub.replay_endpoint is not None
        sub = _sub(ctx, pub.endpoint)
        try:
            _warm_up(pub, sub)
            pub.publish([_stored([1])])  # seq 0, live
            pub.drop_next(2)
            pub.publish([_stored([2], 1)])  # seq 1, lost
            pub.publish_raw(b"\xc1 not msgpack")  # seq 2, lost
            pub.publish([_stored([3], 2)])  # seq 3, live
            seqs = [int.from_bytes(_recv(sub)[1], "big") for _ in range(2)]
            assert seqs == [0, 3]
            replies = _replay(ctx, pub.replay_endpoint, 1)
        finally:
            sub.close(linger=0)
    if shape == 3:
        assert [r[0] for r in replies] == [b"t"] * 3 + [b""]
        replies = [r[1:] for r in replies]
    assert [int.from_bytes(r[0], "big") for r in replies[:-1]] == [1, 2, 3]
    assert decode_batch(replies[0][1]).events == [_stored([2], 1)]
    assert replies[1][1] == b"\xc1 not msgpack"
    assert replies[-1] == [END_SEQ, b""]


def test_replay_edge_cases_and_restart(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    with KVEventPublisher(ctx=ctx, buffer_steps=3) as pub:
        assert pub.replay_endpoint is not None
        for i in range(5):
            pub.publish([_stored([i])])
        # older than the buffer: whatever is left (seq 2..4)
        replies = _replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(r[1], "big") for r in replies] == [2, 3, 4, 2**64 - 1]
        # newer than everything: only the end marker
        assert _replay(ctx, pub.replay_endpoint, 99) == [[b"", END_SEQ, b""]]
        # an invalid request is ignored and the server keeps serving
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart([b"", b"short"])
        bad.send_multipart([b"", b"x", b"y"])
        bad.setsockopt(zmq.RCVTIMEO, 200)
        with pytest.raises(zmq.Again):
            bad.recv_multipart()
        bad.close(linger=0)
        pub.restart()
        assert pub.next_seq == 0
        assert _replay(ctx, pub.replay_endpoint, 0) == [[b"", END_SEQ, b""]]
        assert pub.publish([AllBlocksCleared()]) == 0
        assert [int.from_bytes(r[1], "big") for r in _replay(ctx, pub.replay_endpoint, 0)] == [0, 2**64 - 1]
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])


def test_own_context_closes_cleanly() -> None:
    pub = KVEventPublisher()
    pub.publish([AllBlocksCleared()])
    pub.close()
    pub.close()  # idempotent
