"""Offline fleet simulator: the real index and the real policy over modelled engines, in virtual time.

Why: sweeping routing policies against live engines is slow and noisy; here a whole Mooncake trace
runs in seconds to a minute on one core, deterministically, so policies and weights can be compared
and tuned. Nothing is mocked on the router side:

* **engines**: one :class:`sim.kvcache.PrefixCache` per engine (finite, so it evicts) driven by the
  mock engine's own step, :class:`sim.scheduler.StepScheduler` (the code the live engine runs, with
  ``sim.engine.EngineConfig``'s fields), in virtual time: decode every running sequence (preempting
  the newest when out of blocks), admit FIFO within ``max_num_seqs``, the step token budget and free
  blocks, then a step lasts ``step_overhead + uncached prompt tokens * prefill cost + CPU-tier loads
  + (decode cost if decoding)``; a prefill yields the first token at the step's end;
* **index**: ``index.store.PrefixStore`` fed by ``index.ingest.Ingestor`` with every event batch the
  caches emit, encoded to msgpack bytes as vLLM would and decoded by ``index.wire`` (``wire=False``
  converts the structs directly), ``event_lag_s`` after the step that produced it;
* **policy**: ``router.decision.policy.Policy`` with ``router.fleet.load.LoadTracker`` semantics (a request is
  prefilling, with its uncached prompt tokens pending, until its first token, and active until its
  last), plus predict-on-route as ``index.kvindex.KVIndex`` does it, in virtual time.

Arrivals come from a workload or a trace in timestamp order divided by ``speedup``; in session mode
a later turn of a conversation is issued no earlier than its predecessor's completion plus its think
time. Reported per policy (:class:`SimResult`): the hit ratio as engines count it (cached / prompt
tokens at first admission), its ratio to the infinite-cache bound in the same units (longest prefix of
full blocks seen in any earlier prompt, capped like the engine at ``(n - 1) // block_size`` blocks)
and to a finite "pooled" bound (one LRU cache of the whole fleet's capacity),
TTFT percentiles in virtual seconds, throughput, and load spread (max / mean over engines).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from index.ingest import Ingestor
from index.keys import prompt_keys
from index.kvindex import KVIndex
from index.store import PrefixStore
from index.wire import AllBlocksCleared as WireCleared
from index.wire import Batch, decode_payload
from index.wire import BlockRemoved as WireRemoved
from index.wire import BlockStored as WireStored
from index.wire import Event as WireEvent
from router.decision.policy import Candidate, Decision, Policy, PolicyConfig
from router.fleet.load import LoadTracker, Ticket
from sim.engine import EngineConfig
from sim.kvcache import PrefixCache
from sim.publisher import AllBlocksCleared, BlockRemoved, BlockStored, Event, encode_batch
from sim.scheduler import StepModel, StepPlan, StepScheduler
from sim.workload import Request


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Fleet shape and replay options of one offline run."""

    engines: int = 8
    """Number of engines (one DP rank each)."""
    engine: EngineConfig = msgspec.field(
        default_factory=lambda: EngineConfig(num_gpu_blocks=32_768, max_model_len=1 << 30)
    )
    """Cache size and timing model of every engine (the mock engine's fields; 32k blocks = 512k tokens)."""
    token_scale: float = 1.0
    """Real tokens per simulated token when a trace is scaled down (``Trace.scale``). Everything scales
    together so that cache pressure and time stay realistic: output lengths are divided by it
    (rounded up), step durations multiplied by it (prefill per token, decode step and per-sequence
    cost, overhead: one simulated step stands for ``token_scale`` real ones) and the step token
    budget divided by it."""
    speedup: float = 1.0
    """Arrival times are divided by this."""
    session_mode: bool = True
    """Issue a later turn of a session no earlier than its predecessor's completion + think time."""
    event_lag_s: float = 0.0
    """Virtual delay between the end of a step and the router applying that step's events."""
    predict_ttl_s: float = 2.0
    """Predict-on-route lifetime in virtual seconds, as ``IndexConfig.predict_ttl_s`` (0 = off)."""
    wire: bool = True
    """Encode events to bytes and decode them with index.wire (as the router does); False converts."""
    seed: int = 0
    """Seeds the policy's RNG (random policy, tie-breaks, temperature)."""
    first_byte_at_dispatch: bool = False
    """Model an engine that streams a byte before prefill (the mock engine's chat role chunk): the
    load tracker's prefill-pending state then ends at dispatch, as it does in such live runs."""
    scale_policy: bool = True
    """With ``token_scale`` s != 1, give the policy its block-valued knobs in scaled blocks
    (decode_weight / s, waiting_weight / s, min_match_blocks / s) so that a config means the same
    as on unscaled prompts (see :func:`scale_policy`)."""


PolicyFactory = Callable[[PolicyConfig, random.Random], Policy]


def scale_policy(pcfg: PolicyConfig, scale: float) -> PolicyConfig:
    """The config that behaves on prompts scaled down ``scale`` times as ``pcfg`` does on real ones.

    Prefix credit, prefill and queued work are all counted in blocks of the prompt, so they shrink
    with the prompt; the per-request terms (``decode_weight`` per request in flight,
    ``waiting_weight``) and ``min_match_blocks`` are absolute block counts and must shrink with them.
    """
    if scale == 1:
        return pcfg
    return msgspec.structs.replace(
        pcfg,
        decode_weight=pcfg.decode_weight / scale,
        waiting_weight=pcfg.waiting_weight / scale,
        min_match_blocks=max(1, math.ceil(pcfg.min_match_blocks / scale)),
    )


class SimResult(msgspec.Struct, kw_only=True):
    """What one policy achieved on one workload (virtual time)."""

    policy: str
    label: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_ratio: float
    bound: float
    """Infinite-cache hit ratio in the same units (token-level, engine block granularity)."""
    pooled_bound: float
    """Hit ratio of one LRU cache as large as the whole fleet (engines x blocks) fed every prompt in
    order: roughly the best any routing can do at this capacity (decode blocks not counted)."""
    ratio_to_bound: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    e2e_p50: float
    throughput_rps: float
    output_tps: float
    makespan_s: float
    load_spread_tokens: float
    """max / mean prompt tokens per engine."""
    load_spread_requests: float
    """max / mean requests per engine."""
    per_engine_requests: list[int]
    per_engine_prompt_tokens: list[int]
    decisions: dict[str, int]
    """Decision outcomes (prefix / load)."""
    preemptions: int
    evicted_blocks: int
    truncated: int
    """Prompts cut to fit one engine's cache."""
    wall_s: float
    trace_bound: float | None = None
    """Block-level bound of the trace as loaded (traces only)."""
    config: dict[str, Any] = {}


# ---- engines ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Req:
    idx: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    rng: random.Random
    engine: int = -1
    ticket: Ticket | None = None
    outputs: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    first_at: float | None = None
    done_at: float | None = None


class _Engine:
    """One engine rank: the mock engine's step (:class:`StepScheduler`) over a PrefixCache, in virtual time.

    Durations are multiplied by the token scale: one simulated step stands for ``token_scale`` real ones.
    """

    VOCAB = 2048
    """Output tokens are drawn from [5, VOCAB)."""

    def __init__(self, index: int, cfg: EngineConfig, token_scale: float) -> None:
        self.index = index
        cache = PrefixCache(
            cfg.num_gpu_blocks,
            cfg.block_size,
            hash_seed=cfg.hash_seed,
            cpu_blocks=cfg.cpu_blocks,
            hashes_per_chunk=cfg.hashes_per_chunk,
        )
        model = StepModel.from_engine(cfg, duration_factor=token_scale, token_scale=token_scale)
        self.core: StepScheduler[_Req] = StepScheduler(cache, model)
        self.cache = cache
        self.busy = False
        self.evicted = 0
        self._plan: StepPlan[_Req] | None = None  # the step in flight

    @property
    def waiting(self) -> deque[_Req]:
        """Where arrivals are queued (the step's own FIFO)."""
        return self.core.waiting

    @property
    def preemptions(self) -> int:
        """Preemptions so far (reported per run)."""
        return self.core.preemptions

    def begin_step(self) -> float | None:
        """Plan one step (decode, then admit); returns its duration, or None when there is no work."""
        if not self.core.has_work:
            self.busy = False
            return None
        plan = self.core.plan()
        if plan.rejected:
            n = len(plan.rejected[0].prompt) + len(plan.rejected[0].outputs)
            raise RuntimeError(f"request of {n} tokens does not fit engine {self.index}")
        self._plan = plan
        self.busy = True
        return plan.duration_s

    def end_step(self, now: float) -> tuple[list[_Req], list[_Req]]:
        """Emit one token per scheduled request; returns (first tokens, finished requests)."""
        plan, self._plan = self._plan, None
        if plan is None:
            return [], []
        out = self.core.complete(plan, lambda r: 5 + r.rng.randrange(self.VOCAB - 5))
        for req in out.first:
            req.first_at = now
        for req in out.finished:
            req.done_at = now
        return out.first, out.finished


# ---- the router side -----------------------------------------------------------------------------------


def _to_wire(ev: Event) -> WireEvent:
    if isinstance(ev, BlockStored):
        return WireStored(
            block_hashes=list(ev.block_hashes),
            parent_block_hash=ev.parent_block_hash,
            token_ids=ev.token_ids,
            block_size=ev.block_size,
            lora_id=ev.lora_id,
            medium=ev.medium or "GPU",
            lora_name=ev.lora_name,
            extra_keys=list(ev.extra_keys) if ev.extra_keys is not None else None,
            group_idx=ev.group_idx,
        )
    if isinstance(ev, BlockRemoved):
        return WireRemoved(
            block_hashes=list(ev.block_hashes), medium=ev.medium or "GPU", group_idx=ev.group_idx
        )
    assert isinstance(ev, AllBlocksCleared)
    return WireCleared()


class SimRouter:
    """The router's decision path with the real store, ingestor, load tracker and policy."""

    def __init__(
        self, policy: Policy, names: Sequence[str], block_size: int, predict_ttl_s: float, wire: bool
    ):
        self.policy = policy
        self.block_size = block_size
        self.store = PrefixStore()
        self.ingestor = Ingestor(self.store, block_size)
        self.sources = [(n, 0) for n in names]
        self.sidx = [self.ingestor.add_source(s) for s in self.sources]
        self.loads = LoadTracker()
        self.predict_ttl_s = predict_ttl_s
        self.predicted: list[dict[int, float]] = [{} for _ in names]
        self.wire = wire
        self.decisions: dict[str, int] = {}
        self._pending: list[tuple[int, Batch | None]] = []

    def apply(self, engine: int, events: list[Event], ts: float) -> None:
        """Deliver one step's events from an engine (applied, in order, before the next lookup)."""
        if self.wire:
            batch = decode_payload(encode_batch(events, ts, 0))
        else:
            batch = Batch(ts=ts, events=[_to_wire(e) for e in events], data_parallel_rank=0)
        self._pending.append((self.sidx[engine], batch))

    def flush(self) -> None:
        """Apply the delivered batches as one chunk, as the subscriber hands them to the ingestor."""
        if self._pending:
            self.ingestor.apply_chunk(self._pending)
            self._pending = []

    def route(self, tokens: Sequence[int], keys: list[int], now: float) -> tuple[int, Decision, int]:
        """Choose an engine; returns (engine index, decision, matched blocks on it)."""
        bs = self.block_size
        self.flush()
        matches = {m.source: m for m in self.store.lookup(keys, self.sidx)}
        candidates = []
        for i, src in enumerate(self.sources):
            m = matches[src]
            pred = self.predicted[i]
            if pred and self.predict_ttl_s > 0:
                KVIndex._extend_with_predictions(m, keys, pred, now)
            candidates.append(Candidate(src[0], 0, m.blocks, m.by_medium, self.loads.get(src)))
        decision = self.policy.choose(len(tokens) // bs, bs, candidates)
        chosen = next(i for i, s in enumerate(self.sources) if s[0] == decision.backend)
        self.decisions[decision.outcome] = self.decisions.get(decision.outcome, 0) + 1
        matched = candidates[chosen].matched_blocks
        if self.predict_ttl_s > 0 and keys:
            pred = self.predicted[chosen]
            if len(pred) + len(keys) > 200_000:
                self.predicted[chosen] = pred = {k: t for k, t in pred.items() if t > now}
            expiry = now + self.predict_ttl_s
            for k in keys:
                pred[k] = expiry
        return chosen, decision, matched


# ---- the simulation ------------------------------------------------------------------------------------

_STEP, _EVENTS, _ARRIVAL = 0, 1, 2


class PreparedWorkload:
    """Requests plus a way to get each one's token ids (tokenized once; trace prompts lazily)."""

    def __init__(
        self,
        requests: Sequence[Request],
        tokenize: Callable[[Request], list[int]] | None = None,
        *,
        trace_bound: float | None = None,
        label: str = "",
    ) -> None:
        self.requests = list(requests)
        self.trace_bound = trace_bound
        self.label = label
        self._tokenize = tokenize
        self._cache: dict[int, list[int]] = {}
        for i, r in enumerate(self.requests):
            if r.messages is not None:
                if tokenize is None:
                    raise ValueError("chat requests need a tokenizer")
                self._cache[i] = tokenize(r)

    def tokens(self, i: int) -> list[int]:
        """Token ids of request ``i``."""
        got = self._cache.get(i)
        if got is not None:
            return got
        ids = self.requests[i].token_ids()
        if ids is None:
            raise ValueError(f"request {i} has no prompt")
        return ids


def chat_tokenizer(tok: Any) -> Callable[[Request], list[int]]:
    """Tokenize chat requests exactly as the engine does (template, generation prompt, no BOS added)."""

    def fn(r: Request) -> list[int]:
        assert r.messages is not None
        ids: list[int] = tok.encode_chat(r.messages, add_generation_prompt=True)
        return ids

    return fn


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def _spread(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def simulate(
    work: PreparedWorkload,
    policy: PolicyConfig | str = "kv",
    cfg: SimConfig | None = None,
    *,
    factory: PolicyFactory | None = None,
    label: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``work`` through a modelled fleet routed by ``policy``; deterministic for a given seed.

    ``factory`` builds a different Policy class (prototype cost formulas) from the config.
    """
    cfg = cfg or SimConfig()
    pcfg = PolicyConfig(name=policy) if isinstance(policy, str) else policy  # type: ignore[arg-type]
    rng = random.Random(cfg.seed)
    run_cfg = scale_policy(pcfg, cfg.token_scale) if cfg.scale_policy else pcfg
    pol = factory(run_cfg, rng) if factory is not None else Policy(run_cfg, rng)
    ecfg = cfg.engine
    bs = ecfg.block_size
    names = [f"engine-{i}" for i in range(cfg.engines)]
    router = SimRouter(pol, names, bs, cfg.predict_ttl_s, cfg.wire)
    engines = [_Engine(i, ecfg, cfg.token_scale) for i in range(cfg.engines)]
    max_prompt = ecfg.num_gpu_blocks * bs
    started = time.perf_counter()

    heap: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, kind, seq, payload))

    reqs = work.requests
    n = len(reqs)
    # session chaining: turn k waits for turn k-1 of the same session
    prev_of: dict[int, int] = {}
    next_of: dict[int, int] = {}
    if cfg.session_mode:
        last: dict[str, tuple[int, int]] = {}
        for i, r in enumerate(reqs):
            if r.think_s is not None and r.session in last and last[r.session][1] == r.turn - 1:
                prev_of[i] = last[r.session][0]
                next_of[last[r.session][0]] = i
            last[r.session] = (i, r.turn)
    for i, r in enumerate(reqs):
        if i not in prev_of:
            push(r.at_s / cfg.speedup, _ARRIVAL, i)

    seen_keys: set[int] = set()
    bound_hit = 0
    pool: OrderedDict[int, None] = OrderedDict()
    pool_cap = cfg.engines * ecfg.num_gpu_blocks
    pool_hit = 0
    records: list[_Req] = []
    truncated = 0
    finished = 0
    first_arrival: float | None = None
    now = 0.0
    while heap:
        now, kind, _, payload = heapq.heappop(heap)
        if kind == _ARRIVAL:
            i = payload
            r = reqs[i]
            tokens = work.tokens(i)
            if len(tokens) + r.max_tokens + bs > max_prompt:
                tokens = tokens[: max(1, max_prompt - r.max_tokens - 2 * bs)]
                truncated += 1
            keys = prompt_keys(tokens, bs)
            cap = (len(tokens) - 1) // bs
            bound_hit += _cached_prefix(keys, cap, seen_keys) * bs
            seen_keys.update(keys)
            pool_hit += _cached_prefix(keys, cap, pool) * bs
            for key in keys:
                pool[key] = None
                pool.move_to_end(key)
            while len(pool) > pool_cap:
                pool.popitem(last=False)
            e, _decision, matched = router.route(tokens, keys, now)
            max_tokens = max(1, math.ceil(r.max_tokens / cfg.token_scale))
            req = _Req(i, f"r{i}", tokens, max_tokens, now, random.Random(keys[-1] if keys else i))
            req.engine = e
            req.ticket = router.loads.start(router.sources[e], max(len(tokens) - matched * bs, 0))
            if cfg.first_byte_at_dispatch:
                router.loads.first_byte(req.ticket)
            records.append(req)
            if first_arrival is None:
                first_arrival = now
            eng = engines[e]
            eng.waiting.append(req)
            if not eng.busy:
                d = eng.begin_step()
                if d is not None:
                    push(now + d, _STEP, e)
        elif kind == _STEP:
            eng = engines[payload]
            firsts, done = eng.end_step(now)
            for req in firsts:
                assert req.ticket is not None
                router.loads.first_byte(req.ticket)
            for req in done:
                assert req.ticket is not None
                router.loads.finish(req.ticket)
                finished += 1
                if progress is not None and finished % 500 == 0:
                    progress(finished, n)
                nxt = next_of.get(req.idx)
                if nxt is not None:
                    r = reqs[nxt]
                    push(max(r.at_s / cfg.speedup, now + (r.think_s or 0.0) / cfg.speedup), _ARRIVAL, nxt)
            events = eng.cache.take_events()
            if events:
                eng.evicted += sum(
                    len(ev.block_hashes)
                    for ev in events
                    if isinstance(ev, BlockRemoved) and ev.medium == "GPU"
                )
                if cfg.event_lag_s > 0:
                    push(now + cfg.event_lag_s, _EVENTS, (payload, events, now))
                else:
                    router.apply(payload, events, now)
            d = eng.begin_step()
            if d is not None:
                push(now + d, _STEP, payload)
        else:
            e, events, ts = payload
            router.apply(e, events, ts)
    if progress is not None:
        progress(finished, n)

    prompt = sum(len(q.prompt) for q in records)
    cached = sum(q.cached_tokens or 0 for q in records)
    ttft = [q.first_at - q.arrival for q in records if q.first_at is not None]
    e2e = [q.done_at - q.arrival for q in records if q.done_at is not None]
    end = max((q.done_at for q in records if q.done_at is not None), default=0.0)
    makespan = end - (first_arrival or 0.0)
    per_req = [0] * cfg.engines
    per_tok = [0] * cfg.engines
    for q in records:
        per_req[q.engine] += 1
        per_tok[q.engine] += len(q.prompt)
    hit = cached / prompt if prompt else 0.0
    bound = bound_hit / prompt if prompt else 0.0
    return SimResult(
        policy=pcfg.name,
        label=label or pcfg.name,
        requests=len(records),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_ratio=hit,
        bound=bound,
        ratio_to_bound=hit / bound if bound else 0.0,
        pooled_bound=pool_hit / prompt if prompt else 0.0,
        ttft_p50=_pct(ttft, 0.5),
        ttft_p90=_pct(ttft, 0.9),
        ttft_p99=_pct(ttft, 0.99),
        ttft_mean=sum(ttft) / len(ttft) if ttft else 0.0,
        e2e_p50=_pct(e2e, 0.5),
        throughput_rps=len(e2e) / makespan if makespan > 0 else 0.0,
        output_tps=sum(len(q.outputs) for q in records) / makespan if makespan > 0 else 0.0,
        makespan_s=makespan,
        load_spread_tokens=_spread(per_tok),
        load_spread_requests=_spread(per_req),
        per_engine_requests=per_req,
        per_engine_prompt_tokens=per_tok,
        decisions=dict(router.decisions),
        preemptions=sum(e.preemptions for e in engines),
        evicted_blocks=sum(e.evicted for e in engines),
        truncated=truncated,
        wall_s=time.perf_counter() - started,
        trace_bound=work.trace_bound,
        config={
            "policy": msgspec.to_builtins(pcfg),
            "engines": cfg.engines,
            "capacity_blocks": ecfg.num_gpu_blocks,
            "cpu_blocks": ecfg.cpu_blocks,
            "block_size": bs,
            "speedup": cfg.speedup,
            "token_scale": cfg.token_scale,
        },
    )


def _cached_prefix(keys: Sequence[int], cap: int, held: Container[int]) -> int:
    """Leading blocks of ``keys`` found in ``held``, at most ``cap`` (vLLM never serves a prompt's
    last token from cache, so a prompt of n tokens can hit at most (n - 1) // block_size blocks)."""
    k = 0
    while k < cap and keys[k] in held:
        k += 1
    return k


def token_bound(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """Infinite-cache hit ratio of prompts in this order, in the engines' units (see the module doc)."""
    seen: set[int] = set()
    hit = total = 0
    for tokens in prompts:
        keys = prompt_keys(tokens, block_size)
        hit += _cached_prefix(keys, (len(tokens) - 1) // block_size, seen) * block_size
        total += len(tokens)
        seen.update(keys)
    return hit / total if total else 0.0


def compare(
    work: PreparedWorkload,
    policies: Sequence[PolicyConfig | str] = ("kv", "round_robin", "least_loaded", "random"),
    cfg: SimConfig | None = None,
) -> list[SimResult]:
    """One :func:`simulate` per policy on fresh engines and a fresh index."""
    return [simulate(work, p, cfg) for p in policies]


__all__ = [
    "PreparedWorkload",
    "SimConfig",
    "SimResult",
    "SimRouter",
    "chat_tokenizer",
    "compare",
    "simulate",
    "token_bound",
]
