"""Preemption on a real engine: a KV cache far smaller than the generations running at once.

vLLM admits a request as soon as its prompt's blocks fit; the blocks its decoding needs later may
not. When a running request cannot get one, the scheduler preempts the newest running request: its
blocks are freed (no event: they stay cached until reused), it goes back to the front of the queue,
and on its return it recomputes whatever of its prompt and output was evicted meanwhile
(BlockRemoved for each block reused, BlockStored again when recomputed, possibly while another copy
of the same hash is still cached). The router's references must follow that churn exactly.

Workload: long generations (``ignore_eos``) that share a two-block prefix, each sent once the one
before produced its first token, so every one is admitted while the others decode; probes while
they run (the shared prefix, which the oldest running request holds throughout, and a fresh
suffix); then, once all finished, every generation's prompt and prompt + answer again, one at a
time. It fails if the engine preempted nothing (``vllm:num_preemptions_total``): a test without a
preemption proves nothing about one.

Checked: each request's prediction (``POST /route`` just before it was sent) equals the engine's
``cached_tokens`` (vLLM reports the hit of a request's first admission, not of its return after a
preemption); the router's residencies of the engine equal what the engine's event stream implies
(per hash, stores minus removals); no prediction outlives the engine's BlockRemoved.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from vllm_tier import Fleet, Row, Tier, completion_usage, predicted_tokens, record_line, text

from sim.vllm_engines import MODEL, wait

pytestmark = pytest.mark.vllm_full

BLOCK = 32
GENERATIONS = 6
PROMPT_TOKENS = 160
"""Two shared blocks and three of a generation's own (the last partly filled)."""
MAX_TOKENS = 300
"""Each generation grows to ~15 blocks; six of them need ~90 blocks of a 32-block cache."""
PROBES = 3


@pytest.fixture(scope="module")
def tight(tier: Tier) -> Iterator[Fleet]:
    # 1 MiB: 32 blocks of 32 tokens for this model (2 layers x K,V x 2 heads x 64 x bf16 = 1 KiB a token).
    with tier.serve("llama", BLOCK, kv_cache="1M", max_model_len=512) as f:
        yield f


def preemptions(fleet: Fleet) -> float:
    """The engine's own count (Prometheus ``vllm:num_preemptions_total``)."""
    body = httpx.get(f"{fleet.engine.url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


def implied_residencies(events: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """Per KV cache group, the hashes the engine holds after ``events``: stores minus removals
    (vLLM's pool can hold two blocks of one hash, each stored and removed on its own)."""
    groups: dict[int, Counter[int]] = {}
    for e in events:
        kind = e.get("type")
        if kind == "AllBlocksCleared":
            groups.clear()
            continue
        held = groups.setdefault(int(e.get("group_idx") or 0), Counter())
        if kind == "BlockStored":
            held.update(int(h) for h in e["block_hashes"])
        elif kind == "BlockRemoved":
            held.subtract(int(h) for h in e["block_hashes"])
    for held in groups.values():
        assert all(n >= 0 for n in held.values()), "the engine removed a block it never stored"
    return {g: +held for g, held in groups.items()}


def within(fleet: Fleet, prompt: str, answer: str, limit: int = 500) -> str:
    """``prompt`` and as much of ``answer`` as keeps it under ``limit`` tokens (the answer's text,
    tokenized again, may take more tokens than were generated)."""
    while True:
        body = {"model": MODEL, "prompt": prompt + answer}
        n = httpx.post(f"{fleet.engine.url}/tokenize", json=body, timeout=30).json()["count"]
        if n <= limit:
            return prompt + answer
        answer = answer[: len(answer) * 3 // 4]


class Generation:
    """One long streamed generation through the router, its prediction taken just before."""

    def __init__(self, fleet: Fleet, tag: str, prompt: str) -> None:
        self.fleet, self.tag, self.prompt = fleet, tag, prompt
        self.first = threading.Event()
        self.text = ""
        self.usage: dict[str, Any] | None = None
        self.error: BaseException | None = None
        fleet.sync()
        self.route = fleet.route({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}, "completions")
        self.sent_at = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            stream = self.fleet.client.completions.create(
                model=MODEL,
                prompt=self.prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices:
                    self.text += chunk.choices[0].text or ""
                    self.first.set()
                if chunk.usage is not None:
                    self.usage = completion_usage(chunk)
        except BaseException as exc:  # (raised again by row())
            self.error = exc
        finally:
            self.first.set()

    def row(self) -> Row:
        self.thread.join(600)
        assert not self.thread.is_alive(), f"{self.tag} did not finish"
        if self.error is not None:
            raise self.error
        assert self.usage is not None, f"{self.tag}: the stream carried no usage"
        assert self.usage["completion_tokens"] == MAX_TOKENS, self.usage
        chosen = next(c for c in self.route["candidates"] if c["chosen"])
        bs = self.route["block_size"]
        return Row(
            tag=self.tag,
            endpoint="completions",
            stream=True,
            router_prompt_tokens=self.route["prompt_tokens"],
            engine_prompt_tokens=self.usage["prompt_tokens"],
            block_size=bs,
            predicted=predicted_tokens(
                self.route["prompt_tokens"], bs, sum(chosen["blocks_by_medium"].values())
            ),
            engine_cached=(self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            blocks_by_medium=chosen["blocks_by_medium"],
            sent_at=self.sent_at,
        )


def test_preemption(tight: Fleet) -> None:
    shared = "preempt shared " + text(300, 2 * BLOCK)
    prompts = [
        shared + f" generation {i} " + text(310 + i, PROMPT_TOKENS - 2 * BLOCK) for i in range(GENERATIONS)
    ]
    before = preemptions(tight)
    checks0 = tight.checked().get("checks", {})

    gens: list[Generation] = []
    for i, prompt in enumerate(prompts):
        gens.append(Generation(tight, f"gen{i}", prompt))
        assert gens[-1].first.wait(300), f"gen{i} produced nothing"
    # probes while the generations run and preempt each other (the oldest holds the shared prefix)
    wait(
        lambda: preemptions(tight) > before or all(not g.thread.is_alive() for g in gens), "a preemption", 300
    )
    during_probes = preemptions(tight) - before
    probe_rows = []
    for j in range(PROBES):
        if all(not g.thread.is_alive() for g in gens):
            break
        tight.send(
            f"probe{j} while running",
            {"prompt": shared + f" probe {j} " + text(330 + j, BLOCK), "max_tokens": 4},
        )
        probe_rows.append(tight.rows[-1])
    gen_rows = [g.row() for g in gens]
    n_preempted = preemptions(tight) - before
    assert n_preempted > 0, "the engine preempted nothing: the workload does not exercise preemption"

    # the router checked every generation too (after each response), and found each exact
    tight.rows.extend(gen_rows)
    tight.wait_checked("the generations")
    checks = tight.checked()["checks"]
    delta = {k: n - checks0.get(k, 0) for k, n in checks.items() if n != checks0.get(k, 0)}
    verdict = "exact" if set(delta) == {"exact"} else ",".join(sorted(delta))
    for r in gen_rows:
        r.router_result = verdict

    # the index against the engine's stream, once every block was freed or evicted
    tight.sync()
    implied = implied_residencies(tight.watch.events())
    assert set(implied) == {0}, implied
    assert tight.source()["blocks"]["GPU"] == len(implied[0]), (tight.source()["blocks"], len(implied[0]))
    duplicates = sum(n > 1 for n in implied[0].values())

    # after: every prompt again, and every prompt with its answer (decode-filled blocks)
    after_start = len(tight.rows)
    for i, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
        tight.send(f"after/p{i}", {"prompt": prompt, "max_tokens": 4})
        tight.send(f"after/p{i}+answer", {"prompt": within(tight, prompt, g.text), "max_tokens": 4})
    tight.sync()
    implied = implied_residencies(tight.watch.events())
    assert tight.source()["blocks"]["GPU"] == len(implied[0]), (tight.source()["blocks"], len(implied[0]))

    events = tight.watch.events()
    removed = sum(len(e["block_hashes"]) for e in events if e.get("type") == "BlockRemoved")
    stored = sum(len(e["block_hashes"]) for e in events if e.get("type") == "BlockStored")
    figures = {
        "requests": len(tight.rows),
        "generations": GENERATIONS,
        "preemptions": n_preempted,
        "preemptions_before_probes": during_probes,
        "probes_while_running": len(probe_rows),
        "blocks_stored": stored,
        "blocks_removed": removed,
        "hashes_held_twice_at_end_of_run": duplicates,
        **tight.summary(),
    }
    record_line({"model": "llama", "preemption": figures})
    print(f"\npreemption figures: {figures}")
    assert removed > 0, "the engine evicted nothing"
    assert any(r.engine_cached for r in tight.rows[after_start:]), "no prompt was served from cache again"
    tight.assert_agreement(tight.rows)
