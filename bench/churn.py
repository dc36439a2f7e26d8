"""The churn soak: a real `kvrouter serve` while mock-engine processes join, drain and are
SIGKILLed every few seconds under steady client traffic, for ``--minutes`` (default 10). Prints the
report as JSON; the run passes when no request failed other than streams whose engine was killed under
them (which end with a clean error event). See sim/churn.py.

``python bench/churn.py [--minutes 10] [--interval 3] [--clients 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.churn import Churn, ChurnConfig, soak_router  # noqa: E402
from sim.toy_tokenizer import build_toy_tokenizer  # noqa: E402

ADMIN = "soak-admin"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between membership changes")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-engines", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        tok = build_toy_tokenizer(tmp / "tok")
        with soak_router(tmp, ADMIN, str(tok)) as (url, router):
            cfg = ChurnConfig(
                seconds=args.minutes * 60,
                interval_s=args.interval,
                clients=args.clients,
                max_engines=args.max_engines,
                seed=args.seed,
                tokenizer=str(tok),
            )
            report = asyncio.run(Churn(url, ADMIN, cfg).run())
            alive = router.poll() is None
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
    out = report.summary()
    out["router_never_restarted"] = alive
    out["router_membership_changes"] = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvrouter_membership_changes_total{")
    )
    print(json.dumps(out, indent=2))
    return 0 if report.failed == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
