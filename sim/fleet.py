"""A fleet of mock vLLM engines in one process and one asyncio loop.

A 2-core machine cannot run one process per engine next to the router and a load generator, and the
engines spend their time in `asyncio.sleep` anyway, so all of them share the caller's loop. Each engine
still has its own HTTP port, its own KV publisher per DP rank and its own caches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from router.decision.chat import ChatTokenizer
from sim.engine import EngineConfig, MockEngine


def _offset(port: int | None, by: int) -> int | None:
    """A fixed base port shifted for engine i; 0 (ephemeral) and None (disabled) stay as they are."""
    if not port:
        return port
    return port + by


class Fleet:
    """N mock engines; start/stop them together and read their URLs and KV endpoints."""

    def __init__(self, configs: Sequence[EngineConfig], tokenizer: ChatTokenizer | None = None) -> None:
        if not configs:
            raise ValueError("a fleet needs at least one engine")
        tokenizers: dict[str, ChatTokenizer] = {}
        self.engines: list[MockEngine] = []
        for cfg in configs:
            tok = tokenizer
            if tok is None and cfg.tokenizer is not None:
                # Load each tokenizer once, however many engines share it.
                tok = tokenizers.get(cfg.tokenizer)
                if tok is None:
                    tok = tokenizers[cfg.tokenizer] = ChatTokenizer.from_path(cfg.tokenizer)
            self.engines.append(MockEngine(cfg, tok))
        self._started: list[MockEngine] = []

    @classmethod
    def uniform(
        cls,
        n: int,
        base: EngineConfig | None = None,
        *,
        port: int = 0,
        kv_port: int = 0,
        replay_port: int | None = 0,
        tokenizer: ChatTokenizer | None = None,
        side_channel_port: int = 0,
    ) -> Fleet:
        """`n` engines like `base`: engine i listens on port+i and publishes rank r on
        kv_port + i*dp_size + r (replay and the NIXL side channel likewise), so DP ranges never
        overlap; 0 = ephemeral ports."""
        base = base or EngineConfig()
        dp = base.dp_size
        configs = [
            msgspec.structs.replace(
                base,
                port=_offset(port, i) or 0,
                kv_port=_offset(kv_port, i * dp) or 0,
                replay_port=_offset(replay_port, i * dp),
                kv_side_channel_port=_offset(side_channel_port, i * dp) or 0,
            )
            for i in range(n)
        ]
        return cls(configs, tokenizer)

    async def start(self) -> None:
        """Start every engine; on failure the ones already started are stopped again."""
        try:
            for engine in self.engines:
                await engine.start()
                self._started.append(engine)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every started engine, concurrently (each takes ~0.25 s to drain); idempotent."""
        started, self._started = self._started, []
        await asyncio.gather(*(e.stop() for e in started))

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def urls(self) -> list[str]:
        """Base URL of each engine."""
        return [e.url for e in self.engines]

    @property
    def kv_endpoints(self) -> list[list[str]]:
        """Per engine, the PUB endpoint of each DP rank."""
        return [e.kv_endpoints for e in self.engines]

    @property
    def replay_endpoints(self) -> list[list[str | None]]:
        """Per engine, the replay endpoint of each DP rank (None when replay is off)."""
        return [e.replay_endpoints for e in self.engines]

    def describe(self) -> list[dict[str, Any]]:
        """One JSON-able record per engine (url, model, dp_size, block size, KV cache groups, kv and
        replay endpoints)."""
        return [
            {
                "url": e.url,
                "model": e.config.model,
                "dp_size": e.config.dp_size,
                "block_size": e.config.block_size,
                "kv_groups": e.config.kv_groups,
                "kv_endpoints": e.kv_endpoints,
                "replay_endpoints": e.replay_endpoints,
                "side_channels": e.side_channels,
            }
            for e in self.engines
        ]
