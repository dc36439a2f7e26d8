"""The kv policy's terms, against the rule written out plainly: the credit is what a candidate's
cached prefix saves (per medium: GPU, CPU, STORAGE, PREDICTED), 0 below the minimum match (in blocks
and as a share of the prompt); predicted blocks also come off the queue they are part of."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.decision.policy import Candidate, Policy, PolicyConfig
from router.fleet.load import TargetLoad

MEDIA = ("GPU", "CPU", "STORAGE", "PREDICTED", "DISK")  # (DISK: a medium the policy gives nothing)


def _credit(cfg: PolicyConfig, c: Candidate, prompt_blocks: int) -> float:
    if c.matched_blocks < max(cfg.min_match_blocks, 1):
        return 0.0
    if prompt_blocks and c.matched_blocks < cfg.min_match_ratio * prompt_blocks:
        return 0.0
    by = c.blocks_by_medium
    return (
        cfg.gpu_credit * by.get("GPU", 0)
        + cfg.cpu_credit * by.get("CPU", 0)
        + cfg.storage_credit * by.get("STORAGE", 0)
        + cfg.predicted_credit * by.get("PREDICTED", 0)
    )


candidates = st.lists(
    st.builds(
        lambda media, pending, active, waiting, assumed, rank: (
            media,
            pending,
            active,
            waiting,
            assumed,
            rank,
        ),
        st.dictionaries(st.sampled_from(MEDIA), st.integers(0, 300), max_size=4),
        st.integers(0, 5000),
        st.integers(0, 20),
        st.sampled_from([0.0, 1.0, 2.5]),
        st.sampled_from([0.0, 0.5, 3.0]),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    candidates,
    st.integers(0, 400),
    st.sampled_from([16, 32]),
    st.integers(0, 8),
    st.sampled_from([0.0, 0.25, 0.9]),
    st.sampled_from([0.0, 0.5, 0.8]),
    st.sampled_from([0.25, 1.0]),
)
def test_terms_follow_the_rule(
    raw: list, prompt_blocks: int, block_size: int, min_blocks: int, min_ratio: float, cpu: float, lw: float
) -> None:
    cfg = PolicyConfig(min_match_blocks=min_blocks, min_match_ratio=min_ratio, cpu_credit=cpu, load_weight=lw)
    cands = [
        Candidate(
            f"b{i}", rank, sum(media.values()), media, TargetLoad(active, 0, pending, 0, waiting), assumed
        )
        for i, (media, pending, active, waiting, assumed, rank) in enumerate(raw)
    ]
    decision = Policy(cfg).choose(prompt_blocks, block_size, cands)
    assert sum(s.chosen for s in decision.candidates) == 1
    for c, s in zip(cands, decision.candidates, strict=True):
        credit = _credit(cfg, c, prompt_blocks) if c.matched_blocks else 0.0
        assert s.credit_blocks == credit
        assert s.prefill_blocks == max(prompt_blocks - credit, 0.0)
        queued = c.load.pending_prefill_tokens / block_size
        if credit:
            queued = max(queued - c.blocks_by_medium.get("PREDICTED", 0), 0.0)
        assert s.queued_blocks == queued
        cost = s.prefill_blocks + lw * (queued + cfg.decode_weight * c.load.active + c.assumed_blocks)
        assert s.score == (round(cost, 3) if cost % 1 else cost)
    best = min(s.score for s in decision.candidates)
    assert next(s for s in decision.candidates if s.chosen).score == best
