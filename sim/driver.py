"""Live load generator: issues a workload's requests at their arrival times against an OpenAI base URL.

Every request streams (``stream: true`` with ``stream_options.include_usage``) so that TTFT is the
time to the first chunk carrying content, the way a user perceives it, and the final usage chunk
gives ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``: the hit ratio as the engines
themselves count it. Chat requests go to ``/v1/chat/completions``; token-id prompts (traces) to
``/v1/completions``.

Scheduling: a request is sent at ``at_s / speedup`` after the start. In session mode a later turn of
a conversation waits for its predecessor to finish plus its think time (scaled by ``speedup``), and
with ``echo_answers`` it resends the answers the engine really returned instead of the workload's
stand-ins, as a chat client does. ``concurrency`` bounds requests in flight (a request waiting for a
slot starts its clock only when sent). ``deadline_s`` stops issuing new requests after that long.

Which backend served a request is read from the ``x-kvrouter-backend`` response header when the
router sets one; per-engine load is otherwise taken from the engines' ``/metrics``
(:func:`scrape_engines`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from sim.workload import Request, with_answers

BACKEND_HEADER = "x-kvrouter-backend"


class DriverConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to replay a workload against a live endpoint."""

    base_url: str
    model: str = "toy-model"
    concurrency: int = 128
    """Requests in flight at most."""
    speedup: float = 1.0
    """Arrival times (and think times) are divided by this."""
    session_mode: bool = True
    echo_answers: bool = True
    """Resend the engine's real answers in later turns (chat workloads, session mode)."""
    timeout_s: float = 120.0
    """Per-request timeout."""
    deadline_s: float | None = None
    """Issue no new request after this many seconds."""
    session_header: str | None = None
    """Send each request's session name in this header (router session affinity)."""


class RequestResult(msgspec.Struct, kw_only=True):
    """What happened to one request."""

    index: int
    session: str
    kind: str
    ok: bool = False
    status: int = 0
    error: str | None = None
    sent_s: float = 0.0
    """Send time, seconds after the replay started."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    backend: str | None = None
    skipped: bool = False
    """Not sent (deadline passed)."""
    gaps_s: list[float] = []
    """Time between consecutive content chunks (inter-token latency, one gap per chunk after the first)."""


Progress = Callable[[int, int], None]
"""Called with (finished, total) after every request."""


def _body(req: Request, model: str, answers: Sequence[str | None] | None) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.messages is not None:
        messages = with_answers(req.messages, answers) if answers else req.messages
        return "/v1/chat/completions", {**common, "messages": messages}
    ids = req.token_ids()
    if ids is None:
        raise ValueError(f"request of session {req.session!r} has no prompt")
    return "/v1/completions", {**common, "prompt": ids}


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    delta = c.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(c.get("text") or "")


async def send(
    client: httpx.AsyncClient,
    req: Request,
    index: int,
    cfg: DriverConfig,
    answers: Sequence[str | None] | None,
    t0: float,
) -> tuple[RequestResult, str]:
    """Send one streaming request; returns its result and the generated text."""
    path, body = _body(req, cfg.model, answers)
    res = RequestResult(index=index, session=req.session, kind=req.kind)
    start = time.monotonic()
    res.sent_s = start - t0
    text: list[str] = []
    gaps: list[float] = []
    res.gaps_s = gaps
    last = start
    try:
        headers = {cfg.session_header: req.session} if cfg.session_header else None
        async with client.stream("POST", path, json=body, headers=headers, timeout=cfg.timeout_s) as resp:
            res.status = resp.status_code
            res.backend = resp.headers.get(BACKEND_HEADER)
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = raw.decode("utf-8", "replace")[:300]
                return res, ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res, ""
                piece = _content(chunk)
                if piece:
                    now = time.monotonic()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
        res.e2e_s = time.monotonic() - start
        res.ok = res.error is None
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res, "".join(text)


async def run(
    requests: Sequence[Request], cfg: DriverConfig, progress: Progress | None = None
) -> list[RequestResult]:
    """Replay ``requests``; returns one result per request, in the input's order."""
    results: list[RequestResult | None] = [None] * len(requests)
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    t0 = time.monotonic()
    done = 0
    total = len(requests)

    def finished(i: int, r: RequestResult) -> None:
        nonlocal done
        results[i] = r
        done += 1
        if progress is not None:
            progress(done, total)

    # chains of dependent turns (session mode) and independent requests
    chains: list[list[int]] = []
    if cfg.session_mode:
        by_session: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            if r.think_s is not None and r.session in by_session:
                by_session[r.session].append(i)
            else:
                chain = [i]
                by_session[r.session] = chain
                chains.append(chain)
    else:
        chains = [[i] for i in range(len(requests))]

    limits = httpx.Limits(
        max_connections=max(1, cfg.concurrency), max_keepalive_connections=max(1, cfg.concurrency)
    )
    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits, timeout=cfg.timeout_s) as client:

        async def one_chain(chain: list[int]) -> None:
            answers: list[str | None] = []
            prev_end: float | None = None
            for i in chain:
                req = requests[i]
                when = req.at_s / cfg.speedup
                if prev_end is not None:
                    when = max(when, prev_end + (req.think_s or 0.0) / cfg.speedup)
                delay = when - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if cfg.deadline_s is not None and time.monotonic() - t0 > cfg.deadline_s:
                    for j in chain[chain.index(i) :]:
                        r = requests[j]
                        finished(
                            j,
                            RequestResult(
                                index=j, session=r.session, kind=r.kind, skipped=True, error="deadline"
                            ),
                        )
                    return
                async with sem:
                    res, text = await send(client, req, i, cfg, answers if cfg.echo_answers else None, t0)
                prev_end = time.monotonic() - t0
                answers.append(text if res.ok else None)
                finished(i, res)

        await asyncio.gather(*(one_chain(c) for c in chains))
    return [
        r if r is not None else RequestResult(index=i, session="", kind="", error="lost")
        for i, r in enumerate(results)
    ]


# ---- engine metrics ------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\}\s+(\S+)$")


class EngineCounters(msgspec.Struct, kw_only=True):
    """An engine's cumulative counters (summed over its DP ranks)."""

    url: str
    prompt_tokens: float = 0.0
    requests: float = 0.0
    hits: float = 0.0
    queries: float = 0.0

    def minus(self, before: EngineCounters | None) -> EngineCounters:
        """The increase since ``before`` (counters restart from 0 with the engine)."""
        if before is None:
            return self
        return EngineCounters(
            url=self.url,
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            requests=self.requests - before.requests,
            hits=self.hits - before.hits,
            queries=self.queries - before.queries,
        )


def parse_metrics(url: str, text: str) -> EngineCounters:
    """The counters the report needs from a Prometheus text page with vLLM's names."""
    out = EngineCounters(url=url)
    fields = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:request_success_total": "requests",
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
    }
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in fields:
            attr = fields[m.group(1)]
            setattr(out, attr, getattr(out, attr) + float(m.group(3)))
    return out


async def scrape_engines(urls: Sequence[str], timeout_s: float = 10.0) -> list[EngineCounters]:
    """Every engine's counters from its /metrics."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def one(url: str) -> EngineCounters:
            resp = await client.get(url.rstrip("/") + "/metrics")
            resp.raise_for_status()
            return parse_metrics(url, resp.text)

        return list(await asyncio.gather(*(one(u) for u in urls)))
