"""The dashboard history's windows and bounds, on snapshots built by hand (the served JSON and the
page are tested against a running router in tests/router/observe/test_dashboard.py)."""

from __future__ import annotations

from typing import Any

from router.observe.history import DashboardHistory


def snap(t: float, uptime: float, requests: int, prompt: int, matched: int, alpha: int) -> dict[str, Any]:
    return {
        "time": t,
        "uptime_s": uptime,
        "totals": {"requests": requests, "errors": 0, "prompt_tokens": prompt, "matched_tokens": matched},
        "backends": [
            {"name": "alpha", "requests": alpha, "prompt_tokens": 0, "matched_tokens": 0, "ranks": []},
            {
                "name": "beta",
                "requests": requests - alpha,
                "prompt_tokens": 0,
                "matched_tokens": 0,
                "ranks": [],
            },
        ],
        "sources": [{"source": "alpha/dp0", "gaps": 1}],
    }


def test_last_minute_is_counted_from_the_sample_a_minute_back() -> None:
    h = DashboardHistory(every_s=5.0, keep_s=900.0)
    for i in range(30):  # 150 s: 100 prompt tokens, all missed, for 2 minutes; then hits
        t = 1000.0 + 5 * i
        prompt = 100 * i
        matched = 0 if i <= 18 else 90 * (i - 18)
        h.record(snap(t, 5 * i, i, prompt, matched, alpha=i // 2))
    now = snap(1150.0, 150.0, 30, 3000, 90 * 12, alpha=15)
    w = h.windows(now)
    minute, since = w["last_minute"], w["since_start"]
    assert minute["seconds"] == 60.0  # (the sample at t = 1090)
    assert minute["prompt_tokens"] == 3000 - 1800 and minute["matched_tokens"] == 90 * 12
    assert minute["hit_ratio"] == 1080 / 1200
    assert since["seconds"] == 150.0 and since["hit_ratio"] == 1080 / 3000
    assert minute["backends"] == {"alpha": {"requests": 15 - 9}, "beta": {"requests": 15 - 9}}
    assert minute["requests"] == 30 - 18


def test_a_router_younger_than_a_minute_counts_from_its_start() -> None:
    h = DashboardHistory()
    h.record(snap(1000.0, 0.0, 0, 0, 0, 0))
    w = h.windows(snap(1020.0, 20.0, 4, 40, 10, 1))
    assert w["last_minute"] == w["since_start"]
    assert w["last_minute"]["seconds"] == 20.0 and w["last_minute"]["hit_ratio"] == 0.25
    assert h.windows(snap(1020.0, 20.0, 0, 0, 0, 0))["last_minute"]["hit_ratio"] is None


def test_the_history_is_bounded_and_ordered() -> None:
    h = DashboardHistory(every_s=5.0, keep_s=60.0)
    for i in range(100):
        h.record(snap(1000.0 + 5 * i, 5 * i, i, i, 0, 0))
    h.record(snap(1000.0, 0.0, 0, 0, 0, 0))  # (out of order: ignored)
    samples = h.attach(snap(1500.0, 500.0, 100, 100, 0, 0))["history"]["samples"]
    assert len(samples) == 13
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert samples[-1]["backends"]["alpha"] == [0, 0, 0]
    assert samples[-1]["sources"]["alpha/dp0"][0] == 1
