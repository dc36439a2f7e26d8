"""Fuzzing the KV event decoder and ingest (bounded runs; ``make fuzz-kv`` runs the long one).

Every input goes through tests/kvfuzz.py's target: raw frames into the subscriber's message handling,
then the C ingest into the compact store, beside the Python decode path into the compact store and
into the dict store (the reference), checked after every chunk (no exception escapes, the paths
agree, the store's invariants hold; see kvfuzz's docstring).

1. The seed corpus (every captured vLLM stream, both event shapes), then a few thousand seeded random
   mutations of it at the byte level (deterministic: a fixed seed).
2. Structure-aware mutations (hypothesis, derandomized): captured payloads decoded to their msgpack
   structure, fields changed (types swapped, huge, negative and overflowing ints, token and hash
   lists of the wrong length, hashes listed twice, parents pointing nowhere, removals of unknown
   hashes, clears mixed in, unknown fields, trailing items, bytes hashes, cut payloads), re-encoded.
3. The atheris harness itself, briefly (what ``make fuzz-kv`` runs for hours).
4. Regression tests, one per bug the fuzzing found.
5. Memory stays bounded over many malformed and valid payloads.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvfuzz
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfuzz import Message, Target, encode

from index.ingest import Ingestor
from index.keys import prompt_keys
from index.store import MAX_MEDIA, PrefixStore
from index.store_dict import DictPrefixStore
from index.wire import WireError, decode_payload, peek_message

INPUTS = int(os.environ.get("FUZZ_KV_INPUTS", "2500"))
"""Mutated inputs of the bounded byte-level run."""
SEEDS = kvfuzz.seed_inputs()
STREAMS = list(kvfuzz.capture_streams())


@pytest.fixture(scope="module")
def target() -> Target:
    return Target()


# ---- 1. the seed corpus and byte-level mutations ---------------------------------------------------


def test_the_seed_corpus_ingests_cleanly_on_every_path(target: Target) -> None:
    for data in SEEDS:
        out = target.run(data)
        assert out.decode_errors == 0 and out.bad_events == 0, out
        assert out.applied == out.messages  # every captured batch applied
    assert len(SEEDS) == 4 * len(STREAMS)


def test_the_c_stack_receives_through_the_c_loop(target: Target) -> None:
    """The C path compared with the Python one includes the C receive loop (a real socket)."""
    stack = kvfuzz.Stack("c", target.ctx)
    try:
        assert stack.sub._native and len(stack.writers) == len(stack.srcs)
    finally:
        stack.close()


def test_byte_level_mutations(target: Target) -> None:
    """Seeded random mutations of the seeds (kvfuzz.mutate): nothing escapes, nothing diverges."""
    rng = random.Random(20261124)
    total = kvfuzz.Outcome()
    for _ in range(INPUTS):
        data = rng.choice(SEEDS)
        for _ in range(rng.randint(1, 3)):
            data = kvfuzz.mutate(data, rng, SEEDS)
        total.add(target.run(data))
    # the mutations reach both sides: broken payloads, skipped events, and applied batches compared
    assert total.decode_errors > INPUTS and total.bad_events > 0 and total.applied > INPUTS
    assert total.compared > 10 * total.not_compared and total.lookups > INPUTS // 4


# ---- 2. structure-aware mutations ------------------------------------------------------------------

_JUNK: list[Any] = [None, True, False, 0, -1, 1.5, float("nan"), "x", "GPU", b"", b"\x01", [], {}, [[1]]]
_JUNK += [{"a": [None]}, 2**64 - 1, -(2**63), msgspec.msgpack.Ext(3, b"ext")]
_INTS = [0, 1, -1, -32, -33, 4096, 4097, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
_TYPES: list[Any] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockPinned", "blockstored", 5]
_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
_FIELDS += ["extra_keys", "group_idx", "kv_cache_spec_kind", "type"]


def _as_bytes(h: Any, width: int) -> Any:
    """A hash as a digest of ``width`` bytes (its low 64 bits last, as vLLM's; shorter ones cut)."""
    if type(h) is not int or not 0 <= h < 2**64:
        return h
    return (h & ((1 << 8 * width) - 1)).to_bytes(width, "big")


def _mutate_event(ev: dict[str, Any], draw: st.DrawFn) -> None:
    op = draw(
        st.sampled_from(["type", "int", "tokens", "hashes", "dup", "parent", "unknown", "drop", "bytes"])
    )
    name = draw(st.sampled_from(_FIELDS))
    if op == "type":  # any field, any type
        ev[name] = draw(st.sampled_from(_JUNK + _TYPES))
    elif op == "int":  # huge, negative, overflowing
        ev[draw(st.sampled_from(["block_size", "parent_block_hash", "group_idx", "lora_id"]))] = draw(
            st.sampled_from(_INTS)
        )
        if isinstance(ev.get("token_ids"), list) and ev["token_ids"]:
            ev["token_ids"][draw(st.integers(0, len(ev["token_ids"]) - 1))] = draw(st.sampled_from(_INTS))
    elif op == "tokens" and isinstance(ev.get("token_ids"), list):  # disagrees with block_size
        k = draw(st.integers(-3, 3))
        ev["token_ids"] = ev["token_ids"][:k] if k < 0 else ev["token_ids"] + list(range(k))
    elif op == "hashes" and isinstance(ev.get("block_hashes"), list):  # the wrong number of hashes
        k = draw(st.integers(-2, 2))
        ev["block_hashes"] = ev["block_hashes"][:k] if k < 0 else ev["block_hashes"] + [7] * k
    elif op == "dup" and isinstance(ev.get("block_hashes"), list) and len(ev["block_hashes"]) > 1:
        ev["block_hashes"][-1] = ev["block_hashes"][0]  # a hash listed twice (other tokens)
    elif op == "parent":  # pointing nowhere
        ev["parent_block_hash"] = draw(st.integers(0, 2**64 - 1))
    elif op == "unknown":  # fields of a future version, any type
        ev[f"zz_{name}"] = draw(st.sampled_from(_JUNK))
    elif op == "drop":
        ev.pop(name, None)
    elif op == "bytes" and isinstance(ev.get("block_hashes"), list):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
        width = draw(st.sampled_from([32, 16, 8, 3, 0]))
        ev["block_hashes"] = [_as_bytes(h, width) for h in ev["block_hashes"]]
        ev["parent_block_hash"] = _as_bytes(ev.get("parent_block_hash"), width)


@st.composite
def _mutated_payload(draw: st.DrawFn, payload: bytes) -> bytes:
    raw = msgspec.msgpack.decode(payload)
    events: list[Any] = raw[1]
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["event"] * 6 + ["remove", "clear", "junk", "top", "trailing"]))
        at = draw(st.integers(0, len(events)))
        if op == "event" and events:
            ev = events[draw(st.integers(0, len(events) - 1))]
            if isinstance(ev, dict):
                _mutate_event(ev, draw)
        elif op == "remove":  # hashes nobody stored
            hashes = draw(st.lists(st.integers(0, 2**64 - 1), max_size=4))
            events.insert(at, {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
        elif op == "clear":
            events.insert(at, {"type": "AllBlocksCleared"})
        elif op == "junk":  # an event that is no event
            events.insert(at, draw(st.sampled_from(_JUNK)))
        elif op == "top":  # ts, events or rank of another type
            raw[draw(st.integers(0, 2))] = draw(st.sampled_from(_JUNK))
        else:  # trailing items after the rank
            raw.extend(draw(st.lists(st.sampled_from(_JUNK), min_size=1, max_size=2)))
    if draw(st.booleans()) and isinstance(raw[1], list):
        raw[1] = [_legacy(ev) for ev in raw[1]]
    out = msgspec.msgpack.encode(raw)
    if draw(st.integers(0, 9)) == 0:
        out = out[: draw(st.integers(0, len(out)))]  # cut anywhere
    return out


def _legacy(ev: Any) -> Any:
    """A map event as the <= 0.23 tagged array (its known fields in order, then any others)."""
    if not isinstance(ev, dict) or "type" not in ev:
        return ev
    names = {"BlockStored": kvfuzz._STORED, "BlockRemoved": kvfuzz._REMOVED}.get(ev["type"], ())
    return [
        ev["type"],
        *[ev.get(n) for n in names],
        *[v for k, v in ev.items() if k not in names and k != "type"],
    ]


@st.composite
def _mutated_stream(draw: st.DrawFn) -> bytes:
    _, items = draw(st.sampled_from(STREAMS))
    messages = []
    for source, payload in items[: draw(st.integers(1, 12))]:
        body = draw(_mutated_payload(payload)) if draw(st.integers(0, 2)) else payload
        seq_mode = draw(st.sampled_from([0] * 8 + [1, 2, 3]))
        messages.append(Message(source, seq_mode, 0, body, draw(st.booleans())))
    return encode(messages)


@settings(
    max_examples=int(os.environ.get("FUZZ_KV_EXAMPLES", "400")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(_mutated_stream())
def test_structure_aware_mutations(data: bytes) -> None:
    Target().run(data)


# ---- 3. the atheris harness ------------------------------------------------------------------------------


def test_the_atheris_harness_runs(tmp_path: Path) -> None:
    """A short coverage-guided run of what ``make fuzz-kv`` runs long (the installed C core here)."""
    pytest.importorskip("atheris")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    kvfuzz.write_seeds(str(seeds))
    report = tmp_path / "report.jsonl"
    env = dict(os.environ, KVFUZZ_REPORT=str(report), KVFUZZ_EVERY="100")
    env.pop("KVROUTER_KVCORE", None)
    script = Path(kvfuzz.__file__)
    cmd = [sys.executable, str(script), "-runs=400", "-seed=1", "-max_len=16384", str(seeds)]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [msgspec.json.decode(line) for line in report.read_text().splitlines()]
    assert rows[-1]["inputs"] >= 400 and rows[-1]["compared"] > 0
    # libFuzzer's own count: the 400 mutations, plus the seed inputs when it runs them again
    finished = re.search(r"^Done (\d+) runs", done.stderr, re.M)
    assert finished and int(finished.group(1)) >= 400, done.stderr[-3000:]


# ---- 4. regressions: bugs the fuzzing found ---------------------------------------------------------------


def _stored(**kw: Any) -> dict[str, Any]:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4]}
    return ev | {"block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None} | kw


def _payload(*events: Any, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def _both(store: Any) -> tuple[Ingestor, int, int]:
    ing = Ingestor(store, 4)
    return ing, ing.add_source(("a", 0)), ing.add_source(("b", 0))


STORES = [PrefixStore, DictPrefixStore]


@pytest.mark.parametrize("store_type", STORES)
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (_stored(medium="M" * 40), "a medium name over 31 bytes"),
        (_stored(block_size=5000, token_ids=list(range(5000))), "a block size over 4096"),
        (_stored(extra_keys=[7]), "an extra_keys entry that is not an array"),
        ({"type": "BlockRemoved", "block_hashes": [1], "medium": "M" * 40}, "a removal on such a medium"),
    ],
)
def test_a_malformed_event_is_counted_and_the_rest_of_the_chunk_applies(
    store_type: type, bad: dict[str, Any], why: str
) -> None:
    """These events raised out of Ingestor.apply_chunk (ValueError, TypeError), losing the whole chunk
    (every source's batches in it) to the subscriber's catch-all."""
    ing, a, b = _both(store_type())
    ing.apply_chunk([(a, _payload(bad, _stored(block_hashes=[2]))), (b, _payload(_stored()))])
    assert ing.stats[a].bad_events == 1, why
    assert ing.stats[a].blocks_stored == 1 and ing.stats[b].blocks_stored == 1
    assert ing.stats[a].block_size == 4  # a skipped event teaches nothing


@pytest.mark.parametrize("store_type", STORES)
def test_media_beyond_the_store_limit_are_bad_events(store_type: type) -> None:
    ing, a, _ = _both(store_type())
    fit = MAX_MEDIA - 3  # (GPU, CPU and STORAGE are registered from the start)
    events = [_stored(block_hashes=[i], medium=f"M{i}") for i in range(fit + 7)]
    ing.apply_chunk([(a, _payload(*events))])
    assert ing.stats[a].bad_events == 7 and ing.store.total == fit


@pytest.mark.parametrize("store_type", STORES)
def test_a_hash_listed_twice_with_other_tokens_leaves_no_ghost(store_type: type) -> None:
    """A BlockStored listing one engine hash twice with different tokens kept the first listing's key
    held with no engine hash leading to it: no removal, clear or restart could end it, and the next
    source given the slot inherited it (a false match)."""
    store = store_type()
    ing, a, _ = _both(store)
    ing.apply_chunk([(a, _payload(_stored(block_hashes=[1, 1], token_ids=[1, 2, 3, 4, 5, 6, 7, 8])))])
    assert store.total == 1
    assert store.key_of(a, 1) == prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]  # the last listing decides
    ing.apply_chunk([(a, _payload({"type": "AllBlocksCleared"}))])
    assert store.total == 0
    ing.apply_chunk([(a, _payload(_stored(block_hashes=[1, 1], token_ids=[1, 2, 3, 4, 5, 6, 7, 8])))])
    ing.apply_chunk([(a, None)])  # a restart
    assert store.total == 0
    store.remove_source(("a", 0))
    c = store.add_source(("c", 0))
    assert c == a
    assert store.lookup(prompt_keys([1, 2, 3, 4], 4), [c])[0].blocks == 0


@pytest.mark.parametrize("store_type", STORES)
def test_the_last_listing_of_a_hash_decides_its_key_and_references(store_type: type) -> None:
    store = store_type()
    s = store.add_source(("a", 0))
    k1, k2 = 0x1111_2222_3333_4444, 0x5555_6666_7777_8888
    store.store(s, 0, [9, 9, 9], [k1, k2, k1])  # k1 twice after its last change: two references
    assert store.total == 1 and store.refcount(s, k1) == 2 and store.refcount(s, k2) == 0
    assert store.remove(s, 0, [9]) == 0 and store.remove(s, 0, [9]) == 1 and store.total == 0


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_timestamp_is_a_decode_error(ts: float) -> None:
    """A NaN batch timestamp made every later duplicate (seq back, old timestamp) look like a restart,
    dropping the source's blocks; an infinite one hid every real restart."""
    payload = _payload({"type": "AllBlocksCleared"}, ts=ts)
    for decode in (lambda: peek_message(payload, 0), lambda: decode_payload(payload)):
        with pytest.raises(WireError, match="not finite"):
            decode()
    good = _payload(_stored(), ts=1.0)
    msgs = [Message(0, 0, 0, good, True), Message(0, 0, 0, payload, True), Message(0, 3, 0, good, True)]
    target = Target()
    target.run(encode(msgs))
    c = kvfuzz.Stack("c", target.ctx)
    for m in msgs:
        c.feed([m])
    src = c.srcs[0]
    assert c.counters()[0]["decode_errors"] == 1
    assert src.restarts == 0 and src.duplicates == 1 and c.store.total == 1


# ---- 5. memory ---------------------------------------------------------------------------------------


def _rss_mib() -> float:
    return kvfuzz._rss_kib() / 1024


def test_memory_stays_bounded_over_many_payloads() -> None:
    """One long-lived stack fed fresh chains, captured payloads, broken payloads and removals of unknown
    hashes (a store capped small: evictions run): the store keeps to its cap and the process does
    not grow once warm."""
    rng = random.Random(7)
    target = Target()
    stack = kvfuzz.Stack("c", target.ctx)
    stack.store.max_residencies = 500
    payloads = [m.body for data in SEEDS for m in kvfuzz.parse(data)]
    marks = []
    for i in range(40_000):
        kind = i % 4
        if kind == 0:  # 8 new blocks
            hashes = [rng.getrandbits(64) for _ in range(8)]
            body = _payload(
                _stored(block_hashes=hashes, token_ids=[rng.randrange(50_000) for _ in range(32)])
            )
        elif kind == 1:
            body = rng.choice(payloads)
        elif kind == 2:
            body = kvfuzz.parse(
                kvfuzz.mutate(encode([Message(0, 0, 0, rng.choice(payloads), True)]), rng, SEEDS)
            )
            body = body[0].body if body else b""
        else:
            body = _payload({"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64) for _ in range(4)]})
        stack.feed([Message(rng.randrange(2), 0 if rng.random() < 0.999 else 3, 0, body, True)])
        if i % 10_000 == 9_999:
            marks.append((_rss_mib(), stack.store.nbytes))
    assert stack.store.total <= 500 + 64 and stack.store.evictions > 1000
    assert sum(row["decode_errors"] for row in stack.counters()) > 1000
    assert marks[-1][1] < 1 << 20  # the tables
    assert marks[-1][0] - marks[1][0] < 32, marks  # MiB, after warm-up
