"""The layering of index/, router/ and sim/: floors, every import arrow pointing down.

Each module belongs to one room (the longest dotted prefix below that names it); rooms stand on
floors. A module may import anything on a lower floor and anything in its own room (acyclic), never
a room on its own floor (sideways) or above. An import inside a function body hides the real graph,
so one is allowed only with a ``# optional: <reason>`` comment on its line or above its run of
import lines (a
dependency that is optional, or one a start must not pay for). TYPE_CHECKING imports are edges like
any other. The floors are declared here once and drawn in router/README.md.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("index", "router", "sim")
ACYCLIC = ("router", "sim")
"""Packages in which no two modules may import each other, even through others."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("index",),  # the prefix index (its own modules: index/README.md)
    ("router.net",),  # transport with no knowledge of routing
    ("router.errors",),  # the API's OpenAI-shaped errors
    # the parts config.py and every room share: loads, breakers, metric families, checks, the
    # policy's scoring (a decision's record, the compiled kernel), the text-segment cache, the
    # cluster's and P/D's own configs
    (
        "router.parts",
        "router.fleet.load",
        "router.fleet.breaker",
        "router.observe.exposition",
        "router.observe.checks",
        "router.decision.segments",
        "router.decision._kernel",
        "router.decision.record",
        "router.decision.policy",
        "router.cluster.config",
        "router.pd.config",
        "router.flow.config",
    ),
    ("router.config",),  # the typed config
    ("router.fleet",),  # members, health, load, their sources
    ("router.observe",),  # metrics and the dashboard
    ("router.cluster",),  # router replicas: session pins, shared load
    ("router.decision",),  # one decision for the proxy and /route
    ("router.pd",),  # prefill/decode exchange
    ("router.flow",),  # flow control: saturation, fair admission queues
    ("router.proxy", "router.epp"),  # a decision served: proxied, or told to a gateway (ext_proc)
    ("router.workers",),  # several router processes on one port
    ("router.frontend",),  # Endpoints: what a front end may ask of the router
    ("router.app",),  # KVRouter composes everything below
    ("router.http",),  # the front ends, over router.frontend.Endpoints
    ("router.serve",),  # `kvrouter serve`: builds a router and its server, or the workers
    ("router.cli", "router.__main__", "router"),  # the `kvrouter` command
    ("sim",),  # the simulated fleet and its commands (found through an entry point)
)
"""Bottom to top. ``router.parts`` names the modules on the parts floor as one room: they may
import each other (acyclic), as fleet.load <- decision.policy <- pd.config do."""

PARTS = "router.parts"


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool
    reason: bool


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: Sequence[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(root, path)] = path
        for stub in sorted((root / package).rglob("*.pyi")):  # (a compiled module: its stub)
            found.setdefault(module_name(root, stub), stub)
    return found


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([*base, *([node.module] if node.module else [])])
    else:
        module = node.module or ""
    out = []
    for alias in node.names:
        full = f"{module}.{alias.name}"
        out.append(full if full in known else module)
    return out


def _reasoned(lines: list[str], line: int) -> bool:
    """A ``# optional:`` reason on the import's line, or alone on the line above it or above the run
    of import lines it belongs to."""
    if "# optional:" in lines[line - 1]:
        return True
    at = line - 2
    while at >= 0 and lines[at].lstrip().startswith(("import ", "from ")):
        at -= 1
    return at >= 0 and lines[at].strip().startswith("# optional:")


def _walk(
    node: ast.AST,
    in_function: bool,
    name: str,
    is_package: bool,
    known: set[str],
    lines: list[str],
    out: list[Import],
) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in dict.fromkeys(_targets(child, name, is_package, known)):
                out.append(Import(name, target, child.lineno, in_function, _reasoned(lines, child.lineno)))
        else:
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            _walk(child, inside, name, is_package, known, lines, out)


def imports(root: Path, packages: Sequence[str]) -> tuple[dict[str, Path], list[Import]]:
    """Every import in the modules of ``packages`` (inside function bodies and TYPE_CHECKING too)."""
    found = modules(root, packages)
    known = set(found)
    out: list[Import] = []
    for name, path in found.items():
        text = path.read_text()
        _walk(
            ast.parse(text, str(path)), False, name, path.name == "__init__.py", known, text.splitlines(), out
        )
    return found, out


def room_of(module: str, floors: Sequence[Sequence[str]]) -> tuple[str, int] | None:
    """The room that names ``module`` most specifically, and its floor; None: not on any floor."""
    best: tuple[str, int] | None = None
    for level, rooms in enumerate(floors):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (
                best is None or len(room) > len(best[0])
            ):
                best = (room, level)
    return best


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(
    root: Path,
    packages: Sequence[str],
    floors: Sequence[Sequence[str]],
    acyclic: Iterable[str],
    parts: str = PARTS,
) -> list[str]:
    """What breaks the layering of ``packages`` under ``root``: one line per problem."""
    found, edges = imports(root, packages)
    problems: list[str] = []
    parts_floor = room_of(parts, floors)
    graph: dict[str, set[str]] = {}
    for name in found:
        if room_of(name, floors) is None:
            problems.append(f"{name}: on no floor")
    for imp in edges:
        where = f"{imp.source}:{imp.line}"
        if imp.in_function and not imp.reason:
            problems.append(
                f"{where}: imports {imp.target} in a function body without '# optional: <reason>'"
            )
        if imp.target.split(".")[0] not in packages:
            continue
        graph.setdefault(imp.source, set()).add(imp.target)
        src, dst = room_of(imp.source, floors), room_of(imp.target, floors)
        if src is None or dst is None:
            continue
        if parts_floor is not None:  # (the parts floor is one room)
            src = (parts, src[1]) if src[1] == parts_floor[1] else src
            dst = (parts, dst[1]) if dst[1] == parts_floor[1] else dst
        if dst[1] > src[1]:
            problems.append(f"{where}: imports {imp.target} from a floor above ({dst[0]} over {src[0]})")
        elif dst[1] == src[1] and dst[0] != src[0]:
            problems.append(f"{where}: imports {imp.target} sideways ({dst[0]} beside {src[0]})")
    roots = tuple(acyclic)
    inner = {
        s: {t for t in ts if t.split(".")[0] == s.split(".")[0]}
        for s, ts in graph.items()
        if s.split(".")[0] in roots
    }
    for cycle in _cycles(inner):
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def test_index_router_and_sim_are_layered() -> None:
    problems = violations(ROOT, PACKAGES, FLOORS, ACYCLIC)
    assert not problems, "\n".join(problems)


def test_the_floors_are_drawn_in_the_router_readme() -> None:
    """router/README.md draws the floors declared here: every router room, in the same order."""
    text = (ROOT / "router" / "README.md").read_text()
    picture = text.split("```", 2)[1]
    floors = [
        [room for room in rooms if room.startswith("router.") and room not in (PARTS, "router.__main__")]
        for rooms in FLOORS
    ]
    floors = [rooms for rooms in floors if rooms]
    shown = {room: picture.find(_drawn(room)) for rooms in floors for room in rooms}
    missing = [room for room, at in shown.items() if at < 0]
    assert not missing, missing
    line = {room: picture[:at].count("\n") for room, at in shown.items()}
    # drawn top to bottom: every room of a floor on a line above (or on) every room of the floor below
    for lower, upper in itertools.pairwise(floors):
        assert max(line[r] for r in upper) <= min(line[r] for r in lower), (lower, upper)


def _drawn(room: str) -> str:
    name = room.removeprefix("router.")
    if name in ("app", "config", "errors", "proxy", "frontend", "serve", "cli"):
        return f"{name}.py"
    if "." in name:
        return name.replace(".", "/") + ("" if name.rpartition(".")[2].startswith("_") else ".py")
    return f"{name}/"


def _package(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp


TINY_FLOORS = (("pkg.low",), ("pkg.high",))


def test_the_checker_passes_a_layered_package(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "X = 1\n",
            "pkg/low/b.py": "from pkg.low.a import X\n",
            "pkg/high/__init__.py": "",
            "pkg/high/c.py": (
                "from pkg.low import a\n"
                "def f():\n"
                "    # optional: a heavy dependency only this needs\n"
                "    import json\n"
                "    return json, a\n"
            ),
        },
    )
    assert violations(root, ("pkg",), (*TINY_FLOORS, ("pkg",)), ("pkg",)) == []


def test_the_checker_fails_an_upward_import_a_cycle_and_a_hidden_import(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "from pkg.high.c import Y\n",
            "pkg/low/b.py": "from . import d\n",
            "pkg/low/d.py": "from pkg.low import b\n",
            "pkg/high/__init__.py": "",
            "pkg/high/c.py": "Y = 2\ndef f():\n    from pkg.low import a\n    return a\n",
        },
    )
    problems = violations(root, ("pkg",), (*TINY_FLOORS, ("pkg",)), ("pkg",))
    assert any(p.startswith("pkg.low.a:1: imports pkg.high.c from a floor above") for p in problems), problems
    assert "import cycle: pkg.low.b -> pkg.low.d" in problems, problems
    assert any(p.startswith("pkg.high.c:3: imports pkg.low.a in a function body") for p in problems), problems
    assert any("import cycle: pkg.high.c -> pkg.low.a" in p for p in problems), problems
    assert len(problems) == 4, problems


def test_the_checker_fails_a_sideways_import_and_a_module_on_no_floor(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/left.py": "from pkg.right import Z\n",
            "pkg/right.py": "Z = 3\n",
            "pkg/stray.py": "",
        },
    )
    floors = (("pkg.left", "pkg.right"), ("pkg",))
    problems = violations(root, ("pkg",), floors, ("pkg",))
    assert problems == ["pkg.left:1: imports pkg.right sideways (pkg.right beside pkg.left)"], problems
    assert violations(root, ("pkg",), (("pkg.left", "pkg.right"),), ()) == [
        "pkg: on no floor",
        "pkg.stray: on no floor",
        "pkg.left:1: imports pkg.right sideways (pkg.right beside pkg.left)",
    ]
