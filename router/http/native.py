"""The usual endpoints answered in front of the web framework.

``POST /route``, ``GET /health``, ``/ready``, ``/v1/models`` (what external schedulers and probes
call, often per request), ``/metrics``, ``/debug/index``, ``/dashboard`` and ``/dashboard/data``:
through FastAPI each paid ~0.4 ms of framework work (routing, middleware, request and response
objects) on top of the answer itself, and the framework cost ~30 MB and ~0.4 s of start-up. Here
each is one dictionary lookup away from the ASGI scope (:class:`router.http.asgi.AsgiApp`), so a
router that only ever answers these never imports FastAPI. The answers are the very same bytes as
FastAPI's routes for the same paths (which stay, for odd requests: HEAD is answered here, other
methods there): both build them with the same :class:`router.frontend.Endpoints` methods, errors are
the same OpenAI-shaped bodies with the same statuses, and a test compares the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from router.errors import ApiError
from router.frontend import Endpoints
from router.http.openapi import openapi_body
from router.net.asgi import Headers, Receive, Scope, Send
from router.proxy import read_body

JSON = b"application/json"
METRICS = b"text/plain; version=0.0.4; charset=utf-8"
HTML = b"text/html; charset=utf-8"


class NativeEndpoints:
    """(method, path) -> answer for the endpoints answered without the web framework."""

    def __init__(self, app: Endpoints) -> None:
        self.app = app
        self.enabled = True
        """Off: every request goes to the web framework (a test compares the two)."""
        self.from_parser = True
        """Off: a server that can answer from its parser (:meth:`answer_now`) takes the ASGI path
        (a test compares the two)."""
        self.sync: dict[tuple[str, str], Callable[[], tuple[bytes, bytes]]] = {
            ("GET", "/health"): lambda: (JSON, msgspec.json.encode(app.health_body())),
            ("GET", "/ready"): lambda: (JSON, msgspec.json.encode(app.ready_body())),
            ("GET", "/v1/models"): lambda: (JSON, msgspec.json.encode(app.models_body())),
            ("GET", "/debug/index"): lambda: (JSON, msgspec.json.encode(app.debug_index_body())),
            ("GET", "/dashboard/data"): lambda: (JSON, msgspec.json.encode(app.dashboard_body())),
            ("GET", "/metrics"): lambda: (METRICS, app.metrics_text()),
            ("GET", "/dashboard"): lambda: (HTML, app.dashboard_page.encode()),
            ("GET", "/openapi.json"): lambda: (JSON, openapi_body()),
        }

    def serves(self, method: str, path: str) -> bool:
        """Whether a request is answered here (else by the web framework)."""
        if not self.enabled:
            return False
        if method == "POST":
            return path == "/route"
        return method in ("GET", "HEAD") and ("GET", path) in self.sync

    def answer_get(self, path: str, headers: Headers, query: bytes) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of a GET (or HEAD) of one of the lookup endpoints."""
        try:
            self.app.authorize_request(path, headers, query)
            ctype, body = self.sync[("GET", path)]()
            return 200, ctype, body
        except ApiError as err:
            return err.status, JSON, err.body()

    def answer_now(
        self, method: str, path: str, headers: Headers, query: bytes, body: bytes
    ) -> tuple[int, bytes, bytes] | None:
        """(status, content type, body) of a request :meth:`serves`, its body read whole, when it
        needs no await (a GET, a ``POST /route`` of token ids); None otherwise. What :meth:`__call__`
        answers, for a server that answers from its parser (``router.http.uvicorn_server``)."""
        if method != "POST":
            return self.answer_get(path, headers, query)
        try:
            self.app.authorize_request("/route", headers, query)
            answer = self.app.route_answer_now(body, query, headers)
        except ApiError as err:
            return err.status, JSON, err.body()
        return None if answer is None else (200, JSON, answer)

    async def answer_route(self, scope: Scope, receive: Receive) -> tuple[int, bytes, bytes] | None:
        """``POST /route``'s answer (a prompt of token ids is decided without an await); None when
        the client left while sending its body."""
        headers = scope.get("headers", [])
        query = scope.get("query_string", b"")
        try:
            self.app.authorize_request("/route", headers, query)
            raw = await read_body(scope, receive, self.app.config.server.max_body_bytes)
            answer = self.app.route_answer_now(raw, query, headers)
            if answer is None:
                answer = await self.app.route_answer(raw, query, headers)
        except ApiError as err:
            return err.status, JSON, err.body()
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise
            return None  # (read_body: the client left)
        return 200, JSON, answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a request :meth:`serves` (one response start and one body message)."""
        method, path = scope["method"], scope["path"]
        if method == "POST":
            answer = await self.answer_route(scope, receive)
            if answer is None:
                return
        else:
            answer = self.answer_get(path, scope.get("headers", []), scope.get("query_string", b""))
        status, ctype, body = answer
        headers = [(b"content-type", ctype), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["NativeEndpoints"]
