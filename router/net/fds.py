"""The process's file descriptors: the limit raised at start, the client connection cap it allows,
and the headroom ``/metrics`` shows (``kvrouter_open_fds``, ``kvrouter_fd_limit``).

Every client connection is a descriptor, and so is each connection to a backend that a proxied
request holds (one per request in flight, kept afterwards in the keep-alive pool). At the limit,
``accept()`` fails with EMFILE and the loop drops the new connection unanswered (the client sees a
reset), and the router's own connects fail too. Linux starts most processes at a soft limit of
1,024 whatever their hard limit, so the router raises it to the hard limit, and refuses client
connections (a 503, :mod:`router.http.server`) before they can use up what is left.
"""

from __future__ import annotations

import logging
import os
import resource

__all__ = ["client_connection_cap", "fd_limit", "open_fds", "raise_fd_limit"]

log = logging.getLogger("kvrouter.server")

_RESERVE = 256
"""Descriptors kept for everything but client connections and their backend connections: the
listening sockets, the event streams' sockets, the loop's own, files (config, tokenizers)."""
_UNLIMITED = 1 << 20
"""What an unlimited hard limit is raised to (Linux refuses more than fs.nr_open, 1,048,576 by
default)."""


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (an unlimited one as :data:`_UNLIMITED`)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where the OS allows it (logged); returns the
    soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        log.info("file descriptor limit: %d (the hard limit)", fd_limit())
        return fd_limit()
    target = _UNLIMITED if hard == resource.RLIM_INFINITY else int(hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("file descriptor limit kept at %d: raising it to %d failed (%s)", soft, target, exc)
        return int(soft)
    log.info("file descriptor limit raised from %d to %d", soft, target)
    return target


def client_connection_cap(configured: int, limit: int) -> int:
    """``configured``, or less when the descriptor limit cannot hold that many: half of what the
    limit leaves after a reserve (a quarter of the limit, at most :data:`_RESERVE`), since each
    client connection may hold a backend connection too; at least 1."""
    reserve = min(_RESERVE, limit // 4)
    return max(1, min(configured, (limit - reserve) // 2))


def open_fds() -> int | None:
    """Descriptors open now (Linux and macOS list them), None where that cannot be read."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(where)) - 1  # (less the one the listing opened)
        except OSError:
            continue
    return None
