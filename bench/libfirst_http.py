"""`kvrouter serve` against other servers running the same app, in front of one upstream with
vLLM-like latencies, all on the same cores as the client: router CPU per request and the TTFT /
inter-token latency each adds, side by side in one run.

Why: a hand-written replacement of a maintained library stays only where it buys at least 1.5x on a
workload like production's. A zero-latency upstream makes the router's own cost everything; behind
a real engine the first token takes tens of milliseconds and every later one 10-30 ms, so what
matters is the CPU the router spends per streamed request (which bounds how many requests a core
carries) and the latency it adds to each token.

Sides (all in front of one ``bench/zero_mock.py --ttft-ms T --pace-ms P``, streaming completions):
``direct`` (no router: the baseline of the latencies), ``kvrouter`` (``kvrouter serve`` of this
checkout: uvicorn with kvrouter's client limits), ``before`` (``kvrouter serve`` of the checkout
given by ``--before``, an earlier commit with its C core built: e.g. one that still had kvrouter's
own HTTP server), ``uvicorn`` (the same ASGI app on plain ``uvicorn.run``: httptools, uvloop) and
``granian`` (the same ASGI app on granian, one worker, uvloop). The client is raw asyncio on uvloop:
``c`` keep-alive connections, each sending one streaming request after another for ``--seconds``;
a prober asks ``/health`` twice a second, as a load balancer does. Rounds alternate the sides'
order; figures are medians over rounds. CPU is the user+system time of the side's whole process
group over the window, divided by the requests completed in it.

    flock HEAVY_LOCK .venv/bin/python bench/libfirst_http.py [--conns 8,64,256] \\
        [--rounds 3] [--seconds 6] [--sides direct,before,kvrouter] [--before CHECKOUT] \\
        [--json bench/out/libfirst-http.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_bench as rb

CLK = os.sysconf("SC_CLK_TCK")

GRANIAN = (
    "import sys; from granian.server import Server; "
    "Server('asgi_factory:app', address='127.0.0.1', port=int(sys.argv[1]), interface='asgi', "
    "factory=True, workers=1, loop='uvloop', http='1', websockets=False, log_level='warning', "
    "log_access=False).serve()"
)


def group_cpu(pgid: int) -> float:
    """User+system CPU seconds of every live process in the process group ``pgid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # (fields after the name: state, ppid, pgrp, ...)
            total += int(fields[11]) + int(fields[12])
    return total / CLK


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.done = 0
        self.errors = 0


async def one_conn(host: str, port: int, bodies: list[bytes], until: float, st: Stats) -> None:
    """One keep-alive connection sending streaming completions until ``until``."""
    reader, writer = await asyncio.open_connection(host, port)
    n = 0
    try:
        while time.monotonic() < until:
            body = bodies[n % len(bodies)]
            n += 1
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body)
            )
            t0 = time.perf_counter()
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                st.errors += 1
                return
            chunked = b"transfer-encoding: chunked" in head.lower()
            first = last = 0.0
            events = 0
            buf = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    st.errors += 1
                    return
                now = time.perf_counter()
                got = data.count(b"data: {")
                if got:
                    if not events:
                        first = now
                    else:
                        st.itl.append(now - last)
                    last = now
                    events += got
                buf = (buf + data)[-16:]
                if (chunked and buf.endswith(b"0\r\n\r\n")) or (not chunked and b"[DONE]" in buf):
                    break
            st.ttft.append(first - t0)
            st.done += 1
    finally:
        writer.close()


async def prober(host: str, port: int, until: float) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    req = b"GET /health HTTP/1.1\r\nhost: %s:%d\r\nuser-agent: kube-probe/1.30\r\n\r\n" % (
        host.encode(),
        port,
    )
    try:
        while time.monotonic() < until:
            writer.write(req)
            await reader.readuntil(b"\r\n\r\n")
            await reader.read(65536)
            await asyncio.sleep(0.5)
    finally:
        writer.close()


async def window(port: int, conns: int, seconds: float, bodies: list[bytes]) -> Stats:
    st = Stats()
    until = time.monotonic() + seconds
    tasks = [asyncio.create_task(one_conn("127.0.0.1", port, bodies, until, st)) for _ in range(conns)]
    tasks.append(asyncio.create_task(prober("127.0.0.1", port, until)))
    await asyncio.gather(*tasks)
    return st


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0


def measure(pgid: int | None, port: int, conns: int, seconds: float, bodies: list[bytes]) -> dict[str, float]:
    cpu0 = group_cpu(pgid) if pgid else 0.0
    t0 = time.monotonic()
    st = asyncio.run(window(port, conns, seconds, bodies))
    wall = time.monotonic() - t0
    cpu = (group_cpu(pgid) - cpu0) if pgid else 0.0
    return {
        "rps": st.done / wall,
        "cpu_ms_per_req": cpu / st.done * 1e3 if st.done else 0.0,
        "ttft_p50": pct(st.ttft, 0.5),
        "ttft_p99": pct(st.ttft, 0.99),
        "itl_p50": pct(st.itl, 0.5),
        "itl_p99": pct(st.itl, 0.99),
        "errors": st.errors,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conns", default="8,64,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--ttft-ms", type=float, default=40.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--sides", default="direct,kvrouter,uvicorn,granian")
    ap.add_argument("--json", default=None)
    ap.add_argument("--before", default=None, help="the checkout side 'before' runs `kvrouter serve` from")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from sim.toy_tokenizer import build_toy_tokenizer

    sides = args.sides.split(",")
    with tempfile.TemporaryDirectory(prefix="kvlibfirst-") as d:
        tmp = Path(d)
        tok = build_toy_tokenizer(tmp / "tok")
        words = ["Tell", "me", "about", "the", "old", "harbour", "and", "its", "ships", "at", "dawn"]
        bodies = [
            json.dumps(
                {"model": "toy", "prompt": " ".join(words[: 4 + i % 10]) + f" {i}", "stream": True}
            ).encode()
            for i in range(64)
        ]
        mport = rb.free_port()
        mflags = ["--chunks", str(args.tokens), "--pace-ms", str(args.itl_ms), "--ttft-ms", str(args.ttft_ms)]
        procs = [rb.start([rb.PY, "bench/zero_mock.py", str(mport), *mflags], tmp / "mock.log")]
        ports: dict[str, tuple[int, int | None]] = {"direct": (mport, None)}
        env_cfg: dict[str, str] = {}
        try:
            rb.wait_ready(f"http://127.0.0.1:{mport}/health")
            for side in sides:
                if side == "direct":
                    continue
                port = rb.free_port()
                cfg = str(rb.router_config(tmp, mport, port, tok))
                cwd = rb.ROOT
                if side == "kvrouter":
                    cmd = [rb.PY, "-m", "router.cli", "serve", "--config", cfg]
                elif side == "before":
                    if not args.before:
                        raise SystemExit("side 'before' needs --before CHECKOUT")
                    cmd, cwd = [rb.PY, "-m", "router.cli", "serve", "--config", cfg], Path(args.before)
                elif side == "uvicorn":
                    cmd = [rb.PY, "-c", rb.UVICORN, cfg, str(port)]
                elif side == "granian":
                    env_cfg["KVROUTER_BENCH_CONFIG"] = cfg
                    cmd = [rb.PY, "-c", GRANIAN, str(port)]
                else:
                    raise SystemExit(f"unknown side {side}")
                os.environ.update(env_cfg)
                os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent)
                p = rb.start(cmd, tmp / f"{side}.log", cwd)
                procs.append(p)
                rb.wait_ready(f"http://127.0.0.1:{port}/health")
                ports[side] = (port, p.pid)
                measure(p.pid, port, 8, 1.5, bodies)  # warm-up
            rounds: dict[str, dict[str, list[dict[str, float]]]] = {}
            for r in range(args.rounds):
                for conns in (int(c) for c in args.conns.split(",")):
                    order = sides if r % 2 == 0 else list(reversed(sides))
                    for side in order:
                        port, pgid = ports[side]
                        row = measure(pgid, port, conns, args.seconds, bodies)
                        rounds.setdefault(f"c={conns}", {}).setdefault(side, []).append(row)
                        shown = json.dumps({k: round(v, 3) for k, v in row.items()})
                        print(f"round {r} c={conns} {side}: {shown}", flush=True)
            median = {
                c: {
                    side: {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
                    for side, rows in by_side.items()
                }
                for c, by_side in rounds.items()
            }
        finally:
            for p in reversed(procs):
                rb.stop(p)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "params": vars(args),
        "median": median,
        "rounds": rounds,
    }
    print(json.dumps(median, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
