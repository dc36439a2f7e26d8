"""The ingest fast paths (bulk dict updates, C-level checks, array.fromlist) against their exact meaning."""

from __future__ import annotations

import msgspec
import pytest

from index.ingest import Ingestor
from index.keys import prompt_keys
from index.store import PrefixStore
from index.wire import BlockStored, WireError, decode_payload
from sim.publisher import BlockStored as PubStored
from sim.publisher import encode_batch


def test_a_key_listed_twice_in_one_store_gets_two_references() -> None:
    store = PrefixStore()
    s = store.add_source(("e", 0))
    store.store(s, 0, [1, 2, 3], [10, 10, 11])
    assert store.total == 2
    assert store.refcount(s, 10) == 2 and store.refcount(s, 11) == 1
    assert store.source_blocks(s) == {"GPU": 2}
    assert store.remove(s, 0, [1]) == 0  # one reference left
    assert store.refcount(s, 10) == 1
    assert store.remove(s, 0, [2, 3]) == 2
    assert store.total == 0 and store._refs == {}


def test_fast_store_path_equals_the_per_block_path() -> None:
    """A bulk store into an empty medium and the same blocks stored around a held key end up alike."""
    a, b = PrefixStore(), PrefixStore()
    sa, sb = a.add_source(("e", 0)), b.add_source(("e", 0))
    a.store(sa, 0, [1, 2, 3, 4], [7, 8, 7, 9])  # bulk path (all new), 7 twice
    b.store(sb, 0, [9], [9])  # 9 already held: the per-block path runs
    b.store(sb, 0, [1, 2, 3, 4], [7, 8, 7, 9])
    assert a.refcount(sa, 7) == b.refcount(sb, 7) == 2
    assert a.refcount(sa, 9) == 1 and b.refcount(sb, 9) == 2
    assert a.total == b.total == 3


def _payload(events: list[object]) -> bytes:
    return msgspec.msgpack.encode([1.0, events, 0])


def test_token_ids_outside_u64_are_a_bad_event_not_a_lost_chunk() -> None:
    store = PrefixStore()
    ing = Ingestor(store, 2)
    s = ing.add_source(("e", 0))
    bad = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [-1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    good = dict(bad, block_hashes=[2], token_ids=[3, 4])
    batch = decode_payload(_payload([bad, good]))  # negative ids decode (tolerated, as before)
    ing.apply_chunk([(s, batch)])
    assert ing.stats[s].bad_events == 1
    (m,) = store.lookup(prompt_keys([3, 4], 2), [s])
    assert m.blocks == 1 and store.total == 1


def test_token_ids_as_any_sequence() -> None:
    """Events built in Python (the offline simulator) may carry a tuple or an array of token ids."""
    store = PrefixStore()
    ing = Ingestor(store, 2)
    s = ing.add_source(("e", 0))
    ev = BlockStored([5, 6], None, (1, 2, 3, 4), 2, None, "GPU", None)  # type: ignore[arg-type]
    batch = decode_payload(encode_batch([PubStored([1], None, [9, 9], 2, None, "GPU", None)], 1.0, 0))
    batch.events.append(ev)
    ing.apply_chunk([(s, batch)])
    (m,) = store.lookup(prompt_keys([1, 2, 3, 4], 2), [s])
    assert m.blocks == 2 and store.total == 3


@pytest.mark.parametrize(
    ("hashes", "expected"),
    [
        ([], []),
        ([b"\x00" * 7 + b"\x05", 6], [5, 6]),
        ([6, b"\x00" * 7 + b"\x05"], [6, 5]),
        ([2**64 - 1, 0], [2**64 - 1, 0]),
    ],
)
def test_hash_lists_of_every_shape(hashes: list[object], expected: list[int]) -> None:
    ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    (removed,) = decode_payload(_payload([ev])).events
    assert removed.block_hashes == expected  # type: ignore[union-attr]


@pytest.mark.parametrize("hashes", [[5, -1], [-(2**63)], [b"", 1]])
def test_bad_hashes_raise(hashes: list[object]) -> None:
    with pytest.raises(WireError):
        decode_payload(_payload([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}]))


def test_remapped_engine_hashes_settle_in_order() -> None:
    """An engine hash mapped again (here: within one event, then by a later event) moves its old
    key's references to the new key: the engine blocks behind the hash are the same ones."""
    store = PrefixStore()
    s = store.add_source(("e", 0))
    store.store(s, 0, [1, 1, 1], [10, 20, 30])  # the last listing wins, the others add nothing
    assert store.key_of(s, 1) == 30
    # (10 and 20 used to stay held with no engine hash leading to them: tests/index/test_fuzz_ingest.py)
    assert store._media[0] == {30: 1} and store.total == 1
    store.store(s, 0, [2, 3], [40, 50])
    store.store(s, 0, [4, 2], [60, 41])  # 2 now resolves to 41: 40's reference moves there
    assert store.key_of(s, 2) == 41 and 40 not in store._media[0]
    # (the engine holds two blocks of hash 2 now: one removal must not end the residency)
    assert store.refcount(s, 41) == 2 and store.total == 4
    assert list(store._emaps[s]) == [1, 2, 3, 4]  # insertion order (the eviction order) kept


def test_token_id_arrays_parse_as_msgspec_decodes_them() -> None:
    """``_kvcore.json_ids`` (``/route``'s token-id prompts: index/_kvcore.c ``parse_ids``, up to 7
    digits per word operation) gives msgspec's ids whenever it answers, and answers every plain
    array; for anything else (a sign, a fraction, a leading zero, an id past 2^64 - 1, broken JSON)
    it says None and the request takes msgspec's path."""
    import random

    from index._kvcore import json_ids

    rng = random.Random(11)
    for _ in range(20_000):
        ids = [
            rng.choice([0, 9, 31_999, 10**7 - 1, 10**8, 10**9 + 7, 2**64 - 1, rng.randrange(2**64)])
            for _ in range(rng.randrange(1, 40))
        ]
        text = "[" + ",".join(rng.choice(["", " ", "\n"]) + str(i) + rng.choice(["", " "]) for i in ids) + "]"
        mutated = rng.random() < 0.3
        if mutated:
            at = rng.randrange(len(text))
            bit = rng.choice(["0", "-", ".", "e", "a", " ", ",", "]", "00", "1.5", "9", "99999999999"])
            text = text[:at] + bit + text[at:]
        raw = text.encode()
        try:
            want = msgspec.json.decode(raw)
            plain = isinstance(want, list) and bool(want)
            plain = plain and all(type(x) is int and 0 <= x < 2**64 for x in want)
        except msgspec.DecodeError:
            plain = False
        got = json_ids(raw)
        if got is not None:
            assert plain and memoryview(got).cast("Q").tolist() == want, raw
        else:
            assert mutated, raw
