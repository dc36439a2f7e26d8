"""The connection to the shared store (Redis >= 7 or Valkey), over the lean client in :mod:`resp`.

Two connections: one for commands (publish, snapshot keys), pipelined, and one subscribed to the
cluster channel, whose messages are handed to a callback as they are parsed. Every command has a
timeout, so a store that hangs counts as down; there are no retries here: the cluster reconnects
with its own backoff and decides on local state meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from router.cluster.resp import Connection, ProtocolError, ReplyLimits, RespError, connect


class RedisStore:
    """Commands and one channel subscription on a Redis/Valkey server."""

    errors: tuple[type[BaseException], ...] = (ConnectionError, OSError, TimeoutError, RespError, ValueError)
    """What a failing store raises (every call of this class raises only these, or cancellation)."""

    def __init__(
        self, url: str, timeout_s: float, client_name: str = "kvrouter", limits: ReplyLimits | None = None
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.client_name = client_name
        self.limits = limits or ReplyLimits()
        """What one reply of the store may hold (``cluster.max_reply_*``)."""
        self._cmd: Connection | None = None
        self._sub: Connection | None = None

    async def open(self, channel: str, on_message: Callable[[bytes], None]) -> None:
        """Connect both connections and subscribe to ``channel``; ``on_message`` gets every message."""
        self.close()
        self._cmd = await connect(self.url, self.timeout_s, self.client_name, limits=self.limits)
        self._sub = await connect(
            self.url, self.timeout_s, self.client_name + "-sub", on_message, limits=self.limits
        )
        (confirm,) = self._sub.send([["SUBSCRIBE", channel]])
        reply = await asyncio.wait_for(confirm, self.timeout_s)
        if not isinstance(reply, list) or reply[:1] != [b"subscribe"]:
            raise ConnectionError(f"SUBSCRIBE {channel}: unexpected reply {reply!r}")

    async def lost(self) -> None:
        """Returns when either connection is lost."""
        cmd, sub = self._cmd, self._sub
        if cmd is None or sub is None:
            return
        await asyncio.wait([cmd.lost, sub.lost], return_when=asyncio.FIRST_COMPLETED)

    def violation(self) -> ProtocolError | None:
        """The protocol error (a broken reply, or one over the limits) that closed either
        connection, if one did."""
        for conn in (self._cmd, self._sub):
            if conn is not None and conn.violation is not None:
                return conn.violation
        return None

    def _conn(self) -> Connection:
        if self._cmd is None:
            raise ConnectionError("not connected")
        return self._cmd

    async def _run(self, commands: list[list[bytes | str | int]]) -> list[object]:
        replies = await self._conn().execute(commands, self.timeout_s)
        for r in replies:
            if isinstance(r, RespError):
                raise r
        return replies

    async def publish(
        self,
        channel: str,
        payload: bytes,
        sets: Sequence[tuple[str, bytes, int]] = (),
        hset: tuple[str, str, str] | None = None,
    ) -> None:
        """PUBLISH ``payload`` and, in the same round trip, SET each (key, value, ttl ms) and HSET
        (key, field, value)."""
        await self._run(_publish_commands(channel, payload, sets, hset))

    def publish_nowait(
        self,
        channel: str,
        payload: bytes,
        sets: Sequence[tuple[str, bytes, int]],
        hset: tuple[str, str, str] | None,
        done: Callable[[BaseException | None], None],
    ) -> None:
        """:meth:`publish` without a task or an await: the commands are written now and ``done``
        is called from the reader with None, or with the failure (an error reply, a lost
        connection). No timeout here: the caller watches for a reply that never comes. Raises
        (one of :attr:`errors`) only when there is no connection to write to."""
        futures = self._conn().send(_publish_commands(channel, payload, sets, hset))

        def answered(_: object) -> None:
            for f in futures:
                if f.cancelled():
                    done(ConnectionError("publish cancelled"))
                    return
                exc = f.exception()
                if exc is None and isinstance(f.result(), RespError):
                    exc = f.result()
                if exc is not None:
                    done(exc)
                    return
            done(None)

        futures[-1].add_done_callback(answered)  # replies come in order: the last one comes last

    async def read_states(self, registry: str, key_of: str) -> list[tuple[bytes, int]]:
        """(value, remaining ttl ms) of every live key ``key_of.format(field)`` for the fields of the
        hash ``registry``; fields whose key expired are removed from it."""
        (fields,) = await self._run([["HKEYS", registry]])
        if not isinstance(fields, list) or not fields:
            return []
        names = [f.decode() for f in fields if isinstance(f, bytes)]
        commands: list[list[bytes | str | int]] = []
        for name in names:
            commands += [["GET", key_of.format(name)], ["PTTL", key_of.format(name)]]
        replies = await self._run(commands)
        out: list[tuple[bytes, int]] = []
        gone: list[bytes | str | int] = []
        for i, name in enumerate(names):
            value, ttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(value, bytes) and isinstance(ttl, int) and ttl > 0:
                out.append((value, ttl))
            else:
                gone.append(name)
        if gone:
            await self._run([["HDEL", registry, *gone]])
        return out

    async def scan_values(self, pattern: str, limit: int) -> list[tuple[str, bytes, int]]:
        """(key, value, remaining ttl ms) of up to ``limit`` keys matching ``pattern``."""
        out: list[tuple[str, bytes, int]] = []
        cursor = b"0"
        while len(out) < limit:
            (reply,) = await self._run([["SCAN", cursor, "MATCH", pattern, "COUNT", 1000]])
            if not isinstance(reply, list) or len(reply) != 2:
                raise ConnectionError(f"SCAN: unexpected reply {reply!r}")
            cursor, keys = reply[0], [k for k in reply[1] if isinstance(k, bytes)]
            if keys:
                commands: list[list[bytes | str | int]] = []
                for k in keys:
                    commands += [["GET", k], ["PTTL", k]]
                replies = await self._run(commands)
                for i, k in enumerate(keys):
                    value, ttl = replies[2 * i], replies[2 * i + 1]
                    if isinstance(value, bytes) and isinstance(ttl, int) and ttl > 0:
                        out.append((k.decode(), value, ttl))
            if cursor == b"0":
                break
        return out[:limit]

    async def remove(self, channel: str, payload: bytes, key: str, registry: str, field: str) -> None:
        """A clean exit: publish ``payload`` (the goodbye), delete ``key`` and the registry field."""
        await self._run([["PUBLISH", channel, payload], ["DEL", key], ["HDEL", registry, field]])

    def close(self) -> None:
        """Close both connections (never raises)."""
        for conn in (self._cmd, self._sub):
            if conn is not None:
                conn.close()
        self._cmd = self._sub = None


def _publish_commands(
    channel: str, payload: bytes, sets: Sequence[tuple[str, bytes, int]], hset: tuple[str, str, str] | None
) -> list[list[bytes | str | int]]:
    commands: list[list[bytes | str | int]] = [["PUBLISH", channel, payload]]
    for key, value, ttl_ms in sets:
        commands.append(["SET", key, value, "PX", max(1, ttl_ms)])
    if hset is not None:
        commands.append(["HSET", *hset])
    return commands


__all__ = ["RedisStore"]
