"""Request bodies: held in memory at what they weigh, and large JSON ones decoded and freed in
pieces so that no single call holds the GIL long.

:class:`BodyBuffer` holds a body as it arrives (the server's and the ASGI path's): one bytearray,
whatever the chunks, so a body sent in 2-byte chunks costs its size, not the 28 times a list of
chunk objects cost, and the limit is checked before a chunk is stored.

Decoding JSON costs from ~1 ns per byte (one long string) to ~170 ns (millions of tiny arrays or
objects, with the garbage collector running): a 16 MiB body held the event loop for 0.1-3 s, and
freeing what it decoded into for up to 0.1 s more. A worker thread alone does not help: msgspec
decodes a whole document in one C call, and a thread in a C call keeps the GIL (the interpreter
takes it back only between bytecodes), so the loop would wait just as long. Hence:

- :func:`decode_json` splits a body larger than :data:`LARGE_BODY_BYTES` at member boundaries
  (``index._kvcore.json_split``, which scans without the GIL) and decodes groups of members of at
  most that size each: one call holds the GIL for ~10 ms at worst, and between calls the event
  loop gets it. The result is the one ``msgspec.json.decode`` gives (member order, duplicate keys:
  the last wins, numbers, strings); an invalid body is refused, its message naming the byte range
  of the piece.
- :func:`release` empties what was decoded container by container (each step frees a leaf or an
  empty container), then gives the heap's free pages back to the OS.
- From a large body's decoding to its release, the garbage collector's full passes wait (its
  young generations are collected as usual): a full pass walks every container in the process in
  one call, and with millions of them just decoded that was 0.5 s with the GIL held. Deferred for
  at most :data:`_MAX_DEFER_S` in a row, so that a stream of large bodies cannot put the cyclic
  garbage of the whole process out of reach.

Both run in the worker threads (:meth:`router.decision.tokenizer.RequestTokenizer.offload`); a
body up to :data:`LARGE_BODY_BYTES`, or a flat one (few containers: a long prompt) up to
:data:`FLAT_BODY_BYTES`, is decoded on the event loop in one call (:func:`decodes_at_once`).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

import msgspec

from index._kvcore import json_split, trim

__all__ = ["LARGE_BODY_BYTES", "BodyBuffer", "decode_json", "decoded_in_pieces", "decodes_at_once", "release"]

LARGE_BODY_BYTES = 64 * 1024
"""A body up to this size is decoded on the event loop in one call (at most ~11 ms of the worst
shape, ~0.1 ms of a usual one); a larger one is decoded and freed off the loop, in pieces of at
most this size."""
FLAT_BODY_BYTES = 256 * 1024
"""A larger body than :data:`LARGE_BODY_BYTES` still decodes in one call, on the event loop, when
it is at most this size and holds at most :data:`_FLAT_CONTAINERS` arrays and objects: what costs
is containers (up to ~170 ns a byte for millions of tiny ones), where scalars cost ~1-12 ns a byte
(a 512 KiB array of short escaped strings: 6 ms on a loaded box; of token ids: 1.2 ms). A long
prompt (32k token ids: ~200 KB; text: 4 bytes a token) is that shape, and the piecewise path cost
it ~3x the decode, plus ~6 ms of worker time to free it step by step."""
_FLAT_CONTAINERS = 1024
"""Arrays and objects a flat body may hold (``[`` and ``{`` bytes counted, inside strings too: a
body that counts more takes the piecewise path, which is only slower)."""
_MAX_SPLIT_DEPTH = 32
"""Levels of containers too large for one piece that are split further; below that, a member is
decoded whole (a body nested deeper than this is pathological, and msgspec refuses ~1,000 levels)."""
_WS = b" \t\r\n"
_YIELD_MASK = 2047
"""A worker thread freeing a large body hands the interpreter over every 2,048 objects
(``time.sleep(0)``): its steps are short, but with two or three such threads busy the event loop
waited for its turn at the GIL for 40-65 ms at a time; handing over lets it run at once."""
_MAX_DEFER_S = 30.0
"""The longest the full collections wait in a row while large bodies come one after another."""


class _FullPasses:
    """Defers the garbage collector's full passes while a large decoded body is alive (counted:
    several may be); thresholds only, so the interpreter's own rules apply again afterwards."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive = 0
        self.bodies: set[int] = set()
        """The ids of the large bodies decoded and not released yet."""
        self.since = 0.0
        self.saved: tuple[int, int, int] | None = None

    def hold(self) -> None:
        with self.lock:
            self.alive += 1
            if self.alive == 1:
                self.since = time.monotonic()
                if sys.version_info < (3, 14):  # (3.14's incremental collector has no long full pass)
                    self.saved = gc.get_threshold()
                    gc.set_threshold(self.saved[0], self.saved[1], 2**31 - 1)
            elif time.monotonic() - self.since > _MAX_DEFER_S:
                self._restore()

    def let_go(self) -> None:
        with self.lock:
            self.alive = max(self.alive - 1, 0)
            if not self.alive or time.monotonic() - self.since > _MAX_DEFER_S:
                self._restore()

    def _restore(self) -> None:
        if self.saved is not None:
            gc.set_threshold(*self.saved)
            self.saved = None


_passes = _FullPasses()


class BodyBuffer:
    """A request body as it arrives, at most ``limit`` bytes: the first chunk kept as it came (the
    whole body, usually: no copy), later ones appended to one bytearray (its spare room at most an
    eighth of it)."""

    __slots__ = ("_buf", "_first", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._first = b""
        self._buf: bytearray | None = None

    def add(self, chunk: bytes) -> bool:
        """Store ``chunk``; False when the body would exceed the limit (then nothing is held)."""
        size = self.size + len(chunk)
        if size > self.limit:
            self.clear()
            return False
        self.size = size
        if self._buf is not None:
            self._buf += chunk
        elif self._first:
            self._buf = bytearray(self._first)
            self._buf += chunk
            self._first = b""
        else:
            self._first = chunk
        return True

    def take(self) -> bytes:
        """The body so far (then empty again)."""
        body = self._first if self._buf is None else bytes(self._buf)
        self.clear()
        return body

    def clear(self) -> None:
        self.size = 0
        self._first = b""
        self._buf = None


def decodes_at_once(raw: bytes) -> bool:
    """Whether ``raw`` decodes in one call on the event loop (bounded: up to
    :data:`LARGE_BODY_BYTES` whatever its shape, or a flat body up to :data:`FLAT_BODY_BYTES`);
    else it is decoded in pieces in the worker threads. Counting costs ~0.3 ns a byte."""
    n = len(raw)
    if n <= LARGE_BODY_BYTES:
        return True
    return n <= FLAT_BODY_BYTES and raw.count(b"[") + raw.count(b"{") <= _FLAT_CONTAINERS


def decoded_in_pieces(body: Any) -> bool:
    """Whether ``body`` came from :func:`decode_json` in pieces and is not released yet: then it is
    encoded off the loop and freed by :func:`release` (one decoded at once is dropped as usual)."""
    return id(body) in _passes.bodies


def decode_json(raw: bytes, defer_gc: bool = True) -> Any:
    """``msgspec.json.decode(raw)``: in one call when :func:`decodes_at_once`, else in pieces of at
    most :data:`LARGE_BODY_BYTES`, and then (``defer_gc``: the full collections wait for it) the
    caller must :func:`release` it. Raises what msgspec raises (``msgspec.DecodeError`` for invalid
    JSON)."""
    if decodes_at_once(raw):
        return msgspec.json.decode(raw)
    if not defer_gc:
        return _decode(raw, memoryview(raw), 0, len(raw), 0)
    _passes.hold()
    try:
        body = _decode(raw, memoryview(raw), 0, len(raw), 0)
    except BaseException:
        _passes.let_go()
        raise
    _passes.bodies.add(id(body))
    return body


def _decode(raw: bytes, view: memoryview, start: int, stop: int, depth: int) -> Any:
    split = json_split(raw, start, stop, LARGE_BODY_BYTES) if depth < _MAX_SPLIT_DEPTH else None
    if split is None:  # a scalar, a member too deep to split, or invalid JSON (msgspec words it)
        return msgspec.json.decode(view[start:stop])
    is_object = split[0] == 1
    items: list[Any] = []
    members: dict[str, Any] = {}
    for i in range(1, len(split), 3):
        s, e, v = split[i], split[i + 1], split[i + 2]
        if v >= 0 and e - s > LARGE_BODY_BYTES and view[v] in b"[{":
            value = _decode(raw, view, v, e, depth + 1)  # one member, itself too large: split it
            if is_object:
                key = _piece(bytes(view[s:v]).rstrip(_WS + b":"), s, v)
                if not isinstance(key, str):
                    raise msgspec.DecodeError(f"JSON is malformed: a key is not a string (bytes {s}-{v})")
                members[key] = value
            else:
                items.append(value)
        elif is_object:
            members.update(_piece(b"{" + view[s:e] + b"}", s, e))
        else:
            items.extend(_piece(b"[" + view[s:e] + b"]", s, e))
        time.sleep(0)  # (the event loop's turn between pieces: see _YIELD_MASK)
    return members if is_object else items


def _piece(data: bytes, start: int, stop: int) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise msgspec.DecodeError(f"{exc} (in the part at bytes {start}-{stop})") from None


def release(obj: Any) -> None:
    """Free a decoded body in small steps (a worker thread keeps the GIL for one step at most, where
    dropping the whole at once is one C call over every object), then give the heap's free pages
    back to the OS (for the large bodies :func:`decode_json` returns, and what is built from them).
    The caller must hold no other reference it still uses: the containers are emptied."""
    held = id(obj) in _passes.bodies
    _passes.bodies.discard(id(obj))
    stack = [obj]
    del obj
    n = 0
    while stack:
        o = stack.pop()
        if type(o) is dict:
            while o:
                v = o.popitem()[1]
                if type(v) in (dict, list) and v:
                    stack.append(v)
                del v
                n += 1
                if not n & _YIELD_MASK:
                    time.sleep(0)
        elif type(o) is list:
            while o:
                v = o.pop()
                if type(v) in (dict, list) and v:
                    stack.append(v)
                del v
                n += 1
                if not n & _YIELD_MASK:
                    time.sleep(0)
        del o
    if held:
        _passes.let_go()
    trim()
