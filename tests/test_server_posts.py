"""A POST whose head repeats but for its content-length (router/http/server.py, ``HttpServer.posts``)
is queued from the remembered parse instead of httptools': first differentially, byte sequence by
byte sequence against the parser alone (the same requests queued, the same refusals), then through
the running server with real clients."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import zmq
from harness import TIMEOUT, FakeEngine, NativeServer, RouterRunner
from test_server import _read_response

from router.http.errors import ApiError
from router.http.server import HttpServer, _Connection


def _server(learn: bool) -> HttpServer:
    """An HttpServer's request-parsing state without a router behind it: the parse is what this
    file compares, and nothing past it runs (requests are queued, not answered)."""
    srv = HttpServer.__new__(HttpServer)
    srv.max_body_bytes = 4096
    srv.heads = {}
    srv.posts = {}
    srv.post_hits = 0
    srv._posts_paused_until = 0.0
    srv.canned = {}
    srv.canned_second = 0
    srv.access_log = False
    srv.connections = set()
    srv.stopping = False
    srv.keepalive_timeout = 5.0
    srv.head_timeout = srv.body_timeout = 5.0
    srv.authorize = lambda path, headers, query: None
    srv.write_timeout = 5.0
    if not learn:
        srv._remember_post = lambda data, req: None  # type: ignore[method-assign]
    return srv


class _Transport:
    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _feed(srv: HttpServer, chunks: list[bytes]) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]], bool]:
    """The requests a new connection queues from ``chunks`` read one after the other, the requests it
    refuses, and whether it reads on."""
    conn = _Connection(srv)
    conn.transport = cast(Any, _Transport())
    refused: list[tuple[int, str]] = []

    def refuse(err: ApiError) -> None:
        refused.append((err.status, err.message))
        conn._stop_reading = True

    conn._refuse = refuse  # type: ignore[method-assign]
    conn._after_read = lambda: None  # type: ignore[method-assign]
    for chunk in chunks:
        conn.data_received(chunk)
    queued = [
        (r.method, r.path, r.raw_path, r.query, r.headers, r.body, r.version, r.keep_alive)
        for r in conn.queue
    ]
    conn._cancel_timers()
    return queued, refused, not conn._stop_reading


_NAMES = [b"host", b"Host", b"authorization", b"content-type", b"x-stainless-lang", b"accept", b"User-Agent"]


def _request(rng: random.Random, body: bytes) -> tuple[bytes, bytes]:
    """A random POST head (without its content-length line) split where that line goes."""
    path = rng.choice([b"/route", b"/v1/completions", b"/route?endpoint=chat", b"/v1/%63hat/completions"])
    version = rng.choice([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"])
    fields = [
        b"%s: %s" % (rng.choice(_NAMES), rng.choice([b"a", b"Bearer k", b"x y", b"", b"application/json"]))
    ]
    fields += [b"%s: v%d" % (rng.choice(_NAMES), rng.randrange(3)) for _ in range(rng.randrange(4))]
    if rng.random() < 0.2:
        fields.append(rng.choice([b"connection: close", b"Connection: keep-alive"]))
    cut = rng.randrange(len(fields) + 1)
    before = b"POST %s %s\r\n" % (path, version) + b"".join(f + b"\r\n" for f in fields[:cut])
    after = b"".join(f + b"\r\n" for f in fields[cut:]) + b"\r\n"
    return before, after


def _mutations(rng: random.Random, before: bytes, after: bytes, spell: bytes) -> Iterator[list[bytes]]:
    """Byte sequences close to the learned request's: the same head with other bodies (the fast
    path's case) and the ways a request can differ from it (each must be parsed as it would be)."""

    def req(body: bytes, line: bytes | None = None, head: tuple[bytes, bytes] = (before, after)) -> bytes:
        cl = line if line is not None else spell + b"%d\r\n" % len(body)
        return head[0] + cl + head[1] + body

    for n in (0, 1, 9, 10, 99, 100, 4096, 4097):
        yield [req(b"x" * n)]
    body = json.dumps({"prompt": [rng.randrange(99) for _ in range(rng.randrange(50))]}).encode()
    yield [req(body)]
    yield [req(body)[:-1]]  # a body one byte short: its last byte in the next read
    yield [req(body)[:-1], req(body)[-1:]]
    yield [req(body) + b"X"]  # a byte more than the length says
    yield [req(body) + req(body)]  # two in one read
    yield [req(body) + b"\r\n"]
    yield [req(body, spell + b"+%d\r\n" % len(body))]
    yield [req(body, spell + b" %d\r\n" % len(body))]
    yield [req(body, spell + b"%d \r\n" % len(body))]
    yield [req(body, spell + b"00%d\r\n" % len(body))]
    yield [req(body, spell + b"%d\r\n" % len(body) + spell + b"%d\r\n" % len(body))]
    yield [req(body, spell + b"%d\r\n" % len(body) + b"transfer-encoding: chunked\r\n")]
    yield [req(body, spell + b"%d\r\nexpect: 100-continue\r\n" % len(body))]
    yield [req(body, spell.upper() + b"%d\r\n" % len(body))]
    yield [req(body, spell.replace(b": ", b":") + b"%d\r\n" % len(body))]
    yield [req(body, spell + b"\xd9\xa1\r\n")]  # a non-ASCII digit
    yield [req(body, spell + b"%d\r\n" % (len(body) + 10**12))]
    yield [req(body, head=(before.replace(b"POST", b"PUT", 1), after))]
    yield [req(body, head=(before, b"x-extra: 1\r\n" + after))]
    yield [req(body, head=(before, after.replace(b"\r\n", b"\n", 1)))]
    yield [req(body, head=(before.replace(b"\r\n", b"\r\n \r\n", 1), after))]
    yield [req(body, head=(before.replace(b"HTTP/1.", b"HTTP/2.", 1), after))]
    yield [b"POST", req(body)[4:]]
    # after a request parsed on the same connection: one that keeps it, one that ends it
    other = b"POST /other HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\n{}"
    yield [other, req(body)]
    yield [other.replace(b"host: h", b"connection: close"), req(body)]
    yield [other.replace(b"HTTP/1.1", b"HTTP/1.0"), req(body)]
    if len(after) > 2:  # a byte of the head changed
        k = rng.randrange(len(after) - 2)
        yield [req(body, head=(before, after[:k] + bytes([rng.randrange(256)]) + after[k + 1 :]))]


@pytest.mark.parametrize("seed", range(40))
def test_a_remembered_post_head_queues_what_parsing_would(seed: int) -> None:
    rng = random.Random(seed)

    async def main() -> None:
        learned = _server(learn=True)
        before, after = _request(rng, b"")
        spell = rng.choice([b"\r\ncontent-length: ", b"\r\nContent-Length: "])[2:]
        first = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
        queued, refused, _ = _feed(learned, [before + spell + b"%d\r\n" % len(first) + after + first])
        assert len(queued) == 1 and not refused and len(learned.posts) == 1
        for chunks in _mutations(rng, before, after, spell):
            hits = learned.post_hits
            fast = _feed(learned, chunks)
            slow = _feed(_server(learn=False), chunks)
            assert fast[:2] == slow[:2], chunks
            # (a request that ends its connection: the parser would refuse what follows, the
            # remembered parse stops reading, as for a remembered GET)
            assert fast[2] == slow[2] or (not fast[2] and fast[0] and not fast[0][-1][7]), chunks
            if learned.post_hits > hits:  # (taken: the parse of a learned head, with its length)
                assert fast[0] and fast[0][-1][5] == chunks[-1].split(b"\r\n\r\n", 1)[1]
        assert learned.post_hits >= 8  # the same head with eight other bodies, at least

    asyncio.run(main())


def test_a_post_head_that_differs_each_time_is_learned_a_while_then_not() -> None:
    """A client whose every head differs (a request id in each) fills the table without a hit: no
    head is learned for a while, so it stops paying for the learning."""

    async def main() -> None:
        srv = _server(learn=True)
        for i in range(300):
            body = b'{"prompt":[1]}'
            _feed(
                srv,
                [
                    b"POST /route HTTP/1.1\r\nx-request-id: %d\r\ncontent-length: %d\r\n\r\n%s"
                    % (i, len(body), body)
                ],
            )
        assert srv.posts == {} and srv._posts_paused_until > 0
        # while paused, heads that would repeat are not learned either; afterwards they are
        again = b"POST /route HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\n{}"
        _feed(srv, [again])
        assert srv.posts == {}
        srv._posts_paused_until = 1.0  # (as if the pause were over)
        _feed(srv, [again])
        _feed(srv, [again])
        assert len(srv.posts) == 1 and srv.post_hits == 1

    asyncio.run(main())


@pytest.fixture
def router(ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path) -> Iterator[RouterRunner]:
    engine = FakeEngine("a", ctx)
    toml = (
        f'block_size = 4\ntokenizer = "{tokdir}"\n[server]\nmax_body_bytes = 4096\n{engine.backend_toml()}\n'
    )
    runner = RouterRunner(toml, tmp_path)
    try:
        yield runner
    finally:
        runner.stop()
        engine.close()


def _exchange(s: socket.socket, data: bytes) -> tuple[int, bytes]:
    s.sendall(data)
    status, _, body = _read_response(s, bytearray())
    return status, body


def test_route_lookups_and_completions_through_a_remembered_head(router: RouterRunner) -> None:
    """Through the running server: the second POST with the same head is parsed from the
    remembered parse and answered as the first was; a proxied completion too; a body over the
    limit is still refused with 413."""
    server = cast(NativeServer, router.server).server
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        answers = []
        for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9]):
            body = json.dumps({"model": "toy", "prompt": prompt}).encode()
            head = b"POST /route HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            answers.append(_exchange(s, head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
        assert [a[0] for a in answers] == [200, 200] and server.post_hits == 1
        assert [json.loads(a[1])["prompt_tokens"] for a in answers] == [8, 12]
        for text in ("a b c", "a b c d e f"):
            body = json.dumps({"model": "toy", "prompt": text, "max_tokens": 2}).encode()
            head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            status, out = _exchange(s, head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
            assert status == 200 and json.loads(out)["object"] == "text_completion"
        assert server.post_hits == 2
        big = b"x" * 5000
        status, out = _exchange(s, head + b"content-length: %d\r\n\r\n%s" % (len(big), big))
        assert status == 413 and server.post_hits == 2
