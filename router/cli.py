"""The `kvrouter` command: `serve` (the router) plus the simulated-fleet commands registered by `sim`.

Subcommands live next to what they run; this module only wires them so `kvrouter --help` lists all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; every subcommand sets `func(args) -> int`."""
    parser = argparse.ArgumentParser(prog="kvrouter", description="KV-aware request router for vLLM fleets.")
    sub = parser.add_subparsers(dest="command", required=True)
    from router import serve
    from sim import cli as sim_cli

    serve.register(sub)
    sim_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
