"""The simulation subcommands' names and one-line help, apart from their (heavy) modules: `kvrouter
--help` lists them without importing the mock engine's web app, numpy or the tokenizers (~1 s on
the 2-core box); each command's module registers its full parser with the same line."""

from __future__ import annotations

COMMANDS: dict[str, str] = {
    "mock-engine": "run simulated vLLM engines (OpenAI API, /metrics, KV events over ZMQ)",
    "demo": "compare routing policies on a simulated fleet (mock engines + the real router)",
    "bench": "routing-quality benchmarks on public traces",
}
"""In `kvrouter --help`'s order."""
