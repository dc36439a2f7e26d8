"""The picker's gRPC servers: ext_proc on ``epp.port``, gRPC health on ``epp.health_port`` (and on the
data port too, for a gateway that health-checks its ext_proc cluster).

They run on the router's own event loop (grpc.aio): a decision reads and changes the index's
predictions, the load tracker and the breakers, which belong to that loop, as the proxy's requests
do. gRPC's own I/O polling runs in its core's threads; only the handlers' Python runs on the loop,
and it holds the loop no longer than a proxied request's decision does.

Health (the standard gRPC protocol): ``liveness`` is SERVING while the process answers;
``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are NOT_SERVING until the router's
start-up is over (the first probe round, and the engines found healthy then finished bootstrapping
their index from their replay), SERVING from then on, NOT_SERVING again once shutdown begins.
A fleet with no ready endpoint later is still *ready*: the picker then answers 503, which is the
protocol's answer for it, rather than being taken out of its Service.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.config import EppConfig
from router.epp.protocol import EXT_PROC_SERVICE

if TYPE_CHECKING:
    from router.epp.picker import Picker

log = logging.getLogger("kvrouter.epp")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _credentials(cfg: EppConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert_file:
        return None
    pair = [(Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())]
    if cfg.tls_client_ca_file:
        ca = Path(cfg.tls_client_ca_file).read_bytes()
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


class EppServer:
    """Both gRPC servers and the health states; :meth:`start` binds (ports 0: any free one, read
    back from :attr:`port` / :attr:`health_port`)."""

    def __init__(self, config: EppConfig, picker: Picker, max_message_bytes: int) -> None:
        self.config = config
        self.picker = picker
        self.health = health.aio.HealthServicer()
        self._max = max_message_bytes
        self._servers: list[grpc.aio.Server] = []
        self.port = config.port
        self.health_port = config.health_port

    def _server(self) -> grpc.aio.Server:
        # messages: a body chunk of up to what the proxy accepts, plus the framing
        options = [
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            ("grpc.so_reuseport", 0),  # (a port in use is an error, not shared with a stranger)
        ]
        return grpc.aio.server(options=options)

    async def start(self) -> None:
        """Listen; liveness SERVING, readiness NOT_SERVING until :meth:`ready`."""
        cfg = self.config
        creds = _credentials(cfg)
        await self.health.set("liveness", _SERVING)
        await self.health.set("readiness", _NOT_SERVING)
        await self.health.set(EXT_PROC_SERVICE, _NOT_SERVING)
        data = self._server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.picker, data)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, data)
        probes = self._server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, probes)
        try:
            for server, port, attr in ((data, cfg.port, "port"), (probes, cfg.health_port, "health_port")):
                address = f"{cfg.host}:{port}" if ":" not in cfg.host else f"[{cfg.host}]:{port}"
                bound = (
                    server.add_secure_port(address, creds)
                    if creds is not None
                    else server.add_insecure_port(address)
                )
                if not bound:
                    raise OSError(f"epp.{attr}: cannot listen on {address}")
                setattr(self, attr, bound)
                await server.start()
                self._servers.append(server)
        except BaseException:
            await self.stop(0)
            raise
        log.info(
            "endpoint picker (ext_proc) listening on %s:%d (%s), gRPC health on port %d",
            cfg.host,
            self.port,
            "TLS" if creds is not None else "plaintext",
            self.health_port,
        )

    async def ready(self) -> None:
        """The router finished starting: readiness and the ext_proc service SERVING."""
        await self.health.set("readiness", _SERVING)
        await self.health.set(EXT_PROC_SERVICE, _SERVING)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING everywhere, then close (streams in flight get ``grace`` seconds)."""
        await self.health.enter_graceful_shutdown()
        servers, self._servers = self._servers, []
        for s in servers:
            await s.stop(grace)
