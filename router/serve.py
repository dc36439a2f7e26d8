"""`kvrouter serve`: load the fleet config, build the router and run it under uvicorn."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import sys
from typing import Any

from router.config import ConfigError, env_overrides, load_config, with_overrides
from router.policy import POLICIES


def register(sub: Any) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser(
        "serve",
        help="run the router",
        description=(
            "Run kvrouter in front of a vLLM fleet. Flags override the config file; the environment "
            "variables KVROUTER_HOST, KVROUTER_PORT, KVROUTER_POLICY, KVROUTER_API_KEYS (comma-separated) "
            "and KVROUTER_LOG_LEVEL override the file too, and flags override them."
        ),
    )
    p.add_argument("--config", required=True, help="fleet TOML file (see deploy/fleet.example.toml)")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (policy.name)")
    p.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log level (server.log_level)"
    )
    p.set_defaults(func=run)


def _best(module: str, fallback: str) -> str:
    return module if importlib.util.find_spec(module) is not None else fallback


def run(args: argparse.Namespace) -> int:
    """Load, validate, serve; a config error exits with status 2 and names the key."""
    try:
        cfg = load_config(args.config)
        cfg = with_overrides(cfg, **env_overrides())
        cfg = with_overrides(
            cfg, host=args.host, port=args.port, policy=args.policy, log_level=args.log_level
        )
    except ConfigError as exc:
        print(f"kvrouter: config error: {exc}", file=sys.stderr)
        return 2
    level = cfg.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    import uvicorn

    from router.app import KVRouter

    try:
        app = KVRouter(cfg)
    except (OSError, ValueError) as exc:  # e.g. an unreadable tokenizer
        print(f"kvrouter: cannot start: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        log_level=cfg.server.log_level,
        access_log=cfg.server.access_log,
        loop=_best("uvloop", "asyncio"),
        http=_best("httptools", "h11"),
        timeout_graceful_shutdown=math.ceil(cfg.server.drain_timeout_s),
        lifespan="on",
    )
    return 0
