"""The per-chunk fast paths against the paths they replace.

- The store applies a run of one source's events in one compiled call (``PrefixStore.apply_ops``);
  ``Ingestor.batched = False`` applies the same chunks event by event (``store`` / ``remove``).
  Random multi-source streams (several media and block sizes per chunk, clears, restarts,
  duplicates, remaps, unknown removes, the memory cap, runs longer than one kernel call) must leave
  identical stores and counters.
(The C ingest of raw payloads against this Python path: tests/index/test_index_cingest.py.)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from index.ingest import Ingestor, SourceStats
from index.store import OP_REMOVE, OP_STORE, PrefixStore
from index.wire import Batch, BlockRemoved, BlockStored, decode_payload
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
