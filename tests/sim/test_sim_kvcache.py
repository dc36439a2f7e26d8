"""The simulated prefix cache: hits, LRU order, pinning, and events that mirror what the cache did."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sim.kvcache import PrefixCache
from sim.publisher import AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalBlockHash


def _toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _only(events: list[Event], kind: type, medium: str | None = None) -> list[Event]:
    return [
        e for e in events if isinstance(e, kind) and (medium is None or getattr(e, "medium", None) == medium)
    ]


def _shape(e: Event) -> tuple[object, ...]:
    """(type, medium, hashes, parent) of an event, for compact comparisons."""
    return (
        type(e).__name__,
        getattr(e, "medium", None),
        getattr(e, "block_hashes", None),
        getattr(e, "parent_block_hash", None),
    )


def test_hashes_chain_and_are_seeded() -> None:
    a = PrefixCache(8, 4, hash_seed=1)
    h = a.block_hashes(_toks(0, 10))
    assert len(h) == 2 and all(isinstance(x, int) and 0 <= x < 2**64 for x in h)
    assert a.block_hashes(_toks(0, 8)) == h  # partial tail never hashed
    assert a.block_hashes([99, *_toks(1, 7)])[1] != h[1]  # the chain carries the parent
    assert PrefixCache(8, 4, hash_seed=2).block_hashes(_toks(0, 8)) != h
    raw = PrefixCache(8, 4, hash_seed=1, hash_bytes=True).block_hashes(_toks(0, 8))
    assert all(isinstance(x, bytes) and len(x) == 32 for x in raw)
    assert [int.from_bytes(x[-8:], "big") for x in raw if isinstance(x, bytes)] == h


def test_prefill_stores_full_blocks_and_hits_are_not_reannounced() -> None:
    c = PrefixCache(16, 4)
    adm = c.admit("a", _toks(1000, 14))
    assert adm is not None and adm.cached_tokens == 0 and adm.new_blocks == 4
    (ev,) = c.take_events()
    ha = c.block_hashes(_toks(1000, 14))
    assert ev == BlockStored(
        block_hashes=ha,
        parent_block_hash=None,
        token_ids=_toks(1000, 12),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None, None, None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    # b shares 2 blocks with a (a is still running: shared blocks are pinned twice)
    b_tokens = _toks(1000, 8) + _toks(6000, 8)
    adm = c.admit("b", b_tokens)
    assert adm is not None and adm.gpu_hit_tokens == 8 and adm.new_blocks == 2
    (ev,) = c.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == ha[1] and ev.block_hashes == c.block_hashes(b_tokens)[2:]
    assert ev.token_ids == _toks(6000, 8)
    assert (c.queries, c.hits) == (14 + 16, 8)


def test_full_hit_still_recomputes_last_token() -> None:
    c = PrefixCache(16, 4)
    assert c.admit("a", _toks(0, 8)) is not None
    c.free("a")
    adm = c.admit("b", _toks(0, 8))
    assert adm is not None and adm.gpu_hit_tokens == 4  # (8 - 1) // 4 blocks
    assert c.probe(_toks(0, 9)) == (8, 0)


def test_lru_eviction_order_matches_vllm_capture() -> None:
    """vLLM eviction.json: 5 usable blocks; A (3 blocks) freed; B needs 4 -> A's tail evicted first."""
    c = PrefixCache(5, 4)
    assert c.admit("A", _toks(1000, 12)) is not None
    ha = c.block_hashes(_toks(1000, 12))
    c.free("A")
    c.take_events()
    assert c.admit("B", _toks(7000, 16)) is not None
    events = c.take_events()
    assert events[:2] == [
        BlockRemoved([ha[2]], "GPU", group_idx=0),
        BlockRemoved([ha[1]], "GPU", group_idx=0),
    ]
    assert isinstance(events[2], BlockStored) and events[2].block_hashes == c.block_hashes(_toks(7000, 16))
    assert len(events) == 3
    assert c.cached_hashes() == {ha[0], *c.block_hashes(_toks(7000, 16))}


def test_lru_prefers_least_recently_freed_and_hits_refresh() -> None:
    c = PrefixCache(4, 4)
    for name, base in (("x", 0), ("y", 100)):
        assert c.admit(name, _toks(base, 8)) is not None
        c.free(name)
    hx, hy = c.block_hashes(_toks(0, 8)), c.block_hashes(_toks(100, 8))
    # touch x again (hit), free it: now y is the oldest
    assert c.admit("x2", _toks(0, 9)) is not None  # 2 hit blocks + 1 new block: evicts y's tail
    c.free("x2")
    c.take_events()
    assert c.admit("z", _toks(500, 8)) is not None
    removed = [_shape(e)[2] for e in _only(c.take_events(), BlockRemoved)]
    assert removed == [[hy[0]]]  # y's block 1 went for x2's third block, then y's block 0
    assert set(hx) <= c.cached_hashes()


def test_pinned_blocks_are_never_evicted_and_admission_waits() -> None:
    c = PrefixCache(4, 4)
    assert c.admit("a", _toks(0, 12)) is not None  # 3 blocks pinned
    assert c.admit("b", _toks(100, 8)) is None  # needs 2, only 1 free
    assert c.take_events()[0] == BlockStored(
        c.block_hashes(_toks(0, 12)),
        None,
        _toks(0, 12),
        4,
        None,
        "GPU",
        None,
        [None] * 3,
        0,
        "full_attention",
    )
    assert c.take_events() == [] and c.queries == 12  # a refused admission changes nothing
    assert c.usage == pytest.approx(0.75)
    assert c.admit("b", _toks(100, 4)) is not None
    assert not c.decode("a", 7)  # a's 13th token needs a fifth block: none free
    c.free("b")
    assert c.decode("a", 7)
    removed = _only(c.take_events(), BlockRemoved)
    assert removed == [BlockRemoved(c.block_hashes(_toks(100, 4)), "GPU", group_idx=0)]


def test_decode_fills_blocks_and_last_token_is_not_cached() -> None:
    c = PrefixCache(8, 4)
    prompt = _toks(0, 6)
    assert c.admit("a", prompt) is not None
    c.take_events()
    outputs = [50, 51, 52, 53]  # o1 is sampled by the prefill step; decode computes o1..o3
    assert c.decode("a", outputs[0]) and c.decode("a", outputs[1])
    (ev,) = c.take_events()  # tokens 0..7 computed: block 1 full
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == [4, 5, 50, 51] and ev.parent_block_hash == c.block_hashes(prompt)[0]
    assert c.decode("a", outputs[2])
    assert c.take_events() == []
    assert c.request_tokens("a") == [*prompt, 50, 51, 52]


def test_decode_duplicate_blocks_are_announced_per_copy() -> None:
    """Two requests decoding the same content each cache (and announce) their own block, like vLLM."""
    c = PrefixCache(8, 4)
    for name in ("a", "b"):
        assert c.admit(name, _toks(0, 6)) is not None
    c.take_events()
    for name in ("a", "b"):
        assert c.decode(name, 9) and c.decode(name, 9)
    stored = _only(c.take_events(), BlockStored)
    assert len(stored) == 2 and stored[0].block_hashes == stored[1].block_hashes  # type: ignore[union-attr]
    assert c.num_cached_blocks == 3  # prompt block 0 shared, block 1 twice


def test_reset_only_when_idle() -> None:
    c = PrefixCache(8, 4)
    assert c.admit("a", _toks(0, 8)) is not None
    c.take_events()
    assert not c.reset() and c.take_events() == []
    c.free("a")
    assert c.reset() and c.take_events() == [AllBlocksCleared()]
    assert c.cached_hashes() == set() and c.num_free_blocks == 8
    assert c.probe(_toks(0, 9)) == (0, 0)
    assert c.admit("a", _toks(0, 8)) is not None
    ev = c.take_events()[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == c.block_hashes(_toks(0, 8))  # same hashes


def test_cpu_tier_matches_vllm_offload_capture() -> None:
    """vLLM offload-cpu.json: chunks of 2 blocks, 3 chunks of CPU; GPU then CPU events per step."""
    c = PrefixCache(64, 4, cpu_blocks=6, hashes_per_chunk=2)
    a, b, cc = _toks(1000, 16), _toks(1000, 8) + _toks(6000, 8), _toks(8000, 16)
    ha, hb, hc = c.block_hashes(a), c.block_hashes(b), c.block_hashes(cc)
    assert c.admit("A", a) is not None
    ev = c.take_events()
    assert [_shape(e) for e in ev] == [
        ("BlockStored", "GPU", ha, None),
        ("BlockStored", "CPU", ha[:2], None),
        ("BlockStored", "CPU", ha[2:], ha[1]),
    ]
    cpu0 = ev[1]
    assert isinstance(cpu0, BlockStored) and cpu0.token_ids == _toks(1000, 8) and cpu0.extra_keys is None
    assert c.admit("B", b) is not None
    ev = c.take_events()
    assert [_shape(e) for e in ev] == [
        ("BlockStored", "GPU", hb[2:], hb[1]),
        ("BlockStored", "CPU", hb[2:], hb[1]),
    ]
    assert c.admit("C", cc) is not None
    ev = c.take_events()
    assert [_shape(e)[:3] for e in ev] == [
        ("BlockStored", "GPU", hc),
        ("BlockRemoved", "CPU", ha[2:] + hb[2:]),
        ("BlockStored", "CPU", hc[:2]),
        ("BlockStored", "CPU", hc[2:]),
    ]


def test_cpu_hit_counts_as_cached_and_reloads_to_gpu() -> None:
    c = PrefixCache(5, 4, cpu_blocks=8, hashes_per_chunk=2)
    p = _toks(0, 17)
    assert c.admit("a", p) is not None
    c.free("a")
    assert c.admit("b", _toks(500, 20)) is not None  # evicts all of a's GPU blocks
    c.free("b")
    c.take_events()
    assert c.probe(p) == (0, 16)
    assert c.probe(_toks(0, 15)) == (0, 8)  # only whole chunks, at most (n - 1) // block_size blocks
    adm = c.admit("a2", p)
    assert adm is not None and (adm.gpu_hit_tokens, adm.cpu_hit_tokens, adm.cached_tokens) == (0, 16, 16)
    events = c.take_events()
    stored = _only(events, BlockStored, "GPU")
    assert stored[0].block_hashes == c.block_hashes(p)  # type: ignore[union-attr]
    assert _only(events, BlockStored, "CPU") == []  # already there: touched, not re-stored
    assert (c.cpu_queries, c.cpu_hits) == (17 + 20 + 17, 16)


def test_cpu_chunks_overlapping_a_shared_prefix_repeat_hashes() -> None:
    c = PrefixCache(64, 4, cpu_blocks=64, hashes_per_chunk=2)
    a = _toks(0, 16)
    b = _toks(0, 12) + _toks(900, 4)  # shares 3 blocks: chunk 1 of b = [a's block 2, new block 3]
    assert c.admit("a", a) is not None
    assert c.admit("b", b) is not None
    cpu = Counter(c.cpu_hashes())
    assert cpu[c.block_hashes(a)[2]] == 2  # announced once per chunk that holds it
    stores = Counter(h for e in _only(c.take_events(), BlockStored, "CPU") for h in e.block_hashes)  # type: ignore[union-attr]
    assert stores == cpu


def _apply(state: Counter[tuple[str, ExternalBlockHash]], events: list[Event]) -> None:
    """A reference-counting consumer of the event stream."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            for key in [k for k in state if k[0] == "GPU"]:
                del state[key]
        else:
            assert e.medium is not None
            for h in e.block_hashes:
                key = (e.medium, h)
                if isinstance(e, BlockStored):
                    state[key] += 1
                else:
                    assert state[key] > 0, f"removed {key} that was never stored"
                    state[key] -= 1
                    if state[key] == 0:
                        del state[key]


def test_random_workload_events_reconstruct_cache_state() -> None:
    rng = random.Random(7)
    c = PrefixCache(24, 4, cpu_blocks=16, hashes_per_chunk=2, hash_seed=3)
    state: Counter[tuple[str, ExternalBlockHash]] = Counter()
    prefixes = [_toks(1000 * i, rng.randrange(4, 20)) for i in range(6)]
    running: dict[str, int] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.35:
            prompt = rng.choice(prefixes) + _toks(rng.randrange(10**6), rng.randrange(0, 10))
            if c.admit(f"r{step}", prompt) is not None:
                running[f"r{step}"] = rng.randrange(1, 12)
        elif op < 0.8 and running:
            rid = rng.choice(sorted(running))
            if c.decode(rid, rng.randrange(50)):
                running[rid] -= 1
                if running[rid] == 0:
                    del running[rid]
                    c.free(rid)
        elif op < 0.98 and running:
            rid = rng.choice(sorted(running))
            del running[rid]
            c.free(rid)
        elif not running:
            assert c.reset()
        _apply(state, c.take_events())
        gpu = Counter(h for (m, h), n in state.items() if m == "GPU" for _ in range(n))
        assert set(gpu) == c.cached_hashes()
        assert sum(gpu.values()) == c.num_cached_blocks
        assert Counter(h for (m, h), n in state.items() if m == "CPU" for _ in range(n)) == Counter(
            c.cpu_hashes()
        )
        assert 0 <= c.num_free_blocks <= c.num_blocks
