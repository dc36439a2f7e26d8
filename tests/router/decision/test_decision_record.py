"""The candidate index of the membership (changes reflected, no scan per decision) and the bounded
record a kept decision holds."""

from __future__ import annotations

import gc
import random

from router.config import BackendConfig, MembershipConfig
from router.decision.policy import Policy, PolicyConfig
from router.decision.record import TOP_K, Inputs
from router.decision.service import Route
from router.fleet.load import TargetLoad
from router.fleet.membership import Membership


def _ready(membership: Membership, names: list[str], models: list[str]) -> None:
    membership.reconcile(
        "config", [BackendConfig(n, f"http://127.0.0.1:1/{n}", models=models) for n in names]
    )
    for m in membership.members.values():
        m.healthy = True
    membership.tick(lambda m: 0, lambda m: True)


def test_the_candidate_index_follows_every_change_that_makes_a_candidate() -> None:
    membership = Membership(MembershipConfig())
    _ready(membership, ["a", "b", "c"], ["m"])
    first = membership.routable_for("m")
    assert [m.name for m in first] == ["a", "b", "c"]
    assert membership.routable_for("m") is first  # (kept: no scan per decision)
    a, b, c = (membership.members[n] for n in "abc")
    b.healthy = False  # a probe's verdict is no membership change, but it changes the candidates
    assert [m.name for m in membership.routable_for("m")] == ["a", "c"]
    b.healthy = True
    assert [m.name for m in membership.routable_for("m")] == ["a", "b", "c"]
    c.models = {"other"}
    assert [m.name for m in membership.routable_for("m")] == ["a", "b"]
    assert [m.name for m in membership.routable_for("other")] == ["c"]
    assert membership.can_serve("other") and not membership.can_serve("nobody")
    a.discovery_ready = False
    assert [m.name for m in membership.routable_for("m")] == ["b"]
    a.discovery_ready = True
    membership.drain("b", remove=False)
    assert [m.name for m in membership.routable_for("m")] == ["a"]
    _ready(membership, ["a", "b", "c", "d"], ["m"])  # b readmitted, d joins
    assert [m.name for m in membership.routable_for("m")] == ["a", "b", "c", "d"]
    membership.remove("d", "test")
    assert [m.name for m in membership.routable_for("m")] == ["a", "b", "c"]
    d_before = membership.routable_for("m")
    a.lora_parents = {"adapter": "m"}
    assert membership.lora_name("adapter") == "adapter" and membership.lora_name("m") is None
    assert membership.routable_for("m") is not d_before  # (any change starts the index over)
    unchanged = membership.routable_for("m")
    a.healthy = True  # the same value: nothing changed
    assert membership.routable_for("m") is unchanged


def test_a_kept_decision_holds_the_chosen_candidate_and_the_lowest_scores_only() -> None:
    n = 1024
    rng = random.Random(3)
    targets = [(f"e{i // 8}", i % 8) for i in range(n)]
    matched = [rng.randrange(0, 60) for _ in range(n)]
    loads = [
        TargetLoad(active=rng.randrange(0, 9), pending_prefill_tokens=rng.randrange(0, 4000))
        for _ in range(n)
    ]
    policy = Policy(PolicyConfig(), random.Random(1))
    decision = policy.decide(Inputs(targets), 64, 16, matched, loads)
    assert decision.scored is not None
    route = Route(
        model="m",
        endpoint="completions",
        backend=decision.backend,
        dp_rank=decision.dp_rank,
        outcome=decision.outcome,
        prompt_tokens=1024,
        prompt_blocks=64,
        block_size=16,
        matched_blocks=matched[decision.scored.best],
        decision=decision,
    )
    shown = route.candidates
    assert len(shown) == n and sum(c.chosen for c in shown) == 1  # /route: every candidate's score
    kept = route.kept()
    assert kept.candidates_total == n and len(kept.candidates) == TOP_K
    assert kept.candidates[0].chosen and (kept.candidates[0].backend, kept.candidates[0].dp_rank) == (
        decision.backend,
        decision.dp_rank,
    )
    others = sorted((c for c in shown if not c.chosen), key=lambda c: c.score)[: TOP_K - 1]
    assert [c.score for c in kept.candidates[1:]] == [c.score for c in others]
    assert kept.candidates[1:] == [c for c in kept.candidates[1:]] and all(
        not c.chosen for c in kept.candidates[1:]
    )
    assert kept.explain()["candidates_total"] == n
    # the record of the decision itself: no object per candidate that the collector tracks
    tracked = len(gc.get_referents(decision.scored))
    assert tracked < 16
    # what the recent decisions hold: a copy cut to the top candidates, shown as the same KeptRoute
    lazy = route.keep()
    assert lazy._route is not None and lazy._route.decision.scored is not None
    assert lazy._route.decision.scored.size == TOP_K and lazy._route.report is None
    assert lazy.kept() == kept and lazy.explain() == kept.explain()
    assert lazy._route is None  # (made once; the copy is let go)
