"""The router's predicted cached tokens against real vLLM's own count, request by request.

One real engine per model (a module-scoped fixture: started once, killed by process group at the
end), behind the real router, which reads the engine's streams itself (``kv_events = "auto"``).
Per request: the prediction ``POST /route`` shows just before it is sent, against the engine's
``usage.prompt_tokens_details.cached_tokens``; the router's prompt token count against the engine's
``usage.prompt_tokens``. Workloads: shared prefixes (completions) and multi-turn chat, some of it
streamed through the router with the official openai client.

Expected: no request over-predicted and every one exact. That holds for full attention. For the
hybrids (sliding window, Mamba) vLLM's hit needs more than the full-attention group's prefix (the
window's blocks ending at the hit, a saved state exactly there), which the index does not model
yet: those cases fail until it does, and are meant to.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from vllm_tier import Fleet, Tier, text

from sim.vllm_engines import BLOCK_SIZES, MODEL, TOPIC

MODELS = [
    pytest.param("llama", id="llama"),
    pytest.param("gemma3", id="gemma3"),
    pytest.param("qwen3_next", id="qwen3_next", marks=pytest.mark.vllm_full),
]
BLOCK = BLOCK_SIZES
GROUPS = {
    "llama": {"full_attention"},
    "gemma3": {"sliding_window", "full_attention"},
    "qwen3_next": {"mamba", "full_attention"},
}
"""The KV cache group kinds each model's events carry (what makes it stand for its family)."""


@pytest.fixture(scope="module", params=MODELS)
def fleet(request: pytest.FixtureRequest, tier: Tier) -> Iterator[Fleet]:
    with tier.serve(request.param, BLOCK[request.param]) as f:
        yield f


def kind_of(fleet: Fleet) -> str:
    return fleet.engine.model_dir.name


def test_the_router_follows_the_event_sources_the_engine_lists(fleet: Fleet) -> None:
    e = fleet.engine
    listing = httpx.get(f"{e.url}/kv_event_sources", timeout=30).json()
    assert set(listing) == {"0"}
    assert (listing["0"]["endpoint"], listing["0"]["replay_endpoint"], listing["0"]["topic"]) == (
        f"tcp://*:{e.events_port}",
        f"tcp://*:{e.replay_port}",
        TOPIC,
    )
    b = fleet.backend()
    assert (b["kv_sources"], b["dp_size"], b["state"]) == ("listed", 1, "ready")
    s = fleet.source()
    assert (s["endpoint"], s["bootstrap"], s["connected"]) == (
        f"tcp://127.0.0.1:{e.events_port}",
        "done",
        True,
    )
    # one request: the engine's events reach the router, in the groups that make this model's shape
    fleet.send("probe", {"prompt": text(1, 3 * BLOCK[kind_of(fleet)]), "max_tokens": 4})
    fleet.sync()
    kinds = {ev.get("kv_cache_spec_kind") for ev in fleet.watch.events() if ev.get("type") == "BlockStored"}
    assert kinds == GROUPS[kind_of(fleet)]
    assert {ev.get("block_size") for ev in fleet.watch.events() if "block_size" in ev} == {
        BLOCK[kind_of(fleet)]
    }
    assert fleet.source()["block_size"] == BLOCK[kind_of(fleet)] and not fleet.source()["block_size_mismatch"]


def test_shared_prefixes(fleet: Fleet) -> None:
    """Completions sharing a document: whole, in part, repeated, streamed, and a fresh one."""
    bs = BLOCK[kind_of(fleet)]
    doc = f"shared {kind_of(fleet)} " + text(11, 6 * bs if bs < 100 else 2 * bs)
    q = [f" Question {i}: " + text(30 + i, bs // 2) for i in range(5)]
    start = len(fleet.rows)
    fleet.send("doc+q0", {"prompt": doc + q[0]})
    fleet.send("doc+q1", {"prompt": doc + q[1]})
    fleet.send("doc+q0 again", {"prompt": doc + q[0]})
    fleet.send("half doc+q2", {"prompt": doc[: len(doc) // 2] + q[2]})
    fleet.send("doc+q1 streamed", {"prompt": doc + q[1]}, stream=True)
    fleet.send("two-thirds doc+q3", {"prompt": doc[: 2 * len(doc) // 3] + q[3]})
    fleet.send("half doc+q2 again", {"prompt": doc[: len(doc) // 2] + q[2]}, stream=True)
    fleet.send("fresh", {"prompt": f"fresh {kind_of(fleet)} " + text(47, bs * 2 if bs < 100 else bs)})
    fleet.assert_agreement(fleet.rows[start:])


def test_multi_turn_chat(fleet: Fleet) -> None:
    """Two conversations with one system prompt, interleaved, each turn carrying the real answer
    of the turn before; every other turn streamed through the router."""
    bs = BLOCK[kind_of(fleet)]
    system = {"role": "system", "content": f"chat {kind_of(fleet)} " + text(60, 3 * bs if bs < 100 else bs)}
    talks: dict[str, list[dict[str, str]]] = {"a": [system], "b": [system]}
    start = len(fleet.rows)
    for turn in range(3):
        for name, seed in (("a", 70), ("b", 80)):
            messages = talks[name]
            messages.append({"role": "user", "content": text(seed + turn, bs if bs < 100 else bs // 4)})
            answer = fleet.send(
                f"{name}{turn}", {"messages": list(messages), "max_tokens": 16}, stream=turn % 2 == 1
            )
            assert answer, "the engine generated nothing"
            messages.append({"role": "assistant", "content": answer})
    fleet.assert_agreement(fleet.rows[start:])


def test_streaming_through_the_router_with_the_openai_client(fleet: Fleet) -> None:
    """A chat stream through the router: chunks arrive, the final one carries the engine's usage."""
    prompt = [{"role": "user", "content": f"stream {kind_of(fleet)} " + text(90, 40)}]
    chunks = list(
        fleet.client.chat.completions.create(
            model=MODEL, messages=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 2, chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
