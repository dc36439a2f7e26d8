"""A client can ask vLLM to announce its cached prefix again (``vllm_xargs.kv_cache_report_mode =
"full"``): a BlockStored from block 0 that no BlockRemoved ever matches. Passed on, each such request
adds a reference the engine's eviction never takes back, and the index keeps blocks the engine no
longer holds. The router removes the key from what it proxies (``server.forward_kv_report_mode``,
off by default); these tests run the real router in front of a mock vLLM engine (sim.engine, which
re-announces as vLLM does), with a real OpenAI client, both ways, and show the stale blocks when
the key is passed on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import TIMEOUT, MockFleet, OneEngineRouters, RouterRunner, wait_for

from sim.engine import EngineConfig
from sim.kvcache import PrefixCache

BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))  # 8 full blocks; a repeat of it hits 7 (the last token is computed)


def gpu_blocks(router: RouterRunner, prompt: list[int]) -> int:
    """GPU blocks of ``prompt`` the index holds on the engine (events only, not predictions)."""
    r = httpx.post(f"{router.url}/route", json={"model": "mock-model", "prompt": prompt}, timeout=TIMEOUT)
    r.raise_for_status()
    (cand,) = r.json()["candidates"]
    return int(cand["blocks_by_medium"].get("GPU", 0))


def removed_total(router: RouterRunner) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith("kvrouter_kv_report_mode_removed_total "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Any]:
    routers = OneEngineRouters(tmp_path)

    def make(forward: bool, extra: str = "") -> tuple[RouterRunner, MockFleet]:
        # 40 blocks: six more 8-block prompts evict the first one
        cfg = EngineConfig(time_scale=0.02, num_gpu_blocks=40, block_size=BS, default_max_tokens=1)
        head = (
            f"block_size = {BS}\nremote_tokenize = false\n[health]\ninterval_s = 1.0\n"
            f"[server]\nforward_kv_report_mode = {'true' if forward else 'false'}\n{extra}"
        )
        return routers.make(cfg, head)

    yield make
    routers.close()


def sent_xargs(fleet: MockFleet) -> Any:
    """``vllm_xargs`` of the last request the engine received (absent: the string "absent")."""
    engine = fleet.fleet.engines[0]
    return fleet.call(lambda: engine.received[-1][2].get("vllm_xargs", "absent"))


def engine_holds(fleet: MockFleet, prompt: list[int]) -> int:
    """Full blocks of ``prompt`` the engine itself has cached, each looked up on its own."""
    cache = fleet.fleet.engines[0].ranks[0].core.cache
    assert isinstance(cache, PrefixCache)
    return fleet.call(lambda: cache.held_blocks(prompt))


@pytest.mark.parametrize("forward", [False, True])
def test_a_report_mode_request_leaves_no_stale_blocks_unless_passed_on(setup: Any, forward: bool) -> None:
    router, fleet = setup(forward)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    client.completions.create(model="mock-model", prompt=PROMPT, max_tokens=1)
    wait_for(lambda: gpu_blocks(router, PROMPT) == 8, "the prompt's blocks in the index")
    # the same prompt asking for the re-announcement, beside a custom argument of the client's own
    client.completions.create(
        model="mock-model",
        prompt=PROMPT,
        max_tokens=1,
        extra_body={"vllm_xargs": {"kv_cache_report_mode": "full", "tenant": "t1"}},
    )
    if forward:
        assert sent_xargs(fleet) == {"kv_cache_report_mode": "full", "tenant": "t1"}
        assert removed_total(router) == 0
    else:
        assert sent_xargs(fleet) == {"tenant": "t1"}  # only the key goes; the client's own stays
        assert removed_total(router) == 1
    # other prompts evict it from the engine (one BlockRemoved per block)
    fillers = [list(range(5000 + i * 1000, 5000 + i * 1000 + 8 * BS)) for i in range(6)]
    for f in fillers:
        client.completions.create(model="mock-model", prompt=f, max_tokens=1)
    assert engine_holds(fleet, PROMPT) == 0
    # events are applied in order: once the last filler shows, the evictions before it have applied
    wait_for(lambda: gpu_blocks(router, fillers[-1]) == 8, "the last filler in the index")
    stale = gpu_blocks(router, PROMPT)
    if forward:
        assert stale == 7  # the re-announced blocks: held twice, removed once, cached nowhere
        return
    assert stale == 0
    # /route counts a leading run: stored again, the first block alone leads to nothing behind it
    client.completions.create(model="mock-model", prompt=PROMPT[:BS], max_tokens=1)
    wait_for(lambda: gpu_blocks(router, PROMPT[:BS]) == 1, "the first block again")
    assert gpu_blocks(router, PROMPT) == 1


def test_the_key_alone_takes_vllm_xargs_with_it(setup: Any) -> None:
    router, fleet = setup(False)
    body = {
        "model": "mock-model",
        "prompt": PROMPT,
        "max_tokens": 1,
        "vllm_xargs": {"kv_cache_report_mode": "full"},
    }
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert sent_xargs(fleet) == "absent"
    # a request without it goes as sent (and is not counted)
    body["vllm_xargs"] = {"tenant": "t1"}
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert sent_xargs(fleet) == {"tenant": "t1"}
    assert removed_total(router) == 1


def test_a_stream_the_router_asks_usage_of_goes_without_the_key(setup: Any) -> None:
    """Both changes to one body: the usage the prediction checks ask for, and the key removed."""
    router, fleet = setup(False, "[checks]\nstream_usage_every = 1\n")
    body = {
        "model": "mock-model",
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": True,
        "vllm_xargs": {"kv_cache_report_mode": "full", "tenant": "t1"},
    }
    with (
        httpx.Client(timeout=TIMEOUT) as c,
        c.stream("POST", f"{router.url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n") and b"usage" not in raw  # asked for by the router, stripped
    engine = fleet.fleet.engines[0]
    sent = fleet.call(lambda: engine.received[-1][2])
    assert sent["vllm_xargs"] == {"tenant": "t1"} and sent["stream_options"] == {"include_usage": True}
    assert removed_total(router) == 1


def test_the_mock_engine_re_announces_its_hit_like_vllm() -> None:
    """The sim's side of it (what the end-to-end test relies on): a report-mode admission adds one
    BlockStored of the GPU hit, from block 0 with no parent, before the new blocks' own."""
    cache = PrefixCache(num_blocks=32, block_size=BS)
    assert cache.admit("a", PROMPT) is not None
    cache.free("a")
    first = cache.take_events()
    assert [len(e.block_hashes) for e in first] == [8]
    assert cache.admit("b", PROMPT, report_hits=True) is not None
    # the hit (7 blocks: the last token is computed again), then the last block, computed again
    again, last = cache.take_events()
    assert again.parent_block_hash is None and again.block_hashes == first[0].block_hashes[:7]
    assert again.token_ids == PROMPT[: 7 * BS]
    assert (
        last.parent_block_hash == first[0].block_hashes[6] and last.block_hashes == first[0].block_hashes[7:]
    )
    cache.free("b")
    assert cache.admit("c", PROMPT) is not None
    (only,) = cache.take_events()  # without the mode, a hit is not announced: the last block only
    assert only.parent_block_hash == first[0].block_hashes[6]
    # as in vLLM, the hit is announced when it is looked up, also by a try that must wait for blocks
    full = PrefixCache(num_blocks=8, block_size=BS)
    assert full.admit("a", PROMPT) is not None
    full.take_events()
    assert full.admit("b", PROMPT, report_hits=True) is None  # 8 blocks pinned by "a": no room
    (waiting,) = full.take_events()
    assert waiting.block_hashes == first[0].block_hashes[:7]
