"""The routing decision for one request: validate, tokenize, match against the index, pick a target.

Shared by the proxy (which then sends the request) and by ``POST /route`` (which only explains), so
what an operator sees in ``/route`` is exactly what the proxy does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from index.keys import TokenBuffer
from index.kvindex import KVIndex, MatchReport, PlanMatch, SourcePlan
from index.store import GroupMatch, SourceMatch
from router.decision import _kernel
from router.decision.classes import RequestClass
from router.decision.pd import PDPlan, PDPlanner
from router.decision.policy import Candidate, Policy
from router.decision.record import TOP_K, CandidateScore, Decision, Inputs, Scored
from router.decision.tokenizer import PrefixTokens, RequestTokenizer, TokenizerError, TokenizerUnavailable
from router.errors import ApiError, bad_request, json_body, not_found_model, unavailable
from router.fleet.breaker import Breakers
from router.fleet.load import LoadTracker, PeerLoads, TargetLoad
from router.fleet.membership import Member, Membership
from router.net.body import decoded_in_pieces, decodes_at_once, release

if TYPE_CHECKING:
    from router.cluster.affinity import SessionAffinity
    from router.cluster.unseen import UnseenPeers

log = logging.getLogger("kvrouter.route")

Endpoint = Literal["completions", "chat"]


class TargetGroups(msgspec.Struct):
    """A hybrid model's candidate (KV cache groups of several kinds): what each group allows of the
    prompt's prefix; ``matched_blocks`` is what all of them serve together (vLLM's hybrid rule)."""

    backend: str
    dp_rank: int
    matched_blocks: int
    groups: list[GroupMatch]
    limited_by: list[int]
    """The groups that allow the least: what limited the match."""


class RouteView(msgspec.Struct):
    """A decision as ``/route`` shows it (and the dashboard's recent decisions)."""

    model: str
    endpoint: Endpoint
    backend: str
    dp_rank: int
    outcome: str
    prompt_tokens: int
    prompt_blocks: int
    block_size: int
    matched_blocks: int
    candidates: list[CandidateScore]
    tokenize_error: str | None = None
    timings_us: dict[str, float] = {}
    time: float = 0.0
    policy: str = "kv"
    affinity: str = ""
    """With a session header: what its pin did (router.cluster.affinity.Result); "" otherwise."""
    pd: PDPlan | None = None
    """Prefill/decode disaggregation: the prefill choice and whether its leg runs (None: the model
    is not disaggregated). ``backend``/``candidates`` are then the decode choice."""
    kv_groups: list[TargetGroups] | None = None
    """Candidates that serve a hybrid model (None when none does): per KV cache group, what it
    allows of the prefix and which groups limited the match."""
    request_class: RequestClass | None = None
    """The request's inference objective and fairness id (the gateway's headers), for flow
    control; None without either header."""


class KeptRoute(RouteView):
    """A decision as the dashboard's recent decisions keep it: the chosen candidate and the lowest
    scores (:data:`router.decision.record.TOP_K`), and how many there were."""

    candidates_total: int = 0

    def explain(self) -> dict[str, Any]:
        """The decision as builtins (the dashboard's JSON)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class Route:
    """A decision with everything ``/route`` shows and the proxy needs; the candidates' scores are
    the decision's compact record (router/decision/record.py), made into objects or JSON only when
    shown."""

    __slots__ = (
        "_candidates",
        "affinity",
        "backend",
        "block_size",
        "decision",
        "dp_rank",
        "endpoint",
        "kv_groups",
        "matched_blocks",
        "members",
        "model",
        "outcome",
        "pd",
        "policy",
        "prompt_blocks",
        "prompt_tokens",
        "report",
        "request_class",
        "time",
        "timings_us",
        "tokenize_error",
    )

    def __init__(
        self,
        *,
        model: str,
        endpoint: Endpoint,
        backend: str,
        dp_rank: int,
        outcome: str,
        prompt_tokens: int,
        prompt_blocks: int,
        block_size: int,
        matched_blocks: int,
        decision: Decision,
        tokenize_error: str | None = None,
        timings_us: dict[str, float] | None = None,
        time: float = 0.0,
        policy: str = "kv",
        affinity: str = "",
        pd: PDPlan | None = None,
        kv_groups: list[TargetGroups] | None = None,
        report: MatchReport | None = None,
        members: dict[str, Member] | None = None,
    ) -> None:
        self.model = model
        self.endpoint: Endpoint = endpoint
        self.backend = backend
        self.dp_rank = dp_rank
        self.outcome = outcome
        self.prompt_tokens = prompt_tokens
        self.prompt_blocks = prompt_blocks
        self.block_size = block_size
        self.matched_blocks = matched_blocks
        self.decision = decision
        """The policy's decision (its record of every candidate's score)."""
        self.tokenize_error = tokenize_error
        self.timings_us = timings_us or {}
        self.time = time
        self.policy = policy
        self.affinity = affinity
        self.pd = pd
        self.kv_groups = kv_groups
        self.report = report
        """The match (its prompt keys, for predictions); the proxy drops it once sent."""
        self.members = members or {}
        """The candidates' members as they were when decided (the proxy sends to these, even if the
        membership changed meanwhile: a request decided before a drain still goes where it was sent)."""
        self._candidates: list[CandidateScore] | None = None
        self.request_class: RequestClass | None = None
        """The objective and fairness id the request came with (set by :meth:`RouterService.decide`)."""

    @property
    def candidates(self) -> list[CandidateScore]:
        """Every candidate's score as objects (made from the record at the first use; the reasons
        worded for this route's outcome)."""
        if self._candidates is None:
            scored = self.decision.scored
            self._candidates = scored.scores(self.outcome) if scored is not None else self.decision.candidates
        return self._candidates

    def _view(self, candidates: list[CandidateScore]) -> RouteView:
        return RouteView(
            self.model,
            self.endpoint,
            self.backend,
            self.dp_rank,
            self.outcome,
            self.prompt_tokens,
            self.prompt_blocks,
            self.block_size,
            self.matched_blocks,
            candidates,
            self.tokenize_error,
            {k: round(v, 1) for k, v in self.timings_us.items()},
            self.time,
            self.policy,
            self.affinity,
            self.pd,
            self.kv_groups,
            self.request_class,
        )

    def explain(self) -> dict[str, Any]:
        """The JSON body of ``/route``, as builtins."""
        out: dict[str, Any] = msgspec.to_builtins(self._view(self.candidates))
        return out

    def explain_json(self) -> bytes:
        """:meth:`explain` encoded: the candidates written from the record by the kernel's writer
        (``/route`` over many candidates builds no object per candidate), the rest by msgspec."""
        scored = self.decision.scored
        if scored is None or self._candidates is not None:
            return msgspec.json.encode(self._view(self.candidates))
        rest = msgspec.json.encode(self._view([]))
        # (the first '"candidates":[]' is the field: in the strings before it, encoded as JSON,
        # every quote follows a backslash)
        return rest.replace(b'"candidates":[]', b'"candidates":' + scored.render(self.outcome), 1)

    def kept(self, total: int | None = None) -> KeptRoute:
        """What the recent decisions keep of this one: bounded in objects whatever the fleet's width
        (``total``: the candidates there were, when this route holds only the top of them)."""
        scored = self.decision.scored
        if scored is not None:
            count = scored.size
            candidates = scored.top().scores(self.outcome)
        else:
            count = len(self.candidates)
            candidates = sorted(self.candidates, key=lambda c: (not c.chosen, c.score))[:TOP_K]
        view = self._view(candidates)
        fields = {f: getattr(view, f) for f in view.__struct_fields__}
        return KeptRoute(**fields, candidates_total=count if total is None else total)

    def keep(self) -> KeptDecision:
        """:meth:`kept`, made only when shown: the recent decisions hold a copy of this route with its
        record cut to the top candidates (its match and members dropped), so a proxied request pays
        for bounding the record, not for the candidates' objects and the view that only the
        dashboard reads (~15 us a decision)."""
        scored = self.decision.scored
        if scored is None:
            return KeptDecision(self.kept(), None, 0)
        d = self.decision
        light = object.__new__(Route)
        for name in Route.__slots__:
            setattr(light, name, getattr(self, name))
        light.decision = Decision(d.backend, d.dp_rank, d.outcome, scored=scored.top())
        light.report = None
        light.members = {}
        light._candidates = None
        return KeptDecision(None, light, scored.size)

    def media_of(self, target: tuple[str, int]) -> dict[str, int]:
        """A candidate's matched blocks by medium ({} for one that was not a candidate)."""
        scored = self.decision.scored
        if scored is not None:
            i = scored.inputs.index_of(target)
            return scored.by_medium(i) if i is not None else {}
        return next((c.blocks_by_medium for c in self.candidates if (c.backend, c.dp_rank) == target), {})

    def chosen_media(self) -> dict[str, int]:
        """The chosen candidate's matched blocks by medium."""
        return self.media_of((self.backend, self.dp_rank))

    def matched_of(self, target: tuple[str, int]) -> int | None:
        """A candidate's matched blocks (None: not a candidate)."""
        scored = self.decision.scored
        if scored is not None:
            i = scored.inputs.index_of(target)
            return scored.matched(i) if i is not None else None
        return next((c.matched_blocks for c in self.candidates if (c.backend, c.dp_rank) == target), None)

    def ranked(self) -> list[tuple[str, int]]:
        """Targets from best to worst score, the chosen one first (for failover)."""
        scored = self.decision.scored
        first = (self.backend, self.dp_rank)
        if scored is not None:
            col = scored.scores_column()
            targets = scored.inputs.targets
            rest = sorted((i for i in range(scored.size) if targets[i] != first), key=col.__getitem__)
            return [first] + [targets[i] for i in rest]
        others = sorted((c for c in self.candidates if not c.chosen), key=lambda c: c.score)
        return [first] + [(c.backend, c.dp_rank) for c in others]


class _Matches(Mapping[tuple[str, int], SourceMatch]):
    """A match's per-candidate results as :class:`MatchReport` holds them, made on access (the
    predictions after a decision ask for one or two)."""

    def __init__(self, inputs: Inputs, found: PlanMatch) -> None:
        self.inputs = inputs
        self.found = found

    def __getitem__(self, target: tuple[str, int]) -> SourceMatch:
        i = self.inputs.index_of(target)
        if i is None:
            raise KeyError(target)
        found = self.found
        group = found.groups.get(i)
        if group is not None:
            return group
        by = found.media[i] if found.media is not None else None
        if by == {}:
            raise KeyError(target)  # (a candidate the index does not follow: no match entry)
        if by is None:
            by = Scored(self.inputs, b"", 0, 0, "kv", None, found.offs).offs_medium(found.matched[i], i)
        return SourceMatch(target, found.matched[i], by)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter([t for t in self.inputs.targets if t in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, target: object) -> bool:
        try:
            self[target]  # type: ignore[index]
        except KeyError:
            return False
        return True


def _kv_groups(inputs: Inputs, found: PlanMatch) -> list[TargetGroups]:
    out = []
    for i, m in found.groups.items():
        if m.groups:
            least = min(g.blocks for g in m.groups)
            limited = [g.group for g in m.groups if g.blocks == least]
            backend, rank = inputs.targets[i]
            out.append(TargetGroups(backend, rank, m.blocks, m.groups, limited))
    return out


class _Plan:
    """One candidate set as every decision over it needs it, built once (O(candidates)) and kept
    while the candidates, the index's sources and the load records stay the same."""

    __slots__ = ("backends", "inputs", "key", "loads", "members", "peer_slots", "sources")

    def __init__(
        self,
        key: tuple[Any, ...],
        backends: list[Member],
        inputs: Inputs,
        sources: SourcePlan,
        loads: list[TargetLoad],
        peer_slots: list[bytes],
    ) -> None:
        self.key = key
        self.backends = backends
        self.inputs = inputs
        self.sources = sources
        self.loads = loads
        self.peer_slots = peer_slots
        """Per peer view of the load tracker, the candidates' slots in its columns."""
        self.members = {b.name: b for b in backends}

    def peer_figures(self, peers: Sequence[PeerLoads]) -> bytearray:
        """The other routers' figures per candidate (three int64 each), read from what their
        shares keep per target in one compiled pass per peer view: no Python per candidate."""
        out = bytearray(len(self.inputs.targets) * 24)
        for p, slots in zip(peers, self.peer_slots, strict=True):
            c = p.columns()
            _kernel.gather(out, c.table, c.base, c.stride, c.rows, c.skip, slots)
        return out


def validate_body(endpoint: Endpoint, body: Any) -> str:
    """Minimal OpenAI request validation (400s); returns the model."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a string", "missing_model")
    if endpoint == "completions":
        if "prompt" not in body:
            raise bad_request("`prompt` is required", "missing_prompt")
        p = body["prompt"]
        # a list of token ids is checked id by id once, by the tokenizer step (400 on a bad id):
        # a second pass here cost ~60 ns per id, 2 ms for a 32k-token prompt
        ok = (
            isinstance(p, str)
            or type(p) is TokenBuffer
            or (
                isinstance(p, list)
                and bool(p)
                and (
                    (type(p[0]) is int)
                    or all(isinstance(x, str) for x in p)
                    or all(isinstance(x, list) for x in p)
                )
            )
        )
        if not ok:
            raise bad_request(
                "`prompt` must be a string, a list of token ids, or a list of those", "invalid_prompt"
            )
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("`messages` is required and must be a non-empty list", "missing_messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(
                    f"`messages[{i}]` must be an object with a string `role`", "invalid_messages"
                )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", "invalid_stream")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad_request("`cache_salt` must be a string", "invalid_cache_salt")
    return model


class KeptDecision:
    """One of the recent decisions (the dashboard's): a :class:`KeptRoute`, made from the route's
    bounded copy at the first read (:meth:`Route.keep`)."""

    __slots__ = ("_kept", "_route", "_total")

    def __init__(self, kept: KeptRoute | None, route: Route | None, total: int) -> None:
        self._kept = kept
        self._route = route
        self._total = total

    def kept(self) -> KeptRoute:
        """The decision as kept (made once)."""
        if self._kept is None:
            assert self._route is not None
            self._kept = self._route.kept(self._total)
            self._route = None
        return self._kept

    def explain(self) -> dict[str, Any]:
        """The decision as builtins (the dashboard's JSON)."""
        return self.kept().explain()


class RouterService:
    """Everything a decision needs, passed in explicitly."""

    def __init__(
        self,
        index: KVIndex,
        membership: Membership,
        loads: LoadTracker,
        policy: Policy,
        tokenizer: RequestTokenizer,
        recent: int = 50,
        breakers: Breakers | None = None,
        pd: PDPlanner | None = None,
    ) -> None:
        self.pd = pd
        """Prefill/decode disaggregation (router/decision/pd.py); None: roles are ignored."""
        self._prefill_version = -1
        self._prefill_members: list[Member] = []
        self.index = index
        self.breakers = breakers or Breakers()
        self.membership = membership
        self.loads = loads
        self.policy = policy
        self.tokenizer = tokenizer
        self.recent: collections.deque[KeptDecision] = collections.deque(maxlen=recent)
        """The last decisions (not dry runs), each kept with its chosen candidate and the lowest
        scores only (:meth:`Route.keep`): bounded in objects whatever the fleet's width."""
        self.affinity: SessionAffinity | None = None
        """Session pins (``[cluster] session_header``), applied after the policy (router/cluster)."""
        self.unseen: UnseenPeers | None = None
        """Other replicas' concurrent decisions, assumed as load (router/cluster/unseen.py)."""
        self._plan_cache: _Plan | None = None
        """The last candidate set's plan (:meth:`_plan`)."""
        self.flow_open: Callable[[list[Member], int | None], list[Member]] | None = None
        """Flow control's ``restrict_to_room`` (router/flow): the candidates a decision of a band
        (None: not admitted by flow control, e.g. ``/route``) may take."""
        self._subset: tuple[list[Member], frozenset[str], list[Member]] | None = None
        """(candidates, a gateway's subset, the candidates in it) of the last decision with one."""
        self._unblocked: tuple[list[Member], frozenset[str], list[Member]] | None = None
        """(candidates, the ejected among them, the candidates without them) of the last decision
        with a breaker open."""

    async def read_json(self, raw: bytes, parse: Callable[[bytes], Any] = json_body) -> Any:
        """``parse(raw)`` (the body decoded, or a 400): on the event loop when it decodes in one
        bounded call (:func:`router.net.body.decodes_at_once`), else in the worker threads, in
        pieces; give it back to :meth:`release` when done with it."""
        if decodes_at_once(raw):
            return parse(raw)
        return await self.tokenizer.offload(parse, raw)

    async def write_json(self, body: Any, size: int) -> bytes:
        """``body`` encoded: on the event loop when it was decoded at once (``size``: its bytes
        then), else in the worker threads (a rewritten 16 MiB body held the loop for up to 0.1 s)."""
        if not decoded_in_pieces(body):
            return msgspec.json.encode(body)
        encoded: bytes = await self.tokenizer.offload(msgspec.json.encode, body)
        return encoded

    def release(self, body: Any, size: int) -> None:
        """Free a body :meth:`read_json` decoded from ``size`` bytes, when the caller holds nothing
        of it any more: a large one in the worker threads, in small steps (freed at once, millions of
        objects held the event loop for 0.1 s); one decoded at once is dropped as usual."""
        if body is not None and decoded_in_pieces(body):
            self.tokenizer.offload_soon(release, body)

    def candidates_for(self, model: str, subset: frozenset[str] | None = None) -> list[Member]:
        """Members that may take a request for a model now (ready, healthy, not ejected by their
        breaker; all of them if every one is ejected): 404 if nobody serves it, 503 if nobody can, or
        if a backend never reached yet might (a fleet whose engines are all still starting).
        ``subset``: only these members (by name) are eligible, 503 when none of them is (a gateway's
        subset hint, router/epp)."""
        backends = self.membership.routable_for(model)
        if subset is not None and backends:
            last = self._subset  # (the same subset again: the same list, so the same plan)
            if last is not None and last[0] is backends and last[1] == subset:
                backends = last[2]
            else:
                whole = backends
                backends = [b for b in backends if b.name in subset]
                self._subset = (whole, subset, backends)
            if not backends:
                raise unavailable(
                    f"No backend of the request's endpoint subset can take `{model}` now",
                    "no_eligible_endpoint",
                )
        if not backends:
            if self.membership.known(model):
                raise unavailable(f"No healthy backend serves `{model}`")
            if self.membership.models_pending():
                raise unavailable(
                    f"No backend available yet for `{model}`: a backend that may serve it has not "
                    "answered yet",
                    "no_backend_yet",
                )
            raise not_found_model(model)
        if not self.breakers.any_open():
            return backends  # (the common case: no breaker to ask, one check per decision)
        # the list without the ejected, kept while the candidates and the ejected stay the same (its
        # identity keys the candidate set's plan: a new list each decision re-planned every one)
        blocked = self.breakers.blocked()
        kept = self._unblocked
        if kept is not None and kept[0] is backends and kept[1] == blocked:
            return kept[2]
        ok = [b for b in backends if b.name not in blocked] if blocked else backends
        ok = ok or backends
        self._unblocked = (backends, blocked, ok)
        return ok

    async def decide(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        dry_run: bool = False,
        session: int | None = None,
        size: int | None = None,
        subset: frozenset[str] | None = None,
        request_class: RequestClass | None = None,
        band: int | None = None,
    ) -> Route:
        """Tokenize, match and choose; ``dry_run`` leaves no trace (no prediction, not in `recent`, no
        pin); ``session``: the request's session id, when session affinity is on; ``size``: the
        request body's bytes, when known: a body decoded in pieces
        (:func:`router.net.body.decoded_in_pieces`) is validated in the worker threads (its
        messages are walked one by one: 1.3M tiny ones held the loop for 75 ms), and a chat request
        is tokenized inline or in them by it.

        The candidates are taken after tokenizing (the last await): from there until the proxy takes
        its load ticket nothing yields to the event loop, so a backend that starts draining meanwhile
        is never chosen, and one chosen is never removed before its request counts as in flight.
        ``subset``: the members (by name) the choice is limited to (:meth:`candidates_for`).
        ``request_class``: carried on the route (flow control's input; the choice does not read it).
        ``band``: the flow-control band the request was admitted in: with ``restrict_to_room`` the
        candidates are those with room for that band (below its ceiling under
        ``higher_band_reserve``)."""
        t0 = time.perf_counter()
        if size is not None and decoded_in_pieces(body):
            model = self._servable(await self.tokenizer.offload(validate_body, endpoint, body))
        else:
            model = self._servable_model(endpoint, body)
        tokens: Sequence[int] | None = None
        tok_error: str | None = None
        try:
            tokens = await self.tokenizer.tokenize(endpoint, body, model, size)
        except TokenizerError as exc:
            raise bad_request(str(exc)) from None
        except TokenizerUnavailable as exc:
            tok_error = str(exc)
        if type(tokens) is PrefixTokens:
            tok_error = "media content: matched up to its first media part only"
        unseen = self.unseen
        held = 0.0
        if unseen is not None and not dry_run:
            hold = unseen.hold_s()
            if hold > 0:  # staggered burst (cluster.stagger_bursts): see the replicas ranked before
                held_at = time.perf_counter()
                await asyncio.sleep(hold)
                held = time.perf_counter() - held_at
                unseen.note_hold(held)
                t0 += held  # (the timings are the work's; the hold is reported on its own)
        route = self._choose(
            endpoint, body, model, tokens, tok_error, t0, held, dry_run, session, subset=subset, band=band
        )
        route.request_class = request_class
        return route

    def explain_now(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        session: int | None = None,
        request_class: RequestClass | None = None,
    ) -> Route | None:
        """The dry-run decision of :meth:`decide` (``/route``) without an await, when none is
        needed: a completions prompt already in token ids (``TokenBuffer``). None otherwise (the
        caller then awaits :meth:`decide`). The server answers such a ``/route`` in the callback
        that read it, without a task (~50 us less per lookup); the answer is the same."""
        t0 = time.perf_counter()
        model = validate_body(endpoint, body)
        backends = self.candidates_for(model)  # 404 / 503 before tokenizing; no await follows
        try:
            tokens = self.tokenizer.tokenize_now(endpoint, body, model)
        except TokenizerError as exc:
            raise bad_request(str(exc)) from None
        if tokens is None:
            return None
        route = self._choose(endpoint, body, model, tokens, None, t0, 0.0, True, session, backends)
        route.request_class = request_class
        return route

    def explain_json_now(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        session: int | None = None,
        request_class: RequestClass | None = None,
    ) -> bytes | None:
        """:meth:`explain_now`'s answer as ``/route`` writes it (None when that is None)."""
        route = self.explain_now(endpoint, body, session=session, request_class=request_class)
        return route.explain_json() if route is not None else None

    def _servable_model(self, endpoint: Endpoint, body: dict[str, Any]) -> str:
        """The body's model, validated; 404 / 503 when no backend may take it, before any tokenizing
        (the candidates themselves are taken after it: :meth:`decide` awaits in between)."""
        return self._servable(validate_body(endpoint, body))

    def _servable(self, model: str) -> str:
        if not self.membership.can_serve(model):
            self.candidates_for(model)  # raises
        return model

    def _plan(self, backends: list[Member]) -> _Plan:
        """The candidate set's plan, kept while nothing it depends on changed (the candidate
        list is the membership's own object until a change: its identity is the key)."""
        index = self.index
        key = (id(backends), self.loads.generation, len(index.store._media_names))
        plan = self._plan_cache
        if (
            plan is not None
            and plan.key == key
            and plan.backends is backends
            and index.plan_valid(plan.sources)
        ):
            return plan
        targets = [(b.name, r) for b in backends for r in range(b.spec.dp_size)]
        names, roles = index.medium_roles()
        record = self.loads.record
        plan = _Plan(
            key,
            backends,
            Inputs(targets, names, roles),
            index.plan(targets),
            [record(t) for t in targets],
            self.loads.peer_slots(targets),
        )
        self._plan_cache = plan
        return plan

    def _choose(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        model: str,
        tokens: Sequence[int] | None,
        tok_error: str | None,
        t0: float,
        held: float,
        dry_run: bool,
        session: int | None,
        backends: list[Member] | None = None,
        subset: frozenset[str] | None = None,
        band: int | None = None,
    ) -> Route:
        """THE decision, from the prompt's tokens on (nothing here yields to the event loop): match,
        score and choose (router/decision/policy.py ``Policy.decide``, one compiled pass), the P/D
        pools, the session pin, predict-on-route; ``backends``: the candidates, when the caller took
        them with no await since."""
        unseen = self.unseen
        policy = self.policy
        t1 = time.perf_counter()
        if backends is None:
            backends = self.candidates_for(model, subset)
        if self.flow_open is not None:  # flow control (router/flow): only backends with room
            backends = self.flow_open(backends, band)
        plan = self._plan(backends)
        inputs = plan.inputs
        found: PlanMatch | None = None
        if tokens is not None:
            try:
                found = self.index.match_plan(
                    tokens,
                    plan.sources,
                    lora_name=self.membership.lora_name(model),
                    cache_salt=body.get("cache_salt"),
                    spans=getattr(tokens, "spans", None),
                )
            except ValueError as exc:
                raise bad_request(f"invalid prompt token ids: {exc}") from None
        t2 = time.perf_counter()
        n = len(inputs.targets)
        if found is not None:
            block_size, prompt_blocks = found.block_size, found.prompt_blocks
            matched, media, offs = found.matched, found.media, found.offs
        else:
            block_size, prompt_blocks = self.index.config.block_size or 16, 0
            matched, media, offs = [0] * n, None, None
        loads = plan.loads
        peers = self.loads.peers
        # --- P/D hook (router/decision/pd.py): two pools when prefill-role engines take this model
        plan_pd: PDPlan | None = None
        if self.pd is not None and self._disaggregated(model):
            if peers:
                loads = [self.loads.get(t) for t in inputs.targets]
            scored = Scored(inputs, b"", 0, 0, policy.config.name, media, offs)  # (its by_medium only)
            cands = [
                Candidate(
                    t[0],
                    t[1],
                    matched[i],
                    by
                    if media is not None and (by := media[i]) is not None
                    else scored.offs_medium(matched[i], i),
                    loads[i],
                )
                for i, t in enumerate(inputs.targets)
            ]
            roles = {b.name: b.spec.role for b in backends}
            decision, plan_pd = self.pd.choose(
                policy,
                len(tokens) if tokens is not None else 0,
                prompt_blocks,
                block_size,
                [c for c in cands if roles[c.backend] == "prefill"],
                [c for c in cands if roles[c.backend] != "prefill"],
                have_prompt=tokens is not None,
                dry_run=dry_run,
            )
        else:
            spread: tuple[float, float] | None = None
            if unseen is not None and policy.config.name == "kv":
                spread = unseen.spread_args(policy, unseen.assumed(), n)
            decision = policy.decide(
                inputs,
                prompt_blocks,
                block_size,
                matched,
                loads,
                media=media,
                offs=offs,
                have_prompt=tokens is not None,
                dry_run=dry_run,
                spread=spread,
                extra=plan.peer_figures(peers) if peers else None,
            )
            if unseen is not None and not dry_run and decision.scored is not None:
                unseen.decided(decision.scored.prefill_of(decision.scored.best))
        # --- end P/D hook
        affinity = ""  # --- session affinity (router/cluster); P/D decisions keep their own pools
        if session is not None and self.affinity is not None and plan_pd is None:
            affinity = self.affinity.steer(session, decision, dry_run=dry_run)
        t3 = time.perf_counter()
        chosen = inputs.index_of((decision.backend, decision.dp_rank))
        report: MatchReport | None = None
        kv_groups: list[TargetGroups] | None = None
        if found is not None:
            report = MatchReport(
                len(tokens or ()), block_size, prompt_blocks, _Matches(inputs, found), found.keys
            )
            if found.groups:
                kv_groups = _kv_groups(inputs, found) or None
        route = Route(
            model=model,
            endpoint=endpoint,
            backend=decision.backend,
            dp_rank=decision.dp_rank,
            outcome="session" if affinity == "steered" else decision.outcome,
            prompt_tokens=len(tokens) if tokens is not None else 0,
            prompt_blocks=prompt_blocks,
            block_size=block_size,
            matched_blocks=matched[chosen] if chosen is not None and found is not None else 0,
            decision=decision,
            tokenize_error=tok_error,
            timings_us={
                "tokenize": (t1 - t0) * 1e6,
                "match": (t2 - t1) * 1e6,
                "policy": (t3 - t2) * 1e6,
                "total": (t3 - t0) * 1e6,
                "held": held * 1e6,
            },
            time=time.time(),
            report=report,
            policy=policy.config.name,
            members=plan.members,
            affinity=affinity,
            pd=plan_pd,
            kv_groups=kv_groups,
        )
        if not dry_run:
            if report is not None:
                self.predict((decision.backend, decision.dp_rank), report)
                if plan_pd is not None and plan_pd.prefill_target is not None:  # P/D: both legs' engines
                    self.predict(plan_pd.prefill_target, report)
            self.recent.append(route.keep())
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", route.explain_json().decode())
        return route

    def predict(self, target: tuple[str, int], report: MatchReport) -> None:
        """The prompt's blocks predicted on ``target`` (it computes them now); a large prediction
        is recorded in the worker threads (:data:`index.kvindex.LARGE_PREDICTION_KEYS`)."""
        self.index.predict(target, report, self.tokenizer.offload_soon)

    def _disaggregated(self, model: str) -> bool:
        """The model has prefill-role engines (P/D pools); one version check for a fleet without."""
        if self.pd is None:
            return False
        if self._prefill_version != self.membership.version:
            self._prefill_version = self.membership.version
            self._prefill_members = [m for m in self.membership.members.values() if m.spec.role == "prefill"]
        return any(m.serves(model) for m in self._prefill_members)

    def uncached_tokens(self, route: Route, target: tuple[str, int]) -> int:
        """Prompt tokens the target still has to compute (for the load tracker)."""
        if route.pd is not None and route.pd.prefill_status == "ok":
            return 0  # P/D: the decode engine pulls the prompt's blocks; it computes (almost) nothing
        matched = route.matched_of(target)
        if matched is None:
            return route.prompt_tokens
        return max(route.prompt_tokens - matched * route.block_size, 0)


__all__ = ["ApiError", "Endpoint", "KeptDecision", "KeptRoute", "Route", "RouterService", "validate_body"]
