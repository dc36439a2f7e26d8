"""`kvrouter serve`: load the fleet config, build the router and run it on uvicorn with kvrouter's
client limits (:mod:`router.http.uvicorn_server`; uvloop when installed)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from router.config import ConfigError, RouterConfig, with_overrides
from router.decision.policy import POLICIES
from router.fleet.sources.configfile import read_config_file

if TYPE_CHECKING:
    from router.fleet.sources.configfile import Stamp
    from router.http.uvicorn_server import HttpServer
    from router.workers.supervisor import WorkerContext

log = logging.getLogger("kvrouter")


def register(sub: Any) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser(
        "serve",
        help="run the router",
        description=(
            "Run kvrouter in front of a vLLM fleet. Flags override the config file; the environment "
            "variables KVROUTER_HOST, KVROUTER_PORT, KVROUTER_POLICY, KVROUTER_API_KEYS and "
            "KVROUTER_ADMIN_KEYS (comma-separated), KVROUTER_LOG_LEVEL and KVROUTER_WORKERS override the "
            "file too, and flags override them."
        ),
    )
    p.add_argument("--config", required=True, help="fleet TOML file (see deploy/fleet.example.toml)")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (policy.name)")
    p.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log level (server.log_level)"
    )
    p.add_argument(
        "--workers",
        type=int,
        help="router processes sharing the port (server.workers; see router/workers/supervisor.py)",
    )
    p.set_defaults(func=run)


def config_tokenizers(cfg: RouterConfig) -> list[str]:
    """Every tokenizer path the configuration names."""
    return [*cfg.tokenizers.values(), *([cfg.tokenizer] if cfg.tokenizer else [])]


def run(args: argparse.Namespace) -> int:
    """Load, validate, serve; a config error exits with status 2 and names the key."""
    try:
        loaded = read_config_file(args.config)  # (read once: the watcher starts from the same read)
        cfg = with_overrides(
            loaded[0],
            host=args.host,
            port=args.port,
            policy=args.policy,
            log_level=args.log_level,
            workers=args.workers,
        )
    except ConfigError as exc:
        for problem in str(exc).splitlines():  # (every field error msgspec found, one a line)
            print(f"kvrouter: config error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload request before we serve: nothing to reload
    level = cfg.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    from router.net.fds import raise_fd_limit  # optional: only a serving process raises it

    raise_fd_limit()  # (before the workers start: they inherit it)
    if cfg.server.workers > 1:
        # optional: jinja2 and HF tokenizers, and the supervisor, only with several workers
        from router.decision.chat import ChatTokenizer
        from router.workers.supervisor import Supervisor  # optional: only with several workers

        try:  # what a worker would fail on at start, reported once here instead of by every worker
            for path in config_tokenizers(cfg):
                ChatTokenizer.from_path(path)
        except (OSError, ValueError) as exc:
            print(f"kvrouter: cannot start: {exc}", file=sys.stderr)
            return 2
        return Supervisor(cfg, config_path=args.config, serve=serve_worker).run()
    # optional: the router itself (~0.4 s of imports) only where one runs, not for the parser
    from router.app import KVRouter
    from router.http.uvicorn_server import HttpServer, loop_factory  # optional: as KVRouter

    try:
        app = KVRouter(cfg, config_path=args.config, config_file=loaded)
    except (OSError, ValueError) as exc:  # e.g. an unreadable tokenizer
        print(f"kvrouter: cannot start: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("kvrouter.access").setLevel(logging.INFO if cfg.server.access_log else logging.WARNING)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        try:
            runner.run(serve_until_stopped(HttpServer(app)))
        except OSError as exc:  # e.g. the port is taken
            print(f"kvrouter: cannot serve: {exc}", file=sys.stderr)
            return 1
    return 0


def serve_worker(
    config: RouterConfig,
    ctx: WorkerContext,
    config_path: str | None,
    loaded: tuple[RouterConfig, Stamp] | None,
) -> None:
    """One worker process's router (:data:`router.workers.supervisor.WorkerServe`): the whole router
    on a SO_REUSEPORT socket, until SIGTERM."""
    # optional: the router itself (~0.4 s of imports) only where one runs, not for the parser
    from router.app import KVRouter
    from router.http.uvicorn_server import HttpServer, loop_factory  # optional: as KVRouter
    from router.net.listen import bound_socket  # optional: as KVRouter

    app = KVRouter(config, worker=ctx, config_path=config_path, config_file=loaded)
    # not listening yet: the server listens once the router has started, so the kernel sends this
    # worker no connection before it can answer
    sock = bound_socket(config.server.host, config.server.port)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_until_stopped(HttpServer(app, sock=sock)))


async def serve_until_stopped(server: HttpServer) -> None:
    """``server.run()`` (until SIGINT or SIGTERM), with its shutdown logged when it begins and when
    it is done: the drain between can take ``server.drain_timeout_s``, and an operator who sent
    the signal otherwise saw nothing until the process was gone."""
    from router.observe.gcpauses import freeze_start_up  # optional: as KVRouter

    stop = asyncio.Event()  # (set by the server's own SIGINT/SIGTERM handlers)
    asked: list[float] = []

    async def announce() -> None:
        await stop.wait()
        asked.append(time.monotonic())
        log.info(
            "kvrouter shutting down (SIGTERM or SIGINT): no new connections, requests in flight get "
            "up to %.0f s",
            server.drain_timeout,
        )

    watcher = asyncio.get_running_loop().create_task(announce(), name="kvrouter-shutdown-log")
    try:
        await server.run(stop, before_listen=freeze_start_up)
    finally:
        watcher.cancel()
    if asked:
        log.info("kvrouter stopped (shutdown took %.1f s)", time.monotonic() - asked[0])
