"""The segment token cache must give exactly the ids of a whole-text encode, stay inside its memory
bound, and switch itself off (answering correctly) if an assembled result ever differs.

Tokenizers are built here: the toy byte-level BPE, and Metaspace BPEs with an NFKC normalizer, an
``lstrip`` added token (never a cut point) and both prepend schemes; ``prepend_scheme="first"``
encodes a segment differently at the start of the text than after an added token, which is what
the cache's "starts the text" key and its leading-token trick exist for.
"""

from __future__ import annotations

import asyncio
import random
from array import array
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from router.decision.chat import ChatTokenizer
from router.decision.segments import SegmentCache
from router.decision.tokenizer import RequestTokenizer
from sim.toy_tokenizer import build_toy_tokenizer, toy_corpus

WORDS = "the old harbour ships sail  at dawn\n\n and  return , 42 !? \u00e9 na\u00efve \ufb01ne".split(" ")  # noqa: SIM905 - shorter than the list


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = build_toy_tokenizer(tmp_path_factory.mktemp("toy"))
    return Tokenizer.from_file(str(d / "tokenizer.json"))


def metaspace(scheme: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], show_progress=False
    )
    tok.train_from_iterator(toy_corpus(), trainer)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return tok


def random_text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(0, 14)):
        r = rng.random()
        if r < 0.3:
            parts.append(rng.choice(specials))
        elif r < 0.4:
            parts.append(rng.choice([" ", "\n", "  ", ""]))
        else:
            parts.append(rng.choice(WORDS) + rng.choice(["", " ", "\n"]))
    return "".join(parts)


def tokenizers_under_test(toy: Tokenizer) -> list[tuple[str, Tokenizer]]:
    return [("toy", toy), ("metaspace-first", metaspace("first")), ("metaspace-always", metaspace("always"))]


def test_assembled_ids_equal_whole_text_encoding(toy: Tokenizer) -> None:
    for name, tok in tokenizers_under_test(toy):
        specials = [t.content for t in tok.get_added_tokens_decoder().values()]
        # small enough that entries are evicted all the time
        cache = SegmentCache(tok, max_bytes=20_000, verify_every=7)
        rng = random.Random(name)
        for _ in range(2500):
            text = random_text(rng, specials)
            for add in (False, True):
                assert cache.encode(text, add) == tok.encode(text, add_special_tokens=add).ids, (name, text)
                assert cache.bytes <= cache.max_bytes
        assert cache.enabled and cache.mismatches == 0, name
        assert cache.hit_tokens > 0 and cache.miss_tokens > 0, name


def test_a_segment_after_an_added_token_is_encoded_in_place() -> None:
    """The reason for the leading-token trick: with prepend_scheme="first" a segment alone encodes
    differently from the same text after an added token, and the cache must give the latter."""
    tok = metaspace("first")
    seg = "harbour ships"
    alone = tok.encode(seg, add_special_tokens=False).ids
    in_place = tok.encode("[INST]" + seg, add_special_tokens=False).ids[1:]
    assert alone != in_place
    cache = SegmentCache(tok, verify_every=0)
    cache.encode(seg, False)  # caches the segment as the start of a text
    assert cache.encode("[INST]" + seg, False) == tok.encode("[INST]" + seg, add_special_tokens=False).ids
    assert cache.encode(seg, False) == alone


def test_a_resent_conversation_is_served_from_the_cache(tmp_path: Path) -> None:
    chat = ChatTokenizer.from_path(build_toy_tokenizer(tmp_path / "tok"))
    seg = chat.segments
    messages = [{"role": "system", "content": "You are terse. " * 40}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn} about the harbour and its ships."})
        before = seg.miss_tokens
        ids = chat.encode_chat(messages)
        whole = chat._tok.encode(chat.render_chat(messages), add_special_tokens=False).ids
        assert ids == whole
        new = seg.miss_tokens - before
        if turn:
            assert new < 25, f"turn {turn}: {new} tokens tokenized again"  # the two new messages
        messages.append({"role": "assistant", "content": f"Answer {turn}."})


def test_cached_answers_only_when_every_segment_is_known(toy: Tokenizer) -> None:
    cache = SegmentCache(toy, verify_every=0)
    text = "<|user|>\nold harbour</s><|assistant|>\nships"
    assert cache.cached(text, True) is None
    want = toy.encode(text, add_special_tokens=True).ids
    assert cache.encode(text, True) == want
    assert cache.cached(text, True) == want
    assert cache.cached(text, False) == toy.encode(text, add_special_tokens=False).ids
    assert cache.cached(text + "<|user|>\nnew words", False) is None


def test_a_wrong_assembly_is_caught_answered_correctly_and_switches_the_cache_off(
    toy: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    cache = SegmentCache(toy, verify_every=1)
    text = "<|user|>\nold harbour</s>"
    cache.encode(text, False)
    after_token = cache._tables[False]
    after_token["\nold harbour"] = array("i", [7, 7, 7])  # what a tokenizer quirk would look like
    want = toy.encode(text, add_special_tokens=False).ids
    with caplog.at_level("ERROR", logger="kvrouter.tokenizer"):
        assert cache.encode(text, False) == want
    assert not cache.enabled and cache.mismatches == 1 and len(cache) == 0
    assert "segment token cache disabled" in caplog.text
    assert cache.encode(text, False) == want and cache.cached(text, False) is None


def test_bypassed_when_the_tokenizer_truncates_or_the_cache_is_off(toy: Tokenizer) -> None:
    truncating = Tokenizer.from_str(toy.to_str())
    truncating.enable_truncation(4)
    text = "<|user|>\nthe old harbour ships sail at dawn</s>"
    for tok, cache in ((truncating, SegmentCache(truncating)), (toy, SegmentCache(toy, max_bytes=0))):
        for _ in range(2):
            assert cache.encode(text, True) == tok.encode(text, add_special_tokens=True).ids
        assert len(cache) == 0 and cache.cached(text, True) is None


def test_single_word_added_tokens_are_never_cut_points(toy: Tokenizer) -> None:
    tok = Tokenizer.from_str(toy.to_str())
    tok.add_tokens([AddedToken("harbour", single_word=True)])
    cache = SegmentCache(tok, verify_every=1)
    for text in ("old harbour<|user|>harbours", "<s>harbour ships</s>", "x<|user|>\nharbour"):
        for _ in range(2):
            assert cache.encode(text, False) == tok.encode(text, add_special_tokens=False).ids
    assert cache.enabled


def test_the_router_tokenizer_uses_the_cache_for_completions(tmp_path: Path) -> None:
    chat = ChatTokenizer.from_path(build_toy_tokenizer(tmp_path / "tok"))
    service = RequestTokenizer({}, default=chat)
    body = {"prompt": "Tell me about the old harbour and its ships"}
    try:
        # a whole-text prompt is stored when it comes back (the doorkeeper), then served
        first, second = (asyncio.run(service.tokenize("completions", body, "toy")) for _ in range(2))
        assert chat.segments.hit_tokens == 0
        third = asyncio.run(service.tokenize("completions", body, "toy"))
    finally:
        service.close()
    assert first == second == third == chat._tok.encode(body["prompt"]).ids
    assert chat.segments.hit_tokens == len(first) - 1  # all but the BOS came from the cache


def test_prompts_that_never_repeat_are_not_stored(toy: Tokenizer) -> None:
    cache = SegmentCache(toy, verify_every=0)
    for i in range(cache.DOORKEEPER + 10):
        cache.encode(f"prompt number {i}", True)
    assert len(cache) == 0 and cache.bytes == 0 and len(cache._seen) <= cache.DOORKEEPER
