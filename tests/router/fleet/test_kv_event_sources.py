"""``kv_events = "auto"``: the router follows the event streams an engine lists at GET /kv_event_sources.

The engine here is a stand-in: a real HTTP server (stdlib, on a port it keeps across its restarts)
answering /health, /v1/models and /kv_event_sources the way vLLM does (``tcp://*:P`` per DP rank),
and real KV event publishers with replay sockets on ports chosen by the OS, which are NOT vLLM's
port + rank layout, so only the listing can tell the router where they are. Blocks are published
before the router (re)subscribes: only the bootstrap replay can bring them in. The router is the
real one (KVRouter on `kvrouter serve`'s HTTP server, tests/harness.py), probed with real HTTP.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from harness import TIMEOUT, RouterRunner, wait_for

from router.config import ConfigError, parse_backend, parse_config
from router.fleet.kvsources import ListingError, listed_sources
from sim.publisher import BlockStored, KVEventPublisher

BS = 4
TOPIC = "kv-events"


def ids(seed: int, n: int) -> list[int]:
    return [7 + (seed * 97 + i * 13) % 1500 for i in range(n)]


class StandIn:
    """An engine's HTTP face and its publishers; ``stop``/``start`` restarts it on the same HTTP port
    with new publishers (new ports, seq from 0, empty replay buffers)."""

    def __init__(self, ctx: zmq.Context[Any], ranks: int, listing: bool = True) -> None:
        self.ctx = ctx
        self.ranks = ranks
        self.listing = listing
        self.healthy = True
        self.publishers: list[KVEventPublisher] = []
        self.listing_reads = 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.http: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_rank(self, avoid: set[str] = frozenset()) -> KVEventPublisher:  # type: ignore[assignment]
        """A publisher for the next rank on ports the OS picks (none of ``avoid``: a restart's
        ports must differ from the old ones for the test to mean anything)."""
        while True:
            pub = KVEventPublisher(
                endpoint="tcp://127.0.0.1:0",
                replay_endpoint="tcp://127.0.0.1:0",
                topic=TOPIC,
                dp_rank=len(self.publishers),
                ctx=self.ctx,
            )
            if pub.endpoint not in avoid and pub.replay_endpoint not in avoid:
                self.publishers.append(pub)
                return pub
            pub.close()

    def sources(self) -> dict[str, Any]:
        """What vLLM answers: each rank's config as the engine was given it (wildcard host)."""
        out = {}
        for p in self.publishers:
            assert p.replay_endpoint is not None
            out[str(p.dp_rank)] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": p.endpoint.replace("127.0.0.1", "*"),
                "replay_endpoint": p.replay_endpoint.replace("127.0.0.1", "*"),
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": TOPIC,
            }
        return out

    def announce(self, rank: int, tokens: list[int], seed: int) -> None:
        n = len(tokens) // BS
        hashes = [(seed * 1_000_003 + i) % 2**64 for i in range(n)]
        self.publishers[rank].publish([BlockStored(hashes, None, tokens[: n * BS], BS, None, "GPU", None)])

    def start(self, avoid: set[str] = frozenset()) -> StandIn:  # type: ignore[assignment]
        while len(self.publishers) < self.ranks:
            self.add_rank(avoid)
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health" and stand_in.healthy:
                    self._answer(200, {})
                elif self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": "toy", "object": "model"}]})
                elif self.path == "/kv_event_sources" and stand_in.listing:
                    stand_in.listing_reads += 1
                    self._answer(200, stand_in.sources())
                else:
                    self._answer(404 if self.path != "/health" else 503, {"detail": "Not Found"})

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)  # (SO_REUSEADDR: same port)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()
        return self

    def stop(self) -> None:
        """The engine goes: HTTP server and publishers closed (a restart gets new ones)."""
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            assert self.thread is not None
            self.thread.join(TIMEOUT)
            self.http = None
        for p in self.publishers:
            p.close()
        self.publishers = []


@pytest.fixture
def made(ctx: zmq.Context[Any]) -> Iterator[list[Any]]:
    """Stand-ins and routers a test makes, all stopped at its end (routers first)."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.stop()


def router_for(tmp: Path, made: list[Any], e: StandIn, extra: str = "", dp_size: int = 1) -> RouterRunner:
    toml = (
        f"block_size = {BS}\n[health]\ninterval_s = 0.1\nunhealthy_after = 1\n{extra}\n"
        f'[[backends]]\nname = "e"\nurl = "{e.url}"\nkv_events = "auto"\nmodels = ["toy"]\n'
        f"dp_size = {dp_size}\n"
    )
    router = RouterRunner(toml, tmp)
    made.append(router)
    return router


def debug(router: RouterRunner) -> dict[str, Any]:
    r = httpx.get(f"{router.url}/debug/index", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def backend(router: RouterRunner) -> dict[str, Any]:
    (b,) = debug(router)["backends"]
    return dict(b)


def matched(router: RouterRunner, tokens: list[int]) -> dict[int, int]:
    """DP rank -> blocks of ``tokens`` the router's index holds there (from POST /route)."""
    r = httpx.post(f"{router.url}/route", json={"model": "toy", "prompt": tokens}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return {c["dp_rank"]: c["matched_blocks"] for c in r.json()["candidates"]}


def endpoints(router: RouterRunner) -> dict[int, tuple[str, str]]:
    return {s["dp_rank"]: (s["endpoint"], s["bootstrap"]) for s in debug(router)["sources"]}


def published(e: StandIn) -> dict[int, tuple[str, str]]:
    return {p.dp_rank: (p.endpoint, "done") for p in e.publishers}


def test_auto_follows_every_listed_rank_with_its_replay_and_a_restart_on_new_ports(
    ctx: zmq.Context[Any], tmp_path: Path, made: list[Any]
) -> None:
    e = StandIn(ctx, ranks=2).start()
    made.append(e)
    a, b = ids(1, 3 * BS), ids(2, 2 * BS)
    e.announce(0, a, seed=1)
    e.announce(1, b, seed=2)
    # (no periodic re-read: the probe that sees the engine back must read the listing again)
    router = router_for(tmp_path, made, e, extra="kv_sources_refresh_s = 0")  # dp_size 1; it lists 2
    wait_for(lambda: backend(router)["state"] == "ready", "the auto backend ready")
    # ready only once both listed ranks were subscribed and bootstrapped from their replay sockets
    assert endpoints(router) == published(e)
    assert (backend(router)["dp_size"], backend(router)["kv_sources"]) == (2, "listed")
    assert matched(router, a) == {0: 3, 1: 0}
    assert matched(router, b) == {0: 0, 1: 2}

    # the engine restarts with its publishers on other ports; what it announces before the router
    # re-reads its listing comes in through the new replay sockets, the old ranks' blocks go
    old = published(e)
    old_ports = {p.endpoint for p in e.publishers} | {p.replay_endpoint or "" for p in e.publishers}
    e.stop()
    wait_for(lambda: not backend(router)["healthy"], "the probe to see the engine gone")
    e.start(avoid=old_ports)
    c, d = ids(3, 2 * BS), ids(4, 4 * BS)
    e.announce(0, c, seed=3)
    e.announce(1, d, seed=4)
    assert published(e).keys() == old.keys() and all(published(e)[r] != old[r] for r in old)
    wait_for(lambda: endpoints(router) == published(e), "the router to follow the new ports")
    wait_for(lambda: backend(router)["healthy"], "the engine healthy again")
    assert matched(router, c) == {0: 2, 1: 0}
    assert matched(router, d) == {0: 0, 1: 4}
    assert matched(router, a) == {0: 0, 1: 0} and matched(router, b) == {0: 0, 1: 0}

    # live events go on the new streams
    f = ids(5, 5 * BS)
    e.announce(1, f, seed=5)
    wait_for(lambda: matched(router, f) == {0: 0, 1: 5}, "a live event on the new rank 1")


def test_auto_follows_a_dp_size_change_on_the_periodic_reread(
    ctx: zmq.Context[Any], tmp_path: Path, made: list[Any]
) -> None:
    e = StandIn(ctx, ranks=1).start()
    made.append(e)
    router = router_for(tmp_path, made, e, extra="kv_sources_refresh_s = 0.2", dp_size=3)
    wait_for(lambda: backend(router)["state"] == "ready", "the auto backend ready")
    assert backend(router)["dp_size"] == 1  # the listing's, not the declared 3
    assert set(matched(router, ids(9, 2 * BS))) == {0}

    # a rank added while the engine stays healthy: no failed probe, the periodic re-read finds it
    e.add_rank()
    g = ids(6, 3 * BS)
    e.announce(1, g, seed=6)
    wait_for(lambda: backend(router)["dp_size"] == 2, "the new DP size")
    wait_for(lambda: matched(router, g) == {0: 0, 1: 3}, "rank 1's replayed blocks")
    assert endpoints(router) == published(e)

    # and back to one rank: rank 1's source and its blocks go
    e.publishers.pop().close()
    wait_for(lambda: backend(router)["dp_size"] == 1, "the DP size back to 1")
    wait_for(lambda: set(endpoints(router)) == {0}, "rank 1's source removed")
    assert matched(router, g) == {0: 0}


def test_an_engine_without_the_listing_falls_back_to_vllm_default_port_with_one_log_line(
    ctx: zmq.Context[Any], tmp_path: Path, made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    e = StandIn(ctx, ranks=0, listing=False).start()
    made.append(e)
    with caplog.at_level(logging.INFO, logger="kvrouter.membership"):
        router = router_for(tmp_path, made, e, extra="kv_sources_refresh_s = 0.1", dp_size=2)
        wait_for(lambda: backend(router)["state"] == "ready", "the backend ready on the fallback")
        checks = router.app.health.checks
        wait_for(lambda: router.app.health.checks >= checks + 5, "five more probe rounds")
    assert backend(router)["kv_sources"] == "fallback"
    assert endpoints(router) == {0: ("tcp://127.0.0.1:5557", "none"), 1: ("tcp://127.0.0.1:5558", "none")}
    said = [r.getMessage() for r in caplog.records if "kv_event_sources" in r.getMessage()]
    assert len(said) == 1 and "404" in said[0] and "tcp://127.0.0.1:5557" in said[0], said


def test_listing_rules_and_config_errors() -> None:
    entry = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "t"}
    dp, sources, skipped = listed_sources(
        {
            "0": {**entry, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100"},
            "1": {**entry, "endpoint": "tcp://10.1.1.1:6001", "replay_endpoint": None},  # vLLM connects
            "2": {**entry, "endpoint": "inproc://kv_dp2"},
            "3": {**entry, "enable_kv_cache_events": False, "endpoint": "tcp://*:6003"},
        },
        "e",
        "http://[fd00::5]:8000",
    )
    assert dp == 4 and len(skipped) == 2
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.bind, s.topic) for s in sources] == [
        (0, "tcp://[fd00::5]:6000", "tcp://[fd00::5]:6100", False, "t"),
        (1, "tcp://10.1.1.1:6001", None, True, "t"),
    ]
    for bad in ({"1": {**entry, "endpoint": "tcp://*:1"}}, {"x": {}}, [], {"0": {**entry, "endpoint": 5}}):
        with pytest.raises(ListingError):
            listed_sources(bad, "e", "http://h:1")

    ok = parse_backend({"url": "http://h:8000", "kv_events": "auto"}, "e")
    assert ok.kv_events == "auto"
    for body, field in (
        ({"url": "http://h:8000", "kv_events": "auto", "kv_replay": "tcp://h:5558"}, "kv_replay"),
        ({"url": "http://h:8000", "kv_events": "auto", "kv_bind": True}, "kv_bind"),
    ):
        with pytest.raises(ConfigError) as exc:
            parse_backend(body, "e")
        assert exc.value.field == field and "auto" in str(exc.value)
    with pytest.raises(ConfigError, match="kv_sources_refresh_s"):
        parse_config(
            {"backends": [{"name": "e", "url": "http://h:1"}], "health": {"kv_sources_refresh_s": -1}}
        )
