"""Prefill/decode disaggregation behind a real Envoy: the openai client -> Envoy (ext_proc) -> the
picker, which runs the prefill leg itself and answers the decode endpoint with the prefill's
``kv_transfer_params`` in the body -> the decode engine.

Mock vLLM engines (sim/) play both NIXL roles (the decode engine really pulls the prefill engine's
blocks over the side channel); scriptable engines (tests/harness.py) fail the prefill leg.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import zmq
from envoy_harness import Envoy, bootstrap, envoy_binary
from harness import TIMEOUT, FakeEngine, RouterRunner, wait_for

from sim.engine import EngineConfig, MockEngine

T = TypeVar("T")
MODES = ["BUFFERED", "FULL_DUPLEX_STREAMED"]
SYSTEM = (
    "You keep the harbour's logbook: arrivals, departures, tides, pilots and tugs, the cargo of every "
    "ship and the state of the old lighthouse. Answer in plain words and say so when the log is silent. "
) * 2
NIXL_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
EPP = "[epp]\nenabled = true\nport = 0\nhealth_port = 0\n"


class EngineLoop:
    """Mock engines on an event loop of their own (the router runs on another thread's)."""

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


def _address(url: str) -> tuple[str, int]:
    netloc = url.split("//", 1)[1].rstrip("/")
    host, port = netloc.rsplit(":", 1)
    return host, int(port)


def metric(router: RouterRunner, prefix: str) -> float:
    """The value of the one series whose line starts with ``prefix`` (0 when absent)."""
    for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def route(router: RouterRunner, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{router.url}/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def no_load_left(router: RouterRunner) -> bool:
    data = httpx.get(f"{router.url}/dashboard/data", timeout=10).json()
    return all(b["inflight"] == 0 for b in data["backends"])


@pytest.fixture
def mock_gateway(tmp_path: Path, tokdir: Path) -> Iterator[Callable[[str], tuple[Any, ...]]]:
    """A prefill and a decode mock engine (NIXL), the router with its picker, Envoy in front."""
    envoy_binary()
    loop = EngineLoop()
    made: list[Any] = []

    def make(mode: str) -> tuple[RouterRunner, Envoy, MockEngine, MockEngine]:
        cfg = EngineConfig(model="toy", tokenizer=str(tokdir), kv_connector="NixlConnector", time_scale=0.05)
        p, d = loop.start(cfg), loop.start(cfg)
        toml = f'block_size = 16\ntokenizer = "{tokdir}"\n[pd]\nmin_uncached_tokens = 96\n{EPP}'
        for name, eng, role in (("p", p, "prefill"), ("d", d, "decode")):
            toml += (
                f'[[backends]]\nname = "{name}"\nurl = "{eng.url}"\nkv_events = "{eng.kv_endpoints[0]}"\n'
                f'kv_replay = "{eng.replay_endpoints[0]}"\nrole = "{role}"\nmodels = ["toy"]\n'
            )
        router = RouterRunner(toml, tmp_path)
        made.append(router)
        assert router.app.epp is not None
        engines = [_address(p.url), _address(d.url)]
        envoy = Envoy(bootstrap(("127.0.0.1", router.app.epp.port), engines, mode=mode), tmp_path)
        made.append(envoy)
        return router, envoy, p, d

    try:
        yield make
    finally:
        for thing in reversed(made):
            thing.stop()
        loop.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_picker_runs_the_prefill_leg_and_the_decode_engine_pulls_its_blocks(
    mock_gateway: Callable[[str], tuple[Any, ...]], mode: str
) -> None:
    router, envoy, p, d = mock_gateway(mode)
    client = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="none", max_retries=0, timeout=30)
    prompt = SYSTEM + "Which ship came in first this morning?"
    body = {"model": "toy", "prompt": prompt, "max_tokens": 6}
    explained = route(router, body)
    assert explained["pd"]["mode"] == "disaggregated" and explained["backend"] == "d"
    n = explained["prompt_tokens"]
    # not streamed
    raw = client.completions.with_raw_response.create(
        model="toy", prompt=prompt, max_tokens=6, extra_headers={"x-request-id": "req-7"}
    )
    out = raw.parse()
    assert raw.headers["x-kvrouter-backend"] == "d"
    assert out.usage is not None and out.usage.prompt_tokens == n
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == n - 1  # pulled, not computed
    (p_path, p_headers, p_body), (d_path, d_headers, d_body) = p.received[-1], d.received[-1]
    assert p_path == d_path == "/v1/completions"
    assert p_body == {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_REQUEST}
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "req-7"
    params = d_body.pop("kv_transfer_params")
    assert d_body == body  # the client's request, plus the prefill's parameters
    assert params["remote_engine_id"] == p.engine_id and params["remote_port"] == p.ranks[0].side.port
    assert d.ranks[0].pulled_blocks == len(params["remote_block_ids"]) and p.ranks[0].side.reads == 1
    # streamed chat, with usage: the prefill leg is not streamed, the decode leg is as asked
    msgs: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which tug is on duty?"},
    ]
    stream = client.chat.completions.create(
        model="toy",
        messages=msgs,
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
    assert len(p.received) == 2 and p.received[-1][2]["stream"] is False
    assert "stream_options" not in p.received[-1][2]
    dec = d.received[-1][2]
    assert dec["stream"] is True and dec["stream_options"] == {"include_usage": True}
    assert dec["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    assert p.received[-1][1]["x-request-id"] == d.received[-1][1]["x-request-id"]
    # the same answer an ordinary engine gives (the transfer changed only the cost)
    direct = httpx.post(
        f"{d.url}/v1/chat/completions", json={"model": "toy", "messages": msgs, "max_tokens": 8}, timeout=30
    ).json()
    assert direct["choices"][0]["message"]["content"] == answer
    # the skip rule (pd.min_uncached_tokens): the decode engine now holds the prompt
    wait_for(lambda: route(router, body)["pd"]["mode"] == "skipped", "the pulled blocks indexed")
    again = client.completions.create(model="toy", prompt=prompt, max_tokens=6)
    assert again.choices[0].text == out.choices[0].text
    assert len(p.received) == 2 and "kv_transfer_params" not in d.received[-1][2]
    assert metric(router, 'kvrouter_pd_requests_total{mode="disaggregated"}') == 2
    assert metric(router, 'kvrouter_pd_skips_total{reason="cached"}') == 1
    assert metric(router, 'kvrouter_pd_legs_total{backend="p",leg="prefill",status="2xx"}') == 2
    wait_for(
        lambda: metric(router, 'kvrouter_pd_legs_total{backend="d",leg="decode",status="2xx"}') == 3,
        "the decode legs' ends counted",
    )
    assert metric(router, 'kvrouter_epp_streams_total{outcome="picked"}') == 3
    wait_for(lambda: no_load_left(router), "no request left in flight")


@pytest.fixture
def fake_gateway(ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path) -> Iterator[Callable[..., Any]]:
    """Scriptable prefill and decode engines (their prefill answer and failures set by the test)."""
    envoy_binary()
    made: list[Any] = []

    def make(mode: str) -> tuple[RouterRunner, Envoy, FakeEngine, FakeEngine]:
        p, d = FakeEngine("p", ctx), FakeEngine("d", ctx)
        p.pd_params = {"remote_engine_id": "engine-p", "remote_block_ids": [1, 2], "tp_size": 1}
        made.extend([p, d])
        toml = (
            f'block_size = 4\ntokenizer = "{tokdir}"\n[health]\ninterval_s = 120\n'
            f"[pd]\nmin_uncached_tokens = 0\nprefill_timeout_s = 1.0\n{EPP}"
        )
        toml += p.backend_toml("prefill") + d.backend_toml("decode")
        router = RouterRunner(toml, tmp_path)
        made.append(router)
        assert router.app.epp is not None
        engines = [("127.0.0.1", p.server.port), ("127.0.0.1", d.server.port)]
        envoy = Envoy(bootstrap(("127.0.0.1", router.app.epp.port), engines, mode=mode), tmp_path)
        made.append(envoy)
        return router, envoy, p, d

    yield make
    for thing in reversed(made):
        thing.close() if isinstance(thing, FakeEngine) else thing.stop()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_prefill_leg_falls_back_to_the_decode_engine(
    fake_gateway: Callable[..., Any], mode: str
) -> None:
    router, envoy, p, d = fake_gateway(mode)
    client = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="none", max_retries=0, timeout=30)
    prompt = "Is the lighthouse lit tonight?"
    # the prefill leg works: its parameters reach the decode engine
    assert client.completions.create(model="toy", prompt=prompt, max_tokens=5).choices[0].text == (
        "hello from d"
    )
    assert d.requests[-1]["body"]["kv_transfer_params"] == p.pd_params
    cases: list[tuple[str, Callable[[], object]]] = [
        ("upstream_5xx", lambda: setattr(p, "mode", "error500")),
        ("no_params", lambda: p.__dict__.update(mode="ok", pd_params=None)),
        ("timeout", lambda: setattr(p, "mode", "stall")),
    ]
    for i, (reason, arrange) in enumerate(cases):
        arrange()
        stream = bool(i % 2)
        if stream:
            chunks = client.completions.create(model="toy", prompt=prompt, max_tokens=5, stream=True)
            assert "hello" in "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            assert client.completions.create(model="toy", prompt=prompt, max_tokens=5).choices[0].text == (
                "hello from d"
            )
        got = d.requests[-1]["body"]
        assert "kv_transfer_params" not in got and got["max_tokens"] == 5, reason  # the client's own
        assert metric(router, f'kvrouter_pd_fallbacks_total{{backend="p",reason="{reason}"}}') == 1, reason
    wait_for(lambda: p.disconnected == 1, "the stalled prefill leg aborted")
    # a 400-451 answer of the prefill leg is the client's, and no decode leg is sent
    p.mode = "error400"
    sent = len(d.requests)
    with pytest.raises(openai.BadRequestError, match="bad prompt") as err:
        client.completions.create(model="toy", prompt=prompt, max_tokens=5)
    assert err.value.response.headers["x-kvrouter-prefill-backend"] == "p"
    assert len(d.requests) == sent
    # the prefill engine gone: connection refused, the decode engine prefills
    p.mode = "ok"
    p.server.stop()
    assert client.completions.create(model="toy", prompt=prompt, max_tokens=5).choices[0].text == (
        "hello from d"
    )
    assert metric(router, 'kvrouter_pd_fallbacks_total{backend="p",reason="connect"}') == 1
    wait_for(lambda: no_load_left(router), "no request left in flight")


def test_a_client_leaving_during_the_prefill_leg_aborts_it(fake_gateway: Callable[..., Any]) -> None:
    """Envoy resets the ext_proc stream when its client leaves: the picker's prefill leg is
    cancelled (its connection closed: vLLM's abort) and nothing stays in flight."""
    router, envoy, p, d = fake_gateway("BUFFERED")
    p.mode = "stall"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{envoy.url}/v1/completions",
            json={"model": "toy", "prompt": "Which berth is free?", "max_tokens": 3},
            timeout=0.3,
        )
    wait_for(lambda: p.disconnected == 1, "the prefill leg aborted")
    assert not d.requests
    wait_for(lambda: no_load_left(router), "no request left in flight")
    assert metric(router, 'kvrouter_pd_fallbacks_total{backend="p",reason="timeout"}') == 0
