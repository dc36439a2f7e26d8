"""Flow control end to end: the real router on `kvrouter serve`'s HTTP server, engines over real
HTTP that hold their requests until the test lets them go, real clients (httpx, raw sockets for a disconnect).

Every ordering assertion reads the order in which the engines *received* requests (each carries its
own ``x-request-id``, which the router forwards), so the tests check what the queue did, not timing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from harness import RouterRunner, ThreadedServer, wait_for

MODEL = "toy"


class GateEngine:
    """An OpenAI backend that holds each request until the test releases it (``release``), and
    counts how many it holds at once."""

    def __init__(self, name: str, held: bool = True) -> None:
        self.name = name
        self.held = held
        self.permits = 0
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.order: list[str] = []
        self.done = 0
        self.server = ThreadedServer(self._app()).start()

    @property
    def url(self) -> str:
        return self.server.url

    def release(self, n: int = 1) -> None:
        with self.lock:
            self.permits += n

    def open(self) -> None:
        self.held = False

    def toml(self) -> str:
        return f'[[backends]]\nname = "{self.name}"\nurl = "{self.url}"\nmodels = ["{MODEL}"]\n'

    def _take(self) -> bool:
        with self.lock:
            if not self.held or self.permits > 0:
                if self.held:
                    self.permits -= 1
                return True
            return False

    def _app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            with engine.lock:
                engine.in_flight += 1
                engine.max_in_flight = max(engine.max_in_flight, engine.in_flight)
                engine.order.append(request.headers.get("x-request-id", ""))
            try:
                if body.get("stream"):
                    return StreamingResponse(engine._stream(), media_type="text/event-stream")
                while not engine._take():  # (the mock engine's own wait: the router is not polled)
                    await asyncio.sleep(0.002)
                return JSONResponse(
                    {
                        "id": "x",
                        "object": "text_completion",
                        "model": MODEL,
                        "choices": [{"text": engine.name}],
                    }
                )
            finally:
                if not body.get("stream"):
                    with engine.lock:
                        engine.in_flight -= 1
                        engine.done += 1

        return app

    async def _stream(self) -> Any:
        try:
            for i in range(3):
                yield f"data: {json.dumps({'choices': [{'text': f'w{i}'}]})}\n\n".encode()
                while i == 1 and not self._take():
                    await asyncio.sleep(0.002)
            yield b"data: [DONE]\n\n"
        finally:
            with self.lock:
                self.in_flight -= 1
                self.done += 1

    def close(self) -> None:
        self.server.stop()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., tuple[RouterRunner, list[GateEngine]]]]:
    made: list[Any] = []

    def build(n: int = 1, flow: str = "", held: bool = True) -> tuple[RouterRunner, list[GateEngine]]:
        engines = [GateEngine(f"e{i}", held) for i in range(n)]
        made.extend(engines)
        toml = (
            "block_size = 4\n"
            + (f"[flow]\nenabled = true\n{flow}\n" if flow else "")
            + "\n".join(e.toml() for e in engines)
        )
        router = RouterRunner(toml, tmp_path)
        made.append(router)
        wait_for(lambda: router.app.membership.any_routable(), "backends healthy")
        return router, engines

    yield build
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterRunner) else thing.close()


def body(i: int = 0, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5 + i, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 4, **extra}


def metric(router: RouterRunner, name: str, labels: str = "") -> float:
    text = httpx.get(router.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(part in (m.group(1) or "") for part in labels.split(",") if part):
            total += float(m.group(2))
    return total


class Clients:
    """Requests sent from threads (the test thread stays free to release engines and wait)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = ThreadPoolExecutor(64)
        self.client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=200))

    def send(self, rid: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Future[Any]:
        hdrs = {"x-request-id": rid, **(headers or {})}
        return self.pool.submit(self.client.post, self.url + "/v1/completions", json=payload, headers=hdrs)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


def depth(router: RouterRunner) -> int:
    flow = router.app.flow
    assert flow is not None
    return sum(flow.depth().values())


# ---- flow off / not saturated -----------------------------------------------------------------------


def test_off_and_unsaturated_answer_the_same(make: Callable[..., Any]) -> None:
    """[flow] absent and [flow] on with room give the same answers; /route only adds "flow"."""
    off, _ = make(held=False)
    on, _ = make(flow="max_active = 256", held=False)
    assert off.app.flow is None and off.app.loads.on_free is None and off.app.service.flow_open is None
    for i in range(3):
        a = httpx.post(off.url + "/v1/completions", json=body(i))
        b = httpx.post(on.url + "/v1/completions", json=body(i))
        assert (a.status_code, a.content) == (b.status_code, b.content) == (200, a.content)
    ra = httpx.post(off.url + "/route", json=body(1)).json()
    rb = httpx.post(on.url + "/route", json=body(1)).json()
    assert "flow" not in ra
    flow = rb.pop("flow")
    assert flow["would_queue"] is False and flow["queued"] == 0
    for r in (ra, rb):
        r.pop("timings_us"), r.pop("time")
        for c in r["candidates"]:
            c.pop("load", None)
    assert ra == rb
    assert metric(on, "kvrouter_flow_dispatched_total") == 3  # (the /route lookups never queue)
    assert metric(on, "kvrouter_flow_queue_depth") == 0


# ---- overload ----------------------------------------------------------------------------------------


def test_overload_queue_holds_the_excess(make: Callable[..., Any]) -> None:
    """More requests than the engines may hold: the router holds the rest, the engines never pass
    the threshold, every request is answered and none is lost."""
    router, engines = make(2, flow="max_active = 2\nttl_s = 60\nrestrict_to_room = true")
    clients = Clients(router.url)
    try:
        futs = [clients.send(f"r{i}", body(i)) for i in range(30)]
        wait_for(
            lambda: sum(e.in_flight for e in engines) == 4 and depth(router) == 26, "4 in flight, 26 queued"
        )
        route = httpx.post(router.url + "/route", json=body(99)).json()["flow"]
        assert route["would_queue"] is True and route["reason"]
        assert all(t["room"] == 0 and t["saturated"] for t in route["targets"])
        assert metric(router, "kvrouter_flow_queue_depth", 'band="0"') == 26
        for e in engines:
            e.open()
        statuses = [f.result(timeout=60).status_code for f in futs]
        assert statuses == [200] * 30
        assert all(e.max_in_flight <= 2 for e in engines), [e.max_in_flight for e in engines]
        assert sum(e.done for e in engines) == 30 and sorted(r for e in engines for r in e.order) == sorted(
            f"r{i}" for i in range(30)
        )
        assert depth(router) == 0 and metric(router, "kvrouter_flow_dispatched_total") == 30
        assert metric(router, "kvrouter_flow_wait_seconds_count") == 30
    finally:
        clients.close()


def test_ttl_sheds_with_429_or_503_and_streams_in_flight_go_on(make: Callable[..., Any]) -> None:
    """Past flow.ttl_s a queued request gets 503 (429 in a sheddable band) with Retry-After, before
    the engines free anything; the streams in flight meanwhile finish whole."""
    router, [engine] = make(1, flow="max_active = 2\nttl_s = 0.5\npriorities = [-1]")
    clients = Clients(router.url)
    try:
        streams = [clients.send(f"s{i}", body(i, stream=True)) for i in range(2)]
        wait_for(lambda: engine.in_flight == 2, "two streams in flight")
        t0 = time.monotonic()
        normal = clients.send("n", body(5))
        sheddable = clients.send("x", body(6), {"x-kvrouter-priority": "-1"})
        a, b = normal.result(timeout=30), sheddable.result(timeout=30)
        waited = time.monotonic() - t0
        assert (a.status_code, b.status_code) == (503, 429)
        assert waited >= 0.5 and sorted(engine.order) == ["s0", "s1"]  # (neither reached the engine)
        for r in (a, b):
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "flow_ttl" and err["message"]
        assert metric(router, "kvrouter_flow_rejected_total", 'reason="ttl"') == 2
        engine.release(2)
        for s in streams:
            r = s.result(timeout=30)
            assert r.status_code == 200 and r.text.count("data: ") == 4 and r.text.endswith("[DONE]\n\n")
    finally:
        clients.close()


def test_full_band_rejects_at_once(make: Callable[..., Any]) -> None:
    router, [engine] = make(1, flow="max_active = 1\nmax_band_requests = 2")
    clients = Clients(router.url)
    try:
        first = clients.send("a", body(0))
        wait_for(lambda: engine.in_flight == 1, "one in flight")
        queued = [clients.send(f"q{i}", body(i)) for i in range(2)]
        wait_for(lambda: depth(router) == 2, "two queued")
        r = httpx.post(router.url + "/v1/completions", json=body(9))
        assert r.status_code == 503 and r.json()["error"]["code"] == "flow_queue_full"
        assert int(r.headers["retry-after"]) >= 1
        engine.open()
        assert [f.result(timeout=30).status_code for f in [first, *queued]] == [200, 200, 200]
        assert metric(router, "kvrouter_flow_rejected_total", 'reason="queue_full"') == 1
    finally:
        clients.close()


def test_client_disconnect_leaves_the_queue(make: Callable[..., Any]) -> None:
    router, [engine] = make(1, flow="max_active = 1")
    clients = Clients(router.url)
    try:
        first = clients.send("a", body(0))
        wait_for(lambda: engine.in_flight == 1, "one in flight")
        raw = json.dumps(body(1)).encode()
        port = int(router.url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: gone\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        wait_for(lambda: depth(router) == 1, "queued")
        sock.close()
        wait_for(lambda: depth(router) == 0, "left the queue on disconnect")
        assert metric(router, "kvrouter_flow_rejected_total", 'reason="disconnect"') == 1
        later = clients.send("b", body(2))
        wait_for(lambda: depth(router) == 1, "the next one queued")
        engine.release(1)
        wait_for(lambda: engine.order == ["a", "b"], "the next request dispatched, not the gone one")
        engine.open()
        assert first.result(timeout=30).status_code == 200 and later.result(timeout=30).status_code == 200
        assert "gone" not in engine.order
    finally:
        clients.close()


# ---- priority and fairness ---------------------------------------------------------------------------


def test_high_band_dispatches_first(make: Callable[..., Any]) -> None:
    """Queued default-band requests wait while a higher band's, queued after them, go first; an
    objective maps to its configured priority."""
    router, [engine] = make(1, flow="max_active = 1\npriorities = [10]\nobjectives = { critical = 20 }")
    clients = Clients(router.url)
    try:
        futs = [clients.send("first", body(0))]
        wait_for(lambda: engine.in_flight == 1, "one in flight")
        futs += [clients.send(f"low{i}", body(i)) for i in range(5)]
        wait_for(lambda: depth(router) == 5, "default band queued")
        futs += [clients.send(f"high{i}", body(i), {"x-kvrouter-priority": "15"}) for i in range(3)]
        futs.append(clients.send("crit", body(0), {"x-gateway-inference-objective": "critical"}))
        wait_for(lambda: depth(router) == 9, "higher bands queued")
        assert router.app.flow is not None and router.app.flow.depth() == {20: 1, 10: 3, 0: 5}
        for n in range(2, 11):
            engine.release(1)
            wait_for(functools.partial(lambda k: len(engine.order) == min(k, 10), n), f"dispatch {n}")
        engine.open()
        assert all(f.result(timeout=30).status_code == 200 for f in futs)
        order = engine.order[1:]
        assert order[0] == "crit" and set(order[1:4]) == {"high0", "high1", "high2"}, order
        assert sorted(order[4:]) == [f"low{i}" for i in range(5)]
        assert metric(router, "kvrouter_flow_dispatched_total", 'band="10"') == 3
    finally:
        clients.close()


def test_flooding_flow_gets_its_fair_share(make: Callable[..., Any]) -> None:
    """A flow that queues 10x the others' requests gets at most its share of the dispatches while
    the others have requests waiting; flows are told apart by the fairness header, else the API key,
    else ``user``."""
    router, [engine] = make(1, flow="max_active = 1")
    clients = Clients(router.url)
    try:
        futs = [clients.send("first", body(0))]
        wait_for(lambda: engine.in_flight == 1, "one in flight")
        futs += [
            clients.send(f"flood{i}", body(i), {"x-gateway-inference-fairness-id": "flood"})
            for i in range(20)
        ]
        wait_for(lambda: depth(router) == 20, "the flood queued")
        futs += [clients.send(f"key{i}", body(i), {"authorization": "Bearer k1"}) for i in range(2)]
        futs += [clients.send(f"user{i}", body(i, user="alice")) for i in range(2)]
        wait_for(lambda: depth(router) == 24, "the others queued")
        top = router.app.flow.top_flows() if router.app.flow is not None else []
        assert top[0] == {"band": 0, "flow": "id:flood", "queued": 20} and len(top) == 3
        assert all("k1" not in row["flow"] for row in top)  # (a key is shown as a digest)
        shown = httpx.get(router.url + "/dashboard/data").json()["flow"]
        assert shown["depth"] == {"0": 24} and shown["top_flows"][0]["flow"] == "id:flood"
        for n in range(2, 8):
            engine.release(1)
            wait_for(functools.partial(lambda k: len(engine.order) == k, n), f"dispatch {n}")
        window = engine.order[1:7]  # six dispatches while all three flows wait
        assert sum(r.startswith("flood") for r in window) <= 2, window
        assert (
            sum(r.startswith("key") for r in window) == 2 and sum(r.startswith("user") for r in window) == 2
        )
        engine.open()
        assert all(f.result(timeout=60).status_code == 200 for f in futs)
    finally:
        clients.close()


def test_any_target_mode_still_queues(make: Callable[..., Any]) -> None:
    """restrict_to_room = false (the default): the decision sees every candidate, the queue still
    holds the excess."""
    router, [engine] = make(1, flow="max_active = 1")
    assert router.app.service.flow_open is None and router.app.flow is not None
    clients = Clients(router.url)
    try:
        futs = [clients.send(f"r{i}", body(i)) for i in range(4)]
        wait_for(lambda: engine.in_flight == 1 and depth(router) == 3, "one in flight, three queued")
        engine.open()
        assert [f.result(timeout=30).status_code for f in futs] == [200] * 4 and engine.max_in_flight == 1
    finally:
        clients.close()


def test_restrict_to_room_keeps_a_band_below_its_ceiling(make: Callable[..., Any]) -> None:
    """restrict_to_room with higher_band_reserve: a default-band request is decided among the
    engines below the band's ceiling (1 of max_active 2 here), a higher band's among those below
    max_active; /route shows the candidates each band's decision would weigh, and the proxy sends
    the next default request to the engine still below the ceiling."""
    flow = "max_active = 2\npriorities = [10]\nhigher_band_reserve = 0.5\nrestrict_to_room = true"
    high = {"x-kvrouter-priority": "10"}
    router, engines = make(2, flow=flow)
    clients = Clients(router.url)
    try:
        futs = [clients.send("d0", body(0))]
        wait_for(lambda: sum(e.in_flight for e in engines) == 1, "one default request in flight")
        busy = next(e for e in engines if e.in_flight == 1)
        idle = next(e for e in engines if e is not busy)

        def candidates(headers: dict[str, str] | None = None) -> list[str]:
            r = httpx.post(router.url + "/route", json=body(9), headers=headers).json()
            assert r["flow"]["would_queue"] is False, r["flow"]
            return sorted(c["backend"] for c in r["candidates"])

        assert candidates() == [idle.name]  # (busy is at the default band's ceiling)
        assert candidates(high) == sorted(e.name for e in engines)  # (busy has room for band 10)
        futs.append(clients.send("d1", body(1)))
        wait_for(lambda: idle.in_flight == 1, "the second default request on the other engine")
        assert busy.in_flight == 1 and busy.order == ["d0"] and idle.order == ["d1"]
        for e in engines:
            e.open()
        assert [f.result(timeout=30).status_code for f in futs] == [200] * 2
    finally:
        clients.close()


def test_reserve_lets_a_higher_band_past_a_full_lower_band(make: Callable[..., Any]) -> None:
    """higher_band_reserve = 0.5 of max_active 2: the default band stops at one request in flight,
    so while its next request queues, a higher band's reaches the engine at once; /route and the
    metrics say the default one is held back by the reserve. Without the reserve the default band
    takes both slots and the higher band's request waits behind them."""
    flow = "max_active = 2\npriorities = [10]"
    high = {"x-kvrouter-priority": "10"}
    router, [engine] = make(1, flow=flow + "\nhigher_band_reserve = 0.5")
    plain, [other] = make(1, flow=flow)
    clients, others = Clients(router.url), Clients(plain.url)
    try:
        futs = [clients.send("d0", body(0))]
        wait_for(lambda: engine.in_flight == 1, "the default band's one slot taken")
        futs.append(clients.send("d1", body(1)))
        wait_for(lambda: depth(router) == 1, "the next default request queued")
        held = httpx.post(router.url + "/route", json=body(9)).json()["flow"]
        assert held["would_queue"] is True and held["room"] == 0 and held["reserved"] == 1, held
        assert "reserved for higher bands" in held["reason"]
        assert held["targets"][0]["saturated"] == [
            "active 1 >= 1 (max_active 2 less higher_band_reserve for the bands above)"
        ]
        ahead = httpx.post(router.url + "/route", json=body(9), headers=high).json()["flow"]
        assert ahead["would_queue"] is False and ahead["room"] == 1 and "reserved" not in ahead
        assert metric(router, "kvrouter_flow_reserve_held_total", 'band="0"') == 1
        futs.append(clients.send("h0", body(2), high))
        wait_for(lambda: engine.order == ["d0", "h0"], "the higher band's request sent at once")
        assert depth(router) == 1 and engine.in_flight == 2  # (d1 still waits in the router)
        full = httpx.post(router.url + "/route", json=body(9), headers=high).json()["flow"]
        assert full["would_queue"] is True and full["reason"] == "every candidate is saturated"

        # the same traffic without the reserve: the default band fills the room, h0 waits
        plain_futs = [others.send("d0", body(0)), others.send("d1", body(1))]
        wait_for(lambda: other.in_flight == 2, "both slots taken by the default band")
        plain_futs.append(others.send("h0", body(2), high))
        wait_for(lambda: depth(plain) == 1, "the higher band's request queued")
        assert sorted(other.order) == ["d0", "d1"]
        assert "kvrouter_flow_reserve_held" not in httpx.get(plain.url + "/metrics").text
        assert "reserved" not in httpx.post(plain.url + "/route", json=body(9)).json()["flow"]

        engine.release(2)
        wait_for(lambda: engine.order[2:] == ["d1"], "d1 sent once the room is free")
        engine.open()
        other.open()
        assert [f.result(timeout=30).status_code for f in futs + plain_futs] == [200] * 6
        assert other.order[2] == "h0"
        assert metric(router, "kvrouter_flow_dispatched_total", 'band="10"') == 1
    finally:
        clients.close()
        others.close()


def test_reserve_scales_each_lower_band(tmp_path: Path) -> None:
    """Each band below the highest keeps (1 - reserve) of the room of the band above it, rounded
    down, at least 1; the scraped engine brakes are the same for every band."""
    from router.config import load_config
    from router.fleet.load import LoadTracker
    from router.flow.config import FlowConfig
    from router.flow.saturation import Saturation

    path = tmp_path / "f.toml"
    path.write_text(
        "[flow]\nmax_active = 8\npriorities = [10, -1]\nhigher_band_reserve = 0.25\n"
        "[flow.objectives]\ncritical = 20\n"
        '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    sat = Saturation(load_config(path).flow, LoadTracker())
    assert sat.limits == {20: (8, 65536), 10: (6, 49152), 0: (4, 36864), -1: (3, 27648)}
    tight = FlowConfig(max_active=2, max_pending_prefill_tokens=0, higher_band_reserve=0.9, priorities=[2])
    assert Saturation(tight, LoadTracker()).limits == {2: (2, 0), 0: (1, 0)}  # (0 stays "off")


def test_config_rejects_bad_flow_keys(tmp_path: Path) -> None:
    from router.config import ConfigError, load_config

    for bad in (
        "ttl_s = 0",
        "max_kv_usage = 2.0",
        "priorities = [" + ",".join(map(str, range(20))) + "]",
        "higher_band_reserve = 0.95",
        "higher_band_reserve = -0.1",
        "higher_band_reserve = nan",
    ):
        path = tmp_path / "f.toml"
        path.write_text(f'[flow]\n{bad}\n[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\n')
        with pytest.raises(ConfigError, match="flow"):
            load_config(path)


def test_every_flow_key_is_documented() -> None:
    import msgspec

    from router.flow.config import FlowConfig

    doc = (Path(__file__).resolve().parents[3] / "docs" / "flow-control.md").read_text()
    for f in msgspec.structs.fields(FlowConfig):
        assert re.search(rf"^{f.name} = |^\[flow\.{f.name}\]", doc, re.MULTILINE), (
            f"docs/flow-control.md lacks {f.name}"
        )
