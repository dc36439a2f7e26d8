"""The picker's start-up, configuration and documentation (its traffic: tests/router/epp/test_epp_envoy.py and
tests/router/epp/test_epp_conformance.py)."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.config import ConfigError, EppConfig, parse_config

ROOT = Path(__file__).resolve().parents[3]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_readiness_is_not_serving_until_the_router_has_started() -> None:
    """The first probe round (here: an engine that accepts and never answers, for health.timeout_s)
    comes before readiness; liveness answers from the first moment."""
    from router.app import KVRouter

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    cfg = parse_config(
        {
            "backends": [{"name": "slow", "url": f"http://127.0.0.1:{port}", "models": ["toy"]}],
            "health": {"timeout_s": 1.5},
            "epp": {"enabled": True, "port": 0, "health_port": 0},
        }
    )

    async def check(addr: str, service: str) -> int:
        async with grpc.aio.insecure_channel(addr) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
            return int(r.status)

    async def go() -> None:
        app = KVRouter(cfg)
        assert app.epp is not None
        starting = asyncio.get_running_loop().create_task(app.startup())
        while not app.epp.health_port and not starting.done():
            await asyncio.sleep(0.01)
        addr = f"127.0.0.1:{app.epp.health_port}"
        data = f"127.0.0.1:{app.epp.port}"
        assert not starting.done()
        assert await check(addr, "liveness") == SERVING
        assert await check(addr, "readiness") == NOT_SERVING
        assert await check(data, "envoy.service.ext_proc.v3.ExternalProcessor") == NOT_SERVING
        await starting
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await check(addr, service) == SERVING
            assert await check(data, service) == SERVING
        await app.shutdown()
        with pytest.raises(grpc.aio.AioRpcError):
            await check(addr, "liveness")

    try:
        asyncio.run(go())
    finally:
        silent.close()


@pytest.mark.parametrize(
    ("epp", "error"),
    [
        ({"port": 70000}, "epp.port"),
        ({"enabled": True, "port": 9002, "health_port": 9002}, "epp.health_port"),
        ({"fallbacks": -1}, "epp.fallbacks"),
        ({"max_streams": 0}, "epp.max_streams"),
        ({"message_timeout_s": 0}, "epp.message_timeout_s"),
        ({"response_body_every": -1}, "epp.response_body_every"),
        ({"tls_cert_file": "/nonexistent.pem"}, "epp.tls_cert_file"),
        ({"tls_client_ca_file": "ca.pem"}, "epp.tls_client_ca_file"),
        ({"destination_namespace": ""}, "epp.destination_namespace"),
        ({"portt": 1}, "portt"),
    ],
)
def test_bad_epp_settings_name_the_key(epp: dict[str, object], error: str) -> None:
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_config({**base, "epp": epp})


def test_the_epp_is_off_by_default_with_the_conventional_ports() -> None:
    cfg = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    assert cfg.epp.enabled is False and cfg.epp.port == 9002 and cfg.epp.health_port == 9003


def test_docs_gateway_table_mirrors_the_epp_defaults() -> None:
    """docs/gateway.md has a row for every [epp] key with its default, so it cannot drift."""
    doc = (ROOT / "docs" / "gateway.md").read_text()
    rows = dict(re.findall(r"^\| `epp\.(\w+)` \| `?([^|`]*)`? \|", doc, re.MULTILINE))
    for f in msgspec.structs.fields(EppConfig):
        assert f.name in rows, f"docs/gateway.md has no row for `epp.{f.name}`"
        d = f.default
        want = str(d).lower() if isinstance(d, bool) else (f'"{d}"' if isinstance(d, str) else repr(d))
        assert rows[f.name].strip() == want, (f.name, rows[f.name], want)


def test_the_prefill_clock_scales_the_measured_prefill_time_by_the_work() -> None:
    from router.epp import prefill
    from router.epp.prefill import PrefillClock

    clock = PrefillClock()
    assert clock.seconds(("a", 0), 100) is None  # nothing measured: the caller releases at once
    clock.learn(("a", 0), 0, 1.0)  # (a fully cached prompt says nothing about the rate)
    clock.learn(("a", 0), 100, -1.0)
    assert clock.seconds(("a", 0), 100) is None
    clock.learn(("a", 0), 1000, 0.5)
    assert clock.seconds(("a", 0), 2000) == 1.0 and clock.seconds(("a", 1), 2000) is None
    for _ in range(200):  # the engine got twice as slow: the estimate follows
        clock.learn(("a", 0), 1000, 1.0)
    assert clock.seconds(("a", 0), 1000) == pytest.approx(1.0, rel=1e-3)
    for i in range(prefill._MAX_TARGETS + 5):  # bounded under churn, the oldest forgotten first
        clock.learn((f"pod-{i}", 0), 10, 0.1)
    assert len(clock._seen) == prefill._MAX_TARGETS and ("a", 0) not in clock._seen
