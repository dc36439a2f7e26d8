"""The router as an ASGI application built by a factory, for ASGI servers that import an app by
name (granian): ``KVROUTER_BENCH_CONFIG`` names the fleet config file."""

from __future__ import annotations

import os

from router.app import KVRouter
from router.config import load_config
from router.http.asgi import AsgiApp


def app() -> AsgiApp:
    """A router for the config file ``KVROUTER_BENCH_CONFIG`` names, as an ASGI app."""
    return AsgiApp(KVRouter(load_config(os.environ["KVROUTER_BENCH_CONFIG"])))
