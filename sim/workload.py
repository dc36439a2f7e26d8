"""Seeded workloads with realistic prefix reuse: shared system prompts, growing chats, popular documents.

A KV-aware router only pays off when prompts share prefixes in the ways production traffic does, so
the built-in workload mixes the three shapes that dominate real chat fleets:

* **system prompts**: a few shared system prompts of different lengths (weighted: short ones are
  common, long ones rare); every conversation starts with one of them;
* **multi-turn conversations**: each turn resends the whole history (system prompt, every earlier user
  message and assistant answer) plus a new user message, so turn *k* extends turn *k-1*'s prompt.
  The assistant answers are deterministic stand-ins of ``answer_tokens`` tokens; a live driver can
  substitute the text the engine really returned (``Request.turn`` says which answers precede it);
* **popular documents**: a Zipf-popular set of long documents that single-turn requests quote in full,
  followed by a question (RAG / "chat with a PDF" traffic).

Arrivals are Poisson: conversations start at ``session_rate`` per second and each later turn follows
its predecessor after an exponential think time (``Request.think_s``; replays in session mode issue a
turn no earlier than its predecessor's completion plus that think time); document requests arrive at
``doc_rate`` per second. Everything derives from ``seed``, so a workload is identical on every run.

Requests carry either chat ``messages`` (text, tokenized by the router and the engine alike) or a
prompt of token ids, given explicitly or lazily by a :class:`TracePrompt` (trace replays: see
``sim.traces`` for how trace block ids become tokens).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from sim.toy_tokenizer import toy_corpus

Message = dict[str, str]

TOKENS_PER_WORD = 1.22
"""Toy-tokenizer tokens per corpus word (measured on the toy corpus); sizes below are in tokens."""


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser, vectorised (uint64 in, uint64 out, wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True, slots=True, eq=False)
class TracePrompt:
    """A prompt made of trace blocks, materialised to token ids only when needed (traces are large).

    Block ``h`` of namespace ``ns`` always becomes the same ``tokens_per_block`` pseudo-random ids
    in ``[vocab_lo, vocab_hi)`` (SplitMix64 of ``(ns, h, position)``), so equal ids give equal tokens,
    hence equal router keys and engine block hashes. The prompt is the blocks' tokens concatenated,
    cut to ``n_tokens`` (the last block may be partial); ``tail_seed`` non-zero appends
    ``tail_tokens`` ids private to this request (text a trace does not assign a block id to).
    """

    namespace: int
    hash_ids: npt.NDArray[np.int64]
    """Trace block ids (an int64 array: long traces hold ~100M of them)."""
    n_tokens: int
    tokens_per_block: int
    tail_tokens: int = 0
    tail_seed: int = 0
    vocab_lo: int = 5
    vocab_hi: int = 2048

    def token_ids(self) -> list[int]:
        """The prompt's token ids (deterministic)."""
        tpb = self.tokens_per_block
        span = np.uint64(self.vocab_hi - self.vocab_lo)
        ids = self.hash_ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            seeds = _mix64(
                ids * np.uint64(0x9E3779B97F4A7C15)
                + np.uint64((self.namespace * 0x632BE59BD9B4E019) & 0xFFFF_FFFF_FFFF_FFFF)
            )
            pos = np.arange(tpb, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
            grid = _mix64(seeds[:, None] ^ pos[None, :]).reshape(-1)
            out = (grid % span + np.uint64(self.vocab_lo))[: self.n_tokens]
            if self.tail_tokens and self.tail_seed:
                tail_pos = np.arange(self.tail_tokens, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
                tail = _mix64(np.uint64(self.tail_seed) ^ tail_pos) % span + np.uint64(self.vocab_lo)
                out = np.concatenate([out, tail])
        result: list[int] = out.tolist()
        return result

    @property
    def length(self) -> int:
        """Prompt length in tokens without materialising it."""
        return min(self.n_tokens, len(self.hash_ids) * self.tokens_per_block) + (
            self.tail_tokens if self.tail_seed else 0
        )


@dataclass(slots=True)
class Request:
    """One request of a workload or trace, in arrival order.

    Exactly one of ``messages`` (chat), ``prompt_token_ids`` or ``trace`` (completions with token ids)
    is set. ``at_s`` is the planned arrival (seconds from the start, before any speed-up). For turn
    ``turn > 0`` of a session, ``think_s`` is the user's think time after the previous turn's answer:
    a session-aware replay issues the turn at ``max(at_s, previous completion + think_s)``.
    """

    at_s: float
    session: str
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    turn: int = 0
    think_s: float | None = None
    kind: str = "chat"
    """chat | doc | trace: what produced the request (reports may group by it)."""
    trace: TracePrompt | None = None
    meta: dict[str, float] = field(default_factory=dict)

    def token_ids(self) -> list[int] | None:
        """The prompt's token ids when they are known without a tokenizer (trace or explicit ids)."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        if self.trace is not None:
            return self.trace.token_ids()
        return None


class WorkloadConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape and size of the built-in chat workload (sizes in toy-tokenizer tokens, approximate)."""

    seed: int = 0
    duration_s: float = 30.0
    """Window in which conversations and document requests start (later turns may run past it)."""
    session_rate: float = 1.0
    """New conversations per second (Poisson)."""
    turns: tuple[int, int] = (2, 6)
    """Turns per conversation, uniform in [lo, hi]."""
    think_s: float = 1.5
    """Mean think time between an answer and the next turn (exponential)."""
    system_prompt_tokens: tuple[int, ...] = (300, 700, 1500)
    """One shared system prompt per entry."""
    system_prompt_weights: tuple[float, ...] = (0.5, 0.3, 0.2)
    user_tokens: tuple[int, int] = (20, 120)
    """Length of each new user message, uniform in [lo, hi]."""
    answer_tokens: int = 24
    """max_tokens of chat turns; the stand-in answers have about this length."""
    doc_rate: float = 1.0
    """Document-question requests per second (Poisson)."""
    num_docs: int = 8
    doc_tokens: tuple[int, int] = (800, 2000)
    """Length of each document, uniform in [lo, hi]."""
    doc_zipf: float = 1.1
    """Popularity of document i (0-based) is proportional to 1 / (i + 1) ** doc_zipf."""
    doc_system_prompt: int = 0
    """Index of the system prompt used by document requests (-1: none)."""
    doc_max_tokens: int = 16


def demo_config(quick: bool = False, seed: int = 0) -> WorkloadConfig:
    """The sizes `kvrouter demo` uses: ~75-90 requests in ~14 s (~60 in ~5.5 s with ``quick``, the
    CI's end-to-end fleet test), enough prefix reuse that round-robin misses it and small enough for
    the demo's time budget."""
    if quick:
        return WorkloadConfig(
            seed=seed,
            duration_s=5.5,
            session_rate=3.0,
            turns=(2, 4),
            think_s=0.2,
            system_prompt_tokens=(300, 800),
            system_prompt_weights=(0.6, 0.4),
            doc_rate=4.0,
            num_docs=3,
            doc_tokens=(600, 1200),
            answer_tokens=8,
            doc_max_tokens=8,
        )
    return WorkloadConfig(
        seed=seed,
        duration_s=10.0,
        session_rate=1.6,
        turns=(2, 5),
        think_s=1.0,
        doc_rate=3.5,
        num_docs=8,
    )


def vllm_demo_config(quick: bool = False, seed: int = 0, block_size: int = 32) -> WorkloadConfig:
    """The sizes `kvrouter demo --vllm` uses on real CPU engines (~300 output tokens/s each): ~65
    requests over ~20 s (~40 over ~8 s with ``quick``), short answers, and prompts of at most ~1,250
    tokens, well under the engines' max-model-len. Document questions carry no system prompt: with
    two engines, a system prompt ahead of every request would draw all of them to the engine that
    caches it. ``block_size`` over 64 (the Qwen3-Next shape's 544-token block) doubles the shared
    prefixes so that they still span whole blocks: vLLM only hits whole blocks."""
    grow = 2.0 if block_size > 64 else 1.0
    return WorkloadConfig(
        seed=seed,
        duration_s=8.0 if quick else 20.0,
        session_rate=1.5 if quick else 1.0,
        turns=(2, 4),
        think_s=0.5,
        system_prompt_tokens=tuple(round(n * grow) for n in (300, 700)),
        system_prompt_weights=(0.6, 0.4),
        user_tokens=(20, 60),
        answer_tokens=12,
        doc_rate=1.5 if quick else 1.0,
        num_docs=3 if quick else 4,
        doc_tokens=(round(500 * grow), round(1000 * grow)),
        doc_max_tokens=12,
        doc_system_prompt=-1,
    )


class _Text:
    """Deterministic English-like text drawn from the toy tokenizer's corpus distribution."""

    def __init__(self, seed: int) -> None:
        self.words = " ".join(toy_corpus(seed=seed + 7, sentences=800)).split()

    def make(self, rng: random.Random, tokens: int) -> str:
        n = max(1, round(tokens / TOKENS_PER_WORD))
        start = rng.randrange(len(self.words))
        out = [self.words[(start + i) % len(self.words)] for i in range(n)]
        return " ".join(out)


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    times: list[float] = []
    if rate <= 0:
        return times
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def generate(cfg: WorkloadConfig | None = None) -> list[Request]:
    """The workload of ``cfg`` (deterministic in ``cfg.seed``), sorted by arrival time."""
    cfg = cfg or WorkloadConfig()
    if len(cfg.system_prompt_tokens) != len(cfg.system_prompt_weights):
        raise ValueError("system_prompt_tokens and system_prompt_weights must have the same length")
    rng = random.Random(cfg.seed)
    text = _Text(cfg.seed)
    systems = [
        f"You are assistant #{i} of the kvrouter demo. " + text.make(rng, n)
        for i, n in enumerate(cfg.system_prompt_tokens)
    ]
    docs = [f"Document {i}. " + text.make(rng, rng.randint(*cfg.doc_tokens)) for i in range(cfg.num_docs)]
    out: list[Request] = []
    # conversations
    for s, start in enumerate(_poisson(rng, cfg.session_rate, cfg.duration_s)):
        srng = random.Random(rng.getrandbits(64))
        system = srng.choices(range(len(systems)), weights=cfg.system_prompt_weights)[0]
        history: list[Message] = [{"role": "system", "content": systems[system]}]
        n_turns = srng.randint(*cfg.turns)
        at = start
        for turn in range(n_turns):
            think = None
            if turn:
                think = srng.expovariate(1.0 / cfg.think_s) if cfg.think_s > 0 else 0.0
                at += think
            user = {
                "role": "user",
                "content": f"Turn {turn}: " + text.make(srng, srng.randint(*cfg.user_tokens)),
            }
            messages = [*history, user]
            out.append(
                Request(
                    at_s=at,
                    session=f"chat-{s}",
                    messages=messages,
                    max_tokens=cfg.answer_tokens,
                    turn=turn,
                    think_s=think,
                    kind="chat",
                    meta={"system": float(system)},
                )
            )
            answer = {"role": "assistant", "content": text.make(srng, cfg.answer_tokens)}
            history = [*messages, answer]
    # document questions
    weights = [1.0 / (i + 1) ** cfg.doc_zipf for i in range(cfg.num_docs)]
    for q, at in enumerate(_poisson(rng, cfg.doc_rate, cfg.duration_s) if docs else []):
        d = rng.choices(range(cfg.num_docs), weights=weights)[0]
        question = f"Question {q}: " + text.make(rng, rng.randint(*cfg.user_tokens))
        messages = []
        if 0 <= cfg.doc_system_prompt < len(systems):
            messages.append({"role": "system", "content": systems[cfg.doc_system_prompt]})
        messages.append({"role": "user", "content": docs[d] + "\n\n" + question})
        out.append(
            Request(
                at_s=at,
                session=f"doc-q{q}",
                messages=messages,
                max_tokens=cfg.doc_max_tokens,
                kind="doc",
                meta={"doc": float(d)},
            )
        )
    out.sort(key=lambda r: (r.at_s, r.session, r.turn))
    return out


def with_answers(messages: Sequence[Message], answers: Sequence[str | None]) -> list[Message]:
    """``messages`` with the i-th assistant message replaced by ``answers[i]`` when that is known.

    A live driver uses this to resend what the engine really answered in earlier turns, as a chat
    client does; unknown answers keep the workload's stand-in.
    """
    out: list[Message] = []
    i = 0
    for m in messages:
        if m.get("role") == "assistant":
            if i < len(answers) and answers[i] is not None:
                m = {**m, "content": str(answers[i])}
            i += 1
        out.append(m)
    return out


def summary(requests: Sequence[Request]) -> dict[str, float]:
    """Counts and span of a workload (for logs and the demo banner)."""
    if not requests:
        return {"requests": 0, "sessions": 0, "span_s": 0.0}
    return {
        "requests": len(requests),
        "sessions": len({r.session for r in requests}),
        "span_s": max(r.at_s for r in requests) - min(r.at_s for r in requests),
    }
