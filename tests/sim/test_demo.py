"""`kvrouter demo --quick` end to end: mock fleet + the real router subprocess, once per policy."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from envoy_harness import BINARY, envoy_binary

from router.decision.policy import POLICIES
from sim.routerproc import router_available

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
    assert "`make demo DEMO_ARGS=--keep`) leaves the last policy's fleet and router up" in out, out
    assert "\nspread tok / req: the busiest engine's prompt tokens / requests over the mean" in out, out
    table = out[out.index("policy  ") :]
    for name in POLICIES:
        assert f"\n{name} " in table, table
    rows = {r["policy"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == set(POLICIES)
    for r in rows.values():
        assert r["requests"] >= 50 and r["errors"] == 0  # the small end-to-end fleet test
    assert rows["kv"]["hit_ratio"] > rows["round_robin"]["hit_ratio"], rows


@pytest.mark.timeout(240)
@pytest.mark.skipif(WHY is not None, reason=f"kvrouter demo needs router/serve.py and router/app.py: {WHY}")
def test_quick_demo_behind_a_real_envoy(tmp_path: Path) -> None:
    """``--gateway``: the same workload through a real Envoy, first with its own round robin, then
    with the router as its endpoint picker (ext_proc); every request answered through Envoy, and
    the picker's routing keeps more of the prompts cached than Envoy's round robin."""
    envoy_binary()  # (skips without Envoy outside CI, fails in CI)
    out_json = tmp_path / "demo.json"
    env = dict(os.environ, KVROUTER_ENVOY_VENV=str(BINARY.parent.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--quick", "--gateway", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "behind Envoy" in out and "the router its endpoint picker" in out, out
    assert "Envoy's own round robin at http://127.0.0.1:" in out, out
    assert "through Envoy, kvrouter as its endpoint picker served" in out, out
    rows = {r["policy"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"envoy_rr", "kv+envoy"}
    for r in rows.values():
        assert r["requests"] >= 50 and r["errors"] == 0, rows
    assert rows["kv+envoy"]["hit_ratio"] > rows["envoy_rr"]["hit_ratio"], rows


def test_demo_gateway_says_what_it_needs(tmp_path: Path) -> None:
    """Without Envoy, ``--gateway`` stops before starting anything and says how to install it."""
    env = dict(os.environ, KVROUTER_ENVOY_VENV=str(tmp_path / "no-envoy"))
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--quick", "--gateway"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tests/envoy/install.sh" in proc.stderr and "make demo-gateway" in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.skipif(WHY is not None, reason=f"kvrouter demo needs router/serve.py and router/app.py: {WHY}")
def test_demo_keep_leaves_the_last_fleet_and_router_up_until_ctrl_c() -> None:
    """Each policy's router lives for its run only, on a port of its own, so the dashboard URLs the
    demo printed were dead by the time a newcomer opened one. --keep leaves the last one up, its URL
    printed at the end, until Ctrl-C (SIGINT), which then stops the router and the engines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "demo", "--quick", "--policies", "kv", "--keep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # (its own process group: killed whole if the test fails)
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 200
        while not any(line.startswith("  why there:") for line in seen):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(seen)
            seen.append(line)
        text = "".join(seen)
        took = next(line for line in seen if line.startswith("(demo took"))
        assert "--keep" not in took, took  # (the hint to use it is for runs without it)
        url = re.search(r"kept up \(--keep\): kv's fleet and router at (http://127\.0\.0\.1:\d+)", text)
        assert url, text
        client = openai.OpenAI(base_url=url[1] + "/v1", api_key="none", max_retries=0, timeout=30)
        answer = client.completions.create(model="toy-model", prompt="hello", max_tokens=4)
        assert answer.choices[0].text and answer.usage is not None and answer.usage.prompt_tokens > 0
        assert httpx.get(url[1] + "/dashboard", timeout=30).status_code == 200
        assert proc.poll() is None  # still up after the table
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        assert code == 130, code
        with pytest.raises(httpx.ConnectError):  # the router is gone with the demo
            httpx.get(url[1] + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        ([], 2, "tests/vllm/install.sh"),
        (["--kv-groups", "mistral"], 1, "the real engines' tiny models are llama, gemma3, qwen3_next"),
        (["--pd"], 2, "--pd runs mock engines only"),
    ],
)
def test_demo_vllm_refuses_what_it_cannot_run_and_says_why(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    """Without the vLLM venv (it lives outside the checkout), with a model it has no tiny real
    counterpart of, or with --pd: a message and a non-zero exit before anything is started."""
    missing = tmp_path / "no-venv"
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--vllm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVROUTER_VLLM_VENV": str(missing)},
    )
    assert (proc.returncode, says in proc.stderr) == (code, True), proc.stderr
    if not args:
        assert f"no vLLM venv at {missing}" in proc.stderr, proc.stderr
    assert not missing.exists()
