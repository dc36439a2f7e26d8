"""The mock vLLM engine end to end: real HTTP on ephemeral ports, real KV event sockets."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from router.decision.chat import ChatTokenizer
from sim import cli
from sim.engine import EngineConfig, MockEngine, token_scaled
from sim.fleet import Fleet
from sim.publisher import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch, decode_batch
from sim.toy_tokenizer import build_toy_tokenizer

T = TypeVar("T")
FAST = EngineConfig(time_scale=0.01, block_size=4, num_gpu_blocks=256)


def fast(**changes: Any) -> EngineConfig:
    """A quick engine (100x time scale, small blocks) with some fields changed."""
    return msgspec.structs.replace(FAST, **changes)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_tokenizer(tmp_path_factory.mktemp("toy-tokenizer"))


async def _wait_for(cond: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Sub:
    """A SUB socket on one rank's endpoint that has provably joined (beats the slow-joiner drop)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    async def join(self, client: httpx.AsyncClient, rank: int = 0) -> int:
        """Clear the (idle) cache until an AllBlocksCleared arrives; returns the next expected seq."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = await client.post("/admin/clear", json={"rank": rank})
            assert r.status_code == 200
            if await self.sock.poll(50):
                break
        else:
            raise AssertionError("subscriber never joined")
        last = -1
        while await self.sock.poll(100):  # drain the warm-up batches
            last = int.from_bytes((await self.sock.recv_multipart())[1], "big")
        return last + 1

    async def recv(self, timeout: float = 10.0) -> tuple[int, KVEventBatch]:
        assert await self.sock.poll(int(timeout * 1000)), "no KV event batch"
        frames = await self.sock.recv_multipart()
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2])

    def close(self) -> None:
        self.sock.close(linger=0)


def _stored(batch: KVEventBatch) -> list[BlockStored]:
    return [e for e in batch.events if isinstance(e, BlockStored)]


def test_completions_chat_usage_and_cached_tokens(toy_dir: Path) -> None:
    async def main() -> None:
        cfg = fast(model="toy", tokenizer=str(toy_dir))
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            prompt = "the cache router sends every request to the engine that holds its prefix " * 3
            first = (
                await c.post("/v1/completions", json={"model": "toy", "prompt": prompt, "max_tokens": 5})
            ).json()
            assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
            assert first["choices"][0]["finish_reason"] == "length" and isinstance(
                first["choices"][0]["text"], str
            )
            u1 = first["usage"]
            assert u1["completion_tokens"] == 5 and u1["total_tokens"] == u1["prompt_tokens"] + 5
            assert u1["prompt_tokens_details"] == {"cached_tokens": 0}
            second = (
                await c.post("/v1/completions", json={"model": "toy", "prompt": prompt, "max_tokens": 5})
            ).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (u1["prompt_tokens"] - 1) // 4 * 4 > 0
            assert second["choices"][0]["text"] == first["choices"][0]["text"]  # seeded by the prompt
            tok = ChatTokenizer.from_path(toy_dir)
            assert u1["prompt_tokens"] == len(tok.encode_prompt(prompt))

            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
            chat = (await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})).json()
            assert (
                chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
            )
            assert chat["usage"]["prompt_tokens"] == len(tok.encode_chat(messages))
            chat2 = (
                await c.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 3})
            ).json()
            assert chat2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

            tk = (await c.post("/tokenize", json={"model": "toy", "messages": messages})).json()
            assert tk["tokens"] == tok.encode_chat(messages) and tk["count"] == len(tk["tokens"])
            assert tk["max_model_len"] == 1024  # capped by the cache: 256 blocks x 4 tokens
            r = await c.post("/v1/completions", json={"prompt": [5, 5000]})
            assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
            tk = (await c.post("/tokenize", json={"model": "toy", "prompt": "hello"})).json()
            assert tk["tokens"] == tok.encode_prompt("hello")
            tk = (await c.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False})).json()
            assert tk["tokens"] == tok.encode_prompt("hello", add_special_tokens=False)

            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == "toy" and models["object"] == "list"
            assert (await c.get("/health")).status_code == 200

    run(main())


def _sse(lines: list[str]) -> list[Any]:
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streaming_shapes_and_include_usage() -> None:
    async def main() -> None:
        async with (
            MockEngine(fast()) as eng,
            httpx.AsyncClient(base_url=eng.url, timeout=30) as c,
        ):
            body = {"prompt": list(range(40, 70)), "max_tokens": 4, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                chunks = _sse([line async for line in r.aiter_lines()])
            assert len(chunks) == 4 and all("usage" not in ch for ch in chunks)
            assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, None, "length"]
            streamed = "".join(ch["choices"][0]["text"] for ch in chunks)
            plain = (await c.post("/v1/completions", json={**body, "stream": False})).json()
            assert plain["choices"][0]["text"] == streamed

            chat = {
                "messages": [{"role": "user", "content": "hi there"}],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with c.stream("POST", "/v1/chat/completions", json=chat) as r:
                chunks = _sse([line async for line in r.aiter_lines()])
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(ch["object"] == "chat.completion.chunk" and ch["usage"] is None for ch in chunks[:-1])
            assert [ch["choices"][0]["finish_reason"] for ch in chunks[1:-1]] == [None, None, "length"]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

    run(main())


def test_errors_are_openai_shaped() -> None:
    async def main() -> None:
        cfg = EngineConfig(time_scale=0.01, block_size=4, num_gpu_blocks=8)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            r = await c.post("/v1/completions", json={"model": "other", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
            for body in ({"prompt": 5}, {"prompt": [-1]}, {"prompt": "x", "max_tokens": 0}, {"prompt": ""}):
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 400, body
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
            r = await c.post("/v1/completions", json={"prompt": list(range(30)), "max_tokens": 5})
            assert r.status_code == 400 and "maximum context length is 32" in r.json()["error"]["message"]
            r = await c.post("/v1/chat/completions", content=b"{not json")
            assert r.status_code == 400
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"X-data-parallel-rank": "3"})
            assert r.status_code == 400

    run(main())


def test_kv_events_metrics_and_dp_ranks() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        cfg = fast(dp_size=2)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            assert len(set(eng.kv_endpoints)) == 2 and all(
                e.startswith("tcp://127.0.0.1:") for e in eng.kv_endpoints
            )
            subs = [Sub(ctx, ep) for ep in eng.kv_endpoints]
            try:
                seqs = [await s.join(c, rank) for rank, s in enumerate(subs)]
                prompt = list(range(100, 110))
                r = await c.post(
                    "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 2},
                    headers={"X-data-parallel-rank": "1"},
                )
                assert r.status_code == 200
                seq, batch = await subs[1].recv()
                assert seq == seqs[1] and batch.data_parallel_rank == 1
                (stored,) = _stored(batch)
                assert stored.token_ids == prompt[:8] and stored.parent_block_hash is None
                assert stored.block_size == 4 and stored.medium == "GPU" and len(stored.block_hashes) == 2
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored.block_hashes)
                assert not await subs[0].sock.poll(50)  # rank 0 saw nothing

                text = (await c.get("/metrics")).text
                for name in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                    "vllm:prefix_cache_queries_total",
                    "vllm:prefix_cache_hits_total",
                ):
                    assert f'{name}{{engine="0",model_name="mock-model"}}' in text
                    assert f'{name}{{engine="1",model_name="mock-model"}}' in text
                assert "# TYPE vllm:prefix_cache_queries counter" in text
                assert 'vllm:prefix_cache_queries_total{engine="1",model_name="mock-model"} 10.0' in text
                assert 'vllm:prefix_cache_queries_total{engine="0",model_name="mock-model"} 0.0' in text

                # without the header: the least-loaded rank (rank 0 on a tie)
                await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                seq, batch = await subs[0].recv()
                assert seq == seqs[0] and batch.data_parallel_rank == 0
            finally:
                for s in subs:
                    s.close()
        ctx.term()

    run(main())


def test_faults_restart_drop_and_clear() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        async with (
            MockEngine(fast()) as eng,
            httpx.AsyncClient(base_url=eng.url, timeout=30) as c,
        ):
            sub = Sub(ctx, eng.kv_endpoints[0])
            try:
                seq0 = await sub.join(c)
                prompt = {"prompt": list(range(1, 19)), "max_tokens": 2}  # decode fills no block
                assert (await c.post("/v1/completions", json=prompt)).status_code == 200
                assert (await sub.recv())[0] == seq0

                # a lost batch is still replayable
                assert (await c.post("/admin/drop_batches", json={"n": 1})).status_code == 200
                r = await c.post("/v1/completions", json={"prompt": list(range(50, 70)), "max_tokens": 2})
                assert r.status_code == 200
                assert (await c.post("/admin/clear")).json() == {"success": True}
                seq, batch = await sub.recv()
                assert seq == seq0 + 2 and batch.events == [AllBlocksCleared()]
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                replay = eng.replay_endpoints[0]
                assert replay is not None
                dealer.connect(replay)
                await dealer.send_multipart([b"", (seq0 + 1).to_bytes(8, "big")])
                replies = []
                while True:
                    assert await dealer.poll(10_000)
                    frames = await dealer.recv_multipart()
                    replies.append(frames)
                    if frames[2] == END_SEQ:
                        break
                dealer.close(linger=0)
                assert [int.from_bytes(f[2], "big") for f in replies[:-1]] == [seq0 + 1, seq0 + 2]
                assert _stored(decode_batch(replies[0][3]))[0].token_ids == list(range(50, 70))

                # the cache was cleared: the first prompt misses again
                r = await c.post("/v1/completions", json=prompt)
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert (await sub.recv())[0] == seq0 + 3

                # restart: seq back to 0, cache empty, no AllBlocksCleared
                assert (await c.post("/admin/restart")).status_code == 200
                r = await c.post("/v1/completions", json=prompt)
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                seq, batch = await sub.recv()
                assert seq == 0 and isinstance(batch.events[0], BlockStored)

                # /reset_prefix_cache when idle
                assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
                assert (await sub.recv())[1].events == [AllBlocksCleared()]
            finally:
                sub.close()
        ctx.term()

    run(main())


def test_restart_fails_in_flight_requests() -> None:
    async def main() -> None:
        cfg = EngineConfig(time_scale=1.0, block_size=4, num_gpu_blocks=64)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            task = asyncio.create_task(
                c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 200})
            )

            async def running() -> bool:
                return (
                    'vllm:num_requests_running{engine="0",model_name="mock-model"} 1.0'
                    in (await c.get("/metrics")).text
                )

            await _wait_for(running)
            await c.post("/admin/restart")
            r = await task
            assert r.status_code == 503 and r.json()["error"]["message"] == "engine restarted"

    run(main())


def test_cache_hits_cut_latency() -> None:
    async def main() -> None:
        cfg = EngineConfig(block_size=16, num_gpu_blocks=512, max_model_len=8192, time_scale=1.0)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            body = {"prompt": [i % 200 for i in range(4000)], "max_tokens": 1}
            t0 = time.monotonic()
            await c.post("/v1/completions", json=body)
            cold = time.monotonic() - t0
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=body)
            warm = time.monotonic() - t0
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3984
            assert cold >= 0.4 and warm < 0.3, (cold, warm)

    run(main())


def test_preemption_keeps_outputs_deterministic() -> None:
    async def main() -> None:
        cfg = EngineConfig(time_scale=0.01, block_size=4, num_gpu_blocks=8, max_model_len=32)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            prompts = [[p * 10 + i for i in range(8)] for p in range(1, 4)]
            solo = []
            for p in prompts:
                r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 16})
                solo.append(r.json()["choices"][0]["text"])
            await c.post("/admin/clear")
            results = await asyncio.gather(
                *(c.post("/v1/completions", json={"prompt": p, "max_tokens": 16}) for p in prompts)
            )
            assert [r.json()["choices"][0]["text"] for r in results] == solo
            assert all(r.json()["usage"]["completion_tokens"] == 16 for r in results)
            text = (await c.get("/metrics")).text
            line = next(x for x in text.splitlines() if x.startswith("vllm:num_preemptions_total"))
            assert float(line.split()[-1]) > 0

    run(main())


def test_client_disconnect_aborts_stream() -> None:
    async def main() -> None:
        cfg = EngineConfig(time_scale=1.0, block_size=4, num_gpu_blocks=64)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": 500, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break

            async def idle() -> bool:
                return eng.ranks[0].load == 0 and eng.ranks[0].cache.num_free_blocks == 64

            await _wait_for(idle)

    run(main())


def test_fleet_and_cli(toy_dir: Path) -> None:
    async def main() -> None:
        base = fast(dp_size=2, tokenizer=str(toy_dir))
        async with Fleet.uniform(2, base) as fleet:
            assert len(set(fleet.urls)) == 2
            flat = [ep for eps in fleet.kv_endpoints for ep in eps]
            assert len(flat) == 4 and len(set(flat)) == 4
            assert fleet.engines[0].tokenizer.tok is fleet.engines[1].tokenizer.tok  # loaded once
            info = fleet.describe()
            assert info[1]["dp_size"] == 2 and len(info[1]["replay_endpoints"]) == 2
            async with httpx.AsyncClient(timeout=30) as c:
                for url in fleet.urls:
                    r = await c.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
                    assert r.status_code == 200
        fixed = Fleet.uniform(3, EngineConfig(dp_size=2), port=9000, kv_port=7000, replay_port=None)
        assert [e.config.port for e in fixed.engines] == [9000, 9001, 9002]
        assert [e.config.kv_port for e in fixed.engines] == [7000, 7002, 7004]
        assert [e.config.replay_port for e in fixed.engines] == [None, None, None]

    run(main())

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["mock-engine", "--engines", "3", "--dp-size", "2", "--kv-port", "5557"])
    assert args.func is cli.run_mock_engine and cli._check_ports(args) is None
    args = parser.parse_args(["mock-engine", "--engines", "3", "--dp-size", "40", "--replay-port", "5600"])
    assert "overlaps" in (cli._check_ports(args) or "")
    cfg = cli._config(parser.parse_args(["mock-engine", "--gpu-blocks", "99", "--time-scale", "0.5"]))
    assert (cfg.num_gpu_blocks, cfg.time_scale) == (99, 0.5)
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=EngineConfig) == cfg
    # a scaled-down trace replay: every cost per token, step and block is 8 real ones
    d = EngineConfig()
    cfg = cli._config(parser.parse_args(["mock-engine", "--token-scale", "8"]))
    assert cfg.prefill_s_per_token == pytest.approx(8 * d.prefill_s_per_token)
    assert cfg.step_overhead_s == pytest.approx(8 * d.step_overhead_s)
    assert cfg.decode_step_s == pytest.approx(8 * d.decode_step_s)
    assert cfg.kv_transfer_s_per_block == pytest.approx(8 * d.kv_transfer_s_per_block)
    assert cfg.max_num_batched_tokens == d.max_num_batched_tokens // 8
    assert cfg.num_gpu_blocks == d.num_gpu_blocks  # sizes are the caller's
    with pytest.raises(SystemExit):
        cli._config(parser.parse_args(["mock-engine", "--token-scale", "0"]))


def test_token_scale_slows_prefill_as_many_real_tokens() -> None:
    """A 1,000-token prompt on an engine whose token stands for 4 costs the prefill of 4,000 tokens
    (0.4 s at 0.1 ms a token): a lower bound, which a loaded machine cannot break."""

    async def main() -> None:
        cfg = token_scaled(EngineConfig(num_gpu_blocks=512, max_model_len=8192), 4.0)
        async with MockEngine(cfg) as eng, httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
            t0 = time.monotonic()
            body = {"prompt": [i % 200 for i in range(1000)], "max_tokens": 1}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert time.monotonic() - t0 >= 0.4
            assert r.json()["usage"]["prompt_tokens"] == 1000  # sizes stay the request's own

    run(main())
