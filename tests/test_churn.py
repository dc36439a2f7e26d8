"""Pod churn under load, short version (the 10-minute soak is `bench/churn.py`, BENCHMARKS.md).

A real `kvrouter serve` process, mock engines as real processes that join through the admin API,
drain, or are SIGKILLed, and steady client traffic (chat and completions, streaming and not). Every
request must end complete, except streams whose engine was killed under them, which must end with a
clean error event.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from harness import wait_for

from sim.churn import Churn, ChurnConfig, write_router_config

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "churn-admin"


def test_pod_churn_under_load_fails_no_request(tmp_path: Path, tokdir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg_path = tmp_path / "router.toml"
    write_router_config(cfg_path, port, ADMIN, str(tokdir))
    log = (tmp_path / "router.log").open("wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, "router start", timeout=120)
        cfg = ChurnConfig(
            seconds=20,
            interval_s=1.5,
            min_engines=2,
            max_engines=4,
            clients=3,
            tokenizer=str(tokdir),
            pattern=["join", "vanish", "join", "drain"],
        )
        report = asyncio.run(Churn(url, ADMIN, cfg).run())
        summary = report.summary()
        print(summary)
        assert report.failed == 0, summary
        assert report.ok > 100 and report.joins >= 3 and report.drains >= 1 and report.vanishes >= 1, summary
        assert len(report.served_by) >= 3, summary  # joiners did take traffic
        assert router.poll() is None  # never restarted
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(60)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)
        log.close()
