"""A broken or hostile store cannot stall, bloat or crash the router's cluster link.

The parser (router/cluster/resp.py) against replies cut at every place, and against each limit; then
the real router with its cluster link in front of a hostile RESP server (sim/hostile.py: asyncio on
127.0.0.1:0, in a thread of its own) that answers the handshake like Redis and then sends one attack on the
subscription: a huge array in small pieces, an endless line, a 2 GB bulk string's header and a
trickle of bytes, arrays 100k deep. During each, a timer on the router's event loop measures the
longest stall (the loop's own CPU time between two ticks, which the machine's other load does not
inflate; the wall-clock gap is reported beside it), the client's buffers and the process's RSS are
sampled, requests go through the router, and the server counts the link's attempts. Last, a real
Redis (Debian's redis-server) whose channel gets a message over the limit from another client.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import TIMEOUT, MockFleet, RouterRunner, wait_for
from redis_harness import RedisServer

from router.cluster.config import ClusterConfig, ClusterError, validate_cluster
from router.cluster.resp import ProtocolError, ReplyLimits, ReplyParser, RespError
from sim.engine import EngineConfig
from sim.hostile import HostileStore

LIMITS = ReplyLimits(max_bytes=1 << 20, max_items=300_000, max_depth=8)
WINDOW_S = 3.0
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- the parser ------------------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """RESP2 of a reply value (bytes, int, None, RespError, lists of them)."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, RespError):
        return b"-" + str(value).encode() + b"\r\n"
    return b"*%d\r\n" % len(value) + b"".join(encode(v) for v in value)


def random_reply(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 3 and roll < 0.25:
        return [random_reply(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if roll < 0.5:
        return bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 5, 300))))  # CRLF inside, too
    if roll < 0.7:
        return rng.randrange(-(2**63), 2**63)
    if roll < 0.8:
        return None
    return RespError(f"ERR {rng.randrange(1000)}")


def parsed(chunks: list[bytes], limits: ReplyLimits | None = None) -> tuple[list[Any], ReplyParser]:
    out: list[Any] = []
    parser = ReplyParser(out.append, limits)
    for c in chunks:
        parser.feed(c)
    return out, parser


def same(a: Any, b: Any) -> bool:
    if isinstance(a, RespError):
        return isinstance(b, RespError) and str(a) == str(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_replies_cut_anywhere_parse_as_whole_ones() -> None:
    rng = random.Random(7)
    replies = [random_reply(rng) for _ in range(400)] + [b"+OK"]
    stream = b"".join(encode(r) for r in replies[:-1]) + b"+OK\r\n"
    replies[-1] = b"OK"
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.choice((1, 10, 200, 2000))))
        if trial == 0:
            cuts = list(range(1, len(stream)))  # one byte at a time
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        out, parser = parsed(chunks)
        assert len(out) == len(replies) and all(same(a, b) for a, b in zip(out, replies, strict=True))
        assert parser.buffered == 0


def test_a_huge_array_in_pieces_is_parsed_once_not_once_per_piece() -> None:
    """Each piece costs its own bytes: the old parser re-read the array from its first element on
    every read, quadratic in the pieces (the first 400 of these 1954 took it 5 s of CPU)."""
    n = 250_000
    stream = b"*%d\r\n" % n + b":1\r\n" * n
    chunks = [stream[i : i + 512] for i in range(0, len(stream), 512)]
    out: list[Any] = []
    parser = ReplyParser(out.append, LIMITS)
    worst = 0.0
    for c in chunks:
        t0 = time.thread_time()
        parser.feed(c)
        worst = max(worst, time.thread_time() - t0)
        assert parser.buffered < 512
    assert out == [[1] * n] and worst < 0.01, worst


@pytest.mark.parametrize(
    ("stream", "why"),
    [
        (b"$2000000000\r\n", "bulk string of 2000000000 bytes"),
        (b"*1\r\n" * 100_000 + b":1\r\n", "nested deeper than 8"),
        (b"*300001\r\n", "300001 array elements"),
        (b"*2\r\n*150000\r\n" + b":1\r\n" * 150_000 + b"*149999\r\n", "300001 array elements"),
        (b"+" + b"a" * (1 << 20), "over 1048576 bytes"),
        (b"*3\r\n" + (b"$400000\r\n" + b"x" * 400_000 + b"\r\n") * 3, "bulk string of 400000 bytes"),
        (b"$" + b"9" * 30, "line longer than 24"),
        (b":" + b"1" * 24 + b"\r\n", "line longer than 24"),
        (b"$-2\r\n", "length of -2"),
        (b"*x\r\n", "not a number"),
        (b"!3\r\n", "unexpected RESP type byte"),
    ],
)
def test_each_limit_and_protocol_error_closes_at_once(stream: bytes, why: str) -> None:
    """Within the reply's first bytes past a limit, not once it arrived: the buffer never holds
    more than the limit (fed in 64 KiB reads, as the socket delivers them)."""
    parser = ReplyParser(lambda _: None, LIMITS)
    with pytest.raises(ProtocolError, match=why):
        for i in range(0, len(stream), 65536):
            parser.feed(stream[i : i + 65536])
            assert parser.buffered <= LIMITS.max_bytes
    assert parser.buffered == 0


def test_replies_at_the_limits_pass() -> None:
    big = b"x" * ((1 << 20) - 16)  # the whole reply: 1 MiB
    nested: Any = [1]
    for _ in range(7):
        nested = [nested]
    out, _ = parsed([encode(big), encode(nested), encode([1] * 250_000)], LIMITS)
    assert out == [big, nested, [1] * 250_000]
    # the limits count per reply: many replies read together are no reply over them
    out, _ = parsed([encode(big) * 3], LIMITS)
    assert out == [big] * 3


def test_cluster_config_bounds_the_limits() -> None:
    validate_cluster(ClusterConfig())
    for bad in (
        {"max_reply_bytes": 1000},
        {"max_pending_keys": 1 << 22},  # its messages (32 MiB of keys) would not fit the default
        {"max_reply_items": 100},
        {"max_reply_depth": 1},
        {"max_reply_depth": 1000},
    ):
        with pytest.raises(ClusterError, match="max_reply"):
            validate_cluster(ClusterConfig(**bad))


# ---- a hostile store in front of the real router -------------------------------------------------------


class LoopWatch:
    """A 2 ms timer on the router's event loop: the longest stall (the loop thread's CPU time between
    two ticks, and the wall-clock gap beyond the tick), the client's largest buffer, the largest RSS."""

    def __init__(self, router: RouterRunner) -> None:
        self.router = router
        self.cpu = self.wall = 0.0
        self.buffered = 0
        self.rss = self.rss0 = _rss()
        self._stop = threading.Event()
        loop = router.server._loop
        assert loop is not None
        self.future = asyncio.run_coroutine_threadsafe(self._run(), loop)

    async def _run(self) -> None:
        store = self.router.app.replicas.cluster.store
        wall, cpu = time.monotonic(), time.thread_time()
        while not self._stop.is_set():
            await asyncio.sleep(0.002)
            now, used = time.monotonic(), time.thread_time()
            self.wall = max(self.wall, now - wall - 0.002)
            self.cpu = max(self.cpu, used - cpu)
            for conn in (store._cmd, store._sub):
                if conn is not None:
                    self.buffered = max(self.buffered, conn.parser.buffered)
            self.rss = max(self.rss, _rss())
            wall, cpu = time.monotonic(), time.thread_time()

    def stop(self) -> None:
        self._stop.set()
        self.future.result(TIMEOUT)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.fixture(scope="module")
def engine() -> Iterator[MockFleet]:
    fleet = MockFleet([EngineConfig(time_scale=0.01)])
    yield fleet
    fleet.close()


@pytest.mark.parametrize("attack", ["array_in_pieces", "endless_line", "huge_bulk", "deep_arrays"])
def test_a_hostile_store_neither_stalls_nor_bloats_the_router(
    attack: str, engine: MockFleet, tmp_path: Path
) -> None:
    store = HostileStore(attack)
    router: RouterRunner | None = None
    try:
        toml = (
            "block_size = 16\nremote_tokenize = false\n[health]\ninterval_s = 60\n[cluster]\n"
            f'redis_url = "redis://127.0.0.1:{store.port}/0"\nreconnect_min_s = 0.05\nreconnect_max_s = 1.0\n'
            f"max_reply_bytes = {LIMITS.max_bytes}\nmax_reply_items = {LIMITS.max_items}\n"
            "max_pending_keys = 65536\n"
        )
        router = RouterRunner(toml + engine.backend_toml(0, "e"), tmp_path)
        cluster = router.app.replicas.cluster
        wait_for(lambda: cluster.connected, "the link connected")
        watch = LoopWatch(router)
        store.arm()
        t0 = time.monotonic()
        answered = []
        with httpx.Client(timeout=TIMEOUT) as client:
            body = {"model": "mock-model", "prompt": [1, 2, 3, 4], "max_tokens": 1}
            while time.monotonic() - t0 < WINDOW_S:
                r = client.post(f"{router.url}/v1/completions", json=body)
                answered.append(r.status_code)
                time.sleep(0.02)  # (a steady trickle of requests, not a load test)
        watch.stop()
        attempts = sum(1 for t in store.subscriptions if t >= t0)
        print(
            f"{attack}: stall {watch.cpu * 1000:.1f} ms of CPU ({watch.wall * 1000:.1f} ms wall), "
            f"buffer <= {watch.buffered} bytes, RSS +{(watch.rss - watch.rss0) >> 20} MiB, "
            f"{attempts} attempts, {len(answered)} requests, failures {cluster.stats.failures}"
        )
        assert watch.cpu <= 0.05, f"the event loop stalled {watch.cpu * 1000:.0f} ms"
        assert watch.rss - watch.rss0 < 64 << 20
        assert watch.buffered <= LIMITS.max_bytes
        assert len(answered) >= 10 and set(answered) == {200}
        if attack == "array_in_pieces":  # within the limits: parsed, and the link stays up
            assert store.attacks == 1 and attempts == 0 and cluster.connected
            assert cluster.stats.failures["protocol"] == 0
            return
        # each connection broken at once and counted; the link retries with its growing delay
        # (0.05 s doubling to 1 s, jittered: at most 10 in 3 s), not every 0.05 s (some 60)
        assert cluster.stats.failures["protocol"] >= 2
        assert 2 <= attempts <= 12, attempts
    finally:
        if router is not None:
            router.stop()
        store.close()


def test_a_store_that_never_answers_a_publish_counts_as_down(engine: MockFleet, tmp_path: Path) -> None:
    """Its channel stays alive (what is published is delivered), but no PUBLISH is answered: the
    link gives the store up once a reply is ``connect_timeout_s`` late (caught by the heartbeat),
    counts a publish failure and reconnects, and requests go on meanwhile."""
    store = HostileStore("unanswered_publish")
    router: RouterRunner | None = None
    try:
        toml = (
            "block_size = 16\nremote_tokenize = false\n[health]\ninterval_s = 60\n[cluster]\n"
            f'redis_url = "{store.url}"\nreconnect_min_s = 0.05\nreconnect_max_s = 0.2\n'
            "heartbeat_s = 0.25\npeer_timeout_s = 30.0\nconnect_timeout_s = 0.5\n"
        )
        router = RouterRunner(toml + engine.backend_toml(0, "e"), tmp_path)
        cluster = router.app.replicas.cluster
        wait_for(lambda: cluster.connected and cluster.stats.messages["sent"] > 0, "the link publishing")
        before = len(store.subscriptions)
        store.arm()
        wait_for(lambda: cluster.stats.failures["publish"] >= 1, "the unanswered publish counted")
        assert "no reply within 0.5 s" in cluster.last_error, cluster.last_error
        assert cluster.stats.failures["receive"] == 0  # (the channel never went silent)
        wait_for(lambda: len(store.subscriptions) > before, "the link reconnected")
        body = {"model": "mock-model", "prompt": [1, 2, 3, 4], "max_tokens": 1}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        store.disarm()
        wait_for(lambda: cluster.connected, "the link back")
        sent = cluster.stats.messages["sent"]
        wait_for(lambda: cluster.stats.messages["sent"] > sent, "publishes answered again")
    finally:
        if router is not None:
            router.stop()
        store.close()


def test_a_message_over_the_limit_on_a_real_store_breaks_the_link_not_the_router(
    engine: MockFleet, tmp_path: Path
) -> None:
    """Another client of the store publishes 2 MiB on the cluster channel (the limit: 1 MiB): the
    subscription is closed and counted, the link reconnects and shares again."""
    redis = RedisServer(tmp_path).start()
    router: RouterRunner | None = None
    try:
        toml = (
            "block_size = 16\nremote_tokenize = false\n[health]\ninterval_s = 60\n[cluster]\n"
            f'redis_url = "{redis.url}"\nreconnect_min_s = 0.05\nmax_reply_bytes = {1 << 20}\n'
            "max_pending_keys = 65536\n"
        )
        router = RouterRunner(toml + engine.backend_toml(0, "e"), tmp_path)
        cluster = router.app.replicas.cluster
        wait_for(lambda: cluster.connected and cluster.stats.messages["received"] > 0, "the link sharing")
        connects = cluster.stats.connects

        async def publish() -> None:
            from router.cluster.resp import connect

            conn = await connect(redis.url, TIMEOUT)
            try:
                await conn.execute([["PUBLISH", "kvrouter:cluster", b"x" * (2 << 20)]], TIMEOUT)
            finally:
                conn.close()

        asyncio.run(publish())
        wait_for(lambda: cluster.stats.failures["protocol"] == 1, "the oversized message refused")
        wait_for(lambda: cluster.connected and cluster.stats.connects == connects + 1, "the link back")
        received = cluster.stats.messages["received"]
        wait_for(lambda: cluster.stats.messages["received"] > received, "messages shared again")
        r = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "mock-model", "prompt": [1, 2, 3], "max_tokens": 1},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
    finally:
        if router is not None:
            router.stop()
        redis.stop()
