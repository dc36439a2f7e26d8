"""Load the router tracks itself, per (backend, DP rank): requests and tokens in flight.

A request counts as *prefilling* from dispatch until its first response byte (the engine has then
computed the prompt) and as *decoding* until its response ends. ``pending_prefill_tokens`` is the
uncached prompt work the engine still has to do before a new request's prefill can start, which is
what a new request waits behind; ``active`` is the number of sequences sharing decode steps.

All methods run on the router's event loop thread: no locks.

Other routers' load comes in through :class:`PeerLoads` views: sibling worker processes share a
memory-mapped :class:`LoadBoard` (``server.workers``), and router replicas share through the cluster
store (:mod:`router.cluster`). ``get`` returns this router's own figures plus every view's, so each
process scores candidates against the load of all of them. Targets come and go with membership:
:meth:`LoadTracker.track` when a backend joins, :meth:`LoadTracker.forget` when it is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from _blake2 import blake2b  # (hashlib's blake2b, without loading OpenSSL's hashes at start-up)
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

log = logging.getLogger("kvrouter.load")

Target = tuple[str, int]
"""(backend name, DP rank)."""


class TargetLoad(msgspec.Struct):
    """Load of one (backend, DP rank)."""

    active: int = 0
    """Requests in flight (prefilling or decoding)."""
    prefilling: int = 0
    """Requests in flight that have not produced a first byte yet."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens of the prefilling requests."""
    total: int = 0
    """Requests ever dispatched here."""
    engine_waiting: float = 0.0
    """``vllm:num_requests_waiting`` from the engine's /metrics, when scraping is on."""
    engine_running: float = 0.0
    """``vllm:num_requests_running`` from the engine's /metrics, when scraping is on."""
    engine_kv_usage: float = 0.0
    """``vllm:kv_cache_usage_perc`` (0..1) from the engine's /metrics, when scraping is on."""


_ZERO = TargetLoad()
"""The load of a target not in the fleet (never changed: a request there makes it a record)."""


class PeerLoads(Protocol):
    """Other routers' in-flight load, and where this router's own is published for them."""

    def track(self, target: Target) -> None:
        """A target joined this router's fleet."""

    def forget(self, target: Target) -> None:
        """A target left this router's fleet: withdraw what was published for it."""

    def publish(self, target: Target, load: TargetLoad) -> None:
        """This router's own figures for a target changed."""

    def others(self, target: Target) -> tuple[int, int, int]:
        """(active, prefilling, pending_prefill_tokens) summed over the other routers."""

    def slot_of(self, target: Target) -> int:
        """Where :meth:`columns` keeps a target's figures (-1: nowhere, no load from others); the
        same while the target stays tracked."""

    def columns(self) -> PeerColumns:
        """The other routers' figures of every slot, kept up to date as their shares arrive (a
        decision reads them for all its candidates in one compiled pass, not target by target)."""


class PeerColumns(NamedTuple):
    """Int64 cells holding other routers' figures: a slot's are the ``rows`` triples (active,
    prefilling, pending_prefill_tokens) from ``base + slot * stride``, row ``skip`` left out (this
    process's own; -1: none)."""

    table: Any
    base: int
    stride: int
    rows: int
    skip: int


_FIELDS = 3  # active, prefilling, pending_prefill_tokens
_MAGIC = 0x6B76726F75746232  # "kvroutb2"
_HEADER = 8  # int64 cells: magic, capacity, workers, reserved...


def target_key(target: Target) -> int:
    """A stable non-zero 64-bit id of a target, the same in every process."""
    digest = blake2b(f"{target[0]}\0{target[1]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


class LoadBoard:
    """In-flight figures of every worker process, in a shared file mapping.

    Layout (int64 cells): a header, then ``capacity`` target keys, then ``capacity`` holder masks
    (bit w: worker w has the target in its fleet), then per slot and worker a row of
    (active, prefilling, pending_prefill_tokens). Each worker writes only its own rows and reads the
    others'; aligned 8-byte stores are atomic on the platforms we run on, and a reader one update
    behind is harmless. Slots are allocated and released under an ``flock`` of the file (rare: only
    when membership changes); a slot is free again once no worker holds it, so pods that come and go
    for hours never fill the board. A worker keeps its slot numbers locally, so reads never search.

    A file mapping rather than ``multiprocessing.shared_memory``: no resource-tracker bookkeeping
    across processes, and the file lives in the supervisor's run directory, removed with it.
    """

    CAPACITY = 16384

    def __init__(self, path: str, workers: int, capacity: int = CAPACITY) -> None:
        if not 1 <= workers <= 63:  # (worker w is bit w of a signed 64-bit cell)
            raise ValueError("1..63 workers")
        self.path = path
        self.workers = workers
        self.capacity = capacity
        self._keys = _HEADER
        self._holders = _HEADER + capacity
        self._rows = _HEADER + 2 * capacity
        self._stride = workers * _FIELDS
        size = (self._rows + capacity * self._stride) * 8
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self.cells = memoryview(self._map).cast("q")
        with self._locked():
            if self.cells[0] != _MAGIC:
                self.cells[0] = _MAGIC
                self.cells[1] = capacity
                self.cells[2] = workers
        self.slots: dict[Target, int] = {}
        """This process's targets -> slot."""
        self._full_logged = False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _find(self, key: int) -> int:
        """The slot holding ``key`` (-1 if none), by a C-speed search of the key column."""
        keys = self._map
        needle = key.to_bytes(8, "little")  # the bytes of the int64 cell holding it
        start = self._keys * 8
        end = start + self.capacity * 8
        pos = keys.find(needle, start, end)
        while pos != -1 and (pos - start) % 8:
            pos = keys.find(needle, pos + 1, end)
        return -1 if pos == -1 else (pos - start) // 8

    def acquire(self, worker: int, target: Target) -> int | None:
        """The slot of ``target`` for ``worker`` (allocated on first use); None when the board is full."""
        slot = self.slots.get(target)
        if slot is not None:
            return slot
        key = target_key(target)
        signed = key - (1 << 64) if key >= 1 << 63 else key
        cells = self.cells
        with self._locked():
            slot = self._find(key)
            if slot == -1:
                slot = self._find(0)
                if slot == -1:
                    if not self._full_logged:
                        log.error(
                            "load board full (%d targets): new targets' load is not shared", self.capacity
                        )
                        self._full_logged = True
                    return None
                base = self._rows + slot * self._stride
                for i in range(base, base + self._stride):
                    cells[i] = 0
                cells[self._keys + slot] = signed
            cells[self._holders + slot] |= 1 << worker
        self.slots[target] = slot
        return slot

    def release(self, worker: int, target: Target) -> None:
        """``worker`` no longer has ``target``: zero its row; the slot is freed when nobody holds it."""
        slot = self.slots.pop(target, None)
        if slot is None:
            return
        with self._locked():
            self._clear_row(worker, slot)
            self._drop_holder(worker, slot)

    def _clear_row(self, worker: int, slot: int) -> None:
        base = self._rows + slot * self._stride + worker * _FIELDS
        for i in range(base, base + _FIELDS):
            self.cells[i] = 0

    def _drop_holder(self, worker: int, slot: int) -> None:
        cells = self.cells
        mask = cells[self._holders + slot] & ~(1 << worker)
        cells[self._holders + slot] = mask
        if mask == 0:
            cells[self._keys + slot] = 0

    def clear(self, worker: int) -> None:
        """Zero a worker's rows and drop it from every slot (a dead or restarted worker's requests
        died with it); slots nobody else holds are freed."""
        with self._locked():
            for slot in range(self.capacity):
                if self.cells[self._holders + slot] >> worker & 1 or self.cells[self._keys + slot]:
                    self._clear_row(worker, slot)
                    if self.cells[self._holders + slot] >> worker & 1:
                        self._drop_holder(worker, slot)
        self.slots.clear()

    def publish(self, worker: int, target: Target, load: TargetLoad) -> None:
        """Write one worker's figures for one target it holds."""
        slot = self.slots.get(target)
        if slot is None:
            return
        i = self._rows + slot * self._stride + worker * _FIELDS
        cells = self.cells
        cells[i] = load.active
        cells[i + 1] = load.prefilling
        cells[i + 2] = load.pending_prefill_tokens

    def others(self, worker: int, target: Target) -> tuple[int, int, int]:
        """The sum over every other worker of (active, prefilling, pending_prefill_tokens)."""
        slot = self.slots.get(target)
        if slot is None:
            return 0, 0, 0
        cells = self.cells
        active = prefilling = pending = 0
        base = self._rows + slot * self._stride
        for w in range(self.workers):
            if w == worker:
                continue
            i = base + w * _FIELDS
            active += cells[i]
            prefilling += cells[i + 1]
            pending += cells[i + 2]
        return active, prefilling, pending

    def used(self) -> int:
        """Slots in use (any worker)."""
        return sum(1 for s in range(self.capacity) if self.cells[self._keys + s])

    def close(self) -> None:
        """Unmap and close (the file itself belongs to the supervisor)."""
        self.cells.release()
        self._map.close()
        os.close(self._fd)


class BoardView:
    """One worker's :class:`PeerLoads` view of a :class:`LoadBoard`."""

    def __init__(self, board: LoadBoard, worker: int) -> None:
        self.board = board
        self.worker = worker
        board.clear(worker)

    def track(self, target: Target) -> None:
        self.board.acquire(self.worker, target)

    def forget(self, target: Target) -> None:
        self.board.release(self.worker, target)

    def publish(self, target: Target, load: TargetLoad) -> None:
        self.board.publish(self.worker, target, load)

    def others(self, target: Target) -> tuple[int, int, int]:
        return self.board.others(self.worker, target)

    def slot_of(self, target: Target) -> int:
        slot = self.board.slots.get(target)
        return -1 if slot is None else slot

    def columns(self) -> PeerColumns:
        b = self.board
        return PeerColumns(b.cells, b._rows, b._stride, b.workers, self.worker)


class Ticket:
    """One dispatched request's share of a target's load; released exactly once."""

    __slots__ = ("_first", "_released", "load", "target", "uncached_tokens")

    def __init__(self, target: Target, load: TargetLoad, uncached_tokens: int) -> None:
        self.target = target
        self.load = load
        """The target's record when the request started (kept even if the target leaves meanwhile)."""
        self.uncached_tokens = uncached_tokens
        self._first = False
        self._released = False


class LoadTracker:
    """In-flight requests and prefill work per target, plus what :class:`PeerLoads` views report."""

    def __init__(self, peers: Sequence[PeerLoads] = ()) -> None:
        self._loads: dict[Target, TargetLoad] = {}
        self.peers = list(peers)
        self.generation = 0
        """Bumped when a target's load record is made or dropped (readers keep the records of a
        candidate set: :meth:`record`)."""
        self.on_free: Callable[[], None] | None = None
        """Called when a request's first byte or end frees capacity (flow control's wake-up)."""

    def add_peers(self, peers: PeerLoads) -> None:
        """Another source of other routers' load (the cluster store), tracking every known target."""
        for target in self._loads:
            peers.track(target)
        self.peers.append(peers)
        self.generation += 1  # (the candidate sets' peer slots: :meth:`peer_slots`)

    def peer_slots(self, targets: Sequence[Target]) -> list[bytes]:
        """Per peer view, where each target's figures live in its :meth:`PeerLoads.columns` (int64
        per target, -1: none): valid while :attr:`generation` stays the same (slots are given when
        a target is tracked and taken back when it is forgotten)."""
        out = []
        for p in self.peers:
            slot_of = p.slot_of
            out.append(array("q", [slot_of(t) for t in targets]).tobytes())
        return out

    def _own(self, target: Target) -> TargetLoad:
        load = self._loads.get(target)
        if load is None:
            load = self._loads[target] = TargetLoad()
            self.generation += 1
            for p in self.peers:
                p.track(target)
        return load

    def record(self, target: Target) -> TargetLoad:
        """This router's own load record of a target (the same object while the target stays; a
        zero load for one not in the fleet), without the peers' figures."""
        return self._loads.get(target) or _ZERO

    def track(self, target: Target) -> None:
        """A target joined the fleet."""
        self._own(target)

    def forget(self, target: Target) -> None:
        """A target left the fleet: its figures go (requests still running there finish on their
        own record), and peers withdraw it."""
        if self._loads.pop(target, None) is not None:
            self.generation += 1
            for p in self.peers:
                p.forget(target)

    def get(self, target: Target) -> TargetLoad:
        """The load of a target (a zero load for one not in the fleet), summed with the peers' (a
        copy: ``total`` and the engine figures stay this router's own)."""
        load = self._loads.get(target)
        if load is None:
            return TargetLoad()
        if not self.peers:
            return load
        active = prefilling = pending = 0
        for p in self.peers:
            a, b, c = p.others(target)
            active += a
            prefilling += b
            pending += c
        if not (active or prefilling or pending):
            return load
        return TargetLoad(
            load.active + active,
            load.prefilling + prefilling,
            load.pending_prefill_tokens + pending,
            load.total,
            load.engine_waiting,
            load.engine_running,
            load.engine_kv_usage,
        )

    def local_active(self, targets: Iterable[Target]) -> int:
        """Requests this router has in flight on these targets (what a drain waits for)."""
        loads = self._loads
        return sum(loads[t].active for t in targets if t in loads)

    def all(self) -> dict[Target, TargetLoad]:
        """Every target of the fleet, summed with the peers'."""
        return {t: self.get(t) for t in list(self._loads)}

    def _publish(self, target: Target, load: TargetLoad) -> None:
        if self._loads.get(target) is not load:
            return  # the target left (or re-joined) since: this record is no longer the shared one
        for p in self.peers:
            p.publish(target, load)

    def start(self, target: Target, uncached_tokens: int) -> Ticket:
        """A request was dispatched to ``target`` with this much prompt left to compute."""
        load = self._own(target)
        load.active += 1
        load.prefilling += 1
        load.pending_prefill_tokens += uncached_tokens
        load.total += 1
        if self.peers:
            self._publish(target, load)
        return Ticket(target, load, uncached_tokens)

    def first_byte(self, ticket: Ticket) -> None:
        """The engine answered: its prefill is done."""
        if ticket._first or ticket._released:
            return
        ticket._first = True
        load = ticket.load
        load.prefilling -= 1
        load.pending_prefill_tokens -= ticket.uncached_tokens
        if self.peers:
            self._publish(ticket.target, load)
        if self.on_free is not None:
            self.on_free()

    def finish(self, ticket: Ticket) -> None:
        """The response ended (or failed, or the client went away)."""
        if ticket._released:
            return
        self.first_byte(ticket)
        ticket._released = True
        load = ticket.load
        load.active -= 1
        if self.peers:
            self._publish(ticket.target, load)
        if self.on_free is not None:
            self.on_free()

    def set_engine_metrics(self, target: Target, waiting: float, running: float, kv_usage: float) -> None:
        """Blend in what the engine itself reports (scraped from its /metrics)."""
        load = self._loads.get(target)
        if load is None:
            return
        load.engine_waiting = waiting
        load.engine_running = running
        load.engine_kv_usage = kv_usage


__all__ = [
    "BoardView",
    "LoadBoard",
    "LoadTracker",
    "PeerColumns",
    "PeerLoads",
    "Target",
    "TargetLoad",
    "Ticket",
    "target_key",
]
