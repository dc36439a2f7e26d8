"""Decision cost against fleet width: the proxied decision (``RouterService.decide``, not a dry
run: match, score, choose, predict-on-route, the kept record) and ``/route``'s rendering, at 8, 64,
256 and 1,024 candidates (backends x 8 DP ranks), in one process with garbage collection on.

The fleet is in-process (members made ready by hand, index sources filled directly through the
store, a 1,024-token prompt of token ids with an 8-block shared prefix cached on a quarter of
the sources): what is measured is the router's own CPU per decision, which is what grows with the
fleet. Run it from a tree (``PYTHONPATH=<tree>``) to compare builds side by side::

    python bench/decision_scale.py --out bench/out/decision-scale-new.json
    PYTHONPATH=/tmp/old-decide python bench/decision_scale.py --out bench/out/decision-scale-old.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from index.keys import prompt_keys
from index.kvindex import IndexConfig, KVIndex
from router.config import BackendConfig, MembershipConfig
from router.decision.policy import Policy, PolicyConfig
from router.decision.service import RouterService
from router.decision.tokenizer import RequestTokenizer
from router.fleet.load import LoadTracker
from router.fleet.membership import Membership


def build(width: int, dp: int = 8) -> tuple[RouterService, list[int]]:
    """A ready fleet of ``width`` candidates and the prompt to route."""
    backends = max(width // dp, 1)
    dp = width // backends
    index = KVIndex(IndexConfig(block_size=16))
    membership = Membership(MembershipConfig())
    specs = [
        BackendConfig(f"e{i}", f"http://127.0.0.1:9/{i}", models=["m"], dp_size=dp) for i in range(backends)
    ]
    membership.reconcile("config", specs)
    loads = LoadTracker([])
    rng = random.Random(width)
    prompt = [rng.randrange(1, 30000) for _ in range(1024)]
    keys = prompt_keys(prompt, 16)
    for m in membership.members.values():
        m.healthy = True
        for target in m.targets:
            loads.track(target)
            sidx = index.ingestor.add_source(target)
            if rng.random() < 0.25:
                depth = rng.randrange(1, 9)
                index.store.store(sidx, 0, [k ^ 0x5A5A for k in keys[:depth]], keys[:depth])
    membership.tick(lambda m: 0, lambda m: True)
    tokenizer = RequestTokenizer({})
    service = RouterService(index, membership, loads, Policy(PolicyConfig(), random.Random(1)), tokenizer)
    return service, prompt


async def measure(width: int, count: int) -> dict[str, float]:
    service, prompt = build(width)
    body = {"model": "m", "prompt": prompt}
    spans: list[float] = []
    render: list[float] = []
    for i in range(count + 50):
        t0 = time.process_time()
        route = await service.decide("completions", body)
        t1 = time.process_time()
        if i % 10 == 0:
            r0 = time.process_time()
            route.explain_json()
            render.append((time.process_time() - r0) * 1e6)
        if i >= 50:
            spans.append((t1 - t0) * 1e6)
    spans.sort()
    return {
        "candidates": width,
        "decide_p50_us": statistics.median(spans),
        "decide_p99_us": spans[int(len(spans) * 0.99) - 1],
        "route_json_p50_us": statistics.median(render),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="8,64,256,1024")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/out/decision-scale.json"))
    args = ap.parse_args()
    rows = [asyncio.run(measure(int(w), args.count)) for w in args.widths.split(",")]
    for r in rows:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
