"""Observability against a running router: /metrics exports what Grafana queries, and the built-in
dashboard works in a real headless browser (Debian's chromium driven by Playwright)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from harness import CHROMIUM, IN_CI, FakeEngine, RouterRunner, wait_for
from test_deploy import EXPORTED_METRICS

from sim.toy_tokenizer import build_toy_tokenizer


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterRunner, list[FakeEngine]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    tmp = tmp_path_factory.mktemp("dash")
    tok = build_toy_tokenizer(tmp / "tok")
    engines = [FakeEngine(n, ctx) for n in ("alpha", "beta")]
    toml = f'block_size = 4\ntokenizer = "{tok}"\n' + "\n".join(e.backend_toml() for e in engines)
    router = RouterRunner(toml, tmp)
    try:
        yield router, engines
    finally:
        router.stop()
        for e in engines:
            e.close()
        ctx.term()


def traffic(router: RouterRunner, n: int, stream: bool = False) -> None:
    with httpx.Client(timeout=30) as c:
        for i in range(n):
            body = {
                "model": "toy",
                "prompt": f"request number {i} about ships and harbours",
                "stream": stream,
            }
            assert c.post(f"{router.url}/v1/completions", json=body).status_code == 200


def test_metrics_exports_every_declared_metric(live: tuple[RouterRunner, list[FakeEngine]]) -> None:
    router, engines = live
    engines[0].announce(list(range(10, 42)), 4)
    wait_for(lambda: "kvrouter_index_blocks{" in httpx.get(f"{router.url}/metrics").text, "index metrics")
    traffic(router, 3)
    traffic(router, 2, stream=True)
    text = httpx.get(f"{router.url}/metrics").text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, (kind, labels) in EXPORTED_METRICS.items():
        exported = types.get(name) or types.get(name.removesuffix("_total"))
        assert exported == kind, f"{name}: exported as {exported}"
        sample = re.search(rf"^{re.escape(name)}(?:_bucket|_count)?\{{([^}}]*)\}}", text, re.MULTILINE)
        if sample:  # labelled series present: their label names are the declared ones
            got = {kv.split("=")[0] for kv in sample.group(1).split(",") if kv} - {"le"}
            assert got == set(labels), f"{name}: labels {got} != {set(labels)}"
    assert re.search(
        r'^kvrouter_requests_total\{backend="(alpha|beta)",model="toy",status="2xx"\} [1-9]', text, re.M
    )
    assert "_created" not in text  # no per-series creation timestamps (cardinality)
    assert re.search(r'^kvrouter_kv_source_connected\{source="alpha/dp0"\} 1\.0', text, re.M)


def _browser(p: Any) -> Any:
    assert CHROMIUM is not None, "CI must install chromium"
    return p.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
        ],
    )


def _sync_playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("playwright is not installed")
    return sync_playwright()


def test_the_router_serves_its_dashboard_history_and_windows(
    live: tuple[RouterRunner, list[FakeEngine]],
) -> None:
    """The windows and the history come from the router: a page polling for the first time gets
    them whole, bounded to the samples the router keeps."""
    router, _ = live
    traffic(router, 3)
    data = httpx.get(f"{router.url}/dashboard/data").json()
    hist, win = data["history"], data["windows"]
    assert hist["every_s"] > 0 and hist["samples"], hist
    assert all(a["t"] < b["t"] for a, b in zip(hist["samples"], hist["samples"][1:], strict=False))
    since = win["since_start"]
    assert since["requests"] == data["totals"]["requests"] > 0
    assert since["prompt_tokens"] == data["totals"]["prompt_tokens"]
    assert {b["name"] for b in data["backends"]} == set(since["backends"])
    minute = win["last_minute"]
    assert 0 < minute["seconds"] <= 61 + hist["every_s"]
    assert 0 <= minute["requests"] <= since["requests"]
    sample = hist["samples"][-1]
    assert set(sample["backends"]) == {"alpha", "beta"} and len(sample["backends"]["alpha"]) == 3


@pytest.mark.skipif(not IN_CI and CHROMIUM is None, reason="chromium is not installed (CI installs it)")
def test_a_fresh_page_shows_the_routers_last_minute_and_history_at_once(
    live: tuple[RouterRunner, list[FakeEngine]],
) -> None:
    """The page's first poll renders the router's last-minute figures and shares and charts drawn
    from the router's history: nothing waits for the page to have sampled a minute itself."""
    router, _ = live
    traffic(router, 4)

    def samples() -> list[dict[str, Any]]:
        return list(httpx.get(f"{router.url}/dashboard/data").json()["history"]["samples"])

    # two router samples with traffic between them: a history the charts can draw rates from
    wait_for(lambda: len(samples()) >= 3 and samples()[-1]["requests"] > 0, "router samples", timeout=40)
    errors: list[str] = []
    with _sync_playwright() as p:
        browser = _browser(p)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{router.url}/dashboard?interval=60")  # (one poll within this test)
            page.wait_for_selector("body[data-state=ok]", timeout=30_000)
            page.wait_for_selector("#backends tbody tr[data-backend=beta]", timeout=30_000)
            st = page.evaluate(
                "() => { const s = window.kvrouterDashboard; return {fetches: s.fetches,"
                " routerSamples: s.routerSamples, n: s.history.length, windows: s.last.windows} }"
            )
            assert st["fetches"] == 1, st  # (what follows is the first render)
            assert st["routerSamples"] >= 3 and st["n"] == st["routerSamples"] + 1, st
            minute = st["windows"]["last_minute"]
            shown = page.locator("#fleet-hit-ratio-recent").get_attribute("data-value")
            if minute["hit_ratio"] is None:
                assert shown == ""
            else:
                assert shown and abs(float(shown) - minute["hit_ratio"]) < 1e-9, (shown, minute)
            assert (page.locator("#fleet-hit-ratio-recent").text_content() or "–") != "–" or not minute[
                "prompt_tokens"
            ]
            shares = [
                page.locator(f"#backends tbody tr[data-backend={n}] td[data-field=share]").get_attribute(
                    "data-value"
                )
                for n in ("alpha", "beta")
            ]
            total = sum(b["requests"] for b in minute["backends"].values())
            if total:
                for name, got in zip(("alpha", "beta"), shares, strict=True):
                    assert got and abs(float(got) - minute["backends"][name]["requests"] / total) < 1e-9
            for chart in ("fleet-hit", "decisions"):
                assert page.locator(f"#chart-{chart} svg path").count() > 0, chart
                assert page.locator(f"#chart-{chart} .empty").count() == 0, chart
        finally:
            browser.close()
    assert not errors, errors


@pytest.mark.skipif(not IN_CI and CHROMIUM is None, reason="chromium is not installed (CI installs it)")
def test_dashboard_in_headless_chromium(live: tuple[RouterRunner, list[FakeEngine]]) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("playwright is not installed")
    assert CHROMIUM is not None, "CI must install chromium"
    router, _ = live
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{router.url}/dashboard")
            page.wait_for_selector("body[data-state=ok]", timeout=30_000)
            page.wait_for_selector("#backends tbody tr[data-backend=beta]", timeout=30_000)
            assert page.locator("#backends tbody tr[data-backend]").count() == 2
            assert page.locator("#sources tbody tr[data-source]").count() == 2
            # membership: both backends joined and became ready, shown as the latest changes
            page.wait_for_selector(
                "#membership tbody tr[data-change=ready][data-backend=beta]", timeout=30_000
            )
            assert "ready 2" in (page.locator("#membership-counts").text_content() or "")

            def requests_total() -> float:
                raw = page.locator("#requests-total").get_attribute("data-value")
                return float(raw or 0)

            before = requests_total()
            traffic(router, 4)
            wait_for(lambda: requests_total() >= before + 4, "the page's request count to move", timeout=30)
            page.wait_for_selector("#decisions details.decision", timeout=30_000)
            Path(os.environ.get("KVROUTER_SCREENSHOT", "/tmp/kvrouter-dashboard.png")).parent.mkdir(
                exist_ok=True
            )
            page.screenshot(
                path=os.environ.get("KVROUTER_SCREENSHOT", "/tmp/kvrouter-dashboard.png"), full_page=True
            )
        finally:
            browser.close()
    assert not errors, errors
