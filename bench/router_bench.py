"""Router overhead: throughput through kvrouter vs direct to a zero-latency mock, added TTFT, and the
route-decision latency for 1k/8k/32k-token prompts.

``.venv/bin/python bench/router_bench.py [--seconds 8]`` (``make bench`` runs it). Needs ``wrk``
(Debian package). Everything runs on 127.0.0.1; every load run is bounded in time.

- upstreams: ``raw`` (bench/zero_mock.py: raw asyncio, tens of thousands of req/s, so the router's
  own cost dominates), ``raw+25`` (the same spending 25 us of CPU per request: vllm-router lands near
  the issue's reference ratios on it) and ``framework`` (the same answers from FastAPI on uvicorn,
  vLLM's server stack, so the upstream costs what vLLM's HTTP layer costs without a model).
- every upstream answers ``/tokenize`` (vllm-router kv_aware asks it for every request) by really
  tokenizing with the toy tokenizer, as a vLLM engine would, on the shared cores.
- req/s: wrk, POST /v1/completions (a short text prompt, tokenized by the router with the toy
  tokenizer, so the kv policy does its full work), non-stream and SSE (16 chunks), c=1 and c=32;
  ratio = through the router / direct, measured in the same run; the same app under uvicorn is
  measured in the same run too (the A/B behind kvrouter's own server; ``--no-uvicorn`` skips it),
  and so is ``kvrouter serve --workers 2`` (``--workers N``; 1 skips it).
- added TTFT: 300 sequential streaming requests with paced tokens (20 ms apart), first chunk time
  through the router minus direct, p50.
- unique prompts: the non-stream c=32 row again with every prompt new (wrk spells a counter in
  words in front of each), so the router's segment token cache never hits: the cost of a prompt
  seen for the first time.
- decision latency: ``POST /route`` with prompts of ~1k/8k/32k tokens, the router's own
  ``timings_us.total`` (tokenize + keys + lookup + policy), p50/p99: text seen for the first time,
  the same text again, and the next turn of a chat of that size (see ``decision_latency``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def wrk(url: str, body: str, conns: int, seconds: int, unique: bool = False) -> float:
    """req/s of a fixed POST body; ``unique``: every request's prompt starts with words no other
    request has (start time, wrk thread id and a counter, spelled in words), so nothing the router
    caches about the text helps."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        if unique:
            # the number is spelled in common words (base 16), as new prompts are new combinations
            # of known words: a digit run would be a new BPE word each time, which real tokenizers
            # split into cached 1-3 digit pieces but the toy tokenizer's GPT-2 regex does not
            marker = '"prompt": "'
            cut = body.index(marker) + len(marker)
            script.write(
                'local words = {"harbour", "ship", "dawn", "sail", "net", "fish", "tide", "rope",'
                ' "mast", "deck", "wave", "gull", "port", "crew", "oar", "keel"}\n'
                "local function spell(x)\n"
                '  local s = ""\n'
                "  repeat s = s .. words[(x % 16) + 1] .. ' '; x = math.floor(x / 16) until x == 0\n"
                "  return s\n"
                "end\n"
                "local n = 0\n"
                'function setup(thread) n = n + 1; thread:set("tid", n) end\n'
                "function init(args) counter = 0; run = spell(os.time() % 65536) .. spell(tid) end\n"
                "function request()\n"
                "  counter = counter + 1\n"
                f"  local b = {json.dumps(body[:cut])} .. run .. spell(counter) .. {json.dumps(body[cut:])}\n"
                "  return wrk.format(nil, nil, nil, b)\n"
                "end\n"
            )
        else:
            script.write(f"wrk.body = {json.dumps(body)}\n")
    out = subprocess.run(
        [
            "wrk",
            "-t",
            "1" if conns == 1 else "2",
            "-c",
            str(conns),
            "-d",
            f"{seconds}s",
            "-s",
            script.name,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    ).stdout
    os.unlink(script.name)
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        raise RuntimeError(f"wrk saw errors: {out}")
    return float(m.group(1)) if m else 0.0


def ttft(url: str, n: int) -> list[float]:
    body = {"model": "toy", "prompt": "Tell me about harbours", "stream": True}
    out = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            with c.stream("POST", url, json=body) as r:
                chunks = r.iter_raw()
                next(chunks)
                out.append(time.perf_counter() - t0)
                for _ in chunks:
                    pass
    return out


def start(cmd: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
    )


def stop(p: subprocess.Popen[bytes]) -> None:
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)


UVICORN = (
    "import sys, uvicorn; from router.app import KVRouter; from router.config import load_config; "
    "from router.http.asgi import AsgiApp; "
    "uvicorn.run(AsgiApp(KVRouter(load_config(sys.argv[1]))), host='127.0.0.1', port=int(sys.argv[2]), "
    "log_level='warning', loop='uvloop', http='httptools', lifespan='on')"
)


def router_config(tmp: Path, mock_port: int, port: int, tok: Path) -> Path:
    cfg = tmp / f"bench-{port}.toml"
    cfg.write_text(
        f'block_size = 16\ntokenizer = "{tok}"\n[server]\nport = {port}\nlog_level = "warning"\n'
        f'[[backends]]\nname = "mock"\nurl = "http://127.0.0.1:{mock_port}"\nmodels = ["toy"]\n'
    )
    return cfg


def start_pair(
    tmp: Path, tok: Path, mock_flags: list[str], tag: str
) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], int, int]:
    """A zero_mock upstream and `kvrouter serve` in front of it, both ready: (mock, router, ports)."""
    mport, rport = free_port(), free_port()
    mock = start([PY, "bench/zero_mock.py", str(mport), *mock_flags], tmp / f"mock-{tag}.log")
    router = start(
        [PY, "-m", "router.cli", "serve", "--config", str(router_config(tmp, mport, rport, tok))],
        tmp / f"router-{tag}.log",
    )
    try:
        wait_ready(f"http://127.0.0.1:{mport}/health")
        wait_ready(f"http://127.0.0.1:{rport}/ready")
    except BaseException:
        stop(router)
        stop(mock)
        raise
    return mock, router, mport, rport


def throughput(
    kind: str, args: argparse.Namespace, tmp: Path, tok: Path, body: str, sse: str
) -> list[dict[str, Any]]:
    """wrk through kvrouter (and the peers) vs direct, against one kind of zero-latency upstream."""
    uport = free_port()
    flags = ["--framework"] if kind == "framework" else []
    if kind.startswith("raw+"):  # raw+NN: the raw upstream spending NN us of CPU per request
        flags = ["--cost-us", kind[4:]]
    # /tokenize (vllm-router kv_aware calls it per request) really tokenizes, as an engine does
    flags += ["--tokenizer", str(tok / "tokenizer.json")]
    mock, router, mport, rport = start_pair(tmp, tok, flags, kind)
    try:
        direct = f"http://127.0.0.1:{mport}/v1/completions"
        routed = f"http://127.0.0.1:{rport}/v1/completions"
        wrk(routed, body, 8, 2)  # warm-up
        peers: dict[str, str] = {}
        procs: list[subprocess.Popen[bytes]] = []

        def add_router(name: str, port: int, cmd: list[str], log: str) -> None:
            """Start another router in front of the same upstream, wait for it, warm it up."""
            procs.append(start(cmd, tmp / log))
            wait_ready(f"http://127.0.0.1:{port}/ready")
            peers[name] = f"http://127.0.0.1:{port}/v1/completions"
            wrk(peers[name], body, 8, 2)

        if args.uvicorn:
            # the same app and proxy code under uvicorn: the A/B for kvrouter's own server
            cmd = [PY, "-c", UVICORN, str(router_config(tmp, mport, uport, tok)), str(uport)]
            add_router("kvrouter on uvicorn", uport, cmd, "router-uvicorn.log")
        if args.workers > 1:
            # the same router as several processes on one port (server.workers)
            wport = free_port()
            cmd = [PY, "-m", "router.cli", "serve", "--workers", str(args.workers)]
            cmd += ["--config", str(router_config(tmp, mport, wport, tok))]
            add_router(f"kvrouter, {args.workers} workers", wport, cmd, "router-workers.log")
        if args.vllm_router:
            for i, policy in enumerate(("round_robin", "kv_aware")):
                port, prom = free_port(), free_port()
                cmd = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port)]
                cmd += ["--worker-urls", f"http://127.0.0.1:{mport}", "--policy", policy]
                cmd += ["--prometheus-port", str(prom), "--log-level", "error"]
                procs.append(start(cmd, tmp / f"vllm-router-{i}.log"))
                url = f"http://127.0.0.1:{port}/v1/completions"
                deadline = time.monotonic() + 60
                while True:
                    try:
                        ok = httpx.post(url, content=body, headers={"content-type": "application/json"})
                        if ok.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vllm-router {policy} did not start")
                    time.sleep(0.2)
                peers[f"vllm-router {policy}"] = url
        rows = []
        try:
            cases = [(m, p, c, False) for m, p in (("non-stream", body), ("SSE", sse)) for c in (1, 32)]
            cases.append(("non-stream, unique prompts", body, 32, True))
            for mode, payload, conns, unique in cases:
                d_rps = wrk(direct, payload, conns, args.seconds, unique)
                r_rps = wrk(routed, payload, conns, args.seconds, unique)
                row: dict[str, Any] = {
                    "upstream": kind,
                    "mode": mode,
                    "c": conns,
                    "direct_rps": round(d_rps),
                    "router_rps": round(r_rps),
                    "ratio": round(r_rps / d_rps, 2) if d_rps else 0,
                }
                for name, url in peers.items():
                    p_rps = wrk(url, payload, conns, args.seconds, unique)
                    row[f"{name} rps"] = round(p_rps)
                    row[f"{name} ratio"] = round(p_rps / d_rps, 2) if d_rps else 0
                rows.append(row)
        finally:
            for proc in procs:
                stop(proc)
        print(json.dumps(rows), file=sys.stderr)
        return rows
    finally:
        stop(router)
        stop(mock)


def decision_latency(url: str, tok: Path, reps: int = 40) -> dict[str, Any]:
    """``/route``'s own ``timings_us.total`` (p50/p99 of ``reps``) for text prompts of ~1k/8k/32k
    tokens seen for the first time (a unique number in front: every token is tokenized), the same
    text again (the segment cache answers), and a chat whose earlier messages (the same sizes in
    ~500-token messages) were sent before, with a new final question each time (the next turn of a
    conversation: only the new message is tokenized)."""
    from router.decision.chat import ChatTokenizer
    from sim.toy_tokenizer import toy_corpus

    ct = ChatTokenizer.from_path(tok, cache_bytes=0)
    ids = ct.encode_prompt(" ".join(toy_corpus()), add_special_tokens=False)

    def text(n_tok: int, start: int = 0) -> str:
        start %= len(ids)
        return ct.decode((ids * (n_tok // len(ids) + 2))[start : start + n_tok])

    def measure(bodies: list[dict[str, Any]]) -> dict[str, Any]:
        times, tokens = [], 0
        with httpx.Client(timeout=60) as c:
            for b in bodies:
                j = c.post(url, json={"model": "toy", **b}).json()
                times.append(j["timings_us"]["total"])
                tokens = j["prompt_tokens"]
        times.sort()
        return {"prompt_tokens": tokens, "p50_us": times[len(times) // 2], "p99_us": times[-1]}

    out: dict[str, Any] = {}
    for n_tok in (1024, 8192, 32768):
        prompt = text(n_tok)
        first = measure([{"prompt": f"{i} {prompt}"} for i in range(reps)])
        measure([{"prompt": prompt}] * 2)  # a whole-text prompt is kept from its second sighting
        again = measure([{"prompt": prompt}] * reps)
        history: list[dict[str, str]] = [{"role": "system", "content": text(500)}]
        for k in range(1, max(n_tok // 500, 1)):
            history.append({"role": "user" if k % 2 else "assistant", "content": text(500, 977 * k)})
        if history[-1]["role"] == "user":
            history.append({"role": "assistant", "content": "Noted."})
        measure([{"messages": [*history, {"role": "user", "content": "Warm-up?"}]}])
        turn = measure(
            [{"messages": [*history, {"role": "user", "content": f"Question {i}?"}]} for i in range(reps)]
        )
        out[str(n_tok)] = {"text, first seen": first, "text, seen before": again, "chat, next turn": turn}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--ttft-requests", type=int, default=300)
    ap.add_argument(
        "--vllm-router",
        default=None,
        help="a vllm-router binary (pip install vllm-router in a separate venv), measured in the same run",
    )
    ap.add_argument(
        "--no-uvicorn",
        dest="uvicorn",
        action="store_false",
        help="skip the A/B run of the same app under uvicorn",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="also measure `kvrouter serve --workers N` (server.workers); 1 skips it",
    )
    ap.add_argument(
        "--upstreams",
        default="raw+25,raw,framework",
        help="zero-latency upstreams: raw (asyncio), raw+N (raw spending N us of CPU per request; "
        "raw+25 is calibrated to the issue's mock) and/or framework (FastAPI on uvicorn, as vLLM)",
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is required: apt-get install wrk")
    from sim.toy_tokenizer import build_toy_tokenizer

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = build_toy_tokenizer(tmp / "tok")
        body = json.dumps(
            {"model": "toy", "prompt": "Tell me about the old harbour and its ships", "max_tokens": 16}
        )
        sse = json.dumps(
            {"model": "toy", "prompt": "Tell me about the old harbour and its ships", "stream": True}
        )
        result["throughput"] = [
            row for kind in args.upstreams.split(",") for row in throughput(kind, args, tmp, tok, body, sse)
        ]

        # added TTFT with paced tokens
        mock, router, mport, rport = start_pair(tmp, tok, ["--chunks", "5", "--pace-ms", "20"], "paced")
        try:
            ttft(f"http://127.0.0.1:{rport}/v1/completions", 20)
            t_direct = ttft(f"http://127.0.0.1:{mport}/v1/completions", args.ttft_requests)
            t_routed = ttft(f"http://127.0.0.1:{rport}/v1/completions", args.ttft_requests)
            result["ttft_ms"] = {
                "direct_p50": round(statistics.median(t_direct) * 1e3, 3),
                "router_p50": round(statistics.median(t_routed) * 1e3, 3),
                "added_p50": round((statistics.median(t_routed) - statistics.median(t_direct)) * 1e3, 3),
            }
            result["decision_us"] = decision_latency(f"http://127.0.0.1:{rport}/route", tok)
        finally:
            stop(router)
            stop(mock)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
