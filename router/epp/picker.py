"""The ext_proc ``Process`` stream: one HTTP request through the gateway, decided by kvrouter.

Per request Envoy opens one bidirectional gRPC stream and sends its request headers, body (and
trailers), then the response's. The picker:

- holds the request body (``server.max_body_bytes``, as the proxy does) and, once it is whole, asks
  :meth:`router.decision.service.RouterService.decide` -- the proxy's and ``/route``'s decision --
  and answers with the ``x-gateway-destination-endpoint`` header and the same value in the dynamic
  metadata: the chosen ``ip:port``, then up to ``epp.fallbacks`` next-best other addresses;
- FULL_DUPLEX_STREAMED (what the request's ``protocol_config`` says, and the default when Envoy sends
  none): the headers are answered after the body, and the body is sent back by the picker (the
  mode's rule); BUFFERED: the headers pass at once and the body's answer carries the headers;
- on the response, takes the endpoint that served (``x-gateway-destination-endpoint-served`` in the
  metadata, else Envoy's ``upstream.address`` attribute) as the one the load and the prediction
  belong to, and reads usage from the body's tail for the prediction self-check;
- ends the request's in-flight accounting when the response ends or the stream does (a reset;
  with response body mode NONE the stream's end is the response's, and one in
  ``epp.response_body_every`` bodies is asked for with a ``mode_override`` for the self-check);
- carries ``x-gateway-inference-objective`` / ``-fairness-id`` to the decision (flow control's input);
- answers every error with an ImmediateResponse carrying an OpenAI-shaped body: 400/404/413 for a
  bad request, 503 when no endpoint (or none of the gateway's subset) can take it, 429 when the
  picker sheds (``epp.max_streams`` requests held: its own overload, as a full proxy answers 503
  at its connection cap), 408 when the gateway stalls mid-body.

The stream runs on the router's event loop (grpc.aio), like the proxy's requests: the decision's
objects (index, load tracker, breakers) are the loop's and are never touched from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import grpc
import msgspec

from router.config import EppConfig
from router.decision.classes import request_class_of
from router.decision.service import Endpoint, Route, RouterService
from router.epp import protocol as p
from router.epp.prefill import PrefillClock
from router.errors import ApiError, bad_request, too_large
from router.fleet.load import LoadTracker, Ticket
from router.flow.controller import FlowController, Rejection
from router.flow.controller import Ticket as FlowTicket
from router.net.body import BodyBuffer
from router.observe.checks import PredictionChecks, observe_route, route_checkable, sse_usage, usage_in_json
from router.observe.metrics import LeanCounter, RouterMetrics
from router.pd.connector import ENGINE_FIELDS

if TYPE_CHECKING:
    from router.fleet.membership import Member
    from router.pd.exchange import HeaderBuilder, PDExchange, Prepared

log = logging.getLogger("kvrouter.epp")

PATHS: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_PATH_OF: dict[str, str] = {e: path for path, e in PATHS.items()}
"""The engine's path of a prefill leg whose request came on another (a gateway's route rewrites it)."""
_TAIL = 16384
"""Bytes of a response's end kept for its usage (vLLM's final usage event or JSON field is ~200)."""
_CHUNK = 1 << 20
"""Largest body piece sent back in one message (FULL_DUPLEX_STREAMED): under gRPC's usual 4 MiB."""

OUTCOMES = ("picked", "rejected", "shed", "unsupported", "aborted")


class EppMetrics:
    """The picker's own series (its decisions are counted with the proxy's, by RouterMetrics)."""

    def __init__(self) -> None:
        self.streams = LeanCounter(
            "kvrouter_epp_streams",
            "ext_proc streams by outcome (picked: endpoints answered; rejected: an ImmediateResponse "
            "4xx/503; shed: 429, epp.max_streams held; unsupported: a body mode the picker cannot "
            "decide in; aborted: ended before a decision)",
            ["outcome"],
        )
        self.immediate = LeanCounter(
            "kvrouter_epp_immediate_responses", "ImmediateResponses sent, by HTTP status", ["status"]
        )
        self.served = LeanCounter(
            "kvrouter_epp_served",
            "Responses by where they were served: primary (the first endpoint answered), fallback "
            "(a later one, after the gateway's retry), other (an endpoint the picker did not list), "
            "unknown (the gateway said nothing)",
            ["where"],
        )
        self.active = 0

    @property
    def series(self) -> list[LeanCounter]:
        return [self.streams, self.immediate, self.served]


class Addresses:
    """``ip:port`` <-> member name, rebuilt when the membership changes (the gateway names endpoints
    by address; the router by name)."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self._version = -1
        self._by_address: dict[str, list[str]] = {}

    def of(self, member: Member) -> str:
        return urlsplit(member.url).netloc

    def names(self, addresses: list[str]) -> frozenset[str]:
        m = self.service.membership
        if self._version != m.version:
            self._version = m.version
            by: dict[str, list[str]] = {}
            for member in m.members.values():
                by.setdefault(self.of(member), []).append(member.name)
            self._by_address = by
        return frozenset(n for a in addresses for n in self._by_address.get(a, ()))


class Picker:
    """The ``envoy.service.ext_proc.v3.ExternalProcessor`` servicer (``Process`` only)."""

    def __init__(
        self,
        config: EppConfig,
        service: RouterService,
        loads: LoadTracker,
        metrics: RouterMetrics,
        max_body_bytes: int,
        checks: PredictionChecks | None = None,
        trusted: Callable[[dict[str, str]], bool] = lambda headers: False,
        pd: PDExchange | None = None,
        upstream_headers: HeaderBuilder | None = None,
    ) -> None:
        self.config = config
        self.service = service
        self.loads = loads
        self.metrics = metrics
        self.checks = checks
        self.max_body_bytes = max_body_bytes
        self.trusted = trusted
        """Whether a request's headers let it pass :data:`ENGINE_FIELDS` (``trusted_api_keys``)."""
        self.pd = pd if upstream_headers is not None else None
        """Prefill/decode disaggregation: the proxy's own prefill leg (router/pd), run by the picker
        before it answers the decode endpoint; None: decode endpoint only."""
        self.upstream_headers = upstream_headers
        """The proxy's upstream headers for the prefill leg (its forwarded ones and the engine's auth)."""
        self.epp_metrics = EppMetrics()
        self.addresses = Addresses(service)
        self.flow: FlowController | None = None
        """Flow control (``[flow]``): the proxy's queue, so the gateway's requests wait and are shed
        by the same rules as the proxy's; None when off."""
        self.sampled = 0
        """Checkable responses seen without their body (the sampling of ``_sample_body``)."""
        self.prefill = PrefillClock()
        """When a prefill is over for a response seen without its body (router/epp/prefill.py)."""

    async def Process(
        self,
        request_iterator: AsyncIterator[p.Message],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[p.Message]:
        stream = _Stream(self)
        em = self.epp_metrics
        em.active += 1
        try:
            shed = em.active > self.config.max_streams  # (answered after its first message)
            it = request_iterator.__aiter__()
            while True:
                try:
                    if stream.route is None:
                        # (asyncio.timeout, not wait_for: no task per message)
                        async with asyncio.timeout(self.config.message_timeout_s):
                            req = await it.__anext__()
                    else:
                        req = await it.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    yield stream.error(
                        ApiError(
                            408,
                            "the gateway sent no more of the request within epp.message_timeout_s",
                            "invalid_request_error",
                            "request_timeout",
                        )
                    )
                    return
                if shed:
                    yield self._shed(stream)
                    return
                for resp in await stream.on(req):
                    yield resp
                if stream.finished:
                    return
            if stream.route is None and stream.headers is not None and not stream.finished:
                # the stream ended (half-closed) before the body was whole: answered, not left hanging
                yield stream.error(
                    bad_request("the request ended before its body was complete", "incomplete_body")
                )
        finally:
            em.active -= 1
            stream.close()

    def _shed(self, stream: _Stream) -> p.Message:
        """429: the picker holds ``epp.max_streams`` requests (its answer to its own overload)."""
        stream.outcome = "shed"
        body = {
            "error": {
                "message": f"the endpoint picker holds its maximum of {self.config.max_streams} "
                "requests; retry later",
                "type": "rate_limit_error",
                "param": None,
                "code": "too_many_requests",
            }
        }
        return stream.reject(429, msgspec.json.encode(body), "kvrouter_shed", retry_after=True)


class _Stream:
    """One request's state (its stream's messages arrive in order, one at a time)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.request_mode = p.FULL_DUPLEX
        self.response_mode = p.NONE
        self.headers: dict[str, str] | None = None
        self.subset: list[str] | None = None
        self.body = BodyBuffer(picker.max_body_bytes)
        self.route: Route | None = None
        self.endpoints: list[tuple[str, str, int]] = []
        """(address, member name, rank) in the order the gateway got them."""
        self.ticket: Ticket | None = None
        self.grant: FlowTicket | None = None
        """Flow control's hold on the model's room, from leaving its queue until the load is counted."""
        self.target: tuple[str, int] | None = None
        self.decided_at = 0.0
        self.status = 0
        self.sse = False
        self.tail = b""
        self.truncated = False
        self.first = True
        self.work = 0
        """The target's pending prefill tokens at the decision, this request's included."""
        self.prefill_timer: asyncio.TimerHandle | None = None
        """The estimated end of the prefill of a response seen without its body."""
        self.response_seen = False
        self.body_expected = False
        """Whether Envoy sends the response body (its mode, or the picker's mode_override)."""
        self.finished = False
        self.outcome = "aborted"
        self.pd_leg = False
        """A disaggregated model's request whose decode leg the gateway sends (its end is counted
        in the P/D leg metrics, as the proxy's decode legs are)."""
        self.first_byte_s: float | None = None

    # --- messages ------------------------------------------------------------------------------
    async def on(self, req: p.Message) -> list[p.Message]:
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(req)
        if kind == "request_body":
            return await self._request_body(req.request_body.body, req.request_body.end_of_stream)
        if kind == "request_trailers":
            out = await self._request_body(b"", True) if self.route is None else []
            return [*out, p.continue_trailers()] if not self.finished else out
        if kind == "response_headers":
            return [self._response_headers(req)]
        if kind == "response_body":
            return [self._response_body(req.response_body.body, req.response_body.end_of_stream)]
        if kind == "response_trailers":
            self._response_end()
            return [p.continue_trailers(request=False)]
        return []

    def _request_headers(self, req: p.Message) -> list[p.Message]:
        self.headers = p.header_values(req.request_headers)
        subset = p.metadata_value(req.metadata_context, self.picker.config.subset_namespace, p.SUBSET)
        if subset is not None:
            self.subset = [str(a) for a in subset] if isinstance(subset, list) else [str(subset)]
        if req.request_headers.end_of_stream:
            return [
                self.error(
                    bad_request(
                        "kvrouter's endpoint picker routes inference requests: a JSON body with "
                        "`model` is required",
                        "missing_body",
                    )
                )
            ]
        if self.request_mode not in (p.FULL_DUPLEX, p.BUFFERED):
            self.outcome = "unsupported"
            return [
                self.error(
                    ApiError(
                        500,
                        "the gateway sends the request body in a mode the endpoint picker cannot decide "
                        "in: use FULL_DUPLEX_STREAMED or BUFFERED",
                        "server_error",
                        "unsupported_body_mode",
                    )
                )
            ]
        if self.request_mode == p.BUFFERED:
            return [p.continue_headers()]
        return []  # FULL_DUPLEX_STREAMED: answered with the decision, once the body is in

    async def _request_body(self, chunk: bytes, end: bool) -> list[p.Message]:
        if self.headers is None:
            return [self.error(bad_request("a request body came before its headers", "protocol_error"))]
        if self.route is not None:
            return []  # (trailers after a decided body)
        if chunk and not self.body.add(chunk):
            return [self.error(too_large(self.picker.max_body_bytes))]
        if not end:
            return []
        raw = self.body.take()
        try:
            return await self._decide(raw)
        except ApiError as err:
            return [self.error(err)]

    async def _decide(self, raw: bytes) -> list[p.Message]:
        picker = self.picker
        service = picker.service
        headers = self.headers or {}
        size = len(raw)
        parsed: Any = await service.read_json(raw)
        try:
            path = headers.get(":path", "").split("?", 1)[0]
            endpoint = PATHS.get(path) or (
                "chat" if isinstance(parsed, dict) and "messages" in parsed else "completions"
            )
            changed = False
            rewrite = headers.get(p.MODEL_REWRITE)
            if rewrite and isinstance(parsed, dict):
                parsed = {**parsed, "model": rewrite}
                changed = True
            if isinstance(parsed, dict) and not picker.trusted(headers):
                fields = [f for f in ENGINE_FIELDS if f in parsed]
                if fields:  # (only the router sets them for the engines: trusted_api_keys says why)
                    for f in fields:
                        picker.metrics.client_fields_removed.inc((f,))
                    parsed = {k: v for k, v in parsed.items() if k not in fields}
                    changed = True
            subset = None
            if self.subset is not None:
                subset = picker.addresses.names(self.subset)
                if not subset:
                    raise ApiError(
                        503,
                        "none of the endpoints of the request's subset hint is one the picker knows",
                        "service_unavailable",
                        "no_eligible_endpoint",
                    )
            if picker.flow is not None:  # wait in flow control's queue; decided when it leaves
                answer = await self._admit(picker.flow, headers, parsed, size)
                if answer is not None:
                    return [answer]
            t0 = time.perf_counter()
            classed = request_class_of(headers)
            band = self.grant.priority if self.grant is not None else None
            route = await service.decide(
                endpoint, parsed, size=size, subset=subset, request_class=classed, band=band
            )
            decision_s = time.perf_counter() - t0 - route.timings_us.get("held", 0.0) / 1e6
            body = await service.write_json(parsed, size) if changed else None
            self.route = route  # (a reset during a prefill leg: close() sees the route)
            picker.metrics.routed(
                route.backend,
                route.dp_rank,
                route.outcome,
                route.prompt_tokens,
                route.chosen_media(),
                route.block_size,
                route.prompt_blocks,
                decision_s,
            )
            picker.metrics.classed(classed.objective if classed is not None else None)
            prepared: Prepared | None = None
            if route.pd is not None and picker.pd is not None and isinstance(parsed, dict):
                leg_path = path if path in PATHS else _PATH_OF[endpoint]
                # flow control's room goes back in the step the prefill leg reserves the decode target
                self._release_grant()
                prepared = await self._prepare(picker.pd, leg_path, body if body is not None else raw, parsed)
        finally:
            service.release(parsed, size)
        if prepared is not None and prepared.answer is not None:
            self.pd_leg = False  # (no decode leg: the prefill leg's 4xx is the whole answer)
            self.outcome = "rejected"
            status, answer, prefill_backend = prepared.answer
            return [
                self.reject(
                    status,
                    answer,
                    "kvrouter_prefill_error",
                    headers=[("x-kvrouter-prefill-backend", prefill_backend)],
                )
            ]
        self.endpoints = self._endpoints(route)
        target = (route.backend, route.dp_rank)
        self.target = target
        # (no await since the prefill leg's reservation ended: its ticket follows in the same step)
        self.ticket = picker.loads.start(target, service.uncached_tokens(route, target))
        self.work = self.ticket.load.pending_prefill_tokens
        self._release_grant()  # (the load is counted now: the queue may let the next one go)
        self.decided_at = time.perf_counter()
        self.outcome = "picked"
        value = ",".join(e[0] for e in self.endpoints)
        member = route.members[route.backend]
        set_headers = [(p.DESTINATION, value)]
        remove: list[str] = []
        if member.spec.dp_size > 1:
            set_headers.append((p.DP_RANK, str(route.dp_rank)))
        else:
            remove.append(p.DP_RANK)  # (a client's own would pick a rank the router did not)
        if prepared is not None:
            set_headers.append(("x-request-id", prepared.request_id))  # (the prefill leg's)
            if prepared.body is not (body if body is not None else raw):
                body = prepared.body  # with the prefill leg's kv_transfer_params
        sent = body if body is not None else raw
        if body is not None:
            set_headers.append(("content-length", str(len(body))))
        metadata = p.destination_metadata(picker.config.destination_namespace, value)
        if self.request_mode == p.BUFFERED:
            return [p.picked_buffered_body(set_headers, remove, metadata, body)]
        out = [p.picked_headers(set_headers, remove, metadata)]
        view = memoryview(sent)
        pieces = range(0, len(sent), _CHUNK) if sent else range(1)
        for at in pieces:
            out.append(p.streamed_body(bytes(view[at : at + _CHUNK]), at + _CHUNK >= len(sent)))
        return out

    async def _prepare(self, pd: PDExchange, path: str, body: bytes, parsed: dict[str, Any]) -> Prepared:
        """A disaggregated model's request (``route.pd``): the proxy's prefill leg (router/pd), run
        here while Envoy waits for the body's answer, which then names the decode endpoint and
        carries the decode leg's body. Its rules are the proxy's: skipped per the plan, a 400-451
        answered as it is, any other failure falls back to the decode engine computing the prompt
        (counted in ``kvrouter_pd_fallbacks_total``). A stream reset while it runs cancels this
        task, which closes the prefill leg's connection (vLLM's abort)."""
        route = self.route
        assert route is not None and self.picker.upstream_headers is not None
        headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in (self.headers or {}).items()
            if not k.startswith(":")
        ]
        self.pd_leg = True
        return await pd.prepare(path, headers, body, parsed, route, self.picker.upstream_headers)

    async def _admit(
        self, flow: FlowController, headers: dict[str, str], parsed: Any, size: int
    ) -> p.Message | None:
        """Flow control's admission, as the proxy's: None once the request may be decided (its
        grant kept until the load is counted), else the Rejection as an ImmediateResponse (429 in a
        sheddable band, 503 otherwise, with Retry-After). A gateway that resets the stream while
        the request waits cancels this task: the request leaves the queue then."""
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        admitted = await flow.admit(flow.meta(raw, parsed, size))
        if isinstance(admitted, Rejection):
            self.outcome = "rejected"
            details = f"kvrouter_flow_{admitted.reason}"
            return self.reject(admitted.status, admitted.body(), details, admitted.retry_after)
        self.grant = admitted
        return None

    def _release_grant(self) -> None:
        if self.grant is not None:
            self.grant.release()
            self.grant = None

    def _endpoints(self, route: Route) -> list[tuple[str, str, int]]:
        """The chosen target's address, then up to ``epp.fallbacks`` next-best on other addresses
        (routable members only: the gateway retries down the list in order)."""
        addrs = self.picker.addresses
        members = route.members
        first = members[route.backend]
        out = [(addrs.of(first), route.backend, route.dp_rank)]
        want = self.picker.config.fallbacks
        if want:
            seen = {out[0][0]}
            available = self.picker.service.breakers.available
            for name, rank in route.ranked()[1:]:
                if len(out) > want:
                    break
                m = members.get(name)
                if m is None or not m.routable or not available(name):
                    continue
                a = addrs.of(m)
                if a not in seen:
                    seen.add(a)
                    out.append((a, name, rank))
        return out

    def _response_headers(self, req: p.Message) -> p.Message:
        headers = p.header_values(req.response_headers)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.sse = headers.get("content-type", "").startswith("text/event-stream")
        ns = self.picker.config.destination_namespace
        served = p.metadata_value(req.metadata_context, ns, p.SERVED)
        if served is None:
            served = p.attribute_value(req, p.UPSTREAM_ADDRESS)
        extra: list[tuple[str, str]] = []
        self.response_seen = True
        self.body_expected = self.response_mode != p.NONE
        sample = False
        if self.route is not None:
            self._served(str(served) if served else None)
            if self.target is not None:
                extra = [("x-kvrouter-backend", self.target[0]), ("x-kvrouter-dp-rank", str(self.target[1]))]
                if not self.body_expected:
                    sample = self._sample_body()
                    if not sample:  # (a sampled body's first chunk is the real first byte)
                        self._first_byte(seen=False)
        if req.response_headers.end_of_stream:
            self._response_end()
            sample = False
        out = p.continue_headers(request=False, set_headers=extra)
        if sample:
            out.mode_override.response_body_mode = p.STREAMED
            self.body_expected = True
            self.response_mode = p.STREAMED
        return out

    def _sample_body(self) -> bool:
        """Response body mode NONE (the cheap one: no message per SSE chunk): on one in
        ``epp.response_body_every`` checkable responses ask Envoy for the body after all
        (``mode_override``, honoured when the filter has ``allow_mode_override``), to read its usage
        for the prediction self-check. Where Envoy ignores the override the stream ends without a
        body and the check counts ``no_usage``."""
        picker = self.picker
        every = picker.config.response_body_every
        if picker.checks is None or every <= 0 or self.route is None:
            return False
        if not route_checkable(self.route, self.status):
            return False
        picker.sampled += 1
        return picker.sampled % every == 0

    def _first_byte(self, seen: bool = True) -> None:
        """The engine answered. ``seen``: its first body chunk, so its prefill is over (and how
        long it took teaches the prefill clock). Otherwise the response headers of a body the
        picker does not see, which a vLLM stream sends once the engine took the request, before its
        prefill: the pending prefill is released when the prefill clock says it is over
        (router/epp/prefill.py), at once where it has no measurement yet."""
        if self.first and self.ticket is not None and self.target is not None:
            self.first = False
            picker = self.picker
            self.first_byte_s = time.perf_counter() - self.decided_at
            picker.metrics.observe_ttft(self.target[0], self.first_byte_s)
            if seen:
                if self.sse:  # (a JSON body's first byte comes after the whole generation)
                    picker.prefill.learn(self.target, self.work, self.first_byte_s)
                picker.loads.first_byte(self.ticket)
                return
            over = picker.prefill.seconds(self.target, self.work) if picker.config.estimate_prefill else None
            if over is None or over <= self.first_byte_s:
                picker.loads.first_byte(self.ticket)
                return
            ticket = self.ticket
            loop = asyncio.get_running_loop()
            self.prefill_timer = loop.call_later(over - self.first_byte_s, picker.loads.first_byte, ticket)

    def _served(self, served: str | None) -> None:
        """Move the request's load (and prediction) to the endpoint that served, when the gateway's
        retry went past the first; the endpoints passed over count as failures for their breakers."""
        picker = self.picker
        em = picker.epp_metrics
        route = self.route
        assert route is not None
        if served is None:
            em.served.inc(("unknown",))
            return
        for i, (address, name, rank) in enumerate(self.endpoints):
            if address != served:
                continue
            if i == 0:
                em.served.inc(("primary",))
                return
            em.served.inc(("fallback",))
            for _, skipped, _ in self.endpoints[:i]:
                picker.service.breakers.failure(skipped)
                picker.metrics.error(skipped, "connect")
            target = (name, rank)
            if self.ticket is not None:
                picker.loads.finish(self.ticket)
            self.ticket = picker.loads.start(target, picker.service.uncached_tokens(route, target))
            self.work = self.ticket.load.pending_prefill_tokens
            if route.report is not None:
                picker.service.predict(target, route.report)  # the prefix is computed there now
            self.target = target
            return
        em.served.inc(("other",))
        log.debug("served by %s, which the picker did not list (%s)", served, self.endpoints)

    def _response_body(self, chunk: bytes, end: bool) -> p.Message:
        picker = self.picker
        if chunk:
            self._first_byte()
            if picker.checks is not None:
                tail = self.tail + chunk if self.tail else chunk
                if len(tail) > _TAIL:
                    tail = tail[-_TAIL:]
                    self.truncated = True
                self.tail = tail
        if end:
            self._response_end()
        if self.response_mode == p.FULL_DUPLEX:
            return p.streamed_body(chunk, end, request=False)
        return p.continue_body(request=False)

    def _response_end(self) -> None:
        """The response is over: the request leaves the in-flight count, its usage checks the
        prediction (after this message is answered)."""
        picker = self.picker
        route, target = self.route, self.target
        if self.finished or route is None or target is None:
            self.finished = True
            return
        self.finished = True
        self._release()
        status = self.status
        self._decode_leg_end(target[0], status)
        picker.metrics.finished(target[0], route.model, status, time.perf_counter() - self.decided_at)
        breakers = picker.service.breakers
        if status >= 500:
            breakers.failure(target[0])
        elif status:
            breakers.success(target[0])
        if picker.checks is not None and self.body_expected and route_checkable(route, status):
            tail = self.tail
            if self.truncated:  # (a cut event at the front is not one)
                cut = tail.find(b"\n\n")
                tail = tail[cut + 2 :] if cut >= 0 else b""
            usage = sse_usage(tail) if self.sse else usage_in_json(tail)
            block_size = picker.service.index.block_size_of(target)
            asyncio.get_running_loop().call_soon(
                observe_route, picker.checks, route, target, block_size, usage
            )
        route.report = None

    def _decode_leg_end(self, backend: str, status: int) -> None:
        """A P/D request's decode leg ended (status 0: reset before its answer)."""
        if self.pd_leg and self.picker.pd is not None:
            self.pd_leg = False
            self.picker.pd.metrics.leg("decode", backend, status, self.first_byte_s)

    def _release(self) -> None:
        if self.prefill_timer is not None:
            self.prefill_timer.cancel()
            self.prefill_timer = None
        if self.ticket is not None:
            self.picker.loads.finish(self.ticket)
            self.ticket = None

    # --- answers -------------------------------------------------------------------------------
    def error(self, err: ApiError) -> p.Message:
        if self.outcome == "aborted":
            self.outcome = "rejected"
        return self.reject(err.status, err.body(), f"kvrouter_{err.code}", retry_after=err.status == 503)

    def reject(
        self,
        status: int,
        body: bytes,
        details: str,
        retry_after: bool | int = False,
        headers: list[tuple[str, str]] | None = None,
    ) -> p.Message:
        self.finished = True
        self.picker.epp_metrics.immediate.inc((str(status),))
        return p.immediate(status, body, details, retry_after, headers or [])

    def close(self) -> None:
        """The stream is over (the response ended, or the request was reset): whatever happened,
        the request no longer counts as in flight. With response body mode NONE the stream's end
        *is* the response's (Envoy closes it when the HTTP stream is done): a response whose
        headers came ends normally here, as a client that left mid-stream does (the picker cannot
        tell the two apart without the body; the status already went to the breaker)."""
        if self.response_seen and not self.body_expected and not self.finished:
            self._response_end()
        if self.ticket is not None and self.target is not None and not self.finished:
            self.picker.metrics.error(self.target[0], "stream_reset")
            # (a reset after the response's headers: the decode leg answered with that status)
            self._decode_leg_end(self.target[0], self.status if self.response_seen else 0)
        self._release_grant()  # (a decision that failed or was cancelled: its room back)
        self._release()
        if self.route is not None:
            self.route.report = None
        self.picker.epp_metrics.streams.inc((self.outcome,))
