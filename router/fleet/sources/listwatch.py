"""One list-then-watch loop for a Kubernetes resource, shared by the pod watch and the
InferencePool watch, so both follow the same rules:

- list, then watch from the list's resource version;
- a watch that ends or goes silent (the caller's watch returns) relists at once;
- 410 Gone (the version was compacted away) relists at once, logged;
- any other failure is handed to the caller's ``failed`` (counted, logged) and retried after a
  backoff that doubles from ``backoff_s`` up to ``max_backoff_s``, and starts anew once a watch
  has delivered an event (a watch that worked and then broke is a new outage, not the old one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from router.config import KubernetesConfig

__all__ = ["Followed", "list_and_watch"]

log = logging.getLogger("kvrouter.discovery")


class Followed(Protocol):
    """What the loop keeps up to date on its follower."""

    connected: bool
    """The last list or watch reached the API server."""
    delivered: bool
    """The current watch delivered an event (the follower's watch sets it)."""


async def list_and_watch(
    what: str,
    state: Followed,
    cfg: KubernetesConfig,
    client: Callable[[], Any],
    list_: Callable[[Any], Awaitable[str]],
    watch: Callable[[Any, str], Awaitable[None]],
    failed: Callable[[str], None],
) -> None:
    """Run the loop forever (cancel to stop); ``what`` names the resource in the logs."""
    # optional: httpx and lightkube only with Kubernetes discovery
    import httpx
    from lightkube import ApiError

    backoff = cfg.backoff_s
    while True:
        try:
            api = client()
            version = await list_(api)
            state.connected = True
            state.delivered = False
            await watch(api, version)  # (returns when it ended or went silent: relist)
            backoff = cfg.backoff_s
            continue
        except asyncio.CancelledError:
            raise
        except (ApiError, httpx.HTTPStatusError) as exc:
            state.connected = False
            if isinstance(exc, ApiError):
                code = getattr(exc.status, "code", None)
                message = getattr(exc.status, "message", str(exc))
            else:
                code = exc.response.status_code
                message = str(exc)
            if code == 410:
                log.info("%s: watch version expired (410 Gone): relisting", what)
                continue
            failed(f"API error {code}: {message}")
        except Exception as exc:  # connection refused, reset, bad kubeconfig, ...
            state.connected = False
            failed(f"{type(exc).__name__}: {exc}")
        if state.delivered:
            backoff = cfg.backoff_s
            state.delivered = False
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, cfg.max_backoff_s)
