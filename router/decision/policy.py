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
the same code. The arithmetic and the choice run in one compiled pass (router/decision/_kernel.c,
no Python object per candidate), which :meth:`Policy.decide` feeds from compact per-candidate
lists; :meth:`Policy.choose` takes :class:`Candidate` objects for callers that have them. The same
rules written in plain Python live in the tests only (tests/policy_reference.py), which compare the
two over random fleets. Defaults and the measurements behind them are in the README.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

import msgspec

from router.decision import _kernel
from router.decision.record import CandidateScore, Decision, Inputs, Scored
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


_KINDS: dict[str, int] = {"kv": 0, "round_robin": 1, "least_loaded": 2, "random": 3}


class Policy:
    """Scores candidates and picks one; keeps round-robin state and an RNG."""

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = rng or random.Random()
        self._turn = 0
        self._params_for: PolicyConfig | None = None
        self._params: tuple[float | int, ...] = ()

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

    def decide(
        self,
        inputs: Inputs,
        prompt_blocks: int,
        block_size: int,
        matched: list[int],
        loads: list[TargetLoad],
        *,
        media: list[dict[str, int] | None] | None = None,
        offs: list[list[int] | None] | None = None,
        have_prompt: bool = True,
        dry_run: bool = False,
        assumed: list[float] | None = None,
        spread: tuple[float, float] | None = None,
        extra: bytearray | None = None,
    ) -> Decision:
        """THE decision over ``inputs``' candidates (one compiled pass: see the module docstring):
        ``matched[i]`` blocks of the prompt cached on candidate i, by medium in ``media[i]`` (a
        dict) or ``offs[i]`` (the index's per-medium counts off GPU, named by
        ``inputs.medium_names``), else all on GPU; ``loads[i]`` its load record; ``assumed[i]``
        load assumed on it; ``spread``: (count, blocks each) of other replicas' unseen decisions
        to place on the least loaded first; ``extra``: other routers' figures added to the load
        records' (three int64 per candidate: active, prefilling, pending prefill tokens), as
        :func:`router.decision._kernel.gather` writes them."""
        if not matched:
            raise ValueError("no candidates")
        cfg = self.config
        if self._params_for is not cfg:
            self._params_for = cfg
            self._params = (
                _KINDS[cfg.name],
                cfg.gpu_credit,
                cfg.cpu_credit,
                cfg.storage_credit,
                cfg.predicted_credit,
                cfg.min_match_blocks,
                cfg.min_match_ratio,
                cfg.load_weight,
                cfg.decode_weight,
                cfg.waiting_weight,
                cfg.temperature,
            )
        order: list[int] | None = None
        turn = 0
        if cfg.name == "round_robin":
            order = inputs.order()
            turn = self._turn if dry_run else self._next_turn()
        record, best, prefix, inflight = _kernel.score(
            (prompt_blocks, block_size, *self._params),
            matched,
            media,
            offs,
            inputs.roles,
            loads,
            assumed,
            spread,
            self.rng,
            order,
            turn,
            extra,
        )
        outcome: Literal["prefix", "load", "fallback"]
        outcome = "fallback" if not have_prompt else "prefix" if prefix else "load"
        scored = Scored(inputs, record, best, inflight, cfg.name, media, offs)
        backend, rank = inputs.targets[best]
        return Decision(backend, rank, outcome, scored=scored)

    def choose(
        self,
        prompt_blocks: int,
        block_size: int,
        candidates: Sequence[Candidate],
        have_prompt: bool = True,
        dry_run: bool = False,
    ) -> Decision:
        """Pick a target among ``candidates`` (non-empty) for a prompt of ``prompt_blocks`` blocks:
        :meth:`decide` over :class:`Candidate` objects (each one's ``blocks_by_medium`` is the
        scores' too: shared, not copied)."""
        if not candidates:
            raise ValueError("no candidates")
        inputs = Inputs([(c.backend, c.dp_rank) for c in candidates])
        assumed = [c.assumed_blocks for c in candidates]
        return self.decide(
            inputs,
            prompt_blocks,
            block_size,
            [c.matched_blocks for c in candidates],
            [c.load for c in candidates],
            media=[c.blocks_by_medium for c in candidates],
            have_prompt=have_prompt,
            dry_run=dry_run,
            assumed=assumed if any(assumed) else None,
        )


__all__ = ["POLICIES", "Candidate", "CandidateScore", "Decision", "Policy", "PolicyConfig", "PolicyName"]
