"""The subscriber's ZeroMQ sockets, on libzmq directly (index/_kvzmq.h), under pyzmq's names.

Why: importing pyzmq's Python layer costs 12-24 ms of every start (its enums and helper classes,
pickle, json; binding libzmq here 2-3 ms), a tenth or more of `kvrouter serve`'s time from exec to
serving, for the dozen calls the subscriber makes. pyzmq stays the
dependency that ships libzmq: :func:`backend` binds the copy pyzmq already loaded when there is one
(so pyzmq's sockets and contexts, which tests pass in, mix with ours), else pyzmq's bundled file
found without importing pyzmq, else the system's ``libzmq.so.5``; when none binds (a pyzmq built
otherwise), it returns the ``zmq`` module itself, whose names these mirror, and the subscriber runs
on pyzmq as before (the log says so).

Only what the subscriber uses: contexts (their socket cap raised), SUB/DEALER/PAIR sockets, options,
bind/connect, socket monitors, whole-message receive and send, a poller over sockets and file
descriptors, and :class:`ReadyPoller`, which wakes on the sockets that have something and costs
nothing per idle socket (it works on pyzmq's sockets too). The C receive
loop (``recv_live``, index/_kvrecv.h) is bound in the same step and checked on a socket pair
(:func:`native_receive`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import sys
import threading
from types import ModuleType
from typing import Any

from index import _kvcore

log = logging.getLogger(__name__)

# libzmq's numbers (zmq.h; stable since 4.0)
PAIR, SUB, DEALER = 0, 2, 5
SUBSCRIBE, FD, EVENTS, LINGER, RCVHWM, LAST_ENDPOINT, IMMEDIATE = 6, 14, 15, 17, 24, 32, 39
IO_THREADS, MAX_SOCKETS, SOCKET_LIMIT = 1, 2, 3
NOBLOCK = DONTWAIT = 1
POLLIN, POLLOUT = 1, 2
DEFAULT_MAX_SOCKETS = 1023
"""libzmq's cap of sockets per context unless raised (ZMQ_MAX_SOCKETS)."""
EVENT_CONNECTED, EVENT_ACCEPTED, EVENT_CLOSED, EVENT_DISCONNECTED = 0x1, 0x20, 0x80, 0x200


class ZMQError(Exception):
    """A libzmq call failed: ``errno`` and libzmq's message (str() is the message, as pyzmq's)."""

    def __init__(self, errno: int, strerror: str) -> None:
        super().__init__(errno, strerror)
        self.errno = errno
        self.strerror = strerror

    def __str__(self) -> str:
        return self.strerror


class Again(ZMQError):
    """EAGAIN: nothing to receive without waiting."""


_MONITORS = itertools.count()


class Context:
    """A libzmq context. ``shadow``: one another library made (a pyzmq context), whose sockets and
    ours then share it; it is kept alive by this object (pyzmq terminates a context it collects) and
    never terminated here. Stop what uses this context before terminating the shadowed one: its
    ``destroy()`` closes pyzmq's sockets, not ours, and its ``term()`` waits for ours."""

    def __init__(self, shadow: Any = None, io_threads: int = 1, max_sockets: int | None = None) -> None:
        """``max_sockets``: the context's socket cap (ZMQ_MAX_SOCKETS, libzmq's default 1,023), set
        before its first socket (later it would not hold); not for a shadowed context."""
        if backend() is not sys.modules[__name__]:
            raise RuntimeError("libzmq could not be bound: use pyzmq's zmq.Context")
        self._shadowed = shadow
        self.underlying: int = _kvcore.z_ctx_new(io_threads) if shadow is None else shadow.underlying
        self._own = shadow is None
        self.closed = False
        if max_sockets is not None and self._own:
            self.set(MAX_SOCKETS, max_sockets)

    def get(self, option: int) -> int:
        """A context option (MAX_SOCKETS, SOCKET_LIMIT, IO_THREADS)."""
        return _kvcore.z_ctx_option(self.underlying, option, -1)

    def set(self, option: int, value: int) -> None:
        _kvcore.z_ctx_option(self.underlying, option, value)

    def socket(self, kind: int) -> Socket:
        return Socket(self, kind)

    def term(self) -> None:
        """Terminate (waits until every socket of the context is closed, GIL released)."""
        if self._own and not self.closed:
            self.closed = True
            _kvcore.z_ctx_term(self.underlying)


class Socket:
    """One libzmq socket, used from one thread at a time (as libzmq requires)."""

    def __init__(self, ctx: Context, kind: int) -> None:
        self.context = ctx
        self.underlying: int = _kvcore.z_socket(ctx.underlying, kind)
        self.closed = False

    def setsockopt(self, option: int, value: int | bytes) -> None:
        _kvcore.z_setsockopt(self.underlying, option, value)

    def getsockopt(self, option: int) -> int:
        """An int option (FD, EVENTS)."""
        return _kvcore.z_getsockopt_int(self.underlying, option)

    def getsockopt_string(self, option: int) -> str:
        return _kvcore.z_getsockopt_bytes(self.underlying, option).decode()

    def bind(self, endpoint: str) -> None:
        _kvcore.z_endpoint(self.underlying, endpoint, False)

    def connect(self, endpoint: str) -> None:
        _kvcore.z_endpoint(self.underlying, endpoint, True)

    def get_monitor_socket(self, events: int) -> Socket:
        """A PAIR socket receiving this socket's ``events`` (2 frames each: uint16 event, uint32
        value; the endpoint)."""
        addr = f"inproc://kvrouter-monitor-{next(_MONITORS)}"  # (never reused: closing is async)
        _kvcore.z_monitor(self.underlying, addr, events)
        mon = Socket(self.context, PAIR)
        try:
            mon.connect(addr)
        except ZMQError:
            mon.close(0)
            raise
        return mon

    def disable_monitor(self) -> None:
        _kvcore.z_monitor(self.underlying, None, 0)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        """One whole message (Again when none is queued and ``flags`` is NOBLOCK)."""
        return _kvcore.z_recv_multipart(self.underlying, flags)

    def send_multipart(self, frames: list[bytes]) -> None:
        _kvcore.z_send_multipart(self.underlying, list(frames))

    def poll(self, timeout_ms: int) -> int:
        """POLLIN when a message is queued within ``timeout_ms``, else 0."""
        return POLLIN if _kvcore.z_poll([(self.underlying, 0)], timeout_ms) else 0

    def close(self, linger: int | None = None) -> None:
        """Close (once); a LINGER that cannot be set (a terminating context: ETERM) does not keep the
        socket open, or the context's term() would wait for it forever."""
        if self.closed:
            return
        self.closed = True
        if linger is not None:
            with contextlib.suppress(ZMQError):
                self.setsockopt(LINGER, linger)
        _kvcore.z_close(self.underlying)

    def __del__(self) -> None:  # (as pyzmq's: a forgotten socket must not keep its context alive)
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown, a terminated context
                self.close(0)


class Poller:
    """Waits until sockets or file descriptors (ints) can be read from."""

    def __init__(self) -> None:
        self._objs: list[Any] = []
        self._items: list[tuple[int, int]] = []

    def register(self, obj: Any, flags: int = POLLIN) -> None:
        """``obj``: a socket (ours, or pyzmq's: anything with ``underlying``) or a file descriptor;
        POLLIN only."""
        if obj in self._objs:
            return
        self._objs.append(obj)
        self._items.append((0, obj) if isinstance(obj, int) else (obj.underlying, 0))

    def unregister(self, obj: Any) -> None:
        i = self._objs.index(obj)
        del self._objs[i]
        del self._items[i]

    def poll(self, timeout_ms: int | None = None) -> list[tuple[Any, int]]:
        ready = _kvcore.z_poll(self._items, -1 if timeout_ms is None else int(timeout_ms))
        return [(self._objs[i], POLLIN) for i in ready]


class ReadyPoller:
    """Waits on the sockets that have something to read, at a cost that does not grow with the
    sockets that have nothing (``zmq_poll`` builds and scans every item at every wake-up: with
    thousands of idle event streams, most of a wake-up's work).

    How: every socket's ZMQ_FD (a descriptor libzmq signals when commands reach the socket: a
    message arriving on an empty queue, a peer attached or gone) sits in one epoll set
    (``select.poll`` where there is no epoll); a woken socket is reported with its token and the
    caller then asks libzmq (ZMQ_EVENTS) what it can do. ZMQ_FD signals a change, not a state: after
    a socket has been handled, anything left in it (a drain that stopped at its budget) signals
    nothing more, so the caller hands such a socket back with :meth:`again` and the next
    :meth:`poll` reports it without waiting. A socket is reported once after :meth:`register`, for
    whatever arrived before it was registered. Plain file descriptors (a wake-up pipe) are
    reported while readable."""

    def __init__(self) -> None:
        self._epoll: Any = select.epoll() if hasattr(select, "epoll") else None
        self._poll: Any = None if self._epoll is not None else select.poll()
        self._tokens: dict[int, Any] = {}
        """descriptor -> token"""
        self._fds: dict[int, tuple[Any, int]] = {}
        """id(registered object) -> (it, its descriptor)"""
        self._again: dict[int, Any] = {}
        """descriptor -> token: reported by the next poll without waiting"""

    def __len__(self) -> int:
        return len(self._tokens)

    def register(self, obj: Any, token: Any) -> None:
        """``obj``: a socket (ours or pyzmq's: anything with ``getsockopt(FD)``) or a descriptor."""
        fd = obj if isinstance(obj, int) else int(obj.getsockopt(FD))
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)
        self._tokens[fd] = token
        self._fds[id(obj)] = (obj, fd)
        if not isinstance(obj, int):
            self._again[fd] = token

    def unregister(self, obj: Any) -> None:
        """Before the socket is closed (its descriptor goes with it)."""
        entry = self._fds.pop(id(obj), None)
        if entry is None:
            return
        fd = entry[1]
        self._tokens.pop(fd, None)
        self._again.pop(fd, None)
        with contextlib.suppress(OSError, KeyError, ValueError):
            (self._epoll or self._poll).unregister(fd)

    def again(self, obj: Any) -> None:
        """Report ``obj`` at the next poll without waiting (it still has something)."""
        entry = self._fds.get(id(obj))
        if entry is not None:
            self._again[entry[1]] = self._tokens[entry[1]]

    def poll(self, timeout_ms: int) -> list[Any]:
        """Tokens of the sockets woken (or handed back) and of the readable descriptors, each once;
        waits up to ``timeout_ms`` when none is handed back."""
        wait = 0 if self._again else timeout_ms
        try:
            if self._epoll is not None:
                events = self._epoll.poll(wait / 1000, max(1, min(len(self._tokens), 4096)))
            else:
                events = self._poll.poll(wait)
        except InterruptedError:  # pragma: no cover - (PEP 475 retries; kept for safety)
            events = []
        out, self._again = self._again, {}
        tokens = self._tokens
        for fd, _ in events:
            token = tokens.get(fd)
            if token is not None:
                out[fd] = token
        return list(out.values())

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


def socket_limit(ctx: Any) -> int:
    """A context's socket cap (ours or pyzmq's)."""
    return int(ctx.get(MAX_SOCKETS))


def set_socket_limit(ctx: Any, value: int) -> int:
    """Raise a context's socket cap to ``value`` (at most libzmq's SOCKET_LIMIT) before its first
    socket; returns the cap in force."""
    top = int(ctx.get(SOCKET_LIMIT))
    ctx.set(MAX_SOCKETS, max(1, min(value, top)))
    return socket_limit(ctx)


# ---- binding the library ---------------------------------------------------------------------------
_lock = threading.Lock()
_state: dict[str, Any] = {}
"""Process-wide, as the C core's bound entry points are: the backend once chosen, the receive
loop's check."""


def _mapped() -> list[str]:
    """libzmq files this process has mapped already (pyzmq imported first): the likeliest first."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = (line.rsplit(None, 1)[-1] for line in maps)
            mapped = list(dict.fromkeys(p for p in paths if p.startswith("/")))
    except OSError:
        return []
    libs = [p for p in mapped if os.path.basename(p).startswith("libzmq")]
    return libs + [p for p in mapped if "/zmq/backend/" in p]


def _shipped() -> list[str]:
    """pyzmq's own libzmq, found on sys.path without importing pyzmq: the wheel's bundled copy
    (``pyzmq.libs/``, macOS ``zmq/.dylibs/``), then its extension (a build linking libzmq in)."""
    out: list[str] = []
    for entry in sys.path:
        for sub in ("pyzmq.libs", os.path.join("zmq", ".dylibs"), os.path.join("zmq", "backend", "cython")):
            d = os.path.join(entry or ".", sub)
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            lib = sub.endswith("cython")
            out += [os.path.join(d, n) for n in names if n.startswith("_zmq." if lib else "libzmq")]
    return out


def _bind(paths: list[str]) -> bool:
    errors = (ZMQError, Again)
    return any(_kvcore.zmq_load(p, errors) for p in paths)


def backend() -> ModuleType:
    """This module, once libzmq is bound; else ``zmq`` (pyzmq), whose names it mirrors."""
    with _lock:
        if "backend" not in _state:
            # pyzmq loaded already: its copy, or our sockets and its would not mix
            loaded = "zmq" in sys.modules
            ok = _bind(_mapped()) if loaded else _bind(_shipped()) or _bind(["libzmq.so.5"])
            if not ok:
                # optional: pyzmq's Python layer only when it is loaded already (~10 ms of a start)
                import zmq  # (its loading maps its libzmq: bind that one)

                ok = _bind(_mapped())
            if ok:
                _state["backend"] = sys.modules[__name__]
            else:
                # optional: pyzmq's Python layer only when libzmq cannot be bound directly
                import zmq

                log.warning("libzmq could not be bound; the subscriber runs on pyzmq (slower to start)")
                _state["backend"] = zmq
        return _state["backend"]  # type: ignore[no-any-return]


def context_of(ctx: Any, io_threads: int = 1, max_sockets: int | None = None) -> Any:
    """The context to make sockets in: ``ctx`` itself (ours, or pyzmq's when pyzmq is the backend),
    a pyzmq context shadowed, or a new one (None) with ``io_threads`` I/O threads and a socket cap
    of ``max_sockets`` (libzmq's SOCKET_LIMIT at most; a context passed in keeps its own). A pyzmq context
    made by another copy of libzmq than the one bound here cannot host our sockets: ValueError
    (libzmq itself tells: EFAULT)."""
    z = backend()
    if ctx is None:
        new = z.Context(io_threads=io_threads)
        if max_sockets is not None:
            set_socket_limit(new, max_sockets)  # (before its first socket: later it would not hold)
        return new
    if z is sys.modules[__name__] and not isinstance(ctx, Context):
        try:
            _kvcore.z_close(_kvcore.z_socket(ctx.underlying, PAIR))
        except ZMQError as exc:
            msg = f"this ZeroMQ context comes from another libzmq than the subscriber's: {exc}"
            raise ValueError(msg) from exc
        return Context(shadow=ctx)
    return ctx


def native_receive() -> bool:
    """Whether the C receive loop can be used: libzmq bound here, and a message sent on a socket
    pair received by it, an odd one returned whole (checked once)."""
    with _lock:
        if "native" in _state:
            return bool(_state["native"])
    ok = backend() is sys.modules[__name__] and _self_test()
    if not ok:
        log.info("C receive loop unavailable; receiving in Python")
    with _lock:
        _state["native"] = ok
    return ok


def _self_test() -> bool:
    ctx = Context()
    a, b = ctx.socket(PAIR), ctx.socket(PAIR)
    try:
        for s in (a, b):
            s.setsockopt(LINGER, 0)
        endpoint = f"inproc://kvrouter-zrecv-{next(_MONITORS)}"
        b.bind(endpoint)
        a.connect(endpoint)
        payload = b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x90\xc0"  # [1.5, [], None]
        a.send_multipart([b"t", (7).to_bytes(8, "big"), payload])
        a.send_multipart([b"t", b"short"])
        if not b.poll(1000):
            return False
        chunk: list[tuple[int, bytes]] = []
        taken, last_seq, last_ts, stop = _kvcore.recv_live(b.underlying, chunk, 3, 6, b"t", 10)
        return (
            taken == 1
            and last_seq == 7
            and last_ts == 1.5
            and chunk == [(3, payload)]
            and stop == [b"t", b"short"]
        )
    except Exception:  # anything unexpected means "not this library"
        log.debug("native receive self-test failed", exc_info=True)
        return False
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
