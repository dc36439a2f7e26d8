"""The unfinished SSE event a relayed stream holds: bounded, and never copied again per read.

The proxy forwards whole events only (a broken stream then ends on an event boundary, followed by
an error event the client can read) and reads the engine's usage from them, so the bytes after
the last event end wait for the rest of their event. Re-joining and re-scanning those bytes on
every read costs O(n²) for an event that arrives in n reads; an engine that never ends one would
also grow it without bound. :class:`EventBuffer` keeps the pieces as they came, scans each new
read once (with the three bytes before it, for an end split between two reads) and joins once
when the event ends.
"""

from __future__ import annotations

from router.net.upstream import UpstreamViolation


class EventTooLarge(UpstreamViolation):
    """An SSE event longer than the configured limit (``server.max_sse_event_bytes``)."""

    def __init__(self, limit: int) -> None:
        super().__init__("sse_event_too_large", f"an SSE event over {limit} bytes")


def last_end(data: bytes) -> int:
    """The offset just after the last event end (``\\n\\n`` or ``\\r\\n\\r\\n``) in ``data``; 0: none."""
    at = data.rfind(b"\n\n")
    end = at + 2 if at != -1 else 0
    crlf = data.rfind(b"\r\n\r\n")
    if crlf != -1 and crlf + 4 > end:
        end = crlf + 4
    return end


class EventBuffer:
    """Cuts a stream's bytes into whole events and holds the unfinished rest, at most ``limit``
    bytes of it (:class:`EventTooLarge` beyond)."""

    __slots__ = ("limit", "parts", "size", "tail")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.tail = b""
        """The held bytes' last three (an end may start in them and finish in the next read)."""

    def cut(self, chunk: bytes) -> bytes:
        """The whole events completed by ``chunk`` (with what was held before them); holds the rest."""
        end = last_end(chunk)
        if end < 4 and self.size:  # an end across the boundary finishes at chunk offset 3 at most
            across = last_end(self.tail + chunk[:3]) - len(self.tail)
            end = max(end, across)
        if end <= 0:
            self._hold(chunk)
            return b""
        if self.parts:
            self.parts.append(chunk[:end])
            out = b"".join(self.parts)
        else:
            out = chunk if end == len(chunk) else chunk[:end]
        self.parts, self.size, self.tail = [], 0, b""
        if end < len(chunk):
            self._hold(chunk[end:])
        return out

    def flush(self, chunk: bytes = b"") -> bytes:
        """Everything held, then ``chunk`` (the stream's end: an unfinished last event goes as it is)."""
        if not self.parts:
            return chunk
        self.parts.append(chunk)
        out = b"".join(self.parts)
        self.parts, self.size, self.tail = [], 0, b""
        return out

    def _hold(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)
        self.tail = data[-3:] if len(data) >= 3 else (self.tail + data)[-3:]
        if self.size > self.limit:
            raise EventTooLarge(self.limit)


__all__ = ["EventBuffer", "EventTooLarge", "last_end"]
