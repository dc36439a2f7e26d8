"""The small HTTP vocabulary the proxy is written against, over ASGI.

:class:`ResponseWriter` is what the proxy needs from a server: start a response, send chunks, end
it. ``start`` may hold the status line and headers back until the first chunk or :meth:`flush`.
:class:`AsgiWriter` maps the same calls onto ASGI ``send`` messages (the P/D exchange wraps a
writer in one of its own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class ResponseWriter(Protocol):
    """One response: ``start`` once, ``send`` any number of times, ``end`` once (or never, when the
    response must look truncated: the server then closes the connection)."""

    started: bool

    async def start(self, status: int, headers: Headers) -> None:
        """Status and headers (names lower-case); may be held back until the first chunk."""

    def flush(self) -> None:
        """Send what ``start`` held back now (the first chunk is not there yet)."""

    async def send(self, chunk: bytes) -> None:
        """One body chunk, sent now; waits while the client is not reading."""

    async def end(self, chunk: bytes = b"") -> None:
        """The last chunk (possibly empty) and the end of the response."""


_NO_BODY = frozenset({204, 304})


class AsgiWriter:
    """A :class:`ResponseWriter` over an ASGI ``send`` (no write coalescing: ASGI sends each message).

    A response that has no body by its status (1xx, 204, 304) is passed on without a body and without
    a ``content-length``, whatever the engine framed it with: the server would wait for the bytes
    that length announces (uvicorn closes the connection at the end instead), and a body the client
    does not expect would be read as the next response."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self._bodyless = False

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        if status in _NO_BODY or status < 200:
            self._bodyless = True
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def flush(self) -> None:
        return None

    async def send(self, chunk: bytes) -> None:
        if chunk and not self._bodyless:
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes = b"") -> None:
        body = b"" if self._bodyless else chunk
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


RETRY_AFTER = b"1"
"""``Retry-After`` (seconds) of every 503: each is a state that passes (no backend reached yet, none
healthy, the router overloaded), a retry costs the router microseconds and the engines nothing, and a
backend can come back at any probe; clients that honour it (the openai SDK does) retry soon."""


async def write_json(writer: ResponseWriter, status: int, body: bytes) -> None:
    """A complete JSON response (a 503 with ``Retry-After``)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", RETRY_AFTER))
    await writer.start(status, headers)
    await writer.end(body)


__all__ = ["AsgiWriter", "Headers", "Message", "Receive", "ResponseWriter", "Scope", "Send", "write_json"]
