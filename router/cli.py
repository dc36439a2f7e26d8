"""The `kvrouter` command: `serve` (the router) plus the simulated-fleet commands registered by `sim`.

Subcommands live next to what they run; this module only wires them so `kvrouter --help` lists all.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, told the terminal's width: left to itself it imports shutil for it,
    and shutil brings zlib, bz2 and lzma, ~5 ms of every ``kvrouter serve`` start. The same width
    as shutil's: ``COLUMNS``, else the terminal's, else 80, less 2."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ):
        if width is None:
            try:
                columns = int(os.environ.get("COLUMNS", "0"))
            except ValueError:
                columns = 0
            if columns <= 0:
                try:
                    columns = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 0
                except (AttributeError, ValueError, OSError):
                    columns = 0
            width = (columns or 80) - 2
        super().__init__(prog, indent_increment, max_help_position, width)


class _Parser(argparse.ArgumentParser):
    """A parser (and subcommand parsers: argparse makes them of the parent's class) with
    :class:`_Formatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


def build_parser(serve_only: bool = False, sim: bool = True) -> argparse.ArgumentParser:
    """The top-level parser; every subcommand sets `func(args) -> int`. ``serve_only`` leaves out the
    simulation commands, whose modules (the mock engine's web app and numpy) a router never needs:
    `kvrouter serve` starts ~0.5 s sooner and ~25 MB lighter without them. ``sim=False`` lists them
    by name and help only (sim/commands.py), which is all `kvrouter --help` (or a command line with
    no or an unknown command) shows: ~1 s sooner."""
    parser = _Parser(prog="kvrouter", description="KV-aware request router for vLLM fleets.")
    sub: argparse._SubParsersAction[Any] = parser.add_subparsers(dest="command", required=True)
    from router import serve

    serve.register(sub)
    if serve_only:
        return parser
    if sim:
        from sim import cli as sim_cli

        sim_cli.register(sub)
    else:
        from sim.commands import COMMANDS

        for name, help_line in COMMANDS.items():
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"]:
        parser = build_parser(serve_only=True)
    else:
        from sim.commands import COMMANDS

        first = next((w for w in words if not w.startswith("-")), None)  # (the command, if any)
        parser = build_parser(sim=first in COMMANDS)
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
