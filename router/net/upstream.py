"""A lean keep-alive HTTP/1.1 client for the proxy hot path (asyncio protocol + httptools' C parser).

Why not httpx here: measured on this machine against a zero-latency upstream, httpx sustained
1,275 req/s on one connection and 403 req/s over 32 (its pool scans every connection, with a
readability syscall each, on every request), where this client does ~14k and ~22k.
The router's own calls to its backends (health checks, /tokenize) use it too (:meth:`UpstreamPool.fetch`).

What it does, and no more: one request per connection at a time; the request written in one
``write``; the response parsed by httptools (chunked or content-length, de-chunked for the caller);
flow control (reading pauses while the consumer is behind); read and connect timeouts without
extra tasks; idle connections reused LIFO per (scheme, host, port) and dropped after
``keepalive_expiry`` (below uvicorn's 5 s default idle timeout, so vLLM never closes one we are
about to use). Closing a response before its end closes the connection, which vLLM treats as an abort.

**A request is written once.** An engine that read a request may have started it (a prefill leg
that ran would run twice), and nothing on the wire proves it did not: an engine that closes while
idle and one that closes after reading look the same from here once the request is out. So the
only case treated as "provably never sent" is the one decided *before* writing: a reused idle
connection whose socket shows, in a zero-timeout poll right before the write, that the engine
closed it (or sent bytes nobody asked for). It is dropped and another (or a new) connection takes
the request. Once any byte of the request is written, a failure is the caller's to handle
(:class:`UpstreamError`): a P/D prefill leg falls back, a proxied request fails over to another
backend or gets a 502, never the same request again on the same engine.

**The engine's answer is held to strict framing and limits** (:class:`UpstreamViolation`, counted by
reason in :attr:`UpstreamPool.violations`): bytes after a complete response make the connection
unusable (the response itself is unaffected and never carries them); duplicate or conflicting
framing headers (two content-lengths, content-length with transfer-encoding, a transfer-encoding
other than ``chunked``) and a ``101``/upgrade nobody asked for are errors; interim 1xx responses
(100, 103) are skipped. The head is bounded in bytes and header lines, and must be complete within
``head_timeout`` of its first byte; within the body, a run of wire bytes that yields no body byte
(an endless chunk extension or trailer) is bounded like the head. No buffer grows past its limit.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import select
import ssl
import time
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

log = logging.getLogger("kvrouter.upstream")

_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 16
_PIECE_COST = 48
"""What one body piece costs beyond its bytes (its bytes object and deque slot), counted in the
buffered size: a body of one-byte chunks then pauses reading as soon as a body of large ones, instead
of holding ~40 bytes of objects per byte received."""


class UpstreamError(Exception):
    """The backend could not be reached or broke the protocol before answering."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, connect timeout): the backend is down."""


class RouterResourceError(UpstreamError):
    """The router itself could not open a connection: out of file descriptors or memory (EMFILE,
    ENFILE, ENOBUFS, ENOMEM). Not the backend's fault: no health mark, no breaker failure."""


_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamTimeout(UpstreamError):
    """The backend did not answer (or send the next chunk) in time."""


class UpstreamViolation(UpstreamError):
    """The backend's answer broke the framing rules or a limit; ``reason`` is the metric label
    (trailing_bytes, framing, upgrade, malformed, head_too_large, too_many_headers, head_timeout,
    unframed_bytes, sse_event_too_large)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Conn(asyncio.Protocol):
    """One connection and the parser state of the response in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: UpstreamPool, where: str) -> None:
        self.loop = loop
        self.pool = pool
        self.where = where
        self.transport: asyncio.Transport | None = None
        self.poller: select.poll | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: Exception | None = None
        self.idle_since = 0.0
        self.used = False
        self.in_flight = False
        """A request was written and its response is not released: bytes are expected."""
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.interim = False
        self.close_delimited = False
        self.complete = False
        self.keep_alive = True
        self.got_bytes = False
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.head_bytes = 0
        self.head_lines = 0
        self.head_started = 0.0
        self.unframed = 0
        self.progress = False
        self.violation: UpstreamViolation | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if not self.in_flight:  # (idle, or before the request): never an answer to anything
            self._broken(UpstreamViolation("trailing_bytes", "bytes on an idle connection"))
            return
        try:
            if self.headers_done:
                self.progress = False
                self.parser.feed_data(data)
                if not self.progress:
                    self._unframed(len(data))
            else:
                self._feed_head(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, UpstreamViolation) as exc:
            self._broken(exc)
            return
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _feed_head(self, data: bytes) -> None:
        """Parse bytes of the head, never more than ``max_head_bytes`` of it."""
        if not self.head_started:
            self.head_started = self.loop.time()
        limit = self.pool.max_head_bytes
        room = limit - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            self.parser.feed_data(data)
            return
        view = memoryview(data)
        self.head_bytes = limit
        self.parser.feed_data(view[:room])
        if not self.headers_done:
            raise self._refuse("head_too_large", f"response head over {limit} bytes")
        self.progress = False
        self.parser.feed_data(view[room:])
        if not self.progress:
            self._unframed(len(data) - room)

    def _unframed(self, n: int) -> None:
        """Count body-phase bytes that yielded no body byte and no end (chunk extensions,
        trailers): httptools holds a trailer line whole, so an endless one would grow it."""
        self.unframed += n
        if self.unframed > self.pool.max_head_bytes:
            raise self._refuse(
                "unframed_bytes", f"over {self.pool.max_head_bytes} bytes of framing without data"
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.headers_done and self.close_delimited:
            self.complete = True  # a body without length or chunking ends with the connection
            self.keep_alive = False
        if not self.complete:
            self._fail(UpstreamError(f"connection closed by the backend{': ' + str(exc) if exc else ''}"))
        self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # another response starts after this one's end: the engine answered something nobody
            # asked (a smuggled response): the connection is out of step, its bytes go nowhere
            raise self._refuse("trailing_bytes", "bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:
            return  # a chunked body's trailers: not passed on (bounded by _unframed)
        self.head_lines += 1
        if self.head_lines > self.pool.max_header_lines:
            raise self._refuse("too_many_headers", f"over {self.pool.max_header_lines} header lines")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        if status < 200:
            if status < 100:
                raise self._refuse("malformed", f"status {status}")
            if status == 101 or parser.should_upgrade():
                raise self._refuse("upgrade", f"status {status}: a protocol switch nobody asked for")
            self.headers = []  # an interim response (100 Continue, 103 Early Hints): skipped
            self.interim = True
            return
        lengths = encodings = 0
        coding = b""
        for name, value in self.headers:
            if name == b"content-length":
                lengths += 1
            elif name == b"transfer-encoding":
                encodings += 1
                coding = value
        if lengths > 1 or encodings > 1 or (lengths and encodings):
            raise self._refuse("framing", "duplicate or conflicting content-length / transfer-encoding")
        if encodings and coding.strip().lower() != b"chunked":
            raise self._refuse("framing", f"transfer-encoding {coding[:40]!r} (only chunked is accepted)")
        self.close_delimited = not lengths and not encodings
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body) + _PIECE_COST
        self.progress = True
        self.unframed = 0

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.progress = True
        self.unframed = 0

    # helpers
    def _refuse(self, reason: str, message: str) -> UpstreamViolation:
        """The violation a parser callback raises (httptools re-raises it as its own callback error:
        :meth:`_broken` finds it here)."""
        self.violation = UpstreamViolation(reason, message)
        return self.violation

    def _broken(self, exc: Exception) -> None:
        """The answer broke a rule: count it, close the connection; an error for the caller unless
        the response was already complete (then only what followed it was wrong)."""
        v = self.violation
        if v is None:
            if isinstance(exc, UpstreamViolation):
                v = exc
            elif self.complete:
                v = UpstreamViolation("trailing_bytes", f"bytes after the end of the response: {exc}")
            elif isinstance(exc, httptools.HttpParserUpgrade):
                v = UpstreamViolation("upgrade", "a protocol switch nobody asked for")
            elif "Content-Length" in str(exc) or "Transfer-Encoding" in str(exc):
                v = UpstreamViolation("framing", f"invalid framing: {exc}")  # (refused by llhttp itself)
            else:
                v = UpstreamViolation("malformed", f"invalid HTTP response: {exc}")
        self.violation = v
        self.keep_alive = False
        self.pool.note_violation(v.reason, self.where, str(v))
        if not self.complete:
            self._fail(v)
        self.close()
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until new data, the end, or an error; raises UpstreamTimeout after ``timeout``."""
        w = self.loop.create_future()
        self.waiter = w
        handle = self.loop.call_later(timeout, _expire, w)
        try:
            await w
        finally:
            handle.cancel()
            self.waiter = None

    async def head(self, read_timeout: float, head_timeout: float) -> None:
        """Until the response head is complete: ``read_timeout`` for its first byte (the engine may
        be computing a whole answer), then ``head_timeout`` for all of it (an engine writes its head
        at once: one that trickles it holds the request for nothing)."""
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            wait, by_head = read_timeout, False
            if self.head_started:
                left = self.head_started + head_timeout - self.loop.time()
                if left < read_timeout:
                    wait, by_head = left, True
            try:
                await self.wait(wait)
            except UpstreamTimeout:
                if not by_head:
                    raise
                v = self._refuse(
                    "head_timeout", f"response head not complete {head_timeout:g} s after its first byte"
                )
                self.pool.note_violation(v.reason, self.where, str(v))
                raise v from None

    def sendable(self) -> bool:
        """This idle connection can take a request: open, silent since its last response, and its
        socket shows no close or bytes that the event loop has not delivered yet (a zero-timeout
        poll: the kernel knows of an engine's FIN before the loop does)."""
        t = self.transport
        if self.closed or self.got_bytes or t is None or t.is_closing():
            return False
        return self.poller is None or not self.poller.poll(0)

    def take(self) -> bytes:
        """Everything buffered so far (resumes reading when the buffer drained)."""
        if not self.body:
            return b""
        data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(UpstreamTimeout("timed out waiting for the backend"))


class UpstreamResponse:
    """Status, headers and an async iterator of body chunks; ``aclose()`` exactly once."""

    def __init__(
        self, pool: UpstreamPool, key: tuple[str, str, int], conn: _Conn, read_timeout: float
    ) -> None:
        self.pool = pool
        self.key = key
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self.read_timeout = read_timeout
        self._closed = False

    @property
    def ready(self) -> bool:
        """Body bytes (or the end of the body) arrived with the headers: reading will not wait."""
        return bool(self.conn.body) or self.conn.complete

    @property
    def finished(self) -> bool:
        """The body is complete and every chunk of it has been taken."""
        return self.conn.complete and not self.conn.body

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (de-chunked)."""
        conn = self.conn
        while True:
            data = conn.take()
            if data:
                yield data
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.read_timeout)

    async def aclose(self) -> None:
        """Return the connection to the pool if the response ended cleanly, else close it."""
        if self._closed:
            return
        self._closed = True
        conn = self.conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None and not conn.body:
            self.pool._release(self.key, conn)
        else:
            conn.close()


class UpstreamPool:
    """Idle keep-alive connections per (scheme, host, port)."""

    def __init__(
        self,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        max_idle_per_host: int = 256,
        keepalive_expiry: float = 4.0,
        *,
        max_head_bytes: int = 65536,
        max_header_lines: int = 100,
        head_timeout: float = 10.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_host = max_idle_per_host
        self.keepalive_expiry = keepalive_expiry
        self.max_head_bytes = max_head_bytes
        self.max_header_lines = max_header_lines
        self.head_timeout = head_timeout
        self.violations: dict[str, int] = {}
        """Answers that broke the framing rules or a limit, by reason (exported as
        ``kvrouter_upstream_violations_total``)."""
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None

    @staticmethod
    def key_of(base_url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of a base URL."""
        u = urlsplit(base_url)
        scheme = u.scheme or "http"
        return scheme, u.hostname or "127.0.0.1", u.port or (443 if scheme == "https" else 80)

    def note_violation(self, reason: str, where: str, detail: str) -> None:
        """Count (and log) an answer that broke a rule; ``where``: the backend or its address."""
        self.violations[reason] = self.violations.get(reason, 0) + 1
        log.warning("backend %s broke the HTTP rules (%s): %s; connection closed", where, reason, detail)

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        ctx: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        try:
            # (asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
            # that arrives as the connect completes, losing a caller's own deadline, e.g. fetch's)
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self, f"{host}:{port}"),
                    host,
                    port,
                    ssl=ctx,
                    server_hostname=host if ctx else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            if exc.errno in _LOCAL_ERRNOS:
                raise RouterResourceError(f"cannot open a connection: {exc.strerror or exc}") from None
            raise UpstreamConnectError(f"connect to {host}:{port} failed: {exc.strerror or exc}") from None
        return conn

    def _acquire_idle(self, key: tuple[str, str, int]) -> _Conn | None:
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if now - conn.idle_since < self.keepalive_expiry and conn.sendable():
                return conn
            conn.close()
        return None

    def _release(self, key: tuple[str, str, int], conn: _Conn) -> None:
        stack = self._idle.setdefault(key, [])
        if len(stack) >= self.max_idle_per_host:
            conn.close()
            return
        conn._reset()  # the parser carries on: a complete response leaves it ready for the next one
        conn.in_flight = False
        conn.idle_since = time.monotonic()
        stack.append(conn)

    async def request(
        self, key: tuple[str, str, int], method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send a request once and wait for the response head; raises UpstreamError / UpstreamTimeout
        (UpstreamViolation for an answer that breaks the rules). Never sent again: see the module's
        docstring for why an idle connection is checked before the write instead."""
        host = f"[{key[1]}]" if ":" in key[1] else key[1]
        head = [f"{method} {target} HTTP/1.1\r\nhost: {host}:{key[2]}\r\ncontent-length: {len(body)}\r\n"]
        for name, value in headers:
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1") + body
        conn = self._acquire_idle(key)  # (checked sendable: no await between the check and the write)
        if conn is None:
            conn = await self._connect(key)
        assert conn.transport is not None
        conn.used = True
        conn.in_flight = True
        conn.transport.write(payload)
        try:
            await conn.head(self.read_timeout, self.head_timeout)
        except BaseException:
            conn.close()  # (cancelled: the client left; closing is how vLLM learns to abort)
            raise
        return UpstreamResponse(self, key, conn, self.read_timeout)

    async def fetch(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        *,
        timeout: float,
        max_bytes: int = 16 << 20,
    ) -> tuple[int, bytes]:
        """One whole exchange, (status, body), for the router's own calls to its backends (health
        probes, ``/v1/models``, ``/metrics``, ``/tokenize``): at most ``timeout`` seconds in all,
        connecting and reading included. Raises :class:`UpstreamError` (:class:`UpstreamTimeout`
        when out of time), also for a body over ``max_bytes``. These calls went through httpx,
        which cost ``kvrouter serve`` ~0.1 s of start-up (its import, an SSL context built whether
        or not a backend speaks TLS, its first request) and ~2 MB. As for proxied requests: TLS
        trusts the system's CA store and is set up at the first https URL, ``HTTP(S)_PROXY`` is
        not consulted (backends are reached directly), and a request is never sent twice (the
        module's docstring says why)."""
        u = urlsplit(url)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        pairs = list((headers or {}).items())
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(timeout):
                resp = await self.request(self.key_of(url), method, target, pairs, body)
                try:
                    size = 0
                    async for data in resp.aiter_raw():
                        size += len(data)
                        if size > max_bytes:
                            raise UpstreamError(f"{method} {url}: the answer is over {max_bytes} bytes")
                        chunks.append(data)
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise UpstreamTimeout(f"{method} {url}: no complete answer in {timeout:g}s") from None
        return resp.status, b"".join(chunks)

    def idle_keys(self) -> set[tuple[str, str, int]]:
        """The addresses the idle pool has a place for (with idle connections or without)."""
        return set(self._idle)

    def close_idle(self, key: tuple[str, str, int]) -> None:
        """Close the idle connections to one address (a backend that left the fleet: a peer gone
        without a FIN would hold their descriptors for good)."""
        for conn in self._idle.pop(key, []):
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
