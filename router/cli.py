"""The `kvrouter` command: `serve` (the router) plus the commands other distributions add.

Those are found through the "kvrouter.commands" entry point group, never imported by name: the
simulated fleet's commands (`mock-engine`, `demo`, `bench`) come with kvrouter-sim (sim/pyproject.toml),
which a router's install need not have. Each entry point is an object with a ``help`` line and a
``register(subparsers)`` method (sim/commands.py), so `kvrouter --help` lists them all without
importing what they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint  # (its import costs `kvrouter serve` ~5 ms: only where needed)


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


COMMAND_GROUP = "kvrouter.commands"
"""The entry point group of the subcommands other distributions add."""

MISSING_COMMANDS_HINT = (
    "The simulated-fleet commands (mock-engine, demo, bench) are not installed: they come with "
    "kvrouter-sim, from a checkout `pip install -e ./sim` (or `make demo`)."
)


class Command(Protocol):
    """What a "kvrouter.commands" entry point loads to."""

    @property
    def help(self) -> str:
        """Its line in `kvrouter --help`."""

    def register(self, subparsers: argparse._SubParsersAction[Any]) -> None:
        """Add its parser (setting ``func(args) -> int``)."""


class _TopParser(_Parser):
    """The top-level parser: a command it does not know may be one not installed, so its error
    says how to get those."""

    hint = ""

    def error(self, message: str) -> NoReturn:
        super().error(f"{message}\n{self.hint}" if self.hint else message)


def installed_commands() -> dict[str, EntryPoint]:
    """Name -> entry point of every command installed distributions add (the first of a name;
    none may replace `serve`)."""
    # optional: installed commands only when the parser lists them
    from importlib.metadata import entry_points

    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name != "serve":
            found.setdefault(ep.name, ep)
    return found


def build_parser(serve_only: bool = False, sim: bool = True) -> argparse.ArgumentParser:
    """The top-level parser; every subcommand sets `func(args) -> int`. ``serve_only`` leaves out the
    installed commands (:func:`installed_commands`), whose modules (the mock engine's web app and
    numpy) a router never needs: `kvrouter serve` starts ~0.5 s sooner and ~25 MB lighter without
    them. ``sim=False`` lists them by name and help only, which is all `kvrouter --help` (or a
    command line with no or an unknown command) shows: ~1 s sooner."""
    parser = _TopParser(prog="kvrouter", description="KV-aware request router for vLLM fleets.")
    sub: argparse._SubParsersAction[Any] = parser.add_subparsers(dest="command", required=True)
    # optional: `serve`'s modules only once the parser is built
    from router import serve

    serve.register(sub)
    if serve_only:
        return parser
    commands = installed_commands()
    for name, ep in commands.items():
        command: Command = ep.load()
        if sim:
            command.register(sub)
        else:
            sub.add_parser(name, help=command.help)
    if not commands:
        parser.epilog = parser.hint = MISSING_COMMANDS_HINT
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"]:
        parser = build_parser(serve_only=True)
    else:
        first = next((w for w in words if not w.startswith("-")), None)  # (the command, if any)
        parser = build_parser(sim=first is not None and first in installed_commands())
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
