"""Prefill/decode disaggregation end to end: the real router (`kvrouter serve`'s server, and uvicorn where
the client's disconnect matters) in front of mock vLLM engines playing both NIXL roles (a real pull
of the prefill engine's blocks over the side channel, real KV events), and scriptable engines for
every failure rule of the two legs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import openai
import pytest
import zmq
from harness import CHROMIUM, IN_CI, TIMEOUT, FakeEngine, RouterRunner, wait_for

from router.decision.pd import PDPlanner
from router.decision.policy import Candidate, Policy, PolicyConfig
from router.fleet.load import TargetLoad
from router.pd.config import PDConfig
from router.pd.connector import NixlConnector
from sim.engine import EngineConfig, MockEngine

T = TypeVar("T")
SYSTEM = (
    "You are the harbour master's assistant. You answer questions about ships, tides, moorings, cargo "
    "manifests, pilots, tugs and the old lighthouse, always in plain words, never guessing, and you say "
    "so when the logbook does not tell. Keep answers short and quote the logbook where you can. "
) * 2
NIXL_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# ---- mock engines in a background event loop ---------------------------------------------------------


class EngineLoop:
    """Mock engines on an asyncio loop of their own (the router runs in another thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines: list[MockEngine] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def start(self, cfg: EngineConfig) -> MockEngine:
        async def go() -> MockEngine:
            eng = MockEngine(cfg)
            await eng.start()
            return eng

        eng = self.run(go())
        self.engines.append(eng)
        return eng

    def close(self) -> None:
        for eng in self.engines:
            self.run(eng.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


def mock_toml(name: str, eng: MockEngine, role: str) -> str:
    if eng.config.dp_size > 1:  # its ranks' ephemeral event ports do not follow vLLM's port + rank
        return (
            f'[[backends]]\nname = "{name}"\nurl = "{eng.url}"\nrole = "{role}"\nmodels = ["toy"]\n'
            f"dp_size = {eng.config.dp_size}\n"
        )
    return (
        f'[[backends]]\nname = "{name}"\nurl = "{eng.url}"\nkv_events = "{eng.kv_endpoints[0]}"\n'
        f'kv_replay = "{eng.replay_endpoints[0]}"\nrole = "{role}"\nmodels = ["toy"]\n'
    )


@pytest.fixture
def mocks(tmp_path: Path, tokdir: Path) -> Iterator[tuple[RouterRunner, MockEngine, MockEngine]]:
    """One prefill and one decode mock engine (NIXL connector) behind the router."""
    loop = EngineLoop()
    router: RouterRunner | None = None
    try:
        cfg = EngineConfig(model="toy", tokenizer=str(tokdir), kv_connector="NixlConnector", time_scale=0.05)
        p, d = loop.start(cfg), loop.start(cfg)
        toml = f'block_size = 16\ntokenizer = "{tokdir}"\n[pd]\nmin_uncached_tokens = 96\n'
        toml += mock_toml("p", p, "prefill") + mock_toml("d", d, "decode")
        router = RouterRunner(toml, tmp_path)
        yield router, p, d
    finally:
        if router is not None:
            router.stop()
        loop.close()


def route(router: RouterRunner, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{router.url}/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def prefill_matched(explained: dict[str, Any], backend: str) -> int:
    by = {c["backend"]: c for c in explained["pd"]["prefill_candidates"]}
    return int(by[backend]["matched_blocks"])


def test_one_request_uses_both_engines_and_indexes_the_prompt_on_both(
    mocks: tuple[RouterRunner, MockEngine, MockEngine],
) -> None:
    router, p, d = mocks
    prompt = SYSTEM + "Which ship came in first this morning, and which pilot brought it in?"
    body = {"model": "toy", "prompt": prompt, "max_tokens": 6}
    before = route(router, body)
    assert before["pd"]["mode"] == "disaggregated" and before["pd"]["prefill_backend"] == "p"
    assert before["backend"] == "d" and before["pd"]["decode_uncached_tokens"] == before["prompt_tokens"]
    r = httpx.post(f"{router.url}/v1/completions", json=body, headers={"x-request-id": "req-42"}, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    n = before["prompt_tokens"]
    assert out["usage"]["prompt_tokens"] == n
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # pulled, not computed
    assert out["usage"]["completion_tokens"] == 6 and out["kv_transfer_params"] is None
    # what each engine received
    (p_path, p_headers, p_body), (d_path, d_headers, d_body) = p.received[-1], d.received[-1]
    assert p_path == d_path == "/v1/completions"
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "req-42"
    assert p_body == {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_REQUEST}
    params = d_body.pop("kv_transfer_params")
    assert d_body == body
    assert params["remote_engine_id"] == p.engine_id and params["remote_port"] == p.ranks[0].side.port
    assert d.ranks[0].pulled_blocks == len(params["remote_block_ids"]) and p.ranks[0].side.reads == 1
    # both engines announced the prompt: the index shows it on each pool's engine
    full = n // 16
    wait_for(
        lambda: (e := route(router, body))["matched_blocks"] == full and prefill_matched(e, "p") == full,
        "the prompt indexed on both engines",
    )
    again = route(router, body)
    assert again["pd"]["mode"] == "skipped" and again["pd"]["skip"] == "cached"
    assert "min_uncached_tokens" in again["pd"]["reason"]
    # the decode engine's cached count includes the pulled blocks, which no prediction of its own
    # covers: that leg is not checked (it was, as "under", and every decode engine got a diagnosis)
    checks = httpx.get(f"{router.url}/debug/index", timeout=10).json()["predictions"]["backends"]
    assert sum(checks.get("d", {}).get("checks", {}).values()) == 0, checks
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert 'kvrouter_pd_requests_total{mode="disaggregated"} 1.0' in metrics
    assert 'kvrouter_pd_legs_total{backend="p",leg="prefill",status="2xx"} 1.0' in metrics
    assert 'kvrouter_pd_legs_total{backend="d",leg="decode",status="2xx"} 1.0' in metrics


def test_chat_stream_with_the_openai_client_then_a_follow_up_skips_the_prefill_leg(
    mocks: tuple[RouterRunner, MockEngine, MockEngine],
) -> None:
    router, p, d = mocks
    c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=30)
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which tug is on duty tonight?"},
    ]
    stream = c.chat.completions.create(
        model="toy",
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    answer = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert answer and usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert len(p.received) == 1 and p.received[0][2]["stream"] is False
    assert "stream_options" not in p.received[0][2]
    assert d.received[-1][2]["stream"] is True and d.received[-1][2]["stream_options"] == {
        "include_usage": True
    }
    # the same answer as an ordinary engine gives (the transfer changed nothing but the cost)
    direct = httpx.post(
        f"{d.url}/v1/chat/completions", json={"model": "toy", "messages": msgs, "max_tokens": 8}, timeout=30
    ).json()
    assert direct["choices"][0]["message"]["content"] == answer
    # the next turn: the decode engine holds the conversation, so it prefills the rest itself
    follow = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "And tomorrow?"}]
    body = {"model": "toy", "messages": follow, "max_tokens": 4}
    wait_for(lambda: route(router, body)["pd"]["mode"] == "skipped", "the decode engine's blocks indexed")
    explained = route(router, body)
    assert explained["pd"]["skip"] == "cached" and explained["backend"] == "d"
    assert explained["pd"]["decode_uncached_tokens"] < 96
    assert explained["pd"]["prefill_candidates"][0]["backend"] == "p"  # still explained
    out = c.chat.completions.create(model="toy", messages=follow, max_tokens=4)  # type: ignore[arg-type]
    assert out.choices[0].message.content
    assert len(p.received) == 1  # no prefill leg
    assert "kv_transfer_params" not in d.received[-1][2]
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert 'kvrouter_pd_skips_total{reason="cached"} 1.0' in metrics


def test_a_prefill_engine_with_dp_ranks(tmp_path: Path, tokdir: Path) -> None:
    """The prefill leg goes to the chosen rank (X-data-parallel-rank) and the decode engine pulls
    from that rank's side channel (vLLM: engine id + ``_dp{rank}``, side channel port + rank)."""
    loop = EngineLoop()
    router: RouterRunner | None = None
    try:
        base = EngineConfig(model="toy", tokenizer=str(tokdir), kv_connector="NixlConnector", time_scale=0.05)
        p = loop.start(msgspec.structs.replace(base, dp_size=2))
        d = loop.start(base)
        toml = f'block_size = 16\ntokenizer = "{tokdir}"\n[pd]\nmin_uncached_tokens = 0\n'
        toml += mock_toml("p", p, "prefill") + mock_toml("d", d, "decode")
        router = RouterRunner(toml, tmp_path)
        for i in range(4):
            body = {"model": "toy", "prompt": f"{i} " + SYSTEM, "max_tokens": 2}
            reads = [r.side.reads for r in p.ranks if r.side is not None]
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            rank = int(p.received[-1][1]["x-data-parallel-rank"])
            params = d.received[-1][2]["kv_transfer_params"]
            assert params["remote_engine_id"] == f"{p.engine_id}_dp{rank}"
            side = p.ranks[rank].side
            assert side is not None and params["remote_port"] == side.port and side.reads == reads[rank] + 1
    finally:
        if router is not None:
            router.stop()
        loop.close()


def test_blocks_kept_for_a_transfer_make_the_next_prefill_wait_not_fail() -> None:
    """A prefill engine whose cache is full of blocks kept for a decode engine queues the next
    request until they are read, as vLLM does (the blocks are pinned, not lost)."""

    async def scenario() -> None:
        cfg = EngineConfig(model="toy", kv_connector="NixlConnector", num_gpu_blocks=16, time_scale=0.05)
        async with MockEngine(cfg) as p, MockEngine(cfg) as d, httpx.AsyncClient(timeout=30) as c:
            prefill = {"max_tokens": 1, "kv_transfer_params": NIXL_REQUEST}
            a = await c.post(
                f"{p.url}/v1/completions", json={"model": "toy", "prompt": list(range(1, 200)), **prefill}
            )
            params = a.json()["kv_transfer_params"]
            assert len(params["remote_block_ids"]) == 13
            b = asyncio.create_task(
                c.post(
                    f"{p.url}/v1/completions",
                    json={"model": "toy", "prompt": list(range(300, 500)), **prefill},
                )
            )
            await asyncio.sleep(0)
            for _ in range(200):  # b is queued behind the kept blocks (3 of 16 free), not failed
                if p.ranks[0].waiting:
                    break
                await asyncio.sleep(0.01)
            assert p.ranks[0].waiting and not b.done()
            got = await c.post(
                f"{d.url}/v1/completions",
                json={
                    "model": "toy",
                    "prompt": list(range(1, 200)),
                    "max_tokens": 2,
                    "kv_transfer_params": params,
                },
            )
            assert (
                got.status_code == 200
                and got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 198
            )
            assert (await b).status_code == 200  # admitted once the read released a's blocks

    asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))


# ---- scriptable engines: the legs' exact fields and every failure rule --------------------------------


Fleet = Callable[..., tuple[RouterRunner, FakeEngine, FakeEngine]]
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-x",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 40,
    "a_future_field": {"kept": [1, 2]},
}


@pytest.fixture
def fakes(
    request: pytest.FixtureRequest, ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path
) -> Iterator[Fleet]:
    made: list[Any] = []

    def make(
        pd: str = "min_uncached_tokens = 0\n", top: str = ""
    ) -> tuple[RouterRunner, FakeEngine, FakeEngine]:
        p, d = FakeEngine("p", ctx), FakeEngine("d", ctx)
        p.pd_params = dict(PARAMS)
        made.extend([p, d])
        toml = f'block_size = 4\ntokenizer = "{tokdir}"\n{top}\n[pd]\n{pd}\n'
        toml += p.backend_toml("prefill") + d.backend_toml("decode")
        router = RouterRunner(toml, tmp_path, asgi=getattr(request, "param", "native") == "asgi")
        made.append(router)
        return router, p, d

    yield make
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterRunner) else thing.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_two_legs_carry_exactly_the_nixl_fields(fakes: Fleet, endpoint: str, stream: bool) -> None:
    router, p, d = fakes()
    body: dict[str, Any] = {
        "model": "toy",
        "max_tokens": 20,
        "min_tokens": 2,
        "temperature": 0.3,
        "stream": stream,
    }
    if endpoint == "chat":
        body.update(
            messages=[{"role": "user", "content": "Where is the pilot boat?"}],
            max_completion_tokens=30,
            min_completion_tokens=3,
        )
    else:
        body["prompt"] = "Where is the pilot boat?"
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(
        f"{router.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions", json=body, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-kvrouter-backend"] == "d"
    if stream:
        assert "hello" in r.text and r.text.rstrip().endswith("data: [DONE]")
    else:
        assert "hello from d" in r.text
    (pre,), (dec,) = p.requests, d.requests
    expected = {
        k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    expected.update(stream=False, max_tokens=1, kv_transfer_params=NIXL_REQUEST)
    if endpoint == "chat":
        expected["max_completion_tokens"] = 1
    assert pre["body"] == expected
    assert dec["body"] == {**body, "kv_transfer_params": PARAMS}  # verbatim, unknown fields too
    rid = pre["headers"]["x-request-id"]
    assert rid and dec["headers"]["x-request-id"] == rid


def _fallback_count(router: RouterRunner, reason: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("kvrouter_pd_fallbacks_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class DroppingEngine:
    """Answers probes like an engine, but drops every POST's connection without a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self.dropped = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        break
                    head += data
                if head.startswith(b"GET"):
                    body = b'{"object": "list", "data": [{"id": "toy", "object": "model"}]}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                else:
                    self.dropped += 1  # closed with the request unanswered

    def close(self) -> None:
        self.sock.close()
        self.thread.join(TIMEOUT)


def test_prefill_failures_fall_back_to_the_decode_engine(fakes: Fleet) -> None:
    router, p, d = fakes(
        pd="min_uncached_tokens = 0\nprefill_timeout_s = 1.0\n", top="[health]\ninterval_s = 120\n"
    )
    body = {"model": "toy", "prompt": "Is the lighthouse lit tonight?", "max_tokens": 5}

    def send(stream: bool = False) -> httpx.Response:
        r = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvrouter-backend"] == "d"
        return r

    cases: list[tuple[str, Callable[[], None]]] = [
        ("upstream_5xx", lambda: setattr(p, "mode", "error500")),
        ("no_params", lambda: (setattr(p, "mode", "ok"), setattr(p, "pd_params", None))),
        ("timeout", lambda: setattr(p, "mode", "stall")),
    ]
    for i, (reason, arrange) in enumerate(cases):
        arrange()
        send(stream=bool(i % 2))
        assert "kv_transfer_params" not in d.requests[-1]["body"]  # the client's own request
        assert d.requests[-1]["body"]["max_tokens"] == 5
        assert _fallback_count(router, reason) == 1, reason
    wait_for(lambda: p.disconnected == 1, "the stalled prefill leg aborted")
    p.mode = "ok"
    # a prefill engine that went away: connection refused, then marked unhealthy
    p.server.stop()
    send()
    assert _fallback_count(router, "connect") == 1
    health = {b["name"]: b["healthy"] for b in httpx.get(f"{router.url}/debug/index").json()["backends"]}
    assert health["p"] is False
    # with no prefill engine left the prefill leg is skipped, not attempted
    assert route(router, body)["pd"]["skip"] == "no_prefill"
    send(stream=True)
    assert _fallback_count(router, "connect") == 1
    data = httpx.get(f"{router.url}/dashboard/data", timeout=10).json()
    assert data["pd"]["fallbacks"] == 4 and data["pd"]["skips"]["no_prefill"] == 1
    assert all(b["inflight"] == 0 for b in data["backends"])


def test_a_wedged_prefill_engine_is_ejected_not_waited_for_by_every_request(fakes: Fleet) -> None:
    """Prefill-leg timeouts and 5xx only counted as fallbacks: an engine that accepts the leg and
    never answers (its /health still 200) cost every request sent to it prefill_timeout_s, for
    good. They count in its breaker now, like a proxied request's."""
    router, p, _ = fakes(
        pd="min_uncached_tokens = 0\nprefill_timeout_s = 0.5\n",
        top="[health]\ninterval_s = 120\n[health.breaker]\neject_after = 2\neject_s = 60\n",
    )
    p.mode = "stall"
    body = {"model": "toy", "prompt": "Is the lighthouse lit tonight?", "max_tokens": 5}
    for _ in range(2):
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == "d"
    assert _fallback_count(router, "timeout") == 2
    assert router.app.breakers.state("p") == "open"
    assert route(router, body)["pd"]["prefill_status"] != "ok"
    t0 = time.monotonic()
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 0.5  # not another prefill_timeout_s
    assert _fallback_count(router, "timeout") == 2


def test_a_dropped_prefill_connection_falls_back(ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path) -> None:
    drop, d = DroppingEngine(), FakeEngine("d", ctx)
    router: RouterRunner | None = None
    try:
        toml = (
            f'block_size = 4\ntokenizer = "{tokdir}"\n[health]\ninterval_s = 120\n'
            "[pd]\nmin_uncached_tokens = 0\n"
            f'[[backends]]\nname = "p"\nurl = "http://127.0.0.1:{drop.port}"\nrole = "prefill"\n'
            + d.backend_toml("decode")
        )
        router = RouterRunner(toml, tmp_path)
        for stream in (False, True):
            body = {"model": "toy", "prompt": "Who keeps the harbour log?", "stream": stream}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and "hello" in r.text
        assert drop.dropped == 2 and len(d.requests) == 2
        assert _fallback_count(router, "protocol") == 2
    finally:
        if router is not None:
            router.stop()
        drop.close()
        d.close()


def test_a_prefill_4xx_reaches_the_client(fakes: Fleet) -> None:
    router, p, d = fakes()
    p.mode = "error400"
    c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="bad prompt"):
        c.completions.create(model="toy", prompt="Which berth is free?", stream=True)
    r = httpx.post(
        f"{router.url}/v1/completions", json={"model": "toy", "prompt": "Which berth?"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.headers["x-kvrouter-prefill-backend"] == "p"
    assert not d.requests and len(p.requests) == 2
    assert _fallback_count(router, "status") == 0


@pytest.mark.parametrize("fakes", ["native", "asgi"], indirect=True)
def test_client_leaving_during_the_prefill_leg_aborts_it(fakes: Fleet) -> None:
    """On `kvrouter serve`'s server and under uvicorn: the two detect a client leaving differently."""
    router, p, d = fakes()
    p.mode = "stall"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{router.url}/v1/completions", json={"model": "toy", "prompt": "Any storms?"}, timeout=0.5
        )
    wait_for(lambda: p.disconnected == 1, "the prefill engine sees the abort")
    wait_for(
        lambda: all(b["inflight"] == 0 for b in httpx.get(f"{router.url}/dashboard/data").json()["backends"]),
        "both legs' load released",
    )
    assert not d.requests


def test_route_explains_both_pools_and_a_warm_decode_engine_skips(fakes: Fleet, tokdir: Path) -> None:
    from router.decision.chat import ChatTokenizer

    router, p, d = fakes(pd="min_uncached_tokens = 16\n")
    tok = ChatTokenizer.from_path(tokdir)
    prompt = "The evening tide brings three fishing boats and a ferry to the inner harbour, " * 3
    body = {"model": "toy", "prompt": prompt}
    ids = tok.encode_prompt(prompt)
    explained = route(router, body)
    pd = explained["pd"]
    assert pd["mode"] == "disaggregated" and pd["connector"] == "nixl" and pd["prefill_policy"] == "kv"
    assert [c["backend"] for c in explained["candidates"]] == ["d"]
    assert [c["backend"] for c in pd["prefill_candidates"]] == ["p"]
    for c in (*explained["candidates"], *pd["prefill_candidates"]):
        assert {"credit_blocks", "prefill_blocks", "queued_blocks", "score", "reason"} <= set(c)
        assert c["reason"]
    # the decode engine holds all but a few tokens of the prompt: no prefill leg
    d.announce(ids, 4)
    wait_for(lambda: route(router, body)["pd"]["mode"] == "skipped", "d's blocks indexed")
    pd = route(router, body)["pd"]
    assert pd["skip"] == "cached" and pd["decode_uncached_tokens"] == len(ids) % 4
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and not p.requests and "kv_transfer_params" not in d.requests[0]["body"]
    # the prefill pool's own cache decides which prefill engine computes a prompt
    other = "A cargo ship waits outside the breakwater for the pilot and the morning tide, " * 3
    p.announce(tok.encode_prompt(other), 4)
    wait_for(lambda: prefill_matched(route(router, {"model": "toy", "prompt": other}), "p") > 0, "p's blocks")
    assert route(router, {"model": "toy", "prompt": other})["pd"]["prefill_outcome"] in ("prefix", "load")


def test_a_saturated_prefill_pool_is_skipped(fakes: Fleet) -> None:
    router, p, _ = fakes(pd="min_uncached_tokens = 0\nmax_prefill_queue_tokens = 8\n")
    p.mode = "stall"
    body = {"model": "toy", "prompt": "How deep is the channel at low water near the old pier?"}

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as c:
            task = asyncio.create_task(c.post(f"{router.url}/v1/completions", json=body))
            await asyncio.to_thread(wait_for, lambda: len(p.requests) == 1, "a prefill leg in flight")
            explained = await asyncio.to_thread(route, router, body)
            sent = await c.post(f"{router.url}/v1/completions", json=body)
            assert sent.status_code == 200 and len(p.requests) == 1  # went straight to d
            p.mode = "ok"
            assert (await task).status_code == 200
            return explained

    explained = asyncio.run(scenario())
    assert explained["pd"]["skip"] == "saturated" and explained["pd"]["prefill_queue_tokens"] >= 8


# ---- the decision on its own ---------------------------------------------------------------------------


def _cand(name: str, blocks: int = 0, predicted: int = 0, pending: int = 0) -> Candidate:
    by = {"GPU": blocks - predicted, "PREDICTED": predicted} if blocks else {}
    return Candidate(name, 0, blocks, by, TargetLoad(pending_prefill_tokens=pending))


def test_planner_rules() -> None:
    planner = PDPlanner(PDConfig(min_uncached_tokens=32), PolicyConfig())
    policy = Policy(PolicyConfig())
    # predicted blocks (a request still on its way) do not make a decode engine warm
    _, plan = planner.choose(
        policy, 160, 10, 16, [_cand("p")], [_cand("d", 10, predicted=10)], have_prompt=True
    )
    assert plan.mode == "disaggregated" and plan.decode_uncached_tokens == 160
    _, plan = planner.choose(policy, 160, 10, 16, [_cand("p")], [_cand("d", 9)], have_prompt=True)
    assert plan.skip == "cached" and plan.decode_uncached_tokens == 16 and plan.prefill_backend == "p"
    # an untokenizable prompt is disaggregated by default
    _, plan = planner.choose(policy, 0, 0, 16, [_cand("p")], [_cand("d")], have_prompt=False)
    assert plan.mode == "disaggregated" and plan.decode_uncached_tokens is None
    # no engine that decodes: a prefill engine serves the request whole
    decision, plan = planner.choose(policy, 160, 10, 16, [_cand("p")], [], have_prompt=True)
    assert plan.skip == "no_decode" and decision.backend == "p" and plan.prefill_target is None
    # round-robin prefill placement does not spend a turn on a skipped leg
    rr = PDPlanner(PDConfig(min_uncached_tokens=32, prefill_policy="round_robin"), PolicyConfig())
    pool = [_cand("p0"), _cand("p1")]
    firsts = [
        rr.choose(policy, 160, 10, 16, pool, [_cand("d")], have_prompt=True)[1].prefill_backend for _ in "ab"
    ]
    rr.choose(policy, 160, 10, 16, pool, [_cand("d", 10)], have_prompt=True)  # skipped
    third = rr.choose(policy, 160, 10, 16, pool, [_cand("d")], have_prompt=True)[1].prefill_backend
    assert firsts == ["p0", "p1"] and third == "p0"


def test_nixl_connector_shapes() -> None:
    c = NixlConnector()
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 1}
    leg = c.prefill_body(body, None)  # type: ignore[arg-type]
    assert leg == {
        "model": "m",
        "prompt": "x",
        "stream": False,
        "n": 1,
        "max_tokens": 1,
        "kv_transfer_params": NIXL_REQUEST,
    }
    assert body["stream"] is True  # the client's body is not modified
    assert c.transfer_params({"kv_transfer_params": None}) is None
    assert c.transfer_params({"kv_transfer_params": {}}) is None
    assert c.transfer_params([1]) is None
    assert c.transfer_params({"kv_transfer_params": {"a": 1}}) == {"a": 1}
    assert json.dumps(c.decode_body(body, {"a": 1}, None)) == json.dumps(
        {**body, "kv_transfer_params": {"a": 1}}
    )  # type: ignore[arg-type]


# ---- the dashboard shows both pools ------------------------------------------------------------------


def test_dashboard_shows_both_pools(fakes: Fleet) -> None:

    if not IN_CI and CHROMIUM is None:
        pytest.skip("chromium is not installed (CI installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("playwright is not installed")
    router, p, _ = fakes()
    for i in range(3):
        r = httpx.post(
            f"{router.url}/v1/completions", json={"model": "toy", "prompt": f"ship {i}"}, timeout=30
        )
        assert r.status_code == 200
    p.mode = "error500"
    assert httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": "x"}).status_code == 200
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{router.url}/dashboard")
            page.wait_for_selector("#pd-panel:not([hidden])", timeout=30_000)
            page.wait_for_selector("#pd-pools tbody tr[data-pool=prefill][data-backend=p]", timeout=30_000)
            assert page.locator("#pd-pools tbody tr[data-pool=decode][data-backend=d]").count() == 1
            assert page.locator("#pd-disaggregated").get_attribute("data-value") == "4"
            assert page.locator("#pd-fallbacks").get_attribute("data-value") == "1"
            assert page.locator("#pd-skip-ratio").get_attribute("data-value") == "0"
            assert "upstream_5xx 1" in page.locator("#pd-fallback-reasons").inner_text()
            page.locator("#decisions details.decision").first.click()
            page.wait_for_selector("#decisions details[open] table.pd-prefill", timeout=30_000)
            note = page.locator("#decisions details[open] [data-pd-mode]").inner_text()
            assert "disaggregated" in note and "fallback: upstream_5xx" in note
        finally:
            browser.close()
    assert not errors, errors


def test_pd_dashboard_figures_sum_over_workers() -> None:
    from router.pd.metrics import PDMetrics, merge_dashboards

    a, b = PDMetrics(), PDMetrics()
    a.decided("disaggregated", None)
    a.leg("prefill", "p", 200, 0.01)
    a.fallback("p", "timeout")
    b.decided("skipped", "cached")
    b.decided("disaggregated", None)
    b.leg("prefill", "p", 0, None)
    b.tokens("prefill", 100, 40)
    merged = merge_dashboards([a.dashboard(), b.dashboard()])
    assert merged["requests"] == {"disaggregated": 2.0, "skipped": 1.0}
    assert merged["skips"]["cached"] == 1.0 and merged["fallbacks"] == 1.0
    assert merged["fallbacks_by_reason"]["timeout"] == 1.0
    assert merged["legs"]["prefill"] == {"2xx": 1.0, "error": 1.0}
    assert merged["legs_by_backend"]["p"] == {"prefill": 2.0}
    assert merged["prompt_tokens"]["prefill"] == 100.0 and merged["matched_tokens"]["prefill"] == 40.0
    assert merge_dashboards([]) == {}


def test_the_request_id_sent_to_both_legs_is_one_header() -> None:
    """An empty x-request-id counted as absent, but was kept and forwarded first, beside the new
    one: the engines read the first, "", on both legs."""
    from router.pd.exchange import with_request_id

    base = [(b"host", b"t")]
    same, rid = with_request_id([*base, (b"x-request-id", b"abc")])
    assert rid == "abc" and same == [*base, (b"x-request-id", b"abc")]
    for given in ([(b"x-request-id", b"")], [(b"x-request-id", b""), (b"x-request-id", b"")], []):
        out, rid = with_request_id(base + given)
        assert len(rid) == 32 and [v for n, v in out if n == b"x-request-id"] == [rid.encode()]
    out, rid = with_request_id([*base, (b"x-request-id", b""), (b"x-request-id", b"mine")])
    assert rid == "mine" and [v for n, v in out if n == b"x-request-id"] == [b"mine"]
