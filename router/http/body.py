"""Request bodies, held in memory at what they weigh.

:class:`BodyBuffer` holds a body as it arrives (the server's and the ASGI path's): one bytearray,
whatever the chunks, so a body sent in 2-byte chunks costs its size, not the 28 times a list of
chunk objects cost, and the limit is checked before a chunk is stored.
"""

from __future__ import annotations

__all__ = ["BodyBuffer"]


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
