"""The ZeroMQ subscriber: one SUB socket per source (instance, DP rank), kept exactly in step.

Two threads, off the router's event loop: the receiving thread (a poller over every socket)
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

Memory is bounded: ZMQ's receive high-water mark bounds queued messages (overflow shows up as a
gap, then a replay), held live messages during a replay are capped, and the store has its own cap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

import index._kvcore as _kvcore
from index import zsock
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
    """A source whose socket cannot be bound or connected is tried again this often (a port still
    held by the socket it replaces is usually free a moment later)."""
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
    __slots__ = ("bootstrap", "deadline", "replies", "start", "unreadable", "until")

    def __init__(self, start: int, until: int | None, deadline: float, bootstrap: bool = False) -> None:
        self.start = start
        self.until = until
        self.deadline = deadline
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
        self.dealer: Any = None
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
        self.ctx: Any = zsock.context_of(ctx, self.config.io_threads)
        """A context of the backend's (a pyzmq context passed in is shadowed: the same libzmq)."""
        self._sources: dict[SourceId, _Source] = {}
        self._failed: dict[SourceId, tuple[SourceConfig, str, float]] = {}
        """Sources whose socket could not be opened: (config, error, next attempt); retried by the
        thread, shown by status() until they open."""
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._applier: threading.Thread | None = None
        self._apply_q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=self.config.apply_queue)
        self._poller = self._z.Poller()
        self._by_socket: dict[Any, tuple[str, _Source]] = {}
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
        self._poller.register(self._wake_r, self._z.POLLIN)
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
                    kv_groups={
                        g: f"{spec.kind} {spec.window}" if spec.rule == "sliding_window" else spec.kind
                        for g, spec in sorted(st.groups.items())
                    }
                    or None,
                    group_faults=st.group_faults,
                )
            )
        for cfg, error, _ in list(self._failed.values()):
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
                    bootstrap="pending" if cfg.replay_endpoint is not None else "none",
                    error=error,
                    **zero,
                )
            )
        return out

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
        """Open a source; when its socket cannot be bound or connected, log it, show it in status()
        and try again later (the thread loop): one source's bad address or taken port must not
        stop the others' streams."""
        try:
            self._open(cfg)
        except self._z.ZMQError as exc:
            known = self._failed.get(cfg.source_id)
            if known is None or known[0] != cfg or known[1] != str(exc):
                log.error(
                    "source %s/dp%d: cannot %s %s: %s (retrying every %.0fs)",
                    cfg.instance,
                    cfg.dp_rank,
                    "bind" if cfg.bind else "connect to",
                    cfg.endpoint,
                    exc,
                    self.config.open_retry_s,
                )
            self._failed[cfg.source_id] = (cfg, str(exc), time.monotonic() + self.config.open_retry_s)

    def _retry_failed(self) -> None:
        now = time.monotonic()
        for cfg, _, due in list(self._failed.values()):
            if due <= now and self._failed.get(cfg.source_id, (None,))[0] is cfg:
                self._try_open(cfg)

    def _open(self, cfg: SourceConfig) -> None:
        """Open the source's sockets (raises ZMQError when the address cannot be bound or
        connected, with nothing left behind), then give it a store slot."""
        if cfg.source_id in self._sources:
            return
        z = self._z
        sub = self.ctx.socket(z.SUB)
        monitor = None
        try:
            sub.setsockopt(z.LINGER, 0)
            sub.setsockopt(z.RCVHWM, self.config.rcvhwm)
            sub.setsockopt(z.SUBSCRIBE, cfg.topic.encode())
            monitor = sub.get_monitor_socket(
                z.EVENT_CONNECTED | z.EVENT_ACCEPTED | z.EVENT_DISCONNECTED | z.EVENT_CLOSED
            )
            if cfg.bind:
                sub.bind(cfg.endpoint)
                endpoint = sub.getsockopt_string(z.LAST_ENDPOINT)  # port 0 -> the real one
            else:
                sub.connect(cfg.endpoint)
                endpoint = cfg.endpoint
        except z.ZMQError:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            sub.close(0)
            raise
        self._failed.pop(cfg.source_id, None)
        sidx = self.ingestor.add_source(cfg.source_id)
        src = _Source(cfg, sidx)
        src.endpoint = endpoint
        src.sub, src.monitor = sub, monitor
        self._sources[cfg.source_id] = src
        self._poller.register(sub, z.POLLIN)
        self._poller.register(monitor, z.POLLIN)
        self._by_socket[sub] = ("sub", src)
        self._by_socket[monitor] = ("monitor", src)

    def _close_dealer(self, src: _Source) -> None:
        if src.dealer is not None:
            self._poller.unregister(src.dealer)
            self._by_socket.pop(src.dealer, None)
            src.dealer.close(0)
            src.dealer = None

    def _close_source(self, source: SourceId, forget: bool = True) -> None:
        src = self._sources.pop(source, None)
        if src is None:
            return
        self._close_dealer(src)
        for sock in (src.sub, src.monitor):
            if sock is not None:
                self._poller.unregister(sock)
                self._by_socket.pop(sock, None)
        if src.sub is not None:
            src.sub.disable_monitor()
            src.sub.close(0)
        if src.monitor is not None:
            src.monitor.close(0)
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
        if self._failed:
            self._retry_failed()
        try:  # (the wake-up pipe is always polled: never a busy loop with no sockets)
            ready = dict(self._poller.poll(cfg.poll_ms))
        except self._z.ZMQError as exc:  # pragma: no cover - context terminated under us
            log.error("poll failed: %s", exc)
            self._stop.set()
            return
        if ready.pop(self._wake_r, None) is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            return  # commands first, then whatever is ready (polled again at once)
        if not ready and self._busy:
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
        try:
            for sock in ready:
                kind, src = self._by_socket.get(sock, ("", None))
                if src is None:
                    continue
                if kind == "sub":
                    self._drain_live(src, chunk)
                elif kind == "monitor":
                    self._on_monitor(src, chunk)
                elif kind == "dealer":
                    self._on_replay_reply(src, chunk)
            now = time.monotonic()
            for src in list(self._sources.values()):
                if src.replay is not None and now > src.replay.deadline:
                    log.warning("source %s: replay timed out after %.1fs", src.name, cfg.replay_timeout_s)
                    src.replay_failed_at = now
                    self._finish_replay(src, chunk)
        finally:
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
                for work in after:
                    self._submit(work)  # in order: after the chunk above is applied

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
                and src.cfg.replay_endpoint is not None
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
        if src.dealer is None:
            dealer = self.ctx.socket(self._z.DEALER)
            dealer.setsockopt(self._z.LINGER, 0)
            assert src.cfg.replay_endpoint is not None
            dealer.connect(src.cfg.replay_endpoint)
            src.dealer = dealer
            self._poller.register(dealer, self._z.POLLIN)
            self._by_socket[dealer] = ("dealer", src)
        src.replay = _Replay(start, until, time.monotonic() + self.config.replay_timeout_s, bootstrap)
        if bootstrap:
            src.bootstrap = "pending"
        src.replays += 1
        src.dealer.send_multipart([b"", start.to_bytes(8, "big")])

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
                return
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
        if not finished:
            # replies of an abandoned request could still arrive and be mistaken for the next one's
            self._close_dealer(src)
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
                if src.cfg.replay_endpoint is not None and src.replay is None:
                    # bootstrap: fetch what the engine still buffers (duplicates are skipped by seq/ts)
                    self._start_replay(src, 0, None, bootstrap=True)
            elif event == self._z.EVENT_DISCONNECTED:
                src.peers = max(0, src.peers - 1)
