"""Decoding vLLM's KV event wire format: captured frames, both event shapes, and bad input."""

from __future__ import annotations

import json

import msgspec
import pytest
from vllm_vectors import SHARED_VECTORS, load, scenarios, shared_vectors_or_skip

from index.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_message,
    decode_payload,
    split_replay_reply,
)


@pytest.mark.parametrize("name", scenarios())
def test_every_fixture_frame_decodes(name: str) -> None:
    capture = load(name)
    for rank, data in capture["ranks"].items():
        for frame in data["frames"]:
            frames = [bytes.fromhex(x) for x in frame["frames_hex"]]
            if frame["via"] == "pub":
                topic, batch = decode_message(frames)
                assert topic == capture["topic"].encode()
                assert batch.data_parallel_rank == int(rank)
                assert batch.seq >= 0
            else:
                seq, payload = split_replay_reply(frames)
                if seq != END_SEQ:
                    assert decode_payload(payload).events


def test_every_shared_capture_decodes_like_vllm_decoded_it() -> None:
    """All of ../shared/data/vllm-vectors: our decode equals the decoded batch recorded at capture time."""
    root = shared_vectors_or_skip()
    if root is None:
        pytest.skip(f"{SHARED_VECTORS} is absent (fresh clone without ../shared)")
    checked = 0
    for path in sorted(root.glob("*.json")):
        capture = json.loads(path.read_text())
        for rank in capture["ranks"].values():
            for c in rank["captured"] + rank.get("replayed", []):
                if "frames_hex" not in c or c.get("via") != "pub":
                    continue
                _, batch = decode_message([bytes.fromhex(x) for x in c["frames_hex"]])
                expected = c["decoded"]["events"]
                assert len(batch.events) == len(expected)
                for ours, theirs in zip(batch.events, expected, strict=True):
                    assert type(ours).__name__ == theirs["type"]
                    if isinstance(ours, BlockStored):
                        assert ours.token_ids == theirs["token_ids"]
                        assert ours.block_size == theirs["block_size"]
                        assert ours.medium == (theirs["medium"] or "GPU")
                        assert ours.lora_name == theirs["lora_name"]
                        if all(isinstance(h, int) for h in theirs["block_hashes"]):
                            assert ours.block_hashes == theirs["block_hashes"]
                    elif isinstance(ours, BlockRemoved):
                        assert ours.medium == (theirs["medium"] or "GPU")
                checked += 1
    assert checked >= 40


def _batch(events: list[object], rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([1.5, events, rank])


STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 1, 2**63 + 5],
    "parent_block_hash": 7,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


def test_map_shape_with_unknown_fields_and_large_hashes() -> None:
    ev = dict(STORED_MAP, future_field={"x": 1}, group_idx=3, kv_cache_spec_kind="full_attention")
    batch = decode_payload(
        _batch([ev, {"type": "BlockRemoved", "block_hashes": [9], "medium": "CPU", "new": 1}])
    )
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [2**64 - 1, 2**63 + 5]
    assert stored.parent_block_hash == 7 and stored.group_idx == 3
    assert removed.medium == "CPU"


def test_legacy_tagged_arrays_with_and_without_trailing_items() -> None:
    short = ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None]  # vLLM 0.10: no medium
    long = ["BlockStored", [13], 12, [5, 6], 2, None, "CPU", "ad", None, 0, "full_attention", None, "x", "y"]
    removed = ["BlockRemoved", [11], "GPU", 0, "trailing"]
    batch = decode_payload(_batch([short, long, removed, ["AllBlocksCleared"]]))
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.medium == "GPU" and a.block_hashes == [11, 12]
    assert (
        isinstance(b, BlockStored) and b.medium == "CPU" and b.lora_name == "ad" and b.parent_block_hash == 12
    )
    assert isinstance(c, BlockRemoved) and c.block_hashes == [11]
    assert isinstance(d, AllBlocksCleared)


def test_legacy_two_element_batch_without_rank() -> None:
    batch = decode_payload(msgspec.msgpack.encode([2.0, [["AllBlocksCleared"]]]))
    assert batch.data_parallel_rank is None and isinstance(batch.events[0], AllBlocksCleared)


def test_bytes_hashes_become_their_low_64_bits() -> None:
    digest = bytes(range(32))
    ev = dict(STORED_MAP, block_hashes=[digest, digest[:16]], parent_block_hash=digest)
    stored = decode_payload(_batch([ev])).events[0]
    assert isinstance(stored, BlockStored)
    low = int.from_bytes(digest[-8:], "big")
    assert stored.block_hashes == [low, int.from_bytes(digest[8:16], "big")]
    assert stored.parent_block_hash == low


def test_unknown_event_types_are_skipped() -> None:
    batch = decode_payload(_batch([{"type": "BlockMoved", "x": 1}, STORED_MAP]))
    assert [type(e) for e in batch.events] == [BlockStored]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1not msgpack",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, "events"]),
        _batch([dict(STORED_MAP, token_ids="abc")]),
        _batch([dict(STORED_MAP, block_hashes=[-1])]),
        _batch([{"type": "BlockStored", "block_hashes": [1]}]),
        _batch([42]),
    ],
)
def test_malformed_payloads_raise_one_typed_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_payload(payload)


def test_message_framing() -> None:
    ok = _batch([STORED_MAP])
    topic, batch = decode_message([b"kv", (5).to_bytes(8, "big"), ok])
    assert topic == b"kv" and batch.seq == 5
    with pytest.raises(WireError):
        decode_message([b"kv", ok])
    with pytest.raises(WireError):
        decode_message([b"kv", b"\x00\x01", ok])


def test_replay_reply_shapes() -> None:
    seq8 = (3).to_bytes(8, "big")
    assert split_replay_reply([b"", b"topic", seq8, b"p"]) == (3, b"p")  # vLLM >= 0.26
    assert split_replay_reply([b"", seq8, b"p"]) == (3, b"p")  # older
    assert split_replay_reply([b"", b"", b"\xff" * 8, b""]) == (END_SEQ, b"")
    assert split_replay_reply([b"", b"\xff" * 8, b""]) == (END_SEQ, b"")
    with pytest.raises(WireError):
        split_replay_reply([b"", b"a", b"b", b"c", b"d"])
