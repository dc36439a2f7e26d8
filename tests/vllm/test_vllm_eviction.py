"""Eviction on a real engine: a 4 MiB KV cache, prompts of about 400 tokens, several rounds.

The engine evicts (BlockRemoved) as soon as a round's prompts outgrow its cache, and a prompt
served again later may or may not still be cached: the router's prediction must follow both ways,
never counting a block the engine dropped. Full attention must agree exactly; the sliding-window
hybrid is expected to over-predict until the index models vLLM's hybrid hit rule (and fails).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from vllm_tier import Fleet, Tier, text

pytestmark = pytest.mark.vllm_full

PROMPTS = 14
ROUNDS = 3


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def small(request: pytest.FixtureRequest, tier: Tier) -> Iterator[Fleet]:
    with tier.serve(request.param, 32, kv_cache="4M", max_model_len=512) as f:
        yield f


def test_eviction_rounds(small: Fleet) -> None:
    kind = small.engine.model_dir.name
    prompts = [f"evict {kind} {i} " + text(200 + i, 400) for i in range(PROMPTS)]
    rng = random.Random(7)
    for r in range(ROUNDS):
        order = list(range(PROMPTS))
        rng.shuffle(order)
        for i in order:
            small.send(f"round{r}/p{i}", {"prompt": prompts[i], "max_tokens": 8})
    small.sync()
    removed = [e for e in small.watch.events() if e.get("type") == "BlockRemoved"]
    assert removed, "the engine evicted nothing: the workload does not exercise eviction"
    assert all(360 <= r.engine_prompt_tokens < 504 for r in small.rows), [
        r.engine_prompt_tokens for r in small.rows
    ]
    assert any(r.engine_cached for r in small.rows[PROMPTS:]), "no prompt was ever served from cache again"
    small.assert_agreement(small.rows)
