"""Membership changes measured through the running service (`kvrouter serve` over real sockets).

1. **Join to first routed request**: an engine whose replay buffer holds ``--bootstrap-blocks`` blocks
   is added with ``PUT /admin/backends`` while a client keeps sending a prompt those blocks cover;
   timed from the PUT to the first response served by the new engine (the kv policy sends the prompt
   there as soon as the engine is ready with its bootstrapped index). Repeated ``--joins`` times.
2. **Removing a backend with a large index**: an engine announces ``--blocks`` blocks (chains of 64),
   then is removed with ``DELETE /admin/backends``; a client sends ``GET /health`` back to back on one
   keep-alive connection throughout, and the longest answer during the removal is the event loop's
   longest stall as a client sees it. RSS of the router before the engine joined, with its index
   full, and after the removal.

Engines are stand-ins: a zero-latency upstream (bench/zero_mock.py) for HTTP and a real vLLM-layout
KV publisher (sim.publisher) per engine in this process. Prompts are token ids (no tokenizer).

``python bench/membership_bench.py [--blocks 1000000] [--bootstrap-blocks 20000] [--joins 5]``
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.publisher import BlockStored, KVEventPublisher, encode_batch  # noqa: E402

BS = 16
CHAIN = 64
ADMIN = {"authorization": "Bearer bench-admin"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def wait(cond: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


class Chains:
    """Pre-encoded BlockStored batches: chains of CHAIN blocks with their own tokens."""

    def __init__(self, n_blocks: int, seed: int) -> None:
        rng = random.Random(seed)
        self.prompts: list[list[int]] = []
        self.payloads: list[bytes] = []
        hashes = seed << 40
        for _ in range(max(n_blocks // CHAIN, 1)):
            tokens = [rng.randrange(1, 50_000) for _ in range(CHAIN * BS)]
            block_hashes: list[int | bytes] = list(range(hashes, hashes + CHAIN))
            hashes += CHAIN
            self.prompts.append(tokens)
            event = BlockStored(block_hashes, None, tokens, BS, None, "GPU", None)
            self.payloads.append(encode_batch([event], time.time(), 0))


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.upstream = f"http://127.0.0.1:{self._start([sys.executable, 'bench/zero_mock.py'])}"
        self.port = free_port()
        cfg = tmp / "router.toml"
        cfg.write_text(
            f'block_size = {BS}\nremote_tokenize = false\nadmin_keys = ["bench-admin"]\n'
            f"[server]\nport = {self.port}\n[health]\ninterval_s = 5.0\n"
            "[index.subscriber]\nrcvhwm = 1000000\n"
        )
        log = (tmp / "router.log").open("wb")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
            stdout=log,
            stderr=log,
            cwd=ROOT,
        )
        self.procs.append(self.router)
        self.url = f"http://127.0.0.1:{self.port}"
        wait(lambda: httpx.get(f"{self.url}/health").status_code == 200, "router start")

    def _start(self, cmd: list[str]) -> int:
        port = free_port()
        proc = subprocess.Popen(
            [*cmd, str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.procs.append(proc)
        wait(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, "upstream")
        return port

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.ctx.term()

    def debug(self) -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(f"{self.url}/debug/index", timeout=30).json()
        return out

    def publisher(self, buffer_steps: int = 10_000) -> KVEventPublisher:
        return KVEventPublisher(
            dp_rank=0,
            ctx=self.ctx,
            buffer_steps=buffer_steps,
            hwm=1_000_000,
        )

    def put(self, name: str, pub: KVEventPublisher) -> None:
        body = {
            "url": self.upstream,
            "kv_events": pub.endpoint,
            "kv_replay": pub.replay_endpoint,
            "models": ["toy"],
        }
        r = httpx.put(f"{self.url}/admin/backends/{name}", json=body, headers=ADMIN, timeout=30)
        assert r.status_code in (200, 201), r.text

    def delete(self, name: str) -> None:
        r = httpx.delete(f"{self.url}/admin/backends/{name}", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text

    def gone(self, name: str) -> bool:
        d = self.debug()
        return all(s["instance"] != name for s in d["sources"]) and all(
            b["name"] != name for b in d["backends"]
        )

    # --- 1 ---------------------------------------------------------------------------------------
    def join_latency(self) -> list[float]:
        a = self.publisher()
        self.put(
            "steady", a
        )  # an engine that holds nothing: the request goes there until the joiner is ready
        wait(lambda: any(b["state"] == "ready" for b in self.debug()["backends"]), "steady ready")
        out = []
        for k in range(self.args.joins):
            chains = Chains(self.args.bootstrap_blocks, seed=100 + k)
            pub = self.publisher(buffer_steps=len(chains.payloads) + 10)
            for payload in chains.payloads:  # in its replay buffer before the router knows the engine
                pub.publish_raw(payload)
            prompt = chains.prompts[0]
            served: list[float] = []
            stop = threading.Event()

            name = f"joiner-{k}"

            def client(prompt: list[int], served: list[float], stop: threading.Event, name: str) -> None:
                with httpx.Client(timeout=30) as c:
                    while not stop.is_set():
                        r = c.post(f"{self.url}/v1/completions", json={"model": "toy", "prompt": prompt})
                        if r.headers.get("x-kvrouter-backend") == name:
                            served.append(time.monotonic())
                            return

            t = threading.Thread(target=client, args=(prompt, served, stop, name), daemon=True)
            t.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            self.put(name, pub)
            t.join(60)
            stop.set()
            if served:
                out.append(served[0] - t0)
            self.delete(f"joiner-{k}")
            wait(lambda k=k: self.gone(f"joiner-{k}"), "joiner removed")
            pub.close()
        self.delete("steady")
        wait(lambda: self.gone("steady"), "steady removed")
        a.close()
        return out

    # --- 2 ---------------------------------------------------------------------------------------
    def removal(self) -> dict[str, Any]:
        time.sleep(2)
        rss_before = rss_kb(self.router.pid)
        chains = Chains(self.args.blocks, seed=7)
        pub = self.publisher(buffer_steps=16)
        self.put("big", pub)
        wait(
            lambda: any(s["instance"] == "big" and s["connected"] for s in self.debug()["sources"]),
            "subscribed",
        )
        t_fill = time.monotonic()
        step = 2000
        for i in range(0, len(chains.payloads), step):
            for payload in chains.payloads[i : i + step]:
                pub.publish_raw(payload)
            want = min(i + step, len(chains.payloads)) * CHAIN
            wait(lambda want=want: self.debug()["residencies"] >= want, "indexed")
        fill_s = time.monotonic() - t_fill
        blocks = self.debug()["residencies"]
        time.sleep(2)
        rss_full = rss_kb(self.router.pid)
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=30) as c:
                c.get(f"{self.url}/health")  # the connection and the client's first-use costs, untimed
                while not stop.is_set():
                    t = time.monotonic()
                    c.get(f"{self.url}/health")
                    samples.append((t, time.monotonic() - t))

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        time.sleep(2)
        t_del = time.monotonic()
        self.delete("big")
        wait(lambda: self.gone("big") and self.debug()["residencies"] == 0, "big removed and freed", 300)
        t_freed = time.monotonic()
        time.sleep(1)
        stop.set()
        th.join(30)
        pub.close()
        time.sleep(2)
        rss_after = rss_kb(self.router.pid)
        before = [d for t, d in samples if t < t_del]
        t0 = samples[0][0]
        during = [d for t, d in samples if t_del <= t <= t_freed + 0.5]
        return {
            "blocks": blocks,
            "fill_s": round(fill_s, 2),
            "removal_s": round(t_freed - t_del, 3),
            "health_p50_ms_before": round(statistics.median(before) * 1e3, 3),
            "health_max_ms_before": round(max(before) * 1e3, 2),
            "health_max_before_at_s": round(max(samples[: len(before)], key=lambda x: x[1])[0] - t0, 3),
            "health_max_ms_during_removal": round(max(during) * 1e3, 2),
            "health_probes_during_removal": len(during),
            "rss_mb_before_join": round(rss_before / 1024, 1),
            "rss_mb_full": round(rss_full / 1024, 1),
            "rss_mb_after_removal": round(rss_after / 1024, 1),
            "rss_bytes_per_block": round((rss_full - rss_before) * 1024 / max(blocks, 1), 1),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--bootstrap-blocks", type=int, default=20_000)
    ap.add_argument("--joins", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="100k blocks, 2 joins")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.joins = 100_000, 2
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        try:
            joins = bench.join_latency()
            removal = bench.removal()
        finally:
            bench.close()
    out = {
        "join_to_first_request_s": {
            "bootstrap_blocks": args.bootstrap_blocks,
            "runs": [round(x, 3) for x in joins],
            "median": round(statistics.median(joins), 3) if joins else None,
        },
        "removal": removal,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
