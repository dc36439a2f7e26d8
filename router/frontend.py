"""What a front end may ask of the router: the :class:`Endpoints` protocol.

The front ends (:mod:`router.http`: uvicorn's server, the ASGI app, its native endpoints, the FastAPI app; a
gateway's endpoint picker beside them) stand above :class:`router.app.KVRouter`, which composes the
router, and know it only through this: the config, the proxy hot path, the admin API, the metrics,
and the answers of the non-proxied endpoints. So a front end never imports the composition, and
the composition never imports a front end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from router.config import RouterConfig
from router.fleet.sources.admin import AdminApi
from router.net.asgi import Scope
from router.observe.metrics import RouterMetrics
from router.proxy import ProxyHandler


class Endpoints(Protocol):
    """The router as its front ends see it (:class:`router.app.KVRouter` is one)."""

    config: RouterConfig
    metrics: RouterMetrics
    proxy: ProxyHandler
    admin: AdminApi
    on_config_applied: list[Callable[[], None]]
    """Called when a reload is applied, whose keys may differ (a server's kept answers depend on them)."""

    def authorize(self, scope: Scope) -> None: ...

    def authorize_request(
        self, path: str, headers: Iterable[tuple[bytes, bytes]], query: bytes = b""
    ) -> None: ...

    async def startup(self) -> None: ...

    async def shutdown(self) -> None: ...

    def request_reload(self) -> None: ...

    def health_body(self) -> dict[str, Any]: ...

    def ready_body(self) -> dict[str, Any]: ...

    def models_body(self) -> dict[str, Any]: ...

    async def route_answer(self, raw: bytes, query: bytes, headers: Any = ()) -> bytes: ...

    def route_answer_now(self, raw: bytes, query: bytes, headers: Any = ()) -> bytes | None: ...

    def debug_index_body(self) -> dict[str, Any]: ...

    def metrics_text(self) -> bytes: ...

    @property
    def dashboard_page(self) -> str: ...

    def dashboard_body(self) -> dict[str, Any]: ...


__all__ = ["Endpoints"]
