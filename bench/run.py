"""`make bench`: every benchmark in BENCHMARKS.md, one after the other (never two heavy jobs at once on
the 2-core box). ``--quick`` runs the short variants; ``--only index,router,pd,quality`` picks some.

Each benchmark prints its own figures; this script only sequences them and stops at the first
failure. The router benchmark needs ``wrk`` (skipped with a message when it is missing).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short variants (minutes instead of tens)")
    ap.add_argument("--only", default="index,router,pd,quality", help="comma-separated subset")
    ap.add_argument("--vllm-router", default=None, help="a vllm-router binary to measure in the same run")
    args = ap.parse_args()
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    py = sys.executable
    plan: list[tuple[str, list[str]]] = []
    if "index" in wanted:
        plan.append(("index", [py, "bench/index_bench.py", *(["--quick"] if args.quick else [])]))
    if "router" in wanted:
        if shutil.which("wrk") is None:
            print("router benchmark skipped: wrk is not installed (apt-get install wrk)", file=sys.stderr)
        else:
            cmd = [py, "bench/router_bench.py"]
            cmd += ["--seconds", "4", "--ttft-requests", "100"] if args.quick else []
            cmd += ["--vllm-router", args.vllm_router] if args.vllm_router else []
            plan.append(("router", cmd))
    if "pd" in wanted:  # the P/D path's added TTFT (the live P/D scenario is quality.py's pd stage)
        plan.append(("pd", [py, "bench/pd_bench.py", *(["--requests", "100"] if args.quick else [])]))
    if "quality" in wanted:
        plan.append(("quality", [py, "bench/quality.py", *(["--quick"] if args.quick else [])]))
    for name, cmd in plan:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            print(f"== {name} failed with status {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
