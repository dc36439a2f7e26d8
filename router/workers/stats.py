"""One view of the figures of several worker processes: /metrics and the dashboard, merged.

With ``server.workers > 1`` a scrape lands on whichever process the kernel picked, so each process
writes a snapshot of its figures to the supervisor's run directory every ``interval`` seconds, and
whichever process answers merges the snapshots:

- request-path series (requests, errors, decisions, tokens, latencies: :data:`SUMMED`) are summed
  over the workers;
- everything else (index and event-stream figures, health, in-flight load) is taken from the lowest
  worker: every worker indexes the same events and reads the same shared load board, so one copy is
  the right answer, and taking the same copy each time keeps counters monotonic between scrapes.

The merge reads snapshots only, never the answering process's live state, so that two scrapes
answered by different processes cannot see a counter go backwards. Figures are at most
``interval`` seconds old. When a worker dies, the supervisor folds its last snapshot into
``retired.msgpack`` (:func:`retire`) before starting its replacement, whose counters start from
zero: the sums carry on from where they were instead of dropping, which Prometheus would read as a
reset of every series and turn into a false spike in ``rate()``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from router.observe.exposition import GaugeFamily, Registry, render
from router.pd.metrics import NAMES as PD_SUMMED

log = logging.getLogger("kvrouter.workers")

SUMMED = frozenset(
    {
        "kvrouter_requests",
        "kvrouter_request_errors",
        "kvrouter_route_decision_seconds",
        "kvrouter_route_decisions",
        "kvrouter_matched_prefix_ratio",
        "kvrouter_prompt_tokens",
        "kvrouter_matched_tokens",
        "kvrouter_upstream_latency_seconds",
        "kvrouter_ttft_seconds",
        "kvrouter_tokenizer_cache_tokens",
        "kvrouter_retries",
        "kvrouter_upstream_violations",
        "kvrouter_backend_ejections",
        "kvrouter_prediction_checks",
        "kvrouter_prediction_error_tokens",
        "kvrouter_prompt_tokens_mismatch",
        "kvrouter_client_limit_hits",
        "kvrouter_cluster_held_decisions",
        "kvrouter_cluster_assumed_decisions",
        # each worker is a replica of its own (router/cluster): its traffic and pins add up
        "kvrouter_cluster_messages",
        "kvrouter_cluster_bytes",
        "kvrouter_cluster_predicted_keys",
        "kvrouter_cluster_pins",
        "kvrouter_cluster_failures",
        "kvrouter_cluster_dropped",
        "kvrouter_cluster_lag_seconds",
        "kvrouter_session_affinity",
    }
)
SUMMED = SUMMED | PD_SUMMED  # P/D series (router/pd/metrics.py) are request-path series too
SUMMED = SUMMED | {"kvrouter_flow_wait_seconds", "kvrouter_flow_dispatched", "kvrouter_flow_rejected"}
"""Counters and histograms summed over workers, a dead worker's last figures kept (retired); the
families in none of these sets come from the lowest worker."""
LIVE_SUMMED = frozenset(
    {
        "kvrouter_tokenizer_cache_bytes",
        "kvrouter_tokenizer_cache_disabled",
        "kvrouter_session_pins",
        "kvrouter_client_connections",
        "kvrouter_max_client_connections",
        "kvrouter_flow_queue_depth",  # (each worker's own queue)
    }
)
"""Gauges summed over the live workers only: a dead worker's memory or pins are gone with it."""
LIVE_MAX = frozenset({"kvrouter_backend_ejected", "kvrouter_open_fds"})
"""Gauges whose merged value is the highest of the live workers' (each worker has its breakers: a
backend is shown ejected when any worker ejected it; each has its file descriptor limit: the
fullest one's descriptors are the headroom that matters)."""

_DASH_COUNTERS = ("requests", "errors", "prompt_tokens", "matched_tokens")


class Family(msgspec.Struct, array_like=True):
    """One metric family as collected: name, type, help and samples (name, labels, value)."""

    name: str
    type: str
    doc: str
    samples: list[tuple[str, dict[str, str], float]]


class Snapshot(msgspec.Struct):
    """What one worker publishes."""

    worker: int
    pid: int
    time: float
    families: list[Family]
    dashboard: dict[str, Any]


class Retired(msgspec.Struct):
    """The summed figures of workers that died (their last snapshots), and their pids, whose own
    snapshot files the merge then skips."""

    pids: list[int] = []
    families: list[Family] = []
    dashboard: dict[str, Any] = {}

    def as_snapshot(self) -> Snapshot:
        """The retired figures in the shape of one more worker's snapshot (summed families only)."""
        return Snapshot(-1, 0, 0.0, self.families, self.dashboard)


_RETIRED = "retired.msgpack"


def families_of(registry: Registry) -> list[Family]:
    """A registry's families in a serialisable form."""
    return [Family(m.name, m.type, m.doc, list(m.samples)) for m in registry.collect()]


class SnapshotWriter:
    """Writes this worker's snapshot file (atomically: a reader never sees half a file)."""

    def __init__(self, run_dir: str, worker: int) -> None:
        self.path = Path(run_dir) / f"stats-{worker}.msgpack"
        self.worker = worker
        self._encoder = msgspec.msgpack.Encoder()

    def write(self, families: list[Family], dashboard: dict[str, Any]) -> None:
        """Replace the snapshot file."""
        snap = Snapshot(self.worker, os.getpid(), time.time(), families, dashboard)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(self._encoder.encode(snap))
        os.replace(tmp, self.path)


def read_retired(run_dir: str) -> Retired:
    """The figures of the workers that died so far (none: empty)."""
    path = Path(run_dir) / _RETIRED
    try:
        return msgspec.msgpack.decode(path.read_bytes(), type=Retired)
    except FileNotFoundError:
        return Retired()
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("unreadable %s: %s", path, exc)
        return Retired()


def read_snapshots(run_dir: str) -> list[Snapshot]:
    """Every live worker's latest snapshot, lowest worker first, then the retired workers' figures
    (as one more snapshot, if any). Unreadable files are skipped and logged."""
    retired = read_retired(run_dir)
    gone = set(retired.pids)
    decoder = msgspec.msgpack.Decoder(Snapshot)
    out = []
    for path in Path(run_dir).glob("stats-*.msgpack"):
        try:
            snap = decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("skipping worker snapshot %s: %s", path, exc)
            continue
        if snap.pid not in gone:
            out.append(snap)
    out.sort(key=lambda s: s.worker)
    if retired.pids:
        out.append(retired.as_snapshot())
    return out


def retire(run_dir: str, worker: int) -> None:
    """Fold a dead worker's last snapshot into the retired figures (the supervisor calls this after
    the worker exited and before its replacement starts; it is the only writer of the file)."""
    path = Path(run_dir) / f"stats-{worker}.msgpack"
    try:
        snap = msgspec.msgpack.decode(path.read_bytes(), type=Snapshot)
    except FileNotFoundError:
        return  # it died before publishing anything
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("cannot retire worker %d's figures: %s", worker, exc)
        return
    retired = read_retired(run_dir)
    if snap.pid in retired.pids:
        return
    both = [retired.as_snapshot(), snap]
    families = [f for f in merge_families(both) if f.name in SUMMED]
    out = Retired([*retired.pids, snap.pid], families, _sum_dashboards(both))
    tmp = Path(run_dir) / f"{_RETIRED}.tmp"
    tmp.write_bytes(msgspec.msgpack.encode(out))
    os.replace(tmp, Path(run_dir) / _RETIRED)


def merge_families(snaps: list[Snapshot]) -> list[Family]:
    """:data:`SUMMED` families summed over the snapshots, :data:`LIVE_SUMMED` over the live ones,
    :data:`LIVE_MAX` their highest, the others from the first one."""
    if not snaps:
        return []
    merged: dict[str, Family] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, dict[str, str], float]]] = {}
    for snap in snaps:
        for fam in snap.families:
            kind = "sum" if fam.name in SUMMED else "live" if fam.name in LIVE_SUMMED else ""
            kind = "max" if fam.name in LIVE_MAX else kind
            if not kind:
                if snap is snaps[0]:
                    merged[fam.name] = fam
                continue
            if kind != "sum" and snap.worker < 0:
                continue  # (the retired workers' figures hold no gauge)
            if fam.name not in merged:
                merged[fam.name] = Family(fam.name, fam.type, fam.doc, [])
                sums[fam.name] = {}
            acc = sums[fam.name]
            for name, labels, value in fam.samples:
                key = (name, tuple(sorted(labels.items())))
                prev = acc.get(key)
                if prev is None:
                    acc[key] = (name, labels, value)
                else:
                    acc[key] = (name, labels, max(value, prev[2]) if kind == "max" else value + prev[2])
    for name, acc in sums.items():
        merged[name].samples = list(acc.values())
    return list(merged.values())


def render_merged(snaps: list[Snapshot]) -> bytes:
    """Prometheus text of the merged snapshots, plus ``kvrouter_worker_snapshot_age_seconds``."""
    age = GaugeFamily(
        "kvrouter_worker_snapshot_age_seconds",
        "Age of each worker's published figures; one that keeps growing is a stuck or dead worker",
        labels=["worker"],
    )
    now = time.time()
    for s in snaps:
        if s.worker >= 0:  # not the retired workers' figures
            age.add_metric([str(s.worker)], max(now - s.time, 0.0))
    return render([*merge_families(snaps), age])  # (a snapshot's family renders as it is)


def _sum_dashboards(snaps: list[Snapshot]) -> dict[str, Any]:
    """The cumulative dashboard counters summed over snapshots: totals, per backend, per rank."""
    totals: dict[str, int] = {}
    backends: dict[str, dict[str, Any]] = {}
    for snap in snaps:
        d = snap.dashboard
        for k, v in d.get("totals", {}).items():
            totals[k] = totals.get(k, 0) + v
        for b in d.get("backends", []):
            acc = backends.setdefault(b["name"], {"name": b["name"], **dict.fromkeys(_DASH_COUNTERS, 0)})
            for k in _DASH_COUNTERS:
                acc[k] += b.get(k, 0)
            ranks = acc.setdefault("ranks", {})
            for r in b.get("ranks", []):
                ranks[r["dp_rank"]] = ranks.get(r["dp_rank"], 0) + r.get("requests", 0)
    for acc in backends.values():  # the input's shape, so that sums can be summed again
        acc["ranks"] = [{"dp_rank": r, "requests": n} for r, n in sorted(acc.get("ranks", {}).items())]
    return {"totals": totals, "backends": list(backends.values())}


def merge_dashboard(live: dict[str, Any], snaps: list[Snapshot], recent: int = 20) -> dict[str, Any]:
    """The dashboard JSON with the cumulative counters and recent decisions of every worker.

    Counters (totals, per backend, per rank) are summed over the snapshots and the event streams
    come from the lowest worker's snapshot, like /metrics, so that polls answered by different
    workers agree; health and in-flight load are the answering worker's live view (the load is
    fleet-wide through the shared board)."""
    if not snaps:
        return live
    out = dict(live)
    summed = _sum_dashboards(snaps)
    out["totals"] = {**dict.fromkeys(live.get("totals", {}), 0), **summed["totals"]}
    per_backend = {b["name"]: b for b in summed["backends"]}
    backends = []
    for b in live.get("backends", []):
        b = dict(b)
        acc = per_backend.get(b["name"], {})
        b.update({k: acc[k] for k in _DASH_COUNTERS if k in acc})
        rank_requests = {r["dp_rank"]: r["requests"] for r in acc.get("ranks", [])}
        b["ranks"] = [{**r, "requests": rank_requests.get(r["dp_rank"], 0)} for r in b.get("ranks", [])]
        backends.append(b)
    out["backends"] = backends
    first = snaps[0].dashboard
    if "sources" in first:
        out["sources"] = first["sources"]
    out["uptime_s"] = max([live.get("uptime_s", 0.0), *(s.dashboard.get("uptime_s", 0.0) for s in snaps)])
    decisions = [d for s in snaps for d in s.dashboard.get("recent_decisions", [])]
    decisions.sort(key=lambda r: r.get("time", 0.0))
    out["recent_decisions"] = decisions[-recent:]
    out["workers"] = sum(1 for s in snaps if s.worker >= 0)
    return out


__all__ = [
    "SUMMED",
    "Family",
    "Retired",
    "Snapshot",
    "SnapshotWriter",
    "families_of",
    "merge_dashboard",
    "merge_families",
    "read_retired",
    "read_snapshots",
    "render_merged",
    "retire",
]
