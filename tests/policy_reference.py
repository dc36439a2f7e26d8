"""The routing policy written in plain Python, for the tests only: what router/decision/_kernel.c
must compute (tests/router/decision/test_explain_kernel.py compares the two over random
fleets). The router itself never runs this."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

import msgspec

from router.decision.policy import Candidate, PolicyConfig
from router.decision.record import CandidateScore


class Decision(msgspec.Struct):
    """The chosen target, how it was chosen (outcome) and every candidate's score."""

    backend: str
    dp_rank: int
    outcome: Literal["prefix", "load", "fallback"]
    """prefix: a cached prefix decided it; load: load alone did; fallback: no prompt keys (load only)."""
    candidates: list[CandidateScore]


class ReferencePolicy:
    """The policy written in plain Python: what the kernel must compute."""

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = rng or random.Random()
        self._turn = 0

    def _next_turn(self) -> int:
        turn = self._turn
        self._turn += 1
        return turn

    def spread(self, candidates: Sequence[Candidate], block_size: int, count: float, per: float) -> None:
        """router/cluster/unseen.py's placement of assumed requests, as it was written in Python."""
        if count <= 0 or len(candidates) < 2:
            return
        terms = [self.load_terms(c, block_size) for c in candidates]
        left = count
        while left > 1e-9:
            w = min(left, 1.0)
            i = min(range(len(candidates)), key=terms.__getitem__)
            terms[i] += per * w
            candidates[i].assumed_blocks += per * w
            left -= w

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
