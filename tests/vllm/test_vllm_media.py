"""Chat prompts with images on a real vLLM vision model, behind the real router: the router's
predicted cached tokens against the engine's ``cached_tokens``, request by request.

The model is the tiny Idefics3 shape (sim/vllm_engines.py): its chat template renders an image
part as ``<image>``, which the engine replaces with a fixed 67-token range (image splitting off)
and keys every block that range touches with the image's identifier. An image part with a
``uuid`` has that uuid as its identifier: the router expands the image as the engine does and
salts the same blocks with it, so the whole prompt matches. Without one the identifier is vLLM's
digest of the decoded image: the router matches the prompt up to that image only, and never
predicts more than the engine serves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from media_prompts import WORKLOAD, image_chat
from vllm_tier import Fleet, Tier, record

from sim.vllm_engines import IMAGE_PROMPT

BLOCK = 32


@pytest.fixture(scope="module")
def fleet(tier: Tier) -> Iterator[Fleet]:
    with tier.serve("idefics3", BLOCK) as f:
        yield f


def test_images_with_uuids_match_whole_and_without_up_to_the_image(fleet: Fleet) -> None:
    start = len(fleet.rows)
    whole: list[str] = []
    for tag, parts in WORKLOAD:
        images = [p for p in parts if not isinstance(p, str)]
        known = all(uuid is not None for _url, uuid in images)
        if known:
            whole.append(tag)
        body = {"messages": image_chat(parts), "max_tokens": 4}
        fleet.send(tag, body, stream=tag.endswith("again"), checked=known)
    rows = fleet.rows[start:]
    record(fleet.engine.model_dir.name, rows)
    report = fleet.report(rows)
    by_tag = {r.tag: r for r in rows}
    # the engine's prompt: text plus 67 tokens per image, which the router counts alike when it knows
    # every image's identifier
    assert by_tag["uuid a"].engine_prompt_tokens > len(IMAGE_PROMPT)
    for tag in whole:
        r = by_tag[tag]
        assert r.router_prompt_tokens == r.engine_prompt_tokens, report
    for r in rows:
        assert r.engine_cached is not None, report
        assert r.router_prompt_tokens <= r.engine_prompt_tokens, report
    assert not [r for r in rows if r.result == "over"], report
    for r in rows:  # exact within what the router knows (the engine may serve more of a digest image)
        cap = max(r.router_prompt_tokens - 1, 0) // BLOCK * BLOCK
        expected = r.engine_cached if r.tag in whole else min(r.engine_cached or 0, cap)
        assert r.predicted == expected, report
    assert all(r.result == "exact" for r in rows if r.tag in whole), report
    # the router's own self-check found every prompt it knows whole exact, and diagnoses nothing
    assert [by_tag[t].router_result for t in whole] == ["exact"] * len(whole), report
    assert fleet.checked()["diagnosis"] is None, fleet.checked()
    # the blocks the images touch were served from cache, and predicted so
    again = by_tag["uuid a again"]
    assert again.predicted == again.engine_cached
    assert again.predicted > 48 + len(IMAGE_PROMPT) - BLOCK
    assert by_tag["two images again"].engine_cached == by_tag["two images again"].predicted > 0
    # vLLM trusts the client's uuid: other pixels under the same one are served the first image's cache
    assert by_tag["uuid a with other pixels"].engine_cached == by_tag["uuid a again"].engine_cached
    # without a uuid the router knows the text before the image only (block 0); the engine serves
    # the image's blocks too (its digest of the image), which the router never predicts
    assert by_tag["no uuid"].engine_cached == by_tag["no uuid"].predicted == BLOCK
    assert by_tag["no uuid again"].predicted == BLOCK < (by_tag["no uuid again"].engine_cached or 0)
    # a uuid image before one without: matched up to the second image's range
    second = by_tag["second image without uuid"]
    assert second.predicted == second.engine_cached
    assert second.predicted > (by_tag["two images"].engine_cached or 0)
    # what the engine published: the image's blocks carry [identifier, range start - block start]
    stored = [e for e in fleet.watch.events() if e.get("type") == "BlockStored" and e.get("extra_keys")]
    pairs = {tuple(p) for e in stored for keys in e["extra_keys"] if keys for p in keys}
    assert {("img-a", 16), ("img-a", -16), ("img-a", -48)} <= pairs, pairs
