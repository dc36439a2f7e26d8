"""The reference-counted prefix store: block key -> which sources hold it, on which medium.

A *source* is one event stream: (instance, DP rank). A *residency* is (key, source, medium), with a
reference count: vLLM's GPU pool can hold two blocks with one hash, and the CPU offloading connector
re-announces shared hashes once per chunk and removes them the same way, so a residency ends only
when its count reaches zero.

The tables live in a compiled C object (:mod:`index._kvcore`, ``index/_kvcore.c``, built at install
time by the package's own build, so nothing compiles at start-up); this class keeps the names
(sources, media) and converts to and from Python values. Layout:

- key table: our 64-bit key -> its holders, (source, medium) pairs: up to three inline, more in a
  sparse bitmap of 64-source words (16 bytes per slot at any number of sources; index/README.md). A
  count above one lives in the refs table (rare), keyed (key, source, medium).
- per source, an engine-hash table: vLLM's hash -> our key and the row's position in the source's
  insertion log (24 bytes per slot), so BlockRemoved (which carries only vLLM's hash) and the parent
  of the next BlockStored resolve to our key. A mapping lives while the source holds the key on some
  medium. The log (8 bytes per mapping) gives the eviction order.

The semantics are the dict store's (:mod:`index.store_dict`), operation for operation
(tests/index/test_index_compact.py compares the two on random interleavings).

Threads: one writer (the subscriber thread), lookups from any thread. Writes run with the GIL
released and change the tables under the core's own lock one event at a time (a clear or a drop in
slices of 4,096 rows); a lookup holds that lock for its probe loop, so it sees whole events only, and
the writer never holds the GIL and the lock at once. Tables grow by building new ones beside the old
(outside the lock) and swapping them in; they shrink when mostly empty, and dropped sources' tables
are freed, so memory goes back to the OS (large tables are mmap'ed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import index._kvcore as _kvcore
from index.keys import BASE_ROOT

SourceId = tuple[str, int]
"""(instance name, DP rank)."""

MEDIA = ("GPU", "CPU", "STORAGE")
MAX_MEDIA: int = _kvcore.MAX_MEDIA
"""Medium names a store registers at most (the three above included)."""
MAX_MEDIUM_NAME = 31
"""Bytes (UTF-8) of a medium name, at most."""

OP_STORE = 0
OP_REMOVE = 1
OP_STORE_KEEP = 2
"""A store whose engine hashes keep the key they already resolve to (a sliding-window or Mamba KV
cache group's event: its chain may be uncertain, the full-attention group's is not)."""


def group_medium(medium: str, group: int | None) -> str:
    """The medium name a KV cache group's residencies are kept under: the medium itself for the
    first group (a one-group engine's only one), ``GPU#1`` for group 1 on GPU, and so on. Groups of a
    hybrid model hold different blocks (a sliding-window group only the window's tail, a Mamba group
    only the states it saved), so each needs residencies of its own."""
    return medium if not group else f"{medium}#{group}"


class GroupMatch(msgspec.Struct, gc=False):
    """What one KV cache group of a hybrid model allows of a prompt's prefix (``/route`` shows it)."""

    group: int
    kind: str
    """``full_attention``, ``sliding_window`` or ``mamba`` (the rule applied; an unknown kind is
    matched as full attention: the strictest rule, never more than the engine would serve)."""
    blocks: int
    """The longest prefix this group alone would serve (within the full-attention groups' prefix)."""
    window: int | None = None


class SourceMatch(msgspec.Struct, gc=False):
    """How much of a prompt one source holds: the longest consecutive prefix, by medium.

    ``by_medium[m]`` counts the matched blocks whose best medium is ``m`` (GPU before CPU before
    STORAGE), so the values add up to ``blocks``.
    """

    source: SourceId
    blocks: int
    by_medium: dict[str, int]
    groups: list[GroupMatch] | None = None
    """A hybrid model's KV cache groups (None for one group): what each allows; ``blocks`` is the
    longest prefix all of them serve, as vLLM's hybrid coordinator computes it."""


class SourceCounts(msgspec.Struct):
    """Residencies a source holds per medium, and the housekeeping counters of the store."""

    source: SourceId
    blocks: dict[str, int]
    unknown_removes: int
    evicted: int


class PrefixStore:
    """Residencies and reference counts; knows nothing of wire formats, keys' origin or HTTP."""

    def __init__(self, max_residencies: int = 20_000_000, *, warm: bool = True) -> None:
        """``warm`` is accepted for compatibility (nothing is compiled at run time any more)."""
        if max_residencies < 1:
            raise ValueError("max_residencies must be positive")
        self._core = _kvcore.Store(max_residencies, BASE_ROOT)
        self._media_names: list[str] = list(MEDIA)
        self._families: list[int] = list(range(len(MEDIA)))
        self._sources: list[SourceId | None] = []
        self._index_of: dict[SourceId, int] = {}
        self.generation = 0
        """Bumped when a source is registered or unregistered (readers cache source indices)."""
        self._retiring: set[int] = set()
        """Slots detached from their source whose residencies are not dropped yet: not reused, so a
        source that comes back under the same id meanwhile gets a fresh slot, not the old blocks."""

    @property
    def core(self) -> Any:
        """The compiled store (:mod:`index._kvcore`): the ingest path calls it directly."""
        return self._core

    @property
    def max_residencies(self) -> int:
        """The cap on residencies: beyond it, the oldest blocks of the largest source go."""
        return int(self._core.max_residencies)

    @max_residencies.setter
    def max_residencies(self, value: int) -> None:
        self._core.max_residencies = value

    @property
    def total(self) -> int:
        """Residencies held (all sources, all media)."""
        return int(self._core.total)

    @property
    def evictions(self) -> int:
        """Residencies evicted because the cap bit."""
        return int(self._core.evictions)

    # --- sources -------------------------------------------------------------------------------
    def add_source(self, source: SourceId) -> int:
        """Register a source and return its dense index (reusing a freed slot: slots, and so mask
        bits, do not grow while sources come and go)."""
        if source in self._index_of:
            return self._index_of[source]
        free = [i for i, s in enumerate(self._sources) if s is None and i not in self._retiring]
        if free:
            idx = free[0]
        else:
            idx = int(self._core.new_slot())
            self._sources.append(None)
        self._sources[idx] = source
        self._index_of[source] = idx
        self.generation += 1
        return idx

    def remove_source(self, source: SourceId) -> None:
        """Forget a source entirely: its residencies go (in slices; lookups go on meanwhile) and its
        tables are freed."""
        idx = self.detach(source)
        if idx is not None:
            self.release(idx)

    def detach(self, source: SourceId) -> int | None:
        """Unregister a source at once (lookups stop seeing it; its id is free to register again)
        and return its slot, which keeps its residencies until :meth:`release`. Splitting the two
        lets the ingest thread drop the blocks in stream order while the control thread re-adds a
        source of the same id (a pod recreated under its name) without the two colliding."""
        idx = self._index_of.pop(source, None)
        if idx is None:
            return None
        self._sources[idx] = None
        self._retiring.add(idx)
        self.generation += 1
        return idx

    def release(self, idx: int) -> None:
        """Drop a detached slot's residencies and make the slot reusable."""
        self.drop(idx)
        self._core.reset_counters(idx)
        self._retiring.discard(idx)

    def source_of(self, idx: int) -> SourceId | None:
        """The source registered in a slot (None when free or retiring)."""
        return self._sources[idx] if 0 <= idx < len(self._sources) else None

    def source_index(self, source: SourceId) -> int | None:
        """Dense index of a registered source."""
        return self._index_of.get(source)

    def sources(self) -> list[SourceId]:
        """Registered sources, in index order."""
        return [s for s in self._sources if s is not None]

    def medium_index(self, medium: str) -> int:
        """Index of a medium name, registering names beyond GPU/CPU/STORAGE on first use (at most
        :data:`index._kvcore.MAX_MEDIA`; ValueError beyond). A KV cache group's name
        (:func:`group_medium`, ``GPU#1``) belongs to its medium's family: a clear of the medium
        clears it too."""
        try:
            return self._media_names.index(medium)
        except ValueError:
            base, sep, _ = medium.partition("#")
            family = self.medium_index(base) if sep and base else -1
            m = int(self._core.add_medium(medium.encode(), family))
            self._media_names.append(medium)
            self._families.append(m if family < 0 else family)
            return m

    def medium_lookup(self, medium: str) -> int | None:
        """Index of a medium name already registered; None when it is not (registers nothing: safe
        from the request path while the ingest thread registers names)."""
        names = self._media_names
        return names.index(medium) if medium in names else None

    def family_of(self, midx: int) -> int:
        """The medium a medium index belongs to (its own for GPU, CPU, STORAGE and other names)."""
        return self._families[midx]

    # --- writes (one writer thread) -----------------------------------------------------------
    def key_of(self, sidx: int, engine_hash: int) -> int | None:
        """Our key for a source's engine hash, if that source still holds the block somewhere."""
        key: int | None = self._core.key_of(sidx, engine_hash)
        return key

    def store(
        self,
        sidx: int,
        midx: int,
        engine_hashes: Sequence[int] | Any,
        keys: Sequence[int] | Any,
        keep: bool = False,
    ) -> None:
        """Add one reference per (engine hash, key) pair to the source's residency on a medium.

        A hash already mapped to another key (its parent became known) moves the old key's
        residencies, with their counts, to the new key: they are the same engine blocks. With
        ``keep`` (:data:`OP_STORE_KEEP`) a hash already mapped keeps its key instead.
        """
        self._core.store(sidx, midx, engine_hashes, keys, keep)

    def apply_ops(self, sidx: int, ops: Any, ehs: Any, keys: Any, rems: Any) -> None:
        """A run of one source's events, in order, as :meth:`store` and :meth:`remove` one by one
        would apply them, in one call.

        ``ops`` is an int64 array ``[n, 4 or more]``, one row per event: (:data:`OP_STORE`, medium
        index, first, count) stores ``ehs[first:first+count]`` with ``keys[first:first+count]``
        (:data:`OP_STORE_KEEP`: with ``keep``), (:data:`OP_REMOVE`, medium index, first, count)
        removes ``rems[first:first+count]``.
        """
        self._core.apply_ops(sidx, ops, int(ops.shape[1]), ehs, keys, rems)

    def remove(self, sidx: int, midx: int, engine_hashes: Sequence[int] | Any) -> int:
        """Drop one reference per engine hash; returns how many residencies ended."""
        ended: int = self._core.remove(sidx, midx, engine_hashes)
        return ended

    def clear(self, sidx: int, medium: str = "GPU") -> int:
        """Wipe a source's residencies on one medium (AllBlocksCleared): every KV cache group's on
        that medium; returns how many."""
        family = self.medium_index(medium)
        counts = self._core.source_info(sidx)[0]
        ended = 0
        for midx, fam in enumerate(self._families):
            if fam == family and (midx == family or counts[midx]):
                ended += int(self._core.clear(sidx, midx))
        return ended

    def drop(self, sidx: int) -> int:
        """Wipe every residency of a source (engine restart); returns how many."""
        ended: int = self._core.drop(sidx)
        return ended

    # --- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int] | Any, candidates: Sequence[int]) -> list[SourceMatch]:
        """Longest consecutive prefix of ``keys`` held by each candidate source (any medium).

        One compiled pass over the prompt's keys with bitmask arithmetic: O(prompt blocks),
        independent of the fleet size for fleets whose masks fit a machine word; it stops at the
        first block no candidate holds. ``keys``: a sequence of ints or a buffer of uint64.
        """
        blocks, offs = self._core.lookup(keys, candidates)
        sources = self._sources
        nsrc = len(sources)
        if offs is None:  # the common case: one comprehension, no per-medium work
            return [
                SourceMatch(source, b, {"GPU": b})
                for sidx, b in zip(candidates, blocks, strict=True)
                if sidx < nsrc and (source := sources[sidx]) is not None
            ]
        out = []
        for sidx, b, off in zip(candidates, blocks, offs, strict=True):
            source = sources[sidx] if sidx < nsrc else None
            if source is None:
                continue
            out.append(SourceMatch(source, b, self._by_medium(b, off)))
        return out

    def _by_medium(self, blocks: int, off: Sequence[int]) -> dict[str, int]:
        """A match's blocks by medium from the lookup's per-medium counts (GPU keeps the rest)."""
        names = self._media_names
        by_medium = {"GPU": blocks}
        for midx, c in enumerate(off):
            if c:
                by_medium[names[midx]] = c
                by_medium["GPU"] -= c
        return by_medium

    def lookup_counts(
        self, keys: Sequence[int] | Any, candidates: Sequence[int]
    ) -> tuple[list[int], list[dict[str, int] | None] | None]:
        """:meth:`lookup` as lists aligned with ``candidates``: blocks (-1 for a source removed
        meanwhile) and, when some block is on another medium than GPU, each one's blocks by medium
        (None where all are on GPU). No :class:`SourceMatch` objects (``/route``'s fast path)."""
        blocks, offs = self._core.lookup(keys, candidates)
        sources = self._sources
        nsrc = len(sources)
        for j, sidx in enumerate(candidates):
            if sidx >= nsrc or sources[sidx] is None:
                blocks[j] = -1
        if offs is None:
            return blocks, None
        media = [self._by_medium(b, off) if any(off) else None for b, off in zip(blocks, offs, strict=True)]
        return blocks, media

    def group_bits(
        self, keys: Sequence[int] | Any, sidx: int, media: Sequence[int], need: int, limit: int
    ) -> list[int]:
        """Per prompt block from the first, which of ``media`` (a KV cache group's medium index
        each) the source holds it on, as a bitmask; at most ``limit`` blocks, and none past the
        first block lacking one of the media in the mask ``need``."""
        bits: list[int] = self._core.group_bits(keys, sidx, media, need, limit)
        return bits

    def watch(self, sidx: int, on: bool) -> None:
        """Record (or stop recording) the keys a source stores and removes: :meth:`take_touched`."""
        self._core.watch(sidx, on)

    def take_touched(self) -> list[tuple[int, bytes, bool]]:
        """(source index, uint64 keys, overflowed) of the watched sources that stored or removed
        blocks since the last call; overflowed: more than could be recorded (all of them count)."""
        out: list[tuple[int, bytes, bool]] = self._core.take_touched()
        return out

    def holders(self, key: int) -> dict[SourceId, list[str]]:
        """Which sources hold one key, on which media (debugging and tests)."""
        out: dict[SourceId, list[str]] = {}
        for midx, sidx in self._core.holders(key):
            source = self._sources[sidx] if sidx < len(self._sources) else None
            if source is not None:
                out.setdefault(source, []).append(self._media_names[midx])
        return out

    def refcount(self, sidx: int, key: int, medium: str = "GPU") -> int:
        """The reference count of one residency (0 when absent)."""
        count: int = self._core.refcount(sidx, key, self.medium_index(medium))
        return count

    def counts(self) -> list[SourceCounts]:
        """Per-source residency counts by medium, for status pages and metrics."""
        out = []
        for sidx, source in enumerate(self._sources):
            if source is None:
                continue
            _, unknown, evicted, _ = self._core.source_info(sidx)
            out.append(SourceCounts(source, self.source_blocks(sidx), unknown, evicted))
        return out

    def source_blocks(self, sidx: int) -> dict[str, int]:
        """Residencies of one source by medium."""
        cnt = self._core.source_info(sidx)[0]
        return {name: cnt[midx] for midx, name in enumerate(self._media_names) if cnt[midx] or name == "GPU"}

    def source_keys(self, sidx: int) -> dict[str, set[int]]:
        """Every key one source holds, by medium (O(its blocks); tests and convergence checks)."""
        raw = self._core.source_keys(sidx)
        return {self._media_names[m]: set(keys) for m, keys in raw.items() if keys}

    @property
    def nbytes(self) -> int:
        """Bytes held by the store's tables."""
        n: int = self._core.nbytes()
        return n

    # --- plain views, for tests and debugging (O(size)) -----------------------------------------
    @property
    def _media(self) -> list[dict[int, int]]:
        """Per medium, key -> mask of the sources holding it there."""
        # optional: numpy only on the Python (reference) ingest path
        import numpy as np

        pairs = np.frombuffer(self._core.kt_view(), dtype=np.uint64).reshape(-1, 2).tolist()
        out: list[dict[int, int]] = [{} for _ in self._media_names]
        for key, holder in pairs:
            media = out[holder >> 12]
            media[key] = media.get(key, 0) | 1 << (holder & 0xFFF)
        return out

    @property
    def _emaps(self) -> list[dict[int, int]]:
        """Per source slot, engine hash -> key, in insertion order (the eviction order)."""
        # optional: numpy only on the Python (reference) ingest path
        import numpy as np

        out: list[dict[int, int]] = []
        for sidx in range(len(self._sources)):
            em_raw, log_raw, head, tail = self._core.em_view(sidx)
            em = np.frombuffer(em_raw, dtype=np.uint64).reshape(-1, 3)
            log = np.frombuffer(log_raw, dtype=np.uint64).tolist()
            by_state = {state: (eh, key) for eh, key, state in em[em[:, 2] >= 2].tolist()}
            d: dict[int, int] = {}
            for p in range(head, tail):
                row = by_state.get(p + 2)
                if row is not None and row[0] == log[p]:
                    d[row[0]] = row[1]
            out.append(d)
        return out

    @property
    def _refs(self) -> dict[tuple[int, int, int], int]:
        """(key, source, medium) -> references above one."""
        # optional: numpy only on the Python (reference) ingest path
        import numpy as np

        rt = np.frombuffer(self._core.rt_view(), dtype=np.uint64).reshape(-1, 3)
        out = {}
        for key, tag, count in rt[rt[:, 1] >= 2].tolist():
            out[key, (tag >> 16) - 1, tag & 0xFFFF] = count
        return out
