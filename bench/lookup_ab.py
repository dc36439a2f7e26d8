"""Two kvrouter builds and Dynamo's indexer side by side in one run: the lookup latency phase of
bench/service_bench.py (its stream, placements and client) with a third service.

Why: the service benchmark compares kvrouter with Dynamo, and the box's noise moves both between runs
by more than a change to kvrouter's request path; measured in the same run, against the same
stream, an old and a new build differ by the change alone. The services
take turns as in the service benchmark (A, B, Dynamo, then Dynamo, B, A), so B always runs between
the other two: swap --a and --b to see that the order does not decide a difference.

    .venv/bin/python bench/lookup_ab.py --a OLD_VENV/bin/kvrouter --b NEW_VENV/bin/kvrouter \\
        --dynamo DYNAMO_VENV/bin/python [--lookups 300] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import service_bench as sb

ROWS = ("1k hit", "1k half", "1k miss", "8k hit", "8k miss", "32k hit", "health p50_ms")


def run(a: str, b: str, dynamo: str, lookups: int) -> dict[str, Any]:
    """The latency phase over kvrouter ``a``, kvrouter ``b`` and Dynamo, after one 200k-block drain."""
    mock_port = sb.free_port()
    mock = subprocess.Popen(
        [sb.PY, str(sb.ROOT / "bench" / "zero_mock.py"), str(mock_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        sb.wait_listening(mock_port, mock)
        with tempfile.TemporaryDirectory(prefix="kvab-") as tmpdir:
            tmp = Path(tmpdir)
            stream = sb.make_stream(8, 200_000, False)
            pubs = sb.Publishers(stream, 8, 2, tmp)
            svcs: list[sb.Service] = []
            try:
                for name, exe in (("a", a), ("b", b)):
                    sb.KVROUTER = exe
                    svc = sb.KvRouter(pubs.ports, mock_port, tmp)
                    svc.name = name
                    svcs.append(svc)
                svcs.append(sb.Dynamo(dynamo, pubs.ports))
                for svc in svcs:
                    sb.wait_http(svc)
                sb.subscribe(svcs, pubs, 8)
                sb.drain(svcs, pubs, stream, 100, 200_000, False)
                return sb.latency(svcs, stream, lookups)
            finally:
                for svc in svcs:
                    svc.stop()
                pubs.close()
    finally:
        mock.terminate()
        mock.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="kvrouter executable A (e.g. the old build)")
    ap.add_argument("--b", required=True, help="kvrouter executable B (e.g. the new build)")
    ap.add_argument("--dynamo", required=True, help="python of a venv with ai-dynamo-runtime==1.6.1")
    ap.add_argument("--lookups", type=int, default=300)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    lat = run(args.a, args.b, args.dynamo, args.lookups)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": shlex.join(sys.argv)}
        Path(args.json).write_text(json.dumps({**meta, "latency": lat}, indent=1))
    for placement in lat["a"]:
        print(placement)
        for row in ROWS:
            cells = [lat[s][placement][row] for s in ("a", "b", "dynamo")]
            us = [(c if row.startswith("health") else c["p50_ms"]) * 1e3 for c in cells]
            print(
                f"  {row:14s} A {us[0]:7.1f}  B {us[1]:7.1f}  Dynamo {us[2]:7.1f} us"
                f"   B/Dynamo {us[1] / us[2]:.2f}x  A/Dynamo {us[0] / us[2]:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
