"""A block-level prefix cache that behaves (and reports) like vLLM's v1 BlockPool.

Pure logic, no I/O: the engine's scheduler drives it and publishes `take_events()` once per step.
What it reproduces, because a KV-aware router observes exactly these things:

* full blocks of `block_size` tokens, each hash chained on its parent's; a partial tail is never hashed;
* a fixed pool of `num_blocks`; blocks of running requests are pinned (ref-counted); freed blocks stay
  cached and go to the tail of a free queue (a request's blocks in reverse order, so its tail is evicted
  first); allocation pops the head and evicts the cached hash it held (LRU);
* the events vLLM emits: one `BlockStored` per "cache full blocks" call with every newly full block
  (prefix hits are not re-announced unless a request asks, `report_hits`; parent None at token 0),
  one `BlockRemoved` per evicted hash
  (removals come before the stores of the same step because they happen during allocation), and
  `AllBlocksCleared` on a successful `reset()`;
* like vLLM, a block filled during decode whose content is already cached in another block is cached
  (and announced) again, and each copy's eviction is announced: consumers see repeated hashes;
* an optional CPU tier in the style of vLLM's OffloadingConnector with self-describing events (chunks
  of `hashes_per_chunk` blocks keyed by their last block hash, stored when their blocks become full,
  LRU-evicted with one fanned-out `BlockRemoved` per store call; connector events follow the GPU events
  of the same step).

Hashes are blake2b over (parent digest, tokens) keyed by `hash_seed`: deliberately not vLLM's or the
router's algorithm, so the router can only learn them from the events.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sim.publisher import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    ExternalBlockHash,
)

SPEC_KIND = "full_attention"


@dataclass
class _Block:
    """One physical GPU block; `digest` is set once the block is full and cached (for KV cache
    group `group` of a hybrid model)."""

    block_id: int
    ref_cnt: int = 0
    digest: bytes | None = None
    group: int = 0


@dataclass
class _Seq:
    """A running request's view of the cache."""

    tokens: list[int]
    blocks: list[int]
    num_computed: int = 0
    num_cached_blocks: int = 0  # blocks already handed to _cache_full_blocks
    digests: list[bytes] = field(default_factory=list)  # one per full block of `tokens`
    offloaded_chunks: int = 0  # CPU chunks of this request already considered for offload


@dataclass(frozen=True)
class Admission:
    """Result of admitting a request: how much of its prompt was served from cache."""

    gpu_hit_tokens: int
    cpu_hit_tokens: int
    new_blocks: int
    external_tokens: int = 0
    """Tokens beyond the local hits whose KV arrived from another engine (a P/D transfer)."""

    @property
    def cached_tokens(self) -> int:
        """Tokens that need no prefill compute (reported as `usage.prompt_tokens_details.cached_tokens`)."""
        return self.gpu_hit_tokens + self.cpu_hit_tokens + self.external_tokens


@dataclass
class _Chunk:
    digests: list[bytes]
    parent: bytes | None
    tokens: list[int]


class BlockPool:
    """What the one-group cache and the hybrid one (``sim.kvgroups``) share: the pool's blocks and
    free queue, vLLM's prefix-cache counters, and the engine's own block hash (blake2b over (parent
    digest, tokens) keyed by ``hash_seed``), so both announce the same hashes for the same tokens."""

    def __init__(self, num_blocks: int, block_size: int, hash_seed: int, hash_bytes: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_bytes = hash_bytes
        self._key = hash_seed.to_bytes(8, "big", signed=hash_seed < 0)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free queue in eviction order (head = next victim); holds ref_cnt == 0 blocks, cached or not.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # accounting (vLLM's prefix_cache_* and external_prefix_cache_* counters)
        self.queries = 0
        self.hits = 0
        self.cpu_queries = 0
        self.cpu_hits = 0

    def _digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(digest_size=32, key=self._key)
        h.update(parent if parent is not None else b"\x00" * 32)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def external(self, digest: bytes) -> ExternalBlockHash:
        """The hash as events carry it: the low 64 bits as an unsigned int, or the digest bytes."""
        return digest if self.hash_bytes else int.from_bytes(digest[-8:], "big")

    def _extend_digests(self, digests: list[bytes], tokens: Sequence[int]) -> None:
        bs = self.block_size
        for i in range(len(digests), len(tokens) // bs):
            digests.append(self._digest(digests[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]))

    def block_hashes(self, tokens: Sequence[int]) -> list[ExternalBlockHash]:
        """External hashes of every full block of `tokens` (what BlockStored would announce)."""
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        return [self.external(d) for d in digests]

    @property
    def num_free_blocks(self) -> int:
        """Blocks not pinned by a running request (cached or empty)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks pinned by running requests, like `vllm:kv_cache_usage_perc`."""
        return 1.0 - len(self._free) / self.num_blocks

    def _pin(self, b: int) -> None:
        block = self._blocks[b]
        if block.ref_cnt == 0:
            del self._free[b]
        block.ref_cnt += 1

    def _forget_hashes(self) -> None:
        """A reset's part in the pool: no block holds a hash, all are free again in block order."""
        for block in self._blocks:
            block.digest = None
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))


class PrefixCache(BlockPool):
    """GPU block pool with prefix caching, plus an optional CPU offload tier.

    Requests are identified by caller-chosen string ids. Lifecycle: `admit` (prefill), then one
    `decode` per generated token after the first, then `free`. `admit`/`decode` return a falsy value and
    change nothing when the pool cannot supply a block, so the scheduler can wait or preempt.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        hash_seed: int = 0,
        hash_bytes: bool = False,
        cpu_blocks: int = 0,
        hashes_per_chunk: int = 4,
        group_idx: int = 0,
        connector: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or hashes_per_chunk <= 0 or cpu_blocks < 0:
            raise ValueError("num_blocks, block_size and hashes_per_chunk must be > 0, cpu_blocks >= 0")
        super().__init__(num_blocks, block_size, hash_seed, hash_bytes)
        self.group_idx = group_idx
        self._cached: dict[bytes, dict[int, None]] = {}  # digest -> blocks holding it (vLLM allows several)
        self._seqs: dict[str, _Seq] = {}
        self._gpu_events: list[Event] = []
        # CPU tier
        self.hashes_per_chunk = hashes_per_chunk
        self.cpu_blocks = cpu_blocks
        self.cpu_capacity_chunks = cpu_blocks // hashes_per_chunk
        self._cpu: OrderedDict[bytes, _Chunk] = OrderedDict()  # key = last block digest, LRU order
        self._cpu_events: list[Event] = []
        self.connector = connector or cpu_blocks > 0
        """A KV connector is configured (CPU offload tier, NIXL): external_prefix_cache_* count."""

    # ---- queries -----------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks currently holding a cached hash (pinned or not)."""
        return sum(len(v) for v in self._cached.values())

    def cached_hashes(self) -> set[ExternalBlockHash]:
        """External hashes currently cached on GPU."""
        return {self.external(d) for d in self._cached}

    def cached_by_medium(self) -> dict[str, int]:
        """Distinct cached block hashes per medium, named as the router's index names them (what an
        index that applied every event holds)."""
        out = {"GPU": len(self._cached)}
        if self.cpu_blocks:
            out["CPU"] = len({d for chunk in self._cpu.values() for d in chunk.digests})
        return out

    def fits_alone(self, n_tokens: int) -> bool:
        """Whether a request of ``n_tokens`` could be admitted into an otherwise empty pool."""
        return -(-n_tokens // self.block_size) <= self.num_blocks

    def cpu_hashes(self) -> list[ExternalBlockHash]:
        """Per-block hashes held by the CPU tier, with repeats when chunks overlap."""
        return [self.external(d) for c in self._cpu.values() for d in c.digests]

    def has_request(self, req_id: str) -> bool:
        """Whether `req_id` holds blocks."""
        return req_id in self._seqs

    def request_tokens(self, req_id: str) -> list[int]:
        """All tokens (prompt and generated) of a running request."""
        return list(self._seqs[req_id].tokens)

    def request_blocks(self, req_id: str) -> list[int]:
        """Physical block ids of a request that holds blocks (running, or kept for a P/D transfer)."""
        return list(self._seqs[req_id].blocks)

    def block_contents(self, req_id: str, block_ids: Sequence[int]) -> list[list[int]] | None:
        """The tokens held by some of a request's blocks, in the order asked (what a P/D transfer
        reads: a block's KV is a function of these tokens and their prefix); None when a block id is
        not one of the request's."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return None
        where = {b: i for i, b in enumerate(seq.blocks)}
        bs = self.block_size
        out = []
        for b in block_ids:
            i = where.get(b)
            if i is None:
                return None
            out.append(seq.tokens[i * bs : (i + 1) * bs])
        return out

    def _max_hit_blocks(self, n_tokens: int) -> int:
        # vLLM always recomputes at least the last prompt token (it needs its logits).
        return max(n_tokens - 1, 0) // self.block_size

    def _lookup(self, digests: list[bytes], n_tokens: int) -> tuple[list[int], int]:
        """(GPU hit block ids, CPU hit blocks after them) for a prompt, without side effects."""
        limit = min(self._max_hit_blocks(n_tokens), len(digests))
        gpu: list[int] = []
        for d in digests[:limit]:
            holders = self._cached.get(d)
            if not holders:
                break
            gpu.append(next(iter(holders)))
        end = len(gpu)
        if self.cpu_capacity_chunks:
            k = self.hashes_per_chunk
            c = end // k
            while (c + 1) * k <= len(digests) and digests[(c + 1) * k - 1] in self._cpu and end < limit:
                end = min((c + 1) * k, limit)
                c += 1
        return gpu, end - len(gpu)

    def held_blocks(self, tokens: Sequence[int]) -> int:
        """How many of the full blocks of `tokens` are cached on GPU, each looked up on its own (not
        only a leading run, as a request's hit is)."""
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        return sum(1 for d in digests if self._cached.get(d))

    def probe(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(GPU hit tokens, CPU hit tokens) a request with `tokens` would get now; no side effects."""
        digests: list[bytes] = []
        self._extend_digests(digests, tokens)
        gpu, cpu = self._lookup(digests, len(tokens))
        return len(gpu) * self.block_size, cpu * self.block_size

    # ---- lifecycle ---------------------------------------------------------------------------------

    def admit(
        self,
        req_id: str,
        tokens: Sequence[int],
        external_tokens: int = 0,
        report_hits: bool = False,
        prompt_tokens: int | None = None,
    ) -> Admission | None:
        """Prefill `tokens`: reuse the cached prefix, allocate the rest, cache every full block.

        Returns None (and changes nothing but a `report_hits` announcement) when too few blocks are
        free. Also used to resume a
        preempted request with its prompt plus generated tokens. `external_tokens`: the first tokens
        whose KV was received from another engine (P/D); like local hits they need no compute, at
        most all but the last token (whose logits the first output needs), and their full blocks are
        cached and announced like computed ones. `report_hits`: the request asked for
        ``kv_cache_report_mode = "full"``, so its GPU prefix hit is announced again first (one
        BlockStored from block 0 with no parent, no removal to match it), as vLLM does.
        `prompt_tokens`: how many of `tokens` are the prompt (a resumed request's are fewer); one
        full-attention group caches the same blocks either way, so it is not used here.
        """
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} already admitted")
        if not tokens:
            raise ValueError("empty prompt")
        seq = _Seq(tokens=list(tokens), blocks=[])
        self._extend_digests(seq.digests, seq.tokens)
        gpu_hit, cpu_hit = self._lookup(seq.digests, len(seq.tokens))
        total = -(-len(seq.tokens) // self.block_size)
        new_blocks = total - len(gpu_hit)
        # vLLM announces the hit when it looks the prefix up, before allocating: also on a try
        # that then waits for free blocks (and again at the next try)
        if report_hits and gpu_hit:
            n = len(gpu_hit)
            self._gpu_events.append(
                BlockStored(
                    block_hashes=[self.external(d) for d in seq.digests[:n]],
                    parent_block_hash=None,
                    token_ids=seq.tokens[: n * self.block_size],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=[None] * n,
                    group_idx=self.group_idx,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )
        hit_in_free = sum(1 for b in gpu_hit if self._blocks[b].ref_cnt == 0)
        if new_blocks > len(self._free) - hit_in_free:
            return None
        n_hit_tokens = len(gpu_hit) * self.block_size
        local = n_hit_tokens + cpu_hit * self.block_size
        external = max(0, min(external_tokens, len(seq.tokens) - 1) - local)
        self.queries += len(seq.tokens)
        self.hits += n_hit_tokens
        if self.connector:
            self.cpu_queries += len(seq.tokens) - n_hit_tokens
            self.cpu_hits += cpu_hit * self.block_size + external
        for b in gpu_hit:
            self._pin(b)
        seq.blocks = gpu_hit + [self._allocate() for _ in range(new_blocks)]
        seq.num_cached_blocks = len(gpu_hit)
        seq.num_computed = len(seq.tokens)
        self._seqs[req_id] = seq
        self._cache_full_blocks(seq)
        return Admission(n_hit_tokens, cpu_hit * self.block_size, new_blocks, external)

    def decode(self, req_id: str, token: int) -> bool:
        """One decode step: compute the previously sampled `token`; returns False if no block is free.

        The newest sampled token is only computed in the next step, so a request's final token is
        never cached, as in vLLM.
        """
        seq = self._seqs[req_id]
        if len(seq.tokens) + 1 > len(seq.blocks) * self.block_size:
            if not self._free:
                return False
            seq.blocks.append(self._allocate())
        seq.tokens.append(token)
        seq.num_computed = len(seq.tokens)
        self._extend_digests(seq.digests, seq.tokens)
        self._cache_full_blocks(seq)
        return True

    def free(self, req_id: str) -> None:
        """Release a finished or preempted request; its blocks stay cached (no event) until evicted."""
        seq = self._seqs.pop(req_id)
        for b in reversed(seq.blocks):
            block = self._blocks[b]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[b] = None

    def reset(self) -> bool:
        """Drop every cached GPU hash (AllBlocksCleared); refused while any request holds blocks."""
        if self._seqs:
            return False
        self._forget_hashes()
        self._cached.clear()
        self._gpu_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        """Events since the last call: GPU manager events first, then CPU connector events."""
        events = self._gpu_events + self._cpu_events
        self._gpu_events, self._cpu_events = [], []
        return events

    # ---- internals ---------------------------------------------------------------------------------

    def _allocate(self) -> int:
        b, _ = self._free.popitem(last=False)
        block = self._blocks[b]
        if block.digest is not None:
            holders = self._cached[block.digest]
            del holders[b]
            if not holders:
                del self._cached[block.digest]
            self._gpu_events.append(
                BlockRemoved(
                    block_hashes=[self.external(block.digest)], medium=MEDIUM_GPU, group_idx=self.group_idx
                )
            )
            block.digest = None
        block.ref_cnt = 1
        return b

    def _cache_full_blocks(self, seq: _Seq) -> None:
        """Cache and announce the blocks that became full since the last call (one BlockStored)."""
        bs = self.block_size
        full = seq.num_computed // bs
        start = seq.num_cached_blocks
        if full <= start:
            return
        for i in range(start, full):
            digest = seq.digests[i]
            self._blocks[seq.blocks[i]].digest = digest
            self._cached.setdefault(digest, {})[seq.blocks[i]] = None
        seq.num_cached_blocks = full
        self._gpu_events.append(
            BlockStored(
                block_hashes=[self.external(d) for d in seq.digests[start:full]],
                parent_block_hash=self.external(seq.digests[start - 1]) if start else None,
                token_ids=seq.tokens[start * bs : full * bs],
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * (full - start),
                group_idx=self.group_idx,
                kv_cache_spec_kind=SPEC_KIND,
            )
        )
        if self.cpu_capacity_chunks:
            self._offload(seq)

    def _offload(self, seq: _Seq) -> None:
        """Store the request's newly complete chunks on CPU (evicting LRU chunks first), then touch the
        chunks it found already there (CPU hits or shared prefixes); those are never evicted for it."""
        k = self.hashes_per_chunk
        complete = seq.num_cached_blocks // k
        new: list[int] = []
        present: list[bytes] = []
        for c in range(seq.offloaded_chunks, complete):
            key = seq.digests[(c + 1) * k - 1]
            if key in self._cpu:
                present.append(key)
            else:
                new.append(c)
        seq.offloaded_chunks = complete
        if new and len(new) <= self.cpu_capacity_chunks - len(present):
            self._store_chunks(seq, new, set(present))
        # else: nothing new, or (like vLLM's prepare_store) no room can be made: the store is skipped
        for key in present:
            self._cpu.move_to_end(key)

    def _store_chunks(self, seq: _Seq, new: list[int], protected: set[bytes]) -> None:
        k, bs = self.hashes_per_chunk, self.block_size
        overflow = len(self._cpu) + len(new) - self.cpu_capacity_chunks
        victims = [key for key in self._cpu if key not in protected][: max(overflow, 0)]
        evicted: list[bytes] = []
        for key in victims:
            evicted.extend(self._cpu.pop(key).digests)
        if evicted:
            self._cpu_events.append(
                BlockRemoved(
                    block_hashes=[self.external(d) for d in evicted],
                    medium=MEDIUM_CPU,
                    group_idx=self.group_idx,
                )
            )
        for c in new:
            digests = seq.digests[c * k : (c + 1) * k]
            parent = seq.digests[c * k - 1] if c else None
            tokens = seq.tokens[c * k * bs : (c + 1) * k * bs]
            self._cpu[digests[-1]] = _Chunk(digests, parent, tokens)
            self._cpu_events.append(
                BlockStored(
                    block_hashes=[self.external(d) for d in digests],
                    parent_block_hash=self.external(parent) if parent is not None else None,
                    token_ids=tokens,
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_CPU,
                    lora_name=None,
                    group_idx=self.group_idx,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )


class KVCache(Protocol):
    """What the step (``sim.scheduler``) and the engine use of a rank's cache: ``PrefixCache`` (one
    full-attention group) and ``sim.kvgroups.HybridPrefixCache`` (hybrid KV cache groups)."""

    num_blocks: int
    block_size: int
    queries: int
    hits: int
    cpu_queries: int
    cpu_hits: int

    @property
    def usage(self) -> float: ...

    def probe(self, tokens: Sequence[int]) -> tuple[int, int]: ...

    def admit(
        self,
        req_id: str,
        tokens: Sequence[int],
        external_tokens: int = 0,
        report_hits: bool = False,
        prompt_tokens: int | None = None,
    ) -> Admission | None: ...

    def decode(self, req_id: str, token: int) -> bool: ...

    def free(self, req_id: str) -> None: ...

    def reset(self) -> bool: ...

    def take_events(self) -> list[Event]: ...

    def has_request(self, req_id: str) -> bool: ...

    def request_blocks(self, req_id: str) -> list[int]: ...

    def block_contents(self, req_id: str, block_ids: Sequence[int]) -> list[list[int]] | None: ...

    def cached_by_medium(self) -> dict[str, int]: ...

    def fits_alone(self, n_tokens: int) -> bool: ...

    def held_blocks(self, tokens: Sequence[int]) -> int: ...
