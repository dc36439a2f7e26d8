"""Chat prompts with images: the router's tokens and block keys against a real vLLM engine's.

The oracle is ``tests/fixtures/vllm_real/idefics3-images.json`` (tests/fixtures/make_vllm_media.py):
a real ``vllm serve`` of the tiny Idefics3 shape (sim/vllm_engines.py), its own ``/tokenize`` ids
per request, the frames it published, and the ``cached_tokens`` it reported. The router's tokens
must be the engine's (whole when every image has a ``uuid``, up to the first image without one
otherwise), and the captured events replayed into the real index must predict exactly what the
engine served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from index.keys import prompt_keys, request_extra_keys
from index.kvindex import IndexConfig, KVIndex
from router.decision.chat import ChatTokenizer
from router.decision.media import MediaTokens
from router.decision.tokenizer import PrefixTokens
from sim.vllm_engines import IMAGE_PROMPT, IMAGE_TOKEN_ID, write_model

CAPTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_real" / "idefics3-images.json"
SRC = ("e", 0)
BLOCK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("idefics3"), "idefics3")


@pytest.fixture(scope="module")
def tok(model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_path(model)


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CAPTURE.read_text())
    return data


def _images(messages: list[dict[str, Any]]) -> list[str | None]:
    return [p.get("uuid") for m in messages for p in m["content"] if p["type"] == "image_url"]


def _first_unknown(engine_ids: list[int], images: list[str | None]) -> int | None:
    """Where the engine's range of the first image without a uuid starts."""
    head = IMAGE_PROMPT[:2]
    starts = [i for i in range(len(engine_ids) - 1) if engine_ids[i : i + 2] == head]
    assert len(starts) == len(images)
    return next((s for s, u in zip(starts, images, strict=True) if u is None), None)


def test_the_image_range_comes_from_the_model_files(model: Path, tok: ChatTokenizer) -> None:
    assert tok.image_prompt is not None
    assert tok.image_prompt.placeholder == IMAGE_TOKEN_ID
    assert list(tok.image_prompt.expansion) == IMAGE_PROMPT
    pre = json.loads((model / "preprocessor_config.json").read_text())
    proc = json.loads((model / "processor_config.json").read_text())
    other = model.parent / "split-on"
    other.mkdir(exist_ok=True)
    for name in ("config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json"):
        (other / name).write_text((model / name).read_text())
    # image splitting on: the tile grid depends on each image's size, which the router never decodes
    (other / "preprocessor_config.json").write_text(json.dumps({**pre, "do_image_splitting": True}))
    assert ChatTokenizer.from_path(other).image_prompt is None
    # no processor count: derived from the vision config as the processor derives it (16x16 / 2^2)
    (other / "preprocessor_config.json").write_text(json.dumps(pre))
    proc.pop("image_seq_len")
    (other / "processor_config.json").write_text(json.dumps(proc))
    derived = ChatTokenizer.from_path(other).image_prompt
    assert derived is not None and list(derived.expansion) == IMAGE_PROMPT
    # another architecture: unknown range
    config = json.loads((model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    assert ChatTokenizer.from_path(other).image_prompt is None


def test_router_tokens_are_the_engines(tok: ChatTokenizer, capture: dict[str, Any]) -> None:
    whole = 0
    for rq in capture["requests"]:
        engine = rq["prompt_token_ids"]
        assert len(engine) == rq["prompt_tokens"], rq["tag"]
        images = _images(rq["messages"])
        ids = tok.encode_chat(rq["messages"])
        cut = _first_unknown(engine, images)
        if cut is None:
            whole += 1
            assert type(ids) is MediaTokens and list(ids) == engine, rq["tag"]
            assert [s.identifier for s in ids.spans] == images
            assert [engine[s.offset : s.offset + s.length] for s in ids.spans] == [IMAGE_PROMPT] * len(images)
        else:
            assert type(ids) is PrefixTokens and list(ids) == engine[:cut], rq["tag"]
            known = images[: images.index(None)]
            assert [s.identifier for s in ids.spans] == known, rq["tag"]
    assert whole >= 5


def test_replayed_engine_events_predict_the_cached_tokens(
    tok: ChatTokenizer, capture: dict[str, Any]
) -> None:
    """Each request, with the frames the engine published before it applied: the router's
    prediction (whole blocks, never the last prompt token) is the engine's ``cached_tokens`` for
    a prompt it knows whole, and the engine's count within the part it knows for the others (the
    engine may serve more: an image without a uuid is keyed by vLLM's digest of it)."""
    idx = KVIndex(IndexConfig(block_size=BLOCK, predict_ttl_s=0))
    idx.ingestor.add_source(SRC)
    sidx = idx.store.source_index(SRC)
    assert sidx is not None
    payloads = [bytes.fromhex(f[2]) for f in capture["frames"]]
    done, served = 0, []
    for rq in capture["requests"]:
        idx.ingestor.apply_chunk([(sidx, p) for p in payloads[done : rq["frames_before"]]])
        done = rq["frames_before"]
        ids = tok.encode_chat(rq["messages"])
        report = idx.match(ids, [SRC], spans=getattr(ids, "spans", None))
        cap = max(len(ids) - 1, 0) // BLOCK * BLOCK
        predicted = min(report.matches[SRC].blocks * BLOCK, cap)
        expected = rq["cached_tokens"] if type(ids) is MediaTokens else min(rq["cached_tokens"], cap)
        assert predicted == expected, (rq["tag"], predicted, rq["cached_tokens"])
        served.append((rq["tag"], predicted, rq["cached_tokens"]))
    idx.ingestor.apply_chunk([(sidx, p) for p in payloads[done:]])
    assert idx.ingestor.stats[sidx].bad_events == 0
    # the image's blocks were served from cache and predicted so (more than the text before it);
    # the engine served more than predicted only where an image had no uuid
    assert max(p for _t, p, _c in served) > 48 + len(IMAGE_PROMPT) - BLOCK
    assert {t for t, p, c in served if p < c} == {"no uuid again"}
    # a uuid image before one without: its blocks matched (the prompt up to the second image)
    assert ("second image without uuid", 128, 128) in served
    # without the spans the same tokens key other blocks: the image's blocks never match
    rq = capture["requests"][1]
    ids = tok.encode_chat(rq["messages"])
    assert idx.match(list(ids), [SRC]).matches[SRC].blocks * BLOCK < rq["cached_tokens"]


def test_extra_keys_per_block_follow_vllms_layout() -> None:
    # a range from token 48 to 114 in 32-token blocks: blocks 1..3, offsets relative to each block
    assert request_extra_keys(32, None, [(48, 67, "a")]) == {1: [["a", 16]], 2: [["a", -16]], 3: [["a", -48]]}
    # two ranges in one block, in prompt order; the cache salt after them on block 0
    assert request_extra_keys(32, "s", [(2, 5, "a"), (10, 30, "b")]) == {
        0: [["a", 2], ["b", 10], "s"],
        1: [["b", -22]],
    }
    assert request_extra_keys(32, None, None) is None
    assert request_extra_keys(32, "s", None) == {0: ["s"]}
    # a range ending exactly at a block's end touches no later block
    assert request_extra_keys(32, None, [(0, 64, "a")]) == {0: [["a", 0]], 1: [["a", -32]]}
    # salted keys differ from plain ones from the range's first block on, and only there
    tokens = list(range(128))
    plain = prompt_keys(tokens, 32)
    salted = prompt_keys(tokens, 32, extra_keys=request_extra_keys(32, None, [(40, 10, "a")]))
    assert plain[0] == salted[0] and all(p != s for p, s in zip(plain[1:], salted[1:], strict=True))


def test_unknown_identifiers_and_odd_prompts_match_up_to_the_first_image(
    tok: ChatTokenizer, capture: dict[str, Any]
) -> None:
    rq = next(r for r in capture["requests"] if r["tag"] == "uuid a")
    engine = rq["prompt_token_ids"]
    start = engine.index(IMAGE_PROMPT[0])
    # processor or media options in the request: vLLM hashes the uuid with them
    ids = tok.encode_chat(rq["messages"], media_uuids=False)
    assert type(ids) is PrefixTokens and list(ids) == engine[:start]
    # a text part holding the placeholder itself: counts disagree, the text before it only
    messages = json.loads(json.dumps(rq["messages"]))
    messages[0]["content"][0]["text"] = "see <image> here " + messages[0]["content"][0]["text"]
    ids = tok.encode_chat(messages)
    assert type(ids) is PrefixTokens and IMAGE_TOKEN_ID not in ids and len(ids) < start
    # another media part (audio) after the image: the prompt up to the image
    messages = json.loads(json.dumps(rq["messages"]))
    messages[0]["content"].append({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}})
    ids = tok.encode_chat(messages)
    assert type(ids) is PrefixTokens and list(ids) == engine[:start]
