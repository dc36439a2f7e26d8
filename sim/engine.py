"""A mock vLLM engine: OpenAI-compatible HTTP API, vLLM metrics, KV events, and a timing model.

The router sees exactly what it would see from vLLM: the same endpoints and response shapes, the same
`vllm:*` metric names, the same KV event stream (one ZMQ publisher per DP rank on base+rank), and
latencies that depend on prefix-cache hits. Nothing here runs a model: output tokens are pseudo-random
ids seeded by the prompt, and time is spent in `asyncio.sleep` according to a per-step cost model
(see sim/README.md for the defaults and why).

Each DP rank has its own cache (`PrefixCache`; `sim.kvgroups.HybridPrefixCache` for a hybrid model's
KV cache groups), scheduler loop and `KVEventPublisher`. The step algorithm
itself (decode every running request, preempting when out of blocks, then admit waiting requests FIFO
within sequence slots, token budget and cache blocks, and the step's modelled duration) lives in
`sim.scheduler`, shared with the offline simulator. The loop here plans a step, sleeps for its
duration, emits the tokens to the HTTP streams, and publishes every event the step caused as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from router.decision.chat import ChatTokenizer
from router.decision.tokenizer import TokenizerError, TokenizerUnavailable
from sim import nixl
from sim.kvcache import KVCache
from sim.kvgroups import KVGroupsSpec, check_engine_groups, new_cache, token_capacity
from sim.publisher import KVEventPublisher
from sim.scheduler import StepModel, StepScheduler

DP_RANK_HEADER = "x-data-parallel-rank"
log = logging.getLogger("sim.engine")


class EngineConfig(msgspec.Struct, kw_only=True):
    """Configuration of one mock engine (all DP ranks). Durations are seconds before `time_scale`."""

    model: str = "mock-model"
    """Served model name (`/v1/models`, the `model_name` metric label, request validation)."""
    host: str = "127.0.0.1"
    port: int = 0
    """HTTP port; 0 picks a free one (read `MockEngine.url` after start)."""
    block_size: int = 16
    """Tokens per KV block (vLLM's default on CUDA), the same in every KV cache group."""
    kv_groups: KVGroupsSpec = "llama"
    """The model's KV cache groups (``sim.kvgroups``): a preset (``llama``: one full-attention
    group, today's engine; ``gemma3``, ``mistral``, ``qwen3_next``: the hybrids real engines showed)
    or a list of ``(kind, sliding_window)``. Hybrids share the GPU blocks among their groups, take no
    CPU tier or KV connector, and announce each group's blocks as vLLM 0.32 does."""
    num_gpu_blocks: int = 2048
    """GPU blocks per DP rank: 32k tokens at block_size 16, small enough that benchmarks evict."""
    cpu_blocks: int = 0
    """CPU offload tier per rank in blocks (0 = off), announced as medium="CPU"."""
    hashes_per_chunk: int = 4
    """Blocks per CPU offload chunk (vLLM OffloadingConnector's block_size / gpu block_size)."""
    dp_size: int = 1
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    """Rank r publishes on kv_port + r; 0 = an ephemeral port per rank."""
    replay_port: int | None = 0
    """Rank r's replay ROUTER is on replay_port + r; 0 = ephemeral; None = no replay socket."""
    kv_bind: bool = True
    """True: the PUB socket binds (vLLM with `tcp://*:port`); False: it connects to a binding subscriber."""
    topic: str = ""
    encoding: Literal["map", "array"] = "map"
    """"map" = vLLM >= 0.24 events, "array" = vLLM <= 0.23."""
    replay_frames: Literal[3, 2] = 3
    """3 = vLLM >= 0.26 replay replies `[topic, seq, payload]`; 2 = older `[seq, payload]`."""
    hash_bytes: bool = False
    """Send block hashes as 32 digest bytes instead of the default unsigned 64-bit ints."""
    hash_seed: int = 0
    """Seed of the engine's own block hash (deliberately not the router's algorithm)."""
    max_num_seqs: int = 64
    """Running-batch bound per rank; small enough that a busy rank visibly queues."""
    max_num_batched_tokens: int = 8192
    """Prefill-token budget per step (no chunked prefill: one prompt larger than this runs alone)."""
    max_model_len: int = 8192
    default_max_tokens: int = 16
    """Completion length when the request sets none (OpenAI's completions default)."""
    step_overhead_s: float = 0.002
    """Fixed cost of every step (scheduling, kernel launches)."""
    prefill_s_per_token: float = 0.0001
    """Per uncached prompt token: 10k tokens/s, roughly an 8B model on one A100-class GPU."""
    decode_step_s: float = 0.015
    """Cost of a step that decodes at least one sequence: ~65 tokens/s per stream."""
    decode_s_per_seq: float = 0.0002
    """Extra decode cost per running sequence (attention over a bigger batch)."""
    cpu_load_s_per_block: float = 0.0001
    """Loading one block from the CPU tier (PCIe copy): ~6% of recomputing 16 tokens."""
    time_scale: float = 1.0
    """Multiplies every duration: 0.1 runs ten times faster with the same relative costs."""
    tokenizer: str | None = None
    """HF tokenizer dir or tokenizer.json (ChatTokenizer); None = UTF-8 bytes as token ids (and any
    non-negative id below 2**31 is accepted in token-id prompts)."""
    # --- disagreeing with the router on purpose (the router's prediction checks must notice) ---
    chat_template: str | None = None
    """A chat template of the engine's own instead of the tokenizer's (a router with the model's
    template then counts different prompt tokens on chat requests)."""
    kv_events: bool = True
    """False: publish no KV event at all (vLLM started without --kv-events-config)."""
    lose_events: float = 0.0
    """Share of event batches lost for good: neither sent nor kept for replay."""
    prompt_tokens_details: bool = True
    """False: usage without prompt_tokens_details (vLLM without --enable-prompt-tokens-details)."""
    # P/D disaggregation (sim/nixl.py): vLLM's --kv-transfer-config '{"kv_connector": "NixlConnector",
    # "kv_role": "kv_both"}'; the engine then plays whichever role a request's kv_transfer_params asks
    kv_connector: Literal["NixlConnector"] | None = None
    """None: kv_transfer_params are ignored, as by a vLLM without a KV connector."""
    kv_side_channel_port: int = 0
    """Rank r's NIXL side channel is on this port + r (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); 0 = ephemeral."""
    kv_transfer_setup_s: float = 0.001
    """Fixed cost of one pull (descriptors, the completion notification)."""
    kv_transfer_s_per_block: float = 0.00008
    """Per block pulled: 2 MiB (16 tokens of an 8B model) over ~25 GB/s RDMA, ~5% of recomputing it."""
    kv_transfer_timeout_s: float = 480.0
    """A prefill's blocks nobody reads are released after this long (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    """A pull that fails: end the request with an error (vLLM's default) or compute the prompt."""


def token_scaled(cfg: EngineConfig, scale: float) -> EngineConfig:
    """``cfg`` with the timing of an engine whose simulated token stands for ``scale`` real ones.

    Trace replays shrink prompts ``scale`` times to stay fast (``sim.traces``); multiplying every
    per-token, per-step and per-block cost by ``scale`` keeps the time an engine spends on a request
    that of the full-length prompt. Cache sizes are the caller's (they depend on the capacity asked
    for, in real blocks); ``max_num_batched_tokens`` shrinks so a step holds as many real tokens.
    """
    if scale == 1.0:
        return cfg
    return msgspec.structs.replace(
        cfg,
        step_overhead_s=cfg.step_overhead_s * scale,
        prefill_s_per_token=cfg.prefill_s_per_token * scale,
        decode_step_s=cfg.decode_step_s * scale,
        decode_s_per_seq=cfg.decode_s_per_seq * scale,
        cpu_load_s_per_block=cfg.cpu_load_s_per_block * scale,
        kv_transfer_s_per_block=cfg.kv_transfer_s_per_block * scale,
        max_num_batched_tokens=max(cfg.block_size, int(cfg.max_num_batched_tokens / scale)),
    )


class EngineError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


def _error_response(exc: EngineError) -> Response:
    body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.status}}
    return Response(msgspec.json.encode(body), status_code=exc.status, media_type="application/json")


# ---- tokenization ------------------------------------------------------------------------------------


class EngineTokenizer:
    """Token ids for request bodies, exactly as the router computes them (same ChatTokenizer).

    Without a tokenizer the engine treats UTF-8 bytes as token ids (and renders chats as
    `role: content` lines), which keeps token-id tests meaningful without any files.
    """

    def __init__(self, tokenizer: ChatTokenizer | None, chat_template: str | None = None) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template
        """The engine's own chat template, when it is not the tokenizer's."""
        if tokenizer is None:
            self.vocab_size = 2**31  # any id is a valid prompt token; text prompts use ids 0..255
            self._sample_space = list(range(97, 123))  # a..z: readable output
        else:
            self.vocab_size = tokenizer.max_token_id + 1
            self._sample_space = [i for i in range(self.vocab_size) if not tokenizer.is_special_id(i)]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.encode_prompt(text, add_special_tokens=add_special_tokens)

    def completion_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Prompt ids of a completions (or /tokenize with `prompt`) body."""
        prompt = body.get("prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise EngineError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        if isinstance(prompt, list):
            if len(prompt) != 1 and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise EngineError(400, "batched prompts are not supported by the mock engine", param="prompt")
            if not prompt:
                raise EngineError(400, "prompt must not be empty", param="prompt")
            if isinstance(prompt[0], list | str):
                prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, add_special)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(
                    400, f"token id {bad[0]} is out of vocabulary (< {self.vocab_size})", param="prompt"
                )
        else:
            raise EngineError(400, "prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise EngineError(400, "prompt must not be empty", param="prompt")
        return ids

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Prompt ids of a chat body: the chat template rendered and encoded like vLLM does."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError(400, "messages must be a non-empty list", param="messages")
        add_gen = body.get("add_generation_prompt", True)
        add_special = body.get("add_special_tokens", False)
        if self.tok is None:
            lines = []
            for m in messages:
                if not isinstance(m, Mapping):
                    raise EngineError(400, "each message must be an object", param="messages")
                content = m.get("content")
                if isinstance(content, list):
                    content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
                lines.append(f"{m.get('role', '')}: {content or ''}\n")
            if add_gen:
                lines.append("assistant: ")
            return list("".join(lines).encode("utf-8"))
        try:
            ids = self.tok.encode_chat(
                messages,
                add_generation_prompt=bool(add_gen),
                tools=body.get("tools"),
                chat_template_kwargs=body.get("chat_template_kwargs"),
                continue_final_message=bool(body.get("continue_final_message", False)),
                documents=body.get("documents"),
                chat_template=body.get("chat_template") or self.chat_template,
                add_special_tokens=bool(add_special),
            )
        except (TokenizerError, TokenizerUnavailable) as exc:
            raise EngineError(400, str(exc), param="messages") from exc
        if not ids:
            raise EngineError(400, "the rendered chat prompt is empty", param="messages")
        return ids

    def sample(self, rng: random.Random) -> int:
        """One pseudo-random non-special output token."""
        return self._sample_space[rng.randrange(len(self._sample_space))]

    def text(self, ids: Sequence[int]) -> str:
        """Detokenized text of generated ids."""
        if self.tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tok.decode(ids, skip_special_tokens=True)


# ---- requests and the per-rank scheduler ----------------------------------------------------------------


class _Done:
    """Queue sentinel: the request finished."""


_DONE = _Done()


@dataclass(eq=False)
class EngineRequest:
    """One generation request as the scheduler tracks it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    rank: int
    rng: random.Random
    arrival: float = field(default_factory=time.monotonic)
    outputs: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # set at the first admission
    first_token_at: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    queue: asyncio.Queue[int | _Done | EngineError] = field(default_factory=asyncio.Queue)
    external_tokens: int = 0
    """P/D decode leg: prompt tokens pulled from the prefill engine (no compute at admission)."""
    hold_blocks: bool = False
    """P/D prefill leg: keep the blocks for a decode engine when the request finishes."""
    transfer_params: dict[str, Any] | None = None
    """P/D prefill leg: the answer's kv_transfer_params, set when the request finished."""
    report_hits: bool = False
    """``vllm_xargs.kv_cache_report_mode = "full"``: at admission the cached prefix is announced
    again (a BlockStored from block 0, no parent), as vLLM does for such a request."""

    @property
    def tokens(self) -> list[int]:
        """What a (re)admission prefills: the prompt plus everything generated so far."""
        return self.prompt + self.outputs


_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(_LATENCY_BUCKETS))
    total: int = 0
    sum: float = 0.0

    def observe(self, v: float) -> None:
        self.total += 1
        self.sum += v
        for i, le in enumerate(_LATENCY_BUCKETS):
            if v <= le:
                self.counts[i] += 1


class RankScheduler:
    """One DP rank: the shared step algorithm (`sim.scheduler`) run in real time, plus its publisher."""

    def __init__(
        self, config: EngineConfig, rank: int, publisher: KVEventPublisher | None, tokenizer: EngineTokenizer
    ) -> None:
        self.config = config
        self.rank = rank
        self.publisher = publisher
        self.tokenizer = tokenizer
        self.side: nixl.SideChannel | None = None
        """The NIXL side channel (P/D), when the engine has a KV connector."""
        self.pulled_blocks = 0
        self.pull_failures = 0
        self.invalid_params = 0
        self.model = StepModel.from_engine(config, duration_factor=config.time_scale)
        self.core: StepScheduler[EngineRequest] = StepScheduler(self._new_cache(), self.model)
        self._wake = asyncio.Event()
        self._epoch = 0
        self._in_step = False
        self._task: asyncio.Task[None] | None = None
        # counters for /metrics (reset by restart, like a restarted vLLM process)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished = 0
        self.steps = 0
        self.ttft = _Histogram()
        self.e2e = _Histogram()
        self.announced: dict[str, Any] = {"rank": rank, "seq": -1, "blocks": {"GPU": 0}}

    def _new_cache(self) -> KVCache:
        c = self.config
        return new_cache(
            check_engine_groups(c.kv_groups, c.cpu_blocks, c.kv_connector),
            c.num_gpu_blocks,
            c.block_size,
            hash_seed=c.hash_seed,
            hash_bytes=c.hash_bytes,
            cpu_blocks=c.cpu_blocks,
            hashes_per_chunk=c.hashes_per_chunk,
            connector=c.kv_connector is not None,
        )

    @property
    def cache(self) -> KVCache:
        """This rank's cache (a new one after a restart), for metrics and tests that look inside."""
        return self.core.cache

    @property
    def waiting(self) -> deque[EngineRequest]:
        """FIFO queue, owned by the step (`StepScheduler`)."""
        return self.core.waiting

    @property
    def running(self) -> list[EngineRequest]:
        """Running batch, oldest first, owned by the step (`StepScheduler`)."""
        return self.core.running

    @property
    def preemptions(self) -> int:
        """Preemptions since the start or the last restart (`vllm:num_preemptions_total`)."""
        return self.core.preemptions

    @property
    def load(self) -> int:
        """Requests on this rank (running + waiting), for least-loaded rank selection."""
        return len(self.running) + len(self.waiting)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"mock-engine-dp{self.rank}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self.running, *self.waiting]:
            req.queue.put_nowait(EngineError(503, "engine shutting down", "ServiceUnavailableError"))
        self.running.clear()
        self.waiting.clear()

    # ---- request API ------------------------------------------------------------------------------

    def submit(self, req: EngineRequest) -> None:
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: EngineRequest) -> None:
        """Client went away: drop the request and release its blocks (they stay cached)."""
        if req.finish_reason is not None or req.aborted:
            return
        req.aborted = True
        self.core.held.discard(req.request_id)
        self.core.drop(req)

    def release_held(self, request_id: str) -> None:
        """A P/D prefill's blocks were read (or expired): unpin them; they stay cached."""
        if self.cache.has_request(request_id):
            self.cache.free(request_id)

    # ---- faults and admin ---------------------------------------------------------------------------

    def restart(self) -> None:
        """Like a crashed and restarted engine: in-flight requests fail, cache and seq start over."""
        self._epoch += 1
        for req in [*self.running, *self.waiting]:
            req.aborted = True
            req.queue.put_nowait(EngineError(503, "engine restarted", "ServiceUnavailableError"))
        self.core = StepScheduler(self._new_cache(), self.model)
        if self.side is not None:
            self.side.drop_all()  # the blocks died with the old cache
        if self.publisher is not None:
            self.publisher.restart()
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished = 0
        self.steps = 0
        self.ttft, self.e2e = _Histogram(), _Histogram()
        self.announced = self._announced()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's reset: only succeeds when no request holds blocks, unless running ones are preempted."""
        if reset_running_requests:
            for req in reversed(list(self.running)):
                self.core.preempt(req)
        ok = self.cache.reset()
        if not self._in_step:
            self.flush()
        return ok

    def drop_next(self, n: int) -> None:
        if self.publisher is not None:
            self.publisher.drop_next(n)

    def flush(self) -> None:
        """Publish everything the cache emitted since the last batch, as one batch."""
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
            self.announced = self._announced()

    def _announced(self) -> dict[str, Any]:
        """What the published events describe: distinct cached block hashes per medium, as of the
        last published seq (what an index that applied every event must hold)."""
        out: dict[str, Any] = {"rank": self.rank, "seq": -1, "blocks": self.cache.cached_by_medium()}
        if self.publisher is not None:
            out["seq"] = self.publisher.next_seq - 1
        return out

    # ---- the step loop ------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        epoch = self._epoch
        core = self.core
        self._in_step = True
        try:
            plan = core.plan()
            for req in plan.rejected:  # cannot fit even alone; validation should prevent this
                req.queue.put_nowait(EngineError(400, "request does not fit in the KV cache"))
            if plan.idle:
                self.flush()
                await asyncio.sleep(plan.duration_s)  # nothing fits yet: wait a beat
                return
            await asyncio.sleep(plan.duration_s)
            if epoch != self._epoch:
                return  # restarted while this step ran: its results died with the old engine
            self.steps += 1
            now = time.monotonic()
            out = core.complete(plan, lambda r: self.tokenizer.sample(r.rng))
            self.generation_tokens_total += len(out.emitted)
            for req in out.first:
                req.first_token_at = now
                self.prompt_tokens_total += len(req.prompt)
                self.ttft.observe(now - req.arrival)
            for req, token in out.emitted:
                req.queue.put_nowait(token)
            for req in out.finished:
                req.finish_reason = "length"
                if req.hold_blocks and self.side is not None:  # P/D prefill: blocks kept for the pull
                    rid = req.request_id
                    req.transfer_params = self.side.hold(rid, self.cache.request_blocks(rid))
                self.requests_finished += 1
                self.e2e.observe(now - req.arrival)
                req.queue.put_nowait(_DONE)
        finally:
            self._in_step = False
        self.flush()


# ---- the HTTP engine ---------------------------------------------------------------------------------


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: many servers share one loop; the owner handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _seeded_rng(prompt: Sequence[int]) -> random.Random:
    digest = hashlib.blake2b(b"".join(t.to_bytes(8, "little", signed=True) for t in prompt), digest_size=8)
    return random.Random(int.from_bytes(digest.digest(), "little"))


class MockEngine:
    """One mock vLLM server (all its DP ranks) inside the caller's asyncio loop."""

    def __init__(self, config: EngineConfig, tokenizer: ChatTokenizer | None = None) -> None:
        if config.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if not config.kv_bind and not config.kv_port:
            raise ValueError("kv_bind=False connects to kv_port, which must then be a fixed port")
        self.config = config
        groups = check_engine_groups(config.kv_groups, config.cpu_blocks, config.kv_connector)
        if tokenizer is None and config.tokenizer is not None:
            tokenizer = ChatTokenizer.from_path(config.tokenizer)
        self.tokenizer = EngineTokenizer(tokenizer, config.chat_template)
        # A single request must always fit in one rank's cache, or it could wait forever.
        self.max_model_len = min(
            config.max_model_len, token_capacity(groups, config.num_gpu_blocks, config.block_size)
        )
        self.ranks: list[RankScheduler] = []
        self.app = self._build_app()
        self._server: _QuietServer | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.created = int(time.time())
        self.fail_status: int | None = None
        """Fault: answer every completion with this status."""
        self.reset_streams = 0
        """Fault: tear down this many of the next streams after two tokens."""
        self.engine_id = f"mock-{uuid.uuid4().hex[:12]}"
        """The KV connector's engine id (vLLM's kv_transfer_config.engine_id; rank r: ``_dp{r}``)."""
        self._zctx: zmq.asyncio.Context | None = None
        self.received: deque[tuple[str, dict[str, str], dict[str, Any]]] = deque(maxlen=256)
        """The last generation requests: (path, headers, body), for tests and debugging."""

    # ---- lifecycle ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL (`http://127.0.0.1:PORT`) once started."""
        if self._sock is None:
            raise RuntimeError("engine not started")
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("engine not started")
        port: int = self._sock.getsockname()[1]
        return port

    @property
    def kv_endpoints(self) -> list[str]:
        """PUB endpoint of each DP rank, index = rank."""
        return [r.publisher.endpoint for r in self.ranks if r.publisher is not None]

    @property
    def replay_endpoints(self) -> list[str | None]:
        """Replay ROUTER endpoint of each DP rank (None when replay is off)."""
        return [r.publisher.replay_endpoint if r.publisher is not None else None for r in self.ranks]

    def _endpoint(self, port: int | None, rank: int) -> str | None:
        if port is None:
            return None
        return f"tcp://{self.config.kv_host}:{port + rank if port else 0}"

    async def start(self) -> None:
        """Bind the KV sockets and the HTTP port, start the rank schedulers and the server."""
        cfg = self.config
        try:
            for rank in range(cfg.dp_size):
                endpoint = self._endpoint(cfg.kv_port, rank)
                assert endpoint is not None
                publisher = KVEventPublisher(
                    endpoint=endpoint,
                    replay_endpoint=self._endpoint(cfg.replay_port, rank),
                    topic=cfg.topic,
                    dp_rank=rank,
                    encoding=cfg.encoding,
                    bind=cfg.kv_bind,
                    replay_frames=cfg.replay_frames,
                )
                publisher.silent = not cfg.kv_events
                if cfg.lose_events:
                    publisher.lose(cfg.lose_events, seed=cfg.hash_seed + rank)
                sched = RankScheduler(cfg, rank, publisher, self.tokenizer)
                self.ranks.append(sched)
                if cfg.kv_connector is not None:
                    self._start_side_channel(sched)
                sched.start()
            self._sock = _bind_socket(cfg.host, cfg.port)
            uv_config = uvicorn.Config(
                self.app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=1
            )
            self._server = _QuietServer(uv_config)
            self._serve_task = asyncio.get_running_loop().create_task(
                self._server.serve(sockets=[self._sock])
            )
            deadline = time.monotonic() + 30
            while not self._server.started:
                if self._serve_task.done():
                    self._serve_task.result()
                    raise RuntimeError("HTTP server exited during startup")
                if time.monotonic() > deadline:
                    raise RuntimeError("HTTP server did not start within 30 s")
                await asyncio.sleep(0.01)
        except BaseException:
            await self.stop()
            raise

    def _start_side_channel(self, sched: RankScheduler) -> None:
        """The rank's NIXL side channel (P/D): holds and serves its prefills' blocks."""
        cfg = self.config
        if self._zctx is None:
            self._zctx = zmq.asyncio.Context()
        rank_id = self.engine_id if cfg.dp_size == 1 else f"{self.engine_id}_dp{sched.rank}"
        sched.side = nixl.SideChannel(
            self._zctx,
            rank_id,
            cfg.kv_host,
            cfg.kv_side_channel_port + sched.rank if cfg.kv_side_channel_port else 0,
            lambda rid, blocks: sched.cache.block_contents(rid, blocks),
            sched.release_held,
            cfg.kv_transfer_timeout_s,
        )
        sched.side.start()

    @property
    def side_channels(self) -> list[str]:
        """Each rank's NIXL side channel endpoint (empty without a KV connector)."""
        return [r.side.endpoint for r in self.ranks if r.side is not None]

    async def stop(self) -> None:
        """Stop serving, fail in-flight requests, close the KV sockets."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            for sched in self.ranks:
                await sched.stop()
            try:
                await asyncio.wait_for(asyncio.shield(self._serve_task), timeout=5)
            except TimeoutError:
                self._server.force_exit = True
                with contextlib.suppress(Exception):
                    await self._serve_task
        for sched in self.ranks:
            await sched.stop()
            if sched.publisher is not None:
                sched.publisher.close()
            if sched.side is not None:
                await sched.side.close()
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        self.ranks = []
        self._server = None
        self._serve_task = None
        if self._sock is not None:
            self._sock.close()

    async def __aenter__(self) -> MockEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- helpers ------------------------------------------------------------------------------------

    def _pick_rank(self, request: HttpRequest) -> RankScheduler:
        raw = request.headers.get(DP_RANK_HEADER)
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                raise EngineError(400, f"invalid {DP_RANK_HEADER} header: {raw!r}") from None
            if not 0 <= rank < len(self.ranks):
                raise EngineError(400, f"data parallel rank {rank} out of range (dp_size={len(self.ranks)})")
            return self.ranks[rank]
        return min(self.ranks, key=lambda r: (r.load, r.rank))

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise EngineError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    @staticmethod
    async def _json_body(request: HttpRequest) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise EngineError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise EngineError(400, "request body must be a JSON object")
        return body

    def _max_tokens(self, body: Mapping[str, Any], chat: bool) -> int:
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        if value is None:
            return self.config.default_max_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(400, "max_tokens must be an integer >= 1", param="max_tokens")
        return value

    def _new_request(
        self,
        body: Mapping[str, Any],
        prompt: list[int],
        chat: bool,
        sched: RankScheduler,
        request_id: str | None = None,
    ) -> EngineRequest:
        n = body.get("n", 1)
        if n != 1:
            raise EngineError(400, "the mock engine supports n=1 only", param="n")
        max_tokens = self._max_tokens(body, chat)
        if len(prompt) + max_tokens > self.max_model_len:
            raise EngineError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="messages" if chat else "prompt",
            )
        prefix = "chatcmpl-" if chat else "cmpl-"
        # like vLLM, the client's X-Request-Id names the request (a suffix keeps it unique here)
        rid = f"{prefix}{request_id}-{uuid.uuid4().hex[:8]}" if request_id else f"{prefix}{uuid.uuid4().hex}"
        xargs = body.get("vllm_xargs")
        report = isinstance(xargs, Mapping) and xargs.get("kv_cache_report_mode") == "full"
        return EngineRequest(rid, prompt, max_tokens, sched.rank, _seeded_rng(prompt), report_hits=report)

    def _usage(self, req: EngineRequest) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": len(req.prompt),
            "total_tokens": len(req.prompt) + len(req.outputs),
            "completion_tokens": len(req.outputs),
        }
        if self.config.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens or 0}
        return usage

    # ---- generation ---------------------------------------------------------------------------------

    async def _transfer(self, sched: RankScheduler, req: EngineRequest, params: Any) -> None:
        """The KV connector's part of a request (sim/nixl.py): mark a prefill leg's blocks to be
        kept, or pull a decode leg's blocks from its prefill engine before it is queued."""
        if nixl.wants_remote_decode(params):
            req.hold_blocks = True
            sched.core.held.add(req.request_id)
            return
        if not nixl.wants_remote_prefill(params):
            return
        why = nixl.invalid_reason(params)
        if why is not None:
            sched.invalid_params += 1
            log.warning(
                "Got invalid KVTransferParams: %s (%s). This request will not utilize KVTransfer", params, why
            )
            return
        cfg = self.config
        gpu, cpu = sched.cache.probe(req.prompt)
        assert self._zctx is not None
        try:
            req.external_tokens = await nixl.pull(
                self._zctx,
                params,
                req.prompt,
                gpu + cpu,
                cfg.block_size,
                cfg.kv_transfer_s_per_block * cfg.time_scale,
                cfg.kv_transfer_setup_s * cfg.time_scale,
            )
            sched.pulled_blocks += len(params["remote_block_ids"]) - (gpu + cpu) // cfg.block_size
        except nixl.TransferError as exc:
            sched.pull_failures += 1
            log.warning("KV transfer for %s failed: %s (%s)", req.request_id, exc, cfg.kv_load_failure_policy)
            if cfg.kv_load_failure_policy == "fail":
                raise EngineError(500, f"KV transfer failed: {exc}", "InternalServerError") from None

    async def _generate(
        self, sched: RankScheduler, req: EngineRequest, params: Any = None
    ) -> AsyncGenerator[int, None]:
        """Yield output tokens as the scheduler produces them; aborts the request if the consumer stops."""
        if params is not None:
            await self._transfer(sched, req, params)
        sched.submit(req)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, _Done):
                    return
                if isinstance(item, EngineError):
                    raise item
                yield item
        finally:
            sched.abort(req)

    async def _complete(self, request: HttpRequest, chat: bool) -> Response:
        if self.fail_status is not None:  # a fault: every request fails (its health probe passes)
            return _error_response(EngineError(self.fail_status, "injected failure", "InternalServerError"))
        try:
            body = await self._json_body(request)
            self.received.append((request.url.path, dict(request.headers), body))
            self._check_model(body)
            prompt = self.tokenizer.chat_ids(body) if chat else self.tokenizer.completion_ids(body)
            sched = self._pick_rank(request)
            req = self._new_request(body, prompt, chat, sched, request.headers.get("x-request-id"))
            params = body.get("kv_transfer_params") if self.config.kv_connector else None
        except EngineError as exc:
            return _error_response(exc)
        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, Mapping) and bool(opts.get("include_usage"))
            return StreamingResponse(
                self._stream(sched, req, chat, include_usage, params),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            async with contextlib.aclosing(self._generate(sched, req, params)) as tokens:
                outputs = [t async for t in tokens]
        except EngineError as exc:
            return _error_response(exc)
        text = self.tokenizer.text(outputs)
        base = {"id": req.request_id, "created": int(time.time()), "model": self.config.model}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
            }
            payload = {
                **base,
                "object": "chat.completion",
                "choices": [choice],
                "usage": self._usage(req),
                "kv_transfer_params": req.transfer_params,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
            }
            payload = {
                **base,
                "object": "text_completion",
                "choices": [choice],
                "usage": self._usage(req),
                "kv_transfer_params": req.transfer_params,
            }
        return Response(msgspec.json.encode(payload), media_type="application/json")

    async def _stream(
        self, sched: RankScheduler, req: EngineRequest, chat: bool, include_usage: bool, params: Any = None
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": req.request_id, "object": obj, "created": created, "model": self.config.model}
        usage_field: dict[str, Any] = {"usage": None} if include_usage else {}

        def chunk(choice: dict[str, Any]) -> bytes:
            return b"data: " + msgspec.json.encode({**base, "choices": [choice], **usage_field}) + b"\n\n"

        # vLLM sends the chat role chunk with the first token, after prefill: sending it earlier would
        # tell the router (and any client timing TTFT) that prefill ended at dispatch
        role = (
            chunk(
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            if chat
            else b""
        )
        count = 0
        reset = self.reset_streams > 0  # a fault: this stream's connection is torn after two tokens
        if reset:
            self.reset_streams -= 1
        try:
            async with contextlib.aclosing(self._generate(sched, req, params)) as tokens:
                async for token in tokens:
                    count += 1
                    if reset and count > 2:
                        raise ConnectionResetError("injected: stream reset mid-way")
                    finish = "length" if count >= req.max_tokens else None
                    text = self.tokenizer.text([token])
                    if chat:
                        delta = {"content": text}
                        yield role + chunk(
                            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                        )
                        role = b""
                    else:
                        yield chunk(
                            {
                                "index": 0,
                                "text": text,
                                "logprobs": None,
                                "finish_reason": finish,
                                "stop_reason": None,
                            }
                        )
        except EngineError as exc:
            err = {"error": {"message": exc.message, "type": exc.kind, "param": None, "code": exc.status}}
            yield b"data: " + msgspec.json.encode(err) + b"\n\n"
        else:
            if include_usage:
                yield (
                    b"data: "
                    + msgspec.json.encode({**base, "choices": [], "usage": self._usage(req)})
                    + b"\n\n"
                )
        yield b"data: [DONE]\n\n"

    # ---- metrics ------------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        """Prometheus text exposition with vLLM's metric names and labels (one series per DP rank)."""
        model = self.config.model.replace("\\", "\\\\").replace('"', '\\"')
        out: list[str] = []

        def family(name: str, kind: str, help_: str, values: list[tuple[RankScheduler, float]]) -> None:
            base = name[: -len("_total")] if kind == "counter" else name
            out.append(f"# HELP {base} {help_}")
            out.append(f"# TYPE {base} {kind}")
            for sched, v in values:
                out.append(f'{name}{{engine="{sched.rank}",model_name="{model}"}} {float(v)!r}')

        def hist(name: str, help_: str, pick: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            for sched in self.ranks:
                h: _Histogram = getattr(sched, pick)
                labels = f'engine="{sched.rank}",model_name="{model}"'
                for le, n in zip(_LATENCY_BUCKETS, h.counts, strict=True):
                    out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(n)!r}')
                out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(h.total)!r}')
                out.append(f"{name}_count{{{labels}}} {float(h.total)!r}")
                out.append(f"{name}_sum{{{labels}}} {h.sum!r}")

        r = self.ranks
        family(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [(s, len(s.running)) for s in r],
        )
        family(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [(s, len(s.waiting)) for s in r],
        )
        family(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [(s, s.cache.usage) for s in r],
        )
        family(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            [(s, s.cache.queries) for s in r],
        )
        family(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            [(s, s.cache.hits) for s in r],
        )
        family(
            "vllm:external_prefix_cache_queries_total",
            "counter",
            "External prefix cache queries from KV connector (CPU tier), in tokens.",
            [(s, s.cache.cpu_queries) for s in r],
        )
        family(
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits from KV connector (CPU tier), in tokens.",
            [(s, s.cache.cpu_hits) for s in r],
        )
        family(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemptions.",
            [(s, s.preemptions) for s in r],
        )
        family(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            [(s, s.prompt_tokens_total) for s in r],
        )
        family(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            [(s, s.generation_tokens_total) for s in r],
        )
        family(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [(s, s.requests_finished) for s in r],
        )
        hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft")
        hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e")
        return "\n".join(out) + "\n"

    # ---- the ASGI app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvrouter mock vLLM engine", docs_url=None, redoc_url=None, openapi_url=None)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest) -> Response:
            return await self._complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest) -> Response:
            return await self._complete(request, chat=True)

        @app.get("/v1/models")
        async def models() -> Response:
            card = {
                "id": self.config.model,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [],
            }
            return Response(
                msgspec.json.encode({"object": "list", "data": [card]}), media_type="application/json"
            )

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.post("/tokenize")
        async def tokenize(request: HttpRequest) -> Response:
            try:
                body = await self._json_body(request)
                self._check_model(body)
                if "messages" in body:
                    ids = self.tokenizer.chat_ids(body)
                elif "prompt" in body:
                    ids = self.tokenizer.completion_ids(body)
                else:
                    raise EngineError(400, "either prompt or messages is required")
            except EngineError as exc:
                return _error_response(exc)
            payload = {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
            return Response(msgspec.json.encode(payload), media_type="application/json")

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            ok = [s.reset_prefix_cache() for s in self.ranks]
            return Response(msgspec.json.encode({"success": all(ok)}), media_type="application/json")

        async def admin_body(request: HttpRequest) -> tuple[dict[str, Any], list[RankScheduler]]:
            raw = await request.body()
            body = await self._json_body(request) if raw.strip() else {}
            rank = body.get("rank")
            if rank is None:
                return body, list(self.ranks)
            if not isinstance(rank, int) or not 0 <= rank < len(self.ranks):
                raise EngineError(400, f"invalid rank {rank!r}")
            return body, [self.ranks[rank]]

        @app.post("/admin/restart")
        async def admin_restart(request: HttpRequest) -> Response:
            try:
                _, ranks = await admin_body(request)
            except EngineError as exc:
                return _error_response(exc)
            for s in ranks:
                s.restart()
            return Response(
                msgspec.json.encode({"restarted": [s.rank for s in ranks]}), media_type="application/json"
            )

        @app.post("/admin/drop_batches")
        async def admin_drop(request: HttpRequest) -> Response:
            try:
                body, ranks = await admin_body(request)
                n = body.get("n")
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise EngineError(400, "n must be an integer >= 0", param="n")
            except EngineError as exc:
                return _error_response(exc)
            for s in ranks:
                s.drop_next(n)
            return Response(
                msgspec.json.encode({"dropping": n, "ranks": [s.rank for s in ranks]}),
                media_type="application/json",
            )

        @app.post("/admin/fail")
        async def admin_fail(request: HttpRequest) -> Response:
            """{"status": 500} makes every completion fail with that status; {"status": null} heals."""
            body = await self._json_body(request)
            status = body.get("status")
            if status is not None and (not isinstance(status, int) or not 400 <= status < 600):
                return _error_response(EngineError(400, "status must be null or 400..599", param="status"))
            self.fail_status = status
            return Response(msgspec.json.encode({"status": status}), media_type="application/json")

        @app.post("/admin/reset_streams")
        async def admin_reset_streams(request: HttpRequest) -> Response:
            """{"n": k}: the next k streams lose their connection after two tokens."""
            body = await self._json_body(request)
            n = body.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                return _error_response(EngineError(400, "n must be an integer >= 0", param="n"))
            self.reset_streams = n
            return Response(msgspec.json.encode({"n": n}), media_type="application/json")

        @app.post("/admin/replay")
        async def admin_replay(request: HttpRequest) -> Response:
            """{"up": false} makes the replay sockets ignore requests; {"up": true} restores them."""
            try:
                body, ranks = await admin_body(request)
            except EngineError as exc:
                return _error_response(exc)
            up = bool(body.get("up", True))
            for s in ranks:
                if s.publisher is not None:
                    s.publisher.replay_down = not up
            return Response(msgspec.json.encode({"up": up}), media_type="application/json")

        @app.post("/admin/pause_events")
        async def admin_pause(request: HttpRequest) -> Response:
            """{"seconds": s, "hold": n}: the live stream stalls; n batches wait, later ones are dropped."""
            try:
                body, ranks = await admin_body(request)
                seconds, hold = body.get("seconds"), body.get("hold", 100)
                if (
                    not isinstance(seconds, int | float)
                    or seconds < 0
                    or not isinstance(hold, int)
                    or hold < 0
                ):
                    raise EngineError(400, "seconds >= 0 and hold >= 0 are required")
            except EngineError as exc:
                return _error_response(exc)
            for s in ranks:
                if s.publisher is not None:
                    s.publisher.pause(float(seconds), hold)
            return Response(msgspec.json.encode({"paused_s": seconds}), media_type="application/json")

        @app.get("/admin/cache")
        async def admin_cache() -> Response:
            """Per rank: the distinct cached block hashes per medium as of the last published batch and
            that batch's seq (an index that applied every event holds exactly this)."""
            return Response(
                msgspec.json.encode({"ranks": [s.announced for s in self.ranks]}),
                media_type="application/json",
            )

        @app.post("/admin/clear")
        async def admin_clear(request: HttpRequest) -> Response:
            try:
                _, ranks = await admin_body(request)
            except EngineError as exc:
                return _error_response(exc)
            ok = [s.reset_prefix_cache(reset_running_requests=True) for s in ranks]
            return Response(msgspec.json.encode({"success": all(ok)}), media_type="application/json")

        return app
