"""`kvrouter demo --quick` end to end: mock fleet + the real router subprocess, once per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.decision.policy import POLICIES
from sim.demo import router_available

WHY = router_available()


@pytest.mark.timeout(240)
@pytest.mark.skipif(WHY is not None, reason=f"kvrouter demo needs router/serve.py and router/app.py: {WHY}")
def test_quick_demo_prints_the_table_and_kv_wins(tmp_path: Path) -> None:
    out_json = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "hit ratio" in out and "TTFT p50" in out
    assert "/dashboard" in out
    table = out[out.index("policy  ") :]
    for name in POLICIES:
        assert f"\n{name} " in table, table
    rows = {r["policy"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == set(POLICIES)
    for r in rows.values():
        assert r["requests"] >= 50 and r["errors"] == 0  # the small end-to-end fleet test
    assert rows["kv"]["hit_ratio"] > rows["round_robin"]["hit_ratio"], rows
