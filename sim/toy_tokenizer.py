"""A small, deterministic HF-format tokenizer for tests, the mock engine and `make demo`.

Real model tokenizers are hundreds of megabytes and need a download; the simulated fleet only needs
*a* tokenizer that both the router and the mock engine load from the same files, so that the
router's token ids (and therefore block keys) match the engine's exactly. This module trains a
byte-level BPE on a corpus it generates itself from a fixed seed, so nothing is downloaded and the
written files are byte-identical on every call (tests compare two builds).

Layout written (the standard HF layout that `router.decision.chat.ChatTokenizer.from_path` reads):

- `tokenizer.json`: ByteLevel pre-tokenizer and decoder (any text round-trips), special tokens
  `<s>` (0), `</s>` (1), `<|user|>` (2), `<|assistant|>` (3), `<|system|>` (4), and a post-processor
  that prepends `<s>` when `add_special_tokens=True` (the completions path).
- `tokenizer_config.json`: `bos_token`, `eos_token`, `add_bos_token` and `TOY_CHAT_TEMPLATE`, which
  starts with the BOS itself (so the chat path must encode with `add_special_tokens=False`, as vLLM
  does, or the prompt would start with two BOS tokens).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "SPECIAL_TOKENS",
    "TOY_CHAT_TEMPLATE",
    "build_toy_tokenizer",
    "toy_corpus",
]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
#: Special tokens in id order: training assigns them ids 0..4 before any learned token.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, "<|user|>", "<|assistant|>", "<|system|>")

#: Our own chat template: BOS once, then one role token per turn, the content, EOS and a newline;
#: the generation prompt opens an assistant turn. Unknown roles are rejected with raise_exception,
#: like most real templates do.
TOY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% else %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_SEED = 20240611
_SENTENCES = 2500

# A few hundred ordinary words; the corpus is sentences drawn from them, so the learned merges look
# like an English tokenizer's (common words become single tokens, rare strings fall back to bytes).
_WORD_TEXT = """
the be to of and a in that have i it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see other
than then now look only come its over think also back after use two how our work first well way
even new want because any these give day most us is are was were been has had did said made went
cache request router token tokens block blocks prefix model server engine prompt answer question
system user assistant message messages context length memory latency throughput queue worker load
balance hash index event events store remove clear replica fleet backend policy score match hit
miss warm cold fast slow small large long short high low open close read write send receive start
stop run wait ready error value number list string table file line page data text word name
please thank help explain describe summarize translate write code function class method test bug
fix build deploy check review plan design report result example reason because therefore however
morning evening today tomorrow yesterday week month city country river mountain ocean forest
garden house school market library kitchen window door street road bridge train car bicycle
coffee tea water bread apple orange music story book letter picture movie game friend family
teacher student doctor engineer writer painter farmer pilot chef driver neighbour child parent
happy quiet bright dark warm cold green blue red yellow simple careful important different
"""
_WORDS = _WORD_TEXT.split()

_SYLLABLE_TEXT = "ka lo mi ra ten vor sel din par quo ber ith an el ost um ris gal fen tor by ix on"
_SYLLABLES = _SYLLABLE_TEXT.split()

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
_PUNCT = [".", ".", ".", "?", "!", ";", ":"]


def toy_corpus(seed: int = _SEED, sentences: int = _SENTENCES) -> list[str]:
    """The training corpus: seeded English-like paragraphs with names, numbers and punctuation.

    Exposed so tests and workloads can draw realistic-looking text from the same distribution.
    """
    rng = random.Random(seed)
    # Rarer invented words widen the vocabulary so training reaches the requested size.
    rare = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(900)]
    lines: list[str] = []
    paragraph: list[str] = []
    for _ in range(sentences):
        n = rng.randint(4, 18)
        words = [rng.choice(rare) if rng.random() < 0.15 else rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words[rng.randrange(n)] = rng.choice(_NAMES)
        if rng.random() < 0.2:
            words.insert(rng.randrange(n), str(rng.randint(0, 2025)))
        if rng.random() < 0.25:
            comma = rng.randrange(1, len(words))
            words[comma - 1] += ","
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if rng.random() < 0.1:
            sentence = f'"{sentence}"'
        paragraph.append(sentence)
        if rng.random() < 0.2:
            lines.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        lines.append(" ".join(paragraph))
    return lines


def _train(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE (the trainer breaks count ties by pair, so merges are reproducible)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(toy_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKENS.index(BOS_TOKEN))],
    )
    return tok


def build_toy_tokenizer(directory: Path, vocab_size: int = 2048) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` into `directory` and return `directory`.

    `vocab_size` must leave room for the 256 byte symbols and the special tokens. The output is
    byte-identical across calls and processes (sorted JSON keys, fixed seed, deterministic trainer).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size)
    # Re-serialise through json with sorted keys so the bytes do not depend on the library's
    # field order, only on the trained content.
    tokenizer_json = json.loads(tok.to_str())
    (directory / "tokenizer.json").write_text(
        json.dumps(tokenizer_json, ensure_ascii=False, sort_keys=True, indent=1) + "\n", encoding="utf-8"
    )
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "chat_template": TOY_CHAT_TEMPLATE,
        "eos_token": EOS_TOKEN,
        "model_max_length": 32768,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, sort_keys=True, indent=2) + "\n", encoding="utf-8"
    )
    return directory
