"""The compiled /route decision (router/decision/_explain.c) against the Python policy it mirrors.

``RouterService.explain_json_now`` answers a token-id ``/route`` with the kernel's bytes; the proxy,
the dashboard and every other case keep the Python policy (router/decision/policy.py). Here both
decide the same random fleets with twin random generators, and the answers must be the same bytes
(the timings and the timestamp aside) and leave the generators in the same state, over candidate
counts, media mixes, loads of both number types, weights that are and are not exact binary
fractions, ties, thresholds and magnitudes msgspec lays out differently from repr().
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

from router.decision._explain import explain_kv
from router.decision.policy import Candidate, Policy, PolicyConfig
from router.decision.service import Route, kernel_weights
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


def _python(cfg: PolicyConfig, seed: int, f: Fleet) -> tuple[bytes, Any]:
    """The answer ``RouterService.explain_now`` + ``Route.explain_json`` give for these inputs."""
    rng = random.Random(seed)
    policy = Policy(cfg, rng)
    cands = [
        Candidate(n, r, m, md if md is not None else {"GPU": m}, load)
        for n, r, m, md, load in zip(f.names, f.ranks, f.matched, f.media, f.loads, strict=True)
    ]
    prompt_blocks = f.prompt_tokens // f.block_size
    decision = policy.choose(prompt_blocks, f.block_size, cands, have_prompt=True, dry_run=True)
    target = (decision.backend, decision.dp_rank)
    chosen = next(i for i, c in enumerate(cands) if (c.backend, c.dp_rank) == target)
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
        candidates=decision.candidates,
        timings_us={"tokenize": 0.0, "match": 0.0, "policy": 0.0, "total": 0.0, "held": 0.0},
        policy="kv",
    )
    return route.explain_json(), rng.getstate()


def _kernel(
    cfg: PolicyConfig, seed: int, f: Fleet, times: tuple[float, float, float] = (1.0, 1.5, 2.0)
) -> tuple[bytes, Any]:
    rng = random.Random(seed)
    params = (f.prompt_tokens, f.prompt_tokens // f.block_size, f.block_size, *kernel_weights(cfg))
    answer = explain_kv(
        b'{"model":"m","endpoint":"completions",',
        [msgspec.json.encode(n) for n in f.names],
        f.ranks,
        f.matched,
        f.media,
        f.loads,
        params,
        rng,
        msgspec.json.encode,
        lambda: times[2],
        *times,
    )
    return answer, rng.getstate()


def _fleet(rng: random.Random) -> tuple[PolicyConfig, Fleet]:
    weights = [0.0, 0.25, 0.5, 1.0, 2.0, 0.1, 0.3, 1 / 3, 0.75, 1.7]
    cfg = PolicyConfig(
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
    names, ranks, matched, media, loads = [], [], [], [], []
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
        want, want_state = _python(cfg, seed, fleet)
        got, got_state = _kernel(cfg, seed, fleet)
        assert _VOLATILE.sub(b"", got) == _VOLATILE.sub(b"", want), (case, cfg, fleet)
        assert got_state == want_state, case  # the same draws from the generator
        answer = msgspec.json.decode(got)
        assert list(answer["timings_us"]) == ["tokenize", "match", "policy", "total", "held"]
        assert answer["timings_us"]["tokenize"] == 500000.0 and answer["timings_us"]["match"] == 500000.0
        outcomes.add(answer["outcome"])
        outcomes.update(c["reason"].split(" ")[0] for c in answer["candidates"])
    # every branch of the explanation was taken
    assert {"prefix", "load", "lowest", "its", "more", "tied", "cost"} <= outcomes


def test_the_timings_are_written_as_python_rounds_them() -> None:
    """``timings_us``: round(x, 1) as repr() writes it, which the kernel computes itself far from a
    tie and with CPython's conversions near one."""
    rng = random.Random(7)
    cfg, fleet = _fleet(rng)
    spans = [0.0, 1e-7, 1.25e-7, 0.5e-6, 1.05e-6, 3.45e-5, 2.5e-6, 1e-3, 0.1, 12.0, 1500.0]
    spans += [rng.uniform(0, 1e-3) for _ in range(400)] + [rng.uniform(0, 1e3) for _ in range(100)]
    spans += [round(rng.uniform(0, 1e-3), 7) + 0.5e-7 for _ in range(200)]  # ties and near-ties
    for a in spans:
        t0 = rng.choice([0.0, rng.uniform(0, 1e5)])
        t1 = t0 + a
        got, _ = _kernel(cfg, 1, fleet, times=(t0, t1, t1))
        found = re.search(rb'"timings_us":\{"tokenize":([^,]+),"match":([^,]+),', got)
        assert found is not None
        assert found.group(1).decode() == repr(round((t1 - t0) * 1e6, 1)), (a, found.group(1))
        assert found.group(2).decode() == "0.0"


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
    """rng.choice and encode are Python calls: the kernel holds its own references across them."""
    names = [msgspec.json.encode(f"e{i}") for i in range(4)]
    ranks, matched, media = [0] * 4, [0] * 4, [None] * 4
    loads = [TargetLoad() for _ in range(4)]

    class Clearing(random.Random):
        def choice(self, seq: Any) -> Any:
            names.clear()
            ranks.clear()
            matched.clear()
            loads.clear()
            return seq[-1]

    params = (32, 2, 16, *kernel_weights(PolicyConfig()))
    args = (names, ranks, matched, media, loads, params, Clearing(1), msgspec.json.encode, lambda: 0.0)
    answer = explain_kv(b"{", *args, 0.0, 0.0, 0.0)
    assert msgspec.json.decode(b'{"model":"m",' + answer[1:])["backend"] == "e3"
    by = {"x\u00e9": 1, "GPU": 1}

    def clearing_encode(obj: Any) -> bytes:
        by.clear()
        for _ in range(100):
            [object() for _ in range(10)]
        return msgspec.json.encode(obj)

    params = (32, 2, 16, *kernel_weights(PolicyConfig()))
    answer = explain_kv(
        b"{",
        [b'"a"'],
        [0],
        [2],
        [by],
        [TargetLoad()],
        params,
        random.Random(1),
        clearing_encode,
        lambda: 0.0,
        0.0,
        0.0,
        0.0,
    )
    assert b'"blocks_by_medium":{"x\xc3\xa9":1}' in answer  # (the rest of the dict went meanwhile)


def test_the_kernel_refuses_inconsistent_inputs() -> None:
    cfg, fleet = _fleet(random.Random(1))
    fleet.ranks = [*fleet.ranks[:-1], 0, 0]
    with pytest.raises(ValueError, match="one entry per target"):
        _kernel(cfg, 1, fleet)
    cfg, fleet = _fleet(random.Random(1))
    fleet.media = [[1]] * len(fleet.names)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="dicts or None"):
        _kernel(cfg, 1, fleet)
    with pytest.raises(ValueError, match="no candidates"):
        _kernel(cfg, 1, Fleet([], [], [], [], [], prompt_tokens=16, block_size=16))


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
        kernel_answers: list[bytes] = []
        fast = service.explain_json_now

        def counting(*args: Any, **kwargs: Any) -> bytes | None:
            answer = fast(*args, **kwargs)
            if answer is not None:
                kernel_answers.append(answer)
            return answer

        bodies = [
            {"model": "toy", "prompt": tokens},
            {"model": "toy", "prompt": tokens[:10]},
            {"model": "toy", "prompt": [900 + i for i in range(12)]},  # a miss: three-way tie
            {"model": "toy", "prompt": tokens, "cache_salt": "s"},
            {"model": "toy", "prompt": [5, 6, 7]},  # shorter than a block
        ]

        def answers() -> list[bytes]:
            out = []
            for body in bodies:
                state = service.policy.rng.getstate()
                r = httpx.post(f"{router.url}/route", json=body, timeout=10)
                assert r.status_code == 200, r.text
                service.policy.rng.setstate(state)  # (the other path draws the same tie-break)
                out.append(_VOLATILE.sub(b"", r.content))
            return out

        for proxied in (False, True):
            if proxied:  # predictions on the chosen target: the report's path inside the kernel's
                r = httpx.post(
                    f"{router.url}/v1/completions", json={"model": "toy", "prompt": tokens}, timeout=10
                )
                assert r.status_code == 200
                assert any(app.index._predicted.values())
            service.explain_json_now = counting  # type: ignore[method-assign]
            kernel_answers.clear()
            try:
                through_kernel = answers()
            finally:
                del service.explain_json_now
            assert len(kernel_answers) == len(bodies)
            service.explain_json_now = lambda *args, **kwargs: None  # type: ignore[method-assign]
            try:
                through_python = answers()
            finally:
                del service.explain_json_now
            assert through_kernel == through_python
        assert b'"PREDICTED"' in through_kernel[0] and b'"CPU"' in through_kernel[0]
    finally:
        router.stop()
        a.close()
        b.close()
