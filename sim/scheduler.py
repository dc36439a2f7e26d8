"""The mock engine's scheduler step, written once for the live engine and the offline simulator.

Why a module of its own: the live mock engine (``sim.engine.RankScheduler``, real time, asyncio) and the
offline simulator (``sim.offline``, virtual time) must schedule exactly alike, or offline predictions
stop matching live runs. Both drive a :class:`StepScheduler`, which holds one rank's FIFO waiting
queue, running batch and cache (:class:`~sim.kvcache.KVCache`) and knows nothing of clocks, sockets or
HTTP. A step is two calls with the step's duration spent in between, by ``asyncio.sleep`` or on a
virtual clock:

1. :meth:`StepScheduler.plan` decodes one token's worth of cache for every running request, oldest
   first (preempting the newest running request, recompute-style, when no block is free; no admission
   in a step that preempted), then admits waiting requests FIFO while ``running < max_num_seqs``, the
   step's uncached prompt tokens stay within ``max_num_batched_tokens`` (the first admission always
   fits) and the cache can supply the blocks (head-of-line blocking). It returns a :class:`StepPlan`
   with the step's modelled duration (:func:`step_duration`).
2. :meth:`StepScheduler.complete` emits one token for every planned request still running, and frees
   the requests that reached ``max_tokens``. It returns a :class:`StepOutcome`: who got which token,
   whose token was the first (TTFT) and who finished.

Everything else (publishing the cache's events, metrics, HTTP streams, router bookkeeping) stays with
the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import msgspec

from sim.kvcache import KVCache


class EngineConfig(Protocol):
    """The figures of an engine's config the step model reads (``sim.engine.EngineConfig``, which
    builds on this module)."""

    @property
    def block_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def step_overhead_s(self) -> float: ...

    @property
    def prefill_s_per_token(self) -> float: ...

    @property
    def decode_step_s(self) -> float: ...

    @property
    def decode_s_per_seq(self) -> float: ...

    @property
    def cpu_load_s_per_block(self) -> float: ...


class SchedRequest(Protocol):
    """What the step needs of a request (``sim.engine.EngineRequest``, the offline simulator's own)."""

    request_id: str
    """Cache key of the request's blocks (unique among running requests of a rank)."""
    prompt: list[int]
    outputs: list[int]
    """Tokens generated so far; a (re)admission prefills ``prompt + outputs``."""
    max_tokens: int
    cached_tokens: int | None
    """Set by the step at the first admission (GPU + CPU hit tokens), then kept through preemptions."""


R = TypeVar("R", bound=SchedRequest)


class StepModel(msgspec.Struct, frozen=True, kw_only=True):
    """Budgets and cost model of one rank's step (see :meth:`from_engine` for where each comes from)."""

    block_size: int
    max_num_seqs: int
    """Running-batch bound."""
    max_num_batched_tokens: float
    """Uncached prompt tokens a step may prefill, beyond its first admission (a float: offline it is
    divided by the token scale)."""
    step_overhead_s: float
    prefill_s_per_token: float
    cpu_load_s_per_block: float
    decode_step_s: float
    decode_s_per_seq: float
    duration_factor: float
    """Multiplies every step's duration: ``time_scale`` live, the token scale offline."""

    @classmethod
    def from_engine(cls, cfg: EngineConfig, *, duration_factor: float, token_scale: float = 1.0) -> StepModel:
        """The model of an ``EngineConfig``; ``token_scale`` > 1 shrinks the token budget (scaled traces)."""
        return cls(
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens / token_scale,
            step_overhead_s=cfg.step_overhead_s,
            prefill_s_per_token=cfg.prefill_s_per_token,
            cpu_load_s_per_block=cfg.cpu_load_s_per_block,
            decode_step_s=cfg.decode_step_s,
            decode_s_per_seq=cfg.decode_s_per_seq,
            duration_factor=duration_factor,
        )


def step_duration(model: StepModel, prefill_tokens: int, cpu_hit_blocks: int, n_decoding: int) -> float:
    """Seconds one step takes: overhead, uncached prefill, CPU-tier loads, and a decode pass if any."""
    duration = (
        model.step_overhead_s
        + prefill_tokens * model.prefill_s_per_token
        + cpu_hit_blocks * model.cpu_load_s_per_block
    )
    if n_decoding:
        duration += model.decode_step_s + n_decoding * model.decode_s_per_seq
    return duration * model.duration_factor


@dataclass(eq=False)
class StepPlan(Generic[R]):
    """What one step schedules, decided at its start."""

    decoding: list[R]
    """Running requests that decode a token this step, oldest first."""
    admitted: list[R]
    """Requests admitted (prefilled) this step, in queue order; each produces a token at the step's end."""
    rejected: list[R]
    """Requests taken off the queue because they do not fit even in an otherwise empty cache."""
    preempted: int
    """Running requests preempted back to the queue by this step."""
    prefill_tokens: int
    """Uncached prompt tokens prefilled (GPU and CPU hits excluded)."""
    cpu_hit_blocks: int
    """Blocks loaded back from the CPU tier."""
    duration_s: float

    @property
    def idle(self) -> bool:
        """Nothing was scheduled: the caller only waits ``duration_s`` (the step overhead) and retries."""
        return not self.admitted and not self.decoding


@dataclass(eq=False)
class StepOutcome(Generic[R]):
    """What one step produced at its end."""

    emitted: list[tuple[R, int]] = field(default_factory=list)
    """(request, token) for every planned request still running, in plan order (admitted first)."""
    first: list[R] = field(default_factory=list)
    """Requests whose token was their first (time to first token ends now)."""
    finished: list[R] = field(default_factory=list)
    """Requests that reached ``max_tokens``; their blocks are freed and they left the running batch."""


class StepScheduler(Generic[R]):
    """One rank's waiting queue, running batch and cache, and the step algorithm over them."""

    def __init__(self, cache: KVCache, model: StepModel) -> None:
        self.cache = cache
        self.model = model
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        self.preemptions = 0
        self.held: set[str] = set()
        """Requests whose blocks stay pinned when they finish (a P/D prefill leg's blocks, kept
        until the decode engine has read them); the caller frees them with ``cache.free``."""

    @property
    def has_work(self) -> bool:
        """Whether a step would have anything to do."""
        return bool(self.running or self.waiting)

    def preempt(self, req: R) -> None:
        """vLLM's recompute preemption: free the blocks, requeue at the head, prefill again later."""
        self.running.remove(req)
        self.cache.free(req.request_id)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def drop(self, req: R) -> None:
        """Forget a request (client gone); its blocks are released but stay cached."""
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)

    def plan(self) -> StepPlan[R]:
        """Decode, preempt and admit for one step (mutates the queues and the cache)."""
        model = self.model
        cache = self.cache
        decoding: list[R] = []
        preempted_before = self.preemptions
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted earlier in this loop
            while not cache.decode(req.request_id, req.outputs[-1]):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            else:
                decoding.append(req)
        preempted = self.preemptions - preempted_before
        admitted: list[R] = []
        rejected: list[R] = []
        prefill_tokens = 0
        cpu_blocks = 0
        while self.waiting and not preempted and len(self.running) < model.max_num_seqs:
            req = self.waiting[0]
            tokens = req.prompt + req.outputs if req.outputs else req.prompt
            # a P/D decode leg's request carries ``external_tokens``: prompt tokens whose KV another
            # engine sent (no compute at admission); received once, then they are in this cache
            external: int = getattr(req, "external_tokens", 0)
            if admitted:
                gpu_hit, cpu_hit = cache.probe(tokens)
                saved = max(gpu_hit + cpu_hit, min(external, len(tokens) - 1))
                if prefill_tokens + len(tokens) - saved > model.max_num_batched_tokens:
                    break
            adm = cache.admit(
                req.request_id, tokens, external, getattr(req, "report_hits", False), len(req.prompt)
            )
            if adm is None:
                if not cache.fits_alone(len(tokens)):
                    rejected.append(self.waiting.popleft())  # cannot fit even alone: the caller fails it
                    continue
                break  # wait: running requests finish, blocks kept for a P/D transfer are read
            self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            if req.cached_tokens is None:
                req.cached_tokens = adm.cached_tokens
            if external:
                setattr(req, "external_tokens", 0)  # noqa: B010 - not part of SchedRequest
            prefill_tokens += len(tokens) - adm.cached_tokens
            cpu_blocks += adm.cpu_hit_tokens // model.block_size
        return StepPlan(
            decoding=decoding,
            admitted=admitted,
            rejected=rejected,
            preempted=preempted,
            prefill_tokens=prefill_tokens,
            cpu_hit_blocks=cpu_blocks,
            duration_s=step_duration(model, prefill_tokens, cpu_blocks, len(decoding)),
        )

    def complete(self, plan: StepPlan[R], sample: Callable[[R], int]) -> StepOutcome[R]:
        """End a planned step: one token (from ``sample``) per planned request still running.

        Requests that left the batch during the step (aborted, preempted by a cache reset) get nothing.
        """
        out: StepOutcome[R] = StepOutcome()
        for req in plan.admitted + plan.decoding:
            if req not in self.running:
                continue
            token = sample(req)
            req.outputs.append(token)
            out.emitted.append((req, token))
            if len(req.outputs) == 1:
                out.first.append(req)
            if len(req.outputs) >= req.max_tokens:
                self.running.remove(req)
                if req.request_id in self.held:
                    self.held.discard(req.request_id)  # pinned for a transfer: the caller frees it
                else:
                    self.cache.free(req.request_id)
                out.finished.append(req)
        return out


__all__ = ["SchedRequest", "StepModel", "StepOutcome", "StepPlan", "StepScheduler", "step_duration"]
