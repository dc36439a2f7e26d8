"""The simulation subcommands' names and one-line help, apart from their (heavy) modules: `kvrouter
--help` lists them without importing the mock engine's web app, numpy or the tokenizers (~1 s on
the 2-core box); each command's module registers its full parser with the same line.

`kvrouter` does not import this package: kvrouter-sim declares each :class:`Command` below as a
"kvrouter.commands" entry point (sim/pyproject.toml), and router/cli.py finds them there, so a
router installed without kvrouter-sim simply has no simulation commands."""

from __future__ import annotations

import argparse
import importlib
from typing import Any, NamedTuple

COMMANDS: dict[str, str] = {
    "mock-engine": "run simulated vLLM engines (OpenAI API, /metrics, KV events over ZMQ)",
    "demo": "compare routing policies on a simulated fleet (mock engines + the real router)",
    "bench": "routing-quality benchmarks on public traces",
}
"""Name -> the line `kvrouter --help` shows."""


class Command(NamedTuple):
    """One `kvrouter` subcommand as an entry point: its help line, and where its parser is
    registered (``module:function(subparsers)``), imported only when the command runs."""

    name: str
    registrar: str

    @property
    def help(self) -> str:
        """The line `kvrouter --help` shows."""
        return COMMANDS[self.name]

    def register(self, subparsers: argparse._SubParsersAction[Any]) -> None:
        """Add the command's full parser (this imports its module)."""
        module, _, function = self.registrar.partition(":")
        getattr(importlib.import_module(module), function)(subparsers)


MOCK_ENGINE = Command("mock-engine", "sim.cli:register_mock_engine")
DEMO = Command("demo", "sim.demo:register")
BENCH = Command("bench", "sim.replay:register")
