"""`make bench`: every benchmark of docs/benchmarks/, one after the other (never two heavy jobs at once on
the 2-core box). ``--quick`` runs the short variants; ``--only service,index,router,quality`` picks
some (also pd, membership, churn, replicas).

Each benchmark prints its own figures; this script only sequences them and stops at the first
failure. The service benchmark compares with Dynamo's indexer when ``--dynamo`` names the python of
a venv holding ``ai-dynamo-runtime==1.6.1`` (skipped with a message otherwise), and times the
container image's start when ``--container`` gives the command that runs it; the router benchmark
needs ``wrk`` (skipped with a message when it is missing).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="short variants (minutes instead of tens)")
    ap.add_argument(
        "--only",
        default="service,index,router,pd,quality,membership,churn,replicas",
        help="comma-separated subset",
    )
    ap.add_argument("--vllm-router", default=None, help="a vllm-router binary to measure in the same run")
    ap.add_argument("--dynamo", default=None, help="python of a venv with ai-dynamo-runtime==1.6.1")
    ap.add_argument(
        "--container",
        default=None,
        help="the service benchmark also times new containers of the image this command runs "
        "({config} for the fleet file; see bench/service_bench.py)",
    )
    ap.add_argument(
        "--service-args",
        default="",
        help="more arguments for bench/service_bench.py, as one string given with '=' (the published "
        "runs: --service-args='--lookups 300 --startup-rounds 9 --kvrouter VENV/bin/kvrouter --json F')",
    )
    args = ap.parse_args()
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    py = sys.executable
    plan: list[tuple[str, list[str]]] = []
    if "service" in wanted:
        cmd = [py, "bench/service_bench.py", *(["--quick"] if args.quick else [])]
        cmd += ["--dynamo", args.dynamo] if args.dynamo else []
        cmd += ["--container", args.container] if args.container else []
        cmd += shlex.split(args.service_args)
        plan.append(("service", cmd))
        quick = ["--blocks", "200000"] if args.quick else []
        plan.append(("remove", [py, "bench/remove_bench.py", *quick]))
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
        plan.append(("pd ceiling", [py, "bench/pd_ceiling.py"]))  # what prefill placement can gain at most
    if "quality" in wanted:
        plan.append(("quality", [py, "bench/quality.py", *(["--quick"] if args.quick else [])]))
    if "membership" in wanted:
        plan.append(("membership", [py, "bench/membership_bench.py", *(["--quick"] if args.quick else [])]))
    if "churn" in wanted:
        plan.append(("churn", [py, "bench/churn.py", "--minutes", "1" if args.quick else "10"]))
    if "replicas" in wanted:  # router replicas over Redis (needs redis-server)
        if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
            print("replica benchmarks skipped: redis-server is not installed", file=sys.stderr)
        else:
            plan.append(("store client", [py, "bench/store_client.py"]))
            plan.append(("replicas", [py, "bench/replicas.py", *(["--quick"] if args.quick else [])]))
    for name, cmd in plan:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            print(f"== {name} failed with status {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
