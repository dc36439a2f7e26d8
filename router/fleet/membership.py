"""Membership: which backends the fleet has right now, and where each is in its life.

Every source of membership (the config file and its reloads, the admin API, Kubernetes discovery)
feeds one :class:`Membership`, which owns a :class:`Member` per backend name and moves it through

    joining ──► ready ──► draining ──► gone
       ▲                     │ (drained, kept: a PUT brings it back)
       └──── replaced ◄──────┘

- **joining**: its event streams are subscribed and bootstrapping (the engine's replay buffer is
  being read into the index); it gets no request yet. It becomes *ready* once a health probe
  succeeded and its streams finished the bootstrap (or after ``join_timeout_s``).
- **ready**: a candidate whenever it is healthy. A failed health check is *not* a membership
  change: the backend is skipped, its index kept, and it is back at the first good probe.
- **draining**: no new request goes there; requests and streams in flight finish. When none is
  left (or after ``drain_timeout_s``) it is removed, unless it was drained to be kept.
- **gone**: its event sources are unsubscribed, its index entries freed (in the subscriber thread,
  in slices) and its load rows cleared; the record is dropped, the transition log keeps it.

The class is synchronous and does no I/O: the listeners (the index wiring, the load tracker) do the
work of a transition, and the caller drives time with :meth:`Membership.tick`. Every change is O(1)
in the size of the departing backend's index (the index frees it later, off the event loop).

Who wins when sources disagree (documented in the README): each member remembers its *origin*. A
config (re)load is authoritative for the names the file lists; backends added through the admin API
stay across reloads unless the file names them; Kubernetes owns the pods it discovered, and a pod
whose name another origin already uses is skipped with a log line.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal, Protocol
from urllib.parse import urlsplit

import msgspec

from router.config import AUTO, BackendConfig, MembershipConfig
from router.net.upstream import UpstreamPool

log = logging.getLogger("kvrouter.membership")

State = Literal["joining", "ready", "draining", "gone"]
STATES: tuple[State, ...] = ("joining", "ready", "draining", "gone")
Origin = Literal["config", "admin", "kubernetes"]
Target = tuple[str, int]

_MAX_INDEXED_MODELS = 4096
"""Models the candidate index holds at once (a request's model is the client's string)."""

# fields whose change needs new event subscriptions (and so a new join); the others are updated in place
_REJOIN_FIELDS = ("url", "kv_events", "kv_replay", "kv_bind", "kv_topic", "dp_size")


class Transition(msgspec.Struct):
    """One membership change, for /debug/index, the dashboard and the log."""

    time: float
    backend: str
    origin: str
    change: str
    """joined | ready | draining | drained | removed | replaced | updated | readmitted."""
    state: str
    reason: str


class Member:
    """One backend: its spec, its membership state, and what health probes learned about it."""

    __slots__ = (
        "_discovery_ready",
        "_healthy",
        "_lora_parents",
        "_models",
        "_owner",
        "_spec",
        "_state",
        "base_path",
        "checked_at",
        "declared",
        "discovered_dp",
        "drain_deadline",
        "failures",
        "joined_at",
        "kv_sources",
        "last_error",
        "models_known",
        "name",
        "origin",
        "reason",
        "remove_when_drained",
        "same_engine",
        "state_since",
        "upstream_key",
        "url",
    )

    def __init__(self, spec: BackendConfig, origin: Origin, now: float) -> None:
        self._owner: Membership | None = None
        """The membership holding it, told when what makes it a candidate changes."""
        self.name = spec.name
        self.origin: Origin = origin
        self.state = "joining"
        self.state_since = now
        self.joined_at = now
        self.reason = ""
        self.remove_when_drained = False
        self.drain_deadline = 0.0
        self.healthy = False
        self.failures = 0
        self.checked_at = 0.0
        self.last_error = ""
        self.discovery_ready = True
        self.same_engine = False
        """True while a re-join changes only the event endpoints (same URL and DP size): the
        listeners keep what belongs to the engine itself (the load of its running requests, its
        breaker) instead of forgetting it as they do for a backend that left."""
        self.lora_parents = {}
        self.discovered_dp: int | None = None
        """With ``kv_events = "auto"``: the DP size the engine's /kv_event_sources listed (it
        overrides the spec's); None until listed."""
        self.kv_sources = "pending" if spec.kv_events == AUTO else ""
        """With ``kv_events = "auto"``: where its event streams come from ("pending", "listed",
        "fallback", or "error: ..." while none was read); "" otherwise."""
        self.models_known = spec.models is not None
        """The models it serves are known: configured, or read from its /v1/models. False for a
        backend never reached: an unknown model may be one it serves (503, not 404)."""
        self.set_spec(spec)
        self.models = set(spec.models or [])

    def set_spec(self, spec: BackendConfig) -> None:
        """Take a new spec (its name is this member's). ``declared`` keeps it as its origin gave it
        (what a reload is compared with); ``spec`` is what the router uses: the same, but for the DP
        size an ``auto`` engine listed itself."""
        self.declared = spec
        dp = self.discovered_dp
        auto = spec.kv_events == AUTO
        self.spec = msgspec.structs.replace(spec, dp_size=dp) if auto and dp and dp != spec.dp_size else spec
        self.url = spec.url.rstrip("/")
        self.upstream_key = UpstreamPool.key_of(self.url)
        self.base_path = urlsplit(self.url).path.rstrip("/")
        if spec.models is not None:
            self.models = set(spec.models)
            self.models_known = True

    # --- what makes it a candidate: a change tells the membership (its candidate index) ---------
    def _changed(self) -> None:
        owner = self._owner
        if owner is not None:
            owner.routing_changed()

    @property
    def state(self) -> State:
        """Where it is in its life (module docstring)."""
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        if getattr(self, "_state", None) != value:
            self._state = value
            self._changed()

    @property
    def healthy(self) -> bool:
        """The last probe (or proxied request) found it up, serving some model."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if getattr(self, "_healthy", None) != value:
            self._healthy = value
            self._changed()

    @property
    def discovery_ready(self) -> bool:
        """False while the discovery source reports the backend not ready (a Kubernetes readiness
        flap): skipped like a failed health check, index kept."""
        return self._discovery_ready

    @discovery_ready.setter
    def discovery_ready(self, value: bool) -> None:
        if getattr(self, "_discovery_ready", None) != value:
            self._discovery_ready = value
            self._changed()

    @property
    def models(self) -> set[str]:
        """The models it serves (replace the set to change it: the candidate index is told)."""
        return self._models

    @models.setter
    def models(self, value: set[str]) -> None:
        if getattr(self, "_models", None) != value:
            self._models = value
            self._changed()

    @property
    def lora_parents(self) -> dict[str, str]:
        """LoRA adapter name -> base model, from /v1/models."""
        return self._lora_parents

    @lora_parents.setter
    def lora_parents(self, value: dict[str, str]) -> None:
        if getattr(self, "_lora_parents", None) != value:
            self._lora_parents = value
            self._changed()

    @property
    def spec(self) -> BackendConfig:
        """The spec the router uses (:meth:`set_spec`)."""
        return self._spec

    @spec.setter
    def spec(self, value: BackendConfig) -> None:
        if getattr(self, "_spec", None) is not value:
            self._spec = value
            self._changed()

    @property
    def cfg(self) -> BackendConfig:
        """The spec (the name the rest of the router used before membership existed)."""
        return self.spec

    @property
    def targets(self) -> list[Target]:
        """(name, DP rank) for every rank."""
        return [(self.name, r) for r in range(self.spec.dp_size)]

    @property
    def routable(self) -> bool:
        """May take a new request now."""
        return self.state == "ready" and self.healthy and self.discovery_ready

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may go here."""
        return model in self.models

    @property
    def auth_headers(self) -> dict[str, str]:
        """Authorization towards the backend (never the client's key)."""
        return {"authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}

    def describe(self, inflight: int | None = None) -> dict[str, object]:
        """The entry the admin API and /debug/index show."""
        out: dict[str, object] = msgspec.to_builtins(self.spec)
        if out.get("api_key"):
            out["api_key"] = "***"
        out.update(
            origin=self.origin,
            state=self.state,
            state_since=self.state_since,
            reason=self.reason,
            healthy=self.healthy,
            discovery_ready=self.discovery_ready,
            failures=self.failures,
            last_error=self.last_error,
            checked_at=self.checked_at,
            served_models=sorted(self.models),
            remove_when_drained=self.remove_when_drained,
        )
        if self.kv_sources:
            out["kv_sources"] = self.kv_sources
        if inflight is not None:
            out["inflight"] = inflight
        return out


class MembershipListener(Protocol):
    """What a transition asks of the rest of the router."""

    def joined(self, member: Member) -> None:
        """A backend entered the fleet (or re-joined with new endpoints): follow its event streams,
        make room for its load, probe it."""

    def left(self, member: Member) -> None:
        """A backend is gone: unsubscribe and free its index entries, clear its load."""


class Membership:
    """The fleet's members and their transitions (see the module docstring)."""

    def __init__(
        self,
        config: MembershipConfig | None = None,
        clock: Callable[[], float] = time.time,
        history: int = 200,
    ) -> None:
        self.config = config or MembershipConfig()
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.listeners: list[MembershipListener] = []
        self.transitions: collections.deque[Transition] = collections.deque(maxlen=history)
        self.changes: dict[tuple[str, str], int] = {}
        """(change, origin) -> count, for kvrouter_membership_changes_total."""
        self.version = 0
        """Bumped at every change (cheap cache invalidation for readers)."""
        self.routing = 0
        """Bumped whenever the candidates of some model may have changed: a change above, or a
        member's state, health, discovery readiness, models, LoRA adapters or spec."""
        self._routable: dict[str, list[Member]] = {}
        """The candidate index: model -> :meth:`routable_for`'s answer, rebuilt for a model at its
        first decision after a change (every decision asks; a scan cost ~0.1 us per member)."""
        self._lora: dict[str, str | None] = {}

    # --- queries -------------------------------------------------------------------------------
    def get(self, name: str) -> Member | None:
        """The member of that name, if any."""
        return self.members.get(name)

    def __iter__(self) -> Iterable[Member]:
        return iter(list(self.members.values()))

    def routing_changed(self) -> None:
        """Something that decides who is a candidate changed: the candidate index starts over."""
        self.routing += 1
        if self._routable:
            self._routable = {}
        if self._lora:
            self._lora = {}

    def routable_for(self, model: str) -> list[Member]:
        """Members that may take a new request for ``model`` now (:attr:`Member.routable` and
        :meth:`Member.serves`), in membership order. From the candidate index: the same list object
        until a change (callers must not modify it), so a caller may key its own caches on it; a
        change costs one scan of the members at the model's next decision, a decision none."""
        found = self._routable.get(model)
        if found is None:
            if len(self._routable) >= _MAX_INDEXED_MODELS:
                self._routable = {}  # (bounded: a client naming endless unknown models)
            found = self._routable[model] = [
                m
                for m in self.members.values()
                if m.state == "ready" and m.healthy and m.discovery_ready and model in m.models
            ]
        return found

    def can_serve(self, model: str) -> bool:
        """Some member may take a request for ``model`` now (a cheap check before tokenizing)."""
        return bool(self.routable_for(model))

    def known(self, model: str) -> bool:
        """Any member (whatever its state) serves this model."""
        return any(m.serves(model) for m in self.members.values())

    def models_pending(self) -> bool:
        """Some member's models are not known yet (never reached, none configured): a model no
        member is known to serve may still be one of its."""
        return any(not m.models_known for m in self.members.values())

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter name when ``model`` is one (its blocks are salted by it), else None
        (indexed like :meth:`routable_for`: every decision asks)."""
        lora = self._lora
        if model in lora:
            return lora[model]
        if len(lora) >= _MAX_INDEXED_MODELS:
            lora.clear()
        found = lora[model] = next((model for m in self.members.values() if model in m.lora_parents), None)
        return found

    def models(self) -> dict[str, list[Member]]:
        """Every model served by the fleet -> the members serving it (any state but gone)."""
        out: dict[str, list[Member]] = {}
        for m in self.members.values():
            for model in sorted(m.models):
                out.setdefault(model, []).append(m)
        return out

    def any_routable(self) -> bool:
        """At least one member may take requests."""
        return any(m.routable for m in self.members.values())

    def counts(self) -> dict[str, int]:
        """Members per state (gone is always 0: gone members are dropped)."""
        out: dict[str, int] = dict.fromkeys(STATES, 0)
        for m in self.members.values():
            out[m.state] += 1
        return out

    # --- changes -------------------------------------------------------------------------------
    def _record(self, m: Member, change: str, reason: str = "", before: State | None = None) -> None:
        """Count and log a change; ``before``: the state it moved the member from (None: it stayed,
        or it joined). A move logs as ``joining -> ready``, any other change as ``updated, still
        ready``: never as ``ready -> ready``, which reads as a no-op."""
        self.version += 1
        self.routing_changed()
        t = Transition(self.clock(), m.name, m.origin, change, m.state, reason)
        self.transitions.append(t)
        key = (change, m.origin)
        self.changes[key] = self.changes.get(key, 0) + 1
        why = f" ({reason})" if reason else ""
        if before is not None and before != m.state:
            named = "" if change == m.state else f", {change}"
            log.info("backend %s (%s): %s -> %s%s%s", m.name, m.origin, before, m.state, named, why)
        elif change == "joined":
            log.info("backend %s (%s) joined%s", m.name, m.origin, why)
        else:
            log.info("backend %s (%s) %s, still %s%s", m.name, m.origin, change, m.state, why)

    def _set_state(self, m: Member, state: State, reason: str) -> State:
        """Move the member; returns the state it left."""
        before = m.state
        m.state = state
        m.state_since = self.clock()
        m.reason = reason
        return before

    def upsert(self, spec: BackendConfig, origin: Origin, reason: str = "") -> tuple[Member, bool]:
        """Add a backend, or bring an existing one in line with ``spec``; returns (member, created).

        New endpoints or DP size re-join it (its old streams are dropped, its in-flight requests
        finish where they are); other changes (models, api_key, role) apply in place. A draining
        member named again is readmitted."""
        m = self.members.get(spec.name)
        if m is None:
            m = Member(spec, origin, self.clock())
            m._owner = self
            self.members[spec.name] = m
            self._record(m, "joined", reason or f"added by {origin}")
            for listener in self.listeners:
                listener.joined(m)
            return m, True
        old = m.declared
        m.origin = origin
        if any(getattr(old, f) != getattr(spec, f) for f in _REJOIN_FIELDS):
            m.same_engine = old.url == spec.url and m.spec.dp_size == spec.dp_size  # (the ranks in use)
            for listener in self.listeners:
                listener.left(m)
            m.discovered_dp = None
            m.kv_sources = "pending" if spec.kv_events == AUTO else ""
            m.set_spec(spec)
            m.healthy = False
            m.failures = 0
            m.remove_when_drained = False
            if spec.models is None:
                m.models = set()
                m.models_known = False
                m.lora_parents = {}
            before = self._set_state(m, "joining", "new endpoints")
            m.joined_at = self.clock()
            self._record(m, "replaced", reason or "url, event endpoints or dp_size changed", before)
            for listener in self.listeners:
                listener.joined(m)
            m.same_engine = False
            return m, False
        changed = old != spec
        m.set_spec(spec)
        if m.state == "draining":
            m.remove_when_drained = False
            before = self._set_state(m, "ready" if m.healthy else "joining", "readmitted")
            self._record(m, "readmitted", reason or f"named again by {origin}", before)
        elif changed:
            self._record(m, "updated", reason or "models, api_key or role changed")
        return m, False

    def resize(self, m: Member, dp_size: int, reason: str) -> None:
        """An ``auto`` engine listed another DP size: its targets change in place (the caller moves
        the event sources and load records; no re-join: the engine is the same)."""
        same = m.spec.dp_size == dp_size
        m.discovered_dp = dp_size
        if same:
            return
        m.set_spec(m.declared)
        self._record(m, "updated", reason)

    def drain(self, name: str, remove: bool, reason: str = "") -> Member | None:
        """Stop sending new requests to ``name``; with ``remove`` it goes once its requests finished."""
        m = self.members.get(name)
        if m is None:
            return None
        m.remove_when_drained = m.remove_when_drained or remove
        if m.state != "draining":
            before = self._set_state(m, "draining", reason)
            m.drain_deadline = self.clock() + self.config.drain_timeout_s
            self._record(m, "draining", reason or ("remove" if remove else "drain"), before)
        return m

    def reconcile(self, origin: Origin, specs: Iterable[BackendConfig], reason: str = "") -> None:
        """Make ``origin``'s members equal to ``specs``: new ones join, changed ones are updated or
        re-joined, and that origin's members missing from ``specs`` are drained and removed.

        The config file is authoritative for the names it lists (it takes them over from the admin
        API); Kubernetes never takes a name another origin holds (the pod is skipped, logged)."""
        wanted: dict[str, BackendConfig] = {}
        for spec in specs:
            other = self.members.get(spec.name)
            if other is not None and other.origin != origin and origin == "kubernetes":
                log.warning("pod %s skipped: a backend of that name comes from %s", spec.name, other.origin)
                continue
            if other is not None and other.origin == "kubernetes" and origin != "kubernetes":
                log.warning("backend %s from %s replaces the pod of that name", spec.name, origin)
            wanted[spec.name] = spec
        for spec in wanted.values():
            self.upsert(spec, origin, reason)
        for m in list(self.members.values()):
            leaving = m.state == "draining" and m.remove_when_drained
            if m.origin == origin and m.name not in wanted and not leaving:
                self.drain(m.name, remove=True, reason=reason or f"no longer listed by {origin}")

    def restore(self, specs: Iterable[BackendConfig], origin: Origin, reason: str = "") -> list[str]:
        """Bring back those of ``specs`` the fleet lacks or is removing (an admin DELETE undone: an
        operator's reload of an unchanged config file); the others stay as they are, a drained
        one drained, a name another origin holds that origin's. Returns the names that came back."""
        back = []
        for spec in specs:
            m = self.members.get(spec.name)
            if m is None or (m.state == "draining" and m.remove_when_drained and m.origin == origin):
                self.upsert(spec, origin, reason)
                back.append(spec.name)
        return back

    def tick(self, inflight: Callable[[Member], int], streams_ready: Callable[[Member], bool]) -> None:
        """Advance time-driven transitions: joining -> ready, draining -> gone."""
        now = self.clock()
        for m in list(self.members.values()):
            if m.state == "joining":
                if m.healthy and (streams_ready(m) or now - m.joined_at >= self.config.join_timeout_s):
                    bootstrapped = streams_ready(m)
                    late = "" if bootstrapped else "bootstrap not finished in time"
                    before = self._set_state(m, "ready", late)
                    self._record(m, "ready", late or "healthy, index bootstrapped", before)
            elif m.state == "draining":
                busy = inflight(m)
                timed_out = now >= m.drain_deadline
                if busy and not timed_out:
                    continue
                if m.remove_when_drained:
                    self.remove(m.name, "drained" if not busy else f"drain timed out with {busy} in flight")
                elif m.reason != "drained":
                    m.reason = "drained"
                    self._record(m, "drained", "no request in flight" if not busy else "drain timed out")

    def remove(self, name: str, reason: str = "") -> None:
        """Drop a member now (after its drain): listeners free what it held."""
        m = self.members.pop(name, None)
        if m is None:
            return
        before = self._set_state(m, "gone", reason)
        m._owner = None  # (a removed member's later changes make no candidate)
        for listener in self.listeners:
            listener.left(m)
        self._record(m, "removed", reason, before)


__all__ = [
    "STATES",
    "Member",
    "Membership",
    "MembershipListener",
    "Origin",
    "State",
    "Target",
    "Transition",
]
