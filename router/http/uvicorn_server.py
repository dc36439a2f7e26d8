"""`kvrouter serve`'s HTTP server: uvicorn (httptools, uvloop) running the router's ASGI app
(:class:`router.http.asgi.AsgiApp`), with the client limits uvicorn does not have.

kvrouter had its own HTTP/1.1 server; measured side by side behind engines with vLLM-like latencies
it cost only ~10% less router CPU per streamed request than uvicorn running the same app, short of
what a hand-written replacement of a maintained library must earn (docs/benchmarks/library-first.md).
uvicorn serves; :class:`KvProtocol`, a small subclass of its httptools protocol, adds what its
connections need to be safe in front of any client, every one a ``[server]`` key:

- ``head_timeout_s``: a request's whole head within that long of its first byte, else 408 and
  closed (a slowloris client sending a byte a second held a connection for ever); a new connection
  that sends nothing for that long is closed. uvicorn has no head deadline.
- ``body_timeout_s``: the whole body within that long of the head, else 408 and closed.
- ``max_body_bytes``: 413 as soon as a content-length or the bytes received pass it; a request
  with a body is authorized from its head (401 before any of the body is read); a head over
  64 KiB is 431 while it arrives (httptools holds an unfinished header line whole, unbounded).
- ``max_client_connections`` (lowered to what the descriptor limit holds): a connection past it is
  answered 503 with ``Retry-After`` and closed. uvicorn's ``limit_concurrency`` counts requests in
  flight too and answers without Retry-After; here open connections are counted, exactly.
- ``write_timeout_s``: a client that reads nothing of its response for that long is dropped, which
  cancels its request (uvicorn waits for a paused transport without end).
- a refused request is answered after the requests pipelined before it, then the connection
  closes *lingering*: what the client still sends is read and dropped for a moment, so the kernel
  does not reset the answer away before the client reads it;
- no single read holds the event loop: a read is parsed 16 KiB at a time, and after
  :data:`_READ_WORK` parser callbacks the rest waits for the loop's next turn (libuv hands a ready
  connection up to 32 reads in a row: 2-byte chunks or thousands of pipelined requests held it for
  0.3 s);
- the client half-closing counts as leaving (its request is cancelled, which aborts the engine's).

One shortcut, for speed: a lookup (``GET /health``, ``/ready``, ``/v1/models``, ``/metrics``, ...,
and ``POST /route`` with token ids) that arrives while nothing else on its connection is in flight
is answered from the parser's callbacks, in one write, without an ASGI cycle and its task (uvicorn's
cycle cost more than the answer: beside the client, ``/health`` took 95 us of server CPU and 139 us
p50, now 38 and 66; a 1k-token ``/route`` 240 us p50, now 158). httptools
still parses every byte and every limit above still applies; the answer is the same call as the ASGI
path's (:meth:`NativeEndpoints.answer_now`), byte for byte (a test compares the two). Anything else
(a pipelined request, a body that needs an await, an answer that closes the connection, a paused
writer, ``server.access_log``) takes the ASGI path.

uvicorn itself does the rest: keep-alive (``keepalive_timeout_s``), pipelining, chunked bodies,
``Expect: 100-continue``, response framing, and the graceful drain (``drain_timeout_s``). A client
that disconnects makes ``receive`` return ``http.disconnect``, on which the proxy cancels its task
and so closes the upstream request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterable
from email.utils import formatdate  # (what uvicorn formats its date with, imported by it)
from typing import Any, cast
from urllib.parse import unquote

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import Server, ServerState

from router.errors import (
    ApiError,
    bad_request,
    head_too_large,
    request_timeout,
    too_large,
    too_many_connections,
)
from router.frontend import Endpoints
from router.http.asgi import AsgiApp
from router.http.native import NativeEndpoints
from router.net.asgi import Message, Receive, Scope, Send
from router.net.body import FLAT_BODY_BYTES
from router.net.fds import client_connection_cap, fd_limit, open_fds
from router.net.listen import bound_socket, numeric_family, server_socket
from router.observe.exposition import Family, GaugeFamily
from router.observe.metrics import LeanCounter

log = logging.getLogger("kvrouter.server")
access = logging.getLogger("kvrouter.access")

MAX_HEAD = 64 * 1024
"""Request line plus headers (and a chunked body's trailers), bytes; more: 431."""
_LINGER_S = 2.0
"""After refusing a request, how long the rest of what the client sends is read and dropped."""
_RETRY_AFTER_S = 1
"""The ``Retry-After`` of a connection refused at ``max_client_connections``."""
_SLICE = 16 * 1024
"""A larger read is parsed this much at a time (:data:`_READ_WORK`)."""
_READ_WORK = 1024
"""Parser callbacks (a request, a chunk, 256 bytes of body) past which a connection yields: the rest
of its read, and reading, wait for the loop's next turn."""
_ANSWER_WORK = 32
"""What answering a lookup from the parser counts towards :data:`_READ_WORK` (it costs some tens of
callbacks: without it, 20k pipelined lookups were answered a thousand per turn)."""
_BACKLOG = 2048


class Limits:
    """What every connection of one server checks (from ``[server]``), and the counter of refusals."""

    def __init__(self, app: Endpoints) -> None:
        srv = app.config.server
        self.max_body_bytes = srv.max_body_bytes
        self.head_timeout = srv.head_timeout_s
        self.body_timeout = srv.body_timeout_s
        self.write_timeout = srv.write_timeout_s
        self.authorize = app.authorize_request
        """Checks a request with a body from its head (raises the 401 / 403 / 404)."""
        limit = fd_limit()
        self.max_connections = client_connection_cap(srv.max_client_connections, limit)
        """``server.max_client_connections``, lowered to what the file descriptor limit can hold."""
        log.info(
            "at most %d client connections (server.max_client_connections = %d, file descriptor limit %d)",
            self.max_connections,
            srv.max_client_connections,
            limit,
        )
        self.refusing = 0
        """Connections refused at the cap whose close lingers."""
        self.hits = LeanCounter(
            "kvrouter_client_limit_hits",
            "Client requests and connections refused at a limit, by its key: head_timeout_s, "
            "body_timeout_s (408), max_client_connections (503)",
            ["limit"],
        )


def _error_response(err: ApiError, extra: bytes = b"") -> bytes:
    """A refusal's whole response (``extra``: more header lines), closing the connection."""
    body = err.body()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        err.status,
        _REASONS.get(err.status, b""),
        len(body),
    )
    return head + extra + b"connection: close\r\n\r\n" + body


_REASONS = {
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    408: b"Request Timeout",
    413: b"Request Entity Too Large",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
"""The reason phrases of the statuses a connection is refused with."""


class DateHeader(list[tuple[bytes, bytes]]):
    """uvicorn's default response headers: the ``date`` of the second each response is started in.
    (uvicorn's main loop refreshes its list every 0.1 s, so an answer could carry a second gone by;
    each cycle adds this list to its own headers, which is where the date is read now.)"""

    def __init__(self) -> None:
        super().__init__()
        self._at = -1
        self._date = b""

    def now(self) -> list[tuple[bytes, bytes]]:
        t = int(time.time())
        if t != self._at:
            self._at = t
            self._date = formatdate(t, usegmt=True).encode()
            self[:] = [(b"date", self._date)]
        return [(b"date", self._date)]

    def __add__(self, other: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:  # type: ignore[override]
        return self.now() + other


class _Flow(FlowControl):
    """uvicorn's flow control, with a deadline on waiting for a client to read (``write_timeout_s``)
    and reading kept paused while the connection yields the loop (:data:`_READ_WORK`)."""

    def __init__(self, transport: asyncio.Transport, conn: KvProtocol) -> None:
        super().__init__(transport)
        self.conn = conn

    async def drain(self) -> None:
        # a timer, not asyncio.wait_for: on Python 3.11, when the client leaves, its task is
        # cancelled as the event is set, and wait_for then returns as if nothing happened (the
        # cancellation lost: the proxy would read the engine's stream into a dead socket to its end)
        timer = asyncio.get_running_loop().call_later(self.conn.limits.write_timeout, self.conn.drop_unread)
        try:
            await self._is_writable_event.wait()
        finally:
            timer.cancel()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.conn.yielded and not self.conn.holding():
                self._transport.resume_reading()
        self.conn.resumed()


class KvProtocol(HttpToolsProtocol):
    """uvicorn's httptools connection with kvrouter's limits (the module docstring lists them)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: Limits,
        native: NativeEndpoints | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.native = native
        """Answers lookups from the parser's callbacks (the module docstring); None: never."""
        self._quick: list[bytes] | None = None
        """The body so far of a request answered from the parser's callbacks (:meth:`_answer_quick`)."""
        self._quick_target = ("", "", b"")
        """Its method, path and query."""
        self.stopping = False
        self.yielded = False
        self._unread = b""
        """What a read held past the slice after which the connection yielded (or paused)."""
        self._work = 0
        self._work_turn = -1.0
        self._refused = False
        """Refused at ``max_client_connections`` (counted in ``Limits.refusing`` while it lingers)."""
        self._stop_reading = False
        self._reject: ApiError | None = None
        """A refusal decided in a parser callback, answered once the parser returns."""
        self._final: ApiError | None = None
        """A refusal waiting for the requests pipelined before it to be answered."""
        self._open = False
        self._in_head = False
        self._head_seen = 0
        self._head_size = 0
        self._body_size = 0
        self._maybe_trailers = False
        """A chunk header was parsed and no body followed yet: what comes may be the trailers of
        the last chunk, which httptools holds whole until each line ends (counted like a head)."""
        self._trailer_seen = 0
        self._message_cycle: Any = None
        """The request-response cycle of the request being parsed, once its head is complete."""
        self._running: Any = None
        """The cycle whose app runs (uvicorn's ``cycle`` is the latest parsed, maybe queued)."""
        self._deadline: asyncio.TimerHandle | None = None
        """The connection's one timer; it may fire before :attr:`_due` and is then moved on."""
        self._deadline_kind = ""
        """What is due (``idle``, ``head``, ``body``, ``keepalive``); empty: nothing."""
        self._due = 0.0
        self._linger: asyncio.TimerHandle | None = None

    # --- connections ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._refuse_connection()
            return
        super().connection_made(transport)
        self.flow = _Flow(transport, self)
        self._arm("idle", self.limits.head_timeout)

    def _refuse_connection(self) -> None:
        """Past ``max_client_connections``: a 503 with Retry-After, then closed (lingering, as a
        refused request is, unless many refused connections linger already: each holds a file
        descriptor, which is what the cap saves)."""
        limits = self.limits
        limits.hits.inc(("max_client_connections",))
        err = too_many_connections(limits.max_connections)
        retry = b"retry-after: %d\r\n" % _RETRY_AFTER_S
        self._stop_reading = True
        if limits.refusing >= max(16, limits.max_connections // 16):
            self.transport.write(_error_response(err, retry))
            self.transport.close()
            return
        limits.refusing += 1
        self._refused = True
        self._answer_and_close(err, retry)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self._unread = b""
        if self._refused:
            self._refused = False
            self.limits.refusing -= 1
            self.transport.close()
            return
        super().connection_lost(exc)

    def eof_received(self) -> None:
        """The client stopped sending. Treated as the client leaving (the request in flight is
        cancelled, which aborts the engine's work): clients that half-close and still read are rare,
        clients that time out and close are not, and vLLM must learn about the second at once."""
        self.transport.close()

    def shutdown(self) -> None:
        """Graceful shutdown: an idle connection is closed, one whose request is still arriving is
        answered, then closed."""
        self.stopping = True
        if self._open and (self.cycle is None or self.cycle.response_complete):
            return
        super().shutdown()

    def drop_unread(self) -> None:
        """The client read nothing for ``write_timeout_s``: dropped, its request cancelled."""
        if self.transport.is_closing() and not self.flow.write_paused:
            return
        log.warning(
            "client %s read nothing for %.0f s: disconnected",
            self.client[0] if self.client else "-",
            self.limits.write_timeout,
        )
        if self._running is not None:
            self._running.disconnected = True
            self._running.message_event.set()
        self.transport.abort()  # close() would wait for the unread buffer to flush

    # --- reading ----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._stop_reading or self.parser is None:
            return  # (refused: read and dropped while the close lingers)
        if self._unread:  # (the rest of an earlier read waits for the loop's next turn: this after it)
            self._unread += data
            return
        turn = self.loop.time()  # (uvloop's clock is read once per turn of the loop)
        if turn != self._work_turn:  # parser work is bounded per turn, not over the connection's life
            self._work_turn = turn
            self._work = 0
        for at in range(0, len(data), _SLICE):
            self._received(data[at : at + _SLICE] if len(data) > _SLICE else data)
            if (
                (self.yielded or self.flow.read_paused)
                and at + _SLICE < len(data)
                and not self._stop_reading
                and not self.transport.is_closing()
            ):
                # parsed enough for this turn, or reading paused (a pipelined request waits, or the
                # app has not taken the body so far): the rest later
                self._unread = data[at + _SLICE :]
                if self.yielded:
                    return
                if not self.flow.read_paused:
                    self._yield()
                return

    def _received(self, data: bytes) -> None:
        if self._stop_reading:
            return
        if self._in_head:
            # a head still arriving: counted here, since httptools holds an unfinished header line
            # without calling back (the slice that starts a head is bounded by _SLICE)
            end = data.find(b"\r\n\r\n")
            self._head_seen += len(data) if end < 0 else end
            if self._head_seen > MAX_HEAD:
                self._refuse(head_too_large(MAX_HEAD))
                return
        if self._maybe_trailers:
            self._trailer_seen += len(data)  # (reset by any body that follows: it was a chunk)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # an upgrade offer (h2c from `curl --http2`, some Java clients): the request itself is
            # answered in HTTP/1.1; the parser cannot go past it, so the connection closes after
            if self._reject is None:
                if self.cycle is None or self.cycle.response_complete:
                    self._refuse(bad_request("protocol upgrades are not supported"))
                    return
                self.cycle.keep_alive = False
                self._stop_reading = True
        except httptools.HttpParserError as exc:
            if self._reject is None:
                self._refuse(bad_request(f"invalid HTTP request: {exc}"))
                return
        if self._trailer_seen > MAX_HEAD and self._reject is None:
            # endless trailers: neither head nor body, so no other limit saw them
            self._reject = head_too_large(MAX_HEAD)
        if self._reject is not None:
            self._refuse(self._reject)
            return
        if self._work > _READ_WORK:
            self._yield()

    def _yield(self) -> None:
        """Read no more in this turn of the loop (:data:`_READ_WORK`)."""
        self._work = 0
        if not self.yielded and not self.transport.is_closing():
            self.yielded = True
            self.transport.pause_reading()
            self.loop.call_soon(self._unyield)

    def _unyield(self) -> None:
        self.yielded = False
        t = self.transport
        if self.parser is None or t.is_closing():
            self._unread = b""
            return
        if self._unread:
            if self.pipeline or self.flow.read_paused:
                return  # requests wait already: no more parsed before their turn (resumed())
            rest, self._unread = self._unread, b""
            self.data_received(rest)
            if self.yielded or self._unread:
                return
        if not self.flow.read_paused:
            t.resume_reading()

    def holding(self) -> bool:
        """Part of a read is held back (parsed later): reading waits until it is."""
        return bool(self._unread)

    def resumed(self) -> None:
        """uvicorn resumed reading (a response ended, or the app wants more of the body): what was
        held back is parsed on the loop's next turn, once no request waits for its turn (uvicorn
        itself would read on after every response, and its queue of pipelined requests grow by a
        read each time)."""
        if self._unread and not self.yielded:
            self.yielded = True
            self.transport.pause_reading()
            self.loop.call_soon(self._unyield)

    # --- deadlines --------------------------------------------------------------------------------
    def _arm(self, kind: str, seconds: float) -> None:
        """``kind`` is due in ``seconds``. The timer is moved lazily: every request sets a deadline
        or two, and a timer created and cancelled per request cost more than a lookup's answer
        (uvloop closes a cancelled timer on the loop's next turn), so one that would fire too
        early is left to fire and is moved on then (:meth:`_deadline_due`)."""
        due = self.loop.time() + seconds
        self._deadline_kind = kind
        self._due = due
        timer = self._deadline
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._deadline = self.loop.call_at(due, self._deadline_due)

    def _disarm(self) -> None:
        self._deadline_kind = ""  # (the timer, if any, finds nothing due when it fires)

    def _deadline_due(self) -> None:
        self._deadline = None
        kind = self._deadline_kind
        if not kind or self._stop_reading or self.transport.is_closing():
            return
        if self.loop.time() < self._due:  # (moved on since the timer was set)
            self._deadline = self.loop.call_at(self._due, self._deadline_due)
            return
        self._deadline_kind = ""
        if kind == "idle":
            self.transport.close()  # (a new connection that sent nothing: no answer)
            return
        if kind == "keepalive":
            self.timeout_keep_alive_handler()
            return
        seconds = self.limits.head_timeout if kind == "head" else self.limits.body_timeout
        if self.flow.read_paused or self._unread:
            # not reading (a request pipelined before it is being answered): its time starts again
            self._arm(kind, seconds)
            return
        limit = f"{kind}_timeout_s"
        self.limits.hits.inc((limit,))
        log.info(
            "client %s: request %s not complete after %g s: refused (server.%s)",
            self.client[0] if self.client else "-",
            kind,
            seconds,
            limit,
        )
        self._refuse(request_timeout(kind, seconds))

    def _cancel_timers(self) -> None:
        self._disarm()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    # --- parser callbacks -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._reject is not None:
            return
        self._unset_keepalive_if_required()  # (here, not on any byte: blank lines do not hold it)
        # uvicorn's scope is built once the request is known to need it (_scope): a lookup answered
        # from here never does
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._open = True
        self._in_head = True
        self._head_seen = self._head_size = self._body_size = 0
        self._maybe_trailers = False
        self._trailer_seen = 0
        self._message_cycle = None
        self._arm("head", self.limits.head_timeout)

    def _scope(self) -> None:
        """uvicorn's scope of the request being parsed (its ``on_message_begin``), with the URL and
        headers parsed so far."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def on_url(self, url: bytes) -> None:
        if self._reject is None:
            self.url += url
            self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._reject is not None or not self._in_head:
            return  # (a trailer of a chunked body: ignored; it must not add an authorization)
        self._head_size += len(name) + len(value) + 4
        name = name.lower()
        value = value.rstrip(b" \t")  # (llhttp keeps trailing whitespace, which is not the value's)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._reject is not None:
            return
        self._in_head = False
        self._disarm()
        if self._head_size > MAX_HEAD:
            self._reject = head_too_large(MAX_HEAD)
            return
        limit = self.limits.max_body_bytes
        length = -1
        chunked = False
        for name, value in self.headers:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._reject = bad_request("invalid Content-Length")
                    return
                if length > limit:
                    self._reject = too_large(limit)
                    return
            elif name == b"transfer-encoding":
                chunked = True
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        query = parsed.query or b""
        if chunked or length > 0:
            # authorized before any of the body is read: without a key, nothing of it is held
            try:
                self.limits.authorize(path, self.headers, query)
            except ApiError as err:
                self._reject = err
                return
            self._arm("body", self.limits.body_timeout)
        if self.native is not None and self._quick_fits(path, query, length, chunked):
            self._quick = []
            return
        self._scope()
        super().on_headers_complete()
        self._message_cycle = self.cycle
        if self.stopping:
            self.cycle.keep_alive = False

    def on_chunk_header(self) -> None:
        self._maybe_trailers = True
        self._work += 1

    def on_chunk_complete(self) -> None:
        self._maybe_trailers = False
        self._trailer_seen = 0

    def on_body(self, body: bytes) -> None:
        if self._reject is not None:
            return
        self._maybe_trailers = False
        self._trailer_seen = 0
        self._work += 1 + (len(body) >> 8)
        self._body_size += len(body)
        if self._body_size > self.limits.max_body_bytes:
            self._reject = too_large(self.limits.max_body_bytes)
            return
        if self._quick is not None:
            self._quick.append(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._reject is not None:
            return
        self._open = False
        self._work += 1
        self._disarm()
        self._message_cycle = None
        if self._quick is not None:
            body, self._quick = b"".join(self._quick), None
            self._work += _ANSWER_WORK
            self._answer_quick(body)
            return
        super().on_message_complete()

    # --- lookups answered from the parser's callbacks ---------------------------------------------
    def _quick_fits(self, path: str, query: bytes, length: int, chunked: bool) -> bool:
        """Whether the request whose head just ended is answered from the parser's callbacks: a
        lookup, nothing else of this connection in flight or queued, the writer not paused."""
        if (
            self.stopping
            or self.pipeline
            or (self.cycle is not None and not self.cycle.response_complete)
            or self.flow.write_paused
            or self.expect_100_continue
            or chunked
            or self.parser.should_upgrade()
            or self.parser.get_http_version() == "1.0"
            or not self.parser.should_keep_alive()
        ):
            # (an answer that closes the connection goes through uvicorn's cycle, which stops
            # there: answered here, the requests pipelined after it in the same read would be too)
            return False
        method = self.parser.get_method().decode()
        if method == "POST":
            if not 0 < length <= FLAT_BODY_BYTES:
                return False
        elif length > 0 or method not in ("GET", "HEAD"):
            return False
        native = self.native
        assert native is not None
        if not (native.from_parser and native.serves(method, path)):
            return False
        self._quick_target = (method, path, query)
        return True

    def _answer_quick(self, body: bytes) -> None:
        """Answer the request whose message just ended (:meth:`_quick_fits`) in one write; one whose
        answer needs an await goes on as uvicorn's cycle, its body already read."""
        native = self.native
        assert native is not None
        method, path, query = self._quick_target
        try:
            answer = native.answer_now(method, path, self.headers, query, body)
        except Exception:
            log.exception("answering %s %s from the parser (retried as an ASGI request)", method, path)
            answer = None  # (uvicorn's cycle answers what it raises: 500, and closes)
        if answer is None:  # (needs an await: uvicorn's cycle, as if the head ended now)
            self._scope()
            super().on_headers_complete()
            cycle = self.cycle
            cycle.body = bytearray(body)
            cycle.more_body = False
            cycle.message_event.set()
            return
        status, ctype, content = answer
        date = cast(DateHeader, self.server_state.default_headers).now()[0][1]
        head = b"%sdate: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
            STATUS_LINE[status],
            date,
            ctype,
            len(content),
        )
        self.transport.write(head if method == "HEAD" else head + content)
        self.server_state.total_requests += 1
        self._arm("keepalive", self.timeout_keep_alive)  # (not uvicorn's timer, made per response)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        if self._final is not None and not self.pipeline:
            self.server_state.total_requests += 1
            if not self.transport.is_closing():
                self._answer_and_close(self._final)  # the refused request, after every earlier answer
            return
        super().on_response_complete()

    # --- refusals ---------------------------------------------------------------------------------
    def _refuse(self, err: ApiError) -> None:
        """A request refused before it is answered (bad, too large, too slow, not authorized): read
        no further, answer it after the requests pipelined before it have been answered, close."""
        self._stop_reading = True
        self._disarm()
        self._unread = b""
        own = self._message_cycle
        if own is not None:  # (refused while its body arrives: its app must not answer too)
            own.disconnected = True
            own.message_event.set()
            self.pipeline = type(self.pipeline)(p for p in self.pipeline if p[0] is not own)
            if own.response_started:
                self.transport.close()
                return
        running = self._running
        earlier = self.pipeline or (
            running is not None and running is not own and not running.response_complete
        )
        if earlier:
            self._final = err
            self.flow.pause_reading()
            return
        self._answer_and_close(err)

    def _answer_and_close(self, err: ApiError, extra: bytes = b"") -> None:
        """Answer a refused request, then close *lingering*: our side is shut for writing and what the
        client still sends (the rest of a huge head or body) is read and dropped for a moment, so the
        kernel does not answer it with a reset that would destroy the answer before the client reads
        it (the lingering close of nginx and Apache)."""
        t = self.transport
        if t.is_closing():
            return
        t.write(_error_response(err, extra))
        self._stop_reading = True
        self._disarm()
        if not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        t.resume_reading()
        self._linger = self.loop.call_later(_LINGER_S, self._close_now)

    def _close_now(self) -> None:
        t = self.transport
        if not t.is_closing():
            t.close()
            if t.get_write_buffer_size():
                # close() waits for the buffer to flush: a client that never reads would hold it
                self.loop.call_later(self.limits.write_timeout, t.abort)


class _ClientCollector:
    """Client connections and the process's file descriptors, read at scrape time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server

    def collect(self) -> Iterable[Family]:
        srv = self.server
        for name, doc, value in (
            ("kvrouter_client_connections", "Open client connections", len(srv.connections)),
            (
                "kvrouter_max_client_connections",
                "Client connections accepted at most (server.max_client_connections, lowered to "
                "what the file descriptor limit holds)",
                srv.limits.max_connections,
            ),
            ("kvrouter_open_fds", "File descriptors open in the process", open_fds()),
            ("kvrouter_fd_limit", "The process's file descriptor limit (soft RLIMIT_NOFILE)", fd_limit()),
        ):
            if value is not None:
                family = GaugeFamily(name, doc)
                family.add_metric([], value)
                yield family


class _AccessLog:
    """``server.access_log``: one line per request on ``kvrouter.access`` (status and duration)."""

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_seen(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_seen)
        finally:
            client = scope.get("client")
            access.info(
                '%s - "%s %s HTTP/%s" %d %.1fms',
                client[0] if client else "-",
                scope["method"],
                scope["path"],
                scope["http_version"],
                status[0],
                (time.perf_counter() - t0) * 1e3,
            )


class HttpServer:
    """Serves a router (:class:`router.frontend.Endpoints`, a ``KVRouter``) with uvicorn on one
    listening socket; ``start`` / ``stop`` or ``run``."""

    def __init__(self, app: Endpoints, sock: socket.socket | None = None) -> None:
        srv = app.config.server
        self.app = app
        self.host = srv.host
        self.port = srv.port
        self.sock = sock
        self.drain_timeout = srv.drain_timeout_s
        self.limits = Limits(app)
        app.metrics.add_series([self.limits.hits])
        app.metrics.add_collector(_ClientCollector(self))
        self.asgi = AsgiApp(app)
        self.config = Config(
            _AccessLog(self.asgi) if srv.access_log else self.asgi,
            http=functools.partial(  # type: ignore[arg-type]
                KvProtocol, limits=self.limits, native=None if srv.access_log else self.asgi.native
            ),
            ws="none",
            lifespan="off",  # (the router starts before the port listens: start())
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=srv.keepalive_timeout_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=srv.drain_timeout_s,  # type: ignore[arg-type]
            backlog=_BACKLOG,
        )
        self.server = Server(self.config)
        self.stopping = False

    @property
    def connections(self) -> set[Any]:
        """The open client connections (those refused at the cap are not counted)."""
        return self.server.server_state.connections

    def _sockets(self) -> list[socket.socket]:
        """The listening sockets, bound, not listening yet: a numeric address as it is, a host name
        at every address it resolves to."""
        sock = server_socket(self.host, self.port)
        if sock is not None:
            return [sock]
        out: list[socket.socket] = []
        try:
            seen: set[Any] = set()
            for info in socket.getaddrinfo(
                self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                addr = str(info[4][0])
                if addr in seen or numeric_family(addr) is None:
                    continue
                seen.add(addr)
                s = bound_socket(addr, self.port, reuse_port=False)
                s.setblocking(False)
                out.append(s)
        except BaseException:
            for s in out:
                s.close()
            raise
        return out

    async def start(self, before_listen: Callable[[], None] | None = None) -> None:
        """Bind, start the router's background work, then listen and serve. The address is bound
        first, so a port in use fails before any backend is probed or stream subscribed; it listens
        only once the router serves, so a client or a TCP health check is refused while it starts
        (an L4 balancer's failover keeps working) rather than held. A socket handed in is served as
        given. ``before_listen`` is called once the router has started, before the port listens."""
        sockets = [self.sock] if self.sock is not None else self._sockets()
        try:
            await self.app.startup()
            if before_listen is not None:
                before_listen()
            self.config.load()
            self.server.lifespan = self.config.lifespan_class(self.config)
            self.server.server_state.default_headers = DateHeader()
            await self.server.startup(sockets=sockets)
        except BaseException:
            if self.sock is None:
                for s in sockets:
                    s.close()  # (ours; a socket handed in stays its owner's)
            raise
        self.port = int(sockets[0].getsockname()[1])
        log.info("kvrouter listening on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests for ``drain_timeout_s``, stop the router."""
        self.stopping = True
        if self.server.started:
            n = len(self.connections)
            if n:
                log.info("draining %d connection(s) for up to %.0f s", n, self.drain_timeout)
            await self.server.shutdown()
            tasks = list(self.server.server_state.tasks)
            if tasks:
                await asyncio.wait(tasks, timeout=5)  # (cancelled by uvicorn past the drain)
            for conn in list(self.connections):
                if conn.transport is not None and not conn.transport.is_closing():
                    conn.transport.close()
        await self.app.shutdown()

    async def run(
        self, stop: asyncio.Event | None = None, before_listen: Callable[[], None] | None = None
    ) -> None:
        """Serve until SIGINT/SIGTERM (or until ``stop`` is set), then shut down gracefully
        (``before_listen``: as :meth:`start`'s)."""
        await self.start(before_listen)
        loop = asyncio.get_running_loop()
        stop = stop or asyncio.Event()
        installed: list[signal.Signals] = []
        handlers = {signal.SIGINT: stop.set, signal.SIGTERM: stop.set, signal.SIGHUP: self.app.request_reload}
        for sig, handler in handlers.items():
            try:
                loop.add_signal_handler(sig, handler)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): the caller sets ``stop``
        try:
            await stop.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await self.stop()


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop when installed (measured faster for this server), else asyncio's."""
    try:
        # optional: uvloop when installed
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


__all__ = ["MAX_HEAD", "DateHeader", "HttpServer", "KvProtocol", "Limits", "loop_factory"]
