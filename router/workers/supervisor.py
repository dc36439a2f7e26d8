"""Several router processes on one port (``server.workers > 1``): a supervisor and its workers.

Why processes: one Python process proxies at most ~7k requests/s on the reference box (tokenizing,
hashing, scoring and two socket round trips per request, all under one GIL), while the machine has
cores to spare; two processes measured +25-35% there. Threads would not help: the
per-request work is Python.

How:

- The supervisor reserves the port (a socket bound with SO_REUSEPORT but not listening, so it takes
  no connections) and spawns the workers (``multiprocessing`` spawn: fresh interpreters, no forked
  threads or ZeroMQ contexts). Each worker binds its own listening socket to the same port with
  SO_REUSEPORT and the kernel spreads new connections over them.
- Each worker is a whole router: its own event subscriptions (ZeroMQ PUB fans every event out to
  every subscriber) and so its own copy of the index, its own health checks and tokenizer.
- In-flight load is shared through a :class:`router.fleet.load.LoadBoard` in the run directory, so every
  worker scores candidates against the whole router's load.
- /metrics and the dashboard merge every worker's published figures (:mod:`router.workers.stats`).
- Not shared: predict-on-route. A burst of one new prefix spread over N workers can land on up to
  N engines until the engines' events arrive (milliseconds), after which every worker sees the real
  residencies. Bind-mode KV events need one process (config validation says so).
- A worker that dies is restarted (backoff 1 s doubling to 30 s). Before that, its rows of the load
  board are zeroed (its requests died with it) and its last published figures are folded into the
  retired ones (sums never drop). If workers keep dying within 10 s of their start, the supervisor
  gives up after 5 such deaths in a row and exits 1 (a broken config or port must not spin
  forever); once every worker has run 10 s, the count starts afresh. SIGTERM/SIGINT: every worker
  drains (``drain_timeout_s``) and exits, then the supervisor removes the run directory and exits 0.
- The port is checked with a plain bind first: SO_REUSEPORT alone would let a second router on the
  same port start and silently split the traffic. Workers ask the kernel for SIGTERM when the
  supervisor dies (Linux), so a killed supervisor leaves no orphan serving the port.
- What a worker runs is handed in (``Supervisor(..., serve=)``, :data:`WorkerServe`: `kvrouter
  serve` passes :func:`router.serve.serve_worker`): the workers stand below the router they run,
  which they never build themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeAlias, cast

import msgspec

from router.config import ConfigError, RouterConfig
from router.fleet.load import LoadBoard
from router.fleet.sources.configfile import LIVE_FIELDS, read_config_file
from router.net.listen import bound_socket

if TYPE_CHECKING:
    from router.fleet.sources.configfile import Stamp
from router.workers.stats import retire

log = logging.getLogger("kvrouter.workers")

_QUICK_DEATH_S = 10.0
_MAX_QUICK_DEATHS = 5


class WorkerContext(msgspec.Struct, frozen=True):
    """What a worker process needs to know about its siblings."""

    index: int
    workers: int
    run_dir: str
    stats_interval_s: float = 1.0
    """How often the worker publishes its figures for the merged /metrics and dashboard."""

    def board(self) -> LoadBoard:
        """The shared load board of this router's workers (targets get slots as they join)."""
        return LoadBoard(str(Path(self.run_dir) / "load.board"), self.workers)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the supervisor) dies; elsewhere, nothing."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _with_current_file(
    config: RouterConfig, config_path: str | None
) -> tuple[RouterConfig, tuple[RouterConfig, Stamp] | None]:
    """The supervisor's config with what a reload applies (backends, API and admin keys) as the
    file says now, and that read of the file for the worker's watcher to start from (None: it reads
    the file itself). A worker restarted after a reload started from the supervisor's original
    config, so revoked keys worked again and its backends were the old ones (the file looked
    unchanged to its watcher); and a watcher that read the file again saw a change landing between
    the two reads as already applied. An invalid file now: the config as given, as the running
    workers keep theirs."""
    if config_path is None:
        return config, None
    try:
        loaded = read_config_file(config_path)
    except ConfigError:
        return config, None
    return msgspec.structs.replace(config, **{f: getattr(loaded[0], f) for f in LIVE_FIELDS}), loaded


WorkerServe: TypeAlias = (
    "Callable[[RouterConfig, WorkerContext, str | None, tuple[RouterConfig, Stamp] | None], None]"
)
"""What a worker process runs once set up: ``serve(config, ctx, config_path, loaded)`` builds the
router and serves it on a SO_REUSEPORT socket until SIGTERM. A module-level function: the spawned
interpreter imports it by name."""


def worker_main(
    config: RouterConfig, ctx: WorkerContext, config_path: str | None = None, serve: WorkerServe | None = None
) -> None:
    """Entry point of one worker process: the whole router on a SO_REUSEPORT socket (``serve``).
    Started with SIGHUP blocked (:meth:`Supervisor._spawn`): ignored until the server's reload
    handler is set."""
    _die_with_parent()  # (first: a supervisor killed while this one starts must not leave it behind)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the server's handler (reload) is installed
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    config, loaded = _with_current_file(config, config_path)
    level = config.server.log_level.upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s worker-{ctx.index} %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    logging.getLogger("kvrouter.access").setLevel(
        logging.INFO if config.server.access_log else logging.WARNING
    )
    if serve is None:
        raise ValueError("a worker needs what to serve: Supervisor(..., serve=)")
    serve(config, ctx, config_path, loaded)


class Supervisor:
    """Starts, watches, restarts and stops the worker processes."""

    def __init__(
        self, config: RouterConfig, config_path: str | None = None, serve: WorkerServe | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.serve = serve
        """What each worker runs (:data:`WorkerServe`)."""
        self.workers = config.server.workers
        self.stopping = False
        self.signal = ""
        """The signal that stopped it (for the log)."""
        self._mp = multiprocessing.get_context("spawn")
        self._procs: dict[int, BaseProcess] = {}
        self._started: dict[int, float] = {}
        self._quick_deaths = 0

    def _spawn(self, index: int, run_dir: str) -> None:
        ctx = WorkerContext(index, self.workers, run_dir)
        proc = self._mp.Process(
            target=worker_main,
            args=(self.config, ctx, self.config_path, self.serve),
            name=f"kvrouter-worker-{index}",
            daemon=False,
        )
        # started with SIGHUP blocked (the mask survives fork and exec; the default action would
        # kill a worker still importing): worker_main ignores, then unblocks it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # (a pending one: delivered now)
        self._procs[index] = proc
        self._started[index] = time.monotonic()
        log.info("worker %d started (pid %s)", index, proc.pid)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        self.signal = self.signal or signal.Signals(signum).name  # (logged by run(), not in here)

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        """SIGHUP: every worker re-reads the config file (each applies it to its own membership)."""
        for proc in list(self._procs.values()):
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGHUP)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 after a clean stop, 1 if the port or the workers fail."""
        srv = self.config.server
        try:
            bound_socket(srv.host, srv.port, reuse_port=False).close()  # taken by anyone else?
            reserve = bound_socket(srv.host, srv.port)
        except OSError as exc:
            log.error("cannot serve on %s:%d: %s", srv.host, srv.port, exc)
            return 1
        run_dir = tempfile.mkdtemp(prefix="kvrouter-")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        code = 0
        try:
            WorkerContext(0, self.workers, run_dir).board().close()  # created, zeroed
            for i in range(self.workers):
                self._spawn(i, run_dir)
            log.info("kvrouter supervising %d workers on http://%s:%d", self.workers, srv.host, srv.port)
            code = self._watch(run_dir)
        finally:
            asked = time.monotonic()
            if self.signal:
                log.info("kvrouter shutting down (%s): stopping %d workers", self.signal, len(self._procs))
            self._stop_all()
            if self.signal:
                log.info("kvrouter stopped (shutdown took %.1f s)", time.monotonic() - asked)
            for s, handler in previous.items():
                signal.signal(s, handler)
            reserve.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        return code

    def _watch(self, run_dir: str) -> int:
        backoff = 1.0
        while not self.stopping:
            if self._quick_deaths and all(
                time.monotonic() - self._started[i] > _QUICK_DEATH_S for i in self._procs
            ):
                self._quick_deaths = 0  # every worker has run a while since: start counting afresh
                backoff = 1.0
            sentinels = {p.sentinel: i for i, p in self._procs.items()}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            for sentinel in ready:
                if self.stopping:
                    break
                i = sentinels[cast(int, sentinel)]
                proc = self._procs[i]
                proc.join()
                lived = time.monotonic() - self._started[i]
                log.error(
                    "worker %d (pid %s) exited with code %s after %.1f s", i, proc.pid, proc.exitcode, lived
                )
                self._retire(i, run_dir)
                if lived < _QUICK_DEATH_S:
                    self._quick_deaths += 1
                    if self._quick_deaths >= _MAX_QUICK_DEATHS:
                        log.error("workers keep dying at start; giving up (see the errors above)")
                        return 1
                    self._pause(backoff)
                    backoff = min(backoff * 2, 30.0)
                else:
                    self._quick_deaths = 0
                    backoff = 1.0
                if not self.stopping:
                    self._spawn(i, run_dir)
        return 0

    def _retire(self, index: int, run_dir: str) -> None:
        """A worker died: its in-flight requests died with it (zero its board rows now, not when its
        replacement starts), and its last published figures join the retired ones."""
        board = WorkerContext(index, self.workers, run_dir).board()
        try:
            board.clear(index)
        finally:
            board.close()
        retire(run_dir, index)

    def _pause(self, seconds: float) -> None:
        """Sleep, but return at once when asked to stop (a signal does not cut ``time.sleep`` short)."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.1)

    def _stop_all(self) -> None:
        """SIGTERM every worker (each drains), wait ``drain_timeout_s`` + 10 s, then SIGKILL."""
        for proc in self._procs.values():
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.server.drain_timeout_s + 10.0
        for proc in self._procs.values():
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                log.warning("worker pid %s did not stop in time: killed", proc.pid)
                proc.kill()
                proc.join(5)


__all__ = ["Supervisor", "WorkerContext", "worker_main"]
