"""TLS and mTLS between Envoy and kvrouter's endpoint picker (``epp.tls_cert_file``,
``epp.tls_key_file``, ``epp.tls_client_ca_file``), with a real Envoy whose ext_proc cluster has an
UpstreamTlsContext, and the health ports over gRPC's own secure channel.

The certificates are made per module by tests/tls_harness.py (the ``openssl`` command).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import zmq
from envoy_harness import Envoy, UpstreamTls, bootstrap, envoy_binary
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import FakeEngine, RouterRunner, wait_for
from tls_harness import Pki, make_pki

from router.config import ConfigError, parse_config

BS = 4
SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_toml(pki: Pki, mtls: bool) -> str:
    out = f'tls_cert_file = "{pki.server.cert}"\ntls_key_file = "{pki.server.key}"\n'
    return out + (f'tls_client_ca_file = "{pki.ca}"\n' if mtls else "")


class Fleet:
    """Two fake engines and the router with its picker on TLS (``mtls``: client certificates)."""

    def __init__(self, ctx: zmq.Context[Any], tmp: Path, pki: Pki, mtls: bool) -> None:
        self.engines = {n: FakeEngine(n, ctx) for n in ("a", "b")}
        toml = f"block_size = {BS}\n[epp]\nenabled = true\nport = 0\nhealth_port = 0\n{tls_toml(pki, mtls)}"
        toml += "\n".join(e.backend_toml() for e in self.engines.values())
        self.router = RouterRunner(toml, tmp)
        self.tmp = tmp
        self.envoys: list[Envoy] = []

    @property
    def epp(self) -> Any:
        assert self.router.app.epp is not None
        return self.router.app.epp

    def envoy(self, name: str, tls: UpstreamTls | None, fail_open: bool = False) -> Envoy:
        engines = [("127.0.0.1", e.server.port) for e in self.engines.values()]
        config = bootstrap(("127.0.0.1", self.epp.port), engines, tls=tls, failure_mode_allow=fail_open)
        e = Envoy(config, self.tmp, name)
        self.envoys.append(e)
        return e

    def warm(self, owner: str, seed: int) -> list[int]:
        """A prompt whose blocks ``owner`` announced, once ``/route`` sends it there."""
        prompt = [5 + (seed * 131 + i * 17) % 2000 for i in range(64)]
        blocks = self.engines[owner].announce(prompt, BS)
        body = {"model": "toy", "prompt": prompt}

        def routed() -> dict[str, Any]:
            r = httpx.post(f"{self.router.url}/route", json=body, timeout=10)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        wait_for(lambda: routed()["matched_blocks"] == blocks, "index caught up")
        assert routed()["backend"] == owner
        return prompt

    def served_by(self) -> dict[str, int]:
        return {n: len(e.requests) for n, e in self.engines.items()}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.engines[name].server.port}"

    def close(self) -> None:
        for e in self.envoys:
            e.stop()
        self.router.stop()
        for eng in self.engines.values():
            eng.close()


@pytest.fixture
def fleet(ctx: zmq.Context[Any], tmp_path: Path, pki: Pki) -> Iterator[Any]:
    made: list[Fleet] = []

    def make(mtls: bool) -> Fleet:
        f = Fleet(ctx, tmp_path, pki, mtls)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def client(envoy: Envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="none", max_retries=0)


def lands_where_route_says(f: Fleet, envoy: Envoy, owner: str, seed: int) -> None:
    """Streamed and not: the picker's choice (``owner``, where ``/route`` sends the prompt) serves."""
    prompt = f.warm(owner, seed)
    c = client(envoy)
    n = len(f.engines[owner].requests)
    out = c.completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert out.choices[0].text == f"hello from {owner}"
    stream = c.completions.create(model="toy", prompt=prompt, max_tokens=3, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == f"hello from {owner}"
    got = f.engines[owner].requests[n:]
    assert len(got) == 2
    for r in got:
        assert r["headers"]["x-gateway-destination-endpoint"].split(",")[0] == f.address(owner)


def test_envoy_reaches_the_picker_over_tls_and_a_plaintext_gateway_cannot(fleet: Any, pki: Pki) -> None:
    envoy_binary()
    f: Fleet = fleet(mtls=False)
    tls = f.envoy("tls", UpstreamTls(pki.ca))  # verifies the picker's certificate and its SAN
    lands_where_route_says(f, tls, "b", seed=1)
    lands_where_route_says(f, tls, "a", seed=2)
    stats = tls.stats("cluster.epp.ssl")
    assert stats.get("cluster.epp.ssl.handshake", 0) >= 1, stats  # the ext_proc stream ran over TLS
    # a gateway speaking plaintext HTTP/2 to the TLS port gets no decision: FailClose, a clean 5xx
    plain = f.envoy("plaintext", None)
    before = f.served_by()
    prompt = f.warm("b", seed=3)
    with pytest.raises(openai.APIStatusError) as err:
        client(plain).completions.create(model="toy", prompt=prompt, max_tokens=3)
    assert err.value.status_code >= 500
    assert f.served_by() == before


def test_mtls_refuses_a_gateway_without_a_trusted_client_certificate(fleet: Any, pki: Pki) -> None:
    """With ``epp.tls_client_ca_file`` a gateway must present a certificate that CA signed: without
    one, or with another CA's, the handshake fails and the filter's failure mode decides: FailClose
    fails the request cleanly (nothing reaches an engine), FailOpen lets Envoy's own balancer take
    it (no picker header)."""
    envoy_binary()
    f: Fleet = fleet(mtls=True)
    good = f.envoy("mtls", UpstreamTls(pki.ca, cert=pki.client.cert, key=pki.client.key))
    lands_where_route_says(f, good, "b", seed=4)
    assert good.stats("cluster.epp.ssl").get("cluster.epp.ssl.handshake", 0) >= 1
    prompt = f.warm("a", seed=5)
    for name, tls in (
        ("no-cert", UpstreamTls(pki.ca)),
        ("stranger", UpstreamTls(pki.ca, cert=pki.stranger.cert, key=pki.stranger.key)),
    ):
        refused = f.envoy(name, tls)
        before = f.served_by()
        with pytest.raises(openai.APIStatusError) as err:
            client(refused).completions.create(model="toy", prompt=prompt, max_tokens=3)
        assert err.value.status_code >= 500, name
        assert f.served_by() == before, name
        # refused in the TLS handshake with the picker (no stream ever opened), not by anything later
        stats = refused.stats("cluster.epp")
        assert stats.get("cluster.epp.ssl.handshake", 0) == 0, (name, stats)
        assert stats.get("cluster.epp.upstream_cx_connect_fail", 0) >= 1, (name, stats)
    open_gw = f.envoy("no-cert-fail-open", UpstreamTls(pki.ca), fail_open=True)
    seen = {n: len(e.requests) for n, e in f.engines.items()}
    for _ in range(2):  # Envoy's round robin takes them, without the picker's header
        out = client(open_gw).completions.create(model="toy", prompt=prompt, max_tokens=3)
        assert out.choices[0].text.startswith("hello from")
    new = [r for n, e in f.engines.items() for r in e.requests[seen[n] :]]
    assert len(new) == 2
    assert all("x-gateway-destination-endpoint" not in r["headers"] for r in new)
    # the good gateway still decides after all of it
    lands_where_route_says(f, good, "a", seed=6)


async def _check(target: str, creds: grpc.ChannelCredentials | None, service: str) -> int:
    channel = (
        grpc.aio.secure_channel(target, creds) if creds is not None else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(r.status)


@pytest.mark.parametrize("mtls", [False, True])
def test_both_grpc_ports_serve_health_over_tls(fleet: Any, pki: Pki, mtls: bool) -> None:
    """The health port takes the data port's TLS settings (``epp.health_port``'s docstring): a
    secure channel trusting the CA (with the client certificate under mTLS) sees every service
    SERVING on both ports; a plaintext channel, and under mTLS one without a certificate, get no
    answer."""
    f: Fleet = fleet(mtls=mtls)
    ca = pki.ca.read_bytes()
    trusted = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=pki.client.key.read_bytes() if mtls else None,
        certificate_chain=pki.client.cert.read_bytes() if mtls else None,
    )
    ports = (f.epp.health_port, f.epp.port)

    async def go() -> None:
        for port in ports:
            for service in SERVICES:
                assert (
                    await _check(f"127.0.0.1:{port}", trusted, service)
                    == health_pb2.HealthCheckResponse.SERVING
                )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _check(f"127.0.0.1:{port}", None, "liveness")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            if mtls:
                anonymous = grpc.ssl_channel_credentials(root_certificates=ca)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _check(f"127.0.0.1:{port}", anonymous, "liveness")
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(go())


def test_bad_tls_files_are_config_errors_that_name_the_key(pki: Pki, tmp_path: Path) -> None:
    """Caught when the config is read (gRPC itself only says it "failed to bind" the port)."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted.key"
    import subprocess

    seal = ["-aes256", "-passout", "pass:x", "-out", str(encrypted)]
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki.server.key), *seal],
        check=True,
        capture_output=True,
        timeout=60,
    )
    s, c = pki.server, pki.client
    cases: list[tuple[dict[str, str], str]] = [
        (
            {"tls_cert_file": str(junk), "tls_key_file": str(s.key)},
            "epp.tls_cert_file: .* no PEM certificate",
        ),
        (
            {"tls_cert_file": str(s.cert), "tls_key_file": str(junk)},
            "epp.tls_key_file: .* no PEM private key",
        ),
        ({"tls_cert_file": str(s.cert), "tls_key_file": str(c.key)}, "epp.tls_key_file: .* not the key of"),
        ({"tls_cert_file": str(s.cert), "tls_key_file": str(encrypted)}, "epp.tls_key_file: .* encrypted"),
        (
            {"tls_cert_file": str(s.cert), "tls_key_file": str(s.key), "tls_client_ca_file": str(junk)},
            "epp.tls_client_ca_file: .* no PEM certificate",
        ),
        (
            {"tls_cert_file": str(tmp_path), "tls_key_file": str(s.key)},
            "epp.tls_cert_file: .* not a readable file",
        ),
    ]
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    for epp, error in cases:
        with pytest.raises(ConfigError, match=error) as err:
            parse_config({**base, "epp": epp})
        said = str(err.value)
        assert "\n" not in said and re.search(r"_ssl\.c|PEM lib", said) is None, said
    # and the good files pass
    good = {"tls_cert_file": str(s.cert), "tls_key_file": str(s.key), "tls_client_ca_file": str(pki.ca)}
    parse_config({**base, "epp": good})
