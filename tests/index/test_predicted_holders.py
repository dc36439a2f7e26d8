"""Predictions found from the prompt's keys (``KVIndex._holders``) give the same match as the walk
over every source with predictions (``KVIndex.match``): over random fleets whose sources hold
prefixes for real, are predicted on by this router and by peers (earlier expiries), have
predicted blocks confirmed and removed by their engine's events, expire and restart."""

from __future__ import annotations

import random
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from index.keys import prompt_keys
from index.kvindex import LARGE_PREDICTION_KEYS, PREDICTED, IndexConfig, KVIndex

BS = 16


def _touch(index: KVIndex, sidx: int, keys: list[int] | None) -> None:
    index._touched(sidx, None if keys is None else array("Q", keys).tobytes())


def test_match_plan_finds_every_prediction_the_walk_finds() -> None:
    rng = random.Random(11)
    checked = extended = 0
    for case in range(120):
        index = KVIndex(IndexConfig(block_size=BS, predict_ttl_s=30.0))
        n = rng.choice([1, 3, 8, 40])
        sources = [(f"e{i}", r) for i in range(n) for r in range(rng.choice([1, 2]))]
        prompts = [[rng.randrange(1, 500) for _ in range(BS * rng.randrange(1, 10))] for _ in range(4)]
        prompts += [prompts[0][: BS * 2] + p[BS * 2 :] for p in prompts[1:]]  # (a shared prefix)
        for s in sources:
            added = index.ingestor.add_source(s)
            if rng.random() < 0.4:
                keys = prompt_keys(rng.choice(prompts), BS)[: rng.randrange(0, 5)]
                index.store.store(added, 0, [k ^ 0x77 for k in keys], keys)
        now = time.monotonic()
        for _ in range(rng.randrange(0, 3 * len(sources))):
            s = rng.choice(sources)
            p = rng.choice(prompts)
            keys = prompt_keys(p, BS)
            sidx = index.store.source_index(s)
            assert sidx is not None
            what = rng.random()
            if what < 0.5:
                index.predict(s, index.match(p, [s]))
            elif what < 0.7:  # a peer's, some already about to end
                first = rng.randrange(0, len(keys))
                index.predict_keys(s, BS, keys[first:], now + rng.choice([0.001, 5.0, 60.0]))
            elif what < 0.8:
                _touch(index, sidx, keys[: rng.randrange(0, len(keys) + 1)])
            elif what < 0.85:
                _touch(index, sidx, None)
            elif what < 0.9:
                index._forget_predictions(sidx)
            else:
                index.purge_predictions()
        time.sleep(0.002)  # (the 1 ms predictions have ended)
        plan = index.plan(sources)
        for p in prompts:
            report = index.match(p, sources)
            got = index.match_plan(p, plan)
            for i, s in enumerate(sources):
                m = report.matches[s]
                by = got.media[i] if got.media is not None else None
                assert got.matched[i] == m.blocks, (case, s)
                assert (by if by is not None else {"GPU": got.matched[i]}) == m.by_medium, (case, s)
                checked += 1
                extended += PREDICTED in m.by_medium
        holders = sum(len(h) for h in index._holders.values())
        assert holders == sum(len(p) for p in index._predicted.values()), case  # (one entry per prediction)
    assert checked > 2000 and extended > 200, (checked, extended)


def test_a_large_prediction_is_recorded_in_slices_by_the_deferred_call() -> None:
    """Over LARGE_PREDICTION_KEYS keys, predict() only hands the work to ``defer`` (the router's
    worker threads): nothing is predicted until it runs, then every block, slice by slice, in
    a thread of its own while matches run."""
    index = KVIndex(IndexConfig(block_size=BS, predict_ttl_s=600.0, max_predicted_per_source=1 << 20))
    s = ("e", 0)
    index.ingestor.add_source(s)
    prompt = [7 + i % 999 for i in range(BS * (LARGE_PREDICTION_KEYS * 2 + 5))]
    n = len(prompt) // BS
    deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    index.predict(s, index.match(prompt, [s]), lambda fn, *args: deferred.append((fn, args)))
    assert len(deferred) == 1 and index.match(prompt, [s]).matches[s].blocks == 0
    fn, args = deferred[0]
    worker = threading.Thread(target=fn, args=args)
    worker.start()
    seen = 0
    while worker.is_alive():  # (a growing prefix of the prediction, never more)
        blocks = index.match(prompt, [s]).matches[s].blocks
        assert seen <= blocks <= n
        seen = blocks
        time.sleep(0.001)  # (a poll: the worker hands the interpreter over after each slice)
    worker.join()
    assert index.match(prompt, [s]).matches[s].by_medium == {"GPU": 0, PREDICTED: n}
    small = prompt[: BS * 3]  # (under the threshold: at once, defer unused)
    t = ("f", 0)
    index.ingestor.add_source(t)
    index.predict(t, index.match(small, [t]), lambda fn, *args: deferred.append((fn, args)))
    assert len(deferred) == 1 and index.match(small, [t]).matches[t].by_medium == {"GPU": 0, PREDICTED: 3}
