"""The proxy hot path: a lean ASGI handler for ``POST /v1/completions`` and ``/v1/chat/completions``.

It bypasses the web framework (FastAPI serves everything else) because this path runs for every
request: read the body with a size cap, decide (:class:`router.decision.service.RouterService`), send the
original bytes upstream, and stream the backend's response through chunk
by chunk over the proxy's own keep-alive HTTP/1.1 client (:mod:`router.net.upstream`), unchanged (SSE or
not, status codes and bodies included).

- A connection error or a 5xx **before the first response byte** is retried once on the next-best
  candidate; after that the backend's own error is passed through (or 502 when it never answered).
- A timeout waiting for the backend is a 504 (no retry: the work may be running there).
- A client disconnect cancels the upstream request (its connection is closed, which vLLM treats as
  an abort), and the load tracker releases the request in every case.
- The chosen DP rank goes upstream as ``X-data-parallel-rank``; the response carries
  ``x-kvrouter-backend`` and ``x-kvrouter-dp-rank`` so clients and operators can see where it went.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from router.config import ServerConfig
from router.decision.classes import request_class
from router.decision.service import Endpoint, Route, RouterService
from router.errors import (
    ApiError,
    bad_gateway,
    bad_request,
    gateway_timeout,
    too_large,
    unavailable,
)
from router.fleet.health import HealthChecker
from router.fleet.load import LoadTracker
from router.flow.controller import FlowController, Rejection, Ticket
from router.net.asgi import AsgiWriter, Headers, Receive, ResponseWriter, Scope, Send, write_json
from router.net.body import BodyBuffer
from router.net.sse import EventBuffer, EventTooLarge
from router.net.upstream import (
    RouterResourceError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from router.observe.checks import (
    PredictionChecks,
    observe_route,
    route_checkable,
    sse_usage,
    strip_usage,
    usage_in_json,
)
from router.observe.metrics import RouterMetrics
from router.pd.connector import ENGINE_FIELDS
from router.pd.exchange import PDExchange

if TYPE_CHECKING:
    from router.cluster.affinity import SessionAffinity

log = logging.getLogger("kvrouter.proxy")

PATHS: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"server",
    }
)
_FORWARD_REQUEST_HEADERS = ("x-request-id", "traceparent", "tracestate")


async def send_error(writer: ResponseWriter, err: ApiError) -> None:
    """An OpenAI-shaped JSON error response."""
    await write_json(writer, err.status, err.body())


async def send_rejection(writer: ResponseWriter, rejection: Rejection) -> None:
    """Flow control's 429/503, with its Retry-After."""
    body = rejection.body()
    await writer.start(rejection.status, rejection.headers(body))
    await writer.end(body)


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, or 413 as soon as it is known to exceed ``limit``."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                if int(value) > limit:
                    raise too_large(limit)
            except ValueError:
                raise bad_request("invalid Content-Length") from None
    body = BodyBuffer(limit)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = msg.get("body", b"")
        if chunk and not body.add(chunk):
            raise too_large(limit)
        if not msg.get("more_body", False):
            return body.take()


class _ClientGone(Exception):
    pass


def _stream_error_event(message: str) -> bytes:
    """An SSE error event (OpenAI's error shape; the openai client raises it) and the end marker."""
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    return b"data: " + msgspec.json.encode(body) + b"\n\ndata: [DONE]\n\n"


class ProxyHandler:
    """The two proxied endpoints: ``__call__`` over ASGI, :meth:`handle` once the body is read."""

    def __init__(
        self,
        service: RouterService,
        pool: UpstreamPool,
        metrics: RouterMetrics,
        loads: LoadTracker,
        server: ServerConfig,
        authorize: Callable[[Scope], None],
        health: HealthChecker,
        checks: PredictionChecks | None = None,
        pd: PDExchange | None = None,
    ) -> None:
        self.pd = pd
        """Prefill/decode disaggregation: runs a decision's prefill leg, then :meth:`_exchange`."""
        self.service = service
        self.health = health
        self.checks = checks
        self._streams_seen = 0
        self._report_mode_logged = False
        self._fields_logged = False
        self.trusted: Callable[[Iterable[tuple[bytes, bytes]]], bool] = lambda headers: False
        """Whether a request's key may pass :data:`ENGINE_FIELDS` (``trusted_api_keys``, router.app)."""
        self.pool = pool
        self.metrics = metrics
        self.loads = loads
        self.server = server
        self.authorize = authorize
        self.affinity: SessionAffinity | None = None
        """Reads the session header when session affinity is on (router/cluster)."""
        self.flow: FlowController | None = None
        """Flow control (``[flow]``, router/flow): None when off."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry: read the body, then :meth:`handle` with a task watching for the client leaving."""
        writer = AsgiWriter(send)
        try:
            self.authorize(scope)
            body = await read_body(scope, receive, self.server.max_body_bytes)
        except ApiError as err:
            await send_error(writer, err)
            return
        except asyncio.CancelledError:
            return  # the client left while sending its body
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, task))

        def gone() -> bool:
            return watcher.done() and not watcher.cancelled() and watcher.result() is True

        try:
            await self.handle(scope["path"], scope.get("headers", ()), body, writer, gone, authorized=True)
        except asyncio.CancelledError:
            if not gone():
                raise
            task.uncancel()
        finally:
            watcher.cancel()

    @staticmethod
    async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any]) -> bool:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                task.cancel()
                return True

    async def handle(
        self,
        path: str,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        writer: ResponseWriter,
        gone: Callable[[], bool],
        authorized: bool = False,
    ) -> None:
        """Decide and proxy one request whose body has been read. The caller cancels the running task
        when the client disconnects (``gone()`` then returns True); cancellation closes the upstream
        request, which is how vLLM learns to abort."""
        endpoint = PATHS[path]
        size = len(body)
        parsed: Any = None
        grant: Ticket | None = None
        try:
            if not authorized:
                self.authorize({"path": path, "headers": headers})
            parsed = await self.service.read_json(body)
            if self.flow is not None:  # flow control (router/flow): wait for room, decide after
                admitted = await self.flow.admit(self.flow.meta(headers, parsed, size))
                if isinstance(admitted, Rejection):
                    self.service.release(parsed, size)
                    await send_rejection(writer, admitted)
                    return
                grant = admitted
            t0 = time.perf_counter()
            session = self.affinity.session_of(headers) if self.affinity is not None else None
            classed = request_class(headers)
            route = await self.service.decide(
                endpoint,
                parsed,
                session=session,
                size=size,
                request_class=classed,
                band=grant.priority if grant is not None else None,
            )
            # the decision's own time: a staggered burst's hold (cluster.stagger_bursts) is counted
            # by kvrouter_cluster_held_decisions_total instead
            decision_s = time.perf_counter() - t0 - route.timings_us.get("held", 0.0) / 1e6
        except ApiError as err:
            self.service.release(parsed, size)
            await send_error(writer, err)
            return
        except asyncio.CancelledError:
            self.service.release(parsed, size)
            raise
        finally:
            if grant is not None:
                grant.release()  # (its load ticket is taken before the loop runs the queue again)
        self.metrics.routed(
            route.backend,
            route.dp_rank,
            route.outcome,
            route.prompt_tokens,
            route.chosen_media(),
            route.block_size,
            route.prompt_blocks,
            decision_s,
        )
        self.metrics.classed(classed.objective if classed is not None else None)
        sent = parsed
        if not self.server.forward_kv_report_mode:
            parsed = self._without_report_mode(parsed)
        parsed = self._without_engine_fields(parsed, headers)
        strip = False
        if self.checks is not None and parsed.get("stream") is True and route.pd is None:
            parsed, strip = self._ask_for_usage(parsed)  # (not on P/D routes: their legs differ)
        try:
            if parsed is not sent:  # (rewritten: encoded once, off the loop when large)
                body = await self.service.write_json(parsed, size)
            if route.pd is not None and self.pd is not None:  # P/D hook (router/pd/exchange.py)
                try:
                    await self.pd.run(
                        path,
                        list(headers),
                        body,
                        parsed,
                        route,
                        writer,
                        self._exchange,
                        self.upstream_headers,
                    )
                finally:
                    self.service.release(parsed, size)
            else:
                self.service.release(parsed, size)  # (what is sent is the bytes: not kept while it streams)
                await self._exchange(path, headers, writer, body, route, strip)
        except asyncio.CancelledError:
            if gone():
                log.debug("client disconnected; upstream request to %s cancelled", route.backend)
                self.metrics.error(route.backend, "client_disconnect")
            raise
        finally:
            # (the prompt's block keys, for a retry's prediction: not kept with the recent decisions,
            # where 50 prompts of a million tokens held 100 MB)
            route.report = None

    def _without_report_mode(self, parsed: dict[str, Any]) -> dict[str, Any]:
        """The request without ``vllm_xargs.kv_cache_report_mode`` (``server.forward_kv_report_mode``
        says why), ``vllm_xargs`` itself gone when nothing else is left in it; the same object when
        it is not there (the common case costs one dictionary lookup)."""
        xargs = parsed.get("vllm_xargs")
        if not isinstance(xargs, dict) or "kv_cache_report_mode" not in xargs:
            return parsed
        rest = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
        parsed = {k: v for k, v in parsed.items() if k != "vllm_xargs"}
        if rest:
            parsed["vllm_xargs"] = rest
        self.metrics.report_mode_removed.inc(())
        if not self._report_mode_logged:
            self._report_mode_logged = True
            log.warning(
                "a request asked the engine to announce its cached prefix again "
                "(vllm_xargs.kv_cache_report_mode=%s): removed, as those announcements would keep "
                "blocks in the index after the engine evicts them; server.forward_kv_report_mode = "
                "true passes it on (counted: kvrouter_kv_report_mode_removed_total)",
                repr(xargs["kv_cache_report_mode"])[:40],
            )
        return parsed

    def _without_engine_fields(
        self, parsed: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]
    ) -> dict[str, Any]:
        """The request without the body fields only the router sets for the engines
        (:data:`ENGINE_FIELDS`; ``trusted_api_keys`` says why and exempts a key). Removed here,
        before the route's paths split: ordinary and P/D routes, a skipped prefill leg, every
        fallback and retry send these bytes or build on ``parsed``. The same object when none is
        there (the common case costs a dictionary lookup)."""
        fields = [f for f in ENGINE_FIELDS if f in parsed]
        if not fields or self.trusted(headers):
            return parsed
        for field in fields:
            self.metrics.client_fields_removed.inc((field,))
        if not self._fields_logged:
            self._fields_logged = True
            log.warning(
                "a request carried %s, which only the router sets for the engines: removed, as in a "
                "NIXL fleet it could make an engine pull another engine's blocks (other tenants' "
                "prompts); trusted_api_keys lets a key pass it (counted: "
                "kvrouter_client_fields_removed_total)",
                ", ".join(fields),
            )
        return {k: v for k, v in parsed.items() if k not in fields}

    def _ask_for_usage(self, parsed: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """On one in ``checks.stream_usage_every`` client streams that did not ask for usage, ask the
        engine for it (to check the prediction) and strip it from what the client receives: returns
        (the request to send, whether to strip)."""
        assert self.checks is not None
        every = self.checks.config.stream_usage_every
        opts = parsed.get("stream_options")
        if every <= 0 or (isinstance(opts, dict) and opts.get("include_usage")):
            return parsed, False
        self._streams_seen += 1
        if self._streams_seen % every:
            return parsed, False
        options = dict(opts) if isinstance(opts, dict) else {}
        options["include_usage"] = True
        return {**parsed, "stream_options": options}, True

    def _check_soon(
        self, route: Route, target: tuple[str, int], status: int, usage: dict[str, Any] | None
    ) -> None:
        """Schedule the prediction check of a served request (after the response went out)."""
        if self.checks is not None and route_checkable(route, status):
            asyncio.get_running_loop().call_soon(self._check, route, target, usage)

    def _check(self, route: Route, target: tuple[str, int], usage: dict[str, Any] | None) -> None:
        """One prediction check, after the response went out (scheduled, off the response path)."""
        if self.checks is not None:
            observe_route(self.checks, route, target, self.service.index.block_size_of(target), usage)

    def upstream_headers(
        self, headers: Iterable[tuple[bytes, bytes]], backend_auth: dict[str, str], dp_size: int, rank: int
    ) -> list[tuple[str, str]]:
        """An engine request's headers (the client's forwarded ones, the engine's auth, its DP
        rank): every leg the router sends itself, the endpoint picker's prefill legs too."""
        out = [("content-type", "application/json"), *backend_auth.items()]
        if dp_size > 1:
            out.append(("x-data-parallel-rank", str(rank)))
        for name, value in headers:
            key = name.decode("latin-1")
            if key in _FORWARD_REQUEST_HEADERS:
                out.append((key, value.decode("latin-1")))
        return out

    async def _exchange(
        self,
        path: str,
        headers: Iterable[tuple[bytes, bytes]],
        writer: ResponseWriter,
        body: bytes,
        route: Route,
        strip: bool = False,
    ) -> None:
        members = route.members
        breakers = self.service.breakers
        breakers.request()
        targets = [(route.backend, route.dp_rank)]
        last_error: ApiError | None = None
        attempt = 0
        while attempt < len(targets):
            target = targets[attempt]
            attempt += 1
            backend = members[target[0]]
            if attempt > 1 and route.report is not None:
                self.service.predict(target, route.report)  # the prefix will be computed here now
            uncached = self.service.uncached_tokens(route, target)
            ticket = self.loads.start(target, uncached)
            started = time.perf_counter()
            try:
                try:
                    resp = await self.pool.request(
                        backend.upstream_key,
                        "POST",
                        backend.base_path + path,
                        self.upstream_headers(headers, backend.auth_headers, backend.cfg.dp_size, target[1]),
                        body,
                    )
                except UpstreamTimeout:
                    breakers.failure(backend.name)
                    self.metrics.error(backend.name, "timeout")
                    await send_error(
                        writer, gateway_timeout(f"backend {backend.name} did not answer in time")
                    )
                    return
                except RouterResourceError as exc:
                    # the router's own shortage (file descriptors): a 503 now, the backend kept
                    log.warning("request to %s not sent: %s", backend.name, exc)
                    self.metrics.error(backend.name, "router_resources")
                    await send_error(writer, unavailable(f"the router is overloaded: {exc}"))
                    return
                except UpstreamError as exc:
                    breakers.failure(backend.name)
                    if isinstance(exc, UpstreamConnectError):
                        self.health.mark_failed(backend, str(exc))
                    self.metrics.error(
                        backend.name, "connect" if isinstance(exc, UpstreamConnectError) else "protocol"
                    )
                    last_error = bad_gateway(f"backend {backend.name} failed: {exc}")
                    self._add_retry(route, targets, attempt)
                    continue
                status = resp.status
                if not 100 <= status <= 599:
                    # not a status HTTP defines (RFC 9110: 100-599): the server cannot write it
                    await resp.aclose()
                    breakers.failure(backend.name)
                    self.metrics.error(backend.name, "protocol")
                    last_error = bad_gateway(f"backend {backend.name} answered status {status}")
                    self._add_retry(route, targets, attempt)
                    continue
                if status >= 500:
                    breakers.failure(backend.name)
                else:
                    breakers.success(backend.name)
                if status >= 500 and self._add_retry(route, targets, attempt):
                    await resp.aclose()
                    self.metrics.error(backend.name, "upstream_5xx")
                    self.metrics.finished(backend.name, route.model, status, time.perf_counter() - started)
                    continue
                seen: dict[str, Any] = {}
                try:
                    usage = await self._stream(
                        writer, resp, ticket, backend.name, target[1], started, strip, seen
                    )
                except asyncio.CancelledError:
                    # the client left once the engine had reported its usage: the openai client
                    # closes a stream at [DONE], often before the response's last (chunked) frame,
                    # so many of its streams end this way; the prompt was served, its check stands
                    if "usage" in seen:
                        self._check_soon(route, target, status, seen["usage"])
                    raise
                finally:
                    await resp.aclose()
                self._check_soon(route, target, status, usage)
                self.metrics.finished(backend.name, route.model, status, time.perf_counter() - started)
                return
            finally:
                self.loads.finish(ticket)
        await send_error(writer, last_error or bad_gateway("no backend could be reached"))

    def _add_retry(self, route: Route, targets: list[tuple[str, int]], attempt: int) -> bool:
        """After the first target failed, queue the one retry: the best candidate on *another* healthy
        backend (a dead engine's other DP ranks are dead too). Ranked only on failure, so a request
        that succeeds at once never sorts the candidates. True if another target is queued."""
        if attempt == 1 and len(targets) == 1:
            members = route.members
            first = targets[0][0]
            available = self.service.breakers.available
            nxt = [
                t for t in route.ranked()[1:] if t[0] != first and members[t[0]].routable and available(t[0])
            ]
            if nxt and self.service.breakers.allow_retry():  # the budget keeps a failing fleet from a storm
                targets.append(nxt[0])
        return attempt < len(targets)

    async def _stream(
        self,
        writer: ResponseWriter,
        resp: UpstreamResponse,
        ticket: Any,
        backend: str,
        rank: int,
        started: float,
        strip: bool = False,
        seen: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Pass the response through; returns the engine's ``usage`` when it reported one (for the
        prediction check), after removing it from a stream when the router asked for it (``strip``).
        A stream's usage is also put in ``seen["usage"]`` as soon as it passed, for a client that
        leaves before the stream's end."""
        headers: Headers = [(k, v) for k, v in resp.headers if k not in _HOP_BY_HOP]
        sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        headers.append((b"x-kvrouter-backend", backend.encode()))
        headers.append((b"x-kvrouter-dp-rank", str(rank).encode()))
        await writer.start(resp.status, headers)
        if not resp.ready:
            writer.flush()  # nothing came with the headers: pass them on now, as the backend did
        first = True
        # SSE: bytes of an event not complete yet (held so a break never splits one)
        held = EventBuffer(self.server.max_sse_event_bytes) if sse else None
        usage: dict[str, Any] | None = None
        tail = b""  # a JSON body's last bytes (where vLLM puts usage)
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    first = False
                    self.loads.first_byte(ticket)
                    self.metrics.observe_ttft(backend, time.perf_counter() - started)
                if held is not None:
                    chunk = held.flush(chunk) if resp.finished else held.cut(chunk)
                    if b'"usage"' in chunk:
                        usage = sse_usage(chunk) or usage
                        if seen is not None and usage is not None:
                            seen["usage"] = usage
                        if strip:
                            chunk = strip_usage(chunk)
                elif self.checks is not None:
                    tail = (tail + chunk)[-8192:] if tail else chunk[-8192:]
                if resp.finished:
                    await writer.end(chunk)  # a whole small response goes out in one write
                    return usage if sse else usage_in_json(tail)
                if chunk:
                    await writer.send(chunk)
        except UpstreamError as exc:
            if isinstance(exc, EventTooLarge):
                self.pool.note_violation(exc.reason, backend, str(exc))
            log.warning("backend %s broke the response stream: %s", backend, exc)
            self.service.breakers.failure(backend)
            self.metrics.error(backend, "stream_broken")
            if sse and not any(k == b"content-length" for k, _ in headers):
                # a clean end the client can read: every event it got was whole, then an error
                # event (the shape vLLM streams its own errors in) and the end marker
                await writer.end(_stream_error_event(f"backend {backend} broke the stream: {exc}"))
            else:
                # the status and length are committed (an engine that gave its stream a length:
                # an error event would leave the client waiting for bytes that never come): end
                # without the final frame, so the client sees a truncated response (its head
                # included, even when no body byte went out yet)
                writer.flush()
            return None
        await writer.end(held.flush() if held is not None else b"")
        return usage if sse else usage_in_json(tail)
