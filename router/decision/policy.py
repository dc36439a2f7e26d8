"""Routing policies: which (backend, DP rank) gets a request, and why.

The KV-aware policy estimates, for each candidate, the prefill work a request would wait behind plus
the prefill work it would cause, in blocks, and picks the cheapest:

    credit   = gpu_credit*GPU + cpu_credit*CPU + storage_credit*STORAGE + predicted_credit*PREDICTED
               (matched prefix blocks by medium; 0 when the match is below the minimum-match threshold)
    prefill  = max(prompt_blocks - credit, 0)                       # work this request causes
    queued   = pending uncached prompt tokens in flight / block_size # work it waits behind
               - PREDICTED blocks (in-flight prefill of this same prefix is not extra waiting)
    cost     = prefill + load_weight * (queued + decode_weight * active + waiting_weight * engine_waiting
                                        + assumed)

Lowest cost wins; exact ties break randomly; with ``temperature > 0`` the choice is sampled with
p ~ exp(-(cost - min) / ((max - min) * temperature)). Because the cost of a cached prefix and the
cost of queueing are in the same unit (blocks of prefill), a hot prefix attracts traffic only until
the queue it builds costs more than recomputing the prefix elsewhere: no hot-spotting knob beyond
``load_weight``. The minimum-match threshold keeps a short shared prefix (a common system prompt)
from counting at all, so those requests are placed by load alone. ``assumed`` is load this router
cannot see yet but expects: the decisions other router replicas are making at the same moment
(router/cluster/unseen.py); 0 for a router alone.

The module is pure (no I/O): the router, the simulated fleet and the offline trace simulator all use
the same code. Defaults and the measurements behind them are in the README.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

import msgspec

from router.fleet.load import TargetLoad

PolicyName = Literal["kv", "round_robin", "least_loaded", "random"]
POLICIES: tuple[PolicyName, ...] = ("kv", "round_robin", "least_loaded", "random")


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Policy choice and weights (the README's configuration table mirrors these defaults)."""

    name: PolicyName = "kv"
    """kv | round_robin | least_loaded | random."""
    gpu_credit: float = 1.0
    """Prefill blocks saved per matched block cached on GPU."""
    cpu_credit: float = 0.75
    """Per matched block only in the CPU offload tier (it must be copied back first)."""
    storage_credit: float = 0.25
    """Per matched block only in a storage tier."""
    predicted_credit: float = 1.0
    """Per block predicted on the target by a recent routing decision (predict-on-route)."""
    min_match_blocks: int = 1
    """Matches shorter than this many blocks get no credit."""
    min_match_ratio: float = 0.0
    """Matches covering less than this share of the prompt's blocks get no credit."""
    load_weight: float = 0.25
    """Weight of the load terms against the prefill saved by a cached prefix. 0.25 beat 1.0 on all
    three public traces in hit ratio with equal or better TTFT (trace-driven simulation)."""
    decode_weight: float = 2.0
    """Blocks of cost per request in flight (decode slots, batch share)."""
    waiting_weight: float = 0.0
    """Blocks of cost per request the engine reports waiting (needs metrics scraping)."""
    temperature: float = 0.0
    """0 = always the cheapest; > 0 samples, softening hot-spots at some cost in hit rate."""


class Candidate(msgspec.Struct):
    """One (backend, DP rank) that may serve the request, with what it caches and its load."""

    backend: str
    dp_rank: int
    matched_blocks: int
    blocks_by_medium: dict[str, int]
    load: TargetLoad
    assumed_blocks: float = 0.0
    """Load assumed on top of ``load``, in the policy's load-term units (router/cluster/unseen.py)."""


class CandidateScore(msgspec.Struct):
    """A candidate's terms and verdict, as shown by ``/route``."""

    backend: str
    dp_rank: int
    matched_blocks: int
    blocks_by_medium: dict[str, int]
    credit_blocks: float
    prefill_blocks: float
    queued_blocks: float
    inflight: int
    engine_waiting: float
    score: float
    """The cost; lower is better."""
    chosen: bool = False
    reason: str = ""
    assumed_blocks: float = 0.0
    """Load assumed from other replicas' concurrent decisions (0 for a router alone)."""


class Decision(msgspec.Struct):
    """The chosen target, how it was chosen (outcome) and every candidate's score."""

    backend: str
    dp_rank: int
    outcome: Literal["prefix", "load", "fallback"]
    """prefix: a cached prefix decided it; load: load alone did; fallback: no prompt keys (load only)."""
    candidates: list[CandidateScore]


class Policy:
    """Scores candidates and picks one; keeps round-robin state and an RNG."""

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = rng or random.Random()
        self._turn = 0

    def _next_turn(self) -> int:
        turn = self._turn
        self._turn += 1
        return turn

    def load_terms(self, c: Candidate, block_size: int) -> float:
        """The load part of a candidate's cost before ``load_weight`` (the prefix credit aside)."""
        cfg = self.config
        return (
            c.load.pending_prefill_tokens / max(block_size, 1)
            + cfg.decode_weight * c.load.active
            + cfg.waiting_weight * c.load.engine_waiting
            + c.assumed_blocks
        )

    def choose(
        self,
        prompt_blocks: int,
        block_size: int,
        candidates: Sequence[Candidate],
        have_prompt: bool = True,
        dry_run: bool = False,
    ) -> Decision:
        """Pick a target among ``candidates`` (non-empty) for a prompt of ``prompt_blocks`` blocks."""
        if not candidates:
            raise ValueError("no candidates")
        cfg = self.config
        scores: list[CandidateScore] = []
        append = scores.append
        kv = cfg.name == "kv"
        bs = max(block_size, 1)
        load_weight, decode_weight, waiting_weight = cfg.load_weight, cfg.decode_weight, cfg.waiting_weight
        # the credit: prefill blocks a candidate's cached prefix saves, 0 below the minimum-match
        # thresholds (taken once: a /route over 64 candidates runs this loop 64 times)
        min_blocks = max(cfg.min_match_blocks, 1)
        min_ratio = cfg.min_match_ratio * prompt_blocks if prompt_blocks else 0.0
        gpu, cpu, storage, predicted = (
            cfg.gpu_credit,
            cfg.cpu_credit,
            cfg.storage_credit,
            cfg.predicted_credit,
        )
        for c in candidates:
            load = c.load
            matched = c.matched_blocks
            by = c.blocks_by_medium
            credit = 0.0
            if kv and matched >= min_blocks and matched >= min_ratio:
                credit = (
                    gpu * by.get("GPU", 0)
                    + cpu * by.get("CPU", 0)
                    + storage * by.get("STORAGE", 0)
                    + predicted * by.get("PREDICTED", 0)
                )
            prefill = prompt_blocks - credit if prompt_blocks > credit else 0.0
            pending = load.pending_prefill_tokens
            queued = pending / bs if pending else 0.0
            if credit:
                # predicted blocks are prefill of this very prefix already queued there: waiting for
                # them is not extra work, it is this request's own prefix being computed
                queued = max(queued - by.get("PREDICTED", 0), 0.0)
            active = load.active
            waiting = load.engine_waiting
            assumed = c.assumed_blocks
            cost = prefill + load_weight * (
                queued + decode_weight * active + waiting_weight * waiting + assumed
            )
            append(
                CandidateScore(
                    c.backend,
                    c.dp_rank,
                    matched,
                    by,  # shared, not copied: neither side changes it
                    credit,  # (terms rounded when shown, by explain(); the cost now: ties compare it)
                    prefill,
                    queued,
                    active,
                    waiting,
                    round(cost, 3) if cost % 1 else cost,
                    False,
                    "",
                    assumed,
                )
            )
        chosen = self._pick(scores, candidates, dry_run)
        best = scores[chosen]
        best.chosen = True
        min_credit = min(s.credit_blocks for s in scores)
        outcome: Literal["prefix", "load", "fallback"]
        if not have_prompt:
            outcome = "fallback"
        elif cfg.name == "kv" and best.credit_blocks > 0 and best.credit_blocks > min_credit:
            outcome = "prefix"
        else:
            outcome = "load"
        return Decision(best.backend, best.dp_rank, outcome, scores)

    def _pick(
        self, scores: list[CandidateScore], candidates: Sequence[Candidate], dry_run: bool = False
    ) -> int:
        cfg = self.config
        n = len(scores)
        if cfg.name == "round_robin":
            order = sorted(range(n), key=lambda i: (scores[i].backend, scores[i].dp_rank))
            turn = self._turn if dry_run else self._next_turn()
            return order[turn % n]
        if cfg.name == "random":
            return self.rng.randrange(n)
        if cfg.name == "least_loaded":
            keys = [(c.load.active, c.load.pending_prefill_tokens) for c in candidates]
            low = min(keys)
            return self.rng.choice([i for i in range(n) if keys[i] == low])
        costs = [s.score for s in scores]
        lo, hi = min(costs), max(costs)
        if cfg.temperature > 0 and hi > lo:
            weights = [math.exp(-(c - lo) / ((hi - lo) * cfg.temperature)) for c in costs]
            return self.rng.choices(range(n), weights=weights)[0]
        return self.rng.choice([i for i in range(n) if costs[i] == lo])


def explain(policy: str, scores: list[CandidateScore], outcome: str) -> None:
    """Fill in each candidate's ``reason`` (why it won or lost). Called when a decision is shown
    (``/route``, the dashboard), not when it is made: the proxy never reads the reasons."""
    best = next((s for s in scores if s.chosen), None)
    if best is None:
        return
    for s in scores:  # (whole numbers, most terms, skip round(): a /route may show 64 candidates)
        if s.credit_blocks % 1:
            s.credit_blocks = round(s.credit_blocks, 3)
        if s.prefill_blocks % 1:
            s.prefill_blocks = round(s.prefill_blocks, 3)
        if s.queued_blocks % 1:
            s.queued_blocks = round(s.queued_blocks, 3)
        if s.assumed_blocks % 1:
            s.assumed_blocks = round(s.assumed_blocks, 3)
    for s in scores:
        if policy != "kv":
            s.reason = f"{policy}: chosen" if s.chosen else f"{policy}: not chosen"
            continue
        if s.chosen:
            if outcome == "prefix":
                s.reason = f"lowest cost; cached prefix saves {s.credit_blocks:g} of the prompt's blocks"
            else:
                s.reason = "lowest cost; placed by load"
            continue
        if s.matched_blocks and s.credit_blocks == 0:
            why = f"its {s.matched_blocks}-block match is below the minimum-match threshold"
        elif s.credit_blocks >= best.credit_blocks and s.score > best.score:
            why = (
                f"more cached ({s.credit_blocks:g} blocks) but busier "
                f"(queued {s.queued_blocks:g} blocks, {s.inflight} in flight)"
            )
        elif s.score == best.score:
            why = "tied on cost; lost the random tie-break"
        else:
            why = f"cost {s.score:g} vs {best.score:g}"
        s.reason = why
