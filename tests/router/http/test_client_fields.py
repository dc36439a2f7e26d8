"""A client's own ``kv_transfer_params`` never reach an engine: in a NIXL fleet they would make the
engine pull blocks another request holds on another engine (another tenant's prompt).

The real router (`kvrouter serve`'s server, and uvicorn) in front of mock vLLM engines with the NIXL
connector (sim/nixl.py: a real pull over the producer's side channel). A "victim" prefill holds its
blocks on engine ``a``, as a P/D request's prefill leg does until its decode engine reads them; an
attacker then sends those transfer parameters through the router, on every path a request can take.
Each case checks what every engine received, that the victim's blocks were not read (still held),
and the counter; the last tests show the opt-in of a trusted key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import TIMEOUT, MockFleet, RouterRunner, wait_for

from router.config import ConfigError, parse_config
from router.pd.connector import NixlConnector
from sim.engine import EngineConfig, MockEngine

BS = 16
NIXL = EngineConfig(
    block_size=BS, time_scale=0.02, kv_connector="NixlConnector", kv_load_failure_policy="recompute"
)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
TRUSTED, TENANT = "pd-proxy-key", "tenant-key"


@pytest.fixture(scope="module")
def fleet() -> Iterator[MockFleet]:
    """Engines a and b play either NIXL role (the router's config gives the roles); c has no connector
    (its answers carry no transfer parameters)."""
    made = MockFleet([NIXL, NIXL, EngineConfig(block_size=BS, time_scale=0.02)])
    yield made
    made.close()


def engine(fleet: MockFleet, name: str) -> MockEngine:
    e: MockEngine = fleet.fleet.engines["abc".index(name)]
    return e


def prompt(seed: int) -> list[int]:
    """Four full blocks of tokens no other case uses (the victim's and the attacker's have the same
    length: the mock engine pulls only blocks that fit the prompt's, as the connector does)."""
    return [100_000 + seed * 1000 + i for i in range(4 * BS)]


def victim_hold(fleet: MockFleet, seed: int) -> dict[str, Any]:
    """A prefill on engine a that keeps its blocks for a decode engine: its transfer parameters."""
    body = {
        "model": "mock-model",
        "prompt": prompt(seed),
        "max_tokens": 1,
        "kv_transfer_params": REMOTE_DECODE,
    }
    r = httpx.post(f"{engine(fleet, 'a').url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and held(fleet, params)
    return params


def held(fleet: MockFleet, params: dict[str, Any]) -> bool:
    """The victim's blocks are still kept on engine a (a pull reads them once and releases them)."""
    side = engine(fleet, "a").ranks[0].side
    assert side is not None
    return bool(fleet.call(lambda: params["remote_request_id"] in side.holds))


def received(fleet: MockFleet) -> dict[str, list[dict[str, Any]]]:
    """The completion bodies each engine received (and forget them, for the next case)."""

    def take() -> dict[str, list[dict[str, Any]]]:
        out = {}
        for name in "abc":
            e = engine(fleet, name)
            out[name] = [body for _, _, body in e.received]
            e.received.clear()
        return out

    got: dict[str, list[dict[str, Any]]] = fleet.call(take)
    return got


def backend(fleet: MockFleet, name: str, role: str = "both") -> str:
    return fleet.backend_toml("abc".index(name), name) + f'role = "{role}"\n'


def removed_total(router: RouterRunner, key: str = "none") -> float:
    auth = {"authorization": f"Bearer {key}"}
    text = httpx.get(f"{router.url}/metrics", headers=auth, timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith('kvrouter_client_fields_removed_total{field="kv_transfer_params"} '):
            return float(line.split()[1])
    return 0.0


def complete(router: RouterRunner, body: dict[str, Any], stream: bool, key: str = "none") -> str:
    """One completion through the router with the official client; its text."""
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)
    extra = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens")}
    if stream:
        chunks = client.completions.create(
            model=body["model"],
            prompt=body["prompt"],
            max_tokens=body["max_tokens"],
            stream=True,
            extra_body=extra,
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    out = client.completions.create(
        model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"], extra_body=extra
    )
    return out.choices[0].text


# (case, stream): the paths of a request through the proxy
CASES = [
    ("ordinary", False),
    ("ordinary", True),
    ("ordinary_asgi", False),
    ("ordinary_asgi", True),
    ("retried", False),
    ("disaggregated", False),
    ("disaggregated", True),
    ("prefill_skipped", False),
    ("prefill_skipped", True),
    ("fallback_5xx", False),
    ("fallback_5xx", True),
    ("fallback_no_params", False),
]


EXPECTED: dict[str, dict[str, list[Any]]] = {
    "ordinary": {},
    "ordinary_asgi": {},
    "retried": {"b": ["absent"]},  # (a failed the first try before reading its body)
    "disaggregated": {"a": [NixlConnector.REQUEST_PARAMS], "b": ["answered"]},
    "prefill_skipped": {"b": ["absent"]},
    "fallback_5xx": {"b": ["absent"]},
    "fallback_no_params": {"c": [NixlConnector.REQUEST_PARAMS], "b": ["absent"]},
}
"""Per case, the ``kv_transfer_params`` each engine received: absent, or the router's own (its
prefill leg's request, or what that leg answered)."""


def router_for(case: str, fleet: MockFleet, tmp_path: Path) -> RouterRunner:
    head = f"block_size = {BS}\nremote_tokenize = false\n[health]\ninterval_s = 60\n"
    if case.startswith("ordinary") or case == "retried":
        toml = head + backend(fleet, "a") + backend(fleet, "b")
    elif case == "fallback_no_params":
        toml = (
            head
            + "[pd]\nmin_uncached_tokens = 0\n"
            + backend(fleet, "c", "prefill")
            + backend(fleet, "b", "decode")
        )
    else:
        least = 1_000_000 if case == "prefill_skipped" else 0
        toml = head + f"[pd]\nmin_uncached_tokens = {least}\n"
        toml += backend(fleet, "a", "prefill") + backend(fleet, "b", "decode")
    return RouterRunner(toml, tmp_path, asgi=case.endswith("asgi"))


@pytest.mark.parametrize(("case", "stream"), CASES)
def test_a_clients_transfer_parameters_reach_no_engine(
    fleet: MockFleet, tmp_path: Path, case: str, stream: bool
) -> None:
    seed = CASES.index((case, stream)) + 1
    victim = victim_hold(fleet, seed)
    received(fleet)  # (the victim's own prefill is not what this case checks)
    attack = prompt(seed + 100)
    router = router_for(case, fleet, tmp_path)
    a = engine(fleet, "a")
    try:
        if case == "retried":  # the attacker's prompt is cached on a, which then fails: retried on b
            httpx.post(
                f"{a.url}/v1/completions",
                json={"model": "mock-model", "prompt": attack, "max_tokens": 1},
                timeout=TIMEOUT,
            ).raise_for_status()
            received(fleet)
            explain = {"model": "mock-model", "prompt": attack}
            wait_for(
                lambda: (
                    httpx.post(f"{router.url}/route", json=explain, timeout=TIMEOUT).json()["backend"] == "a"
                ),
                "the attacker's prompt indexed on a",
            )
        if case in ("retried", "fallback_5xx"):
            fleet.call(lambda: setattr(a, "fail_status", 500))
        try:
            body = {"model": "mock-model", "prompt": attack, "max_tokens": 2, "kv_transfer_params": victim}
            text = complete(router, body, stream)
        finally:
            fleet.call(lambda: setattr(a, "fail_status", None))
        got = received(fleet)
        assert held(fleet, victim), "an engine read the victim's blocks"
        assert text
        for name, bodies in got.items():
            assert all(b["prompt"] == attack for b in bodies)
            got_params = [b.get("kv_transfer_params", "absent") for b in bodies]
            want = EXPECTED[case].get(name, [])
            if case.startswith("ordinary") and got_params:  # (either engine: the policy's choice)
                want = ["absent"]
            if want == ["answered"]:  # the router's own decode leg: what the prefill leg answered
                assert len(got_params) == 1 and isinstance(got_params[0], dict), got_params
                assert got_params[0]["remote_request_id"] != victim["remote_request_id"]
                assert got_params[0]["remote_engine_id"] == victim["remote_engine_id"]  # (from a)
                continue
            assert got_params == want, (case, name, got_params)
        assert sum(map(len, got.values())) == (2 if case in ("disaggregated", "fallback_no_params") else 1)
        if case == "retried":
            errors = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
            assert 'kvrouter_request_errors_total{backend="a",kind="upstream_5xx"} 1.0' in errors
        assert removed_total(router) == 1
    finally:
        router.stop()


def test_a_trusted_key_passes_them_and_every_other_key_does_not(fleet: MockFleet, tmp_path: Path) -> None:
    """``trusted_api_keys``: the opt-in for a component that runs P/D legs of its own through the
    router; a tenant's key on the same router still loses the field."""
    head = (
        f'block_size = {BS}\nremote_tokenize = false\napi_keys = ["{TENANT}", "{TRUSTED}"]\n'
        f'trusted_api_keys = ["{TRUSTED}"]\n[health]\ninterval_s = 60\n'
    )
    router = RouterRunner(head + backend(fleet, "b"), tmp_path)
    try:
        victim = victim_hold(fleet, 50)
        received(fleet)
        body = {"model": "mock-model", "prompt": prompt(150), "max_tokens": 2, "kv_transfer_params": victim}
        complete(router, body, stream=False, key=TENANT)
        assert held(fleet, victim) and "kv_transfer_params" not in received(fleet)["b"][0]
        assert removed_total(router, TENANT) == 1
        # the trusted component's own transfer: passed as sent, and the engine pulls
        own = victim_hold(fleet, 51)
        received(fleet)
        complete(router, {**body, "prompt": prompt(51), "kv_transfer_params": own}, stream=True, key=TRUSTED)
        assert received(fleet)["b"][0]["kv_transfer_params"] == own
        assert not held(fleet, own)  # read by b
        assert removed_total(router, TENANT) == 1
        # a request without the field is passed on as it came (and not counted)
        complete(
            router, {"model": "mock-model", "prompt": prompt(52), "max_tokens": 1}, stream=False, key=TENANT
        )
        assert removed_total(router, TENANT) == 1
    finally:
        router.stop()


def test_a_trusted_key_must_be_a_client_key() -> None:
    backends = [{"name": "a", "url": "http://127.0.0.1:8000"}]
    with pytest.raises(ConfigError, match=r"^trusted_api_keys"):
        parse_config({"backends": backends, "api_keys": ["k1"], "trusted_api_keys": ["k2"]})
    assert parse_config({"backends": backends, "api_keys": ["k1"], "trusted_api_keys": ["k1"]})
