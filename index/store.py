"""The reference-counted prefix store: block key -> which sources hold it, on which medium.

A *source* is one event stream: (instance, DP rank). A *residency* is (key, source, medium), with a
reference count: vLLM's GPU pool can hold two blocks with one hash, and the CPU offloading connector
re-announces shared hashes once per chunk and removes them the same way, so a residency ends only
when its count reaches zero.

Layout: compact open-addressing tables over numpy arrays, every per-block loop a compiled kernel of
:mod:`index.table` (numba), one kernel call per lookup, per eviction, per event or per run of
events (:meth:`PrefixStore.apply_ops`, the ingest path):

- key table: our 64-bit key -> one uint64 source bitmask per (medium, 64-source word) in use (a
  GPU-only fleet of up to 64 sources: 16 bytes per slot). A count above one lives in the refs table
  (rare), keyed (key, source, medium).
- per source, an engine-hash table: vLLM's hash -> our key and the row's position in the source's
  insertion log (24 bytes per slot), so BlockRemoved (which carries only vLLM's hash) and the parent
  of the next BlockStored resolve to our key. A mapping lives while the source holds the key on some
  medium. The log (8 bytes per mapping) gives the eviction order.

About 100 bytes per residency at 1M residencies over 8 sources (the dict store,
:mod:`index.store_dict`, ~190). The semantics are the dict store's, operation for operation
(tests/test_index_compact.py compares the two on random interleavings).

Threads: writes come from one thread (the subscriber), lookups from the router's event loop. The
kernels that change the key table, and the lookup, hold the GIL, so each runs whole with respect to
the other thread, as one dict operation did: a lookup sees the tables between two events and never
a row mid-move. A rebuild fills new arrays without the GIL (nothing changes the published ones
meanwhile) and publishes them with one attribute store of a tuple (table, shift, column layout),
which a lookup reads once; clearing or dropping a source holds the GIL in slices, and a run of
events in calls of at most 4,096 blocks (~1 ms). Media are registered by the writer (ingest does).
See :mod:`index.table`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from index import table as tb

SourceId = tuple[str, int]
"""(instance name, DP rank)."""

MEDIA = ("GPU", "CPU", "STORAGE")

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

_MIN_CAP = 64
_REBUILD_LOAD = 0.625  # a rebuilt table is the smallest power of two at or below this load
_SLICE = 1 << 16  # engine-hash rows per kernel call when clearing or dropping a source (~10 ms)
_OPS_BUDGET = 4096  # blocks per apply_ops kernel call (~1 ms holding the GIL)
OP_STORE = tb.OP_STORE
OP_REMOVE = tb.OP_REMOVE


class SourceMatch(msgspec.Struct, gc=False):
    """How much of a prompt one source holds: the longest consecutive prefix, by medium.

    ``by_medium[m]`` counts the matched blocks whose best medium is ``m`` (GPU before CPU before
    STORAGE), so the values add up to ``blocks``.
    """

    source: SourceId
    blocks: int
    by_medium: dict[str, int]


class SourceCounts(msgspec.Struct):
    """Residencies a source holds per medium, and the housekeeping counters of the store."""

    source: SourceId
    blocks: dict[str, int]
    unknown_removes: int
    evicted: int


_UINT64 = np.dtype(np.uint64)


def _u64(values: Sequence[int] | U64) -> U64:
    """Hashes or keys as a uint64 array (``fromiter``: the fastest conversion of a list of ints)."""
    if type(values) is np.ndarray and values.dtype is _UINT64:
        return values  # the common case (slices of the ingestor's arrays), without a call into numpy
    if isinstance(values, np.ndarray):
        return values.astype(np.uint64, copy=False)
    return np.fromiter(values, np.uint64, len(values))


def _full(used: int, cap: int) -> bool:
    """Past the 3/4 load a table may reach (the store kernel's test, in the same integers)."""
    return used * 4 > cap * 3


def _cap_for(rows: int) -> int:
    cap = _MIN_CAP
    while rows > cap * _REBUILD_LOAD:
        cap *= 2
    return cap


class _Source:
    """One source's engine-hash table, insertion log and counters (touched by the writer only)."""

    __slots__ = ("cnt", "em", "eshift", "log", "ss")

    def __init__(self, media: int) -> None:
        self.em: U64 = np.zeros((_MIN_CAP, 3), dtype=np.uint64)
        self.eshift = tb.shift_of(_MIN_CAP)
        self.log: U64 = np.zeros(256, dtype=np.uint64)
        self.ss: I64 = np.zeros(tb.S_SIZE, dtype=np.int64)
        self.cnt: I64 = np.zeros(max(8, media), dtype=np.int64)

    def reset_map(self) -> None:
        """An empty engine-hash table and log (after a restart)."""
        self.em = np.zeros((_MIN_CAP, 3), dtype=np.uint64)
        self.eshift = tb.shift_of(_MIN_CAP)
        self.log = np.zeros(256, dtype=np.uint64)
        for i in (tb.S_EM_LIVE, tb.S_HEAD, tb.S_TAIL):
            self.ss[i] = 0

    def room(self, n: int) -> None:
        """Make room for ``n`` new mappings (rebuild the table, compact or grow the log)."""
        ss = self.ss
        if _full(int(ss[tb.S_EM_LIVE]) + n, len(self.em)):
            new = np.zeros((_cap_for(int(ss[tb.S_EM_LIVE]) + n), 3), dtype=np.uint64)
            tb.em_rebuild(self.em, new)
            self.em, self.eshift = new, tb.shift_of(len(new))
        if int(ss[tb.S_TAIL]) + n > len(self.log):
            need = int(ss[tb.S_EM_LIVE]) + n
            size = len(self.log) if need <= len(self.log) * 0.75 else need + need // 2 + 256
            new_log = np.zeros(size, dtype=np.uint64)
            tb.log_compact(self.em, self.log, ss, new_log)
            self.log = new_log


@functools.cache
def _warm_up() -> None:
    """Every kernel once, with the argument types of real calls (see :class:`PrefixStore`); once
    per process, as the dispatchers keep what they compiled or loaded."""
    st = PrefixStore(2, warm=False)
    a, b = st.add_source(("a", 0)), st.add_source(("b", 0))
    cpu = st.medium_index("CPU")
    st.store(a, 0, [1, 2, 3], [10, 10, 11])
    st.refcount(a, 10)
    st.store(a, 0, [1], [12])  # remap, then the cap evicts
    st.store(b, cpu, np.array([4], dtype=np.uint64), np.array([10], dtype=np.uint64))
    st.store(b, 0, list(range(100, 400)), list(range(300)))  # rebuilds, log compaction
    ops = np.array([[OP_STORE, cpu, 0, 2], [OP_REMOVE, 0, 0, 1], [OP_STORE, 0, 2, 1]], dtype=np.int64)
    hashes = np.array([7, 8, 9], dtype=np.uint64)
    st.apply_ops(a, ops, hashes, np.array([20, 21, 22], dtype=np.uint64), hashes[:1])
    st.lookup([10, 11], [a, b])
    st.lookup(np.array([10], dtype=np.uint64), [a])
    st.key_of(a, 1)
    st.remove(a, 0, [2, 3, 9])
    st.clear(b, "CPU")
    st.drop(b)


class PrefixStore:
    """Residencies and reference counts; knows nothing of wire formats, keys' origin or HTTP."""

    def __init__(self, max_residencies: int = 20_000_000, *, warm: bool = True) -> None:
        """``warm``: run every kernel once on a throwaway store, so that numba compiles (first run
        without a cache, ~10 s) or loads (~0.2 s) them here, at startup, not on the first event or
        the first request (compiling holds the GIL); once per process."""
        if max_residencies < 1:
            raise ValueError("max_residencies must be positive")
        self._g: I64 = np.zeros(tb.G_SIZE, dtype=np.int64)
        self.max_residencies = max_residencies
        self._media_names: list[str] = list(MEDIA)
        col_of = np.full((len(MEDIA), 1), -1, dtype=np.int64)
        col_of[0, 0] = 1  # GPU, sources 0..63: column 1 (column 0 holds the key)
        kt = np.zeros((_MIN_CAP, 2), dtype=np.uint64)
        self._kts: tuple[U64, np.uint64, I64] = (kt, tb.shift_of(_MIN_CAP), col_of)
        self._rts: tuple[U64, np.uint64] = (np.zeros((_MIN_CAP, 3), np.uint64), tb.shift_of(_MIN_CAP))
        self._srcs: list[_Source] = []
        self._sources: list[SourceId | None] = []
        self._index_of: dict[SourceId, int] = {}
        if warm:
            _warm_up()

    @property
    def max_residencies(self) -> int:
        """The cap on residencies: beyond it, the oldest blocks of the largest source go."""
        return int(self._g[tb.G_MAX])

    @max_residencies.setter
    def max_residencies(self, value: int) -> None:
        self._g[tb.G_MAX] = value

    @property
    def total(self) -> int:
        """Residencies held (all sources, all media)."""
        return int(self._g[tb.G_TOTAL])

    @property
    def evictions(self) -> int:
        """Residencies evicted because the cap bit."""
        return int(self._g[tb.G_EVICTIONS])

    # --- sources -------------------------------------------------------------------------------
    def add_source(self, source: SourceId) -> int:
        """Register a source and return its dense index (reusing a freed slot)."""
        if source in self._index_of:
            return self._index_of[source]
        try:
            idx = self._sources.index(None)
        except ValueError:
            idx = len(self._sources)
            self._sources.append(None)
            self._srcs.append(_Source(len(self._media_names)))
            kt, shift, col_of = self._kts
            if idx >> 6 >= col_of.shape[1]:  # every kernel may index the source's word
                wider = np.full((col_of.shape[0], (idx >> 6) + 1), -1, dtype=np.int64)
                wider[:, : col_of.shape[1]] = col_of
                self._kts = (kt, shift, wider)
        self._sources[idx] = source
        self._index_of[source] = idx
        return idx

    def remove_source(self, source: SourceId) -> None:
        """Forget a source entirely (its residencies first)."""
        idx = self._index_of.pop(source, None)
        if idx is None:
            return
        self.drop(idx)
        self._sources[idx] = None
        ss = self._srcs[idx].ss
        ss[tb.S_UNKNOWN] = 0
        ss[tb.S_EVICTED] = 0

    def source_index(self, source: SourceId) -> int | None:
        """Dense index of a registered source."""
        return self._index_of.get(source)

    def sources(self) -> list[SourceId]:
        """Registered sources, in index order."""
        return [s for s in self._sources if s is not None]

    def medium_index(self, medium: str) -> int:
        """Index of a medium name, registering names beyond GPU/CPU/STORAGE on first use."""
        try:
            return self._media_names.index(medium)
        except ValueError:
            m = len(self._media_names)
            for src in self._srcs:
                if len(src.cnt) <= m:
                    cnt = np.zeros(2 * (m + 1), dtype=np.int64)
                    cnt[: len(src.cnt)] = src.cnt
                    src.cnt = cnt
            kt, shift, col_of = self._kts
            taller = np.full((m + 1, col_of.shape[1]), -1, dtype=np.int64)
            taller[:m] = col_of
            self._kts = (kt, shift, taller)
            self._media_names.append(medium)
            return m

    # --- writes (one writer thread) -----------------------------------------------------------
    def key_of(self, sidx: int, engine_hash: int) -> int | None:
        """Our key for a source's engine hash, if that source still holds the block somewhere."""
        src = self._srcs[sidx]
        em = src.em
        i = tb.em_find(em, src.eshift, np.uint64(engine_hash))
        return None if i < 0 else int(em[i, 1])

    def _room(self, sidx: int, midx: int, n: int) -> None:
        """Columns and free rows for a store of ``n`` blocks (rebuilds publish new tables)."""
        kt, _, col_of = self._kts
        w = sidx >> 6
        g = self._g
        if col_of[midx, w] < 0:
            col_of = col_of.copy()
            col_of[midx, w] = kt.shape[1]
            self._rebuild_kt(kt.shape[1] + 1, col_of, n)
        elif _full(int(g[tb.G_KT_LIVE]) + n, len(kt)):
            self._rebuild_kt(kt.shape[1], col_of, n)
        rt, _ = self._rts
        if _full(int(g[tb.G_RT_USED]) + n, len(rt)):
            new = np.zeros((_cap_for(int(g[tb.G_RT_LIVE]) + n), 3), dtype=np.uint64)
            tb.rt_rebuild(rt, new)
            self._rts = (new, tb.shift_of(len(new)))
            g[tb.G_RT_USED] = g[tb.G_RT_LIVE]
        self._srcs[sidx].room(n)

    def _rebuild_kt(self, width: int, col_of: I64, n: int) -> None:
        kt = self._kts[0]
        g = self._g
        new = np.zeros((_cap_for(int(g[tb.G_KT_LIVE]) + n), width), dtype=np.uint64)
        tb.kt_rebuild(kt, new, np.arange(kt.shape[1], dtype=np.int64))
        self._kts = (new, tb.shift_of(len(new)), col_of)

    def store(
        self, sidx: int, midx: int, engine_hashes: Sequence[int] | U64, keys: Sequence[int] | U64
    ) -> None:
        """Add one reference per (engine hash, key) pair to the source's residency on a medium.

        A hash already mapped to another key (its parent became known) retires the old key's
        residencies first, so nothing stale survives.
        """
        n = len(keys)
        if len(engine_hashes) != n:
            raise ValueError("one key per engine hash")
        ehs = _u64(engine_hashes)
        ks = _u64(keys)
        src = self._srcs[sidx]
        while True:
            kt, kshift, col_of = self._kts
            rt, rshift = self._rts
            over = tb.store_event(
                kt, kshift, col_of, self._g, rt, rshift, src.em, src.eshift, src.log, src.ss, src.cnt,
                sidx, midx, ehs, ks,
            )  # fmt: skip
            if over >= 0:
                break
            self._room(sidx, midx, n)
        if over:
            self._evict()

    def apply_ops(self, sidx: int, ops: I64, ehs: U64, keys: U64, rems: U64) -> None:
        """A run of one source's events, in order, as :meth:`store` and :meth:`remove` one by one
        would apply them (the same kernels, called from one compiled loop: no Python per event).

        ``ops`` is ``int64[n, 4]``, one row per event: (:data:`OP_STORE`, medium index, first, count)
        stores ``ehs[first:first+count]`` with ``keys[first:first+count]``, (:data:`OP_REMOVE`,
        medium index, first, count) removes ``rems[first:first+count]``. The arrays must be
        C-contiguous (one compiled version of the kernel).
        """
        j = 0
        n = len(ops)
        while j < n:
            src = self._srcs[sidx]  # (re-read: making room replaces its arrays)
            kt, kshift, col_of = self._kts
            rt, rshift = self._rts
            j, status = tb.apply_ops(
                kt, kshift, col_of, self._g, rt, rshift, src.em, src.eshift, src.log, src.ss, src.cnt,
                sidx, ops, ehs, keys, rems, j, _OPS_BUDGET,
            )  # fmt: skip
            if status < 0:
                self._room(sidx, int(ops[j, 1]), int(ops[j, 3]))
            elif status > 0:
                self._evict()

    def remove(self, sidx: int, midx: int, engine_hashes: Sequence[int] | U64) -> int:
        """Drop one reference per engine hash; returns how many residencies ended."""
        kt, kshift, col_of = self._kts
        rt, rshift = self._rts
        src = self._srcs[sidx]
        ended: int = tb.remove_event(
            kt, kshift, col_of, self._g, rt, rshift, src.em, src.eshift, src.ss, src.cnt, sidx, midx,
            _u64(engine_hashes),
        )  # fmt: skip
        return ended

    def clear(self, sidx: int, medium: str = "GPU") -> int:
        """Wipe a source's residencies on one medium (AllBlocksCleared); returns how many."""
        midx = self.medium_index(medium)
        src = self._srcs[sidx]
        ended = 0
        i = 0
        while i < len(src.em):  # in slices: the interpreter may switch threads between them
            kt, kshift, col_of = self._kts
            i, n = tb.clear_rows(
                kt,
                kshift,
                col_of,
                self._g,
                src.em,
                src.eshift,
                src.ss,
                sidx,
                midx,
                i,
                min(i + _SLICE, len(src.em)),
            )
            ended += n
        tb.drop_refs(self._rts[0], self._g, src.ss, sidx, midx)
        src.cnt[midx] = 0
        return ended

    def drop(self, sidx: int) -> int:
        """Wipe every residency of a source (engine restart); returns how many."""
        src = self._srcs[sidx]
        ended = 0
        for i in range(0, len(src.em), _SLICE):
            kt, kshift, col_of = self._kts
            ended += tb.drop_rows(kt, kshift, col_of, self._g, src.em, sidx, i, min(i + _SLICE, len(src.em)))
        tb.drop_refs(self._rts[0], self._g, src.ss, sidx, -1)
        src.cnt[:] = 0
        src.reset_map()
        return ended

    def _evict(self) -> None:
        """Over the cap: drop the oldest 1% of the largest source's blocks (all media)."""
        live = [int(src.ss[tb.S_EM_LIVE]) for src in self._srcs]
        sidx = max(range(len(live)), key=live.__getitem__)
        n = max(1, live[sidx] // 100, self.total - self.max_residencies)
        kt, kshift, col_of = self._kts
        rt, rshift = self._rts
        src = self._srcs[sidx]
        gone = tb.evict_oldest(
            kt, kshift, col_of, self._g, rt, rshift, src.em, src.eshift, src.log, src.ss, src.cnt, sidx, n
        )
        self._g[tb.G_EVICTIONS] += gone
        src.ss[tb.S_EVICTED] += gone

    # --- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int] | U64, candidates: Sequence[int]) -> list[SourceMatch]:
        """Longest consecutive prefix of ``keys`` held by each candidate source (any medium).

        One compiled pass over the prompt's keys with bitmask arithmetic: O(prompt blocks),
        independent of the fleet size for fleets whose masks fit a machine word; it stops at the
        first block no candidate holds.
        """
        kt, kshift, col_of = self._kts  # one consistent snapshot (see the module docstring)
        cands = np.array(candidates, dtype=np.int64)
        blocks = np.empty(len(cands), dtype=np.int64)
        off = np.zeros((len(cands), col_of.shape[0]), dtype=np.int64)
        any_off = tb.lookup_prefix(kt, kshift, col_of, cands, _u64(keys), blocks, off)
        sources = self._sources
        if not any_off:  # the common case: one comprehension, no per-medium work
            return [
                SourceMatch(source, b, {"GPU": b})
                for source, b in zip(map(sources.__getitem__, candidates), blocks.tolist(), strict=True)
                if source is not None
            ]
        names = self._media_names
        out = []
        offs = off.tolist()
        for i, (sidx, b) in enumerate(zip(candidates, blocks.tolist(), strict=True)):
            source = sources[sidx]
            if source is None:
                continue
            by_medium = {"GPU": b}
            for midx, c in enumerate(offs[i]):
                if c:
                    by_medium[names[midx]] = c
                    by_medium["GPU"] -= c
            out.append(SourceMatch(source, b, by_medium))
        return out

    def _row(self, key: int) -> tuple[U64, I64, int]:
        kt, kshift, col_of = self._kts
        return kt, col_of, tb.kt_find(kt, kshift, np.uint64(key))

    def holders(self, key: int) -> dict[SourceId, list[str]]:
        """Which sources hold one key, on which media (debugging and tests)."""
        out: dict[SourceId, list[str]] = {}
        kt, col_of, r = self._row(key)
        if r < 0:
            return out
        for midx in range(col_of.shape[0]):
            for w in range(col_of.shape[1]):
                c = col_of[midx, w]
                mask = int(kt[r, c]) if c >= 0 else 0
                while mask:
                    low = mask & -mask
                    sidx = (w << 6) + low.bit_length() - 1
                    source = self._sources[sidx] if sidx < len(self._sources) else None
                    if source is not None:
                        out.setdefault(source, []).append(self._media_names[midx])
                    mask ^= low
        return out

    def refcount(self, sidx: int, key: int, medium: str = "GPU") -> int:
        """The reference count of one residency (0 when absent)."""
        midx = self.medium_index(medium)
        kt, col_of, r = self._row(key)
        c = col_of[midx, sidx >> 6]
        if r < 0 or c < 0 or not int(kt[r, c]) >> (sidx & 63) & 1:
            return 0
        rt, rshift = self._rts
        q = tb.rt_find(rt, rshift, np.uint64(key), np.uint64((sidx + 1) << 16 | midx))
        return 1 + (int(rt[q, 2]) if q >= 0 else 0)

    def counts(self) -> list[SourceCounts]:
        """Per-source residency counts by medium, for status pages and metrics."""
        out = []
        for sidx, source in enumerate(self._sources):
            if source is None:
                continue
            ss = self._srcs[sidx].ss
            out.append(
                SourceCounts(source, self.source_blocks(sidx), int(ss[tb.S_UNKNOWN]), int(ss[tb.S_EVICTED]))
            )
        return out

    def source_blocks(self, sidx: int) -> dict[str, int]:
        """Residencies of one source by medium."""
        cnt = self._srcs[sidx].cnt.tolist()
        return {name: cnt[midx] for midx, name in enumerate(self._media_names) if cnt[midx] or name == "GPU"}

    @property
    def nbytes(self) -> int:
        """Bytes held by the store's arrays."""
        n = self._kts[0].nbytes + self._rts[0].nbytes
        return n + sum(src.em.nbytes + src.log.nbytes for src in self._srcs)

    # --- plain views, for tests and debugging (O(size)) -----------------------------------------
    @property
    def _media(self) -> list[dict[int, int]]:
        """Per medium, key -> mask of the sources holding it there."""
        kt, _, col_of = self._kts
        out: list[dict[int, int]] = [{} for _ in self._media_names]
        rows = kt[kt[:, 1:].any(axis=1)].tolist()
        for row in rows:
            for midx in range(col_of.shape[0]):
                mask = 0
                for w in range(col_of.shape[1]):
                    c = int(col_of[midx, w])
                    if c >= 0 and row[c]:
                        mask |= row[c] << (64 * w)
                if mask:
                    out[midx][row[0]] = mask
        return out

    @property
    def _emaps(self) -> list[dict[int, int]]:
        """Per source, engine hash -> key, in insertion order (the eviction order)."""
        out: list[dict[int, int]] = []
        for src in self._srcs:
            d: dict[int, int] = {}
            ss = src.ss
            for p in range(int(ss[tb.S_HEAD]), int(ss[tb.S_TAIL])):
                eh = int(src.log[p])
                i = tb.em_find(src.em, src.eshift, np.uint64(eh))
                if i >= 0 and int(src.em[i, 2]) == p + 2:
                    d[eh] = int(src.em[i, 1])
            out.append(d)
        return out

    @property
    def _refs(self) -> dict[tuple[int, int, int], int]:
        """(key, source, medium) -> references above one."""
        rt = self._rts[0]
        out = {}
        for key, tag, count in rt[rt[:, 1] >= 2].tolist():
            out[key, (tag >> 16) - 1, tag & 0xFFFF] = count
        return out
