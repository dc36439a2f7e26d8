"""Pod churn under load, short version (the 10-minute soak is `bench/churn.py`).

A real `kvrouter serve` process, mock engines as real processes that join through the admin API,
drain, or are SIGKILLed, and steady client traffic (chat and completions, streaming and not). Every
request must end complete, except streams whose engine was killed under them, which must end with a
clean error event.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sim.churn import Churn, ChurnConfig, soak_router

ADMIN = "churn-admin"


def test_pod_churn_under_load_fails_no_request(tmp_path: Path, tokdir: Path) -> None:
    with soak_router(tmp_path, ADMIN, str(tokdir)) as (url, router):
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
