"""``kv_events = "auto"``: a backend's KV event streams as the engine itself lists them.

vLLM answers ``GET /kv_event_sources`` with its publisher's resolved configuration per DP rank,
``{"<rank>": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events", ...}}``, each rank's ports already offset
by vLLM (rank r at port + r), ``tcp://*:0`` already resolved to the port it bound. So the router
needs no port of the engine's configured: it subscribes to every rank listed, and the number of
ranks is the backend's DP size.

How an entry becomes a :class:`~index.subscriber.SourceConfig`, following vLLM's own rules:

- a wildcard host (``*``, ``0.0.0.0``, ``[::]``) is the engine's host: the host of its URL;
- vLLM's PUB socket binds when its endpoint has ``*`` or ``::`` or is ``ipc://``; otherwise it
  connects to that address, which the router must then bind (``bind``); its replay ROUTER always
  binds;
- ``inproc://`` exists only inside the engine's process and a publisher other than ``zmq`` speaks
  another protocol: such a rank is not followed (logged);
- ranks must be numbered 0..n-1 (anything else is an unusable listing, and the streams followed so
  far stay).

When it is read (:class:`KVSourceDiscovery`, called by each successful health probe of such a
backend, before the probe marks it healthy, so a joining backend is subscribed before it can be
ready): at its first probe, at its first probe after a failed one (the engine may have restarted
with other ports or another DP size), and at most every ``health.kv_sources_refresh_s`` otherwise.
An engine without the endpoint (404: vLLM before it existed) is followed at vLLM's default
publisher port (:data:`VLLM_DEFAULT_PORT`; no replay, vLLM's default has none), said in one log
line; any other failure keeps what is followed and is retried at the next probe.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from index.subscriber import SourceConfig
from router.config import rank_endpoint
from router.fleet.membership import Member
from router.net.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("kvrouter.membership")

VLLM_DEFAULT_PORT = 5557
"""vLLM's default KV event endpoint, ``tcp://*:5557`` (KVEventsConfig.endpoint)."""

_WILDCARD = re.compile(r"^tcp://(\*|0\.0\.0\.0|\[::\]|\[::0\]|::):(\d+)$")

Apply = Callable[[Member, int, list[SourceConfig]], None]
"""Follow these sources (and this DP size) for a member, instead of what it had."""


class ListingError(ValueError):
    """A /kv_event_sources answer the router cannot use; the message says why."""


def url_host(url: str) -> str:
    """The host of a backend URL as ZMQ's tcp:// wants it (an IPv6 address in brackets)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def engine_address(endpoint: str, host: str) -> str:
    """The address to reach an engine's bound socket: its wildcard host replaced by ``host``."""
    m = _WILDCARD.match(endpoint)
    return f"tcp://{host}:{m.group(2)}" if m else endpoint


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind on a wildcard or ipc/inproc endpoint, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def listed_sources(listing: Any, instance: str, url: str) -> tuple[int, list[SourceConfig], list[str]]:
    """(DP size, the sources to follow, why some ranks are not followed) from a decoded
    ``/kv_event_sources`` answer; raises :class:`ListingError` when it cannot be used."""
    if not isinstance(listing, dict):
        raise ListingError("the answer is not a JSON object keyed by DP rank")
    ranks: dict[int, Any] = {}
    for key, value in listing.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ListingError(f"key {key!r} is not a DP rank")
        ranks[int(key)] = value
    if sorted(ranks) != list(range(len(ranks))):
        raise ListingError(f"DP ranks {sorted(ranks)} are not 0..{len(ranks) - 1}")
    host = url_host(url)
    sources: list[SourceConfig] = []
    skipped: list[str] = []
    for rank in sorted(ranks):
        cfg = ranks[rank]
        if not isinstance(cfg, dict):
            raise ListingError(f"rank {rank}: not an object")
        if not cfg.get("enable_kv_cache_events", False) or cfg.get("publisher", "zmq") == "null":
            skipped.append(f"rank {rank}: KV events off")
            continue
        endpoint, replay, topic = cfg.get("endpoint"), cfg.get("replay_endpoint"), cfg.get("topic", "")
        if not isinstance(endpoint, str) or not re.match(r"^(tcp|ipc|inproc)://.", endpoint):
            raise ListingError(f"rank {rank}: endpoint {endpoint!r} is not a ZMQ endpoint")
        if replay is not None and not (isinstance(replay, str) and re.match(r"^(tcp|ipc)://.", replay)):
            raise ListingError(f"rank {rank}: replay_endpoint {replay!r} is not a ZMQ endpoint")
        if not isinstance(topic, str):
            raise ListingError(f"rank {rank}: topic {topic!r} is not a string")
        if cfg.get("publisher", "zmq") != "zmq":
            skipped.append(f"rank {rank}: publisher {cfg.get('publisher')!r} is not zmq")
            continue
        if endpoint.startswith("inproc://"):
            skipped.append(f"rank {rank}: {endpoint} is inside the engine's process")
            continue
        binds = publisher_binds(endpoint)
        sources.append(
            SourceConfig(
                instance=instance,
                dp_rank=rank,
                endpoint=engine_address(endpoint, host) if binds else endpoint,
                replay_endpoint=engine_address(replay, host) if replay else None,
                bind=not binds,
                topic=topic,
            )
        )
    return len(ranks), sources, skipped


def fallback_sources(member: Member, default_topic: str) -> list[SourceConfig]:
    """An engine that does not list its streams: vLLM's default port on its host, rank r at + r."""
    spec = member.declared
    endpoint = f"tcp://{url_host(spec.url)}:{VLLM_DEFAULT_PORT}"
    topic = spec.kv_topic if spec.kv_topic is not None else default_topic
    return [
        SourceConfig(instance=spec.name, dp_rank=r, endpoint=rank_endpoint(endpoint, r), topic=topic)
        for r in range(spec.dp_size)
    ]


class KVSourceDiscovery:
    """Reads ``/kv_event_sources`` of ``auto`` backends when due and hands the result to ``apply``."""

    def __init__(
        self,
        client: UpstreamPool,
        apply: Apply,
        refresh_s: float,
        default_topic: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.apply = apply
        self.refresh_s = refresh_s
        self.default_topic = default_topic
        self.clock = clock
        self._read_at: dict[str, float] = {}
        """member -> when its listing (or its 404) was last read."""
        self._said: dict[str, str] = {}
        """member -> the last thing logged about its listing (each said once)."""
        self.reads = 0

    def due(self, member: Member, came_back: bool) -> bool:
        """Whether this probe of ``member`` should read its listing."""
        at = self._read_at.get(member.name)
        if at is None or came_back or member.kv_sources not in ("listed", "fallback"):
            return True
        return self.refresh_s > 0 and self.clock() - at >= self.refresh_s

    def forget(self, name: str) -> None:
        """The member left (or re-joins): its next probe reads the listing."""
        self._read_at.pop(name, None)
        self._said.pop(name, None)

    def _say(self, member: Member, level: int, message: str) -> None:
        if self._said.get(member.name) != message:
            self._said[member.name] = message
            log.log(level, "backend %s: %s", member.name, message)

    async def probe(self, member: Member, came_back: bool, timeout: float) -> None:
        """Read the listing of ``member`` if due and apply it; failures are logged, never raised
        (the probe's verdict on the backend's health is its /health's)."""
        if not self.due(member, came_back):
            return
        declared = member.declared
        self.reads += 1
        try:
            status, body = await self.client.fetch(
                "GET", f"{member.url}/kv_event_sources", member.auth_headers, timeout=timeout
            )
        except UpstreamError as exc:
            self._failed(member, f"GET /kv_event_sources failed: {type(exc).__name__}: {exc}")
            return
        if member.declared is not declared or member.state == "gone":
            return  # replaced or removed meanwhile: its next join reads again
        if status == 404:
            self._read_at[member.name] = self.clock()
            sources = fallback_sources(member, self.default_topic)
            if member.kv_sources != "fallback":
                self._say(
                    member,
                    logging.WARNING,
                    f"no GET /kv_event_sources (404): following vLLM's default publisher port "
                    f"{sources[0].endpoint if sources else VLLM_DEFAULT_PORT} (rank r at + r), "
                    "without replay",
                )
            member.kv_sources = "fallback"
            self.apply(member, declared.dp_size, sources)
            return
        if status != 200:
            self._failed(member, f"GET /kv_event_sources answered {status}")
            return
        try:
            dp_size, sources, skipped = listed_sources(msgspec.json.decode(body), member.name, member.url)
        except (msgspec.DecodeError, ListingError) as exc:
            self._failed(member, f"GET /kv_event_sources is unusable: {exc}")
            return
        self._read_at[member.name] = self.clock()
        member.kv_sources = "listed"
        shown = ", ".join(s.endpoint for s in sources) or "none"
        extra = f" (not followed: {'; '.join(skipped)})" if skipped else ""
        self._say(member, logging.INFO, f"KV events of {dp_size} DP rank(s) listed: {shown}{extra}")
        self.apply(member, dp_size, sources)

    def _failed(self, member: Member, message: str) -> None:
        """Keep what is followed; retried at the next probe (not due by time: by state)."""
        if member.kv_sources not in ("listed", "fallback"):
            member.kv_sources = f"error: {message}"
        self._read_at.pop(member.name, None)
        self._say(member, logging.WARNING, f"{message} (retried at the next probe)")


__all__ = [
    "VLLM_DEFAULT_PORT",
    "KVSourceDiscovery",
    "ListingError",
    "engine_address",
    "fallback_sources",
    "listed_sources",
    "publisher_binds",
    "url_host",
]
