"""Hostile engines and a hostile store: the attacks shared by the hostile tests, the chaos soak
(sim/chaos.py) and bench/hostile_bench.py, which must not import tests/.

- :class:`HostileEngine`: a raw-socket engine on 127.0.0.1 that writes exactly the bytes an attack
  scripts. Alone it answers like vLLM with canned answers, and the first word of each prompt picks
  the attack (the tests). With ``upstream`` it is a proxy in front of a real (mock) engine that
  relays its answers byte for byte, and attacks every POST while it is armed (``POST
  /hostile/attack``): an engine that turns hostile for a while, as the soak and the benchmark need.
- :class:`HostileStore`: a RESP server that answers the cluster link like an empty Redis and
  delivers what is published, until it is armed (:meth:`HostileStore.arm` or the command
  ``HOSTILE ATTACK <name>``): then every subscription gets a huge, deep or endless reply.
- ``python -m sim.hostile [--proxy URL]... [--store]``: both in a process of their own, printing
  their addresses as one JSON line. Their attacks cost CPU: clients whose latency is measured must
  not share a GIL with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httptools

TIMEOUT = 30.0
"""Longest wait on a socket (a peer that neither sends nor closes)."""
ATTACK_BYTES = 64 << 20
"""How much an endless attack sends at most (before the router stops reading it)."""


# ---- HTTP pieces -----------------------------------------------------------------------------------


def framed(status: str, body: bytes, headers: str = "content-type: application/json\r\n") -> bytes:
    """A complete response with a content-length."""
    return f"HTTP/1.1 {status}\r\n{headers}content-length: {len(body)}\r\n\r\n".encode() + body


def completion(token: str, extra: dict[str, Any] | None = None) -> bytes:
    """An OpenAI completion whose id and text name ``token`` (so a client can tell its own answer)."""
    body = {
        "id": f"cmpl-{token}",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": token, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        **(extra or {}),
    }
    return json.dumps(body).encode()


def sse_event(token: str) -> bytes:
    """One streamed completion chunk for ``token``."""
    chunk = {
        "id": f"cmpl-{token}",
        "object": "text_completion",
        "created": 1,
        "model": "toy",
        "choices": [{"index": 0, "text": token, "finish_reason": None, "logprobs": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def send_for(sock: socket.socket, piece: bytes, total: int) -> int:
    """Send ``piece`` again and again, ``total`` bytes at most, until the peer stops reading it
    (closes); returns the bytes sent."""
    sent = 0
    view = memoryview(piece)
    with contextlib.suppress(OSError):
        while sent < total:
            sock.sendall(view)
            sent += len(piece)
    return sent


TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "hostile",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}
"""What the canned engine answers a P/D prefill leg with (``kv_transfer_params.do_remote_decode``)."""


Answer = Callable[[socket.socket, bytes], bool]
"""Writes the sound answer to a request, then the given bytes in the same write as its end; False
when the answer could not be written whole (the connection is then closed)."""


class Post:
    """One POST the engine read."""

    def __init__(
        self,
        path: str,
        body: dict[str, Any],
        conn: int,
        index: int,
        headers: Sequence[tuple[str, str]] = (),
        answer: Answer | None = None,
        previous: bytes = b"",
    ) -> None:
        self.path = path
        self.body = body
        self.conn = conn
        """The engine's connection number (0, 1, ...: accepted order)."""
        self.index = index
        """Position of this request on its connection (0: the first)."""
        self.headers = list(headers)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):  # chat: the last message
            prompt = str(body.get("messages", [{}])[-1].get("content", ""))
        self.word, _, self.token = prompt.partition(" ")
        self.answer: Answer = answer or self._canned
        """The sound answer: the upstream engine's (relayed), else a canned one."""
        self.previous = previous
        """The last sound answer this engine wrote before this request, whole (b"": none yet)."""

    @property
    def tag(self) -> str:
        """What names the request in canned answers: its ``x-request-id`` (as vLLM names a request
        by it), else the prompt's second word."""
        for name, value in self.headers:
            if name.lower() == "x-request-id":
                return value
        return self.token

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    def _canned(self, sock: socket.socket, after: bytes) -> bool:
        sock.sendall(canned(self) + after)
        return True


def canned(post: Post) -> bytes:
    """What a sound engine answers: the completion (or a stream of it) for the request's tag, with
    transfer parameters when it is a prefill leg."""
    params = post.body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_decode"):
        return framed("200 OK", completion(post.tag, {"kv_transfer_params": TRANSFER_PARAMS}))
    if post.streamed:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return head + chunk(sse_event(post.tag)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    return framed("200 OK", completion(post.tag))


Attack = Callable[[socket.socket, Post], bool]
"""Writes an answer (or anything else) on the socket; True keeps the connection for the next request."""


def answer_ok(sock: socket.socket, post: Post) -> bool:
    """The sound answer."""
    return post.answer(sock, b"")


# ---- engine attacks --------------------------------------------------------------------------------


def hold_until_closed(sock: socket.socket, seconds: float = TIMEOUT) -> None:
    """Keep the connection open (sending nothing) until the router closes it."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


POISON = completion("POISON")
"""The bytes ``trailing_bytes`` smuggles when the engine has no earlier answer to send again."""


def trailing_bytes(sock: socket.socket, post: Post) -> bool:
    """The sound answer, and in the same write right after its end the previous answer again: a
    router that read past the end would hand another request's bytes to the next client (in one
    write, as a sound engine never sends anything after its answer, a router can only tell them apart
    when they arrive with it)."""
    return post.answer(sock, post.previous or framed("200 OK", POISON))


def upgrade(sock: socket.socket, post: Post) -> bool:
    """A protocol switch nobody asked for, and the connection held."""
    sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")
    hold_until_closed(sock)
    return False


def _endless_head(sock: socket.socket, start: bytes, piece: bytes) -> bool:
    sock.sendall(b"HTTP/1.1 200 OK\r\n" + start)
    send_for(sock, piece, ATTACK_BYTES)
    return False


def many_headers(sock: socket.socket, post: Post) -> bool:
    """A head whose header lines never end."""
    return _endless_head(sock, b"", b"x-f: a\r\n" * (1 << 17))


def endless_header_line(sock: socket.socket, post: Post) -> bool:
    """A head with one header line that never ends."""
    return _endless_head(sock, b"x-long: ", b"a" * (1 << 20))


def trickle(sock: socket.socket, post: Post) -> bool:
    """A head trickled a byte every 0.2 s: never idle long, never done."""
    head = b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 200
    try:
        for i in range(len(head)):
            sock.sendall(head[i : i + 1])
            time.sleep(0.2)
    except OSError:
        pass  # the router closed it
    return False


def endless_sse_event(sock: socket.socket, post: Post) -> bool:
    """A stream whose second event never ends."""
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunk(sse_event(post.tag))
        + chunk(b"data: ")
    )
    send_for(sock, chunk(b"a" * (1 << 20)), ATTACK_BYTES)
    return False


def drop(sock: socket.socket, post: Post) -> bool:
    """The request was read: closed without an answer."""
    return False


ENGINE_ATTACKS: dict[str, Attack] = {
    "trailing_bytes": trailing_bytes,
    "upgrade": upgrade,
    "endless_head": many_headers,
    "trickled_head": trickle,
    "endless_sse": endless_sse_event,
    "drop": drop,
}
"""What an armed proxy does to every POST (the soak's and the benchmark's engine faults)."""


# ---- the engine ------------------------------------------------------------------------------------


class _Message:
    """httptools callbacks: just the end of the message."""

    def __init__(self) -> None:
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True


_HOP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})


class _Relay:
    """One connection to the upstream engine per client connection, kept alive as the client's is."""

    IDLE_S = 3.0
    """Reconnect after this long idle: uvicorn (vLLM's server) closes idle connections after 5 s."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self.idle_since = 0.0

    def exchange(
        self,
        client: socket.socket,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        after: bytes,
    ) -> bytes | None:
        """Relay one request and its answer as it comes, ``after`` in the write of the answer's end;
        the answer's bytes, or None when the upstream (or the client) broke off."""
        if self.sock is not None and time.monotonic() - self.idle_since > self.IDLE_S:
            self.close()
        head = [
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-length: {len(body)}\r\n"
        ]
        head += [f"{k}: {v}\r\n" for k, v in headers if k.lower() not in _HOP_HEADERS]
        out = bytearray()
        try:
            if self.sock is None:
                self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            self.sock.sendall("".join(head).encode("latin-1") + b"\r\n" + body)
            message = _Message()
            parser = httptools.HttpResponseParser(message)
            while not message.complete:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("the upstream closed mid-answer")
                parser.feed_data(data)
                out += data
                client.sendall(data + after if message.complete else data)
            keep = parser.should_keep_alive()
        except (OSError, httptools.HttpParserError):
            self.close()
            return None
        if not keep:
            self.close()
        self.idle_since = time.monotonic()
        return bytes(out)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class HostileEngine:
    """A raw-socket engine on 127.0.0.1:0 (threads: one accepting, one per connection).

    Every POST it reads is recorded. It is attacked by ``attacks[word]`` (the prompt's first word),
    or, while armed, by ``attacks[armed]`` whatever its word (only streamed ones with
    ``streams_only``); otherwise it gets the sound answer. GETs are answered soundly. ``POST
    /hostile/attack`` with ``{"attack": name | null, "streams_only": bool}`` arms (or disarms) it;
    ``GET /hostile/attack`` reads that and how many requests were attacked."""

    def __init__(
        self,
        attacks: dict[str, Attack] | None = None,
        upstream: str | None = None,
        timeout: float = TIMEOUT,
        record: bool = True,
    ) -> None:
        self.attacks = dict(attacks or {})
        self.record = record
        """Keep every POST in ``posts`` (a long-running proxy does not: they would add up)."""
        self.upstream: tuple[str, int] | None = None
        if upstream is not None:
            u = urlsplit(upstream)
            self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.timeout = timeout
        self.armed: str | None = None
        self.streams_only = False
        self.attacked = 0
        """POSTs an attack answered."""
        self.previous = b""
        self.posts: list[Post] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port: int = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts_of(self, token: str) -> list[Post]:
        with self.lock:
            return [p for p in self.posts if p.token == token]

    def arm(self, attack: str | None, streams_only: bool = False) -> None:
        """Attack every POST from now on with ``attacks[attack]`` (None: no more)."""
        if attack is not None and attack not in self.attacks:
            raise KeyError(attack)
        with self.lock:
            self.armed, self.streams_only = attack, streams_only

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                n = self.accepted
                self.accepted += 1
                self.conns.append(conn)
                self.threads = [t for t in self.threads if t.is_alive()]
                self.conns = [c for c in self.conns if c.fileno() != -1]
            t = threading.Thread(target=self._serve, args=(conn, n), daemon=True)
            self.threads.append(t)
            t.start()

    def _attack_for(self, post: Post) -> Attack | None:
        with self.lock:
            if self.armed is not None and (post.streamed or not self.streams_only):
                attack: Attack | None = self.attacks[self.armed]
            else:
                attack = self.attacks.get(post.word)
            if attack is not None:
                self.attacked += 1
            return attack

    def _control(self, method: str, body: bytes) -> bytes:
        if method == "POST":
            try:
                req = json.loads(body)
                self.arm(req.get("attack"), bool(req.get("streams_only", False)))
            except (ValueError, AttributeError, KeyError, TypeError) as exc:
                err = {"error": {"message": f"bad attack: {exc}", "type": "invalid_request_error"}}
                return framed("400 Bad Request", json.dumps(err).encode())
        with self.lock:
            state = {"attack": self.armed, "streams_only": self.streams_only, "attacked": self.attacked}
        return framed("200 OK", json.dumps(state).encode())

    def _serve(self, conn: socket.socket, n: int) -> None:
        buf = b""
        index = 0
        relay = _Relay(*self.upstream, self.timeout) if self.upstream else None
        try:
            conn.settimeout(self.timeout)
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers: list[tuple[str, str]] = []
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers.append((name.strip(), value.strip()))
                    if name.strip().lower() == "content-length":
                        length = int(value)
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                index += 1
                if path.startswith("/hostile/"):
                    conn.sendall(self._control(method, body))
                    continue
                if method != "POST":
                    if relay is not None:
                        if relay.exchange(conn, method, path, headers, body, b"") is None:
                            return
                    elif path.startswith("/v1/models"):
                        models = {"object": "list", "data": [{"id": "toy", "object": "model"}]}
                        conn.sendall(framed("200 OK", json.dumps(models).encode()))
                    else:
                        conn.sendall(framed("200 OK", b'{"status": "ok"}'))
                    continue
                post = Post(path, json.loads(body), n, index - 1, headers, previous=self.previous)
                post.answer = self._answer(relay, post, body)
                if self.record:
                    with self.lock:
                        self.posts.append(post)
                attack = self._attack_for(post)
                if not (post.answer(conn, b"") if attack is None else attack(conn, post)):
                    return
        except OSError:
            return
        finally:
            if relay is not None:
                relay.close()
            conn.close()

    def _answer(self, relay: _Relay | None, post: Post, body: bytes) -> Answer:
        """The sound answer to ``post`` (relayed, else canned), remembered for ``trailing_bytes``."""

        def answer(sock: socket.socket, after: bytes) -> bool:
            if relay is None:
                whole = canned(post)
                sock.sendall(whole + after)
                data: bytes | None = whole
            else:
                data = relay.exchange(sock, "POST", post.path, post.headers, body, after)
            if data is None:
                return False
            with self.lock:
                self.previous = data
            return True

        return answer

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept: closing alone does not)
        self.sock.close()
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self.thread.join(self.timeout)
        for t in self.threads:
            t.join(self.timeout)


# ---- the store -------------------------------------------------------------------------------------


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


async def _command(reader: asyncio.StreamReader) -> list[bytes] | None:
    """One command (an array of bulk strings), or None at the end of the connection."""
    line = await reader.readline()
    if not line:
        return None
    args = []
    for _ in range(int(line[1:])):
        n = int((await reader.readline())[1:])
        args.append((await reader.readexactly(n + 2))[:-2])
    return args


STORE_ATTACKS = ("array_in_pieces", "endless_line", "huge_bulk", "deep_arrays", "unanswered_publish")
"""On a subscription: a 250k-element array in 4 KiB pieces (1 MB: within limits that allow it), an
endless status line, a 2 GB bulk string's header and a trickle of its bytes, arrays 100k deep. On
the command connection (``unanswered_publish``): every PUBLISH delivered to the subscribers but
never answered, a store that hangs on commands while its channel looks alive."""


class HostileStore:
    """Answers the link's commands like Redis (an empty store: no peers, no pins) and delivers what it
    publishes back to it; while armed, sends ``attack`` on every subscription instead (one already
    made, and each one made meanwhile). Disarmed, an attack stops and its connection (mid-reply,
    nothing else can follow on it) is closed; a reply that has an end (a huge array, deep arrays)
    leaves the subscription usable again.

    The command ``HOSTILE ATTACK <name>`` arms it from another process (``OFF`` disarms), ``HOSTILE
    COUNT`` answers how many attacks were sent."""

    ANSWERS: ClassVar[dict[bytes, bytes]] = {
        b"HKEYS": b"*0\r\n",
        b"SCAN": b"*2\r\n$1\r\n0\r\n*0\r\n",
        b"GET": b"$-1\r\n",
        b"PTTL": b":-2\r\n",
    }

    def __init__(self, attack: str | None = None, timeout: float = TIMEOUT) -> None:
        self.attack = attack
        self.timeout = timeout
        self.subscriptions: list[float] = []
        """When each SUBSCRIBE came: one per attempt of the link that got that far."""
        self.attacks = 0
        self._subscribers: set[asyncio.StreamWriter] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self._armed = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result(timeout)
        self.port: int = self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, attack: str | None = None) -> None:
        """Attack every subscription with ``attack`` (default: the one given at construction)."""
        if attack is not None and attack not in STORE_ATTACKS:
            raise KeyError(attack)
        self.loop.call_soon_threadsafe(self._arm, attack, True)

    def disarm(self) -> None:
        self.loop.call_soon_threadsafe(self._arm, None, False)

    def _arm(self, attack: str | None, on: bool) -> None:
        if attack is not None:
            self.attack = attack
        if on:
            self._armed.set()
        else:
            self._armed.clear()

    def _control(self, args: list[bytes]) -> bytes:
        what = [a.decode("latin-1", "replace") for a in args]
        if what[:1] == ["COUNT"]:
            return b":%d\r\n" % self.attacks
        if len(what) == 2 and what[0] == "ATTACK" and (what[1] == "OFF" or what[1] in STORE_ATTACKS):
            self._arm(None if what[1] == "OFF" else what[1], what[1] != "OFF")
            return b"+OK\r\n"
        return (
            b"-ERR HOSTILE ATTACK <" + "|".join(("OFF", *STORE_ATTACKS)).encode() + b"> or HOSTILE COUNT\r\n"
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attack: asyncio.Task[None] | None = None
        self._writers.add(writer)
        try:
            while (cmd := await _command(reader)) is not None:
                name = cmd[0].upper()
                if name == b"SUBSCRIBE":
                    self.subscriptions.append(time.monotonic())
                    writer.write(b"*3\r\n$9\r\nsubscribe\r\n" + _bulk(cmd[1]) + b":1\r\n")
                    self._subscribers.add(writer)
                    attack = asyncio.ensure_future(self._attack(writer))
                elif name == b"PUBLISH":
                    for sub in self._subscribers:
                        sub.write(b"*3\r\n$7\r\nmessage\r\n" + _bulk(cmd[1]) + _bulk(cmd[2]))
                    if self._armed.is_set() and self.attack == "unanswered_publish":
                        self.attacks += 1
                        continue
                    writer.write(b":%d\r\n" % len(self._subscribers))
                elif name == b"HOSTILE":
                    writer.write(self._control(cmd[1:]))
                else:
                    writer.write(self.ANSWERS.get(name, b"+OK\r\n" if name != b"PING" else b"+PONG\r\n"))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._subscribers.discard(writer)
            self._writers.discard(writer)
            if attack is not None:
                attack.cancel()
            writer.close()

    async def _disarmed(self) -> None:
        while self._armed.is_set():
            await asyncio.sleep(0.05)

    async def _attack(self, w: asyncio.StreamWriter) -> None:
        while True:
            await self._armed.wait()
            attack = self.attack
            if attack == "unanswered_publish":  # (the command connection's attack, not this one's)
                await self._disarmed()
                continue
            if attack == "array_in_pieces" and self.attacks:
                return  # (once: a huge reply within the limits, then an ordinary store)
            self._subscribers.discard(w)  # (nothing else goes on this connection: it is mid-reply)
            self.attacks += 1
            try:
                if attack == "array_in_pieces":  # 250k elements, 1 MB, in 4 KiB pieces
                    n = 250_000
                    w.write(b"*%d\r\n" % n)
                    for _ in range(n // 1000):
                        w.write(b":1\r\n" * 1000)
                        await w.drain()
                        await asyncio.sleep(0.001)  # (each piece a read of its own)
                elif attack == "endless_line":
                    w.write(b"+")
                    while self._armed.is_set():
                        w.write(b"a" * 65536)
                        await w.drain()
                elif attack == "huge_bulk":
                    w.write(b"$2000000000\r\n")
                    while self._armed.is_set():
                        w.write(b"x")
                        await w.drain()
                        await asyncio.sleep(0.01)
                elif attack == "deep_arrays":
                    w.write(b"*1\r\n" * 100_000 + b":1\r\n")
                    await w.drain()
            except ConnectionError:
                return
            if attack in ("endless_line", "huge_bulk"):  # (cut mid-reply: the connection is no use)
                w.close()
                return
            self._subscribers.add(w)
            await self._disarmed()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for w in list(self._subscribers):
                w.close()
            for w in list(self._writers):  # (each connection's task ends at its end of file)
                w.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:
                await asyncio.wait(others, timeout=self.timeout)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(self.timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(self.timeout)
        self.loop.close()


async def store_command(url: str, *args: str, timeout: float = 5.0) -> bytes:
    """One command to the store at ``url`` on a connection of its own; the reply's first line (how the
    soak and the benchmark arm the hostile store in its process)."""
    u = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port), timeout)
    try:
        writer.write(b"*%d\r\n" % len(args) + b"".join(_bulk(a.encode()) for a in args))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line.startswith((b"+", b":")):
        raise RuntimeError(f"store: {' '.join(args)}: {line!r}")
    return line.strip()


# ---- both in a process of their own ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sim.hostile",
        description="A hostile proxy in front of each engine URL and a hostile store; prints their "
        'addresses as one JSON line ({"proxies": [...], "store": ...}) and serves until SIGTERM.',
    )
    ap.add_argument("--proxy", action="append", default=[], metavar="URL", help="an engine to proxy")
    ap.add_argument("--store", action="store_true", help="a hostile RESP store too")
    args = ap.parse_args(argv)
    engines = [HostileEngine(ENGINE_ATTACKS, upstream=u, record=False) for u in args.proxy]
    store = HostileStore() if args.store else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        json.dumps({"proxies": [e.url for e in engines], "store": store.url if store else None}), flush=True
    )
    while not stop.wait(0.5):
        pass
    for e in engines:
        e.close()
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "ATTACK_BYTES",
    "ENGINE_ATTACKS",
    "STORE_ATTACKS",
    "Attack",
    "HostileEngine",
    "HostileStore",
    "Post",
    "answer_ok",
    "canned",
    "chunk",
    "completion",
    "framed",
    "send_for",
    "sse_event",
    "store_command",
]
