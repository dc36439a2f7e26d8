"""The C receive loop's binding to libzmq (index/_kvrecv.h): found, bound and checked once.

The C core does not link libzmq: a second copy would not know pyzmq's sockets. It calls the copy
pyzmq loaded, whose entry points :func:`native_receive` finds among the process's mapped files
(pyzmq's bundled ``libzmq-*.so``, a system ``libzmq.so.5``, or pyzmq's own extension when that links
libzmq statically) and checks on an in-process socket pair before the subscriber uses them. When
none passes (another platform, a pyzmq built otherwise), the subscriber keeps its Python receive
loop, which does the same job about 7 us a message slower (bench/recv_bench.py); the log says so.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any

import zmq

from index import _kvcore

log = logging.getLogger(__name__)

_ENTRY_POINTS = (
    "zmq_msg_init",
    "zmq_msg_recv",
    "zmq_msg_data",
    "zmq_msg_size",
    "zmq_msg_more",
    "zmq_msg_close",
    "zmq_errno",
)
_TESTS = itertools.count()
_lock = threading.Lock()
_state: dict[str, bool] = {}
"""Process-wide, as the C core's bound entry points are: whether binding succeeded, once known."""


def _candidates() -> list[str]:
    """Mapped files that may hold pyzmq's libzmq, the likeliest first."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            # the path is a line's last field, when it has one (dict: unique, in mapping order)
            paths = (line.rsplit(None, 1)[-1] for line in maps)
            mapped = list(dict.fromkeys(p for p in paths if p.startswith("/")))
    except OSError:
        return []
    libs = [p for p in mapped if os.path.basename(p).startswith("libzmq")]
    backend = [p for p in mapped if "/zmq/backend/" in p]
    return libs + backend


def _bind(path: str) -> bool:
    addrs = _kvcore.loaded_symbols(path, _ENTRY_POINTS)
    if not addrs or not all(addrs):
        return False
    _kvcore.recv_bind(addrs)
    return _self_test()


def _self_test() -> bool:
    """A message sent by pyzmq is received by the C loop, and an odd one comes back whole."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
        endpoint = f"inproc://kvrouter-zrecv-{next(_TESTS)}"  # (never reused: closing is async)
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
    except Exception:  # a foreign libzmq answers ENOTSOCK; anything else also means "not this one"
        log.debug("native receive self-test failed", exc_info=True)
        return False
    finally:
        a.close(0)
        b.close(0)


def native_receive() -> bool:
    """Whether the C receive loop is bound to pyzmq's libzmq (found and checked on first call)."""
    with _lock:
        if "ok" not in _state:
            ok = False
            for path in _candidates():
                if _bind(path):
                    ok = True
                    log.debug("native receive bound to %s", path)
                    break
            if not ok:
                log.info("C receive loop unavailable (pyzmq's libzmq not found); receiving in Python")
            _state["ok"] = ok
        return _state["ok"]
