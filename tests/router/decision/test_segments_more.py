"""More attempts to break the segment token cache's exactness, with tokenizers shaped like real ones.

``router.decision.segments`` claims that the ids it assembles from cached segments equal a whole-text
``Tokenizer.encode``; the argument rests on how HF ``tokenizers`` cuts text at added tokens. These
tests build (train, offline, from seeded text) the configurations real models ship and compare the
cache with the tokenizer on thousands of random texts:

- Llama-3 / GPT-4 style byte-level BPE: a ``Split`` regex pre-tokenizer before a regex-less
  ``ByteLevel``, 250 ``<|reserved_special_token_N|>`` sharing a prefix, header/eot tokens and
  added tokens whose content is a prefix of another's;
- added tokens with ``lstrip`` / ``rstrip`` / ``normalized`` / ``single_word``, and whitespace
  added tokens (the tokenizer emits overlapping pieces when an ``rstrip`` token swallows them);
- ``encode_special_tokens = True`` (``split_special_tokens`` in ``tokenizer_config.json``);
- normalizers that change length (NFKC, Lowercase, Replace, the Llama-2 legacy ``Prepend("▁")``),
  Metaspace with every prepend scheme, WordPiece with ``BertPreTokenizer``, Unigram;
- other pipelines: ByteLevel with ``add_prefix_space``, a ByteLevel normalizer, Punctuation/Digits
  splits, Strip + NFD + StripAccents;
- post-processors: BOS only, BOS and EOS, EOS only, Roberta, BERT, ByteLevel, none.

Texts mix words, whitespace runs (tabs, ``\\r\\n``), unicode that normalizers rewrite (combining
marks, ligatures, emoji, full-width letters, a dotted capital I that lowercases to two chars),
added tokens back to back, at either end, separated only by whitespace, and cut-off added-token
strings (``<|eot_id``, ``<|eot_id|``) that must stay text. A pool of recurring messages gives cache
hits, and a small ``max_bytes`` keeps evicting. ``verify_every=0``: nothing in the cache may
notice or repair a wrong answer, so every difference shows here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from router.decision.segments import SegmentCache
from sim.toy_tokenizer import toy_corpus

# the pre-tokenizer regex of Llama-3 and GPT-4 (cl100k), and Qwen2's (one digit per piece)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
    *(f"<|reserved_special_token_{n}|>" for n in range(250)),
]

WHITESPACE = [
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r\n\r\n",
    " \n ",
    "\t \t",
    "\r",
    "\u00a0",
    "\u3000",
]
UNICODE = [
    "e\u0301",  # combining acute: NFKC composes it
    "\u0301",  # a lone combining mark
    "\ufb01ne",  # fi ligature: NFKC expands it
    "\ufb03x",  # ffi
    "\U0001f44d\U0001f3fd",  # thumbs up with a skin tone
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # a ZWJ family
    "\u65e5\u672c\u8a9e",  # CJK (BERT pads it with spaces)
    "\uff21\uff22\uff23",  # full-width ABC
    "\u2460",  # circled 1
    "\u0130stanbul",  # dotted capital I: lowercases to two code points
    "Stra\u00dfe",
    "\u01c5",  # Dz digraph, title case
    "\u2163",  # roman numeral four
    "\u210c",  # black-letter H
    "\u200b",  # zero-width space
    "\u1fa7",  # omega with four marks
    "\u2026",  # ellipsis
    "\u00bd",
    "\ud55c\uad6d\uc5b4",  # Hangul (NFD splits it into jamo)
    "na\u00efve caf\u00e9",
    "\x07\x00",  # control characters (BERT's normaliser drops them)
    "``quoted''",
]
EXTRA_WORDS = ["don't", "it's", "WE'LL", "x=42;", "3.14159", "1234567", "foo_bar()", "--flag", "#!", "a.b.c"]


def corpus() -> list[str]:
    """Training text: toy sentences plus lines with the whitespace and unicode the tests send."""
    rng = random.Random(7)
    lines = toy_corpus(sentences=700)
    for _ in range(150):
        bits = [rng.choice(UNICODE + EXTRA_WORDS + WHITESPACE) for _ in range(8)]
        lines.append(" ".join(bits) + rng.choice(lines)[:60])
    return lines


CORPUS = corpus()
WORDS = sorted({w for line in CORPUS[:200] for w in line.split()}) + EXTRA_WORDS


def partials(specials: Sequence[str]) -> list[str]:
    """Cut-off and mangled added-token strings: text that must not be cut (``<|eot_id|`` etc.)."""
    out = set()
    for s in specials[:40]:
        if len(s) > 2:
            out.update({s[:-1], s[:-2], s[1:], s[2:], s[: len(s) // 2], s.upper(), s[:-1] + " " + s[-1]})
    return sorted(out - set(specials))


class TextMaker:
    """Seeded random texts in the shapes the cache has to get right; some recur (cache hits)."""

    def __init__(self, seed: str, specials: Sequence[str], extra: Sequence[str] = ()) -> None:
        self.rng = random.Random(seed)
        self.specials = list(specials)
        self.partials = partials(self.specials)
        self.extra = list(extra)  # strings that matter to this tokenizer (e.g. non-special added words)
        self.pool = [self.loose(self.rng.randint(1, 12), specials=False) for _ in range(40)]

    def piece(self, specials: bool) -> str:
        rng = self.rng
        r = rng.random()
        if specials and r < 0.2:
            return rng.choice(self.specials)
        if r < 0.28:
            return rng.choice(self.partials) if self.partials else ""
        if r < 0.4:
            return rng.choice(WHITESPACE)
        if r < 0.5:
            return rng.choice(UNICODE)
        if r < 0.58 and self.extra:
            return rng.choice(self.extra)
        return rng.choice(WORDS) + rng.choice(["", " ", " ", "\n", ", "])

    def loose(self, n: int, specials: bool = True) -> str:
        return "".join(self.piece(specials) for _ in range(n))

    def chat(self) -> str:
        """Messages from the pool between added tokens, like a chat template writes them; a pool
        message also opens some texts, so the same segment is seen at the start and after a token."""
        rng = self.rng
        out = [rng.choice(["", rng.choice(self.specials), rng.choice(self.pool)])]
        for _ in range(rng.randint(1, 6)):
            head, tail = rng.choice(self.specials), rng.choice(self.specials)
            if rng.random() < 0.4:
                out.append(head + rng.choice(self.pool) + tail)
                continue
            sep = rng.choice(["", "\n", "\n\n", " ", rng.choice(self.specials)])
            out.append(head + rng.choice(WORDS) + rng.choice(["", " "]) + sep + rng.choice(self.pool) + tail)
            out.append(rng.choice(["", "\n", " ", "\r\n"]))
        return "".join(out)

    def adjacent(self) -> str:
        """Added tokens back to back, at the ends, or apart by whitespace or a partial only."""
        rng = self.rng
        glue = ["", "", " ", "\n", "\t", "\r\n", "  "]
        out = []
        for _ in range(rng.randint(1, 6)):
            out.append(rng.choice(self.specials + self.partials + self.extra))
            out.append(rng.choice(glue))
        if rng.random() < 0.5:
            out.insert(rng.randrange(len(out) + 1), rng.choice(self.pool))
        return "".join(out)

    def edges(self) -> list[str]:
        """Hand-picked shapes for the first added tokens: empty and blank texts, a token alone,
        doubled, at either end, between words or whitespace, and its cut-off forms."""
        out = ["", " ", "\n", "\r\n", "  \t\n"]
        for s, t in zip(self.specials[:8], self.specials[1:9], strict=False):
            out += [s, s + s, s + t, s + " " + t, s + "\r\n" + t, " " + s, s + " ", "\n" + s + "\n"]
            out += ["a" + s + "b", "a " + s + " b", s[:-1], s[:-1] + s, s + s[1:], s[:-1] + t, s + t[:-1]]
        return out

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.01:  # one segment larger than the whole cache: never stored, still exact
            return self.rng.choice(self.specials) + " ".join(self.pool) * 12
        if r < 0.4:
            return self.chat()
        if r < 0.65:
            return self.adjacent()
        return self.loose(self.rng.randint(0, 18))

    def texts(self, n: int) -> list[str]:
        return self.edges() + [self.text() for _ in range(n)]


def assert_exact(tok: Tokenizer, texts: Sequence[str], max_bytes: int = 8000) -> SegmentCache:
    """Every text, with and without the post-processor: ``encode`` and (when it answers)
    ``cached`` give the whole-text ids, the cache stays on and within its bound, and it did serve
    hits and evict, so the comparison exercised assembly rather than a bypass."""
    cache = SegmentCache(tok, max_bytes=max_bytes, verify_every=0)
    served = {False: 0, True: 0}
    for text in texts:
        for add in (False, True):
            want = tok.encode(text, add_special_tokens=add).ids
            early = cache.cached(text, add)
            assert early is None or early == want, ("cached before encode", add, text)
            assert cache.encode(text, add) == want, ("encode", add, text)
            late = cache.cached(text, add)
            assert late is None or late == want, ("cached after encode", add, text)
            served[add] += (early is not None) + (late is not None)
            assert cache.enabled and cache.mismatches == 0, text
            assert cache.bytes <= max_bytes
    assert cache.hit_tokens > 0 and cache.miss_tokens > 0
    assert served[False] > 0 and served[True] > 0, served  # neither mode was bypassed
    assert any(cache.cached(t, False) is None for t in texts[:200]), "nothing was evicted"
    return cache


# --- tokenizers -----------------------------------------------------------------------------------


def byte_level_bpe(split: str, specials: Sequence[str], vocab: int = 1200) -> Tokenizer:
    """A Llama-3 / GPT-4 style BPE: regex split, then bytes to printable chars (no second regex)."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def token_id(tok: Tokenizer, content: str) -> int:
    tid = tok.token_to_id(content)
    assert isinstance(tid, int), content
    return tid


def bos_only(tok: Tokenizer, bos: str) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, token_id(tok, bos))]
    )


def bos_eos(tok: Tokenizer, bos: str, eos: str) -> processors.PostProcessor:
    return processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        special_tokens=[(bos, token_id(tok, bos)), (eos, token_id(tok, eos))],
    )


def copy(tok: Tokenizer) -> Tokenizer:
    return Tokenizer.from_str(tok.to_str())


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    """Llama-3 layout: special tokens first, ``ByteLevel`` + BOS template post-processor, and
    added tokens overlapping others (``<|eot_id|>\\n`` extends ``<|eot_id|>``, ``<think>`` is a
    prefix of ``<think>\\n``)."""
    tok = byte_level_bpe(LLAMA3_SPLIT, LLAMA3_SPECIALS)
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in ("<|eot_id|>\n", "<think>", "<think>\n")]
    )
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("</think>", "<tool_call>")])
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), bos_only(tok, "<|begin_of_text|>")]
    )
    return tok


def llama3_specials(tok: Tokenizer) -> list[str]:
    first = [t.content for t in tok.get_added_tokens_decoder().values()][:30]
    return [*first, *(f"<|reserved_special_token_{n}|>" for n in (1, 10, 100, 249))]


def test_llama3_split_regex_with_many_prefix_sharing_special_tokens(llama3: Tokenizer) -> None:
    texts = TextMaker(
        "llama3", llama3_specials(llama3), ["<|reserved_special_token_", "<think", "\n<|"]
    ).texts(1500)
    assert_exact(llama3, texts)


@pytest.mark.parametrize("post", ["bos-eos", "byte-level", "none"])
def test_qwen2_split_regex_with_each_post_processor(post: str) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|box_start|>"]
    tok = byte_level_bpe(QWEN2_SPLIT, specials, vocab=900)
    # Qwen2.5 ships its tool and fim tokens as plain (non-special) raw added tokens
    tok.add_tokens(
        [
            AddedToken(s, special=False, normalized=False)
            for s in ("<tool_call>", "</tool_call>", "<|fim_pad|>")
        ]
    )
    if post == "bos-eos":
        tok.post_processor = bos_eos(tok, "<|im_start|>", "<|im_end|>")
    elif post == "byte-level":
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    specials += ["<tool_call>", "</tool_call>", "<|fim_pad|>"]
    assert_exact(tok, TextMaker(f"qwen2-{post}", specials).texts(1000))


def test_encode_special_tokens_without_overlaps(llama3: Tokenizer) -> None:
    """``split_special_tokens``: special tokens are plain text and only the non-special raw ones
    (``</think>``, ``<tool_call>``) cut; none of those overlaps a special token here (the last
    test covers one that does)."""
    tok = copy(llama3)
    tok.encode_special_tokens = True
    texts = TextMaker("split-specials", llama3_specials(llama3), ["<tool_call>", "<tool_call", "</think"])
    assert_exact(tok, texts.texts(1000))


@pytest.fixture(scope="module")
def flagged() -> Tokenizer:
    """Byte-level BPE (GPT-2 regex) with added tokens of every flag combination real models use:
    ``<mask>`` lstrip (RoBERTa), an rstrip and an lstrip+rstrip token, normalized non-special
    words, and whitespace added tokens (some code models add runs of spaces and newlines)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(
        [
            AddedToken("<mask>", lstrip=True, special=True, normalized=False),
            AddedToken("[R]", rstrip=True, special=True, normalized=False),
            AddedToken("[LR]", lstrip=True, rstrip=True, special=True, normalized=False),
            AddedToken("<sep>", special=True, normalized=False),
        ]
    )
    tok.add_tokens(
        [
            AddedToken("harbour", special=False, normalized=True),  # matched after lowercasing
            AddedToken("\ufb01", special=False, normalized=True),  # never matches: NFKC rewrites it
            AddedToken("fine", special=False, normalized=True, lstrip=True),
            AddedToken("old\n\nharbour", special=False, normalized=True),  # "\n\n" is cut out first
            AddedToken("[raw]", special=False, normalized=False, rstrip=True),
            AddedToken("\n\n", special=False, normalized=False),
            AddedToken("  ", special=False, normalized=False),
            AddedToken("\t", special=False, normalized=False),
        ]
    )
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", token_id(tok, "</s>")), ("<s>", token_id(tok, "<s>"))
    )
    return tok


FLAGGED_EXTRA = [
    "old\n\nharbour",
    "OLD\n\nHarbour",
    "harbour",
    "HARBOUR",
    "Harbour ",
    "\ufb01",
    "fine",
    " FINE ",
    "[raw]",
    "[raw]  ",
    " [R]  ",
    "\t\t",
]


def test_lstrip_rstrip_normalized_and_whitespace_added_tokens(flagged: Tokenizer) -> None:
    specials = ["<s>", "</s>", "<mask>", "[R]", "[LR]", "<sep>", "\n\n", "  ", "\t", "[raw]"]
    assert_exact(flagged, TextMaker("flags", specials, FLAGGED_EXTRA).texts(1500))


def test_strip_tokens_next_to_whitespace_cut_tokens(flagged: Tokenizer) -> None:
    """An rstrip token swallows the whitespace after it even where a whitespace added token starts
    inside it (the tokenizer then emits overlapping pieces); an lstrip token stops at the previous
    match. Every arrangement of these, exhaustively for short ones."""
    atoms = ["<mask>", "[R]", "[LR]", "[raw]", "<sep>", "\n\n", "  ", "\t", " ", "\n", "x", "fine"]
    rng = random.Random(11)
    texts = ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 7))) for _ in range(2500)]
    texts += [a + b + c for a in atoms for b in atoms for c in atoms[:6]]
    assert_exact(flagged, texts, max_bytes=3000)


def test_single_word_added_tokens_leave_the_text_whole(flagged: Tokenizer) -> None:
    """A ``single_word`` match depends on the characters around it, which a cut would hide when a
    cut token starts or ends with a word character (``Answer``): such tokenizers are not cut."""
    tok = copy(flagged)
    tok.add_tokens([AddedToken("ship", single_word=True, normalized=False)])
    tok.add_tokens([AddedToken("Answer", normalized=False)])
    tok.add_special_tokens([AddedToken("[W]", single_word=True, special=True, normalized=False)])
    extra = ["ship", "ships", " ship ", "shipAnswer", "Answership", "[W]", "x[W]", "[W] ", "ship[W]"]
    specials = ["<s>", "</s>", "<mask>", "[R]", "<sep>", "Answer"]
    assert_exact(tok, TextMaker("single-word", specials, extra).texts(1200))


def metaspace_bpe(scheme: str, normalizer: normalizers.Normalizer | None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


LENGTH_CHANGING = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.Replace(Regex(r"\s+"), " "),  # whitespace runs collapse
        normalizers.Replace("``", '"'),
        normalizers.Replace("''", '"'),
        normalizers.Lowercase(),
        normalizers.Strip(left=False, right=True),
    ]
)


@pytest.mark.parametrize("scheme", ["first", "always", "never"])
def test_metaspace_schemes_with_length_changing_normalizers(scheme: str) -> None:
    tok = metaspace_bpe(scheme, LENGTH_CHANGING)
    # raw added tokens are matched before normalization: NFKC would rewrite the ligature in "[\ufb01]"
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<<SYS>>", "[\ufb01]")])
    tok.post_processor = bos_eos(tok, "<s>", "</s>")
    specials = ["<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "[\ufb01]", "[fi]"]
    assert_exact(
        tok, TextMaker(f"metaspace-{scheme}", specials, ["[INST", "<<SYS>", " [/INST] "]).texts(1000)
    )


def test_llama2_legacy_prepend_normalizer_with_byte_fallback() -> None:
    """Llama-2's converted tokenizer: no pre-tokenizer, ``Prepend("▁")`` + ``Replace(" ", "▁")``
    on every piece between added tokens, byte fallback for unseen characters, BOS only."""
    trained = metaspace_bpe("always", None)
    spec = json.loads(trained.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    pairs = [m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"]]
    merges = [(str(a), str(b)) for a, b in pairs]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = bos_only(tok, "<s>")
    tok.add_tokens([AddedToken("[INST]", special=False, normalized=False)])
    texts = TextMaker("llama2", ["<s>", "</s>", "<unk>", "[INST]"], ["\u2581", " \u2581 "]).texts(1200)
    assert_exact(tok, texts)


def test_wordpiece_with_bert_normalizer_and_pre_tokenizer() -> None:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=900, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken("[unused0]", special=False, normalized=False)])
    for post in ("bert", "template"):
        if post == "bert":
            tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
        else:
            tok.post_processor = bos_eos(tok, "[CLS]", "[SEP]")
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"]
        assert_exact(tok, TextMaker(f"bert-{post}", specials, ["[CLS", "[sep]"]).texts(700))


def test_unigram_with_nfkc_and_metaspace() -> None:
    """T5 / ALBERT shape: Unigram, NFKC, Metaspace, ``$A </s>`` (EOS only)."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=700, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(CORPUS[:500], trainer)
    tok.add_special_tokens([AddedToken(f"<extra_id_{n}>", special=True, normalized=False) for n in range(20)])
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", token_id(tok, "</s>"))]
    )
    specials = ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_1>", "<extra_id_10>", "<extra_id_19>"]
    assert_exact(tok, TextMaker("unigram", specials, ["<extra_id_", "<extra_id_1"]).texts(1000))


OTHER_PIPELINES = {
    "byte-level-prefix-space": (pre_tokenizers.ByteLevel(add_prefix_space=True), None),
    "byte-level-normalizer": (None, normalizers.ByteLevel()),
    "punctuation-digits": (
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Punctuation(),
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(use_regex=False),
            ]
        ),
        None,
    ),
    "strip-nfd-accents": (
        pre_tokenizers.ByteLevel(),
        normalizers.Sequence([normalizers.Strip(), normalizers.NFD(), normalizers.StripAccents()]),
    ),
}


@pytest.mark.parametrize("name", sorted(OTHER_PIPELINES))
def test_other_pre_tokenizers_and_normalizers(name: str) -> None:
    """Pieces that gain a leading space, lose their ends, or are split by character class."""
    pre, norm = OTHER_PIPELINES[name]
    tok = Tokenizer(models.BPE())
    tok.normalizer = norm
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool>", normalized=False)])
    tok.post_processor = bos_eos(tok, "<s>", "</s>")
    assert_exact(tok, TextMaker(name, ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool>"]).texts(600))


# --- found: a special token skipped under encode_special_tokens still hides what it overlaps -----


@pytest.mark.parametrize(
    ("inner", "text"),
    [
        ("_id", "<|eot_id|>"),  # a non-special token inside a special one
        ("|>x", "<|eot_id|>x"),  # one that starts inside a special token and ends after it
    ],
)
def test_encode_special_tokens_with_a_non_special_token_overlapping_a_special_one(
    inner: str, text: str
) -> None:
    """Found by this suite (failed before the fix that keeps special tokens in the match).

    HF finds raw added tokens with one leftmost-longest automaton over *all* of them, special
    included, and only then drops the special matches when ``encode_special_tokens`` is set; the
    dropped match has still consumed its characters, so ``inner`` is never found there and the
    whole text is encoded as plain text. A cache that left special tokens out of its match would
    find ``inner``, cut the text there and answer with ``inner``'s added id.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["the old harbour"], trainer)
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken(inner, special=False, normalized=False)])
    tok.encode_special_tokens = True
    want = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id(inner) not in want  # the tokenizer did not extract it
    cache = SegmentCache(tok, verify_every=0)
    got = [cache.encode(text, False) for _ in range(2)]  # one segment: stored when it comes back
    assert (got, cache.cached(text, False)) == ([want, want], want)
