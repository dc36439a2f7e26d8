"""`kvrouter demo --pd --quick` end to end: mock engines in their own processes (a decode engine pulls
from a prefill engine in another process), the real router subprocess, every arm on one workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.demo import router_available

WHY = router_available()


@pytest.mark.timeout(300)
@pytest.mark.skipif(WHY is not None, reason=f"kvrouter demo needs the router: {WHY}")
def test_quick_pd_demo(tmp_path: Path) -> None:
    out_json = tmp_path / "pd.json"
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--pd", "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hit prefill pool" in proc.stdout and "follow-up p50" in proc.stdout
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"aggregated", "P/D kv", "P/D always"}
    for r in rows.values():
        assert r["requests"] >= 50 and r["errors"] == 0, r
    always, kv = rows["P/D always"], rows["P/D kv"]
    assert always["skip_ratio"] == 0 and always["prefill_legs"] == always["requests"]
    assert always["fallbacks"] == 0 and kv["fallbacks"] == 0
    assert always["prefill_hit_ratio"] > 0  # the prefill pool's engines served (and cached) prompts
    assert kv["skip_ratio"] > 0  # follow-up turns found their conversation on the decode engine
