"""Engines that attack the router: a raw-socket engine (tests/hostile.py) writing exactly the bytes of
each attack, the real ``kvrouter serve`` in a subprocess in front of it, and a raw keep-alive client.

For every attack: the client's answer (a 502, or an intact stream ended by an error event, and never
a byte of what the engine smuggled), the next request on the same client connection answered with
its own answer, the violation counted; for the memory attacks also the router's peak resident
memory over its size before (VmHWM, reset before the attack) and the longest ``GET /health`` answer
time during the attack, which bounds the event loop's longest stall.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import FakeEngine
from hostile import RawClient, RouterProcess, Watch
from hypothesis import given, settings
from hypothesis import strategies as st

from router.net.sse import EventBuffer, EventTooLarge
from sim.hostile import (
    ATTACK_BYTES,
    HostileEngine,
    Post,
    completion,
    drop,
    endless_header_line,
    endless_sse_event,
    framed,
    many_headers,
    send_for,
    sse_event,
    trickle,
    upgrade,
)

SSE_LIMIT = 1 << 20
"""The test router's server.max_sse_event_bytes."""
HEAD_LIMIT = 65536
"""server.upstream_max_head_bytes (its default)."""
HEAD_TIMEOUT = 1.0
"""The test router's server.upstream_head_timeout_s."""
SLACK_KB = 8 << 10
"""Peak memory allowed over a limit: what one request costs the router anyway (read buffers,
parsing, allocator rounding)."""
MAX_STALL_S = 0.05


def token() -> str:
    return uuid.uuid4().hex[:12]


POISON = framed("200 OK", b'{"POISONED": true}', "content-type: application/json\r\nx-injected: 1\r\n")


def smuggle_unframed(sock: socket.socket, post: Post) -> bool:
    sock.sendall(
        framed("200 OK", completion(post.token))
        + b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-injected: 1\r\n\r\n"
        + b'{"POISONED": true}'
    )
    return True


def smuggle_framed(sock: socket.socket, post: Post) -> bool:
    sock.sendall(framed("200 OK", completion(post.token)) + POISON)
    return True


def interim(sock: socket.socket, post: Post) -> bool:
    for head in (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"):
        sock.sendall(head)
        time.sleep(0.05)  # (separate reads on the router's side: not a synchronisation)
    sock.sendall(framed("200 OK", completion(post.token)))
    return True


FRAMINGS = {
    "two_lengths": b"content-length: 5\r\ncontent-length: 5\r\n\r\nhello",
    "length_and_chunked": b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "gzip": b"transfer-encoding: gzip\r\n\r\nhello",
    "gzip_chunked": b"transfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "two_encodings": b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
}


def framing(sock: socket.socket, post: Post) -> bool:
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + FRAMINGS[post.token.split(":")[0]]
    )
    return False


def endless_sse_event_with_length(sock: socket.socket, post: Post) -> bool:
    first = sse_event(post.token)
    length = len(first) + len(b"data: ") + ATTACK_BYTES
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % length
        + first
        + b"data: "
    )
    send_for(sock, b"a" * (1 << 20), ATTACK_BYTES)
    return False


def odd_status(sock: socket.socket, post: Post) -> bool:
    sock.sendall(framed(post.token.split(":")[0] + " Odd", completion(post.token)))
    return True


ATTACKS = {
    "odd_status": odd_status,
    "smuggle_unframed": smuggle_unframed,
    "smuggle_framed": smuggle_framed,
    "upgrade": upgrade,
    "interim": interim,
    "framing": framing,
    "many_headers": many_headers,
    "endless_header_line": endless_header_line,
    "endless_sse_event": endless_sse_event,
    "endless_sse_event_with_length": endless_sse_event_with_length,
    "trickle": trickle,
    "drop": drop,
}


def base_toml(tokdir: Path) -> str:
    return (
        f'block_size = 4\ntokenizer = "{tokdir}"\n'
        f"[server]\nread_timeout_s = 30\nupstream_head_timeout_s = {HEAD_TIMEOUT}\n"
        f"max_sse_event_bytes = {SSE_LIMIT}\n"
        "[health]\ninterval_s = 60\n[health.breaker]\neject_after = 0\n"
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[HostileEngine]:
    e = HostileEngine(ATTACKS)
    yield e
    e.close()


@pytest.fixture(scope="module")
def router(
    engine: HostileEngine, tokdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    toml = base_toml(tokdir) + f'[[backends]]\nname = "h"\nurl = "{engine.url}"\nmodels = ["toy"]\n'
    r = RouterProcess(toml, tmp_path_factory.mktemp("hostile"))
    yield r
    r.stop()


def completions(word: str, tok: str, **extra: Any) -> dict[str, Any]:
    return {"model": "toy", "prompt": f"{word} {tok}", "max_tokens": 1, **extra}


def text_of(body: bytes) -> str:
    out: str = json.loads(body)["choices"][0]["text"]
    return out


def assert_502(r: Any) -> None:
    assert r.status == 502, (r.status, r.body[:300])
    err = json.loads(r.body)["error"]
    assert err["type"] and err["message"] and "code" in err and "param" in err, err


def assert_bounded(w: Watch, limit: int) -> None:
    """The router's peak memory grew by at most ``limit`` plus what any request costs, and its
    event loop answered every probe in time."""
    growth = (w.rss_before_kb, w.peak_growth_kb, w.rss_after_kb)
    assert w.peak_growth_kb <= limit // 1024 + SLACK_KB, growth
    assert w.longest_stall <= MAX_STALL_S, w.longest_stall


def assert_next_is_own(c: RawClient, engine: HostileEngine) -> None:
    """The next request on the same client connection gets its own answer."""
    t = token()
    r = c.request("POST", "/v1/completions", completions("ok", t))
    assert r.status == 200 and text_of(r.body) == t, r.body[:300]
    assert len(engine.posts_of(t)) == 1


@pytest.mark.parametrize("kind", ["smuggle_unframed", "smuggle_framed"])
def test_a_response_smuggled_after_the_answer_reaches_nobody(
    router: RouterProcess, engine: HostileEngine, kind: str
) -> None:
    before = router.metric("kvrouter_upstream_violations_total", reason="trailing_bytes")
    with RawClient(router.port) as c:
        t1 = token()
        r1 = c.request("POST", "/v1/completions", completions(kind, t1))
        assert r1.status == 200 and r1.body == completion(t1)
        assert not r1.header(b"x-injected") and r1.header(b"content-length") == [b"%d" % len(r1.body)]
        assert_next_is_own(c, engine)
        assert b"POISONED" not in c.received + c.unread()
    (p1,) = engine.posts_of(t1)
    assert all(p.conn != p1.conn for p in engine.posts[engine.posts.index(p1) + 1 :])  # never reused
    assert router.metric("kvrouter_upstream_violations_total", reason="trailing_bytes") == before + 1


def test_an_upgrade_nobody_asked_for_is_a_502_at_once(router: RouterProcess, engine: HostileEngine) -> None:
    with RawClient(router.port) as c:
        t0 = time.monotonic()
        assert_502(c.request("POST", "/v1/completions", completions("upgrade", token()), timeout=5))
        assert time.monotonic() - t0 < 5
        assert_next_is_own(c, engine)
    assert router.metric("kvrouter_upstream_violations_total", reason="upgrade") >= 1


def test_a_status_http_does_not_define_is_a_502(router: RouterProcess, engine: HostileEngine) -> None:
    """An engine's ``999`` (or ``099``): uvicorn cannot write a status outside 100-599 and closed
    the client's connection mid-answer; the router answers 502 and the connection serves on."""
    with RawClient(router.port) as c:
        for status in ("999", "099"):
            assert_502(c.request("POST", "/v1/completions", completions("odd_status", f"{status}:{token()}")))
        assert_next_is_own(c, engine)


def test_interim_responses_are_skipped(router: RouterProcess, engine: HostileEngine) -> None:
    with RawClient(router.port) as c:
        t = token()
        r = c.request("POST", "/v1/completions", completions("interim", t))
        assert r.status == 200 and text_of(r.body) == t and not r.header(b"link")
        assert_next_is_own(c, engine)


def test_conflicting_or_unknown_framing_is_a_502(router: RouterProcess, engine: HostileEngine) -> None:
    """(httptools already refused the first two; the others were passed on as if sound.)"""
    with RawClient(router.port) as c:
        for case in FRAMINGS:
            r = c.request("POST", "/v1/completions", completions("framing", f"{case}:{token()}"))
            assert_502(r)
            assert b"hello" not in r.body, case
        assert_next_is_own(c, engine)


@pytest.mark.parametrize("kind", ["many_headers", "endless_header_line"])
def test_an_endless_head_is_a_502_in_bounded_memory_without_stalling(
    router: RouterProcess, engine: HostileEngine, kind: str
) -> None:
    with RawClient(router.port, timeout=20) as c, Watch(router).running() as w:
        assert_502(c.request("POST", "/v1/completions", completions(kind, token())))
        assert_next_is_own(c, engine)
    assert_bounded(w, HEAD_LIMIT)


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_an_endless_sse_event_ends_the_stream_in_bounded_memory_without_stalling(
    router: RouterProcess, engine: HostileEngine, framing: str
) -> None:
    """The whole events before it reach the client; then an error event and the end marker, or,
    when the engine gave the stream a length (the client then expects that many bytes), the
    connection closed after them: a truncated answer, never one that leaves the client waiting."""
    t = token()
    kind = "endless_sse_event" if framing == "chunked" else "endless_sse_event_with_length"
    with RawClient(router.port, timeout=20) as c, Watch(router).running() as w:
        r = c.request("POST", "/v1/completions", completions(kind, t, stream=True), allow_cut=True)
        assert r.status == 200
        if framing == "chunked":
            first, error, done, rest = r.body.split(b"\n\n")
            assert first + b"\n\n" == sse_event(t) and done == b"data: [DONE]" and rest == b""
            assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "upstream_error"
            assert_next_is_own(c, engine)
        else:
            assert r.cut and r.body == sse_event(t)
    if framing == "length":
        with RawClient(router.port) as c:
            assert_next_is_own(c, engine)
    assert_bounded(w, SSE_LIMIT)
    assert router.metric("kvrouter_upstream_violations_total", reason="sse_event_too_large") >= 1


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    events=st.lists(
        st.sampled_from([b"data: x\n\n", b"data: y\r\n\r\n", b": c\n\n", b"data: z", b"\n", b"\r\n", b"\r"]),
        max_size=12,
    ),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_the_held_sse_event_is_cut_as_before_and_bounded(events: list[bytes], cuts: list[int]) -> None:
    """EventBuffer against the former re-join and re-scan of the whole held bytes on every read:
    the same events out for any split of the stream (ends split between two reads included), the
    rest held, and a held event over the limit refused."""
    data = b"".join(events)
    at = sorted({min(c, len(data)) for c in cuts})
    reads = [data[i:j] for i, j in zip([0, *at], [*at, len(data)], strict=True) if data[i:j]]
    buf = EventBuffer(1 << 20)
    held = b""
    for read in reads:
        whole = held + read
        cut, crlf = whole.rfind(b"\n\n"), whole.rfind(b"\r\n\r\n")  # (the former cut, verbatim)
        end = cut + 2 if cut != -1 else 0
        if crlf != -1 and crlf + 4 > end:
            end = crlf + 4
        assert buf.cut(read) == whole[:end]
        held = whole[end:]
        assert buf.size == len(held)
    assert buf.flush() == held
    small = EventBuffer(1024)
    small.cut(b"data: " + b"a" * 1000)
    with pytest.raises(EventTooLarge):
        small.cut(b"a" * 100)


def test_a_head_trickled_byte_by_byte_meets_a_deadline(router: RouterProcess, engine: HostileEngine) -> None:
    with RawClient(router.port) as c:
        t0 = time.monotonic()
        assert_502(c.request("POST", "/v1/completions", completions("trickle", token()), timeout=8))
        assert HEAD_TIMEOUT <= time.monotonic() - t0 < HEAD_TIMEOUT + 4
        assert_next_is_own(c, engine)
    assert router.metric("kvrouter_upstream_violations_total", reason="head_timeout") >= 1


def test_a_request_the_engine_read_and_dropped_is_not_sent_again(
    router: RouterProcess, engine: HostileEngine
) -> None:
    """On a reused keep-alive connection (the case the stale-connection retry sent again): the
    engine may have started it, so it is a 502 (no other backend to fail over to), sent once."""
    with RawClient(router.port) as c:
        assert_next_is_own(c, engine)  # (a keep-alive connection to the engine, idle now)
        t = token()
        assert_502(c.request("POST", "/v1/completions", completions("drop", t)))
        (post,) = engine.posts_of(t)
        assert post.index > 0  # it went on a reused connection
        assert_next_is_own(c, engine)


def test_a_prefill_leg_the_engine_dropped_falls_back_and_is_not_sent_again(
    ctx: zmq.Context[Any], tokdir: Path, tmp_path: Path
) -> None:
    """P/D: the prefill engine read the leg and closed without answering. The leg may have run, so
    it is not sent again: the decode engine gets the client's request and computes the prefill."""
    prefill, decode = HostileEngine(ATTACKS), FakeEngine("d", ctx)
    router: RouterProcess | None = None
    try:
        toml = (
            base_toml(tokdir)
            + "[pd]\nmin_uncached_tokens = 0\n"
            + f'[[backends]]\nname = "p"\nurl = "{prefill.url}"\nrole = "prefill"\nmodels = ["toy"]\n'
            + decode.backend_toml("decode")
        )
        router = RouterProcess(toml, tmp_path, backends=2)
        with RawClient(router.port) as c:
            t0 = token()
            r = c.request("POST", "/v1/completions", completions("ok", t0))
            assert r.status == 200 and r.header(b"x-kvrouter-backend") == [b"d"]
            assert decode.requests[-1]["body"]["kv_transfer_params"]["remote_engine_id"] == "hostile"
            t1 = token()
            r = c.request("POST", "/v1/completions", completions("drop", t1))
            assert r.status == 200 and b"hello from d" in r.body
        (leg,) = prefill.posts_of(t1)
        assert leg.index > 0  # on the reused connection of the first leg
        assert "kv_transfer_params" not in decode.requests[-1]["body"]  # the client's own request
        assert router.metric("kvrouter_pd_fallbacks_total", reason="protocol") == 1
    finally:
        if router is not None:
            router.stop()
        prefill.close()
        decode.close()
