"""The config file as a source of membership: re-read on SIGHUP and when it changes on disk.

A reload parses and validates the whole file first (the same checks as at start-up, environment
overrides included); only a file that passes is applied, in one step on the event loop: its
``[[backends]]`` reconcile the members of origin "config" (new ones join, changed ones are updated or
re-join, missing ones drain and leave), and ``api_keys`` / ``admin_keys`` take effect for the next
request. A file that does not pass is rejected with one log line naming the key, and the running
fleet is kept: never half-applied. Other settings (server, policy, index, ...) need a restart; a
reload that changes them says so in the log.

Changes on disk are noticed by polling the file's (mtime, size, inode) every ``watch_interval_s``: it
works on every filesystem, including a Kubernetes ConfigMap volume (whose update swaps a symlink, a
new inode), and costs one ``stat`` per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from router.config import ConfigError, RouterConfig, env_overrides, load_config, with_overrides

log = logging.getLogger("kvrouter.config")

LIVE_FIELDS = ("backends", "api_keys", "admin_keys")
"""What a reload applies (the other settings need a restart)."""

Stamp = tuple[int, int, int] | None
"""A file's (mtime, size, inode); None when it cannot be read."""


def file_stamp(path: str | Path) -> Stamp:
    """The file's :data:`Stamp`."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _file_config(path: str | Path) -> RouterConfig:
    """The file with the environment's overrides, without command-line flags: what a reload
    compares with and applies (raises :class:`ConfigError`)."""
    return with_overrides(load_config(path), **env_overrides())


def _digest(cfg: RouterConfig) -> str:
    """A stable digest (the same in every process, unlike ``hash``) of what a reload applies."""
    # optional: only when a config file is read
    import zlib

    # optional: only when a config file is read
    import msgspec

    live = msgspec.json.encode([getattr(cfg, f) for f in LIVE_FIELDS])
    return f"{zlib.crc32(live):08x}"


def read_config_file(path: str | Path) -> tuple[RouterConfig, Stamp]:
    """The file with the environment's overrides (what a reload compares with; raises
    :class:`ConfigError`), and its stamp taken *before* reading it: a change that lands after the
    stamp is noticed by the watch even when the read already saw it (then reloaded once more and
    found unchanged); stamped after the read, a change landing in between was never applied.
    ``kvrouter serve`` (each worker, with several) reads the file once with it and hands the result
    to its watcher."""
    stamp = file_stamp(path)
    return _file_config(path), stamp


class ConfigWatcher:
    """Reloads ``path`` on request (SIGHUP) and when it changes; ``apply`` receives a valid config."""

    def __init__(
        self,
        path: str | Path,
        current: RouterConfig,
        apply: Callable[[RouterConfig], None],
        watch: bool = True,
        interval_s: float = 2.0,
        restore: Callable[[RouterConfig], int] | None = None,
        loaded: tuple[RouterConfig, Stamp] | None = None,
    ) -> None:
        """``restore``: what an operator's reload of an unchanged file does (re-add the backends it
        lists that the fleet lacks: an admin DELETE undone; how many); None: such a reload changes
        nothing. ``loaded``: the file as the router was built from it (:func:`read_config_file`),
        else it is read here; either way, what a reload compares with is the file and environment
        without command-line flags."""
        self.path = Path(path)
        if loaded is None:
            stamp = file_stamp(self.path)  # (before the read, as read_config_file takes it)
            try:
                loaded = (_file_config(self.path), stamp)
            except ConfigError:  # (an invalid file: a fix to it is a change from this stamp)
                loaded = (current, stamp)
        self.current, self._stamp = loaded
        self._version = ""  # (no reload applied yet)
        self.apply = apply
        self.restore = restore
        self.watch = watch
        self.interval_s = interval_s
        self.results: dict[str, int] = {"applied": 0, "rejected": 0, "unchanged": 0}
        """Reloads by result, for kvrouter_config_reloads_total."""
        self.last_error = ""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def version(self) -> str:
        """What the last applied reload read, the same in every worker that read those bytes: the
        file's stamp around a read it did not change, and a digest of the backends and keys read
        (two versions with one stamp, e.g. none: a file replaced between a stat and a read, still
        differ). The admin journal names a reload by it (router/fleet/sources/admin.py)."""
        return self._version

    def request(self) -> None:
        """Reload soon (from a signal handler: only sets a flag the task waits on)."""
        self._wake.set()

    def reload(self, asked: bool = False) -> bool:
        """Read, validate and (if valid) apply the file now; True if applied. ``asked``: an
        operator's reload (SIGHUP, ``POST /admin/reload``) applies the file even when it has not
        changed, so that it restores what the admin API changed meanwhile (a backend it deleted);
        a reload the file watch starts applies only a change."""
        try:
            # the stamp before the read (the watch notices a change after it), taken again if the
            # file changed during the read, so that it names the bytes read (a few tries)
            for _ in range(3):
                self._stamp = file_stamp(self.path)
                new = _file_config(self.path)
                # command-line overrides only touch server settings, which a reload does not apply
                if file_stamp(self.path) == self._stamp:
                    break
        except ConfigError as exc:
            self.results["rejected"] += 1
            self.last_error = str(exc)
            log.error("config reload rejected, the running fleet is kept: %s", exc)
            return False
        ignored = [
            f
            for f in RouterConfig.__struct_fields__
            if f not in LIVE_FIELDS and getattr(new, f) != getattr(self.current, f)
        ]
        if ignored:
            log.warning("config reload: changes to %s take effect at the next restart", ", ".join(ignored))
        if all(getattr(new, f) == getattr(self.current, f) for f in LIVE_FIELDS):
            # unchanged: an operator's reload restores what the admin API deleted, and nothing else
            # (re-applied whole, it also readmitted a backend drained for maintenance)
            restored = self.restore(new) if asked and self.restore is not None else 0
            if not restored:
                self.results["unchanged"] += 1
                return False
            self.results["applied"] += 1
            log.info("config reload: %d backend(s) the file lists restored", restored)
            return True
        self._version = f"{self._stamp}:{_digest(new)}"
        self.apply(new)
        self.current = new
        self.results["applied"] += 1
        self.last_error = ""
        log.info("config reloaded from %s (%d backends)", self.path, len(new.backends))
        return True

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s if self.watch else None)
            asked = self._wake.is_set()
            self._wake.clear()
            if asked or (self.watch and file_stamp(self.path) != self._stamp):
                try:
                    self.reload(asked=asked)
                except Exception:  # a bug applying one reload must not end reloading
                    log.exception("config reload failed")

    def start(self) -> None:
        """Start watching (and listening for reload requests)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvrouter-config-watch")

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["ConfigWatcher", "Stamp", "file_stamp", "read_config_file"]
