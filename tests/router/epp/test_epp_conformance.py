"""A black-box conformance suite for Endpoint Picker Protocol endpoint pickers (EPPs).

It speaks only the protocol: Envoy's ext_proc gRPC service (as Envoy would, message by message)
and the standard gRPC health service. Nothing here looks inside the picker, so any EPP can be
pointed at it:

    EPP_ADDRESS=10.0.0.5:9002 EPP_HEALTH_ADDRESS=10.0.0.5:9003 \\
    EPP_ENDPOINTS=10.0.1.1:8000,10.0.1.2:8000 EPP_MODEL=my-model \\
    pytest tests/router/epp/test_epp_conformance.py

``EPP_ENDPOINTS``: the pool's ready endpoints; ``EPP_MODEL``: a model they serve. Optional:
``EPP_UNREADY_ADDRESS`` (a picker whose pool has no ready endpoint: the 503 case),
``EPP_MAX_STREAMS`` (where the picker sheds: the 429 case), ``EPP_MAX_BODY_BYTES`` (its body
limit). A case whose setting is absent is skipped. Without ``EPP_ADDRESS`` the suite runs against
kvrouter's own picker in front of fake engines.

Each test names the rule it checks: "MUST" rules are the protocol document's (GIE's Endpoint Picker
Protocol, v1.0.0); "kvrouter" rules are this project's promises beyond it (OpenAI-shaped errors for
malformed traffic, a stream never left hanging).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import zmq
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
WAIT = 10.0


@dataclass
class Target:
    address: str
    health: str
    endpoints: list[str]
    model: str
    unready: str | None = None
    max_streams: int | None = None
    max_body_bytes: int | None = None


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if os.environ.get("EPP_ADDRESS"):
        yield Target(
            os.environ["EPP_ADDRESS"],
            os.environ.get("EPP_HEALTH_ADDRESS", os.environ["EPP_ADDRESS"]),
            os.environ["EPP_ENDPOINTS"].split(","),
            os.environ["EPP_MODEL"],
            os.environ.get("EPP_UNREADY_ADDRESS"),
            int(os.environ["EPP_MAX_STREAMS"]) if os.environ.get("EPP_MAX_STREAMS") else None,
            int(os.environ["EPP_MAX_BODY_BYTES"]) if os.environ.get("EPP_MAX_BODY_BYTES") else None,
        )
        return
    from harness import FakeEngine, RouterRunner

    tmp = tmp_path_factory.mktemp("conformance")
    ctx: zmq.Context[Any] = zmq.Context()
    engines = [FakeEngine(n, ctx) for n in ("a", "b", "c")]
    head = "block_size = 4\n[server]\nmax_body_bytes = 65536\n"
    epp = "[epp]\nenabled = true\nport = 0\nhealth_port = 0\nmax_streams = 3\nfallbacks = 2\n"
    router = RouterRunner(head + epp + "\n".join(e.backend_toml() for e in engines), tmp)
    # a second picker whose only backend never answers: no ready endpoint
    down = RouterRunner(
        head + epp + '[[backends]]\nname = "gone"\nurl = "http://127.0.0.1:1"\nmodels = ["toy"]\n',
        tmp,
    )
    try:
        assert router.app.epp is not None and down.app.epp is not None
        yield Target(
            f"127.0.0.1:{router.app.epp.port}",
            f"127.0.0.1:{router.app.epp.health_port}",
            [f"127.0.0.1:{e.server.port}" for e in engines],
            "toy",
            f"127.0.0.1:{down.app.epp.port}",
            3,
            65536,
        )
    finally:
        down.stop()
        router.stop()
        for e in engines:
            e.close()
        ctx.destroy(linger=0)


# --- speaking ext_proc as Envoy does ---------------------------------------------------------------


def headers_msg(
    path: str = "/v1/completions",
    end: bool = False,
    mode: int = FULL_DUPLEX,
    subset: list[str] | None = None,
    extra: dict[str, str] | None = None,
) -> Any:
    hs = {":method": "POST", ":path": path, ":authority": "gateway", "content-type": "application/json"}
    hs.update(extra or {})
    req = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()]
            ),
            end_of_stream=end,
        ),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET: subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return req


def body_msg(data: bytes, end: bool) -> Any:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def completion(model: str, n: int = 40) -> bytes:
    return json.dumps({"model": model, "prompt": [5 + i for i in range(n)], "max_tokens": 2}).encode()


class Stream:
    """One ext_proc stream (one HTTP request), driven message by message."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ep_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *msgs: Any) -> None:
        for m in msgs:
            await self.call.write(m)

    async def recv(self) -> Any:
        msg = await asyncio.wait_for(self.call.read(), WAIT)
        assert msg is not grpc.aio.EOF, "the picker ended the stream without answering"
        return msg

    async def close(self) -> grpc.StatusCode:
        """Half-close and wait for the picker's end of the stream: its gRPC status."""
        await self.call.done_writing()
        while (await asyncio.wait_for(self.call.read(), WAIT)) is not grpc.aio.EOF:
            pass
        code: grpc.StatusCode = await self.call.code()
        return code


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


def header_map(mutation: Any) -> dict[str, str]:
    return {
        h.header.key.lower(): (h.header.raw_value or h.header.value.encode()).decode()
        for h in mutation.set_headers
    }


def destination_of(resp: Any) -> tuple[str, str]:
    """(header value, metadata value) of a response that picked."""
    which = resp.WhichOneof("response")
    common = getattr(resp, which).response
    header = header_map(common.header_mutation).get(DEST, "")
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    return header, meta


async def pick(
    target: Target, body: bytes, mode: int = FULL_DUPLEX, subset: list[str] | None = None, pieces: int = 3
) -> tuple[Any, list[Any], Stream, grpc.aio.Channel]:
    """Send a request as Envoy does in ``mode``; returns (the picking response, what followed it)."""
    ch = await channel(target.address)
    s = Stream(ch)
    await s.send(headers_msg(mode=mode, subset=subset))
    if mode == BUFFERED:
        first = await s.recv()
        assert first.WhichOneof("response") == "request_headers", first
        await s.send(body_msg(body, True))
        return await s.recv(), [], s, ch
    step = max(1, len(body) // pieces)
    for at in range(0, len(body), step):
        await s.send(body_msg(body[at : at + step], at + step >= len(body)))
    picked = await s.recv()
    if picked.WhichOneof("response") == "immediate_response":
        return picked, [], s, ch
    rest = []
    while True:
        m = await s.recv()
        rest.append(m)
        sr = m.request_body.response.body_mutation.streamed_response
        if sr.end_of_stream:
            return picked, rest, s, ch


# --- the protocol's MUSTs --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED], ids=["full_duplex", "buffered"])
def test_must_pick_with_the_same_value_in_the_header_and_the_metadata(target: Target, mode: int) -> None:
    """MUST: the picked endpoints in the header and in envoy.lb dynamic metadata, the same value,
    ``ip:port`` or a comma-separated list of them, from the pool; streaming (full duplex) and not."""

    async def go() -> None:
        body = completion(target.model)
        picked, rest, s, ch = await pick(target, body, mode)
        assert picked.WhichOneof("response") == ("request_headers" if mode == FULL_DUPLEX else "request_body")
        header, meta = destination_of(picked)
        assert header and header == meta
        endpoints = header.split(",")
        assert all(e in target.endpoints for e in endpoints), (endpoints, target.endpoints)
        assert len(set(endpoints)) == len(endpoints)
        if mode == FULL_DUPLEX:  # the body the picker sends back is the request's, whole
            sent = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in rest)
            assert json.loads(sent) == json.loads(body)
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


def test_must_pick_only_from_the_subset_hint(target: Target) -> None:
    """MUST: with ``x-gateway-destination-endpoint-subset`` set, only endpoints of that list."""

    async def go() -> None:
        for one in target.endpoints:
            picked, _, s, ch = await pick(target, completion(target.model), subset=[one])
            header, meta = destination_of(picked)
            assert header == meta == one
            await s.close()
            await ch.close()

    run(go())


@pytest.mark.parametrize("subset", [[], ["192.0.2.1:8000"]], ids=["empty", "none_eligible"])
def test_must_answer_503_for_an_empty_or_ineligible_subset(target: Target, subset: list[str]) -> None:
    """MUST: an empty subset, or one with no eligible endpoint: ImmediateResponse 503."""

    async def go() -> None:
        picked, _, s, ch = await pick(target, completion(target.model), subset=subset)
        assert picked.WhichOneof("response") == "immediate_response"
        assert picked.immediate_response.status.code == 503
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


def test_must_answer_503_without_a_ready_endpoint(target: Target) -> None:
    """MUST: no ready endpoint: ImmediateResponse 503."""
    if target.unready is None:
        pytest.skip("EPP_UNREADY_ADDRESS not given")
    unready = Target(target.unready, target.unready, [], target.model)

    async def go() -> None:
        picked, _, s, ch = await pick(unready, completion(target.model))
        assert picked.WhichOneof("response") == "immediate_response"
        assert picked.immediate_response.status.code == 503
        await s.close()
        await ch.close()

    run(go())


def test_must_answer_429_for_a_request_it_sheds(target: Target) -> None:
    """MUST: a request to drop under load: ImmediateResponse 429 (here: past the streams it holds)."""
    if target.max_streams is None:
        pytest.skip("EPP_MAX_STREAMS not given")
    assert target.max_streams is not None
    n = target.max_streams

    async def go() -> None:
        ch = await channel(target.address)
        held = []
        for _ in range(n):  # requests whose bodies are still arriving
            s = Stream(ch)
            await s.send(headers_msg())
            held.append(s)
        extra = Stream(ch)
        await extra.send(headers_msg())
        shed = await extra.recv()
        assert shed.WhichOneof("response") == "immediate_response", shed
        assert shed.immediate_response.status.code == 429
        assert await extra.close() == grpc.StatusCode.OK
        for s in held:  # and the ones held are still served
            await s.send(body_msg(completion(target.model), True))
            assert (await s.recv()).WhichOneof("response") == "request_headers"
            await s.close()
        await ch.close()

    run(go())


@pytest.mark.parametrize("mode", [FULL_DUPLEX, BUFFERED], ids=["full_duplex", "buffered"])
def test_must_take_the_served_endpoint_and_pass_the_response_through(target: Target, mode: int) -> None:
    """MUST (data plane -> EPP): the served endpoint comes in the response's metadata_context; the
    picker takes it (here a fallback, as after Envoy's retry) and lets the response through, a
    full-duplex body sent back whole and in order."""

    async def go() -> None:
        picked, _, s, ch = await pick(target, completion(target.model), mode)
        header, _ = destination_of(picked)
        served = header.split(",")[-1]
        resp = ep.ProcessingRequest(
            response_headers=ep.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[
                        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                    ]
                )
            )
        )
        lb = struct_pb2.Struct()
        lb.update({DEST: header, SERVED: served})
        resp.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
        await s.send(resp)
        answer = await s.recv()
        assert answer.WhichOneof("response") == "response_headers"
        events = [
            b'data: {"choices":[{"text":"x"}]}\n\n',
            b'data: {"choices":[],"usage":{"prompt_tokens":40}}\n\n',
        ]
        events.append(b"data: [DONE]\n\n")
        echoed = b""
        for i, e in enumerate(events):
            await s.send(
                ep.ProcessingRequest(response_body=ep.HttpBody(body=e, end_of_stream=i == len(events) - 1))
            )
            a = await s.recv()
            assert a.WhichOneof("response") == "response_body"
            echoed += a.response_body.response.body_mutation.streamed_response.body
        if mode == FULL_DUPLEX:
            assert echoed == b"".join(events)
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


@pytest.mark.parametrize("service", ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"])
def test_must_serve_grpc_health(target: Target, service: str) -> None:
    """MUST: the gRPC health protocol, for these three services: SERVING once ready."""

    async def go() -> None:
        async with grpc.aio.insecure_channel(target.health) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING

    run(go())


def test_health_of_an_unknown_service_is_not_found(target: Target) -> None:
    """The standard protocol: a service the server does not know is NOT_FOUND."""

    async def go() -> None:
        async with grpc.aio.insecure_channel(target.health) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(go())


# --- malformed traffic: an OpenAI-shaped 4xx, never a crashed stream (kvrouter) ----------------------


def _openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    assert resp.immediate_response.status.code == status
    body: dict[str, Any] = json.loads(resp.immediate_response.body)
    assert set(body["error"]) >= {"message", "type", "code"}
    return body


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"prompt": "hi"}', 400),
        (b"[1, 2]", 400),
        (b'{"model": "x", "prompt": 5}', 400),
    ],
    ids=["not_json", "no_model", "not_an_object", "bad_prompt"],
)
def test_kvrouter_a_malformed_body_gets_an_openai_4xx(target: Target, body: bytes, status: int) -> None:
    async def go() -> None:
        picked, _, s, ch = await pick(target, body)
        _openai_error(picked, status)
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


def test_kvrouter_a_body_over_the_limit_is_413_as_soon_as_it_is(target: Target) -> None:
    if target.max_body_bytes is None:
        pytest.skip("EPP_MAX_BODY_BYTES not given")
    assert target.max_body_bytes is not None

    async def go() -> None:
        ch = await channel(target.address)
        s = Stream(ch)
        await s.send(headers_msg(), body_msg(b"x" * (target.max_body_bytes // 2 + 1), False))
        await s.send(body_msg(b"x" * (target.max_body_bytes // 2 + 1), False))  # not the end yet
        _openai_error(await s.recv(), 413)
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


def test_kvrouter_a_stream_that_ends_early_is_answered(target: Target) -> None:
    """Headers and half a body, then the stream is half-closed: a 400, and the stream ends."""

    async def go() -> None:
        ch = await channel(target.address)
        s = Stream(ch)
        await s.send(headers_msg(), body_msg(completion(target.model)[:10], False))
        await s.call.done_writing()
        _openai_error(await s.recv(), 400)
        assert await s.close() == grpc.StatusCode.OK
        await ch.close()

    run(go())


def test_kvrouter_a_body_before_its_headers_or_no_body_at_all(target: Target) -> None:
    async def go() -> None:
        ch = await channel(target.address)
        s = Stream(ch)
        await s.send(body_msg(completion(target.model), True))
        _openai_error(await s.recv(), 400)
        await s.close()
        s = Stream(ch)
        await s.send(headers_msg(end=True))
        _openai_error(await s.recv(), 400)
        await s.close()
        await ch.close()

    run(go())


def test_kvrouter_a_reset_stream_leaves_the_picker_serving(target: Target) -> None:
    """Streams cancelled at every step (a client gone mid-request) do not break the next one."""

    async def go() -> None:
        ch = await channel(target.address)
        for steps in range(3):
            s = Stream(ch)
            msgs = [headers_msg(), body_msg(completion(target.model), True)][:steps]
            await s.send(*msgs)
            s.call.cancel()
        picked, _, s, _ = await pick(target, completion(target.model))
        assert destination_of(picked)[0]
        await s.close()
        await ch.close()

    run(go())
