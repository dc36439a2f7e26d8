"""Flow control behind the endpoint picker: ext_proc streams over real gRPC against the real picker
(the router on its own thread), in front of real mock engines, as Envoy sends them.

The picker's decision counts a request as in flight until its response ends (or its stream is
reset), so the tests saturate the fleet with streams that were picked and whose responses have not
ended, and free it by ending them: nothing here waits on an engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import zmq
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from harness import FakeEngine, RouterRunner, wait_for

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
DEST = "x-gateway-destination-endpoint"
WAIT = 20.0


class Fleet:
    def __init__(self, router: RouterRunner, engines: list[FakeEngine]) -> None:
        self.router = router
        self.engines = engines

    @property
    def address(self) -> str:
        assert self.router.app.epp is not None
        return f"127.0.0.1:{self.router.app.epp.port}"

    def depth(self) -> int:
        flow = self.router.app.flow
        assert flow is not None
        return sum(flow.depth().values())

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.router.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name and all(p in head for p in labels.split(",") if p):
                total += float(value)
        return total


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    made: list[Any] = []
    ctx: zmq.Context[Any] = zmq.Context()

    def build(flow: str, n: int = 1) -> Fleet:
        engines = [FakeEngine(f"e{i}", ctx) for i in range(n)]
        made.extend(engines)
        toml = (
            "block_size = 4\n[epp]\nenabled = true\nport = 0\nhealth_port = 0\nfallbacks = 0\n"
            f"[flow]\nenabled = true\n{flow}\n" + "\n".join(e.backend_toml() for e in engines)
        )
        router = RouterRunner(toml, tmp_path)
        made.append(router)
        wait_for(lambda: router.app.membership.any_routable(), "backends healthy")
        return Fleet(router, engines)

    yield build
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterRunner) else thing.close()
    ctx.destroy(linger=0)


def completion(i: int = 0) -> bytes:
    return json.dumps({"model": "toy", "prompt": [5 + i, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 2}).encode()


def headers_msg(extra: dict[str, str] | None = None) -> Any:
    hs = {
        ":method": "POST",
        ":path": "/v1/completions",
        ":authority": "gw",
        "content-type": "application/json",
    }
    hs.update(extra or {})
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]
            )
        ),
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX
        ),
    )


class Req:
    """One ext_proc stream: the request sent at once, its answer read when the test asks."""

    def __init__(self, ch: grpc.aio.Channel, i: int, headers: dict[str, str] | None = None) -> None:
        self.call = ep_grpc.ExternalProcessorStub(ch).Process()
        self.i = i
        self.headers = headers

    async def send(self) -> Req:
        await self.call.write(headers_msg(self.headers))
        await self.call.write(
            ep.ProcessingRequest(request_body=ep.HttpBody(body=completion(self.i), end_of_stream=True))
        )
        return self

    async def answer(self) -> Any:
        msg = await asyncio.wait_for(self.call.read(), WAIT)
        assert msg is not grpc.aio.EOF, "the picker ended the stream without answering"
        if msg.WhichOneof("response") == "request_headers":  # (picked: the body comes back after)
            while True:
                m = await asyncio.wait_for(self.call.read(), WAIT)
                if m.request_body.response.body_mutation.streamed_response.end_of_stream:
                    break
        return msg

    async def finish(self) -> None:
        """The engine's response, as Envoy passes it: headers, one body piece, the end."""
        hs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
        await self.call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hs)))
        await asyncio.wait_for(self.call.read(), WAIT)
        body = b'{"choices": [{"text": "x"}]}'
        await self.call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=body, end_of_stream=True)))
        await asyncio.wait_for(self.call.read(), WAIT)
        await self.call.done_writing()
        while (await asyncio.wait_for(self.call.read(), WAIT)) is not grpc.aio.EOF:
            pass


async def until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def picked(msg: Any) -> bool:
    return bool(msg.WhichOneof("response") == "request_headers")


def immediate(msg: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    assert msg.WhichOneof("response") == "immediate_response", msg
    im = msg.immediate_response
    hs = {
        h.header.key: (h.header.raw_value or h.header.value.encode()).decode() for h in im.headers.set_headers
    }
    return im.status.code, hs, json.loads(im.body)


def test_queued_requests_are_decided_when_a_response_ends(fleet: Callable[..., Fleet]) -> None:
    """max_active = 1: one request picked, the next two wait in the router (not answered), /route says
    "would queue"; each response's end lets exactly the next one through, in arrival order."""
    f = fleet("max_active = 1")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            waiting = [await Req(ch, 1 + i).send() for i in range(2)]
            await until(lambda: f.depth() == 2, "two queued")
            route = httpx.post(f.router.url + "/route", content=completion(9)).json()["flow"]
            assert route["would_queue"] is True and route["queued"] == 2
            reads = [asyncio.ensure_future(w.answer()) for w in waiting]
            await asyncio.sleep(0)  # (nothing is answered while the fleet is saturated)
            assert not any(r.done() for r in reads)
            await first.finish()
            assert picked(await reads[0])
            assert f.depth() == 1 and not reads[1].done()
            await waiting[0].finish()
            assert picked(await reads[1])
            await waiting[1].finish()
        assert f.depth() == 0
        assert f.metric("kvrouter_flow_dispatched_total") == 3  # (/route only says "would queue")
        assert f.metric("kvrouter_flow_wait_seconds_count") == 3
        assert f.router.app.flow is not None and f.router.app.flow.describe()["granted"] == 0

    asyncio.run(go())


def test_ttl_answers_503_or_429_with_retry_after(fleet: Callable[..., Fleet]) -> None:
    """Past flow.ttl_s: an ImmediateResponse 503 (429 for a sheddable band, here by
    x-gateway-inference-objective), OpenAI-shaped, with Retry-After; nothing was picked for it."""
    f = fleet("max_active = 1\nttl_s = 0.5\n[flow.objectives]\nbatch = -5\n")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            t0 = time.monotonic()
            normal = await Req(ch, 1, {"x-gateway-inference-fairness-id": "tenant-a"}).send()
            batch = await Req(ch, 2, {"x-gateway-inference-objective": "batch"}).send()
            await until(lambda: f.depth() == 2, "two queued")
            flow = f.router.app.flow
            assert flow is not None
            assert {r["flow"] for r in flow.top_flows()} == {"id:tenant-a", "(anonymous)"}
            a, b = immediate(await normal.answer()), immediate(await batch.answer())
            assert time.monotonic() - t0 >= 0.5
            assert (a[0], b[0]) == (503, 429)
            for _, hs, err in (a, b):
                assert int(hs["retry-after"]) >= 1 and hs["content-type"] == "application/json"
                assert err["error"]["code"] == "flow_ttl" and err["error"]["message"]
            for r in (normal, batch):
                await r.call.done_writing()
                assert await r.call.code() == grpc.StatusCode.OK
            await first.finish()
        assert f.metric("kvrouter_flow_rejected_total", 'reason="ttl"') == 2
        assert f.metric("kvrouter_flow_rejected_total", 'band="-5",reason="ttl"') == 1
        assert f.metric("kvrouter_epp_immediate_responses_total", 'status="429"') == 1

    asyncio.run(go())


def test_full_band_rejects_at_once(fleet: Callable[..., Fleet]) -> None:
    f = fleet("max_active = 1\nmax_band_requests = 1")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            queued = await Req(ch, 1).send()
            await until(lambda: f.depth() == 1, "one queued")
            status, hs, err = immediate(await (await Req(ch, 2).send()).answer())
            assert status == 503 and err["error"]["code"] == "flow_queue_full" and "retry-after" in hs
            await first.finish()
            assert picked(await queued.answer())
            await queued.finish()

    asyncio.run(go())


def test_a_stream_reset_while_queued_leaves_the_queue(fleet: Callable[..., Fleet]) -> None:
    """The gateway resets a queued request's stream (its client went away): it leaves the queue at
    once, counted as a disconnect, and the next freed slot goes to the request queued after it."""
    f = fleet("max_active = 1")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            gone = await Req(ch, 1).send()
            await until(lambda: f.depth() == 1, "queued")
            gone.call.cancel()
            await until(lambda: f.depth() == 0, "left the queue on reset")
            later = await Req(ch, 2).send()
            await until(lambda: f.depth() == 1, "the next one queued")
            await first.finish()
            assert picked(await later.answer())
            # a picked stream reset before its response ends frees its room too
            after = await Req(ch, 3).send()
            await until(lambda: f.depth() == 1, "queued behind the reset one")
            later.call.cancel()
            assert picked(await after.answer())
            await after.finish()
        assert f.metric("kvrouter_flow_rejected_total", 'reason="disconnect"') == 1
        assert f.metric("kvrouter_flow_dispatched_total") == 3
        flow = f.router.app.flow
        assert flow is not None
        await until(
            lambda: flow.describe()["granted"] == 0 and f.router.app.loads.get(("e0", 0)).active == 0,
            "all released",
        )

    asyncio.run(go())


def test_a_higher_band_leaves_first(fleet: Callable[..., Fleet]) -> None:
    """x-kvrouter-priority / x-gateway-inference-objective choose the band, as in the proxy."""
    f = fleet("max_active = 1\npriorities = [10]\n[flow.objectives]\ncritical = 20\n")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            low = await Req(ch, 1).send()
            await until(lambda: f.depth() == 1, "default band queued")
            mid = await Req(ch, 2, {"x-kvrouter-priority": "15"}).send()
            top = await Req(ch, 3, {"x-gateway-inference-objective": "critical"}).send()
            await until(lambda: f.depth() == 3, "three queued")
            order = []
            current = first
            reads = {r: asyncio.ensure_future(r.answer()) for r in (low, mid, top)}
            for _ in range(3):
                await current.finish()
                done, _ = await asyncio.wait(
                    reads.values(), return_when=asyncio.FIRST_COMPLETED, timeout=WAIT
                )
                assert len(done) == 1
                current = next(r for r, t in reads.items() if t in done)
                assert picked(reads.pop(current).result())
                order.append(current.i)
            await current.finish()
            assert order == [3, 2, 1]

    asyncio.run(go())


def test_the_reserve_for_higher_bands_holds_in_the_picker(fleet: Callable[..., Fleet]) -> None:
    """higher_band_reserve through the picker, as in the proxy (the same controller): the default
    band stops at one of max_active 2, the higher band's request is picked at once past the queued
    default one, which goes when the room is below its ceiling again."""
    f = fleet("max_active = 2\npriorities = [10]\nhigher_band_reserve = 0.5")

    async def go() -> None:
        async with grpc.aio.insecure_channel(f.address) as ch:
            first = await Req(ch, 0).send()
            assert picked(await first.answer())
            low = await Req(ch, 1).send()
            await until(lambda: f.depth() == 1, "the default band's next request queued")
            assert f.metric("kvrouter_flow_reserve_held_total", 'band="0"') == 1
            high = await Req(ch, 2, {"x-kvrouter-priority": "10"}).send()
            assert picked(await high.answer())
            assert f.depth() == 1
            read = asyncio.ensure_future(low.answer())
            await first.finish()
            await high.finish()
            assert picked(await read)
            await low.finish()
        assert f.metric("kvrouter_flow_dispatched_total", 'band="10"') == 1
        assert f.metric("kvrouter_flow_dispatched_total", 'band="0"') == 2

    asyncio.run(go())
