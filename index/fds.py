"""The process's file descriptors, for the event streams: the soft limit raised where allowed and
the headroom read.

Every followed source holds descriptors (its sockets' libzmq mailboxes and TCP connections), and
Linux starts most processes at a soft RLIMIT_NOFILE of 1,024 whatever their hard limit: ~250 event
sources would use it up. The index raises the soft limit to the hard one when its subscriber is
made (the router's ``kvrouter serve`` does so at start too; a library user of ``KVIndex`` gets it
here), and sizes its ZeroMQ context's socket cap from what the limit allows. router/ uses the same
functions for its client connections (router/net/fds.py adds their cap).
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("kvrouter.index")

_UNLIMITED = 1 << 20
"""What an unlimited limit counts as (Linux refuses more than fs.nr_open, 1,048,576 by default)."""


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (an unlimited one as :data:`_UNLIMITED`)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where the OS allows it (logged when raised);
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        log.debug("file descriptor limit: %d (the hard limit)", fd_limit())
        return fd_limit()
    target = _UNLIMITED if hard == resource.RLIM_INFINITY else int(hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("file descriptor limit kept at %d: raising it to %d failed (%s)", soft, target, exc)
        return int(soft)
    log.info("file descriptor limit raised from %d to %d", soft, target)
    return target


def open_fds() -> int | None:
    """Descriptors open now (Linux and macOS list them), None where that cannot be read."""
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(where)) - 1  # (less the one the listing opened)
        except OSError:
            continue
    return None
