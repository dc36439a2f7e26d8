"""The FastAPI app over :class:`router.frontend.Endpoints` (a ``KVRouter``): every endpoint but
the two proxied ones.

:class:`router.http.asgi.AsgiApp` (what ``kvrouter serve`` runs) answers the proxied and the usual
endpoints itself (:mod:`router.proxy`, :mod:`router.http.native`) and hands only odd requests
(unknown paths, other methods, the admin API) to this app, which it builds and imports on first use.
The answers come from the same ``KVRouter`` methods as the native ones (a test compares both byte
for byte).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.errors import ApiError, bad_request
from router.frontend import Endpoints
from router.http.openapi import openapi_body
from router.proxy import read_body

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_api(router: Endpoints) -> FastAPI:
    """The FastAPI app for a router (lifespan: the router's startup and shutdown)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.startup()
        try:
            yield
        finally:
            await router.shutdown()

    api = FastAPI(title="kvrouter", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    @api.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        err = bad_request(f"invalid request: {exc.errors()}")
        return Response(err.body(), status_code=400, media_type="application/json")

    @api.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error", "not_found")
        return Response(err.body(), status_code=exc.status_code, media_type="application/json")

    @api.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        try:
            router.authorize(request.scope)
        except ApiError as err:
            return Response(err.body(), status_code=err.status, media_type="application/json")
        response: Response = await call_next(request)
        return response

    @api.get("/health")
    async def health() -> dict[str, Any]:
        return router.health_body()

    @api.get("/ready")
    async def ready() -> Response:
        return JSONResponse(router.ready_body())

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return router.models_body()

    @api.post("/route")
    async def route(request: Request) -> Response:
        try:
            raw = await read_body(request.scope, request.receive, router.config.server.max_body_bytes)
        except asyncio.CancelledError:
            return Response(status_code=499)
        answer = await router.route_answer(
            raw, request.scope.get("query_string", b""), request.scope["headers"]
        )
        return Response(answer, media_type="application/json")

    @api.get("/debug/index")
    async def debug_index() -> Response:
        return Response(msgspec.json.encode(router.debug_index_body()), media_type="application/json")

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics_text(), media_type=METRICS_TYPE)

    @api.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(router.dashboard_page)

    @api.get("/dashboard/data")
    async def dashboard_json() -> Response:
        return Response(msgspec.json.encode(router.dashboard_body()), media_type="application/json")

    @api.get("/openapi.json")
    async def openapi() -> Response:
        return Response(openapi_body(), media_type="application/json")

    # the admin API (router/fleet/sources/admin.py; the middleware checks the admin keys)
    @api.get("/admin/backends")
    async def admin_list() -> Response:
        return Response(msgspec.json.encode(router.admin.list()), media_type="application/json")

    @api.put("/admin/backends/{name}")
    async def admin_put(name: str, request: Request) -> Response:
        status, entry = router.admin.put(name, await request.body())
        return Response(msgspec.json.encode(entry), status_code=status, media_type="application/json")

    @api.delete("/admin/backends/{name}")
    async def admin_delete(name: str) -> Response:
        return Response(msgspec.json.encode(router.admin.delete(name)), media_type="application/json")

    @api.post("/admin/backends/{name}/drain")
    async def admin_drain(name: str) -> Response:
        return Response(msgspec.json.encode(router.admin.drain(name)), media_type="application/json")

    return api


__all__ = ["METRICS_TYPE", "build_api"]
