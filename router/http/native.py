"""The lookup endpoints served natively by kvrouter's own server, without the web framework.

``GET /health``, ``GET /ready``, ``GET /v1/models`` and ``POST /route`` are what external schedulers
and probes call, often per request: through FastAPI each paid ~0.4 ms of framework work (routing,
middleware, request and response objects) on top of the answer itself (BENCHMARKS.md, service
section). Here each is one dictionary lookup away from the request, and the answers are the very
same bytes: both paths build them with :class:`router.app.KVRouter`'s ``health_body``,
``ready_body``, ``models_body`` and ``route_answer``, and errors are the same OpenAI-shaped bodies
with the same statuses. Everything else (the dashboard, /metrics, /debug/index) stays on FastAPI,
and the FastAPI app keeps these routes too, so the router still runs complete under any ASGI server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from router.http.asgi import Headers, ResponseWriter, write_json
from router.http.errors import ApiError
from router.http.proxy import send_error

if TYPE_CHECKING:
    from router.app import KVRouter

Handler = Callable[[Headers, bytes, bytes, ResponseWriter], Awaitable[None]]


class NativeEndpoints:
    """(method, path) -> handler for the endpoints :mod:`router.http.server` serves itself."""

    def __init__(self, app: KVRouter) -> None:
        self.app = app
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/ready"): self._ready,
            ("GET", "/v1/models"): self._models,
            ("POST", "/route"): self._route,
        }
        self.sync: dict[tuple[str, str], Callable[[], Any]] = {
            ("GET", "/health"): app.health_body,
            ("GET", "/ready"): app.ready_body,
            ("GET", "/v1/models"): app.models_body,
        }

    def get(self, method: str, path: str) -> Handler | None:
        """The handler of a request, or None when the web framework serves it."""
        return self.routes.get((method, path))

    def answer_now(self, method: str, path: str, headers: Headers, query: bytes) -> tuple[int, bytes] | None:
        """(status, JSON body) of a request whose answer needs no waiting (the probes and
        /v1/models), so the server writes it without a task; None for every other request."""
        make = self.sync.get((method, path)) if self.routes else None
        if make is None:
            return None
        try:
            self.app.authorize({"path": path, "headers": headers, "query_string": query})
            return 200, msgspec.json.encode(make())
        except ApiError as err:
            return err.status, err.body()

    async def _answer(
        self, path: str, headers: Headers, query: bytes, writer: ResponseWriter, make: Callable[[], Any]
    ) -> None:
        try:
            self.app.authorize({"path": path, "headers": headers, "query_string": query})
            body = make()
        except ApiError as err:
            await send_error(writer, err)
            return
        await write_json(writer, 200, body if type(body) is bytes else msgspec.json.encode(body))

    async def _health(self, headers: Headers, query: bytes, raw: bytes, writer: ResponseWriter) -> None:
        await self._answer("/health", headers, query, writer, self.app.health_body)

    async def _ready(self, headers: Headers, query: bytes, raw: bytes, writer: ResponseWriter) -> None:
        await self._answer("/ready", headers, query, writer, self.app.ready_body)

    async def _models(self, headers: Headers, query: bytes, raw: bytes, writer: ResponseWriter) -> None:
        await self._answer("/v1/models", headers, query, writer, self.app.models_body)

    async def _route(self, headers: Headers, query: bytes, raw: bytes, writer: ResponseWriter) -> None:
        try:
            self.app.authorize({"path": "/route", "headers": headers, "query_string": query})
            answer = await self.app.route_answer(raw, query)
        except ApiError as err:
            await send_error(writer, err)
            return
        await write_json(writer, 200, answer)


__all__ = ["NativeEndpoints"]
