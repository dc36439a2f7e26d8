"""CPU of the replica link per request: the lean RESP client (router/cluster/resp.py) against redis-py.

``.venv/bin/python bench/store_client.py [--requests 600]``: three :class:`router.cluster.node.Cluster`
replicas in one process (one uvloop loop) on a real ``redis-server``; each request is a load-tracker
start, first byte and finish on one replica 5 and 10 ms apart, then 20 ms of quiet (three messages
per request, each delivered to all three replicas). Prints this process's CPU time per request with
each client and without any sharing, and the p50/p99 of a publish's round trip (the pipelined
PUBLISH and SETs of a replica's load, to the store's reply). redis-py and valkey-glide are measured
only when installed (neither is a dependency: ``pip install 'redis[hiredis]' valkey-glide``); their
adapters here implement the same store interface.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvloop

from index.kvindex import IndexConfig, KVIndex
from router.cluster.config import ClusterConfig
from router.cluster.node import Cluster
from router.cluster.store import RedisStore
from router.fleet.load import LoadTracker


class RedisPyStore(RedisStore):
    """The store interface over redis-py's asyncio client (a reader task feeds the callback)."""

    def __init__(self, url: str, timeout_s: float, client_name: str = "kvrouter") -> None:
        super().__init__(url, timeout_s, client_name)
        from redis.exceptions import RedisError

        self.errors = (RedisError, OSError, TimeoutError, ConnectionError)
        self._r: Any = None
        self._ps: Any = None
        self._reader: asyncio.Task[None] | None = None

    async def open(self, channel: str, on_message: Callable[[bytes], None]) -> None:
        import redis.asyncio as aredis

        self._r = aredis.from_url(self.url, socket_timeout=self.timeout_s)
        await self._r.ping()
        self._ps = aredis.from_url(self.url).pubsub(ignore_subscribe_messages=True)
        await self._ps.subscribe(channel)

        async def read() -> None:
            # (listen() blocks on the socket without a timer per message; get_message(timeout=...)
            # arms one per call)
            async for msg in self._ps.listen():
                if msg.get("type") == "message":
                    on_message(msg["data"])

        self._reader = asyncio.get_running_loop().create_task(read())

    async def lost(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader

    async def publish(
        self,
        channel: str,
        payload: bytes,
        sets: Sequence[tuple[str, bytes, int]] = (),
        hset: tuple[str, str, str] | None = None,
    ) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.publish(channel, payload)
        for key, value, ttl_ms in sets:
            pipe.set(key, value, px=max(1, ttl_ms))
        if hset is not None:
            pipe.hset(*hset)
        await pipe.execute()

    async def read_states(self, registry: str, key_of: str) -> list[tuple[bytes, int]]:
        return []

    async def scan_values(self, pattern: str, limit: int) -> list[tuple[str, bytes, int]]:
        return []

    async def remove(self, channel: str, payload: bytes, key: str, registry: str, field: str) -> None:
        await self._r.publish(channel, payload)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


class GlideStore(RedisStore):
    """The store interface over valkey-glide's asyncio client (its Rust core delivers messages to a
    callback; RESP3 push messages)."""

    def __init__(self, url: str, timeout_s: float, client_name: str = "kvrouter") -> None:
        super().__init__(url, timeout_s, client_name)
        from glide import GlideError

        self.errors = (GlideError, OSError, TimeoutError, ConnectionError)
        self._c: Any = None
        self._s: Any = None

    async def open(self, channel: str, on_message: Callable[[bytes], None]) -> None:
        from glide import GlideClient, GlideClientConfiguration, NodeAddress

        ep = self.url.removeprefix("redis://").split("/")[0]
        host, port = ep.rsplit(":", 1)
        addr = [NodeAddress(host, int(port))]
        ms = int(self.timeout_s * 1000)
        self._c = await GlideClient.create(GlideClientConfiguration(addr, request_timeout=ms))
        subs = GlideClientConfiguration.PubSubSubscriptions(
            {GlideClientConfiguration.PubSubChannelModes.Exact: {channel}},
            lambda msg, _ctx: on_message(msg.message),
            None,
        )
        self._s = await GlideClient.create(
            GlideClientConfiguration(addr, request_timeout=ms, pubsub_subscriptions=subs)
        )

    async def lost(self) -> None:
        await asyncio.Event().wait()

    async def publish(
        self,
        channel: str,
        payload: bytes,
        sets: Sequence[tuple[str, bytes, int]] = (),
        hset: tuple[str, str, str] | None = None,
    ) -> None:
        from glide import Batch, ExpirySet, ExpiryType

        batch = Batch(is_atomic=False)
        batch.publish(payload, channel)
        for key, value, ttl_ms in sets:
            batch.set(key, value, expiry=ExpirySet(ExpiryType.MILLSEC, max(1, ttl_ms)))
        if hset is not None:
            batch.hset(hset[0], {hset[1]: hset[2]})
        await self._c.exec(batch, raise_on_error=True)

    async def read_states(self, registry: str, key_of: str) -> list[tuple[bytes, int]]:
        return []

    async def scan_values(self, pattern: str, limit: int) -> list[tuple[str, bytes, int]]:
        return []

    async def remove(self, channel: str, payload: bytes, key: str, registry: str, field: str) -> None:
        await self._c.publish(payload, channel)

    def close(self) -> None:
        for c in (self._c, self._s):
            if c is not None:
                asyncio.get_event_loop().create_task(c.close())
        self._c = self._s = None


def timed_store(store: type[RedisStore], rtts: list[float]) -> type[RedisStore]:
    """``store`` with each publish's round trip appended to ``rtts`` (seconds)."""

    class Timed(store):  # type: ignore[misc,valid-type]
        async def publish(self, *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            await super().publish(*args, **kwargs)
            rtts.append(time.perf_counter() - t0)

    return Timed


async def measure(url: str | None, store: type[RedisStore], requests: int) -> float:
    """CPU seconds per request over ``requests`` requests (no sharing when ``url`` is None)."""
    index = KVIndex(IndexConfig())
    trackers: list[LoadTracker] = []
    nodes: list[Cluster] = []
    if url is None:
        trackers = [LoadTracker()]
    else:
        cfg = ClusterConfig(redis_url=url)
        for i in range(3):
            node = Cluster(cfg, index, name=f"r{i}", store=store(url, 1.0))
            tracker = LoadTracker()
            tracker.add_peers(node)
            node.start()
            nodes.append(node)
            trackers.append(tracker)
        deadline = time.monotonic() + 20
        while not all(n.connected and len(n.table.peers) == 2 for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not connect")
            await asyncio.sleep(0.01)
    t0 = time.process_time()
    for i in range(requests):
        tracker = trackers[i % len(trackers)]
        ticket = tracker.start((f"e{i % 4}", 0), 1000)
        await asyncio.sleep(0.005)
        tracker.first_byte(ticket)
        await asyncio.sleep(0.005)
        tracker.finish(ticket)
        await asyncio.sleep(0.02)
    cpu = (time.process_time() - t0) / requests
    for n in nodes:
        await n.stop()
    index.stop()
    return cpu


def decision_path(repeat: int = 20_000) -> list[tuple[str, float, float]]:
    """(what, without sharing us, with sharing us): what sharing adds inside a decision, per decision of
    8 candidates: the load read per candidate (one more dict lookup per PeerLoads view), the prediction
    (the listener queues the unconfirmed keys) and a session pin lookup and renewal."""
    from index.keys import prompt_keys
    from index.kvindex import MatchReport
    from index.store import SourceMatch
    from router.cluster.affinity import SessionAffinity
    from router.decision.policy import CandidateScore, Decision

    targets = [(f"e{i}", 0) for i in range(8)]
    alone, shared = LoadTracker(), LoadTracker()
    node = Cluster(ClusterConfig(redis_url="redis://127.0.0.1:1/0"), KVIndex(IndexConfig()))
    node.connected = True  # queue as when connected (nothing is sent: no loop runs here)
    shared.add_peers(node)
    for t in targets:
        alone.track(t)
        shared.track(t)
        node.table.totals[t] = (3, 1, 500)

    def per_call(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat * 1e6

    out = [
        (
            "load of 8 candidates",
            per_call(lambda: [alone.get(t) for t in targets]),
            per_call(lambda: [shared.get(t) for t in targets]),
        )
    ]
    keys = prompt_keys(list(range(512 * 16)), 16)  # an 8k-token prompt
    report = MatchReport(
        len(keys) * 16, 16, len(keys), {targets[0]: SourceMatch(targets[0], 500, {"GPU": 500})}, {}
    )
    report.keys[16] = keys
    index = KVIndex(IndexConfig(block_size=16))
    index.store.add_source(targets[0])

    def predict_alone() -> None:
        index.prediction_listener = None
        index.predict(targets[0], report)

    def predict_shared() -> None:
        index.prediction_listener = node.predicted
        index.predict(targets[0], report)
        node._preds.clear()  # what the sender would take
        node._pending_keys = 0

    out.append(
        ("prediction, 8k-token prompt (12 new blocks)", per_call(predict_alone), per_call(predict_shared))
    )
    aff = SessionAffinity("x-session-id", 600.0, 2.0, 100_000)
    scores = [
        CandidateScore(t[0], 0, 0, {}, 0.0, 0.0, 0.0, 1, 0.0, 0.0, i == 0) for i, t in enumerate(targets)
    ]

    def steer() -> None:
        aff.steer(12345, Decision("e0", 0, "load", scores))

    out.append(("session pin (steer and renew)", 0.0, per_call(steer)))
    index.stop()
    node.index.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="rounds, the clients' order alternating; medians")
    p.add_argument("--no-decision", action="store_true", help="skip the decision-path micro figures")
    args = p.parse_args()
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        print("redis-server is not installed", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=tmp,
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            url = f"redis://127.0.0.1:{port}/0"
            rows: list[tuple[str, str | None, type[RedisStore]]] = [
                ("no sharing", None, RedisStore),
                ("lean RESP client", url, RedisStore),
            ]
            try:
                import redis  # noqa: F401

                rows.append(("redis-py + hiredis", url, RedisPyStore))
            except ImportError:
                print("redis-py not installed: its row is skipped", file=sys.stderr)
            try:
                import glide  # noqa: F401

                rows.append(("valkey-glide", url, GlideStore))
            except ImportError:
                print("valkey-glide not installed: its row is skipped", file=sys.stderr)
            cpus: dict[str, list[float]] = {}
            rtts: dict[str, list[float]] = {}
            for r in range(args.rounds):
                for label, u, store in rows if r % 2 == 0 else rows[::-1]:
                    cpu = uvloop.run(
                        measure(u, timed_store(store, rtts.setdefault(label, [])), args.requests)
                    )
                    cpus.setdefault(label, []).append(cpu)
            for label, _, _ in rows:
                rt = sorted(rtts[label])
                p50, p99 = (rt[len(rt) // 2] * 1e3, rt[int(len(rt) * 0.99)] * 1e3) if rt else (0.0, 0.0)
                lat = f", publish p50 {p50:.3f} ms p99 {p99:.3f} ms" if rt else ""
                cpu = statistics.median(cpus[label])
                print(f"{label:<20} {cpu * 1e3:6.3f} ms CPU per request{lat}", flush=True)
            if args.no_decision:
                return 0
            print("inside one decision (us per call): without sharing / with sharing")
            for what, a, b in decision_path():
                print(f"  {what:<45} {a:7.2f} / {b:7.2f}", flush=True)
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
