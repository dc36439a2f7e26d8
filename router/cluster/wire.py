"""What replicas say to each other: one msgpack message shape, versioned, over one pub/sub channel.

A message carries the sender's own figures only, never anyone else's, and absolute values, never
deltas: a lost or duplicated message is repaired by the next one, and the heartbeat (``full``)
re-sends the whole table, so nothing depends on Redis pub/sub's at-most-once delivery. Times are
durations (``ttl_ms``), never timestamps: receivers never compare another host's clock with theirs.
"""

from __future__ import annotations

import array
import sys
from _blake2 import blake2b  # (hashlib's blake2b, without loading OpenSSL's hashes at start-up)
from collections.abc import Sequence

import msgspec

VERSION = 1
"""Bumped when the message shape or the block-key function changes; other versions are ignored
(a rolling upgrade then shares nothing between old and new replicas until it completes)."""


class LoadRow(msgspec.Struct, array_like=True, frozen=True):
    """The sender's in-flight figures for one (backend, DP rank)."""

    backend: str
    rank: int
    active: int
    prefilling: int
    pending_tokens: int


class Prediction(msgspec.Struct, array_like=True, frozen=True):
    """Predicted residencies: blocks a decision just sent to (backend, rank), valid ``ttl_ms`` more."""

    backend: str
    rank: int
    block_size: int
    ttl_ms: int
    keys: bytes
    """Block keys as little-endian unsigned 64-bit integers, in prompt order."""


class Pin(msgspec.Struct, array_like=True, frozen=True):
    """A conversation pinned to (backend, rank) for ``ttl_ms`` more."""

    session: int
    backend: str
    rank: int
    ttl_ms: int


class Message(msgspec.Struct, array_like=True, kw_only=True):
    """Everything one replica sends in one publish interval."""

    version: int = VERSION
    replica: str
    """Random id of the sending process, new at every start."""
    seq: int
    """Per sender, +1 per message: receivers count the messages they missed."""
    full: bool = False
    """``loads`` is the sender's whole table (targets not listed are idle), not only what changed."""
    name: str = ""
    """The sender's display name (sent with full messages)."""
    group: str = ""
    """Worker processes of one ``kvrouter serve`` share a group: their load reaches each other through
    the local load board already, so receivers of the same group skip it."""
    loads: list[LoadRow] = []
    predictions: list[Prediction] = []
    pins: list[Pin] = []
    bye: bool = False
    """The sender is shutting down: drop what it contributed now."""


class Head(msgspec.Struct, array_like=True, kw_only=True):
    """A :class:`Message` with its loads and predictions left undecoded (``msgspec.Raw``;
    :func:`loads_of` and :func:`predictions_of` decode them). A replica hears every message it
    sends (Redis pub/sub delivers to every subscriber) and needs back only the sequence number and
    the pins: that half of what it reads costs a quarter of a whole decode of a typical message."""

    version: int = VERSION
    replica: str
    seq: int
    full: bool = False
    name: str = ""
    group: str = ""
    loads: msgspec.Raw = msgspec.Raw(b"\x90")
    predictions: msgspec.Raw = msgspec.Raw(b"\x90")
    pins: list[Pin] = []
    bye: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_head_decoder = msgspec.msgpack.Decoder(Head)
_loads_decoder = msgspec.msgpack.Decoder(list[LoadRow])
_predictions_decoder = msgspec.msgpack.Decoder(list[Prediction])


def encode(msg: Message) -> bytes:
    """msgpack bytes of a message."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """A message from msgpack bytes; raises ``msgspec.DecodeError`` / ``ValidationError`` when malformed."""
    return _decoder.decode(data)


def decode_head(data: bytes) -> Head:
    """A message as :class:`Head` reads it (extra trailing fields of a later shape are ignored);
    raises like :func:`decode`."""
    return _head_decoder.decode(data)


def loads_of(head: Head) -> list[LoadRow]:
    """A head's load rows; raises like :func:`decode`."""
    return _loads_decoder.decode(head.loads)


def predictions_of(head: Head) -> list[Prediction]:
    """A head's predictions; raises like :func:`decode`."""
    return _predictions_decoder.decode(head.predictions)


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as little-endian u64 bytes (8 bytes a key)."""
    arr = array.array("Q", keys)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_keys(data: bytes) -> list[int]:
    """The inverse of :func:`pack_keys`; raises ValueError on a length that is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError("key bytes are not a multiple of 8")
    arr = array.array("Q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def session_id(value: bytes) -> int:
    """A fixed-size id of a session header's value: the same on every replica, and the value itself
    (which may identify a user) never reaches the store."""
    return int.from_bytes(blake2b(value, digest_size=8).digest(), "little")


__all__ = [
    "VERSION",
    "Head",
    "LoadRow",
    "Message",
    "Pin",
    "Prediction",
    "decode",
    "decode_head",
    "encode",
    "loads_of",
    "pack_keys",
    "predictions_of",
    "session_id",
    "unpack_keys",
]
