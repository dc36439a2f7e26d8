"""The membership, kept live: transitions wired to the index and the load tracker, joiners probed at
once, and the state machine advanced by a small periodic task.

:class:`FleetRuntime` is the one object the rest of the router holds for "the fleet": the
:class:`~router.fleet.membership.Membership` (who), the :class:`~router.fleet.health.HealthChecker`
(healthy or not) and the glue between a transition and what it costs elsewhere:

- a backend joins: one event source per DP rank is subscribed (the subscriber thread connects and
  bootstraps from the engine's replay buffer), its targets get load records (and load-board slots
  with several workers), and it is probed at once;
- it becomes ready when the probe succeeded and every stream finished its bootstrap;
- it is gone: its sources are unsubscribed and their index entries freed by the subscriber thread in
  slices (never in one long pause of the event loop), its load records and board slots released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from index.kvindex import KVIndex
from index.subscriber import SourceConfig
from router.config import AUTO, BackendConfig, HealthConfig, MembershipConfig, rank_endpoint
from router.fleet.breaker import Breakers
from router.fleet.health import HealthChecker
from router.fleet.kvsources import KVSourceDiscovery
from router.fleet.load import LoadTracker
from router.fleet.membership import Member, Membership
from router.net.upstream import UpstreamPool

log = logging.getLogger("kvrouter.membership")

TICK_S = 0.05
"""How often joining and draining members are looked at (cheap: a pass over the members)."""


def sources_of(spec: BackendConfig, default_topic: str) -> list[SourceConfig]:
    """One event source per DP rank of a backend with KV events (vLLM's port + rank rule); none
    for ``kv_events = "auto"``, whose sources the engine lists (:class:`KVSourceDiscovery`)."""
    if spec.kv_events is None or spec.kv_events == AUTO:
        return []
    return [
        SourceConfig(
            instance=spec.name,
            dp_rank=rank,
            endpoint=rank_endpoint(spec.kv_events, rank),
            replay_endpoint=rank_endpoint(spec.kv_replay, rank) if spec.kv_replay else None,
            bind=spec.kv_bind,
            topic=spec.kv_topic if spec.kv_topic is not None else default_topic,
        )
        for rank in range(spec.dp_size)
    ]


class FleetRuntime:
    """Membership + health + the wiring of transitions (implements ``MembershipListener``)."""

    def __init__(
        self,
        index: KVIndex,
        loads: LoadTracker,
        client: UpstreamPool,
        health: HealthConfig,
        config: MembershipConfig,
        default_topic: str = "",
    ) -> None:
        self.index = index
        self.loads = loads
        self.default_topic = default_topic
        self.membership = Membership(config)
        self.discovery = KVSourceDiscovery(client, self.follow, health.kv_sources_refresh_s, default_topic)
        self.health = HealthChecker(self.membership, health, client, loads, self.discovery.probe)
        self.breakers = Breakers(health.breaker)
        self.membership.listeners.append(self)
        self._sources: dict[str, list[SourceConfig]] = {}
        self._task: asyncio.Task[None] | None = None
        self.tick_hooks: list[Callable[[], None]] = []
        """Run on every tick before the transitions (e.g. applying other workers' admin changes)."""

    # --- MembershipListener ----------------------------------------------------------------------
    def joined(self, member: Member) -> None:
        sources = sources_of(member.spec, self.default_topic)
        self._sources[member.name] = sources
        for source in sources:
            self.index.add_source(source)
        for target in member.targets:
            self.loads.track(target)
        self.health.probe_soon(member)

    def left(self, member: Member) -> None:
        self.discovery.forget(member.name)
        for source in self._sources.pop(member.name, []):
            self.index.remove_source(source.source_id)
        if member.same_engine:
            return  # only its event endpoints change: its running requests and breaker stay
        for target in member.targets:
            self.loads.forget(target)
        self.breakers.forget(member.name)

    def follow(self, member: Member, dp_size: int, sources: list[SourceConfig]) -> None:
        """An ``auto`` backend's streams as its engine listed them: sources no longer listed (or
        listed with other endpoints) are dropped with their blocks, new ones subscribed (and
        bootstrapped from their replay), and a new DP size moves its targets' load records."""
        if self.membership.get(member.name) is not member:
            return  # gone meanwhile
        old = self._sources.get(member.name, [])
        for source in old:
            if source not in sources:
                self.index.remove_source(source.source_id)
        for source in sources:
            if source not in old:
                self.index.add_source(source)
        self._sources[member.name] = list(sources)
        before = member.targets
        self.membership.resize(member, dp_size, f"dp_size {dp_size} listed by /kv_event_sources")
        after = member.targets
        for target in before:
            if target not in after:
                self.loads.forget(target)
        for target in after:
            if target not in before:
                self.loads.track(target)

    # --- what tick() needs -------------------------------------------------------------------------
    def streams_ready(self, member: Member) -> bool:
        """Every event stream of the member finished its first bootstrap (or has none); an ``auto``
        backend's streams are known once its listing was read (or it has none: the fallback)."""
        if member.kv_sources and member.kv_sources not in ("listed", "fallback"):
            return False
        return all(self.index.source_ready(s.source_id) for s in self._sources.get(member.name, []))

    def inflight(self, member: Member) -> int:
        """Requests this router has in flight on the member."""
        return self.loads.local_active(member.targets)

    def tick(self) -> None:
        """Advance joining -> ready and draining -> gone."""
        for hook in self.tick_hooks:
            hook()
        self.membership.tick(self.inflight, self.streams_ready)

    # --- lifecycle -------------------------------------------------------------------------------
    async def settle(self, timeout_s: float = 2.0) -> None:
        """At start-up: wait (briefly) for healthy joiners to finish their bootstrap, so that a router
        starting next to a running fleet serves with its index filled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self.tick()
            waiting = [m for m in self.membership.members.values() if m.state == "joining" and m.healthy]
            if not waiting or loop.time() >= deadline:
                return
            await asyncio.sleep(0.01)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # a bug in one transition must not stop the others
                log.exception("membership tick failed")

    def start(self) -> None:
        """Start health checks and the transition task."""
        self.health.start()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvrouter-membership")

    async def stop(self) -> None:
        """Stop health checks and the transition task (members and index stay as they are)."""
        await self.health.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["FleetRuntime", "sources_of"]
