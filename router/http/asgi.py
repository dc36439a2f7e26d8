"""A router as a complete ASGI application (:class:`AsgiApp`): what ``kvrouter serve`` runs on
uvicorn (:mod:`router.http.uvicorn_server`), and what any other ASGI server can run.

The two proxied POST paths go to the proxy's hot path (:class:`router.proxy.ProxyHandler`), the
lookup endpoints to :mod:`router.http.native`, everything else to the FastAPI app
(:mod:`router.http.framework`), which is built and imported only when such a request comes: a router
that answers only the usual requests never loads the framework (~30 MB and ~0.4 s of start-up).
"""

from __future__ import annotations

import functools
from typing import Any

from router.frontend import Endpoints
from router.http.native import NativeEndpoints
from router.net.asgi import Receive, Scope, Send
from router.proxy import PATHS


class AsgiApp:
    """``AsgiApp(router)``: every endpoint of a router (:class:`router.frontend.Endpoints`) over ASGI."""

    def __init__(self, router: Endpoints) -> None:
        self.router = router
        self.native = NativeEndpoints(router)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if method == "POST" and path in PATHS:
                await self.router.proxy(scope, receive, send)
                return
            if self.native.serves(method, path):
                await self.native(scope, receive, send)
                return
        await self.api(scope, receive, send)

    @functools.cached_property
    def api(self) -> Any:
        """The FastAPI app over the router, built on first use."""
        # optional: FastAPI only for odd requests (start-up cost)
        from router.http.framework import build_api

        return build_api(self.router)


__all__ = ["AsgiApp"]
