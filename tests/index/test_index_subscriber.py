"""The subscriber over real ZeroMQ sockets against a vLLM-compatible publisher (PUB + replay ROUTER)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from harness import TIMEOUT, wait_for

from index.ingest import Ingestor
from index.keys import prompt_keys
from index.kvindex import IndexConfig, KVIndex
from index.store import PrefixStore
from index.subscriber import SourceConfig, SourceStatus, SubscriberConfig
from index.wire import Batch
from sim.publisher import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher, encode_batch

BS = 4


class Chain:
    """A growing token sequence and the events an engine would publish for it."""

    def __init__(self, start: int, seed: int = 0) -> None:
        self.tokens: list[int] = []
        self.hashes: list[int] = []
        self.next = start
        self.seed = seed

    def extend(self, blocks: int, medium: str = "GPU") -> BlockStored:
        parent = self.hashes[-1] if self.hashes else None
        toks = list(range(self.next, self.next + blocks * BS))
        self.next += blocks * BS
        new = [
            (self.seed * 1_000_003 + len(self.hashes) + i + 1) * 0x9E3779B97F4A7C15 % 2**64
            for i in range(blocks)
        ]
        self.tokens += toks
        self.hashes += new
        return BlockStored(new, parent, toks, BS, None, medium, None)


@pytest.fixture
def make_index(ctx: zmq.Context[Any]) -> Iterator[Callable[..., KVIndex]]:
    made: list[KVIndex] = []

    def make(*sources: SourceConfig, **sub: Any) -> KVIndex:
        cfg = IndexConfig(block_size=BS, subscriber=SubscriberConfig(**{"replay_timeout_s": 5.0, **sub}))
        idx = KVIndex(cfg, ctx=ctx)
        for s in sources:
            idx.add_source(s)
        idx.start()
        made.append(idx)
        return idx

    yield make
    for idx in made:
        idx.stop()


@pytest.fixture
def make_pub(ctx: zmq.Context[Any]) -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def make(**kw: Any) -> KVEventPublisher:
        p = KVEventPublisher(ctx=ctx, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def status(idx: KVIndex, name: str = "e/dp0") -> SourceStatus:
    return next(s for s in idx.status() if s.source == name)


def matched(idx: KVIndex, tokens: list[int], source: tuple[str, int] = ("e", 0)) -> int:
    return idx.match(tokens, [source]).matches[source].blocks


def connect(pub: KVEventPublisher, rank: int = 0, topic: str = "", instance: str = "e") -> SourceConfig:
    return SourceConfig(instance, rank, pub.endpoint, pub.replay_endpoint, topic=topic)


def publish_until_seen(pub: KVEventPublisher, idx: KVIndex, chain: Chain, source: str = "e/dp0") -> None:
    """PUB drops messages until the subscription has propagated: publish empty batches until one
    is applied (a dropped one loses nothing), then the chain's next block, which then arrives. (A
    chain block as the probe broke the chain whenever the first probes were dropped: the first
    one received had a parent the index never saw.)"""
    deadline = time.monotonic() + TIMEOUT
    if status(idx, source).batches == 0:
        while status(idx, source).batches == 0:
            assert time.monotonic() < deadline, "subscription never propagated"
            pub.publish([])
            time.sleep(0.05)  # pacing of the probe, not synchronisation: the loop condition is
    n = status(idx, source).batches
    pub.publish([chain.extend(1)])
    wait_for(lambda: status(idx, source).batches > n, "the chain's first block applied")


def test_live_events_are_indexed(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(100)
    wait_for(lambda: status(idx).connected, "connection")
    wait_for(lambda: status(idx).replays >= 1, "bootstrap replay")
    pub.publish([c.extend(3)])
    wait_for(lambda: matched(idx, c.tokens) == 3, "3 blocks indexed")
    pub.publish([BlockRemoved(c.hashes[-1:], "GPU")])
    wait_for(lambda: matched(idx, c.tokens) == 2, "removal applied")
    st = status(idx)
    assert st.gaps == 0 and st.lost_batches == 0 and st.decode_errors == 0
    assert st.blocks == {"GPU": 2}


def test_gap_then_replay_recovers_every_batch(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    pub.drop_next(3)
    for _ in range(3):
        pub.publish([c.extend(2)])  # lost on the live stream, kept in the replay buffer
    pub.publish([c.extend(1)])
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "replayed blocks indexed")
    st = status(idx)
    assert st.gaps == 1 and st.replayed_batches >= 3 and st.lost_batches == 0
    assert st.last_seq == pub.next_seq - 1


def test_gap_without_replay_is_counted_as_lost(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub(replay_endpoint=None)
    idx = make_index(SourceConfig("e", 0, pub.endpoint))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    before = status(idx)  # probes sent before the subscription propagated were lost too
    pub.drop_next(2)
    pub.publish([c.extend(1)])
    pub.publish([c.extend(1)])
    pub.publish([c.extend(1)])
    # last_seq moves on receipt, unknown_parents when the ingest thread applies: wait for both
    wait_for(
        lambda: (
            status(idx).last_seq == pub.next_seq - 1 and status(idx).unknown_parents > before.unknown_parents
        ),
        "stream caught up and applied",
    )
    st = status(idx)
    assert st.gaps == 1 and st.lost_batches - before.lost_batches == 2 and st.replays == 0
    # the block after the gap names a parent we never saw: anchored, so it cannot match a prompt
    assert st.unknown_parents - before.unknown_parents == 1
    assert matched(idx, c.tokens) < len(c.hashes)


def test_late_join_bootstraps_from_the_replay_buffer(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    c = Chain(0)
    for _ in range(5):
        pub.publish([c.extend(2)])  # nobody subscribed yet: PUB drops these
    idx = make_index(connect(pub))
    wait_for(lambda: matched(idx, c.tokens) == 10, "bootstrap replay applied")
    st = status(idx)
    assert st.replayed_batches == 5 and st.last_seq == 4 and st.lost_batches == 0
    # live traffic continues from there, without duplicates being applied twice
    pub.publish([c.extend(1)])
    wait_for(lambda: matched(idx, c.tokens) == 11, "live after bootstrap")
    assert idx.store.refcount(0, prompt_keys(c.tokens, BS)[0]) == 1


def _indexed(pub: KVEventPublisher, idx: KVIndex) -> Chain:
    """A chain the engine published and the index holds."""
    chain = Chain(0)
    publish_until_seen(pub, idx, chain)
    pub.publish([chain.extend(3)])
    wait_for(lambda: matched(idx, chain.tokens) == len(chain.hashes), "the chain's blocks")
    return chain


def _indexed_then_restarted(pub: KVEventPublisher, idx: KVIndex) -> Chain:
    """A chain the engine published and the index holds, then the engine restarted (seq back to 0,
    buffer emptied, like a new engine process); returns the old chain."""
    old = _indexed(pub, idx)
    pub.restart()
    return old


def test_engine_restart_drops_its_blocks(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    idx = make_index(connect(pub))
    old = _indexed_then_restarted(pub, idx)
    new = Chain(5000, seed=1)
    pub.publish([new.extend(2)])
    wait_for(lambda: status(idx).restarts == 1, "restart detected")
    wait_for(lambda: matched(idx, new.tokens) == 2, "new blocks")
    assert matched(idx, old.tokens) == 0
    assert status(idx).blocks == {"GPU": 2}


def test_after_a_restart_a_smaller_block_size_is_learned_from_its_first_multi_block_event(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """An engine restarted with a smaller ``--block-size``: its single-block events look exactly like
    a hybrid model's partial blocks, so they are skipped (counted) until a multi-block event
    teaches the new size; everything from that event on is indexed at it (index/README.md)."""
    pub = make_pub()
    idx = make_index(connect(pub))
    _indexed_then_restarted(pub, idx)
    small = BS // 2
    single = list(range(90_000, 90_000 + small))
    pub.publish([BlockStored([0xABC000], None, single, small, None, "GPU", None)])
    toks = list(range(80_000, 80_000 + 2 * small))
    pub.publish([BlockStored([0xABC101, 0xABC102], None, toks, small, None, "GPU", None)])
    child = list(range(70_000, 70_000 + small))
    pub.publish([BlockStored([0xABC103], 0xABC102, child, small, None, "GPU", None)])
    wait_for(lambda: status(idx).restarts == 1, "restart detected")
    wait_for(lambda: matched(idx, toks + child) == 3, "the size taught by the two-block event")
    st = status(idx)
    assert st.block_size == small and st.bad_events == 1 and st.blocks == {"GPU": 3}


@pytest.mark.parametrize("c_path", [True, False])
def test_a_partial_block_first_after_a_restart_is_not_learned_as_the_size(c_path: bool) -> None:
    """A hybrid model's partial block (one hash, fewer tokens than the block size) as the first event
    after an engine restart (a prompt shorter than a block) must not become the source's block size:
    prompts would be hashed at it (found in review: a restart that forgot the size did that)."""
    ing = Ingestor(PrefixStore(), BS)
    if not c_path:
        ing._core = None
    s = ing.add_source(("e", 0))

    def one(hashes: list[int], parent: int | None, toks: list[int], bs: int) -> bytes:
        return encode_batch([BlockStored(hashes, parent, toks, bs, None, "GPU", None)], 1.0, 0)

    ing.apply_chunk([(s, one([1, 2], None, list(range(2 * BS)), BS))])
    ing.apply_chunk([(s, None)])  # a restart: seq went back
    ing.apply_chunk([(s, one([777], None, [9], 1))])  # partial entries of 1, then 3 tokens
    ing.apply_chunk([(s, one([778], 777, [9] * (BS - 1), BS - 1))])
    ing.apply_chunk([(s, one([3], None, list(range(BS)), BS))])  # then a full block
    st = ing.stats[s]
    assert st.block_size == BS and st.bad_events == 2 and st.block_size_mismatch == 0
    assert ing.store.total == 1


def test_clear_wipes_gpu_but_not_cpu(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    gpu = c.extend(2)
    cpu = BlockStored(c.hashes, None, c.tokens, BS, None, "CPU", None)
    pub.publish([gpu, cpu])
    wait_for(lambda: status(idx).blocks.get("CPU") == len(c.hashes), "cpu copies")
    pub.publish([AllBlocksCleared()])
    wait_for(lambda: status(idx).blocks.get("GPU", 0) == 0, "gpu cleared")
    m = idx.match(c.tokens, [("e", 0)]).matches["e", 0]
    n = len(c.hashes)
    assert m.blocks == n and m.by_medium == {"GPU": 0, "CPU": n}


def test_two_dp_ranks_are_two_sources(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    p0, p1 = make_pub(dp_rank=0), make_pub(dp_rank=1)
    idx = make_index(connect(p0, 0), connect(p1, 1))
    a, b = Chain(0), Chain(9000, seed=2)
    publish_until_seen(p0, idx, a, "e/dp0")
    publish_until_seen(p1, idx, b, "e/dp1")
    rep = idx.match(a.tokens, [("e", 0), ("e", 1)])
    assert rep.matches["e", 0].blocks == len(a.hashes) and rep.matches["e", 1].blocks == 0
    rep = idx.match(b.tokens, [("e", 0), ("e", 1)])
    assert rep.matches["e", 1].blocks == len(b.hashes) and rep.matches["e", 0].blocks == 0


def test_topic_filter_is_exact(ctx: zmq.Context[Any], make_index: Callable[..., KVIndex]) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    try:
        idx = make_index(SourceConfig("e", 0, pub.getsockopt_string(zmq.LAST_ENDPOINT), topic="kv-events"))
        c = Chain(0)

        def send(topic: bytes, seq: int) -> None:
            payload = msgspec.msgpack.encode([time.time(), [msgspec.to_builtins(c.extend(1))], 0])
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

        deadline = time.monotonic() + TIMEOUT
        seq = 0
        while status(idx).batches == 0:  # wait for the subscription to propagate
            assert time.monotonic() < deadline
            send(b"kv-events", seq)
            seq += 1
            time.sleep(0.05)
        seen = status(idx).batches
        send(b"other", seq)  # filtered by ZMQ itself
        send(b"kv-events-2", seq)  # prefix match in ZMQ, rejected by the exact check
        send(b"kv-events", seq)
        wait_for(lambda: status(idx).batches == seen + 1, "the right topic applied")
        wait_for(lambda: status(idx).foreign_topic == 1, "foreign topic counted")
    finally:
        pub.close(0)


def test_bind_mode_engine_connects_to_us(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    idx = make_index(SourceConfig("e", 0, "tcp://127.0.0.1:0", bind=True))
    endpoint = status(idx).endpoint
    assert not endpoint.endswith(":0")
    pub = make_pub(endpoint=endpoint, bind=False, replay_endpoint=None)
    c = Chain(0)
    wait_for(lambda: status(idx).connected, "engine connected")
    publish_until_seen(pub, idx, c)
    assert matched(idx, c.tokens) == len(c.hashes)


def test_malformed_payloads_are_counted_and_the_stream_survives(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    pub.publish_raw(b"\xc1\xc1 not msgpack")
    pub.publish([c.extend(1)])
    pub.publish_raw(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]))
    pub.publish([c.extend(1)])
    # the first error is counted on receipt, the second (a bad event) and the good batches when the
    # ingest thread applies them, after last_seq has moved: wait for the applied state
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "the good batches applied")
    wait_for(lambda: status(idx).decode_errors >= 2, "both malformed messages counted")
    st = status(idx)
    assert st.decode_errors == 2 and st.gaps == 0 and st.lost_batches == 0
    assert st.last_seq == pub.next_seq - 1


def test_old_two_frame_replay_replies(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    pub = make_pub(replay_frames=2, encoding="array")
    c = Chain(0)
    for _ in range(3):
        pub.publish([c.extend(1)])
    idx = make_index(connect(pub))
    wait_for(lambda: matched(idx, c.tokens) == 3, "bootstrap through a vLLM<0.26 style replay")


def test_replay_timeout_is_bounded_and_counted(
    ctx: zmq.Context[Any], make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    silent = ctx.socket(zmq.ROUTER)  # a replay socket that never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    try:
        pub = make_pub(replay_endpoint=None)
        cfg = SourceConfig("e", 0, pub.endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT))
        idx = make_index(cfg, replay_timeout_s=0.5)
        c = Chain(0)
        publish_until_seen(pub, idx, c)
        pub.drop_next(2)
        for _ in range(3):
            pub.publish([c.extend(1)])
        wait_for(lambda: status(idx).last_seq == pub.next_seq - 1, "stream resumed after the timeout")
        assert status(idx).gaps == 1
        wait_for(lambda: status(idx).lost_batches >= 2, "the two dropped batches counted as lost")
    finally:
        silent.close(0)


def test_an_idle_subscriber_without_sources_does_not_spin(make_index: Callable[..., KVIndex]) -> None:
    """With nothing to poll, zmq returns at once: the thread must sleep, not hold the GIL in a loop."""
    make_index()
    before = time.process_time()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.process_time() - before < 0.2  # a spinning thread burns ~0.5 s of CPU here


def test_messages_of_other_frame_counts_are_counted_and_the_stream_survives(
    ctx: zmq.Context[Any], make_index: Callable[..., KVIndex]
) -> None:
    """The subscriber reads three frames per message and checks only the last one's flag: a message
    of 1, 2 or 4 frames is a decode error (the message after a short one may go with it: a gap)."""
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    try:
        idx = make_index(SourceConfig("e", 0, pub.getsockopt_string(zmq.LAST_ENDPOINT)))
        c = Chain(0)
        seq = 0

        def good() -> None:
            nonlocal seq
            payload = msgspec.msgpack.encode([time.time(), [msgspec.to_builtins(c.extend(1))], 0])
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1

        deadline = time.monotonic() + TIMEOUT
        while status(idx).batches == 0:  # wait for the subscription to propagate
            assert time.monotonic() < deadline
            good()
            time.sleep(0.05)
        before = status(idx).batches
        pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\x90", b"extra"])  # 4 frames
        pub.send_multipart([b"", b"\x93"])  # 2 frames
        pub.send_multipart([b"only"])  # 1 frame
        for _ in range(5):
            good()
        wait_for(lambda: status(idx).last_seq == seq - 1, "stream caught up")
        # counted by ingest (a short message can swallow the next, hence 3 of the 5)
        wait_for(lambda: status(idx).batches >= before + 3, "batches applied")
        assert status(idx).decode_errors >= 2
    finally:
        pub.close(0)


def test_bootstrap_state_and_source_ready(
    ctx: zmq.Context[Any], make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """The lead's readiness signal: "none" (ready at once) without a replay endpoint; "pending" until
    the first-contact replay ends, then "done"; "failed" (and ready) when nobody answers it."""
    pub = make_pub()
    c = Chain(0)
    for _ in range(3):
        pub.publish([c.extend(2)])
    plain = make_pub(replay_endpoint=None)
    dead = ctx.socket(zmq.ROUTER)  # a replay socket that never answers
    dead.setsockopt(zmq.LINGER, 0)
    dead.bind("tcp://127.0.0.1:0")
    try:
        silent = make_pub()
        idx = make_index(
            connect(pub),
            connect(plain, instance="p"),
            SourceConfig("s", 0, silent.endpoint, dead.getsockopt_string(zmq.LAST_ENDPOINT)),
            replay_timeout_s=0.5,
        )
        assert status(idx, "p/dp0").bootstrap == "none" and idx.source_ready(("p", 0))
        wait_for(lambda: idx.source_ready(("e", 0)), "bootstrap done")
        assert status(idx).bootstrap == "done" and matched(idx, c.tokens) == 6
        wait_for(lambda: idx.source_ready(("s", 0)), "bootstrap given up")
        assert status(idx, "s/dp0").bootstrap == "failed"
        assert not idx.source_ready(("nobody", 0))
        assert idx.source_blocks_by_medium(("e", 0)) == {"GPU": 6}
        assert idx.source_keys(("e", 0)) == {"GPU": set(prompt_keys(c.tokens, BS))}
        assert idx.source_keys(("nobody", 0)) == {} and idx.source_blocks_by_medium(("nobody", 0)) == {}
    finally:
        dead.close(0)


def test_ready_only_once_the_bootstrap_is_in_the_index(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """Readiness means the replayed blocks are matchable: with the ingest thread held, a finished
    bootstrap replay stays "pending" and not ready; once the thread goes on, both flip together
    with the blocks in the index. (It used to flip when the reply arrived, before the apply: a
    joiner could be routed to with an index that did not yet hold its bootstrap.)"""
    pub = make_pub()
    c = Chain(0)
    for _ in range(3):
        pub.publish([c.extend(2)])
    idx = make_index()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(TIMEOUT)

    idx.subscriber._submit(hold)
    assert held.wait(TIMEOUT)
    try:
        idx.add_source(connect(pub))
        wait_for(
            lambda: (
                any(s.source == "e/dp0" and s.replays >= 1 for s in idx.status())
                and idx.subscriber._apply_q.qsize() >= 2
            ),
            "the replay received and its chunk handed over",
        )
        assert not idx.source_ready(("e", 0)) and status(idx).bootstrap == "pending"
    finally:
        release.set()
    wait_for(lambda: idx.source_ready(("e", 0)), "ready after the apply")
    assert status(idx).bootstrap == "done" and matched(idx, c.tokens) == 6


def test_remove_and_re_add_sources_while_running_reuses_slots(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """Pods joining and leaving: removal unsubscribes and frees the source's blocks; its slot (and
    mask bit) is reused by the next source, which starts empty."""
    idx = make_index()
    for round_ in range(3):
        pub = make_pub(replay_endpoint=None)
        c = Chain(round_)
        idx.add_source(connect(pub, instance=f"pod{round_}"))
        name = f"pod{round_}/dp0"
        wait_for(lambda n=name: any(s.source == n for s in idx.status()), "added")  # type: ignore[misc]
        publish_until_seen(pub, idx, c, source=f"pod{round_}/dp0")
        assert idx.source_blocks_by_medium((f"pod{round_}", 0))["GPU"] >= 1
        idx.remove_source((f"pod{round_}", 0))
        wait_for(lambda r=round_: idx.store.source_index((f"pod{r}", 0)) is None, "removed")  # type: ignore[misc]
        wait_for(lambda: not idx.store._retiring, "its blocks dropped and its slot freed")
        assert idx.store.total == 0
    assert len(idx.store._sources) == 1  # one slot, reused


def test_a_source_re_added_under_its_id_at_once_keeps_its_new_stream(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A pod recreated under its name (a StatefulSet) is removed and re-added in one go, before the
    ingest thread has dropped the old blocks: the new stream must neither inherit the old blocks nor
    be wiped by the old removal landing after it."""
    idx = make_index()
    old, new = make_pub(replay_endpoint=None), make_pub(replay_endpoint=None)
    c_old, c_new = Chain(1), Chain(2)
    idx.add_source(connect(old, instance="sts"))
    wait_for(lambda: any(s.source == "sts/dp0" for s in idx.status()), "added")
    publish_until_seen(old, idx, c_old, source="sts/dp0")
    for _ in range(3):
        old.publish([c_old.extend(4)])
    wait_for(lambda: matched(idx, c_old.tokens, ("sts", 0)) == len(c_old.tokens) // BS, "old chain indexed")
    idx.remove_source(("sts", 0))
    idx.add_source(connect(new, instance="sts"))
    wait_for(lambda: any(s.endpoint == new.endpoint for s in idx.status()), "the new stream listed")
    publish_until_seen(new, idx, c_new, source="sts/dp0")
    new.publish([c_new.extend(3)])
    want = len(c_new.tokens) // BS
    wait_for(lambda: matched(idx, c_new.tokens, ("sts", 0)) == want, "new chain indexed")
    assert matched(idx, c_old.tokens, ("sts", 0)) == 0  # nothing inherited
    assert [s.endpoint for s in idx.status()] == [new.endpoint]
    assert idx.source_keys(("sts", 0)) == {"GPU": set(prompt_keys(c_new.tokens, BS))}


def test_a_deeply_nested_payload_is_a_bad_message_not_the_end_of_the_stream(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """~1 KB of nested arrays made the decoder raise RecursionError, which ended the subscriber
    thread: every source's stream stopped, silently."""
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    pub.publish_raw(b"\x91" * 100_000 + b"\xc0")
    pub.publish([c.extend(2)])
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "the batch after it applied")
    st = status(idx)
    assert st.decode_errors == 1 and st.lost_batches == 0 and st.last_seq == pub.next_seq - 1


def test_a_deeply_nested_payload_costs_only_itself_in_the_ingest_thread(
    make_index: Callable[..., KVIndex],
) -> None:
    """The same payload inside a chunk (the C core hands it to Python decoding) used to throw away
    the whole chunk: the other sources' batches in it were never applied, nor counted."""
    idx = make_index()
    ing = idx.ingestor
    a, b = ing.add_source(("a", 0)), ing.add_source(("b", 0))
    good = msgspec.msgpack.encode([1.0, [["BlockStored", [7], None, [1, 2, 3, 4], BS, None]]])
    ing.apply_chunk([(a, good), (a, b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 5000 + b"\xc0"), (b, good)])
    assert idx.store.source_blocks(b) == {"GPU": 1} and idx.store.source_blocks(a) == {"GPU": 1}
    assert ing.stats[a].decode_errors == 1


def test_a_source_whose_address_is_taken_is_retried_and_the_others_go_on(
    ctx: zmq.Context[Any], make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A bind that fails (the port held by another socket, e.g. the one a re-joining backend's old
    source just closed) raised out of the subscriber thread and ended it for every source. Now the
    source shows its error, is retried, and opens once the port is free."""
    pub = make_pub()
    idx = make_index(connect(pub), open_retry_s=0.05)
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    holder = ctx.socket(zmq.PULL)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind("tcp://127.0.0.1:0")
    taken = holder.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        idx.add_source(SourceConfig("other", 0, taken, bind=True))
        wait_for(lambda: any(s.source == "other/dp0" and s.error for s in idx.status()), "the failure shown")
        st = status(idx, "other/dp0")
        assert not st.connected and "in use" in (st.error or "")
        pub.publish([c.extend(1)])  # the thread still serves the other source
        wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "the healthy source still indexed")
    finally:
        holder.close(0)
    wait_for(
        lambda: any(s.source == "other/dp0" and s.error is None for s in idx.status()),
        "opened once the port is free",
    )
    assert status(idx, "other/dp0").endpoint == taken
    idx.remove_source(("other", 0))
    wait_for(lambda: all(s.source != "other/dp0" for s in idx.status()), "removed")


def test_a_gap_the_engine_no_longer_buffers_is_lost_once_not_replayed_forever(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A replay that ends without the gap's batches (the engine's buffer moved past them) used to
    start the same replay again at once, thousands of times a second, with the source frozen."""
    pub = make_pub(buffer_steps=2)
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    pub.drop_next(5)
    for _ in range(5):
        pub.publish([c.extend(1)])  # lost live, and beyond the engine's 2-batch buffer
    tail = Chain(10_000, seed=3)
    for _ in range(3):
        pub.publish([tail.extend(1)])
    wait_for(lambda: status(idx).last_seq == pub.next_seq - 1, "the stream goes on past the gap")
    st = status(idx)
    assert st.lost_batches == 5 and st.gaps == 1 and st.replays <= 2  # (the bootstrap, the gap's)
    wait_for(lambda: matched(idx, tail.tokens) == 3, "what followed the gap applied")


def test_a_source_drained_before_its_connected_event_still_becomes_ready(
    ctx: zmq.Context[Any], make_pub: Callable[..., KVEventPublisher]
) -> None:
    """When the first live message was read before the monitor's CONNECTED (both ready in one
    poll), its gap replay from seq 0 was not taken as the bootstrap, and the source stayed
    "pending", not ready, for good: its backend waited out join_timeout_s."""
    pub = make_pub()
    c = Chain(0)
    for _ in range(5):
        pub.publish([c.extend(1)])  # an engine that has been running: 0..4 in its buffer
    idx = KVIndex(IndexConfig(block_size=BS), ctx=ctx)
    try:
        idx.add_source(connect(pub))
        stop = threading.Event()

        def engine() -> None:
            while not stop.is_set():
                pub.publish([c.extend(1)])
                stop.wait(0.02)

        t = threading.Thread(target=engine)
        t.start()
        try:
            # the SUB socket connects and queues live messages before the thread first polls
            wait_for(lambda: pub.next_seq > 30, "the engine published meanwhile")
            idx.start()
            wait_for(lambda: idx.source_ready(("e", 0)), "the source ready")
        finally:
            stop.set()
            t.join()
        assert status(idx).bootstrap == "done"
        wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "everything indexed")
    finally:
        idx.stop()


def test_a_partial_block_does_not_change_the_sources_block_size(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """vLLM's cache_partial_block (hybrid models) publishes one hash whose block_size is the tokens
    of a partial entry: it was learned as the source's new block size, and every prompt was then
    hashed at that size for the source: no match at all."""
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(0)
    publish_until_seen(pub, idx, c)
    pub.publish([c.extend(3)])
    partial = BlockStored([777], c.hashes[-1], [9, 9, 9], BS - 1, None, "GPU", None)
    pub.publish([partial])
    pub.publish([c.extend(1)])
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "every full block indexed")
    st = status(idx)
    assert st.block_size == BS and not st.block_size_mismatch and st.bad_events == 1


def test_batches_accepted_before_a_turn_fails_are_indexed_all_the_same(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A subscriber turn that raises for a reason nobody foresaw is logged and the next one runs;
    the batches it had accepted before failing (their sequence numbers taken: no gap, no replay
    would bring them back) are applied, not dropped."""
    pub = make_pub()
    idx = make_index(connect(pub))
    c = Chain(700)
    # live first: batches that arrive while the bootstrap replay runs are held and applied by
    # the replay's path, which this test does not break
    publish_until_seen(pub, idx, c)
    seen = len(c.hashes)
    wait_for(lambda: status(idx).bootstrap == "done", "bootstrap replay over")
    sub = idx.subscriber
    real = sub._drain_live
    failures: list[int] = []

    def drain_then_fail(src: Any, chunk: list[Any]) -> None:
        real(src, chunk)
        if chunk and not failures:
            failures.append(len(chunk))
            raise RuntimeError("an unforeseen failure after accepting batches")

    sub._drain_live = drain_then_fail  # type: ignore[method-assign]
    try:
        pub.publish([c.extend(3)])
        wait_for(lambda: failures, "a turn that accepted the batch, then failed")
        wait_for(lambda: matched(idx, c.tokens) == seen + 3, "the accepted batch indexed")
        pub.publish([c.extend(2)])  # and the stream goes on
        wait_for(lambda: matched(idx, c.tokens) == seen + 5, "the next batch indexed")
    finally:
        del sub._drain_live
    st = status(idx)
    assert st.gaps == 0 and st.lost_batches == 0


def test_messages_the_c_loop_took_before_failing_are_replayed_once_not_applied_twice(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex], monkeypatch: Any
) -> None:
    """The C receive loop can take messages and then fail (memory ran out midway): their sequence
    numbers never reached the source, so the next batch is a gap and its replay brings them. Kept in
    the chunk too, they were applied twice, and a block the engine then evicted stayed indexed."""
    import index.subscriber as subscriber_module

    pub = make_pub()
    idx = make_index(connect(pub))
    if not idx.subscriber._native:
        pytest.skip("no C receive loop on this platform")
    c = Chain(800)
    publish_until_seen(pub, idx, c)
    wait_for(lambda: status(idx).bootstrap == "done", "bootstrap replay over")
    seen = len(c.hashes)
    real = subscriber_module._kvcore
    armed = [True]

    class FailingCore:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def recv_live(self, *args: Any) -> Any:
            out = real.recv_live(*args)
            if armed[0] and out[0] > 0:
                armed[0] = False
                raise MemoryError("simulated: an allocation failed after messages were taken")
            return out

    monkeypatch.setattr(subscriber_module, "_kvcore", FailingCore())
    pub.publish([c.extend(3)])  # taken by the C loop, then the turn fails
    wait_for(lambda: not armed[0], "the failing turn")
    pub.publish([])  # the next batch: a gap, replayed
    wait_for(lambda: matched(idx, c.tokens) == seen + 3, "the taken batch indexed by the replay")
    pub.publish([BlockRemoved(c.hashes[-3:], "GPU")])  # the engine evicts those 3 blocks
    wait_for(lambda: matched(idx, c.tokens) == seen, "the evicted blocks gone (one reference each)")
    st = status(idx)
    assert st.gaps == 1 and st.lost_batches == 0


MARK = 3_000_000_000
"""Token ids from here on are msgpack uint32s beginning with these bytes (up to MARK + 3,583)."""
MARK_BYTES = b"\xce" + MARK.to_bytes(4, "big")[:2]


def _ours(item: object) -> bool:
    if isinstance(item, bytes):
        return MARK_BYTES in item
    if isinstance(item, Batch):
        return any(MARK <= t < MARK + 3584 for ev in item.events for t in getattr(ev, "token_ids", ()))
    return False


def _chunks_alive() -> int:
    """Lists shaped like a subscriber chunk, [(source slot, payload bytes or Batch), ...], holding a
    payload of this test's (token ids from MARK), alive now."""
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if type(o) is list
        and o
        and all(type(i) is tuple and len(i) == 2 and type(i[0]) is int for i in o)
        and any(_ours(i[1]) for i in o)
    )


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("inline_max", [0, 64])
def test_once_applied_no_chunk_of_messages_stays_in_memory(
    make_pub: Callable[..., KVEventPublisher],
    make_index: Callable[..., KVIndex],
    native: bool,
    inline_max: int,
) -> None:
    """The ingest thread let go of a chunk only when the next work arrived: after a burst, its last
    chunk (up to max_chunk messages of every source that was ready) stayed in memory while the router
    idled, megabytes after a drain (RSS per block). ``inline_max = 0``: every chunk
    goes through the ingest thread; 64: small ones are applied by the receiving thread."""
    pub = make_pub()
    idx = make_index(connect(pub), native_receive=native, inline_max=inline_max)
    c = Chain(MARK)
    publish_until_seen(pub, idx, c)
    wait_for(lambda: status(idx).bootstrap == "done", "bootstrap replay over")
    for _ in range(40):
        pub.publish([c.extend(2), c.extend(1)])
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "the burst indexed")
    wait_for(lambda: _chunks_alive() == 0, "no chunk held once applied")


def test_a_backlog_beyond_the_receive_high_water_mark_waits_and_loses_nothing(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A SUB socket whose queue is full (``rcvhwm``) stops reading its connection instead of dropping:
    the backlog waits in the kernel and the publisher's queue. What the low default rests on (no
    replay socket here: a dropped batch could not come back)."""
    pub = make_pub(replay_endpoint=None)
    idx = make_index(connect(pub), rcvhwm=8, apply_queue=1, max_chunk=4)
    c = Chain(1100)
    publish_until_seen(pub, idx, c)
    gate = threading.Event()

    def hold() -> None:
        gate.wait(TIMEOUT)

    idx.subscriber._submit(hold)  # the ingest thread held
    try:
        for _ in range(400):
            pub.publish([c.extend(1)])
    finally:
        gate.set()
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "every batch of the backlog indexed")
    st = status(idx)
    assert st.gaps == 0 and st.lost_batches == 0


@pytest.mark.parametrize(("inline_max", "thread"), [(64, "kv-subscriber"), (0, "kv-ingest")])
def test_at_a_steady_rate_the_receiving_thread_applies_small_chunks_itself(
    make_pub: Callable[..., KVEventPublisher],
    make_index: Callable[..., KVIndex],
    inline_max: int,
    thread: str,
) -> None:
    """A message or two per wake-up, with the ingest thread idle: applied where it was received (no
    hand-over, no second thread woken per message); ``inline_max = 0`` hands every chunk over."""
    pub = make_pub()
    idx = make_index(connect(pub), inline_max=inline_max)
    c = Chain(1300)
    publish_until_seen(pub, idx, c)
    wait_for(lambda: status(idx).bootstrap == "done", "bootstrap replay over")
    ing = idx.ingestor
    real = ing.apply_chunk
    where: list[str] = []

    def recording(chunk: Any) -> Any:
        where.append(threading.current_thread().name)
        return real(chunk)

    ing.apply_chunk = recording  # type: ignore[method-assign]
    try:
        for _ in range(5):
            pub.publish([c.extend(1)])
            wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "the block indexed")
        assert where and set(where) == {thread}
        assert status(idx).gaps == 0
        # an engine restart's drop of its source (which can take a while) goes to the ingest thread
        where.clear()
        pub.restart()
        pub.publish([Chain(1500, seed=2).extend(1)])
        wait_for(lambda: status(idx).restarts == 1 and matched(idx, c.tokens) == 0, "the restart applied")
        assert where and where[0] == "kv-ingest"  # (the chunk with the drop)
    finally:
        del ing.apply_chunk


def rebound(make: Callable[[], KVEventPublisher]) -> KVEventPublisher:
    """A publisher on the addresses of one just closed: libzmq releases a closed socket's address
    in its I/O thread, a moment later, so binding it again is retried until it is free."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return make()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def pulse_until(pub: KVEventPublisher, cond: Callable[[], bool], what: str) -> None:
    """Empty batches until ``cond``: after a reconnection a PUB drops what it sends until the
    subscription has reached its new socket, so a chain block sent at once could be lost."""
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pub.publish([])
        time.sleep(0.01)


def test_a_restarted_engine_that_published_nothing_is_dropped_once_reconnected(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """A new engine process on the old one's addresses has an empty replay buffer: the bootstrap of
    the reconnection says so before the engine publishes anything (a running engine always buffers
    its latest batch), so its old blocks go at once, not at its first batch."""
    old_pub = make_pub()
    idx = make_index(connect(old_pub))
    old = _indexed(old_pub, idx)
    endpoint, replay = old_pub.endpoint, old_pub.replay_endpoint
    old_pub.close()
    new_pub = rebound(lambda: make_pub(endpoint=endpoint, replay_endpoint=replay))  # nothing published
    wait_for(lambda: status(idx).restarts == 1, "the restart inferred from the empty bootstrap")
    wait_for(lambda: matched(idx, old.tokens) == 0, "its blocks dropped (by the ingest thread)")
    assert status(idx).blocks.get("GPU", 0) == 0 and status(idx).lost_batches == 0
    # its stream then starts at seq 0 like any new engine's
    pulse_until(new_pub, lambda: status(idx).last_seq >= 0, "the new engine's stream")
    new = Chain(5000, seed=1)
    new_pub.publish([new.extend(2)])
    wait_for(lambda: matched(idx, new.tokens) == 2, "the new engine's first blocks")
    assert status(idx).restarts == 1 and status(idx).lost_batches == 0


def test_a_reconnection_to_the_same_engine_keeps_its_blocks(
    make_pub: Callable[..., KVEventPublisher], make_index: Callable[..., KVIndex]
) -> None:
    """The same engine behind a dropped live connection (its replay connection stays up, so no
    reconnection is seen: the subscriber watches the replay socket's connection, not a monitor per
    SUB): what its PUB dropped while the subscription came back shows as a gap, which the replay
    brings back, and nothing is dropped or lost."""
    pub = make_pub()
    idx = make_index(connect(pub))
    c = _indexed(pub, idx)
    pub.drop_connections()
    last = status(idx).last_seq
    pulse_until(pub, lambda: status(idx).last_seq > last, "the stream back")
    pub.publish([c.extend(1)])
    wait_for(lambda: matched(idx, c.tokens) == len(c.hashes), "live after the reconnection")
    wait_for(lambda: status(idx).last_seq == pub.next_seq - 1, "every batch applied")
    st = status(idx)
    assert st.restarts == 0 and st.lost_batches == 0 and st.bootstrap == "done"
