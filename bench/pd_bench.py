"""What the P/D path adds to TTFT over the two legs' own latencies, with zero-latency engines.

``.venv/bin/python bench/pd_bench.py [--requests 300]`` (``make bench`` runs it). Two zero-latency
upstreams (bench/zero_mock.py, raw asyncio): ``P`` answers a prefill leg (``do_remote_decode``) at
once with transfer parameters, ``D`` streams its answer (first chunk at once). Behind one
``kvrouter serve`` they are a prefill and a decode engine (``pd.min_uncached_tokens = 0``: every
request takes both legs); behind another, ``D`` alone is an ordinary engine (the aggregated path,
for comparison). Rounds alternate, one request each, sequentially, on keep-alive connections:

- ``prefill``: the prefill leg's body straight to P, until the whole answer is read;
- ``decode``: the decode leg's body (with P's transfer parameters) straight to D, until its first chunk;
- ``pd``: the client's streaming request through the P/D router, until its first chunk;
- ``direct`` / ``aggregated``: the client's request straight to D / through the aggregated router.

Added by the P/D path = median(pd) - (median(prefill) + median(decode)); by the ordinary path =
median(aggregated) - median(direct). Everything in one run on the same cores.

``--gateway``: both routers also run their endpoint picker, each behind an Envoy (request body
BUFFERED, response body NONE, as deploy/gateway; Envoy from tests/envoy/install.sh), and two more
kinds join the rounds: ``gateway_pd`` (the picker runs the prefill leg, Envoy the decode leg) and
``gateway_aggregated`` (the same Envoy hop for an ordinary model). Added by the gateway's P/D path
= median(gateway_pd) - (median(prefill) + median(decode)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from router_bench import PY, free_port, start, stop, wait_ready

from router.pd.connector import NixlConnector

PROMPT = "Tell me about the old harbour and the ships that come in with the morning tide"


def router_toml(
    tmp: Path, tok: Path, port: int, backends: list[tuple[str, int, str]], epp_port: int = 0
) -> Path:
    """A config with these (name, port, role) backends (and the endpoint picker on ``epp_port``)."""
    path = tmp / f"router-{port}.toml"
    text = f'block_size = 16\ntokenizer = "{tok}"\n[server]\nport = {port}\nlog_level = "warning"\n'
    text += "[pd]\nmin_uncached_tokens = 0\n"
    if epp_port:
        text += f"[epp]\nenabled = true\nport = {epp_port}\nhealth_port = {free_port()}\n"
    for name, bport, role in backends:
        text += f'[[backends]]\nname = "{name}"\nurl = "http://127.0.0.1:{bport}"\nrole = "{role}"\n'
        text += 'models = ["toy"]\n'
    path.write_text(text)
    return path


def first_chunk(c: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first body chunk of a streamed answer (the rest is read and dropped)."""
    t0 = time.perf_counter()
    with c.stream("POST", url, json=body) as r:
        chunks = r.iter_raw()
        next(chunks)
        took = time.perf_counter() - t0
        for _ in chunks:
            pass
    return took


def whole(c: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """Seconds to a whole non-streamed answer."""
    t0 = time.perf_counter()
    r = c.post(url, json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=300, help="rounds (one request of each kind per round)")
    ap.add_argument("--gateway", action="store_true", help="also through Envoy + each router's picker")
    args = ap.parse_args()
    from sim.toy_tokenizer import build_toy_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = build_toy_tokenizer(tmp / "tok")
        pport, dport, rport, aport = free_port(), free_port(), free_port(), free_port()
        epp = (free_port(), free_port()) if args.gateway else (0, 0)
        envoys: list[Any] = []
        procs = [
            start([PY, "bench/zero_mock.py", str(pport), "--chunks", "5"], tmp / "p.log"),
            start([PY, "bench/zero_mock.py", str(dport), "--chunks", "5"], tmp / "d.log"),
        ]
        try:
            wait_ready(f"http://127.0.0.1:{pport}/health")
            wait_ready(f"http://127.0.0.1:{dport}/health")
            pd_cfg = router_toml(tmp, tok, rport, [("P", pport, "prefill"), ("D", dport, "decode")], epp[0])
            agg_cfg = router_toml(tmp, tok, aport, [("D", dport, "both")], epp[1])
            for cfg in (pd_cfg, agg_cfg):
                procs.append(
                    start([PY, "-m", "router.cli", "serve", "--config", str(cfg)], tmp / f"{cfg.stem}.log")
                )
            wait_ready(f"http://127.0.0.1:{rport}/ready")
            wait_ready(f"http://127.0.0.1:{aport}/ready")
            if args.gateway:
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from envoy_harness import Envoy, bootstrap

                engines = [("127.0.0.1", pport), ("127.0.0.1", dport)]
                for i, port in enumerate(epp):
                    envoys.append(Envoy(bootstrap(("127.0.0.1", port), engines), tmp, name=f"envoy{i}"))
            client = {"model": "toy", "prompt": PROMPT, "max_tokens": 16, "stream": True}
            prefill_body = {
                **client,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": NixlConnector.REQUEST_PARAMS,
            }
            with httpx.Client(timeout=30) as c:
                params = c.post(f"http://127.0.0.1:{pport}/v1/completions", json=prefill_body).json()
                decode_body = {**client, "kv_transfer_params": params["kv_transfer_params"]}
                kinds: dict[str, Callable[[], float]] = {
                    "prefill": lambda: whole(c, f"http://127.0.0.1:{pport}/v1/completions", prefill_body),
                    "decode": lambda: first_chunk(c, f"http://127.0.0.1:{dport}/v1/completions", decode_body),
                    "pd": lambda: first_chunk(c, f"http://127.0.0.1:{rport}/v1/completions", client),
                    "direct": lambda: first_chunk(c, f"http://127.0.0.1:{dport}/v1/completions", client),
                    "aggregated": lambda: first_chunk(c, f"http://127.0.0.1:{aport}/v1/completions", client),
                }
                if envoys:
                    pd_gw, agg_gw = (f"{e.url}/v1/completions" for e in envoys)
                    kinds["gateway_pd"] = lambda: first_chunk(c, pd_gw, client)
                    kinds["gateway_aggregated"] = lambda: first_chunk(c, agg_gw, client)
                for fn in kinds.values():  # warm-up: connections, the router's caches
                    for _ in range(20):
                        fn()
                times: dict[str, list[float]] = {k: [] for k in kinds}
                for _ in range(args.requests):
                    for k, fn in kinds.items():
                        times[k].append(fn())
                metrics = c.get(f"http://127.0.0.1:{rport}/metrics").text
        finally:
            for e in envoys:
                e.stop()
            for p in reversed(procs):
                stop(p)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    legs = [line for line in metrics.splitlines() if line.startswith("kvrouter_pd_legs_total")]
    out = {
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "p90_ms": {k: round(sorted(v)[int(0.9 * len(v))] * 1e3, 3) for k, v in times.items()},
        "pd_added_ms": round(med["pd"] - med["prefill"] - med["decode"], 3),
        "aggregated_added_ms": round(med["aggregated"] - med["direct"], 3),
        **(
            {
                "gateway_pd_added_ms": round(med["gateway_pd"] - med["prefill"] - med["decode"], 3),
                "gateway_aggregated_added_ms": round(med["gateway_aggregated"] - med["direct"], 3),
            }
            if "gateway_pd" in med
            else {}
        ),
        "rounds": args.requests,
        "router_legs": legs,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
