"""The routing decision for one request: validate, tokenize, match against the index, pick a target.

Shared by the proxy (which then sends the request) and by ``POST /route`` (which only explains), so
what an operator sees in ``/route`` is exactly what the proxy does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from index.keys import TokenBuffer
from index.kvindex import KVIndex, MatchReport
from index.store import GroupMatch, SourceMatch
from router.decision._explain import explain_kv
from router.decision.pd import PDPlan, PDPlanner
from router.decision.policy import Candidate, CandidateScore, Decision, Policy, PolicyConfig, explain
from router.decision.tokenizer import PrefixTokens, RequestTokenizer, TokenizerError, TokenizerUnavailable
from router.fleet.breaker import Breakers
from router.fleet.load import LoadTracker
from router.fleet.membership import Member, Membership
from router.http.body import LARGE_BODY_BYTES, release
from router.http.errors import ApiError, bad_request, json_body, not_found_model, unavailable

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


_SHOWN = len(RouteView.__struct_fields__)


class Route(RouteView):
    """A decision with everything ``/route`` shows and the proxy needs (the shown fields first)."""

    report: MatchReport | None = None
    members: dict[str, Member] = {}
    """The candidates' members as they were when decided (the proxy sends to these, even if the
    membership changed meanwhile: a request decided before a drain still goes where it was sent)."""

    def explain(self) -> dict[str, Any]:
        """The JSON body of ``/route`` (and of the dashboard's recent decisions), as builtins."""
        out: dict[str, Any] = msgspec.to_builtins(self._view())
        return out

    def explain_json(self) -> bytes:
        """:meth:`explain` encoded, without building the dicts (``/route`` over many candidates)."""
        return msgspec.json.encode(self._view())

    def _view(self) -> RouteView:
        """What is shown: everything but the match report and the members; the candidates'
        reasons are written here, the first time the decision is shown."""
        if self.candidates and not any(c.reason for c in self.candidates):
            explain(self.policy, self.candidates, self.outcome)
        if self.pd is not None:
            self.pd.explain()
        if self.report is not None and self.kv_groups is None:
            self.kv_groups = _kv_groups(self.report) or None
        view = RouteView(*msgspec.structs.astuple(self)[:_SHOWN])
        view.timings_us = {k: round(v, 1) for k, v in self.timings_us.items()}  # off the hot path
        return view

    def ranked(self) -> list[tuple[str, int]]:
        """Targets from best to worst score, the chosen one first (for failover)."""
        rest = sorted((c for c in self.candidates if not c.chosen), key=lambda c: c.score)
        return [(self.backend, self.dp_rank)] + [(c.backend, c.dp_rank) for c in rest]


def _kv_groups(report: MatchReport) -> list[TargetGroups]:
    out = []
    for (backend, rank), m in report.matches.items():
        if m.groups:
            least = min(g.blocks for g in m.groups)
            limited = [g.group for g in m.groups if g.blocks == least]
            out.append(TargetGroups(backend, rank, m.blocks, m.groups, limited))
    return out


def kernel_weights(cfg: PolicyConfig) -> tuple[float | int, ...]:
    """The policy's weights in the order router/decision/_explain.c reads them."""
    return (
        cfg.gpu_credit,
        cfg.cpu_credit,
        cfg.storage_credit,
        cfg.predicted_credit,
        cfg.min_match_blocks,
        cfg.min_match_ratio,
        cfg.load_weight,
        cfg.decode_weight,
        cfg.waiting_weight,
    )


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
        self.recent: collections.deque[Route] = collections.deque(maxlen=recent)
        self.affinity: SessionAffinity | None = None
        """Session pins (``[cluster] session_header``), applied after the policy (router/cluster)."""
        self.unseen: UnseenPeers | None = None
        """Other replicas' concurrent decisions, assumed as load (router/cluster/unseen.py)."""
        self._view: tuple[int, list[Member], list[tuple[str, int]], list[bytes], list[int]] | None = None
        """:meth:`explain_json_now`'s targets, their names in JSON and their ranks, for the candidates
        it last saw (membership version, members): the same list of members while nothing changes."""
        self._params_for: PolicyConfig | None = None
        self._params: tuple[float | int, ...] = ()

    async def read_json(self, raw: bytes, parse: Callable[[bytes], Any] = json_body) -> Any:
        """``parse(raw)`` (the body decoded, or a 400): on the event loop up to
        :data:`router.http.body.LARGE_BODY_BYTES`, else in the worker threads, in pieces; give
        it back to :meth:`release` when done with it."""
        if len(raw) <= LARGE_BODY_BYTES:
            return parse(raw)
        return await self.tokenizer.offload(parse, raw)

    async def write_json(self, body: Any, size: int) -> bytes:
        """``body`` encoded: on the event loop when it was decoded from at most
        :data:`router.http.body.LARGE_BODY_BYTES` (``size``), else in the worker threads (a
        rewritten 16 MiB body held the loop for up to 0.1 s)."""
        if size <= LARGE_BODY_BYTES:
            return msgspec.json.encode(body)
        encoded: bytes = await self.tokenizer.offload(msgspec.json.encode, body)
        return encoded

    def release(self, body: Any, size: int) -> None:
        """Free a body :meth:`read_json` decoded from ``size`` bytes, when the caller holds nothing
        of it any more: a large one in the worker threads, in small steps (freed at once, millions of
        objects held the event loop for 0.1 s)."""
        if size > LARGE_BODY_BYTES and body is not None:
            self.tokenizer.offload_soon(release, body)

    def candidates_for(self, model: str) -> list[Member]:
        """Members that may take a request for a model now (ready, healthy, not ejected by their
        breaker; all of them if every one is ejected): 404 if nobody serves it, 503 if nobody can, or
        if a backend never reached yet might (a fleet whose engines are all still starting)."""
        backends = self.membership.routable_for(model)
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
        available = self.breakers.available
        ok = [b for b in backends if available(b.name)]
        return ok or backends

    async def decide(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        *,
        dry_run: bool = False,
        session: int | None = None,
        size: int | None = None,
    ) -> Route:
        """Tokenize, match and choose; ``dry_run`` leaves no trace (no prediction, not in `recent`, no
        pin); ``session``: the request's session id, when session affinity is on; ``size``: the
        request body's bytes, when known: a body larger than
        :data:`router.http.body.LARGE_BODY_BYTES` is validated in the worker threads (its
        messages are walked one by one: 1.3M tiny ones held the loop for 75 ms), and a chat request
        is tokenized inline or in them by it.

        The candidates are taken after tokenizing (the last await): from there until the proxy takes
        its load ticket nothing yields to the event loop, so a backend that starts draining meanwhile
        is never chosen, and one chosen is never removed before its request counts as in flight."""
        t0 = time.perf_counter()
        if size is not None and size > LARGE_BODY_BYTES:
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
        return self._choose(endpoint, body, model, tokens, tok_error, t0, held, dry_run, session)

    def explain_now(
        self, endpoint: Endpoint, body: dict[str, Any], *, session: int | None = None
    ) -> Route | None:
        """The dry-run decision of :meth:`decide` (``/route``) without an await, when none is
        needed: a completions prompt already in token ids (``TokenBuffer``). None otherwise (the
        caller then awaits :meth:`decide`). The server answers such a ``/route`` in the callback
        that read it, without a task (~50 us less per lookup); the answer is the same."""
        front = self._token_prompt(endpoint, body)
        if front is None:
            return None
        t0, model, backends, tokens = front
        return self._choose(endpoint, body, model, tokens, None, t0, 0.0, True, session, backends)

    def _token_prompt(
        self, endpoint: Endpoint, body: dict[str, Any]
    ) -> tuple[float, str, list[Member], Sequence[int]] | None:
        """What both token-id paths (:meth:`explain_now`, :meth:`explain_json_now`) take first, with
        the same checks in the same order: (start, model, candidates, tokens), or None when the
        prompt is not token ids."""
        t0 = time.perf_counter()
        model = validate_body(endpoint, body)
        backends = self.candidates_for(model)  # 404 / 503 before tokenizing; no await follows
        try:
            tokens = self.tokenizer.tokenize_now(endpoint, body, model)
        except TokenizerError as exc:
            raise bad_request(str(exc)) from None
        return None if tokens is None else (t0, model, backends, tokens)

    def explain_json_now(
        self, endpoint: Endpoint, body: dict[str, Any], *, session: int | None = None
    ) -> bytes | None:
        """:meth:`explain_now`'s answer as ``/route`` writes it, scored and written by compiled code
        (router/decision/_explain.c) when the decision is the plain kv policy's: no load assumed
        from other replicas' concurrent decisions (``cluster.assume_concurrent_decisions``), no
        session pin, no P/D pools, temperature 0, no debug log of every route. None otherwise,
        and for any body :meth:`explain_now` would not answer now: the caller then takes that
        (Python) path. The answer is the same bytes (tests/test_explain_kernel.py); building the
        candidates' Python objects cost most of a lookup in the running service."""
        policy = self.policy
        cfg = policy.config
        if (
            cfg.name != "kv"
            or cfg.temperature > 0
            or self.unseen is not None
            or (session is not None and self.affinity is not None)
            or log.isEnabledFor(logging.DEBUG)
        ):
            return None
        front = self._token_prompt(endpoint, body)
        if front is None:
            return None
        t0, model, backends, tokens = front
        if self._disaggregated(model):
            return None
        t1 = time.perf_counter()
        view = self._view
        version = self.membership.version
        if (
            view is None
            or view[0] != version
            or len(view[1]) != len(backends)
            or any(a is not b for a, b in zip(view[1], backends, strict=True))
        ):
            targets = [(b.name, r) for b in backends for r in range(b.spec.dp_size)]
            view = self._view = (
                version,
                backends,
                targets,
                [msgspec.json.encode(t[0]) for t in targets],
                [t[1] for t in targets],
            )
        _, _, targets, tnames, ranks = view
        cache_salt = body.get("cache_salt")
        lora_name = self.membership.lora_name(model)
        try:
            counts = self.index.match_counts(tokens, targets, lora_name=lora_name, cache_salt=cache_salt)
            if counts is None:  # predictions, several block sizes: the report's path
                report = self.index.match(tokens, targets, lora_name=lora_name, cache_salt=cache_salt)
                block_size = report.block_size
                matched = [(m.blocks if (m := report.matches.get(t)) else 0) for t in targets]
                media: list[dict[str, int] | None] = [
                    (m.by_medium if (m := report.matches.get(t)) else {}) for t in targets
                ]
            else:
                block_size, matched, media = counts
        except ValueError as exc:
            raise bad_request(f"invalid prompt token ids: {exc}") from None
        t2 = time.perf_counter()
        get_load = self.loads.get
        loads = [get_load(t) for t in targets]
        if self._params_for is not cfg:
            self._params_for = cfg
            self._params = kernel_weights(cfg)
        head = b'{"model":%s,"endpoint":"%s",' % (msgspec.json.encode(model), endpoint.encode())
        answer: bytes = explain_kv(
            head,
            tnames,
            ranks,
            matched,
            media,
            loads,
            (len(tokens), len(tokens) // block_size, block_size, *self._params),
            policy.rng,
            msgspec.json.encode,
            time.perf_counter,
            t0,
            t1,
            t2,
        )
        return answer

    def _servable_model(self, endpoint: Endpoint, body: dict[str, Any]) -> str:
        """The body's model, validated; 404 / 503 when no backend may take it, before any tokenizing
        (the candidates themselves are taken after it: :meth:`decide` awaits in between)."""
        return self._servable(validate_body(endpoint, body))

    def _servable(self, model: str) -> str:
        if not self.membership.can_serve(model):
            self.candidates_for(model)  # raises
        return model

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
    ) -> Route:
        """Match and choose, from the prompt's tokens on (nothing here yields to the event loop);
        ``backends``: the candidates, when the caller took them with no await since."""
        unseen = self.unseen
        t1 = time.perf_counter()
        if backends is None:
            backends = self.candidates_for(model)
        targets = [(b.name, r) for b in backends for r in range(b.spec.dp_size)]
        report: MatchReport | None = None
        if tokens is not None:
            try:
                report = self.index.match(
                    tokens,
                    targets,
                    lora_name=self.membership.lora_name(model),
                    cache_salt=body.get("cache_salt"),
                )
            except ValueError as exc:
                raise bad_request(f"invalid prompt token ids: {exc}") from None
        t2 = time.perf_counter()
        matches = report.matches if report is not None else {}
        block_size = report.block_size if report is not None else (self.index.config.block_size or 16)
        prompt_blocks = report.prompt_blocks if report is not None else 0
        cands = []
        get_load = self.loads.get
        for target in targets:
            m = matches.get(target)
            # the report's per-medium dicts are built for this request and never changed: shared
            if m is None:
                cands.append(Candidate(target[0], target[1], 0, {}, get_load(target)))
            else:
                cands.append(Candidate(target[0], target[1], m.blocks, m.by_medium, get_load(target)))
        # --- P/D hook (router/decision/pd.py): two pools when prefill-role engines take this model
        pools = self._pools(model, backends, cands) if self.pd is not None else None
        plan: PDPlan | None = None
        if pools is None:
            if unseen is not None and self.policy.config.name == "kv":
                unseen.spread(self.policy, cands, block_size, unseen.assumed())
            decision: Decision = self.policy.choose(
                prompt_blocks, block_size, cands, have_prompt=tokens is not None, dry_run=dry_run
            )
            if unseen is not None and not dry_run:
                unseen.decided(next(c.prefill_blocks for c in decision.candidates if c.chosen))
        else:
            assert self.pd is not None
            decision, plan = self.pd.choose(
                self.policy,
                len(tokens) if tokens is not None else 0,
                prompt_blocks,
                block_size,
                pools[0],
                pools[1],
                have_prompt=tokens is not None,
                dry_run=dry_run,
            )
        # --- end P/D hook
        affinity = ""  # --- session affinity (router/cluster); P/D decisions keep their own pools
        if session is not None and self.affinity is not None and plan is None:
            affinity = self.affinity.steer(session, decision, dry_run=dry_run)
        t3 = time.perf_counter()
        chosen: SourceMatch | None = matches.get((decision.backend, decision.dp_rank))
        route = Route(
            model=model,
            endpoint=endpoint,
            backend=decision.backend,
            dp_rank=decision.dp_rank,
            outcome="session" if affinity == "steered" else decision.outcome,
            prompt_tokens=len(tokens) if tokens is not None else 0,
            prompt_blocks=prompt_blocks,
            block_size=block_size,
            matched_blocks=chosen.blocks if chosen else 0,
            candidates=decision.candidates,
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
            policy=self.policy.config.name,
            members={b.name: b for b in backends},
            affinity=affinity,
            pd=plan,
        )
        if not dry_run:
            if report is not None:
                self.index.predict((decision.backend, decision.dp_rank), report)
                if plan is not None and plan.prefill_target is not None:  # P/D: both legs' engines
                    self.index.predict(plan.prefill_target, report)
            self.recent.append(route)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", msgspec.json.encode(route.explain()).decode())
        return route

    def _pools(
        self, model: str, backends: list[Member], cands: list[Candidate]
    ) -> tuple[list[Candidate], list[Candidate]] | None:
        """(prefill pool, decode pool) candidates when the model has prefill-role engines (in any
        state: with all of them down it is still disaggregated, its prefill legs skipped), else None.
        A fleet without prefill engines pays one version check."""
        if not self._disaggregated(model):
            return None
        roles = {b.name: b.spec.role for b in backends}
        prefill = [c for c in cands if roles[c.backend] == "prefill"]
        decode = [c for c in cands if roles[c.backend] != "prefill"]
        return prefill, decode

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
        for c in route.candidates:
            if (c.backend, c.dp_rank) == target:
                return max(route.prompt_tokens - c.matched_blocks * route.block_size, 0)
        return route.prompt_tokens


__all__ = ["ApiError", "Endpoint", "Route", "RouterService", "validate_body"]
