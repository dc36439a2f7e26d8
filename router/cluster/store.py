"""The connection to the shared store (Redis >= 7 or Valkey): the only module that imports a client.

redis-py's asyncio client (the ``cluster`` extra: ``pip install 'kvrouter[cluster]'``, with hiredis
for parsing) is imported when a store is opened, so a router without ``cluster.redis_url`` never
loads it. Chosen over a hand-written RESP client by measurement (BENCHMARKS.md, "Router replicas"):
it costs ~190 us of CPU per pipelined publish and ~30 us per received message against ~100 us and
~11 us for a minimal client, differences that the publish interval bounds to about 1% of a core at
any request rate, while it brings TLS, ACL users, URLs and a maintained protocol parser.

Two connections: one for commands (publish, snapshot keys) and one subscribed to the cluster
channel. Its own retries are off (the cluster reconnects with its own backoff and falls back to
local state meanwhile), and every command has a timeout, so a store that hangs counts as down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


def missing_client() -> str | None:
    """Why the store client cannot be used (None when it can)."""
    try:
        import redis.asyncio  # noqa: F401
    except ImportError:
        return "cluster.redis_url needs the redis package: pip install 'kvrouter[cluster]'"
    return None


class RedisStore:
    """Commands and one channel subscription on a Redis/Valkey server."""

    def __init__(self, url: str, timeout_s: float, client_name: str = "kvrouter") -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._cmd: Any = None
        self._sub: Any = None
        self._pubsub: Any = None
        from redis.exceptions import RedisError

        self.errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError, EOFError)
        """What a failing store raises (every call of this class raises only these, or cancellation)."""

    def _client(self, read_timeout: float | None) -> Any:
        import redis.asyncio as aredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return aredis.from_url(
            self.url,
            socket_timeout=read_timeout,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            client_name=self.client_name,
            max_connections=4,
        )

    async def open(self, channel: str) -> None:
        """Connect both connections and subscribe to ``channel``."""
        await self.close()
        self._cmd = self._client(self.timeout_s)
        await asyncio.wait_for(self._cmd.ping(), self.timeout_s)
        self._sub = self._client(None)
        self._pubsub = self._sub.pubsub(ignore_subscribe_messages=True)
        await asyncio.wait_for(self._pubsub.subscribe(channel), self.timeout_s)

    async def next_message(self, timeout_s: float) -> bytes | None:
        """The next message on the channel, or None after ``timeout_s`` without one."""
        msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        if msg is None or msg.get("type") != "message":
            return None
        data = msg["data"]
        return data if isinstance(data, bytes) else str(data).encode()

    async def publish(
        self,
        channel: str,
        payload: bytes,
        sets: Sequence[tuple[str, bytes, int]] = (),
        hset: tuple[str, str, str] | None = None,
    ) -> None:
        """PUBLISH ``payload`` and, in the same round trip, SET each (key, value, ttl ms) and HSET
        (key, field, value)."""
        pipe = self._cmd.pipeline(transaction=False)
        pipe.publish(channel, payload)
        for key, value, ttl_ms in sets:
            pipe.set(key, value, px=max(1, ttl_ms))
        if hset is not None:
            pipe.hset(hset[0], hset[1], hset[2])
        await asyncio.wait_for(pipe.execute(), self.timeout_s)

    async def read_states(self, registry: str, key_of: str) -> list[tuple[bytes, int]]:
        """(value, remaining ttl ms) of every live key ``key_of.format(field)`` for the fields of the
        hash ``registry``; fields whose key expired are removed from it."""
        fields = await asyncio.wait_for(self._cmd.hkeys(registry), self.timeout_s)
        if not fields:
            return []
        names = [f.decode() if isinstance(f, bytes) else str(f) for f in fields]
        pipe = self._cmd.pipeline(transaction=False)
        for name in names:
            pipe.get(key_of.format(name))
            pipe.pttl(key_of.format(name))
        replies = await asyncio.wait_for(pipe.execute(), self.timeout_s)
        out: list[tuple[bytes, int]] = []
        gone: list[str] = []
        for i, name in enumerate(names):
            value, ttl = replies[2 * i], replies[2 * i + 1]
            if value is None or ttl is None or ttl < 0:
                gone.append(name)
            else:
                out.append((value, int(ttl)))
        if gone:
            await asyncio.wait_for(self._cmd.hdel(registry, *gone), self.timeout_s)
        return out

    async def scan_values(self, pattern: str, limit: int) -> list[tuple[str, bytes, int]]:
        """(key, value, remaining ttl ms) of up to ``limit`` keys matching ``pattern``."""
        out: list[tuple[str, bytes, int]] = []
        cursor: int = 0
        while len(out) < limit:
            cursor, keys = await asyncio.wait_for(
                self._cmd.scan(cursor=cursor, match=pattern, count=1000), self.timeout_s
            )
            if keys:
                pipe = self._cmd.pipeline(transaction=False)
                for k in keys:
                    pipe.get(k)
                    pipe.pttl(k)
                replies = await asyncio.wait_for(pipe.execute(), self.timeout_s)
                for i, k in enumerate(keys):
                    value, ttl = replies[2 * i], replies[2 * i + 1]
                    if value is not None and ttl is not None and ttl > 0:
                        out.append((k.decode() if isinstance(k, bytes) else str(k), value, int(ttl)))
            if int(cursor) == 0:
                break
        return out[:limit]

    async def remove(self, channel: str, payload: bytes, key: str, registry: str, field: str) -> None:
        """A clean exit: publish ``payload`` (the goodbye), delete ``key`` and the registry field."""
        pipe = self._cmd.pipeline(transaction=False)
        pipe.publish(channel, payload)
        pipe.delete(key)
        pipe.hdel(registry, field)
        await asyncio.wait_for(pipe.execute(), self.timeout_s)

    async def close(self) -> None:
        """Close both connections (never raises)."""
        pubsub, sub, cmd = self._pubsub, self._sub, self._cmd
        self._pubsub = self._sub = self._cmd = None
        for obj in (pubsub, sub, cmd):
            if obj is None:
                continue
            try:
                await asyncio.wait_for(obj.aclose(), self.timeout_s)
            except BaseException as exc:  # a dead connection may fail to close: it is dropped anyway
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue


__all__ = ["RedisStore", "missing_client"]
