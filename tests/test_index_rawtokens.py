"""Compiled token ids (index/rawtokens.py) against the list path, store operation by operation.

The reference is ``decode_payload(payload, compiled=False)`` (token_ids decoded into Python lists,
keys through numpy), i.e. the ingest path as it was before the compiled one. Both paths feed an ingestor
whose store records every call; the call logs, the counters and the decoded batches must be
identical, on the captured vLLM frames (map shape, and the same events re-encoded as <= 0.23 tagged
arrays) and on hypothesis-generated batches in both shapes with every msgpack int encoding.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_vectors import live_frames, load, scenarios

from index.ingest import Ingestor, SourceStats
from index.keys import block_contents, prompt_keys, u64_block_contents
from index.rawtokens import TokenIds, strip_tokens
from index.store import PrefixStore
from index.wire import BlockStored, WireError, decode_payload

U64 = (1 << 64) - 1


# ---- recording both paths ---------------------------------------------------------------------


def _plain(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


class RecordingStore:
    """A real store whose every method call (arguments and result) is logged."""

    def __init__(self) -> None:
        self.inner = PrefixStore()
        self.log: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            out = attr(*args, **kw)
            self.log.append((name, _plain(args), _plain(kw), _plain(out)))
            return out

        return call


def _stats(st_: SourceStats) -> dict[str, Any]:
    return {k: getattr(st_, k) for k in SourceStats.__slots__ if k != "last_applied"}


class Pair:
    """The compiled path and the list path side by side, fed the same payloads in the same chunks."""

    def __init__(self, sources: int = 1, block_size: int | None = None) -> None:
        self.stores = (RecordingStore(), RecordingStore())
        self.ings = tuple(Ingestor(s, block_size) for s in self.stores)  # type: ignore[arg-type]
        self.sidx = [[ing.add_source(("e", r)) for r in range(sources)] for ing in self.ings]
        self.decode_errors = 0
        self.raw_events = 0

    def chunk(self, items: list[tuple[int, bytes]]) -> None:
        chunks: tuple[list[Any], list[Any]] = ([], [])
        for src, payload in items:
            try:
                new = decode_payload(payload)
            except WireError:
                new = None
            try:
                old = decode_payload(payload, compiled=False)
            except WireError:
                old = None
            assert (new is None) == (old is None), payload.hex()
            if new is None or old is None:
                self.decode_errors += 1
                continue
            assert new == old  # TokenIds equals the list msgspec decodes
            for a, b in zip(new.events, old.events, strict=True):
                if isinstance(a, BlockStored):
                    assert isinstance(b, BlockStored)
                    self.raw_events += type(a.token_ids) is TokenIds
                    assert len(a.token_ids) == len(b.token_ids)
                    assert list(a.token_ids) == b.token_ids
            chunks[0].append((self.sidx[0][src], new))
            chunks[1].append((self.sidx[1][src], old))
        for ing, chunk in zip(self.ings, chunks, strict=True):
            ing.apply_chunk(chunk)
        self.check()

    def check(self) -> None:
        a, b = self.stores
        assert a.log == b.log
        for s0, s1 in zip(self.sidx[0], self.sidx[1], strict=True):
            assert _stats(self.ings[0].stats[s0]) == _stats(self.ings[1].stats[s1])


# ---- re-encoding helpers --------------------------------------------------------------------------

_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED = ("block_hashes", "medium", "group_idx")


def _to_legacy(ev: dict[str, Any], trailing: list[Any]) -> list[Any]:
    """A map event as the <= 0.23 tagged array (known fields in order, then ``trailing`` items)."""
    kind = ev["type"]
    names = _STORED if kind == "BlockStored" else _REMOVED if kind == "BlockRemoved" else ()
    return [kind, *[ev.get(n) for n in names], *(trailing if names else [])]


def _legacy_payload(payload: bytes, trailing: list[Any]) -> bytes:
    raw = msgspec.msgpack.decode(payload)
    raw[1] = [_to_legacy(ev, trailing) for ev in raw[1]]
    return msgspec.msgpack.encode(raw)


# ---- captured frames ----------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("name", scenarios())
def test_captures_ingest_identically(name: str, legacy: bool) -> None:
    capture = load(name)
    ranks = sorted(capture["ranks"])
    pair = Pair(len(ranks), capture["block_size"])
    items = []
    for i, rank in enumerate(ranks):
        for frames in live_frames(capture, rank):
            payload = frames[2]
            items.append((i, _legacy_payload(payload, [None, "future"]) if legacy else payload))
    for start in range(0, len(items), 3):  # chunks of three messages, as the subscriber may form
        pair.chunk(items[start : start + 3])
    stored = sum(st_.blocks_stored for st_ in pair.ings[0].stats.values())
    assert pair.decode_errors == 0
    if any(st_.stored_events for st_ in pair.ings[0].stats.values()):
        assert pair.raw_events > 0 and stored > 0


# ---- hypothesis: both shapes, every int encoding ----------------------------------------------------

_EDGES = [0, 1, 127, 128, 255, 256, 2**15 - 1, 2**15, 2**16 - 1, 2**16, 2**31, 2**32 - 1, 2**32, 2**63, U64]


def _encodings(v: int) -> list[bytes]:
    """Every msgpack encoding of the int ``v`` (msgspec itself only writes the shortest one)."""
    out = []
    if 0 <= v < 0x80:
        out.append(bytes([v]))
    if -32 <= v < 0:
        out.append(struct.pack(">b", v))
    for tag, fmt, lo, hi in (
        (0xCC, ">B", 0, 2**8),
        (0xCD, ">H", 0, 2**16),
        (0xCE, ">I", 0, 2**32),
        (0xCF, ">Q", 0, 2**64),
        (0xD0, ">b", -(2**7), 2**7),
        (0xD1, ">h", -(2**15), 2**15),
        (0xD2, ">i", -(2**31), 2**31),
        (0xD3, ">q", -(2**63), 2**63),
    ):
        if lo <= v < hi:
            out.append(bytes([tag]) + struct.pack(fmt, v))
    return out


_NON_INTS = [b"\xc0", b"\xc3", b"\xc2", b"\xcb" + struct.pack(">d", 1.0), b"\xa1x", b"\xc4\x01x", b"\x90"]


def _array_header(n: int, wide: int) -> bytes:
    if n < 16 and wide == 0:
        return bytes([0x90 | n])
    if n < 2**16 and wide <= 1:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


@st.composite
def _token_array(draw: st.DrawFn, n: int) -> tuple[msgspec.Raw, list[int]]:
    """A raw msgpack array of ``n`` token ids, each in a random valid encoding (rarely not an int)."""
    kind = draw(st.sampled_from(["plain"] * 8 + ["negative", "not-int"]))
    values = draw(
        st.lists(
            st.one_of(st.sampled_from(_EDGES), st.integers(0, 200_000), st.integers(0, U64)),
            min_size=n,
            max_size=n,
        )
    )
    items = [draw(st.sampled_from(_encodings(v))) for v in values]
    if n and kind == "negative":
        i = draw(st.integers(0, n - 1))
        values[i] = draw(st.sampled_from([-1, -32, -33, -(2**63)]))
        items[i] = draw(st.sampled_from(_encodings(values[i])))
    elif n and kind == "not-int":
        items[draw(st.integers(0, n - 1))] = draw(st.sampled_from(_NON_INTS))
    wide = draw(st.sampled_from([0, 0, 0, 1, 2]))
    return msgspec.Raw(_array_header(n, wide) + b"".join(items)), values


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 2 + ["cleared"]))
    pool = st.integers(1, 40)
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    medium = draw(st.sampled_from(["GPU", "GPU", "CPU", None]))
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": draw(st.lists(pool, max_size=4)), "medium": medium}
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["ok"] * 8 + ["short", "placeholder"]))
    ntok = bs * n if shape == "ok" else max(0, bs * n - draw(st.integers(1, bs + 1)))
    if shape == "placeholder":
        bs, ntok = 0, 0
    tokens, _ = draw(_token_array(ntok))
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(pool, min_size=n, max_size=n)),
        "parent_block_hash": draw(st.one_of(st.none(), pool)),
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": medium,
        "lora_name": draw(st.sampled_from([None, None, "sql"])),
    }
    if draw(st.booleans()):
        ev["extra_keys"] = [draw(st.sampled_from([None, ["salt"], ["sql", "mm", 3]])) for _ in range(n)]
        ev["group_idx"] = 0
    if draw(st.booleans()):
        ev["kv_cache_spec_kind"] = "full_attention"  # a field added after 0.23
    return ev


@st.composite
def _stream(draw: st.DrawFn) -> tuple[list[list[tuple[int, bytes]]], bool]:
    legacy = draw(st.booleans())
    trailing = draw(st.sampled_from([[], [None], [7, "x"]]))
    chunks = []
    for _ in range(draw(st.integers(1, 4))):
        chunk = []
        for _ in range(draw(st.integers(1, 4))):
            events = draw(st.lists(_event(), max_size=5))
            wire_events: list[Any] = [_to_legacy(ev, trailing) for ev in events] if legacy else events
            payload = msgspec.msgpack.encode([1.0, wire_events, 0])
            chunk.append((draw(st.integers(0, 1)), payload))
        chunks.append(chunk)
    return chunks, legacy


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stream())
def test_generated_batches_ingest_identically(stream: tuple[list[list[tuple[int, bytes]]], bool]) -> None:
    chunks, _ = stream
    pair = Pair(2, 4)
    for chunk in chunks:
        pair.chunk(chunk)


def _one_event(tokens: msgspec.Raw, legacy: bool = False) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens}
    ev |= {"block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([1.0, [_to_legacy(ev, []) if legacy else ev], 0])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40).flatmap(lambda n: _token_array(n)), st.booleans())
def test_strip_accepts_exactly_what_list_int_accepts(
    arr: tuple[msgspec.Raw, list[int]], legacy: bool
) -> None:
    raw, values = arr
    try:
        expected: list[int] | None = msgspec.msgpack.decode(raw, type=list[int])
    except msgspec.ValidationError:
        expected = None
    stripped = strip_tokens(_one_event(raw, legacy))
    if expected is None:
        assert stripped is None
        return
    assert stripped is not None and expected == values
    copy, (tokens,) = stripped
    assert msgspec.msgpack.decode(copy)[1][0][3 if legacy else "token_ids"] == 0  # the index
    assert tokens == expected and len(tokens) == len(expected) and list(tokens) == expected
    assert tokens.negative == any(v < 0 for v in expected)
    if not tokens.negative and expected:
        bs = len(expected)
        assert u64_block_contents(tokens.array(), bs).tolist() == block_contents(expected, bs).tolist()


# ---- edges ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # nothing
        b"\x92\xcb",  # truncated
        msgspec.msgpack.encode([1.0, [], 0]) + b"\x00",  # trailing byte
        msgspec.msgpack.encode({"ts": 1.0}),  # not an array
        msgspec.msgpack.encode([1.0]),  # no events
        msgspec.msgpack.encode([1.0, {"a": 1}]),  # events not an array
        _one_event(msgspec.Raw(b"\xc0")),  # token_ids nil
        _one_event(msgspec.Raw(b"\xa3abc")),  # token_ids a string
        _one_event(msgspec.Raw(b"\x91\xa1x")),  # a string token
        _one_event(msgspec.Raw(b"\x91\x91\x01")),  # a nested array
        _one_event(msgspec.Raw(b"\xc1")),  # the never-used type byte
        b"\x93\x00\xdd\xff\xff\xff\xff\x00",  # 2^32-1 events claimed in 8 bytes
        b"\x93\x00\x91\x81\xa9token_ids\xdd\xff\xff\xff\xff\x00",  # 2^32-1 tokens claimed
    ],
)
def test_strip_gives_up_on_what_it_does_not_understand(payload: bytes) -> None:
    assert strip_tokens(payload) is None


def test_every_other_msgpack_type_is_skipped() -> None:
    """Unknown fields of every msgpack type around the token arrays (what _skip walks over)."""
    odd = [None, True, False, 1.5, -3, 2**64 - 1, "s" * 40, "t" * 300, b"b" * 300, {"m": [1, {"n": None}]}]
    ext = [msgspec.msgpack.Ext(1, b"x" * n) for n in (1, 2, 4, 8, 16, 3, 300)]
    ev = {"type": "BlockStored", "zz": odd + ext, "block_hashes": [1, 2], "parent_block_hash": None}
    ev |= {
        "token_ids": list(range(20)),
        "block_size": 10,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    payload = msgspec.msgpack.encode([1.0, [ev, {"type": "AllBlocksCleared", "x": odd}], 0, odd, ext])
    assert decode_payload(payload) == decode_payload(payload, compiled=False)
    stripped = strip_tokens(payload)
    assert stripped is not None and stripped[1] == [list(range(20))]


def test_array16_and_array32_headers_and_many_arrays() -> None:
    big = list(range(70_000))  # array32 on the wire
    mid = [U64] * 32  # array16
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [0],
            "parent_block_hash": None,
            "token_ids": t,
            "block_size": 1,
        }
        for t in [big, mid] + [[i] for i in range(300)]  # indexes >= 128 take 2 bytes, >= 256 3 bytes
    ]
    payload = msgspec.msgpack.encode([1.0, events, 0])
    stripped = strip_tokens(payload)
    assert stripped is not None
    ids = stripped[1]
    assert ids[0] == big and ids[1] == mid and [t.tolist() for t in ids[2:]] == [[i] for i in range(300)]
    assert msgspec.msgpack.decode(stripped[0])[1][200]["token_ids"] == 200
    # an empty array has no room for an index from 128 on: the payload takes the generic path
    events[200]["token_ids"] = []
    assert strip_tokens(msgspec.msgpack.encode([1.0, events, 0])) is None
    events[2]["token_ids"] = []
    payload = msgspec.msgpack.encode([1.0, events[:100], 0])
    assert decode_payload(payload) == decode_payload(payload, compiled=False)
    assert u64_block_contents(ids[0].array(), 16).tolist() == block_contents(big, 16).tolist()


def test_token_ids_behave_like_the_list() -> None:
    stripped = strip_tokens(_one_event(msgspec.Raw(msgspec.msgpack.encode([3, 300, 70_000]))))
    negative = strip_tokens(_one_event(msgspec.Raw(b"\x93\x01\xff\xd0\x80")))
    assert stripped is not None and negative is not None
    t = stripped[1][0]
    assert t == [3, 300, 70_000] and operator.eq([3, 300, 70_000], t) and t != (3, 300, 70_000)
    assert t[1] == 300 and t[-1] == 70_000 and t[:2] == [3, 300] and 300 in t
    assert repr(t) == "[3, 300, 70000]" and t.tolist() == [3, 300, 70_000]
    t.tolist().append(1)
    assert len(t) == 3 and list(t) == [3, 300, 70_000]
    with pytest.raises(TypeError):
        hash(t)
    (n,) = negative[1]
    assert n.negative and n == [1, -1, -128] and len(n) == 3


def test_decoded_and_python_events_in_one_chunk_key_alike() -> None:
    """A chunk mixing decoded (raw) events and Python-built ones (list token ids) in one group."""
    tokens = list(range(100, 116))
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "parent_block_hash": None,
                    "token_ids": tokens[:8],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
            0,
        ]
    )
    store = PrefixStore()
    ing = Ingestor(store, 4)
    s = ing.add_source(("e", 0))
    batch = decode_payload(payload)
    assert isinstance(batch.events[0], BlockStored) and type(batch.events[0].token_ids) is TokenIds
    batch.events.append(BlockStored([3, 4], 2, tokens[8:], 4, None, "GPU", None))
    ing.apply_chunk([(s, batch)])
    (m,) = store.lookup(prompt_keys(tokens, 4), [s])
    assert m.blocks == 4


def test_a_group_whose_only_event_is_rejected() -> None:
    """The block-size group exists but holds no event (its only event had a negative id)."""
    pair = Pair(1, 1)
    pair.chunk([(0, _one_event(msgspec.Raw(b"\x91\xff")))])
    assert pair.ings[0].stats[pair.sidx[0][0]].bad_events == 1
