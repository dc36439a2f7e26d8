"""The ZeroMQ subscriber: one SUB socket per source (instance, DP rank), kept exactly in step.

Two threads, off the router's event loop: the receiving thread (woken by the sockets that have
something: :class:`index.zsock.ReadyPoller`, so an idle source costs nothing per wake-up)
drains what is queued at each wake-up (up to ``max_chunk`` messages per socket), does the sequence
bookkeeping below reading only each payload's seq and timestamp, and hands the raw payloads, in
order, to the ingest thread, which applies them with one C call per chunk without the GIL
(:meth:`index.ingest.Ingestor.apply_chunk`). So receiving, ingesting and the HTTP loop overlap on
two cores; at most ``apply_queue`` chunks wait between the two threads (beyond, the backlog stays in
ZMQ's bounded queues). Source removal goes through the same queue, after the source's last chunk.

Per source it tracks the sequence number of the last applied batch:

- next seq: applied.
- a **gap**: the missing batches are fetched from the engine's replay socket over a DEALER
  (``[b"", start_seq]``, replies until the end marker), without blocking other sources: live
  messages of that source are held meanwhile, then everything is applied in order. What the replay
  cannot supply (it fell out of the engine's buffer, or the replay timed out) is counted as lost.
- **first contact** (and every (re)connection of the SUB socket): a bootstrap replay from seq 0
  fetches what the engine still buffers, so a router that starts after the engines is not empty.
  An empty answer after a reconnection, from an engine whose batches were applied, means a new
  engine process that has published nothing yet (a running one always buffers its latest batch):
  its blocks are dropped then, as at a restart.
- a seq that **goes back** with a newer batch timestamp: the engine restarted; the source's blocks
  are dropped and rebuilt (with a bootstrap replay when the new stream did not start at 0). A seq
  that goes back with an old timestamp is a duplicate (e.g. live copies of replayed batches) and is
  skipped.
- a payload that does not decode is counted, logged with its source and skipped; the stream goes on.

Scale (thousands of sources in one process): a source costs one libzmq socket (its SUB) plus, with a
replay endpoint, its DEALER, which is also how its connection is seen (``ZMQ_IMMEDIATE``: the DEALER
can send only while connected, and its ZMQ_FD signals when that changes), or, without one, a
socket monitor (two sockets: libzmq's and ours; libzmq's stable API gives no way to share one
between sockets). The context's socket cap is raised from libzmq's 1,023 to what the descriptor
limit allows (raised itself first), replays in flight are capped (``max_replays``, the rest wait
their turn), and a socket that cannot be opened is reported once and retried with a capped
exponential backoff, without holding up the other sources (docs/scale.md).

Memory is bounded: ZMQ's receive high-water mark bounds queued messages (overflow shows up as a
gap, then a replay), held live messages during a replay are capped, and the store has its own cap.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

import index._kvcore as _kvcore
from index import fds, zsock
from index.ingest import Ingestor
from index.store import SourceId
from index.wire import END_SEQ, Batch, RawBatch, WireError, decode_seq, peek_message, split_replay_reply

log = logging.getLogger("kvrouter.subscriber")


def _monitor_event(frames: list[bytes]) -> int:
    """The event of a libzmq socket-monitor message (frame 1: uint16 event, uint32 value; frame 2:
    the endpoint), -1 for anything else. (pyzmq's zmq.utils.monitor does the same and more, but
    costs ~1 ms of every start to import.)"""
    if len(frames) != 2 or len(frames[0]) != 6:
        return -1
    return int.from_bytes(frames[0][:2], sys.byteorder)


class SourceConfig(msgspec.Struct, frozen=True):
    """One event stream: a DP rank of an engine."""

    instance: str
    dp_rank: int
    endpoint: str
    """ZMQ address of the engine's PUB socket (connect mode) or the address we bind (bind mode)."""
    replay_endpoint: str | None = None
    """Engine's replay ROUTER socket; None disables gap recovery and bootstrap."""
    bind: bool = False
    """True when the engine connects to us (vLLM's endpoint without ``*``)."""
    topic: str = ""
    """Topic to subscribe to; messages whose topic differs exactly are counted and skipped."""

    @property
    def source_id(self) -> SourceId:
        """(instance, DP rank)."""
        return (self.instance, self.dp_rank)


class SubscriberConfig(msgspec.Struct, frozen=True):
    """Tuning of the subscriber thread (defaults suit fleets of tens of engines)."""

    replay_timeout_s: float = 2.0
    """Give up on a replay after this long; what did not arrive is counted as lost."""
    replay_retry_s: float = 5.0
    """After a failed replay, gaps of that source are not replayed again for this long."""
    max_chunk: int = 512
    """Messages drained and indexed together per wake-up."""
    rcvhwm: int = 1000
    """ZMQ receive high-water mark per SUB socket (messages): how far libzmq's I/O threads read ahead
    of the receiving thread. A SUB socket whose queue is full stops reading its TCP connection, so
    what does not fit waits in the kernel's buffers and the engine's publisher queue (vLLM's
    SNDHWM, 100,000 by default), and only beyond that does the publisher drop, which shows up
    here as a gap, then a replay. libzmq's own default; it was 100,000, and then a backlog of every
    source was read into this process's heap at once (tens of MB per 200k blocks)."""
    max_held: int = 50_000
    """Live messages of one source held while its replay is in flight; beyond, the replay is abandoned."""
    poll_ms: int = 100
    """Poll timeout; bounds how late stop() and replay timeouts are noticed."""
    apply_queue: int = 4
    """Chunks received but not yet applied, at most (the ingest thread applies them in order)."""
    inline_max: int = 64
    """A chunk of at most this many messages is applied by the receiving thread itself when the
    ingest thread has nothing left to do: at an engine fleet's steady rate a chunk is a message or
    two, and handing each to the ingest thread cost a thread wake-up per message
    (paced ingest). A backlog's chunks (hundreds) still go to the ingest thread, so receiving and
    applying overlap. 0: every chunk to the ingest thread."""
    open_retry_s: float = 1.0
    """A source whose socket cannot be bound or connected is tried again after this long (a port
    still held by the socket it replaces is usually free a moment later), then after twice as
    long each time, up to ``open_retry_max_s``: a source that stays unopenable (no descriptor or
    socket left, an address refused) costs a try now and then, not one a second for good."""
    open_retry_max_s: float = 30.0
    """The longest wait between two tries of a source that cannot be opened."""
    max_replays: int = 256
    """Replay requests in flight at once; more wait their turn (their timeout runs from their
    sending). A router starting next to thousands of engines asks each for its buffer: all at once,
    the answers queued faster than they were read and replays timed out."""
    max_sockets: int = 0
    """The socket cap of the subscriber's own ZeroMQ context (ZMQ_MAX_SOCKETS; libzmq's default is
    1,023, ~340 sources); 0: the descriptor limit (each socket needs one), at most libzmq's 65,535."""
    raise_fd_limit: bool = True
    """Raise the process's soft descriptor limit to its hard limit when the subscriber is made (each
    source holds 2-4 descriptors; most processes start at 1,024)."""
    io_threads: int = 2
    """ZeroMQ I/O threads of the subscriber's own context (they read the SUB sockets, TCP to
    messages). Two, not libzmq's one: a backlog from many sources (a replica starting, a burst of
    engine steps) is read by both, the sockets split between them, instead of by one thread the
    receiving thread waits on (measured: a small gain in drains, no more CPU; an idle thread
    costs nothing). Unused with a context passed in."""
    native_receive: bool = True
    """Receive live messages in the C core (index/_kvrecv.h) when pyzmq's libzmq can be bound;
    False keeps the Python loop (same rules, ~7 us a message slower)."""


class SourceStatus(msgspec.Struct):
    """What an operator needs to judge one event stream (served by the router's debug endpoint)."""

    source: str
    instance: str
    dp_rank: int
    endpoint: str
    connected: bool
    last_seq: int
    last_event_age_s: float | None
    batches: int
    gaps: int
    replays: int
    replayed_batches: int
    lost_batches: int
    restarts: int
    duplicates: int
    decode_errors: int
    foreign_topic: int
    unknown_parents: int
    placeholders: int
    bad_events: int
    block_size: int | None
    block_size_mismatch: bool
    blocks: dict[str, int]
    bootstrap: str = "none"
    """The first-contact replay: "pending" (waiting for the engine, or in flight), "done", "failed"
    (timed out or abandoned; live events are applied all the same), "none" (no replay endpoint)."""
    error: str | None = None
    """Why the stream's socket could not be opened (e.g. the address to bind is taken), retried
    every ``open_retry_s`` meanwhile; None once it is open."""
    kv_groups: dict[int, str] | None = None
    """A hybrid model's KV cache groups as its events describe them (``{0: "sliding_window 64",
    1: "full_attention"}``); None for a one-group engine."""
    group_faults: int = 0
    """Malformed KV cache group metadata (each makes matches conservative; logged)."""
    open_attempts: int = 0
    """Failed tries to open the stream's sockets since it last opened (with ``error``)."""


_STATUS_COUNTERS = (
    "batches",
    "gaps",
    "replays",
    "replayed_batches",
    "lost_batches",
    "restarts",
    "duplicates",
    "decode_errors",
    "foreign_topic",
    "unknown_parents",
    "placeholders",
    "bad_events",
)
"""The SourceStatus counters (all 0 for a source whose socket is not open yet)."""


class _Replay:
    __slots__ = ("bootstrap", "deadline", "queued", "replies", "sent", "start", "unreadable", "until")

    def __init__(self, start: int, until: int | None, deadline: float, bootstrap: bool = False) -> None:
        self.start = start
        self.until = until
        self.deadline = deadline
        """Given up after this (monotonic); from its creation while the replay connection is down
        (as a request queued in the socket was), from its sending once sent; none while it waits
        for a slot (``max_replays``)."""
        self.sent = False
        self.queued = False
        """Waiting for a slot among the replays in flight."""
        self.bootstrap = bootstrap
        """A (re)connection's replay from seq 0, not a gap's."""
        self.replies: list[tuple[int, bytes]] = []
        self.unreadable = 0
        """Replies that were not replay frames (counted as decode errors): an answer all the same."""


class _Source:
    """Mutable per-source state, touched only by the subscriber thread (status reads are racy-but-safe)."""

    def __init__(self, cfg: SourceConfig, sidx: int) -> None:
        self.cfg = cfg
        self.sidx = sidx
        self.name = f"{cfg.instance}/dp{cfg.dp_rank}"
        self.endpoint = cfg.endpoint
        self.topic = cfg.topic.encode()
        self.sub: Any = None
        """The SUB socket (index/zsock.py's, or pyzmq's when libzmq could not be bound)."""
        self.monitor: Any = None
        """A socket monitor (sources without a replay endpoint: how their connection is seen)."""
        self.dealer: Any = None
        """The replay socket (ZMQ_IMMEDIATE): replays, and the source's connection state."""
        self.up = False
        """The DEALER has a connection (it can send)."""
        self.skip_up = False
        """The next connection of a DEALER reopened while connected is not a reconnection: no
        bootstrap for it (the socket was closed only to drop an abandoned replay's stragglers)."""
        self.dealer_delay = 0.0
        """Backoff of a DEALER that could not be reopened (0: none pending)."""
        self.dealer_error: str | None = None
        self.closed = False
        self.peers = 0
        self.last_seq = -1
        self.last_ts = 0.0
        self.replay: _Replay | None = None
        self.held: list[tuple[int, Batch | RawBatch]] = []
        self.replay_failed_at = 0.0
        self.gaps = 0
        self.replays = 0
        self.replayed_batches = 0
        self.lost = 0
        self.restarts = 0
        self.duplicates = 0
        self.foreign_topic = 0
        self.wire_errors = 0
        """Messages this thread could not read; the ingest thread counts bad events in its own
        ``SourceStats.decode_errors``, so no counter has two writers (a += from two threads can lose
        an increment). Status reports their sum."""
        self.bootstrap = "pending" if cfg.replay_endpoint is not None else "none"
        self.bootstrapped = cfg.replay_endpoint is None
        """The first bootstrap attempt has ended (or none is configured): the source is ready."""


class _Failed:
    """A source whose sockets could not be opened: retried with backoff until they open."""

    __slots__ = ("attempts", "cfg", "delay", "due", "error")

    def __init__(self, cfg: SourceConfig, error: str, due: float, delay: float, attempts: int) -> None:
        self.cfg = cfg
        self.error = error
        self.due = due
        self.delay = delay
        self.attempts = attempts


class EventSubscriber:
    """Keeps an :class:`Ingestor` in step with every configured source; start() / stop()."""

    def __init__(
        self,
        ingestor: Ingestor,
        sources: list[SourceConfig] | None = None,
        config: SubscriberConfig | None = None,
        ctx: Any = None,
    ) -> None:
        self.ingestor = ingestor
        self.config = config or SubscriberConfig()
        self._own_ctx = ctx is None
        self._z: Any = zsock.backend()
        """The socket library: index/zsock.py (libzmq bound), else pyzmq (the same names)."""
        max_sockets = None
        if self._own_ctx:
            limit = fds.raise_fd_limit() if self.config.raise_fd_limit else fds.fd_limit()
            max_sockets = self.config.max_sockets or max(zsock.DEFAULT_MAX_SOCKETS, limit)
        self.ctx: Any = zsock.context_of(ctx, self.config.io_threads, max_sockets)
        """A context of the backend's (a pyzmq context passed in is shadowed: the same libzmq)."""
        self._sources: dict[SourceId, _Source] = {}
        self._failed: dict[SourceId, _Failed] = {}
        """Sources whose socket could not be opened; retried by the thread (:attr:`_retry`), shown
        by status() until they open."""
        self._retry: list[tuple[float, int, str, SourceId]] = []
        """Heap of (due, tie, "open" or "dealer", source): sockets to try again."""
        self._tie = itertools.count()
        self.open_errors = 0
        """Failed tries to open a source's sockets (every try counts; each error is logged once)."""
        self._sockets = 0
        """libzmq sockets held (a monitor counts two: libzmq's and ours)."""
        self._inflight: dict[int, _Source] = {}
        """id(source) -> source with a replay request sent and not finished (at most max_replays)."""
        self._replay_wait: deque[_Source] = deque()
        """Sources whose replay waits for a slot among those in flight."""
        self._deadlines: list[tuple[float, int, _Source, _Replay]] = []
        """Heap of replay deadlines (stale entries skipped): timeouts checked in O(due), not O(sources)."""
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._applier: threading.Thread | None = None
        self._apply_q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=self.config.apply_queue)
        self._poller = zsock.ReadyPoller()
        """Tokens (kind, source): "sub", "monitor", "dealer"; ("wake", None) for the pipe."""
        self._wake_r = self._wake_w = -1
        """A pipe in the poller that wakes the thread for a command (add, remove, stop) at once:
        waiting for the poll timeout made a joining engine's stream start up to poll_ms late. Opened
        by start(): a subscriber that never runs holds no descriptors."""
        self._native = self.config.native_receive and zsock.native_receive()
        """Live messages are received by the C loop (index/zsock.py bound libzmq and checked it)."""
        self._after_chunk: list[Callable[[], None]] = []
        """Work due once this loop turn's chunk is applied (a bootstrap's end becomes visible then)."""
        self._handed = 0
        """Work items handed to the ingest thread (written by the receiving thread only)."""
        self._done = 0
        """Work items the ingest thread has finished (written by it only); see :meth:`_ingest_idle`."""
        self._busy = True
        """Something was ingested since the heap was last trimmed (True at first: start-up's own
        garbage goes back to the OS at the first idle moment)."""
        for cfg in sources or []:
            self.add_source(cfg)

    # --- control (any thread) ------------------------------------------------------------------
    def add_source(self, cfg: SourceConfig) -> None:
        """Start following a source (takes effect in the subscriber thread)."""
        if self._thread is None:
            self._try_open(cfg)
        else:
            self._commands.put(("add", cfg))
            self._wake()

    def remove_source(self, source: SourceId) -> None:
        """Stop following a source and forget its blocks."""
        if self._thread is None:
            self._failed.pop(source, None)
            self._close_source(source)
        else:
            self._commands.put(("remove", source))
            self._wake()

    def _wake(self) -> None:
        if self._wake_w < 0:
            return  # not running
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway; closed: stopped
            os.write(self._wake_w, b"!")

    def start(self) -> None:
        """Start the subscriber thread."""
        if self._thread is not None:
            return
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, ("wake", None))
        self._applier = threading.Thread(target=self._apply_loop, name="kv-ingest", daemon=True)
        self._applier.start()
        self._thread = threading.Thread(target=self._run, name="kv-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._applier is not None:
            self._apply_q.put(None)  # after everything handed over
            self._applier.join(timeout)
            self._applier = None
        for source in list(self._sources):
            self._close_source(source, forget=False)
        if self._wake_w >= 0:
            self._poller.unregister(self._wake_r)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._poller.close()
        if self._own_ctx:
            self.ctx.term()

    def status(self) -> list[SourceStatus]:
        """A snapshot of every source's stream health and index counts."""
        now = time.time()
        out = []
        for src in list(self._sources.values()):
            st = self.ingestor.stats.get(src.sidx)
            if st is None:
                continue
            out.append(
                SourceStatus(
                    source=src.name,
                    instance=src.cfg.instance,
                    dp_rank=src.cfg.dp_rank,
                    endpoint=src.endpoint,
                    connected=src.peers > 0,
                    last_seq=src.last_seq,
                    last_event_age_s=round(now - st.last_applied, 3) if st.last_applied else None,
                    batches=st.batches,
                    gaps=src.gaps,
                    replays=src.replays,
                    replayed_batches=src.replayed_batches,
                    lost_batches=src.lost,
                    restarts=src.restarts,
                    duplicates=src.duplicates,
                    decode_errors=st.decode_errors + src.wire_errors,
                    foreign_topic=src.foreign_topic,
                    unknown_parents=st.unknown_parents,
                    placeholders=st.placeholders,
                    bad_events=st.bad_events,
                    block_size=st.block_size,
                    block_size_mismatch=st.block_size_mismatch > 0,
                    blocks=self.ingestor.store.source_blocks(src.sidx),
                    bootstrap=src.bootstrap,
                    error=src.dealer_error,
                    kv_groups={
                        g: f"{spec.kind} {spec.window}" if spec.rule == "sliding_window" else spec.kind
                        for g, spec in sorted(st.groups.items())
                    }
                    or None,
                    group_faults=st.group_faults,
                )
            )
        for failed in list(self._failed.values()):
            cfg = failed.cfg
            zero: dict[str, Any] = dict.fromkeys(_STATUS_COUNTERS, 0)
            out.append(
                SourceStatus(
                    source=f"{cfg.instance}/dp{cfg.dp_rank}",
                    instance=cfg.instance,
                    dp_rank=cfg.dp_rank,
                    endpoint=cfg.endpoint,
                    connected=False,
                    last_seq=-1,
                    last_event_age_s=None,
                    block_size=None,
                    block_size_mismatch=False,
                    blocks={},
                    bootstrap="failed" if cfg.replay_endpoint is not None else "none",
                    error=failed.error,
                    open_attempts=failed.attempts,
                    **zero,
                )
            )
        return out

    def resources(self) -> dict[str, int | None]:
        """The headroom of the event streams: sources followed and failing, libzmq sockets held and
        the context's cap, descriptors open and the limit, failed opening tries, replays in flight
        and waiting (``/debug/index``, the ``kvrouter_event_*`` metrics)."""
        try:
            socket_limit: int | None = zsock.socket_limit(self.ctx)
        except Exception:  # (a terminated context)
            socket_limit = None
        return {
            "sources": len(self._sources),
            "sources_failing": len(self._failed),
            "sockets": self._sockets,
            "socket_limit": socket_limit,
            "fds": fds.open_fds(),
            "fd_limit": fds.fd_limit(),
            "open_errors": self.open_errors,
            "replays_in_flight": len(self._inflight),
            "replays_waiting": len(self._replay_wait),
        }

    def source_ready(self, source: SourceId) -> bool:
        """Whether a followed source's first bootstrap attempt has ended (or none is configured)."""
        src = self._sources.get(source)
        return src is not None and src.bootstrapped

    def sidx_of(self, source: SourceId) -> int | None:
        """Store index of a followed source."""
        src = self._sources.get(source)
        return None if src is None else src.sidx

    # --- sockets (subscriber thread, or before start) -------------------------------------------
    def _try_open(self, cfg: SourceConfig) -> None:
        """Open a source; when its sockets cannot be opened (an address to bind that is taken, one
        ZMQ refuses, no descriptor or socket left), log it once per error, count it, show it in
        status() and try again after a backoff (the thread loop): one source's failure must not stop
        the others' streams."""
        try:
            self._open(cfg)
        except self._z.ZMQError as exc:
            self.open_errors += 1
            sid = cfg.source_id
            known = self._failed.get(sid)
            retry = self.config.open_retry_s
            same = known is not None and known.cfg == cfg
            delay = min(self.config.open_retry_max_s, known.delay * 2) if same and known else retry
            attempts = known.attempts + 1 if same and known else 1
            if not same or known is None or known.error != str(exc):
                log.error(
                    "source %s/dp%d: cannot %s %s: %s (retried after %.1fs, backing off to %.0fs)",
                    cfg.instance,
                    cfg.dp_rank,
                    "bind" if cfg.bind else "connect to",
                    cfg.endpoint,
                    exc,
                    retry,
                    self.config.open_retry_max_s,
                )
            due = time.monotonic() + delay
            self._failed[sid] = _Failed(cfg, str(exc), due, delay, attempts)
            heapq.heappush(self._retry, (due, next(self._tie), "open", sid))

    def _retry_due(self, now: float) -> None:
        """Try again what is due (sources, DEALERs); O(due) per turn."""
        heap = self._retry
        while heap and heap[0][0] <= now:
            due, _, kind, sid = heapq.heappop(heap)
            if kind == "open":
                failed = self._failed.get(sid)
                if failed is not None and failed.due == due:
                    self._try_open(failed.cfg)
            else:
                src = self._sources.get(sid)
                if src is not None and src.dealer is None and src.dealer_delay > 0:
                    self._open_dealer(src)

    def _new_dealer(self, cfg: SourceConfig) -> Any:
        """The source's replay socket, connected. ZMQ_IMMEDIATE: it queues nothing while it has no
        connection, so whether it can send tells whether the engine's replay socket is reachable,
        and its ZMQ_FD signals when that changes (the connection seen without a socket monitor)."""
        z = self._z
        dealer = self.ctx.socket(z.DEALER)
        try:
            dealer.setsockopt(z.LINGER, 0)
            dealer.setsockopt(zsock.IMMEDIATE, 1)
            assert cfg.replay_endpoint is not None
            dealer.connect(cfg.replay_endpoint)
        except z.ZMQError:
            dealer.close(0)
            raise
        self._sockets += 1
        return dealer

    def _open(self, cfg: SourceConfig) -> None:
        """Open the source's sockets (raises ZMQError when the address cannot be bound or
        connected, or a socket cannot be made, with nothing left behind), then give it a store slot."""
        if cfg.source_id in self._sources:
            return
        z = self._z
        sub = self.ctx.socket(z.SUB)
        monitor = dealer = None
        try:
            sub.setsockopt(z.LINGER, 0)
            sub.setsockopt(z.RCVHWM, self.config.rcvhwm)
            sub.setsockopt(z.SUBSCRIBE, cfg.topic.encode())
            if cfg.replay_endpoint is None:
                monitor = sub.get_monitor_socket(
                    z.EVENT_CONNECTED | z.EVENT_ACCEPTED | z.EVENT_DISCONNECTED | z.EVENT_CLOSED
                )
            if cfg.bind:
                sub.bind(cfg.endpoint)
                endpoint = sub.getsockopt_string(z.LAST_ENDPOINT)  # port 0 -> the real one
            else:
                sub.connect(cfg.endpoint)
                endpoint = cfg.endpoint
            if cfg.replay_endpoint is not None:
                dealer = self._new_dealer(cfg)
        except z.ZMQError:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            sub.close(0)
            raise
        self._sockets += 1 + (2 if monitor is not None else 0)
        self._failed.pop(cfg.source_id, None)
        sidx = self.ingestor.add_source(cfg.source_id)
        src = _Source(cfg, sidx)
        src.endpoint = endpoint
        src.sub, src.monitor, src.dealer = sub, monitor, dealer
        self._sources[cfg.source_id] = src
        self._poller.register(sub, ("sub", src))
        if monitor is not None:
            self._poller.register(monitor, ("monitor", src))
        if dealer is not None:
            self._poller.register(dealer, ("dealer", src))

    def _open_dealer(self, src: _Source) -> None:
        """(Re)open a source's DEALER; when it cannot be made, report it once, show it in status(),
        and try again with a capped backoff (the source's live stream goes on)."""
        try:
            dealer = self._new_dealer(src.cfg)
        except self._z.ZMQError as exc:
            self.open_errors += 1
            first = src.dealer_delay == 0
            src.dealer_delay = (
                self.config.open_retry_s if first else min(self.config.open_retry_max_s, src.dealer_delay * 2)
            )
            if first:
                log.error(
                    "source %s: cannot open its replay socket (%s): %s (retried with backoff)",
                    src.name,
                    src.cfg.replay_endpoint,
                    exc,
                )
            src.dealer_error = str(exc)
            due = time.monotonic() + src.dealer_delay
            heapq.heappush(self._retry, (due, next(self._tie), "dealer", src.cfg.source_id))
            return
        src.dealer_delay = 0.0
        src.dealer_error = None
        src.dealer = dealer
        self._poller.register(dealer, ("dealer", src))

    def _close_dealer(self, src: _Source) -> None:
        if src.dealer is not None:
            self._poller.unregister(src.dealer)
            src.dealer.close(0)
            src.dealer = None
            self._sockets -= 1
        src.up = False

    def _close_source(self, source: SourceId, forget: bool = True) -> None:
        src = self._sources.pop(source, None)
        if src is None:
            return
        src.closed = True
        self._inflight.pop(id(src), None)
        self._close_dealer(src)
        for sock in (src.sub, src.monitor):
            if sock is not None:
                self._poller.unregister(sock)
        if src.sub is not None:
            if src.monitor is not None:
                src.sub.disable_monitor()
            src.sub.close(0)
            self._sockets -= 1
        if src.monitor is not None:
            src.monitor.close(0)
            self._sockets -= 2
        self._pump_replays()
        if forget:
            ingestor = self.ingestor
            # detached now (a source re-added under this id meanwhile gets a fresh slot), dropped in
            # stream order behind the chunks already handed over
            sidx = ingestor.store.detach(source)

            def forget_source() -> None:
                ingestor.stats.pop(src.sidx, None)  # (first: the slot is reusable right after)
                if sidx is not None:
                    ingestor.store.release(sidx)  # in slices, without the GIL (index/store.py)
                _kvcore.trim()  # the tables are unmapped already; the heap's free pages go back too

            self._submit(forget_source)  # after the source's chunks already handed over

    # --- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        """The subscriber thread: one turn after another until stop(). A turn that fails for a
        reason not foreseen is logged and the next one runs: every source's stream depends on this
        thread staying alive."""
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:
                log.exception("event subscriber: a turn failed; going on")
                self._stop.wait(self.config.poll_ms / 1000)  # (not a busy loop if it keeps failing)

    def _turn(self) -> None:
        cfg = self.config
        self._drain_commands()
        if self._retry and self._retry[0][0] <= time.monotonic():
            self._retry_due(time.monotonic())
        try:  # (the wake-up pipe is always polled: never a busy loop with no sockets)
            tokens = self._poller.poll(cfg.poll_ms)
        except OSError as exc:  # pragma: no cover - the poller closed under us
            log.error("poll failed: %s", exc)
            self._stop.set()
            return
        work: list[tuple[str, _Source]] = [t for t in tokens if t[1] is not None]
        if len(work) < len(tokens):  # the wake-up pipe: commands first, then the sockets woken
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            self._drain_commands()
        if not work and self._inflight:
            # a quiet poll with replays in flight: their DEALERs are looked at once more (a cheap
            # guard, O(replays in flight), against a reply whose wake-up was not seen)
            for src in self._inflight.values():
                if src.dealer is not None:
                    self._poller.again(src.dealer)
        if not work and self._busy:
            # idle after a burst: the heap gives back what the messages took (glibc keeps it), once
            # the ingest thread has applied (and let go of) the chunks handed over before this; here
            # when it has nothing left (a hand-over would keep the next small chunk from being
            # applied here)
            self._busy = False
            if self._ingest_idle():
                self._trim()
            else:
                self._submit(self._trim)
        chunk: list[tuple[int, Batch | bytes | None]] = []
        done = 0
        try:
            for kind, src in work:
                if not src.closed:
                    if kind == "sub":
                        self._drain_live(src, chunk)
                        sub = src.sub
                        if not src.closed and sub.getsockopt(zsock.EVENTS) & zsock.POLLIN:
                            self._poller.again(sub)  # (its budget ran out: the rest at the next turn)
                    elif kind == "monitor":
                        self._on_monitor(src, chunk)
                    elif kind == "dealer":
                        self._on_dealer(src, chunk)
                done += 1
            if self._deadlines and self._deadlines[0][0] <= time.monotonic():
                self._time_out(chunk)
        finally:
            # a socket woken and not handled would signal nothing more: handed back for the next
            # turn (the one that failed too: _run waits poll_ms before it)
            for _, src in work[done:]:
                for sock in (src.sub, src.monitor, src.dealer):
                    if sock is not None and not src.closed:
                        self._poller.again(sock)
            # what was accepted before a failure is applied all the same: its sequence numbers are
            # taken, so nothing would ever replay it (the failure itself goes on to _run's log)
            if chunk:
                self._busy = True
                if (
                    len(chunk) <= cfg.inline_max
                    and self._ingest_idle()
                    and all(item is not None for _, item in chunk)
                ):
                    # the ingest thread has nothing left to do: applied here, in stream order, a
                    # small chunk costs no hand-over (at engine-step rates, one wake-up a message).
                    # Not a restart's drop of a source (None), which can take a while: meanwhile
                    # this thread would receive nothing
                    self._apply(chunk)
                else:
                    self._submit(lambda c=chunk: self._apply(c))  # type: ignore[misc]
            if self._after_chunk:
                after, self._after_chunk = self._after_chunk, []
                for later in after:
                    self._submit(later)  # in order: after the chunk above is applied

    def _time_out(self, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        """Replays past their deadline are given up (what they did not bring is lost)."""
        now = time.monotonic()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, src, replay = heapq.heappop(heap)
            if src.closed or src.replay is not replay or replay.deadline != deadline:
                continue  # finished, or its deadline moved (sent after waiting for a slot)
            log.warning("source %s: replay timed out after %.1fs", src.name, self.config.replay_timeout_s)
            src.replay_failed_at = now
            self._finish_replay(src, chunk)

    def _ingest_idle(self) -> bool:
        """The ingest thread has finished everything handed to it, so work done now in the receiving
        thread stays in stream order."""
        return self._handed == self._done

    @staticmethod
    def _trim() -> None:
        _kvcore.trim()

    def _apply(self, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        try:
            self.ingestor.apply_chunk(chunk)
        except Exception:  # never let one bad chunk kill ingestion
            log.exception("indexing a chunk of %d batches failed", len(chunk))

    def _submit(self, work: Callable[[], None]) -> None:
        """Hand work to the ingest thread (in order; waits while ``apply_queue`` chunks are queued,
        so the backlog stays in ZMQ's bounded queues), or do it now before the threads run."""
        if self._applier is None:
            work()
        else:
            self._handed += 1
            self._apply_q.put(work)

    def _apply_loop(self) -> None:
        """The ingest thread: store work in stream order. The C ingest runs without the GIL, so
        receiving (this module's other thread) and applying overlap, on two cores when there are."""
        while True:
            work = self._apply_q.get()
            if work is None:
                return
            try:
                work()
            finally:
                self._done += 1
            # let go of it before waiting for the next: held while idle, a chunk's payloads (up to
            # max_chunk messages of every source that was ready) stayed in memory after a burst
            del work

    def _drain_commands(self) -> None:
        while True:
            try:
                op, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._try_open(arg)
            elif op == "remove":
                self._failed.pop(arg, None)
                self._close_source(arg)

    def _drain_live(self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        sub = src.sub
        assert sub is not None
        budget = self.config.max_chunk
        if self._native:
            # the common message in C; the first other one comes back whole for the rules below
            addr = sub.underlying
            while budget > 0 and src.replay is None:
                before = len(chunk)
                try:
                    taken, last_seq, last_ts, odd = _kvcore.recv_live(
                        addr, chunk, src.sidx, src.last_seq, src.topic, budget
                    )
                except BaseException:
                    # (out of memory midway): what it appended is not in last_seq, so the gap
                    # that follows replays it; kept here too it would be applied twice
                    del chunk[before:]
                    raise
                if taken:
                    src.last_seq, src.last_ts = last_seq, last_ts
                    budget -= taken
                if odd is None:
                    return
                if isinstance(odd, int):  # a socket error: the Python loop raises or reports it
                    break
                budget -= 1
                self._on_live(src, odd, chunk)
        # the Python loop (no C loop, or after a socket error): whole messages, so that a message of
        # fewer frames can never take the next one's first frames as its own
        recv_multipart = sub.recv_multipart
        for _ in range(budget):
            try:
                frames = recv_multipart(self._z.NOBLOCK)
            except self._z.Again:
                return
            self._on_live(src, frames, chunk)

    def _on_live(
        self, src: _Source, frames: list[bytes], chunk: list[tuple[int, Batch | bytes | None]]
    ) -> None:
        """One live message, as received (its frames): checked, sequenced, and handed to ``chunk``
        (the fuzz tests drive this with arbitrary frames, tests/kvfuzz.py)."""
        if len(frames) < 3:
            self._decode_error(src, WireError("message has fewer than 3 frames"), [])
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self._decode_error(src, WireError("message is not 3 frames [topic, seq, payload]"), [])
            return
        topic, seq_frame, payload = frames
        try:
            batch = peek_message(payload, decode_seq(seq_frame))
        except WireError as exc:
            self._decode_error(src, exc, frames)
            return
        if src.topic and topic != src.topic:
            src.foreign_topic += 1
            return
        if src.replay is not None:
            if len(src.held) >= self.config.max_held:
                log.warning("source %s: too many live messages held during replay; abandoning it", src.name)
                src.replay_failed_at = time.monotonic()
                self._finish_replay(src, chunk)
                self._accept(src, batch, chunk, allow_replay=False)
            else:
                src.held.append((batch.seq, batch))
            return
        self._accept(src, batch, chunk, allow_replay=True)

    def _decode_error(self, src: _Source, exc: Exception, frames: list[bytes]) -> None:
        src.wire_errors += 1
        if src.wire_errors <= 5 or src.wire_errors % 1000 == 0:
            log.warning(
                "source %s: malformed message skipped (%d so far): %s", src.name, src.wire_errors, exc
            )
        # a bad payload with a readable seq still advances the stream, so it is not replayed forever
        if len(frames) == 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if seq == src.last_seq + 1:
                src.last_seq = seq

    def _accept(
        self,
        src: _Source,
        batch: Batch | RawBatch,
        chunk: list[tuple[int, Batch | bytes | None]],
        allow_replay: bool,
        gap_counted: bool = False,
    ) -> None:
        """The per-source state machine for one batch in arrival order. ``gap_counted``: the batch
        whose gap started the replay that just ended (that gap is counted once)."""
        seq = batch.seq
        last = src.last_seq
        if last >= 0 and seq <= last:
            if batch.ts <= src.last_ts:
                src.duplicates += 1
                return
            src.restarts += 1
            log.warning(
                "source %s: seq went back from %d to %d: engine restarted, dropping its blocks",
                src.name,
                last,
                seq,
            )
            chunk.append((src.sidx, None))
            src.last_seq = last = -1
            src.last_ts = 0.0
        expected = last + 1
        if seq > expected:
            missing = seq - expected
            if last >= 0 and not gap_counted:
                src.gaps += 1
            can_replay = (
                allow_replay
                and src.dealer is not None
                and time.monotonic() - src.replay_failed_at > self.config.replay_retry_s
            )
            if can_replay:
                # before the first contact's replay (CONNECTED not handled yet: the socket was
                # drained first) this replay is that bootstrap, and it makes the source ready
                self._start_replay(src, expected, seq, bootstrap=last < 0 and not src.bootstrapped)
                src.held.append((seq, batch))
                return
            if last >= 0:  # before first contact the engine's history is not ours to lose
                src.lost += missing
                log.warning("source %s: %d batches lost (seq %d..%d)", src.name, missing, expected, seq - 1)
        chunk.append((src.sidx, batch.payload if isinstance(batch, RawBatch) else batch))
        src.last_seq = seq
        src.last_ts = batch.ts

    def _start_replay(self, src: _Source, start: int, until: int | None, bootstrap: bool = False) -> None:
        """Ask the engine for its batches from ``start`` (until ``until``): sent now when the
        replay connection is up and a slot is free, else when it is (its deadline runs from now
        while the connection is down, as for a request queued in the socket)."""
        replay = _Replay(start, until, time.monotonic() + self.config.replay_timeout_s, bootstrap)
        src.replay = replay
        if bootstrap:
            src.bootstrap = "pending"
        src.replays += 1
        heapq.heappush(self._deadlines, (replay.deadline, next(self._tie), src, replay))
        self._send_replay(src)

    def _send_replay(self, src: _Source) -> None:
        replay = src.replay
        if replay is None or replay.sent or src.dealer is None or not src.up:
            return
        if len(self._inflight) >= self.config.max_replays:
            if not replay.queued:
                replay.queued = True
                replay.deadline = math.inf  # (waiting on this process, not on the engine)
                self._replay_wait.append(src)
            return
        try:
            src.dealer.send_multipart([b"", replay.start.to_bytes(8, "big")])
        except self._z.Again:  # the connection went just now: sent when it is back
            src.up = False
            return
        replay.sent = True
        replay.queued = False
        self._inflight[id(src)] = src
        replay.deadline = time.monotonic() + self.config.replay_timeout_s
        heapq.heappush(self._deadlines, (replay.deadline, next(self._tie), src, replay))

    def _pump_replays(self) -> None:
        """Send waiting replays while slots are free."""
        wait = self._replay_wait
        while wait and len(self._inflight) < self.config.max_replays:
            src = wait.popleft()
            replay = src.replay
            if src.closed or replay is None or replay.sent or not replay.queued:
                continue
            replay.queued = False
            replay.deadline = time.monotonic() + self.config.replay_timeout_s
            heapq.heappush(self._deadlines, (replay.deadline, next(self._tie), src, replay))
            self._send_replay(src)

    def _on_dealer(self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        """The DEALER woke: replies first, then its connection state (ZMQ_IMMEDIATE: it can send
        only while connected). A (re)connection starts a bootstrap replay, as a socket monitor's
        CONNECTED did: what the engine still buffers, or an empty answer that tells a new process."""
        dealer = src.dealer
        if dealer is None:
            return
        events = dealer.getsockopt(zsock.EVENTS)
        if events & zsock.POLLIN:
            self._on_replay_reply(src, chunk)
            dealer = src.dealer  # (reopened when a replay was abandoned)
            if dealer is None or src.closed:
                return
            events = dealer.getsockopt(zsock.EVENTS)
        if events & zsock.POLLIN:  # (arrived since it was read: no wake-up would come for it)
            self._poller.again(dealer)
        up = bool(events & zsock.POLLOUT)
        if up == src.up:
            return
        src.up = up
        if not up:
            src.peers = 0
            return
        src.peers = 1
        if src.skip_up:
            src.skip_up = False
            self._send_replay(src)  # (one that waited for the connection)
        elif src.replay is None:
            self._start_replay(src, 0, None, bootstrap=True)
        else:
            self._send_replay(src)

    def _on_replay_reply(self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        dealer = src.dealer
        while dealer is not None:
            try:
                frames = dealer.recv_multipart(self._z.NOBLOCK)
            except self._z.Again:
                return
            if src.replay is None:
                continue  # a straggler from an abandoned replay
            try:
                seq, payload = split_replay_reply(frames)
            except WireError as exc:
                src.replay.unreadable += 1
                self._decode_error(src, exc, [])
                continue
            if seq == END_SEQ:
                self._finish_replay(src, chunk, finished=True)
                # on to Again all the same: a replay the held batches started just now may be
                # answered already, and a socket not read to the end signals nothing more
                dealer = src.dealer
                continue
            src.replay.replies.append((seq, payload))

    def _finish_replay(
        self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]], finished: bool = False
    ) -> None:
        replay = src.replay
        if replay is None:
            return
        src.replay = None
        if replay.bootstrap:
            # "done" and ready only once the ingest thread has applied what the replay brought (the
            # chunk this call fills): a lead that sees ready must find the bootstrap in the index
            outcome = "done" if finished else "failed"

            def bootstrapped() -> None:
                src.bootstrap = outcome
                src.bootstrapped = True

            self._after_chunk.append(bootstrapped)
        if self._inflight.pop(id(src), None) is not None:
            self._pump_replays()
        if not finished and replay.sent:
            # replies of an abandoned request could still arrive and be mistaken for the next one's:
            # a new socket (its first connection is not a reconnection when the old one was up)
            was_up = src.up
            self._close_dealer(src)
            self._open_dealer(src)
            src.skip_up = was_up and src.dealer is not None
        elif (
            replay.bootstrap
            and replay.start == 0
            and replay.until is None
            and not replay.replies
            and not replay.unreadable
        ):
            self._restarted_silent(src, chunk)
        for seq, payload in sorted(replay.replies, key=lambda r: r[0]):
            if seq < replay.start or (replay.until is not None and seq >= replay.until):
                continue
            try:
                batch = peek_message(payload, seq)
            except WireError as exc:
                self._decode_error(src, exc, [])
                continue
            src.replayed_batches += 1
            self._accept(src, batch, chunk, allow_replay=False)
        if replay.until is not None and src.last_seq < replay.until - 1:
            # the engine no longer buffers what the gap missed (or restarted meanwhile): asking
            # again would bring the same answer, so that gap is lost (counted by the next _accept)
            src.replay_failed_at = time.monotonic()
        held, src.held = src.held, []
        for i, (_, batch) in enumerate(held):
            self._accept(
                src, batch, chunk, allow_replay=True, gap_counted=i == 0 and replay.until is not None
            )
            if src.replay is not None:  # a new gap started another replay: keep holding the rest
                src.held.extend(held[i + 1 :])
                return

    def _restarted_silent(self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        """A (re)connection's bootstrap came back empty from an engine whose batches we applied. vLLM
        keeps its latest ``buffer_steps`` batches (10,000 by default) for replay, so a running engine
        that published batch ``last_seq`` still has it: an empty answer means a new engine process
        that has published nothing yet. Its blocks go now, as at a restart seen by its seq, instead
        of staying in the index (routed to as cached) until its first batch, which could take as long
        as no request reaches it. It needs ``buffer_steps`` >= 1: an engine configured with a replay
        socket and no buffer answers every replay empty (its blocks would go at every reconnection
        in which it published nothing; one whose stream went on meanwhile is recognised)."""
        if src.last_seq < 0:
            return  # nothing of an earlier process applied: nothing to drop
        if any(seq == src.last_seq + 1 for seq, _ in src.held):
            return  # its stream went on meanwhile: the same process (an engine with buffer_steps 0)
        src.restarts += 1
        log.warning(
            "source %s: reconnected and its replay buffer is empty (last applied seq %d): engine "
            "restarted, dropping its blocks",
            src.name,
            src.last_seq,
        )
        chunk.append((src.sidx, None))
        src.last_seq = -1
        src.last_ts = 0.0

    def _on_monitor(self, src: _Source, chunk: list[tuple[int, Batch | bytes | None]]) -> None:
        """A source without a replay endpoint: its connection as its socket monitor reports it."""
        monitor = src.monitor
        assert monitor is not None
        while True:
            try:
                frames = monitor.recv_multipart(self._z.NOBLOCK)
            except self._z.Again:
                return
            event = _monitor_event(frames)
            if event in (self._z.EVENT_CONNECTED, self._z.EVENT_ACCEPTED):
                src.peers += 1
            elif event == self._z.EVENT_DISCONNECTED:
                src.peers = max(0, src.peers - 1)
