"""The router checks its own predictions against what each engine reports it served from cache.

vLLM reports, per request, the prompt tokens it counted (``usage.prompt_tokens``) and how many of
them its prefix cache served (``usage.prompt_tokens_details.cached_tokens``, with
``--enable-prompt-tokens-details``; in the final SSE event with ``stream_options.include_usage``).
The router knows what it predicted for the chosen target: the matched prefix blocks (GPU, CPU,
storage and predicted-on-route) times that source's block size, capped as vLLM caps hits (the last
prompt token is always computed: at most ``floor((prompt - 1) / block) * block`` tokens). Each
proxied request with usage becomes one check:

- ``exact``: the same number of tokens; ``within_block``: off by less than one block;
- ``over``: the router predicted at least a block more than the engine served;
- ``under``: the engine served at least a block more than the router predicted;
- ``no_usage``: the engine reported no cached-token count.

A check costs a few microseconds and runs after the response went out (scheduled on the event loop).
Per backend, the last ``window`` checks give a **diagnosis** when a problem is systematic (at least
``threshold`` of them), naming the likely cause as an operator would find it by hand:

- prompt token counts differ from the engine's: on chat requests only, the chat template differs; on
  completions too, the tokenizer differs;
- the engine hits blocks its events never announced (predict-on-route may have guessed them): no
  events arrive from it (endpoint, topic, ``--kv-events-config``), or block size / hashing differ;
- the router predicted blocks the engine did not have: a stale index (lost events, no replay);
- the engine reports no usage details: ``--enable-prompt-tokens-details`` is off;
- the engine's events carry another block size than the config's ``block_size`` (routing adapts to
  the engine's size; the config should say so).

A diagnosis is logged once when it appears or changes, shown on the dashboard and in /debug/index.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec


class _Transfer(Protocol):
    @property
    def prefill_status(self) -> str: ...


class Route(Protocol):
    """What a check reads of a decision (:class:`router.decision.service.Route`, made floors above)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def tokenize_error(self) -> str | None: ...

    @property
    def pd(self) -> _Transfer | None: ...

    def media_of(self, target: tuple[str, int]) -> dict[str, int]: ...


log = logging.getLogger("kvrouter.checks")

RESULTS = ("exact", "within_block", "over", "under", "no_usage")
_DIAGNOSE_EVERY = 5
ERROR_BUCKETS = (-4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 15.0, 63.0, 255.0, 1023.0, 4095.0)


class ChecksConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[checks]``: comparing predicted cached tokens with the engines' own counts."""

    enabled: bool = True
    """Compare each request's predicted cached tokens with the engine's ``usage`` (docs/operations.md)."""
    stream_usage_every: int = 8
    """Ask the engine for usage (``stream_options.include_usage``) on one in this many client streams
    that did not ask for it, and strip it from what the client receives; 0 never asks."""
    window: int = 100
    """Checks kept per backend for its diagnosis."""
    min_checks: int = 10
    """Checks needed before a diagnosis is made."""
    threshold: float = 0.5
    """Share of a backend's recent checks that must show a problem for a diagnosis."""
    recent: int = 50
    """Mismatches kept for /debug/index."""


class Check(msgspec.Struct):
    """One comparison, as /debug/index lists the mismatches."""

    time: float
    backend: str
    dp_rank: int
    endpoint: str
    result: str
    predicted_tokens: int
    engine_cached_tokens: int | None
    router_prompt_tokens: int
    engine_prompt_tokens: int | None
    block_size: int
    predicted_blocks: dict[str, int]
    confirmed_tokens: int = 0
    """Of the prediction, what the engine's own events confirmed (predict-on-route left out)."""


class StreamStats(msgspec.Struct):
    """What the index knows of a backend's event streams (for telling causes apart)."""

    batches: int = 0
    connected: bool = False
    lost: int = 0
    block_size: int | None = None
    configured_block_size: int | None = None
    kv_groups: dict[int, str] | None = None
    """A hybrid model's KV cache groups (None: one group)."""
    group_faults: int = 0


class PredictionChecks:
    """Counts checks, keeps each backend's recent ones, and names systematic problems."""

    def __init__(
        self,
        config: ChecksConfig | None = None,
        streams: Callable[[str], StreamStats] | None = None,
    ) -> None:
        self.config = config or ChecksConfig()
        self.streams = streams or (lambda name: StreamStats())
        self.counts: dict[tuple[str, str], int] = {}
        """(backend, result) -> checks."""
        self.mismatched_prompts: dict[str, int] = {}
        """backend -> requests whose prompt token count differed from the engine's."""
        self.error_buckets: list[int] = [0] * (len(ERROR_BUCKETS) + 1)
        self.error_sum = 0.0
        self.error_count = 0
        self._windows: dict[str, collections.deque[Check]] = {}
        self.recent: collections.deque[Check] = collections.deque(maxlen=self.config.recent)
        self._diagnoses: dict[str, str | None] = {}
        self._seen: dict[str, int] = {}
        self._details_seen: set[str] = set()
        """Backends that reported a cached-token count once: they run with the flag, and a usage
        without one means nothing was cached (vLLM writes the field only when some was)."""

    # --- one check ---------------------------------------------------------------------------------
    def observe(
        self,
        backend: str,
        dp_rank: int,
        endpoint: str,
        prompt_tokens: int,
        block_size: int,
        predicted_blocks: dict[str, int],
        usage: dict[str, Any] | None,
    ) -> Check:
        """Compare one request's prediction with the engine's usage (None: it reported none)."""
        cap = max(prompt_tokens - 1, 0) // block_size * block_size if prompt_tokens and block_size else None
        predicted = sum(predicted_blocks.values()) * block_size
        confirmed = (sum(predicted_blocks.values()) - predicted_blocks.get("PREDICTED", 0)) * block_size
        if cap is not None:
            predicted, confirmed = min(predicted, cap), min(confirmed, cap)
        engine_prompt = _int(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None:
            self._details_seen.add(backend)
        elif details is None and engine_prompt is not None and backend in self._details_seen:
            cached = 0  # vLLM leaves prompt_tokens_details out when nothing was cached
        if cached is None:
            result = "no_usage"
        else:
            error = cached - predicted
            self._observe_error(error)
            if error == 0:
                result = "exact"
            elif abs(error) < block_size:
                result = "within_block"
            else:
                result = "over" if error < 0 else "under"
        check = Check(
            time.time(),
            backend,
            dp_rank,
            endpoint,
            result,
            predicted,
            cached,
            prompt_tokens,
            engine_prompt,
            block_size,
            predicted_blocks,
            confirmed,
        )
        key = (backend, result)
        self.counts[key] = self.counts.get(key, 0) + 1
        mismatch = engine_prompt is not None and prompt_tokens > 0 and engine_prompt != prompt_tokens
        if mismatch:
            self.mismatched_prompts[backend] = self.mismatched_prompts.get(backend, 0) + 1
        if mismatch or result in ("over", "under"):
            self.recent.append(check)
        if usage is None:
            return check  # no usage at all (a stream nobody asked it for): counted, nothing to learn
        window = self._windows.get(backend)
        if window is None:
            window = self._windows[backend] = collections.deque(maxlen=self.config.window)
        window.append(check)
        seen = self._seen.get(backend, 0) + 1
        self._seen[backend] = seen
        if seen % _DIAGNOSE_EVERY == 0 or seen == self.config.min_checks:
            self._update_diagnosis(backend)  # (it reads the event streams' state: not every request)
        return check

    def _observe_error(self, error: int) -> None:
        i = 0
        for bound in ERROR_BUCKETS:
            if error <= bound:
                break
            i += 1
        self.error_buckets[i] += 1
        self.error_sum += error
        self.error_count += 1

    # --- diagnosis -----------------------------------------------------------------------------------
    def diagnosis(self, backend: str) -> str | None:
        """The likely cause of a systematic disagreement, in words; None when predictions agree."""
        return self._diagnoses.get(backend)

    def _update_diagnosis(self, backend: str) -> None:
        new = self._diagnose(backend)
        old = self._diagnoses.get(backend)
        self._diagnoses[backend] = new
        if new != old:
            if new is None:
                log.info("backend %s: the router's predictions agree with the engine again", backend)
            else:
                log.warning("backend %s: %s", backend, new)

    def _diagnose(self, backend: str) -> str | None:
        cfg = self.config
        window = list(self._windows.get(backend, ()))
        streams = self.streams(backend)
        config_size = streams.configured_block_size
        size_note = None
        if streams.block_size and config_size and streams.block_size != config_size:
            size_note = (
                f"block size: the engine's events carry {streams.block_size}-token blocks but the config "
                f"says block_size = {config_size} (prompts are hashed at the engine's size, so routing "
                "works; set block_size to match)"
            )
        if len(window) < cfg.min_checks:
            return size_note
        need = cfg.threshold * len(window)
        with_usage = [c for c in window if c.engine_prompt_tokens is not None]
        mism = [
            c
            for c in with_usage
            if c.engine_prompt_tokens != c.router_prompt_tokens and c.router_prompt_tokens
        ]
        if with_usage and len(mism) >= cfg.threshold * len(with_usage):
            last = mism[-1]
            sample = (
                f"router {last.router_prompt_tokens}, engine {last.engine_prompt_tokens} "
                f"on a recent {last.endpoint} request"
            )
            chat_ok = [c for c in with_usage if c.endpoint == "chat" and c not in mism]
            comp = [c for c in with_usage if c.endpoint == "completions"]
            comp_bad = [c for c in comp if c in mism]
            chat_bad = [c for c in mism if c.endpoint == "chat"]
            if chat_bad and comp and not comp_bad and not chat_ok:
                return (
                    f"prompt token counts differ from the engine's on chat requests only ({sample}): "
                    "the router's chat template is not the one the engine renders"
                )
            return (
                f"prompt token counts differ from the engine's ({sample}): the router's tokenizer (or "
                "chat template) is not the engine's, so its block keys cannot match"
            )
        # usage without the cached count although the router predicted cached blocks (vLLM leaves the
        # count out when nothing was cached: with nothing predicted, both agree)
        no_usage = [c for c in window if c.result == "no_usage" and c.predicted_tokens]
        if len(no_usage) >= need:
            return (
                "the engine reports no cached-token counts where the router predicted cached blocks: "
                "it runs without --enable-prompt-tokens-details (start vLLM with it so the router can "
                "check its predictions), or the router's index is stale (vLLM omits the count when "
                "nothing was cached)"
            )
        # hits the engine's events never told us of (predict-on-route may have guessed them right)
        blind = [
            c for c in window if c.confirmed_tokens == 0 and (c.engine_cached_tokens or 0) >= c.block_size
        ]
        if len(blind) >= need:
            if not streams.batches or not streams.connected:
                return (
                    "the engine serves cached prefixes the router never heard of: no KV events arrive from "
                    "it (check kv_events, the topic, and that vLLM runs with --kv-events-config)"
                )
            if streams.lost:
                return (
                    f"the engine hits blocks whose events were lost ({streams.lost} batches lost so far): "
                    "configure kv_replay (vLLM's replay_endpoint) so gaps are recovered"
                )
            # events arrive: a hit predict-on-route foresaw is a burst ahead of its events, not a
            # fault, while some of the window's checks are confirmed by events; none ever is when
            # the keys differ (steady traffic keeps predictions fresh enough to hide that otherwise)
            unforeseen = [c for c in blind if c.result == "under"]
            if len(unforeseen) >= need or not any(c.confirmed_tokens for c in window):
                return size_note or (
                    "the engine hits blocks its events never announced although they arrive: the block "
                    "size or the block contents differ (block_size, LoRA adapters, cache_salt, tokenizer)"
                )
        under = [c for c in window if c.result == "under"]
        if len(under) >= need:
            return (
                "the engine serves more from cache than the router predicted: events are late or lost "
                f"({streams.lost} batches lost so far; configure kv_replay)"
            )
        over = [c for c in window if c.result == "over"]
        if len(over) >= need and streams.kv_groups and not streams.lost:
            groups = ", ".join(f"{g}: {k}" for g, k in sorted(streams.kv_groups.items()))
            return (
                "the router predicted cached blocks the engine did not serve on a hybrid model (KV cache "
                f"groups {groups}): no events were lost, so the group rule of vLLM's hybrid coordinator "
                "served less than the index's model of it"
                + (
                    f" ({streams.group_faults} malformed group events: see the log)"
                    if streams.group_faults
                    else "; a group the engine never announced, or a rule this router version lacks"
                )
            )
        if len(over) >= need:
            return (
                "the router predicted cached blocks the engine did not have: its index is stale (events "
                f"lost or not replayed: {streams.lost} batches lost so far; check kv_replay and "
                "kvrouter_kv_lost_batches_total)"
            )
        return size_note

    # --- views ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Per backend: checks by result, prompt mismatches, diagnosis; and the latest mismatches."""
        backends: dict[str, Any] = {}
        for (backend, result), n in sorted(self.counts.items()):
            entry = backends.setdefault(backend, {"checks": dict.fromkeys(RESULTS, 0)})
            entry["checks"][result] = n
        for backend, entry in backends.items():
            entry["prompt_token_mismatches"] = self.mismatched_prompts.get(backend, 0)
            entry["diagnosis"] = self._diagnoses.get(backend)
        return {"backends": backends, "recent_mismatches": [msgspec.to_builtins(c) for c in self.recent]}

    def diagnoses(self) -> dict[str, str]:
        """Backends with a diagnosis."""
        return {b: d for b, d in self._diagnoses.items() if d}

    def forget(self, backend: str, removed: bool = False) -> None:
        """The backend left the fleet or re-joined; ``removed``: it left for good, and its counters
        go too (pod churn names new backends at every rollout: kept, their series grew for good)."""
        self._windows.pop(backend, None)
        self._diagnoses.pop(backend, None)
        self._seen.pop(backend, None)
        self._details_seen.discard(backend)
        if removed:
            for key in [k for k in self.counts if k[0] == backend]:
                del self.counts[key]
            self.mismatched_prompts.pop(backend, None)


def route_checkable(route: Route, status: int) -> bool:
    """Whether a served request's usage can check its prediction: a 200 whose prompt was tokenized
    whole, not after a P/D prefill leg (the engine's cached count then includes the blocks it
    pulled from the prefill engine, which no prediction of its own index covers), nor a media
    prompt (its tokens are its text before the media)."""
    transferred = route.pd is not None and route.pd.prefill_status == "ok"
    return status == 200 and bool(route.prompt_tokens) and route.tokenize_error is None and not transferred


def observe_route(
    checks: PredictionChecks,
    route: Route,
    target: tuple[str, int],
    block_size: int,
    usage: dict[str, Any] | None,
) -> None:
    """One prediction check of a request ``target`` served (the proxy's and the endpoint picker's)."""
    predicted = route.media_of(target)
    checks.observe(target[0], target[1], route.endpoint, route.prompt_tokens, block_size, predicted, usage)


def _int(v: Any) -> int | None:
    return v if type(v) is int else None


# --- finding usage in responses -------------------------------------------------------------------


def usage_in_json(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON completion (searched from the end, where vLLM puts it)."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    obj = _object_after(body, at + 7)
    if obj is None:
        return None
    try:
        usage = msgspec.json.decode(obj)
    except msgspec.DecodeError:
        return None
    return usage if isinstance(usage, dict) else None


def _object_after(data: bytes, i: int) -> bytes | None:
    """The JSON object following ``"key"`` at ``i`` (after the colon), by matching braces."""
    n = len(data)
    while i < n and data[i] in b" \t\r\n:":
        i += 1
    if i >= n or data[i] != 0x7B:  # {  (null or anything else: no usage)
        return None
    depth = 0
    in_str = False
    j = i
    while j < n:
        c = data[j]
        if in_str:
            if c == 0x5C:  # backslash
                j += 2
                continue
            if c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return data[i : j + 1]
        j += 1
    return None


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n")


def sse_events(events: bytes) -> list[bytes]:
    """Whole SSE events split into events each with its own end (``\\n\\n`` or ``\\r\\n\\r\\n``: both
    are SSE; splitting on the first only read a CRLF stream's events as one)."""
    parts = _EVENT_END.split(events)
    ends = _EVENT_END.findall(events)
    return [p + e for p, e in zip(parts, ends, strict=False)] + ([parts[-1]] if parts[-1] else [])


def _data_json(event: bytes) -> bytes | None:
    """The JSON object of an event that is one ``data:`` line (``data: {`` or ``data:{``)."""
    body = event.rstrip(b"\r\n")
    if body.startswith(b"data: {"):
        return body[6:]
    if body.startswith(b"data:{"):
        return body[5:]
    return None


def usage_event(event: bytes) -> dict[str, Any] | None:
    """The usage of an SSE event that carries one (``data: {..., "usage": {...}}``)."""
    if b'"usage"' not in event:
        return None
    data = _data_json(event)
    return usage_in_json(data) if data is not None else None


def sse_usage(events: bytes) -> dict[str, Any] | None:
    """The last usage carried by these whole SSE events, if any (with continuous usage stats every
    event has one: the final one has the cached tokens)."""
    found = None
    for event in sse_events(events):
        usage = usage_event(event)
        if usage is not None:
            found = usage
    return found


def strip_usage(events: bytes) -> bytes:
    """Whole SSE events with the usage the router asked for removed: the final usage event (empty
    ``choices``) is dropped, and ``"usage": null`` fields that some servers add to every chunk when
    usage is requested are taken out, so the client receives what it would have without it."""
    if b'"usage"' not in events:
        return events
    out = []
    for event in sse_events(events):
        data = _data_json(event) if b'"usage"' in event else None
        if data is not None:
            try:
                obj = msgspec.json.decode(data)
            except msgspec.DecodeError:
                out.append(event)
                continue
            if isinstance(obj, dict) and "usage" in obj:
                if obj.get("usage") is not None and not obj.get("choices"):
                    continue  # the usage event itself
                del obj["usage"]
                end = event[len(event.rstrip(b"\r\n")) :]
                event = b"data: " + msgspec.json.encode(obj) + end
        out.append(event)
    return b"".join(out)


__all__ = [
    "Check",
    "ChecksConfig",
    "PredictionChecks",
    "StreamStats",
    "sse_events",
    "strip_usage",
    "usage_event",
    "usage_in_json",
]
