"""A vLLM stand-in for the router's health probes, on a real socket: 200 to every request,
``/v1/models`` answered with the given model cards, ``/metrics`` with the given text, anything else
with ``{}``. It imports nothing but asyncio, so the start-up tests can load it in a fresh interpreter
without loading what they check a starting router does not load."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def probe_backend(
    models: bytes, metrics: bytes = b"{}", hold: Callable[[], Awaitable[object]] | None = None
) -> Handler:
    """An ``asyncio.start_server`` handler; ``hold`` is awaited before each answer (a stall, or
    something to do while the router waits)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if hold is not None:
                    await hold()
                path = head.split(b" ")[1]
                body = {b"/v1/models": models, b"/metrics": metrics}.get(path, b"{}")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle
