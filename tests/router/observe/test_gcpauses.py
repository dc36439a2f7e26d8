"""kvrouter_gc_pause_seconds: every collection of the process timed by generation, while installed;
kvrouter_gc_frozen_objects: what a serving process left out of collections at start-up."""

from __future__ import annotations

import gc
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from harness import wait_for

from router.observe.gcpauses import GcPauses


def _count(p: GcPauses, generation: str) -> float:
    return sum(p.histogram.series[(generation,)][:-1])


def test_collections_are_timed_by_generation_only_while_installed() -> None:
    p = GcPauses()
    assert [_count(p, g) for g in "012"] == [0, 0, 0]  # (exported at zero from the start)
    p.install()
    p.install()  # (idempotent: one callback)
    try:
        gc.collect()
        gc.collect(0)
        assert _count(p, "2") == 1
        assert _count(p, "0") >= 1
        assert p.histogram.series[("2",)][-1] > 0  # (the pause's seconds summed)
    finally:
        p.remove()
    before = [_count(p, g) for g in "012"]
    gc.collect()
    assert [_count(p, g) for g in "012"] == before
    p.remove()  # (idempotent)
    fam = p.histogram.family()
    assert fam.name == "kvrouter_gc_pause_seconds"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _frozen(port: int) -> float | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^kvrouter_gc_frozen_objects (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_a_serving_process_leaves_its_start_up_out_of_collections(tmp_path: Path) -> None:
    """`kvrouter serve` freezes what start-up built before it listens (a full collection later walks
    only what came after: a 13-21 ms pause at 1,024 candidates otherwise); a router inside another
    process, as in the tests, freezes nothing."""
    port = _free_port()
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nlog_level = "warning"\n'
        f'[[backends]]\nname = "a"\nurl = "http://127.0.0.1:{_free_port()}"\nmodels = ["m"]\ndp_size = 4\n'
    )
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
            cwd=Path(__file__).resolve().parents[3],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            up = lambda: _frozen(port) is not None or proc.poll() is not None  # noqa: E731
            wait_for(up, "the router's /metrics", 120)
            frozen = _frozen(port)
            assert frozen is not None and frozen > 10_000, (frozen, (tmp_path / "router.log").read_text())
        finally:
            proc.terminate()
            proc.wait(30)
    assert gc.get_freeze_count() == 0  # (this test process froze nothing)
