"""Compiled kernels (numba) of the compact prefix store: open-addressing tables over numpy arrays.

:class:`index.store.PrefixStore` owns the arrays; every operation on them is one call of a kernel
here (one per event or run of events, per lookup, per eviction), so the per-block work runs as
machine code with no Python objects. The kernels know nothing of sources' names or media names:
only dense indices.

Tables (all power-of-two sized, linear probing, Fibonacci hashing of the 64-bit key; the load is
kept at or below 3/4: the store kernel refuses an event that would cross it and the caller
rebuilds). The key and engine-hash tables delete by backward shift (Knuth's algorithm R: the rows
after a freed slot that may move back, move back), so they have no tombstones and churn never forces
a rebuild; the refs table, rarely written, uses tombstones.

- key table ``kt``: ``uint64[cap, 1 + C]``, a row = our key, then C source bitmasks, one per
  (medium, 64-source word) in use (``col_of[medium, word]`` is the column, -1 when none yet). A row
  is live while any mask is non-zero, so every 64-bit key (0 too) can be stored without a marker.
- engine-hash table ``em`` (one per source): ``uint64[cap, 3]``, a row = vLLM's engine hash, our
  key, and a state word: 0 empty, ``seq + 2`` live, ``seq`` the row's position in the
  source's insertion log (``log``: engine hashes in insertion order; a log entry is current while
  the row for its hash carries its position). The log gives the eviction order a dict's insertion
  order gave the dict store: a remap keeps the position, a delete and a re-insert moves to the end.
- refs table ``rt``: ``uint64[cap, 3]``, a row = key, tag (``(source + 1) << 16 | medium``; 0 empty,
  1 tombstone), count: the references above one of a residency (rare).

Counters live in int64 arrays the kernels update in place: ``g`` (global) and, per source, ``ss``
and ``cnt`` (residencies per medium); the indices are the constants below.

Concurrency: writes come from the subscriber thread, lookups from the router's event loop. A kernel
that changes a table a lookup reads (the key table) holds the GIL, and so does the lookup: each runs
whole with respect to the other thread, as one ``dict`` operation did, so a lookup sees the tables
between two write kernels (at worst an event half applied, which only affects one decision) and
never a row mid-move. A ``nogil`` lookup would have to tolerate a writer moving rows under it (or
take a lock on every call); it runs in microseconds, so it gains nothing worth that.

Long work must not hold the GIL (the event loop would stall): rebuilds are build-new-then-swap (the
kernel reads the published table, which nothing changes meanwhile, and fills private new arrays;
the caller then publishes them with one attribute store) and log compaction touches only writer-only
arrays, so these run ``nogil``; clearing and dropping a source change the key table, so they keep
the GIL but go in slices of rows (:func:`clear_rows`, :func:`drop_rows`), each ~10 ms at most, with
Python between them, where the interpreter may switch threads.
"""

from __future__ import annotations

import numba
import numpy as np

FIB = np.uint64(0x9E3779B97F4A7C15)
TAGMUL = np.uint64(0xC2B2AE3D27D4EB4F)
U0 = np.uint64(0)
U1 = np.uint64(1)
U2 = np.uint64(2)
U63 = np.uint64(63)

# g: global counters
G_TOTAL = 0
G_EVICTIONS = 1
G_KT_LIVE = 3
G_RT_USED = 4
G_RT_LIVE = 5
G_MAX = 6  # the residency cap
G_TOUCH = 7  # where _touch's meaningless result goes (a store the compiler cannot drop)
G_SIZE = 8
# ss: per-source counters
S_EM_LIVE = 1
S_HEAD = 2
S_TAIL = 3
S_REFS = 4  # references above one held by the source (the sum of its rt counts)
S_UNKNOWN = 5
S_EVICTED = 6
S_TOUCH = 7  # as G_TOUCH, for the writer-only kernels that run without the GIL
S_SIZE = 8

_jit = numba.njit(cache=True)
_jit_nogil = numba.njit(cache=True, nogil=True)


@_jit
def shift_of(cap: int) -> np.uint64:
    """The right shift that maps a Fibonacci product to a slot of a table of ``cap`` (power of 2)."""
    b = 0
    while (1 << b) < cap:
        b += 1
    return np.uint64(64 - b) if b else np.uint64(63)


@_jit
def _home(key: np.uint64, shift: np.uint64) -> np.int64:
    return np.int64((key * FIB) >> shift)


# --- key table ---------------------------------------------------------------------------------
@_jit
def _kt_live(kt: np.ndarray, i: int) -> bool:
    for c in range(1, kt.shape[1]):  # noqa: SIM110 - a plain loop compiles to the tightest code
        if kt[i, c] != U0:
            return True
    return False


@_jit
def kt_find(kt: np.ndarray, shift: np.uint64, key: np.uint64) -> int:
    """Row of ``key``, -1 when absent."""
    mask = kt.shape[0] - 1
    i: int = _home(key, shift) & mask
    while _kt_live(kt, i):
        if kt[i, 0] == key:
            return i
        i = (i + 1) & mask
    return -1


@_jit
def _kt_insert(kt: np.ndarray, shift: np.uint64, g: np.ndarray, key: np.uint64) -> int:
    """Row of ``key``, claimed (key written, masks zero) when absent: the caller sets a bit at once."""
    mask = kt.shape[0] - 1
    i: int = _home(key, shift) & mask
    while _kt_live(kt, i):
        if kt[i, 0] == key:
            return i
        i = (i + 1) & mask
    g[G_KT_LIVE] += 1
    kt[i, 0] = key
    return i


@_jit
def _stays(home: int, hole: int, j: int) -> bool:
    """Whether the row at ``j`` with home slot ``home`` must stay (home cyclically in (hole, j])."""
    if hole < j:
        return hole < home <= j
    return home > hole or home <= j


@_jit
def _kt_settle(kt: np.ndarray, kshift: np.uint64, g: np.ndarray, i: int) -> None:
    """Free a row whose masks all went to zero, shifting back the rows of its cluster that may move."""
    if _kt_live(kt, i):
        return
    g[G_KT_LIVE] -= 1
    mask = kt.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if not _kt_live(kt, j):
            break
        if _stays(_home(kt[j, 0], kshift) & mask, i, j):
            continue
        kt[i, :] = kt[j, :]
        kt[j, 1:] = U0
        i = j
    kt[i, 0] = U0


@_jit_nogil
def kt_rebuild(old: np.ndarray, new: np.ndarray, colmap: np.ndarray) -> int:
    """Copy the live rows of ``old`` into the empty ``new`` (old column c goes to colmap[c])."""
    shift = shift_of(new.shape[0])
    mask = new.shape[0] - 1
    n = 0
    for r in range(old.shape[0]):
        if not _kt_live(old, r):
            continue
        key = old[r, 0]
        i: int = _home(key, shift) & mask
        while _kt_live(new, i):
            i = (i + 1) & mask
        new[i, 0] = key
        for c in range(1, old.shape[1]):
            new[i, colmap[c]] = old[r, c]
        n += 1
    return n


# --- engine-hash table (one per source) ----------------------------------------------------------
@_jit
def em_find(em: np.ndarray, shift: np.uint64, eh: np.uint64) -> int:
    """Row of engine hash ``eh``, -1 when absent."""
    mask = em.shape[0] - 1
    i: int = _home(eh, shift) & mask
    while em[i, 2] != U0:
        if em[i, 0] == eh:
            return i
        i = (i + 1) & mask
    return -1


@_jit
def _em_delete(em: np.ndarray, eshift: np.uint64, ss: np.ndarray, i: int) -> None:
    """Free a row (backward shift, as :func:`_kt_settle`)."""
    ss[S_EM_LIVE] -= 1
    mask = em.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if em[j, 2] == U0:
            break
        if _stays(_home(em[j, 0], eshift) & mask, i, j):
            continue
        em[i, 0] = em[j, 0]
        em[i, 1] = em[j, 1]
        em[i, 2] = em[j, 2]
        i = j
    em[i, 2] = U0


@_jit_nogil
def em_rebuild(old: np.ndarray, new: np.ndarray) -> int:
    shift = shift_of(new.shape[0])
    mask = new.shape[0] - 1
    n = 0
    for r in range(old.shape[0]):
        if old[r, 2] < U2:
            continue
        i = _home(old[r, 0], shift) & mask
        while new[i, 2] != U0:
            i = (i + 1) & mask
        new[i, 0] = old[r, 0]
        new[i, 1] = old[r, 1]
        new[i, 2] = old[r, 2]
        n += 1
    return n


_AHEAD = 64
"""Entries whose home slots :func:`log_compact` and the rebuilds read ahead of processing them."""


@_jit_nogil
def log_compact(em: np.ndarray, log: np.ndarray, ss: np.ndarray, new: np.ndarray) -> None:
    """Copy the current entries of a source's log to the start of ``new`` and renumber their rows.

    Every entry costs a probe of the engine-hash table at a random place; the home slots of the next
    :data:`_AHEAD` entries are read first, so their cache misses overlap (~3x faster at 200k rows).
    """
    shift = shift_of(em.shape[0])
    mask = em.shape[0] - 1
    q = 0
    tail = ss[S_TAIL]
    acc = U0
    for base in range(ss[S_HEAD], tail, _AHEAD):
        stop = min(base + _AHEAD, tail)
        for p in range(base, stop):
            acc ^= em[_home(log[p], shift) & mask, 2]
        for p in range(base, stop):
            i = em_find(em, shift, log[p])
            if i >= 0 and em[i, 2] == np.uint64(p + 2):
                new[q] = log[p]
                em[i, 2] = np.uint64(q + 2)
                q += 1
    ss[S_HEAD] = 0
    ss[S_TAIL] = q
    ss[S_TOUCH] = np.int64(acc)


# --- refs table ----------------------------------------------------------------------------------
@_jit
def _tag(s: int, m: int) -> np.uint64:
    return np.uint64(((s + 1) << 16) | m)


@_jit
def rt_find(rt: np.ndarray, shift: np.uint64, key: np.uint64, tag: np.uint64) -> int:
    mask = rt.shape[0] - 1
    i: int = _home(key ^ (tag * TAGMUL), shift) & mask
    while True:
        t = rt[i, 1]
        if t == U0:
            return -1
        if t == tag and rt[i, 0] == key:
            return i
        i = (i + 1) & mask


@_jit
def _rt_add(rt: np.ndarray, shift: np.uint64, g: np.ndarray, key: np.uint64, tag: np.uint64, n: int) -> None:
    mask = rt.shape[0] - 1
    i: int = _home(key ^ (tag * TAGMUL), shift) & mask
    tomb = -1
    while True:
        t = rt[i, 1]
        if t == U0:
            break
        if t == U1:
            if tomb < 0:
                tomb = i
        elif t == tag and rt[i, 0] == key:
            rt[i, 2] += np.uint64(n)
            return
        i = (i + 1) & mask
    if tomb >= 0:
        i = tomb
    else:
        g[G_RT_USED] += 1
    g[G_RT_LIVE] += 1
    rt[i, 0] = key
    rt[i, 1] = tag
    rt[i, 2] = np.uint64(n)


@_jit
def _rt_pop(rt: np.ndarray, shift: np.uint64, g: np.ndarray, key: np.uint64, tag: np.uint64) -> np.int64:
    i = rt_find(rt, shift, key, tag)
    if i < 0:
        return np.int64(0)
    rt[i, 1] = U1
    g[G_RT_LIVE] -= 1
    return np.int64(rt[i, 2])


@_jit
def rt_drop(rt: np.ndarray, g: np.ndarray, s: int, m: int) -> np.int64:
    """Remove a source's refs on medium ``m`` (all media when ``m`` < 0); returns their sum."""
    lo = np.uint64((s + 1) << 16)
    hi = np.uint64((s + 2) << 16)
    out = np.int64(0)
    for i in range(rt.shape[0]):
        t = rt[i, 1]
        if t >= lo and t < hi and (m < 0 or t == lo + np.uint64(m)):
            out += np.int64(rt[i, 2])
            rt[i, 1] = U1
            g[G_RT_LIVE] -= 1
    return out


@_jit_nogil
def rt_rebuild(old: np.ndarray, new: np.ndarray) -> int:
    shift = shift_of(new.shape[0])
    mask = new.shape[0] - 1
    n = 0
    for r in range(old.shape[0]):
        if old[r, 1] < U2:
            continue
        i = _home(old[r, 0] ^ (old[r, 1] * TAGMUL), shift) & mask
        while new[i, 1] != U0:
            i = (i + 1) & mask
        new[i, 0] = old[r, 0]
        new[i, 1] = old[r, 1]
        new[i, 2] = old[r, 2]
        n += 1
    return n


# --- operations ----------------------------------------------------------------------------------
@_jit
def _touch(tab: np.ndarray, shift: np.uint64, keys: np.ndarray, col: int) -> np.uint64:
    """Read every key's home slot once, up front: the loads are independent, so their cache misses
    overlap (the processing loop that follows, a chain of dependent steps, then mostly hits the
    cache). Only a hint: the result is meaningless and the tables are not changed."""
    mask = tab.shape[0] - 1
    acc = U0
    for j in range(len(keys)):
        acc ^= tab[_home(keys[j], shift) & mask, col]
    return acc


@_jit
def _held_elsewhere(kt: np.ndarray, col_of: np.ndarray, r: int, w: int, bit: np.uint64, skip: int) -> bool:
    for mm in range(col_of.shape[0]):
        c = col_of[mm, w]
        if mm != skip and c >= 0 and kt[r, c] & bit:
            return True
    return False


@_jit
def _forget(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    rt: np.ndarray,
    rshift: np.uint64,
    ss: np.ndarray,
    cnt: np.ndarray,
    s: int,
    key: np.uint64,
) -> None:
    """Retire every residency of ``key`` on source ``s`` (all media, refs included)."""
    w = s >> 6
    bit = U1 << np.uint64(s & 63)
    r = kt_find(kt, kshift, key)
    for mm in range(col_of.shape[0]):
        c = col_of[mm, w]
        if r >= 0 and c >= 0 and kt[r, c] & bit:
            kt[r, c] &= ~bit
            cnt[mm] -= 1
            g[G_TOTAL] -= 1
        if ss[S_REFS]:
            ss[S_REFS] -= _rt_pop(rt, rshift, g, key, _tag(s, mm))
    if r >= 0:
        _kt_settle(kt, kshift, g, r)


@_jit
def store_event(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    rt: np.ndarray,
    rshift: np.uint64,
    em: np.ndarray,
    eshift: np.uint64,
    log: np.ndarray,
    ss: np.ndarray,
    cnt: np.ndarray,
    s: int,
    m: int,
    ehs: np.ndarray,
    keys: np.ndarray,
) -> int:
    """One BlockStored: one reference per (engine hash, key) on (source, medium).

    Returns -1, having changed nothing, when a table lacks room for len(keys) new rows (at most
    3/4 of its slots used) or the (medium, word) column does not exist yet: the caller rebuilds and
    calls again. Otherwise 1 when the total went over ``g[G_MAX]`` (the caller evicts), else 0.

    As the dict store: first every engine hash is mapped (new hashes appended to the log, a hash
    already mapped to another key retires that key's residencies and takes the new key in place),
    then every key gets the source's bit or, when the source already holds it there, a reference.
    """
    n = len(keys)
    if m >= col_of.shape[0] or (s >> 6) >= col_of.shape[1]:
        return -1  # not registered (the caller's column lookup raises): never read out of bounds
    col = col_of[m, s >> 6]
    if (
        col < 0
        or (g[G_KT_LIVE] + n) * 4 > kt.shape[0] * 3
        or (ss[S_EM_LIVE] + n) * 4 > em.shape[0] * 3
        or (g[G_RT_USED] + n) * 4 > rt.shape[0] * 3
        or ss[S_TAIL] + n > len(log)
    ):
        return -1
    emask = em.shape[0] - 1
    if n > 1:
        g[G_TOUCH] = np.int64(_touch(em, eshift, ehs, 2) ^ _touch(kt, kshift, keys, 1))
    fresh = np.zeros(n, dtype=np.bool_)
    tail = ss[S_TAIL]
    nfresh = 0
    for j in range(n):
        eh = ehs[j]
        i = _home(eh, eshift) & emask
        found = False
        while em[i, 2] != U0:
            if em[i, 0] == eh:
                found = True
                break
            i = (i + 1) & emask
        if found:
            continue
        ss[S_EM_LIVE] += 1
        em[i, 0] = eh
        em[i, 1] = keys[j]
        em[i, 2] = np.uint64(tail + 2)
        log[tail] = eh
        tail += 1
        fresh[j] = True
        nfresh += 1
    ss[S_TAIL] = tail
    if nfresh != n:
        for j in range(n):
            if fresh[j]:
                continue
            i = em_find(em, eshift, ehs[j])
            cur = em[i, 1]
            if cur != keys[j]:
                _forget(kt, kshift, col_of, g, rt, rshift, ss, cnt, s, cur)
                em[i, 1] = keys[j]
    bit = U1 << np.uint64(s & 63)
    tag = _tag(s, m)
    added = 0
    for j in range(n):
        key = keys[j]
        r = _kt_insert(kt, kshift, g, key)
        if kt[r, col] & bit:
            _rt_add(rt, rshift, g, key, tag, 1)
            ss[S_REFS] += 1
        else:
            kt[r, col] |= bit
            added += 1
    cnt[m] += added
    g[G_TOTAL] += added
    return 1 if g[G_TOTAL] > g[G_MAX] else 0


@_jit
def remove_event(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    rt: np.ndarray,
    rshift: np.uint64,
    em: np.ndarray,
    eshift: np.uint64,
    ss: np.ndarray,
    cnt: np.ndarray,
    s: int,
    m: int,
    ehs: np.ndarray,
) -> int:
    """One BlockRemoved: drop one reference per engine hash; returns residencies ended. A hash the
    source does not map, or maps to a key it does not hold on ``m``, counts as an unknown remove."""
    w = s >> 6
    col = col_of[m, w] if m < col_of.shape[0] else -1
    bit = U1 << np.uint64(s & 63)
    tag = _tag(s, m)
    ended = 0
    if len(ehs) > 1:
        g[G_TOUCH] = np.int64(_touch(em, eshift, ehs, 2))
        if col >= 0:
            found = np.empty(len(ehs), dtype=np.uint64)
            nf = 0
            for j in range(len(ehs)):
                i = em_find(em, eshift, ehs[j])
                if i >= 0:
                    found[nf] = em[i, 1]
                    nf += 1
            g[G_TOUCH] ^= np.int64(_touch(kt, kshift, found[:nf], 1))
    for j in range(len(ehs)):
        i = em_find(em, eshift, ehs[j])
        r = -1
        if i >= 0 and col >= 0:
            r = kt_find(kt, kshift, em[i, 1])
        if r < 0 or not kt[r, col] & bit:
            ss[S_UNKNOWN] += 1
            continue
        if ss[S_REFS]:
            q = rt_find(rt, rshift, em[i, 1], tag)
            if q >= 0:
                ss[S_REFS] -= 1
                if rt[q, 2] > U1:
                    rt[q, 2] -= U1
                else:
                    rt[q, 1] = U1
                    g[G_RT_LIVE] -= 1
                continue
        kt[r, col] &= ~bit
        ended += 1
        if not _held_elsewhere(kt, col_of, r, w, bit, m):
            _em_delete(em, eshift, ss, i)
        _kt_settle(kt, kshift, g, r)
    cnt[m] -= ended
    g[G_TOTAL] -= ended
    return ended


OP_STORE = 0
OP_REMOVE = 1


@_jit
def apply_ops(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    rt: np.ndarray,
    rshift: np.uint64,
    em: np.ndarray,
    eshift: np.uint64,
    log: np.ndarray,
    ss: np.ndarray,
    cnt: np.ndarray,
    s: int,
    ops: np.ndarray,
    ehs: np.ndarray,
    keys: np.ndarray,
    rems: np.ndarray,
    j: int,
    budget: int,
) -> tuple[int, int]:
    """A run of one source's events in one call, from op ``j`` on: :func:`store_event` and
    :func:`remove_event` in turn, exactly as separate calls would apply them.

    ``ops[j]`` is (kind, medium, first, count): a store of ``ehs``/``keys[first:first+count]``
    (:data:`OP_STORE`) or a removal of ``rems[first:first+count]`` (:data:`OP_REMOVE`). One call
    instead of one per event: a kernel call with this many array arguments costs ~1.5 us to dispatch.
    Returns (next op, status): status -1 when op ``next`` needs room (the caller makes it, as after
    :func:`store_event`'s -1, and calls again), 1 when the store just before ``next`` went over the
    cap (the caller evicts and calls again), 0 when done or when ``budget`` blocks were applied (the
    caller calls again: the interpreter may switch threads in between).
    """
    done = 0
    while j < ops.shape[0]:
        m = ops[j, 1]
        a = ops[j, 2]
        n = ops[j, 3]
        if ops[j, 0] == OP_STORE:
            over = store_event(
                kt, kshift, col_of, g, rt, rshift, em, eshift, log, ss, cnt, s, m,
                ehs[a : a + n], keys[a : a + n],
            )  # fmt: skip
            if over < 0:
                return j, -1
            j += 1
            if over > 0:
                return j, 1
        else:  # OP_REMOVE
            remove_event(kt, kshift, col_of, g, rt, rshift, em, eshift, ss, cnt, s, m, rems[a : a + n])
            j += 1
        done += n
        if done >= budget:
            break
    return j, 0


@_jit
def clear_rows(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    em: np.ndarray,
    eshift: np.uint64,
    ss: np.ndarray,
    s: int,
    m: int,
    start: int,
    stop: int,
) -> tuple[int, int]:
    """AllBlocksCleared for one medium, engine-hash rows ``start`` to ``stop``: every key the source
    maps loses its bit there; a mapping whose key the source holds on no other medium goes. Returns
    (the row to go on from, residencies ended); the caller zeroes the medium's count and drops the
    refs after the last slice.

    A deletion shifts later rows back, so the slot just freed is examined again; a row can be seen
    twice (a cluster wrapping around the end), which is harmless: the step is idempotent."""
    w = s >> 6
    col = col_of[m, w] if m < col_of.shape[0] else -1
    bit = U1 << np.uint64(s & 63)
    ended = 0
    i = start
    while i < stop:
        if em[i, 2] < U2:
            i += 1
            continue
        r = kt_find(kt, kshift, em[i, 1])
        if r >= 0 and col >= 0 and kt[r, col] & bit:
            kt[r, col] &= ~bit
            ended += 1
        gone = r < 0 or not _held_elsewhere(kt, col_of, r, w, bit, m)
        if r >= 0:
            _kt_settle(kt, kshift, g, r)
        if gone:
            _em_delete(em, eshift, ss, i)
        else:
            i += 1
    g[G_TOTAL] -= ended
    return i, ended


@_jit
def drop_rows(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    em: np.ndarray,
    s: int,
    start: int,
    stop: int,
) -> int:
    """A restart, engine-hash rows ``start`` to ``stop``: every key the source maps loses the
    source's bits on every medium. Returns residencies ended; after the last slice the caller drops
    the refs, zeroes the counts and replaces the engine-hash table and log with empty ones."""
    w = s >> 6
    bit = U1 << np.uint64(s & 63)
    ended = 0
    for i in range(start, stop):
        if em[i, 2] < U2:
            continue
        r = kt_find(kt, kshift, em[i, 1])
        if r < 0:
            continue
        for mm in range(col_of.shape[0]):
            c = col_of[mm, w]
            if c >= 0 and kt[r, c] & bit:
                kt[r, c] &= ~bit
                ended += 1
        _kt_settle(kt, kshift, g, r)
    g[G_TOTAL] -= ended
    return ended


@_jit
def drop_refs(rt: np.ndarray, g: np.ndarray, ss: np.ndarray, s: int, m: int) -> None:
    """Forget a source's refs on medium ``m`` (every medium when ``m`` < 0)."""
    if ss[S_REFS]:
        ss[S_REFS] -= rt_drop(rt, g, s, m)


@_jit
def evict_oldest(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    g: np.ndarray,
    rt: np.ndarray,
    rshift: np.uint64,
    em: np.ndarray,
    eshift: np.uint64,
    log: np.ndarray,
    ss: np.ndarray,
    cnt: np.ndarray,
    s: int,
    n: int,
) -> int:
    """Drop the source's ``n`` oldest engine-hash mappings (log order) and retire their keys; returns
    residencies ended."""
    before = g[G_TOTAL]
    done = 0
    p = ss[S_HEAD]
    tail = ss[S_TAIL]
    while p < tail and done < n:
        i = em_find(em, eshift, log[p])
        if i >= 0 and em[i, 2] == np.uint64(p + 2):
            key = em[i, 1]
            _em_delete(em, eshift, ss, i)
            _forget(kt, kshift, col_of, g, rt, rshift, ss, cnt, s, key)
            done += 1
        p += 1
    ss[S_HEAD] = p
    gone: int = before - g[G_TOTAL]
    return gone


@_jit
def lookup_prefix(
    kt: np.ndarray,
    kshift: np.uint64,
    col_of: np.ndarray,
    cands: np.ndarray,
    keys: np.ndarray,
    blocks: np.ndarray,
    off: np.ndarray,
) -> bool:
    """Longest consecutive prefix of ``keys`` held (any medium) by each candidate source index.

    ``blocks[i]`` gets candidate i's prefix length; ``off[i, m]`` its matched blocks whose best
    medium is m > 0 (the first medium after GPU, in index order, holding it where GPU does not).
    Returns whether any off-GPU block was counted. One pass with bitmask arithmetic per 64-source
    word: O(prompt blocks), the probe loop stops at the first block no candidate holds.
    """
    nm = col_of.shape[0]
    nw = col_of.shape[1]
    for c in cands:
        if (c >> 6) + 1 > nw:
            nw = (c >> 6) + 1
    alive = np.zeros(nw, dtype=np.uint64)
    for c in cands:
        alive[c >> 6] |= U1 << np.uint64(c & 63)
    depth = np.zeros(nw * 64, dtype=np.int64)
    offs = np.zeros((nw * 64, nm), dtype=np.int64)
    cw = col_of.shape[1]
    any_off = False
    n = len(keys)
    j = 0
    gcol = col_of[0, 0] if cw > 0 else -1
    simple = nw == 1 and cw == 1 and kt.shape[1] == 2 and gcol == 1
    if simple:
        # the common fleet: one word, GPU only; no per-medium work
        a = alive[0]
        while j < n and a != U0:
            r = kt_find(kt, kshift, keys[j])
            held = kt[r, 1] if r >= 0 else U0
            still = a & held
            if still != a:
                lost = a & ~still
                b = 0
                while lost:
                    if lost & U1:
                        depth[b] = j
                    lost >>= U1
                    b += 1
                a = still
            if a != U0:
                j += 1
        alive[0] = a
    else:
        while j < n:
            r = kt_find(kt, kshift, keys[j])
            live = False
            for w in range(nw):
                a = alive[w]
                if a == U0:
                    continue
                gpu = U0
                held = U0
                if r >= 0 and w < cw:
                    c = col_of[0, w]
                    if c >= 0:
                        gpu = kt[r, c]
                    held = gpu
                    for mm in range(1, nm):
                        c = col_of[mm, w]
                        if c >= 0:
                            held |= kt[r, c]
                still = a & held
                if still != a:
                    lost = a & ~still
                    b = 0
                    while lost:
                        if lost & U1:
                            depth[w * 64 + b] = j
                        lost >>= U1
                        b += 1
                    alive[w] = still
                if still == U0:
                    continue
                live = True
                ob = still & ~gpu
                b = 0
                while ob:
                    if ob & U1:
                        bit = U1 << np.uint64(b)
                        for mm in range(1, nm):
                            c = col_of[mm, w]
                            if c >= 0 and kt[r, c] & bit:
                                offs[w * 64 + b, mm] += 1
                                any_off = True
                                break
                    ob >>= U1
                    b += 1
            if not live:
                break
            j += 1
    for w in range(nw):
        a = alive[w]
        b = 0
        while a:
            if a & U1:
                depth[w * 64 + b] = n
            a >>= U1
            b += 1
    for i in range(len(cands)):
        blocks[i] = depth[cands[i]]
        if any_off:
            for mm in range(nm):
                off[i, mm] = offs[cands[i], mm]
    return any_off
