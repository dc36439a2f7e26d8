"""`kvrouter demo --pd --quick` end to end: mock engines in their own processes (a decode engine pulls
from a prefill engine in another process), the real router subprocess, every arm on one workload."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.routerproc import router_available

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
    # the arms, each explained under the header, named whole at the head of their progress lines
    legend = "\n  pd-always-kv = 2 prefill + 2 decode engines, every request disaggregated, KV-aware"
    assert legend in proc.stdout, proc.stdout
    assert re.search(r"^  pd-always-kv +\[", proc.stdout, re.M), proc.stdout
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"aggregated", "pd-kv", "pd-always-kv"}
    for r in rows.values():
        assert r["requests"] >= 50 and r["errors"] == 0, r
    always, kv = rows["pd-always-kv"], rows["pd-kv"]
    assert always["skip_ratio"] == 0 and always["prefill_legs"] == always["requests"]
    assert always["fallbacks"] == 0 and kv["fallbacks"] == 0
    assert always["prefill_hit_ratio"] > 0  # the prefill pool's engines served (and cached) prompts
    assert kv["skip_ratio"] > 0  # follow-up turns found their conversation on the decode engine


def test_trace_scenario_scales_the_trace_the_engines_and_the_threshold() -> None:
    """The P/D trace stage (``bench/quality.py --stages pd_traces``) replays a public trace with the
    same scaling on both sides: prompts a simulated token of which stands for ``scale`` real ones,
    engines whose costs and cache are scaled alike, the conditional threshold in real tokens."""
    from sim.pd_demo import PD_THRESHOLD_TOKENS, trace_scenario
    from sim.traces import resolve

    if not all(p.exists() for p in resolve("conversation")):
        pytest.skip("the shared Mooncake trace is not present")
    scn, requests, bound = trace_scenario("conversation", capacity_blocks=64_000, deadline_s=10.0)
    assert scn.token_scale == 32.0  # 512-token trace blocks as 16 tokens
    assert scn.num_gpu_blocks == 64_000 // 32 and not scn.session_mode
    arms = {a.label: a for a in scn.arms}
    assert arms["aggregated"].both == 4
    assert arms["pd-kv"].pd == {"min_uncached_tokens": PD_THRESHOLD_TOKENS // 32}
    assert arms["pd-always-rr"].pd == {"min_uncached_tokens": 0, "prefill_policy": "round_robin"}
    assert (arms["pd-kv"].prefill, arms["pd-kv"].decode) == (2, 2)
    # every request arrives within the deadline (at the replay's speed) and fits an engine
    assert requests and all(r.at_s / scn.speedup <= 10.0 for r in requests)
    assert all(len(r.prompt_token_ids or []) + r.max_tokens <= scn.num_gpu_blocks * 16 for r in requests)
    assert 0.0 < bound < 1.0  # requests share prefixes, and not all of them


def test_the_arm_names_fit_a_progress_line_whole() -> None:
    """ "P/D always, round-robin" was cut to "P/D always, r" at the head of its progress line, and its
    comma split it in the header's comma-separated list of arms."""
    import io

    from sim.pd_demo import ARMS
    from sim.routerproc import ProgressLine

    for arm in ARMS:
        assert re.fullmatch(r"[a-z][a-z-]*", arm.label), arm.label
        out = io.StringIO()
        bar = ProgressLine(arm.label, 10, out)
        bar.update(10)
        assert re.match(rf"  {arm.label} +\[#+\]", out.getvalue()), out.getvalue()
        assert arm.describe().startswith(f"{arm.label} = ")
    assert [a.describe() for a in ARMS][-1] == (
        "pd-always-rr = 2 prefill + 2 decode engines, every request disaggregated, "
        "round-robin prefill placement"
    )
