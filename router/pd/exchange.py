"""The two legs of a disaggregated request: the prefill leg here, then the proxy's own exchange as the
decode leg.

Rules, in the order they apply:

- Both legs carry one ``X-Request-Id``: the client's when it sent one (so engine logs match its
  own), else a new one. The decode engine's pull is keyed by the prefill engine's request id, which
  vLLM derives from this header, so a client that reuses ids across concurrent requests breaks its
  own transfers, as it would with vLLM's example proxy.
- The decode target carries the request (one more in flight) from the decision on, so requests
  decided while this one's prefill leg runs see it; the prefill target carries the prompt's
  uncached tokens until its answer arrives. The decode leg then takes a ticket of its own for its
  whole life (:meth:`router.proxy.ProxyHandler._exchange`), in the same step as the
  reservation is released, so no decision in between sees the decode target idle.
- The prefill leg is never retried elsewhere. An answer with status 400-451 goes to the client as it
  is (the request itself is wrong: the decode leg would fail the same way). Anything else that
  keeps it from producing transfer parameters (no connection, no answer within
  ``pd.prefill_timeout_s``, a broken response, 5xx, another status, an answer without
  ``kv_transfer_params``) falls back: the decode target gets the client's request as it came and
  computes the prefill itself; the fallback is counted (``kvrouter_pd_fallbacks_total``) and logged.
- A client that disconnects during the prefill leg cancels the request's task: the prefill leg's
  connection is closed, which vLLM treats as an abort, and both load records are released.
- Nothing reaches the client before the decode leg's first byte (except that 4xx answer, which is
  the whole response), so the decode leg's failover (one retry on the next-best decode engine on a
  connect error or a 5xx before the first byte) works as for any request: the transfer parameters
  stay valid for another decode engine, which pulls the same blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from index.kvindex import PREDICTED
from router.decision.pd import PDPlan
from router.decision.policy import CandidateScore
from router.decision.service import Route
from router.fleet.breaker import Breakers
from router.fleet.health import HealthChecker
from router.fleet.load import LoadTracker
from router.net.asgi import Headers, ResponseWriter
from router.net.upstream import (
    RouterResourceError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)
from router.pd.config import PDConfig
from router.pd.connector import Connector, Leg, connector
from router.pd.metrics import PDMetrics

log = logging.getLogger("kvrouter.pd")

RequestHeaders = list[tuple[bytes, bytes]]
HeaderBuilder = Callable[[RequestHeaders, dict[str, str], int, int], list[tuple[str, str]]]
"""The proxy's upstream headers: (client headers, backend auth, DP size, DP rank) -> headers."""
Exchange = Callable[[str, RequestHeaders, ResponseWriter, bytes, Route], Awaitable[None]]
"""The proxy's exchange with the decode target (streamed to the client, with its failover)."""

MAX_ANSWER_BYTES = 64 << 20
"""A prefill answer larger than this (prompt logprobs of a huge prompt) is treated as broken."""


class _Fallback(Exception):
    """The prefill leg produced no transfer parameters; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class LegWriter:
    """Passes the decode leg's response through and notes its status, backend and first body byte
    (headers sent ahead of the body, as a streaming engine sends them, do not count)."""

    def __init__(self, inner: ResponseWriter, backend: str) -> None:
        self.inner = inner
        self.started = False
        self.status = 0
        self.backend = backend
        self.t0 = time.perf_counter()
        self.first_byte_s: float | None = None

    def _first(self) -> None:
        if self.first_byte_s is None:
            self.first_byte_s = time.perf_counter() - self.t0

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status = status
        for name, value in headers:
            if name == b"x-kvrouter-backend":
                self.backend = value.decode("latin-1")
        await self.inner.start(status, headers)

    def flush(self) -> None:
        self.inner.flush()  # headers only: not the first byte of the answer

    async def send(self, chunk: bytes) -> None:
        if chunk:
            self._first()
        await self.inner.send(chunk)

    async def end(self, chunk: bytes = b"") -> None:
        self._first()
        await self.inner.end(chunk)


class Prepared(msgspec.Struct, frozen=True):
    """What the decode leg is sent with, once the prefill leg (if any) is over."""

    headers: RequestHeaders
    """The client's headers with exactly one ``x-request-id`` (both legs carry it)."""
    request_id: str
    body: bytes
    """The decode leg's body: with the prefill's transfer parameters, or the client's own bytes
    (skipped leg, fallback)."""
    answer: tuple[int, bytes, str] | None = None
    """The prefill leg's 400-451 (status, body, prefill backend): the client's answer, no decode leg."""


_ENGINE_FAULTS = frozenset({"connect", "timeout", "protocol", "upstream_5xx"})
"""Fallback reasons that are the prefill engine's failure (the breaker counts them)."""


def with_request_id(headers: RequestHeaders) -> tuple[RequestHeaders, str]:
    """The client's headers with exactly one ``x-request-id``: the client's first non-empty one,
    or a new one. (An empty or repeated one was forwarded too, first: the engines read the first
    and saw "" on both legs, not the id the router logged.)"""
    ids = [value for name, value in headers if name == b"x-request-id"]
    rid = next((v.decode("latin-1") for v in ids if v), None)
    if rid is not None and len(ids) == 1:
        return headers, rid  # (the usual case: the headers as they are)
    rid = rid or uuid.uuid4().hex
    return [h for h in headers if h[0] != b"x-request-id"] + [(b"x-request-id", rid.encode())], rid


def _confirmed(c: CandidateScore | None) -> int:
    """Blocks a candidate holds according to its events (predictions excluded)."""
    if c is None:
        return 0
    return c.matched_blocks - c.blocks_by_medium.get(PREDICTED, 0)


class PDExchange:
    """Runs the prefill leg and hands the decode leg to the proxy's exchange."""

    def __init__(
        self,
        config: PDConfig,
        pool: UpstreamPool,
        loads: LoadTracker,
        metrics: PDMetrics,
        health: HealthChecker,
        breakers: Breakers | None = None,
    ) -> None:
        self.config = config
        self.connector: Connector = connector(config.connector)
        self.pool = pool
        self.loads = loads
        self.metrics = metrics
        self.health = health
        self.breakers = breakers or Breakers()
        """Prefill legs count like proxied requests: an engine that times out or fails them is
        ejected, instead of costing every request routed to it ``prefill_timeout_s``."""

    async def run(
        self,
        path: str,
        headers: RequestHeaders,
        body: bytes,
        parsed: dict[str, Any],
        route: Route,
        writer: ResponseWriter,
        exchange: Exchange,
        build_headers: HeaderBuilder,
    ) -> None:
        """The whole disaggregated request: prefill leg (if the plan has one), then the decode leg
        (``exchange``: the proxy's own, with its failover; ``build_headers``: its upstream headers)."""
        prepared = await self.prepare(path, headers, body, parsed, route, build_headers)
        if prepared.answer is not None:  # the prefill leg's 4xx is the answer
            status, raw, prefill_backend = prepared.answer
            await writer.start(
                status,
                [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode()),
                    (b"x-kvrouter-prefill-backend", prefill_backend.encode()),
                ],
            )
            await writer.end(raw)
            return
        lw = LegWriter(writer, route.backend)
        try:
            await exchange(path, prepared.headers, lw, prepared.body, route)
        finally:
            self.metrics.leg("decode", lw.backend, lw.status, lw.first_byte_s)

    async def prepare(
        self,
        path: str,
        headers: RequestHeaders,
        body: bytes,
        parsed: dict[str, Any],
        route: Route,
        build_headers: HeaderBuilder,
    ) -> Prepared:
        """Everything before the decode leg, shared by the proxy (:meth:`run`) and the endpoint
        picker (router/epp, which hands the decode leg to the gateway): counts the request, gives
        it one request id and runs the prefill leg when the plan has one. The decode target is
        reserved from the first step of this call (no await before it) until it returns, so the
        caller takes the decode leg's own load ticket right after, with no await in between."""
        plan = route.pd
        assert plan is not None
        m = self.metrics
        m.decided(plan.mode, plan.skip)
        chosen = next((c for c in route.candidates if c.chosen), None)
        m.tokens("decode", route.prompt_tokens, _confirmed(chosen) * route.block_size)
        headers, rid = with_request_id(headers)
        if not plan.two_legs:
            return Prepared(headers, rid, body)
        return await self._prefill(path, headers, body, parsed, route, plan, rid, build_headers)

    async def _prefill(
        self,
        path: str,
        headers: RequestHeaders,
        body: bytes,
        parsed: dict[str, Any],
        route: Route,
        plan: PDPlan,
        rid: str,
        build_headers: HeaderBuilder,
    ) -> Prepared:
        """The prefill leg: the decode leg's body (with the transfer parameters, or the client's own
        bytes on a fallback), or the prefill leg's 4xx as the answer."""
        target = plan.prefill_target
        assert target is not None
        member = route.members[target[0]]
        decode_member = route.members[route.backend]
        chosen = next((c for c in plan.prefill_candidates if c.chosen), None)
        self.metrics.tokens("prefill", route.prompt_tokens, _confirmed(chosen) * route.block_size)
        leg = Leg(rid, member.url, target[1], decode_member.url, route.dp_rank)
        payload = msgspec.json.encode(self.connector.prefill_body(parsed, leg))
        upstream_headers = build_headers(headers, member.auth_headers, member.spec.dp_size, target[1])
        # the decode target carries the request from now on; the prefill target its prompt work
        reservation = self.loads.start((route.backend, route.dp_rank), 0)
        ticket = self.loads.start(target, plan.prefill_uncached_tokens)
        started = time.perf_counter()
        status = 0
        first_byte: float | None = None
        try:
            try:
                async with asyncio.timeout(self.config.prefill_timeout_s):
                    resp = await self.pool.request(
                        member.upstream_key, "POST", member.base_path + path, upstream_headers, payload
                    )
                    first_byte = time.perf_counter() - started
                    status = resp.status
                    try:
                        raw = await self._read(resp.aiter_raw())
                    finally:
                        await resp.aclose()
            except TimeoutError:
                raise _Fallback("timeout", f"no answer within {self.config.prefill_timeout_s:g} s") from None
            except UpstreamTimeout:
                raise _Fallback("timeout", "the engine did not answer in time") from None
            except RouterResourceError as exc:
                raise _Fallback("router_resources", str(exc)) from None
            except UpstreamConnectError as exc:
                self.health.mark_failed(member, str(exc))
                raise _Fallback("connect", str(exc)) from None
            except UpstreamError as exc:
                raise _Fallback("protocol", str(exc)) from None
            if 400 <= status <= 451:
                plan.prefill_status = f"error {status}"
                return Prepared(headers, rid, body, (status, raw, member.name))
            if status != 200:
                raise _Fallback("upstream_5xx" if status >= 500 else "status", f"status {status}")
            try:
                answer = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                raise _Fallback("no_params", "the answer is not JSON") from None
            params = self.connector.transfer_params(answer)
            if params is None:
                raise _Fallback("no_params", "the answer carries no kv_transfer_params")
        except _Fallback as fb:
            plan.prefill_status = f"fallback: {fb.reason}"
            self.metrics.fallback(member.name, fb.reason)
            if fb.reason in _ENGINE_FAULTS:
                self.breakers.failure(member.name)
            log.warning(
                "prefill leg %s to %s failed (%s: %s); decode engine %s computes the prefill itself",
                rid,
                member.name,
                fb.reason,
                fb,
                route.backend,
            )
            return Prepared(headers, rid, body)
        finally:
            self.loads.finish(ticket)
            # released in the same step as the decode leg takes its own ticket (no await in between)
            self.loads.finish(reservation)
            self.metrics.leg("prefill", member.name, status, first_byte)
        plan.prefill_status = "ok"
        self.breakers.success(member.name)
        return Prepared(headers, rid, msgspec.json.encode(self.connector.decode_body(parsed, params, leg)))

    @staticmethod
    async def _read(chunks: Any) -> bytes:
        """The whole answer, up to :data:`MAX_ANSWER_BYTES`."""
        parts: list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise UpstreamError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
            parts.append(chunk)
        return b"".join(parts)


__all__ = ["MAX_ANSWER_BYTES", "LegWriter", "PDExchange", "Prepared", "with_request_id"]
