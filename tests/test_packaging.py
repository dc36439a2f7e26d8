"""Packaging that tells the truth: the router's wheel holds the router and its index, not the simulated
fleet; its dependencies are exactly what router/ and index/ import; and a router installed without
kvrouter-sim and without sim's extra dependency (httpx) imports, serves its help, and says
how to get the simulation commands, which kvrouter-sim's wheel then adds through its entry points.

The wheels are built for real from a copy of the sources (``pip wheel --no-build-isolation``, the C
core compiled: ~10 s on a loaded 2-core box) and installed with ``pip install --no-deps --target``
into a fresh ``python -m venv --without-pip``, whose only other packages are links to this venv's,
less httpx and anything of kvrouter's own."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SIM_ONLY = ("httpx",)
"""What only sim/ (and the kubernetes watch's lazy import) needs: absent from the fresh venv."""


def _name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(0)).lower()


def _imports(package: str) -> dict[str, bool]:
    """Top-level module -> imported at module level somewhere (else only inside functions), for
    every import in ``package`` (``if TYPE_CHECKING`` blocks left out: never run)."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other, top)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                root = name.split(".")[0]
                found[root] = found.get(root, False) or top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    for path in (ROOT / package).rglob("*.py"):
        # router/epp is a feature package imported only when [epp] is on (router.app): its own
        # module-level imports of the epp extra run only then
        visit(ast.parse(path.read_text(), str(path)), LAZY not in path.relative_to(ROOT).parents)
    return found


LAZY = Path("router/epp")


def test_the_dependencies_are_exactly_what_the_router_and_index_import() -> None:
    """Every distribution router/ and index/ import is declared, and every declared one is imported
    (an extra's only inside functions: the feature imports it when it is turned on).
    sortedcontainers (imported nowhere) and httpx (sim/ and tests only) were hard dependencies;
    uvicorn is one, since `kvrouter serve` runs on it."""
    own = {"router", "index", "sim"}
    modules: dict[str, bool] = {}
    for package in ("router", "index"):
        for root, top in _imports(package).items():
            modules[root] = modules.get(root, False) or top
    third_party = {m: top for m, top in modules.items() if m not in sys.stdlib_module_names and m not in own}
    assert "sim" not in modules, "router/ or index/ imports sim/"
    project = PYPROJECT["project"]
    core = {_name(r) for r in project["dependencies"]}
    kubernetes = {_name(r) for r in project["optional-dependencies"]["kubernetes"]}
    kubernetes |= {_name(r) for r in project["optional-dependencies"]["epp"]}
    dists = packages_distributions()
    used: dict[str, bool] = {}  # declared distribution -> imported at module level
    for module, top in third_party.items():
        # (a module several distributions install, e.g. lightkube and lightkube-models: one declared)
        declared = {_name(d) for d in dists.get(module, [])} & (core | kubernetes)
        assert declared, f"{module}: imported by the router, declared by no dependency or extra"
        for dist in declared:
            used[dist] = used.get(dist, False) or top
    assert set(used) == core | kubernetes, (sorted(used), sorted(core), sorted(kubernetes))
    assert {d for d in kubernetes if used[d]} == set(), "the kubernetes or epp extra imported at start-up"
    assert not modules_importing_epp_at_top(), "router.epp imported at module level outside router/epp"
    assert not {_name(r) for r in project["optional-dependencies"]["sim"]} & core


def modules_importing_epp_at_top() -> list[str]:
    """Modules outside router/epp that import it at module level (it needs the epp extra)."""
    out = []
    for path in (ROOT / "router").rglob("*.py"):
        if LAZY in path.relative_to(ROOT).parents:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("router.epp"):
                out.append(str(path.relative_to(ROOT)))
    return out


def _copy_sources(dest: Path) -> None:
    """What the wheels are built from, as a fresh clone has it (no build products, no venv)."""
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for package in ("index", "router", "sim"):
        shutil.copytree(ROOT / package, dest / package, ignore=skip)


def _venv_without(tmp: Path, leave_out: tuple[str, ...]) -> Path:
    """A fresh venv (no pip) seeing this venv's packages through symlinks, less ``leave_out`` and
    kvrouter's own (the editable installs); returns its python."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = tmp / "site"
    site.mkdir()
    ours = re.compile(r"(__editable__|_*kvrouter)", re.I)
    gone = re.compile(rf"^({'|'.join(leave_out)})([-_.].*)?$", re.I)
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not ours.match(entry.name) and not gone.match(entry.name) and entry.suffix != ".pth":
            (site / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "others.pth").write_text(f"{site}\n")
    return python


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


FRESH_SCRIPT = r"""
import contextlib, importlib, io, pkgutil, sys
import router, index
for package in (router, index):  # every module, as a router imports it (kubernetes: lightkube lazily)
    for mod in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(mod.name)
import router.app
from router.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--help"])
if sys.argv[1:] == ["refuse"]:  # (a simulation command, when none is installed)
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        main(["demo"])
print(repr(out.getvalue()))
print(repr(err.getvalue()))
print(sorted(m for m in ("httpx", "sim", "sortedcontainers") if m in sys.modules))
print(repr(router.__file__))
"""


@pytest.mark.timeout(300)
def test_the_router_wheel_installs_and_runs_without_sim_or_its_dependencies(tmp_path: Path) -> None:
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    src.mkdir()
    _copy_sources(src)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src), str(src / "sim"))
    router_whl = next(wheels.glob("kvrouter-*.whl"))
    sim_whl = next(wheels.glob("kvrouter_sim-*.whl"))
    with zipfile.ZipFile(router_whl) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")))
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"router", "index"}, tops
    assert b"kvrouter = router.cli:main" in entry_points and b"kvrouter.commands" not in entry_points
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    hard = [r for r in requires if "extra ==" not in r]
    assert not [r for r in hard if re.search(r"\b(httpx|sortedcontainers)\b", r)], hard
    assert [r for r in hard if re.search(r"\buvicorn\b", r)], hard  # (what `kvrouter serve` runs on)
    with zipfile.ZipFile(sim_whl) as z:
        sim_tops = {n.split("/")[0] for n in z.namelist()}
        sim_eps = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {t for t in sim_tops if not t.endswith(".dist-info")} == {"sim"}, sim_tops
    assert "[kvrouter.commands]" in sim_eps and "mock-engine = sim.commands:MOCK_ENGINE" in sim_eps

    python = _venv_without(tmp_path, (*SIM_ONLY, "sortedcontainers"))
    target = python.parent.parent / "installed"
    _pip("install", "--no-deps", "--target", str(target), str(router_whl))
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"}

    def fresh(*args: str) -> list[Any]:
        proc = subprocess.run(
            [str(python), "-c", FRESH_SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [ast.literal_eval(line) for line in proc.stdout.splitlines()]

    helped, refused, loaded, where = fresh("refuse")
    assert where.startswith(str(target)), where  # (the installed wheel, not this checkout)
    assert loaded == [], loaded
    assert "{serve}" in helped, helped  # (the only command)
    assert "come with kvrouter-sim, from a checkout `pip install -e ./sim`" in " ".join(helped.split())
    assert "invalid choice: 'demo'" in refused and "kvrouter-sim" in refused, refused

    _pip("install", "--no-deps", "--target", str(target), str(sim_whl))
    helped, _, loaded, _ = fresh()
    assert loaded == ["sim"], loaded  # (its command list only: sim.commands, no httpx)
    for command in ("mock-engine", "demo", "bench"):
        assert re.search(rf"^\s+{command}\s+\S", helped, re.M), helped
    assert "kvrouter-sim" not in helped, helped
