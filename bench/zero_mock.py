"""A zero-latency OpenAI-shaped upstream for proxy benchmarks: raw asyncio HTTP/1.1, keep-alive.

``python bench/zero_mock.py PORT [--chunks N] [--pace-ms MS] [--ttft-ms MS]``: non-stream requests
get a fixed JSON completion at once; ``"stream": true`` requests get N SSE chunks (the first at once,
the rest ``--pace-ms`` apart) and ``data: [DONE]``; ``--ttft-ms`` delays the first chunk (after the
response head, as vLLM sends it) and a non-stream answer (by the whole generation) like an engine's
prefill, so that the upstream has vLLM-like latencies without spending CPU on them; a P/D prefill
leg (``kv_transfer_params`` with ``do_remote_decode``) gets a completion with transfer parameters,
as a vLLM prefill engine answers. It answers /health, /v1/models and /tokenize (vllm-router's
kv_aware policy calls it) so routers accept it: by default with a fixed answer (no work at all),
with ``--tokenizer PATH`` by really tokenizing the prompt with that HF tokenizer.json, as a vLLM
engine's /tokenize does (and charges to the engine's CPU).
Deliberately minimal so that the upstream is not the bottleneck of the measurement.

``--framework``: the same answers from a FastAPI app under uvicorn (uvloop + httptools), the server
stack vLLM's OpenAI server runs on, so that the upstream costs per request what vLLM's HTTP layer
costs (without a model): the closer analogue of a real fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable

from fastapi import Request  # resolved from module globals by FastAPI (postponed annotations)

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": "hello world", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
).encode()
EVENT = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": " tok", "finish_reason": None}],
    }
).encode()
COMPLETION_PD = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": "hello", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [1, 2, 3],
            "remote_engine_id": "bench",
            "remote_request_id": "cmpl-bench",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        },
    }
).encode()
"""A prefill leg's answer (P/D): a request asking ``do_remote_decode`` gets transfer parameters."""
MODELS = json.dumps({"object": "list", "data": [{"id": "toy", "object": "model"}]}).encode()
HEALTH = b"{}"
TOKENIZE = json.dumps({"count": 12, "max_model_len": 4096, "tokens": list(range(100, 112))}).encode()


Tokenize = Callable[[bytes], bytes]


def fixed_tokenize(body: bytes) -> bytes:
    """The fixed /tokenize answer (no work)."""
    return TOKENIZE


def real_tokenize(path: str) -> Tokenize:
    """/tokenize answered by tokenizing ``prompt`` (or the messages' text) with the given tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)

    def answer(body: bytes) -> bytes:
        req = json.loads(body or b"{}")
        text = req.get("prompt")
        if not isinstance(text, str):
            messages = [m for m in req.get("messages", []) if isinstance(m, dict)]
            text = "\n".join(str(m.get("content", "")) for m in messages)
        ids = tok.encode(text, add_special_tokens=bool(req.get("add_special_tokens", True))).ids
        return json.dumps({"count": len(ids), "max_model_len": 32768, "tokens": ids}).encode()

    return answer


def _response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def handle(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    chunks: int,
    pace: float,
    cost: float = 0.0,
    tokenize: Tokenize = fixed_tokenize,
    ttft: float = 0.0,
) -> None:
    event = EVENT
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            length = 0
            for h in rest.split(b"\r\n"):
                if h[:15].lower() == b"content-length:":
                    length = int(h[15:])
            body = await reader.readexactly(length) if length else b""
            path = line.split(b" ")[1]
            if cost:  # --cost-us: CPU spent per request, to model a heavier HTTP layer
                end = time.perf_counter() + cost
                while time.perf_counter() < end:
                    pass
            if path == b"/health":
                writer.write(_response(HEALTH))
            elif path == b"/v1/models":
                writer.write(_response(MODELS))
            elif path == b"/tokenize":
                writer.write(_response(tokenize(body)))
            elif b'"do_remote_decode":true' in body.replace(b" ", b""):
                writer.write(_response(COMPLETION_PD))
            elif b'"stream":true' in body.replace(b" ", b""):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                if ttft:
                    await writer.drain()
                    await asyncio.sleep(ttft)
                for i in range(chunks):
                    if i and pace:
                        await writer.drain()
                        await asyncio.sleep(pace)
                    writer.write(_chunk(b"data: " + event + b"\n\n"))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                if ttft:
                    await asyncio.sleep(ttft + max(chunks - 1, 0) * pace)
                writer.write(_response(COMPLETION))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def main(
    port: int,
    chunks: int,
    pace: float,
    cost: float = 0.0,
    tokenize: Tokenize = fixed_tokenize,
    ttft: float = 0.0,
) -> None:
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, chunks, pace, cost, tokenize, ttft), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


def framework_app(chunks: int, pace: float, tokenize_fn: Tokenize = fixed_tokenize) -> object:
    """The same endpoints as a FastAPI app (vLLM's server stack)."""
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()
    event = EVENT

    @app.get("/health")
    async def health() -> Response:
        return Response(HEALTH, media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(MODELS, media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return Response(tokenize_fn(await request.body()), media_type="application/json")

    async def stream() -> object:
        for i in range(chunks):
            if i and pace:
                await asyncio.sleep(pace)
            yield b"data: " + event + b"\n\n"
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")  # type: ignore[arg-type]
        return Response(COMPLETION, media_type="application/json")

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--pace-ms", type=float, default=0.0)
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="raw mode: delay before the first chunk")
    ap.add_argument("--framework", action="store_true", help="FastAPI under uvicorn, as vLLM serves")
    ap.add_argument("--cost-us", type=float, default=0.0, help="raw mode: CPU microseconds per request")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json: /tokenize really tokenizes")
    a = ap.parse_args()
    tokenize_fn = real_tokenize(a.tokenizer) if a.tokenizer else fixed_tokenize
    if a.framework:
        import uvicorn

        uvicorn.run(
            framework_app(a.chunks, a.pace_ms / 1000, tokenize_fn),  # type: ignore[arg-type]
            host="127.0.0.1",
            port=a.port,
            log_level="warning",
            loop="uvloop",
            http="httptools",
        )
        raise SystemExit(0)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(a.port, a.chunks, a.pace_ms / 1000, a.cost_us / 1e6, tokenize_fn, a.ttft_ms / 1000))
