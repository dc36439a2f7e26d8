"""The scoring kernel (router/decision/_kernel.c), the one decision path's, against the policy
written in plain Python (tests/policy_reference.py, run by nothing but the tests).

Both decide the same random fleets with twin random generators; the kernel's ``/route`` answer
(the record written as JSON by the kernel) must be the reference's msgspec bytes (the timings and
the timestamp aside) and leave the generators in the same state, over candidate counts, media
mixes, loads of both number types, weights that are and are not exact binary fractions, ties,
thresholds, temperature, every policy, assumed peer load, and magnitudes msgspec lays out
differently from repr().
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from harness import FakeEngine, RouterRunner, wait_for
from policy_reference import ReferencePolicy, explain

from router.decision.policy import Candidate, Policy, PolicyConfig
from router.decision.record import Inputs
from router.decision.service import Route, RouteView
from router.fleet.load import TargetLoad

_VOLATILE = re.compile(rb'"timings_us":\{[^}]*\},"time":[^,]+,')


@dataclasses.dataclass
class Fleet:
    """The targets of one decision, as the kernel takes them (one entry per target in each list)."""

    names: list[str]
    ranks: list[int]
    matched: list[int]
    media: list[dict[str, int] | None]
    loads: list[TargetLoad]
    prompt_tokens: int
    block_size: int


def _cands(f: Fleet) -> list[Candidate]:
    return [
        Candidate(n, r, m, md if md is not None else {"GPU": m}, load)
        for n, r, m, md, load in zip(f.names, f.ranks, f.matched, f.media, f.loads, strict=True)
    ]


_TIMINGS = {"tokenize": 0.0, "match": 0.0, "policy": 0.0, "total": 0.0, "held": 0.0}


def _python(
    cfg: PolicyConfig, seed: int, f: Fleet, spread: tuple[float, float] | None = None
) -> tuple[bytes, Any]:
    """The reference: the policy in plain Python, explained, encoded by msgspec."""
    rng = random.Random(seed)
    policy = ReferencePolicy(cfg, rng)
    cands = _cands(f)
    prompt_blocks = f.prompt_tokens // f.block_size
    if spread is not None and cfg.name == "kv":
        policy.spread(cands, f.block_size, *spread)
    decision = policy.choose(prompt_blocks, f.block_size, cands, have_prompt=True, dry_run=True)
    explain(cfg.name, decision.candidates, decision.outcome)
    target = (decision.backend, decision.dp_rank)
    chosen = next(i for i, c in enumerate(cands) if (c.backend, c.dp_rank) == target)
    view = RouteView(
        "m",
        "completions",
        decision.backend,
        decision.dp_rank,
        decision.outcome,
        f.prompt_tokens,
        prompt_blocks,
        f.block_size,
        f.matched[chosen],
        decision.candidates,
        None,
        _TIMINGS,
        0.0,
        cfg.name,
    )
    return msgspec.json.encode(view), rng.getstate()


def _kernel(
    cfg: PolicyConfig, seed: int, f: Fleet, spread: tuple[float, float] | None = None
) -> tuple[bytes, Any]:
    """The one path: Policy.decide's record, written by the kernel."""
    rng = random.Random(seed)
    policy = Policy(cfg, rng)
    prompt_blocks = f.prompt_tokens // f.block_size
    inputs = Inputs(list(zip(f.names, f.ranks, strict=True)))
    decision = policy.decide(
        inputs,
        prompt_blocks,
        f.block_size,
        f.matched,
        f.loads,
        media=f.media,
        dry_run=True,
        spread=spread if cfg.name == "kv" else None,
    )
    assert decision.scored is not None
    chosen = decision.scored.best
    route = Route(
        model="m",
        endpoint="completions",
        backend=decision.backend,
        dp_rank=decision.dp_rank,
        outcome=decision.outcome,
        prompt_tokens=f.prompt_tokens,
        prompt_blocks=prompt_blocks,
        block_size=f.block_size,
        matched_blocks=f.matched[chosen],
        decision=decision,
        timings_us=dict(_TIMINGS),
        policy=cfg.name,
    )
    return route.explain_json(), rng.getstate()


def _fleet(rng: random.Random) -> tuple[PolicyConfig, Fleet]:
    weights = [0.0, 0.25, 0.5, 1.0, 2.0, 0.1, 0.3, 1 / 3, 0.75, 1.7]
    cfg = PolicyConfig(
        name=rng.choice(["kv", "kv", "kv", "kv", "round_robin", "least_loaded", "random"]),
        temperature=rng.choice([0.0, 0.0, 0.0, 0.5, 2.0]),
        gpu_credit=rng.choice([1.0, 1.0, 0.9, 1.25]),
        cpu_credit=rng.choice([0.75, 0.5, 0.6, 1 / 3]),
        storage_credit=rng.choice([0.25, 0.1, 0.0]),
        predicted_credit=rng.choice([1.0, 0.8]),
        min_match_blocks=rng.choice([1, 1, 2, 8]),
        min_match_ratio=rng.choice([0.0, 0.0, 0.1, 0.5]),
        load_weight=rng.choice(weights),
        decode_weight=rng.choice(weights),
        waiting_weight=rng.choice(weights),
    )
    block_size = rng.choice([16, 16, 1, 5, 32])
    prompt_tokens = rng.choice([0, 3, block_size * rng.randrange(1, 300) + rng.randrange(block_size)])
    prompt_blocks = prompt_tokens // block_size
    n = rng.choice([1, 2, 3, 8, 8, 17, 64])
    names: list[str] = []
    ranks: list[int] = []
    matched: list[int] = []
    media: list[dict[str, int] | None] = []
    loads: list[TargetLoad] = []
    for i in range(n):
        names.append(rng.choice([f"e{i}", f"pod-{i}.ns", f"é{i}"]))
        ranks.append(rng.choice([0, 0, 1, 3]))
        kind = rng.random()
        m = 0 if kind < 0.3 else rng.randrange(0, prompt_blocks + 1)
        matched.append(m)
        if kind < 0.1:
            media.append({})  # a source the index does not know
            matched[-1] = 0
        elif kind < 0.6:
            media.append(None)  # all on GPU
        else:
            left, by = m, {"GPU": m}
            for medium in ("CPU", "STORAGE", "PREDICTED", "disk tier"):
                if left and rng.random() < 0.5:
                    c = rng.randrange(0, left + 1)
                    if c:
                        by[medium] = c
                        by["GPU"] -= c
                        left -= c
            media.append(by)
        active = rng.choice([0, 0, 1, 2, 7, 40])
        waiting: float = rng.choice([0.0, 0.0, 1.0, 2.5, 3.0, rng.uniform(0, 50), 1e-6, 3e17])
        if rng.random() < 0.1:
            waiting = int(waiting)  # (scraped gauges are floats; tests and peers may give ints)
        pending = rng.choice([0, 0, 16, 100, 1000, rng.randrange(0, 200_000), 10**17, 2**53 + 1, 10**17 + 3])
        loads.append(TargetLoad(active=active, pending_prefill_tokens=pending, engine_waiting=waiting))
    if rng.random() < 0.3:  # everything level: ties for the random tie-break
        loads = [TargetLoad() for _ in range(n)]
        matched = [0] * n
        media = [None] * n
    return cfg, Fleet(names, ranks, matched, media, loads, prompt_tokens, block_size)


def test_the_kernel_answers_as_the_python_policy_over_random_fleets() -> None:
    rng = random.Random(20261126)
    outcomes: set[str] = set()
    for case in range(3000):
        cfg, fleet = _fleet(rng)
        seed = rng.randrange(2**32)
        spread = rng.choice([None, None, (rng.choice([0.5, 1.0, 3.0, 2.7]), rng.choice([2.0, 5.25, 0.3]))])
        want, want_state = _python(cfg, seed, fleet, spread)
        got, got_state = _kernel(cfg, seed, fleet, spread)
        assert _VOLATILE.sub(b"", got) == _VOLATILE.sub(b"", want), (case, cfg, fleet, spread)
        assert got_state == want_state, case  # the same draws from the generator
        answer = msgspec.json.decode(got)
        assert list(answer["timings_us"]) == ["tokenize", "match", "policy", "total", "held"]
        outcomes.add(answer["outcome"])
        outcomes.update(c["reason"].split(" ")[0] for c in answer["candidates"])
    # every branch of the explanation was taken
    assert {"prefix", "load", "lowest", "its", "more", "tied", "cost", "round_robin:", "random:"} <= outcomes


def test_an_int_load_past_2_53_divides_as_python_divides_it() -> None:
    """``pending / block_size`` with an int a double cannot hold: Python rounds the quotient once;
    converting the int first would round twice (a different queue, score and choice)."""
    cfg = PolicyConfig(load_weight=0.25)
    for pending in (2**53 + 1, 10**17 + 3, 3 * 10**18 + 7, 2**70 + 1):
        loads = [TargetLoad(pending_prefill_tokens=pending), TargetLoad(pending_prefill_tokens=pending - 1)]
        fleet = Fleet(["a", "b"], [0, 0], [0, 0], [None, None], loads, prompt_tokens=30, block_size=3)
        want, _ = _python(cfg, 1, fleet)
        got, _ = _kernel(cfg, 1, fleet)
        assert _VOLATILE.sub(b"", got) == _VOLATILE.sub(b"", want), pending


def test_callbacks_that_change_the_inputs_do_not_crash_the_kernel() -> None:
    """rng.choice and encode are Python calls: the kernel reads its inputs before any of them and
    holds its own references across them."""
    matched, loads = [0] * 4, [TargetLoad() for _ in range(4)]

    class Clearing(random.Random):
        def choice(self, seq: Any) -> Any:
            matched.clear()
            loads.clear()
            return seq[-1]

    inputs = Inputs([(f"e{i}", 0) for i in range(4)])
    decision = Policy(PolicyConfig(), Clearing(1)).decide(inputs, 2, 16, matched, loads)
    assert decision.backend == "e3"
    by = {"x\u00e9": 1, "GPU": 1}

    def clearing_encode(obj: Any) -> bytes:
        by.clear()
        for _ in range(100):
            [object() for _ in range(10)]
        return msgspec.json.encode(obj)

    one = Inputs([("a", 0)])
    decision = Policy(PolicyConfig(), random.Random(1)).decide(one, 2, 16, [2], [TargetLoad()], media=[by])
    assert decision.scored is not None
    from router.decision import _kernel

    s = decision.scored
    codes = _kernel.reasons(s.record, 1, 0, False, True)
    answer = _kernel.render(
        s.record, 1, 0, codes, one.names(), one.ranks, [by], None, (), b"kv", clearing_encode
    )
    assert b'"blocks_by_medium":{"x\xc3\xa9":1}' in answer  # (the rest of the dict went meanwhile)


def test_the_kernel_refuses_inconsistent_inputs() -> None:
    cfg, fleet = _fleet(random.Random(1))
    fleet.loads = [*fleet.loads, TargetLoad()]
    with pytest.raises(ValueError, match="one entry per candidate"):
        _kernel(cfg, 1, fleet)
    cfg, fleet = _fleet(random.Random(1))
    fleet.media = [[1]] * len(fleet.names)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="dicts or None"):
        _kernel(cfg, 1, fleet)
    with pytest.raises(ValueError, match="no candidates"):
        _kernel(cfg, 1, Fleet([], [], [], [], [], prompt_tokens=16, block_size=16))
    from router.decision import _kernel as kernel

    with pytest.raises(ValueError, match="no candidates"):
        kernel.score(
            (0, 16, 0, *[0.0] * 4, 1, *[0.0] * 5),
            [],
            None,
            None,
            None,
            [],
            None,
            None,
            random.Random(),
            None,
            0,
        )


def test_a_running_router_answers_token_id_routes_through_the_kernel_as_through_python(
    ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path
) -> None:
    """The real router, two engines (one with two DP ranks, one caching on CPU), then a proxied
    request (its predicted blocks make the kernel take the match report's path): every ``/route``
    answer with a token-id prompt comes from the kernel and is the Python path's, byte for byte but
    the timings."""
    a = FakeEngine("a", ctx, dp_size=2)
    b = FakeEngine("b", ctx)
    # (predictions that outlive both phases of the comparison, however slow the box)
    toml = f'block_size = 4\ntokenizer = "{tokdir}"\n[index]\npredict_ttl_s = 600.0\n'
    toml += f"{a.backend_toml()}\n{b.backend_toml()}\n"
    router = RouterRunner(toml, tmp_path)
    try:
        app = router.app
        service = app.service
        tokens = [5 + i for i in range(40)]
        a.announce(tokens[:16], 4)
        a.announce(tokens[:8], 4, rank=1)
        b.announce(tokens[:24], 4, medium="CPU")

        def matched() -> list[int]:
            r = httpx.post(f"{router.url}/route", json={"model": "toy", "prompt": tokens}, timeout=10)
            return sorted(c["matched_blocks"] for c in r.json()["candidates"])

        wait_for(lambda: matched() == [2, 4, 6], "the three announcements indexed")
        bodies = [
            {"model": "toy", "prompt": tokens},
            {"model": "toy", "prompt": tokens[:10]},
            {"model": "toy", "prompt": [900 + i for i in range(12)]},  # a miss: three-way tie
            {"model": "toy", "prompt": tokens, "cache_salt": "s"},
            {"model": "toy", "prompt": [5, 6, 7]},  # shorter than a block
        ]

        def reference(body: dict[str, Any], state: Any) -> bytes:
            """The old report path (KVIndex.match) and the plain-Python policy, on the router's own
            index, loads and generator state."""
            backends = service.candidates_for("toy")
            targets = [(b.name, r) for b in backends for r in range(b.spec.dp_size)]
            report = app.index.match(body["prompt"], targets, cache_salt=body.get("cache_salt"))
            cands = []
            for t in targets:
                m = report.matches.get(t)
                by = dict(m.by_medium) if m is not None else {}
                cands.append(Candidate(t[0], t[1], m.blocks if m else 0, by, service.loads.get(t)))
            rng = random.Random()
            rng.setstate(state)
            policy = ReferencePolicy(service.policy.config, rng)
            decision = policy.choose(report.prompt_blocks, report.block_size, cands, dry_run=True)
            explain("kv", decision.candidates, decision.outcome)
            chosen = next(c for c in decision.candidates if c.chosen)
            view = RouteView(
                "toy",
                "completions",
                decision.backend,
                decision.dp_rank,
                decision.outcome,
                len(body["prompt"]),
                report.prompt_blocks,
                report.block_size,
                chosen.matched_blocks,
                decision.candidates,
                None,
                _TIMINGS,
                0.0,
                "kv",
            )
            return _VOLATILE.sub(b"", msgspec.json.encode(view))

        through_kernel: list[bytes] = []
        for proxied in (False, True):
            if proxied:  # predictions on the chosen target: the match extends over them
                r = httpx.post(
                    f"{router.url}/v1/completions", json={"model": "toy", "prompt": tokens}, timeout=10
                )
                assert r.status_code == 200
                assert any(app.index._predicted.values())
            through_kernel = []
            for body in bodies:
                state = service.policy.rng.getstate()
                want = reference(body, state)
                r = httpx.post(f"{router.url}/route", json=body, timeout=10)
                assert r.status_code == 200, r.text
                through_kernel.append(_VOLATILE.sub(b"", r.content))
                assert through_kernel[-1] == want, body
        assert b'"PREDICTED"' in through_kernel[0] and b'"CPU"' in through_kernel[0]
    finally:
        router.stop()
        a.close()
        b.close()
