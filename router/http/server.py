"""kvrouter's own HTTP/1.1 server (asyncio + httptools' C parser): the two proxied endpoints and
the lookup endpoints (/health, /ready, /v1/models, /route: :mod:`router.http.native`) run natively,
everything else goes through the FastAPI app over a minimal ASGI bridge.

Why not uvicorn for the hot path (measured side by side): under uvicorn every proxied response
costs two socket writes (status line and headers, then the body) plus ASGI message dicts and a task
watching for the client leaving. On the 2-vCPU VM we benchmark on, a write that wakes the peer is the
largest single cost of a request, so owning the socket lets a small response go out in one write and
a disconnect cancel the request's task directly. Behind engines with real latencies (TTFT tens of
ms, a token every 20 ms, streamed) that saves only ~10% of the router's CPU per request and of the
tail latency it adds, against uvicorn running the same app; what keeps this server is that it bounds
a request's whole head and whole body in time (``head_timeout_s``, ``body_timeout_s``), which
uvicorn does not. The ASGI app stays complete (``AsgiApp(KVRouter)``, :mod:`router.http.framework`,
tested under uvicorn), so any ASGI server can run kvrouter too.

What it implements, and no more:

- HTTP/1.0 and 1.1, keep-alive with an idle timeout, pipelined requests answered in order (reading
  pauses while one is in flight), content-length and chunked request bodies, ``Expect: 100-continue``;
- every request is parsed by httptools on its own connection: nothing parsed or answered on one
  connection is reused for another (a parse or an answer kept across connections would be state on
  the security boundary that a smuggled request could reach, for ~2-3 us of a streamed request
  that costs the router ~1-2 ms of CPU);
- limits: request line plus headers at most ``_MAX_HEAD`` bytes (431), body at most
  ``max_body_bytes`` (413 as soon as it is known, then the connection is closed), held in one
  buffer; the whole head within ``head_timeout_s`` of its first byte and the whole body within
  ``body_timeout_s`` of the head (408, then closed); a request with a body is authorized from its
  head (401 before any of the body is read); at most ``max_client_connections`` open connections
  (a new one past it is answered 503 with ``Retry-After`` and closed);
- response framing: the handler's content-length, else chunked (1.1) or close-delimited (1.0);
  no body for HEAD, 204 and 304;
- flow control: a handler's write waits while the client is not reading (transport high-water mark),
  for at most ``write_timeout_s``, then the client is disconnected;
- a client disconnect cancels the request's task (the proxy then closes its upstream request);
- graceful shutdown: stop accepting, close idle connections, give in-flight requests
  ``drain_timeout_s``, then cancel what is left.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, cast
from urllib.parse import unquote

import httptools

from router.errors import (
    ApiError,
    bad_request,
    head_too_large,
    internal_error,
    request_timeout,
    too_large,
    too_many_connections,
)
from router.frontend import Endpoints
from router.http.native import NativeEndpoints
from router.net.asgi import Headers, Message
from router.net.body import BodyBuffer
from router.net.fds import client_connection_cap, fd_limit, open_fds
from router.net.listen import server_socket
from router.observe.exposition import Family, GaugeFamily
from router.observe.metrics import LeanCounter
from router.proxy import PATHS, send_error

log = logging.getLogger("kvrouter.server")
access = logging.getLogger("kvrouter.access")

_MAX_HEAD = 64 * 1024
_LINGER_S = 2.0
"""After refusing a request, how long the rest of what the client sends is read and dropped."""
_RETRY_AFTER_S = 1
"""The ``Retry-After`` of a connection refused at ``max_client_connections``."""
_SLICE = 16 * 1024
"""A larger read is parsed this much at a time (:data:`_READ_WORK`)."""
_READ_WORK = 1024
"""Parsing work (a request, a chunk, 256 bytes of body) past which a connection yields: the rest of
its read, and reading, wait for the loop's next turn. libuv reads a ready socket up to 32 times in a
row: 32 reads of 2-byte chunks (256 KB each, 10-40 ms of parsing) held the loop for 0.3 s, and 32
reads of an 8 MB body 30 ms. Each connection yields at most once per 256 KB of body."""
_ANSWERS_PER_TURN = 64
"""Pipelined requests answered at once in one turn of the loop; the rest on the next turns."""
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})
_NO_BODY = frozenset({204, 304})
_BACKLOG = 2048
# reason phrases (RFC 9110 and the registry); an enum built from http.HTTPStatus costs ~3 ms of start-up
_REASONS = {
    100: b"Continue",
    101: b"Switching Protocols",
    102: b"Processing",
    103: b"Early Hints",
    200: b"OK",
    201: b"Created",
    202: b"Accepted",
    203: b"Non-Authoritative Information",
    204: b"No Content",
    205: b"Reset Content",
    206: b"Partial Content",
    207: b"Multi-Status",
    208: b"Already Reported",
    226: b"IM Used",
    300: b"Multiple Choices",
    301: b"Moved Permanently",
    302: b"Found",
    303: b"See Other",
    304: b"Not Modified",
    305: b"Use Proxy",
    307: b"Temporary Redirect",
    308: b"Permanent Redirect",
    400: b"Bad Request",
    401: b"Unauthorized",
    402: b"Payment Required",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    406: b"Not Acceptable",
    407: b"Proxy Authentication Required",
    408: b"Request Timeout",
    409: b"Conflict",
    410: b"Gone",
    411: b"Length Required",
    412: b"Precondition Failed",
    413: b"Request Entity Too Large",
    414: b"Request-URI Too Long",
    415: b"Unsupported Media Type",
    416: b"Requested Range Not Satisfiable",
    417: b"Expectation Failed",
    418: b"I'm a Teapot",
    421: b"Misdirected Request",
    422: b"Unprocessable Entity",
    423: b"Locked",
    424: b"Failed Dependency",
    425: b"Too Early",
    426: b"Upgrade Required",
    428: b"Precondition Required",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    451: b"Unavailable For Legal Reasons",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
    506: b"Variant Also Negotiates",
    507: b"Insufficient Storage",
    508: b"Loop Detected",
    510: b"Not Extended",
    511: b"Network Authentication Required",
}
_DAYS = (b"Mon", b"Tue", b"Wed", b"Thu", b"Fri", b"Sat", b"Sun")
_MONTHS = (b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec")


def http_date(t: float) -> bytes:
    """RFC 9110's IMF-fixdate of ``t`` (English names whatever the locale; email.utils, which does
    the same, is ~4 ms of a starting router's imports)."""
    tm = time.gmtime(t)
    return b"%s, %02d %s %04d %02d:%02d:%02d GMT" % (
        _DAYS[tm.tm_wday],
        tm.tm_mday,
        _MONTHS[tm.tm_mon - 1],
        tm.tm_year,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
    )


class _Request:
    """A complete request: what the parser saw, body included."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query", "raw_path", "version")

    def __init__(
        self,
        method: str,
        path: str,
        raw_path: bytes,
        query: bytes,
        headers: Headers,
        body: bytes,
        version: str,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.raw_path = raw_path
        self.query = query
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive


class _Writer:
    """The :class:`router.http.ResponseWriter` of one request on one connection."""

    __slots__ = ("_bodyless", "_chunked", "_head", "committed", "conn", "ended", "req", "started", "status")

    def __init__(self, conn: _Connection, req: _Request) -> None:
        self.conn = conn
        self.req = req
        self.started = False
        self.committed = False
        self.ended = False
        self.status = 0
        self._head = b""
        self._chunked = False
        self._bodyless = req.method == "HEAD"

    async def start(self, status: int, headers: Headers) -> None:
        req = self.req
        self.started = True
        self.status = status
        self._bodyless = req.method == "HEAD" or status in _NO_BODY or status < 200
        has_length = False
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"")), self.conn.server.date_line()]
        for name, value in headers:
            name = name.lower()
            if name in _FRAMING:
                if name != b"content-length":
                    continue  # framing and connection management are this server's job
                has_length = True
            lines.append(b"%s: %s\r\n" % (name, value))
        if not has_length and not self._bodyless:
            if req.version == "1.1":
                self._chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            else:
                req.keep_alive = False  # HTTP/1.0 without a length: the body ends with the connection
        if self.conn.server.stopping:
            req.keep_alive = False  # draining: tell the client not to reuse this connection
        if not req.keep_alive:
            lines.append(b"connection: close\r\n")
        elif req.version == "1.0":
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        self._head = b"".join(lines)

    def flush(self) -> None:
        if self._head:
            self.conn.write(self._head)
            self._head = b""
            self.committed = True

    def _frame(self, chunk: bytes) -> bytes:
        if self._bodyless or not chunk:
            return b""
        if self._chunked:
            return b"%x\r\n%s\r\n" % (len(chunk), chunk)
        return chunk

    async def send(self, chunk: bytes) -> None:
        data = self._frame(chunk)
        if self._head:
            data = self._head + data
            self._head = b""
        if data:
            self.committed = True
            conn = self.conn
            conn.write(data)
            if conn.write_paused:
                await conn.drain()

    async def end(self, chunk: bytes = b"") -> None:
        data = self._frame(chunk)
        if self._chunked:
            data += b"0\r\n\r\n"
        if self._head:
            data = self._head + data
            self._head = b""
        self.ended = True
        self.committed = True
        if data:
            self.conn.write(data)


class _Connection(asyncio.Protocol):
    """One client connection: parser state, the queue of complete requests, the running request."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.sockname: tuple[str, int] | None = None
        self.queue: collections.deque[_Request] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.gone = False
        self.write_paused = False
        self.read_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None
        self._idle_for = server.head_timeout
        """How long the connection may stay idle: a new one, until its first head is due; then the
        keep-alive timeout."""
        self._linger: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._due = 0.0
        """When the part of a request arriving now (its head, else its body) is due, on the loop's
        clock; 0: nothing is arriving. One lazy timer, as for the idle timeout."""
        self._due_head = True
        self._completed = 0
        """Requests the parser completed on this connection."""
        self._work = 0
        """Parsing work since the connection last yielded (:data:`_READ_WORK`)."""
        self._yielded = False
        self._unread = b""
        """What a read held past the slice after which the connection yielded."""
        self._reject: ApiError | None = None
        self._final: ApiError | None = None
        self._stop_reading = False
        self._in_head = False
        self._open = False
        self._head_seen = 0
        self._maybe_trailers = False
        """A chunk header was parsed and no body followed yet: what comes may be the trailers of
        the last chunk, which httptools buffers whole until each line ends (counted like a head)."""
        self._trailer_seen = 0
        self._refused = False
        """Refused at ``max_client_connections`` and lingering (counted in ``HttpServer.refusing``)."""
        self._body = BodyBuffer(server.max_body_bytes)
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._parsed: tuple[bytes, str, bytes] | None = None
        self._headers: Headers = []
        self._head_size = 0
        if self._body.size:
            self._body.clear()

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        name = transport.get_extra_info("sockname")
        self.sockname = (str(name[0]), int(name[1])) if isinstance(name, tuple) else None
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._refuse_connection()
            return
        server.connections.add(self)
        self._arm_idle()

    def _refuse_connection(self) -> None:
        """Past ``max_client_connections``: a 503 with Retry-After, then closed (lingering, as a
        refused request is, unless many refused connections linger already: each holds a file
        descriptor, which is what the cap saves)."""
        server = self.server
        server.limit_hits.inc(("max_client_connections",))
        err = too_many_connections(server.max_connections)
        retry = b"retry-after: %d\r\n" % _RETRY_AFTER_S
        if server.refusing >= max(16, server.max_connections // 16):
            self._stop_reading = True
            self.write(self._error_response(err, retry))
            self.close()
            return
        server.refusing += 1
        self._refused = True
        self._answer_and_close(err, retry)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server.connections.discard(self)
        if self._refused:
            self._refused = False
            self.server.refusing -= 1
        self._cancel_timers()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        for fut in (self._drain, self._lost):
            if fut is not None and not fut.done():
                fut.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._unread:  # (the rest of an earlier read waits for the loop's next turn: this after it)
            self._unread += data
            return
        if len(data) <= _SLICE:
            self._received(data)
            return
        for at in range(0, len(data), _SLICE):
            self._received(data[at : at + _SLICE])
            if (
                (self._yielded or self.read_paused)
                and at + _SLICE < len(data)
                and not self._stop_reading
                and not self.gone
            ):
                # parsed enough for this turn (or requests wait, pipelined): the rest on the next
                self._unread = data[at + _SLICE :]
                if not self._yielded:
                    self._yielded = True
                    self.loop.call_soon(self._unyield)
                return

    def _received(self, data: bytes) -> None:
        server = self.server
        self._disarm_idle()
        if self._stop_reading:
            return
        self._idle_for = server.keepalive_timeout  # (it spoke: idle from now on means between requests)
        if self._in_head:
            # a head still arriving: count it here, since httptools buffers an unfinished header
            # line without calling back (the chunk that starts a head is bounded by the read size)
            end = data.find(b"\r\n\r\n")
            self._head_seen += len(data) if end < 0 else end
            if self._head_seen > _MAX_HEAD:
                self._refuse(head_too_large(_MAX_HEAD))
                return
        if self._maybe_trailers:
            self._trailer_seen += len(data)  # (reset by any body that follows: it was a chunk)
        completed = self._completed
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # an upgrade offer (h2c from `curl --http2`, some Java clients): answer the request
            # itself in HTTP/1.1, as uvicorn does; the parser cannot go past it, so close afterwards
            if not self.queue:
                self._refuse(bad_request("protocol upgrades are not supported"))
                return
            self.queue[-1].keep_alive = False
            self._stop_reading = True
        except httptools.HttpParserError as exc:
            self._refuse(bad_request(f"invalid HTTP request: {exc}"))
            return
        if self._trailer_seen > _MAX_HEAD and self._reject is None:
            # endless trailers: neither head nor body, so no other limit saw them (memory grew,
            # and httptools' buffering of one endless line stalled the loop)
            self._reject = head_too_large(_MAX_HEAD)
        if self._reject is not None:
            self._refuse(self._reject)
            return
        if self._open or self._completed == completed:
            # a request still arriving, or bytes that began none (blank lines): its deadline runs
            self._track_deadline()
        if self._work > _READ_WORK:
            self._yield_reading()
        self._after_read()

    def _yield_reading(self) -> None:
        """Read no more in this turn of the loop (:data:`_READ_WORK`)."""
        self._work = 0
        t = self.transport
        if not self._yielded and not self.read_paused and t is not None and not t.is_closing():
            self._yielded = True
            t.pause_reading()
            self.loop.call_soon(self._unyield)

    def _unyield(self) -> None:
        self._yielded = False
        if self.gone:
            self._unread = b""
            return
        if self._unread:
            rest, self._unread = self._unread, b""
            self.data_received(rest)
            if self._yielded:
                return
        t = self.transport
        if not self.read_paused and t is not None and not t.is_closing():
            t.resume_reading()  # (unless reading was paused meanwhile for a request in flight)

    def _track_deadline(self) -> None:
        """The part of the request arriving now is due ``head_timeout_s`` after its first byte (the
        head) or ``body_timeout_s`` after the head (the body): set when it starts arriving."""
        head = self._in_head or not self._open
        if self._due and self._due_head == head:
            return
        server = self.server
        self._due_head = head
        self._due = self.loop.time() + (server.head_timeout if head else server.body_timeout)
        timer = self._deadline
        if timer is not None and timer.when() > self._due:
            timer.cancel()  # (set for a later part: a body's, before this next head)
            timer = None
        if timer is None:
            self._deadline = self.loop.call_at(self._due, self._deadline_due)

    def _deadline_due(self) -> None:
        self._deadline = None
        due = self._due
        if not due or self._stop_reading or self.gone:
            return
        left = due - self.loop.time()
        if left > 1e-3:
            self._deadline = self.loop.call_later(left, self._deadline_due)
            return
        head = self._due_head
        seconds = self.server.head_timeout if head else self.server.body_timeout
        if self.read_paused:
            # not reading (a request pipelined before it is being answered): its time starts again
            self._due = self.loop.time() + seconds
            self._deadline = self.loop.call_at(self._due, self._deadline_due)
            return
        self._due = 0.0
        limit = "head_timeout_s" if head else "body_timeout_s"
        self.server.limit_hits.inc((limit,))
        what = "head" if head else "body"
        log.info(
            "client %s: request %s not complete after %g s: refused (server.%s)",
            self.client[0] if self.client else "-",
            what,
            seconds,
            limit,
        )
        self._refuse(request_timeout(what, seconds))

    def _after_read(self) -> None:
        if self.queue:
            if self.task is None:
                self._next()
            elif not self.read_paused and self.transport is not None:
                self.read_paused = True  # a pipelined request waits; read no further meanwhile
                self.transport.pause_reading()
        elif self.task is None:
            self._arm_idle()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset_message()
        self._open = True
        self._in_head = True
        self._head_seen = 0
        self._maybe_trailers = False
        self._trailer_seen = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer of a chunked body: ignored (it must not add an authorization)
        self._headers.append((name.lower(), value))
        self._head_size += len(name) + len(value) + 4

    def on_chunk_header(self) -> None:
        self._maybe_trailers = True
        self._work += 1

    def on_chunk_complete(self) -> None:
        self._maybe_trailers = False
        self._trailer_seen = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._reject is not None:
            return
        if self._head_size > _MAX_HEAD:
            self._reject = head_too_large(_MAX_HEAD)
            return
        limit = self.server.max_body_bytes
        expect = False
        body = False
        for name, value in self._headers:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    self._reject = bad_request("invalid Content-Length")
                    return
                if length > limit:
                    self._reject = too_large(limit)
                    return
                body = length > 0
            elif name == b"transfer-encoding":
                body = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        if body:
            # authorized before any of the body is read: without a key, nothing of it is held
            _, path, query = self._target()
            try:
                self.server.authorize(path, self._headers, query)
            except ApiError as err:
                self._reject = err
                return
        if expect and self.task is None and not self.queue and self.parser.get_http_version() == "1.1":
            # only when nothing is in flight: mid-response it would corrupt the response being sent;
            # a client whose 100 is skipped sends its body after its own short wait anyway
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._maybe_trailers = False
        self._trailer_seen = 0
        self._work += 1 + (len(body) >> 8)
        if self._reject is None and not self._body.add(body):
            self._reject = too_large(self.server.max_body_bytes)

    def _target(self) -> tuple[bytes, str, bytes]:
        """The request target's raw path, path (percent-decoded) and query, parsed once."""
        if self._parsed is None:
            parsed = httptools.parse_url(self._url)
            raw_path: bytes = parsed.path
            path = raw_path.decode("latin-1")
            if "%" in path:
                path = unquote(path)
            self._parsed = (raw_path, path, parsed.query or b"")
        return self._parsed

    def on_message_complete(self) -> None:
        self._open = False
        self._due = 0.0
        self._completed += 1
        self._work += 1
        if self._reject is not None:
            return
        raw_path, path, query = self._target()
        body = self._body.take()
        keep_alive = self.parser.should_keep_alive()
        self.queue.append(
            _Request(
                self.parser.get_method().decode("latin-1"),
                path,
                raw_path,
                query,
                self._headers,
                body,
                self.parser.get_http_version(),
                keep_alive,
            )
        )
        self._reset_message()

    # --- requests --------------------------------------------------------------------------------
    def _next(self) -> None:
        answered = 0
        while True:
            if self.write_paused:
                # the client reads none of what was answered (pipelining, never reading): answer the
                # rest once it reads, and read no more meanwhile, so memory stays bounded
                if not self.read_paused and self.transport is not None:
                    self.read_paused = True
                    self.transport.pause_reading()
                self.task = self.loop.create_task(self._after_drain())
                return
            req = self.queue.popleft()
            answer = (
                None  # (every request through the task, which writes the access log line)
                if self.server.access_log
                else self.server.native.answer_now(req.method, req.path, req.headers, req.query, req.body)
            )
            if answer is None:
                self.task = self.loop.create_task(self._run(req))
                return
            # a GET answered at once (/health, /ready, /v1/models, /metrics, ...): no task, one write
            if not self._write_now(req.method, req.version, req.keep_alive, *answer):
                return
            if not self.queue:
                break
            answered += 1
            if answered == _ANSWERS_PER_TURN:  # (many pipelined: the rest after the loop's other work)
                if not self.read_paused and self.transport is not None:
                    self.read_paused = True
                    self.transport.pause_reading()
                self.task = self.loop.create_task(self._answer_later())
                return
        if self._final is not None:
            self._answer_and_close(self._final)
            return
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        self._arm_idle()

    async def _answer_later(self) -> None:
        """The queued requests, on a later turn of the loop (:data:`_ANSWERS_PER_TURN`)."""
        await asyncio.sleep(0)
        self.task = None
        if self.queue:
            self._next()

    async def _after_drain(self) -> None:
        """The queued requests, once the client reads again (dropped by drain() after
        ``write_timeout_s`` if it never does)."""
        try:
            await self.drain()
        except asyncio.CancelledError:
            return  # gone, or dropped by the write timeout
        self.task = None
        if self.queue:
            self._next()

    def _write_now(
        self, method: str, version: str, keep_alive: bool, status: int, ctype: bytes, body: bytes
    ) -> bool:
        """A complete response in one write, framed as :class:`_Writer` frames one; False when the
        connection is closed after it."""
        if self.server.stopping:
            keep_alive = False
        self.write(self._response(method, version, keep_alive, status, ctype, body))
        if not keep_alive or self.gone:
            self.close()
            return False
        return True

    def _response(
        self, method: str, version: str, keep_alive: bool, status: int, ctype: bytes, body: bytes
    ) -> bytes:
        """The bytes of a complete response, in one piece."""
        conn = b""
        if not keep_alive:
            conn = b"connection: close\r\n"
        elif version == "1.0":
            conn = b"connection: keep-alive\r\n"
        return b"HTTP/1.1 %d %s\r\n%scontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
            status,
            _REASONS.get(status, b""),
            self.server.date_line(),
            ctype,
            len(body),
            conn,
            b"" if method == "HEAD" else body,
        )

    async def _run(self, req: _Request) -> None:
        writer = _Writer(self, req)
        t0 = time.perf_counter()
        try:
            await self.server.dispatch(req, writer, self)
        except asyncio.CancelledError:
            self.close()
            if not self.gone:
                raise  # cancelled by shutdown, not by the client
            return
        except Exception:
            log.exception("unhandled error in %s %s", req.method, req.path)
            if not writer.committed:
                writer = _Writer(self, req)
                await send_error(writer, internal_error())
        finally:
            if self.server.access_log:
                access.info(
                    '%s - "%s %s HTTP/%s" %d %.1fms',
                    self.client[0] if self.client else "-",
                    req.method,
                    req.path,
                    req.version,
                    writer.status,
                    (time.perf_counter() - t0) * 1e3,
                )
        if not writer.ended or not req.keep_alive or self.server.stopping or self.gone:
            self.close()  # a response that did not end properly must look truncated
            return
        self.task = None
        if self.queue:
            self._next()
            return
        if self._final is not None:
            self._answer_and_close(self._final)  # the refused request, after every earlier answer
            return
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        self._arm_idle()

    def _refuse(self, err: ApiError) -> None:
        """A request refused before it is handled (bad, too large): read no further, answer it after
        the requests pipelined before it have been answered, then close."""
        self._stop_reading = True
        if self.task is None and not self.queue:
            self._answer_and_close(err)
            return
        self._final = err
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self._next()

    @staticmethod
    def _error_response(err: ApiError, extra: bytes = b"") -> bytes:
        """A refusal's whole response (``extra``: more header lines), closing the connection."""
        body = err.body()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
            err.status,
            _REASONS.get(err.status, b""),
            len(body),
        )
        return head + extra + b"connection: close\r\n\r\n" + body

    def _answer_and_close(self, err: ApiError, extra: bytes = b"") -> None:
        """Answer a refused request, then close *lingering*: our side is shut for writing and what the
        client still sends (the rest of a huge head or body) is read and dropped for a moment, so the
        kernel does not answer it with a reset that would destroy the answer before the client reads
        it (the lingering close of nginx and Apache)."""
        self.write(self._error_response(err, extra))
        t = self.transport
        if t is None or t.is_closing() or not t.can_write_eof():
            self.close()
            return
        self._cancel_timers()
        self._stop_reading = True
        t.write_eof()
        if self.read_paused:
            self.read_paused = False
            t.resume_reading()
        self._linger = self.loop.call_later(_LINGER_S, self.close)

    def eof_received(self) -> bool | None:
        """The client stopped sending. Treated as the client leaving (the request in flight is
        cancelled, which aborts the backend's work): clients that half-close and still read are rare,
        clients that time out and close are not, and vLLM must learn about the second at once."""
        self.close()
        return None

    # --- helpers ---------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        t = self.transport
        if t is not None and not self.gone and not t.is_closing():
            t.write(data)

    async def drain(self) -> None:
        """Wait until the client reads again (or leaves); drop it after ``write_timeout_s``."""
        while self.write_paused and not self.gone:
            self._drain = self.loop.create_future()
            try:
                await asyncio.wait_for(self._drain, self.server.write_timeout)
            except TimeoutError:
                log.warning(
                    "client %s read nothing for %.0f s: disconnected",
                    self.client[0] if self.client else "-",
                    self.server.write_timeout,
                )
                self.gone = True
                if self.transport is not None:
                    self.transport.abort()  # close() would wait for the unread buffer to flush
                raise asyncio.CancelledError from None
        if self.gone:
            # the client left while we waited: connection_lost cancelled the task and completed
            # the future, and on Python 3.11 wait_for then returns as if nothing happened (the
            # cancellation is lost): raised here, so the handler stops and the engine's request
            # is aborted instead of generating into a dead socket to the end
            raise asyncio.CancelledError

    async def wait_lost(self) -> None:
        """Until the client disconnects."""
        if self.gone:
            return
        if self._lost is None:
            self._lost = self.loop.create_future()
        # shielded: a waiter that is cancelled (Starlette cancels its disconnect listener when a
        # response ends) must not cancel the connection's future for the next request
        await asyncio.shield(self._lost)

    def close(self) -> None:
        self._cancel_timers()
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()
            if t.get_write_buffer_size():
                # close() waits for the buffer to flush: a client that never reads would hold it
                self.loop.call_later(self.server.write_timeout, t.abort)

    def _arm_idle(self) -> None:
        """The connection is idle from now: closed after ``keepalive_timeout`` unless a request
        comes. Lazy: a request only moves ``_idle_since``, and the one timer, when it fires early,
        sets itself again for what is left (a timer cancelled and created per request cost more
        than the rest of answering a ``/health``)."""
        self._idle_since = self.loop.time()
        if self._idle is None:
            self._idle = self.loop.call_later(self._idle_for, self._idle_due)

    def _disarm_idle(self) -> None:
        self._idle_since = None

    def _idle_due(self) -> None:
        self._idle = None
        if self._idle_since is None:
            return  # busy: armed again once idle
        left = self._idle_since + self._idle_for - self.loop.time()
        if left > 1e-3:  # (the loop's clock counts milliseconds: less is due now, not a spin)
            self._idle = self.loop.call_later(left, self._idle_due)
        else:
            self.close()

    def _cancel_timers(self) -> None:
        self._idle_since = None
        self._due = 0.0
        for timer in (self._idle, self._linger, self._deadline):
            if timer is not None:
                timer.cancel()
        self._idle = self._linger = self._deadline = None


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
                srv.max_connections,
            ),
            ("kvrouter_open_fds", "File descriptors open in the process", open_fds()),
            ("kvrouter_fd_limit", "The process's file descriptor limit (soft RLIMIT_NOFILE)", fd_limit()),
        ):
            if value is not None:
                family = GaugeFamily(name, doc)
                family.add_metric([], value)
                yield family


class HttpServer:
    """Serves a router (:class:`router.frontend.Endpoints`, a ``KVRouter``) on one listening socket;
    ``start`` / ``stop`` or ``run``."""

    def __init__(self, app: Endpoints, sock: socket.socket | None = None) -> None:
        srv = app.config.server
        self.app = app
        self.host = srv.host
        self.port = srv.port
        self.sock = sock
        self.max_body_bytes = srv.max_body_bytes
        self.head_timeout = srv.head_timeout_s
        self.body_timeout = srv.body_timeout_s
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
        self.limit_hits = LeanCounter(
            "kvrouter_client_limit_hits",
            "Client requests and connections refused at a limit, by its key: head_timeout_s, "
            "body_timeout_s (408), max_client_connections (503)",
            ["limit"],
        )
        app.metrics.add_series([self.limit_hits])
        app.metrics.add_collector(_ClientCollector(self))
        self.keepalive_timeout = srv.keepalive_timeout_s
        self.write_timeout = srv.write_timeout_s
        self.drain_timeout = srv.drain_timeout_s
        self.access_log = srv.access_log
        self.native = NativeEndpoints(app)
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._date = b""
        self._date_at = 0

    def date_line(self) -> bytes:
        """The ``date`` header, formatted at most once per second."""
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = b"date: %s\r\n" % http_date(now)
        return self._date

    async def dispatch(self, req: _Request, writer: _Writer, conn: _Connection) -> None:
        """The proxied endpoints and the lookup endpoints (:mod:`router.http.native`) natively,
        everything else through the ASGI app."""
        if req.method == "POST" and req.path in PATHS:
            await self.app.proxy.handle(req.path, req.headers, req.body, writer, lambda: conn.gone)
            return
        native = self.native.get(req.method, req.path)
        if native is not None:
            await native(req.headers, req.query, req.body, writer)
        else:
            await self._asgi(req, writer, conn)

    async def _asgi(self, req: _Request, writer: _Writer, conn: _Connection) -> None:
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": req.version,
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.raw_path,
            "query_string": req.query,
            "root_path": "",
            "headers": req.headers,
            "client": conn.client,
            "server": conn.sockname,
        }
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await conn.wait_lost()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
                await writer.start(int(message["status"]), headers)
                conn.loop.call_soon(writer.flush)  # a body sent right away still shares the write
            elif kind == "http.response.body" and not writer.ended:
                if message.get("more_body", False):
                    await writer.send(message.get("body", b""))
                else:
                    await writer.end(message.get("body", b""))

        await self.api(scope, receive, send)

    @functools.cached_property
    def api(self) -> Any:
        """The FastAPI app, built on first use: kvrouter answers every usual endpoint natively and
        needs it only for odd requests (unknown paths, other methods, HEAD), so it is not even
        imported unless one comes (~30 MB and ~0.4 s of start-up)."""
        # optional: FastAPI only for odd requests (start-up cost)
        from router.http.framework import build_api

        return build_api(self.app)

    async def start(self) -> None:
        """Bind, start the router's background work, then listen and serve. A numeric address is
        bound first, so a port in use fails before any backend is probed or stream subscribed; it
        listens only once the router serves, so a client or a TCP health check is refused while it
        starts (an L4 balancer's failover keeps working) rather than held. A host name is bound by
        the loop, last; a socket handed in is served as given."""
        sock = self.sock if self.sock is not None else server_socket(self.host, self.port)
        try:
            await self.app.startup()
            loop = asyncio.get_running_loop()
            if sock is not None:
                self._server = await loop.create_server(
                    lambda: _Connection(self), sock=sock, backlog=_BACKLOG
                )
            else:
                self._server = await loop.create_server(
                    lambda: _Connection(self), self.host, self.port, backlog=_BACKLOG, reuse_address=True
                )
        except BaseException:
            if sock is not None and sock is not self.sock:
                sock.close()  # (ours; a socket handed in stays its owner's)
            raise
        sockets = self._server.sockets
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("kvrouter listening on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests for ``drain_timeout_s``, stop the router."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.task is None and not conn._open and not conn.queue:
                conn.close()  # idle; one whose request is still arriving is answered, then closed
        deadline = time.monotonic() + self.drain_timeout
        logged = False
        while True:
            busy = [c.task for c in self.connections if c.task is not None and not c.task.done()]
            arriving = any(c.task is None and (c._open or c.queue) for c in self.connections)
            left = deadline - time.monotonic()
            if not busy and not arriving:
                break
            if not logged:
                n = len(self.connections)
                log.info("draining %d connection(s) with requests in flight for up to %.0f s", n, left)
                logged = True
            if left <= 0:
                for t in busy:
                    t.cancel()
                if busy:
                    await asyncio.wait(busy, timeout=5)
                break
            # (a request still arriving has no task yet: looked at again every 50 ms)
            if busy:
                await asyncio.wait(busy, timeout=min(left, 0.05), return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(min(left, 0.05))
        for conn in list(self.connections):
            conn.close()
        await self.app.shutdown()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until SIGINT/SIGTERM (or until ``stop`` is set), then shut down gracefully."""
        await self.start()
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


__all__ = ["HttpServer", "loop_factory"]
