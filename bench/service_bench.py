"""The index as a service: the real ``kvrouter serve`` beside NVIDIA Dynamo's standalone indexer, on
the same event stream, in one run.

``.venv/bin/python bench/service_bench.py [--dynamo /path/to/venv/bin/python] [--quick]``
(``make bench`` runs it as ``--only service``). Dynamo's indexer is a benchmark tool installed in its
own venv (``pip install ai-dynamo-runtime==1.6.1``), never a project dependency; without
``--dynamo`` (or with a python that cannot import it) its column is skipped with a message.

Everything runs on 127.0.0.1 and every phase is bounded in time. Both services subscribe to the
same ZMQ PUB sockets (vLLM 0.33's frames and fields: ``[topic, seq u64 BE, payload]``, map events with
``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``; the maps in msgpack's short form where vLLM
writes 16-bit maps, the batch's rank field the source's number: both services read either the same
way), served by publisher processes that send
pre-encoded messages (so the publisher is never the bottleneck) with an unlimited send high-water
mark (nothing is dropped while the services are stopped).

Phases, per stream (sources x events per batch):

- **drain**: both services SIGSTOPped, the whole stream queued in their sockets, then SIGCONT
  (together, each in its own session: ``--share``, :data:`SESSIONS`; or one at a time, ``--drain
  alone``) and timed to the moment the last chain of every source is visible through each lookup endpoint
  (kvrouter ``POST /route``, Dynamo ``POST /query``); CPU seconds of each process from /proc over
  the same interval; RSS before the first event and after. Each stream drains ``--drain-repeats``
  times (3), each time into fresh services, and the run reports the median (:func:`median_drain`).
- **loss check**: sampled chains looked up on both; every one must match in full on its source.
- **paced ingest** (first stream only): the publishers send at a fixed rate, both services running;
  CPU per block and the lag from the last send to the last chain visible.
- **lookups**: p50/p99 over HTTP of prompts of 1k/8k/32k tokens, fully cached (hit), half cached,
  and not cached (miss); ``GET /health`` p50. A keep-alive raw-socket client, so the client costs
  little and the same for both. Three times: as the kernel places the processes, then with each
  service pinned to the client's vCPU and to the other vCPU (:func:`placements` says why).
- **start to subscribed**: from process start to the first event visible through the lookup
  endpoint, on a cold machine (page cache dropped where permitted, no bytecode caches: a fresh
  install) and a warm one.

Workload: chains of 1-384 blocks (block size 16) in 32 families sharing a prefix of up to 16
blocks; each source publishes its chains as BlockStored events of 1-31 blocks (a cached family
prefix is not announced again, as vLLM does not), one event per batch or 8-24 events per batch (a
busy engine's step: one event per request that filled blocks).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
KVROUTER = str(Path(PY).parent / "kvrouter")
"""The ``kvrouter`` measured: this venv's, or ``--kvrouter`` (e.g. a production install's, without
the test extras: in the development venv schemathesis brings rich, which httpx's command-line module
imports whenever it is installed, ~4 MB and ~40 ms that a ``pip install .`` never has)."""
SESSIONS = True
"""Each service starts in a session of its own (``--share services``, the default). Why: on Linux
with autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) the CPU is
shared between sessions first, then between the threads inside one, as it is between the containers
or systemd units the two services run in when deployed. Started as children of the benchmark's own
session, the two shared the two cores thread by thread, so a service got more of the box the more
busy threads it ran: in a drain where both compete, that measured thread counts, not speed
(before sessions of their own). ``--share threads`` keeps that mode for comparison."""
BS = 16
FAMILIES = 32
FAMILY_BLOCKS = 16
TICK = os.sysconf("SC_CLK_TCK")
LATENCY_BLOCKS = {"1k": 64, "8k": 512, "32k": 2048}
SENTINEL = (-2, 77_777, 4)
"""(family, seed, blocks) of the chain every source publishes last, the same tokens on all: one
lookup then shows whether every source's stream is applied. Checking each source's own last chain
took one lookup per source in turn, and over 64 sources that serial confirmation was 55-127 ms of a
0.3-0.45 s drain for either service (their lookup speed, measured in its own row, not ingest)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---- workload -----------------------------------------------------------------------------------
def family_tokens(f: int) -> list[int]:
    rng = random.Random(1_000_003 * (f + 1))
    return [rng.randrange(32_000) for _ in range(FAMILY_BLOCKS * BS)]


def chain_tokens(family: int, seed: int, blocks: int) -> list[int]:
    """A chain's tokens: its family's prefix (up to 16 blocks), then tokens of its own."""
    fam = family_tokens(family)[: min(blocks, FAMILY_BLOCKS) * BS] if family >= 0 else []
    rng = random.Random(seed)
    return fam + [rng.randrange(32_000) for _ in range(blocks * BS - len(fam))]


def block_hashes(tokens: list[int], parent: int = 0) -> list[int]:
    """vLLM-like content hashes: each block's hash covers its parent's and its tokens (64 bits)."""
    out = []
    h = parent
    for i in range(len(tokens) // BS):
        raw = h.to_bytes(8, "little") + msgspec.msgpack.encode(tokens[i * BS : (i + 1) * BS])
        h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        out.append(h)
    return out


class Chain(msgspec.Struct, array_like=True):
    source: int
    family: int
    seed: int
    blocks: int


class Stream(msgspec.Struct):
    sources: int
    payloads: list[list[bytes]]
    """Per source, the pre-encoded payloads in order."""
    chains: list[Chain]
    long: dict[str, Chain]
    """The latency chains (source 0, published first)."""
    blocks: int
    batches: int
    hybrid: bool = False
    """Each full-attention event beside a sliding-window group's, as a hybrid model publishes."""


HYBRID_WINDOW_BLOCKS = 4
"""The sliding-window group's window, in blocks, of the hybrid stream (Gemma3-shaped: that group
announces only the last blocks of each newly cached range, over the whole range's tokens)."""


def _event(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def _sliding(full: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window group's event beside a full-attention group's (group 1) one."""
    full["group_idx"] = 1
    keep = full["block_hashes"][-HYBRID_WINDOW_BLOCKS:]
    return {
        **full,
        "block_hashes": keep,
        "extra_keys": [None] * len(keep),
        "group_idx": 0,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": HYBRID_WINDOW_BLOCKS * BS,
    }


def make_stream(sources: int, total_blocks: int, multi: bool, seed: int = 7, hybrid: bool = False) -> Stream:
    """Per source, events of its chains in order, grouped into batches; deterministic. ``hybrid``: a
    sliding-window group's event before each full-attention one, in the same batch."""
    rng = random.Random(seed)
    per_source = total_blocks // sources
    events: list[list[dict[str, Any]]] = [[] for _ in range(sources)]
    chains: list[Chain] = []
    long: dict[str, Chain] = {}
    blocks = 0
    for s in range(sources):
        cached: set[int] = set()
        n = 0
        todo: list[Chain] = []
        if s == 0:
            for name, size in LATENCY_BLOCKS.items():
                long[name] = Chain(0, -1, 9_000 + size, size)
                todo.append(long[name])
        while n < per_source:
            c = Chain(s, rng.randrange(FAMILIES), rng.getrandbits(40), rng.randint(1, 384))
            todo.append(c)
            n += c.blocks
        todo.append(Chain(s, *SENTINEL))
        for c in todo:
            tokens = chain_tokens(c.family, c.seed, c.blocks)
            hashes = block_hashes(tokens)
            first = 0
            while first < c.blocks and hashes[first] in cached:
                first += 1
            while first < c.blocks:
                k = min(rng.randint(1, 31), c.blocks - first)
                parent = hashes[first - 1] if first else None
                ev = _event(hashes[first : first + k], parent, tokens[first * BS : (first + k) * BS])
                if hybrid:
                    events[s].append(_sliding(ev))
                events[s].append(ev)
                cached.update(hashes[first : first + k])
                blocks += k
                first += k
            if c.family >= 0:
                chains.append(c)
    enc = msgspec.msgpack.Encoder()
    payloads: list[list[bytes]] = []
    batches = 0
    ts = time.time()
    for s in range(sources):
        out = []
        evs = events[s]
        i = 0
        while i < len(evs):
            k = rng.randint(8, 24) if multi else 2 if hybrid else 1
            out.append(enc.encode([ts, evs[i : i + k], s]))
            i += k
        batches += len(out)
        payloads.append(out)
    return Stream(sources, payloads, chains, long, blocks, batches, hybrid)


def probe_payload(s: int, rank: int = 0) -> tuple[bytes, list[int]]:
    tokens = [700_000 + s] * BS
    return msgspec.msgpack.encode([time.time(), [_event([(1 << 62) + s], None, tokens)], rank]), tokens


# ---- publisher processes -----------------------------------------------------------------------------
def publisher_main(path: str) -> int:
    """``service_bench.py --publisher FILE``: bind PUB sockets, then obey commands on stdin.

    Commands: ``probe`` (send one probe message per socket), ``go`` (send every queued payload as
    fast as possible), ``pace R`` (send them at R blocks/s in all), ``quit``. Replies ``ok`` lines.
    """
    import zmq

    spec = msgspec.msgpack.decode(Path(path).read_bytes())
    ctx = zmq.Context(io_threads=1)
    socks = []
    ports = []
    for source, payloads, blocks in spec:
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)  # unlimited: nothing dropped while the services are stopped
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDBUF, 4 << 20)
        # an ephemeral port bound here and reported: a port picked by the parent could be taken
        # by any other connection before this bind
        ports.append(sock.bind_to_random_port("tcp://127.0.0.1"))
        socks.append([sock, source, payloads, blocks, 0])
    print("ok ready " + " ".join(map(str, ports)), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "probe":
            for entry in socks:
                sock, source, _, _, seq = entry
                payload, _ = probe_payload(source)
                sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                entry[4] = seq + 1
            print("ok probed", flush=True)
        elif cmd[0] in ("go", "pace"):
            rate = float(cmd[1]) if cmd[0] == "pace" else 0.0
            t0 = time.perf_counter()
            sent_blocks = 0
            # round robin over the sockets, one message each, as engines publish side by side
            idx = [0] * len(socks)
            left = sum(len(e[2]) for e in socks)
            while left:
                for k, entry in enumerate(socks):
                    sock, _, payloads, blocks, seq = entry
                    i = idx[k]
                    if i >= len(payloads):
                        continue
                    sock.send_multipart([b"", seq.to_bytes(8, "big"), payloads[i]], copy=False)
                    entry[4] = seq + 1
                    idx[k] = i + 1
                    left -= 1
                    sent_blocks += blocks[i]
                    if rate:
                        wait = t0 + sent_blocks / rate - time.perf_counter()
                        if wait > 0.001:
                            time.sleep(wait)
            print(f"ok sent {time.perf_counter() - t0:.4f}", flush=True)
        elif cmd[0] == "quit":
            break
    for entry in socks:
        entry[0].close()
    ctx.term()
    return 0


class Publishers:
    """Publisher processes serving the sources' PUB sockets (a few sockets per process)."""

    def __init__(self, stream: Stream | None, sources: int, per_proc: int, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        for first in range(0, sources, per_proc):
            spec = []
            for s in range(first, min(first + per_proc, sources)):
                payloads = stream.payloads[s] if stream else []
                blocks = [self._blocks(p) for p in payloads] if stream else []
                spec.append([s, payloads, blocks])
            path = tmp / f"pub-{first}.msgpack"
            path.write_bytes(msgspec.msgpack.encode(spec))
            proc = subprocess.Popen(
                [PY, str(Path(__file__).resolve()), "--publisher", str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self.procs.append(proc)
        # "ok ready PORT ...": each process's sockets, in source order
        self.ports = [int(p) for line in self.command(None) for p in line.split()[2:]]
        assert len(self.ports) == sources, self.ports

    @staticmethod
    def _blocks(payload: bytes) -> int:
        return sum(len(ev["block_hashes"]) for ev in msgspec.msgpack.decode(payload)[1])

    def command(self, cmd: str | None) -> list[str]:
        for p in self.procs:
            if cmd is not None:
                assert p.stdin is not None
                p.stdin.write(cmd + "\n")
                p.stdin.flush()
        out = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if not line.startswith("ok"):
                raise RuntimeError(f"publisher: {line!r}")
            out.append(line)
        return out

    def cpu(self) -> float:
        """CPU seconds of the publisher processes (all threads)."""
        total = 0.0
        for p in self.procs:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
        return total

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- HTTP --------------------------------------------------------------------------------------------
class Http:
    """A keep-alive HTTP/1.1 client over one raw socket: little client cost per request."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        if body:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        data = head.encode() + b"\r\n" + body
        for attempt in (0, 1):
            if self.sock is None:
                self.sock = self._connect()
            try:
                self.sock.sendall(data)
                return self._read()
            except (OSError, ConnectionError):
                self.sock.close()
                self.sock = None
                if attempt:
                    raise
        raise RuntimeError("unreachable")

    def _read(self) -> tuple[int, bytes]:
        assert self.sock is not None
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            while len(rest) < n:
                chunk = self.sock.recv(max(65536, n - len(rest)))
                if not chunk:
                    raise ConnectionError("closed")
                rest += chunk
            body = rest[:n]
        else:  # chunked
            body = b""
            while True:
                while b"\r\n" not in rest:
                    rest += self.sock.recv(65536)
                size_line, rest = rest.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                while len(rest) < size + 2:
                    rest += self.sock.recv(65536)
                body += rest[:size]
                rest = rest[size + 2 :]
                if size == 0:
                    break
        if headers.get(b"connection", b"").lower() == b"close":
            self.sock.close()
            self.sock = None
        return status, body

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# ---- the two services ------------------------------------------------------------------------------
class Service:
    name = ""
    proc: subprocess.Popen[bytes] | None = None
    port = 0
    sources = 0
    """The event sources it follows (numbered 0..sources-1 in lookups)."""

    def query_body(self, tokens: list[int]) -> bytes:
        raise NotImplementedError

    def matched(self, body: bytes) -> dict[int, int]:
        """Blocks matched per source index."""
        raise NotImplementedError

    def lookup(self, http: Http, tokens: list[int]) -> dict[int, int]:
        status, body = http.request("POST", self.path, self.query_body(tokens))
        if status != 200:
            raise RuntimeError(f"{self.name}: {status} {body[:200]!r}")
        return self.matched(body)

    path = ""

    # /proc figures
    def cpu(self) -> float:
        """CPU seconds of every thread, from the scheduler's nanosecond counters
        (``/proc/PID/task/*/schedstat``): the tick-based utime + stime of ``/proc/PID/stat`` counts
        10 ms ticks, up to +-20% of kvrouter's ~0.1 CPU-s drains (measured 2026-11-26: -3% to +6%
        in three drains). A thread that ends between two readings takes its time with it; neither
        service starts or ends threads while it is measured."""
        assert self.proc is not None
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # (a thread gone meanwhile)
        return total / 1e9

    def threads(self) -> dict[str, float]:
        """CPU seconds per thread (tid:comm), to see where a service spends."""
        assert self.proc is not None
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            out[f"{task.name}:{comm}"] = (int(fields[11]) + int(fields[12])) / TICK
        return out

    def switches(self) -> dict[str, tuple[int, int]]:
        """Context switches per thread (tid:comm): (voluntary, preempted). Many voluntary ones
        in a drain mean a thread waited for work (a stall in its pipeline); preempted ones, that
        another process took its core."""
        assert self.proc is not None
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                comm = (task / "comm").read_text().strip()
                lines = (task / "status").read_text().splitlines()
            except OSError:
                continue
            vals = {k: v for k, _, v in (ln.partition(":") for ln in lines)}
            voluntary = int(vals.get("voluntary_ctxt_switches", 0))
            out[f"{task.name}:{comm}"] = (voluntary, int(vals.get("nonvoluntary_ctxt_switches", 0)))
        return out

    def rss(self, field: str = "VmRSS") -> int:
        """Resident bytes (``field``: VmRSS, or its parts RssAnon, RssFile, RssShmem)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.killed()

    def killed(self) -> None:
        """After a kill: what the process leaves running."""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)


class KvRouter(Service):
    name = "kvrouter"
    path = "/route"

    def __init__(
        self,
        ports: list[int],
        mock_port: int,
        tmp: Path,
        env: dict[str, str] | None = None,
        container: str | None = None,
    ) -> None:
        """``container``: run the image this command line starts instead of the local executable
        (:func:`container_command`)."""
        self.port = free_port()
        self.container = container
        self.sources = len(ports)
        lines = [
            f"block_size = {BS}",
            "remote_tokenize = false",
            "[server]",
            'host = "127.0.0.1"',
            f"port = {self.port}",
            f'log_level = "{"info" if os.environ.get("KVBENCH_LOGS") else "warning"}"',
            "[health]",
            "interval_s = 3600.0",
            *os.environ.get("KVBENCH_CONFIG", "").split(";"),  # (experiments: more TOML lines, ";"-separated)
        ]
        for s, p in enumerate(ports):
            lines += [
                "[[backends]]",
                f'name = "e{s}"',
                f'url = "http://127.0.0.1:{mock_port}"',
                f'kv_events = "tcp://127.0.0.1:{p}"',
                'models = ["default"]',
            ]
        cfg = tmp / f"fleet-{self.port}.toml"
        cfg.write_text("\n".join(lines) + "\n")
        self.t_start = time.perf_counter()
        logs = os.environ.get("KVBENCH_LOGS")  # a directory: keep each kvrouter's log there
        cmd = [KVROUTER, "serve", "--config", str(cfg)]
        self.container_name = f"kvbench-{self.port}" if container and "{name}" in container else None
        if container:
            cmd = container_command(container, cfg, self.container_name or "")
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=open(Path(logs) / f"kvrouter-{self.port}.log", "wb") if logs else subprocess.DEVNULL,  # noqa: SIM115
            start_new_session=SESSIONS,
        )

    def killed(self) -> None:
        """A container engine's process killed leaves its container running: removed by name."""
        if self.container and self.container_name:
            engine = shlex.split(self.container)[0]
            subprocess.run([engine, "rm", "-f", self.container_name], capture_output=True, timeout=60)

    def query_body(self, tokens: list[int]) -> bytes:
        return msgspec.json.encode({"model": "default", "prompt": tokens})

    def matched(self, body: bytes) -> dict[int, int]:
        out = {}
        for c in msgspec.json.decode(body)["candidates"]:
            out[int(c["backend"][1:])] = c["matched_blocks"]
        return out


def container_command(template: str, config: Path, name: str) -> list[str]:
    """The command line that starts kvrouter's container image on ``config``: ``template`` with
    ``{config}`` (and ``{name}``, a name for this container) replaced, e.g. ``podman run --rm
    --network=host --name {name} -v {config}:/etc/kvrouter/fleet.toml:ro kvrouter:dev`` (the image's
    default arguments serve that file; host networking, as the publishers and the mock backend
    listen on 127.0.0.1). With ``{name}``, a container that outlives its engine's process is removed."""
    return [part.replace("{config}", str(config)).replace("{name}", name) for part in shlex.split(template)]


class Dynamo(Service):
    name = "dynamo"
    path = "/query"

    def __init__(self, python: str, ports: list[int], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.sources = len(ports)
        workers = ",".join(f"{s + 1}=tcp://127.0.0.1:{p}" for s, p in enumerate(ports))
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                python,
                "-m",
                "dynamo.indexer",
                "--port",
                str(self.port),
                "--block-size",
                str(BS),
                "--threads",
                "1",
                "--workers",
                workers,
            ],
            env={**os.environ, "RUST_LOG": "warn", **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=SESSIONS,
        )

    def query_body(self, tokens: list[int]) -> bytes:
        return msgspec.json.encode({"model_name": "default", "token_ids": tokens})

    def matched(self, body: bytes) -> dict[int, int]:
        out = {}
        for worker, ranks in msgspec.json.decode(body).get("scores", {}).items():
            out[int(worker) - 1] = max(ranks.values()) // BS if ranks else 0
        return out


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Wait until a process accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nothing listening on port {port}") from None
            time.sleep(0.02)


def wait_http(svc: Service, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    http = Http(svc.port)
    while time.monotonic() < deadline:
        assert svc.proc is not None
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode}")
        try:
            status, _ = http.request("GET", "/health")
            if status == 200:
                http.close()
                return time.perf_counter()
        except OSError:
            http.close()
        # the resolution of the start-up figures (20 ms before 2026-11-26 13:00, 5 ms until 15:10): a
        # kvrouter that binds first holds the connection until it answers, Dynamo's indexer refuses it
        time.sleep(0.001)
    raise RuntimeError(f"{svc.name} not healthy in {timeout}s")


def sentinel_targets(stream: Stream) -> list[tuple[int, list[int], int]]:
    """The drain's one target: the :data:`SENTINEL` chain, on every source (source -1)."""
    family, seed, blocks = SENTINEL
    tokens = chain_tokens(family, seed, blocks)
    # (a hybrid model serves at most prompt - 1 tokens from cache: one more token shows all of it)
    return [(-1, [*tokens, 1] if stream.hybrid else tokens, blocks)]


def wait_visible(
    svcs: list[Service],
    targets: list[tuple[int, list[int], int]],
    timeout: float,
    between: float = 0.005,
    confirm: dict[str, float] | None = None,
) -> dict[str, float]:
    """Poll every service (one thread each, ``between`` seconds apart, so a slow endpoint delays
    neither the other's detection nor loads its own process much: a /route over 64 candidates
    costs ~0.9 ms, polled every 2 ms it took a third of a core from the drain it measures) until
    each (source, tokens, blocks) target is fully matched (source -1: on every source of the
    stream); the time each service finished.
    ``confirm`` receives, per service, the seconds from the last answer that still missed a target
    to the finish: the serial confirmation of the targets found visible meanwhile (one lookup each),
    which the finish includes."""
    done: dict[str, float] = {}
    errors: list[str] = []

    def poll(svc: Service) -> None:
        http = Http(svc.port)
        todo = list(targets)
        deadline = time.monotonic() + timeout
        last_miss = time.perf_counter()
        try:
            while todo:
                if time.monotonic() > deadline:
                    errors.append(f"{svc.name}: {len(todo)} targets not visible in {timeout}s")
                    return
                source, tokens, blocks = todo[-1]
                try:
                    found = svc.lookup(http, tokens)
                    if source >= 0:
                        ok = found.get(source, 0) == blocks
                    else:
                        ok = all(found.get(s, 0) == blocks for s in range(svc.sources))
                except (OSError, ConnectionError):
                    ok = False
                if ok:
                    todo.pop()
                    continue
                last_miss = time.perf_counter()
                if between:
                    time.sleep(between)
            done[svc.name] = time.perf_counter()
            if confirm is not None:
                confirm[svc.name] = done[svc.name] - last_miss
        finally:
            http.close()

    threads = [threading.Thread(target=poll, args=(svc,)) for svc in svcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return done


# ---- phases ------------------------------------------------------------------------------------------
def start_services(dynamo_py: str | None, ports: list[int], mock_port: int, tmp: Path) -> list[Service]:
    svcs: list[Service] = [KvRouter(ports, mock_port, tmp)]
    if dynamo_py:
        svcs.append(Dynamo(dynamo_py, ports))
    for svc in svcs:
        wait_http(svc)
    return svcs


def subscribe(svcs: list[Service], pubs: Publishers, sources: int, timeout: float = 60) -> None:
    """Probe every source until both services show its probe block (the subscriptions are live)."""
    deadline = time.monotonic() + timeout
    targets = [(s, probe_payload(s)[1], 1) for s in range(sources)]
    while True:
        pubs.command("probe")
        try:
            wait_visible(svcs, targets, timeout=1.0, between=0.01)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise


SETTLE_S = 0.5
"""Seconds from a drain's end to the settled RSS reading."""


def drain(
    svcs: list[Service], pubs: Publishers, stream: Stream, sample: int, seed: int, alone: bool = False
) -> dict[str, dict[str, Any]]:
    """Stop every service, queue the whole stream, continue and time each until the last chain of
    every source is visible. ``alone``: one service continues at a time while the others stay
    stopped (their stream still queued), so that each drains with the box to itself instead of
    competing with the other for the two cores."""
    rss0 = {svc.name: svc.rss() for svc in svcs}
    anon0 = {svc.name: svc.rss("RssAnon") for svc in svcs}
    for svc in svcs:
        svc.signal(signal.SIGSTOP)
    sent = pubs.command("go")
    time.sleep(0.5)
    cpu0 = {svc.name: svc.cpu() for svc in svcs}
    pub0 = pubs.cpu()
    threads0 = {svc.name: svc.threads() for svc in svcs}
    switches0 = {svc.name: svc.switches() for svc in svcs}
    targets = sentinel_targets(stream)
    spy = None
    profiler = os.environ.get("KVBENCH_PROFILE")
    if profiler:  # profile kvrouter's drain, e.g. KVBENCH_PROFILE="perf record -g -p {pid} -o perf.data"
        assert svcs[0].proc is not None
        cmd = profiler.format(pid=svcs[0].proc.pid, blocks=stream.blocks).split()
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    t0s: dict[str, float] = {}
    done: dict[str, float] = {}
    confirm: dict[str, float] = {}
    if alone:
        for svc in svcs:
            t0s[svc.name] = time.perf_counter()
            svc.signal(signal.SIGCONT)
            done |= wait_visible([svc], targets, timeout=300, confirm=confirm)
    else:
        t0 = time.perf_counter()
        for svc in svcs:
            t0s[svc.name] = t0
            svc.signal(signal.SIGCONT)
        done = wait_visible(svcs, targets, timeout=300, confirm=confirm)
    pub_cpu = pubs.cpu() - pub0
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    out: dict[str, Any] = {}
    for svc in svcs:
        secs = done[svc.name] - t0s[svc.name]
        cpu = svc.cpu() - cpu0[svc.name]
        out[svc.name] = {
            "seconds": round(secs, 3),
            "blocks_per_s": round(stream.blocks / secs),
            "confirm_ms": round(confirm[svc.name] * 1e3, 1),
            "cpu_s": round(cpu, 3),
            "blocks_per_cpu_s": round(stream.blocks / cpu) if cpu else None,
            "rss_before_mb": round(rss0[svc.name] / 2**20, 1),
            "rss_after_mb": round(svc.rss() / 2**20, 1),
            "rss_per_block_b": round((svc.rss() - rss0[svc.name]) / stream.blocks, 1),
            # its anonymous part (heap, tables; not pages of code and libraries read in meanwhile)
            "rss_anon_per_block_b": round((svc.rss("RssAnon") - anon0[svc.name]) / stream.blocks, 1),
            "thread_cpu_s": {
                k: round(v - threads0[svc.name].get(k, 0.0), 3)
                for k, v in svc.threads().items()
                if v - threads0[svc.name].get(k, 0.0) > 0.005
            },
            "thread_switches": {
                k: (v[0] - before[0], v[1] - before[1])
                for k, v in svc.switches().items()
                if v != (before := switches0[svc.name].get(k, (0, 0)))
            },
        }
    rng = random.Random(seed)
    picks = rng.sample(stream.chains, min(sample, len(stream.chains)))
    for svc in svcs:
        http = Http(svc.port)
        bad = 0
        for c in picks:
            if svc.lookup(http, chain_tokens(c.family, c.seed, c.blocks)).get(c.source, 0) != c.blocks:
                bad += 1
        http.close()
        out[svc.name]["sampled_chains"] = len(picks)
        out[svc.name]["chains_missing"] = bad
    # and once settled: at the drain's end a process may still hold the burst's receive buffers
    # (kvrouter gives its heap back after 100 ms without messages), which are not memory per block
    time.sleep(max(0.0, SETTLE_S - (time.perf_counter() - max(done.values()))))
    for svc in svcs:
        out[svc.name]["rss_settled_per_block_b"] = round((svc.rss() - rss0[svc.name]) / stream.blocks, 1)
    out["_publishers"] = {"sent": sent, "cpu_s_during_drain": round(pub_cpu, 3)}
    return out


def median_drain(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Each service's figures, field by field, as the median over a stream's drains (each into fresh
    services); every drain is kept under ``repeats``, and ``ratio`` gives kvrouter's blocks/s over
    Dynamo's as the median of the drains' ratios (each drain pairs the two in the same seconds).

    Why repeat: a drain of 200k blocks lasts ~0.1-0.3 s, a few of the scheduler's time slices on two
    shared cores, and one drain's figure moves with which of the box's other threads ran in those
    slices (a drain where kvrouter got 0.4 of a core read 0.85x between drains of 1.6x-2.5x:
    on two shared cores). The median of three is the figure a run reports; the spread stays in the JSON."""
    if len(repeats) == 1:
        return repeats[0]
    out: dict[str, Any] = {"repeats": repeats}
    for name in repeats[0]:
        if name.startswith("_"):
            continue
        rows = [r[name] for r in repeats]
        med: dict[str, Any] = {}
        for field, value in rows[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                vals = [row[field] for row in rows if row.get(field) is not None]
                med[field] = statistics.median(vals) if vals else None
        # a chain missing in any drain is a loss: counted over all of them, never a median
        med["chains_missing"] = sum(row["chains_missing"] for row in rows)
        med["sampled_chains"] = sum(row["sampled_chains"] for row in rows)
        out[name] = med
    if "kvrouter" in out and "dynamo" in out:
        ratios = [r["kvrouter"]["blocks_per_s"] / r["dynamo"]["blocks_per_s"] for r in repeats]
        out["ratio"] = {
            "blocks_per_s_median": round(statistics.median(ratios), 3),
            "blocks_per_s_each": [round(x, 3) for x in ratios],
        }
    return out


BLOCK = 50
"""Lookups per turn of a service in the latency phase."""


def placements() -> list[tuple[str, tuple[int, int] | None]]:
    """Where the latency phase runs the services and the client: as the kernel places them, then
    pinned, each service's threads on the client's vCPU ("same vCPU") and on the other one ("other
    vCPU"), the client on the same vCPU throughout.

    Why pinned too: on this VM a request is ~0.03 ms when the woken server runs on the client's vCPU
    (a hand-over, no wake-up of an idle vCPU) and ~0.1 ms when it runs on the other one, whatever
    the server. Unpinned, which of the two a server gets is decided by where its thread happened
    to be: Linux wakes a thread on its previous vCPU while that one is idle, so whichever service
    once landed beside the client stays there for the rest of the phase (``perf sched timehist``:
    Dynamo's worker on the client's vCPU for a whole run, kvrouter's loop on the other; alone, each
    of them, and a bare uvloop echo server, sit on the other vCPU, ~0.1 ms). The pinned rows compare
    the servers in each case; the unpinned rows are kept to show what a client saw."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return [("as placed", None)]
    return [("as placed", None), ("same vCPU", (cpus[1], cpus[1])), ("other vCPU", (cpus[0], cpus[1]))]


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto ``cpus`` (threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(int(task.name), cpus)


def latency(svcs: list[Service], stream: Stream, n: int) -> dict[str, dict[str, Any]]:
    """:func:`lookups` in each of :func:`placements`: ``{service: {placement: rows}}``."""
    out: dict[str, dict[str, Any]] = {svc.name: {} for svc in svcs}
    everywhere = os.sched_getaffinity(0)
    for name, cpus in placements():
        if cpus is not None:
            for svc in svcs:
                assert svc.proc is not None
                _pin(svc.proc.pid, {cpus[0]})
            os.sched_setaffinity(0, {cpus[1]})
        try:
            rows = lookups(svcs, stream, n)
        finally:
            if cpus is not None:
                os.sched_setaffinity(0, everywhere)
                for svc in svcs:
                    assert svc.proc is not None
                    _pin(svc.proc.pid, everywhere)
        for svc in svcs:
            out[svc.name][name] = rows[svc.name]
    return out


def lookups(svcs: list[Service], stream: Stream, n: int) -> dict[str, dict[str, Any]]:
    """p50/p99 of lookups, the services taking turns in blocks of :data:`BLOCK` requests (one, then
    the other, then the other way round), so that a burst of the box's noise weighs on both alike.
    Blocks, not single requests: alternating request by request measured each service partly
    against the other's tail (the work a server does after it answered, while the next request
    already goes to the other one on the 2 cores), which no deployment does."""
    rng = random.Random(3)
    out: dict[str, dict[str, Any]] = {svc.name: {} for svc in svcs}

    def alternate(requests: dict[str, tuple[str, str, bytes]], count: int, warm: int) -> dict[str, Any]:
        https = {svc.name: Http(svc.port) for svc in svcs}
        times: dict[str, list[float]] = {svc.name: [] for svc in svcs}
        last: dict[str, bytes] = {}
        try:
            for b in range(max(1, -(-count // BLOCK))):
                for svc in svcs if b % 2 == 0 else svcs[::-1]:
                    method, path, body = requests[svc.name]
                    http = https[svc.name]
                    for i in range(warm + min(BLOCK, count - b * BLOCK)):
                        t = time.perf_counter()
                        status, resp = http.request(method, path, body)
                        dt = time.perf_counter() - t
                        if status != 200:
                            raise RuntimeError(f"{svc.name} {status}")
                        if i >= warm:
                            times[svc.name].append(dt)
                        last[svc.name] = resp
        finally:
            for h in https.values():
                h.close()
        return {"times": times, "last": last}

    for name, c in stream.long.items():
        full = chain_tokens(c.family, c.seed, c.blocks)
        half = full[: len(full) // 2] + [rng.randrange(32_000) for _ in range(len(full) - len(full) // 2)]
        miss = [rng.randrange(32_000) for _ in range(len(full))]
        for kind, tokens in (("hit", full), ("half", half), ("miss", miss)):
            res = alternate({svc.name: ("POST", svc.path, svc.query_body(tokens)) for svc in svcs}, n, 5)
            want = {"hit": c.blocks, "half": c.blocks // 2, "miss": 0}[kind]
            for svc in svcs:
                times = sorted(res["times"][svc.name])
                out[svc.name][f"{name} {kind}"] = {
                    "p50_ms": round(statistics.median(times) * 1e3, 4),
                    "p99_ms": round(times[int(len(times) * 0.99) - 1] * 1e3, 4),
                    "matched": svc.matched(res["last"][svc.name]).get(0, 0),
                    "expected": want,
                }
    res = alternate({svc.name: ("GET", "/health", b"") for svc in svcs}, n * 2, 5)
    for svc in svcs:
        out[svc.name]["health p50_ms"] = round(statistics.median(res["times"][svc.name]) * 1e3, 4)
    return out


def paced(svcs: list[Service], pubs: Publishers, stream: Stream, rate: float) -> dict[str, dict[str, Any]]:
    cpu0 = {svc.name: svc.cpu() for svc in svcs}
    t0 = time.perf_counter()
    pubs.command(f"pace {rate / len(pubs.procs)}")
    t_sent = time.perf_counter()
    targets = sentinel_targets(stream)
    done = wait_visible(svcs, targets, timeout=120)
    out = {}
    for svc in svcs:
        cpu = svc.cpu() - cpu0[svc.name]
        out[svc.name] = {
            "send_s": round(t_sent - t0, 3),
            "lag_after_last_send_ms": round((done[svc.name] - t_sent) * 1e3, 1),
            "cpu_s": round(cpu, 3),
            "blocks_per_cpu_s": round(stream.blocks / cpu) if cpu else None,
            "cpu_per_block_us": round(cpu / stream.blocks * 1e6, 3),
        }
    return out


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _start_once(
    name: str,
    dynamo_py: str | None,
    pubs: Publishers,
    mock_port: int,
    tmp: Path,
    env: dict[str, str],
    container: str | None = None,
) -> dict[str, Any]:
    """One start of one service: to its health endpoint answering, then to a probe event visible."""
    svc: Service
    if name == "kvrouter":
        svc = KvRouter(pubs.ports, mock_port, tmp, env)
    elif name == "container":
        svc = KvRouter(pubs.ports, mock_port, tmp, env, container=container)
    else:
        assert dynamo_py is not None
        svc = Dynamo(dynamo_py, pubs.ports, env)
    try:
        t_http = wait_http(svc)
        target = [(0, probe_payload(0)[1], 1)]
        deadline = time.monotonic() + 60
        probes = 0
        while True:
            probes += 1
            pubs.command("probe")
            try:
                done = wait_visible([svc], target, timeout=0.05, between=0.005)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
        return {
            "http_s": round(t_http - svc.t_start, 3),
            "subscribed_s": round(done[svc.name] - svc.t_start, 3),
            "rss_mb": None if name == "container" else round(svc.rss() / 2**20, 1),  # (of podman's)
            "probes": probes,
        }
    finally:
        svc.stop()


def startup(
    dynamo_py: str | None, mock_port: int, tmp: Path, rounds: int, container: str | None = None
) -> dict[str, Any]:
    """Start to subscribed: process start until the first probe event shows through the lookup.
    ``container``: also start kvrouter's image with this command line (:func:`container_command`),
    from the container engine's start: ``container cold`` with the page cache dropped (a node that
    never ran the image has it on disk only), then ``container`` rounds. Every container is a new
    one from the image, so nothing from an earlier start is reused but the page cache."""
    sources = 8
    pubs = Publishers(None, sources, 8, tmp)
    out: dict[str, Any] = {"page_cache_dropped": None}
    try:
        kinds: list[tuple[str, Any]] = [("kvrouter", None)]
        if dynamo_py:
            kinds.append(("dynamo", None))
        # cold: what a fresh install (or a new container) has: the page cache dropped where
        # permitted, the package's own bytecode not compiled yet (site-packages as pip left them);
        # no-bytecode: the worst case, nothing compiled anywhere (an empty PYTHONPYCACHEPREFIX)
        # the services take turns, round by round (first one, then the other, then the other way
        # round): the box's noise comes in bursts lasting seconds, which a run of one service's
        # rounds followed by the other's turned into differences between the services
        for mode in ["cold", "no-bytecode", "warm"]:
            turns = []
            for r in range(rounds if mode == "warm" else 1):
                turns += [n for n, _ in (kinds if r % 2 == 0 else kinds[::-1])]
            for name in turns:
                env = {}
                if mode != "warm":
                    out["page_cache_dropped"] = drop_caches()
                if mode == "cold" and name == "kvrouter":
                    for pkg in ("index", "router", "sim"):
                        for cache in (ROOT / pkg).rglob("__pycache__"):
                            shutil.rmtree(cache, ignore_errors=True)
                if mode == "no-bytecode":
                    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(dir=tmp, prefix="pyc-")
                out.setdefault(f"{name} {mode}", []).append(
                    _start_once(name, dynamo_py, pubs, mock_port, tmp, env)
                )
        if container:
            for r in range(1 + rounds):
                if r == 0:
                    out["container_page_cache_dropped"] = drop_caches()
                key = "container cold" if r == 0 else "container"
                out.setdefault(key, []).append(
                    _start_once("container", None, pubs, mock_port, tmp, {}, container)
                )
    finally:
        pubs.close()
    return out


def have_dynamo(python: str | None) -> str | None:
    if not python:
        print("Dynamo's indexer skipped: pass --dynamo /path/to/venv/bin/python (ai-dynamo-runtime==1.6.1)")
        return None
    try:
        subprocess.run([python, "-c", "import dynamo.indexer"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        print(f"Dynamo's indexer skipped: {python} cannot import dynamo.indexer")
        return None
    return python


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publisher", help=argparse.SUPPRESS)
    ap.add_argument("--dynamo", default=None, help="python of a venv with ai-dynamo-runtime==1.6.1")
    ap.add_argument("--quick", action="store_true", help="one small stream, fewer samples")
    ap.add_argument("--blocks", default="200000,500000", help="blocks per drain stream (comma-separated)")
    ap.add_argument("--sources", default="8,64")
    ap.add_argument(
        "--batches",
        default="single,multi",
        help="single, multi (8-24 events a batch), hybrid (a sliding-window group's event beside each "
        "full-attention one, as a Gemma3-shaped engine publishes)",
    )
    ap.add_argument("--lookups", type=int, default=200, help="requests per latency row")
    ap.add_argument("--pace", type=float, default=150_000, help="paced ingest rate, blocks/s (all sources)")
    ap.add_argument("--startup-rounds", type=int, default=3)
    ap.add_argument("--kvrouter", default=None, help="kvrouter executable to measure (default: this venv's)")
    ap.add_argument(
        "--drain",
        choices=("together", "alone"),
        default="together",
        help="continue the services together (competing for the cores) or one at a time",
    )
    ap.add_argument(
        "--drain-repeats",
        type=int,
        default=3,
        help="drains of each stream, each into fresh services; the median is reported "
        "(median_drain says why)",
    )
    ap.add_argument(
        "--share",
        choices=("services", "threads"),
        default="services",
        help="each service in a session of its own, so the kernel shares the CPU between the services "
        "first (autogroup), as between two containers; or both in the benchmark's session, shared "
        "thread by thread (SESSIONS says why)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="phases to skip: drain,paced,latency,startup (paced and latency run on the first drain's "
        "services: skipping drain skips them too)",
    )
    ap.add_argument(
        "--container",
        default=None,
        help="also time starts of kvrouter's image: the command that runs it, {config} standing for "
        "the fleet file and {name} for a container name (e.g. 'podman run --rm --network=host "
        "--name {name} -v {config}:/etc/kvrouter/fleet.toml:ro kvrouter:dev')",
    )
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    if args.publisher:
        return publisher_main(args.publisher)
    dynamo_py = have_dynamo(args.dynamo)
    skip = set(args.skip.split(","))
    global KVROUTER, SESSIONS
    if args.kvrouter:
        KVROUTER = args.kvrouter
    SESSIONS = args.share == "services"
    blocks_list = [int(b) for b in args.blocks.split(",")]
    sources_list = [int(s) for s in args.sources.split(",")]
    batch_kinds = args.batches.split(",")
    if args.quick:
        blocks_list, sources_list, args.lookups, args.startup_rounds = [50_000], [8], 50, 1
        args.drain_repeats = 1
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}",
        "command": shlex.join(sys.argv),
        "share": args.share,
        "sched_autogroup": _read("/proc/sys/kernel/sched_autogroup_enabled"),
    }
    mock_port = free_port()
    mock = subprocess.Popen(
        [PY, str(ROOT / "bench" / "zero_mock.py"), str(mock_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # the backend up before any router starts: a router that probes it first starts with no
        # healthy backend (a race that a slower router start used to hide)
        wait_listening(mock_port, mock)
        with tempfile.TemporaryDirectory(prefix="kvbench-") as tmpdir:
            tmp = Path(tmpdir)
            first = True
            if "drain" not in skip:
                for sources in sources_list:
                    for kind in batch_kinds:
                        for blocks in blocks_list:
                            if sources > 8 and blocks != blocks_list[0]:
                                continue  # 64 sources: the first size only (time)
                            label = f"{blocks // 1000}k blocks, {sources} sources, {kind}-event batches"
                            stream = make_stream(sources, blocks, kind == "multi", hybrid=kind == "hybrid")
                            label += f" ({stream.blocks} blocks in {stream.batches} batches)"
                            print(f"== drain: {label}", flush=True)
                            repeats = []
                            for rep in range(args.drain_repeats):
                                pubs = Publishers(stream, sources, max(1, sources // 4), tmp)
                                svcs = start_services(dynamo_py, pubs.ports, mock_port, tmp)
                                try:
                                    subscribe(svcs, pubs, sources)
                                    res = drain(
                                        svcs,
                                        pubs,
                                        stream,
                                        100 if args.quick else 300,
                                        blocks,
                                        args.drain == "alone",
                                    )
                                    print(json.dumps(res, indent=1), flush=True)
                                    repeats.append(res)
                                    if first and rep == 0 and "latency" not in skip:
                                        lat = latency(svcs, stream, args.lookups)
                                        print(json.dumps(lat, indent=1), flush=True)
                                        results["latency"] = lat
                                finally:
                                    for svc in svcs:
                                        svc.stop()
                                    pubs.close()
                            results[f"drain {label}"] = summary = median_drain(repeats)
                            print(f"== drain median of {len(repeats)}: {json.dumps(summary.get('ratio'))}")
                            if first and "paced" not in skip:
                                stream = make_stream(sources, blocks // 2, kind == "multi", seed=11)
                                pubs = Publishers(stream, sources, max(1, sources // 4), tmp)
                                svcs = start_services(dynamo_py, pubs.ports, mock_port, tmp)
                                try:
                                    subscribe(svcs, pubs, sources)
                                    res = paced(svcs, pubs, stream, args.pace)
                                    print(
                                        f"== paced: {stream.blocks} blocks at {args.pace:.0f}/s", flush=True
                                    )
                                    print(json.dumps(res, indent=1), flush=True)
                                    results[f"paced {stream.blocks} blocks at {args.pace:.0f} blocks/s"] = res
                                finally:
                                    for svc in svcs:
                                        svc.stop()
                                    pubs.close()
                            first = False
            if "startup" not in skip:
                res = startup(dynamo_py, mock_port, tmp, args.startup_rounds, args.container)
                print("== start to subscribed", flush=True)
                print(json.dumps(res, indent=1), flush=True)
                results["startup"] = res
    finally:
        mock.terminate()
        mock.wait(10)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
