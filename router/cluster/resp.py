"""A lean Redis/Valkey client for the cluster link: RESP2 over an asyncio protocol, nothing else.

Why not redis-py: measured in the live replica benchmark (BENCHMARKS.md, "Router replicas"), its
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


class _Incomplete(Exception):
    pass


def parse_reply(buf: bytes | bytearray, pos: int = 0) -> tuple[Reply, int]:
    """One reply starting at ``pos`` and the position after it; raises ``_Incomplete`` when ``buf``
    does not hold all of it yet, ValueError on a protocol error."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    nxt = end + 2
    if kind == 0x24:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, nxt
        if len(buf) < nxt + n + 2:
            raise _Incomplete
        return bytes(buf[nxt : nxt + n]), nxt + n + 2
    if kind == 0x2A:  # * array
        n = int(line)
        if n < 0:
            return None, nxt
        items = []
        for _ in range(n):
            item, nxt = parse_reply(buf, nxt)
            items.append(item)
        return items, nxt
    if kind == 0x3A:  # : integer
        return int(line), nxt
    if kind == 0x2B:  # + simple string
        return line, nxt
    if kind == 0x2D:  # - error
        return RespError(line.decode("utf-8", "replace")), nxt
    raise ValueError(f"unexpected RESP type byte {kind!r}")


class Connection(asyncio.Protocol):
    """One connection: commands answered in order, or (after SUBSCRIBE) pushed messages."""

    def __init__(self, on_message: Callable[[bytes], None] | None = None) -> None:
        self.on_message = on_message
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved when the connection closes, whatever the reason."""

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses of it

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                reply, pos = parse_reply(buf, pos)
                self._dispatch(reply)
        except _Incomplete:
            pass
        except ValueError as exc:  # a broken stream: nothing after it can be trusted
            self._fail(ConnectionError(f"protocol error: {exc}"))
            return
        del buf[:pos]

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
) -> Connection:
    """A connection, authenticated and on the URL's database."""
    ep = parse_url(url)
    loop = asyncio.get_running_loop()
    context: ssl.SSLContext | None = None
    if ep.tls:
        context = ssl.create_default_context(cafile=ep.ca_file)
        if not ep.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE

    def factory() -> Connection:
        return Connection(on_message)

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


__all__ = ["Connection", "Endpoint", "RespError", "connect", "encode_command", "parse_reply", "parse_url"]
