"""Load the router tracks itself, per (backend, DP rank): requests and tokens in flight.

A request counts as *prefilling* from dispatch until its first response byte (the engine has then
computed the prompt) and as *decoding* until its response ends. ``pending_prefill_tokens`` is the
uncached prompt work the engine still has to do before a new request's prefill can start, which is
what a new request waits behind; ``active`` is the number of sequences sharing decode steps.

All methods run on the router's event loop thread: no locks.
"""

from __future__ import annotations

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


class Ticket:
    """One dispatched request's share of a target's load; released exactly once."""

    __slots__ = ("_first", "_released", "target", "uncached_tokens")

    def __init__(self, target: Target, uncached_tokens: int) -> None:
        self.target = target
        self.uncached_tokens = uncached_tokens
        self._first = False
        self._released = False


class LoadTracker:
    """In-flight requests and prefill work per target."""

    def __init__(self) -> None:
        self._loads: dict[Target, TargetLoad] = {}

    def get(self, target: Target) -> TargetLoad:
        """The load of a target (a zero load for one never used)."""
        load = self._loads.get(target)
        if load is None:
            load = self._loads[target] = TargetLoad()
        return load

    def all(self) -> dict[Target, TargetLoad]:
        """Every target seen so far."""
        return dict(self._loads)

    def start(self, target: Target, uncached_tokens: int) -> Ticket:
        """A request was dispatched to ``target`` with this much prompt left to compute."""
        load = self.get(target)
        load.active += 1
        load.prefilling += 1
        load.pending_prefill_tokens += uncached_tokens
        load.total += 1
        return Ticket(target, uncached_tokens)

    def first_byte(self, ticket: Ticket) -> None:
        """The engine answered: its prefill is done."""
        if ticket._first or ticket._released:
            return
        ticket._first = True
        load = self.get(ticket.target)
        load.prefilling -= 1
        load.pending_prefill_tokens -= ticket.uncached_tokens

    def finish(self, ticket: Ticket) -> None:
        """The response ended (or failed, or the client went away)."""
        if ticket._released:
            return
        self.first_byte(ticket)
        ticket._released = True
        self.get(ticket.target).active -= 1

    def set_engine_metrics(self, target: Target, waiting: float, running: float, kv_usage: float) -> None:
        """Blend in what the engine itself reports (scraped from its /metrics)."""
        load = self.get(target)
        load.engine_waiting = waiting
        load.engine_running = running
        load.engine_kv_usage = kv_usage
