"""The reference-counted store, fed through the ingestor, against vLLM's ground truth and a naive model."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_vectors import NaiveModel, live_frames, load, scenarios

from index.ingest import Ingestor
from index.keys import prompt_keys
from index.store import PrefixStore
from index.wire import decode_message, decode_payload
from sim.publisher import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch


def _replay_capture(name: str) -> tuple[PrefixStore, Ingestor, NaiveModel, dict[str, int], int]:
    capture = load(name)
    store = PrefixStore()
    ing = Ingestor(store, capture["block_size"])
    model = NaiveModel()
    sidx = {}
    for rank in capture["ranks"]:
        sidx[rank] = ing.add_source(("engine", int(rank)))
        for frames in live_frames(capture, rank):
            _, batch = decode_message(frames)
            ing.apply(sidx[rank], batch)
            model.apply_payload(int(rank), frames[2])
    return store, ing, model, sidx, capture["block_size"]


@pytest.mark.parametrize("name", scenarios())
def test_capture_state_matches_vllm_hashes(name: str) -> None:
    """For every request of every capture, our token-keyed match equals the match by vLLM's own hashes."""
    store, _, model, sidx, bs = _replay_capture(name)
    capture = load(name)
    checked = 0
    for rank, data in capture["ranks"].items():
        for rq in data["requests"]:
            if not rq.get("hashes"):
                continue
            keys = prompt_keys(
                rq["token_ids"],
                bs,
                lora_name=rq["lora_name"],
                extra_keys={0: [rq["cache_salt"]]} if rq["cache_salt"] else None,
            )
            for other_rank in capture["ranks"]:
                (m,) = store.lookup(keys, [sidx[other_rank]])
                n, by = model.expected(int(other_rank), rq["hashes"])
                assert (m.blocks, m.by_medium) == (n, by), (rq["id"], rank, other_rank)
                checked += 1
    # residency counts equal the model's live (rank, medium, hash) entries
    live = Counter((r, m) for (r, m, _), c in model.counts.items() if c > 0)
    for counts in store.counts():
        rank = counts.source[1]
        for medium, n in counts.blocks.items():
            assert n == live.get((rank, medium), 0), (medium, counts)
    if name not in ("all-types-topic", "gap-replay-req", "ipc-bind"):
        assert checked > 0


def test_eviction_removes_a_blocks() -> None:
    store, _, _, sidx, bs = _replay_capture("eviction")
    a, b = load("eviction")["ranks"]["0"]["requests"][:2]
    (ma,) = store.lookup(prompt_keys(a["token_ids"], bs), [sidx["0"]])
    (mb,) = store.lookup(prompt_keys(b["token_ids"], bs), [sidx["0"]])
    assert ma.blocks < len(a["hashes"])  # A's blocks were evicted for B
    assert mb.blocks == len(b["hashes"])


def test_clear_keeps_only_blocks_stored_after_it() -> None:
    store, ing, _, sidx, bs = _replay_capture("clear")
    assert ing.stats[sidx["0"]].cleared == 1
    rq = load("clear")["ranks"]["0"]["requests"][0]
    (m,) = store.lookup(prompt_keys(rq["token_ids"], bs), [sidx["0"]])
    assert m.blocks == len(rq["hashes"])  # A-again re-stored the same blocks after the clear


def test_multi_dp_gives_two_ranks() -> None:
    store, _, _, sidx, bs = _replay_capture("multi-dp")
    assert {c.source for c in store.counts()} == {("engine", 0), ("engine", 1)}
    rq = load("multi-dp")["ranks"]["0"]["requests"][1]  # rank 0's own continuation
    m0, m1 = store.lookup(prompt_keys(rq["token_ids"], bs), [sidx["0"], sidx["1"]])
    assert m0.blocks == len(rq["hashes"]) and m1.blocks < m0.blocks


def test_offload_cpu_counts_gpu_and_cpu_with_refcounts() -> None:
    store, ing, _, sidx, _ = _replay_capture("offload-cpu")
    blocks = store.source_blocks(sidx["0"])
    assert blocks["GPU"] > 0 and blocks["CPU"] > 0
    assert ing.stats[sidx["0"]].placeholders == 0


def test_legacy_offload_placeholders_are_counted_and_ignored() -> None:
    store, ing, _, sidx, _ = _replay_capture("offload-cpu-legacy")
    assert ing.stats[sidx["0"]].placeholders > 0
    assert "CPU" not in store.source_blocks(sidx["0"])


def test_lora_and_salt_requests_match_only_their_own_blocks() -> None:
    store, _, _, sidx, bs = _replay_capture("lora-salt-session")
    reqs = {r["id"]: r for r in load("lora-salt-session")["ranks"]["0"]["requests"]}
    tokens = reqs["base"]["token_ids"]
    assert tokens == reqs["lora"]["token_ids"] == reqs["salted"]["token_ids"]
    for name, kwargs in (
        ("base", {}),
        ("lora", {"lora_name": "sql-adapter"}),
        ("salted", {"extra_keys": {0: ["tenant-42"]}}),
    ):
        (m,) = store.lookup(prompt_keys(tokens, bs, **kwargs), [sidx["0"]])  # type: ignore[arg-type]
        assert m.blocks == 2, name
    (m,) = store.lookup(prompt_keys(tokens, bs, lora_name="other"), [sidx["0"]])
    assert m.blocks == 0


# --- a naive model under random interleavings -------------------------------------------------


class _Engine:
    """A toy engine: blocks of 2 tokens from a small alphabet, vLLM-like hashes seeded per engine."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def ehash(self, tokens: tuple[int, ...]) -> int:
        return hash((self.seed, tokens)) & (2**64 - 1)


BS = 2
PATHS = [tuple(p) for p in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [1, 2, 7, 7, 7, 7], [5, 5, 5, 5])]

op_st = st.tuples(
    st.sampled_from(["store", "dup", "remove", "store", "dup", "remove", "clear", "restart"]),
    st.integers(0, 1),  # source (the third one stays idle: its index must stay empty)
    st.sampled_from(["GPU", "GPU", "CPU"]),
    st.integers(0, len(PATHS) - 1),
    st.integers(1, 4),  # blocks
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=3, max_size=40), encoding=st.sampled_from(["map", "array"]))
def test_random_interleavings_against_naive_model(
    ops: list[tuple[str, int, str, int, int]], encoding: str
) -> None:
    store = PrefixStore()
    ing = Ingestor(store, BS)
    engines = [_Engine(s) for s in (11, 22, 33)]
    sidx = [ing.add_source(("e", s)) for s in range(3)]
    # model: per source, per medium, prefix tuple -> count
    model: list[Counter[tuple[str, tuple[int, ...]]]] = [Counter() for _ in range(3)]

    def send(s: int, events: list[object]) -> None:
        payload = encode_batch(events, ts=1.0, dp_rank=0, encoding=encoding)  # type: ignore[arg-type]
        ing.apply(sidx[s], decode_payload(payload))

    for kind, s, medium, p, nblocks in ops:
        eng = engines[s]
        path = PATHS[p][: nblocks * BS]
        prefixes = [path[: (i + 1) * BS] for i in range(len(path) // BS)]
        if kind in ("store", "dup"):
            # like vLLM: store from the first block this source does not hold on this medium
            held = [model[s][medium, pre] > 0 for pre in prefixes]
            first = 0 if kind == "dup" else (held.index(False) if False in held else len(held))
            # the parent must be held somewhere on this source, else start from the root
            if first > 0 and not any(model[s][m, prefixes[first - 1]] > 0 for m in ("GPU", "CPU")):
                first = 0
            new = prefixes[first:]
            if not new:
                continue
            parent = eng.ehash(prefixes[first - 1]) if first else None
            toks = [t for pre in new for t in pre[-BS:]]
            send(s, [BlockStored([eng.ehash(x) for x in new], parent, toks, BS, None, medium, None)])
            for pre in new:
                model[s][medium, pre] += 1
        elif kind == "remove":
            doomed = [pre for pre in prefixes if model[s][medium, pre] > 0][-nblocks:]
            if not doomed:
                continue
            send(s, [BlockRemoved([eng.ehash(x) for x in doomed], medium)])
            for pre in doomed:
                model[s][medium, pre] -= 1
        elif kind == "clear":
            send(s, [AllBlocksCleared()])
            for key in list(model[s]):
                if key[0] == "GPU":
                    del model[s][key]
        else:
            ing.apply_chunk([(sidx[s], None)])
            model[s].clear()

        # invariants after every step
        for src in range(3):
            for (med, pre), count in model[src].items():
                assert count >= 0
                key = prompt_keys(list(pre), BS)[-1]
                assert store.refcount(sidx[src], key, med) == count, (src, med, pre)
            expected_blocks = Counter(med for (med, _), c in model[src].items() if c > 0)
            got = store.source_blocks(sidx[src])
            assert {m: n for m, n in got.items() if n} == dict(expected_blocks)
        for path in PATHS:
            matches = store.lookup(prompt_keys(list(path), BS), sidx)
            for src, m in enumerate(matches):
                n = 0
                for i in range(len(path) // BS):
                    pre = path[: (i + 1) * BS]
                    if not any(model[src][med, pre] > 0 for med in ("GPU", "CPU")):
                        break
                    n += 1
                assert m.blocks == n
                assert sum(m.by_medium.values()) == n
    assert store.total == sum(1 for s in range(3) for _, c in model[s].items() if c > 0)


def test_memory_cap_evicts_oldest_and_counts() -> None:
    store = PrefixStore(max_residencies=1000)
    ing = Ingestor(store, 4)
    s = ing.add_source(("e", 0))
    rng = random.Random(0)
    for i in range(50):
        toks = [rng.randrange(1000) for _ in range(4 * 40)]
        ing.apply(
            s,
            decode_payload(
                encode_batch(
                    [BlockStored(list(range(i * 40, i * 40 + 40)), None, toks, 4, None, "GPU", None)], 1.0, 0
                )
            ),
        )
    assert store.total <= 1000
    assert store.evictions >= 1000
    assert store.counts()[0].evicted == store.evictions
    # the newest blocks survive
    assert store.key_of(s, 50 * 40 - 1) is not None
    assert store.key_of(s, 0) is None


def test_unknown_parent_never_matches_a_prompt() -> None:
    store = PrefixStore()
    ing = Ingestor(store, 2)
    s = ing.add_source(("e", 0))
    # block [3, 4] whose parent (engine hash 999) we never saw
    ing.apply(s, decode_payload(encode_batch([BlockStored([5], 999, [3, 4], 2, None, "GPU", None)], 1.0, 0)))
    assert ing.stats[s].unknown_parents == 1
    for prompt in ([3, 4], [1, 2, 3, 4], [0, 0, 3, 4]):
        (m,) = store.lookup(prompt_keys(prompt, 2), [s])
        assert m.blocks == 0
    # its children still chain and its removal still resolves
    ing.apply(s, decode_payload(encode_batch([BlockStored([6], 5, [7, 8], 2, None, "GPU", None)], 1.0, 0)))
    ing.apply(s, decode_payload(encode_batch([BlockRemoved([5, 6], "GPU")], 1.0, 0)))
    assert store.total == 0 and store.counts()[0].unknown_removes == 0


def test_block_size_mismatch_is_reported_and_learned() -> None:
    store = PrefixStore()
    ing = Ingestor(store, 16)
    s = ing.add_source(("e", 0))
    ing.apply(
        s,
        decode_payload(
            encode_batch([BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None)], 1.0, 0)
        ),
    )
    assert ing.stats[s].block_size == 4 and ing.stats[s].block_size_mismatch == 1
    (m,) = store.lookup(prompt_keys(list(range(8)), 4), [s])
    assert m.blocks == 2


def test_bad_shapes_are_counted_and_skipped() -> None:
    store = PrefixStore()
    ing = Ingestor(store, 4)
    s = ing.add_source(("e", 0))
    ing.apply(
        s,
        decode_payload(
            encode_batch([BlockStored([1, 2], None, list(range(5)), 4, None, "GPU", None)], 1.0, 0)
        ),
    )
    assert ing.stats[s].bad_events == 1 and store.total == 0


@settings(max_examples=100, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, len(PATHS) - 1), st.integers(1, 4), st.booleans()),
        min_size=1,
        max_size=25,
    ),
    with_extra=st.booleans(),
)
def test_one_chunk_equals_batch_by_batch(plan: list[tuple[int, int, int, bool]], with_extra: bool) -> None:
    """Keys solved for a whole chunk (parents inside the chunk) equal keys applied batch by batch."""
    engines = [_Engine(s) for s in (5, 6)]
    held: list[set[tuple[int, ...]]] = [set(), set()]
    payloads: list[tuple[int, bytes]] = []
    for s, p, nblocks, remove in plan:
        eng = engines[s]
        path = PATHS[p][: nblocks * BS]
        prefixes = [path[: (i + 1) * BS] for i in range(len(path) // BS)]
        if remove and held[s] & set(prefixes):
            doomed = [x for x in prefixes if x in held[s]][-1:]
            held[s] -= set(doomed)
            ev: object = BlockRemoved([eng.ehash(x) for x in doomed], "GPU")
        else:
            first = next((i for i, x in enumerate(prefixes) if x not in held[s]), len(prefixes))
            if first == len(prefixes):
                continue
            if first and prefixes[first - 1] not in held[s]:
                first = 0
            new = prefixes[first:]
            held[s] |= set(new)
            extra = [["salt"]] + [None] * (len(new) - 1) if with_extra and first == 0 else None
            toks = [t for pre in new for t in pre[-BS:]]
            parent = eng.ehash(prefixes[first - 1]) if first else None
            ev = BlockStored([eng.ehash(x) for x in new], parent, toks, BS, None, "GPU", None, extra)
        payloads.append((s, encode_batch([ev], 1.0, 0)))

    def build(chunked: bool) -> PrefixStore:
        store = PrefixStore()
        ing = Ingestor(store, BS)
        sidx = [ing.add_source(("e", s)) for s in range(2)]
        batches = [(sidx[s], decode_payload(p)) for s, p in payloads]
        if chunked:
            ing.apply_chunk(batches)  # type: ignore[arg-type]
        else:
            for item in batches:
                ing.apply_chunk([item])
        return store

    a, b = build(True), build(False)
    assert a._media == b._media and a._emaps == b._emaps and a._refs == b._refs


def test_a_hash_removed_twice_in_one_event() -> None:
    store = PrefixStore()
    ing = Ingestor(store, 2)
    s = ing.add_source(("e", 0))
    stored = BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None)
    ing.apply(s, decode_payload(encode_batch([stored], 1.0, 0)))
    ing.apply(s, decode_payload(encode_batch([BlockRemoved([2, 2, 1], "GPU")], 1.0, 0)))
    assert store.total == 0 and store.counts()[0].unknown_removes == 1
