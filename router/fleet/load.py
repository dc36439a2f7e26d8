"""Load the router tracks itself, per (backend, DP rank): requests and tokens in flight.

A request counts as *prefilling* from dispatch until its first response byte (the engine has then
computed the prompt) and as *decoding* until its response ends. ``pending_prefill_tokens`` is the
uncached prompt work the engine still has to do before a new request's prefill can start, which is
what a new request waits behind; ``active`` is the number of sequences sharing decode steps.

All methods run on the router's event loop thread: no locks.

With several worker processes (``server.workers``), each worker tracks the requests it dispatched
and publishes its figures on a shared :class:`LoadBoard`; ``get`` then returns the fleet-wide sum,
so every worker scores candidates against the load of all of them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import msgspec

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


_FIELDS = 3  # active, prefilling, pending_prefill_tokens


class LoadBoard:
    """In-flight figures of every worker process, in a shared file mapping: one row of int64 per
    (worker, target). Each worker writes only its own rows and reads the others'; aligned 8-byte
    stores are atomic on the platforms we run on, and a reader one update behind is harmless.

    A file mapping rather than ``multiprocessing.shared_memory``: no resource-tracker bookkeeping
    across processes, and the file lives in the supervisor's run directory, removed with it.
    """

    def __init__(self, path: str, workers: int, targets: Sequence[Target]) -> None:
        self.path = path
        self.workers = workers
        self.targets = list(targets)
        self.slot = {t: i for i, t in enumerate(self.targets)}
        self._stride = len(self.targets) * _FIELDS
        size = max(workers * self._stride * 8, 8)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.cells = memoryview(self._map).cast("q")

    def clear(self, worker: int) -> None:
        """Zero a worker's rows (a restarted worker must not inherit its predecessor's requests)."""
        base = worker * self._stride
        for i in range(base, base + self._stride):
            self.cells[i] = 0

    def publish(self, worker: int, target: Target, load: TargetLoad) -> None:
        """Write one worker's figures for one target."""
        slot = self.slot.get(target)
        if slot is None:
            return
        i = worker * self._stride + slot * _FIELDS
        cells = self.cells
        cells[i] = load.active
        cells[i + 1] = load.prefilling
        cells[i + 2] = load.pending_prefill_tokens

    def others(self, worker: int, target: Target) -> tuple[int, int, int]:
        """The sum over every other worker of (active, prefilling, pending_prefill_tokens)."""
        slot = self.slot.get(target)
        if slot is None:
            return 0, 0, 0
        cells = self.cells
        active = prefilling = pending = 0
        for w in range(self.workers):
            if w == worker:
                continue
            i = w * self._stride + slot * _FIELDS
            active += cells[i]
            prefilling += cells[i + 1]
            pending += cells[i + 2]
        return active, prefilling, pending

    def close(self) -> None:
        """Unmap (the file itself belongs to the supervisor)."""
        self.cells.release()
        self._map.close()


class Ticket:
    """One dispatched request's share of a target's load; released exactly once."""

    __slots__ = ("_first", "_released", "target", "uncached_tokens")

    def __init__(self, target: Target, uncached_tokens: int) -> None:
        self.target = target
        self.uncached_tokens = uncached_tokens
        self._first = False
        self._released = False


class LoadTracker:
    """In-flight requests and prefill work per target (fleet-wide when a :class:`LoadBoard` is given)."""

    def __init__(self, board: LoadBoard | None = None, worker: int = 0) -> None:
        self._loads: dict[Target, TargetLoad] = {}
        self.board = board
        self.worker = worker
        if board is not None:
            board.clear(worker)

    def _own(self, target: Target) -> TargetLoad:
        load = self._loads.get(target)
        if load is None:
            load = self._loads[target] = TargetLoad()
        return load

    def get(self, target: Target) -> TargetLoad:
        """The load of a target (a zero load for one never used); with a board, summed over workers
        (a copy: ``total`` and the engine figures stay this worker's own)."""
        load = self._own(target)
        if self.board is None:
            return load
        active, prefilling, pending = self.board.others(self.worker, target)
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

    def all(self) -> dict[Target, TargetLoad]:
        """Every target seen so far (and, with a board, every target of the fleet)."""
        targets = list(self._loads)
        if self.board is not None:
            targets += [t for t in self.board.targets if t not in self._loads]
        return {t: self.get(t) for t in targets}

    def start(self, target: Target, uncached_tokens: int) -> Ticket:
        """A request was dispatched to ``target`` with this much prompt left to compute."""
        load = self._own(target)
        load.active += 1
        load.prefilling += 1
        load.pending_prefill_tokens += uncached_tokens
        load.total += 1
        if self.board is not None:
            self.board.publish(self.worker, target, load)
        return Ticket(target, uncached_tokens)

    def first_byte(self, ticket: Ticket) -> None:
        """The engine answered: its prefill is done."""
        if ticket._first or ticket._released:
            return
        ticket._first = True
        load = self._own(ticket.target)
        load.prefilling -= 1
        load.pending_prefill_tokens -= ticket.uncached_tokens
        if self.board is not None:
            self.board.publish(self.worker, ticket.target, load)

    def finish(self, ticket: Ticket) -> None:
        """The response ended (or failed, or the client went away)."""
        if ticket._released:
            return
        self.first_byte(ticket)
        ticket._released = True
        load = self._own(ticket.target)
        load.active -= 1
        if self.board is not None:
            self.board.publish(self.worker, ticket.target, load)

    def set_engine_metrics(self, target: Target, waiting: float, running: float, kv_usage: float) -> None:
        """Blend in what the engine itself reports (scraped from its /metrics)."""
        load = self._own(target)
        load.engine_waiting = waiting
        load.engine_running = running
        load.engine_kv_usage = kv_usage
