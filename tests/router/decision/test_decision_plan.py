"""The candidate set's plan is kept across decisions while nothing it depends on changes, also with
a breaker open (the list without the ejected is the same object while the ejected stay the same),
and made anew when the ejected change."""

from __future__ import annotations

import asyncio
import random

from index.kvindex import IndexConfig, KVIndex
from router.config import BackendConfig, MembershipConfig
from router.decision.policy import Policy, PolicyConfig
from router.decision.service import RouterService
from router.decision.tokenizer import RequestTokenizer
from router.fleet.breaker import BreakerConfig, Breakers
from router.fleet.load import LoadTracker
from router.fleet.membership import Membership


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _service(clock: Clock) -> RouterService:
    index = KVIndex(IndexConfig(block_size=16))
    membership = Membership(MembershipConfig())
    specs = [BackendConfig(f"e{i}", f"http://127.0.0.1:9/{i}", models=["m"], dp_size=2) for i in range(4)]
    membership.reconcile("config", specs)
    loads = LoadTracker([])
    for m in membership.members.values():
        m.healthy = True
        for target in m.targets:
            loads.track(target)
            index.ingestor.add_source(target)
    membership.tick(lambda m: 0, lambda m: True)
    breakers = Breakers(BreakerConfig(eject_after=1, eject_s=5.0), clock=clock)
    policy = Policy(PolicyConfig(), random.Random(3))
    return RouterService(index, membership, loads, policy, RequestTokenizer({}), breakers=breakers)


def test_an_open_breaker_keeps_the_plan_and_keeps_its_backend_out() -> None:
    clock = Clock()
    service = _service(clock)
    body = {"model": "m", "prompt": list(range(1, 65))}

    async def decide(n: int) -> list[str]:
        return [(await service.decide("completions", body)).backend for _ in range(n)]

    asyncio.run(decide(1))
    alone = service._plan_cache
    assert alone is not None and len(alone.inputs.targets) == 8
    assert service.breakers.failure("e1")
    chosen = asyncio.run(decide(20))
    plan = service._plan_cache
    assert plan is not None and plan is not alone and len(plan.inputs.targets) == 6
    assert "e1" not in chosen
    asyncio.run(decide(5))
    assert service._plan_cache is plan  # (kept: the ejected are the same)
    assert service.breakers.failure("e2")
    asyncio.run(decide(1))
    both = service._plan_cache
    assert both is not None and both is not plan and len(both.inputs.targets) == 4
    clock.now += 60  # past both cooldowns: on trial, candidates again
    asyncio.run(decide(1))
    back = service._plan_cache
    assert back is not None and len(back.inputs.targets) == 8
