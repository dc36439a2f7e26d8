"""Passive ejection and the retry budget: the breaker on its own (a fake clock), then end to end with
real engines that fail on demand behind the real router."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from harness import TIMEOUT, FakeEngine, RouterRunner, wait_for

from router.fleet.breaker import BreakerConfig, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_cools_down_doubles_and_closes() -> None:
    clock = Clock()
    b = Breakers(BreakerConfig(eject_after=3, eject_s=5, max_eject_s=12), clock)
    assert b.available("a") and b.state("a") == "closed"
    assert not b.failure("a") and not b.failure("a")
    b.success("a")  # a success in between: the count starts again
    assert not b.failure("a") and not b.failure("a")
    assert b.failure("a")  # the third in a row: ejected
    assert not b.available("a") and b.state("a") == "open" and b.ejected_total == {"a": 1}
    clock.now += 5
    assert b.available("a") and b.state("a") == "half_open"  # on trial
    assert b.failure("a")  # one failure on trial: ejected again, for twice as long
    clock.now += 9.9
    assert not b.available("a")
    clock.now += 0.1
    assert b.available("a")
    assert b.failure("a")
    clock.now += 11.9
    assert not b.available("a")  # 20 s capped at 12
    clock.now += 0.1
    b.success("a")  # the trial succeeded: closed, and the next ejection starts again at 5 s
    assert b.state("a") == "closed"
    for _ in range(3):
        b.failure("a")
    clock.now += 5
    assert b.available("a")
    assert Breakers(BreakerConfig(eject_after=0)).failure("x") is False  # off


def test_a_backend_failing_every_trial_for_days_stays_ejected_between_trials() -> None:
    """The doubling cooldown overflowed at the 1025th ejection in a row (~17 h at the defaults):
    the failure raised, and the backend stayed half-open, taking its full share, for good."""
    clock = Clock()
    b = Breakers(BreakerConfig(eject_after=1, eject_s=1.0, max_eject_s=60.0), clock)
    for _ in range(3000):
        assert b.failure("a")
        assert not b.available("a") and b.state("a") == "open"
        clock.now += 60.0  # the cooldown, capped: its trial comes, and fails again
    assert b.ejected_total == {"a": 3000}


def test_retry_budget() -> None:
    clock = Clock()
    b = Breakers(BreakerConfig(retry_ratio=0.1, retry_min_per_s=1.0), clock)
    spent = sum(b.allow_retry() for _ in range(100))
    assert spent == 10  # the initial bucket (10 x min_per_s), then nothing
    for _ in range(100):
        b.request()
    assert sum(b.allow_retry() for _ in range(100)) == 10  # a tenth of a retry per request
    clock.now += 3
    assert sum(b.allow_retry() for _ in range(100)) == 3  # plus min_per_s per second
    assert b.retries_refused == 300 - 23


BS = 4


@pytest.fixture
def fleet(
    request: pytest.FixtureRequest, ctx: zmq.Context[Any], tmp_path: Path
) -> Iterator[tuple[RouterRunner, dict[str, FakeEngine]]]:
    engines = {n: FakeEngine(n, ctx) for n in ("a", "b")}
    eject_after = getattr(request, "param", 2)
    toml = (
        f"block_size = {BS}\n[health]\ninterval_s = 60\n"
        f"[health.breaker]\neject_after = {eject_after}\neject_s = 1.0\nmax_eject_s = 4\n"
        "retry_ratio = 0.1\nretry_min_per_s = 0.5\n"
    )
    toml += "\n".join(e.backend_toml() for e in engines.values())
    router = RouterRunner(toml, tmp_path)
    yield router, engines
    router.stop()
    for e in engines.values():
        e.close()


def metric(router: RouterRunner, name: str, labels: str = "") -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_backend_that_fails_requests_is_ejected_then_readmitted(
    fleet: tuple[RouterRunner, dict[str, FakeEngine]],
) -> None:
    router, eng = fleet
    prompt = [5 + i for i in range(8 * BS)]
    eng["a"].announce(prompt, BS)  # a holds the prefix: the policy prefers it
    body = {"model": "toy", "prompt": prompt}
    wait_for(
        lambda: httpx.post(f"{router.url}/route", json=body).json()["backend"] == "a", "a holds the prefix"
    )
    eng["a"].mode = "error500"  # answers its health probe, fails every request
    for i in range(20):  # (after a failure, predict-on-route may send the prefix to b directly)
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": prompt[: -i or None]})
        assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == "b"  # retried on b if need be
        if len(eng["a"].requests) == 2:
            break
    assert len(eng["a"].requests) == 2
    assert metric(router, "kvrouter_backend_ejections_total", '{backend="a"}') == 1
    debug = httpx.get(f"{router.url}/debug/index").json()
    assert {x["name"]: x["breaker"] for x in debug["backends"]} == {"a": "open", "b": "closed"}
    # ejected: the next requests go straight to b (no failed attempt first), although a caches the prefix
    before = len(eng["a"].requests)
    for _ in range(3):
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.headers["x-kvrouter-backend"] == "b"
    assert len(eng["a"].requests) == before
    # it recovers; after the cooldown a trial request succeeds and it is back
    eng["a"].mode = "ok"

    def back() -> bool:
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
        return r.headers["x-kvrouter-backend"] == "a"

    wait_for(back, "a readmitted after its cooldown")
    assert httpx.get(f"{router.url}/debug/index").json()["backends"][0]["breaker"] == "closed"


@pytest.mark.parametrize("fleet", [0], indirect=True)  # ejection off: the budget alone limits retries
def test_the_retry_budget_stops_a_retry_storm(fleet: tuple[RouterRunner, dict[str, FakeEngine]]) -> None:
    router, eng = fleet
    for e in eng.values():
        e.mode = "error500"
    total = sum(len(e.requests) for e in eng.values())
    n = 60
    for i in range(n):
        r = httpx.post(
            f"{router.url}/v1/completions", json={"model": "toy", "prompt": f"q{i}"}, timeout=TIMEOUT
        )
        assert r.status_code == 500  # the backend's own error, passed through
    sent = sum(len(e.requests) for e in eng.values()) - total
    allowed = metric(router, "kvrouter_retries_total", '{result="allowed"}')
    refused = metric(router, "kvrouter_retries_total", '{result="refused"}')
    assert sent == n + allowed  # every retry is one more request to the fleet
    assert allowed <= 5 + 0.1 * n + 0.5 * 30  # the bucket, the per-request share, the per-second floor
    assert allowed >= 5 and refused == n - allowed  # retried while the budget lasted, then not


def test_the_router_running_out_of_file_descriptors_does_not_blame_the_backends(
    fleet: tuple[RouterRunner, dict[str, FakeEngine]],
) -> None:
    """EMFILE on the router's own connect was a connect error to the backend: health marked it
    failed and the breaker counted it, so a moment of fd shortage became fleet-wide 503s that
    outlived it. Now the request gets a 503 saying the router is overloaded, and nothing else."""
    import resource

    router, _ = fleet
    router.app.pool.max_idle_per_host = 0  # every request opens its connection to the engine
    for stack in router.app.pool._idle.values():
        for conn in stack:
            conn.close()
        stack.clear()
    with socket.create_connection(("127.0.0.1", router.server.port), timeout=TIMEOUT) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # accepted: it needs no new descriptor
        body = b'{"model": "toy", "prompt": "x y z"}'
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # no new descriptor in this process, whatever is closed meanwhile: a new one must be below
        # the limit, and 0-2 are taken (a limit at the lowest free number raced with the closes of
        # other threads: a connect got a freed number, and the engine's accept failed instead)
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))
        try:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            answer = b""
            while b"}}" not in answer:
                chunk = s.recv(4096)
                assert chunk, answer
                answer += chunk
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert answer.startswith(b"HTTP/1.1 503") and b"overloaded" in answer, answer
    assert all(m.healthy for m in router.app.membership.members.values())
    assert all(router.app.breakers.state(n) == "closed" for n in ("a", "b"))
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": "x y z"}, timeout=TIMEOUT)
    assert r.status_code == 200
