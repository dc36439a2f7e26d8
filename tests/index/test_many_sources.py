"""Thousands of event sources in one process: no socket or descriptor wall, no source stalled by
another's failure, replay errors reported instead of bootstraps left pending.

The publishers run in helper subprocesses (sim/many.py: XPUB sockets in vLLM's wire format, one
thread each), so this process's descriptors are the subscriber's alone.
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from index.kvindex import IndexConfig, KVIndex
from index.subscriber import SourceConfig, SubscriberConfig
from sim.many import BLOCK_SIZE, first_blocks
from sim.publisher import BlockStored, KVEventPublisher
from tests.harness import wait_for

SOURCES = 2000
REPLAY_EVERY = 4
"""A quarter of the sources with a replay endpoint (a bootstrap each)."""
PER_HELPER = 1000


class Helpers:
    """The publisher subprocesses and the endpoints they listen on."""

    def __init__(self, sources: int, replay_every: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.endpoints: list[tuple[str, str | None]] = []
        for first in range(0, sources, PER_HELPER):
            n = min(PER_HELPER, sources - first)
            cmd = [sys.executable, "-m", "sim.many", "--sources", str(n), "--first", str(first)]
            cmd += ["--replay-every", str(replay_every)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "a publisher helper did not start"
            self.endpoints += [(a, b) for a, b in json.loads(line)["sources"]]

    def ask(self, command: str) -> list[dict[str, Any]]:
        out = []
        for proc in self.procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
            out.append(json.loads(proc.stdout.readline()))
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def helpers() -> Iterator[Helpers]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    need = 4 * SOURCES + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard descriptor limit ({hard}) holds fewer than {need} descriptors")
    h = Helpers(SOURCES, REPLAY_EVERY)
    yield h
    h.close()


def test_two_thousand_sources_are_subscribed_and_indexed_in_one_process(helpers: Helpers) -> None:
    idx = KVIndex(IndexConfig(block_size=BLOCK_SIZE, subscriber=SubscriberConfig(replay_timeout_s=20.0)))
    try:
        configs = [SourceConfig(f"e{i}", 0, ep, replay) for i, (ep, replay) in enumerate(helpers.endpoints)]
        for cfg in configs:
            idx.add_source(cfg)
        idx.start()
        subscribed = lambda: sum(helpers_subscribed(helpers)) == SOURCES  # noqa: E731
        wait_for(subscribed, "every subscription reached its publisher", 60)
        ids = [c.source_id for c in configs]
        wait_for(lambda: all(idx.source_ready(s) for s in ids), "every bootstrap ended", 60)

        def all_found() -> bool:
            return all(
                idx.match(first_blocks(i), [sid]).matches[sid].blocks == 2 for i, sid in enumerate(ids)
            )

        wait_for(all_found, "every source's two blocks indexed", 60)
        status = {s.source: s for s in idx.status()}
        assert len(status) == SOURCES
        with_replay = [s for s in status.values() if s.bootstrap != "none"]
        assert len(with_replay) == SOURCES // REPLAY_EVERY
        assert all(s.bootstrap == "done" for s in with_replay)
        assert all(s.connected and s.error is None and s.lost_batches == 0 for s in status.values())
        # another source's blocks are not this one's
        assert idx.match(first_blocks(1), [ids[0]]).matches[ids[0]].blocks == 0
        res = idx.subscriber.resources()
        assert res["sources"] == SOURCES and res["sources_failing"] == 0 and res["open_errors"] == 0
        # a plain source: SUB + a monitor (libzmq's socket and ours); one with replay: SUB + DEALER
        plain = SOURCES - SOURCES // REPLAY_EVERY
        assert res["sockets"] == 3 * plain + 2 * (SOURCES // REPLAY_EVERY)
        assert res["socket_limit"] is not None and res["socket_limit"] > res["sockets"]
        assert res["fds"] is not None and res["fd_limit"] is not None and res["fds"] < res["fd_limit"]
    finally:
        idx.stop()


def helpers_subscribed(helpers: Helpers) -> list[int]:
    return [r["subscribed"] for r in helpers.ask("subscribed")]


def test_a_source_that_cannot_open_is_reported_once_and_retried_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A source whose address is taken is logged once, counted at every try, retried after waits
    that double up to the cap, and the other sources stream meanwhile."""
    holder: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PAIR)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    pub = KVEventPublisher(replay_endpoint=None)
    cfg = SubscriberConfig(open_retry_s=0.02, open_retry_max_s=0.16)
    idx = KVIndex(IndexConfig(block_size=BLOCK_SIZE, subscriber=cfg))
    try:
        idx.add_source(SourceConfig("good", 0, pub.endpoint))
        idx.add_source(SourceConfig("bad", 0, f"tcp://127.0.0.1:{port}", bind=True))
        with caplog.at_level(logging.ERROR, logger="kvrouter.subscriber"):
            idx.start()
            sub = idx.subscriber
            delays: list[float] = []

            def attempts(n: int) -> bool:
                failed = sub._failed.get(("bad", 0))
                if failed is not None and (not delays or failed.delay != delays[-1]):
                    delays.append(failed.delay)
                return failed is not None and failed.attempts >= n

            wait_for(lambda: attempts(7), "seven failed tries")
            tokens = first_blocks(0)
            hashes: list[int | bytes] = [11, 12]
            deadline = time.monotonic() + 30
            while idx.match(tokens, [("good", 0)]).matches[("good", 0)].blocks < 2:
                assert time.monotonic() < deadline, "the good source never indexed"
                pub.publish([BlockStored(hashes, None, tokens, BLOCK_SIZE, None, "GPU", None)])
                time.sleep(0.05)  # (pacing of the probe until the subscription has propagated)
        lines = [r for r in caplog.records if "bad/dp0" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert sub.open_errors >= 7
        assert delays[:4] == [0.02, 0.04, 0.08, 0.16] and max(delays) == 0.16
        st = {s.source: s for s in idx.status()}["bad/dp0"]
        assert st.error and "in use" in st.error and st.open_attempts >= 7 and not st.connected
        assert idx.subscriber.resources()["sources_failing"] == 1
    finally:
        idx.stop()
        pub.close()
        holder.close(0)


def test_a_replay_socket_that_cannot_open_is_reported_and_retried_not_left_pending() -> None:
    """The context's socket cap reached at a source's DEALER (its SUB fitted): the source is
    reported failed (bootstrap "failed", its error shown) and retried; once sockets free up it
    opens and its bootstrap completes. The other source goes on meanwhile."""
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3)  # (before its first socket) one SUB + DEALER pair, then one SUB
    a = KVEventPublisher()
    b = KVEventPublisher()
    cfg = SubscriberConfig(open_retry_s=0.02, open_retry_max_s=0.1, replay_timeout_s=20.0)
    idx = KVIndex(IndexConfig(block_size=BLOCK_SIZE, subscriber=cfg), ctx=ctx)
    try:
        tok_a, tok_b = first_blocks(0), first_blocks(1)
        a.publish([BlockStored([1, 2], None, tok_a, BLOCK_SIZE, None, "GPU", None)])
        b.publish([BlockStored([3, 4], None, tok_b, BLOCK_SIZE, None, "GPU", None)])
        idx.add_source(SourceConfig("a", 0, a.endpoint, a.replay_endpoint))
        idx.add_source(SourceConfig("b", 0, b.endpoint, b.replay_endpoint))
        idx.start()

        def st(name: str) -> Any:
            return {s.source: s for s in idx.status()}[name]

        wait_for(lambda: st("a/dp0").bootstrap == "done", "a's bootstrap")
        assert idx.match(tok_a, [("a", 0)]).matches[("a", 0)].blocks == 2
        wait_for(lambda: st("b/dp0").open_attempts >= 2, "b retried")
        failed = st("b/dp0")
        assert failed.bootstrap == "failed" and failed.error and "Too many open files" in failed.error
        assert not idx.source_ready(("b", 0))  # (never pending without an error shown)
        idx.remove_source(("a", 0))  # its sockets go back to the context
        wait_for(lambda: st("b/dp0").bootstrap == "done", "b opened and bootstrapped")
        assert st("b/dp0").error is None
        assert idx.match(tok_b, [("b", 0)]).matches[("b", 0)].blocks == 2
    finally:
        idx.stop()
        a.close()
        b.close()
        ctx.destroy(0)
