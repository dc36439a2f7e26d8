"""The dict-based prefix store, kept as the reference the compact store is checked against.

:class:`DictPrefixStore` is the store kvrouter used before :mod:`index.store` (compiled open-addressing
tables): the same public API and semantics, built on Python dicts (~190 bytes per residency). The
differential tests (tests/index/test_index_compact.py) drive both with the same operations and compare
every observable; ``bench/index_bench.py --store dict`` measures it.

A *source* is one event stream: (instance, DP rank). A *residency* is (key, source, medium), with a
reference count: vLLM's GPU pool can hold two blocks with one hash, and the CPU offloading connector
re-announces shared hashes once per chunk and removes them the same way, so a residency ends only
when its count reaches zero.

Layout (chosen for lookup speed and memory; see index/README.md for the complexity table):

- ``_media[m]``: ``dict[key, int]``, one per medium, the value a bitmask of the sources holding the key
  there. For fleets of up to 8 sources every mask is a small cached int, so a residency costs one
  dict slot. A count above one lives in ``_refs`` (rare), keyed ``(key, source, medium)``.
- ``_emaps[s]``: ``dict[engine hash, key]`` per source, so BlockRemoved (which carries only vLLM's
  hash) and the parent of the next BlockStored resolve to our key. An entry lives while the source
  holds the key on some medium.

Writes come from one thread (the subscriber); lookups from the router's event loop. Lookups only call
``dict.get``, which is atomic under the GIL, so no lock is needed: a lookup may see a batch half
applied, which only affects one routing decision.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from index.store import MAX_MEDIA, MAX_MEDIUM_NAME, MEDIA, SourceCounts, SourceId, SourceMatch


def _unset(media: dict[int, int], key: int, bit: int) -> bool:
    """Clear one source's bit for ``key`` on a medium (dropping the entry when no holder is left)."""
    held = media.get(key, 0)
    if not held & bit:
        return False
    rest = held & ~bit
    if rest:
        media[key] = rest
    else:
        del media[key]
    return True


class DictPrefixStore:
    """Residencies and reference counts; knows nothing of wire formats, keys' origin or HTTP."""

    def __init__(self, max_residencies: int = 20_000_000) -> None:
        if max_residencies < 1:
            raise ValueError("max_residencies must be positive")
        self.max_residencies = max_residencies
        self._media_names: list[str] = list(MEDIA)
        self._families: list[int] = list(range(len(MEDIA)))
        self._media: list[dict[int, int]] = [{} for _ in self._media_names]
        self._refs: dict[tuple[int, int, int], int] = {}
        self._refs_by_source: list[int] = []
        self._emaps: list[dict[int, int]] = []
        self._counts: list[list[int]] = []
        self._unknown_removes: list[int] = []
        self._evicted: list[int] = []
        self._sources: list[SourceId | None] = []
        self._index_of: dict[SourceId, int] = {}
        self._retiring: set[int] = set()
        self.total = 0
        self.evictions = 0

    # --- sources -------------------------------------------------------------------------------
    def add_source(self, source: SourceId) -> int:
        """Register a source and return its dense index (reusing a freed slot)."""
        if source in self._index_of:
            return self._index_of[source]
        free = [i for i, s in enumerate(self._sources) if s is None and i not in self._retiring]
        if free:
            idx = free[0]
        else:
            idx = len(self._sources)
            self._sources.append(None)
            self._emaps.append({})
            self._counts.append([0] * len(self._media))
            self._refs_by_source.append(0)
            self._unknown_removes.append(0)
            self._evicted.append(0)
        self._sources[idx] = source
        self._index_of[source] = idx
        return idx

    def remove_source(self, source: SourceId) -> None:
        """Forget a source entirely (its residencies first)."""
        idx = self.detach(source)
        if idx is not None:
            self.release(idx)

    def detach(self, source: SourceId) -> int | None:
        """Unregister a source at once, keeping its slot's residencies until :meth:`release` (the
        compact store's two-step removal, :meth:`index.store.PrefixStore.detach`)."""
        idx = self._index_of.pop(source, None)
        if idx is None:
            return None
        self._sources[idx] = None
        self._retiring.add(idx)
        return idx

    def release(self, idx: int) -> None:
        """Drop a detached slot's residencies and make the slot reusable."""
        self.drop(idx)
        self._unknown_removes[idx] = 0
        self._evicted[idx] = 0
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
        """Index of a medium name, registering names beyond GPU/CPU/STORAGE on first use (the compact
        store's limits: at most ``MAX_MEDIA`` names of at most ``MAX_MEDIUM_NAME`` bytes; ValueError
        beyond)."""
        try:
            return self._media_names.index(medium)
        except ValueError:
            if len(self._media_names) >= MAX_MEDIA or len(medium.encode()) > MAX_MEDIUM_NAME:
                raise ValueError("too many media, or a medium name over 31 bytes") from None
            base, sep, _ = medium.partition("#")
            family = self.medium_index(base) if sep and base else len(self._media_names)
            self._media_names.append(medium)
            self._families.append(family)
            self._media.append({})
            for counts in self._counts:
                counts.append(0)
            return len(self._media_names) - 1

    # --- writes (one writer thread) -----------------------------------------------------------
    def key_of(self, sidx: int, engine_hash: int) -> int | None:
        """Our key for a source's engine hash, if that source still holds the block somewhere."""
        return self._emaps[sidx].get(engine_hash)

    def store(
        self,
        sidx: int,
        midx: int,
        engine_hashes: Sequence[int],
        keys: Sequence[int] | npt.NDArray[np.uint64],
        keep: bool = False,
    ) -> None:
        """Add one reference per (engine hash, key) pair to the source's residency on a medium.

        Fast path (the common case: new blocks): the mappings are inserted with C-level bulk dict
        updates; only keys the medium already holds, or engine hashes already mapped, take the
        per-block path.
        """
        if isinstance(keys, np.ndarray):  # the ingestor hands over slices of its key array
            keys = keys.tolist()
        media = self._media[midx]
        emap = self._emaps[sidx]
        bit = 1 << sidx
        if len(engine_hashes) != len(keys):
            raise ValueError("one key per engine hash")
        if keep:  # every listing adds to the key its hash already resolves to, if any
            keys = [emap.setdefault(eh, key) for eh, key in zip(engine_hashes, keys, strict=True)]
        # one probe per block: setdefault inserts the new mappings (in order); when some hashes were
        # mapped already (the dict grew by less), the loop below settles every listing in order
        before = len(emap)
        remapped = False
        collections.deque(map(emap.setdefault, engine_hashes, keys), maxlen=0)
        if len(emap) - before != len(keys):
            for eh, key in zip(engine_hashes, keys, strict=True):
                current = emap[eh]  # not setdefault's answer: a hash listed twice may have moved on since
                if current != key:
                    # the same engine block now resolves to another key (its parent became known):
                    # its residencies, with their counts, move to that key
                    self._move(sidx, current, key)
                    emap[eh] = key
                    remapped = True
            if remapped:
                # a hash listed twice with different keys: its last listing decides; the others add
                # nothing (their key would be held with no engine hash leading to it, for good)
                keys = [key for eh, key in zip(engine_hashes, keys, strict=True) if emap[eh] == key]
        if media.keys().isdisjoint(keys):
            # all new: one bulk insert; a key listed twice in the event (the dict grew by less than
            # the list is long) gets one reference per extra listing, as the per-block path would
            before = len(media)
            media.update(zip(keys, itertools.repeat(bit)))
            added = len(media) - before
            if added != len(keys):
                for key, times in collections.Counter(keys).items():
                    if times > 1:
                        rk = (key, sidx, midx)
                        self._refs[rk] = self._refs.get(rk, 0) + times - 1
                        self._refs_by_source[sidx] += times - 1
        else:
            added = 0
            for key in keys:
                held = media.get(key, 0)
                if held & bit:
                    rk = (key, sidx, midx)
                    self._refs[rk] = self._refs.get(rk, 0) + 1
                    self._refs_by_source[sidx] += 1
                else:
                    media[key] = held | bit
                    added += 1
        self._counts[sidx][midx] += added
        self.total += added
        if self.total > self.max_residencies:
            self._evict()

    def remove(self, sidx: int, midx: int, engine_hashes: Sequence[int]) -> int:
        """Drop one reference per engine hash; returns how many residencies ended.

        Fast path: this source is the only holder of every block, holds them once, on this medium
        only (no offload tier in use): bulk deletes. Anything else takes the per-block path.
        """
        media = self._media[midx]
        emap = self._emaps[sidx]
        bit = 1 << sidx
        if not self._refs_by_source[sidx] and not any(m for i, m in enumerate(self._media) if i != midx):
            keys = list(map(emap.get, engine_hashes))
            if (
                list(map(media.get, keys)).count(bit) == len(keys)  # type: ignore[arg-type]
                and len(set(engine_hashes)) == len(keys)  # a hash listed twice takes the careful path
            ):
                collections.deque(map(media.__delitem__, keys), maxlen=0)  # type: ignore[arg-type]
                collections.deque(map(emap.__delitem__, engine_hashes), maxlen=0)
                n = len(keys)
                self._counts[sidx][midx] -= n
                self.total -= n
                return n
        ended = 0
        for eh in engine_hashes:
            key = emap.get(eh)
            held = 0 if key is None else media.get(key, 0)
            if key is None or not held & bit:
                self._unknown_removes[sidx] += 1
                continue
            if self._refs_by_source[sidx]:
                rk = (key, sidx, midx)
                extra = self._refs.get(rk)
                if extra is not None:
                    self._refs_by_source[sidx] -= 1
                    if extra > 1:
                        self._refs[rk] = extra - 1
                    else:
                        del self._refs[rk]
                    continue
            _unset(media, key, bit)
            ended += 1
            if not self._held_elsewhere(sidx, key, midx):
                del emap[eh]
        self._counts[sidx][midx] -= ended
        self.total -= ended
        return ended

    def clear(self, sidx: int, medium: str = "GPU") -> int:
        """Wipe a source's residencies on one medium (AllBlocksCleared), every KV cache group's;
        returns how many."""
        family = self.medium_index(medium)
        return sum(
            self._clear_one(sidx, midx)
            for midx, fam in enumerate(self._families)
            if fam == family and (midx == family or self._counts[sidx][midx])
        )

    def _clear_one(self, sidx: int, midx: int) -> int:
        media = self._media[midx]
        emap = self._emaps[sidx]
        bit = 1 << sidx
        ended = 0
        for eh, key in list(emap.items()):
            if _unset(media, key, bit):
                ended += 1
            if not self._held_elsewhere(sidx, key, midx):
                del emap[eh]
        self._drop_refs(sidx, {midx})
        self._counts[sidx][midx] = 0
        self.total -= ended
        return ended

    def drop(self, sidx: int) -> int:
        """Wipe every residency of a source (engine restart); returns how many."""
        emap = self._emaps[sidx]
        bit = 1 << sidx
        ended = 0
        for media in self._media:
            for key in set(emap.values()):
                if _unset(media, key, bit):
                    ended += 1
        emap.clear()
        self._drop_refs(sidx, None)
        self._counts[sidx] = [0] * len(self._media)
        self.total -= ended
        return ended

    def _held_elsewhere(self, sidx: int, key: int, skip: int) -> bool:
        bit = 1 << sidx
        return any(i != skip and media.get(key, 0) & bit for i, media in enumerate(self._media))

    def _move(self, sidx: int, old: int, new: int) -> None:
        """The source's residencies of ``old``, on every medium and with their counts, become ``new``'s."""
        bit = 1 << sidx
        for midx, media in enumerate(self._media):
            extra = self._refs.pop((old, sidx, midx), 0) if self._refs_by_source[sidx] else 0
            if not _unset(media, old, bit):
                self._refs_by_source[sidx] -= extra
                continue
            count = 1 + extra
            held = media.get(new, 0)
            if not held & bit:
                media[new] = held | bit
                count -= 1
            else:
                self._counts[sidx][midx] -= 1
                self.total -= 1
            self._refs_by_source[sidx] -= extra
            if count:
                rk = (new, sidx, midx)
                self._refs[rk] = self._refs.get(rk, 0) + count
                self._refs_by_source[sidx] += count

    def _forget(self, sidx: int, key: int) -> None:
        bit = 1 << sidx
        for midx, media in enumerate(self._media):
            if _unset(media, key, bit):
                self._counts[sidx][midx] -= 1
                self.total -= 1
            if self._refs_by_source[sidx]:
                extra = self._refs.pop((key, sidx, midx), 0)
                self._refs_by_source[sidx] -= extra

    def _drop_refs(self, sidx: int, media: set[int] | None) -> None:
        if not self._refs_by_source[sidx]:
            return
        doomed = [rk for rk in self._refs if rk[1] == sidx and (media is None or rk[2] in media)]
        for rk in doomed:
            self._refs_by_source[sidx] -= self._refs.pop(rk)

    def _evict(self) -> None:
        """Over the cap: drop the oldest 1% of the largest source's blocks (all media)."""
        sidx = max(range(len(self._emaps)), key=lambda i: len(self._emaps[i]))
        emap = self._emaps[sidx]
        n = max(1, len(emap) // 100, self.total - self.max_residencies)
        doomed = list(itertools.islice(emap.items(), n))
        before = self.total
        for eh, key in doomed:
            emap.pop(eh, None)
            self._forget(sidx, key)
        gone = before - self.total
        self.evictions += gone
        self._evicted[sidx] += gone

    # --- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], candidates: Sequence[int]) -> list[SourceMatch]:
        """Longest consecutive prefix of ``keys`` held by each candidate source (any medium).

        One pass over the prompt's keys with bitmask arithmetic: O(prompt blocks), independent of
        the fleet size for fleets whose masks fit a machine word; per-medium counting only touches
        blocks that a candidate holds off-GPU.
        """
        alive = 0
        for sidx in candidates:
            alive |= 1 << sidx
        depth: dict[int, int] = {}
        off_gpu: dict[tuple[int, int], int] = {}
        gpu = self._media[0]
        others = [(i, m) for i, m in enumerate(self._media) if i and m]
        n = 0
        if alive:
            for n, key in enumerate(keys):
                on_gpu = gpu.get(key, 0)
                held = on_gpu
                if others:
                    for _, media in others:
                        held |= media.get(key, 0)
                still = alive & held
                if still != alive:
                    lost = alive & ~still
                    while lost:
                        low = lost & -lost
                        depth[low.bit_length() - 1] = n
                        lost ^= low
                    alive = still
                    if not alive:
                        break
                if others:
                    off = alive & ~on_gpu
                    while off:
                        low = off & -off
                        s = low.bit_length() - 1
                        for midx, media in others:
                            if media.get(key, 0) & low:
                                off_gpu[s, midx] = off_gpu.get((s, midx), 0) + 1
                                break
                        off ^= low
            else:
                n = len(keys)
        while alive:
            low = alive & -alive
            depth[low.bit_length() - 1] = n
            alive ^= low
        out = []
        names = self._media_names
        for sidx in candidates:
            source = self._sources[sidx]
            if source is None:
                continue
            blocks = depth.get(sidx, 0)
            by_medium = {"GPU": blocks}
            if others:
                for midx, _ in others:
                    c = off_gpu.get((sidx, midx), 0)
                    if c:
                        by_medium[names[midx]] = c
                        by_medium["GPU"] -= c
            out.append(SourceMatch(source, blocks, by_medium))
        return out

    def holders(self, key: int) -> dict[SourceId, list[str]]:
        """Which sources hold one key, on which media (debugging and tests)."""
        out: dict[SourceId, list[str]] = {}
        for midx, media in enumerate(self._media):
            mask = media.get(key, 0)
            while mask:
                low = mask & -mask
                source = self._sources[low.bit_length() - 1]
                if source is not None:
                    out.setdefault(source, []).append(self._media_names[midx])
                mask ^= low
        return out

    def refcount(self, sidx: int, key: int, medium: str = "GPU") -> int:
        """The reference count of one residency (0 when absent)."""
        midx = self.medium_index(medium)
        if not self._media[midx].get(key, 0) & (1 << sidx):
            return 0
        return 1 + self._refs.get((key, sidx, midx), 0)

    def counts(self) -> list[SourceCounts]:
        """Per-source residency counts by medium, for status pages and metrics."""
        out = []
        for sidx, source in enumerate(self._sources):
            if source is None:
                continue
            blocks = {
                name: self._counts[sidx][midx]
                for midx, name in enumerate(self._media_names)
                if self._counts[sidx][midx] or name == "GPU"
            }
            out.append(SourceCounts(source, blocks, self._unknown_removes[sidx], self._evicted[sidx]))
        return out

    def source_blocks(self, sidx: int) -> dict[str, int]:
        """Residencies of one source by medium."""
        return {
            name: self._counts[sidx][midx]
            for midx, name in enumerate(self._media_names)
            if self._counts[sidx][midx] or name == "GPU"
        }
