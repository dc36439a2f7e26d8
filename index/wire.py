"""vLLM KV event wire format: the one adapter that knows its quirks.

A live message is three ZMQ frames ``[topic, seq (u64 big-endian), payload]``; the payload is a
msgpack array ``[ts, events, data_parallel_rank?]``. Events are maps tagged by ``"type"`` from vLLM
0.24 on, and tagged arrays ``["BlockStored", field, ...]`` up to 0.23. Block hashes are unsigned
64-bit ints by default or raw digest bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

Decoding (the Python path; the ingest hands most payloads to the C core instead, see
:mod:`index.ingest`) tries the typed decoders (map shape, then the legacy array shape), and only
then a tolerant positional parse of the untyped value, which accepts unknown trailing fields and
items.
Everything downstream sees one normalised shape: :class:`Batch` holding :class:`BlockStored`,
:class:`BlockRemoved` and :class:`AllBlocksCleared` with int hashes and a non-empty ``medium``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
"""Seq of the replay end marker (``-1`` as a signed 64-bit big-endian int)."""

MEDIUM_GPU = "GPU"

_U64 = (1 << 64) - 1


class WireError(ValueError):
    """A frame or payload that does not follow the format; the caller counts it and skips it."""


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """Blocks newly cached by a source; ``token_ids`` holds all their tokens, concatenated.

    ``token_ids`` is a list (or an :class:`index.rawtokens.TokenIds` built by tools).
    """

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: Any = None
    """The KV cache group's kind (``full_attention``, ``sliding_window``, ``mamba``...): any value is
    decoded, the ingest judges it (a malformed one makes that engine's matches conservative)."""
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    """``LOCAL`` or ``REMOTE`` (an offloading tier on another host, vLLM >= 0.28)."""


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """Blocks evicted from one medium of a source."""

    block_hashes: list[int | bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: Any = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """The source's GPU prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, gc=False):
    """One scheduler step's events, as published (``seq`` is filled from frame 1)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    seq: int = -1


# Legacy (vLLM <= 0.23) shape: events are arrays whose first item is the tag.
class _LegacyStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None


class _LegacyRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


class _LegacyCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyStored | _LegacyRemoved | _LegacyCleared]
    data_parallel_rank: int | None = None


_map_decoder = msgspec.msgpack.Decoder(Batch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)
_any_decoder = msgspec.msgpack.Decoder()


def hash_to_int(value: int | bytes) -> int:
    """An engine block hash as an unsigned 64-bit int (bytes: the last 8, big-endian, as vLLM does)."""
    if type(value) is int:
        if value < 0 or value > _U64:
            raise WireError(f"block hash {value} is outside the unsigned 64-bit range")
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise WireError("empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise WireError(f"block hash of type {type(value).__name__}")


def _int_hashes(hashes: list[int | bytes]) -> list[int | bytes]:
    """The list itself when it already holds unsigned ints (the common case), else a converted copy.

    ``min`` checks the common case in one C loop (a Python loop over the hashes cost ~30 ns each): it
    returns a non-negative int only when every item is an int and none is negative, and raises for a
    mix of ints and bytes or an empty list.
    """
    try:
        low = min(hashes)
    except (TypeError, ValueError):
        low = None
    if type(low) is int and low >= 0:
        return hashes
    return [hash_to_int(x) for x in hashes]


def _check_ts(ts: float) -> None:
    """A batch timestamp must be finite: the subscriber tells restarts from duplicates by comparing
    them (a NaN would make every later duplicate a restart, an infinity hide every restart)."""
    if not math.isfinite(ts):
        raise WireError(f"batch timestamp {ts} is not finite")


def _normalise(batch: Batch) -> Batch:
    """Int hashes and a medium on every event; raises WireError on values we cannot index."""
    _check_ts(batch.ts)
    for ev in batch.events:
        if type(ev) is BlockStored:
            ev.block_hashes = _int_hashes(ev.block_hashes)
            parent = ev.parent_block_hash
            if parent is not None and (type(parent) is not int or parent < 0):
                ev.parent_block_hash = hash_to_int(parent)
            if ev.medium is None:
                ev.medium = MEDIUM_GPU
            if ev.block_size < 0:
                raise WireError(f"negative block_size {ev.block_size}")
        elif type(ev) is BlockRemoved:
            ev.block_hashes = _int_hashes(ev.block_hashes)
            if ev.medium is None:
                ev.medium = MEDIUM_GPU
    return batch


def _from_legacy(old: _LegacyBatch) -> Batch:
    events: list[Event] = []
    for ev in old.events:
        if type(ev) is _LegacyStored:
            events.append(
                BlockStored(
                    ev.block_hashes,
                    ev.parent_block_hash,
                    ev.token_ids,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    ev.extra_keys,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                    ev.kv_cache_spec_sliding_window,
                )
            )
        elif type(ev) is _LegacyRemoved:
            events.append(BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx))
        else:
            events.append(AllBlocksCleared())
    return Batch(old.ts, events, old.data_parallel_rank)


# Field order of each event in the positional (array) shape, after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _as_fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return {n: raw[n] for n in names if n in raw}
    # positional: drop the tag, keep known positions, ignore unknown trailing items
    return dict(zip(names, raw[1:], strict=False))


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int for v in value):
        raise WireError(f"{what} must be a list of ints")
    return value


def _tolerant_event(raw: Any) -> Event | None:
    """Positional or map event from an untyped decode; None for an unknown event type."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise WireError(f"event is a {type(raw).__name__}, not a map or an array")
    if tag == "BlockStored":
        f = _as_fields(raw, _STORED_FIELDS)
        for required in _STORED_FIELDS[:4]:
            if required not in f:
                raise WireError(f"BlockStored without {required}")
        hashes = f["block_hashes"]
        if not isinstance(hashes, list):
            raise WireError("block_hashes must be a list")
        size = f["block_size"]
        if type(size) is not int:
            raise WireError("block_size must be an int")
        parent = f["parent_block_hash"]
        medium = f.get("medium")
        lora_name = f.get("lora_name")
        lora_id = f.get("lora_id")
        group = f.get("group_idx")
        extra = f.get("extra_keys")
        return BlockStored(
            [hash_to_int(h) for h in hashes],
            None if parent is None else hash_to_int(parent),
            _int_list(f["token_ids"], "token_ids"),
            size,
            lora_id if type(lora_id) is int else None,
            medium if isinstance(medium, str) else MEDIUM_GPU,
            lora_name if isinstance(lora_name, str) else None,
            extra if isinstance(extra, list) else None,
            group if type(group) is int else None,
            f.get("kv_cache_spec_kind"),
            f.get("kv_cache_spec_sliding_window"),
            raw.get("locality") if isinstance(raw, dict) else None,
        )
    if tag == "BlockRemoved":
        f = _as_fields(raw, _REMOVED_FIELDS)
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise WireError("BlockRemoved without a block_hashes list")
        medium = f.get("medium")
        group = f.get("group_idx")
        return BlockRemoved(
            [hash_to_int(h) for h in hashes],
            medium if isinstance(medium, str) else MEDIUM_GPU,
            group if type(group) is int else None,
            raw.get("locality") if isinstance(raw, dict) else None,
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _tolerant_batch(payload: bytes) -> Batch:
    try:
        raw = _any_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError("payload is not an array [ts, events, rank?]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError("ts is not a number")
    if not isinstance(events, list):
        raise WireError("events is not an array")
    _check_ts(float(ts))
    rank = raw[2] if len(raw) > 2 and type(raw[2]) is int else None
    out: list[Event] = []
    for ev in events:
        decoded = _tolerant_event(ev)
        if decoded is not None:
            out.append(decoded)
    return Batch(float(ts), out, rank)


def decode_payload(payload: bytes, *, compiled: bool = True) -> Batch:
    """Decode one batch payload of any vLLM version since 0.9; raises :class:`WireError`.

    ``compiled`` is accepted for compatibility; every ``token_ids`` is a list.
    """
    # (invalid UTF-8 in a string raises UnicodeDecodeError, a ValueError, from msgspec; a payload
    # nested ~1,000 deep, about 1 KB, raises RecursionError: a bad message, like the others)
    try:
        return _normalise(_map_decoder.decode(payload))
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    try:
        return _normalise(_from_legacy(_legacy_decoder.decode(payload)))
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    try:
        return _tolerant_batch(payload)
    except RecursionError:
        raise WireError("payload is nested too deeply") from None


class RawBatch:
    """A live or replayed payload not decoded yet: its seq, its batch timestamp, the bytes.

    The subscriber's sequence bookkeeping needs only these two numbers; the payload itself is
    decoded and applied by the C core (:meth:`index.ingest.Ingestor.apply_chunk`).
    """

    __slots__ = ("payload", "seq", "ts")

    def __init__(self, payload: bytes, seq: int, ts: float) -> None:
        self.payload = payload
        self.seq = seq
        self.ts = ts


_TS = struct.Struct(">d")


def peek_message(payload: bytes, seq: int) -> RawBatch | Batch:
    """A payload as a :class:`RawBatch` when its timestamp can be read in place (vLLM's layout: a
    short array whose first item is a float64), else decoded now (:func:`decode_payload`; raises
    :class:`WireError`), with ``seq`` set either way."""
    if len(payload) >= 10 and 0x92 <= payload[0] <= 0x9F and payload[1] == 0xCB:
        ts = _TS.unpack_from(payload, 2)[0]
        _check_ts(ts)
        return RawBatch(payload, seq, ts)
    batch = decode_payload(payload)
    batch.seq = seq
    return batch


def decode_seq(frame: bytes) -> int:
    """Frame 1: the batch sequence number, an unsigned 64-bit big-endian int."""
    if len(frame) != 8:
        raise WireError(f"seq frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> tuple[bytes, Batch]:
    """A live message ``[topic, seq, payload]`` -> (topic, batch with ``seq`` set)."""
    if len(frames) != 3:
        raise WireError(f"message has {len(frames)} frames, expected 3 [topic, seq, payload]")
    topic, seq_frame, payload = frames
    batch = decode_payload(payload)
    batch.seq = decode_seq(seq_frame)
    return topic, batch


def split_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A DEALER-side replay reply -> (seq, payload).

    vLLM >= 0.26 sends ``[b"", topic, seq, payload]``; older versions ``[b"", seq, payload]``.
    The end marker has seq :data:`END_SEQ` and an empty payload.
    """
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 3:
        _, seq_frame, payload = parts
    elif len(parts) == 2:
        seq_frame, payload = parts
    else:
        raise WireError(f"replay reply has {len(frames)} frames")
    return decode_seq(seq_frame), payload
