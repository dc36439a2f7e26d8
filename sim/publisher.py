"""A KV event publisher that is byte-compatible with vLLM's ZMQ publisher.

Written from the wire spec (docs/vllm-kv-events.md), not from vLLM's code. The router must not be able
to tell this publisher from a real engine's, so it reproduces the frame layout, the per-publisher seq
counter, the replay ROUTER protocol (3-frame replies of vLLM >= 0.26 and the older 2-frame shape), the
tagged-map event encoding of vLLM >= 0.24 and the tagged-array encoding of vLLM <= 0.23. Two test hooks
simulate what goes wrong in production: `drop_next` (live loss that replay can repair) and `restart`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq

# vLLM's ExternalBlockHash: the low 64 bits of the digest as an unsigned int (default), or the raw digest.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
END_SEQ = b"\xff" * 8
"""Seq frame of the replay end marker: -1 as a signed 64-bit big-endian int."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; `tag=True` writes `"type": <class name>` first in each map (vLLM >= 0.24)."""


class BlockStored(KVCacheEvent):
    """Newly cached full blocks, in vLLM 0.33's field order; fields without a default are always sent."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from `medium`; no parent and no tokens on the wire."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole (GPU) prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One scheduler step's events: on the wire the 3-element array `[ts, events, dp_rank]`."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# ---- vLLM <= 0.23: the same events as tagged arrays `["BlockStored", f1, f2, ...]` ----------------------


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-shaped events of vLLM 0.20-0.23."""


class LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    """BlockStored as vLLM 0.20-0.23 declared it (fields up to `group_idx`)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    """BlockRemoved as vLLM 0.20-0.23 declared it."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    """AllBlocksCleared as a one-element tagged array."""


LegacyEvent = LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared


class LegacyKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch of vLLM 0.10-0.23 carrying array-shaped events."""

    ts: float
    events: list[LegacyEvent]
    data_parallel_rank: int | None = None


def to_legacy(event: Event) -> LegacyEvent:
    """Project a 0.33 event onto the 0.23 field set (newer fields did not exist then)."""
    if isinstance(event, BlockStored):
        return LegacyBlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return LegacyBlockRemoved(
            block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx
        )
    return LegacyAllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()
_MAP_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(LegacyKVEventBatch)


def encode_batch(
    events: Sequence[Event], ts: float, dp_rank: int | None, encoding: Literal["map", "array"] = "map"
) -> bytes:
    """Encode one batch exactly as the matching vLLM version would."""
    if encoding == "map":
        return _ENCODER.encode(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=dp_rank))
    legacy = [to_legacy(e) for e in events]
    return _ENCODER.encode(LegacyKVEventBatch(ts=ts, events=legacy, data_parallel_rank=dp_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a map-shaped (vLLM >= 0.24) payload with these structs; used by tests and tools."""
    return _MAP_DECODER.decode(payload)


def decode_legacy_batch(payload: bytes) -> LegacyKVEventBatch:
    """Decode an array-shaped (vLLM <= 0.23) payload."""
    return _ARRAY_DECODER.decode(payload)


class KVEventPublisher:
    """Live PUB stream plus a replay ROUTER served by a background thread.

    `publish` is meant to be called from one thread (the engine's scheduler); the replay thread only
    touches the buffer under `_lock`, and each ZMQ socket is used by a single thread.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        encoding: Literal["map", "array"] = "map",
        bind: bool = True,
        ctx: zmq.Context | None = None,  # type: ignore[type-arg]
        replay_frames: Literal[3, 2] = 3,
        hwm: int = 100_000,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', not {encoding!r}")
        if replay_frames not in (3, 2):
            raise ValueError(f"replay_frames must be 3 or 2, not {replay_frames!r}")
        self.topic = topic
        self.dp_rank = dp_rank
        self.encoding: Literal["map", "array"] = encoding
        self.replay_frames: Literal[3, 2] = replay_frames
        self._topic_bytes = topic.encode("utf-8")
        self._own_ctx = ctx is None
        self._ctx: zmq.Context = zmq.Context() if ctx is None else ctx  # type: ignore[type-arg]
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._drop = 0
        self._lose = 0.0
        self._lose_rng = random.Random(0)
        self.silent = False
        """Publish nothing at all (an engine whose KV events are off): no seq, no buffer."""
        self.replay_down = False
        """Ignore replay requests (the replay socket accepts, nobody answers: the consumer times out)."""
        self._paused_until = 0.0
        self._hold = 0
        self._held: list[tuple[int, bytes]] = []
        self._closed = False
        self._bound = bind

        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        router = None
        try:  # (a socket left open would keep its context's term() waiting for good)
            if bind:
                self._pub.bind(endpoint)
                self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                router.bind(replay_endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise

        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if router is not None:
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replay, args=(router,), name=f"kv-replay-dp{dp_rank}", daemon=True
            )
            self._thread.start()

    # ---- live stream -------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry."""
        return self._seq

    def publish(self, events: Sequence[Event], ts: float | None = None) -> int:
        """Encode and send one batch (one scheduler step); returns its seq."""
        payload = encode_batch(events, time.time() if ts is None else ts, self.dp_rank, self.encoding)
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Send arbitrary payload bytes under the next seq (also buffered for replay)."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        if self.silent:
            return -1
        with self._lock:
            seq = self._seq
            self._seq += 1
            lost = self._lose > 0 and self._lose_rng.random() < self._lose
            if not lost:
                self._buffer.append((seq, payload))
            drop = lost or self._drop > 0
            if drop and not lost:
                self._drop -= 1
            if not drop and self._paused_until:
                if time.monotonic() < self._paused_until:
                    # a stalled stream: what fits under the high-water mark waits, the rest is dropped
                    if len(self._held) < self._hold:
                        self._held.append((seq, payload))
                    return seq
                self._paused_until = 0.0
                held, self._held = self._held, []
                for s, p in held:
                    self._pub.send_multipart((self._topic_bytes, s.to_bytes(8, "big"), p))
        if not drop:
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
        return seq

    def drop_next(self, n: int) -> None:
        """The next `n` batches take a seq and are buffered for replay but never sent live."""
        if n < 0:
            raise ValueError("n must be >= 0")
        with self._lock:
            self._drop = n

    def pause(self, seconds: float, hold: int) -> None:
        """Stall the live stream for ``seconds``: the first ``hold`` batches wait (a high-water mark)
        and go out when it resumes, later ones are dropped (they stay in the replay buffer)."""
        with self._lock:
            self._paused_until = time.monotonic() + seconds
            self._hold = hold

    def lose(self, ratio: float, seed: int = 0) -> None:
        """From now on, this share of batches takes a seq but is neither sent nor kept for replay:
        lost for good, as when the replay buffer is too small or off (a seeded, repeatable draw)."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError("ratio must be between 0 and 1")
        with self._lock:
            self._lose = ratio
            self._lose_rng = random.Random(seed)

    def drop_connections(self) -> None:
        """Close the PUB socket and bind a new one at the same address, so that every subscriber's
        connection drops and comes back (a network blip, a proxy restarting), while the engine goes
        on: same seq, same replay buffer. Bound publishers only; call it from the publishing thread."""
        if self._closed or not self._bound:
            raise RuntimeError("drop_connections needs an open publisher that binds its address")
        with self._lock:
            hwm = self._pub.getsockopt(zmq.SNDHWM)
            self._pub.close(linger=0)
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub = pub
            # libzmq closes the old listening socket in its I/O thread, a moment later: the address
            # is taken until then
            deadline = time.monotonic() + 30.0
            while True:
                try:
                    pub.bind(self.endpoint)
                    return
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    def restart(self) -> None:
        """Behave like a restarted engine: seq back to 0 and nothing left to replay."""
        with self._lock:
            self._seq = 0
            self._drop = 0
            self._buffer.clear()

    def close(self) -> None:
        """Stop the replay thread and close both sockets without lingering."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- replay ------------------------------------------------------------------------------------

    def _serve_replay(self, router: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Answer `[identity, b"", start_seq8]` requests until close(); other shapes are ignored."""
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(50)):
                    continue
                while True:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(router, frames)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:  # type: ignore[type-arg]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return  # vLLM logs "Invalid replay request" and moves on
        if self.replay_down:
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            batches = [(s, p) for s, p in self._buffer if s >= start]
        try:
            for seq, payload in batches:
                if self.replay_frames == 3:
                    router.send_multipart((identity, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
                else:
                    router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            if self.replay_frames == 3:
                router.send_multipart((identity, b"", b"", END_SEQ, b""))
            else:
                router.send_multipart((identity, b"", END_SEQ, b""))
        except zmq.ZMQError:
            pass  # the client vanished (ROUTER drops unroutable messages); nothing to recover
