"""Engines that attack the router: a raw-socket engine (tests/hostile.py) writing exactly the bytes of
each attack, the real ``kvrouter serve`` in a subprocess in front of it, and a raw keep-alive client.

Here: an engine that reads a request and closes the connection without answering. The request
may have started there, so it is never sent to that engine again: the client's answer is a 502 (or
a P/D fallback), and the next request on the same client connection gets its own answer.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import FakeEngine
from hostile import (
    HostileEngine,
    Post,
    RawClient,
    RouterProcess,
)


def token() -> str:
    return uuid.uuid4().hex[:12]


def drop(sock: socket.socket, post: Post) -> bool:
    return False  # the request was read: closed without an answer


ATTACKS = {
    "drop": drop,
}


def base_toml(tokdir: Path) -> str:
    return (
        f'block_size = 4\ntokenizer = "{tokdir}"\n'
        "[server]\nread_timeout_s = 30\n"
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


def assert_next_is_own(c: RawClient, engine: HostileEngine) -> None:
    """The next request on the same client connection gets its own answer."""
    t = token()
    r = c.request("POST", "/v1/completions", completions("ok", t))
    assert r.status == 200 and text_of(r.body) == t, r.body[:300]
    assert len(engine.posts_of(t)) == 1


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
