"""POSTs whose heads repeat but for their content-length, on one keep-alive connection of the
running server (as an external scheduler's ``/route`` calls and a gateway's completions arrive):
each answered for its own body, the body limit applied to every one."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import zmq
from harness import TIMEOUT, FakeEngine, NativeServer, RouterRunner
from test_server import _read_response


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


def test_route_lookups_and_completions_with_a_repeated_head(router: RouterRunner) -> None:
    """The second POST with the same head but another length is answered for its own body, as
    the first was; a proxied completion too; a body over the limit is refused with 413."""
    server = cast(NativeServer, router.server).server
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        answers = []
        for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9]):
            body = json.dumps({"model": "toy", "prompt": prompt}).encode()
            head = b"POST /route HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            answers.append(_exchange(s, head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
        assert [a[0] for a in answers] == [200, 200]
        assert [json.loads(a[1])["prompt_tokens"] for a in answers] == [8, 12]
        for text in ("a b c", "a b c d e f"):
            body = json.dumps({"model": "toy", "prompt": text, "max_tokens": 2}).encode()
            head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            status, out = _exchange(s, head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
            assert status == 200 and json.loads(out)["object"] == "text_completion"
        big = b"x" * 5000
        status, out = _exchange(s, head + b"content-length: %d\r\n\r\n%s" % (len(big), big))
        assert status == 413
