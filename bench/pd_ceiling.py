"""What KV-aware prefill placement can gain over round-robin at most, per trace and prefill-pool size.

``.venv/bin/python bench/pd_ceiling.py [--engines 2,4]``: the generated workloads of the P/D stage
(``bench/quality.py --stages pd``: chat, conversations, long sessions, tokenized as the engines
tokenize them), the requests the P/D trace stage sends (``sim.pd_demo.trace_scenario``, as
``--stages pd_traces`` replays them) and the whole Mooncake conversation trace (16 tokens per trace
block, as the stage), as the router keys them (full 16-token blocks), placed on N engines with
unbounded caches and no load:

- *longest prefix*: each request goes to the engine caching the longest prefix of its blocks (ties: the
  engine holding fewer blocks), the best any prefix-aware placement does without knowing the future;
- *round-robin*: request i goes to engine i mod N.

The hit ratio is the share of a request's blocks its engine already held. With unbounded caches
the ratio of the two is the most KV-aware placement can gain over round-robin from prefix reuse alone
(finite caches widen it: round-robin stores every prefix on every engine, so it fills the caches
sooner). It explains the prefill-pool ratios of the P/D benchmarks: with two prefill engines,
round-robin already sends every other follow-up to the engine that served the previous turn.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.keys import prompt_keys
from router.decision.chat import ChatTokenizer
from sim.offline import chat_tokenizer
from sim.pd_demo import TRACE_WORKLOADS, conversations, long_sessions, trace_scenario
from sim.toy_tokenizer import build_toy_tokenizer
from sim.traces import load_trace
from sim.workload import demo_config, generate


def keys_of(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each prompt's full 16-token blocks as the router keys them."""
    return [[int(k) for k in prompt_keys(ids, 16)] for ids in prompts]


def place(prompts: Sequence[Sequence[int]], engines: int, policy: str) -> float:
    """Hit ratio of ``policy`` (``prefix`` | ``round_robin``) on ``engines`` unbounded caches."""
    caches: list[set[int]] = [set() for _ in range(engines)]
    hits = total = 0
    for i, keys in enumerate(prompts):
        held = []
        for cache in caches:
            n = 0
            for k in keys:
                if k not in cache:
                    break
                n += 1
            held.append(n)
        if policy == "round_robin":
            e = i % engines
        else:
            e = max(range(engines), key=lambda j: (held[j], -len(caches[j])))
        hits += held[e]
        total += len(keys)
        caches[e].update(keys)
    return hits / total if total else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--engines", default="2,4", help="prefill-pool sizes (comma-separated)")
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.engines.split(",")]
    windows: list[tuple[str, list[list[int]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = ChatTokenizer.from_path(str(build_toy_tokenizer(Path(tmp))))
        for name, cfg in (
            ("chat", demo_config()),
            ("conversations", conversations()),
            ("long sessions", long_sessions()),
        ):
            requests = generate(cfg)
            prompts = keys_of([chat_tokenizer(tok)(r) for r in requests])
            windows.append((f"{name} (generated, {len(requests)} requests)", prompts))
    for name in TRACE_WORKLOADS:  # the very requests the P/D trace stage sends
        _, sent, _ = trace_scenario(name)
        prompts = keys_of([r.prompt_token_ids or [] for r in sent])
        windows.append((f"{name} trace (the P/D stage's {len(sent)} requests)", prompts))
    whole = load_trace("conversation", tokens_per_block=16)
    prompts = keys_of([r.token_ids() or [] for r in whole.requests])
    windows.append((f"conversation trace (whole, {len(whole.requests)} requests)", prompts))
    print("| trace | prefill engines | longest prefix | round-robin | ceiling of the ratio |")
    print("|---|---:|---:|---:|---:|")
    for label, prompts in windows:
        for n in sizes:
            kv, rr = place(prompts, n, "prefix"), place(prompts, n, "round_robin")
            print(
                f"| {label} | {n} | {kv:.3f} | {rr:.3f} | {kv / rr if rr else float('inf'):.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
