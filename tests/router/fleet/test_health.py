"""Health probes over the upstream pool against real backends on ephemeral ports: a healthy engine
(models and LoRA parents from /v1/models, load from /metrics), one that serves no model, one that
stalls past the probe timeout and a dead port; each unhealthy reason is logged once, not every round."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from backend_stub import probe_backend

from router.config import BackendConfig, HealthConfig, MembershipConfig
from router.fleet.health import HealthChecker
from router.fleet.load import LoadTracker
from router.fleet.membership import Membership
from router.net.upstream import UpstreamPool

MODELS = b'{"object": "list", "data": [{"id": "m"}, {"id": "lora-a", "parent": "m"}]}'
NO_MODELS = b'{"object": "list", "data": []}'
METRICS = b'vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 2.0\n'


def test_probes_models_metrics_and_one_log_line_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        servers = [
            await asyncio.start_server(probe_backend(MODELS, METRICS), "127.0.0.1", 0),
            await asyncio.start_server(probe_backend(NO_MODELS, METRICS), "127.0.0.1", 0),
            await asyncio.start_server(
                probe_backend(MODELS, METRICS, hold=lambda: asyncio.sleep(30)), "127.0.0.1", 0
            ),
        ]
        held = socket.socket()  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        ports = [s.sockets[0].getsockname()[1] for s in servers] + [held.getsockname()[1]]
        names = ["good", "empty", "stalled", "dead"]
        membership = Membership(MembershipConfig())
        membership.reconcile(
            "config", [BackendConfig(n, f"http://127.0.0.1:{p}") for n, p in zip(names, ports, strict=True)]
        )
        loads = LoadTracker([])
        for m in membership.members.values():
            for target in m.targets:
                loads.track(target)
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=0.5, scrape_metrics=True), pool, loads)
        try:
            with caplog.at_level("INFO", logger="kvrouter.backends"):
                t0 = time.monotonic()
                for _ in range(3):
                    await checker.check_all()
                assert time.monotonic() - t0 < 20  # the stalled backend costs its timeout, not 30 s
            good, empty, stalled, dead = (membership.get(n) for n in names)
            assert good is not None and empty is not None and stalled is not None and dead is not None
            assert good.healthy and good.models == {"m", "lora-a"} and good.lora_parents == {"lora-a": "m"}
            assert loads.get(("good", 0)).engine_waiting == 2.0
            assert not empty.healthy and empty.last_error == "serves no model"
            assert not stalled.healthy and "UpstreamTimeout" in stalled.last_error
            assert not dead.healthy and "UpstreamConnectError" in dead.last_error
            lines = [r.getMessage() for r in caplog.records]
            for name in ("empty", "stalled", "dead"):  # three rounds, one line each
                assert sum(f"backend {name} " in line for line in lines) == 1, lines
            assert sum("backend good is healthy" in line for line in lines) == 1, lines
        finally:
            pool.close()
            held.close()
            for s in servers:
                s.close()

    asyncio.run(main())


def test_a_nan_or_infinite_engine_figure_is_ignored() -> None:
    """vLLM's /metrics may print NaN: it made every candidate's cost NaN, so the policy found no
    cheapest one and every request was a 500."""
    from router.decision.policy import Candidate, Policy, PolicyConfig

    odd = b'vllm:num_requests_waiting{model_name="m"} NaN\nvllm:num_requests_running{model_name="m"} +Inf\n'

    async def main() -> None:
        server = await asyncio.start_server(probe_backend(MODELS, odd), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        membership = Membership(MembershipConfig())
        membership.reconcile("config", [BackendConfig("a", f"http://127.0.0.1:{port}")])
        loads = LoadTracker([])
        loads.track(("a", 0))
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=2, scrape_metrics=True), pool, loads)
        try:
            await checker.check_all()
            load = loads.get(("a", 0))
            assert load.engine_waiting == 0.0 and load.engine_running == 0.0
            policy = Policy(PolicyConfig(waiting_weight=1.0))
            cands = [Candidate("a", 0, 0, {}, load), Candidate("b", 0, 0, {}, loads.get(("b", 0)))]
            assert policy.choose(4, 16, cands).backend in ("a", "b")
        finally:
            pool.close()
            server.close()

    asyncio.run(main())


def test_lora_adapters_are_learned_for_models_given_in_the_config() -> None:
    """With `models` in the config, /v1/models was never read, so an adapter listed there was
    taken for a base model: its prompts were keyed without the adapter's name, crediting blocks
    the engine cannot reuse and missing the adapter's own."""

    async def main() -> None:
        with_cards = await asyncio.start_server(probe_backend(MODELS, METRICS), "127.0.0.1", 0)
        no_cards = await asyncio.start_server(probe_backend(b"not json", METRICS), "127.0.0.1", 0)
        ports = [s.sockets[0].getsockname()[1] for s in (with_cards, no_cards)]
        membership = Membership(MembershipConfig())
        membership.reconcile(
            "config",
            [
                BackendConfig("a", f"http://127.0.0.1:{ports[0]}", models=["m", "lora-a"]),
                BackendConfig("b", f"http://127.0.0.1:{ports[1]}", models=["m"]),
            ],
        )
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=2), pool, LoadTracker([]))
        try:
            await checker.check_all()
            a, b = membership.get("a"), membership.get("b")
            assert a is not None and b is not None
            assert membership.lora_name("lora-a") == "lora-a" and membership.lora_name("m") is None
            assert a.models == {"m", "lora-a"} and a.healthy
            assert b.healthy and b.models == {"m"}  # its unreadable /v1/models costs nothing
        finally:
            pool.close()
            for s in (with_cards, no_cards):
                s.close()

    asyncio.run(main())


def test_a_round_awaits_the_probe_a_join_started_instead_of_probing_twice() -> None:
    """A member that just joined is probed at once (probe_soon); a round that starts meanwhile (the
    first round at start-up, right after the config file's members joined) waits for that probe
    rather than sending a second one, unless the member's spec changed since it started."""

    async def main() -> None:
        requests = 0
        gate = asyncio.Event()

        async def hold() -> None:
            nonlocal requests
            requests += 1
            await gate.wait()

        async def until(n: int) -> None:
            while requests < n:
                await asyncio.sleep(0.001)

        server = await asyncio.start_server(probe_backend(MODELS, METRICS, hold=hold), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        membership = Membership(MembershipConfig())
        membership.reconcile("config", [BackendConfig("a", url)])
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=30), pool, None)
        try:
            member = membership.get("a")
            assert member is not None
            checker.probe_soon(member)
            round_ = asyncio.ensure_future(checker.check_all())
            await asyncio.wait_for(until(1), 30)  # the join's probe waits for its /health answer
            gate.set()
            await asyncio.wait_for(round_, 30)
            assert member.healthy and member.models == {"m", "lora-a"}
            assert requests == 2  # /health and /v1/models, once
            # a spec replaced while its probe runs: the round probes the new one itself
            gate.clear()
            checker.probe_soon(member)
            member.set_spec(BackendConfig("a", url + "/"))
            round_ = asyncio.ensure_future(checker.check_all())
            await asyncio.wait_for(until(4), 30)  # both probes wait for their /health answers
            gate.set()
            await asyncio.wait_for(round_, 30)
            assert requests == 6
        finally:
            gate.set()
            await checker.stop()
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_no_probe_starts_once_the_checker_stops() -> None:
    """A member added while the router stops (the membership tick applying another worker's admin
    change runs until it is stopped after health) is not probed: such a probe used to outlive the
    stop, and its end raised in a callback."""

    async def main() -> None:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx["message"]))
        held = socket.socket()  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        membership = Membership(MembershipConfig())
        membership.reconcile("config", [BackendConfig("a", url), BackendConfig("b", url)])
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=5), pool, None)
        a, b = membership.get("a"), membership.get("b")
        assert a is not None and b is not None
        try:
            checker.probe_soon(a)
            stopping = asyncio.ensure_future(checker.stop())
            await asyncio.sleep(0)  # (one turn: stop() now waits for the probe it cancelled)
            checker.probe_soon(b)
            await asyncio.wait_for(stopping, 30)
            assert not checker._probes and not [t for t in asyncio.all_tasks() if "probe" in t.get_name()]
        finally:
            pool.close()
            held.close()
        assert errors == [] and b.checked_at == 0

    asyncio.run(main())


def test_a_backend_that_goes_down_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A healthy engine that stops answering logged "is unhealthy" at the failure that crossed
    ``unhealthy_after`` and "is not healthy" (the same error) at the next probe; one marked down by a
    failed request likewise logged twice. One line each, and a new reason is still logged."""

    async def main() -> None:
        server = await asyncio.start_server(probe_backend(MODELS, METRICS), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        membership = Membership(MembershipConfig())
        membership.reconcile("config", [BackendConfig("e", f"http://127.0.0.1:{port}")])
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=2, unhealthy_after=2), pool, None)
        member = membership.get("e")
        assert member is not None
        try:
            with caplog.at_level("INFO", logger="kvrouter.backends"):
                await checker.check_all()
                assert member.healthy
                server.close()
                await server.wait_closed()
                pool.close()  # (no kept-alive connection: the next probes connect, and are refused)
                for _ in range(4):
                    await checker.check_all()
                assert not member.healthy
                down = [r.getMessage() for r in caplog.records if "healthy" in r.getMessage()]
                assert len(down) == 2 and down[1].startswith(
                    "backend e is unhealthy: UpstreamConnectError"
                ), down
                caplog.clear()
                server = await asyncio.start_server(probe_backend(MODELS, METRICS), "127.0.0.1", port)
                await checker.check_all()
                assert member.healthy
                checker.mark_failed(member, "connection reset by the engine")  # (a proxied request)
                server.close()
                await server.wait_closed()
                pool.close()
                for _ in range(3):
                    await checker.check_all()
                assert not member.healthy and "UpstreamConnectError" in member.last_error
                lines = [r.getMessage() for r in caplog.records]
                assert lines == [
                    "backend e is healthy (models: lora-a, m)",
                    "backend e marked unhealthy: connection reset by the engine",
                ], lines
        finally:
            pool.close()
            server.close()

    asyncio.run(main())


def test_a_round_spreads_its_probes_over_the_interval_with_bounded_concurrency() -> None:
    """Members probed before start over the round's spread, member k (in order) not before its
    slot k x spread / n; never more than ``max_concurrent`` probes in flight. (Only lower bounds
    on time: a loaded machine makes probes late, never early.)"""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        arrivals: list[float] = []
        inflight = peak = 0

        async def hold() -> None:
            nonlocal inflight, peak
            arrivals.append(loop.time())
            inflight += 1
            peak = max(peak, inflight)
            await asyncio.sleep(0.02)  # (the engine's answer takes a while: probes overlap)
            inflight -= 1

        server = await asyncio.start_server(probe_backend(MODELS, METRICS, hold=hold), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        names = [f"e{i}" for i in range(6)]
        membership = Membership(MembershipConfig())
        membership.reconcile("config", [BackendConfig(n, url, models=["m"]) for n in names])
        pool = UpstreamPool()
        checker = HealthChecker(membership, HealthConfig(timeout_s=10), pool, None, max_concurrent=2)
        try:
            # (each probe asks /health, then /v1/models for LoRA adapters: two requests per member)
            await checker.check_all(spread_s=0.6)  # never probed: all at once (bounded), no waiting
            assert len(arrivals) == 12 and peak <= 2
            assert all(m.healthy for m in membership.members.values())
            arrivals.clear()
            peak = 0
            began = loop.time()
            await checker.check_all(spread_s=0.6)
            assert len(arrivals) == 12 and peak <= 2
            for k in range(6):  # before slot k, only members 0..k-1 can have asked anything
                assert sorted(arrivals)[2 * k] - began >= k * 0.1 - 0.005, (k, arrivals)
            # a member removed before its moment is not probed
            arrivals.clear()
            round_ = asyncio.ensure_future(checker.check_all(spread_s=0.6))
            membership.remove("e5", "test")
            await asyncio.wait_for(round_, 30)
            assert len(arrivals) == 10
        finally:
            await checker.stop()
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
