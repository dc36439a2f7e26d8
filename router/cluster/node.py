"""One router replica's link to the others: what it sends, what it hears, and how it survives the store.

:class:`Cluster` is a :class:`~router.fleet.load.PeerLoads` (added with ``LoadTracker.add_peers``): the
load tracker tells it this replica's own in-flight figures as they change and reads the peers' sums
for every candidate. It also hears of every prediction this replica makes (``KVIndex``'s prediction
listener) and every session pin (``SessionAffinity.listener``). None of these calls waits for
anything: they note what changed and wake the sender.

Tasks, all on the router's event loop, none on the request path:

- the *sender* publishes what changed (absolute figures of the targets that changed, the new
  predictions and pins) as one message, at most one per ``publish_interval_s`` and one in flight
  (a change after a quiet spell goes out on the loop's next turn; under load changes collect until
  the interval is up and the previous message is answered), and every ``heartbeat_s`` the whole
  table, which is also stored as this replica's snapshot (a key expiring after ``peer_timeout_s``)
  for replicas that join or reconnect later. It is not a task but a timer callback that writes the
  message, and a callback on its reply: a message costs no task switch, no event and no timer of
  its own (a reply missing for ``connect_timeout_s`` is caught by the heartbeat, so a store that
  hangs on commands counts as down within that and one heartbeat);
- the *receiver* applies the peers' messages: their figures to the :class:`PeerTable`, their
  predictions to the index (``KVIndex.predict_keys``), their pins to the affinity map. It also reads
  this replica's own messages coming back from the store: the time from a change to its echo is the
  sharing lag (``kvrouter_cluster_lag_seconds``, one clock), and a channel silent for three
  heartbeats (own ones included) is a dead connection;
- the *heartbeat* re-sends the full table, drops peers silent for ``peer_timeout_s`` (this replica's
  clock) and purges expired pins.

When the store fails, decisions go on with local state (the peers' last figures until they expire,
then this replica's own), every failure is counted and logged once per outage, and the connection is
retried with jittered exponential backoff (``reconnect_min_s`` to ``reconnect_max_s``). On
reconnecting, the replica reads the peers' snapshots and the stored pins, then sends its full table.
A reply that breaks RESP or the ``max_reply_*`` limits closes the connection (counted as kind
``protocol``); the next successful connect then does not reset the delay, so a store that answers
the handshake and breaks every reply after it is retried ever more slowly, not at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from index.kvindex import KVIndex
from router.cluster.affinity import SessionAffinity
from router.cluster.config import ClusterConfig
from router.cluster.peers import Figures, PeerTable
from router.cluster.resp import ProtocolError, ReplyLimits
from router.cluster.store import RedisStore
from router.cluster.wire import (
    VERSION,
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
    unpack_keys,
)
from router.fleet.load import PeerColumns, Target, TargetLoad
from router.observe.metrics import LeanHistogram

log = logging.getLogger("kvrouter.cluster")

_ZERO: Figures = (0, 0, 0)
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_MAX_UNACKED = 4096


class ClusterStats:
    """Counters of the link (exported by :mod:`router.cluster.metrics`)."""

    def __init__(self) -> None:
        self.messages = {"sent": 0, "received": 0}
        self.bytes = {"sent": 0, "received": 0}
        self.predicted_keys = {"sent": 0, "received": 0}
        self.pins = {"sent": 0, "received": 0}
        self.failures = {"connect": 0, "publish": 0, "receive": 0, "decode": 0, "protocol": 0}
        """``protocol``: the store broke RESP or a reply limit (cluster.max_reply_*), whatever the
        link was doing; the connection was closed."""
        self.dropped = {"predictions": 0, "pins": 0}
        self.connects = 0
        self.ignored = 0
        """Messages of another wire version."""
        self.lag = LeanHistogram(
            "kvrouter_cluster_lag_seconds",
            "From a change of this replica's shared state to its message coming back from the store",
            [],
            _LAG_BUCKETS,
        )


def redact(url: str) -> str:
    """The store URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class Cluster:
    """This replica's shared state: a PeerLoads view plus the store link (see the module docstring)."""

    def __init__(
        self,
        config: ClusterConfig,
        index: KVIndex,
        affinity: SessionAffinity | None = None,
        *,
        name: str = "",
        group: str = "",
        store: RedisStore | None = None,
    ) -> None:
        if config.redis_url is None:
            raise ValueError("a cluster needs cluster.redis_url")
        self.config = config
        self.index = index
        self.affinity = affinity
        self.id = uuid.uuid4().hex[:16]
        self.name = name or self.id
        self.group = group
        self.table = PeerTable(group)
        self.store = store or RedisStore(
            config.redis_url,
            config.connect_timeout_s,
            f"kvrouter-{self.id}",
            ReplyLimits(config.max_reply_bytes, config.max_reply_items, config.max_reply_depth),
        )
        p = config.key_prefix
        self.channel = f"{p}:cluster"
        self.registry = f"{p}:replicas"
        self.state_key = f"{p}:replica:{{}}"
        self.session_key = f"{p}:session:{{:016x}}"
        self.stats = ClusterStats()
        self.connected = False
        self.since = time.monotonic()
        """When ``connected`` last changed."""
        self.last_error = ""
        self.lag_mean = 0.002
        """Moving mean of the lag of this replica's own messages (capped at 50 ms per sample)."""
        self._own: dict[Target, Figures] = {}
        self._dirty: set[Target] = set()
        self._full = True
        self._preds: list[tuple[Target, int, Sequence[int], float]] = []
        self._pending_keys = 0
        self._pins: dict[int, tuple[Target, float]] = {}
        self._seq = 0
        self._first_change: float | None = None
        self._last_message = 0.0
        self._subscribed_at = 0.0
        self._unacked: dict[int, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_at: asyncio.Handle | None = None
        """The sender's next turn, when one is scheduled."""
        self._last_sent = float("-inf")
        """When (the loop's clock) the sender last took a message."""
        self._in_flight: tuple[int, float, int] | None = None
        """The message awaiting its reply: (link generation, sent at, bytes)."""
        self._generation = 0
        """Counts connections: a reply callback of an earlier one changes nothing."""
        self._broken: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._down_logged = False
        if affinity is not None:
            affinity.listener = self.pinned

    # --- PeerLoads -------------------------------------------------------------------------------
    def track(self, target: Target) -> None:
        """A target joined this replica's fleet (nothing to send until it has load; the peers'
        sums for it kept where decisions read them)."""
        self.table.watch(target)

    def forget(self, target: Target) -> None:
        """A target left this replica's fleet: its figures go to zero for the peers."""
        self.table.unwatch(target)
        if self._own.pop(target, None) is not None:
            self._changed(target)

    def publish(self, target: Target, load: TargetLoad) -> None:
        """This replica's own figures for a target changed."""
        figures = (load.active, load.prefilling, load.pending_prefill_tokens)
        if figures == _ZERO:
            if self._own.pop(target, None) is None:
                return
        else:
            self._own[target] = figures
        self._changed(target)

    def others(self, target: Target) -> tuple[int, int, int]:
        """The peers' summed figures for a target."""
        return self.table.totals.get(target, _ZERO)

    def slot_of(self, target: Target) -> int:
        """Where :meth:`columns` keeps a target's peers' sums (-1: nowhere)."""
        return self.table.slot_of(target)

    def columns(self) -> PeerColumns:
        """The peers' sums of this replica's targets, one row per slot."""
        return PeerColumns(self.table.cells, 0, 3, 1, -1)

    def _changed(self, target: Target) -> None:
        self._dirty.add(target)
        self._kick()

    def _kick(self) -> None:
        if self._first_change is None:
            self._first_change = time.monotonic()
        if self._flush_at is None and self._in_flight is None and self._loop is not None:
            self._schedule()

    # --- sending -------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """The sender's next turn: at once after a quiet spell, else when the interval is up."""
        loop = self._loop
        assert loop is not None
        at = self._last_sent + self.config.publish_interval_s
        if at <= loop.time():
            self._flush_at = loop.call_soon(self._flush)
        else:
            self._flush_at = loop.call_at(at, self._flush)

    def _flush(self) -> None:
        """The sender's turn: write what changed as one message (nothing waits for the reply)."""
        self._flush_at = None
        loop = self._loop
        assert loop is not None
        self._last_sent = loop.time()
        if not self.connected:
            self._drop_pending()
            return
        taken = self._take()
        if taken is None:
            return
        payload, sets, full = taken
        generation = self._generation
        try:
            self.store.publish_nowait(
                self.channel,
                payload,
                sets,
                (self.registry, self.id, self.name) if full else None,
                lambda exc: self._answered(generation, exc),
            )
        except self.store.errors as exc:
            self._publish_failed(exc)
            return
        self._in_flight = (generation, self._last_sent, len(payload))

    def _answered(self, generation: int, exc: BaseException | None) -> None:
        """The store's reply to the message in flight (or its failure)."""
        flight = self._in_flight
        if generation != self._generation or flight is None:
            return  # (a connection already given up)
        self._in_flight = None
        if exc is not None:
            self._publish_failed(exc)
            return
        st = self.stats
        st.messages["sent"] += 1
        st.bytes["sent"] += flight[2]
        pending = self._full or self._dirty or self._preds or self._pins
        if pending and self._flush_at is None and self._loop is not None:
            self._schedule()

    def _publish_failed(self, exc: BaseException) -> None:
        self._failed("publish", exc)
        self._full = True
        if self._broken is not None:
            self._broken.set()

    def _stalled(self, now: float) -> bool:
        """Whether the message in flight has waited longer than ``connect_timeout_s`` (the loop's
        clock): the store hangs, and counts as down."""
        flight = self._in_flight
        return flight is not None and now - flight[1] > self.config.connect_timeout_s

    def unseen_window(self) -> float:
        """How long a peer's decision may stay invisible here: a publish interval plus the lag."""
        return self.config.publish_interval_s + self.lag_mean

    DECIDING_S = 5.0
    """A peer counts as deciding (for the assumption of concurrent decisions) this long after a
    message last showed it dispatching a request."""

    def replica_keys(self, now: float | None = None) -> list[str]:
        """One key per live peer process that is deciding requests (its worker group, or its id when
        it runs alone). An idle peer (a standby, or one the balancer sends nothing) makes no decisions
        to assume: counting it added phantom load to every burst of the one replica that did all the
        routing."""
        now = time.monotonic() if now is None else now
        return [p.group or p.id for p in self.table.peers.values() if now - p.last_decided <= self.DECIDING_S]

    # --- predictions and pins made here ------------------------------------------------------------
    def predicted(self, source: Target, block_size: int, keys: Sequence[int], ttl_s: float) -> None:
        """KVIndex's prediction listener: share the unconfirmed blocks of a prediction."""
        if not self.config.share_predictions or not keys:
            return
        if not self.connected or self._pending_keys + len(keys) > self.config.max_pending_keys:
            self.stats.dropped["predictions"] += 1
            return
        self._preds.append((source, block_size, keys, time.monotonic() + ttl_s))
        self._pending_keys += len(keys)
        self._kick()

    def pinned(self, session: int, target: Target, ttl_s: float) -> None:
        """SessionAffinity's listener: share a pin (the last one per session in an interval wins)."""
        if not self.connected:
            self.stats.dropped["pins"] += 1
            return
        self._pins.pop(session, None)
        self._pins[session] = (target, time.monotonic() + ttl_s)
        self._kick()

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the link (returns at once: decisions never wait for the store)."""
        if self._tasks:
            return
        self._broken = asyncio.Event()
        loop = self._loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(), name="kvrouter-cluster-link"),
            loop.create_task(self._heartbeat(), name="kvrouter-cluster-heartbeat"),
        ]

    async def stop(self) -> None:
        """Say goodbye (peers drop this replica's load at once) and close the link."""
        tasks, self._tasks = self._tasks, []
        link, others = tasks[:1], tasks[1:]
        self._loop = None  # nothing is sent after the goodbye
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        await _cancel(others)
        if self.connected:
            self._seq += 1
            bye = encode(Message(replica=self.id, seq=self._seq, bye=True, group=self.group))
            try:
                await self.store.remove(
                    self.channel, bye, self.state_key.format(self.id), self.registry, self.id
                )
            except self.store.errors as exc:
                log.info("cluster: could not say goodbye (%s); peers expire this replica instead", exc)
        await _cancel(link)
        self._set_connected(False)
        self.store.close()

    def _set_connected(self, value: bool) -> None:
        if value != self.connected:
            self.connected = value
            self.since = time.monotonic()

    # --- the link ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.config
        delay = cfg.reconnect_min_s
        # the last connection ended by a protocol error: the delay is not reset by the next connect,
        # so a store that answers the handshake and then breaks a reply is not reconnected to at
        # once, over and over (it was, some 7 times a second by default), but ever more slowly
        violated = False
        while True:
            try:
                self._last_message = self._subscribed_at = time.monotonic()
                await self.store.open(self.channel, self._on_message)
                await self._resync()
            except self.store.errors as exc:
                self._failed("connect", exc)
                self.store.close()
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, cfg.reconnect_max_s)
                continue
            self.stats.connects += 1
            if self._down_logged:
                log.warning("cluster: store %s reachable again; sharing resumed", redact(self.store.url))
            self._down_logged = False
            self._set_connected(True)
            if not violated:
                delay = cfg.reconnect_min_s
            assert self._broken is not None
            self._broken.clear()
            self._full = True
            self._kick()
            receiver = asyncio.get_running_loop().create_task(self._receive())
            broken = asyncio.get_running_loop().create_task(self._broken.wait())
            try:
                await asyncio.wait([receiver, broken], return_when=asyncio.FIRST_COMPLETED)
                if receiver.done() and not receiver.cancelled():
                    error = receiver.exception()
                    if error is not None:
                        self._failed("receive", error)
            finally:
                for t in (receiver, broken):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, *self.store.errors):
                        await t
                self._set_connected(False)
                self._unacked.clear()
                self._generation += 1  # (the reply callbacks of this connection change nothing now)
                self._in_flight = None
                violated = self.store.violation() is not None
                self.store.close()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            if violated:
                delay = min(delay * 2, cfg.reconnect_max_s)

    def _failed(self, kind: str, exc: BaseException) -> None:
        if isinstance(exc, ProtocolError):
            kind = "protocol"
        self.stats.failures[kind] += 1
        self.last_error = f"{kind}: {type(exc).__name__}: {exc}"
        if not self._down_logged:
            self._down_logged = True
            log.warning(
                "cluster: store %s failed (%s); deciding on local state, retrying",
                redact(self.store.url),
                self.last_error,
            )

    async def _resync(self) -> None:
        """Snapshots: the peers' last full tables and the stored session pins."""
        now = time.monotonic()
        timeout = self.config.peer_timeout_s
        for value, ttl_ms in await self.store.read_states(self.registry, self.state_key):
            try:
                msg = decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.stats.failures["decode"] += 1
                continue
            if msg.replica == self.id or msg.version != VERSION:
                continue
            known = self.table.peers.get(msg.replica)
            if known is not None and known.last_heard >= self._subscribed_at:
                continue  # heard live since subscribing: newer than its snapshot
            age = max(0.0, timeout - ttl_ms / 1000)  # the store's clock, not the peer's
            peer = self.table.heard(msg.replica, now - age)
            if peer is not None:
                peer.name = msg.name or peer.name
                peer.group = msg.group
                self.table.set_loads(peer, msg.loads, True, now - age)
        if self.affinity is not None:
            pattern = self.session_key.split("{")[0] + "*"
            for key, value, ttl_ms in await self.store.scan_values(pattern, self.affinity.max_sessions):
                try:
                    sid = int(key.rsplit(":", 1)[1], 16)
                    backend, rank = msgspec.msgpack.decode(value, type=tuple[str, int])
                except (ValueError, IndexError, msgspec.DecodeError, msgspec.ValidationError):
                    self.stats.failures["decode"] += 1
                    continue
                if self.affinity.pinned(sid) is None:
                    self.affinity.pin(sid, (backend, rank), ttl_ms / 1000, announce=False)

    def _on_message(self, data: bytes) -> None:
        now = time.monotonic()
        self._last_message = now
        self.apply(data, now)

    async def _receive(self) -> None:
        """Watch the subscription: returns (raises) when a connection is lost, or when the channel
        has been silent for three heartbeats (this replica's own heartbeats come back on it; a
        heartbeat waits for the publish interval when that is longer, so three of those)."""
        silent_limit = 3 * max(self.config.heartbeat_s, self.config.publish_interval_s)
        lost = asyncio.ensure_future(self.store.lost())
        try:
            while True:
                done, _ = await asyncio.wait([lost], timeout=self.config.heartbeat_s)
                if done:
                    raise self.store.violation() or ConnectionError("connection to the store lost")
                silent = time.monotonic() - self._last_message
                if silent > silent_limit:
                    raise TimeoutError(f"nothing on {self.channel} for {silent:.1f} s")
        finally:
            lost.cancel()

    def apply(self, data: bytes, now: float) -> None:
        """Apply one message from the channel (a peer's, or this replica's own coming back)."""
        st = self.stats
        try:
            msg = decode_head(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            st.failures["decode"] += 1
            log.debug("cluster: undecodable message skipped: %s", exc)
            return
        if msg.version != VERSION:
            st.ignored += 1
            return
        st.messages["received"] += 1
        st.bytes["received"] += len(data)
        if msg.replica == self.id:
            sent = self._unacked.pop(msg.seq, None)
            if sent is not None:
                st.lag.observe((), now - sent)
                self.lag_mean += 0.1 * (min(now - sent, 0.05) - self.lag_mean)
            self._apply_pins(msg.pins)  # the store's order settles races between replicas
            return
        if msg.bye:
            if self.table.drop(msg.replica) is not None:
                log.info("cluster: replica %s left", msg.name or msg.replica)
            return
        try:
            loads = loads_of(msg)
            predictions = predictions_of(msg) if self.config.share_predictions else []
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            st.failures["decode"] += 1
            log.debug("cluster: undecodable message skipped: %s", exc)
            return
        peer = self.table.heard(msg.replica, now, msg.seq)
        if peer is None:
            return
        if msg.name:
            peer.name = msg.name
        peer.group = msg.group
        self.table.set_loads(peer, loads, msg.full, now)
        if predictions:
            for p in predictions:
                try:
                    keys = unpack_keys(p.keys)
                except ValueError:
                    st.failures["decode"] += 1
                    continue
                st.predicted_keys["received"] += len(keys)
                self.index.predict_keys((p.backend, p.rank), p.block_size, keys, now + p.ttl_ms / 1000)
        self._apply_pins(msg.pins)

    def _apply_pins(self, pins: list[Pin]) -> None:
        if self.affinity is None or not pins:
            return
        self.stats.pins["received"] += len(pins)
        for p in pins:
            self.affinity.pin(p.session, (p.backend, p.rank), p.ttl_ms / 1000, announce=False)

    def _drop_pending(self) -> None:
        if self._preds:
            self.stats.dropped["predictions"] += len(self._preds)
            self._preds = []
            self._pending_keys = 0
        if self._pins:
            self.stats.dropped["pins"] += len(self._pins)
            self._pins = {}
        self._first_change = None

    def _take(self) -> tuple[bytes, list[tuple[str, bytes, int]], bool] | None:
        """The next message (and the keys to set with it), or None when nothing changed."""
        full = self._full
        if not (full or self._dirty or self._preds or self._pins):
            self._first_change = None
            return None
        now = time.monotonic()
        own = self._own
        if full:
            rows = [LoadRow(t[0], t[1], *f) for t, f in own.items()]
            # targets that changed and are idle again go along as zero rows: they tell the peers this
            # replica is routing (router/cluster/peers.py, PeerTable.set_loads)
            rows += [LoadRow(t[0], t[1], *_ZERO) for t in self._dirty if t not in own]
        else:
            rows = [LoadRow(t[0], t[1], *own.get(t, _ZERO)) for t in self._dirty]
        self._dirty = set()
        self._full = False
        preds = []
        for (backend, rank), size, keys, expiry in self._preds:
            ttl_ms = int((expiry - now) * 1000)
            if ttl_ms > 0:
                preds.append(Prediction(backend, rank, size, ttl_ms, pack_keys(keys)))
                self.stats.predicted_keys["sent"] += len(keys)
        self._preds = []
        self._pending_keys = 0
        pins = []
        sets: list[tuple[str, bytes, int]] = []
        for sid, ((backend, rank), expiry) in self._pins.items():
            ttl_ms = int((expiry - now) * 1000)
            if ttl_ms > 0:
                pins.append(Pin(sid, backend, rank, ttl_ms))
                sets.append((self.session_key.format(sid), msgspec.msgpack.encode((backend, rank)), ttl_ms))
        self.stats.pins["sent"] += len(pins)
        self._pins = {}
        self._seq += 1
        msg = Message(
            replica=self.id,
            seq=self._seq,
            full=full,
            name=self.name if full else "",
            group=self.group,
            loads=rows,
            predictions=preds,
            pins=pins,
        )
        payload = encode(msg)
        if full:
            snapshot = encode(msgspec.structs.replace(msg, predictions=[], pins=[]))
            sets.append((self.state_key.format(self.id), snapshot, int(self.config.peer_timeout_s * 1000)))
        if len(self._unacked) >= _MAX_UNACKED:  # echoes that never came back (a lost connection)
            self._unacked.clear()
        self._unacked[self._seq] = self._first_change if self._first_change is not None else now
        self._first_change = None
        return payload, sets, full

    async def _heartbeat(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_s)
            if self._stalled(asyncio.get_running_loop().time()):
                self._publish_failed(TimeoutError(f"no reply within {cfg.connect_timeout_s} s"))
            self._full = True
            self._kick()
            for peer in self.table.expire(time.monotonic(), cfg.peer_timeout_s):
                log.warning(
                    "cluster: replica %s silent for %.1f s: its load (%d in flight) is dropped",
                    peer.name or peer.id,
                    cfg.peer_timeout_s,
                    peer.inflight(),
                )
            if self.affinity is not None:
                self.affinity.purge()

    # --- observability -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The replica, the store link and every peer with the age of its last update."""
        now = time.monotonic()
        peers = []
        for p in sorted(self.table.peers.values(), key=lambda p: p.name or p.id):
            peers.append(
                {
                    "replica": p.id,
                    "name": p.name,
                    "same_process": bool(self.group) and p.group == self.group,
                    "age_s": round(now - p.last_heard, 3),
                    "seen_for_s": round(now - p.first_heard, 1),
                    "inflight": p.inflight(),
                    "targets": len(p.loads),
                    "messages": p.messages,
                    "missed": p.missed,
                }
            )
        st = self.stats
        return {
            "replica": self.id,
            "name": self.name,
            "store": redact(self.store.url),
            "connected": self.connected,
            "state_for_s": round(now - self.since, 1),
            "last_error": self.last_error,
            "publish_interval_s": self.config.publish_interval_s,
            "heartbeat_s": self.config.heartbeat_s,
            "peer_timeout_s": self.config.peer_timeout_s,
            "peers": peers,
            "expired_peers": self.table.expired,
            "messages": dict(st.messages),
            "bytes": dict(st.bytes),
            "failures": dict(st.failures),
            "dropped": dict(st.dropped),
            "connects": st.connects,
        }


async def _cancel(tasks: list[asyncio.Task[None]], within_s: float = 5.0) -> None:
    """Cancel the link's tasks and wait for them, at most ``within_s``: a shutdown never waits on a
    task stuck on a store (one still running is logged and left to the loop's end)."""
    for t in tasks:
        t.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=within_s)
    for t in pending:
        log.warning("cluster: task %s did not stop within %.0f s of its cancellation", t.get_name(), within_s)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.info("cluster: task %s ended with %r", t.get_name(), t.exception())


__all__ = ["Cluster", "ClusterStats", "redact"]
