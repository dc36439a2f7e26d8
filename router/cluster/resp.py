"""A lean Redis/Valkey client for the cluster link: RESP2 over an asyncio protocol, nothing else.

Why not redis-py: measured in the live replica benchmark, its
asyncio client cost ~1.6 ms of CPU per shared message over three replicas (one pipelined publish
and three deliveries: a task, a timeout and several parser calls per received message), which added
3.2 ms of router CPU per request and showed in the routing figures on a 2-core box. Here a received
message is parsed in ``data_received`` and handed straight to the cluster (no task, no timer), and
a publish is one ``write`` whose reply resolves a future.

What it supports is what the cluster needs: ``redis://[user:password@]host:port/db``,
``rediss://`` (TLS with the system's CAs; ``?ssl_ca_certs=PATH`` for a private CA,
``?ssl_cert_reqs=none`` to skip verification), ``unix:///path?db=N``; AUTH (ACL user or password),
SELECT, CLIENT SETNAME; pipelined commands with replies in order; SUBSCRIBE with a callback per
message. Replies are bytes, ints, lists or None; an error reply raises :class:`RespError` for that
command only.

The store is not trusted with the router's memory or its event loop: replies are parsed
incrementally (:class:`ReplyParser`: a reply that arrives in pieces is never parsed again from its
start), without recursion, and within :class:`ReplyLimits` (its bytes, its array elements, its
nesting); a reply that breaks RESP or a limit closes the connection (:class:`ProtocolError`).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

Reply = Any
"""bytes | int | None | list[Reply] (RESP2), or a RespError instance in a pipeline's results."""


class RespError(Exception):
    """An error reply from the server (``-ERR ...``)."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect, from a URL."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    tls: bool = False
    ca_file: str | None = None
    verify: bool = True
    username: str | None = None
    password: str | None = None
    db: int = 0


def parse_url(url: str) -> Endpoint:
    """An :class:`Endpoint` from ``redis://``, ``rediss://`` or ``unix://``; ValueError when malformed."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{url!r}: no socket path")
        return Endpoint(path=parts.path, username=username, password=password, db=int(query.get("db", 0)))
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"{url!r} is not a redis://, rediss:// or unix:// URL")
    db = parts.path.strip("/") or query.get("db", "0")
    return Endpoint(
        host=parts.hostname,
        port=parts.port or 6379,
        tls=parts.scheme == "rediss",
        ca_file=query.get("ssl_ca_certs"),
        verify=query.get("ssl_cert_reqs", "required").lower() != "none",
        username=username,
        password=password,
        db=int(db),
    )


def encode_command(args: Sequence[bytes | str | int]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n" % len(b))
        out.append(b)
        out.append(b"\r\n")
    return b"".join(out)


class ProtocolError(ConnectionError):
    """The server broke RESP or one of the reply limits (:class:`ReplyLimits`): nothing after it on
    that connection can be trusted, so the connection is closed and the cluster link reconnects
    with its backoff."""


@dataclass(frozen=True)
class ReplyLimits:
    """What one reply may hold (``cluster.max_reply_*``): a broken or hostile store cannot make the
    router buffer or build without bound."""

    max_bytes: int = 32 << 20
    """Bytes of one reply, everything in it; a bulk string announcing more fails at its header."""
    max_items: int = 100_000
    """Array elements in one reply, at every level together."""
    max_depth: int = 8
    """Arrays nested in one reply."""


_NUMBER_LINE = 24
"""A length or integer line is at most this long (a sign, 20 digits, the type byte, CRLF)."""


class ReplyParser:
    """RESP2 replies from a byte stream, parsed incrementally: each call of :meth:`feed` resumes
    where the previous one stopped (a partly received array keeps its parsed elements, a line keeps
    where its end was searched, a bulk string its announced length), so a reply sent in many small
    pieces costs its bytes once, not once per piece. Iterative (no recursion: nesting is a list of
    at most ``max_depth`` arrays), and within :class:`ReplyLimits`: between two calls the buffer
    holds only the part of the current reply not parsed yet, at most ``max_bytes``."""

    __slots__ = ("_limits", "_on_reply", "_outer", "_state", "buf")

    def __init__(self, on_reply: Callable[[Reply], None], limits: ReplyLimits | None = None) -> None:
        self._on_reply = on_reply
        self._limits = limits or ReplyLimits()
        self.buf = bytearray()
        """Bytes received and not parsed yet."""
        self._state: tuple[list[Reply] | None, int, int, int, int, int] | None = None
        """Where the last call stopped inside a reply (None: between replies, nothing held): the
        innermost array being filled and the number of elements it announced; the announced length
        of a bulk string whose body is incomplete (-1: none); where the search for the current
        line's end resumes (the bytes before hold no CRLF); where the reply began, relative to
        :attr:`buf` (negative: in bytes parsed earlier); the array elements it announced so far."""
        self._outer: list[tuple[list[Reply], int]] = []
        """The arrays around the innermost one, outermost first, with their announced sizes."""

    @property
    def buffered(self) -> int:
        """Bytes held and not parsed yet (part of one reply: at most ``max_bytes``)."""
        return len(self.buf)

    def _broken(self, why: str) -> ProtocolError:
        self.buf.clear()  # (nothing after it is read)
        return ProtocolError(f"protocol error: {why}")

    def feed(self, data: bytes) -> None:
        """Parse ``data`` and pass each reply it completes to ``on_reply``, in order; raises
        :class:`ProtocolError` on a reply that breaks RESP or the limits (the parser is then
        unusable, as the connection is)."""
        buf: bytes | bytearray = data
        if self.buf:
            self.buf += data
            buf = self.buf
        # (else the usual read, whole replies: parsed from the received bytes themselves)
        size = len(buf)
        limits = self._limits
        max_bytes = limits.max_bytes
        state = self._state
        cur, want, bulk, scan, start, items = (None, 0, -1, 0, 0, 0) if state is None else state
        pos = 0
        value: Reply
        while True:
            if bulk >= 0:  # the body of a bulk string whose header came earlier
                if size < pos + bulk + 2:
                    break
                value = bytes(buf[pos : pos + bulk])
                pos += bulk + 2
                bulk = -1
            elif pos < size:
                kind = buf[pos]
                end = buf.find(b"\r\n", scan if scan > pos else pos)
                if end < 0:
                    if kind in b"$*:" and size - pos > _NUMBER_LINE:
                        raise self._broken(f"a {chr(kind)} line longer than {_NUMBER_LINE} bytes")
                    scan = size - 1  # (its CR may be the last byte so far)
                    break
                scan = 0
                if kind == 0x24 or kind == 0x2A or kind == 0x3A:  # $ bulk string, * array, : integer
                    if end - pos > _NUMBER_LINE:
                        raise self._broken(f"a {chr(kind)} line longer than {_NUMBER_LINE} bytes")
                    try:
                        n = int(buf[pos + 1 : end])
                    except ValueError:
                        raise self._broken(f"not a number: {bytes(buf[pos + 1 : end])!r}") from None
                    pos = end + 2
                    if kind == 0x3A:
                        value = n
                    elif n < 0:
                        if n < -1:
                            raise self._broken(f"a length of {n}")
                        value = None
                    elif kind == 0x24:
                        if pos + n + 2 - start > max_bytes:
                            raise self._broken(f"a bulk string of {n} bytes (max_reply_bytes {max_bytes})")
                        if size < pos + n + 2:
                            bulk = n
                            break
                        value = bytes(buf[pos : pos + n])
                        pos += n + 2
                    elif n == 0:
                        value = []
                    else:  # an array: its elements follow
                        items += n
                        self._check_array(items, cur is not None)
                        if cur is not None:
                            self._outer.append((cur, want))
                        cur, want = [], n
                        continue
                elif kind == 0x2B:  # + simple string
                    value = bytes(buf[pos + 1 : end])
                    pos = end + 2
                elif kind == 0x2D:  # - error
                    value = RespError(bytes(buf[pos + 1 : end]).decode("utf-8", "replace"))
                    pos = end + 2
                else:
                    raise self._broken(f"unexpected RESP type byte {kind!r}")
            else:
                break
            if cur is not None:  # an element: into the innermost array; completed arrays move up
                cur.append(value)
                if len(cur) < want:
                    continue
                value, cur = cur, None
                outer = self._outer
                while outer:
                    cur, want = outer.pop()
                    cur.append(value)
                    if len(cur) < want:
                        break
                    value, cur = cur, None
                if cur is not None:
                    continue
            if pos - start > max_bytes:
                raise self._broken(f"a reply over {max_bytes} bytes (max_reply_bytes)")
            self._on_reply(value)
            start = pos
            items = 0
        if size - start > max_bytes:
            raise self._broken(f"a reply over {max_bytes} bytes so far (max_reply_bytes)")
        if pos == size and cur is None and bulk < 0:  # (the usual end: nothing left over)
            self.buf.clear()
            self._state = None
            return
        if buf is data:
            self.buf += memoryview(data)[pos:]
        elif pos:
            del self.buf[:pos]  # (the front of a bytearray goes without moving the rest)
        self._state = (cur, want, bulk, scan - pos if scan > pos else 0, start - pos, items)

    def _check_array(self, items: int, nested: bool) -> None:
        """An array opens: within max_reply_items and max_reply_depth?"""
        limits = self._limits
        if items > limits.max_items:
            raise self._broken(f"{items} array elements in a reply (max_reply_items {limits.max_items})")
        if nested and len(self._outer) + 2 > limits.max_depth:
            raise self._broken(f"arrays nested deeper than {limits.max_depth} (max_reply_depth)")


class Connection(asyncio.Protocol):
    """One connection: commands answered in order, or (after SUBSCRIBE) pushed messages."""

    def __init__(
        self, on_message: Callable[[bytes], None] | None = None, limits: ReplyLimits | None = None
    ) -> None:
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self.parser = ReplyParser(self._dispatch, limits)
        self.violation: ProtocolError | None = None
        """The protocol error that closed this connection, if one did."""
        self._waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved when the connection closes, whatever the reason."""

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses of it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except ProtocolError as exc:  # a broken stream: nothing after it can be trusted
            self.violation = exc
            self._fail(exc)

    def _dispatch(self, reply: Reply) -> None:
        if self.on_message is not None and type(reply) is list and len(reply) == 3 and reply[0] == b"message":
            self.on_message(reply[2])
            return
        if self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection lost: {exc}" if exc else "connection closed by the server"))

    def _fail(self, exc: BaseException) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)
        if not self.lost.done():
            self.lost.set_result(None)
        if self.transport is not None:
            self.transport.abort()

    # --- commands ----------------------------------------------------------------------------------
    def send(self, commands: Sequence[Sequence[bytes | str | int]], replies: int | None = None) -> list[Any]:
        """Write commands in one go; futures of their replies (``replies`` of them when a command
        answers more than once, as SUBSCRIBE does per channel)."""
        if self.transport is None or self.lost.done():
            raise ConnectionError("not connected")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Reply]] = [
            loop.create_future() for _ in range(len(commands) if replies is None else replies)
        ]
        for f in futures:
            # a lost connection fails every command waiting; the caller sees it on the one it awaits
            # and the link logs it once: the others' exceptions are retrieved here (one failed page
            # of 2,000 commands logged 1,999 "exception never retrieved" errors)
            f.add_done_callback(_retrieve)
        self._waiting.extend(futures)
        self.transport.write(b"".join(encode_command(c) for c in commands))
        return futures

    async def execute(self, commands: Sequence[Sequence[bytes | str | int]], timeout_s: float) -> list[Reply]:
        """Pipeline commands; their replies in order (error replies as RespError instances)."""
        futures = self.send(commands)
        try:
            async with asyncio.timeout(timeout_s):  # no task per call, unlike wait_for
                await futures[-1]  # replies come in order: the last one resolves after the others
        except TimeoutError:
            self._fail(TimeoutError(f"no reply within {timeout_s} s"))
            raise
        return [f.result() for f in futures]

    def close(self) -> None:
        """Close the connection (pending commands fail)."""
        self._fail(ConnectionError("closed"))


def _retrieve(fut: asyncio.Future[Reply]) -> None:
    if not fut.cancelled():
        fut.exception()


async def connect(
    url: str,
    timeout_s: float,
    client_name: str = "",
    on_message: Callable[[bytes], None] | None = None,
    limits: ReplyLimits | None = None,
) -> Connection:
    """A connection, authenticated and on the URL's database; its replies within ``limits``."""
    ep = parse_url(url)
    loop = asyncio.get_running_loop()
    context: ssl.SSLContext | None = None
    if ep.tls:
        context = ssl.create_default_context(cafile=ep.ca_file)
        if not ep.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE

    def factory() -> Connection:
        return Connection(on_message, limits)

    if ep.path is not None:
        coro = loop.create_unix_connection(factory, ep.path)
    else:
        coro = loop.create_connection(
            factory, ep.host, ep.port, ssl=context, server_hostname=ep.host if context else None
        )
    _, conn = await asyncio.wait_for(coro, timeout_s)
    hello: list[list[bytes | str | int]] = []
    if ep.password is not None:
        hello.append(["AUTH", ep.username, ep.password] if ep.username else ["AUTH", ep.password])
    if ep.db:
        hello.append(["SELECT", ep.db])
    if client_name:
        hello.append(["CLIENT", "SETNAME", client_name])
    hello.append(["PING"])
    try:
        for command, reply in zip(hello, await conn.execute(hello, timeout_s), strict=True):
            if isinstance(reply, RespError) and command[0] != "CLIENT":
                raise reply  # (the name is cosmetic: an ACL user without client|setname connects)
    except BaseException:
        conn.close()
        raise
    return conn


__all__ = [
    "Connection",
    "Endpoint",
    "ProtocolError",
    "ReplyLimits",
    "ReplyParser",
    "RespError",
    "connect",
    "encode_command",
    "parse_url",
]
