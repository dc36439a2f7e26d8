"""The C ingest (``index/_kvcore.c``, raw payloads) against the Python path (decoded batches).

Both ingest the same payloads into a compact store each; after every chunk the stores (every raw
map: ``_media``, ``_emaps`` in eviction order, ``_refs``, totals, per-source counts) and the
per-source counters must be identical. The C side gets whole chunks (it takes what it understands,
the Python path the rest, in order); the reference decodes every payload in Python and applies one
message per chunk.

Semantics note (index/README.md): the C path resolves a parent against what the source holds when
the event applies; the Python path resolves parents stored earlier in the same chunk from the chunk
itself. They differ only when a parent is removed or cleared earlier in the same chunk, which vLLM
never publishes (a block is in use while its child is computed), so the generated streams do not.
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
from index.rawtokens import TokenIds
from index.store import PrefixStore

U64 = (1 << 64) - 1


def _stats(st_: SourceStats) -> dict[str, Any]:
    # (a window-only source's placement memory lives in the C core on its path: compared through
    # what it places, the store's maps)
    skip = ("last_applied", "wends", "ghosts")
    return {k: getattr(st_, k) for k in SourceStats.__slots__ if k not in skip}


class Pair:
    """The C path and the Python path side by side, fed the same payloads."""

    def __init__(self, sources: int = 1, block_size: int | None = None) -> None:
        self.stores = (PrefixStore(), PrefixStore())
        self.ings = tuple(Ingestor(s, block_size) for s in self.stores)
        self.ings[1]._core = None  # the reference: every payload decoded and applied in Python
        self.sidx = [[ing.add_source(("e", r)) for r in range(sources)] for ing in self.ings]
        self.c_applied = 0
        self.py_applied = 0
        inner = self.ings[0]._apply_decoded

        def counting(items: Any) -> None:
            self.py_applied += sum(b is not None for _, b in items)
            inner(items)

        self.ings[0]._apply_decoded = counting  # type: ignore[method-assign]

    def chunk(self, items: list[tuple[int, bytes]]) -> None:
        core = self.stores[0].core
        batches, py = sum(st_.batches for st_ in self.ings[0].stats.values()), self.py_applied
        self.ings[0].apply_chunk([(self.sidx[0][s], p) for s, p in items])
        added = sum(st_.batches for st_ in self.ings[0].stats.values()) - batches
        self.c_applied += added - (self.py_applied - py)  # batches the C path applied
        assert core.take_stats() == []  # merged by the ingestor
        for s, p in items:
            self.ings[1].apply_chunk([(self.sidx[1][s], p)])
        self.check()

    def check(self) -> None:
        a, b = self.stores
        assert a.total == b.total and a.evictions == b.evictions
        assert a.counts() == b.counts()
        assert a._media == b._media
        assert [list(d.items()) for d in a._emaps] == [list(d.items()) for d in b._emaps]
        assert a._refs == b._refs
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
    decode_errors = sum(st_.decode_errors for st_ in pair.ings[0].stats.values())
    assert decode_errors == 0


def test_the_c_path_takes_plain_vllm_payloads() -> None:
    """After the first event of a source has taught its block size, plain payloads never leave C."""
    capture = load("clear")
    pair = Pair(1, capture["block_size"])
    items = [(0, f[2]) for f in live_frames(capture, sorted(capture["ranks"])[0])]
    pair.chunk(items[:1])
    pair.c_applied = 0
    pair.chunk(items[1:])
    assert pair.c_applied == len(items) - 1


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
    # a hybrid model's KV cache groups (applied by the C ingest once the Python path learned them)
    group = draw(st.sampled_from([None] * 6 + [0, 1, 2, 99]))
    spec = draw(st.sampled_from([None, ("full_attention", None), ("sliding_window", 8), ("mamba", None)]))
    if kind == "removed":
        ev = {"type": "BlockRemoved", "block_hashes": draw(st.lists(pool, max_size=4)), "medium": medium}
        if group is not None:
            ev["group_idx"] = group
        return ev
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["ok"] * 8 + ["short", "placeholder", "sparse", "none"]))
    ntok = bs * n if shape == "ok" else max(0, bs * n - draw(st.integers(1, bs + 1)))
    if shape == "placeholder":
        bs, ntok = 0, 0
    elif shape in ("sparse", "none"):  # a group's event: hashes for the last blocks of its range, or none
        ntok = bs * (n + draw(st.integers(1, 3)))
        n = 0 if shape == "none" else n
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
    if group is not None:
        ev["group_idx"] = group
    if spec is not None:
        ev["kv_cache_spec_kind"] = spec[0]
        if spec[1] is not None:
            ev["kv_cache_spec_sliding_window"] = spec[1]
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
            gone = False  # after a removal or a clear, no parent in this message (see the docstring)
            for ev in events:
                if ev["type"] != "BlockStored":
                    gone = True
                elif gone:
                    ev["parent_block_hash"] = None
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


# ---- odd encodings of the fields the decoder normalises ---------------------------------------------


def _ints(v: int) -> st.SearchStrategy[bytes]:
    out = [msgspec.msgpack.encode(v)]
    for tag, fmt, lo, hi in ((0xD0, ">b", -128, 128), (0xD3, ">q", -(2**63), 2**63), (0xCF, ">Q", 0, 2**64)):
        if lo <= v < hi:
            out.append(bytes([tag]) + struct.pack(fmt, v))
    return st.sampled_from(out)


_HASH = st.one_of(
    st.integers(0, 300).flatmap(_ints),
    st.integers(0, 2**64 - 1).flatmap(_ints),
    st.integers(-(2**63), -1).flatmap(_ints),  # rejected: a decode error
    st.binary(min_size=0, max_size=9).map(msgspec.msgpack.encode),  # bytes hashes: low 8 bytes; b"" bad
)


@st.composite
def _map_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["stored"] * 5 + ["removed"] * 2 + ["cleared", "other"]))
    medium = draw(st.sampled_from([msgspec.Raw(b"\xc0"), "GPU", "CPU", "", "NVME", 3, None]))
    if kind == "cleared":
        ev: dict[str, Any] = {"type": "AllBlocksCleared"}
        if draw(st.booleans()):
            ev["token_ids"] = [1, 2]  # an unknown field here: ignored
        return ev
    if kind == "other":
        return {"type": draw(st.sampled_from(["BlockPinned", 5])), "block_hashes": [1]}
    items = draw(st.lists(_HASH, max_size=4))
    ev = {"type": "BlockRemoved" if kind == "removed" else "BlockStored"}
    ev["block_hashes"] = msgspec.Raw(bytes([0x90 | len(items)]) + b"".join(items))
    if medium is not None:
        ev["medium"] = medium
    if kind == "removed":
        return ev
    n = draw(st.integers(0, 3))
    ev["parent_block_hash"] = msgspec.Raw(draw(st.one_of(st.just(b"\xc0"), _HASH)))
    ev["token_ids"] = draw(st.lists(st.integers(0, 70_000), min_size=2 * n, max_size=2 * n))
    ev["block_size"] = msgspec.Raw(draw(st.sampled_from([2, 2, 0, -2]).flatmap(_ints)))
    if draw(st.booleans()):
        ev["lora_id"] = draw(st.sampled_from([None, 7, "x"]))
    return ev


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_map_event(), max_size=4), min_size=1, max_size=3), st.sampled_from([1.5, 3, "x"]))
def test_odd_encodings_ingest_identically(messages: list[list[dict[str, Any]]], ts: Any) -> None:
    pair = Pair(1, 2)
    chunk = []
    for events in messages:
        gone = False
        for ev in events:
            if ev["type"] != "BlockStored":
                gone = True
            elif gone:
                ev["parent_block_hash"] = None
        chunk.append((0, msgspec.msgpack.encode([ts, events, 0])))
    pair.chunk(chunk)


# ---- malformed payloads: never a crash, never a read past the end -----------------------------------


def _one_event(tokens: msgspec.Raw, legacy: bool = False) -> bytes:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": tokens}
    ev |= {"block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([1.0, [_to_legacy(ev, []) if legacy else ev], 0])


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
def test_malformed_payloads_are_decode_errors_and_change_nothing(payload: bytes) -> None:
    pair = Pair(1, 1)
    pair.chunk([(0, payload)])
    assert pair.stores[0].total == 0


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_truncated_and_corrupted_payloads(data: st.DataObject) -> None:
    """Every prefix and random byte flips of a real payload: the C parser bounds-checks each read."""
    capture = load("eviction")
    frames = next(iter(live_frames(capture, sorted(capture["ranks"])[0])))
    payload = bytearray(frames[2])
    cut = data.draw(st.integers(0, len(payload)))
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, max(0, len(payload) - 1)), st.integers(0, 255)), max_size=4)
    )
    for pos, val in flips:
        if pos < len(payload):
            payload[pos] = val
    pair = Pair(1, capture["block_size"])
    pair.chunk([(0, bytes(payload[:cut]))])


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
    payload = msgspec.msgpack.encode([1.0, [ev, {"type": "AllBlocksCleared", "x": odd}], 0, 7, odd, ext])
    pair = Pair(1, 10)
    pair.chunk([(0, payload)])
    # the first event of a block size: Python learns the size (no numpy), then the C core applies it
    assert pair.c_applied == 1 and pair.ings[0].stats[0].block_size == 10
    pair.c_applied = 0
    pair.chunk([(0, payload)])
    assert pair.c_applied == 1 and pair.ings[0].stats[0].blocks_stored == 4  # (then cleared)


@pytest.mark.parametrize("at_end", [True, False])
def test_token_ids_in_every_encoding_up_to_the_payloads_last_byte(at_end: bool) -> None:
    """The C path reads a token id's 8 bytes after its tag at once while 9 bytes remain, and byte by
    byte in the last 8: every encoding (and a negative or a non-int, which go to the Python path)
    at each of the last positions of a token array that ends the payload (an event map whose last
    field is ``token_ids``, in a batch without its rank field) or is followed by it."""
    n = 3
    encodings = [e for v in _EDGES for e in _encodings(v)] + _encodings(-1) + _encodings(-(2**40)) + _NON_INTS
    taken = 0
    for pos in range(n):
        for enc in encodings:
            items = [b"\xce\x00\x01\x86\x9f"] * n  # 99,999 as uint32
            items[pos] = enc
            ev = {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "block_size": n,
                "medium": "GPU",
                "token_ids": msgspec.Raw(bytes([0x90 | n]) + b"".join(items)),
            }
            payload = msgspec.msgpack.encode([1.0, [ev]] if at_end else [1.0, [ev], 0])
            assert payload.endswith(b"".join(items)) == at_end
            pair = Pair(1, n)
            pair.chunk([(0, payload)])  # (its size taught to the core, which then applies it)
            pair.chunk([(0, payload)])  # the C path's
            taken += pair.c_applied
    assert taken == 2 * n * sum(len(_encodings(v)) for v in _EDGES)  # each unsigned one: both in C


def test_array16_and_array32_token_arrays() -> None:
    big = list(range(70_000))  # array32 on the wire
    events = [
        {
            "type": "BlockStored",
            "block_hashes": list(range(1, 4376)),
            "parent_block_hash": None,
            "token_ids": big[: 4375 * 16],
            "block_size": 16,
        }
    ]
    payload = msgspec.msgpack.encode([1.0, events, 0])
    pair = Pair(1, 16)
    pair.chunk([(0, payload)])
    pair.chunk([(0, payload)])
    assert pair.stores[0].total == 4375
    assert (
        u64_block_contents(np.array(big[:32], dtype=np.uint64), 16).tolist()
        == block_contents(big[:32], 16).tolist()
    )


def test_token_ids_behave_like_the_list() -> None:
    t = TokenIds(np.array([3, 300, 70_000], dtype=np.uint64), 0, 3)
    assert t == [3, 300, 70_000] and operator.eq([3, 300, 70_000], t) and t != (3, 300, 70_000)
    assert t[1] == 300 and t[-1] == 70_000 and t[:2] == [3, 300] and 300 in t
    assert repr(t) == "[3, 300, 70000]" and t.tolist() == [3, 300, 70_000]
    t.tolist().append(1)
    assert len(t) == 3 and list(t) == [3, 300, 70_000]
    with pytest.raises(TypeError):
        hash(t)
    n = TokenIds(np.zeros(3, dtype=np.uint64), 0, 3, True, b"\x93\x01\xff\xd0\x80")
    assert n.negative and n == [1, -1, -128] and len(n) == 3


def test_a_negative_token_id_is_a_bad_event_on_both_paths() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": msgspec.Raw(b"\x91\xff"),
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
    }
    payload = msgspec.msgpack.encode([1.0, [ev], 0])
    pair = Pair(1, 1)
    pair.chunk([(0, payload)])
    assert pair.ings[0].stats[pair.sidx[0][0]].bad_events == 1


def test_lookups_see_what_the_c_path_stored() -> None:
    tokens = list(range(100, 132))
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": tokens[:8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
    }
    child = dict(ev, block_hashes=[3, 4], parent_block_hash=2, token_ids=tokens[8:16])
    store = PrefixStore()
    ing = Ingestor(store, 4)
    s = ing.add_source(("e", 0))
    ing.apply_chunk(
        [(s, msgspec.msgpack.encode([1.0, [ev], 0])), (s, msgspec.msgpack.encode([1.0, [child], 0]))]
    )
    (m,) = store.lookup(prompt_keys(tokens, 4), [s])
    assert m.blocks == 4
    assert ing.stats[s].stored_events == 2 and ing.stats[s].unknown_parents == 0
    assert store.source_keys(s) == {"GPU": set(prompt_keys(tokens[:16], 4))}
