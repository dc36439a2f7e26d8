"""`KVIndex`: the small interface the router uses (match, predict, status), over store + subscriber.

The router never sees engine hashes, sockets or wire formats: it hands over token ids and candidate
sources and gets, per source, the longest cached prefix by medium.

Predict-on-route: after a decision the router calls :meth:`KVIndex.predict`, giving the chosen
source short-lived *predicted* residencies for the prompt's blocks, so a burst of requests sharing a
prefix lands together before the engine's BlockStored arrives (~one scheduler step plus network).
Predictions are kept apart from event-fed residencies: they never change a reference count, expire
after ``predict_ttl_s``, and a source's predictions are dropped when it restarts or clears its
cache, so they never outlive or override what the engine reported. A predicted block also ends when
the engine's events speak of it (its BlockStored or BlockRemoved: the store records the keys a
source with predictions stores and removes), so a prediction never outlives the block's eviction.

Hybrid models (KV cache groups of several kinds: sliding window, Mamba, beside full attention) are
matched by vLLM's hybrid rule (:meth:`KVIndex._match_groups`): the longest prefix every
full-attention group holds, within which each sliding-window group needs the blocks of its window
just before the hit, and each Mamba group a state saved exactly at the hit's end; and at most
``prompt_tokens - 1`` tokens, as vLLM always computes one. A prediction on such a source is the
prompt's last full block only: the prompt's whole prefix, which its prefill leaves servable.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from index.ingest import FULL, MAMBA, SLIDING, GroupSpec, Ingestor, SourceStats
from index.keys import prompt_keys, prompt_keys_both, prompt_keys_raw, request_extra_keys
from index.store import GroupMatch, PrefixStore, SourceId, SourceMatch, group_medium
from index.subscriber import EventSubscriber, SourceConfig, SourceStatus, SubscriberConfig

PREDICTED = "PREDICTED"
LARGE_PREDICTION_KEYS = 4096
"""A prediction of more block keys than this is recorded in slices (:data:`_PREDICTION_SLICE`) by the
``defer`` given to :meth:`KVIndex.predict` (the router's worker threads): recorded inline, the 62k
keys of a million-token prompt held the event loop ~75 ms. The slices already recorded count at
once, a prefix of the prediction: a match extended by it is never longer than the whole one."""
_PREDICTION_SLICE = 1024
"""Keys per slice of a deferred prediction (~1 ms of the interpreter); the thread hands the
interpreter over after each, so the event loop never waits behind it for long."""

PredictionListener = Callable[[SourceId, int, Sequence[int], float], None]
"""Called with (source, block size, keys not yet confirmed by events, ttl seconds) after a prediction."""


class IndexConfig(msgspec.Struct, frozen=True):
    """Index settings (mirrored in the README's configuration table)."""

    block_size: int | None = 16
    """Engines' block size; None learns it from the first events. A mismatch is logged and counted."""
    max_residencies: int = 20_000_000
    """Cap on indexed residencies (key, source, medium); beyond it the oldest blocks of the largest
    source are evicted and counted. 20M is ~1.3 GB of index tables at any number of sources (~63
    bytes per residency at 64 or 1,024, up to 2x while a table doubles)."""
    predict_ttl_s: float = 2.0
    """Lifetime of predicted residencies; 0 disables predict-on-route."""
    max_predicted_per_source: int = 200_000
    """Cap on predicted blocks per source."""
    subscriber: SubscriberConfig = SubscriberConfig()


class MatchReport(msgspec.Struct):
    """A prompt matched against candidate sources."""

    prompt_tokens: int
    block_size: int
    prompt_blocks: int
    matches: Mapping[SourceId, SourceMatch]
    keys: dict[int, list[int]]
    """Prompt keys per block size (reused by predict())."""


class SourcePlan:
    """How a candidate set's sources are matched (:meth:`KVIndex.plan`): their store indices by
    block size, the hybrid ones, the unknown ones; valid while no source comes or goes and no
    source's block size or KV cache groups change (:meth:`KVIndex.plan_valid`)."""

    __slots__ = ("groups", "hybrid", "main_size", "n", "pos_of", "unknown", "unknown_media", "version")

    def __init__(self, version: tuple[int, int], n: int, main_size: int) -> None:
        self.version = version
        self.n = n
        self.main_size = main_size
        self.groups: list[tuple[int, list[int], list[int] | None]] = []
        """(block size, store indices, their candidate positions; None: every candidate in order)."""
        self.hybrid: list[tuple[int, int, int]] = []
        """(candidate position, store index, block size) of hybrid models' sources."""
        self.unknown: list[int] = []
        """Positions of candidates the index does not follow."""
        self.unknown_media: list[dict[str, int] | None] = []
        """Per candidate ``{}`` where the index does not follow it, else None (a match copies it:
        no Python loop over a fleet the index does not follow)."""
        self.pos_of: dict[int, tuple[int, int]] = {}
        """Store index -> (candidate position, block size) of the plain sources."""


class PlanMatch(msgspec.Struct):
    """A prompt matched against a :class:`SourcePlan`'s candidates, as lists in candidate order."""

    block_size: int
    prompt_blocks: int
    keys: dict[int, list[int]]
    matched: list[int]
    media: list[dict[str, int] | None] | None
    """Per candidate its blocks by medium, where the offs do not say it (None: nowhere)."""
    offs: list[list[int] | None] | None
    """Per candidate the index's per-medium counts of its blocks off GPU (None: all on GPU)."""
    groups: dict[int, SourceMatch]
    """Hybrid models' matches by candidate position."""


class KVIndex:
    """Store, ingestor, subscriber and predictions behind one object with a small API."""

    def __init__(self, config: IndexConfig | None = None, ctx: Any = None) -> None:
        """``ctx``: a ZeroMQ context to make the sockets in (index/zsock.py's or pyzmq's); None: a new one."""
        self.config = config or IndexConfig()
        self.store = PrefixStore(self.config.max_residencies)
        self.ingestor = Ingestor(self.store, self.config.block_size)
        self.subscriber = EventSubscriber(self.ingestor, config=self.config.subscriber, ctx=ctx)
        self.ingestor.on_reset = self._forget_predictions
        self.ingestor.on_touched = self._touched
        self._predicted: dict[int, dict[int, float]] = {}
        self._holders: dict[int, dict[int, float]] = {}
        """Block key -> the sources it is predicted on, with the expiry: a match finds the
        candidates a prediction extends from the prompt's keys, not by a walk over every source
        with predictions (at a high request rate, nearly every source has some)."""
        self._plock = threading.Lock()
        """Guards changes to the predictions (the event loop adds them, the ingest thread ends them)."""
        self._watched: set[int] = set()
        """Sources whose stored and removed keys the store records (those with predictions)."""
        self.prediction_listener: PredictionListener | None = None
        """Told of every prediction this process makes (router replicas share them); not of the ones
        added with :meth:`predict_keys`."""

    # --- lifecycle -------------------------------------------------------------------------------
    def add_source(self, cfg: SourceConfig) -> None:
        """Follow one (instance, DP rank) event stream; any time, also while the subscriber runs (it
        takes effect in the subscriber thread). Freed source slots (and mask bits) are reused."""
        self.subscriber.add_source(cfg)

    def remove_source(self, source: SourceId) -> None:
        """Stop following a source: unsubscribed at once, then its entries are freed in slices
        without the GIL (lookups go on meanwhile) and its tables go back to the OS."""
        self.subscriber.remove_source(source)
        sidx = self.store.source_index(source)
        if sidx is not None:
            with self._plock:
                self._unhold(sidx, self._predicted.pop(sidx, None))

    def source_ready(self, source: SourceId) -> bool:
        """True once the source's first bootstrap replay has ended (done, failed or abandoned) or
        when it has no replay endpoint: from then on its index is as complete as replay can make it."""
        return self.subscriber.source_ready(source)

    def source_blocks_by_medium(self, source: SourceId) -> dict[str, int]:
        """Residencies one source holds, by medium ({} for a source not followed)."""
        sidx = self.store.source_index(source)
        return {} if sidx is None else self.store.source_blocks(sidx)

    def source_keys(self, source: SourceId) -> dict[str, set[int]]:
        """Every block key one source holds, by medium: O(its blocks), for tests and convergence
        checks against the engines' own caches (keys as :func:`index.keys.prompt_keys` makes them)."""
        sidx = self.store.source_index(source)
        return {} if sidx is None else self.store.source_keys(sidx)

    def start(self) -> None:
        """Start ingesting in the background thread."""
        self.subscriber.start()

    def stop(self) -> None:
        """Stop ingesting and close sockets."""
        self.subscriber.stop()

    # --- queries -------------------------------------------------------------------------------
    def block_size_of(self, source: SourceId) -> int:
        """The block size prompts are hashed at for a source: learned from its events, else configured."""
        sidx = self.store.source_index(source)
        if sidx is not None:
            st = self.ingestor.stats.get(sidx)
            if st is not None and st.block_size:
                return st.block_size
        return self.config.block_size or 16

    def match(
        self,
        tokens: Sequence[int],
        candidates: Sequence[SourceId],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        spans: Sequence[Sequence[Any]] | None = None,
    ) -> MatchReport:
        """Longest cached prefix of ``tokens`` on every candidate source, by medium (predictions included)."""
        by_size: dict[int, list[int]] = {}
        default_size = self.config.block_size or 16
        index_of = self.store.source_index
        stats = self.ingestor.stats
        hybrid: dict[int, list[int]] = {}  # block size -> sources of hybrid models (matched apart)
        for source in candidates:  # one dict lookup or two per candidate: this loop is O(fleet)
            sidx = index_of(source)
            if sidx is not None:
                st = stats.get(sidx)
                size = st.block_size if st is not None and st.block_size else default_size
                plain = by_size.setdefault(size, [])
                if st is not None and (st.groups or st.groups_bad):
                    hybrid.setdefault(size, []).append(sidx)
                else:
                    plain.append(sidx)
        main_size = self.config.block_size or (next(iter(by_size)) if by_size else 16)
        keys: dict[int, list[int]] = {}
        matches: dict[SourceId, SourceMatch] = {}
        now = time.monotonic()
        predictions = self._predicted
        for size, sidxs in by_size.items():
            ks, arr = prompt_keys_both(
                tokens, size, lora_name=lora_name, extra_keys=request_extra_keys(size, cache_salt, spans)
            )
            keys[size] = ks
            for sidx in hybrid.get(size, ()):  # hybrid models: vLLM's hybrid rule, source by source
                hm = self._match_groups(sidx, stats[sidx], size, arr, ks, len(tokens), now)
                if hm is not None:
                    matches[hm.source] = hm
            for m in self.store.lookup(arr, sidxs):  # skips a source removed meanwhile
                if predictions:
                    sidx = index_of(m.source)
                    predicted = predictions.get(sidx) if sidx is not None else None
                    if predicted:
                        self._extend_with_predictions(m, ks, predicted, now)
                matches[m.source] = m
        if main_size not in keys:
            keys[main_size] = prompt_keys(
                tokens,
                main_size,
                lora_name=lora_name,
                extra_keys=request_extra_keys(main_size, cache_salt, spans),
            )
        return MatchReport(len(tokens), main_size, len(tokens) // main_size, matches, keys)

    def plan(self, candidates: Sequence[SourceId]) -> SourcePlan:
        """What :meth:`match_plan` needs of a candidate set, found once (a decision over the same
        candidates then costs no Python per candidate). O(candidates)."""
        version = (self.store.generation, self.ingestor.layout_version)  # (read first: a race re-plans)
        default_size = self.config.block_size or 16
        index_of = self.store.source_index
        stats = self.ingestor.stats
        by_size: dict[int, tuple[list[int], list[int]]] = {}
        hybrid: list[tuple[int, int, int]] = []
        unknown: list[int] = []
        for i, source in enumerate(candidates):
            sidx = index_of(source)
            if sidx is None:
                unknown.append(i)
                continue
            st = stats.get(sidx)
            size = st.block_size if st is not None and st.block_size else default_size
            plain = by_size.setdefault(size, ([], []))
            if st is not None and (st.groups or st.groups_bad):
                hybrid.append((i, sidx, size))
            else:
                plain[0].append(sidx)
                plain[1].append(i)
        main_size = self.config.block_size or (next(iter(by_size)) if by_size else 16)
        plan = SourcePlan(version, len(candidates), main_size)
        plan.hybrid = hybrid
        plan.unknown = unknown
        if unknown:
            empty: dict[str, int] = {}  # (never changed: shared)
            plan.unknown_media = [None] * len(candidates)
            for i in unknown:
                plan.unknown_media[i] = empty
        for size, (sidxs, where) in by_size.items():
            identity = len(sidxs) == len(candidates)
            plan.groups.append((size, sidxs, None if identity else where))
            for sidx, i in zip(sidxs, where, strict=True):
                plan.pos_of[sidx] = (i, size)
        return plan

    def plan_valid(self, plan: SourcePlan) -> bool:
        """Whether a plan still says how its candidates are matched."""
        return plan.version == (self.store.generation, self.ingestor.layout_version)

    def match_plan(
        self,
        tokens: Sequence[int],
        plan: SourcePlan,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        spans: Sequence[Sequence[Any]] | None = None,
    ) -> PlanMatch:
        """:meth:`match` over a :class:`SourcePlan`'s candidates, as lists in candidate order: one
        compiled lookup per block size, no object per candidate (a dict only for a candidate with
        predictions, a hybrid model's or one the index does not follow). Same answer as
        :meth:`match`."""
        n = plan.n
        keys: dict[int, list[int]] = {}
        arrays: dict[int, bytes] = {}
        matched: list[int] | None = None
        offs: list[list[int] | None] | None = None
        media: list[dict[str, int] | None] | None = None
        lookup = self.store.core.lookup
        for size, sidxs, where in plan.groups:
            ks, arr = prompt_keys_both(
                tokens, size, lora_name=lora_name, extra_keys=request_extra_keys(size, cache_salt, spans)
            )
            keys[size] = ks
            arrays[size] = arr
            blocks, off = lookup(arr, sidxs)
            if where is None:
                matched, offs = blocks, off
                continue
            if matched is None:
                matched = [0] * n
            for j, i in enumerate(where):
                matched[i] = blocks[j]
            if off is not None:
                if offs is None:
                    offs = [None] * n
                for j, i in enumerate(where):
                    offs[i] = off[j]
        if matched is None:
            matched = [0] * n
        if plan.unknown:
            media = plan.unknown_media.copy()
        groups: dict[int, SourceMatch] = {}
        now = time.monotonic()
        if plan.hybrid:
            stats = self.ingestor.stats
            for i, sidx, size in plan.hybrid:
                if size not in keys:
                    ks, arr = prompt_keys_both(
                        tokens,
                        size,
                        lora_name=lora_name,
                        extra_keys=request_extra_keys(size, cache_salt, spans),
                    )
                    keys[size] = ks
                    arrays[size] = arr
                st = stats.get(sidx)
                hm = (
                    self._match_groups(sidx, st, size, arrays[size], keys[size], len(tokens), now)
                    if st
                    else None
                )
                if media is None:
                    media = [None] * n
                if hm is None:
                    matched[i] = 0
                    media[i] = {}
                    continue
                matched[i] = hm.blocks
                media[i] = hm.by_medium
                groups[i] = hm
        if self._holders:
            media = self._extend_plan(plan, keys, matched, offs, media, now)
        main = plan.main_size
        if main not in keys:
            keys[main] = prompt_keys(
                tokens, main, lora_name=lora_name, extra_keys=request_extra_keys(main, cache_salt, spans)
            )
        return PlanMatch(main, len(tokens) // main, keys, matched, media, offs, groups)

    def _extend_plan(
        self,
        plan: SourcePlan,
        keys: dict[int, list[int]],
        matched: list[int],
        offs: list[list[int] | None] | None,
        media: list[dict[str, int] | None] | None,
        now: float,
    ) -> list[dict[str, int] | None] | None:
        """Predictions on the plan's plain candidates: one whose next prompt block (after what it
        holds, ``matched``) is predicted on it gets the predicted run on top (``matched`` and
        ``media`` changed in place; ``media`` made when first needed). Found through
        :attr:`_holders` from the keys at the depths the candidates reached (few distinct ones): the
        work is the candidates predicted there, not the sources with predictions."""
        holders = self._holders
        pos_of = plan.pos_of
        predictions = self._predicted
        found: list[tuple[int, int, int]] = []  # (position, held blocks, with the predicted run)
        for size, ks in keys.items():
            nk = len(ks)
            for b in set(matched):
                if b >= nk:
                    continue
                held = holders.get(ks[b])
                if not held:
                    continue
                for sidx, expiry in list(held.items()):  # (the ingest thread may end some meanwhile)
                    at = pos_of.get(sidx)
                    if at is None or at[1] != size or expiry <= now or matched[at[0]] != b:
                        continue
                    predicted = predictions.get(sidx)
                    if not predicted:
                        continue
                    j = b
                    while j < nk and predicted.get(ks[j], 0.0) > now:
                        j += 1
                    if j > b:
                        found.append((at[0], b, j))
        if not found:
            return media
        names = self.store._media_names
        if media is None:
            media = [None] * plan.n
        same: dict[tuple[int, int], dict[str, int]] = {}  # (all on GPU: one dict per run, shared)
        for i, b, j in found:
            row = offs[i] if offs is not None else None
            if row and any(row):
                by = {"GPU": b}
                for k, c in enumerate(row):
                    if c:
                        by[names[k]] = c
                        by["GPU"] -= c
                by[PREDICTED] = j - b
            else:
                shared = same.get((b, j))
                if shared is None:
                    shared = same[(b, j)] = {"GPU": b, PREDICTED: j - b}
                by = shared
            media[i] = by
            matched[i] = j
        return media

    def medium_roles(self) -> tuple[tuple[str, ...], bytes]:
        """The index's medium names by medium index and what the policy credits each as (1 GPU,
        2 CPU, 3 STORAGE, 0 another): the columns of :meth:`match_plan`'s ``offs``."""
        names = tuple(self.store._media_names)
        roles = bytes({"GPU": 1, "CPU": 2, "STORAGE": 3}.get(m, 0) for m in names)
        return names, roles

    def match_counts(
        self,
        tokens: Sequence[int],
        candidates: Sequence[SourceId],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        spans: Sequence[Sequence[Any]] | None = None,
    ) -> tuple[int, list[int], list[dict[str, int] | None]] | None:
        """:meth:`match` as plain lists, without a report: (block size, matched blocks per
        candidate, blocks by medium per candidate: None for ``{"GPU": blocks}``, ``{}`` for a
        candidate the index does not know). None when :meth:`match` is needed: a candidate with
        predictions, or one whose events taught another block size than the configured one.
        For ``/route`` (router/decision/service.py ``explain_json_now``): the report's objects were
        a fifth of a lookup's cost in the running service."""
        size = self.config.block_size
        if not size:
            return None
        index_of = self.store.source_index
        stats = self.ingestor.stats
        predictions = self._predicted
        sidxs: list[int] = []
        where: list[int] = []
        for i, source in enumerate(candidates):
            sidx = index_of(source)
            if sidx is not None:
                st = stats.get(sidx)
                if st is not None and (st.groups or st.groups_bad or st.block_size not in (None, size)):
                    return None  # (another block size, or a hybrid model: the report's path)
                if predictions and predictions.get(sidx):
                    return None
                sidxs.append(sidx)
                where.append(i)
        keys = prompt_keys_raw(tokens, size, lora_name, request_extra_keys(size, cache_salt, spans))
        blocks, offs = self.store.lookup_counts(keys, sidxs)
        n = len(candidates)
        matched = [0] * n
        media: list[dict[str, int] | None] = [{}] * n  # (never changed: shared)
        for j, i in enumerate(where):
            b = blocks[j]
            if b >= 0:  # (-1: the source was removed meanwhile)
                matched[i] = b
                media[i] = offs[j] if offs is not None else None
        return size, matched, media

    def _match_groups(
        self,
        sidx: int,
        st: SourceStats,
        size: int,
        arr: bytes,
        keys: list[int],
        ntokens: int,
        now: float,
    ) -> SourceMatch | None:
        """A hybrid model's match: the longest prefix every KV cache group would serve, as vLLM's
        hybrid coordinator finds it (each group in turn lowers the hit to what it can serve, until
        none lowers it), capped at ``ntokens - 1`` tokens. Its CPU and storage tiers earn nothing:
        vLLM's offloading covers only the full-attention groups, so a hit needs the others' blocks
        on the GPU anyway."""
        source = self.store.source_of(sidx)
        if source is None:
            return None
        if st.groups_bad:
            return SourceMatch(source, 0, {"GPU": 0}, [])
        specs = dict(st.groups)
        if 0 not in specs:  # (its events went the C way, which takes full attention only)
            specs[0] = GroupSpec.of(FULL, None, size)
        order = sorted(specs)
        media = [self.store.medium_lookup(group_medium("GPU", g)) for g in order]
        cap = max(ntokens - 1, 0) // size
        if any(m is None for m in media):  # a group that never stored a block serves nothing
            bits: list[int] = []
        else:
            need = sum(1 << i for i, g in enumerate(order) if specs[g].rule == FULL)
            bits = self.store.group_bits(arr, sidx, media, need, cap)  # type: ignore[arg-type]  # (not None)
        depth = len(bits)
        own = [_group_hit(bits, i, specs[g], depth) for i, g in enumerate(order)]
        hit = min(own, default=depth)
        sparse = [i for i, g in enumerate(order) if specs[g].rule != FULL]
        moved = True
        while moved and hit:
            moved = False
            for i in sparse:
                h = _group_hit(bits, i, specs[order[i]], hit)
                if h < hit:
                    hit, moved = h, True
        by_medium = {"GPU": hit}
        predicted = self._predicted.get(sidx)
        if predicted:  # a predicted prompt's end: its whole prefix
            for j in range(min(cap, len(keys)), hit, -1):
                if predicted.get(keys[j - 1], 0.0) > now:
                    by_medium[PREDICTED] = j - hit
                    hit = j
                    break
        groups = [
            GroupMatch(g, specs[g].rule, own[i], specs[g].window if specs[g].rule == SLIDING else None)
            for i, g in enumerate(order)
        ]
        return SourceMatch(source, hit, by_medium, groups)

    def _grouped(self, sidx: int) -> bool:
        st = self.ingestor.stats.get(sidx)
        return st is not None and bool(st.groups or st.groups_bad)

    @staticmethod
    def _extend_with_predictions(
        m: SourceMatch, keys: list[int], predicted: dict[int, float], now: float
    ) -> None:
        i = m.blocks
        n = len(keys)
        while i < n and predicted.get(keys[i], 0.0) > now:
            i += 1
        if i > m.blocks:
            m.by_medium[PREDICTED] = i - m.blocks
            m.blocks = i

    def predict(
        self, source: SourceId, report: MatchReport, defer: Callable[..., None] | None = None
    ) -> None:
        """Give ``source`` predicted residencies for the report's prompt blocks for ``predict_ttl_s``.
        ``defer(fn, *args)``: runs ``fn(*args)`` in another thread, soon; given, a prediction of
        more than :data:`LARGE_PREDICTION_KEYS` keys is recorded there, in slices."""
        ttl = self.config.predict_ttl_s
        sidx = self.store.source_index(source)
        if ttl <= 0 or sidx is None:
            return
        size = self.block_size_of(source)
        keys = report.keys.get(size)
        if not keys:
            return
        now = time.monotonic()
        if defer is not None and len(keys) > LARGE_PREDICTION_KEYS and not self._grouped(sidx):
            defer(self._add_in_slices, sidx, keys, now + ttl)
        elif not self._add_predictions(sidx, keys, now + ttl, now):
            return
        if self.prediction_listener is not None:
            # the blocks the source's events already confirmed are known to every process that follows
            # the same streams: only the rest is news to them
            m = report.matches.get(source)
            confirmed = m.blocks - m.by_medium.get(PREDICTED, 0) if m is not None else 0
            if confirmed < len(keys):
                self.prediction_listener(source, size, keys[confirmed:], ttl)

    def predict_keys(self, source: SourceId, block_size: int, keys: Sequence[int], expiry: float) -> bool:
        """Predicted residencies decided elsewhere (another router replica): ``keys`` (block keys at
        ``block_size``, in prompt order) on ``source`` until ``expiry`` (``time.monotonic()``). False
        when not taken: unknown source, another block size than the source's, predictions off, or the
        cap. The listener is not told (these came from a peer)."""
        sidx = self.store.source_index(source)
        if self.config.predict_ttl_s <= 0 or sidx is None or block_size != self.block_size_of(source):
            return False
        now = time.monotonic()
        if expiry <= now or not keys:
            return False
        return self._add_predictions(sidx, keys, expiry, now)

    def _add_in_slices(self, sidx: int, keys: Sequence[int], expiry: float) -> None:
        """:meth:`_add_predictions` of ``keys`` in slices of :data:`_PREDICTION_SLICE` (each a
        short hold of the lock and of the interpreter), up to the first the cap refuses."""
        for at in range(0, len(keys), _PREDICTION_SLICE):
            now = time.monotonic()
            part = keys[at : at + _PREDICTION_SLICE]
            if expiry <= now or not self._add_predictions(sidx, part, expiry, now):
                return
            time.sleep(0)  # (the event loop's turn at the interpreter between slices)

    def _add_predictions(self, sidx: int, keys: Sequence[int], expiry: float, now: float) -> bool:
        """Keys predicted on a source until ``expiry`` (a later one of a key already predicted wins);
        False when the cap leaves no room. A hybrid model's prediction is the prompt's last block
        only (its whole prefix: :meth:`_match_groups`)."""
        with self._plock:
            pred = self._predicted.get(sidx)
            if pred is None:
                pred = self._predicted[sidx] = {}
            if len(pred) + len(keys) > self.config.max_predicted_per_source:
                pred = self._purge(sidx, now)
                if len(pred) + len(keys) > self.config.max_predicted_per_source:
                    return False
            if self._grouped(sidx):
                keys = keys[-1:]
            holders = self._holders
            if now + self.config.predict_ttl_s <= expiry:  # (this router's own: the latest of all)
                pred.update(
                    dict.fromkeys(keys, expiry)
                )  # (in C: a loop held the event loop 14 ms per 50k keys)
                for k in keys:
                    h = holders.get(k)
                    if h is None:
                        holders[k] = {sidx: expiry}
                    else:
                        h[sidx] = expiry
            else:
                for k in keys:
                    if pred.get(k, 0.0) < expiry:
                        pred[k] = expiry
                        h = holders.get(k)
                        if h is None:
                            holders[k] = {sidx: expiry}
                        else:
                            h[sidx] = expiry
            self._watch(sidx)
        return True

    def _unhold(self, sidx: int, keys: Iterable[int] | None) -> None:
        """(under _plock) The source's predictions of these keys ended: out of :attr:`_holders`."""
        if not keys:
            return
        holders = self._holders
        for k in keys:
            h = holders.get(k)
            if h is not None and h.pop(sidx, None) is not None and not h:
                del holders[k]

    def _purge(self, sidx: int, now: float) -> dict[int, float]:
        """(under _plock) The source's live predictions only."""
        pred = self._predicted.get(sidx, {})
        live = self._predicted[sidx] = {k: t for k, t in pred.items() if t > now}
        if len(live) < len(pred):
            self._unhold(sidx, [k for k, t in pred.items() if t <= now])
        return live

    def _watch(self, sidx: int) -> None:
        """(under _plock) Have the store record the keys the source stores and removes."""
        if sidx not in self._watched:
            self._watched.add(sidx)
            self.store.watch(sidx, True)

    def _touched(self, sidx: int, keys: bytes | None) -> None:
        """The engine's events spoke of these blocks (stored or removed; None: of too many to list):
        its events say what it holds now, so their predictions end."""
        with self._plock:
            pred = self._predicted.get(sidx)
            if not pred:
                return
            if keys is None:
                self._unhold(sidx, list(pred))
                pred.clear()
                return
            ids = array("Q")
            ids.frombytes(keys)
            ended = pred.keys() & set(ids)
            for k in ended:
                del pred[k]
            self._unhold(sidx, ended)

    def purge_predictions(self) -> None:
        """Drop expired predictions (the router calls this periodically to bound memory); a source
        left without any is no longer watched."""
        now = time.monotonic()
        with self._plock:
            for sidx in list(self._predicted):
                if not self._purge(sidx, now) and sidx in self._watched:
                    self._watched.discard(sidx)
                    if self.store.source_of(sidx) is not None:
                        self.store.watch(sidx, False)

    def predicted_blocks(self) -> int:
        """Predicted residencies currently held (expired ones included until purged)."""
        return sum(len(p) for p in list(self._predicted.values()))

    def _forget_predictions(self, sidx: int) -> None:
        with self._plock:
            if sidx in self._predicted:
                self._unhold(sidx, list(self._predicted[sidx]))
                self._predicted[sidx] = {}

    def resources(self) -> dict[str, int | None]:
        """The event streams' headroom: sockets and their cap, descriptors and their limit, failing
        sources, open errors, replays in flight and waiting."""
        return self.subscriber.resources()

    def status(self) -> list[SourceStatus]:
        """Per-source event stream health and block counts."""
        return self.subscriber.status()

    @property
    def evictions(self) -> int:
        """Residencies evicted because the memory cap bit."""
        return self.store.evictions


def _group_hit(bits: Sequence[int], i: int, spec: GroupSpec, limit: int) -> int:
    """The longest prefix of at most ``limit`` blocks KV cache group ``i`` serves, given which
    blocks it holds (``bits[j] >> i & 1``), by vLLM's rule for its kind: full attention every block
    (``bits`` stops at the first block a full-attention group lacks); a sliding window the
    ``spec.need()`` blocks just before the hit, or every block of a shorter prefix; Mamba the block
    that ends at the hit (its saved state)."""
    if spec.rule == FULL:
        return limit
    bit = 1 << i
    if spec.rule == MAMBA:
        for j in range(limit - 1, -1, -1):
            if bits[j] & bit:
                return j + 1
        return 0
    need = spec.need()
    run = 0
    for j in range(limit - 1, -1, -1):
        if bits[j] & bit:
            run += 1
            if run >= need:
                return j + need
        else:
            run = 0
    return run
