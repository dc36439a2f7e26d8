"""`kvrouter serve`'s HTTP server (uvicorn with kvrouter's limits, router/http/uvicorn_server.py)
on a real socket: framing, keep-alive, pipelining, limits, malformed input, idle timeout, graceful
shutdown, slow readers."""

from __future__ import annotations

import contextlib
import email.utils
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import zmq
from harness import TIMEOUT, FakeEngine, NativeServer, RouterRunner, wait_for

from router.http.uvicorn_server import _REASONS, DateHeader, HttpServer, KvProtocol
from router.net.listen import server_socket


@pytest.fixture
def setup(ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path) -> Iterator[tuple[RouterRunner, FakeEngine]]:
    engine = FakeEngine("a", ctx)
    toml = (
        f'block_size = 4\ntokenizer = "{tokdir}"\n[server]\nmax_body_bytes = 2048\n'
        f"keepalive_timeout_s = 0.5\ndrain_timeout_s = 20\n{engine.backend_toml()}\n"
    )
    router = RouterRunner(toml, tmp_path)
    try:
        yield router, engine
    finally:
        router.stop()
        engine.close()


def _connect(router: RouterRunner) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", router.server.port), timeout=TIMEOUT)
    return s


def _read_response(
    s: socket.socket, buf: bytearray, is_head: bool = False
) -> tuple[int, dict[str, str], bytes]:
    """One response (content-length or chunked) from ``buf`` + the socket; leaves the rest in buf."""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        assert data, f"connection closed before a response head: {bytes(buf)!r}"
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    del buf[:]
    buf += rest
    if status == 100 or is_head:
        return status, headers, b""
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            data = s.recv(65536)
            assert data, "connection closed inside a body"
            buf += data
        body = bytes(buf[:n])
        del buf[:n]
        return status, headers, body
    assert headers.get("transfer-encoding") == "chunked", headers
    out = b""
    while True:
        while b"\r\n" not in buf:
            buf += s.recv(65536)
        size_line, _, _ = bytes(buf).partition(b"\r\n")
        size = int(size_line, 16)
        need = len(size_line) + 2 + size + 2
        while len(buf) < need:
            data = s.recv(65536)
            assert data, "connection closed inside a chunk"
            buf += data
        out += bytes(buf[len(size_line) + 2 : len(size_line) + 2 + size])
        del buf[:need]
        if size == 0:
            return status, headers, out


def _closed(s: socket.socket) -> bool:
    """True once the peer closed (reads until EOF; fails the test on a timeout)."""
    while True:
        data = s.recv(65536)
        if not data:
            return True


def _completion(prompt: str = "x y z") -> bytes:
    return json.dumps({"model": "toy", "prompt": prompt, "max_tokens": 4}).encode()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_keep_alive_and_pipelining(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, engine = setup
    with _connect(router) as s:
        buf = bytearray()
        s.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert _read_response(s, buf)[0] == 200
        # three pipelined requests in one write: answered in order on the same connection
        s.sendall(
            _post("/v1/completions", _completion("a b"))
            + b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n"
            + _post("/v1/completions", _completion("c d"))
        )
        first, second, third = (_read_response(s, buf) for _ in range(3))
        assert first[0] == 200 and json.loads(first[2])["object"] == "text_completion"
        assert first[1]["x-kvrouter-backend"] == "a"
        assert second[0] == 200 and json.loads(second[2])["data"][0]["id"] == "toy"
        assert third[0] == 200 and json.loads(third[2])["object"] == "text_completion"
    assert len(engine.requests) == 2


def test_expect_continue_and_chunked_request_body(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, _ = setup
    body = _completion()
    with _connect(router) as s:
        buf = bytearray()
        s.sendall(
            _post("/v1/completions", b"", "expect: 100-continue\r\n").replace(
                b"content-length: 0", b"content-length: %d" % len(body)
            )
        )
        status, _, _ = _read_response(s, buf)
        assert status == 100
        s.sendall(body)
        assert _read_response(s, buf)[0] == 200
        chunked = (
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (10, body[:10])
            + b"%x\r\n%s\r\n" % (len(body) - 10, body[10:])
            + b"0\r\n\r\n"
        )
        s.sendall(chunked)
        status, _, out = _read_response(s, buf)
        assert status == 200, out


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_and_closes(setup: tuple[RouterRunner, FakeEngine], chunked: bool) -> None:
    router, engine = setup
    big = _completion("w " * 3000)
    assert len(big) > 2048
    with _connect(router) as s:
        buf = bytearray()
        if chunked:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
            )
        else:
            s.sendall(_post("/v1/completions", big))
        status, headers, body = _read_response(s, buf)
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert headers["connection"] == "close"
        assert _closed(s)
    assert engine.requests == []


def test_malformed_requests(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, _ = setup
    with _connect(router) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, body = _read_response(s, bytearray())
        assert status == 400 and "error" in json.loads(body)
        assert _closed(s)
    with _connect(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n")
        status, _, body = _read_response(s, bytearray())
        assert status == 431
    # the server is fine afterwards
    assert httpx.get(f"{router.url}/health", timeout=TIMEOUT).status_code == 200


def test_http10_head_and_idle_timeout(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, _ = setup
    with _connect(router) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        status, headers, body = _read_response(s, bytearray())
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert headers["connection"] == "close"
        assert _closed(s)
    with _connect(router) as s:
        buf = bytearray()
        s.sendall(b"HEAD /health HTTP/1.1\r\nhost: t\r\n\r\n")
        status, headers, body = _read_response(s, buf, is_head=True)
        # HEAD: the GET's status and headers, no body (load balancers probe with it)
        assert status == 200 and "content-length" in headers and body == b""
        assert buf == bytearray()
        # keepalive_timeout_s = 0.5: the idle connection is closed by the server
        t0 = time.monotonic()
        assert _closed(s)
        assert time.monotonic() - t0 < TIMEOUT


def test_graceful_shutdown_drains_streams(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, engine = setup
    engine.mode = "short_stream"
    engine.delay_s = 0.05  # a stream of ~10 paced chunks in flight while the router stops
    got: dict[str, Any] = {}

    def client() -> None:
        with httpx.stream(
            "POST",
            f"{router.url}/v1/completions",
            json={"model": "toy", "prompt": "x y z", "stream": True},
            timeout=TIMEOUT,
        ) as r:
            got["status"] = r.status_code
            got["body"] = b"".join(r.iter_raw())

    t = threading.Thread(target=client)
    t.start()
    wait_for(lambda: len(engine.requests) == 1, "the stream started")
    router.stop()
    t.join(TIMEOUT)
    assert got["status"] == 200
    assert got["body"].rstrip().endswith(b"data: [DONE]")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{router.url}/health", timeout=2)


def test_graceful_shutdown_answers_a_request_whose_body_is_still_arriving(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """Shutdown took a connection with no task for an idle one and closed it, even with a request's
    body half-sent: the client got EOF and no answer despite drain_timeout_s."""
    router, _ = setup
    assert isinstance(router.server, NativeServer)
    body = _completion()
    stopper = threading.Thread(target=router.stop)
    with _connect(router) as s:
        s.sendall(_post("/v1/completions", body)[: -len(body) // 2])
        wait_for(lambda: any(c._open for c in list(router.server.server.connections)), "the head read")
        stopper.start()
        wait_for(lambda: router.server.server.stopping, "the shutdown begun")
        s.sendall(body[-len(body) // 2 :])
        status, headers, out = _read_response(s, bytearray())
    stopper.join(TIMEOUT)
    assert status == 200 and json.loads(out)["object"] == "text_completion"
    assert headers["connection"] == "close"


class _Transport:
    """A client connection's transport that records what the server writes; the client reads nothing
    of it once the test pauses writing (a full socket buffer, deterministic)."""

    def __init__(self, conn: KvProtocol, loop: Any) -> None:
        self.conn = conn
        self.loop = loop
        self.written = bytearray()
        self.closing = False
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else default

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.conn.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()


def _stalled_stream(router: RouterRunner, engine: FakeEngine, write_timeout: float, leave: bool) -> bool:
    """A streamed completion on a connection whose client stops reading after the first event (the
    server's writes pause); the client then leaves (``leave``) or stays silent. True once the
    engine's stream was cancelled, which is how vLLM learns to abort, and the server dropped the
    connection."""
    import asyncio
    import copy

    server = cast(HttpServer, cast(NativeServer, router.server).server)
    loop = cast(NativeServer, router.server)._loop
    assert loop is not None
    limits = copy.copy(server.limits)
    limits.write_timeout = write_timeout
    engine.mode = "held_stream"  # a word every 20 ms until released, or until the router leaves
    body = json.dumps({"model": "toy", "prompt": "x y z", "stream": True}).encode()

    async def scenario() -> tuple[KvProtocol, _Transport]:
        conn = KvProtocol(server.config, server.server.server_state, {}, limits=limits)
        t = _Transport(conn, asyncio.get_running_loop())
        conn.connection_made(t)  # type: ignore[arg-type]
        conn.data_received(_post("/v1/completions", body))
        return conn, t

    conn, t = asyncio.run_coroutine_threadsafe(scenario(), loop).result(TIMEOUT)
    wait_for(lambda: b"data: " in t.written, "the first event written")
    loop.call_soon_threadsafe(conn.pause_writing)  # the client stopped reading
    streamed = engine.streamed
    wait_for(lambda: engine.streamed > streamed + 3, "the engine streaming on")
    if leave:
        loop.call_soon_threadsafe(conn.connection_lost, ConnectionResetError())
    wait_for(lambda: engine.disconnected == 1, "the engine's stream cancelled")
    wait_for(lambda: conn not in server.connections, "the connection dropped")
    return t.aborted


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """uvicorn waits for a paused transport without end: a client that reads nothing for
    ``write_timeout_s`` is disconnected (aborted: a close would wait for the unread buffer) and its
    engine request cancelled."""
    router, engine = setup
    assert _stalled_stream(router, engine, write_timeout=0.2, leave=False) is True


def test_a_client_that_leaves_while_its_stream_waits_to_drain_stops_the_handler(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """A client that goes while the proxy waits to write more: the proxy stops (the engine's stream
    is cancelled at once) instead of reading the engine's stream into a dead socket to its end."""
    router, engine = setup
    assert _stalled_stream(router, engine, write_timeout=TIMEOUT * 10, leave=True) is False


# --- regressions found in review (each failed before its fix) --------------------------------------


def test_expect_continue_is_not_written_into_a_response_in_flight(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    router, engine = setup
    engine.mode = "short_stream"  # ~30 paced chunks
    body = _completion()
    with _connect(router) as s:
        buf = bytearray()
        s.sendall(
            _post("/v1/completions", json.dumps({"model": "toy", "prompt": "x", "stream": True}).encode())
        )
        while b"data: " not in buf:
            buf += s.recv(65536)
        head = _post("/v1/completions", b"", "expect: 100-continue\r\n")
        s.sendall(head.replace(b"content-length: 0", b"content-length: %d" % len(body)))
        rest = bytearray(buf)
        status, _, streamed = _read_response(s, rest)
        assert status == 200 and b"100 Continue" not in streamed and streamed.rstrip().endswith(b"[DONE]")
        s.sendall(body)  # the client sends its body (after its own wait, if no 100 came)
        status, _, out = _read_response(s, rest)
        if status == 100:  # (written when the request's turn came, after the stream: allowed)
            status, _, out = _read_response(s, rest)
        assert status == 200 and json.loads(out)["object"] == "text_completion"


def test_an_h2c_upgrade_offer_is_answered_in_http11(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, _ = setup
    with _connect(router) as s:
        s.sendall(
            b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
        )
        status, headers, body = _read_response(s, bytearray())
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert headers["connection"] == "close"


def test_a_refused_request_is_answered_after_the_requests_before_it(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    router, _ = setup
    big = _completion("w " * 3000)
    with _connect(router) as s:
        buf = bytearray()
        s.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" + _post("/v1/completions", big))
        first = _read_response(s, buf)
        second = _read_response(s, buf)
        assert first[0] == 200 and json.loads(first[2]) == {"status": "ok"}
        assert second[0] == 413 and second[1]["connection"] == "close"


def _refused_while_sending(router: RouterRunner, start: bytes, line: bytes) -> None:
    """Sends ``start``, then ``line`` over and over: the server must answer 431 and close well before
    8 MB (without a limit it would take all of it, silently)."""
    sent = 0
    with _connect(router) as s:
        s.sendall(start)
        try:
            while sent < 8_000_000:
                s.sendall(line)
                sent += len(line)
            got = s.recv(100)
        except OSError:
            got = b"refused"  # the server answered 431 and closed while we were still sending
    assert sent < 8_000_000 or got.startswith(b"HTTP/1.1 431"), (sent, got)


def test_an_endless_request_head_is_refused_while_it_arrives(setup: tuple[RouterRunner, FakeEngine]) -> None:
    router, _ = setup
    _refused_while_sending(router, b"GET /health HTTP/1.1\r\nhost: t\r\n", b"x-pad: " + b"a" * 1000 + b"\r\n")


def test_endless_trailers_of_a_chunked_body_are_refused_while_they_arrive(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """Trailers are neither head nor body: no limit saw them, the router took 148 MiB of one
    endless trailer line (httptools buffers it whole) and its loop stalled for seconds."""
    router, _ = setup
    head = _post("/v1/completions", b"", "transfer-encoding: chunked\r\n").replace(
        b"content-length: 0\r\n", b""
    )
    _refused_while_sending(router, head + b"3\r\nabc\r\n0\r\nx-trailer: ", b"a" * 1000)
    assert httpx.get(f"{router.url}/health", timeout=TIMEOUT).status_code == 200


def test_a_trailer_is_not_a_request_header(setup: tuple[RouterRunner, FakeEngine]) -> None:
    """httptools reports trailers through on_header: they were added to the request's headers, so
    a trailer could supply the authorization or the x-request-id sent to the engine."""
    router, engine = setup
    body = _completion()
    with _connect(router) as s:
        head = _post("/v1/completions", b"", "transfer-encoding: chunked\r\n").replace(
            b"content-length: 0\r\n", b""
        )
        s.sendall(head + b"%x\r\n%s\r\n0\r\nx-request-id: from-a-trailer\r\n\r\n" % (len(body), body))
        status, _, out = _read_response(s, bytearray())
    assert status == 200 and json.loads(out)["object"] == "text_completion"
    sent = {k.lower(): v for k, v in engine.requests[-1]["headers"].items()}
    assert sent.get("x-request-id") != "from-a-trailer"


def test_pipelined_requests_wait_while_the_client_reads_nothing(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """Answers written at once (/health, /metrics, ...) ignored the write buffer: a client that
    pipelined and never read grew the router's memory without bound (434 MB in 9 s)."""
    router, _ = setup
    assert isinstance(router.server, NativeServer)
    conns = router.server.server.connections
    flood = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" * 100_000  # 3.6 MB; ~13 MB of answers
    peak = [0]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    s.connect(("127.0.0.1", router.server.port))

    def send() -> None:
        with contextlib.suppress(OSError):  # (reset at the end of the test)
            s.sendall(flood)

    sender = threading.Thread(target=send)
    sender.start()
    try:

        def settled() -> bool:
            for c in list(conns):
                if c.transport is not None:
                    peak[0] = max(peak[0], c.transport.get_write_buffer_size())
                    if not c.transport.is_reading() and c.flow.write_paused and (c.pipeline or c._unread):
                        return True  # waiting for the client, reading nothing more
            return peak[0] >= 1_000_000  # (before the fix: every answer buffered)

        wait_for(settled, "the server waiting for the client")
        assert peak[0] < 1_000_000, peak  # the kernel holds ~4 MB of the 13 MB of answers, not more
        buf = bytearray()
        for _ in range(2000):  # the answers come, in order, once the client reads
            status, _, body = _read_response(s, buf)
            assert status == 200 and json.loads(body) == {"status": "ok"}
    finally:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset: the sender stops
        sender.join(TIMEOUT)
    assert httpx.get(f"{router.url}/health", timeout=TIMEOUT).status_code == 200


def test_asgi_requests_after_one_that_waited_for_a_disconnect(setup: tuple[RouterRunner, FakeEngine]) -> None:
    """Starlette cancels its disconnect listener when a streamed response ends; that must not cancel
    the connection's own disconnect future for the next request."""
    import asyncio
    from collections.abc import AsyncIterator

    from fastapi.responses import StreamingResponse

    router, _ = setup

    async def parts() -> AsyncIterator[bytes]:
        for i in range(3):
            await asyncio.sleep(0.01)
            yield b"part %d\n" % i

    async def stream() -> StreamingResponse:
        return StreamingResponse(parts(), media_type="text/plain")

    assert isinstance(router.server, NativeServer)  # (the FastAPI app behind kvrouter's ASGI app)
    router.server.server.asgi.api.add_api_route("/test/stream", stream, methods=["GET"])
    with _connect(router) as s:
        buf = bytearray()
        for _ in range(3):
            s.sendall(b"GET /test/stream HTTP/1.1\r\nhost: t\r\n\r\n")
            status, _, body = _read_response(s, buf)
            assert status == 200 and body == b"part 0\npart 1\npart 2\n"


def test_a_refused_request_is_answered_even_while_the_client_keeps_sending(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """A lingering close: after refusing an oversized body the server shuts its side and reads (and
    drops) what the client still sends for a moment, instead of closing with unread input, which
    makes the kernel answer with a reset that can destroy the 413 before the client reads it."""
    router, _ = setup
    s = _connect(router)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 900000\r\n\r\n")
        status, headers, body = _read_response(s, bytearray())
        assert status == 413 and headers["connection"] == "close" and b"request_too_large" in body
        assert s.recv(1) == b""  # the server finished writing (a half-close) ...
        for _ in range(8):
            s.sendall(b"x" * 65536)  # ... and still reads: no reset while the client finishes
    finally:
        s.close()


def test_the_linger_ends_even_while_the_client_keeps_sending(setup: tuple[RouterRunner, FakeEngine]) -> None:
    """The lingering close lasts ``_LINGER_S`` whatever the client sends meanwhile (a client that
    streams the rest of a refused body forever must not hold the connection open)."""
    router, _ = setup
    s = _connect(router)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 90000000\r\n\r\n")
        assert _read_response(s, bytearray())[0] == 413
        deadline = time.monotonic() + TIMEOUT
        closed = False
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"x" * 4096)  # once the server closed, this is reset
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            else:
                time.sleep(0.05)  # (a pace for the sender; the wait is the deadline above)
        assert closed, "the server still reads after the lingering close should have ended"
    finally:
        s.close()


def test_repeated_probes_and_their_neighbours_are_each_answered(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """Probes send the same bytes every time: each repeat is answered as the first, and so are
    the requests around them (another header value, a HEAD, another path, two in one read, POSTs);
    a probe asking ``connection: close``, or in HTTP/1.0, closes its connection every time."""
    router, _ = setup
    probe = b"GET /health HTTP/1.1\r\nhost: t\r\nuser-agent: kube-probe/1.31\r\n\r\n"
    with _connect(router) as s:
        buf = bytearray()
        answers = []
        for _ in range(3):
            s.sendall(probe)
            answers.append(_read_response(s, buf))
        assert [a[0] for a in answers] == [200] * 3 and {a[2] for a in answers} == {b'{"status":"ok"}'}
        s.sendall(probe.replace(b"1.31", b"1.32"))
        assert _read_response(s, buf)[0] == 200
        s.sendall(b"HEAD /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert _read_response(s, buf, is_head=True)[0] == 200
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n")
        status, _, body = _read_response(s, buf)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "toy"
        s.sendall(probe + probe)
        assert [_read_response(s, buf)[0] for _ in range(2)] == [200, 200]
        post = _post("/route", json.dumps({"model": "toy", "prompt": [1, 2, 3, 4]}).encode())
        for _ in range(2):
            s.sendall(post)
            assert _read_response(s, buf)[0] == 200
    closing = b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
    for _ in range(2):
        with _connect(router) as s:
            s.sendall(closing)
            status, headers, _ = _read_response(s, bytearray())
            assert status == 200 and headers["connection"] == "close" and _closed(s)
    old = b"GET /health HTTP/1.0\r\n\r\n"
    for _ in range(2):
        with _connect(router) as s:
            s.sendall(old)
            status, headers, body = _read_response(s, bytearray())
            assert status == 200 and headers["connection"] == "close" and body == b'{"status":"ok"}'
            assert _closed(s)


def test_a_repeated_probe_carries_the_current_date_and_waits_its_turn(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """A ``/health`` probe repeated on a keep-alive connection over more than a second: every
    answer carries the date of the second it was given in (never one gone by) and is otherwise the
    same; a probe arriving while a request is in flight on its connection is answered after it."""
    router, engine = setup
    server = cast(NativeServer, router.server).server
    probe = b"GET /health HTTP/1.1\r\nhost: t\r\nuser-agent: kube-probe/1.31\r\n\r\n"
    seen: list[tuple[int, dict[str, str], bytes]] = []
    dates: set[int] = set()
    deadline = time.monotonic() + TIMEOUT
    with _connect(router) as s:
        buf = bytearray()
        while len(seen) < 5 or len(dates) < 2:  # (until the date moved on at least once)
            assert time.monotonic() < deadline, dates
            t_sent = time.time()
            s.sendall(probe)
            status, headers, body = _read_response(s, buf)
            t_read = time.time()
            date = int(email.utils.parsedate_to_datetime(headers.pop("date")).timestamp())
            assert int(t_sent) <= date <= int(t_read)  # never the date of a second gone by
            dates.add(date)
            seen.append((status, headers, body))
        assert {(st, tuple(sorted(h.items())), b) for st, h, b in seen} == {
            (200, (("content-length", "15"), ("content-type", "application/json")), b'{"status":"ok"}')
        }
        head = b"HEAD /health HTTP/1.1\r\nhost: t\r\n\r\n"
        models = b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n"
        for _ in range(3):
            s.sendall(head)
            assert _read_response(s, buf, is_head=True)[0] == 200
            s.sendall(models)
            assert _read_response(s, buf)[0] == 200
        s.sendall(probe)
        assert _read_response(s, buf)[0] == 200
        engine.delay_s = 0.3  # (keeps the completion in flight; nothing waits on it)
        s.sendall(_post("/v1/completions", _completion()))
        wait_for(lambda: bool(server.server.server_state.tasks), "the completion in flight")
        s.sendall(probe)
        first, second = _read_response(s, buf), _read_response(s, buf)
        assert json.loads(first[2])["object"] == "text_completion", first
        assert second[2] == b'{"status":"ok"}'


_TICK = 0.01
"""Slack for the event loop's clock (libuv keeps milliseconds, read once per loop iteration)."""


def test_the_idle_timeout_counts_from_the_last_request(setup: tuple[RouterRunner, FakeEngine]) -> None:
    """The keep-alive timer is set once and moved lazily (``KvProtocol._arm``): a connection in
    use for several timeouts stays open, and none is closed sooner than ``keepalive_timeout_s``
    (0.5 s here) after the request before (a request sent later than that may meet a closed
    connection only if this thread stalled that long; then the test reconnects)."""
    router, _ = setup
    probe = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    s = _connect(router)
    try:
        buf = bytearray()
        answered, before = 0, time.monotonic()
        end = before + 1.5
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                s.sendall(probe)
                status = _read_response(s, buf)[0]
            except (OSError, AssertionError):
                assert time.monotonic() - before >= 0.5 - _TICK, "closed while in use"
                s.close()
                s, buf = _connect(router), bytearray()
                before = time.monotonic()
                continue
            assert status == 200
            answered += 1
            before = sent
        assert answered > 3
        assert _closed(s)
        assert time.monotonic() - before >= 0.5 - _TICK
    finally:
        s.close()


def test_native_lookup_endpoints_answer_as_the_framework_does(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """/health, /ready, /v1/models and /route are served without FastAPI (router/http/native.py):
    the same requests through the FastAPI routes give the same statuses and bytes (/route: the same
    JSON apart from the timing values)."""
    router, engine = setup
    tokens = [5 + i for i in range(32)]
    engine.announce(tokens[:16], 4)
    wait_for(lambda: _route(router, {"model": "toy", "prompt": tokens})[1]["matched_blocks"] == 4, "index")
    cases: list[tuple[str, str, bytes]] = [
        ("GET", "/health", b""),
        ("GET", "/debug/index", b""),
        ("GET", "/dashboard", b""),
        ("GET", "/nope", b""),
        ("POST", "/health", b"{}"),
        ("GET", "/ready", b""),
        ("GET", "/v1/models", b""),
        ("POST", "/route", json.dumps({"model": "toy", "prompt": tokens}).encode()),
        (
            "POST",
            "/route?endpoint=chat",
            json.dumps({"model": "toy", "messages": [{"role": "user"}]}).encode(),
        ),
        (
            "POST",
            "/route",
            json.dumps({"model": "toy", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        ),
        ("POST", "/route", b"{not json"),
        ("POST", "/route", json.dumps({"prompt": tokens}).encode()),
        ("POST", "/route", json.dumps({"model": "nope", "prompt": tokens}).encode()),
        ("POST", "/route", json.dumps({"model": "toy", "prompt": [True, 1]}).encode()),
        ("POST", "/route", json.dumps({"model": "toy", "prompt": [10**9]}).encode()),
        ("POST", "/route", b'{"model": "toy", "prompt": [ 5, 6 ,7,\n8 ], "cache_salt": "s"}'),
        ("POST", "/route", b'{"model": "toy", "prompt": [5, 6.0]}'),
        ("POST", "/route", b'{"model": "toy", "prompt": [5, 06]}'),
        ("POST", "/route", b'{"model": "toy", "prompt": [5, -6]}'),
        ("POST", "/route", b'{"model": "toy", "prompt": [18446744073709551616]}'),
        ("POST", "/route", b'{"model": "toy", "prompt": []}'),
        ("POST", "/route", b'{"model": "toy", "prompt": [5], "prompt": [6, 7]}'),
    ]

    def answers() -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        for method, path, body in cases:
            r = httpx.request(method, f"{router.url}{path}", content=body or None, timeout=10)
            if path != "/dashboard":
                assert r.headers["content-type"] == "application/json"
            if path == "/debug/index":  # (event ages and health probes move on between the calls)
                data = r.json()
                for src in data["sources"]:
                    src["last_event_age_s"] = None
                for backend in data["backends"]:
                    backend["checked_at"] = None
                out.append((r.status_code, data))
            elif path.startswith("/route") and r.status_code == 200:
                data = r.json()
                data["timings_us"] = sorted(data["timings_us"])
                data["time"] = 0
                out.append((200, data))
            else:
                out.append((r.status_code, r.content))
        return out

    server = cast(NativeServer, router.server).server
    native = answers()
    server.asgi.native.enabled = False  # everything through FastAPI now
    try:
        framework = answers()
    finally:
        server.asgi.native.enabled = True
    assert native == framework
    # token-id prompts parsed straight into uint64s (router.app._token_prompt_body) against the
    # generic JSON decode
    import router.app as app_module

    fast = app_module._token_prompt_body
    app_module._token_prompt_body = lambda raw: None  # type: ignore[assignment]
    try:
        generic = answers()
    finally:
        app_module._token_prompt_body = fast
    assert native == generic
    assert [status for status, _ in native][:15] == [200, 200, 200, 404, 405] + [200] * 5 + [
        400,
        400,
        404,
    ] + [400] * 2


def test_a_token_id_route_is_decided_without_an_await(setup: tuple[RouterRunner, FakeEngine]) -> None:
    """A /route whose prompt is token ids needs no await (router.app.KVRouter.route_answer_now); a
    chat /route (tokenizing) awaits. Both answers are the ones the other path gives (the test
    above)."""
    router, engine = setup
    tokens = [5 + i for i in range(32)]
    engine.announce(tokens[:16], 4)
    wait_for(lambda: _route(router, {"model": "toy", "prompt": tokens})[1]["matched_blocks"] == 4, "index")
    app = cast(NativeServer, router.server).server.app
    awaited: list[bytes] = []
    real = app.route_answer

    async def counting(raw: bytes, query: bytes, headers: Any = ()) -> bytes:
        awaited.append(raw)
        return await real(raw, query, headers)

    app.route_answer = counting  # type: ignore[method-assign]
    try:
        status, body = _route(router, {"model": "toy", "prompt": tokens})
        assert status == 200 and body["matched_blocks"] == 4 and body["backend"] == "a"
        assert _route(router, {"model": "nope", "prompt": tokens})[0] == 404  # errors too
        assert _route(router, {"model": "toy", "prompt": [10**9]})[0] == 400
        assert awaited == []
        status, _ = _route(router, {"model": "toy", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and len(awaited) == 1
    finally:
        del app.route_answer


def test_with_access_logs_a_route_is_decided_once_and_logged(
    ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``server.access_log``: every request is logged on ``kvrouter.access``, and a /route is
    decided once."""
    engine = FakeEngine("a", ctx)
    router = RouterRunner(
        f'block_size = 4\ntokenizer = "{tokdir}"\n[server]\naccess_log = true\n{engine.backend_toml()}\n',
        tmp_path,
    )
    try:
        app = cast(NativeServer, router.server).server.app
        calls: list[str] = []
        now, later = app.route_answer_now, app.route_answer

        def counting_now(raw: bytes, query: bytes, headers: Any = ()) -> bytes | None:
            calls.append("now")
            return now(raw, query, headers)

        async def counting(raw: bytes, query: bytes, headers: Any = ()) -> bytes:
            calls.append("task")
            return await later(raw, query, headers)

        app.route_answer_now = counting_now  # type: ignore[method-assign]
        app.route_answer = counting  # type: ignore[method-assign]
        with caplog.at_level("INFO", logger="kvrouter.access"):
            status, body = _route(router, {"model": "toy", "prompt": [5, 6, 7, 8, 9]})
            assert status == 200 and body["backend"] == "a"
            wait_for(lambda: any("POST /route" in r.getMessage() for r in caplog.records), "access line")
        assert calls == ["now"]
    finally:
        router.stop()
        engine.close()


def _route(router: RouterRunner, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(f"{router.url}/route", json=body, timeout=10)
    return r.status_code, r.json()


def test_the_date_header_is_the_current_seconds() -> None:
    """Every response's ``date`` is formatted in the second it is started in (uvicorn's own list is
    refreshed every 0.1 s), as email.utils writes an IMF-fixdate."""
    dates = DateHeader()
    for _ in range(3):
        before = int(time.time())
        (name, value), extra = dates + [(b"x", b"y")]  # noqa: RUF005 (what uvicorn does with it)
        after = int(time.time())
        assert name == b"date" and extra == (b"x", b"y")
        assert value.decode() in {email.utils.formatdate(t, usegmt=True) for t in range(before, after + 1)}


def test_every_refusal_has_its_reason_phrase() -> None:
    """The statuses a connection is refused with carry the standard library's reason phrases."""
    from http import HTTPStatus

    for status, phrase in _REASONS.items():
        assert phrase.decode() == HTTPStatus(status).phrase or status == 413, status
    assert _REASONS[413] == b"Request Entity Too Large"  # (the name clients know; 3.13: "Content")


def test_a_numeric_listen_address_is_bound_by_the_server() -> None:
    """``server_socket``: a literal address gets a socket bound here (the loop would resolve it in a
    thread pool), non-blocking, IPv6 only on an IPv6 address, not listening until the loop serves
    on it (until then a client is refused); a host name is left to the loop; an address in use is
    an OSError that names it, and the refused socket is closed."""
    sock = server_socket("127.0.0.1", 0)
    assert sock is not None
    try:
        port = sock.getsockname()[1]
        assert port and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
        assert not sock.getblocking() and sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        sock.listen(16)  # (what the loop's create_server does)
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            server_socket("127.0.0.1", port)
        assert len(os.listdir("/proc/self/fd")) == fds
        client = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        client.close()
    finally:
        sock.close()
    assert server_socket("localhost", 0) is None
    assert server_socket("", 0) is None
    if socket.has_ipv6:
        try:
            six = server_socket("::1", 0)
        except OSError:
            six = None  # (a box without an IPv6 loopback)
        if six is not None:
            try:
                assert six.family == socket.AF_INET6
                assert six.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
                six.listen(16)
                with pytest.raises(OSError, match=rf"cannot listen on \[::1\]:{six.getsockname()[1]}"):
                    server_socket("::1", six.getsockname()[1])
            finally:
                six.close()


def _without_date(response: bytes) -> bytes:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    if b'"timings_us"' in body:  # (/route: how long each step took, which differs between calls)
        data = json.loads(body)
        data["timings_us"], data["time"] = sorted(data["timings_us"]), 0
        body = json.dumps(data).encode()
        lines = [line for line in lines if not line.lower().startswith(b"content-length:")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def test_lookups_answered_from_the_parser_are_the_asgi_answers(
    setup: tuple[RouterRunner, FakeEngine],
) -> None:
    """A lookup with nothing else in flight on its connection is answered from the parser's
    callbacks (KvProtocol._answer_quick): the same bytes, date aside, as the ASGI path gives, for
    answers, errors and HEAD; one that closes its connection (HTTP/1.0, ``connection: close``) is
    answered by uvicorn's cycle, which answers nothing pipelined after it; a /route that needs an
    await (a chat
    prompt, a body that is not token ids) goes on through the ASGI cycle with its body already
    read."""
    router, engine = setup
    server = cast(NativeServer, router.server).server
    native = server.asgi.native
    tokens = [5 + i for i in range(32)]
    engine.announce(tokens[:16], 4)
    wait_for(lambda: _route(router, {"model": "toy", "prompt": tokens})[1]["matched_blocks"] == 4, "index")
    chat = json.dumps({"model": "toy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    requests = [
        b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n",
        b"HEAD /health HTTP/1.1\r\nhost: t\r\n\r\n",
        b"GET /ready HTTP/1.1\r\nhost: t\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n",
        _post("/route", json.dumps({"model": "toy", "prompt": tokens}).encode()),
        _post("/route?endpoint=chat", chat),
        _post("/route", b"{not json"),
        _post("/route", json.dumps({"model": "nope", "prompt": tokens}).encode()),
        _post("/route", json.dumps({"model": "toy", "prompt": [10**9]}).encode()),
        b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
        b"GET /health HTTP/1.0\r\n\r\n",
    ]

    def answers() -> list[bytes]:
        out = []
        for request in requests:
            with _connect(router) as s:
                s.sendall(request)
                data = b""
                while chunk := s.recv(65536):  # (each request closes: read to the end)
                    data += chunk
                    if b"\r\n\r\n" in data and not request.startswith(b"HEAD"):
                        head, _, body = data.partition(b"\r\n\r\n")
                        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                        if len(body) >= length:
                            break
                    elif request.startswith(b"HEAD") and b"\r\n\r\n" in data:
                        break
                out.append(_without_date(data))
        return out

    real_now = native.answer_now
    calls: list[str] = []

    def counting(*args: Any) -> Any:
        calls.append(args[1])
        return real_now(*args)

    native.answer_now = counting  # type: ignore[method-assign]
    awaited: list[bytes] = []
    real_route = server.app.route_answer

    async def counting_route(raw: bytes, query: bytes, headers: Any = ()) -> bytes:
        awaited.append(raw)
        return await real_route(raw, query, headers)

    server.app.route_answer = counting_route  # type: ignore[method-assign]
    try:
        quick = answers()
        # (the last two close their connection: uvicorn's cycle answers those; a body that is not
        # token ids is decoded off the parser)
        assert len(calls) == len(requests) - 2 and awaited == [chat, b"{not json"]
        native.from_parser = False
        try:
            through_asgi = answers()
        finally:
            native.from_parser = True
        assert len(calls) == len(requests) - 2 and len(awaited) == 4
    finally:
        del native.answer_now, server.app.route_answer
    assert quick == through_asgi
    statuses = [int(a.split(b" ", 2)[1]) for a in quick]
    assert statuses == [200] * 6 + [400, 404, 400, 200, 200]
    assert b"connection: close" in quick[-1] and b"connection: close" in quick[-2]
    # a lookup that closes its connection, then one pipelined after it: only the first is answered
    with _connect(router) as s:
        s.sendall(requests[-2] + requests[0])
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 1 and data.endswith(b'{"status":"ok"}'), data
