"""From decoded batches to store operations: keys, parents, block sizes, and per-source counters.

The subscriber hands over chunks of ``(source index, batch)`` in stream order; all BlockStored token
ids of a chunk are hashed in one call per block size (decoded events: the compiled
:func:`index.keys.u64_block_contents` over their payloads' uint64 buffers; token lists built in
Python: :func:`index.keys.block_contents`); each event's root (its parent's key) is resolved one by
one, because a block's key depends on its parent's, which may have arrived earlier in the same
chunk, and then the store applies each run of one source's events in one compiled call
(:meth:`index.store.PrefixStore.apply_ops`, one row per event: no Python per event there).

Decisions (each counted per source, see :class:`SourceStats`):

- **Unknown parent** (we never saw the parent block, e.g. it was stored before we connected and fell
  out of the replay buffer): the chain is anchored to a root derived from (source, parent hash).
  Such keys can never equal a prompt's keys, whose chains start at the model/LoRA root, so they can
  never produce a false match; their children still chain and their removals still resolve.
- **Legacy offloading placeholders** (``token_ids`` empty and ``block_size`` 0): ignored; without
  tokens there is nothing to key them by.
- **Bad shape** (``len(token_ids) != block_size * len(block_hashes)``, e.g. vLLM's partial-block
  path): skipped; a partial block can never match a prompt's full blocks anyway.
- **Block size**: learned per source from events. A size different from the configured one is
  logged once and counted; lookups hash prompts at each source's learned size, so a mismatch never
  silently zeroes matches.
- **LoRA**: ``lora_name`` salts the chain root, and is stripped from per-block extra keys; the other
  extra keys (cache_salt, multimodal ids) salt their block. With only the deprecated ``lora_id``
  (vLLM 0.11-0.13) the root is salted by the id, which no request name can match.
- **KV cache groups** (hybrid models: sliding-window or Mamba layers beside full attention): each
  group's residencies are kept under a medium of its own (:func:`index.store.group_medium`), and
  the group's kind, window and block size are learned per source (:class:`GroupSpec`), for the
  lookup's hybrid rule. A sliding-window group announces only the blocks it keeps, over the whole
  newly cached token range (fewer hashes than blocks: the hashes are the range's last blocks, or
  its first ones for a window cut by the range's start, :func:`_window_drop`; a window-only
  model's where the keys its hashes had agree, :func:`_window_place`; 0 hashes when it keeps
  none), a Mamba group one hash, the block where its state was saved: every block's key is
  chained over the whole range and the hashes take the last ones. Such a group's
  chain may start after a block it dropped (no parent then), so a hash already mapped (by the
  full-attention group, whose events carry the same hashes) keeps its key
  (:data:`index.store.OP_STORE_KEEP`). A Mamba group of larger blocks than the source's hash
  block size is read at that size (:func:`_fine_mamba`). Malformed group metadata (a group index
  out of range, a group whose kind, window or block size changes, other groups of different block
  sizes) is counted and makes the source's matches 0 until it restarts: conservative, never larger
  than the engine's.
"""

from __future__ import annotations

import bisect
import logging
import time
from array import array
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec

from index._lazy import LazyModule
from index.keys import (
    BASE_ROOT,
    CHAIN_MUL,
    M64,
    MAX_BLOCK_SIZE,
    block_contents,
    extra_hash,
    lora_root,
    powers,
    u64_block_contents,
    unknown_root,
)
from index.rawtokens import TokenIds
from index.store import MEDIA, OP_REMOVE, OP_STORE, OP_STORE_KEEP, PrefixStore, SourceId, group_medium
from index.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, WireError, decode_payload

log = logging.getLogger("kvrouter.index")

_OP_STORE = OP_STORE
_OP_REMOVE = OP_REMOVE
_OP_KEEP = OP_STORE_KEEP
_OP_CLEAR = 3  # an AllBlocksCleared: a row that marks where the store clears (never given to the store)
MAX_GROUPS = 16
"""KV cache groups a source may announce (indices 0..15); an index beyond is malformed metadata."""
FULL, SLIDING, MAMBA = "full_attention", "sliding_window", "mamba"
_ROW = 5  # op row: kind, medium, first, count, group number (the store reads the first four)
if TYPE_CHECKING:
    import numpy as np

    from index.keys import U64
else:
    np = LazyModule("numpy")  # the Python path only (what the C core hands over)
_NO_COUNTS = (0, 0, 0, 0)


_BUILTIN_MEDIA = frozenset(MEDIA)


class GroupSpec(msgspec.Struct, frozen=True, gc=False):
    """One KV cache group of a source, as its events describe it, and the hit rule it gets
    (:meth:`of`: ``rule`` from the kind)."""

    kind: str
    """The kind as announced (``kv_cache_spec_kind``)."""
    window: int | None
    block_size: int
    rule: str
    """FULL, SLIDING or MAMBA: full attention, and any kind not known, get the strictest rule (every
    block of the prefix), as does a sliding window without a usable window size."""

    @classmethod
    def of(cls, kind: str, window: int | None, block_size: int) -> GroupSpec:
        if "sliding" in kind:
            rule = SLIDING if window is not None and window > 0 else FULL
        elif "mamba" in kind:
            rule = MAMBA
        else:
            rule = FULL
        return cls(kind, window, block_size, rule)

    def need(self) -> int:
        """Blocks a sliding-window group needs cached just before a hit (the window's tail)."""
        w = self.window or 1
        return max(1, -(-(w - 1) // self.block_size))


class SourceStats:
    """Counters of one event source (plain attributes: written by one thread, read by others)."""

    __slots__ = (
        "bad_events",
        "batches",
        "block_size",
        "block_size_mismatch",
        "blocks_removed",
        "blocks_stored",
        "cleared",
        "decode_errors",
        "ghosts",
        "group_faults",
        "groups",
        "groups_bad",
        "last_applied",
        "last_ts",
        "placeholders",
        "removed_events",
        "stored_events",
        "unknown_parents",
        "wends",
    )

    def __init__(self) -> None:
        self.batches = 0
        self.stored_events = 0
        self.removed_events = 0
        self.cleared = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.unknown_parents = 0
        self.placeholders = 0
        self.bad_events = 0
        self.decode_errors = 0
        self.block_size: int | None = None
        self.block_size_mismatch = 0
        self.last_ts = 0.0
        self.last_applied = 0.0
        self.groups: dict[int, GroupSpec] = {}
        """KV cache groups other than a first full-attention one (empty: a one-group engine, whose
        events the C core applies; group 0 is full attention unless learned otherwise)."""
        self.group_faults = 0
        self.groups_bad = False
        """Malformed group metadata seen since the source's last restart: its matches are 0."""
        self.wends: list[tuple[int, int, int] | None] | None = None
        """A window-only model's windows placed at their range's end (:func:`_window_drop`), by
        :func:`_win_slot` of the last hash: (that hash, keys of the range's last two blocks)."""
        self.ghosts: list[tuple[int, int] | None] | None = None
        """A window-only model's recently removed blocks, (engine hash, key) by :func:`_win_slot`
        modulo :data:`GHOST_SLOTS`: a window stored again keeps its hashes' place
        (:func:`_window_place`)."""


def _ints(hashes: list[int | bytes]) -> list[int]:
    """Engine hashes after :func:`index.wire.decode_payload` normalised them to ints."""
    return cast(list[int], hashes)


def _stored_what(n: int, bs: int, ntokens: int, why: str) -> str:
    return f"BlockStored with {n} hashes, block_size {bs} and {ntokens} token ids ({why})"


def _spec_of(ev: BlockStored) -> GroupSpec:
    """The group an event describes (a kind that is not a string is full attention's)."""
    kind = ev.kv_cache_spec_kind if isinstance(ev.kv_cache_spec_kind, str) else FULL
    window = ev.kv_cache_spec_sliding_window
    return GroupSpec.of(kind[:40], window if type(window) is int else None, ev.block_size)


def _medium_of(ev: BlockStored | BlockRemoved) -> str:
    """The medium a residency is kept under. A ``REMOTE`` tier (an offloading store on another host,
    e.g. one several engines share) is kept and credited as STORAGE, on the engine that announced
    it: loading from it costs what storage costs, and which other engines share it the events do
    not say."""
    return "STORAGE" if ev.locality == "REMOTE" else ev.medium or "GPU"


def _lora_of(ev: BlockStored) -> str | None:
    if ev.lora_name:
        return ev.lora_name
    if ev.lora_id is not None:
        return f"#lora-id-{ev.lora_id}"
    return None


def _block_extras(ev: BlockStored, n: int) -> list[tuple[int, list[Any]]]:
    """(block index, extra items) for the blocks of an event that carry extra keys beyond the LoRA name."""
    extra = ev.extra_keys
    if not extra:
        return []
    out = []
    for i, items in enumerate(extra[:n]):
        if not items:
            continue
        rest = list(items)
        if ev.lora_name is not None and rest and rest[0] == ev.lora_name:
            rest = rest[1:]
        if rest:
            out.append((i, rest))
    return out


def _hash_block_size(events: Sequence[Any], configured: int | None) -> int | None:
    """A source's hash block size before it is learned, from its batch's full-attention BlockStored
    events with hashes (:func:`_fine_mamba`): the configured size when one of them has it, else the
    smallest size of those that carry several blocks, else the smallest (a partial block's event,
    vLLM's cache_partial_block, carries one hash: it is not taken for the size when another is
    there)."""
    sizes: set[int] = set()
    several: set[int] = set()
    for ev in events:
        if type(ev) is BlockStored and ev.block_hashes and ev.kv_cache_spec_kind in (None, FULL):
            bs = ev.block_size
            if type(bs) is int and bs > 0:
                sizes.add(bs)
                if len(ev.block_hashes) > 1:
                    several.add(bs)
    if configured in sizes:
        return configured
    return min(several or sizes) if sizes else None


def _fine_mamba(events: Sequence[Any], h: int) -> list[Any] | None:
    """A batch's Mamba events of blocks larger than the source's hash block size ``h``, read at
    ``h`` (None: the batch has none).

    vLLM hashes every request at the greatest common divisor of its groups' block sizes (its
    ``hash_block_size``; a Mamba group of 64-token blocks beside full attention of 16 hashes at
    16), and a larger block's hash is that of its last hash-sized block, the value the
    full-attention group announces there. A Mamba group saves its state at its own block
    boundaries and at the hash block that ends a prompt (those come as events of size ``h``), and a
    hit ends where a state is, at size ``h``. So such an event's range is cut into blocks of ``h``,
    and its hashes, the states of its last blocks, take the last hash block of each: one event per
    hash, each chained on the one before."""
    out: list[Any] | None = None
    for i, ev in enumerate(events):
        bs = ev.block_size if type(ev) is BlockStored else 0
        if not (type(bs) is int and bs > h and bs % h == 0 and ev.kv_cache_spec_kind == MAMBA):
            if out is not None:
                out.append(ev)
            continue
        if out is None:
            out = list(events[:i])
        hashes, tokens = ev.block_hashes, ev.token_ids
        n, ntokens = len(hashes), len(tokens)
        if ntokens % bs or ntokens < n * bs:
            out.append(ev)  # (a bad shape at its own size: judged as usual, counted and skipped)
            continue
        if n <= 1:
            out.append(msgspec.structs.replace(ev, block_size=h))
            continue
        cut = ntokens - (n - 1) * bs  # the first event: every block up to the first state
        parent = ev.parent_block_hash
        for j, eh in enumerate(hashes):
            a, b = (0, cut) if j == 0 else (cut + (j - 1) * bs, cut + j * bs)
            part = (
                TokenIds(tokens.buf, tokens.off + a, b - a, tokens.negative)
                if type(tokens) is TokenIds
                else list(tokens[a:b])
            )
            out.append(
                msgspec.structs.replace(
                    ev, block_hashes=[eh], parent_block_hash=parent, token_ids=part, block_size=h
                )
            )
            parent = eh
    return out


def _window_drop(need: int, n: int, k: int) -> int:
    """Blocks at the end of a sliding-window group's BlockStored of ``k`` blocks and ``n`` hashes
    that none of its hashes is (the hashes are the ``n`` blocks before them), for a window that
    needs ``need`` blocks before a hit (:meth:`GroupSpec.need`).

    vLLM keeps the ``need`` blocks ending at the request's replay boundary, its ``prompt - 1``
    tokens floored to a block (the longest hit a resend can take), while the event covers every
    newly full block: the prefill's range ends at the prompt's last full block, so the window kept
    ends at the range's end when the prompt has a partial last block, one block before it when the
    prompt is whole blocks (a resend computes that block again); a decode-filled block keeps
    nothing (0 hashes). So:

    * fewer hashes than both ``need`` and ``k`` over a range of at most ``need`` blocks: the window
      was cut by the range's start, and the hashes are the range's first blocks wherever it ends
      (prompt 8 tokens, 4-token blocks, window 9: 2 blocks, 1 hash, block 0);
    * fewer hashes than ``need`` over a longer range: a chunk of a chunked prefill, whose window
      at the chunk's end is still short of ``need`` (vLLM's own scheduler: a 96-token chunk, window
      64 over 16-token blocks, 3 hashes, blocks 3-5); the range's last blocks. Placed first, they
      would credit the prefix's start, which the engine no longer holds (over-prediction, seen
      against vLLM's scheduler in tests/vllm/test_vllm_oracle.py); placed last, a window cut by the
      range's start that this misreads is credited nothing (never more than the engine has);
    * ``need`` hashes or more over more blocks: ambiguous. A prompt of ``k`` whole blocks and one
      with a partial block after the same ``k`` send the same shape, and the router cannot
      recompute vLLM's hash values. They stay the range's last blocks: right for every prompt
      length but a multiple of the block size. Neither placement is safe both ways (the other
      one over-credits a prompt that leaves the first one's chain in its last block, and roots the
      children of every partial-block prompt one block off); for a whole-block prompt the index
      credits an extending prompt one block too many and an exact resend too little, and the
      hashes keep their keys one block off until evicted. A resend extending it settles its own
      chain: it names the window's last hash as parent and computes the block after the window
      again, so a child whose first block is the range's last one again is rooted one block
      earlier (:meth:`_Group.rechain`; the C core alike), and the conversation's later turns match.

    Beside a full-attention group (Gemma) the same placement applies, and that group's event,
    which carries every hash of the range, settles each hash on its block either way. A window-only
    model's reading is checked against the keys its hashes had before (:func:`_window_place`).
    """
    if n == 0 or n >= k or n >= need or k > need:
        return 0
    return k - n


WIN_SLOTS = 64
"""Windows placed at their range's end a window-only source remembers, by slot of their last hash
(the C core's WIN_SLOTS): a child of a window overwritten since keeps the root as placed."""


GHOST_SLOTS = 64
"""Removed blocks a window-only source remembers (the C core's GHOST_SLOTS), by :func:`_win_slot`."""


def _win_slot(engine_hash: int) -> int:
    return (((engine_hash * CHAIN_MUL) & M64) >> 56) % WIN_SLOTS


def _window_place(known: Sequence[int | None], keys: Sequence[int], last: int, placed: int) -> int:
    """The block of a window-only model's first hash in its event's range of blocks ``keys``.

    ``placed`` is where :func:`_window_drop` puts it by the event's shape, which cannot tell every
    case apart: vLLM keeps the window that ends at the request's replay boundary, ``prompt - 1``
    tokens floored to a block, and a preempted request recomputes its prompt *and* its output in
    one range, so its window sits any number of blocks before the range's end. An engine hash
    names one block of one prefix for good, so the keys its hashes had before (``known``: still
    mapped, or removed lately) say where they are: an offset in ``0..last`` that every known key
    agrees on wins; keys that disagree, or none, leave the shape's reading (measured against vLLM's
    scheduler in docs/benchmarks/hybrid.md)."""
    at, voted = placed, False
    for j, key in enumerate(known):
        if key is None or (voted and keys[at + j] == key):
            continue
        o = next((o for o in range(last + 1) if keys[o + j] == key), -1)
        if o >= 0:
            if voted:
                return placed  # (it agrees with another offset)
            at, voted = o, True
    return at


def _window_only(st: SourceStats) -> bool:
    """Sliding-window groups and no full attention (Mistral): nothing puts a window's hashes on their
    blocks but the event's shape (:func:`_window_drop`)."""
    groups = st.groups
    return 0 in groups and groups[0].rule == SLIDING and all(x.rule != FULL for x in groups.values())


_Step = tuple["_Group", int, int, str, bool]
"""A BlockStored's place in pass 2: group, first block, blocks, medium name, keep (OP_STORE_KEEP)."""


class _Group:
    """The BlockStored events of one chunk that share a block size, keyed together.

    Token ids decoded from the wire are :class:`TokenIds`, slices of their payload's uint64 buffer:
    consecutive slices of one buffer are kept as one run, and the runs are hashed in one compiled
    pass. Ids given as Python sequences (events built in Python) take the numpy path. Engine hashes
    are gathered into one uint64 array too, so the store gets a slice per event (no per-call
    conversion of a list).
    """

    __slots__ = (
        "alts",
        "block_size",
        "blocks",
        "drops",
        "ehs",
        "events",
        "extras",
        "fixes",
        "hashes",
        "keys",
        "later",
        "m",
        "number",
        "prefix",
        "roots",
        "runs",
        "sizes",
        "starts",
        "tokens",
        "wend_events",
        "windows",
    )

    def __init__(self, block_size: int, number: int) -> None:
        self.fixes: list[tuple[int, int, int, int]] = []
        """(event, source, key, key) of the events chained on a window remembered at its range's end
        (:attr:`SourceStats.wends`): the keys of that range's last two blocks."""
        self.wend_events: dict[int, tuple[int, int]] = {}
        """Events placing a window at their range's end: (source, last hash), by event number."""
        self.alts: dict[int, int] = {}
        """Events chained on the last block of such an event of this chunk: their source."""
        self.windows: list[tuple[int, int, int, int]] = []
        """A window-only model's events with fewer hashes than blocks: (event, source, op row, block
        of the first hash in the range), placed again once the keys are known (:func:`_window_place`)."""
        self.block_size = block_size
        self.number = number
        """Groups of a chunk are numbered in creation order."""
        self.tokens = array("Q")
        """Ids of the events whose token_ids are Python sequences."""
        self.runs: list[list[Any]] = []
        """[buffer, first, end] runs of the TokenIds events' ids, in event order."""
        self.blocks = 0
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.events: list[BlockStored] = []
        self.drops: dict[int, int] = {}
        """Blocks after an event's hashes that none of them is (:func:`_window_drop`), by event number."""
        self.extras: list[int] = []
        """Numbers of the events that carry extra keys."""
        self.roots: list[int] = []
        """Root of each event (0 for those in ``later``)."""
        self.later: list[tuple[int, int, int]] = []
        """(event, parent block, parent event) of the events whose parent is a block of this chunk."""
        self.hashes = array("Q")
        """Engine hashes of the events, in block order (zeros for an event whose hashes did not fit)."""
        self.ehs: U64 = np.empty(0, dtype=np.uint64)
        self.keys: U64 = np.empty(0, dtype=np.uint64)
        self.m: U64 = np.empty(0, dtype=np.uint64)
        self.prefix: U64 = np.empty(0, dtype=np.uint64)

    def add(self, ev: BlockStored, n: int) -> bool:
        """Take an event's ``n`` blocks of tokens; False (nothing taken) when a token id is not an
        unsigned 64-bit int (the shape was checked by the caller)."""
        tokens = ev.token_ids
        if type(tokens) is TokenIds:
            if tokens.negative:
                return False
            runs = self.runs
            if runs and runs[-1][0] is tokens.buf and runs[-1][2] == tokens.off:
                runs[-1][2] += tokens.size
            else:
                runs.append([tokens.buf, tokens.off, tokens.off + tokens.size])
        else:
            try:
                if type(tokens) is list:
                    self.tokens.fromlist(tokens)  # all or nothing; ~2x faster than list.extend + array()
                else:
                    self.tokens.extend(array("Q", tokens))
            except (OverflowError, TypeError):
                return False
        if ev.extra_keys:
            self.extras.append(len(self.starts))
        self.starts.append(self.blocks)
        self.sizes.append(n)
        self.blocks += n
        self.events.append(ev)
        return True

    def prepare(self) -> None:
        """Contents of every block (extra keys folded in) and the prefix sums of m_j * C^-j."""
        if self.runs and not self.tokens:
            runs = self.runs
            if len(runs) == 1:
                buf, first, end = runs[0]
                ids = buf[first:end]
            else:
                ids = np.concatenate([buf[first:end] for buf, first, end in runs])
            m = u64_block_contents(ids, self.block_size)
        elif not self.runs:
            m = block_contents(self.tokens, self.block_size)
        else:  # both kinds in one chunk (rare: Python-built events mixed into decoded ones)
            parts = []
            for ev in self.events:
                tokens = ev.token_ids
                ids = tokens.array() if type(tokens) is TokenIds else np.array(tokens, dtype=np.uint64)
                parts.append(ids)
            m = u64_block_contents(np.concatenate(parts), self.block_size)
        for e in self.extras:
            ev = self.events[e]
            # (extra keys are per hash: the event's last blocks when it has fewer hashes than blocks)
            start = self.starts[e] + self.sizes[e] - len(ev.block_hashes) - self.drops.get(e, 0)
            for i, items in _block_extras(ev, len(ev.block_hashes)):
                m[start + i] ^= np.uint64(extra_hash(items))
        n = len(m)
        powers.ensure(n + 1)
        self.m = m
        self.prefix = np.cumsum(m * powers.inv[:n], dtype=np.uint64)
        self.ehs = np.frombuffer(self.hashes, dtype=np.uint64) if self.hashes else self.ehs

    def rechain(self, window_only: Callable[[int], bool]) -> None:
        """Root one block earlier each event chained on the last hash of a window placed at its
        range's end whose first block is that range's last block again (``window_only`` of its
        source): the window was a whole-block prompt's, which keeps it one block earlier, and a
        resend extending it computes that last block again (:func:`_window_drop`)."""
        m = self.m
        for e, sidx, k0, k1 in self.fixes:
            if window_only(sidx) and (k0 * CHAIN_MUL + int(m[self.starts[e]])) & M64 == k1:
                self.roots[e] = k0
        if self.alts:
            self.later = [
                (e, b - 1, pe)
                if e in self.alts and window_only(self.alts[e]) and m[self.starts[e]] == m[b]
                else (e, b, pe)
                for e, b, pe in self.later
            ]

    def solve(self) -> None:
        """All keys at once, from the prefix sums and one root per event.

        With ``C^(i-start+1) = C^i * C * C^-start``, block ``i`` of an event has key
        ``C^i * (P_i + d)``, ``d = C * C^-start * root - P_{start-1}`` one number per event. Events
        whose parent is a block of an earlier event here get their ``d`` in stream order, from that
        block's key.
        """
        n = len(self.m)
        prefix = self.prefix
        first = np.array(self.starts, dtype=np.int64)
        below = np.zeros(len(first), dtype=np.uint64)
        below[1:] = prefix[first[1:] - 1]
        scale = powers.inv[first] * np.uint64(CHAIN_MUL)
        d = scale * np.array(self.roots, dtype=np.uint64) - below
        if self.later:
            dl = d.tolist()
            sl = scale.tolist()
            bl = below.tolist()
            at = np.array([b for _, b, _ in self.later], dtype=np.int64)
            fwd_at = powers.fwd[at].tolist()
            prefix_at = prefix[at].tolist()
            for (e, _, pe), f, p in zip(self.later, fwd_at, prefix_at, strict=True):
                key = (f * (p + dl[pe])) & M64
                dl[e] = (sl[e] * key - bl[e]) & M64
            d = np.array(dl, dtype=np.uint64)
        sizes = np.array(self.sizes, dtype=np.int64)
        self.keys = powers.fwd[:n] * (prefix + np.repeat(d, sizes))  # the store takes slices as they are


class _Seen:
    """Engine hash -> block of the earlier events of one (source, block size) in a chunk.

    The dict is filled lazily: most parents are the last block of the latest event (one comparison),
    and the others find every earlier event's blocks merged in first, latest occurrence winning, as
    if each event had been added as it came.
    """

    __slots__ = ("index", "last_b", "last_e", "last_hash", "pending", "starts")

    def __init__(self, starts: list[int]) -> None:
        self.starts = starts
        """The group's first block of each event."""
        self.index: dict[int, int] = {}
        self.pending: list[tuple[list[int], int]] = []
        """(hashes, first block) of events not merged into ``index`` yet, in stream order."""
        self.last_hash: int | None = None
        self.last_b = -1
        self.last_e = -1

    def find(self, parent: int) -> tuple[int, int] | None:
        """(block, event number) of the latest block with this hash, if any."""
        if self.last_e >= 0 and parent == self.last_hash:
            return self.last_b, self.last_e
        if self.pending:
            index = self.index
            for hashes, start in self.pending:
                index.update(zip(hashes, range(start, start + len(hashes)), strict=True))
            self.pending.clear()
        b = self.index.get(parent)
        if b is None:
            return None
        return b, bisect.bisect_right(self.starts, b) - 1

    def add(self, hashes: list[int], start: int, e: int) -> None:
        """An event's blocks, ``start`` .. ``start + len(hashes) - 1`` of the group."""
        self.pending.append((hashes, start))
        self.last_hash = hashes[-1]
        self.last_b = start + len(hashes) - 1
        self.last_e = e


class Ingestor:
    """Applies batches of one or many sources to a :class:`PrefixStore`."""

    def __init__(self, store: PrefixStore, block_size: int | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.stats: dict[int, SourceStats] = {}
        self.layout_version = 0
        """Bumped when a source's block size or KV cache groups change, or a source is added: how a
        source is matched (readers cache per candidate set what this says)."""
        self.lag_observer: Callable[[float], None] | None = None
        """Called with now - batch.ts for every applied batch (metrics)."""
        self.on_reset: Callable[[int], None] | None = None
        """Called with the source index when a source's GPU blocks are cleared or the source restarted."""
        self.on_touched: Callable[[int, bytes | None], None] | None = None
        """Called after each chunk with the keys (uint64 bytes; None: too many to list) a source the
        store watches (:meth:`index.store.PrefixStore.watch`) stored or removed in it."""
        self._core: Any = getattr(store, "core", None)
        """The compiled store the raw payloads go to (None: the dict store; everything is decoded)."""
        self.batched = callable(getattr(store, "apply_ops", None))
        """Apply runs of events with one store call (:meth:`PrefixStore.apply_ops`); False: one call per
        event (the dict store has no batch call; tests compare both)."""
        self._known_media: set[str] = set(_BUILTIN_MEDIA)
        """Media names known to be registered (names are never unregistered): news for the core only once."""

    def add_source(self, source: SourceId) -> int:
        """Register a source with the store and give it counters."""
        sidx = self.store.add_source(source)
        self.stats[sidx] = SourceStats()
        self.layout_version += 1
        if self.on_reset is not None:
            self.on_reset(sidx)  # a reused slot starts without the previous holder's predictions
        return sidx

    def source_name(self, sidx: int) -> str:
        src = self.store.source_of(sidx) or ("?", 0)
        return f"{src[0]}/dp{src[1]}"

    def apply(self, sidx: int, batch: Batch) -> None:
        """Apply one batch."""
        self.apply_chunk([(sidx, batch)])

    def apply_chunk(self, items: Sequence[tuple[int, Batch | bytes | None]]) -> None:
        """Apply items in stream order (:meth:`_apply_chunk`), then tell :attr:`on_touched` which
        watched sources' blocks the chunk stored or removed."""
        self._apply_chunk(items)
        if self.on_touched is not None and self._core is not None:
            for sidx, keys, over in self._core.take_touched():
                self.on_touched(sidx, None if over else keys)

    def _apply_chunk(self, items: Sequence[tuple[int, Batch | bytes | None]]) -> None:
        """Apply items in stream order: a raw payload (bytes), a decoded batch, or ``None`` (that
        source restarted: its residencies are dropped).

        Raw payloads go to the C core (:meth:`index._kvcore.Store.ingest`: parse, keys and store
        operations in one call per run of payloads, without the GIL); a payload it does not take
        (LoRA, extra keys, a block size or medium not seen before, anything unusual or malformed)
        changes nothing there and is decoded and applied here instead, in order, so the result is
        the Python path's (tests/index/test_index_cingest.py compares the two). Counters of the C path
        are merged per chunk; the event-lag metric is then observed once per source and chunk,
        for its latest batch.
        """
        core = self._core
        todo = items if type(items) is list else list(items)
        n = len(todo)
        i = 0
        taught = -1
        decoded: Batch | None = None
        while i < n:
            if core is not None:
                nxt, status = core.ingest(todo, i)
                if nxt > i:
                    self._merge_core_stats(core)
                if status == 0:
                    return
                i = nxt
                if i != taught and type(todo[i][1]) is bytes:
                    taught = i  # (once per item: what the core still refuses goes the Python way)
                    decoded = self._decode_or_none(todo[i][1])
                    if decoded is not None and self._teach_core(todo[i][0], decoded):
                        continue  # the core takes it now
            # what the core did not take: this item, and the decoded batches and restarts after it
            j = i + 1
            while j < n and type(todo[j][1]) is not bytes:
                j += 1
            if core is None:
                j = n
            run: list[tuple[int, Batch | None]] = []
            for k, (sidx, item) in enumerate(todo[i:j], i):
                if k == taught and decoded is not None:
                    run.append((sidx, decoded))  # (decoded once, above)
                elif type(item) is bytes:
                    try:
                        run.append((sidx, decode_payload(item)))
                    except WireError as exc:
                        self._decode_error(sidx, exc)
                else:
                    run.append((sidx, item))
            if run:
                self._apply_decoded(run)
            i = j

    @staticmethod
    def _decode_or_none(payload: bytes) -> Batch | None:
        try:
            return decode_payload(payload)
        except WireError:
            return None  # (counted when the Python path decodes it again)

    def _teach_core(self, sidx: int, batch: Batch) -> bool:
        """Learn what made the C core refuse a payload when that is only news, not an oddity: the
        source's block size (its first BlockStored) or a medium not registered yet. Returns whether
        anything was learned, so the core can take the payload after all. Before this, every
        source's first event went the Python way, which imports numpy: ~15 MB and 60-400 ms (on a
        cold disk) before a starting router saw its first block."""
        st = self.stats.get(sidx)
        if st is None:
            return False
        # only for a batch the Python path would take whole (the same checks, media registered in
        # the same event order: tests/kvfuzz.py compares the two paths) and of one block size;
        # anything odd is left to the Python path
        sizes = set()
        learned = False
        known = self._known_media
        news: dict[int, BlockStored] = {}  # a hybrid model's groups first seen here: their first event
        for ev in batch.events:
            if type(ev) is BlockStored:
                if ev.locality == "REMOTE":
                    return False
                medium = ev.medium or "GPU"
                if ev.group_idx or ev.kv_cache_spec_kind not in (None, FULL):
                    g = ev.group_idx or 0
                    if not 0 <= g < MAX_GROUPS or medium != "GPU":
                        return False
                    spec = _spec_of(ev)
                    had = st.groups.get(g) or (_spec_of(news[g]) if g in news else None)
                    if had is None:
                        sizes_now = {x.block_size for x in st.groups.values()} | {
                            _spec_of(x).block_size for x in news.values()
                        }
                        if sizes_now and sizes_now != {spec.block_size}:
                            return False  # (a fault: the Python path counts it)
                        news[g] = ev
                    elif had != spec:
                        return False
                    medium = group_medium(medium, g)
                elif st.groups and (
                    any(x.block_size != ev.block_size for x in st.groups.values())
                    or (0 in st.groups and st.groups[0].rule != FULL)
                ):
                    return False
                new = medium not in known
                tokens = ev.token_ids
                ntokens = tokens.size if type(tokens) is TokenIds else len(tokens)
                if self._stored_fault(ev, len(ev.block_hashes), ntokens, medium, known) is not None:
                    return False
                if self._partial(st, ev.block_size, len(ev.block_hashes)):
                    return False  # (the Python path skips it)
                sizes.add(ev.block_size)
            elif type(ev) is BlockRemoved:
                if ev.locality == "REMOTE":
                    return False
                medium = ev.medium or "GPU"
                if ev.group_idx:
                    g = ev.group_idx
                    if not 0 <= g < MAX_GROUPS or medium != "GPU" or (g not in st.groups and g not in news):
                        return False
                    medium = group_medium(medium, g)
                new = medium not in known
                if new and not self._registers(medium):
                    return False
            else:
                continue
            if new:
                known.add(medium)
                learned = True
        if len(sizes) > 1:
            return False
        if sizes and st.block_size != (bs := next(iter(sizes))):
            self._learn_block_size(sidx, st, bs)
            learned = True
        for ev in news.values():
            self._learn_group(sidx, st, ev)  # (teaches the core too)
            learned = True
        return learned

    def _merge_core_stats(self, core: Any) -> None:
        now = time.time()
        lag = self.lag_observer
        for sidx, batches, se, sb, re, rb, cleared, unknown, placeholders, ts in core.take_stats():
            st = self.stats.get(sidx)
            if st is None:
                continue
            st.batches += batches
            st.stored_events += se
            st.blocks_stored += sb
            st.removed_events += re
            st.blocks_removed += rb
            st.cleared += cleared
            st.unknown_parents += unknown
            st.placeholders += placeholders
            st.last_ts = ts
            st.last_applied = now
            if cleared and self.on_reset is not None:
                self.on_reset(sidx)
            if lag is not None:
                lag(max(0.0, now - ts))

    def _decode_error(self, sidx: int, exc: Exception) -> None:
        st = self.stats.get(sidx)
        if st is None:
            return
        st.decode_errors += 1
        if st.decode_errors <= 5 or st.decode_errors % 1000 == 0:
            log.warning(
                "source %s: malformed message skipped (%d so far): %s",
                self.source_name(sidx),
                st.decode_errors,
                exc,
            )

    def _apply_decoded(self, items: Sequence[tuple[int, Batch | None]]) -> None:
        """Apply decoded batches in order; ``None`` in place of a batch drops that source (a restart).

        Keys are computed for the whole chunk at once: every BlockStored's token ids go through one
        vectorised content hash per block size, and the chain recurrence is solved for all blocks
        together (``S_i = C^i * (P_i - P_{start-1}) + C^(i-start+1) * root``, P a prefix sum of
        ``m_j * C^-j``); only each event's root (its parent's key) is resolved one by one, from the
        store or from an earlier event of the same chunk.

        Then the store applies each run of one source's events between resets in one call
        (:meth:`PrefixStore.apply_ops`): one row per event, no Python per event. A store without it
        (the dict store), or a chunk with engine hashes that do not fit a uint64 array (events built
        in Python), goes event by event (:meth:`_apply_events`), with the same result.
        """
        # pass 1, in stream order: validate BlockStored events, gather their tokens and hashes per
        # block size, and find each event's root (its parent's key): from the store, or a reference
        # to a block of an earlier event of this chunk, resolved once the groups are prepared; and
        # one op row per event for the store
        groups: dict[int, _Group] = {}
        plan: list[_Step | None] = []  # per BlockStored: (group, first block, blocks, medium, keep)
        local: dict[tuple[int, int], _Seen] = {}  # (source, block size) -> earlier blocks of the chunk
        store = self.store
        stats = self.stats
        batched = self.batched
        ops = array("q")  # rows of _ROW: kind, medium (chunk-local number), first, count, group number
        rems = array("Q")  # engine hashes of the BlockRemoved events
        media: dict[str, int] = {}  # medium name -> chunk-local number, in first-use order
        ends: list[int] = []  # per item: its op rows end here
        counts: list[tuple[int, int, int, int]] = []  # per item: events and blocks, stored and removed
        clears = False  # some batch holds an AllBlocksCleared (a row of its own, applied apart)
        for sidx, batch in items:
            if batch is None:
                for key in [k for k in local if k[0] == sidx]:
                    del local[key]
                ends.append(len(ops) // _ROW)
                counts.append(_NO_COUNTS)
                self._forget_groups(stats[sidx])
                self.layout_version += 1
                continue
            st = stats[sidx]
            se = sb = re = rb = 0
            events = batch.events
            if st.block_size is None or any(x.rule == MAMBA for x in st.groups.values()):
                h = st.block_size or _hash_block_size(events, self.block_size)
                events = (_fine_mamba(events, h) if h else None) or events
            for ev in events:
                kind = type(ev)
                if kind is not BlockStored:
                    if kind is BlockRemoved:
                        hashes: list[int] = ev.block_hashes  # type: ignore[union-attr,assignment]  # (kind)
                        medium = _medium_of(ev)  # type: ignore[arg-type]
                        group = ev.group_idx  # type: ignore[union-attr]
                        if group:
                            if not 0 <= group < MAX_GROUPS:
                                self._group_fault(sidx, st, f"BlockRemoved of KV cache group {group}")
                                continue
                            medium = group_medium(medium, group)
                        mi = media.get(medium)
                        if mi is None:
                            if not self._registers(medium):
                                self._bad_event(sidx, st, f"BlockRemoved on medium {medium[:40]!r}")
                                continue
                            mi = media[medium] = len(media)
                        first = len(rems)
                        if st.groups and _window_only(st):
                            self._remember_removed(sidx, st, hashes)
                        if batched:
                            try:
                                rems.fromlist(hashes)  # all or nothing
                            except (OverflowError, TypeError):
                                batched = False  # the store converts (and rejects) the list itself
                        ops.extend((_OP_REMOVE, mi, first, len(hashes), 0))
                        re += 1
                        rb += len(hashes)
                    elif kind is AllBlocksCleared:
                        ops.extend((_OP_CLEAR, 0, 0, 0, 0))
                        clears = True
                    continue
                stored: BlockStored = ev  # type: ignore[assignment]  # (kind)
                hashes = stored.block_hashes  # type: ignore[assignment]  # ints after decode_payload
                n = len(hashes)
                bs = stored.block_size
                tokens: TokenIds = stored.token_ids  # type: ignore[assignment]  # (tested next)
                raw = type(tokens) is TokenIds
                ntokens = tokens.size if raw else len(tokens)
                if bs == 0 and not ntokens:
                    st.placeholders += 1
                    plan.append(None)
                    continue
                medium = _medium_of(stored)
                group = stored.group_idx
                grouped = bool(group) or stored.kv_cache_spec_kind not in (None, FULL)
                if group and 0 <= group < MAX_GROUPS:
                    medium = group_medium(medium, group)
                why = self._stored_fault(stored, n, ntokens, medium, media)
                if why is not None:
                    self._bad_event(sidx, st, _stored_what(n, bs, ntokens, why))
                    plan.append(None)
                    continue
                op = _OP_STORE
                need = 0  # (a sliding window's: where its hashes sit, see _window_drop)
                if grouped:
                    learned = self._learn_group(sidx, st, stored)
                    if learned is None:
                        plan.append(None)
                        continue
                    if learned.rule != FULL:
                        op = _OP_KEEP
                        if learned.rule == SLIDING:
                            need = learned.need()
                elif st.groups and any(g.block_size != bs for g in st.groups.values()):
                    self._group_fault(sidx, st, f"KV cache group 0 with block size {bs}")
                    plan.append(None)
                    continue
                if st.block_size != bs:
                    if self._partial(st, bs, n):
                        self._bad_event(sidx, st, f"a partial block ({bs} tokens)")
                        plan.append(None)
                        continue
                    self._learn_block_size(sidx, st, bs)
                if not n:  # a group that keeps none of the blocks it computed (sliding window)
                    plan.append(None)
                    continue
                k = ntokens // bs  # blocks of tokens: the hashes are n of them, ``drop`` before the end
                drop = _window_drop(need, n, k) if need else 0
                skip = k - n - drop
                if skip or drop:
                    op = _OP_KEEP
                g = groups.get(bs)
                if g is None:
                    g = groups[bs] = _Group(bs, len(groups))
                e = len(g.starts)
                if raw and not tokens.negative and not stored.extra_keys:
                    # _Group.add, inlined for the usual event (payloads have a buffer each: a new run)
                    start = g.blocks
                    g.runs.append([tokens.buf, tokens.off, tokens.off + ntokens])
                    g.starts.append(start)
                    g.sizes.append(k)
                    g.blocks = start + k
                    g.events.append(stored)
                elif g.add(stored, k):
                    start = g.starts[e]
                else:
                    self._bad_event(sidx, st, _stored_what(n, bs, ntokens, "token ids outside 0..2^64-1"))
                    plan.append(None)
                    continue
                if skip:
                    g.hashes.fromlist([0] * skip)  # (blocks without a hash: keyed, never stored)
                try:
                    g.hashes.fromlist(hashes)  # all or nothing
                except (OverflowError, TypeError):
                    g.hashes.fromlist([0] * n)  # the store converts (and rejects) the list itself
                    plan.append((g, -1 - start - skip, n, medium, op == _OP_KEEP))
                    batched = False
                else:
                    plan.append((g, start + skip, n, medium, op == _OP_KEEP))
                if drop:
                    g.hashes.fromlist([0] * drop)
                    g.drops[e] = drop
                elif need and skip:  # (ambiguous: remembered for its children, if window-only)
                    g.wend_events[e] = (sidx, hashes[-1])
                mi = media.get(medium)
                if mi is None:
                    mi = media[medium] = len(media)
                if need and k > n and batched and _window_only(st) and not _block_extras(stored, n):
                    g.windows.append((e, sidx, len(ops) // _ROW, skip))
                ops.extend((op, mi, start + skip, n, g.number))
                se += 1
                sb += n
                parent: int | None = stored.parent_block_hash  # type: ignore[assignment]  # as above
                seen = local.get((sidx, bs))
                if seen is None:
                    seen = local[sidx, bs] = _Seen(g.starts)
                if parent is None:
                    lora = stored.lora_name or stored.lora_id is not None
                    root = lora_root(_lora_of(stored)) if lora else BASE_ROOT
                elif seen.last_e >= 0 and parent == seen.last_hash:  # (_Seen.find's first test)
                    g.later.append((e, seen.last_b, seen.last_e))
                    if seen.last_e in g.wend_events:
                        g.alts[e] = sidx
                    root = 0
                else:
                    found = seen.find(parent)
                    if found is not None:
                        g.later.append((e, found[0], found[1]))
                        pe = found[1]
                        if pe in g.wend_events and found[0] == g.starts[pe] + g.sizes[pe] - 1:
                            g.alts[e] = sidx
                        root = 0
                    else:
                        known = store.key_of(sidx, parent)
                        if known is None:
                            st.unknown_parents += 1
                            root = unknown_root(sidx, parent)
                        else:
                            root = known
                            if st.wends is not None:
                                w = st.wends[_win_slot(parent)]
                                if w is not None and w[0] == parent and w[2] == known:
                                    g.fixes.append((e, sidx, w[1], w[2]))
                g.roots.append(root)
                seen.pending.append((hashes, start + skip))  # _Seen.add, inlined
                seen.last_hash = hashes[-1]
                seen.last_b = start + k - 1 - drop
                seen.last_e = e
            ends.append(len(ops) // _ROW)
            counts.append((se, sb, re, rb))
        for g in groups.values():
            g.prepare()
            if g.fixes or g.alts:
                g.rechain(lambda sidx: _window_only(stats[sidx]))
            g.solve()
            if g.windows and batched and self._place_windows(g, ops):  # (unbatched: the shape's)
                g.solve()
            for e, (sidx, last) in g.wend_events.items():
                st = stats[sidx]
                if _window_only(st):
                    if st.wends is None:
                        st.wends = [None] * WIN_SLOTS
                    end = g.starts[e] + g.sizes[e]
                    st.wends[_win_slot(last)] = (last, int(g.keys[end - 2]), int(g.keys[end - 1]))
        if not batched:
            self._apply_events(items, plan)
            return

        # pass 2: runs of one source's events, one store call each, in stream order
        rows = np.frombuffer(ops, dtype=np.int64).reshape(-1, _ROW) if ops else np.empty((0, _ROW), np.int64)
        if media:
            mids = [store.medium_index(name) for name in media]  # registered in first-use order
            if mids != list(range(len(mids))):
                rows[:, 1] = np.array(mids, dtype=np.int64)[rows[:, 1]]
        if len(groups) == 1:
            (g,) = groups.values()
            ehs, keys = g.ehs, g.keys
        elif groups:  # several block sizes in one chunk: one array, each group's rows moved on
            ehs = np.concatenate([g.ehs for g in groups.values()])
            keys = np.concatenate([g.keys for g in groups.values()])
            offsets = np.cumsum([0] + [g.blocks for g in groups.values()], dtype=np.int64)
            is_store = (rows[:, 0] == _OP_STORE) | (rows[:, 0] == _OP_KEEP)
            rows[is_store, 2] += offsets[rows[is_store, 4]]
        else:
            ehs = keys = np.empty(0, dtype=np.uint64)
        removed = np.frombuffer(rems, dtype=np.uint64) if rems else np.empty(0, dtype=np.uint64)
        now = time.time()
        lag = self.lag_observer
        run = -1  # the source of the op rows not applied yet, ``lo`` to ``upto``
        lo = upto = 0
        for (sidx, batch), hi, (se, sb, re, rb) in zip(items, ends, counts, strict=True):
            if batch is None:
                if upto > lo:
                    store.apply_ops(run, rows[lo:upto], ehs, keys, removed)
                lo = upto
                run = -1
                store.drop(sidx)  # (its groups were forgotten in pass 1)
                if self.on_reset is not None:
                    self.on_reset(sidx)
                continue
            if sidx != run:
                if upto > lo:
                    store.apply_ops(run, rows[lo:upto], ehs, keys, removed)
                lo = upto
                run = sidx
            st = stats[sidx]
            if clears:  # (rare) each AllBlocksCleared after the rows before it
                for c in np.flatnonzero(rows[upto:hi, 0] == _OP_CLEAR).tolist():
                    c += upto
                    if c > lo:
                        store.apply_ops(sidx, rows[lo:c], ehs, keys, removed)
                    lo = c + 1
                    store.clear(sidx, "GPU")
                    st.cleared += 1
                    if self.on_reset is not None:
                        self.on_reset(sidx)
            upto = hi
            st.batches += 1
            st.stored_events += se
            st.blocks_stored += sb
            st.removed_events += re
            st.blocks_removed += rb
            st.last_ts = batch.ts
            st.last_applied = now
            if lag is not None:
                lag(max(0.0, now - batch.ts))
        if upto > lo:
            store.apply_ops(run, rows[lo:upto], ehs, keys, removed)

    def _apply_events(self, items: Sequence[tuple[int, Batch | None]], plan: list[_Step | None]) -> None:
        """Pass 2 event by event: one store call per event (stores without :meth:`PrefixStore.apply_ops`,
        and chunks holding engine hashes that do not fit a uint64 array)."""
        store = self.store
        stats = self.stats
        now = time.time()
        media: dict[str, int] = {}
        steps = iter(plan)
        for sidx, batch in items:
            if batch is None:
                store.drop(sidx)
                if self.on_reset is not None:
                    self.on_reset(sidx)
                continue
            st = stats[sidx]
            st.batches += 1
            for ev in batch.events:
                if type(ev) is BlockStored:
                    step = next(steps)
                    if step is None:
                        continue
                    g, start, n, medium, keep = step
                    midx = media.get(medium)
                    if midx is None:
                        midx = media[medium] = store.medium_index(medium)
                    if start >= 0:
                        store.store(sidx, midx, g.ehs[start : start + n], g.keys[start : start + n], keep)
                    else:
                        start = -1 - start
                        store.store(sidx, midx, _ints(ev.block_hashes), g.keys[start : start + n], keep)
                    st.stored_events += 1
                    st.blocks_stored += n
                elif type(ev) is BlockRemoved:
                    medium = _medium_of(ev)
                    if ev.group_idx:
                        if not 0 <= ev.group_idx < MAX_GROUPS:
                            continue  # (counted in pass 1)
                        medium = group_medium(medium, ev.group_idx)
                    midx = media.get(medium)
                    if midx is None:
                        if not self._registers(medium):
                            continue  # a bad event (counted in pass 1)
                        midx = media[medium] = store.medium_index(medium)
                    store.remove(sidx, midx, _ints(ev.block_hashes))
                    st.removed_events += 1
                    st.blocks_removed += len(ev.block_hashes)
                elif type(ev) is AllBlocksCleared:
                    store.clear(sidx, "GPU")
                    st.cleared += 1
                    if self.on_reset is not None:
                        self.on_reset(sidx)
            st.last_ts = batch.ts
            st.last_applied = now
            if self.lag_observer is not None:
                self.lag_observer(max(0.0, now - batch.ts))

    def _learn_group(self, sidx: int, st: SourceStats, ev: BlockStored) -> GroupSpec | None:
        """The spec of the KV cache group a BlockStored belongs to, learned on its first event; None
        when the event cannot be kept apart (a group index out of range: its matches go to 0)."""
        group = ev.group_idx or 0
        if not 0 <= group < MAX_GROUPS:
            self._group_fault(sidx, st, f"BlockStored of KV cache group {group}")
            return None
        spec = _spec_of(ev)
        window = ev.kv_cache_spec_sliding_window
        known = st.groups.get(group)
        if known is None:
            if spec.kind not in (FULL, SLIDING, MAMBA) or (spec.kind == SLIDING and spec.rule != SLIDING):
                st.group_faults += 1
                log.warning(
                    "source %s: KV cache group %d of kind %r (window %r) is matched as full attention "
                    "(the strictest rule)",
                    self.source_name(sidx),
                    group,
                    spec.kind,
                    window,
                )
            others = {g.block_size for g in st.groups.values()}
            if others and others != {spec.block_size}:
                self._group_fault(sidx, st, f"KV cache group {group} with block size {spec.block_size}")
                return None
            st.groups[group] = spec
            self.layout_version += 1
            # (its GPU medium registered on either path alike: media are numbered in registration order)
            gpu = self._registers(group_medium("GPU", group))
            if self._core is not None and gpu and spec.kind.isascii():
                self._core.set_group(  # the C ingest applies the group's events from now on
                    sidx,
                    group,
                    spec.rule != FULL,
                    -1 if spec.window is None else spec.window,
                    spec.block_size,
                    self.store.medium_index(group_medium("GPU", group)),
                    spec.kind.encode(),
                    spec.need() if spec.rule == SLIDING else 0,
                )
            log.info(
                "source %s: KV cache group %d is %s%s, %d-token blocks",
                self.source_name(sidx),
                group,
                spec.kind,
                f" (window {spec.window})" if spec.rule == SLIDING else "",
                spec.block_size,
            )
            return spec
        if known != spec:
            self._group_fault(sidx, st, f"KV cache group {group} changing to {spec.kind} {spec.block_size}")
            return None
        return known

    def _group_fault(self, sidx: int, st: SourceStats, what: str) -> None:
        """Malformed KV cache group metadata: the event is skipped and the source's matches are 0
        until it restarts (a group the index cannot follow could hold less than the others say)."""
        st.group_faults += 1
        if not st.groups_bad:
            log.warning("source %s: %s: its matches are 0 until it restarts", self.source_name(sidx), what)
        st.groups_bad = True
        self.layout_version += 1
        self._bad_event(sidx, st, what)

    def _remember_removed(self, sidx: int, st: SourceStats, hashes: list[int]) -> None:
        """Keys of a window-only source's blocks being removed (:attr:`SourceStats.ghosts`)."""
        ghosts = st.ghosts
        if ghosts is None:
            ghosts = st.ghosts = [None] * GHOST_SLOTS
        key_of = self.store.key_of
        for h in hashes:
            if type(h) is int and 0 <= h <= M64:
                key = key_of(sidx, h)
                if key is not None:
                    ghosts[_win_slot(h) % GHOST_SLOTS] = (h, key)

    def _known_key(self, sidx: int, h: int) -> int | None:
        """A window-only source's key for an engine hash: mapped, or removed lately."""
        key = self.store.key_of(sidx, h)
        if key is None:
            ghosts = self.stats[sidx].ghosts
            ghost = ghosts[_win_slot(h) % GHOST_SLOTS] if ghosts is not None else None
            if ghost is not None and ghost[0] == h:
                key = ghost[1]
        return key

    def _place_windows(self, g: _Group, ops: array[int]) -> bool:
        """Place a window-only model's windows by their hashes' known keys (:func:`_window_place`):
        their hashes, op rows and children move; True when a child's parent block moved (the keys
        are solved again)."""
        keys = g.keys
        moved = False
        for e, sidx, row, off in g.windows:
            start, k = g.starts[e], g.sizes[e]
            hashes = _ints(g.events[e].block_hashes)
            n = len(hashes)
            at = _window_place(
                [self._known_key(sidx, h) for h in hashes], keys[start : start + k].tolist(), k - n, off
            )
            if at == k - n:
                g.wend_events[e] = (sidx, hashes[-1])
            else:
                g.wend_events.pop(e, None)
            if at == off:
                continue
            g.hashes[start : start + k] = array("Q", [0] * at + hashes + [0] * (k - n - at))
            ops[row * _ROW + 2] = start + at
            for i, (c, _b, pe) in enumerate(g.later):
                if pe == e:
                    parent = g.events[c].parent_block_hash
                    if parent in hashes:
                        g.later[i] = (c, start + at + hashes.index(parent), pe)
                        moved = True
        return moved

    @staticmethod
    def _forget_groups(st: SourceStats) -> None:
        """An engine restart: the new process announces its groups again (another model may run)."""
        st.groups = {}
        st.groups_bad = False
        st.wends = None
        st.ghosts = None

    def _bad_event(self, sidx: int, st: SourceStats, what: str) -> None:
        st.bad_events += 1
        if st.bad_events <= 3 or st.bad_events % 1000 == 0:
            log.warning("source %s: %s skipped (%d so far)", self.source_name(sidx), what, st.bad_events)

    def _stored_fault(
        self, ev: BlockStored, n: int, ntokens: int, medium: str, known: Container[str]
    ) -> str | None:
        """Why a BlockStored of ``n`` hashes and ``ntokens`` token ids is a bad event, None when it is
        not; registers its medium when new (``known``: the names known registered)."""
        bs = ev.block_size
        if bs <= 0 or not ntokens or ntokens % bs or ntokens < bs * n:
            return "bad shape"
        if bs > MAX_BLOCK_SIZE:
            return f"block_size over {MAX_BLOCK_SIZE}"
        if medium not in known and not self._registers(medium):
            return f"medium {medium[:40]!r}"
        if ev.extra_keys and not all(x is None or type(x) is list for x in ev.extra_keys):
            return "an extra_keys entry that is not an array"
        return None

    def _registers(self, medium: str) -> bool:
        """Whether the store knows or can register a medium name (at most ``MAX_MEDIA`` names of at
        most 31 bytes: a name beyond makes its event a bad event, not a lost chunk)."""
        try:
            self.store.medium_index(medium)
        except ValueError:
            return False
        return True

    def _partial(self, st: SourceStats, bs: int, n: int) -> bool:
        """A BlockStored of vLLM's cache_partial_block (hybrid models): one hash holding fewer
        tokens than the blocks the source published so far. Not a change of block size: learning
        it would hash every prompt of the source at the wrong size. (Before the source's first
        block the configured size is no guide: an engine whose size the config gets wrong would
        have every single-block event skipped.)"""
        return st.block_size is not None and n == 1 and bs < st.block_size

    def _learn_block_size(self, sidx: int, st: SourceStats, bs: int) -> None:
        if st.block_size is not None and st.block_size != bs:
            log.warning(
                "source %s: block size changed from %d to %d", self.source_name(sidx), st.block_size, bs
            )
        if st.block_size != bs:
            self.layout_version += 1
        st.block_size = bs
        if self._core is not None:
            self._core.set_block_size(sidx, bs)  # the C path takes this source's events of this size now
        if self.block_size is not None and bs != self.block_size:
            st.block_size_mismatch += 1
            log.error(
                "source %s publishes block_size %d but the router is configured with %d: prompts for this "
                "source are hashed at %d; fix `block_size` in the config to silence this",
                self.source_name(sidx),
                bs,
                self.block_size,
                bs,
            )
