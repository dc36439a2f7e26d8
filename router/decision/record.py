"""The record of one decision: every candidate's terms in compact columns, and what shows them.

:func:`router.decision.policy.Policy.decide` scores in compiled code (router/decision/_kernel.c),
which writes each candidate's terms into one bytes object of packed columns (no Python object per
candidate: the decision record of 50 recent routes at 1,024 candidates was ~95k objects, and a full
garbage collection over them ran every ~33 requests). :class:`Scored` keeps that record with the
candidate set's :class:`Inputs` (shared by every decision over the same candidates); the
candidates' :class:`CandidateScore` objects, the reasons and the JSON are made from it only when a
decision is shown (``/route``, the dashboard), by the kernel's writer, so what is shown is what
was decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from router.decision import _kernel

Target = tuple[str, int]

_NCOLS = _kernel.COLUMNS
_C_PREFILL, _C_SCORE, _C_MATCHED, _C_ACTIVE = 1, 3, 6, 7
TOP_K = 8
"""Candidates a decision kept for the dashboard shows: the chosen one and the lowest scores."""


class CandidateScore(msgspec.Struct):
    """A candidate's terms and verdict, as shown by ``/route``."""

    backend: str
    dp_rank: int
    matched_blocks: int
    blocks_by_medium: dict[str, int]
    credit_blocks: float
    prefill_blocks: float
    queued_blocks: float
    inflight: int
    engine_waiting: float
    score: float
    """The cost; lower is better."""
    chosen: bool = False
    reason: str = ""
    assumed_blocks: float = 0.0
    """Load assumed from other replicas' concurrent decisions (0 for a router alone)."""


_SCORES = msgspec.json.Decoder(list[CandidateScore])


class Inputs:
    """One candidate set, in candidate order: built once per set (its owner keeps it while the
    candidates stay the same) and shared by every decision and record over it."""

    __slots__ = ("_names", "_order", "_pos", "medium_names", "ranks", "roles", "targets")

    def __init__(
        self, targets: list[Target], medium_names: tuple[str, ...] = (), roles: bytes | None = None
    ) -> None:
        self.targets = targets
        self.ranks = [t[1] for t in targets]
        self.medium_names = medium_names
        """The names of the index's media, by medium index (the columns of a match's ``offs``)."""
        self.roles = roles
        """Per medium index: 1 GPU, 2 CPU, 3 STORAGE, 0 another (what the policy credits)."""
        self._names: list[bytes] | None = None
        self._pos: dict[Target, int] | None = None
        self._order: list[int] | None = None

    def names(self) -> list[bytes]:
        """Each candidate's backend name as a JSON string."""
        if self._names is None:
            self._names = [msgspec.json.encode(t[0]) for t in self.targets]
        return self._names

    def index_of(self, target: Target) -> int | None:
        """A target's position among the candidates (None: not one)."""
        if self._pos is None:
            self._pos = {t: i for i, t in enumerate(self.targets)}
        return self._pos.get(target)

    def order(self) -> list[int]:
        """Positions by (backend, DP rank): round_robin's turn order."""
        if self._order is None:
            targets = self.targets
            self._order = sorted(range(len(targets)), key=targets.__getitem__)
        return self._order


class Scored:
    """Every candidate's score of one decision (the compiled record) and the chosen position."""

    __slots__ = ("best", "inflight", "inputs", "media", "offs", "policy", "record")

    def __init__(
        self,
        inputs: Inputs,
        record: bytes,
        best: int,
        inflight: int,
        policy: str,
        media: list[dict[str, int] | None] | None = None,
        offs: list[list[int] | None] | None = None,
    ) -> None:
        self.inputs = inputs
        self.record = record
        self.best = best
        self.inflight = inflight
        """Requests in flight over every candidate (the session pin's load bound)."""
        self.policy = policy
        self.media = media
        self.offs = offs

    @property
    def size(self) -> int:
        """Candidates scored."""
        return len(self.inputs.targets)

    def _int(self, column: int, i: int) -> int:
        value: int = memoryview(self.record)[(column * self.size + i) * 8 :][:8].cast("q")[0]
        return value

    def matched(self, i: int) -> int:
        """Candidate i's matched blocks."""
        return self._int(_C_MATCHED, i)

    def prefill_of(self, i: int) -> float:
        """Candidate i's prefill blocks (the prompt's blocks it does not cache), unrounded."""
        value: float = memoryview(self.record)[(_C_PREFILL * self.size + i) * 8 :][:8].cast("d")[0]
        return value

    def inflight_of(self, i: int) -> int:
        """Candidate i's requests in flight when decided."""
        return self._int(_C_ACTIVE, i)

    def scores_column(self) -> Sequence[float]:
        """Every candidate's score (the cost; lower is better)."""
        n = self.size
        return memoryview(self.record)[_C_SCORE * n * 8 : (_C_SCORE + 1) * n * 8].cast("d")

    def by_medium(self, i: int) -> dict[str, int]:
        """Candidate i's matched blocks by medium (GPU first)."""
        if self.media is not None and (by := self.media[i]) is not None:
            return by
        return self.offs_medium(self.matched(i), i)

    def offs_medium(self, matched: int, i: int) -> dict[str, int]:
        """``matched`` blocks by medium as candidate i's offs say (all on GPU without)."""
        row = self.offs[i] if self.offs is not None else None
        if not row or not any(row):
            return {"GPU": matched}
        out = {"GPU": matched - sum(row)}
        names = self.inputs.medium_names
        for k, c in enumerate(row):
            if c:
                out[names[k]] = c
        return out

    def render(self, outcome: str) -> bytes:
        """The candidates' JSON list, as ``/route`` shows it (``outcome``: the decision's, after any
        session pin: it words the chosen one's reason)."""
        n = self.size
        inputs = self.inputs
        codes = _kernel.reasons(self.record, n, self.best, outcome == "prefix", self.policy == "kv")
        return _kernel.render(
            self.record,
            n,
            self.best,
            codes,
            inputs.names(),
            inputs.ranks,
            self.media,
            self.offs,
            inputs.medium_names,
            self.policy.encode(),
            msgspec.json.encode,
        )

    def scores(self, outcome: str) -> list[CandidateScore]:
        """The candidates as objects (read back from :meth:`render`: one writer of the reasons)."""
        return _SCORES.decode(self.render(outcome))

    def raw_scores(self) -> list[CandidateScore]:
        """The candidates as objects with their terms as computed (unrounded) and no reasons: what
        a caller of :meth:`router.decision.policy.Policy.choose` reads."""
        n = self.size
        mv = memoryview(self.record)
        d = mv.cast("d")
        q = mv.cast("q")
        targets = self.inputs.targets
        out = []
        for i in range(n):
            waiting: float = q[9 * n + i] if q[8 * n + i] else d[5 * n + i]
            out.append(
                CandidateScore(
                    targets[i][0],
                    targets[i][1],
                    q[6 * n + i],
                    self.by_medium(i),
                    d[i],
                    d[n + i],
                    d[2 * n + i],
                    q[7 * n + i],
                    waiting,
                    d[3 * n + i],
                    i == self.best,
                    "",
                    d[4 * n + i],
                )
            )
        return out

    def top(self, k: int = TOP_K) -> Scored:
        """The chosen candidate and up to ``k - 1`` others from the lowest score, as a record of their
        own (what a kept decision holds: bounded whatever the fleet's width)."""
        n = self.size
        if n <= k:
            return self
        picked = _kernel.top(self.record, n, self.best, k)
        record = _kernel.take(self.record, n, picked)
        targets = self.inputs.targets
        inputs = Inputs([targets[i] for i in picked], self.inputs.medium_names, self.inputs.roles)
        media = [self.media[i] for i in picked] if self.media is not None else None
        offs = [self.offs[i] for i in picked] if self.offs is not None else None
        inflight = self.inflight
        return Scored(inputs, record, 0, inflight, self.policy, media, offs)


class Decision:
    """The chosen target, how it was chosen (outcome) and every candidate's score: a compiled
    record (:class:`Scored`), or a list of :class:`CandidateScore` given by the caller."""

    __slots__ = ("_candidates", "backend", "dp_rank", "outcome", "scored")

    def __init__(
        self,
        backend: str,
        dp_rank: int,
        outcome: Literal["prefix", "load", "fallback"],
        candidates: list[CandidateScore] | None = None,
        *,
        scored: Scored | None = None,
    ) -> None:
        if candidates is None and scored is None:
            raise ValueError("a decision needs its candidates' scores")
        self.backend = backend
        self.dp_rank = dp_rank
        self.outcome: Literal["prefix", "load", "fallback"] = outcome
        """prefix: a cached prefix decided it; load: load alone did; fallback: no prompt keys (load only)."""
        self._candidates = candidates
        self.scored = scored

    @property
    def candidates(self) -> list[CandidateScore]:
        """Every candidate's score as objects, its terms as computed and no reasons (made from the
        record at the first use; what is shown comes from :meth:`Scored.scores`)."""
        if self._candidates is None:
            assert self.scored is not None
            self._candidates = self.scored.raw_scores()
        return self._candidates

    @property
    def size(self) -> int:
        """Candidates scored."""
        return self.scored.size if self.scored is not None else len(self.candidates)

    def index_of(self, target: Target) -> int | None:
        """A target's position among the candidates (None: not one)."""
        if self.scored is not None:
            return self.scored.inputs.index_of(target)
        return next((i for i, c in enumerate(self.candidates) if (c.backend, c.dp_rank) == target), None)

    def inflight_of(self, i: int) -> int:
        """Candidate i's requests in flight when decided."""
        return self.scored.inflight_of(i) if self.scored is not None else self.candidates[i].inflight

    def total_inflight(self) -> int:
        """Requests in flight over every candidate."""
        return self.scored.inflight if self.scored is not None else sum(c.inflight for c in self.candidates)

    def choose_index(self, i: int) -> None:
        """Make candidate i the choice (a session pin overriding the policy)."""
        if self.scored is not None:
            self.scored.best = i
            self.backend, self.dp_rank = self.scored.inputs.targets[i]
            self._candidates = None
            return
        for j, c in enumerate(self.candidates):
            c.chosen = j == i
        chosen = self.candidates[i]
        self.backend, self.dp_rank = chosen.backend, chosen.dp_rank


__all__ = ["TOP_K", "CandidateScore", "Decision", "Inputs", "Scored"]
