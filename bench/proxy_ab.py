"""Two kvrouter builds side by side in front of one upstream: the proxied path's throughput, wrk
rounds alternating between them (A, B, then B, A), medians per row.

Why: the router table in docs/benchmarks/proxy.md is one run on a box whose speed moves by tens of percent
between runs; a change to the request path is judged against the build before it in the same run
("the proxy path keeps its figures"). The upstream is bench/zero_mock.py spending 25 us of
CPU per request (raw+25, the router table's calibrated mock); the rows are the table's non-stream
c=32, SSE c=32 and non-stream c=1.

    .venv/bin/python bench/proxy_ab.py --a OLD_VENV/bin/kvrouter --b NEW_VENV/bin/kvrouter \\
        [--rounds 6] [--seconds 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_bench as rb

ROWS = (("non-stream", 32), ("SSE", 32), ("non-stream", 1))


def run(a: str, b: str, rounds: int, seconds: int) -> dict[str, Any]:
    """Median req/s per row of each build, and every round's figure."""
    from sim.toy_tokenizer import build_toy_tokenizer

    with tempfile.TemporaryDirectory(prefix="kvproxyab-") as d:
        tmp = Path(d)
        tok = build_toy_tokenizer(tmp / "tok")
        prompt = "Tell me about the old harbour and its ships"
        bodies = {
            "non-stream": json.dumps({"model": "toy", "prompt": prompt, "max_tokens": 16}),
            "SSE": json.dumps({"model": "toy", "prompt": prompt, "stream": True}),
        }
        mport = rb.free_port()
        flags = ["--cost-us", "25", "--tokenizer", str(tok / "tokenizer.json")]
        procs = [rb.start([rb.PY, "bench/zero_mock.py", str(mport), *flags], tmp / "mock.log")]
        try:
            rb.wait_ready(f"http://127.0.0.1:{mport}/health")
            urls = {}
            for name, exe in (("a", a), ("b", b)):
                port = rb.free_port()
                cfg = rb.router_config(tmp, mport, port, tok)
                procs.append(rb.start([exe, "serve", "--config", str(cfg)], tmp / f"router-{name}.log"))
                rb.wait_ready(f"http://127.0.0.1:{port}/ready")
                urls[name] = f"http://127.0.0.1:{port}/v1/completions"
                rb.wrk(urls[name], bodies["non-stream"], 8, 2)  # warm-up
            figures: dict[str, dict[str, list[float]]] = {n: {} for n in urls}
            for r in range(rounds):
                for mode, conns in ROWS:
                    for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                        rps = rb.wrk(urls[name], bodies[mode], conns, seconds)
                        figures[name].setdefault(f"{mode} c={conns}", []).append(round(rps))
            median = {n: {k: statistics.median(v) for k, v in rows.items()} for n, rows in figures.items()}
            return {"rounds": figures, "median": median}
        finally:
            for p in reversed(procs):
                rb.stop(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="kvrouter executable A (e.g. the old build)")
    ap.add_argument("--b", required=True, help="kvrouter executable B (e.g. the new build)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    out = run(args.a, args.b, args.rounds, args.seconds)
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out["command"] = " ".join(sys.argv)
    for row in out["median"]["a"]:
        a, b = out["median"]["a"][row], out["median"]["b"][row]
        print(f"{row:16s} A {a:8.0f}  B {b:8.0f} req/s  B/A {b / a:.2f}x  rounds A {out['rounds']['a'][row]}")
        print(f"{'':16s} {'':28s} rounds B {out['rounds']['b'][row]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
