"""Loaders for the public prefix-sharing traces in ``../shared/data/traces`` beside the repository
(read in place, never copied).

Formats (details and statistics in that directory's README.md):

* **Mooncake FAST'25** (``*.jsonl.gz``): one request per line, ``timestamp`` in ms, ``input_length``,
  ``output_length`` and ``hash_ids``, one id per 512-token block (the last block partial), chained
  (an id implies its whole prefix). Arrival = ``timestamp / 1000`` seconds.
* **kv-cache-tester agentic coding sessions** (``*.tar.gz`` of per-session JSON): block size 64,
  ``hash_ids`` cover full blocks only (``len == in // 64``), ids are local to a file (subagents share
  their parent's ids), subagents nest their own ``requests`` with ``t`` relative to the subagent's
  start. Sessions carry no absolute start, so we choose one: sessions start as a Poisson process of
  ``session_rate`` per second in file order (seeded), every request at ``start + t`` (a subagent's at
  ``start + t_subagent + t``). Idle gaps longer than ``max_gap_s`` between consecutive requests of
  one timeline are shortened to ``max_gap_s`` (sessions span up to days; a user returning after a
  break finds a cold cache anyway, so a long gap and ``max_gap_s`` behave alike for the cache,
  and replays stay short). Requests of different models are routed as if to one fleet.

**Ids to tokens.** Trace block ``h`` of namespace ``ns`` (0 for a Mooncake file, the session's file
index for kv-cache-tester) becomes a fixed pseudo-random sequence of ``tokens_per_block`` token ids
(:class:`sim.workload.TracePrompt`), so equal ids give equal tokens and therefore equal router keys
and equal engine block hashes; different ids give different tokens. ``tokens_per_block`` defaults to
the trace's own block size (512 or 64 tokens, exact); a smaller value scales every prompt down by
``scale = trace_block_size / tokens_per_block`` to keep long traces fast. A partial last Mooncake
block keeps ``ceil(rest * tokens_per_block / trace_block_size)`` of its tokens; the text after the
last full kv-cache-tester block (``in % 64`` tokens, scaled likewise) is private to its request.
When scaling, simulate with ``token_scale = scale`` (sim.offline) so that prefill time per
simulated token stands for ``scale`` real tokens; output lengths are not scaled.

**Bound.** :func:`infinite_hit_ratio` is the share of trace blocks whose id was seen in an earlier
request (one infinite cache, requests in arrival order): 0.366 (conversation), 0.640 (synthetic),
0.963 (all 710 sessions) per the README, a check that a loader read every block.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import random
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sim.workload import Request, TracePrompt

DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
"""``../shared/data/traces`` beside the repository (this file is ``<repo>/sim/traces.py``)."""
TRACE_FILES = {
    "conversation": "mooncake_fast25_conversation_trace.jsonl.gz",
    "synthetic": "mooncake_fast25_synthetic_trace.jsonl.gz",
    "sessions": (
        "kv_cache_tester_claude_code_traces_part1.tar.gz,kv_cache_tester_claude_code_traces_part2.tar.gz"
    ),
}
"""Short names for the shared trace files (``sessions`` = both kv-cache-tester archives)."""

README_BOUNDS = {"conversation": 0.3664, "synthetic": 0.6396, "sessions": 0.9634}
"""Infinite-cache block-hit bounds published in the traces README (all requests / all 710 sessions)."""


def trace_dir() -> Path:
    """Where the shared traces live: ``$KVROUTER_TRACE_DIR``, else ``../shared/data/traces`` beside
    the repository (a checkout or an editable install; an installed package needs the variable)."""
    return Path(os.environ.get("KVROUTER_TRACE_DIR", str(DEFAULT_TRACE_DIR)))


@dataclass
class Trace:
    """A loaded trace: requests in arrival order plus what is needed to interpret them."""

    name: str
    kind: Literal["mooncake", "sessions"]
    trace_block_size: int
    tokens_per_block: int
    requests: list[Request]
    sources: list[str] = field(default_factory=list)
    sessions: int = 0

    @property
    def scale(self) -> float:
        """Real tokens per simulated token (1 when blocks are not scaled down)."""
        return self.trace_block_size / self.tokens_per_block

    def infinite_hit_ratio(self) -> float:
        """Block-level infinite-cache bound of the loaded requests (see the module docstring)."""
        return infinite_hit_ratio(self.requests)


def infinite_hit_ratio(requests: Sequence[Request]) -> float:
    """Share of trace blocks whose (namespace, id) appeared in an earlier request.

    Computed as ``1 - distinct / total``: every occurrence of an id but its first was seen before,
    which equals the per-request definition as long as no id repeats inside one request (true of
    chained prefix ids; checked against the README's figures for all three traces).
    """
    parts = [
        r.trace.hash_ids + (np.int64(r.trace.namespace) << np.int64(32))
        for r in requests
        if r.trace is not None
    ]
    if not parts:
        return 0.0
    keys = np.concatenate(parts)
    if not len(keys):
        return 0.0
    return 1.0 - len(np.unique(keys)) / len(keys)


def _scaled(tokens: int, trace_block_size: int, tokens_per_block: int) -> int:
    return math.ceil(tokens * tokens_per_block / trace_block_size)


# ---- Mooncake ----------------------------------------------------------------------------------------


def load_mooncake(
    path: str | Path,
    *,
    tokens_per_block: int | None = None,
    limit: int | None = None,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
    vocab: tuple[int, int] = (5, 2048),
    trace_block_size: int = 512,
) -> Trace:
    """A Mooncake FAST'25 ``.jsonl(.gz)`` trace (first ``limit`` lines); ``max_input_tokens`` (real
    tokens) drops the trailing blocks of longer prompts."""
    path = Path(path)
    tpb = tokens_per_block or trace_block_size
    opener = gzip.open if path.suffix == ".gz" else open
    requests: list[Request] = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = np.asarray(rec["hash_ids"], dtype=np.int64)
            n_in = int(rec["input_length"])
            if not len(ids) or n_in <= 0:
                continue
            if max_input_tokens is not None and n_in > max_input_tokens:
                ids = ids[: max(1, max_input_tokens // trace_block_size)]
                n_in = len(ids) * trace_block_size
            rest = n_in - (len(ids) - 1) * trace_block_size
            n_tokens = (len(ids) - 1) * tpb + max(
                1, _scaled(min(rest, trace_block_size), trace_block_size, tpb)
            )
            out = max(1, int(rec.get("output_length", 1)))
            if max_output_tokens is not None:
                out = min(out, max_output_tokens)
            requests.append(
                Request(
                    at_s=float(rec["timestamp"]) / 1000.0,
                    session=f"r{i}",
                    max_tokens=out,
                    kind="trace",
                    trace=TracePrompt(0, ids, n_tokens, tpb, vocab_lo=vocab[0], vocab_hi=vocab[1]),
                )
            )
    requests.sort(key=lambda r: r.at_s)  # stable: file order among equal timestamps
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return Trace(name, "mooncake", trace_block_size, tpb, requests, [str(path)], len(requests))


# ---- kv-cache-tester sessions ------------------------------------------------------------------------


def iter_session_files(paths: Sequence[str | Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(member name, parsed JSON) of every session file in the archives, sorted by name per archive."""
    for p in paths:
        p = Path(p)
        if p.suffix == ".json":
            yield p.name, json.loads(p.read_text(encoding="utf-8"))
            continue
        with tarfile.open(p, "r:*") as tf:
            members = sorted(
                (m for m in tf.getmembers() if m.isfile() and m.name.endswith(".json")), key=lambda m: m.name
            )
            for m in members:
                fh = tf.extractfile(m)
                if fh is None:
                    continue
                with fh:
                    yield m.name, json.load(fh)


def _flatten(
    entries: Sequence[dict[str, Any]],
    start: float,
    max_gap_s: float | None,
    out: list[tuple[float, dict[str, Any]]],
) -> None:
    """Absolute (clamped) times of a timeline's requests, recursing into subagents."""
    last_t = 0.0
    clock = start
    for e in entries:
        t = float(e.get("t", 0.0))
        gap = max(0.0, t - last_t)
        if max_gap_s is not None:
            gap = min(gap, max_gap_s)
        clock += gap
        last_t = max(last_t, t)
        if e.get("type") == "subagent":
            _flatten(e.get("requests", []), clock, max_gap_s, out)
        else:
            out.append((clock, e))


def load_sessions(
    paths: Sequence[str | Path],
    *,
    tokens_per_block: int | None = None,
    max_sessions: int | None = None,
    limit: int | None = None,
    session_rate: float = 0.05,
    max_gap_s: float | None = 60.0,
    seed: int = 0,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
    vocab: tuple[int, int] = (5, 2048),
) -> Trace:
    """kv-cache-tester sessions from ``.tar.gz`` archives (or ``.json`` files), see the module docstring.

    ``max_sessions`` reads only that many files; ``limit`` keeps the first requests by arrival;
    ``max_input_tokens`` (real tokens) drops the trailing blocks of longer prompts.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    trace_bs = 64
    tpb = tokens_per_block or trace_bs
    start = 0.0
    sessions = 0
    for ns, (name, doc) in enumerate(iter_session_files(paths)):
        if max_sessions is not None and ns >= max_sessions:
            break
        bs = int(doc.get("block_size", trace_bs))
        if bs != trace_bs:
            raise ValueError(f"{name}: block_size {bs}, expected {trace_bs}")
        if sessions:
            start += rng.expovariate(session_rate) if session_rate > 0 else 0.0
        sessions += 1
        flat: list[tuple[float, dict[str, Any]]] = []
        _flatten(doc.get("requests", []), start, max_gap_s, flat)
        sid = str(doc.get("id", name))
        for k, (at, e) in enumerate(flat):
            ids = np.asarray(e.get("hash_ids", []), dtype=np.int64)
            n_in = int(e.get("in", len(ids) * bs))
            if max_input_tokens is not None and n_in > max_input_tokens:
                ids = ids[: max_input_tokens // bs]
                n_in = max_input_tokens
            rest = max(0, n_in - len(ids) * bs)
            tail = _scaled(rest, bs, tpb) if rest else 0
            if not len(ids) and not tail:
                tail = 1
            digest = hashlib.blake2b(f"{ns}/{k}".encode(), digest_size=8).digest()
            out = max(1, int(e.get("out", 1)))
            if max_output_tokens is not None:
                out = min(out, max_output_tokens)
            requests.append(
                Request(
                    at_s=at,
                    session=sid,
                    max_tokens=out,
                    turn=k,
                    kind="trace",
                    trace=TracePrompt(
                        ns,
                        ids,
                        len(ids) * tpb,
                        tpb,
                        tail_tokens=tail,
                        tail_seed=int.from_bytes(digest, "little") | 1,
                        vocab_lo=vocab[0],
                        vocab_hi=vocab[1],
                    ),
                )
            )
    requests.sort(key=lambda r: r.at_s)
    if limit is not None:
        requests = requests[:limit]
    return Trace(
        "kv-cache-tester-sessions", "sessions", trace_bs, tpb, requests, [str(p) for p in paths], sessions
    )


# ---- dispatch ----------------------------------------------------------------------------------------


def resolve(name_or_path: str) -> list[Path]:
    """Files of a short trace name (conversation | synthetic | sessions) or a path as given."""
    if name_or_path in TRACE_FILES:
        return [trace_dir() / f for f in TRACE_FILES[name_or_path].split(",")]
    return [Path(p) for p in name_or_path.split(",")]


def load_trace(
    name_or_path: str,
    *,
    tokens_per_block: int | None = None,
    limit: int | None = None,
    max_sessions: int | None = None,
    session_rate: float = 0.05,
    max_gap_s: float | None = 60.0,
    seed: int = 0,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
) -> Trace:
    """Load a trace by short name or path(s), choosing the format from the file name."""
    paths = resolve(name_or_path)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"trace file(s) not found: {', '.join(missing)}")
    if all(p.name.endswith((".tar.gz", ".tgz", ".tar", ".json")) for p in paths):
        trace = load_sessions(
            paths,
            tokens_per_block=tokens_per_block,
            max_sessions=max_sessions,
            limit=limit,
            session_rate=session_rate,
            max_gap_s=max_gap_s,
            seed=seed,
            max_output_tokens=max_output_tokens,
            max_input_tokens=max_input_tokens,
        )
    elif len(paths) == 1:
        trace = load_mooncake(
            paths[0],
            tokens_per_block=tokens_per_block,
            limit=limit,
            max_output_tokens=max_output_tokens,
            max_input_tokens=max_input_tokens,
        )
    else:
        raise ValueError("give one Mooncake .jsonl(.gz) file or kv-cache-tester .tar.gz/.json files")
    if name_or_path in TRACE_FILES:
        trace.name = name_or_path
    return trace
