"""The chaos soak: `make soak` runs it for 10 minutes (bounded), writes bench/out/soak/report.json
and plot.svg, prints the summary and exits 0 only when every invariant held. See sim/chaos.py.

``python bench/soak.py [--minutes 10] [--out bench/out/soak] [--interval 12] [--flow]``

``--flow`` adds the flow-control lane (sim/chaos.py): ``[flow]`` on, offered load over capacity,
clients that hang up while queued.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.chaos import Soak, SoakConfig, write_report  # noqa: E402
from sim.toy_tokenizer import build_toy_tokenizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=12.0, help="seconds between faults")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "soak"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flow", action="store_true", help="add the flow-control lane ([flow] on, overload)")
    ap.add_argument("--flow-clients", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = SoakConfig(
            seconds=args.minutes * 60,
            fault_interval_s=args.interval,
            engines=args.engines,
            clients=args.clients,
            seed=args.seed,
            flow=args.flow,
            flow_clients=args.flow_clients,
            tokenizer=str(build_toy_tokenizer(work / "tok")),
        )
        report = asyncio.run(Soak(cfg, work).run())
        summary = write_report(report, cfg, Path(args.out))
    print(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
