"""Membership's state machine on its own: joining -> ready -> draining -> gone, sources and origins.

The class does no I/O; a fake clock and a recording listener show every transition and what it asks
of the rest of the router. The end-to-end behaviour (real engines, real router) is in
test_membership_e2e.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import TIMEOUT

from router.config import BackendConfig, MembershipConfig
from router.fleet.membership import Member, Membership


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def joined(self, m: Member) -> None:
        self.calls.append(("joined", m.name, m.url))

    def left(self, m: Member) -> None:
        self.calls.append(("left", m.name, m.url))


def spec(name: str, **kw: Any) -> BackendConfig:
    return BackendConfig(name=name, url=kw.pop("url", f"http://{name}:8000"), models=["m"], **kw)


def setup(**cfg: Any) -> tuple[Membership, Recorder, Clock]:
    clock = Clock()
    ms = Membership(MembershipConfig(**cfg), clock=clock)
    rec = Recorder()
    ms.listeners.append(rec)
    return ms, rec, clock


def test_a_joiner_is_ready_once_healthy_and_bootstrapped() -> None:
    ms, rec, _ = setup(join_timeout_s=10)
    m, created = ms.upsert(spec("a"), "admin")
    assert created and m.state == "joining" and rec.calls == [("joined", "a", "http://a:8000")]
    assert ms.routable_for("m") == []  # not before it is ready
    ms.tick(lambda m: 0, lambda m: True)
    assert m.state == "joining"  # no probe answered yet
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: False)
    assert m.state == "joining"  # its streams are still bootstrapping
    ms.tick(lambda m: 0, lambda m: True)
    assert m.state == "ready" and ms.routable_for("m") == [m]
    assert [t.change for t in ms.transitions] == ["joined", "ready"]


def test_a_slow_bootstrap_does_not_keep_a_healthy_backend_out_forever() -> None:
    ms, _, clock = setup(join_timeout_s=3)
    m, _ = ms.upsert(spec("a"), "config")
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: False)
    assert m.state == "joining"
    clock.now += 3
    ms.tick(lambda m: 0, lambda m: False)
    assert m.state == "ready" and "bootstrap not finished" in m.reason


def test_a_failed_health_check_is_not_a_membership_change() -> None:
    ms, rec, _ = setup()
    m, _ = ms.upsert(spec("a"), "config")
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: True)
    m.healthy = False
    ms.tick(lambda m: 0, lambda m: True)
    assert m.state == "ready" and not m.routable and ms.known("m")
    assert rec.calls == [("joined", "a", "http://a:8000")]  # nothing left: the index is kept
    m.healthy = True
    assert ms.routable_for("m") == [m]


def test_drain_waits_for_requests_in_flight_then_removes() -> None:
    ms, rec, _ = setup(drain_timeout_s=60)
    m, _ = ms.upsert(spec("a"), "admin")
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: True)
    ms.drain("a", remove=True, reason="test")
    assert m.state == "draining" and not m.routable
    inflight = {"a": 2}
    ms.tick(lambda m: inflight[m.name], lambda m: True)
    assert ms.get("a") is m  # still serving its streams
    inflight["a"] = 0
    ms.tick(lambda m: inflight[m.name], lambda m: True)
    assert ms.get("a") is None and m.state == "gone"
    assert rec.calls[-1] == ("left", "a", "http://a:8000")
    assert [t.change for t in ms.transitions] == ["joined", "ready", "draining", "removed"]
    assert ms.changes[("removed", "admin")] == 1


def test_a_drain_that_times_out_removes_the_backend_anyway() -> None:
    ms, _, clock = setup(drain_timeout_s=5)
    ms.upsert(spec("a"), "admin")
    ms.drain("a", remove=True)
    clock.now += 5
    ms.tick(lambda m: 3, lambda m: True)
    assert ms.get("a") is None and "timed out with 3 in flight" in ms.transitions[-1].reason


def test_drain_without_remove_keeps_it_and_a_put_readmits_it() -> None:
    ms, rec, _ = setup()
    m, _ = ms.upsert(spec("a"), "admin")
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: True)
    ms.drain("a", remove=False)
    ms.tick(lambda m: 0, lambda m: True)
    assert ms.get("a") is m and m.state == "draining" and m.reason == "drained"
    m2, created = ms.upsert(spec("a"), "admin")
    assert m2 is m and not created and m.state == "ready" and m.routable
    assert [c[0] for c in rec.calls] == ["joined"]  # never unsubscribed meanwhile


def test_new_endpoints_rejoin_other_changes_apply_in_place() -> None:
    ms, rec, _ = setup()
    m, _ = ms.upsert(spec("a"), "admin")
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: True)
    ms.upsert(spec("a", role="decode"), "admin")  # role: in place
    assert m.state == "ready" and m.spec.role == "decode" and len(rec.calls) == 1
    ms.upsert(spec("a", url="http://10.0.0.9:8000", role="decode"), "admin")  # new address: re-join
    assert rec.calls[1:] == [("left", "a", "http://a:8000"), ("joined", "a", "http://10.0.0.9:8000")]
    assert m.state == "joining" and not m.healthy and m.url == "http://10.0.0.9:8000"
    assert ms.transitions[-1].change == "replaced"


def test_reconcile_applies_one_origin_and_leaves_the_others() -> None:
    ms, _, _ = setup()
    ms.reconcile("config", [spec("a"), spec("b")])
    ms.upsert(spec("x"), "admin")
    ms.reconcile("config", [spec("b"), spec("c")], "reload")
    assert ms.get("a") is not None and ms.get("a").state == "draining"  # type: ignore[union-attr]
    assert {m.name: m.origin for m in ms.members.values()} == {
        "a": "config",
        "b": "config",
        "c": "config",
        "x": "admin",
    }
    # the file takes over a name it lists; discovery never takes a name another origin holds
    ms.reconcile("config", [spec("b"), spec("c"), spec("x")], "reload")
    assert ms.get("x").origin == "config"  # type: ignore[union-attr]
    ms.reconcile("kubernetes", [spec("c", url="http://pod:1"), spec("pod-1")])
    assert ms.get("c").url == "http://c:8000" and ms.get("pod-1").origin == "kubernetes"  # type: ignore[union-attr]
    ms.reconcile("kubernetes", [])
    assert ms.get("pod-1").state == "draining" and ms.get("c").state != "draining"  # type: ignore[union-attr]


def test_counts_and_lora_and_models() -> None:
    ms, _, _ = setup()
    a, _ = ms.upsert(spec("a"), "config")
    b, _ = ms.upsert(BackendConfig(name="b", url="http://b:1"), "config")
    b.models = {"m", "sql-lora"}
    b.lora_parents = {"sql-lora": "m"}
    assert ms.counts() == {"joining": 2, "ready": 0, "draining": 0, "gone": 0}
    assert ms.lora_name("sql-lora") == "sql-lora" and ms.lora_name("m") is None
    assert [x.name for x in ms.models()["m"]] == ["a", "b"]
    assert a.describe(inflight=3)["inflight"] == 3
    assert BackendConfig(name="k", url="http://k:1", api_key="s").api_key == "s"
    k, _ = ms.upsert(BackendConfig(name="k", url="http://k:1", api_key="secret"), "admin")
    assert k.describe()["api_key"] == "***"  # never shown


def test_sighup_restores_what_the_admin_api_deleted_even_when_the_file_did_not_change(
    tmp_path: Path,
) -> None:
    """An operator's reload of an unchanged file restores the backends it lists that the fleet
    lacks; it used to be skipped as "unchanged", so a backend the file lists stayed deleted until
    someone edited the file. It readmits nothing else (a backend drained for maintenance stays
    drained), and a reload the file watch starts applies only a change."""
    from router.config import load_config
    from router.fleet.sources.configfile import ConfigWatcher

    path = tmp_path / "fleet.toml"
    path.write_text(
        '[[backends]]\nname = "a"\nurl = "http://a:8000"\nmodels = ["m"]\n'
        '[[backends]]\nname = "b"\nurl = "http://b:8000"\nmodels = ["m"]\n'
    )
    ms, _, _ = setup()
    cfg = load_config(path)
    ms.reconcile("config", cfg.backends)

    watcher = ConfigWatcher(
        path,
        cfg,
        lambda new: ms.reconcile("config", new.backends, "reloaded"),
        restore=lambda new: len(ms.restore(new.backends, "config", "restored")),  # (as KVRouter does)
    )

    def before() -> None:
        ms.drain("a", remove=True, reason="DELETE /admin/backends/a")
        ms.drain("b", remove=False, reason="POST /admin/backends/b/drain")  # maintenance
        ms.tick(lambda m: 0, lambda m: True)
        assert sorted(ms.members) == ["b"]
        watcher.request()  # what SIGHUP does

    asyncio.run(_until_applied(watcher, before))
    assert sorted(ms.members) == ["a", "b"]
    b = ms.get("b")
    assert b is not None and b.state == "draining"  # the drain for maintenance holds
    assert watcher.reload() is False and watcher.results["unchanged"] == 1  # (the watch's kind)
    assert watcher.reload(asked=True) is False and watcher.results["unchanged"] == 2  # nothing missing


async def _until_applied(watcher: Any, before: Callable[[], None]) -> None:
    """Start ``watcher``, run ``before``, wait until it applied a reload, stop it."""
    watcher.start()
    try:
        before()
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        while watcher.results["applied"] == 0:
            assert asyncio.get_running_loop().time() < deadline, watcher.results
            await asyncio.sleep(0.01)
    finally:
        await watcher.stop()


def test_a_file_change_while_the_router_starts_is_applied(tmp_path: Path) -> None:
    """``kvrouter serve`` reads the config file once and hands that read to the watcher with the
    file's stamp from before the read. A change landing after the read is applied by the watch; the
    watcher used to read the file again itself, took the changed file for what the router ran, and
    never applied it (the same when its own read came before its stamp)."""
    import os

    from router.fleet.sources.configfile import ConfigWatcher, read_config_file

    path = tmp_path / "fleet.toml"
    path.write_text('[[backends]]\nname = "a"\nurl = "http://a:8000"\nmodels = ["m"]\n')
    loaded = read_config_file(path)
    ms, _, _ = setup()
    ms.reconcile("config", loaded[0].backends)
    new = tmp_path / "fleet.new"  # a new file put in place, as a ConfigMap update does (a new inode)
    new.write_text('[[backends]]\nname = "b"\nurl = "http://b:8000"\nmodels = ["m"]\n')
    os.replace(new, path)

    def apply(cfg: Any) -> None:
        ms.reconcile("config", cfg.backends, "reloaded")

    watcher = ConfigWatcher(path, loaded[0], apply, interval_s=0.01, loaded=loaded)

    asyncio.run(_until_applied(watcher, lambda: None))
    assert sorted(ms.members) == ["a", "b"] and ms.get("a").state == "draining"  # type: ignore[union-attr]


def test_a_worker_starts_its_watcher_from_the_read_it_was_built_from(tmp_path: Path) -> None:
    """With ``server.workers > 1`` each worker reads the file as it is now; its watcher starts from
    that read (and its stamp), so a change landing before the watcher exists is still applied (the
    watcher used to read the file again and take the change for what the worker ran)."""
    import os

    from router.config import load_config
    from router.fleet.sources.configfile import ConfigWatcher, file_stamp
    from router.workers.supervisor import _with_current_file

    path = tmp_path / "fleet.toml"
    path.write_text('api_keys = ["old"]\n[[backends]]\nname = "a"\nurl = "http://a:8000"\n')
    config, loaded = _with_current_file(load_config(path), str(path))
    assert loaded is not None and loaded[0].api_keys == config.api_keys == ["old"]
    new = tmp_path / "fleet.new"
    new.write_text('api_keys = ["new"]\n[[backends]]\nname = "b"\nurl = "http://b:8000"\n')
    os.replace(new, path)
    watcher = ConfigWatcher(path, config, lambda cfg: None, loaded=loaded)
    assert watcher.current.api_keys == ["old"] and file_stamp(path) != watcher._stamp
    assert watcher.reload() is True and watcher.current.api_keys == ["new"]
    assert _with_current_file(config, None) == (config, None)


def test_a_rejoin_for_new_event_endpoints_keeps_the_engines_running_requests() -> None:
    """Only the event endpoints change (same URL, same engine): its in-flight requests used to be
    forgotten with the old spec, so the policy saw it idle and piled requests on it, and a drain
    right after ended at once with ten streams still running there."""
    from index.kvindex import KVIndex
    from router.config import HealthConfig
    from router.fleet.load import LoadTracker
    from router.fleet.runtime import FleetRuntime
    from router.net.upstream import UpstreamPool

    async def scenario() -> None:
        index, loads = KVIndex(), LoadTracker()
        fleet = FleetRuntime(index, loads, UpstreamPool(1, 1, 4, 4), HealthConfig(), MembershipConfig())
        try:
            ms = fleet.membership
            m, _ = ms.upsert(spec("a", kv_events="tcp://127.0.0.1:5557"), "admin")
            m.healthy = True
            fleet.tick()
            tickets = [loads.start(("a", 0), 100) for _ in range(10)]
            ms.upsert(spec("a", kv_events="tcp://127.0.0.1:6557"), "admin")  # the event port fixed
            assert m.state == "joining" and loads.get(("a", 0)).active == 10 and fleet.inflight(m) == 10
            ms.drain("a", remove=True)
            fleet.tick()
            assert ms.get("a") is not None  # still running its ten streams
            for t in tickets:
                loads.finish(t)
            fleet.tick()
            assert ms.get("a") is None
            ms.upsert(spec("b", url="http://b:8000"), "admin")
            ms.upsert(spec("b", url="http://b2:8000"), "admin")  # another engine: a fresh record
            assert loads.get(("b", 0)).active == 0
        finally:
            await fleet.stop()
            index.stop()

    asyncio.run(scenario())


def test_routable_for_is_routable_and_serves_over_every_member_state() -> None:
    """``routable_for`` inlines ``Member.routable`` and ``Member.serves`` (every decision asks): it
    must keep answering as they do, whatever the states, flags and models."""
    import random

    rng = random.Random(5)
    ms, _, _ = setup()
    for i in range(40):
        ms.upsert(spec(f"b{i}"), "config")
    models = ["m", "lora-a", "other"]
    for _ in range(300):
        for m in ms.members.values():
            m.state = rng.choice(["joining", "ready", "draining", "gone"])
            m.healthy = rng.random() < 0.7
            m.discovery_ready = rng.random() < 0.8
            m.models = set(rng.sample(models, rng.randrange(len(models) + 1)))
        for model in models:
            want = [m for m in ms.members.values() if m.routable and m.serves(model)]
            assert ms.routable_for(model) == want
            assert ms.can_serve(model) == bool(want)


class _Worker:
    """One worker's membership and admin API over the shared journal (router.app wires the same)."""

    def __init__(self, journal: Path, me: str, file: list[BackendConfig]) -> None:
        from router.fleet.load import LoadTracker
        from router.fleet.sources.admin import AdminApi, AdminJournal

        self.file = file
        self.ms, _, _ = setup()
        self.ms.reconcile("config", file)  # a (re)started worker: the config file as it is now
        self.api = AdminApi(self.ms, LoadTracker(), 2, AdminJournal(journal, me), lambda: self.file)
        self.api.sync()  # its first tick: the journal replayed

    def reload(self, file: list[BackendConfig]) -> None:
        """A changed file applied (what KVRouter._apply_config does; the file's version in the
        record: every worker reading one version records the same)."""
        self.file = file
        self.ms.reconcile("config", file, "config file reloaded")
        self.api.reloaded(repr([b.name for b in file]))

    def restore(self) -> list[str]:
        """An operator's reload of the unchanged file (what KVRouter._restore_config_backends does)."""
        back = self.ms.restore(self.file, "config")
        if back:
            self.api.restored(back)
        return back

    def states(self) -> dict[str, str]:
        return {n: m.state for n, m in self.ms.members.items()}


def test_a_restarted_workers_replay_keeps_what_later_reloads_did(tmp_path: Path) -> None:
    """The admin journal recorded admin changes but not config reloads, so a restarted worker's
    replay re-applied an admin drain that a later reload of a changed file had readmitted: that
    worker alone kept the backend out. Reloads are journaled now and replayed in their place."""
    journal = tmp_path / "admin.journal"
    first = [spec("a"), spec("b")]
    w1, w2 = _Worker(journal, "0:1", first), _Worker(journal, "1:2", first)
    w1.api.drain("a")  # POST /admin/backends/a/drain on worker 0
    w2.api.sync()
    assert w1.states()["a"] == w2.states()["a"] == "draining"
    changed = [spec("a"), spec("b"), spec("c")]  # the file changed: applied whole, a readmitted
    w1.reload(changed)
    w2.reload(changed)
    w2.api.sync()  # (a running worker skips the others' reload records: it reloaded itself)
    assert w1.states() == w2.states() and w1.states()["a"] != "draining"
    w1.api.drain("b")  # a drain after the reload holds
    w2.api.sync()
    w2 = _Worker(journal, "1:3", changed)  # worker 1 restarts
    assert w2.states() == w1.states()
    assert w2.states()["a"] != "draining" and w2.states()["b"] == "draining"


def test_a_replayed_restore_brings_back_what_a_delete_removed(tmp_path: Path) -> None:
    """An operator's reload of an unchanged file restores a backend an admin DELETE removed (and
    leaves a drained one drained): a worker started after it replays both in order."""
    journal = tmp_path / "admin.journal"
    file = [spec("a"), spec("b")]
    w1 = _Worker(journal, "0:1", file)
    w1.api.delete("a")
    w1.api.drain("b")
    w1.ms.tick(lambda m: 0, lambda m: True)
    assert sorted(w1.ms.members) == ["b"]
    assert w1.restore() == ["a"]
    w2 = _Worker(journal, "1:2", file)
    w2.ms.tick(lambda m: 0, lambda m: True)
    assert sorted(w2.ms.members) == ["a", "b"] and w2.states()["b"] == "draining"


def test_a_reload_recorded_by_every_worker_is_replayed_where_it_first_stands(tmp_path: Path) -> None:
    """Every worker records the reloads it applies. Worker 0 reloaded a changed file, then drained a
    backend; worker 1 reloaded the same version before its next tick synced that drain: both
    applied reload, then drain. Replayed record by record, the second reload readmitted the
    backend in a restarted worker (found in review); one version's reload is replayed once."""
    journal = tmp_path / "admin.journal"
    first = [spec("a"), spec("b")]
    w0, w1 = _Worker(journal, "0:1", first), _Worker(journal, "1:2", first)
    changed = [spec("a"), spec("b"), spec("c")]
    w0.reload(changed)
    w0.api.drain("a")
    w1.reload(changed)
    w1.api.sync()
    assert w0.states()["a"] == w1.states()["a"] == "draining"
    w1 = _Worker(journal, "1:3", changed)
    assert w1.states() == w0.states()


def test_a_replayed_restore_leaves_a_name_a_discovered_pod_took(tmp_path: Path) -> None:
    """A file-listed backend DELETE'd, its name then taken by a discovered pod; a later reload of
    the unchanged file restored another backend only. A restarted worker's replay restored both
    (its discovery not started yet), and its discovery then skipped the pod for good as a taken
    name (found in review): a replayed restore brings back the names it brought back then."""
    journal = tmp_path / "admin.journal"
    file = [spec("x"), spec("y")]
    w0 = _Worker(journal, "0:1", file)
    w0.api.delete("x")
    w0.ms.tick(lambda m: 0, lambda m: True)
    pod = spec("x", url="http://10.0.0.7:8000")
    w0.ms.reconcile("kubernetes", [pod])  # discovery: a pod named x
    w0.api.delete("y")
    w0.ms.tick(lambda m: 0, lambda m: True)
    assert w0.restore() == ["y"]  # the pod keeps x
    w1 = _Worker(journal, "1:2", file)
    w1.ms.tick(lambda m: 0, lambda m: True)  # (the first tick: the replay, then the removals)
    w1.ms.reconcile("kubernetes", [pod])  # its discovery starts
    assert {n: (m.origin, m.spec.url) for n, m in w1.ms.members.items()} == {
        n: (m.origin, m.spec.url) for n, m in w0.ms.members.items()
    }


def test_a_reloads_version_names_the_bytes_it_read(tmp_path: Path, monkeypatch: Any) -> None:
    """The journal names a reload by the version of the file it read. The stamp was taken before the
    read only, so a write landing between the two named new bytes with the old stamp, and workers
    that read the same bytes recorded two versions (found in review). The read is stamped again
    and retried when the file changed under it; the version also carries a digest of what was
    read (a missing stamp no longer names every version alike)."""
    import router.fleet.sources.configfile as configfile

    path = tmp_path / "fleet.toml"
    body = '[[backends]]\nname = "{}"\nurl = "http://{}:8000"\nmodels = ["m"]\n'
    path.write_text(body.format("a", "a"))
    first = configfile.read_config_file(path)
    applied: list[Any] = []
    watcher = configfile.ConfigWatcher(path, first[0], applied.append, loaded=first)
    real = configfile._file_config
    writes = [body.format("b", "b") + "# a longer file\n"]

    def read_then_written(p: Any) -> Any:
        cfg = real(p)
        if writes:  # another write lands right after this read
            path.write_text(writes.pop())
        return cfg

    monkeypatch.setattr(configfile, "_file_config", read_then_written)
    assert watcher.reload() is True
    assert [b.name for b in applied[-1].backends] == ["b"]  # the bytes as they stand
    assert watcher.version.startswith(f"{configfile.file_stamp(path)}:")
    other = configfile.ConfigWatcher(path, first[0], applied.append, loaded=first)
    monkeypatch.setattr(configfile, "_file_config", real)
    assert other.reload() is True and other.version == watcher.version  # one version, one name
    monkeypatch.setattr(configfile, "file_stamp", lambda p: None)  # no stamps: the digests differ
    versions = []
    for name in ("c", "d"):
        path.write_text(body.format(name, name))
        assert other.reload() is True
        versions.append(other.version)
    assert versions[0].startswith("None:") and versions[0] != versions[1]


def test_journal_lines_of_the_previous_version_replay_as_they_meant(tmp_path: Path) -> None:
    """A worker respawned after an upgrade in place reads the journal the old version wrote: reload
    records without a version (each one replayed) and restore records without names (restore
    whatever the file lists)."""
    journal = tmp_path / "admin.journal"
    journal.write_text(
        '{"op":"reload","name":"","origin":"0:1"}\n'
        '{"op":"drain","name":"a","origin":"0:1"}\n'
        '{"op":"reload","name":"","origin":"0:1"}\n'
        '{"op":"delete","name":"b","origin":"0:1"}\n'
        '{"op":"restore","name":"","origin":"0:1"}\n'
    )
    w = _Worker(journal, "1:2", [spec("a"), spec("b")])
    w.ms.tick(lambda m: 0, lambda m: True)
    assert sorted(w.ms.members) == ["a", "b"] and w.states()["a"] != "draining"


def test_the_log_shows_moves_as_moves_and_never_a_state_to_itself(caplog: pytest.LogCaptureFixture) -> None:
    """Every change was logged as "<change> -> <state>": "ready -> ready" for a backend becoming
    ready, "draining -> draining" for one starting to drain, which read as nothing happening."""
    ms, _, clock = setup(join_timeout_s=10, drain_timeout_s=5)
    with caplog.at_level(logging.INFO, logger="kvrouter.membership"):
        m, _ = ms.upsert(spec("a"), "admin")
        m.healthy = True
        ms.tick(lambda m: 0, lambda m: True)
        ms.upsert(spec("a", role="prefill"), "admin")  # models, api_key or role: in place
        ms.drain("a", remove=False, reason="operator")
        ms.tick(lambda m: 0, lambda m: True)  # nothing in flight: drained, kept
        ms.upsert(spec("a", role="prefill"), "admin")  # named again: readmitted
        ms.drain("a", remove=True)
        clock.now += 6
        ms.tick(lambda m: 1, lambda m: True)  # the drain timed out: removed
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "backend a (admin) joined (added by admin)",
        "backend a (admin): joining -> ready (healthy, index bootstrapped)",
        "backend a (admin) updated, still ready (models, api_key or role changed)",
        "backend a (admin): ready -> draining (operator)",
        "backend a (admin) drained, still draining (no request in flight)",
        "backend a (admin): draining -> ready, readmitted (named again by admin)",
        "backend a (admin): ready -> draining (remove)",
        "backend a (admin): draining -> gone, removed (drain timed out with 1 in flight)",
    ], lines
