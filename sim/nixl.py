"""The mock engine's side of vLLM's NIXL connector: both roles, with a real pull between processes.

What vLLM does (``NixlConnector``, see ../shared/docs/pd-disaggregation.md) and what the mock does:

- **Producer (prefill leg)**: a request whose ``kv_transfer_params`` has ``do_remote_decode`` runs an
  ordinary prefill (its blocks are cached and announced with BlockStored as usual); when it finishes
  by the length cap its blocks are *kept pinned* and the answer carries ``kv_transfer_params`` naming
  them: ``do_remote_prefill``, ``do_remote_decode``, ``remote_block_ids`` (the request's physical
  block ids), ``remote_engine_id`` (the engine id, ``_dp{rank}`` appended under DP),
  ``remote_request_id``, ``remote_host``, ``remote_port`` (side channel port + DP rank) and
  ``tp_size``. The blocks are released when a decode engine has read them, or after
  ``kv_transfer_timeout_s`` (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s); released blocks stay
  cached (evictable), as in vLLM.
- **Consumer (decode leg)**: a request with ``do_remote_prefill`` and complete parameters pulls the
  blocks it does not hold itself (its local prefix hit is not transferred) from the producer's side
  channel, waits the transfer time of the timing model, and is then admitted with those tokens
  already computed: only the last prompt token is computed (its logits give the first output). The
  received full blocks are cached and announced with BlockStored (medium GPU), so after one P/D
  request both engines report the prompt. Parameters without ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host`` or ``remote_port`` are logged as
  vLLM logs them ("Got invalid KVTransferParams") and the engine computes the prefill itself. A
  pull that fails (unknown or expired request, unreachable producer, blocks that do not hold this
  prompt) follows ``kv_load_failure_policy``: ``fail`` (vLLM's default: the request ends with an
  error) or ``recompute``.

The transport is a stand-in for RDMA: one ZeroMQ ROUTER socket per DP rank (vLLM's side channel is
a ZMQ ROUTER too, though it only serves the handshake there), answering msgpack
``[op, engine_id, request_id, block_ids]`` with ``{"ok", "error", "blocks"}``: ``read`` returns the
token ids each block holds (a block's KV is a function of them, so the consumer can check it got
its own prompt's blocks: vLLM cannot, it would decode garbage) and releases the request's blocks,
``release`` only releases them (a consumer that holds the whole prompt already). Engines in other
processes pull from each other exactly as in one process.

**Timing model** of a pull (consumer side, before admission, not in a step: vLLM loads
asynchronously while other requests run): ``time_scale * (kv_transfer_setup_s + blocks *
kv_transfer_s_per_block)``; defaults 1 ms per transfer and 80 us per 16-token block (an 8B model's
KV is ~128 KiB per token, 2 MiB per block; ~25 GB/s of RDMA per GPU), about 5% of recomputing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("sim.nixl")

REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
"""What a decode leg's parameters must carry for a pull (as vLLM's connector checks)."""


class TransferError(Exception):
    """A pull that did not deliver the blocks."""


def wants_remote_decode(params: Any) -> bool:
    """A prefill leg: keep the blocks and answer with transfer parameters."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: Any) -> bool:
    """A decode leg: pull the prompt's blocks instead of computing them."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))


def invalid_reason(params: Mapping[str, Any]) -> str | None:
    """Why a decode leg's parameters cannot be used (None: they can)."""
    missing = [k for k in REQUIRED if params.get(k) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    ids = params["remote_block_ids"]
    if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        return "remote_block_ids is not a list of block ids"
    port = params["remote_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return "remote_port is not a port"
    if not isinstance(params["remote_host"], str) or not isinstance(params["remote_request_id"], str):
        return "remote_host and remote_request_id must be strings"
    return None


class _Hold:
    __slots__ = ("request_id", "timer")

    def __init__(self, request_id: str, timer: asyncio.TimerHandle) -> None:
        self.request_id = request_id
        self.timer = timer


class SideChannel:
    """One DP rank's producer side: blocks kept for transfers, served on a ROUTER socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        engine_id: str,
        host: str,
        port: int,
        contents: Callable[[str, Sequence[int]], list[list[int]] | None],
        release: Callable[[str], None],
        timeout_s: float,
    ) -> None:
        self.engine_id = engine_id
        self.host = host
        self.contents = contents
        """(request id, block ids) -> the blocks' tokens, from the rank's cache."""
        self.release_blocks = release
        """Unpin a request's blocks (they stay cached)."""
        self.timeout_s = timeout_s
        self.holds: dict[str, _Hold] = {}
        self.reads = 0
        self.expired = 0
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """Where consumers connect."""
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name=f"nixl-{self.engine_id}")

    async def close(self) -> None:
        """Stop serving and release every held request (the engine is stopping or restarting)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.drop_all()
        self.sock.close(0)

    def drop_all(self) -> None:
        """Forget every hold without touching the cache (after a restart the cache is a new one)."""
        for h in self.holds.values():
            h.timer.cancel()
        self.holds.clear()

    def hold(self, request_id: str, block_ids: list[int], tp_size: int = 1) -> dict[str, Any]:
        """Keep a finished prefill's blocks for a consumer; returns the answer's transfer parameters."""
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, request_id)
        self.holds[request_id] = _Hold(request_id, timer)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": tp_size,
        }

    def _expire(self, request_id: str) -> None:
        if self.holds.pop(request_id, None) is not None:
            self.expired += 1
            log.warning(
                "%s: blocks of %s were never read; released after %g s",
                self.engine_id,
                request_id,
                self.timeout_s,
            )
            self.release_blocks(request_id)

    def _release(self, request_id: str) -> bool:
        h = self.holds.pop(request_id, None)
        if h is None:
            return False
        h.timer.cancel()
        self.release_blocks(request_id)
        return True

    def answer(self, msg: Any) -> dict[str, Any]:
        """The reply to one request (see the module docstring)."""
        try:
            op, engine_id, request_id, block_ids = msg
        except (TypeError, ValueError):
            return {"ok": False, "error": "malformed request"}
        if engine_id != self.engine_id:
            return {"ok": False, "error": f"this is engine {self.engine_id}, not {engine_id}"}
        if request_id not in self.holds:
            return {"ok": False, "error": f"no blocks held for request {request_id} (expired or read)"}
        if op == "release":
            self._release(request_id)
            return {"ok": True, "error": "", "blocks": []}
        if op != "read" or not isinstance(block_ids, list):
            return {"ok": False, "error": f"unknown operation {op!r}"}
        blocks = self.contents(request_id, block_ids)
        if blocks is None:
            return {"ok": False, "error": "block ids that request does not hold"}
        self.reads += 1
        self._release(request_id)
        return {"ok": True, "error": "", "blocks": blocks}

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) < 3:
                continue
            ident, body = frames[0], frames[-1]
            try:
                reply = self.answer(msgspec.msgpack.decode(body))
            except msgspec.DecodeError:
                reply = {"ok": False, "error": "not msgpack"}
            await self.sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])


async def request(
    ctx: zmq.asyncio.Context,
    params: Mapping[str, Any],
    op: str,
    block_ids: list[int],
    timeout_s: float = 10.0,
) -> list[list[int]]:
    """One request to a producer's side channel; raises TransferError."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
        msg = [op, params["remote_engine_id"], params["remote_request_id"], block_ids]
        await sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
        try:
            async with asyncio.timeout(timeout_s):
                frames = await sock.recv_multipart()
        except TimeoutError:
            raise TransferError(f"no answer from {params['remote_host']}:{params['remote_port']}") from None
        reply = msgspec.msgpack.decode(frames[-1])
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise TransferError(str(reply.get("error") if isinstance(reply, dict) else reply))
        blocks: list[list[int]] = reply.get("blocks") or []
        return blocks
    finally:
        sock.close(0)


async def pull(
    ctx: zmq.asyncio.Context,
    params: Mapping[str, Any],
    prompt: Sequence[int],
    local_tokens: int,
    block_size: int,
    seconds_per_block: float,
    setup_s: float,
) -> int:
    """Read the prompt's blocks this engine lacks (all but its ``local_tokens`` prefix hit) from the
    producer, after checking they hold this prompt; sleeps the modelled transfer time. Returns the
    number of prompt tokens now available without compute (the whole prompt)."""
    remote: list[int] = list(params["remote_block_ids"])
    n_blocks = -(-len(prompt) // block_size)
    if len(remote) != n_blocks:
        raise TransferError(f"{len(remote)} remote blocks for a prompt of {n_blocks} blocks")
    first = local_tokens // block_size
    wanted = remote[first:]
    if not wanted:
        await request(ctx, params, "release", [])
        return len(prompt)
    started = time.monotonic()
    blocks = await request(ctx, params, "read", wanted)
    for i, got in enumerate(blocks):
        lo = (first + i) * block_size
        expected = list(prompt[lo : lo + block_size])
        if list(got[: len(expected)]) != expected:
            raise TransferError(f"block {first + i} holds other tokens than this prompt")
    if len(blocks) != len(wanted):
        raise TransferError(f"{len(blocks)} blocks received, {len(wanted)} asked")
    remaining = setup_s + len(wanted) * seconds_per_block - (time.monotonic() - started)
    if remaining > 0:
        await asyncio.sleep(remaining)
    return len(prompt)


__all__ = [
    "REQUIRED",
    "SideChannel",
    "TransferError",
    "invalid_reason",
    "pull",
    "request",
    "wants_remote_decode",
    "wants_remote_prefill",
]
