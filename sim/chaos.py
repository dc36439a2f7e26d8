"""The chaos soak: the real router and a mock fleet under steady mixed load while faults come and go.

One `kvrouter serve` process, ``engines`` mock-engine processes (sim.procs), clients sending chat and
completions, streaming and not, long and short prompts, a few of them misbehaving (they stop reading,
or disconnect mid-stream), and a rogue publisher sending malformed frames at a high rate on an event
endpoint the router follows. Every ``fault_interval_s`` one fault of the schedule is applied to one
engine, held for a while, then healed:

| fault | what happens | healable |
|---|---|---|
| ``kill_restart`` | SIGKILL, then a new process on the same ports (its seq starts at 0) | yes |
| ``gap_replayed`` | the next batches are not sent live (they stay in the replay buffer) | yes, no loss |
| ``stream_stall`` | the live stream stalls longer than its high-water mark holds | yes, no loss |
| ``gap_lost`` | replay down, batches dropped: lost for good; a prefix-cache reset heals | after the reset |
| ``hang`` | SIGSTOP: connections are accepted, nothing answers; SIGCONT heals | yes |
| ``fail_5xx`` | every completion answers 500 (its health probe passes) | yes |
| ``reset_streams`` | streams lose their connection after two tokens | yes |

Two more lanes of faults run beside those, on their own grid (offset by a third and two thirds of
the interval), so that a short soak holds one of each within its time. A hostile engine: one more
mock engine, reached through a proxy (sim/hostile.py, in a process of its own) that relays its
answers byte for byte, and while the fault is on answers every request (``engine_endless_sse``:
every stream) with the attack:

| fault | what the engine does |
|---|---|
| ``engine_trailing_bytes`` | the answer, then in the same write the previous answer (another request's) |
| ``engine_upgrade`` | ``101 Switching Protocols`` nobody asked for, the connection held |
| ``engine_endless_head`` | header lines without end |
| ``engine_trickled_head`` | the head a byte every 0.2 s |
| ``engine_endless_sse`` | a first event, then one that never ends |
| ``engine_drop`` | reads the request, closes without an answer |

And a hostile store: the router's cluster link (``[cluster] redis_url``) talks to a RESP server that
behaves like an empty Redis, and while the fault is on sends every subscription a 2 GB bulk string's
header and a trickle (``store_huge_bulk``), arrays 100k deep (``store_deep_arrays``) or an endless
line (``store_endless_line``). A hostile fault is held for ``fault_hold_s`` and at least until one
attack went out (the breaker may have ejected the engine for a moment), 10 s more at most.

A flow-control lane (``flow = True``): the router runs with ``[flow]`` on and a low
``flow_max_active`` per engine, ``flow_clients`` more clients send back to back (offered load over
what the engines may hold; half of them in a sheddable band, ``x-kvrouter-priority: -1``, each its
own ``x-gateway-inference-fairness-id``), and a client every ``flow_disconnect_every_s`` sends a
request and hangs up before any answer, while it waits in the queue. Every request of theirs must
end with its answer or a clean 429/503 (judged as any other); the report counts requests lost or
hung (0), the queue's rejections by reason (``disconnect`` among them: they did leave it), the
largest queue depth sampled, and the queue must be empty at the end.

Invariants, checked all along and reported at the end:

- the router never exits; its RSS stays under ``rss_bound_mb`` and grows by at most
  ``rss_growth_bound_mb`` over its size before the load;
- every request ends complete or with a clean, well-formed error (an OpenAI JSON error; an SSE stream
  that ends with an error event and ``[DONE]``), never a hang past the timeouts, never a truncated
  body; misbehaving clients are not judged (they leave), but what they leave behind must be released;
- no answer is poisoned: each request carries its own ``x-request-id`` (which the engine names its
  answer by, as vLLM does), and every completion and every streamed chunk a client receives must
  carry that id, never another request's;
- every hostile fault was delivered (the proxy or the store counts the attacks it sent);
- after each fault heals, the index converges to what the engines really hold: per engine, when the
  router has applied the engine's last published batch, the distinct blocks it indexes equal the
  distinct hashes the engine's own events describe (``/admin/cache``); the time from the heal to
  that point is reported per fault; where replay is available nothing may be lost
  (``lost_batches`` does not move);
- a backend failing requests is ejected (``kvrouter_backend_ejections_total``) and readmitted;
- after a store fault heals, the link is back (connected, and receiving its messages again): the time
  from the heal is its convergence time.

The report holds the figures and an SVG plot of hit ratio, error rate and divergence over time with
the faults marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import re
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
import zmq.asyncio

from sim.hostile import store_command
from sim.procs import EngineProc, status_kb, stop_group

FAULTS = ("kill_restart", "gap_replayed", "stream_stall", "gap_lost", "hang", "fail_5xx", "reset_streams")
HOSTILE_FAULTS = (
    "engine_trailing_bytes",
    "engine_upgrade",
    "engine_endless_head",
    "engine_trickled_head",
    "engine_endless_sse",
    "engine_drop",
)
STORE_FAULTS = ("store_huge_bulk", "store_deep_arrays", "store_endless_line")
ADMIN = "chaos-admin"


class SoakConfig(msgspec.Struct, kw_only=True):
    """One soak run."""

    seconds: float = 600.0
    engines: int = 3
    clients: int = 4
    fault_interval_s: float = 12.0
    fault_hold_s: float = 4.0
    faults: list[str] = msgspec.field(default_factory=lambda: list(FAULTS))
    hostile_faults: list[str] = msgspec.field(default_factory=lambda: list(HOSTILE_FAULTS))
    """The hostile engine's lane (empty: no hostile engine)."""
    store_faults: list[str] = msgspec.field(default_factory=lambda: list(STORE_FAULTS))
    """The store's lane (empty: no store, the router decides alone)."""
    rss_bound_mb: float = 700.0
    rss_growth_bound_mb: float = 160.0
    """Most the router's RSS may grow over its size before the load: what the soak grows by without
    attacks (~60 MB in 10 minutes: the index, caches and buffers filling, the allocator keeping what
    it freed), plus what the router's default limits let the attacks make it hold at once: a store
    reply of 32 MiB (``max_reply_bytes``), an SSE event of 16 MiB per stream on the hostile engine
    (``max_sse_event_bytes``; up to one per client), 64 KiB per engine head."""
    converge_bound_s: float = 2.0
    """The stated bound: divergence back to 0 within this long of a heal."""
    rogue_rate: float = 2000.0
    """Malformed frames per second from the rogue publisher."""
    time_scale: float = 0.05
    gpu_blocks: int = 512
    """Small caches: evictions keep the event streams busy."""
    tokenizer: str | None = None
    seed: int = 0
    request_timeout_s: float = 30.0
    model: str = "mock-model"
    flow: bool = False
    """The flow-control lane: ``[flow]`` on, load over capacity, clients leaving while queued."""
    flow_clients: int = 24
    flow_max_active: int = 2
    """``flow.max_active`` per engine: low, so that the extra clients overload the fleet."""
    flow_ttl_s: float = 8.0
    """Under ``request_timeout_s``: a request the queue cannot serve is shed before a client gives up."""
    flow_max_band_requests: int = 12
    """Small, so that full bands are part of the run too."""
    flow_disconnect_every_s: float = 0.25


@dataclass
class Sample:
    t: float
    requests: int
    clean_errors: int
    bad: int
    hit_ratio: float | None
    divergence: int | None
    rss_mb: float


@dataclass
class FaultRecord:
    fault: str
    engine: str
    start: float
    heal: float = 0.0
    converged_s: float | None = None
    lost_before: float = 0.0
    lost_after: float = 0.0
    attacks: int | None = None
    """Hostile faults: the attacks the proxy or the store sent meanwhile."""


@dataclass
class SoakReport:
    requests: int = 0
    ok: int = 0
    clean_errors: int = 0
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    poisoned: int = 0
    poisoned_examples: list[str] = field(default_factory=list)
    misbehaving_clients: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    router_alive: bool = True
    rss_start_mb: float = 0.0
    rss_max_mb: float = 0.0
    ejections: float = 0.0
    retries_refused: float = 0.0
    decode_errors: float = 0.0
    inflight_after: float = 0.0
    upstream_violations: dict[str, float] = field(default_factory=dict)
    store_failures: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    hung: int = 0
    """Requests with no answer within ``request_timeout_s``."""
    flow_rejected: dict[str, float] = field(default_factory=dict)
    flow_status: dict[str, int] = field(default_factory=dict)
    """The flow lane's clients' answers by HTTP status."""
    flow_disconnects: int = 0
    flow_depth_max: float = 0.0
    flow_depth_after: float = 0.0

    def summary(self, cfg: SoakConfig) -> dict[str, Any]:
        per: dict[str, list[float | None]] = {}
        for f in self.faults:
            per.setdefault(f.fault, []).append(f.converged_s)
        converge = {
            k: {
                "n": len(v),
                "max_s": max((x for x in v if x is not None), default=None),
                # every one, in order: a maximum alone cannot tell an outlier from a trend
                "each_s": [None if x is None else round(x, 3) for x in v],
                "not_converged": sum(1 for x in v if x is None),
            }
            for k, v in sorted(per.items())
        }
        replayed = [f for f in self.faults if f.fault in ("gap_replayed", "stream_stall", "kill_restart")]
        rss_by_minute: dict[int, float] = {}
        for x in self.samples:
            m = int(x.t // 60)
            rss_by_minute[m] = max(rss_by_minute.get(m, 0.0), x.rss_mb)
        attacks: dict[str, list[int]] = {}
        for f in self.faults:
            if f.attacks is not None:
                attacks.setdefault(f.fault, []).append(f.attacks)
        return {
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "ok": self.ok,
            "clean_errors": self.clean_errors,
            "bad_responses": self.bad,
            "bad_examples": self.bad_examples[:10],
            "poisoned_responses": self.poisoned,
            "poisoned_examples": self.poisoned_examples[:10],
            "misbehaving_clients": self.misbehaving_clients,
            "router_alive": self.router_alive,
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_max_mb": round(self.rss_max_mb, 1),
            "rss_growth_mb": round(self.rss_max_mb - self.rss_start_mb, 1),
            # by minute: a maximum alone cannot tell an attack's peak from a leak's trend
            "rss_max_mb_by_minute": [round(v, 1) for _, v in sorted(rss_by_minute.items())],
            "rss_bound_mb": cfg.rss_bound_mb,
            "rss_growth_bound_mb": cfg.rss_growth_bound_mb,
            "attacks_by_fault": dict(sorted(attacks.items())),
            "upstream_violations": self.upstream_violations,
            "store_failures": self.store_failures,
            "faults": len(self.faults),
            "converge_by_fault": converge,
            "converge_bound_s": cfg.converge_bound_s,
            "lost_batches_during_replayed_faults": sum(f.lost_after - f.lost_before for f in replayed),
            "ejections": self.ejections,
            "retries_refused": self.retries_refused,
            "malformed_frames_counted": self.decode_errors,
            "inflight_after": self.inflight_after,
            "hung": self.hung,
            "lost": self.lost,
            **(
                {
                    "flow": {
                        "rejected_by_reason": self.flow_rejected,
                        "answers_by_status": dict(sorted(self.flow_status.items())),
                        "disconnects_sent": self.flow_disconnects,
                        "queue_depth_max": self.flow_depth_max,
                        "queue_depth_after": self.flow_depth_after,
                    }
                }
                if cfg.flow
                else {}
            ),
        }

    @property
    def lost(self) -> int:
        """Requests sent that ended with no verdict at all (each ends as exactly one)."""
        return self.requests - self.ok - self.clean_errors - self.bad - self.poisoned

    def passed(self, cfg: SoakConfig) -> bool:
        s = self.summary(cfg)
        converged = all(
            v["not_converged"] == 0 and (v["max_s"] is None or v["max_s"] <= cfg.converge_bound_s)
            for v in s["converge_by_fault"].values()
        )
        return (
            self.router_alive
            and self.bad == 0
            and self.poisoned == 0
            and self.rss_max_mb <= cfg.rss_bound_mb
            and self.rss_max_mb - self.rss_start_mb <= cfg.rss_growth_bound_mb
            and all(f.attacks != 0 for f in self.faults)
            and converged
            and s["lost_batches_during_replayed_faults"] == 0
            and self.inflight_after == 0
            and self.hung == 0
            and self.lost == 0
            and (not cfg.flow or (self.flow_depth_after == 0 and self.flow_rejected.get("disconnect", 0) > 0))
        )


TAG = re.compile(rb"soak-\d{10}")
"""How the soak names a request (``x-request-id``; fixed width, so no tag is a part of another)."""


def tag_of(i: int) -> str:
    return f"soak-{i:010d}"


def foreign(tag: str, seen: bytes) -> str:
    """Another request's tag among the bytes a client received (an answer, or what its HTTP parser
    choked on), or ''."""
    return next((t.decode() for t in TAG.findall(seen) if t.decode() != tag), "")


def judge(tag: str, status: int, raw: bytes, stream: bool) -> tuple[str, str]:
    """What a well-behaved client makes of an answer to its request ``tag``: ``ok`` (complete, its
    own), ``clean`` (an OpenAI-shaped error, or a stream ended by an error event and ``[DONE]``),
    ``poisoned`` (holding bytes of another request's answer) or ``bad`` (anything else: truncated,
    malformed); and why, when not ok."""
    other = foreign(tag, raw)
    if other:
        return "poisoned", f"{tag} got bytes of {other}'s answer: {raw[:200]!r}"
    if status != 200:
        try:
            err = json.loads(raw).get("error")
        except (ValueError, AttributeError):
            err = None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return "clean", ""
        return "bad", f"{status} malformed error: {raw[:200]!r}"
    if not stream:
        try:
            data = json.loads(raw)
        except ValueError:
            return "bad", f"200, not JSON: {raw[:200]!r}"
        if not isinstance(data, dict) or not data.get("choices"):
            return "bad", f"200 without choices: {raw[:200]!r}"
        if tag not in str(data.get("id")):
            return "bad", f"{tag} got an answer named {str(data.get('id'))[:80]!r}"
        return "ok", ""
    events = [e for e in raw.decode("utf-8", "replace").split("\n\n") if e]
    if not events or events[-1] != "data: [DONE]" or not all(e.startswith("data: ") for e in events):
        return "bad", f"truncated or malformed stream: ...{raw[-200:]!r}"
    verdict = "ok"
    for e in events[:-1]:
        try:
            data = json.loads(e[6:])
        except ValueError:
            return "bad", f"an event that is not JSON: {e[:200]!r}"
        if not isinstance(data, dict):
            return "bad", f"an event that is not an object: {e[:200]!r}"
        if "error" in data:
            verdict = "clean"
        elif tag not in str(data.get("id")):
            return "bad", f"{tag} got a chunk named {str(data.get('id'))[:80]!r}"
    return verdict, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Soak:
    """Starts everything, runs the schedule and the load, watches the invariants."""

    def __init__(self, cfg: SoakConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.engines: list[EngineProc] = []
        self.report = SoakReport()
        self.router: asyncio.subprocess.Process | None = None
        self.url = ""
        self._stop = asyncio.Event()
        self._t0 = 0.0
        self.zctx = zmq.asyncio.Context()
        self._rogue_endpoint = ""
        self.hostile_engine: EngineProc | None = None
        """The engine behind the hostile proxy (its lane's faults only; the others never touch it)."""
        self.hostile: asyncio.subprocess.Process | None = None
        """``python -m sim.hostile``: the proxy and the store."""
        self.proxy_url = ""
        self.store_url = ""

    # --- set-up ------------------------------------------------------------------------------------
    async def _start(self) -> None:
        cfg = self.cfg
        args = [
            "--time-scale",
            str(cfg.time_scale),
            "--model",
            cfg.model,
            "--gpu-blocks",
            str(cfg.gpu_blocks),
        ]
        if cfg.tokenizer:
            args += ["--tokenizer", cfg.tokenizer]
        self.engines = [EngineProc(f"engine-{i}", args) for i in range(cfg.engines)]
        if cfg.hostile_faults:
            self.hostile_engine = EngineProc("hostile-0", args)
        await asyncio.gather(*(e.start() for e in self.all_engines))  # (at once: start-up is seconds each)
        await self._start_hostile()
        self._rogue_endpoint = f"tcp://127.0.0.1:{free_port()}"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        tok = f'tokenizer = "{cfg.tokenizer}"\n' if cfg.tokenizer else ""
        # (a hostile engine's trickled head is cut after 2 s; an ejected engine is tried again after
        # 1-4 s, so that one ejected during a fault takes traffic, and attacks, in the next)
        toml = (
            f'{tok}block_size = 16\nadmin_keys = ["{ADMIN}"]\n'
            f"[server]\nport = {port}\nread_timeout_s = 8\nwrite_timeout_s = 3\nconnect_timeout_s = 2\n"
            "upstream_head_timeout_s = 2\n"
            "[health]\ninterval_s = 1.0\ntimeout_s = 1.0\nunhealthy_after = 1\n"
            "[health.breaker]\neject_s = 1.0\nmax_eject_s = 4.0\n"
            "[index.subscriber]\nreplay_timeout_s = 1.0\nreplay_retry_s = 1.0\n"
        )
        if cfg.flow:
            toml += (
                f"[flow]\nenabled = true\nmax_active = {cfg.flow_max_active}\nttl_s = {cfg.flow_ttl_s}\n"
                f"max_band_requests = {cfg.flow_max_band_requests}\npriorities = [-1]\n"
            )
        if self.store_url:
            toml += (
                f'[cluster]\nredis_url = "{self.store_url}"\nreconnect_min_s = 0.05\nreconnect_max_s = 1.0\n'
            )
        for e in self.engines:
            toml += (
                f'[[backends]]\nname = "{e.name}"\nurl = "{e.url}"\nkv_events = "{e.kv_events}"\n'
                f'kv_replay = "{e.kv_replay}"\nmodels = ["{cfg.model}"]\n'
            )
        if self.hostile_engine is not None:
            h = self.hostile_engine
            toml += (
                f'[[backends]]\nname = "{h.name}"\nurl = "{self.proxy_url}"\nkv_events = "{h.kv_events}"\n'
                f'kv_replay = "{h.kv_replay}"\nmodels = ["{cfg.model}"]\n'
            )
        # the rogue: an event stream of garbage; its HTTP side answers nothing (never routed to)
        toml += (
            f'[[backends]]\nname = "rogue"\nurl = "http://127.0.0.1:{free_port()}"\n'
            f'kv_events = "{self._rogue_endpoint}"\nmodels = ["{cfg.model}"]\n'
        )
        path = self.workdir / "router.toml"
        path.write_text(toml)
        log = (self.workdir / "router.log").open("wb")
        self.router = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "serve", "--config", str(path), stdout=log, stderr=log
        )
        backends = len(self.all_engines)
        async with httpx.AsyncClient(timeout=5) as c:
            deadline = time.monotonic() + 120
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    r = await c.get(f"{self.url}/ready")
                    if (
                        r.status_code == 200
                        and len(r.json()["healthy_backends"]) == backends
                        and (not self.store_url or await self._metric(c, "kvrouter_cluster_connected") == 1)
                    ):
                        self.report.rss_start_mb = self._rss_mb()
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("router did not become ready")
                await asyncio.sleep(0.1)

    @property
    def all_engines(self) -> list[EngineProc]:
        return self.engines + ([self.hostile_engine] if self.hostile_engine is not None else [])

    async def _start_hostile(self) -> None:
        """The hostile proxy (in front of the hostile engine) and the store, in a process of their own."""
        cmd = [sys.executable, "-m", "sim.hostile"]
        if self.hostile_engine is not None:
            cmd += ["--proxy", self.hostile_engine.url]
        if self.cfg.store_faults:
            cmd.append("--store")
        if len(cmd) == 3:
            return
        log = (self.workdir / "hostile.log").open("wb")
        self.hostile = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True
        )
        assert self.hostile.stdout is not None
        info = json.loads(await asyncio.wait_for(self.hostile.stdout.readline(), 60))
        self.proxy_url = info["proxies"][0] if info["proxies"] else ""
        self.store_url = info["store"] or ""

    # --- load --------------------------------------------------------------------------------------
    def _body(self, i: int) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        long = rng.random() < 0.3
        words = " ".join(f"w{rng.randrange(400)}" for _ in range(rng.randrange(150, 300) if long else 10))
        system = f"You are assistant number {rng.randrange(6)} of the chaos soak. " * (3 if long else 1)
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": 12, "stream": rng.random() < 0.5}
        if rng.random() < 0.5:
            body["messages"] = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{i} {words}"},
            ]
            return "/v1/chat/completions", body
        body["prompt"] = f"{system}{i} {words}"
        return "/v1/completions", body

    def _bad(self, why: str) -> None:
        self.report.bad += 1
        if len(self.report.bad_examples) < 50:
            self.report.bad_examples.append(why)

    async def _one(self, client: httpx.AsyncClient, i: int, extra: dict[str, str] | None = None) -> int:
        """One request, judged; its HTTP status (0: none)."""
        path, body = self._body(i)
        tag = tag_of(i)
        self.report.requests += 1
        headers = {"x-request-id": tag, **(extra or {})}
        r: httpx.Response | None = None
        try:
            if body["stream"]:
                async with client.stream("POST", f"{self.url}{path}", json=body, headers=headers) as r:
                    raw = b"".join([c async for c in r.aiter_raw()])
            else:
                r = await client.post(f"{self.url}{path}", json=body, headers=headers)
                raw = r.content
        except httpx.TimeoutException as exc:
            self.report.hung += 1
            self._bad(f"{path}: no answer within {self.cfg.request_timeout_s} s ({type(exc).__name__})")
            return 0
        except httpx.HTTPError as exc:
            verdict, why = "bad", f"{type(exc).__name__}: {exc}"
            if foreign(tag, str(exc).encode()):  # (the parser choked on another answer's bytes)
                verdict = "poisoned"
        else:
            verdict, why = judge(tag, r.status_code, raw, body["stream"])
        if verdict == "ok":
            self.report.ok += 1
        elif verdict == "clean":
            self.report.clean_errors += 1
        elif verdict == "poisoned":
            self.report.poisoned += 1
            if len(self.report.poisoned_examples) < 50:
                self.report.poisoned_examples.append(f"{path}: {why}")
        else:
            self._bad(f"{path}: {why}")
        return r.status_code if r is not None else 0

    async def _flow_clients(self, k: int) -> None:
        """The flow lane's extra load: back to back, half in the sheddable band, a flow id each."""
        timeout = httpx.Timeout(self.cfg.request_timeout_s)
        extra = {"x-gateway-inference-fairness-id": f"tenant-{k}"}
        if k % 2:
            extra["x-kvrouter-priority"] = "-1"
        limits = httpx.Limits(max_connections=2)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            i = 20_000_000 + k
            while not self._stop.is_set():
                status = str(await self._one(client, i, extra))
                self.report.flow_status[status] = self.report.flow_status.get(status, 0) + 1
                i += self.cfg.flow_clients
                if status in ("429", "503"):  # (backs off less than Retry-After: the pressure stays)
                    await self._pause(0.2 + 0.3 * self.rng.random())

    async def _flow_leavers(self) -> None:
        """Clients that send a request and hang up while it waits in the queue (before any answer)."""
        n = 0
        host, port = self.url.rsplit(":", 1)[0][7:], int(self.url.rsplit(":", 1)[1])
        while not self._stop.is_set():
            await self._pause(self.cfg.flow_disconnect_every_s)
            n += 1
            path, body = self._body(30_000_000 + n)
            payload = json.dumps(body).encode()
            with contextlib.suppress(OSError, TimeoutError):
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                writer.write(
                    f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"x-request-id: {tag_of(30_000_000 + n)}\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                await self._pause(0.05 + 0.3 * self.rng.random())
                writer.transport.abort()
                self.report.flow_disconnects += 1

    async def _clients(self, k: int) -> None:
        timeout = httpx.Timeout(self.cfg.request_timeout_s)
        async with httpx.AsyncClient(timeout=timeout) as client:
            i = k
            while not self._stop.is_set():
                await self._one(client, i)
                i += self.cfg.clients

    async def _misbehaving(self) -> None:
        """Clients that stop reading a stream, or hang up in the middle of one."""
        n = 0
        while not self._stop.is_set():
            await self._pause(1.0)
            n += 1
            path, body = self._body(10_000_000 + n)
            body["stream"] = True
            body["max_tokens"] = 200
            payload = json.dumps(body).encode()
            host, port = self.url.rsplit(":", 1)[0][7:], int(self.url.rsplit(":", 1)[1])
            with contextlib.suppress(OSError, TimeoutError):
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
                writer.write(
                    f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"x-request-id: {tag_of(10_000_000 + n)}\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
                if n % 2:
                    await asyncio.wait_for(reader.read(200), 10)  # a little, then hang up
                else:
                    await self._pause(4)  # read nothing past the router's write timeout
                writer.transport.abort()
            self.report.misbehaving_clients += 1

    async def _pause(self, seconds: float) -> None:
        """Sleep, but not past the end of the run (which waits for every task)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _rogue(self) -> None:
        """Malformed frames at a high rate on an event endpoint the router follows."""
        pub = self.zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self._rogue_endpoint)
        rng = random.Random(self.cfg.seed + 1)
        seq = 0
        try:
            while not self._stop.is_set():
                for _ in range(max(int(self.cfg.rogue_rate / 20), 1)):
                    seq += 1
                    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
                    frames = [b"", seq.to_bytes(8, "big"), b"\x93\xcb" + junk][: rng.randrange(1, 4)]
                    with contextlib.suppress(zmq.ZMQError):
                        await pub.send_multipart(frames, flags=zmq.NOBLOCK)
                await asyncio.sleep(0.05)
        finally:
            pub.close(0)

    # --- watching ----------------------------------------------------------------------------------
    async def _divergence(self, c: httpx.AsyncClient, engines: list[EngineProc]) -> int | None:
        """Sum over engines of |indexed - announced| blocks, where the router has applied the engine's
        last batch; None while some engine's stream is behind (or the engine is down)."""
        total = 0
        try:
            announced = {}
            for e in engines:
                r = await c.get(f"{e.url}/admin/cache", timeout=2)
                announced[e.name] = r.json()["ranks"][0]
            debug = (await c.get(f"{self.url}/debug/index", timeout=5)).json()
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None
        sources = {s["instance"]: s for s in debug["sources"]}
        for e in engines:
            a, s = announced[e.name], sources.get(e.name)
            if s is None or s["last_seq"] != a["seq"]:
                return None
            total += abs(s["blocks"].get("GPU", 0) - a["blocks"]["GPU"])
        return total

    async def _metric(self, c: httpx.AsyncClient, name: str, labels: str = "") -> float:
        text = (await c.get(f"{self.url}/metrics", timeout=5)).text
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        out = 0.0
        for m in re.finditer(pattern, text, re.M):
            if labels in (m.group(1) or ""):
                out += float(m.group(2))
        return out

    async def _by_label(self, c: httpx.AsyncClient, name: str, label: str) -> dict[str, float]:
        """A counter's series by the value of one label (the series that are not 0)."""
        text = (await c.get(f"{self.url}/metrics", timeout=5)).text
        out: dict[str, float] = {}
        for m in re.finditer(rf'^{re.escape(name)}\{{[^}}]*{label}="([^"]*)"[^}}]*\}} (\S+)$', text, re.M):
            if float(m.group(2)):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def _rss_mb(self) -> float:
        assert self.router is not None
        try:
            return status_kb(self.router.pid, "VmRSS") / 1024
        except (OSError, KeyError):
            return 0.0

    async def _watch(self) -> None:
        async with httpx.AsyncClient(timeout=5) as c:
            last = (0.0, 0.0)
            while not self._stop.is_set():
                await asyncio.sleep(0.5)
                assert self.router is not None
                if self.router.returncode is not None:
                    self.report.router_alive = False
                rss = self._rss_mb()
                self.report.rss_max_mb = max(self.report.rss_max_mb, rss)
                with contextlib.suppress(httpx.HTTPError):
                    if self.cfg.flow:
                        depth = await self._metric(c, "kvrouter_flow_queue_depth")
                        self.report.flow_depth_max = max(self.report.flow_depth_max, depth)
                    prompt = await self._metric(c, "kvrouter_prompt_tokens_total")
                    matched = await self._metric(c, "kvrouter_matched_tokens_total", 'medium="GPU"')
                    hit = (matched - last[1]) / (prompt - last[0]) if prompt > last[0] else None
                    last = (prompt, matched)
                    div = await self._divergence(c, self.all_engines)
                    self.report.samples.append(
                        Sample(
                            time.monotonic() - self._t0,
                            self.report.requests,
                            self.report.clean_errors,
                            self.report.bad,
                            hit,
                            div,
                            rss,
                        )
                    )

    # --- faults ------------------------------------------------------------------------------------
    async def _post(self, c: httpx.AsyncClient, e: EngineProc, path: str, body: dict[str, Any]) -> None:
        r = await c.post(f"{e.url}{path}", json=body, timeout=5)
        r.raise_for_status()

    async def _fault(self, c: httpx.AsyncClient, fault: str, e: EngineProc) -> FaultRecord:
        rec = FaultRecord(fault, e.name, time.monotonic() - self._t0)
        rec.lost_before = await self._metric(c, "kvrouter_kv_lost_batches_total", f'source="{e.name}/dp0"')
        hold = self.cfg.fault_hold_s
        if fault == "kill_restart":
            await e.stop(kill=True)
            await asyncio.sleep(hold / 2)
            await e.start()
        elif fault == "gap_replayed":
            await self._post(c, e, "/admin/drop_batches", {"n": 5})
            await asyncio.sleep(hold)
        elif fault == "stream_stall":
            await self._post(c, e, "/admin/pause_events", {"seconds": hold / 2, "hold": 3})
            await asyncio.sleep(hold)
        elif fault == "gap_lost":
            await self._post(c, e, "/admin/replay", {"up": False})
            await self._post(c, e, "/admin/drop_batches", {"n": 3})
            await asyncio.sleep(hold)
            await self._post(c, e, "/admin/replay", {"up": True})
            await self._post(c, e, "/admin/clear", {})  # the cure for lost events: a prefix-cache reset
        elif fault == "hang":
            e.signal(signal.SIGSTOP)
            await asyncio.sleep(hold)
            e.signal(signal.SIGCONT)
        elif fault == "fail_5xx":
            await self._post(c, e, "/admin/fail", {"status": 500})
            await asyncio.sleep(hold)
            await self._post(c, e, "/admin/fail", {"status": None})
        elif fault == "reset_streams":
            await self._post(c, e, "/admin/reset_streams", {"n": 5})
            await asyncio.sleep(hold)
        rec.heal = time.monotonic() - self._t0
        rec.converged_s = await self._converge(c, e)
        rec.lost_after = await self._metric(c, "kvrouter_kv_lost_batches_total", f'source="{e.name}/dp0"')
        return rec

    async def _converge(self, c: httpx.AsyncClient, e: EngineProc) -> float | None:
        """Seconds from the heal until the index holds what the engine announced (None: not in 30 s)."""
        start = time.monotonic()
        while time.monotonic() - start < 30:
            if await self._divergence(c, [e]) == 0:
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        return None

    async def _hostile_fault(self, c: httpx.AsyncClient, fault: str, k: int) -> FaultRecord:
        """One fault of the hostile engine's or the store's lane (the ``k``-th of its lane)."""
        store = fault.startswith("store_")
        attack = fault.split("_", 1)[1]
        engine = self.hostile_engine
        where = "store" if store or engine is None else engine.name
        rec = FaultRecord(fault, where, time.monotonic() - self._t0)
        before = await self._attacks(c, store)
        await self._arm(c, store, attack)
        await asyncio.sleep(self.cfg.fault_hold_s)
        give_up = time.monotonic() + 10
        while await self._attacks(c, store) == before and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        await self._arm(c, store, None)
        rec.heal = time.monotonic() - self._t0
        rec.attacks = await self._attacks(c, store) - before
        if store:
            rec.converged_s = await self._link_back(c)
        else:
            assert engine is not None
            rec.converged_s = await self._converge(c, engine)
        return rec

    async def _arm(self, c: httpx.AsyncClient, store: bool, attack: str | None) -> None:
        if store:
            await store_command(self.store_url, "HOSTILE", "ATTACK", attack or "OFF")
        else:
            body = {"attack": attack, "streams_only": attack == "endless_sse"}
            (await c.post(f"{self.proxy_url}/hostile/attack", json=body, timeout=5)).raise_for_status()

    async def _attacks(self, c: httpx.AsyncClient, store: bool) -> int:
        """How many attacks the store (or the proxy) sent so far."""
        if store:
            return int((await store_command(self.store_url, "HOSTILE", "COUNT"))[1:])
        n: int = (await c.get(f"{self.proxy_url}/hostile/attack", timeout=5)).json()["attacked"]
        return n

    async def _link_back(self, c: httpx.AsyncClient) -> float | None:
        """Seconds from the heal until the link is connected and receives messages again (None: not in
        30 s)."""
        received = 'direction="received"'
        start = time.monotonic()
        before = await self._metric(c, "kvrouter_cluster_messages_total", received)
        while time.monotonic() - start < 30:
            if (
                await self._metric(c, "kvrouter_cluster_connected") == 1
                and await self._metric(c, "kvrouter_cluster_messages_total", received) > before
            ):
                return time.monotonic() - start
            await asyncio.sleep(0.05)
        return None

    async def _schedule(self) -> None:
        """The lanes of faults, each on its own grid, a third of the interval apart."""
        lanes = [
            (self.cfg.faults, 0.0, self._engine_fault),
            (self.cfg.hostile_faults, 1 / 3, self._hostile_fault),
            (self.cfg.store_faults, 2 / 3, self._hostile_fault),
        ]
        await asyncio.gather(*(self._lane(faults, offset, run) for faults, offset, run in lanes if faults))

    def _engine_fault(self, c: httpx.AsyncClient, fault: str, k: int) -> Awaitable[FaultRecord]:
        return self._fault(c, fault, self.engines[k % len(self.engines)])

    async def _lane(
        self,
        faults: list[str],
        offset: float,
        run: Callable[[httpx.AsyncClient, str, int], Awaitable[FaultRecord]],
    ) -> None:
        # faults start on a fixed grid (t0 + k * interval), not an interval after the previous one
        # ended: a fault's own hold, heal and convergence do not push the rest of the schedule out
        interval = self.cfg.fault_interval_s
        async with httpx.AsyncClient(timeout=10) as c:
            k = 0
            while not self._stop.is_set():
                due = self._t0 + (k + 1 + offset) * interval
                await self._pause(max(0.0, due - time.monotonic()))
                if self._stop.is_set():
                    return
                fault = faults[k % len(faults)]
                self.report.faults.append(await run(c, fault, k))
                k += 1

    # --- the run -----------------------------------------------------------------------------------
    async def run(self) -> SoakReport:
        try:
            await self._start()
            self._t0 = time.monotonic()
            tasks = [asyncio.create_task(self._clients(k)) for k in range(self.cfg.clients)]
            tasks += [
                asyncio.create_task(self._misbehaving()),
                asyncio.create_task(self._rogue()),
                asyncio.create_task(self._watch()),
                asyncio.create_task(self._schedule()),
            ]
            if self.cfg.flow:
                tasks += [asyncio.create_task(self._flow_clients(k)) for k in range(self.cfg.flow_clients)]
                tasks.append(asyncio.create_task(self._flow_leavers()))
            await asyncio.sleep(self.cfg.seconds)
            self._stop.set()
            await asyncio.gather(*tasks)
            self.report.seconds = time.monotonic() - self._t0
            async with httpx.AsyncClient(timeout=10) as c:
                self.report.ejections = await self._metric(c, "kvrouter_backend_ejections_total")
                self.report.retries_refused = await self._metric(
                    c, "kvrouter_retries_total", 'result="refused"'
                )
                self.report.decode_errors = await self._metric(c, "kvrouter_kv_decode_errors_total")
                self.report.upstream_violations = await self._by_label(
                    c, "kvrouter_upstream_violations_total", "reason"
                )
                self.report.store_failures = await self._by_label(
                    c, "kvrouter_cluster_failures_total", "kind"
                )
                if self.cfg.flow:
                    self.report.flow_rejected = await self._by_label(
                        c, "kvrouter_flow_rejected_total", "reason"
                    )
                    self.report.flow_depth_after = await self._metric(c, "kvrouter_flow_queue_depth")
                deadline = time.monotonic() + 15  # what clients left behind must be released
                while True:
                    self.report.inflight_after = await self._metric(c, "kvrouter_inflight_requests")
                    if self.report.inflight_after == 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
            assert self.router is not None
            self.report.router_alive = self.report.router_alive and self.router.returncode is None
        finally:
            self._stop.set()
            if self.router is not None and self.router.returncode is None:
                self.router.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.router.wait(), 60)
                except TimeoutError:
                    self.router.kill()
            await asyncio.gather(*(e.stop() for e in self.all_engines), stop_group(self.hostile))
            self.zctx.term()
        return self.report


def svg_plot(report: SoakReport, width: int = 960, height: int = 420) -> str:
    """Hit ratio, error rate and divergence over time, faults marked (a self-contained SVG)."""
    s = report.samples
    if len(s) < 2:
        return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    t_max = max(x.t for x in s) or 1.0
    m = 40
    panel_h = (height - 2 * m) / 3

    def x(t: float) -> float:
        return m + (width - 2 * m) * t / t_max

    def series(values: list[tuple[float, float]], top: float, vmax: float, color: str) -> str:
        pts = " ".join(f"{x(t):.1f},{top + panel_h - panel_h * min(v / vmax, 1.0):.1f}" for t, v in values)
        return f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{pts}'/>"

    head = f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'"
    out = [head + " font-family='sans-serif' font-size='11'>"]
    out.append(f"<rect width='{width}' height='{height}' fill='white'/>")
    hits = [(a.t, a.hit_ratio) for a in s if a.hit_ratio is not None]
    errs = []
    for a, b in itertools.pairwise(s):
        n = b.requests - a.requests
        errs.append((b.t, (b.clean_errors - a.clean_errors) / n if n > 0 else 0.0))
    div = [(a.t, float(a.divergence)) for a in s if a.divergence is not None]
    dmax = max([v for _, v in div] + [1.0])
    for k, (name, values, vmax, color) in enumerate(
        [
            ("GPU hit ratio (routed prompt tokens)", hits, 1.0, "#2b7"),
            ("clean error share of requests", errs, 1.0, "#d52"),
            (f"index divergence, blocks (max {dmax:.0f})", div, dmax, "#36c"),
        ]
    ):
        top = m + k * panel_h
        out.append(f"<text x='{m}' y='{top + 12}'>{name}</text>")
        out.append(
            f"<line x1='{m}' y1='{top + panel_h}' x2='{width - m}' y2='{top + panel_h}' stroke='#ccc'/>"
        )
        if values:
            out.append(series(values, top, vmax, color))
    for f in report.faults:
        w, h = max(x(f.heal) - x(f.start), 1), 3 * panel_h
        out.append(
            f"<rect x='{x(f.start):.1f}' y='{m}' width='{w:.1f}' height='{h:.1f}' fill='#fc3' opacity='.25'/>"
        )
        out.append(f"<text x='{x(f.start):.1f}' y='{m - 4}' font-size='9'>{f.fault}</text>")
    out.append(f"<text x='{width - m}' y='{height - 10}' text-anchor='end'>{t_max:.0f} s</text>")
    out.append("</svg>")
    return "\n".join(out)


def write_report(report: SoakReport, cfg: SoakConfig, out_dir: Path) -> dict[str, Any]:
    """report.json and plot.svg in ``out_dir``; returns the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = report.summary(cfg)
    summary["passed"] = report.passed(cfg)
    (out_dir / "report.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "plot.svg").write_text(svg_plot(report))
    return summary


__all__ = [
    "FAULTS",
    "HOSTILE_FAULTS",
    "STORE_FAULTS",
    "Soak",
    "SoakConfig",
    "SoakReport",
    "judge",
    "svg_plot",
    "tag_of",
    "write_report",
]
