"""Well-behaved clients' latency while the router is attacked: one phase per attack, side by side
with a phase without (the goal: p99 within 2x of it).

``.venv/bin/python bench/hostile_bench.py [--seconds 10] [--clients 8] [--json F] [--only A,B]``

The real ``kvrouter serve`` (defaults, but for what is listed below) in front of three mock engines
with vLLM-like latencies (``--time-scale 1``: ~2 ms a step, 15 ms a decode step, 0.1 ms per
prompt token; ``max_tokens`` 8, so an answer takes ~150 ms), a fourth, hostile engine (a mock engine
serving ``hostile-model`` only, behind sim/hostile.py's proxy) and a store for the cluster link
(sim/hostile.py's RESP server). The hostile pieces, and each attacker (this script again, with
``--attacker``), run in processes of their own: their CPU is on the same two cores, their GIL is
not the measuring clients'.

Normal clients (``--clients``, closed loop, each request on its own tag, chat and completions,
half of them streamed, all on ``mock-model``: the three sound engines) run throughout; a phase
measures the requests that started in its window. Per phase: p50 and p99 of their end-to-end
latency, the errors among them (anything but a complete answer of their own), the router's peak RSS
over its size at the phase's start (VmHWM, reset then), and the longest answer time of ``GET
/health`` asked over and over on a connection of its own (the longest the router's event loop did
not get to it, plus a round trip), and the attack's volume: the requests the hostile engine
attacked, the attacks the store sent, or what the client attacker did (requests; connections for
slowloris and conn_flood).

Attacks:

- engine-side: the hostile engine armed with each attack of sim/hostile.py (``ENGINE_ATTACKS``)
  while an attacker sends it ``hostile-model`` requests, 4 at a time, each client at most 5 a second
  (a hostile engine gets a share of the traffic, not a flood); ``[health.breaker] eject_after = 0``
  keeps it in the fleet for the whole phase (ejected, it would be spared the attacks);
- store-side: the store armed with each of ``STORE_ATTACKS`` (no attacker: the link's own
  subscription is hit, again at each reconnection);
- client-side: ``slowloris`` (500 connections, each sending a request head a header line a second,
  never finished; reopened when closed), ``chunked_2b`` (4 connections, each sending a 32 KiB
  body in 2-byte chunks, again and again), ``huge_tools`` (2 connections sending chats with 2,000
  tools, 4 MB each), ``conn_flood`` (connections opened as fast as they go, up to 4,000 open at once,
  the oldest closed in turn). Body attacks ask ``hostile-model`` (unarmed then), so that what the
  router does with them is measured, not what a sound engine does with 4 MB bodies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.chaos import judge, tag_of  # noqa: E402
from sim.hostile import ENGINE_ATTACKS, STORE_ATTACKS, store_command  # noqa: E402
from sim.procs import EngineProc, reset_peak, status_kb, stop_group  # noqa: E402
from sim.routerproc import free_port  # noqa: E402
from sim.toy_tokenizer import build_toy_tokenizer  # noqa: E402

MODEL = "mock-model"
HOSTILE_MODEL = "hostile-model"
STORE_PHASES = tuple(a for a in STORE_ATTACKS if a != "array_in_pieces")  # (that one is within limits)
CLIENT_ATTACKS = ("slowloris", "chunked_2b", "huge_tools", "conn_flood")


# ---- attackers (each in a process of its own: ``--attacker NAME``) -----------------------------------


class _Run:
    """One attacker's count and its end (every loop checks it: asyncio.wait_for in Python 3.11 can
    swallow a cancellation, so a cancelled loop may go on)."""

    def __init__(self) -> None:
        self.count = 0
        self.stop = asyncio.Event()

    @property
    def on(self) -> bool:
        return not self.stop.is_set()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)


async def _engine_attacker(port: int, stream: bool, run: _Run) -> None:
    """``hostile-model`` requests, at most 5 a second (the hostile engine answers them)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        while run.on:
            t0 = time.monotonic()
            body = {
                "model": HOSTILE_MODEL,
                "prompt": f"attack {run.count}",
                "max_tokens": 8,
                "stream": stream,
            }
            with contextlib.suppress(httpx.HTTPError):
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_raw():
                        pass
            run.count += 1
            await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))


async def _slowloris(port: int, run: _Run) -> None:
    """One connection sending a request head a header line a second, never finishing it."""
    while run.on:
        with contextlib.suppress(OSError, TimeoutError):
            _, w = await _open(port)
            run.count += 1
            w.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n")
            try:
                while run.on:
                    await asyncio.sleep(1.0)
                    w.write(b"x-slow: %d\r\n" % random.randrange(1 << 30))
                    await w.drain()
            finally:
                w.transport.abort()
        await asyncio.sleep(0.1)


def _chunked(data: bytes, size: int) -> bytes:
    return b"".join(
        b"%x\r\n%s\r\n" % (len(p), p) for p in (data[i : i + size] for i in range(0, len(data), size))
    )


async def _chunked_2b(port: int, run: _Run) -> None:
    """A 32 KiB completion request in 2-byte chunks, again and again on one connection."""
    body = json.dumps({"model": HOSTILE_MODEL, "prompt": "tiny " * 6500, "max_tokens": 1}).encode()
    payload = (
        b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + _chunked(body, 2) + b"0\r\n\r\n"
    )
    while run.on:
        with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            r, w = await _open(port)
            try:
                while run.on:
                    w.write(payload)
                    await w.drain()
                    await _read_answer(r)
                    run.count += 1
            finally:
                w.transport.abort()
        await asyncio.sleep(0.1)


async def _read_answer(r: asyncio.StreamReader) -> None:
    """One content-length answer (the router's answers to non-streamed requests have one)."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await asyncio.wait_for(r.readexactly(length), 30)


async def _huge_tools(port: int, run: _Run) -> None:
    """Chats with 2,000 tools of 2 KB each."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "d" * 2000,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(2000)
    ]
    messages = [{"role": "user", "content": "hi"}]
    body = json.dumps({"model": HOSTILE_MODEL, "messages": messages, "tools": tools, "max_tokens": 1})
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        while run.on:
            with contextlib.suppress(httpx.HTTPError):
                await c.post("/v1/chat/completions", content=body.encode(), headers=headers)
            run.count += 1


async def _conn_flood(port: int, run: _Run) -> None:
    """Connections opened as fast as they go, at most 4,000 open, the oldest closed in turn."""
    held: list[asyncio.StreamWriter] = []
    while run.on:
        try:
            _, w = await _open(port)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.01)
            continue
        run.count += 1
        held.append(w)
        if len(held) >= 4000:
            for old in held[:500]:
                old.transport.abort()
            del held[:500]


async def attacker(name: str, port: int) -> None:
    """Runs one attack until SIGTERM; prints ``ready`` when it began, then at the end how much it did."""
    run = _Run()
    if name in ENGINE_ATTACKS:
        jobs = [_engine_attacker(port, name == "endless_sse" or k % 2 == 1, run) for k in range(4)]
    elif name == "slowloris":
        jobs = [_slowloris(port, run) for _ in range(500)]
    elif name == "chunked_2b":
        jobs = [_chunked_2b(port, run) for _ in range(4)]
    elif name == "huge_tools":
        jobs = [_huge_tools(port, run) for _ in range(2)]
    elif name == "conn_flood":
        jobs = [_conn_flood(port, run)]
    else:
        raise SystemExit(f"unknown attack {name!r}")
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, run.stop.set)
    tasks = [asyncio.ensure_future(j) for j in jobs]
    print("ready", flush=True)
    await run.stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=10)
    print(json.dumps({"done": run.count}), flush=True)


# ---- the measurement ---------------------------------------------------------------------------------


@dataclass
class Sample:
    start: float
    latency: float
    verdict: str


@dataclass
class Bench:
    url: str
    pid: int
    samples: list[Sample] = field(default_factory=list)
    health: list[tuple[float, float]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, k: int, clients: int) -> None:
        rng = random.Random(k)
        i = k
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                tag, stream = tag_of(i), rng.random() < 0.5
                i += clients
                text = " ".join(f"w{rng.randrange(400)}" for _ in range(rng.randrange(10, 60)))
                body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": stream}
                if rng.random() < 0.5:
                    path = "/v1/chat/completions"
                    body["messages"] = [
                        {"role": "system", "content": f"assistant {k}"},
                        {"role": "user", "content": text},
                    ]
                else:
                    path, body["prompt"] = "/v1/completions", f"assistant {k}: {text}"
                t0 = time.monotonic()
                try:
                    async with c.stream("POST", path, json=body, headers={"x-request-id": tag}) as r:
                        raw = b"".join([x async for x in r.aiter_raw()])
                    verdict = judge(tag, r.status_code, raw, stream)[0]
                except httpx.HTTPError:
                    verdict = "bad"
                self.samples.append(Sample(t0, time.monotonic() - t0, verdict))

    async def probe(self) -> None:
        """GET /health over and over on one connection of its own."""
        port = int(self.url.rsplit(":", 1)[1])
        r, w = await _open(port)
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                w.write(b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n")
                await _read_answer(r)
                self.health.append((t0, time.monotonic() - t0))
                await asyncio.sleep(0.005)
        finally:
            w.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _start_engines(tok: Path) -> tuple[list[EngineProc], EngineProc]:
    args = ["--time-scale", "1.0", "--tokenizer", str(tok), "--no-replay"]
    engines = [EngineProc(f"engine-{i}", [*args, "--model", MODEL]) for i in range(3)]
    hostile = EngineProc("hostile", [*args, "--model", HOSTILE_MODEL])
    for e in [*engines, hostile]:
        await e.start()
    return engines, hostile


async def _wait_ready(url: str, backends: int) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = await c.get(f"{url}/ready")
                metrics = (await c.get(f"{url}/metrics")).text
                if (
                    r.status_code == 200
                    and len(r.json()["healthy_backends"]) == backends
                    and "\nkvrouter_cluster_connected 1" in metrics
                ):
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError("the router did not become ready")


@contextlib.asynccontextmanager
async def _attacking(name: str, port: int, done: list[int | None]) -> AsyncIterator[None]:
    """An attacker process through the block: its attack begun before, the process ended after
    (SIGTERM, SIGKILL after 60 s) whatever happens; ``done[0]``: what it says it did."""
    cmd = [sys.executable, __file__, "--attacker", name, "--port", str(port)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() != b"ready":
            raise RuntimeError(f"the {name} attacker did not start")
        yield
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            done[0] = json.loads(out.splitlines()[-1])["done"]
        except (TimeoutError, ValueError, IndexError):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _attacks_sent(c: httpx.AsyncClient, kind: str, proxy: str, store: str) -> int:
    """The attacks the hostile engine (or store) sent so far."""
    if kind == "store":
        return int((await store_command(store, "HOSTILE", "COUNT"))[1:])
    n: int = (await c.get(f"{proxy}/hostile/attack")).json()["attacked"]
    return n


async def _phase(
    bench: Bench, name: str, kind: str, seconds: float, proxy: str, store: str, router_port: int
) -> dict[str, Any]:
    """One attack (or none) for ``seconds``, the figures of the requests that started meanwhile."""
    async with httpx.AsyncClient(timeout=10) as c:
        sent = await _attacks_sent(c, kind, proxy, store)
        if kind == "engine":
            body = {"attack": name, "streams_only": name == "endless_sse"}
            (await c.post(f"{proxy}/hostile/attack", json=body)).raise_for_status()
        reset_peak(bench.pid)
        rss0 = status_kb(bench.pid, "VmRSS")
        if kind == "store":
            await store_command(store, "HOSTILE", "ATTACK", name)
        done: list[int | None] = [None]
        attacker = _attacking(name, router_port, done) if kind in ("engine", "client") else None
        async with attacker or contextlib.nullcontext():
            t0 = time.monotonic()
            await asyncio.sleep(seconds)
            t1 = time.monotonic()
            peak = status_kb(bench.pid, "VmHWM")
        if kind == "engine":
            (await c.post(f"{proxy}/hostile/attack", json={"attack": None})).raise_for_status()
        if kind == "store":
            await store_command(store, "HOSTILE", "ATTACK", "OFF")
        if kind in ("engine", "store"):
            done[0] = await _attacks_sent(c, kind, proxy, store) - sent
    window = [s for s in bench.samples if t0 <= s.start < t1]
    ok = [s.latency for s in window if s.verdict == "ok"]
    health = [lat for t, lat in bench.health if t0 <= t < t1]
    return {
        "attack": name,
        "side": kind,
        "requests": len(window),
        "errors": len(window) - len(ok),
        "p50_ms": round(1000 * statistics.median(ok), 1) if ok else None,
        "p99_ms": round(1000 * _pct(ok, 0.99), 1) if ok else None,
        "rss_delta_mb": round((peak - rss0) / 1024, 1),
        "health_max_ms": round(1000 * max(health), 1) if health else None,
        "health_probes": len(health),
        "attack_volume": done[0],
    }


async def run(seconds: float, clients: int, only: set[str] | None) -> dict[str, Any]:
    phases = [("baseline", "baseline")]
    phases += [(a, "engine") for a in ENGINE_ATTACKS]
    phases += [(a, "store") for a in STORE_PHASES]
    phases += [(a, "client") for a in CLIENT_ATTACKS]
    if only:
        phases = [p for p in phases if p[0] in only or p[0] == "baseline"]
    phases.append(("baseline again", "baseline"))
    with tempfile.TemporaryDirectory(prefix="kvhostile-") as d:
        tmp = Path(d)
        tok = build_toy_tokenizer(tmp / "tok")
        engines, hostile = await _start_engines(tok)
        sources = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sim.hostile", "--proxy", hostile.url, "--store",
            stdout=asyncio.subprocess.PIPE, start_new_session=True, cwd=ROOT,
        )  # fmt: skip
        router: asyncio.subprocess.Process | None = None
        try:
            assert sources.stdout is not None
            info = json.loads(await asyncio.wait_for(sources.stdout.readline(), 60))
            proxy, store = info["proxies"][0], info["store"]
            port = free_port()
            toml = (
                f'tokenizer = "{tok}"\nblock_size = 16\n[server]\nport = {port}\n'
                "[health]\ninterval_s = 1.0\n[health.breaker]\neject_after = 0\n"
                f'[cluster]\nredis_url = "{store}"\n'
            )
            members = [(e.name, e.url, e.kv_events, MODEL) for e in engines]
            for name, url, kv, model in [*members, ("hostile", proxy, hostile.kv_events, HOSTILE_MODEL)]:
                toml += f'[[backends]]\nname = "{name}"\nurl = "{url}"\nkv_events = "{kv}"\n'
                toml += f'models = ["{model}"]\n'
            (tmp / "router.toml").write_text(toml)
            log = (tmp / "router.log").open("wb")
            router = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "serve", "--config", str(tmp / "router.toml"),
                stdout=log, stderr=log, start_new_session=True, cwd=ROOT,
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(url, 4)
            bench = Bench(url, router.pid)
            tasks = [asyncio.ensure_future(bench.client(k, clients)) for k in range(clients)]
            tasks.append(asyncio.ensure_future(bench.probe()))
            await asyncio.sleep(3)  # (warm: connections, the caches' first blocks)
            rows = []
            for name, kind in phases:
                rows.append(await _phase(bench, name, kind, seconds, proxy, store, port))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                await _wait_ready(url, 4)  # (the link back after a store attack)
                await asyncio.sleep(1)
            bench.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            alive = router.returncode is None
        finally:
            await stop_group(router)
            await asyncio.gather(stop_group(sources), *(e.stop() for e in [*engines, hostile]))
    base = rows[0]["p99_ms"]
    for r in rows:
        r["p99_ratio"] = round(r["p99_ms"] / base, 2) if r["p99_ms"] and base else None
    return {"seconds_per_phase": seconds, "clients": clients, "router_alive": alive, "rows": rows}


def table(result: dict[str, Any]) -> str:
    cols = ["attack", "side", "requests", "errors", "p50 ms", "p99 ms", "p99 / baseline", "RSS delta MB"]
    cols += ["longest /health ms", "attack volume"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        ratio = r["p99_ratio"]
        mark = " **over 2x**" if ratio is not None and ratio > 2 else ""
        cells = [
            r["attack"],
            r["side"],
            r["requests"],
            r["errors"],
            r["p50_ms"],
            r["p99_ms"],
            f"{ratio}{mark}",
        ]
        cells += [r["rss_delta_mb"], r["health_max_ms"], r["attack_volume"] or ""]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase's window")
    ap.add_argument("--clients", type=int, default=8, help="well-behaved clients, closed loop")
    ap.add_argument("--only", default="", help="comma-separated attacks (the baselines always run)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "hostile_bench.json"))
    ap.add_argument("--attacker", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.attacker:
        asyncio.run(attacker(args.attacker, args.port))
        return 0
    only = {a for a in args.only.split(",") if a} or None
    result = asyncio.run(run(args.seconds, args.clients, only))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0 if result["router_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
