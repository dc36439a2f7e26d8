"""What ``kvrouter serve`` loads to start: a router whose prompts are token ids (a lookup service,
the job Dynamo's indexer does) must start without the web framework, the chat machinery, httpx or
pyzmq's Python layer (each ms to tens of ms of start-up and MBs of RSS),
still probe its backends, and
index an engine's first KV event without numpy (the Python ingest path's; it cost a starting router
60-400 ms before its first block). Checked in a fresh interpreter, against a real backend and a real
ZMQ publisher in vLLM's layout on ephemeral ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BACKEND = r"""
import sys
sys.path.insert(0, "tests")
from backend_stub import probe_backend  # (asyncio only)
CARDS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
"""

SCRIPT = r"""
import asyncio, sys, time, tomllib
import msgspec
from index import zsock  # (the publisher too: this interpreter never imports pyzmq)
from router.app import KVRouter
from router.config import parse_config
import router.http.uvicorn_server, router.serve  # everything `kvrouter serve` imports

async def main():
    server = await asyncio.start_server(probe_backend(CARDS), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ctx = zsock.Context()
    pub = ctx.socket(1)  # PUB
    pub.setsockopt(zsock.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    toml = (
        f'block_size = 16\nremote_tokenize = true\n[[backends]]\nname = "a"\n'
        f'url = "http://127.0.0.1:{port}"\nkv_events = "{pub.getsockopt_string(zsock.LAST_ENDPOINT)}"\n'
    )
    router = KVRouter(parse_config(tomllib.loads(toml)))
    await router.startup()
    try:
        member = router.membership.get("a")
        print(member.healthy, sorted(member.models))
        event = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                 "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "extra_keys": [None]}
        deadline = time.monotonic() + 60
        seq = 0
        def indexed():
            status = router.index.status()  # (empty until the subscriber thread registered it)
            return status[0].blocks.get("GPU", 0) if status else 0

        while indexed() == 0:  # (until the subscription is up)
            assert time.monotonic() < deadline, router.index.status()
            payload = msgspec.msgpack.encode([time.time(), [event], 0])
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            await asyncio.sleep(0.02)
        print(router.index.status()[0].block_size)
        print(*(name in sys.modules for name in ("httpx", "fastapi", "jinja2", "tokenizers", "numpy")))
        # nor prometheus-client (kvrouter renders its metrics itself) or starlette (the framework
        # under FastAPI: uvicorn runs kvrouter's ASGI app, which builds FastAPI only for odd requests)
        print(*(name in sys.modules for name in ("prometheus_client", "starlette")))
        # nor what only Kubernetes discovery, several workers or the dashboard page need
        print(*(name in sys.modules for name in (
            "router.fleet.sources.kubernetes", "router.workers.supervisor", "importlib.resources")))
        # nor OpenSSL's hashes (hashlib, hmac), ctypes or pyzmq's Python layer (~10 ms of a start:
        # the subscriber's sockets are index/zsock.py's, on the libzmq pyzmq ships)
        print(*(name in sys.modules for name in ("hashlib", "hmac", "ctypes", "zmq")))
    finally:
        await router.shutdown()
        server.close()
        pub.close()
        ctx.term()

asyncio.run(main())
"""


def _fresh(script: str, env: dict[str, str] | None = None) -> str:
    """What ``script`` prints, run in a fresh interpreter from the repository's root."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_token_id_router_starts_and_indexes_without_httpx_fastapi_numpy_or_chat() -> None:
    stdout = _fresh(BACKEND + SCRIPT)
    lines = stdout.splitlines()
    assert lines[0] == "True ['m']", stdout  # probed (/health, /v1/models) over the upstream pool
    assert lines[1] == "16", stdout  # the first event indexed, its block size learned
    assert lines[2] == "False False False False False", stdout
    assert lines[3] == "False False", stdout
    assert lines[4] == "False False False", stdout
    assert lines[5] == "False False False False", stdout


CLI_SCRIPT = r"""
import argparse, sys
from router.cli import build_parser
parser = build_parser(serve_only=True)
args = parser.parse_args(["serve", "--config", "fleet.toml"])
print(args.command, args.config, "shutil" in sys.modules)
serve = parser._subparsers._group_actions[0].choices["serve"]
ours = [parser.format_help(), serve.format_help()]
parser.formatter_class = serve.formatter_class = argparse.HelpFormatter  # (imports shutil)
print(ours == [parser.format_help(), serve.format_help()])
"""


@pytest.mark.parametrize("columns", [None, "97"])
def test_the_cli_parses_serve_without_shutil_and_helps_as_argparse_does(columns: str | None) -> None:
    """argparse's own formatter imports shutil (and zlib, bz2, lzma) to learn the terminal's width;
    kvrouter's tells it the same width."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = columns
    stdout = _fresh(CLI_SCRIPT, env)
    assert stdout.splitlines() == ["serve fleet.toml False", "True"], stdout


HELP_SCRIPT = r"""
import contextlib, io, sys
from router.cli import build_parser, main
light, full = build_parser(sim=False), None
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--help"])
print("sim.engine" in sys.modules, "fastapi" in sys.modules)
full = build_parser()
same_usage = light.format_usage() == full.format_usage()
print(out.getvalue() == full.format_help() == light.format_help(), same_usage)
errors = []
for parser in (light, full):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        parser.parse_args(["no-such-command"])
    errors.append(err.getvalue())
print(errors[0] == errors[1] and "invalid choice" in errors[0])
"""


def test_kvrouter_help_lists_every_command_without_loading_the_simulator() -> None:
    """`kvrouter --help` (a newcomer's first command) lists the simulation commands from their
    names and help lines alone (sim/commands.py): the same text as the full parser's, ~1 s sooner."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    assert _fresh(HELP_SCRIPT, env).splitlines() == ["False False", "True True", "True"]


LISTEN_SCRIPT = r"""
import asyncio, os, socket, sys, tomllib
from router.app import KVRouter
from router.config import parse_config
from router.http.uvicorn_server import HttpServer, loop_factory

async def main():
    toml = 'admin_keys = ["k"]\n[server]\nhost = "127.0.0.1"\n'  # (no backend yet)
    router = KVRouter(parse_config(tomllib.loads(toml)))
    server = HttpServer(router)
    server.port = 0  # (an ephemeral port: the config's must be 1-65535)
    await server.start()
    tasks = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    resolvers = [t for t in tasks if t.startswith("libuv-worker")]  # (uvloop's pool: native threads)
    idna = "encodings.idna" in sys.modules
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", server.port))  # (the loop's would resolve)
    client.setblocking(False)
    await loop.sock_sendall(client, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        more = await loop.sock_recv(client, 4096)
        if not more:
            break
        answer += more
    client.close()
    print(answer.split(b"\r\n", 1)[0].decode(), answer.rsplit(b"\r\n", 1)[1].decode())
    print(idna, resolvers)
    port = server.port
    await server.stop()
    again = socket.socket()  # (SO_REUSEADDR: a closed connection's TIME_WAIT does not count, a
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # listener still would on Linux)
    again.bind(("127.0.0.1", port))
    again.close()
    print("released")

with asyncio.Runner(loop_factory=loop_factory()) as runner:
    runner.run(main())
"""


def test_a_numeric_listen_address_starts_no_resolver() -> None:
    """Listening on a literal address resolves nothing: no idna codec, no resolver threads (uvloop's
    create_server resolved 127.0.0.1 in a pool of 4 threads it started: ~5 ms of a warm start), and
    stopping the server releases the port."""
    lines = _fresh(LISTEN_SCRIPT).splitlines()
    assert lines[0] == 'HTTP/1.1 200 OK {"status":"ok"}', lines
    assert lines[1] == "False []", lines
    assert lines[2] == "released", lines


STARTING_SCRIPT = r"""
import asyncio, socket, tomllib
from router.app import KVRouter
from router.config import parse_config
from router.http.uvicorn_server import HttpServer, loop_factory

tried = []

async def try_router():  # while the router probes its backend (its start-up): is its port open?
    try:
        socket.create_connection(("127.0.0.1", server.port), timeout=30).close()
        tried.append("accepted")
    except ConnectionRefusedError:
        tried.append("refused")

async def main():
    global server
    up = await asyncio.start_server(probe_backend(CARDS, hold=try_router), "127.0.0.1", 0)
    toml = (f'[server]\nhost = "127.0.0.1"\n[health]\ntimeout_s = 30\n[[backends]]\nname = "a"\n'
            f'url = "http://127.0.0.1:{up.sockets[0].getsockname()[1]}"\nmodels = ["m"]\n')
    server = HttpServer(KVRouter(parse_config(tomllib.loads(toml))))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    server.port = probe.getsockname()[1]  # (an ephemeral port)
    probe.close()
    await server.start()
    print(*sorted(set(tried)))
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    client.sendall(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
    print((await loop.run_in_executor(None, client.recv, 4096)).split(b"\r\n", 1)[0].decode())
    client.close()
    await server.stop()
    up.close()

with asyncio.Runner(loop_factory=loop_factory()) as runner:
    runner.run(main())
"""


def test_the_port_is_refused_while_the_router_starts_then_served() -> None:
    """Bound before the start-up work but listening only once the router serves: while it probes
    its backend a client (or a TCP health check) is refused, as an L4 balancer's failover expects,
    not held in the backlog; then the router answers."""
    lines = _fresh(BACKEND + STARTING_SCRIPT).splitlines()
    assert lines == ["refused", "HTTP/1.1 200 OK"], lines


def test_a_taken_port_fails_before_any_backend_is_probed(tmp_path: Path) -> None:
    """`kvrouter serve` on a port in use exits 1 naming the address, without probing its backends
    or subscribing to anything first."""
    import errno
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class Backend(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    backend = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    serving = threading.Thread(target=backend.serve_forever, daemon=True)
    serving.start()
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "fleet.toml"
        cfg.write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {port}\n[[backends]]\nname = "a"\n'
            f'url = "http://127.0.0.1:{backend.server_address[1]}"\nmodels = ["m"]\n'
        )
        proc = subprocess.run(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert f"cannot serve: [Errno {errno.EADDRINUSE}] cannot listen on 127.0.0.1:{port}" in proc.stderr, (
            proc.stderr
        )
        assert hits == [], hits
    finally:
        taken.close()
        backend.shutdown()
        backend.server_close()
        serving.join(30)
