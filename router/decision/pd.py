"""The two-pool decision of prefill/decode disaggregation: which decode engine, which prefill engine,
and whether the prefill leg runs at all.

A model is *disaggregated* when the engines that may take it now include at least one ``prefill``
engine and at least one engine that decodes (``decode`` or ``both``). Then, in this order:

1. **Decode target first**, by ``[policy]`` over the decode pool (``decode`` and ``both`` engines):
   its own cached prefix counts (what it holds need not be transferred, and enough of it makes the
   prefill leg unnecessary), and its load.
2. **Skip the prefill leg** (the decode target prefills the prompt itself) when
   - ``cached``: the decode target caches all but fewer than ``pd.min_uncached_tokens`` of the
     prompt's tokens (a follow-up turn of a conversation it served; blocks only predicted by a
     recent decision do not count), or
   - ``saturated``: every prefill engine already has ``pd.max_prefill_queue_tokens`` uncached prompt
     tokens queued (when that limit is set), or
   - ``no_prefill``: no prefill engine may take requests right now (all down or draining).
3. **Prefill target**, by ``pd.prefill_policy`` (with ``[policy]``'s weights) over the prefill pool:
   its longest cached prefix saves prefill compute, its queued prefill work costs. Scored even when
   the leg is skipped, so ``/route`` shows every candidate of both pools.

What ``both`` engines do in a disaggregated model: they are decode-pool members (they take a decode
leg, or the whole request when the prefill leg is skipped), never prefill targets. An operator marks
engines ``prefill`` to dedicate them to prompts; an engine left as ``both`` is an ordinary engine
that serves requests start to end (with NIXL configured it also accepts a decode leg; without it,
vLLM ignores the transfer parameters and computes the prefill itself, which is still correct). A
model whose only decoding engines are unavailable is served whole by its prefill engines
(``no_decode``): slower, but no request fails for it.

Pure (no I/O), like :mod:`router.decision.policy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from index.kvindex import PREDICTED
from router.decision.policy import Candidate, CandidateScore, Decision, Policy, PolicyConfig
from router.fleet.load import Target
from router.pd.config import PDConfig

Mode = Literal["disaggregated", "skipped"]
SkipReason = Literal["cached", "saturated", "no_prefill", "no_decode"]
SKIP_REASONS: tuple[SkipReason, ...] = ("cached", "saturated", "no_prefill", "no_decode")


class PDPlan(msgspec.Struct):
    """The prefill/decode part of a decision: the prefill choice and whether the leg runs."""

    mode: Mode
    """disaggregated: a prefill leg, then the decode leg; skipped: the decode target does it all."""
    reason: str
    """Why, in words (``/route``, the dashboard)."""
    skip: SkipReason | None
    """The machine-readable skip reason (the metrics' ``reason`` label); None when disaggregated."""
    connector: str
    prefill_policy: str
    decode_uncached_tokens: int | None
    """Prompt tokens the decode target does not cache (None: the prompt could not be tokenized)."""
    min_uncached_tokens: int
    prefill_queue_tokens: int | None
    """Uncached prompt tokens queued on the least-loaded prefill engine (None: no prefill engine)."""
    max_prefill_queue_tokens: int
    prefill_backend: str | None = None
    prefill_dp_rank: int | None = None
    prefill_outcome: str | None = None
    prefill_matched_blocks: int = 0
    prefill_uncached_tokens: int = 0
    """Prompt tokens the prefill target must compute (its pending work while the leg runs)."""
    prefill_candidates: list[CandidateScore] = []
    prefill_status: str = ""
    """Set by the proxy: ``ok`` (transfer parameters obtained), ``fallback: <why>`` (the decode
    target computed the prefill), ``error <status>`` (the prefill leg's 4xx went to the client);
    empty in ``/route`` and for skipped legs."""

    @property
    def two_legs(self) -> bool:
        """Whether a prefill leg is sent."""
        return self.mode == "disaggregated"

    @property
    def prefill_target(self) -> Target | None:
        """(backend, DP rank) of the prefill leg, if it runs."""
        if self.prefill_backend is None or self.prefill_dp_rank is None or not self.two_legs:
            return None
        return self.prefill_backend, self.prefill_dp_rank

    def explain(self) -> None:
        """(The prefill candidates carry their reasons from the decision's record already.)"""


class PDPlanner:
    """Splits candidates into pools and makes the prefill choice; keeps the prefill policy's state."""

    def __init__(self, config: PDConfig, policy: PolicyConfig, prefill_policy: Policy | None = None) -> None:
        self.config = config
        self.prefill_policy = prefill_policy or Policy(
            msgspec.structs.replace(policy, name=config.prefill_policy)
        )

    def choose(
        self,
        decode_policy: Policy,
        prompt_tokens: int,
        prompt_blocks: int,
        block_size: int,
        prefill: Sequence[Candidate],
        decode: Sequence[Candidate],
        *,
        have_prompt: bool,
        dry_run: bool = False,
    ) -> tuple[Decision, PDPlan]:
        """Choose the decode target (the request's main target) and plan the prefill leg.

        ``prefill`` and ``decode`` are the two pools' candidates; at least one of them is non-empty."""
        cfg = self.config
        queue = min((c.load.pending_prefill_tokens for c in prefill), default=None)
        if not decode:
            decision = decode_policy.choose(
                prompt_blocks, block_size, prefill, have_prompt=have_prompt, dry_run=dry_run
            )
            plan = self._plan(
                "skipped",
                "no_decode",
                "no engine that decodes is available: a prefill engine serves the request whole",
                None,
                queue,
            )
            return decision, plan
        decision = decode_policy.choose(
            prompt_blocks, block_size, decode, have_prompt=have_prompt, dry_run=dry_run
        )
        chosen = next(c for c in decode if (c.backend, c.dp_rank) == (decision.backend, decision.dp_rank))
        # predicted blocks are a guess about a request still in flight: only confirmed residencies
        # count, or a burst of one new prompt would skip its prefill legs on a decode engine that
        # does not hold the prompt yet
        held = chosen.matched_blocks - chosen.blocks_by_medium.get(PREDICTED, 0)
        uncached = max(prompt_tokens - held * block_size, 0) if have_prompt else None
        skip: SkipReason | None = None
        why = ""
        if not prefill:
            skip, why = "no_prefill", "no prefill engine is available: the decode target prefills itself"
        elif uncached is not None and uncached < cfg.min_uncached_tokens:
            skip = "cached"
            why = (
                f"the decode target caches all but {uncached} of the prompt's {prompt_tokens} tokens "
                f"(< pd.min_uncached_tokens = {cfg.min_uncached_tokens}): it prefills them itself"
            )
        elif cfg.max_prefill_queue_tokens > 0 and queue is not None and queue >= cfg.max_prefill_queue_tokens:
            skip = "saturated"
            why = (
                f"the prefill pool is saturated: its least-loaded engine has {queue} prompt tokens queued "
                f"(>= pd.max_prefill_queue_tokens = {cfg.max_prefill_queue_tokens})"
            )
        else:
            why = (
                f"the decode target lacks {uncached} of the prompt's {prompt_tokens} tokens: a prefill "
                "engine computes them and the decode engine pulls the blocks"
                if uncached is not None
                else "the prompt could not be tokenized: disaggregated by default"
            )
        plan = self._plan("skipped" if skip else "disaggregated", skip, why, uncached, queue)
        if prefill:
            pre = self.prefill_policy.choose(
                prompt_blocks,
                block_size,
                prefill,
                have_prompt=have_prompt,
                dry_run=dry_run or skip is not None,
            )
            best = next(c for c in prefill if (c.backend, c.dp_rank) == (pre.backend, pre.dp_rank))
            plan.prefill_backend = pre.backend
            plan.prefill_dp_rank = pre.dp_rank
            plan.prefill_outcome = pre.outcome
            plan.prefill_candidates = pre.scored.scores(pre.outcome) if pre.scored else pre.candidates
            plan.prefill_matched_blocks = best.matched_blocks
            plan.prefill_uncached_tokens = max(prompt_tokens - best.matched_blocks * block_size, 0)
        return decision, plan

    def _plan(
        self, mode: Mode, skip: SkipReason | None, reason: str, uncached: int | None, queue: int | None
    ) -> PDPlan:
        cfg = self.config
        return PDPlan(
            mode=mode,
            reason=reason,
            skip=skip,
            connector=cfg.connector,
            prefill_policy=cfg.prefill_policy,
            decode_uncached_tokens=uncached,
            min_uncached_tokens=cfg.min_uncached_tokens,
            prefill_queue_tokens=queue,
            max_prefill_queue_tokens=cfg.max_prefill_queue_tokens,
        )


__all__ = ["SKIP_REASONS", "Mode", "PDPlan", "PDPlanner", "SkipReason"]
