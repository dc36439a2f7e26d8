"""index/zsock.py: the subscriber's sockets on libzmq directly, against pyzmq's on real sockets.

In this process pyzmq is imported (the tests' publishers), so zsock binds the libzmq pyzmq loaded and
the two kinds of sockets talk to each other, in one context too. What a router process does (no pyzmq
imported at all) runs in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from index import zsock

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ctx() -> Iterator[zsock.Context]:
    assert zsock.backend() is zsock
    c = zsock.Context()
    yield c
    c.term()


@pytest.fixture
def pctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _bound(pctx: zmq.Context[Any], kind: int) -> tuple[zmq.Socket[Any], int]:
    """A pyzmq socket of ``kind`` bound to an ephemeral port of 127.0.0.1, and that port."""
    sock = pctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, sock.bind_to_random_port("tcp://127.0.0.1")


def _recv(sock: zsock.Socket, timeout: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing arrived"
    return sock.recv_multipart(zsock.NOBLOCK)


def test_a_router_process_never_imports_pyzmq() -> None:
    script = """
import sys, time
from index import zsock
z = zsock.backend()
ctx = zsock.Context()
pub, sub = ctx.socket(1), ctx.socket(zsock.SUB)  # (1: PUB, which the router itself never makes)
for s in (pub, sub):
    s.setsockopt(zsock.LINGER, 0)
pub.bind("tcp://127.0.0.1:0")
sub.setsockopt(zsock.SUBSCRIBE, b"")
sub.connect(pub.getsockopt_string(zsock.LAST_ENDPOINT))
deadline = time.monotonic() + 30
while not sub.poll(10):
    assert time.monotonic() < deadline
    pub.send_multipart([b"t", b"x"])
print(z.__name__, sub.recv_multipart(zsock.NOBLOCK), zsock.native_receive(), "zmq" in sys.modules)
pub.close(); sub.close(); ctx.term()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    ).stdout.split()
    assert out == ["index.zsock", "[b't',", "b'x']", "True", "False"]


def test_sub_follows_its_topic_from_a_pyzmq_publisher(ctx: zsock.Context, pctx: zmq.Context[Any]) -> None:
    pub, port = _bound(pctx, zmq.PUB)
    sub = ctx.socket(zsock.SUB)
    try:
        sub.setsockopt(zsock.LINGER, 0)
        sub.setsockopt(zsock.RCVHWM, 1000)
        sub.setsockopt(zsock.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while not sub.poll(10):  # (until the subscription has reached the publisher)
            assert time.monotonic() < deadline
            pub.send_multipart([b"other", b"no"])
            pub.send_multipart([b"kv", b"\x00" * 8, b"payload"])
        assert sub.recv_multipart(zsock.NOBLOCK) == [b"kv", b"\x00" * 8, b"payload"]
        with contextlib.suppress(zsock.Again):  # (more of the loop's copies may be queued)
            while True:
                assert sub.recv_multipart(zsock.NOBLOCK) == [b"kv", b"\x00" * 8, b"payload"]
        pub.send_multipart([b"other", b"no"])
        pub.send_multipart([b"kv", b"", b"2"])
        assert _recv(sub) == [b"kv", b"", b"2"]  # the other topic never arrived in between
    finally:
        sub.close()
        pub.close()


def test_dealer_round_trip_with_a_pyzmq_router(ctx: zsock.Context, pctx: zmq.Context[Any]) -> None:
    router, port = _bound(pctx, zmq.ROUTER)
    dealer = ctx.socket(zsock.DEALER)
    try:
        dealer.setsockopt(zsock.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"", (5).to_bytes(8, "big")])
        assert router.poll(10_000)
        ident, empty, start = router.recv_multipart()
        assert (empty, start) == (b"", (5).to_bytes(8, "big"))
        big = os.urandom(1 << 20)
        router.send_multipart([ident, b"", b"\x00" * 8, big])
        assert _recv(dealer) == [b"", b"\x00" * 8, big]
    finally:
        dealer.close()
        router.close()


def test_errors_carry_libzmqs_errno_and_message(ctx: zsock.Context, pctx: zmq.Context[Any]) -> None:
    sock = ctx.socket(zsock.SUB)
    taken = pctx.socket(zmq.PUB)
    try:
        sock.setsockopt(zsock.LINGER, 0)
        with pytest.raises(zsock.Again) as again:
            sock.recv_multipart(zsock.NOBLOCK)
        assert again.value.errno == errno.EAGAIN and isinstance(again.value, zsock.ZMQError)
        with pytest.raises(zsock.ZMQError) as bad:
            sock.connect("nonsense://here")
        with pytest.raises(zmq.ZMQError) as theirs:
            taken.connect("nonsense://here")
        # libzmq's message, as pyzmq's (which appends the address; the subscriber's log names it)
        assert bad.value.errno == theirs.value.errno == errno.EPROTONOSUPPORT
        assert str(bad.value) == zmq.strerror(bad.value.errno) == "Protocol not supported"
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(zsock.ZMQError) as busy:
            sock.bind(f"tcp://127.0.0.1:{port}")
        assert busy.value.errno == errno.EADDRINUSE and str(busy.value) == "Address already in use"
    finally:
        sock.close()
        taken.close(0)


def test_a_monitor_reports_the_connection(ctx: zsock.Context, pctx: zmq.Context[Any]) -> None:
    pub, port = _bound(pctx, zmq.PUB)
    sub = ctx.socket(zsock.SUB)
    sub.setsockopt(zsock.LINGER, 0)
    mon = sub.get_monitor_socket(zsock.EVENT_CONNECTED | zsock.EVENT_DISCONNECTED)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        frames = _recv(mon)
        assert len(frames) == 2 and int.from_bytes(frames[0][:2], sys.byteorder) == zsock.EVENT_CONNECTED
        assert frames[1] == f"tcp://127.0.0.1:{port}".encode()
        pub.close()
        frames = _recv(mon)
        assert int.from_bytes(frames[0][:2], sys.byteorder) == zsock.EVENT_DISCONNECTED
    finally:
        sub.disable_monitor()
        mon.close(0)
        sub.close()
        pub.close(0)


def test_the_poller_watches_sockets_and_file_descriptors(ctx: zsock.Context) -> None:
    a, b = ctx.socket(zsock.PAIR), ctx.socket(zsock.PAIR)
    r, w = os.pipe()
    poller = zsock.Poller()
    try:
        b.bind("inproc://test-poller")
        a.connect("inproc://test-poller")
        poller.register(b, zsock.POLLIN)
        poller.register(r, zsock.POLLIN)
        poller.register(r, zsock.POLLIN)  # (twice: still once)
        assert poller.poll(0) == []
        os.write(w, b"!")
        assert poller.poll(10_000) == [(r, zsock.POLLIN)]
        os.read(r, 1)
        a.send_multipart([b"m"])
        assert poller.poll(10_000) == [(b, zsock.POLLIN)]
        poller.unregister(b)
        assert poller.poll(0) == []
        assert b.recv_multipart(zsock.NOBLOCK) == [b"m"]
    finally:
        os.close(r)
        os.close(w)
        a.close(0)
        b.close(0)
        b.close(0)  # (closing twice is harmless)


def test_sockets_made_in_a_shadowed_pyzmq_context_reach_pyzmqs(pctx: zmq.Context[Any]) -> None:
    """One libzmq: a pyzmq context passed to the router (tests do) hosts our sockets too; inproc
    endpoints only connect within one context of one library."""
    mine = zsock.context_of(pctx)
    assert isinstance(mine, zsock.Context) and mine.underlying == pctx.underlying
    theirs = pctx.socket(zmq.PAIR)
    ours = mine.socket(zsock.PAIR)
    try:
        theirs.bind("inproc://test-shadow")
        ours.connect("inproc://test-shadow")
        theirs.send_multipart([b"hello", b"there"])
        assert _recv(ours) == [b"hello", b"there"]
        ours.send_multipart([b"back"])
        assert theirs.poll(10_000) and theirs.recv_multipart() == [b"back"]
    finally:
        ours.close(0)
        theirs.close(0)
        mine.term()  # (a shadow: never terminates pyzmq's context)
    assert not pctx.closed


FOLLOW = """
import logging, sys, time
import msgspec, zmq
from index import _kvcore, zsock
from index.kvindex import IndexConfig, KVIndex
from index.subscriber import SourceConfig
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
{prelude}
pctx = zmq.Context()
pub = pctx.socket(zmq.PUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
index = KVIndex(IndexConfig(block_size=2{index_cfg}){index_ctx})
index.add_source(SourceConfig("e", 0, f"tcp://127.0.0.1:{{port}}"))
index.start()
event = {{"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": None}}
seq, deadline = 0, time.monotonic() + 30
while not index.match([1, 2], [("e", 0)]).matches[("e", 0)].blocks:
    assert time.monotonic() < deadline
    pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event], 0])])
    seq += 1
    time.sleep(0.02)
import os
def names():
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            out.append(open(f"/proc/self/task/{{t}}/comm").read().strip())
        except OSError:
            pass  # (a thread gone meanwhile)
    return out
# a thread names itself once it runs: a second I/O thread expected is waited for (its count is read)
deadline = time.monotonic() + ({wait_io1} and 30)
while "ZMQbg/IO/1" not in names() and time.monotonic() < deadline:
    time.sleep(0.01)
names = names()
index.stop()
pub.close(0)
pctx.term()
# (pyzmq's context here has one I/O thread, "ZMQbg/IO/0": a second one is the index context's)
print(zsock.backend().__name__, index.subscriber._native, names.count("ZMQbg/IO/1"))
"""


def _follow(prelude: str = "", index_ctx: str = "", index_cfg: str = "", wait_io1: bool = False) -> str:
    """What a fresh interpreter prints after its index followed a pyzmq publisher's first event: the
    socket library, whether the C loop received, how many second ZeroMQ I/O threads ran."""
    script = FOLLOW.format(prelude=prelude, index_ctx=index_ctx, index_cfg=index_cfg, wait_io1=wait_io1)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    ).stdout


def test_without_a_bindable_libzmq_the_subscriber_runs_on_pyzmq() -> None:
    """Where no libzmq binds (a pyzmq built otherwise), the index still follows its streams, through
    pyzmq, and says so."""
    out = _follow(prelude="_kvcore.zmq_load = lambda path, errors: False", wait_io1=True)
    assert "libzmq could not be bound; the subscriber runs on pyzmq" in out
    assert out.split()[-3:] == ["zmq", "False", "1"]  # (pyzmq's context: two I/O threads too)


def test_a_temporary_pyzmq_context_passed_in_is_kept_alive() -> None:
    """The shadow holds pyzmq's context: collected, pyzmq would terminate it under our sockets (a
    hang while they are open, freed memory otherwise)."""
    out = _follow(index_ctx=", ctx=zmq.Context()")  # (nobody else holds this context)
    assert out.split() == ["index.zsock", "True", "0"]  # (a context passed in: its own I/O threads)


@pytest.mark.parametrize(("cfg", "second"), [("", "1"), (", subscriber=SubscriberConfig(io_threads=1)", "0")])
def test_the_subscribers_own_context_reads_with_io_threads_of_the_config(cfg: str, second: str) -> None:
    """Two I/O threads by default (a backlog of many sources is read by both), one when configured."""
    prelude = "from index.subscriber import SubscriberConfig"
    out = _follow(prelude=prelude, index_cfg=cfg, wait_io1=second == "1")
    assert out.split() == ["index.zsock", "True", second]


def test_a_context_has_the_io_threads_asked_for_and_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="io_threads"):
        zsock.Context(io_threads=0)
    c = zsock.Context(io_threads=3)
    sock = c.socket(zsock.SUB)  # (libzmq starts a context's I/O threads with its first socket)

    def names() -> list[str]:
        out = []
        for t in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # (a thread gone meanwhile)
                out.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        return out

    try:
        deadline = time.monotonic() + 30
        while "ZMQbg/IO/2" not in names():  # (each thread names itself once it runs)
            assert time.monotonic() < deadline, names()
            time.sleep(0.01)
    finally:
        sock.close()
        c.term()


def test_a_context_of_another_library_is_refused() -> None:
    class Foreign:
        underlying = id(object())  # (readable memory that is no libzmq context of ours)

    with pytest.raises(ValueError, match="another libzmq"):
        zsock.context_of(Foreign())


def test_close_closes_even_when_its_linger_cannot_be_set(ctx: zsock.Context) -> None:
    """Once the context terminates, setting LINGER fails (ETERM); the socket must close all the same,
    or term() would wait for it forever."""
    sock = ctx.socket(zsock.SUB)
    term = threading.Thread(target=ctx.term)
    term.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # (until the socket has seen term() begin: its calls then fail with ETERM)
            try:
                sock.recv_multipart(zsock.NOBLOCK)
            except zsock.Again:
                pass
            except zsock.ZMQError as exc:
                assert exc.errno == zmq.ETERM
                break
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(zsock.ZMQError):
            sock.setsockopt(zsock.LINGER, 0)  # what close(0) meets first
    finally:
        sock.close(0)
        term.join(30)
    assert not term.is_alive() and sock.closed


def test_a_message_is_sent_whole_or_not_at_all(ctx: zsock.Context) -> None:
    a, b = ctx.socket(zsock.PAIR), ctx.socket(zsock.PAIR)
    try:
        b.bind("inproc://test-whole")
        a.connect("inproc://test-whole")
        with pytest.raises(TypeError):
            a.send_multipart([b"first", "not bytes"])  # type: ignore[list-item]
        frames = [str(i).encode() for i in range(100)]
        a.send_multipart(frames)
        assert _recv(b) == frames  # (no stray first frame; every one of the 100)
    finally:
        a.close(0)
        b.close(0)
