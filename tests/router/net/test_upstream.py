"""The proxy's HTTP/1.1 upstream client against a raw asyncio server that can misbehave on purpose."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
from collections.abc import Awaitable, Callable

import pytest

from router.net.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


class Server:
    def __init__(self, respond: Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.respond = respond
        self.connections = 0
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                body = await read_request(reader)
                self.requests += 1
                if not await self.respond(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return ("http", "127.0.0.1", self.server.sockets[0].getsockname()[1])  # type: ignore[return-value]

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def body_of(pool: UpstreamPool, key: tuple[str, str, int], payload: bytes = b"{}") -> tuple[int, bytes]:
    resp = await pool.request(key, "POST", "/v1/completions", [("content-type", "application/json")], payload)
    out = b"".join([c async for c in resp.aiter_raw()])
    await resp.aclose()
    return resp.status, out


async def fixed(body: bytes, w: asyncio.StreamWriter) -> bool:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body) + 3, b"ok:" + body))
    await w.drain()
    return True


def test_content_length_keep_alive_reuses_one_connection() -> None:
    async def main() -> None:
        srv = Server(fixed)
        async with srv as key:
            pool = UpstreamPool()
            for i in range(20):
                assert await body_of(pool, key, b"%d" % i) == (200, b"ok:%d" % i)  # type: ignore[arg-type]
            assert srv.connections == 1 and srv.requests == 20
            pool.close()

    asyncio.run(main())


def test_chunked_bodies_are_dechunked_and_streamed() -> None:
    async def chunked(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(5):
            data = b"data: %d\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(data), data))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    async def main() -> None:
        srv = Server(chunked)
        async with srv as key:
            pool = UpstreamPool()
            status, body = await body_of(pool, key)  # type: ignore[arg-type]
            assert status == 200 and body == b"".join(b"data: %d\n\n" % i for i in range(5))
            await body_of(pool, key)  # type: ignore[arg-type]
            assert srv.connections == 1
            pool.close()

    asyncio.run(main())


def test_connection_close_delimited_body_and_no_reuse() -> None:
    async def closing(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await w.drain()
        return False

    async def main() -> None:
        srv = Server(closing)
        async with srv as key:
            pool = UpstreamPool()
            assert await body_of(pool, key) == (200, b"until the end")  # type: ignore[arg-type]
            assert await body_of(pool, key) == (200, b"until the end")  # type: ignore[arg-type]
            assert srv.connections == 2
            pool.close()

    asyncio.run(main())


def test_stale_idle_connection_is_retried_once_on_a_fresh_one() -> None:
    async def one_shot(body: bytes, w: asyncio.StreamWriter) -> bool:
        await fixed(body, w)
        return False  # close after answering, although the response said keep-alive

    async def main() -> None:
        srv = Server(one_shot)
        async with srv as key:
            pool = UpstreamPool()
            assert await body_of(pool, key, b"1") == (200, b"ok:1")  # type: ignore[arg-type]
            await asyncio.sleep(0.05)  # let the close arrive (or not: both paths must work)
            assert await body_of(pool, key, b"2") == (200, b"ok:2")  # type: ignore[arg-type]
            assert srv.requests == 2
            pool.close()

    asyncio.run(main())


def test_timeouts_and_connect_errors() -> None:
    async def silent(body: bytes, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def main() -> None:
        srv = Server(silent)
        async with srv as key:
            pool = UpstreamPool(read_timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await body_of(pool, key)  # type: ignore[arg-type]
            pool.close()
        closed = ("http", "127.0.0.1", key[2])
        with pytest.raises(UpstreamConnectError):
            await body_of(UpstreamPool(connect_timeout=2), closed)  # type: ignore[arg-type]

    asyncio.run(main())


def test_garbage_and_early_close_are_errors() -> None:
    async def garbage(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        return False

    async def truncated(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        await w.drain()
        return False

    async def main() -> None:
        for respond in (garbage, truncated):
            srv = Server(respond)
            async with srv as key:
                pool = UpstreamPool()
                with pytest.raises(UpstreamError):
                    await body_of(pool, key)  # type: ignore[arg-type]
                pool.close()

    asyncio.run(main())


def test_large_body_with_a_slow_reader_keeps_memory_bounded() -> None:
    big = b"x" * (8 << 20)

    async def huge(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 1 << 16):
            w.write(big[i : i + (1 << 16)])
            await w.drain()
        return True

    async def main() -> None:
        srv = Server(huge)
        async with srv as key:
            pool = UpstreamPool()
            resp = await pool.request(key, "POST", "/", [], b"{}")  # type: ignore[arg-type]
            total = 0
            peak = 0
            async for chunk in resp.aiter_raw():
                total += len(chunk)
                peak = max(peak, resp.conn.buffered + len(chunk))
                await asyncio.sleep(0.001)
            await resp.aclose()
            assert total == len(big)
            assert peak < 4 << 20  # reading paused near the high-water mark instead of buffering 8 MB
            pool.close()

    asyncio.run(main())


def test_closing_early_closes_the_connection() -> None:
    async def endless(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for _ in range(1000):
                w.write(b"5\r\nhello\r\n")
                await w.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        return False

    async def main() -> None:
        srv = Server(endless)
        async with srv as key:
            pool = UpstreamPool()
            resp = await pool.request(key, "POST", "/", [], b"{}")  # type: ignore[arg-type]
            async for _ in resp.aiter_raw():
                break
            await resp.aclose()
            assert resp.conn.closed
            assert not pool._idle.get(key)  # type: ignore[arg-type]
            pool.close()

    asyncio.run(main())


def test_an_idle_connection_that_received_bytes_is_not_reused() -> None:
    """Unsolicited bytes on an idle pooled connection (a misbehaving backend, a late duplicate) must
    never be read as the answer to the next request."""

    async def answer_then_stray(body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body) + 3, b"ok:" + body))
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")  # nobody asked
        await w.drain()
        return True

    async def main() -> None:
        srv = Server(answer_then_stray)
        async with srv as key:
            pool = UpstreamPool(read_timeout=5)
            assert await body_of(pool, key, b"one") == (200, b"ok:one")
            conn = pool._idle[key][-1]
            for _ in range(500):  # until the stray bytes reached the idle connection
                if conn.got_bytes:
                    break
                await asyncio.sleep(0.01)
            assert conn.got_bytes
            assert await body_of(pool, key, b"two") == (200, b"ok:two")
            assert srv.connections == 2
            pool.close()

    asyncio.run(main())


def test_bytes_of_another_response_after_the_end_are_not_reused() -> None:
    """The start of a response nobody asked for, in the same segment as the end of the answer: the
    connection is out of step and must not go back to the pool (the next request would read it)."""

    async def answer_plus_stray(body: bytes, w: asyncio.StreamWriter) -> bool:
        answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body) + 3, b"ok:" + body)
        w.write(answer + b"HTTP/1.1 2")
        await w.drain()
        return True

    async def main() -> None:
        srv = Server(answer_plus_stray)
        async with srv as key:
            pool = UpstreamPool(read_timeout=5)
            assert await body_of(pool, key, b"one") == (200, b"ok:one")
            assert await body_of(pool, key, b"two") == (200, b"ok:two")
            assert srv.connections == 2
            pool.close()

    asyncio.run(main())


def test_fetch_is_one_bounded_exchange() -> None:
    """fetch (health probes, /v1/models, /metrics, /tokenize): the whole answer, the query string
    sent, a keep-alive connection reused; a stalled answer is a timeout for the whole exchange, an
    answer over max_bytes an error, a dead port a connect error; no TLS context until an https URL."""
    targets: list[bytes] = []

    async def respond(body: bytes, w: asyncio.StreamWriter) -> bool:
        if body == b"stall":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")  # 7 bytes never come
            await w.drain()
            await asyncio.sleep(30)
            return False
        w.write(
            b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n%s" % (len(body) + 1024, body + b"x" * 1024)
        )
        await w.drain()
        return True

    class Recording(Server):
        async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    targets.append(head.split(b" ")[1])
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    if not await self.respond(await reader.readexactly(length), writer):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

    async def main() -> None:
        srv = Recording(respond)
        async with srv as key:
            base = f"http://127.0.0.1:{key[2]}"
            pool = UpstreamPool()
            try:
                status, body = await pool.fetch("POST", f"{base}/tokenize?x=1", {"a": "b"}, b"hi", timeout=10)
                assert (status, body) == (201, b"hi" + b"x" * 1024)
                assert await pool.fetch("GET", f"{base}/health", timeout=10) == (201, b"x" * 1024)
                assert targets == [b"/tokenize?x=1", b"/health"] and srv.connections == 1
                with pytest.raises(UpstreamError, match="over 100 bytes"):
                    await pool.fetch("GET", f"{base}/metrics", timeout=10, max_bytes=100)
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(UpstreamTimeout):
                    await pool.fetch("POST", f"{base}/slow", None, b"stall", timeout=0.3)
                assert loop.time() - t0 < 10
                assert pool._ssl is None  # plain http never built a TLS context
            finally:
                pool.close()
        with socket.socket() as held:  # a port bound by nobody listening: refused, and not reusable
            held.bind(("127.0.0.1", 0))
            dead = held.getsockname()[1]
            with pytest.raises(UpstreamConnectError):
                await UpstreamPool().fetch("GET", f"http://127.0.0.1:{dead}/health", timeout=10)

    asyncio.run(main())


def test_an_idle_connection_the_backend_closed_is_never_written_to() -> None:
    """The one case where a request provably never left: the backend closed the idle connection
    before the write. Its socket shows it (a zero-timeout poll) even when the event loop has not
    read the FIN yet, so the request goes on a new connection instead, and is sent once. (It was
    written on the closed one and sent again on a fresh one when that failed within a second: a
    backend that half-closes, or reads the request and closes, then got it twice.)"""
    seen: list[tuple[int, bytes]] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for n in range(2):
            conn, _ = listener.accept()
            with conn:
                reader = conn.makefile("rb")
                while True:
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = reader.readline()
                        if not line:
                            break
                        head += line
                    if not head:
                        break
                    length = next(
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    )
                    body = reader.read(length)
                    seen.append((n, body))
                    if n == 0 and len(seen) > 1:
                        break  # a request after the FIN: read, and the connection closed
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\nok:%s" % (len(body) + 3, body)
                    )
                    if n == 0:
                        conn.shutdown(socket.SHUT_WR)  # done with it: FIN sent, still reading

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> None:
        key = ("http", "127.0.0.1", listener.getsockname()[1])
        pool = UpstreamPool(read_timeout=10)
        assert await body_of(pool, key, b"one") == (200, b"ok:one")
        conn = pool._idle[key][-1]
        fd = conn.transport.get_extra_info("socket").fileno()  # type: ignore[union-attr]
        select.select([fd], [], [], 10)  # (blocking the loop: the FIN is in, the loop has not read it)
        assert not conn.closed
        assert await body_of(pool, key, b"two") == (200, b"ok:two")
        pool.close()

    try:
        asyncio.run(main())
        thread.join(10)
    finally:
        listener.close()
    assert seen == [(0, b"one"), (1, b"two")]
