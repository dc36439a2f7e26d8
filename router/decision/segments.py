"""Token ids of prompt text, reused segment by segment: the text between added tokens is cached.

Why: tokenizing is the largest single cost of a routing decision (a 10-word prompt costs ~30 us on
the event loop while the router is busy, an 8k-token chat ~8 ms), and the traffic a KV-aware router
exists for repeats itself: every chat turn resends the system prompt and the whole conversation
so far, agents resend their tool definitions, few-shot templates resend their examples. A chat
template writes an added token (``<|im_start|>``, ``<|eot_id|>``, ...) around every message, so
the text between two of them is a natural unit: on the next turn every earlier message is found
here and only the new one is tokenized.

Why it is exact (the ids are the ones a whole-text ``encode`` gives, not an approximation):
HF ``tokenizers`` first cuts the text at its added tokens (leftmost-longest match on the raw text)
and then normalises, pre-tokenizes and encodes every piece between them on its own. So the
concatenation of per-piece encodings *is* the whole encoding, provided that

- the cut points are the ones the tokenizer itself would choose: every added token matched on raw
  text takes part in the leftmost-longest match here (special ones too when the tokenizer encodes
  them as text: their match still hides overlapping tokens), but the text is only cut at tokens
  that cannot reach outside their own characters (no ``lstrip``/``rstrip``/``single_word``, not
  ``normalized``, not special under ``encode_special_tokens``); others stay inside a segment,
  where the tokenizer handles them itself;
- position-dependent rules see the right position: a Metaspace pre-tokenizer with
  ``prepend_scheme="first"`` treats the piece at offset 0 differently, so a segment that does not
  start the text is encoded after its added token (``"<|im_start|>" + segment``) and that token's
  id is dropped, and the cache keys "starts the text" apart from "does not";
- the post-processor (BOS/EOS for ``add_special_tokens=True``) wraps the whole: its prefix and
  suffix are learned once by encoding probe texts with and without it, and when they are not a
  plain prefix/suffix (or truncation or padding is configured) the cache steps aside for that call.

Tokenizers with ``single_word`` added tokens (whose matching depends on the surrounding text) are
not cut at all: their whole text is one segment. Because this relies on how HF ``tokenizers``
works inside, a sample of assembled results (one in ``verify_every`` texts of more than one
segment) is checked against a plain whole-text encode; on any difference the cache logs it, counts
it and switches itself off. (A text of one segment needs no check: its ids are the tokenizer's own
for that very text. ``cached`` does not check either, so that it never tokenizes.) The tests, and
an adversarial suite of real-model layouts (Llama-3 and Qwen2 regexes with hundreds of special
tokens, Metaspace, Llama-2 legacy, WordPiece, Unigram; every added-token flag), compare it with
whole-text encodes on thousands of random texts.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the tokenizer comes from router.decision.chat, which imports the library)
    from tokenizers import Tokenizer

log = logging.getLogger("kvrouter.tokenizer")

__all__ = ["SegmentCache"]

Encoder = Callable[[list[str], bool], list[list[int]]]


def _affix(encode: Encoder) -> tuple[list[int], list[int]] | None:
    """What the post-processor adds around a single sequence, or None if it is not a fixed
    prefix and suffix (learned from two probe texts)."""
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for probe in ("hello world", "The 3 quick foxes."):
        plain = encode([probe], False)[0]
        full = encode([probe], True)[0]
        n = len(plain)
        if n == 0:
            return None
        starts = [i for i in range(len(full) - n + 1) if full[i : i + n] == plain]
        if len(starts) != 1:
            return None
        i = starts[0]
        found.add((tuple(full[:i]), tuple(full[i + n :])))
    if len(found) != 1:
        return None
    pre, post = found.pop()
    return list(pre), list(post)


class SegmentCache:
    """``encode(text, add_special_tokens)`` with the ids of text segments remembered (bounded LRU).

    Thread-safe: the lock guards only the tables; encoding runs outside it. ``max_bytes`` bounds an
    estimate of the memory held: 4 bytes per id, the segment text, and ~200 bytes of per-entry
    overhead (measured with tracemalloc: 494 bytes for a 37-token entry, 5.4 KB for 715 tokens).
    Two tables, segments that start the text and the others, keyed by the text alone: entries are a
    str and an array, none of them tracked by the cyclic GC, so a full cache costs no collector
    time. A text that is one whole segment (a completions prompt) is stored only when it comes back
    (a doorkeeper of hashes): prompts that never repeat would otherwise churn the cache and cost
    more than they save. Segments of a multi-segment text (chat messages) are stored at once: the
    next turn of the conversation resends them.
    Counters (``hit_tokens``, ``miss_tokens``, ``mismatches``) are read by the metrics at scrape time.
    """

    ENTRY_OVERHEAD = 200
    DOORKEEPER = 1 << 16

    def __init__(self, tok: Tokenizer, max_bytes: int = 32 << 20, verify_every: int = 256) -> None:
        self._tok = tok
        self.max_bytes = max_bytes
        self.verify_every = max(verify_every, 0)
        self.enabled = max_bytes > 0
        self._lock = threading.Lock()
        # [False]: segments after an added token, [True]: segments that start the text
        self._tables: tuple[OrderedDict[str, array[int]], OrderedDict[str, array[int]]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._seen: set[int] = set()
        self.bytes = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.mismatches = 0
        self._assembled = 0
        # tokens the tokenizer extracts from raw text, and the subset the text may be cut at
        added = tok.get_added_tokens_decoder()
        skip_special = bool(getattr(tok, "encode_special_tokens", False))
        # with encode_special_tokens the tokenizer still *matches* special tokens (a match hides
        # any token overlapping it) and only then encodes them as text: they stay in the match,
        # never as cut points
        raw = [t for t in added.values() if not t.normalized]
        self._ids = {t.content: int(i) for i, t in added.items()}
        self._cut = frozenset(
            t.content
            for t in raw
            if not (t.lstrip or t.rstrip or t.single_word or (skip_special and t.special))
        )
        if any(t.single_word for t in added.values()) or not self._cut:
            self._split: re.Pattern[str] | None = None
        else:
            alternatives = sorted({t.content for t in raw if t.content}, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._plain = tok.truncation is None and tok.padding is None
        self._wrap = _affix(self._encode) if self._plain else None

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def _encode_misses(self, texts: list[str]) -> list[list[int]]:
        """One call per text while the work is small: a batch goes through the tokenizer's thread
        pool, which costs more than it saves below a few KB (2 short texts: 21 us batched vs 2x7 us;
        20 messages of 200 words: 2.1 ms batched vs 4.0 ms one by one)."""
        if len(texts) > 1 and sum(map(len, texts)) >= 4096:
            return self._encode(texts, False)
        return [self._encode([t], False)[0] for t in texts]

    def _wrapping(self, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
        """The post-processor's (prefix, suffix) for this call, or None when the cache cannot serve
        it (off, truncation/padding configured, or a post-processor that is not a plain affix)."""
        if not self.enabled or not self._plain:
            return None
        return self._wrap if add_special_tokens else ([], [])

    def _lookup(
        self, plan: list[tuple[str, bool, str, int]], out: list[int]
    ) -> tuple[int, list[tuple[int, str, bool, str]]]:
        """Append the plan's cached ids and added-token ids to ``out`` (a -1 placeholder per
        missing segment); return the hit count and the misses as (slot, segment, first, token
        before). The caller holds the lock."""
        misses: list[tuple[int, str, bool, str]] = []
        hits = 0
        tables = self._tables
        for seg, first, before, tid in plan:
            if seg:
                table = tables[first]
                ids = table.get(seg)
                if ids is None:
                    misses.append((len(out), seg, first, before))
                    out.append(-1)
                else:
                    table.move_to_end(seg)
                    hits += len(ids)
                    out.extend(ids)
            if tid >= 0:
                out.append(tid)
        return hits, misses

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids ``Tokenizer.encode(text, add_special_tokens).ids`` would give."""
        wrap = self._wrapping(add_special_tokens)
        if wrap is None:
            return self._encode([text], add_special_tokens)[0]
        plan = self._plan(text)
        if len(plan) == 1:
            return self._whole(text, add_special_tokens, wrap)
        out: list[int] = list(wrap[0])
        with self._lock:
            hits, misses = self._lookup(plan, out)
        fresh: list[tuple[str, bool, list[int]]] = []
        if misses:
            # a segment that does not start the text is encoded after its added token, whose id is
            # dropped: position-dependent pre-tokenizers then see it where the whole text has it
            texts = [seg if first else before + seg for _, seg, first, before in misses]
            for (_, seg, first, before), ids_i in zip(misses, self._encode_misses(texts), strict=True):
                if not first:
                    if not ids_i or ids_i[0] != self._ids[before]:
                        return self._give_up(text, add_special_tokens, "an added token did not encode alone")
                    ids_i = ids_i[1:]
                fresh.append((seg, first, ids_i))
            for (where, *_), (*_, ids_i) in zip(reversed(misses), reversed(fresh), strict=True):
                out[where : where + 1] = ids_i  # back to front: earlier slots keep their place
        out.extend(wrap[1])
        self._store(fresh, hits, sum(len(ids_i) for *_, ids_i in fresh))
        return self._checked(text, add_special_tokens, out)

    def cached(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """The ids if every segment of ``text`` is cached (no tokenizer call, so cheap enough for
        the event loop whatever the size), else None."""
        wrap = self._wrapping(add_special_tokens)
        if wrap is None:
            return None
        out: list[int] = list(wrap[0])
        with self._lock:
            hits, misses = self._lookup(self._plan(text), out)
            if misses:
                return None
            self.hit_tokens += hits
        out.extend(wrap[1])
        return out

    def _whole(self, text: str, add_special_tokens: bool, wrap: tuple[list[int], list[int]]) -> list[int]:
        """Text with no cut point: one lookup, or one encode (post-processor included) on a miss."""
        table = self._tables[True]
        with self._lock:
            ids = table.get(text)
            if ids is not None:
                table.move_to_end(text)
                self.hit_tokens += len(ids)
        if ids is not None:  # the tokenizer's own ids for this very text: nothing to check
            out = ids.tolist()
            return [*wrap[0], *out, *wrap[1]] if wrap[0] or wrap[1] else out
        out = self._encode([text], add_special_tokens)[0]
        pre, post = len(wrap[0]), len(wrap[1])
        if out[:pre] != wrap[0] or out[len(out) - post :] != wrap[1]:
            return self._give_up(text, add_special_tokens, "the post-processor added something else", out)
        core = out[pre : len(out) - post]
        h = hash(text)
        with self._lock:
            admit = h in self._seen
            if admit:
                self._seen.discard(h)
            else:
                if len(self._seen) >= self.DOORKEEPER:
                    self._seen.clear()
                self._seen.add(h)
        self._store([(text, True, core)] if admit else [], 0, len(core))
        return out

    def _checked(self, text: str, add_special_tokens: bool, out: list[int]) -> list[int]:
        """``out``, compared with a whole-text encode once every ``verify_every`` results."""
        if self.verify_every:
            self._assembled += 1
            if self._assembled % self.verify_every == 0:
                whole = self._encode([text], add_special_tokens)[0]
                if whole != out:
                    return self._give_up(text, add_special_tokens, "an assembled result differed", whole)
        return out

    def _plan(self, text: str) -> list[tuple[str, bool, str, int]]:
        """The text as (segment, starts the text, added token before it, id of the added token
        after it or -1)."""
        parts = self._split.split(text) if self._split else [text]  # [text, token, ..., text]
        if len(parts) == 1:
            return [(text, True, "", -1)]
        cut, ids = self._cut, self._ids
        plan: list[tuple[str, bool, str, int]] = []
        seg = parts[0]
        first = True
        before = ""
        for i in range(1, len(parts), 2):
            tok = parts[i]
            if tok in cut:
                plan.append((seg, first, before, ids[tok]))
                seg, first, before = parts[i + 1], False, tok
            else:
                seg += tok + parts[i + 1]  # the tokenizer extracts it inside its segment
        plan.append((seg, first, before, -1))
        return plan

    def _cost(self, seg: str, n_ids: int) -> int:
        return self.ENTRY_OVERHEAD + 4 * n_ids + (len(seg) if seg.isascii() else 4 * len(seg))

    def _store(self, fresh: list[tuple[str, bool, list[int]]], hits: int, misses: int) -> None:
        with self._lock:
            self.hit_tokens += hits
            self.miss_tokens += misses
            for seg, first, ids in fresh:
                table = self._tables[first]
                cost = self._cost(seg, len(ids))
                if seg in table or cost > self.max_bytes:
                    continue
                table[seg] = array("i", ids)
                self.bytes += cost
            while self.bytes > self.max_bytes:
                # no recency order across the two tables: the larger one gives up its oldest
                rest, head = self._tables
                table = head if len(head) > len(rest) else rest
                old_seg, old = table.popitem(last=False)
                self.bytes -= self._cost(old_seg, len(old))

    def _give_up(
        self, text: str, add_special_tokens: bool, why: str, whole: list[int] | None = None
    ) -> list[int]:
        """Switch the cache off for good and answer with a whole-text encode."""
        self.mismatches += 1
        self.enabled = False
        with self._lock:
            for table in self._tables:
                table.clear()
            self._seen.clear()
            self.bytes = 0
        log.error(
            "segment token cache disabled: %s (text of %d chars); every prompt is now tokenized whole",
            why,
            len(text),
        )
        return whole if whole is not None else self._encode([text], add_special_tokens)[0]

    def __len__(self) -> int:
        return len(self._tables[0]) + len(self._tables[1])
