"""The mock engine's step (sim.scheduler), driven directly, and checked against both of its users."""

from __future__ import annotations

import asyncio
import heapq
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from index.keys import prompt_keys
from sim.engine import EngineConfig, EngineRequest, EngineTokenizer, RankScheduler
from sim.kvcache import PrefixCache
from sim.offline import PreparedWorkload, SimConfig, simulate
from sim.scheduler import StepModel, StepScheduler, step_duration
from sim.workload import Request

BS = 16


@dataclass(eq=False)
class _R:
    """The smallest request the step accepts."""

    request_id: str
    prompt: list[int]
    max_tokens: int = 4
    outputs: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    first_at: float | None = None
    done_at: float | None = None


def _model(**changes: Any) -> StepModel:
    cfg = msgspec.structs.replace(EngineConfig(block_size=BS), **changes)
    return StepModel.from_engine(cfg, duration_factor=1.0)


def _sched(blocks: int = 64, **changes: Any) -> StepScheduler[_R]:
    return StepScheduler(PrefixCache(blocks, BS), _model(**changes))


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 2000) for _ in range(n)]


def _count(r: _R) -> int:
    return 100 + len(r.outputs)


def test_admission_respects_sequence_and_token_budgets() -> None:
    s = _sched(max_num_seqs=3)
    s.waiting.extend(_R(f"r{i}", _tokens(i, 20)) for i in range(5))
    plan = s.plan()
    assert [r.request_id for r in plan.admitted] == ["r0", "r1", "r2"]
    assert [r.request_id for r in s.waiting] == ["r3", "r4"]
    assert (plan.decoding, plan.preempted, plan.prefill_tokens) == ([], 0, 60)
    m = s.model
    assert plan.duration_s == pytest.approx(m.step_overhead_s + 60 * m.prefill_s_per_token)
    assert not plan.idle

    # token budget: the first admission always fits, the next must stay within it; head-of-line blocking
    s = _sched(max_num_batched_tokens=100)
    big, mid, small = _R("big", _tokens(1, 150)), _R("mid", _tokens(2, 90)), _R("small", _tokens(3, 5))
    s.waiting.extend([big, mid, small])
    plan = s.plan()
    assert plan.admitted == [big] and list(s.waiting) == [mid, small]
    # next step: big decodes, mid is admitted alone, small (90 + 5 <= 100) joins it
    s.complete(plan, _count)
    plan = s.plan()
    assert plan.decoding == [big] and plan.admitted == [mid, small]
    m = s.model
    want = m.step_overhead_s + 95 * m.prefill_s_per_token + m.decode_step_s + m.decode_s_per_seq
    assert plan.duration_s == pytest.approx(want)


def test_prefix_hits_are_counted_once_and_shrink_prefill_and_budget() -> None:
    s = _sched(max_num_batched_tokens=100)
    shared = _tokens(7, 64)  # 4 full blocks
    s.waiting.append(_R("a", shared + _tokens(8, 8), max_tokens=1))
    plan = s.plan()
    out = s.complete(plan, _count)
    assert [r.request_id for r in out.finished] == ["a"] and plan.admitted[0].cached_tokens == 0
    # 72 + 72 tokens would break the budget, but with 64 cached each, 8 + 8 new tokens fit easily
    b, c = _R("b", shared + _tokens(9, 8)), _R("c", shared + _tokens(10, 8))
    s.waiting.extend([b, c])
    plan = s.plan()
    assert plan.admitted == [b, c]
    assert (b.cached_tokens, c.cached_tokens, plan.prefill_tokens) == (64, 64, 16)
    assert (s.cache.queries, s.cache.hits) == (72 * 3, 128)
    # a prompt equal to a cached one still recomputes its last token: 3 of 4 blocks hit
    s.waiting.append(_R("d", list(shared)))
    s.complete(plan, _count)
    plan = s.plan()
    assert plan.admitted[0].cached_tokens == 48
    assert step_duration(s.model, 16, 0, 2) == pytest.approx(plan.duration_s)


def test_cache_pressure_preempts_the_newest_and_blocks_admission() -> None:
    # 8 blocks: two 63-token prompts take 4 blocks each; their second decode needs a 9th block
    s = _sched(blocks=8)
    old, new = _R("old", _tokens(1, 63), max_tokens=8), _R("new", _tokens(2, 63), max_tokens=8)
    waiter = _R("waiter", _tokens(3, 4))
    s.waiting.extend([old, new])
    s.complete(s.plan(), _count)
    assert s.cache.num_free_blocks == 0
    s.waiting.append(waiter)
    plan = s.plan()
    # the first decode fills each request's 4th block; the waiter finds no free block
    assert plan.decoding == [old, new] and plan.preempted == 0 and plan.admitted == []
    s.complete(plan, _count)
    plan = s.plan()  # token 51 needs a 5th block for each: the newest running request is preempted
    assert plan.preempted == 1 and s.preemptions == 1
    assert plan.decoding == [old] and s.running == [old]
    assert list(s.waiting) == [new, waiter]  # back at the head of the queue, with its outputs kept
    assert plan.admitted == []  # no admission in a step that preempted
    out = s.complete(plan, _count)
    assert [r for r, _ in out.emitted] == [old] and len(new.outputs) == 2
    while s.has_work:
        s.complete(s.plan(), _count)
    # old took new's freed last block (evicted first); new came back once old finished, prefilling its
    # prompt and outputs with 3 blocks still cached, and kept its first admission's count
    assert s.preemptions == 1 and s.cache.hits == 48
    assert new.cached_tokens == 0 and new.outputs == [100 + i for i in range(8)]
    assert waiter.cached_tokens == 0 and len(waiter.outputs) == 4

    # a lone request that cannot grow preempts itself: nothing runs, the step is only overhead
    s = _sched(blocks=4)
    solo = _R("solo", _tokens(4, 63), max_tokens=8)
    s.waiting.append(solo)
    s.complete(s.plan(), _count)
    plan = s.plan()
    assert plan.decoding == [solo]
    s.complete(plan, _count)
    plan = s.plan()
    assert plan.idle and plan.preempted == 1 and list(s.waiting) == [solo]
    assert plan.duration_s == pytest.approx(s.model.step_overhead_s)


def test_finish_frees_blocks_and_late_removals_get_no_token() -> None:
    s = _sched(blocks=16)
    a, b = _R("a", _tokens(1, 30), max_tokens=3), _R("b", _tokens(2, 30), max_tokens=5)
    s.waiting.extend([a, b])
    firsts: list[_R] = []
    finished: list[_R] = []
    for _ in range(3):
        out = s.complete(s.plan(), _count)
        firsts += out.first
        finished += out.finished
    assert firsts == [a, b] and finished == [a]
    assert a.outputs == [100, 101, 102] and s.running == [b]
    plan = s.plan()
    s.drop(b)  # the client went away while the step ran
    assert s.complete(plan, _count).emitted == [] and len(b.outputs) == 3
    assert s.cache.num_free_blocks == 16 and not s.has_work

    # a request larger than the whole cache is rejected without blocking the queue
    s = _sched(blocks=2)
    huge, ok = _R("huge", _tokens(3, 40)), _R("ok", _tokens(4, 10))
    s.waiting.extend([huge, ok])
    plan = s.plan()
    assert plan.rejected == [huge] and plan.admitted == [ok]


def _drive(
    arrivals: list[tuple[float, list[int], int]], model: StepModel, blocks: int
) -> tuple[list[_R], int]:
    """One engine in virtual time, step by step, exactly as the offline simulator sequences events."""
    core: StepScheduler[_R] = StepScheduler(PrefixCache(blocks, BS), model)
    heap: list[tuple[float, int, int, int]] = []
    for i, (at, _, _) in enumerate(arrivals):
        heap.append((at, 2, i, i))
    heapq.heapify(heap)
    records: list[_R] = []
    arrived: dict[int, float] = {}
    rngs: dict[str, random.Random] = {}
    seq = len(arrivals)
    busy = False
    plan = None

    def begin(now: float) -> None:
        nonlocal busy, plan, seq
        busy = core.has_work
        if busy:
            plan = core.plan()
            seq += 1
            heapq.heappush(heap, (now + plan.duration_s, 0, seq, -1))

    while heap:
        now, kind, _, i = heapq.heappop(heap)
        if kind == 2:
            _, prompt, max_tokens = arrivals[i]
            req = _R(f"r{i}", prompt, max_tokens)
            rngs[req.request_id] = random.Random(prompt_keys(prompt, BS)[-1])
            arrived[id(req)] = now
            records.append(req)
            core.waiting.append(req)
            if not busy:
                begin(now)
        else:
            assert plan is not None
            out = core.complete(plan, lambda r: 5 + rngs[r.request_id].randrange(2048 - 5))
            for r in out.first:
                r.first_at = now - arrived[id(r)]
            for r in out.finished:
                r.done_at = now
            begin(now)
    return records, core.preemptions


def test_offline_simulator_and_the_step_agree() -> None:
    # a busy single engine with shared prefixes, a tight cache (preemptions) and a small token budget
    rng = random.Random(11)
    docs = [_tokens(100 + d, 160) for d in range(3)]
    arrivals = []
    t = 0.0
    for _ in range(40):
        t += rng.expovariate(30.0)
        arrivals.append((t, rng.choice(docs) + _tokens(rng.randrange(10**6), rng.randint(5, 40)), 40))
    cfg = EngineConfig(block_size=BS, num_gpu_blocks=45, max_num_seqs=6, max_num_batched_tokens=400)
    records, preemptions = _drive(arrivals, StepModel.from_engine(cfg, duration_factor=1.0), 45)

    work = PreparedWorkload(
        [
            Request(at_s=at, session=f"s{i}", prompt_token_ids=p, max_tokens=mt)
            for i, (at, p, mt) in enumerate(arrivals)
        ]
    )
    sim = simulate(work, "round_robin", SimConfig(engines=1, engine=cfg))
    assert preemptions > 0 and sim.preemptions == preemptions
    assert sim.cached_tokens == sum(r.cached_tokens or 0 for r in records)
    ttft = [r.first_at for r in records if r.first_at is not None]
    assert len(ttft) == sim.requests == 40
    assert sim.ttft_mean == pytest.approx(sum(ttft) / len(ttft), rel=1e-12)
    ordered = sorted(ttft)
    assert sim.ttft_p50 == pytest.approx(ordered[19], rel=1e-12)
    assert sim.ttft_p99 == pytest.approx(ordered[-1], rel=1e-12)
    end = max(r.done_at for r in records if r.done_at is not None)
    assert sim.makespan_s == pytest.approx(end - arrivals[0][0], rel=1e-12)


def test_live_rank_scheduler_runs_the_same_step() -> None:
    """Sequential requests (no timing effects): the live rank's cached counts equal the step's own."""
    shared = _tokens(5, 70)
    prompts = [shared + _tokens(20 + i, 10 + i) for i in range(4)] + [list(shared)]
    cfg = EngineConfig(block_size=BS, num_gpu_blocks=32, time_scale=0.001)

    async def live() -> list[int | None]:
        sched = RankScheduler(cfg, 0, None, EngineTokenizer(None))
        assert isinstance(sched.core, StepScheduler) and sched.model.duration_factor == cfg.time_scale
        sched.start()
        try:
            got = []
            for i, p in enumerate(prompts):
                req = EngineRequest(f"q{i}", p, 3, 0, random.Random(i))
                sched.submit(req)
                items = [await asyncio.wait_for(req.queue.get(), 30) for _ in range(4)]
                assert len(items) == 4 and len(req.outputs) == 3
                got.append(req.cached_tokens)
            assert sched.steps >= 3 * len(prompts) and sched.requests_finished == len(prompts)
            return got
        finally:
            await sched.stop()

    live_cached = asyncio.run(asyncio.wait_for(live(), 60))
    s: StepScheduler[_R] = StepScheduler(PrefixCache(32, BS), StepModel.from_engine(cfg, duration_factor=1.0))
    direct = []
    for i, p in enumerate(prompts):
        r = _R(f"q{i}", p, max_tokens=3)
        s.waiting.append(r)
        while s.has_work:
            s.complete(s.plan(), lambda q: random.Random(q.request_id).randrange(97, 123))
        direct.append(r.cached_tokens)
    assert live_cached == direct == [0, 64, 64, 64, 64]
