"""What ``kvrouter serve`` loads to start: a router whose prompts are token ids (a lookup service,
the job Dynamo's indexer does) must start without the web framework, the chat machinery or httpx
(each tens of ms of start-up and MBs of RSS; BENCHMARKS.md, issue 11), and still probe its backends.
Checked in a fresh interpreter, against a real backend on an ephemeral port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, sys, tomllib
from router.app import KVRouter
from router.config import parse_config
import router.http.server, router.serve  # everything `kvrouter serve` imports

CARDS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'

async def backend(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1]
            body = CARDS if path == b"/v1/models" else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(backend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    toml = f'remote_tokenize = true\n[[backends]]\nname = "a"\nurl = "http://127.0.0.1:{port}"\n'
    router = KVRouter(parse_config(tomllib.loads(toml)))
    await router.startup()
    try:
        member = router.membership.get("a")
        print(member.healthy, sorted(member.models))
        print(*(name in sys.modules for name in ("httpx", "fastapi", "jinja2", "tokenizers")))
    finally:
        await router.shutdown()
        server.close()

asyncio.run(main())
"""


def test_a_token_id_router_starts_without_httpx_fastapi_or_the_chat_machinery() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "True ['m']", proc.stdout  # probed (/health, /v1/models) over the upstream pool
    assert lines[1] == "False False False False", proc.stdout
