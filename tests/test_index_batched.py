"""The per-chunk fast paths against the paths they replace.

- The store applies a run of one source's events in one compiled call (``PrefixStore.apply_ops``);
  ``Ingestor.batched = False`` applies the same chunks event by event (``store`` / ``remove``).
  Random multi-source streams (several media and block sizes per chunk, clears, restarts,
  duplicates, remaps, unknown removes, the memory cap, runs longer than one kernel call) must leave
  identical stores and counters.
- The compiled decode tells whether a batch needs normalising (``strip_events``' clean flag); for
  every msgpack encoding of hashes, parents, block sizes and media it must decode exactly as the
  list path, and claim clean only when normalising would change nothing.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index import table as tb
from index import wire
from index.ingest import Ingestor, SourceStats
from index.rawtokens import TokenIds, strip_events, strip_tokens
from index.store import OP_REMOVE, OP_STORE, PrefixStore
from index.wire import Batch, BlockRemoved, BlockStored, WireError, decode_payload
from sim.publisher import AllBlocksCleared as SimCleared
from sim.publisher import BlockRemoved as SimRemoved
from sim.publisher import BlockStored as SimStored
from sim.publisher import encode_batch

# ---- batched store calls against one call per event -----------------------------------------------


def _stats(st_: SourceStats) -> dict[str, Any]:
    return {k: getattr(st_, k) for k in SourceStats.__slots__ if k != "last_applied"}


class _Twin:
    """Two ingestors over two stores, one batched and one event by event, fed the same chunks."""

    def __init__(self, sources: int, cap: int) -> None:
        self.stores = (PrefixStore(cap), PrefixStore(cap))
        self.ings = (Ingestor(self.stores[0], 4), Ingestor(self.stores[1], 4))
        self.ings[1].batched = False
        assert self.ings[0].batched
        self.sidx = [[ing.add_source(("e", r)) for r in range(sources)] for ing in self.ings]
        self.calls = 0
        inner = self.stores[0].apply_ops

        def counting(*args: Any) -> None:
            self.calls += 1
            inner(*args)

        self.stores[0].apply_ops = counting  # type: ignore[method-assign,assignment]

    def chunk(self, items: list[tuple[int, bytes | None]]) -> None:
        for ing, sidx in zip(self.ings, self.sidx, strict=True):
            ing.apply_chunk([(sidx[s], None if p is None else decode_payload(p)) for s, p in items])
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


def _random_stream(rng: random.Random, sources: int) -> list[list[tuple[int, bytes | None]]]:
    """Chunks of payloads: chains that extend, branch, repeat and get removed, on a few media."""
    pool = [rng.getrandbits(64) if rng.random() < 0.3 else rng.randrange(1, 200) for _ in range(120)]
    last: dict[int, int | bytes | None] = {}
    chunks: list[list[tuple[int, bytes | None]]] = []
    sent: list[SimStored] = []
    for _ in range(rng.randint(1, 6)):
        chunk: list[tuple[int, bytes | None]] = []
        for _ in range(rng.randint(1, 12)):
            s = rng.randrange(sources)
            if rng.random() < 0.04:
                chunk.append((s, None))  # a restart
                last[s] = None
                continue
            events: list[Any] = []
            for _ in range(rng.randint(0, 4)):
                r = rng.random()
                medium = rng.choice(["GPU"] * 5 + ["CPU", "DISK", None])
                if r < 0.1 and sent:  # earlier content under new hashes: the same keys, more references
                    old = rng.choice(sent)
                    hashes: list[int | bytes] = [rng.choice(pool) for _ in old.block_hashes]
                    events.append(
                        SimStored(
                            hashes, old.parent_block_hash, old.token_ids, old.block_size, None, "GPU", None
                        )
                    )
                elif r < 0.55:
                    bs = rng.choice([4, 4, 4, 8])
                    n = rng.randint(1, 6)
                    hashes = [rng.choice(pool) for _ in range(n)]
                    parent = last.get(s) if rng.random() < 0.7 else rng.choice([None, *pool])
                    tokens = [rng.randrange(50) for _ in range(n * bs)]
                    salts: list[tuple[Any, ...] | None] = [None, ("salt",)]
                    extra = [rng.choice(salts) for _ in range(n)] if rng.random() < 0.1 else None
                    lora = rng.choice([None, None, None, "sql"])
                    events.append(SimStored(hashes, parent, tokens, bs, None, medium, lora, extra))
                    sent.append(events[-1])
                    last[s] = hashes[-1]
                elif r < 0.9:
                    events.append(SimRemoved([rng.choice(pool) for _ in range(rng.randint(0, 6))], medium))
                else:
                    events.append(SimCleared())
            chunk.append((s, encode_batch(events, 1.0, 0)))
        chunks.append(chunk)
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_batched_store_calls_equal_one_call_per_event(seed: int) -> None:
    rng = random.Random(seed)
    twin = _Twin(rng.randint(1, 3), rng.choice([10, 30, 10**9]))
    for chunk in _random_stream(rng, len(twin.sidx[0])):
        twin.chunk(chunk)


def test_the_batched_path_runs_and_long_runs_take_several_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """One store call per run of a source; a run longer than the kernel's budget of blocks takes
    several kernel calls (the interpreter may switch threads in between)."""
    twin = _Twin(2, 10**9)
    rng = random.Random(7)
    items: list[tuple[int, bytes | None]] = []
    for i in range(160):
        hashes: list[int | bytes] = list(range(i * 64 + 1, i * 64 + 65))
        tokens = [rng.randrange(1000) for _ in range(64 * 4)]
        items.append((i % 2, encode_batch([SimStored(hashes, None, tokens, 4, None, "GPU", None)], 1.0, 0)))
    twin.chunk(items[:60])
    assert twin.calls == 60  # the sources alternate: one run per batch
    applied: list[int] = []  # blocks per kernel call
    kernel = tb.apply_ops

    def counting(*args: Any) -> tuple[int, int]:
        out: tuple[int, int] = kernel(*args)
        ops, first = args[12], args[16]
        applied.append(int(ops[first : out[0], 3].sum()))
        return out

    monkeypatch.setattr(tb, "apply_ops", counting)
    twin.chunk([(0, p) for _, p in items[60:]])  # 6,400 blocks of one source
    assert twin.calls == 61 and sum(applied) == 6400
    assert len(applied) >= 2 and max(applied) <= 4096 + 64
    assert twin.stores[0].total == 160 * 64


def test_hashes_that_do_not_fit_take_the_per_event_path() -> None:
    """Python-built events with hashes outside uint64: the chunk goes event by event, as before."""
    for bad in (
        BlockStored([-1], None, [1, 2, 3, 4], 4, None, "GPU", None),
        BlockRemoved([-5], "GPU"),
    ):
        errors = []
        for batched in (True, False):
            store = PrefixStore()
            ing = Ingestor(store, 4)
            ing.batched = batched
            s = ing.add_source(("e", 0))
            good = BlockStored([1], None, [5, 6, 7, 8], 4, None, "GPU", None)
            try:
                ing.apply_chunk([(s, Batch(1.0, [good, bad]))])
            except (OverflowError, ValueError, TypeError) as exc:
                errors.append(type(exc))
            assert store.total == 1 and ing.stats[s].stored_events == 1  # the good event went first
        assert len(errors) == 2 and errors[0] == errors[1]


def test_apply_ops_equals_store_and_remove() -> None:
    ops = [[OP_STORE, 0, 0, 3], [OP_REMOVE, 0, 0, 2], [OP_STORE, 1, 3, 2], [OP_REMOVE, 1, 2, 1]]
    ehs, keys, rems = [1, 2, 3, 4, 5], [10, 11, 12, 10, 13], [1, 3, 4]
    a, b = PrefixStore(2), PrefixStore(2)
    for st_ in (a, b):
        st_.add_source(("e", 0))
        st_.medium_index("CPU")
    a.apply_ops(
        0,
        np.array(ops, dtype=np.int64),
        np.array(ehs, dtype=np.uint64),
        np.array(keys, dtype=np.uint64),
        np.array(rems, dtype=np.uint64),
    )
    for kind, m, first, n in ops:
        if kind == OP_STORE:
            b.store(0, m, ehs[first : first + n], keys[first : first + n])
        else:
            b.remove(0, m, rems[first : first + n])
    assert a._media == b._media and a._emaps == b._emaps and a._refs == b._refs
    assert a.counts() == b.counts() and a.evictions == b.evictions > 0


# ---- the clean flag: every encoding of the fields the decoder normalises ---------------------------


def _ints(v: int) -> st.SearchStrategy[bytes]:
    """Encodings of ``v``: the shortest, and the signed and wider ones msgspec also decodes as int."""
    out = [msgspec.msgpack.encode(v)]
    for tag, fmt, lo, hi in ((0xD0, ">b", -128, 128), (0xD3, ">q", -(2**63), 2**63), (0xCF, ">Q", 0, 2**64)):
        if lo <= v < hi:
            out.append(bytes([tag]) + struct.pack(fmt, v))
    return st.sampled_from(out)


_HASH = st.one_of(
    st.integers(0, 300).flatmap(_ints),
    st.integers(0, 2**64 - 1).flatmap(_ints),
    st.integers(-(2**63), -1).flatmap(_ints),  # rejected by the normaliser
    st.binary(min_size=1, max_size=9).map(msgspec.msgpack.encode),  # bytes hashes: low 8 bytes
)


@st.composite
def _hashes(draw: st.DrawFn) -> msgspec.Raw:
    items = draw(st.lists(_HASH, max_size=4))
    return msgspec.Raw(bytes([0x90 | len(items)]) + b"".join(items))


@st.composite
def _map_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["stored"] * 5 + ["removed"] * 2 + ["cleared"]))
    medium = draw(st.sampled_from([msgspec.Raw(b"\xc0"), "GPU", "CPU", None]))  # None: field left out
    if kind == "cleared":
        ev: dict[str, Any] = {"type": "AllBlocksCleared"}
        if draw(st.booleans()):
            ev["token_ids"] = [1, 2]  # an unknown field here: stripped, ignored
        return ev
    ev = {"type": "BlockRemoved" if kind == "removed" else "BlockStored", "block_hashes": draw(_hashes())}
    if medium is not None:
        ev["medium"] = medium
    if kind == "removed":
        return ev
    n = draw(st.integers(0, 3))
    ev["parent_block_hash"] = msgspec.Raw(draw(st.one_of(st.just(b"\xc0"), _HASH)))
    ev["token_ids"] = draw(st.lists(st.integers(0, 70_000), min_size=2 * n, max_size=2 * n))
    ev["block_size"] = msgspec.Raw(draw(st.sampled_from([2, 2, 0, -2]).flatmap(_ints)))
    return ev


@settings(max_examples=400, deadline=None)
@given(st.lists(_map_event(), max_size=4))
def test_compiled_decode_and_its_clean_flag(events: list[dict[str, Any]]) -> None:
    payload = msgspec.msgpack.encode([1.5, events, 0])
    try:
        expected: Batch | None = decode_payload(payload, compiled=False)
    except WireError:
        expected = None
    try:
        got: Batch | None = decode_payload(payload)
    except WireError:
        got = None
    assert got == expected
    stripped = strip_events(payload)
    if stripped is not None and stripped[2]:
        # clean: the typed decode alone (no normalising) already gives the normalised batch
        assert expected is not None and wire._map_decoder.decode(payload) == expected
    if got is not None:
        for ev in got.events:
            if type(ev) is BlockStored:
                assert type(ev.token_ids) is TokenIds


def test_strip_events_and_strip_tokens_find_the_same_arrays() -> None:
    events: list[Any] = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5] * 300},
        {"type": "BlockRemoved", "block_hashes": [1], "token_ids": [9]},
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1, "token_ids": [-1, 2]},
    ]
    for ev in events:
        if ev["type"] == "BlockStored":
            ev["block_size"] = len(ev["token_ids"])
    payload = msgspec.msgpack.encode([1.0, events, 0])
    by_index = strip_tokens(payload)
    by_event = strip_events(payload)
    assert by_index is not None and by_event is not None
    assert [e for e, _ in by_event[1]] == [0, 1, 3]
    assert [t.tolist() for _, t in by_event[1]] == [t.tolist() for t in by_index[1]]
    assert by_event[2]  # hashes, parents, sizes and media all in normal form
    assert msgspec.msgpack.decode(by_event[0])[1][0]["token_ids"] == []
    assert decode_payload(payload) == decode_payload(payload, compiled=False)


def test_a_repeated_token_ids_key_keeps_the_last_like_msgspec() -> None:
    ev = msgspec.msgpack.encode({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None})
    extra = msgspec.msgpack.encode({"token_ids": [1, 2], "block_size": 1})[1:]  # two more pairs
    again = msgspec.msgpack.encode({"token_ids": [3]})[1:]
    event = bytes([0x80 | 6]) + ev[1:] + extra + again
    payload = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" + event + b"\x00"
    got = decode_payload(payload)
    assert got == decode_payload(payload, compiled=False)
    stored = got.events[0]
    assert isinstance(stored, BlockStored) and isinstance(stored.token_ids, TokenIds)
    assert stored.token_ids == [3]
