"""The usual endpoints served natively by kvrouter's own server, without the web framework.

``POST /route``, ``GET /health``, ``/ready``, ``/v1/models`` (what external schedulers and probes
call, often per request), ``/metrics``, ``/debug/index``, ``/dashboard`` and ``/dashboard/data``:
through FastAPI each paid ~0.4 ms of framework work (routing, middleware, request and response
objects) on top of the answer itself (measured in the running service), and the framework cost ~30 MB
and ~0.4 s of start-up. Here each is one dictionary lookup away from the request; the GETs are
answered in one write without a task. The answers are the very same bytes: both paths build them
with the same :class:`router.frontend.Endpoints` methods, errors are the same OpenAI-shaped bodies with
the same statuses, and a test compares the two. HEAD on those GETs is answered like the GET without
its body (load balancers probe with it). A ``/route`` whose prompt is token ids is answered like
the GETs, in the callback that read it, without a task (~50 us less per lookup). Anything else
(unknown paths, other methods) goes to the FastAPI app (:mod:`router.http.framework`), built on
first use, which also keeps every route so the router runs complete under any ASGI server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from router.errors import ApiError
from router.frontend import Endpoints
from router.http.openapi import openapi_body
from router.net.asgi import Headers, ResponseWriter, write_json
from router.proxy import send_error

Handler = Callable[[Headers, bytes, bytes, ResponseWriter], Awaitable[None]]
JSON = b"application/json"
METRICS = b"text/plain; version=0.0.4; charset=utf-8"
HTML = b"text/html; charset=utf-8"


class NativeEndpoints:
    """(method, path) -> handler for the endpoints :mod:`router.http.server` serves itself."""

    def __init__(self, app: Endpoints) -> None:
        self.app = app
        self.routes: dict[tuple[str, str], Handler] = {("POST", "/route"): self._route}
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
        for path in self.sync:  # (what the server does not answer at once, e.g. with access logs on)
            self.routes[path] = lambda h, q, r, w, p=path[1]: self._get(p, h, q, w)  # type: ignore[misc]

    def get(self, method: str, path: str) -> Handler | None:
        """The handler of a request, or None when the web framework serves it."""
        handler = self.routes.get((method, path))
        if handler is None and method == "HEAD":
            handler = self.routes.get(("GET", path))  # (the writer sends no body for HEAD)
        return handler

    def answer_now(
        self, method: str, path: str, headers: Headers, query: bytes, body: bytes = b""
    ) -> tuple[int, bytes, bytes] | None:
        """(status, content type, body) of a request whose answer needs no waiting (every GET
        above, and a ``POST /route`` whose prompt is token ids), so the server writes it without a
        task; None for every other request."""
        if method == "POST" and path == "/route" and self.routes:
            try:
                self.app.authorize_request(path, headers, query)
                answer = self.app.route_answer_now(body, query, headers)
            except ApiError as err:
                return err.status, JSON, err.body()
            return None if answer is None else (200, JSON, answer)
        make = self.sync.get(("GET" if method == "HEAD" else method, path)) if self.routes else None
        if make is None:
            return None
        try:
            self.app.authorize_request(path, headers, query)
            ctype, body = make()
            return 200, ctype, body
        except ApiError as err:
            return err.status, JSON, err.body()

    async def _get(self, path: str, headers: Headers, query: bytes, writer: ResponseWriter) -> None:
        answer = self.answer_now("GET", path, headers, query)
        assert answer is not None
        status, ctype, body = answer
        await writer.start(status, [(b"content-type", ctype), (b"content-length", b"%d" % len(body))])
        await writer.end(body)

    async def _route(self, headers: Headers, query: bytes, raw: bytes, writer: ResponseWriter) -> None:
        try:
            self.app.authorize_request("/route", headers, query)
            answer = await self.app.route_answer(raw, query, headers)
        except ApiError as err:
            await send_error(writer, err)
            return
        await write_json(writer, 200, answer)


__all__ = ["NativeEndpoints"]
