"""Prediction against a real hybrid engine: ``kvrouter serve`` and Dynamo's indexer on the same stream.

The stream is a real one: ``tests/fixtures/vllm_real/gemma3-small-kv-eviction.json``, frames a
Gemma3-shaped ``vllm serve`` engine (sliding window 64 beside full attention, 4 MiB of KV cache: heavy
eviction) published while serving 42 requests, with each request's token ids, the time it was
routed, and the ``cached_tokens`` the engine then reported. Both services subscribe to one publisher
that replays the engine's batches in the engine's order; before each request, the batches the engine
had published by then are sent, then a probe block, and once both services show the probe, each is
asked what it predicts for the request's prompt (at most ``prompt_tokens - 1`` tokens, as vLLM always
computes one). Prints, per service, how many predictions were exact, over or under.

    .venv/bin/python bench/hybrid_exact.py --dynamo /path/to/venv/bin/python [--json out.json]

Without ``--dynamo`` (a venv with ai-dynamo-runtime==1.6.1) only kvrouter is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import service_bench as sb  # noqa: E402  (the services as the service benchmark runs them)

CAPTURE = ROOT / "tests" / "fixtures" / "vllm_real" / "gemma3-small-kv-eviction.json"
BS = 32


def probe(n: int) -> tuple[bytes, list[int]]:
    """A one-block prompt of its own, stored in both groups (a hybrid hit needs the window too)."""
    tokens = [900_000 + n] * BS
    h = (1 << 62) + n
    evs = [
        {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": g,
            "kv_cache_spec_kind": kind,
            **({"kv_cache_spec_sliding_window": 64} if g == 0 else {}),
        }
        for g, kind in ((0, "sliding_window"), (1, "full_attention"))
    ]
    return msgspec.msgpack.encode([time.time(), evs, 0]), [*tokens, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dynamo", default=None, help="python of a venv with ai-dynamo-runtime==1.6.1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sb.BS = BS  # (the services' block size)
    capture = json.loads(CAPTURE.read_text())
    payloads = sorted(
        (bytes.fromhex(f[2]) for f in capture["frames"]), key=lambda p: msgspec.msgpack.decode(p)[0]
    )
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    mock_port = sb.free_port()
    mock = subprocess.Popen([sys.executable, str(ROOT / "bench" / "zero_mock.py"), str(mock_port)])
    verdicts: dict[str, Counter[str]] = {}
    try:
        sb.wait_listening(mock_port, mock)
        with tempfile.TemporaryDirectory(prefix="kvhybrid-") as tmp:
            svcs = sb.start_services(sb.have_dynamo(args.dynamo), [port], mock_port, Path(tmp))
            https = {svc.name: sb.Http(svc.port) for svc in svcs}
            try:
                probes = 0

                def settle() -> None:
                    """A probe sent until every service shows it: all sent before it is applied."""
                    nonlocal probes
                    deadline = time.monotonic() + 60
                    payload, tokens = probe(probes)
                    probes += 1
                    while True:
                        send(payload)
                        if all(svc.lookup(https[svc.name], tokens).get(0, 0) >= 1 for svc in svcs):
                            return
                        if time.monotonic() > deadline:
                            raise RuntimeError("a probe never showed")
                        time.sleep(0.05)

                settle()
                done = 0
                for row in sorted(capture["rows"], key=lambda r: r["t0"]):
                    while done < len(payloads) and msgspec.msgpack.decode(payloads[done])[0] < row["t0"]:
                        send(payloads[done])
                        done += 1
                    settle()
                    tokens = capture["prompts"][row["prompt"]]
                    cap = (len(tokens) - 1) // BS * BS
                    for svc in svcs:
                        got = min(svc.lookup(https[svc.name], tokens).get(0, 0) * BS, cap)
                        want = row["cached_tokens"]
                        verdict = "exact" if got == want else "over" if got > want else "under"
                        verdicts.setdefault(svc.name, Counter())[verdict] += 1
            finally:
                for h in https.values():
                    h.close()
                for svc in svcs:
                    svc.stop()
    finally:
        mock.terminate()
        mock.wait(timeout=10)
        pub.close(0)
        ctx.term()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "capture": CAPTURE.name,
        "requests": len(capture["rows"]),
        "verdicts": {name: dict(v) for name, v in verdicts.items()},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
