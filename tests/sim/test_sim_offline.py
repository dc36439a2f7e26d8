"""The offline simulator: real index + real policy over modelled engines, deterministic and fast."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest

from router.decision.chat import ChatTokenizer
from router.decision.policy import PolicyConfig
from sim.engine import EngineConfig
from sim.offline import (
    PreparedWorkload,
    SimConfig,
    SimRouter,
    chat_tokenizer,
    scale_policy,
    simulate,
    token_bound,
)
from sim.report import from_sim, markdown, table, to_json
from sim.toy_tokenizer import build_toy_tokenizer
from sim.workload import Request, demo_config, generate


def _doc_workload(docs: int = 8, doc_tokens: int = 640, requests: int = 160, seed: int = 0) -> list[Request]:
    """Requests quoting one of ``docs`` long documents then a private question, Poisson arrivals.

    Built so that prefix locality decides the hit ratio: every engine's cache holds ~2 documents,
    so spreading a document's requests over all engines (round-robin) keeps evicting it, while
    keeping each document on one engine (kv) keeps it cached.
    """
    rng = random.Random(seed)
    bodies = [[rng.randrange(5, 2000) for _ in range(doc_tokens)] for _ in range(docs)]
    out = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(20.0)
        d = rng.randrange(docs)
        question = [rng.randrange(5, 2000) for _ in range(rng.randint(20, 60))]
        out.append(
            Request(at_s=t, session=f"q{i}", prompt_token_ids=bodies[d] + question, max_tokens=8, kind="doc")
        )
    return out


FLEET = SimConfig(engines=4, engine=EngineConfig(num_gpu_blocks=110, block_size=16, max_model_len=1 << 20))


def test_kv_beats_the_cache_blind_policies_on_hit_ratio() -> None:
    work = PreparedWorkload(_doc_workload())
    results = {p: simulate(work, p, FLEET) for p in ("kv", "round_robin", "least_loaded", "random")}
    kv = results["kv"]
    for name in ("round_robin", "least_loaded", "random"):
        assert kv.hit_ratio > results[name].hit_ratio + 0.15, (name, kv.hit_ratio, results[name].hit_ratio)
    assert kv.ratio_to_bound > 0.8
    assert kv.ttft_p50 < results["round_robin"].ttft_p50
    assert kv.decisions.get("prefix", 0) > len(work.requests) // 2
    assert all(r.requests == len(work.requests) for r in results.values())
    assert all(0 < r.bound <= 1 for r in results.values())
    assert results["round_robin"].per_engine_requests == [40, 40, 40, 40]
    assert results["round_robin"].evicted_blocks > kv.evicted_blocks
    assert max(r.load_spread_requests for r in results.values()) < 3.0


def test_simulation_is_deterministic_and_the_wire_path_matches_structs() -> None:
    work = PreparedWorkload(_doc_workload(requests=60, seed=2))
    a = simulate(work, "kv", FLEET)
    b = simulate(work, "kv", FLEET)
    c = simulate(work, "kv", msgspec.structs.replace(FLEET, wire=False))
    keys = ("hit_ratio", "ttft_p50", "ttft_p99", "per_engine_requests", "decisions")
    assert [getattr(a, k) for k in keys] == [getattr(b, k) for k in keys] == [getattr(c, k) for k in keys]
    lagged = simulate(work, "kv", msgspec.structs.replace(FLEET, event_lag_s=0.05, predict_ttl_s=0.0))
    assert lagged.requests == a.requests


def test_bound_and_timing_model() -> None:
    same = [1000 + i for i in range(64)]
    prompts = [same, same, same[:40]]
    # second prompt: 3 of 4 blocks (the engine recomputes the last token); third: 2 of 2 full blocks
    assert token_bound(prompts, 16) == pytest.approx((48 + 32) / (64 + 64 + 40))
    reqs = [
        Request(at_s=float(i), session=f"s{i}", prompt_token_ids=p, max_tokens=4)
        for i, p in enumerate(prompts)
    ]
    eng = EngineConfig(num_gpu_blocks=64, block_size=16)
    r = simulate(PreparedWorkload(reqs), "kv", SimConfig(engines=1, engine=eng))
    assert r.hit_ratio == pytest.approx(r.bound)
    # an idle engine: TTFT = one step = overhead + uncached tokens * prefill cost
    first = eng.step_overhead_s + 64 * eng.prefill_s_per_token
    cached = eng.step_overhead_s + 16 * eng.prefill_s_per_token
    assert r.ttft_p99 == pytest.approx(first)
    assert r.ttft_p50 == pytest.approx(cached)


def test_session_turns_wait_for_their_predecessor() -> None:
    turn0 = Request(at_s=0.0, session="c", prompt_token_ids=list(range(5, 200)), max_tokens=50, turn=0)
    turn1 = Request(
        at_s=0.0, session="c", prompt_token_ids=list(range(5, 260)), max_tokens=5, turn=1, think_s=1.0
    )
    work = PreparedWorkload([turn0, turn1])
    cfg = SimConfig(engines=2, engine=EngineConfig(num_gpu_blocks=64))
    chained = simulate(work, "round_robin", cfg)
    free = simulate(work, "round_robin", msgspec.structs.replace(cfg, session_mode=False))
    assert chained.makespan_s > free.makespan_s + 1.0  # 50 decode steps + 1 s think before turn 1
    # kv keeps the conversation on the engine that holds its history
    assert simulate(work, "kv", cfg).cached_tokens > chained.cached_tokens


def test_pending_prefill_spreads_a_burst_unless_the_first_byte_comes_early() -> None:
    shared = list(range(5, 69))  # 4 blocks every request shares
    rng = random.Random(1)
    burst = [
        Request(
            at_s=0.0, session=f"b{i}", prompt_token_ids=shared + [rng.randrange(5, 2000) for _ in range(960)]
        )
        for i in range(8)
    ]
    cfg = SimConfig(engines=2, engine=EngineConfig(num_gpu_blocks=1024))
    normal = simulate(PreparedWorkload(burst), "kv", cfg)
    early = simulate(PreparedWorkload(burst), "kv", msgspec.structs.replace(cfg, first_byte_at_dispatch=True))
    assert max(normal.per_engine_requests) <= 5  # queued prefill outweighs a 4-block match
    assert max(early.per_engine_requests) >= 7  # the queue is invisible: the match wins every time
    assert early.ttft_p99 > normal.ttft_p99


def test_scaled_policy_keeps_per_request_terms_in_real_units() -> None:
    cfg = PolicyConfig(decode_weight=2.0, min_match_blocks=8, waiting_weight=1.0)
    s = scale_policy(cfg, 4.0)
    assert (s.decode_weight, s.min_match_blocks, s.waiting_weight) == (0.5, 2, 0.25)
    assert scale_policy(cfg, 1.0) is cfg


def test_router_ingests_engine_events() -> None:
    from router.decision.policy import Policy
    from sim.kvcache import PrefixCache

    router = SimRouter(Policy(PolicyConfig()), ["a", "b"], 16, predict_ttl_s=0.0, wire=True)
    cache = PrefixCache(32, 16)
    tokens = list(range(5, 5 + 64))
    assert cache.admit("x", tokens) is not None
    router.apply(1, cache.take_events(), 0.0)
    from index.keys import prompt_keys

    engine, decision, matched = router.route(tokens, prompt_keys(tokens, 16), 0.0)
    assert (engine, matched, decision.outcome) == (1, 4, "prefix")


def test_chat_workload_through_the_toy_tokenizer(tmp_path: Path) -> None:
    tok = ChatTokenizer.from_path(build_toy_tokenizer(tmp_path / "tok"))
    work = PreparedWorkload(generate(demo_config(quick=True)), chat_tokenizer(tok))
    cfg = SimConfig(engines=3, engine=EngineConfig(num_gpu_blocks=512, max_model_len=1 << 20))
    kv = simulate(work, "kv", cfg)
    rr = simulate(work, "round_robin", cfg)
    assert kv.hit_ratio > rr.hit_ratio
    rows = [from_sim(kv), from_sim(rr)]
    text = table(rows, title="t")
    assert "kv" in text and "round_robin" in text and "TTFT p50" in text
    lines = text.splitlines()
    assert len({len(line) for line in lines[1:4]}) == 1  # aligned columns
    assert markdown(rows).count("\n") == 3
    assert b'"ratio_to_bound"' in to_json(rows, {"x": 1})


def test_the_table_says_when_requests_were_skipped_at_the_deadline() -> None:
    """Past the run's deadline a policy's ratios are over fewer requests than the bound's: the
    count was in the JSON only, and the table read as if every request had run."""
    from sim.report import Row

    text = table([Row(policy="kv", requests=10, extra={"skipped": 3}), Row(policy="random", requests=10)])
    assert "kv (3 skipped at the deadline)" in text and "random (" not in text


def test_the_table_explains_its_spread_columns() -> None:
    """ "spread tok" and "spread req" were never explained: one line under the table says what they are."""
    from sim.report import Row

    lines = table([Row(policy="kv", requests=10, spread_tokens=1.5, spread_requests=1.25)]).splitlines()
    assert lines[-1].startswith(
        "spread tok / req: the busiest engine's prompt tokens / requests over the mean"
    )
    assert lines[-2].split()[-2:] == ["1.50", "1.25"]
