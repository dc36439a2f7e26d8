"""A do-nothing endpoint picker: the floor under what any Python ext_proc server costs behind Envoy.

``python bench/epp_floor.py KIND PORT ENGINE[,ENGINE...]`` serves Envoy's ext_proc stream as
deploy/gateway configures it (request body BUFFERED, response body NONE) with the picker's own
message builders (router/epp/protocol.py) and no decision at all: the request headers are let
through, the body is answered with the next engine in turn (header + ``envoy.lb`` metadata), the
response headers are let through. ``KIND`` is the gRPC stack:

- ``aio``: grpcio's asyncio server on uvloop, what the picker runs on;
- ``threads``: grpcio's synchronous server (a thread per stream);
- ``grpclib``: grpclib's asyncio server (pure-Python HTTP/2 from ``h2``), when it is installed
  (``pip install grpclib``: not a dependency of kvrouter; the benchmark skips it otherwise).

bench/epp_bench.py ``--floor`` runs each behind its own Envoy beside the real picker: what remains
between the picker's figures and these is the picker's own work; what lies between these and Envoy's
round robin is the gRPC stack's, which no change to the picker can remove.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from router.epp import protocol

DESTINATION_NAMESPACE = "envoy.lb"


class Floor:
    """The answers, engine after engine: one per message that expects one (BUFFERED / NONE)."""

    def __init__(self, engines: list[str]) -> None:
        self._next = itertools.cycle(engines)

    def answer(self, request: Any) -> Any:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return protocol.continue_headers()
        if kind == "request_body":
            dest = next(self._next)
            meta = protocol.destination_metadata(DESTINATION_NAMESPACE, dest)
            return protocol.picked_buffered_body([(protocol.DESTINATION, dest)], (), meta, None)
        if kind == "response_headers":
            return protocol.continue_headers(request=False)
        return None


def serve_aio(floor: Floor, port: int) -> None:
    import grpc
    import uvloop
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

    class Servicer(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for request in requests:
                out = floor.answer(request)
                if out is not None:
                    yield out

    async def run() -> None:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(run())


def serve_threads(floor: Floor, port: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

    class Servicer(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
            for request in requests:
                out = floor.answer(request)
                if out is not None:
                    yield out

    server = grpc.server(ThreadPoolExecutor(max_workers=64))  # (c=32 streams at once, at most)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_grpclib(floor: Floor, port: int) -> None:
    import uvloop
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    class Servicer:
        async def process(self, stream: Any) -> None:
            while (request := await stream.recv_message()) is not None:
                out = floor.answer(request)
                if out is not None:
                    await stream.send_message(out)

        def __mapping__(self) -> dict[str, Handler]:
            return {
                f"/{protocol.EXT_PROC_SERVICE}/Process": Handler(
                    self.process,
                    Cardinality.STREAM_STREAM,
                    ext_proc.ProcessingRequest,
                    ext_proc.ProcessingResponse,
                )
            }

    async def run() -> None:
        server = Server([Servicer()])
        await server.start("127.0.0.1", port)
        await server.wait_closed()

    uvloop.run(run())


KINDS = {"aio": serve_aio, "threads": serve_threads, "grpclib": serve_grpclib}


def available(kind: str) -> bool:
    """Whether ``kind``'s library is installed (grpclib is optional)."""
    if kind != "grpclib":
        return True
    try:
        import grpclib  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    KINDS[sys.argv[1]](Floor(sys.argv[3].split(",")), int(sys.argv[2]))
