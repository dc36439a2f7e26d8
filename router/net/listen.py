"""Listening sockets that kvrouter binds itself.

A numeric address (``127.0.0.1``, ``0.0.0.0``, ``::``) is bound as it is. uvloop's
``create_server`` (the loop ``kvrouter serve`` runs on) resolves even a literal address, in a pool
of 4 resolver threads it starts for that, and imports the idna codec to do so: ~5 ms of a ~0.15 s
warm start (asyncio's own loop does not). A host name is left to
whoever resolves it: the single-process server hands it to the loop, which binds every address the
name has; the workers' supervisor binds the first one.
"""

from __future__ import annotations

import socket
from typing import Any


def numeric_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an address in its standard form, None otherwise: a host name, "" (every
    interface), an IPv6 address with a zone (``fe80::1%eth0``) or a short IPv4 form (``127.1``), all of
    which the resolver handles."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return None


def bound_socket(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    """A TCP socket bound to (host, port), not listening: SO_REUSEADDR, SO_REUSEPORT when asked
    (the workers share one port), IPv6 only on an IPv6 address as asyncio does. A name is resolved
    here and its first address bound; so is "" (every interface: the first of the IPv4 and IPv6
    wildcards, usually IPv4, where asyncio's loop binds both)."""
    family = numeric_family(host)
    addr: tuple[Any, ...]
    if family is not None:
        kind, proto, addr = socket.SOCK_STREAM, 0, (host, port)
    else:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def server_socket(host: str, port: int) -> socket.socket | None:
    """The single-process server's socket for a numeric address: bound, non-blocking, not listening
    yet (the loop's ``create_server`` listens on it once the router serves, so until then a client
    or a TCP health check is refused, as before); None for a host name (the loop resolves it). A
    taken address is an OSError that names it."""
    family = numeric_family(host)
    if family is None:
        return None
    try:
        sock = bound_socket(host, port, reuse_port=False)
    except OSError as exc:
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


__all__ = ["bound_socket", "numeric_family", "server_socket"]
