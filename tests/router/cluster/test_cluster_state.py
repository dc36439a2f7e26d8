"""The replica-sharing pieces without a store: the wire format, the peer table's sums and expiry, the
session pins and their overload bound, the [cluster] config checks, and KVIndex.predict_keys."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from index.keys import prompt_keys
from index.kvindex import PREDICTED, IndexConfig, KVIndex
from router.cluster.affinity import SessionAffinity
from router.cluster.config import ClusterConfig, ClusterError, validate_cluster
from router.cluster.node import redact
from router.cluster.peers import PeerTable
from router.cluster.wire import (
    LoadRow,
    Message,
    Pin,
    Prediction,
    decode,
    decode_head,
    encode,
    loads_of,
    pack_keys,
    predictions_of,
    session_id,
    unpack_keys,
)
from router.config import ConfigError, parse_config
from router.decision.policy import CandidateScore, Decision

# --- wire ------------------------------------------------------------------------------------------


def test_message_round_trip_and_key_packing() -> None:
    keys = [0, 1, 2**64 - 1, 123456789012345678]
    msg = Message(
        replica="r1",
        seq=7,
        full=True,
        name="pod-a:8000",
        group="g",
        loads=[LoadRow("e0", 1, 2, 1, 640)],
        predictions=[Prediction("e0", 1, 16, 1500, pack_keys(keys))],
        pins=[Pin(session_id(b"abc"), "e1", 0, 600_000)],
    )
    back = decode(encode(msg))
    assert back == msg
    head = decode_head(encode(msg))  # what a replica reads of every message before the rest
    assert (head.replica, head.seq, head.full, head.name, head.group) == ("r1", 7, True, "pod-a:8000", "g")
    assert head.pins == msg.pins and not head.bye
    assert loads_of(head) == msg.loads and predictions_of(head) == msg.predictions
    bare = decode_head(encode(Message(replica="r2", seq=1, bye=True)))
    assert bare.bye and loads_of(bare) == [] and predictions_of(bare) == []
    bad = [1, "r3", 1, False, "", "", [["e0", "one", 1, 0, 0]], [], []]
    bad_row = decode_head(msgspec.msgpack.encode(bad))
    with pytest.raises(msgspec.ValidationError):  # a malformed row: found when the loads are read
        loads_of(bad_row)
    assert unpack_keys(back.predictions[0].keys) == keys
    assert len(pack_keys(keys)) == 8 * len(keys)
    with pytest.raises(ValueError):
        unpack_keys(b"1234567")
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode(b"\x93\x01\x02")
    assert session_id(b"abc") == session_id(b"abc") != session_id(b"abd")


# --- peer table ------------------------------------------------------------------------------------


def rows(*items: tuple[str, int, int, int, int]) -> list[LoadRow]:
    return [LoadRow(*i) for i in items]


def test_peer_sums_follow_changes_full_tables_and_expiry() -> None:
    t = PeerTable()
    a = t.heard("a", 100.0, 1)
    b = t.heard("b", 100.0, 1)
    assert a is not None and b is not None
    t.set_loads(a, rows(("e0", 0, 2, 1, 100), ("e1", 0, 1, 0, 0)), full=True)
    t.set_loads(b, rows(("e0", 0, 1, 1, 50)), full=False)
    assert t.others(("e0", 0)) == (3, 2, 150)
    assert t.others(("e1", 0)) == (1, 0, 0)
    t.set_loads(a, rows(("e0", 0, 1, 0, 0)), full=False)  # one finished its prefill and one ended
    assert t.others(("e0", 0)) == (2, 1, 50)
    t.set_loads(a, rows(), full=True)  # a full table without e1: e1 is idle at a now
    assert t.others(("e1", 0)) == (0, 0, 0) and t.others(("e0", 0)) == (1, 1, 50)
    t.heard("b", 103.0, 5)  # b's messages 2-4 never arrived
    assert t.peers["b"].missed == 3 and t.missed == 3
    gone = t.expire(104.0, timeout_s=3.5)  # a last heard at 100: silent 4 s
    assert [p.id for p in gone] == ["a"] and t.expired == 1
    assert t.others(("e0", 0)) == (1, 1, 50)
    t.drop("b")
    assert t.totals == {} and t.peers == {}


def test_a_peer_counts_as_deciding_only_when_its_messages_show_requests() -> None:
    t = PeerTable()
    a = t.heard("a", 10.0)
    assert a is not None and a.last_decided == float("-inf")
    t.set_loads(a, rows(), full=True, now=10.0)  # a heartbeat of an idle replica
    assert a.last_decided == float("-inf")
    t.set_loads(a, rows(("e0", 0, 1, 1, 64)), full=True, now=11.0)  # a request in flight
    assert a.last_decided == 11.0
    t.set_loads(a, rows(("e0", 0, 0, 0, 0)), full=True, now=12.0)  # one came and went: a zero row
    assert a.last_decided == 12.0
    t.set_loads(a, rows(("e1", 0, 0, 0, 0)), full=False, now=13.0)  # any change
    assert a.last_decided == 13.0
    t.set_loads(a, rows(("e1", 0, 2, 0, 0)), full=False)  # no clock given: not marked
    assert a.last_decided == 13.0


def test_sibling_workers_load_is_not_added_twice() -> None:
    t = PeerTable(group="host:/run/x")
    sib = t.heard("w1", 0.0)
    other = t.heard("r2", 0.0)
    assert sib is not None and other is not None
    sib.group = "host:/run/x"
    other.group = "elsewhere"
    t.set_loads(sib, rows(("e0", 0, 5, 5, 500)), full=True)
    t.set_loads(other, rows(("e0", 0, 1, 0, 0)), full=True)
    assert t.others(("e0", 0)) == (1, 0, 0)  # the sibling's 5 come through the local load board
    t.drop("w1")
    assert t.others(("e0", 0)) == (1, 0, 0)


def test_peer_table_is_bounded() -> None:
    t = PeerTable()
    t.MAX_PEERS = 2
    assert t.heard("a", 0.0) and t.heard("b", 0.0)
    assert t.heard("c", 0.0) is None and t.refused == 1


# --- session affinity ------------------------------------------------------------------------------


def score(backend: str, inflight: int, chosen: bool = False) -> CandidateScore:
    return CandidateScore(backend, 0, 0, {}, 0.0, 0.0, 0.0, inflight, 0.0, 0.0, chosen)


def decision(chosen: str, loads: dict[str, int]) -> Decision:
    return Decision(chosen, 0, "load", [score(b, n, b == chosen) for b, n in loads.items()])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_pins_steer_within_the_load_bound_and_expire() -> None:
    clock = Clock()
    aff = SessionAffinity("X-Session-Id", ttl_s=10.0, load_factor=2.0, max_sessions=100, clock=clock)
    heard: list[Any] = []
    aff.listener = lambda s, t, ttl: heard.append((s, t, ttl))
    sid = aff.session_of([(b"x-session-id", b"conv-1")])
    assert sid == session_id(b"conv-1") and aff.session_of([(b"other", b"v")]) is None
    d = decision("e0", {"e0": 0, "e1": 0, "e2": 0})
    assert aff.steer(sid, d) == "new" and aff.pinned(sid) == ("e0", 0)
    assert heard == [(sid, ("e0", 0), 10.0)]
    # the policy now prefers e1; e0 holds 2 of 3 in flight: capacity ceil(2 * 4 / 3) = 3 >= 2 + 1
    d = decision("e1", {"e0": 2, "e1": 1, "e2": 0})
    assert aff.steer(sid, d) == "steered"
    assert (d.backend, d.dp_rank) == ("e0", 0) and [s.chosen for s in d.candidates] == [True, False, False]
    # e0 at 4 of 5: capacity ceil(2 * 6 / 3) = 4 < 5: the policy's choice stands and becomes the pin
    d = decision("e2", {"e0": 4, "e1": 1, "e2": 0})
    assert aff.steer(sid, d) == "overloaded" and d.backend == "e2" and aff.pinned(sid) == ("e2", 0)
    d = decision("e1", {"e0": 0, "e1": 0})  # e2 is no candidate any more
    assert aff.steer(sid, d) == "unavailable" and aff.pinned(sid) == ("e1", 0)
    d = decision("e1", {"e0": 0, "e1": 0})
    assert aff.steer(sid, d, dry_run=True) == "kept"
    assert aff.results == {"new": 1, "kept": 0, "steered": 1, "overloaded": 1, "unavailable": 1}
    clock.now += 10.5  # idle longer than the TTL
    assert aff.pinned(sid) is None


def test_pins_are_bounded_least_recently_used_first() -> None:
    clock = Clock()
    aff = SessionAffinity("x-s", ttl_s=100.0, load_factor=2.0, max_sessions=3, clock=clock)
    for s in (1, 2, 3):
        aff.pin(s, ("e0", 0))
    aff.pin(1, ("e0", 0))  # renewed: now the most recent
    aff.pin(4, ("e1", 0))
    assert set(aff.pins) == {3, 1, 4} and aff.evicted == 1
    clock.now += 50
    aff.pin(5, ("e1", 0), ttl_s=1000)
    clock.now += 60  # 3, 1, 4 expired
    aff.purge()
    assert set(aff.pins) == {5}


# --- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"redis_url": "http://x"}, "cluster.redis_url"),
        ({"redis_url": "redis://"}, "cluster.redis_url"),
        ({"session_header": "bad header"}, "cluster.session_header"),
        ({"key_prefix": "a b"}, "cluster.key_prefix"),
        ({"heartbeat_s": 1.0, "peer_timeout_s": 1.5}, "cluster"),
        ({"publish_interval_s": 2.0}, "cluster.publish_interval_s"),
        ({"session_load_factor": 0.5}, "cluster"),
        ({"reconnect_min_s": 3.0, "reconnect_max_s": 1.0}, "cluster"),
        ({"redis_url": 5}, "cluster.redis_url"),
        ({"colour": "red"}, "cluster.colour"),
    ],
)
def test_cluster_config_errors_name_the_key(cluster: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], "cluster": cluster})
    assert str(err.value).startswith(message), str(err.value)


def test_cluster_config_accepts_tls_passwords_and_sockets() -> None:
    for url in ("rediss://user:pw@redis.example:6380/2", "redis://valkey:6379/0", "unix:///run/redis.sock"):
        validate_cluster(ClusterConfig(redis_url=url, session_header="x-session-id"))
    with pytest.raises(ClusterError):
        validate_cluster(ClusterConfig(max_sessions=0))
    assert redact("rediss://user:pw@h:6380/2") == "rediss://user:***@h:6380/2"
    assert redact("redis://:pw@h/0") == "redis://:***@h/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


# --- predictions from peers --------------------------------------------------------------------------


def test_predict_keys_extends_matches_and_tells_no_listener() -> None:
    index = KVIndex(IndexConfig(block_size=16, predict_ttl_s=5.0))
    try:
        source = ("e0", 0)
        index.store.add_source(source)
        told: list[Any] = []
        index.prediction_listener = lambda *a: told.append(a)
        tokens = list(range(64))
        keys = prompt_keys(tokens, 16)
        assert index.predict_keys(source, 16, keys, time.monotonic() + 5)
        m = index.match(tokens, [source]).matches[source]
        assert m.blocks == 4 and m.by_medium[PREDICTED] == 4
        assert told == []
        assert not index.predict_keys(source, 32, keys, time.monotonic() + 5)  # another block size
        assert not index.predict_keys(("nobody", 0), 16, keys, time.monotonic() + 5)
        assert not index.predict_keys(source, 16, keys, time.monotonic() - 1)  # already expired
        # a local prediction tells the listener the unconfirmed blocks only (here: all 4 are predicted)
        report = index.match(tokens + list(range(100, 132)), [source])
        index.predict(source, report)
        assert len(told) == 1 and told[0][0] == source and told[0][1] == 16 and len(told[0][2]) == 6
    finally:
        index.stop()


# --- the lean client against a real server: TLS, a password, a database ------------------------------


def test_store_client_over_tls_with_a_password(tmp_path: Path) -> None:
    import shutil
    import subprocess

    from router.cluster.resp import RespError
    from router.cluster.store import RedisStore
    from tests.redis_harness import RedisServer, _free_port

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    san = ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            *san,
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls_port = _free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--requirepass", "s3cret"]
    server = RedisServer(tmp_path, tls).start()
    try:
        base = f"rediss://:s3cret@127.0.0.1:{tls_port}/3"

        async def scenario() -> None:
            got: list[bytes] = []
            store = RedisStore(f"{base}?ssl_ca_certs={cert}", 5.0, "kvrouter-test")
            await store.open("chan", got.append)
            try:
                await store.publish("chan", b"\x00hello\r\n", [("k:1", b"v", 60_000)], ("reg", "1", "x"))
                deadline = time.monotonic() + 10
                while not got and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert got == [b"\x00hello\r\n"]  # binary-safe, through TLS
                assert await store.scan_values("k:*", 10) == [("k:1", b"v", pytest.approx(60_000, abs=5_000))]
                assert await store.read_states("reg", "k:{}") == [(b"v", pytest.approx(60_000, abs=5_000))]
            finally:
                store.close()
            for url, error in (
                (f"rediss://:wrong@127.0.0.1:{tls_port}/3?ssl_ca_certs={cert}", RespError),  # password
                (base, OSError),  # the server's certificate is not one the system trusts
            ):
                bad = RedisStore(url, 5.0)
                with pytest.raises(error):
                    await bad.open("chan", got.append)
                bad.close()
            insecure = RedisStore(f"{base}?ssl_cert_reqs=none", 5.0)
            await insecure.open("chan", got.append)
            insecure.close()

        asyncio.run(scenario())
    finally:
        server.stop()


# --- decisions other replicas are making now (router/cluster/unseen.py) -----------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _cands(loads: list[tuple[int, int]]) -> list[Any]:
    from router.decision.policy import Candidate
    from router.fleet.load import TargetLoad

    return [
        Candidate(f"e{i}", 0, 0, {}, TargetLoad(active=a, pending_prefill_tokens=p))
        for i, (a, p) in enumerate(loads)
    ]


def test_replica_ranks_count_processes_not_workers() -> None:
    from router.cluster.unseen import replica_ranks

    peers = ["b", "host:run1", "host:run1", "d"]  # two sibling workers of one process count once
    assert replica_ranks("c", lambda: peers)() == (1, 4)  # b < c < d < host:run1
    assert replica_ranks("a", lambda: [])() == (0, 1)
    assert replica_ranks("host:run1", lambda: ["host:run1", "z"])() == (0, 2)


def test_unseen_decisions_alone_in_steady_traffic_and_in_a_burst() -> None:
    from router.cluster.unseen import UnseenPeers

    clock = _Clock()
    rank = [(1, 3)]
    u = UnseenPeers(lambda: rank[0], lambda: 0.004, clock=clock)
    assert u.assumed() == 0.0  # no evidence of bursts yet: as before
    for _ in range(20):  # steady traffic, 50 ms apart
        clock.t += 0.05
        u.decided(10.0)
    clock.t += 0.05
    assert u.burst_share == 0.0 and u.assumed() == 0.0
    assert abs(u.request_blocks - 10.0 * (1 - 0.95**20)) < 1e-9
    u.decided(10.0)
    clock.t += 0.001  # 1 ms later: in a burst, one own decision in the window
    assert u.assumed() == 1 * (3 - 1) + 1
    u.decided(10.0)
    assert u.burst_share > 0
    clock.t += 0.001
    assert u.assumed() == 2 * 2 + 1  # two own decisions in the window
    clock.t += 0.01  # the window passed: the burst's next first request, weighted by the share
    assert u.assumed() == pytest.approx(1 * u.burst_share)
    rank[0] = (0, 3)  # the first replica in the order assumes nothing at a burst's start
    assert u.assumed() == 0.0
    rank[0] = (2, 2)
    clock.t += 0.0005
    u.decided(1.0)
    clock.t += 0.0005
    assert u.assumed() == 1 * 1 + 2
    rank[0] = (0, 1)  # alone again
    assert u.assumed() == 0.0
    for _ in range(200):  # a long burst is bounded
        u.decided(1.0)
    rank[0] = (5, 8)
    assert u.assumed() == UnseenPeers.MAX_ASSUMED


def test_staggered_bursts_hold_by_rank_and_assume_nothing() -> None:
    from router.cluster.unseen import UnseenPeers

    clock = _Clock()
    rank = [(2, 3)]
    u = UnseenPeers(lambda: rank[0], lambda: 0.004, clock=clock, stagger=True)
    assert u.hold_s() == 0.0  # no burst seen yet
    u.decided(5.0)
    clock.t += 0.001  # the next request 1 ms later: a burst
    assert u.hold_s() == pytest.approx(2 * 0.004) and u.assumed() == 0.0
    rank[0] = (0, 3)
    assert u.hold_s() == 0.0  # the first in the order decides at once
    rank[0] = (7, 8)
    assert u.hold_s() == UnseenPeers.MAX_HOLD_S  # bounded
    rank[0] = (1, 1)
    assert u.hold_s() == 0.0  # alone (or the store down: no peers)
    rank[0] = (1, 2)
    clock.t += 1.0  # quiet, and bursts are rare here: no hold
    assert u.burst_share < 0.5 and u.hold_s() == 0.0
    assert UnseenPeers(lambda: (1, 2), lambda: 0.004, clock=clock).hold_s() == 0.0  # off by default


def test_assumed_requests_go_to_the_least_loaded_and_move_the_choice() -> None:
    from router.cluster.unseen import UnseenPeers
    from router.decision.policy import Policy, PolicyConfig

    policy = Policy(PolicyConfig(), rng=__import__("random").Random(1))
    u = UnseenPeers(lambda: (2, 3), lambda: 0.004)
    u.request_blocks = 4.0  # each assumed request: 4 uncached blocks + decode_weight 2 = 6 units
    # e1 is idle, e0 and e2 each have one small request: e1 first, then the tie e0/e2, then ...
    cands = _cands([(1, 32), (0, 0), (1, 32)])  # 2 + 2 = 4 units on e0 and e2
    u.spread(policy, cands, 16, 2.0)
    assert [c.assumed_blocks for c in cands].count(0.0) == 1
    assert cands[1].assumed_blocks == 6.0  # the idle one takes the first
    d = policy.choose(8, 16, cands)
    chosen = next(c for c in d.candidates if c.chosen)
    assert chosen.assumed_blocks == 0.0  # ours goes where no assumed request went
    assert all(c.assumed_blocks == cand.assumed_blocks for c, cand in zip(d.candidates, cands, strict=True))
    # fractional: half a request on the idle candidate
    cands = _cands([(1, 0), (0, 0)])
    u.spread(policy, cands, 16, 0.5)
    assert [c.assumed_blocks for c in cands] == [0.0, 3.0]
    assert u.assumed_total == 2.5
    # a cached prefix still wins over an assumed request's load
    from router.decision.policy import Candidate
    from router.fleet.load import TargetLoad

    cached = Candidate("e0", 0, 8, {"GPU": 8}, TargetLoad())
    cands = [cached, Candidate("e1", 0, 0, {}, TargetLoad())]
    u.spread(policy, cands, 16, 1.0)
    assert policy.choose(8, 16, cands).backend == "e0"
