"""The process's file descriptors for the client side: the connection cap the limit allows, and
the headroom ``/metrics`` shows (``kvrouter_open_fds``, ``kvrouter_fd_limit``).

Every client connection is a descriptor, and so is each connection to a backend that a proxied
request holds (one per request in flight, kept afterwards in the keep-alive pool). At the limit,
``accept()`` fails with EMFILE and the loop drops the new connection unanswered (the client sees a
reset), and the router's own connects fail too. Linux starts most processes at a soft limit of
1,024 whatever their hard limit, so ``kvrouter serve`` raises it to the hard limit (the index's
:func:`index.fds.raise_fd_limit`, which its event streams need too), and refuses client
connections (a 503) before they can use up what is left.
"""

from __future__ import annotations

from index.fds import fd_limit, open_fds, raise_fd_limit

__all__ = ["client_connection_cap", "fd_limit", "open_fds", "raise_fd_limit"]

_RESERVE = 256
"""Descriptors kept for everything but client connections and their backend connections: the
listening sockets, the event streams' sockets, the loop's own, files (config, tokenizers)."""


def client_connection_cap(configured: int, limit: int) -> int:
    """``configured``, or less when the descriptor limit cannot hold that many: half of what the
    limit leaves after a reserve (a quarter of the limit, at most :data:`_RESERVE`), since each
    client connection may hold a backend connection too; at least 1."""
    reserve = min(_RESERVE, limit // 4)
    return max(1, min(configured, (limit - reserve) // 2))
