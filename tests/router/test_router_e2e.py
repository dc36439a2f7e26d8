"""The router end to end: real servers on 127.0.0.1 (kvrouter's own and uvicorn), fake engines
publishing real KV events, and the official OpenAI client."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from harness import FakeEngine, NativeServer, RouterRunner, wait_for

from router.decision.chat import ChatTokenizer

BS = 4
SYSTEM = "You are a careful assistant. Answer in plain words and keep to the facts you are given."


@pytest.fixture(scope="module")
def tok(tokdir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_path(tokdir)


Fleet = Callable[..., tuple[RouterRunner, dict[str, FakeEngine]]]


@pytest.fixture(params=["native", "asgi"])
def fleet(
    request: pytest.FixtureRequest, ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path
) -> Iterator[Fleet]:
    """Every test runs on `kvrouter serve`'s server (what `kvrouter serve` runs) and under uvicorn
    (the app is a complete ASGI application too)."""
    made: list[Any] = []

    def make(
        names: tuple[str, ...] = ("a", "b"), extra: str = "", dp: dict[str, int] | None = None, top: str = ""
    ) -> tuple[RouterRunner, dict[str, FakeEngine]]:
        engines = {n: FakeEngine(n, ctx, dp_size=(dp or {}).get(n, 1)) for n in names}
        made.extend(engines.values())
        toml = f'block_size = {BS}\ntokenizer = "{tokdir}"\n{top}\n' + extra + "\n"
        toml += "\n".join(e.backend_toml() for e in engines.values())
        router = RouterRunner(toml, tmp_path, asgi=request.param == "asgi")
        made.append(router)
        return router, engines

    yield make
    for thing in reversed(made):
        thing.stop() if isinstance(thing, RouterRunner) else thing.close()


def ids(seed: int, n: int) -> list[int]:
    """n distinct-looking token ids inside the toy vocabulary (out-of-vocabulary ids are a 400)."""
    return [5 + (seed * 131 + i * 17) % 2000 for i in range(n)]


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def route(router: RouterRunner, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{router.url}/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def wait_routed(
    router: RouterRunner, body: dict[str, Any], backend: str, blocks: int | None = None
) -> dict[str, Any]:
    """Poll /route until the index has caught up with what a test announced."""
    seen: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal seen
        seen = route(router, body)
        return seen["backend"] == backend and (blocks is None or seen["matched_blocks"] == blocks)

    wait_for(ok, f"route to {backend}")
    return seen


def client(router: RouterRunner, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_longest_prefix_wins_with_the_openai_client(fleet: Fleet, tok: ChatTokenizer) -> None:
    router, eng = fleet(("a", "b", "c"))
    msgs = messages("Tell me about the old harbour and the ships that came there every spring.")
    tokens = tok.encode_chat(msgs)
    n = eng["b"].announce(tokens, BS)
    eng["a"].announce(tokens[: 2 * BS], BS)
    body = {"model": "toy", "messages": msgs}
    explained = wait_routed(router, body, "b", n)
    assert explained["outcome"] == "prefix" and explained["prompt_tokens"] == len(tokens)
    by = {c["backend"]: c for c in explained["candidates"]}
    assert by["a"]["matched_blocks"] == 2 and by["c"]["matched_blocks"] == 0
    out = client(router).chat.completions.create(model="toy", messages=msgs)  # type: ignore[arg-type]
    assert out.choices[0].message.content == "hello from b"
    assert len(eng["b"].requests) == 1 and not eng["a"].requests and not eng["c"].requests


def test_a_prompt_with_an_image_matches_its_text_before_the_image_only(
    fleet: Fleet, tok: ChatTokenizer
) -> None:
    """vLLM keys an image's blocks by the image's identifier, which the router cannot reproduce:
    engine b caches the conversation's text without the image; the request with the image matches
    b only up to the image (never the text after it), and says so in /route."""
    router, eng = fleet(("a", "b"))
    question = "Tell me what the picture shows about the old harbour and its ships in spring."
    text_only = tok.encode_chat(messages(question))
    n = eng["b"].announce(text_only, BS)
    wait_routed(router, {"model": "toy", "messages": messages(question)}, "b", n)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with_image = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [image, {"type": "text", "text": question}]},
    ]
    explained = route(router, {"model": "toy", "messages": with_image})
    by = {c["backend"]: c for c in explained["candidates"]}
    before = len(tok.encode_chat(with_image))
    assert 0 < by["b"]["matched_blocks"] <= before // BS < n
    assert "first media part" in explained["tokenize_error"]
    out = client(router).chat.completions.create(model="toy", messages=with_image)  # type: ignore[arg-type]
    assert out.choices[0].message.content == "hello from b"


def test_streaming_and_completions_through_the_openai_client(fleet: Fleet, tok: ChatTokenizer) -> None:
    router, eng = fleet(("a",))
    c = client(router)
    text = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model="toy", messages=messages("hi"), stream=True)  # type: ignore[arg-type]
    )
    assert text == "hello from a"
    comp = c.completions.create(model="toy", prompt="Once upon a time there was a river")
    assert comp.choices[0].text == "hello from a"
    streamed = "".join(
        ch.choices[0].text for ch in c.completions.create(model="toy", prompt=[1, 2, 3, 4, 5], stream=True)
    )
    assert streamed == "hello from a"
    assert [r["path"] for r in eng["a"].requests] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/completions",
    ]
    models = c.models.list()
    assert [m.id for m in models.data] == ["toy"]


def test_dp_rank_goes_upstream_as_a_header(fleet: Fleet, tok: ChatTokenizer) -> None:
    router, eng = fleet(("a",), dp={"a": 2})
    msgs = messages("Which rank holds this conversation about rivers and their many bridges?")
    tokens = tok.encode_chat(msgs)
    n = eng["a"].announce(tokens, BS, rank=1)
    body = {"model": "toy", "messages": msgs}
    wait_for(
        lambda: route(router, body)["dp_rank"] == 1 and route(router, body)["matched_blocks"] == n, "rank 1"
    )
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvrouter-dp-rank"] == "1"
    assert eng["a"].requests[-1]["headers"]["x-data-parallel-rank"] == "1"


@pytest.mark.parametrize(("cpu_credit", "winner"), [(0.75, "b"), (0.25, "a")])
def test_cpu_only_residency_earns_partial_credit(
    fleet: Fleet, tok: ChatTokenizer, cpu_credit: float, winner: str
) -> None:
    router, eng = fleet(("a", "b"), extra=f"[policy]\ncpu_credit = {cpu_credit}\n")
    prompt = ids(1, 8 * BS)
    eng["a"].announce(prompt[: 3 * BS], BS)  # 3 blocks on GPU
    eng["b"].announce(prompt, BS, medium="CPU")  # 8 blocks in the CPU tier only
    body = {"model": "toy", "prompt": prompt}
    explained = wait_routed(router, body, winner)
    by = {c["backend"]: c for c in explained["candidates"]}
    wait_for(lambda: route(router, body)["candidates"][1]["matched_blocks"] == 8, "b's CPU blocks indexed")
    by = {c["backend"]: c for c in route(router, body)["candidates"]}
    assert by["b"]["blocks_by_medium"] == {"GPU": 0, "CPU": 8}
    assert by["b"]["credit_blocks"] == pytest.approx(8 * cpu_credit)
    assert by["a"]["credit_blocks"] == 3


def test_minimum_match_threshold_falls_back_to_load(fleet: Fleet, tok: ChatTokenizer) -> None:
    router, eng = fleet(("a", "b"), extra="[policy]\nmin_match_blocks = 3\n")
    system_only = tok.encode_chat([{"role": "system", "content": "Be brief."}], add_generation_prompt=False)
    eng["a"].announce(system_only[: 2 * BS], BS)  # a short shared prefix (2 blocks) on a
    busy_prompt = ids(2, 10 * BS)
    eng["a"].announce(busy_prompt, BS)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a harbour?"}]
    body = {"model": "toy", "messages": msgs}
    wait_for(
        lambda: {c["backend"]: c for c in route(router, body)["candidates"]}["a"]["matched_blocks"] == 2,
        "a's prefix",
    )
    wait_routed(router, {"model": "toy", "prompt": busy_prompt}, "a", 10)
    # make a busy with a request that its long cached prefix attracts, held open by a slow engine
    eng["a"].delay_s = 3.0

    async def busy() -> int:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": busy_prompt})
            return r.status_code

    async def scenario() -> dict[str, Any]:
        task = asyncio.create_task(busy())
        await asyncio.to_thread(wait_for, lambda: len(eng["a"].requests) == 1, "busy request on a")
        explained = await asyncio.to_thread(route, router, body)
        assert await task == 200
        return explained

    explained = asyncio.run(scenario())
    by = {c["backend"]: c for c in explained["candidates"]}
    assert by["a"]["matched_blocks"] == 2 and by["a"]["credit_blocks"] == 0
    assert "minimum-match" in by["a"]["reason"]
    assert explained["backend"] == "b" and explained["outcome"] == "load"


def test_predict_on_route_keeps_a_burst_together(fleet: Fleet) -> None:
    router, eng = fleet(("a", "b", "c"))
    for e in eng.values():
        e.delay_s = 1.0  # no engine answers (or publishes anything) before the burst is routed
    prompt = ids(3, 40 * BS)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=30) as c:
            rs = await asyncio.gather(
                *(
                    c.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": prompt})
                    for _ in range(5)
                )
            )
        return [r.headers["x-kvrouter-backend"] for r in rs]

    served = asyncio.run(burst())
    assert len(set(served)) == 1, served
    # the burst's followers matched predicted blocks only: a guess, labelled, never a cache hit
    metrics = httpx.get(f"{router.url}/metrics", timeout=30).text
    assert (
        f'kvrouter_matched_tokens_total{{backend="{served[0]}",medium="PREDICTED"}} {4 * 40 * BS}.0'
        in metrics
    )
    data = httpx.get(f"{router.url}/dashboard/data", timeout=30).json()
    assert data["totals"]["matched_tokens"] == 0, data["totals"]


def test_metrics_scrape_is_valid_prometheus_text_and_keeps_the_contract(fleet: Fleet) -> None:
    """kvrouter writes its exposition itself (router/observe/exposition.py): a live scrape, after
    traffic, parsed by prometheus-client's parser and checked by ``promtool check metrics`` (when
    installed: Debian's ``prometheus``), has every family of the contract (tests/test_deploy.py) with
    its type and labels, and nothing else."""
    from prometheus_client.parser import text_string_to_metric_families
    from test_deploy import EXPORTED_METRICS, SERVER_METRICS

    router, eng = fleet(("a", "b"))
    prompt = ids(9, 6 * BS)
    eng["a"].announce(prompt, BS)
    body = {"model": "toy", "prompt": prompt}
    wait_routed(router, body, "a", 6)
    for _ in range(3):
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=30).status_code == 200
    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    native = isinstance(router.server, NativeServer)  # (`kvrouter serve`'s server adds its figures)
    contract = {
        name.removesuffix("_total") if kind == "counter" else name: (kind, labels)
        for name, (kind, labels) in {**EXPORTED_METRICS, **(SERVER_METRICS if native else {})}.items()
    }
    assert set(families) == set(contract), set(families) ^ set(contract)
    for name, fam in families.items():
        kind, labels = contract[name]
        assert fam.type == kind, name
        for sample in fam.samples:
            assert set(sample.labels) <= labels | ({"le"} if kind == "histogram" else set()), sample
    assert families["kvrouter_requests"].samples, "no request counted"
    assert any(s.value > 0 for s in families["kvrouter_kv_event_lag_seconds"].samples)
    promtool = shutil.which("promtool")
    if promtool is not None:
        proc = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_failover_before_first_byte(fleet: Fleet, tok: ChatTokenizer) -> None:
    router, eng = fleet(("a", "b", "c"), top="[health]\ninterval_s = 120\n")
    prompt = ids(4, 6 * BS)
    eng["a"].announce(prompt, BS)
    body = {"model": "toy", "prompt": prompt}
    wait_routed(router, body, "a", 6)
    eng["a"].mode = "error500"
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] in ("b", "c")
    assert len(eng["a"].requests) == 1
    # a backend that went away (connection refused) is retried on the next best too
    eng["a"].mode = "ok"
    prompt2 = ids(5, 6 * BS)
    eng["c"].announce(prompt2, BS)
    body2 = {"model": "toy", "prompt": prompt2}
    wait_routed(router, body2, "c", 6)
    eng["c"].server.stop()
    r = httpx.post(f"{router.url}/v1/completions", json=body2, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] in ("a", "b")
    health = {b["name"]: b["healthy"] for b in httpx.get(f"{router.url}/debug/index").json()["backends"]}
    assert health["c"] is False


def test_client_disconnect_cancels_the_upstream_stream(fleet: Fleet) -> None:
    router, eng = fleet(("a",))
    eng["a"].mode = "slow_stream"
    with (
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST", f"{router.url}/v1/completions", json={"model": "toy", "prompt": "x y z", "stream": True}
        ) as r,
    ):
        for _ in r.iter_raw():
            break  # one chunk, then hang up
    wait_for(lambda: eng["a"].disconnected == 1, "the engine sees the disconnect")
    data = httpx.get(f"{router.url}/dashboard/data").json()
    wait_for(
        lambda: httpx.get(f"{router.url}/dashboard/data").json()["backends"][0]["inflight"] == 0,
        "load released",
    )
    assert data["backends"][0]["name"] == "a"


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


def test_error_statuses(fleet: Fleet, ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path) -> None:
    dead = FakeEngine("dead", ctx, model="other")
    dead.server.stop()  # never healthy: serves "other" on paper only
    try:
        extra = f'[[backends]]\nname = "dead"\nurl = "{dead.url}"\nmodels = ["other"]\n'
        router, eng = fleet(
            ("a",),
            extra=extra,
            top="[server]\nmax_body_bytes = 4096\nread_timeout_s = 1.0\n[health]\ninterval_s = 120\n",
        )
        url = f"{router.url}/v1/chat/completions"
        post = lambda body, **kw: httpx.post(url, timeout=30, **({"json": body} if body is not None else kw))  # noqa: E731
        _error(httpx.post(url, content=b"{not json", timeout=30), 400)
        _error(post({"messages": messages("hi")}), 400)
        _error(post({"model": "toy"}), 400)
        _error(post({"model": "toy", "messages": "hi"}), 400)
        _error(post({"model": "toy", "messages": [{"content": "no role"}]}), 400)
        _error(post({"model": "toy", "messages": messages("hi"), "stream": "yes"}), 400)
        _error(
            httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": 5}, timeout=30), 400
        )
        for bad in ([-1, 2], [1, True], [1, "a"], [1, [2]], [True, 1]):
            _error(
                httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": bad}, timeout=30),
                400,
            )
        # invalid UTF-8 and deep nesting: msgspec raises UnicodeDecodeError / RecursionError, not
        # DecodeError; they were 500s, and a token-id /route lost its connection
        deep = b'{"model": "toy", "prompt": [5, 6], "x": ' + b"[" * 1500 + b"]" * 1500 + b"}"
        for raw in (b'{"model": "toy", "prompt": [5, 6], "x": "\xff"}', deep):
            for path in ("/v1/completions", "/route"):
                _error(httpx.post(f"{router.url}{path}", content=raw, timeout=30), 400)
        assert _error(post({"model": "nope", "messages": messages("hi")}), 404)["code"] == "model_not_found"
        _error(post({"model": "toy", "messages": messages("x" * 5000)}), 413)
        _error(post({"model": "other", "messages": messages("hi")}), 503)
        eng["a"].mode = "stall"
        assert _error(post({"model": "toy", "messages": messages("hi")}), 504)["code"] == "gateway_timeout"
        eng["a"].mode = "ok"
        eng["a"].server.stop()
        assert _error(post({"model": "toy", "messages": messages("hi")}), 502)["code"] == "bad_gateway"
        _error(httpx.get(f"{router.url}/no/such/path", timeout=30), 404)
    finally:
        dead.close()


def test_a_tokenizer_without_a_chat_template_routes_chat_on_load(
    ctx: zmq.Context[Any], tmp_path: Path, tokdir: Path
) -> None:
    """A lone tokenizer.json (a documented `tokenizer` value) has no chat template: every chat
    request was a 400, though the engine (given its template by --chat-template) serves it."""
    engine = FakeEngine("a", ctx)
    router = RouterRunner(
        f'block_size = {BS}\ntokenizer = "{tokdir / "tokenizer.json"}"\n{engine.backend_toml()}', tmp_path
    )
    try:
        body = {"model": "toy", "messages": messages("Is the lighthouse lit?"), "max_tokens": 2}
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        explained = route(router, body)
        assert explained["outcome"] == "fallback" and "no chat template" in explained["tokenize_error"]
    finally:
        router.stop()
        engine.close()


def test_route_leaves_a_round_robin_turn_where_it_was(fleet: Fleet) -> None:
    """/route is a dry run: with the round-robin policy it used a turn, so its answer was not where
    the proxy then sent the request (a scheduler calling /route first sent everything to one)."""
    router, _ = fleet(top='[policy]\nname = "round_robin"\n')
    body = {"model": "toy", "prompt": ids(3, 8), "max_tokens": 2}
    for _ in range(4):
        said = route(router, body)["backend"]
        assert route(router, body)["backend"] == said
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == said


def test_api_keys(fleet: Fleet) -> None:
    router, _ = fleet(("a",), top='api_keys = ["s3cret", "other"]\n')
    body = {"model": "toy", "prompt": "hello there"}
    assert _error(httpx.post(f"{router.url}/v1/completions", json=body), 401)["code"] == "invalid_api_key"
    _error(
        httpx.post(f"{router.url}/v1/completions", json=body, headers={"authorization": "Bearer wrong"}), 401
    )
    _error(httpx.post(f"{router.url}/route", json=body), 401)
    _error(httpx.get(f"{router.url}/metrics"), 401)
    _error(httpx.get(f"{router.url}/v1/models"), 401)
    assert httpx.get(f"{router.url}/health").status_code == 200  # probes are exempt (auth_exempt_probes)
    assert httpx.get(f"{router.url}/ready").status_code == 200
    ok = client(router, "s3cret").completions.create(model="toy", prompt="hello there")
    assert ok.choices[0].text == "hello from a"
    assert httpx.get(f"{router.url}/dashboard/data?key=other").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(router, "nope").completions.create(model="toy", prompt="hello")


def test_graceful_shutdown_drains_an_inflight_stream(fleet: Fleet) -> None:
    router, eng = fleet(("a",))
    eng["a"].mode = "short_stream"  # 30 chunks, 50 ms apart
    with (
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST", f"{router.url}/v1/completions", json={"model": "toy", "prompt": "x", "stream": True}
        ) as r,
    ):
        chunks = r.iter_raw()
        first = next(chunks)
        router.server.server.should_exit = True  # SIGTERM's effect: stop accepting, drain in-flight
        rest = b"".join(chunks)
    assert b"[DONE]" in first + rest
    assert (first + rest).count(b"hello") == 10


def test_client_leaving_before_the_headers_aborts_the_backend_request(fleet: Fleet) -> None:
    """vLLM sends a non-streamed reply's headers only when generation ends: hanging up must abort it."""
    router, eng = fleet(("a",))
    eng["a"].mode = "stall"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json={"model": "toy", "prompt": "x"}, timeout=0.5)
    wait_for(lambda: eng["a"].disconnected == 1, "the engine to see the abort")
    wait_for(
        lambda: httpx.get(f"{router.url}/dashboard/data").json()["backends"][0]["inflight"] == 0, "released"
    )


def test_a_stream_broken_by_the_backend_ends_with_a_clean_error_event(fleet: Fleet) -> None:
    router, eng = fleet(("a",))
    eng["a"].mode = "broken_stream"
    body = {"model": "toy", "prompt": "x", "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())  # no protocol error: the response ends properly
    events = [e for e in got.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), got  # every event whole
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert "broke the stream" in error["message"] and error["type"] == "upstream_error"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]] == ["hello", " from"]
    # a break in the middle of an event: the half event is never passed on
    eng["a"].mode = "broken_mid_event"
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
        cut = b"".join(r.iter_raw()).decode()
    first, err, done = [e for e in cut.split("\n\n") if e]
    assert json.loads(first[6:])["choices"][0]["text"] == "hello"  # whole; the half one is dropped
    assert "error" in json.loads(err[6:]) and done == "data: [DONE]"
    eng["a"].mode = "broken_stream"
    # the official client raises it as an API error instead of returning a cut-short answer
    stream = client(router).completions.create(model="toy", prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="broke the stream"):
        for _ in stream:
            pass


def test_failover_skips_the_other_ranks_of_a_dead_engine(fleet: Fleet) -> None:
    router, eng = fleet(("a", "b"), dp={"a": 2}, top="[health]\ninterval_s = 120\n")
    prompt = ids(6, 6 * BS)
    eng["a"].announce(prompt, BS, rank=1)
    body = {"model": "toy", "prompt": prompt}
    wait_for(lambda: route(router, body)["dp_rank"] == 1, "a/1 holds the prefix")
    eng["a"].server.stop()
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvrouter-backend"] == "b"
