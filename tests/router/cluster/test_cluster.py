"""Router replicas over a real Redis server: shared load, shared predictions, session affinity across
replicas, a dead replica's load expiring, and the store killed and restarted under traffic.

Every replica is a real router (``KVRouter`` on the HTTP server of ``kvrouter serve``, or a
``kvrouter serve`` process where it must die like one) in front of the same real fake engines, over
real sockets.
Conditions are waited on with generous deadlines, never with fixed sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.harness import TIMEOUT, FakeEngine, RouterRunner, wait_for
from tests.redis_harness import RedisServer

BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK))  # 8 blocks, announced by nobody
BODY = {"model": "toy", "prompt": PROMPT, "max_tokens": 4}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def engines(ctx: zmq.Context[Any]) -> Iterator[list[FakeEngine]]:
    es = [FakeEngine(f"e{i}", ctx) for i in range(3)]
    yield es
    for e in es:
        e.mode = "ok"
    for e in es:
        e.close()


def config(engines: list[FakeEngine], redis_url: str | None, **cluster: Any) -> str:
    lines = [
        f"block_size = {BLOCK}",
        "",
        "[index]",
        "predict_ttl_s = 60.0",
        "",
        "[health]",
        "interval_s = 0.5",
    ]
    lines += ["", "[cluster]"]
    if redis_url:
        lines.append(f'redis_url = "{redis_url}"')
    base: dict[str, Any] = {"heartbeat_s": 0.25, "peer_timeout_s": 30.0, "reconnect_max_s": 0.5}
    for k, v in {**base, **cluster}.items():
        value = f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
        lines.append(f"{k} = {value}")
    return "\n".join(lines) + "\n\n" + "\n".join(e.backend_toml() for e in engines)


class Replicas:
    """Several in-process routers on one config; stopped together."""

    def __init__(self, toml: str, tmp: Path, n: int) -> None:
        self.routers: list[RouterRunner] = []
        try:
            for _ in range(n):
                self.routers.append(RouterRunner(toml, tmp))
        except BaseException:
            self.stop()
            raise

    def __getitem__(self, i: int) -> RouterRunner:
        return self.routers[i]

    def stop(self) -> None:
        for r in self.routers:
            r.stop()


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator[Callable[[str, int], Replicas]]:
    made: list[Replicas] = []

    def make(toml: str, n: int) -> Replicas:
        reps = Replicas(toml, tmp_path, n)
        made.append(reps)
        return reps

    yield make
    for reps in made:
        reps.stop()


def debug(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(url + "/debug/index", timeout=10).json()
    return data


def peers_of(url: str) -> list[dict[str, Any]]:
    peers: list[dict[str, Any]] = debug(url)["cluster"].get("peers", [])
    return peers


def route(
    url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    resp = httpx.post(url + "/route", json=body or BODY, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def inflight(url: str) -> dict[str, int]:
    return {c["backend"]: c["inflight"] for c in route(url)["candidates"]}


def all_connected(reps: Replicas, peers: int) -> Callable[[], bool]:
    def check() -> bool:
        for r in reps.routers:
            c = debug(r.url)["cluster"]
            if not c["connected"] or len(c["peers"]) != peers:
                return False
        return True

    return check


def ready(urls: list[str], engines: int) -> None:
    for url in urls:
        wait_for(
            lambda u=url: (
                len(httpx.get(u + "/ready", timeout=5).json().get("healthy_backends", [])) == engines
            ),
            "every backend healthy",
        )


# --- shared load ---------------------------------------------------------------------------------


def test_two_replicas_share_in_flight_load(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url), 2)
    a, b = reps[0], reps[1]
    wait_for(all_connected(reps, 1), "both replicas connected and seeing each other")
    ready([a.url, b.url], 3)
    assert inflight(b.url) == {"e0": 0, "e1": 0, "e2": 0}
    for e in engines:
        e.mode = "stall"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, a.url + "/v1/completions", json=BODY, timeout=30)
        wait_for(lambda: sum(len(e.requests) for e in engines) == 1, "the request reaching an engine")
        stalled = next(e.name for e in engines if e.requests)
        # B never saw the request: only the store can tell it that A has one in flight there
        wait_for(lambda: inflight(b.url)[stalled] == 1, "replica B counting A's stalled request")
        assert sum(inflight(b.url).values()) == 1
        # and B places an unrelated prompt elsewhere for the same reason
        other = {"model": "toy", "prompt": [5] * (4 * BLOCK), "max_tokens": 4}
        assert route(b.url, other)["backend"] != stalled
        for e in engines:
            e.mode = "ok"
        assert fut.result().status_code == 200
    wait_for(lambda: sum(inflight(b.url).values()) == 0, "B seeing A's request finish")
    m = httpx.get(b.url + "/metrics", timeout=10).text
    assert "kvrouter_cluster_connected 1.0" in m
    assert 'kvrouter_cluster_messages_total{direction="received"}' in m
    assert re.search(r"^kvrouter_cluster_lag_seconds_count [1-9]", m, re.M)  # own messages came back


def test_cluster_metrics_are_exported_as_declared(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    from tests.test_deploy import CLUSTER_METRICS

    reps = cluster_of(config(engines, redis.url, session_header="x-session-id"), 1)
    wait_for(all_connected(reps, 0), "connected")
    ready([reps[0].url], 3)
    httpx.post(reps[0].url + "/v1/completions", json=BODY, headers={"x-session-id": "s"}, timeout=30)
    text = httpx.get(reps[0].url + "/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, (kind, labels) in CLUSTER_METRICS.items():
        assert (types.get(name) or types.get(name.removesuffix("_total"))) == kind, name
        sample = re.search(rf"^{re.escape(name)}(?:_bucket|_count)?\{{([^}}]*)\}}", text, re.MULTILINE)
        if sample:
            assert {kv.split("=")[0] for kv in sample.group(1).split(",") if kv} - {"le"} == set(labels), name
    assert 'kvrouter_session_affinity_total{result="new"} 1.0' in text


def test_a_clean_shutdown_withdraws_at_once(
    redis: RedisServer, engines: list[FakeEngine], tmp_path: Path
) -> None:
    toml = config(engines, redis.url, peer_timeout_s=120.0)  # expiry cannot explain what follows
    a = RouterRunner(toml, tmp_path)
    try:
        b = RouterRunner(toml, tmp_path)
        try:
            wait_for(lambda: len(peers_of(b.url)) == 1 and len(peers_of(a.url)) == 1, "peers seen")
            name = peers_of(b.url)[0]["name"]
            assert name.endswith(":8000")  # host:port of the peer, as configured
        finally:
            b.stop()
        wait_for(lambda: peers_of(a.url) == [], "A dropping B after its goodbye")
    finally:
        a.stop()


def test_replicas_assume_each_others_concurrent_decisions(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    # a 1 s publish interval makes "a decision within the window" easy to hit from a test; the
    # assumption alone (staggered replicas assume nothing: their own test below)
    reps = cluster_of(config(engines, redis.url, publish_interval_s=1.0, stagger_bursts=False), 2)
    wait_for(all_connected(reps, 1), "both replicas connected and seeing each other")
    ready([r.url for r in reps.routers], 3)
    # nobody has decided anything yet: each replica ranks itself alone
    assert all(debug(r.url)["cluster"]["assumed"]["replicas"] == 1 for r in reps.routers)
    for r in reps.routers:
        assert sum(c["assumed_blocks"] for c in route(r.url)["candidates"]) == 0  # nothing decided yet
    for r in reps.routers:
        assert httpx.post(r.url + "/v1/completions", json=BODY, timeout=30).status_code == 200

    def ranked() -> bool:
        assumed = [debug(r.url)["cluster"]["assumed"] for r in reps.routers]
        return sorted(a["rank"] for a in assumed) == [0, 1] and {a["replicas"] for a in assumed} == {2}

    wait_for(ranked, "both deciding, each seeing the other decide")

    def decided_then_assumes(url: str) -> bool:
        for other in reps.routers:  # both keep deciding, this one last
            if other.url != url:
                assert httpx.post(other.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        # a decision just made here means a burst: the peer's share of it is assumed somewhere
        return sum(c["assumed_blocks"] for c in route(url)["candidates"]) > 0

    for r in reps.routers:
        wait_for(lambda u=r.url: decided_then_assumes(u), "a decision followed by assumed peer load")
    m = httpx.get(reps[0].url + "/metrics", timeout=10).text
    assert re.search(r"^kvrouter_cluster_assumed_decisions_total [0-9.]+$", m, re.M)


def test_an_idle_peer_is_not_assumed_to_decide(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    """A standby replica (or one the balancer sends nothing) makes no decisions: the replica doing
    all the routing must not assume any from it, while the standby does see the active one decide."""
    reps = cluster_of(config(engines, redis.url, publish_interval_s=1.0), 2)
    wait_for(all_connected(reps, 1), "both replicas connected and seeing each other")
    ready([r.url for r in reps.routers], 3)
    active, standby = reps.routers

    def standby_sees_a_decider() -> bool:
        assert httpx.post(active.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        return bool(debug(standby.url)["cluster"]["assumed"]["replicas"] == 2)

    wait_for(standby_sees_a_decider, "the standby seeing the active replica decide")
    assert httpx.post(active.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    assert debug(active.url)["cluster"]["assumed"]["replicas"] == 1
    assert sum(c["assumed_blocks"] for c in route(active.url)["candidates"]) == 0


def test_staggered_replicas_hold_burst_decisions_by_rank(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url, publish_interval_s=1.0), 2)  # (staggered: the default)
    wait_for(all_connected(reps, 1), "both replicas connected and seeing each other")
    ready([r.url for r in reps.routers], 3)

    def both_ranked() -> bool:
        for r in reps.routers:
            assert httpx.post(r.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        return {debug(r.url)["cluster"]["assumed"]["replicas"] for r in reps.routers} == {2}

    wait_for(both_ranked, "both deciding, each seeing the other decide")
    second = next(r for r in reps.routers if debug(r.url)["cluster"]["assumed"]["rank"] == 1)
    first = next(r for r in reps.routers if r is not second)
    for _ in range(2):  # two requests within the window: a burst
        assert httpx.post(second.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        assert httpx.post(first.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    assumed = debug(second.url)["cluster"]["assumed"]
    assert assumed["staggered"] and assumed["held"] >= 1 and assumed["total"] == 0
    assert debug(first.url)["cluster"]["assumed"]["held"] == 0  # rank 0 never waits
    assert all(c["assumed_blocks"] == 0 for c in route(second.url)["candidates"])
    m = httpx.get(second.url + "/metrics", timeout=10).text
    found = re.search(r'^kvrouter_cluster_held_decisions_total\{unit="decisions"\} ([0-9.]+)$', m, re.M)
    assert found and float(found.group(1)) >= 1


def test_no_assumptions_when_turned_off(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(
        config(engines, redis.url, publish_interval_s=1.0, assume_concurrent_decisions=False), 2
    )
    wait_for(all_connected(reps, 1), "both replicas connected and seeing each other")
    ready([r.url for r in reps.routers], 3)
    assert "assumed" not in debug(reps[0].url)["cluster"]
    for _ in range(3):
        assert httpx.post(reps[0].url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        assert all(c["assumed_blocks"] == 0 for c in route(reps[0].url)["candidates"])


# --- shared predictions --------------------------------------------------------------------------


def test_three_replicas_share_predictions(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url), 3)
    wait_for(all_connected(reps, 2), "three replicas connected, two peers each")
    ready([r.url for r in reps.routers], 3)
    for r in reps.routers:
        assert route(r.url)["matched_blocks"] == 0
    resp = httpx.post(reps[0].url + "/v1/completions", json=BODY, timeout=30)
    assert resp.status_code == 200
    chosen = resp.headers["x-kvrouter-backend"]

    # no engine announced anything: B and C can only know from A's prediction
    def predicted_on_chosen(url: str) -> bool:
        r = route(url)
        c = next(c for c in r["candidates"] if c["backend"] == chosen)
        return c["blocks_by_medium"].get("PREDICTED", 0) == len(PROMPT) // BLOCK and r["backend"] == chosen

    for r in reps.routers[1:]:
        wait_for(lambda u=r.url: predicted_on_chosen(u), "the prediction reaching a peer")
    sent = debug(reps[0].url)["cluster"]
    assert sent["messages"]["sent"] >= 1 and sent["failures"]["decode"] == 0
    m = httpx.get(reps[1].url + "/metrics", timeout=10).text
    assert f'kvrouter_cluster_predicted_keys_total{{direction="received"}} {len(PROMPT) // BLOCK}.0' in m


def test_only_unconfirmed_blocks_are_sent(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url), 2)
    wait_for(all_connected(reps, 1), "connected")
    ready([r.url for r in reps.routers], 3)
    # e1 caches the first 5 blocks: every replica learns that from e1's own events
    engines[1].announce(PROMPT[: 5 * BLOCK], BLOCK)
    for r in reps.routers:
        wait_for(lambda u=r.url: route(u)["matched_blocks"] == 5, "the event reaching every replica")
    resp = httpx.post(reps[0].url + "/v1/completions", json=BODY, timeout=30)
    assert resp.headers["x-kvrouter-backend"] == "e1"
    wait_for(
        lambda: (
            debug(reps[0].url)["cluster"]["messages"]["sent"] > 0
            and 'kvrouter_cluster_predicted_keys_total{direction="sent"} 3.0'
            in httpx.get(reps[0].url + "/metrics", timeout=10).text
        ),
        "A sending the 3 blocks past the confirmed 5",
    )

    def b_sees_all_8() -> bool:
        c = next(c for c in route(reps[1].url)["candidates"] if c["backend"] == "e1")
        return bool(c["matched_blocks"] == 8 and c["blocks_by_medium"].get("PREDICTED") == 3)

    wait_for(b_sees_all_8, "B extending e1's confirmed 5 blocks with A's 3 predicted ones")


# --- session affinity ----------------------------------------------------------------------------


def test_session_affinity_across_replicas(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url, session_header="x-session-id", share_predictions=False), 3)
    wait_for(all_connected(reps, 2), "connected")
    ready([r.url for r in reps.routers], 3)
    sessions: list[str] = []
    first: dict[str, str] = {}
    # first turns, spread over the replicas: 6 sessions, more while all went to one engine (idle
    # engines tie and the policy breaks ties at random: 6 on one engine by chance is 1 run in 243)
    for i in range(30):
        if i >= 6 and len(set(first.values())) > 1:
            break
        s = f"conversation-{i}"
        body = {"model": "toy", "prompt": [7000 + i] * (4 * BLOCK), "max_tokens": 2}
        r = httpx.post(
            reps[i % 3].url + "/v1/completions", json=body, headers={"x-session-id": s}, timeout=30
        )
        assert r.status_code == 200
        sessions.append(s)
        first[s] = r.headers["x-kvrouter-backend"]
    assert len(set(first.values())) > 1  # nothing pinned them together: the policy spread them
    for r in reps.routers:  # every replica learns every pin
        for s, backend in first.items():
            wait_for(
                lambda u=r.url, s=s, b=backend: route(u, headers={"x-session-id": s})["backend"] == b,
                "the pin reaching every replica",
            )
    # later turns (another prompt: no cached prefix to follow) go to the same engine via any replica
    for turn in range(3):
        for i, s in enumerate(sessions):
            body = {"model": "toy", "prompt": [9000 + turn * 100 + i] * (4 * BLOCK), "max_tokens": 2}
            url = reps[(i + turn + 1) % 3].url
            r = httpx.post(url + "/v1/completions", json=body, headers={"x-session-id": s}, timeout=30)
            assert r.headers["x-kvrouter-backend"] == first[s], (s, turn)
    results = debug(reps[0].url)["cluster"]["sessions"]["results"]
    assert results["new"] >= 1 and results["kept"] + results["steered"] >= 1


def test_session_pin_yields_to_an_unhealthy_target(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url, session_header="x-session-id"), 2)
    wait_for(all_connected(reps, 1), "connected")
    ready([r.url for r in reps.routers], 3)
    h = {"x-session-id": "s-1"}
    r = httpx.post(reps[0].url + "/v1/completions", json=BODY, headers=h, timeout=30)
    pinned = r.headers["x-kvrouter-backend"]
    wait_for(lambda: route(reps[1].url, headers=h)["affinity"] in ("kept", "steered"), "B knowing the pin")
    engines[int(pinned[1])].close()  # the pinned engine dies
    wait_for(lambda: route(reps[1].url, headers=h)["affinity"] == "unavailable", "B noticing it is gone")
    r = httpx.post(reps[1].url + "/v1/completions", json=BODY, headers=h, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] != pinned
    moved = r.headers["x-kvrouter-backend"]
    wait_for(lambda: route(reps[0].url, headers=h)["backend"] == moved, "A learning the new pin")


# --- a dead replica ------------------------------------------------------------------------------


class ServeProcess:
    """``kvrouter serve`` as a child process (it can be SIGKILLed like a crashed pod)."""

    def __init__(self, toml: str, tmp: Path, port: int) -> None:
        path = tmp / f"serve-{port}.toml"
        if "[server]" in toml:
            toml = toml.replace("[server]", f"[server]\nport = {port}", 1)
        else:
            toml = toml.replace("[cluster]", f"[server]\nport = {port}\n\n[cluster]", 1)
        path.write_text(toml)
        self.log = open(tmp / f"serve-{port}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, "kvrouter serve exited"
            try:
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "kvrouter serve ready", timeout=90)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def test_a_dead_replicas_load_expires(
    redis: RedisServer, engines: list[FakeEngine], tmp_path: Path, cluster_of: Callable[[str, int], Replicas]
) -> None:
    from sim.routerproc import free_port

    toml = config(engines, redis.url, peer_timeout_s=1.5, heartbeat_s=0.25)
    dead = ServeProcess(toml, tmp_path, free_port())
    try:
        dead.wait_ready()
        reps = cluster_of(toml, 1)
        b = reps[0]
        wait_for(lambda: len(peers_of(b.url)) == 1, "B seeing the other replica")
        ready([b.url], 3)
        for e in engines:
            e.mode = "stall"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(httpx.post, dead.url + "/v1/completions", json=BODY, timeout=30)
            wait_for(lambda: sum(inflight(b.url).values()) == 1, "B counting the other replica's request")
            dead.stop(signal.SIGKILL)  # no goodbye: only the timeout can clear its load
            killed = time.monotonic()
            wait_for(lambda: sum(inflight(b.url).values()) == 0, "the dead replica's load expiring", 15)
            gone_after = time.monotonic() - killed
            for e in engines:
                e.mode = "ok"
        assert gone_after < 1.5 + 2.0, gone_after  # peer_timeout_s plus a heartbeat and polling slack
        assert peers_of(b.url) == []
        assert "kvrouter_cluster_peers_expired_total 1.0" in httpx.get(b.url + "/metrics", timeout=10).text
    finally:
        dead.stop(signal.SIGKILL)


# --- the store fails -----------------------------------------------------------------------------


def test_store_killed_and_restarted_under_traffic(
    redis: RedisServer, engines: list[FakeEngine], cluster_of: Callable[[str, int], Replicas]
) -> None:
    reps = cluster_of(config(engines, redis.url, session_header="x-session-id"), 2)
    wait_for(all_connected(reps, 1), "connected")
    ready([r.url for r in reps.routers], 3)
    statuses: list[int] = []
    sent = 0

    def traffic(until: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
        nonlocal sent
        deadline = time.monotonic() + limit_s
        with httpx.Client(timeout=30) as client:
            while not until():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                for i, r in enumerate(reps.routers):
                    body = {"model": "toy", "prompt": [100 + sent % 50] * (3 * BLOCK), "max_tokens": 2}
                    resp = client.post(
                        r.url + "/v1/completions", json=body, headers={"x-session-id": f"s{sent % 7}"}
                    )
                    statuses.append(resp.status_code)
                    sent += 1
                    if i == 0:
                        statuses.append(client.post(r.url + "/route", json=body).status_code)

    def state(connected: bool, peers: int) -> Callable[[], bool]:
        def check() -> bool:
            return all(
                debug(r.url)["cluster"]["connected"] is connected
                and len(debug(r.url)["cluster"]["peers"]) == peers
                for r in reps.routers
            )

        return check

    traffic(lambda: sent >= 20, "warm-up traffic")
    redis.kill()
    traffic(lambda: all(not debug(r.url)["cluster"]["connected"] for r in reps.routers), "noticing")
    before = sent
    traffic(lambda: sent >= before + 30, "traffic without the store")
    for r in reps.routers:
        c = debug(r.url)["cluster"]
        assert sum(c["failures"].values()) >= 1 and c["last_error"]
    redis.start()  # empty: a restarted store without persistence
    traffic(state(True, 1), "both replicas reconnected and resynchronised")
    before = sent
    traffic(lambda: sent >= before + 20, "traffic after the store's return")
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    # sharing works again: a stalled request through A counts in B's /route
    for e in engines:
        e.mode = "stall"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, reps[0].url + "/v1/completions", json=BODY, timeout=30)
        wait_for(lambda: sum(inflight(reps[1].url).values()) == 1, "load shared again")
        for e in engines:
            e.mode = "ok"
        assert fut.result().status_code == 200
    m = httpx.get(reps[0].url + "/metrics", timeout=10).text
    assert 'kvrouter_cluster_failures_total{kind="connect"}' in m


# --- worker processes and replicas --------------------------------------------------------------


def test_workers_are_replicas_without_double_counting(
    redis: RedisServer, engines: list[FakeEngine], tmp_path: Path, cluster_of: Callable[[str, int], Replicas]
) -> None:
    """``server.workers = 2`` with [cluster]: each worker is a replica for the store (predictions and pins
    reach its sibling), while in-flight load between the two goes through the local board only."""
    from sim.routerproc import free_port

    toml = config(engines, redis.url).replace("[cluster]", "[server]\nworkers = 2\n\n[cluster]", 1)
    two = ServeProcess(toml, tmp_path, free_port())
    try:
        two.wait_ready()
        b = cluster_of(config(engines, redis.url), 1)[0]
        wait_for(lambda: len(peers_of(b.url)) == 2, "B seeing both workers as replicas")

        def siblings_linked() -> bool:  # each worker sees its sibling (same process) and B
            peers = peers_of(two.url)
            return len(peers) == 2 and sum(p["same_process"] for p in peers) == 1

        wait_for(siblings_linked, "each worker seeing its sibling and B")
        ready([b.url, two.url], 3)
        for e in engines:
            e.mode = "stall"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, two.url + "/v1/completions", json=BODY, timeout=30)
            wait_for(lambda: sum(inflight(b.url).values()) == 1, "B counting the request")
            # whichever worker answers, it counts the request once (board or store, never both)
            wait_for(lambda: sum(inflight(two.url).values()) == 1, "the workers counting it")
            for _ in range(10):
                assert sum(inflight(two.url).values()) == 1
            for e in engines:
                e.mode = "ok"
            assert fut.result().status_code == 200
        wait_for(lambda: sum(inflight(b.url).values()) == 0, "B seeing it finish")
    finally:
        two.stop()


# --- the dashboard ----------------------------------------------------------------------------------


def test_dashboard_lists_the_peers_in_a_browser(
    redis: RedisServer,
    engines: list[FakeEngine],
    cluster_of: Callable[[str, int], Replicas],
    tmp_path: Path,
) -> None:
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium")
        pytest.skip("chromium is not installed")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    reps = cluster_of(config(engines, redis.url, session_header="x-session-id"), 2)
    wait_for(all_connected(reps, 1), "connected")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{reps[0].url}/dashboard")
            page.wait_for_selector("body[data-state=ok]", timeout=30_000)
            page.wait_for_function(
                "document.querySelectorAll('#replicas-body tr[data-replica]').length === 2", timeout=30_000
            )
            peer_id = debug(reps[1].url)["cluster"]["replica"]
            row = page.locator(f"#replicas-body tr[data-replica='{peer_id}']")
            assert "live" in row.inner_text() and "ago" in row.inner_text()
            assert page.locator("#replicas-summary").inner_text().startswith("connected to redis://")
            page.locator("#replicas").screenshot(
                path=os.environ.get("KVROUTER_SCREENSHOT_REPLICAS", str(tmp_path / "replicas.png"))
            )
        finally:
            browser.close()
    assert not errors, errors


def test_a_least_privilege_acl_user_connects(redis: RedisServer) -> None:
    """CLIENT SETNAME was required: a user granted exactly the commands the link runs got NOPERM
    and the replica retried for good, routing alone. The name is cosmetic now."""
    from router.cluster.resp import connect

    async def main() -> None:
        admin = await connect(redis.url, TIMEOUT)
        try:
            grant = "+publish +subscribe +set +get +pttl +hset +hkeys +hdel +del +scan +ping"
            acl = ["ACL", "SETUSER", "kv", "on", ">pw", "~kvrouter:*", "&kvrouter:*", *grant.split()]
            assert (await admin.execute([acl], TIMEOUT))[0] == b"OK"
        finally:
            admin.close()
        conn = await connect(f"redis://kv:pw@127.0.0.1:{redis.port}/0", TIMEOUT, client_name="kvrouter-x")
        try:
            assert (await conn.execute([["PING"]], TIMEOUT))[0] == b"PONG"
        finally:
            conn.close()

    asyncio.run(main())


def test_a_pipeline_cut_by_a_lost_connection_logs_no_unretrieved_errors(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the awaited (last) reply's error was retrieved: one dropped page of 2,000 commands
    logged 1,999 "Future exception was never retrieved" errors."""
    import gc

    from router.cluster.resp import connect

    async def main() -> None:
        conn = await connect(redis.url, TIMEOUT)
        try:
            page = [["GET", f"kvrouter:k{i}"] for i in range(2000)]
            pending = asyncio.ensure_future(conn.execute([["BLPOP", "kvrouter:none", "5"], *page], TIMEOUT))
            await asyncio.sleep(0.05)
            redis.kill()  # the store dies with the whole page waiting
            with pytest.raises(ConnectionError):
                await pending
        finally:
            conn.close()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
