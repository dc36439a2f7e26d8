"""Several router processes on one port: shared load, merged metrics, restarts, clean stop."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import pytest
import zmq
from harness import FakeEngine, wait_for

from router.fleet.load import BoardView, LoadBoard, LoadTracker
from router.observe.exposition import GaugeFamily, Registry
from router.observe.metrics import LeanCounter, LeanHistogram
from router.workers.stats import (
    Snapshot,
    SnapshotWriter,
    families_of,
    merge_dashboard,
    read_snapshots,
    render_merged,
)

ROOT = Path(__file__).resolve().parents[3]
BS = 16


# --- the load board ---------------------------------------------------------------------------------


def _tracker(path: str, worker: int, targets: list[tuple[str, int]]) -> LoadTracker:
    t = LoadTracker([BoardView(LoadBoard(path, 2), worker)])
    for target in targets:
        t.track(target)
    return t


def test_load_board_sums_the_other_workers(tmp_path: Path) -> None:
    targets = [("a", 0), ("a", 1), ("b", 0)]
    path = str(tmp_path / "board")
    w0 = _tracker(path, 0, targets)
    w1 = _tracker(path, 1, targets)
    t = w0.start(("a", 1), uncached_tokens=64)
    seen = w1.get(("a", 1))
    assert (seen.active, seen.prefilling, seen.pending_prefill_tokens) == (1, 1, 64)
    assert w1.get(("a", 0)).active == 0 and w1.get(("b", 0)).active == 0
    t1 = w1.start(("a", 1), uncached_tokens=16)
    both = w0.get(("a", 1))
    assert (both.active, both.pending_prefill_tokens) == (2, 80)
    w0.first_byte(t)
    assert w1.get(("a", 1)).pending_prefill_tokens == 16 and w1.get(("a", 1)).active == 2
    w0.finish(t)
    w1.finish(t1)
    assert w0.get(("a", 1)).active == 0 and w1.get(("a", 1)).active == 0
    # every fleet target is listed (the inflight gauge), with the other worker's load in it
    t2 = w1.start(("b", 0), 0)
    assert {k: v.active for k, v in w0.all().items()} == {("a", 0): 0, ("a", 1): 0, ("b", 0): 1}
    w1.finish(t2)


def test_a_restarted_worker_does_not_inherit_its_predecessors_load(tmp_path: Path) -> None:
    targets = [("a", 0)]
    path = str(tmp_path / "board")
    w0 = _tracker(path, 0, targets)
    dead = _tracker(path, 1, targets)
    dead.start(("a", 0), 100)  # never finished: the process died
    assert w0.get(("a", 0)).active == 1
    _tracker(path, 1, targets)  # its replacement
    assert w0.get(("a", 0)).active == 0


def test_board_targets_come_and_go_and_slots_are_reused(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    board0, board1 = LoadBoard(path, 2, capacity=4), LoadBoard(path, 2, capacity=4)
    w0 = LoadTracker([BoardView(board0, 0)])
    w1 = LoadTracker([BoardView(board1, 1)])
    for i in range(40):  # ten times the capacity: pods that come and go
        target = (f"pod-{i}", 0)
        w0.track(target)
        w1.track(target)
        ticket = w0.start(target, 8)
        assert w1.get(target).active == 1  # shared while both hold it
        w0.forget(target)  # worker 0 removed it: its row is withdrawn at once
        assert w1.get(target).active == 0
        w0.finish(ticket)  # the request ends after the target left: nothing is published
        w1.forget(target)
        assert board0.used() == 0
    # a target one worker still holds keeps its slot; the board being full is not an error
    for i in range(5):
        w1.track((f"x-{i}", 0))
    assert board0.used() == 4
    w0.track(("x-4", 0))  # no slot: tracked locally, its load not shared
    w0.start(("x-4", 0), 1)
    assert w1.get(("x-4", 0)).active == 0
    board0.close()
    board1.close()


# --- merged figures ---------------------------------------------------------------------------------


def _snapshot(worker: int, requests: float, lag: float, recent_time: float) -> Snapshot:
    reg = Registry()
    req = LeanCounter("kvrouter_requests", "Requests", ["backend", "model", "status"])
    req.inc(("a", "toy", "2xx"), requests)
    ttft = LeanHistogram("kvrouter_ttft_seconds", "TTFT", ["backend"], (0.1, 1.0))
    ttft.observe(("a",), 0.05 * (worker + 1))

    class _C:
        def collect(self) -> Any:
            yield req.family()
            yield ttft.family()
            blocks = GaugeFamily("kvrouter_index_blocks", "Indexed blocks", ["source"])
            blocks.add_metric(["a/0"], lag)
            yield blocks

    reg.register(_C())
    dash = {
        "totals": {"requests": int(requests), "errors": worker},
        "backends": [
            {
                "name": "a",
                "requests": int(requests),
                "errors": 0,
                "prompt_tokens": 10,
                "matched_tokens": 5,
                "ranks": [{"dp_rank": 0, "inflight": 9, "requests": int(requests)}],
            }
        ],
        "sources": [{"source": "a/0", "batches": 100 + worker}],
        "uptime_s": 50.0 - worker,
        "recent_decisions": [{"time": recent_time, "backend": "a", "worker": worker}],
    }
    return Snapshot(worker, 1000 + worker, time.time(), families_of(reg), dash)


def test_request_series_are_summed_and_state_comes_from_the_first_worker() -> None:
    text = render_merged([_snapshot(0, 3, 111, 1.0), _snapshot(1, 4, 222, 2.0)]).decode()
    assert 'kvrouter_requests_total{backend="a",model="toy",status="2xx"} 7.0' in text
    assert 'kvrouter_ttft_seconds_count{backend="a"} 2.0' in text
    assert 'kvrouter_ttft_seconds_bucket{backend="a",le="0.1"} 2.0' in text
    assert 'kvrouter_index_blocks{source="a/0"} 111.0' in text  # not 333: every worker indexes the same
    assert text.count('kvrouter_worker_snapshot_age_seconds{worker="') == 2


def test_every_workers_counters_and_gauges_merge_by_their_kind(tmp_path: Path) -> None:
    """Retries, ejections and prediction checks came from worker 0 only (worker 1's 40 refused
    retries showed as 0); gauges were summed and, once a worker died, kept for good (pins 10000 ->
    15000 after one restart)."""
    from router.workers.stats import Family, retire

    def snap(worker: int, refused: float, ejected: float, pins: float) -> Snapshot:
        fams = [
            Family(
                "kvrouter_retries",
                "counter",
                "",
                [("kvrouter_retries_total", {"result": "refused"}, refused)],
            ),
            Family(
                "kvrouter_backend_ejected",
                "gauge",
                "",
                [("kvrouter_backend_ejected", {"backend": "e1"}, ejected)],
            ),
            Family("kvrouter_session_pins", "gauge", "", [("kvrouter_session_pins", {}, pins)]),
        ]
        return Snapshot(worker, 2000 + worker, time.time(), fams, {"totals": {}, "backends": []})

    run_dir = str(tmp_path)
    for s_ in (snap(0, 0, 0, 5000), snap(1, 40, 1, 5000)):
        SnapshotWriter(run_dir, s_.worker).path.write_bytes(msgspec.msgpack.encode(s_))
    text = render_merged(read_snapshots(run_dir)).decode()
    assert 'kvrouter_retries_total{result="refused"} 40.0' in text
    assert 'kvrouter_backend_ejected{backend="e1"} 1.0' in text
    assert "kvrouter_session_pins 10000.0" in text
    retire(run_dir, 1)  # worker 1 died; its replacement starts with nothing yet
    SnapshotWriter(run_dir, 1).path.write_bytes(msgspec.msgpack.encode(snap(1, 0, 0, 0)))
    text = render_merged(read_snapshots(run_dir)).decode()
    assert 'kvrouter_retries_total{result="refused"} 40.0' in text  # a counter keeps what it counted
    assert 'kvrouter_backend_ejected{backend="e1"} 0.0' in text and "kvrouter_session_pins 5000.0" in text


def test_dashboard_counters_are_summed_and_decisions_interleaved() -> None:
    live = {
        "totals": {"requests": 99, "errors": 99},
        "backends": [{"name": "a", "healthy": True, "requests": 99, "inflight": 2}],
        "recent_decisions": [],
    }
    live["backends"][0]["ranks"] = [{"dp_rank": 0, "inflight": 2, "requests": 99}]
    live["sources"] = [{"source": "a/0", "batches": 999}]
    live["uptime_s"] = 1.0
    out = merge_dashboard(live, [_snapshot(0, 3, 0, 5.0), _snapshot(1, 4, 0, 2.0)])
    assert out["totals"] == {"requests": 7, "errors": 1}
    assert out["backends"][0]["requests"] == 7 and out["backends"][0]["inflight"] == 2
    assert out["backends"][0]["ranks"] == [{"dp_rank": 0, "inflight": 2, "requests": 7}]
    assert out["sources"] == [{"source": "a/0", "batches": 100}]  # worker 0's, whoever answers
    assert out["uptime_s"] == 50.0
    assert [d["worker"] for d in out["recent_decisions"]] == [1, 0]
    assert out["workers"] == 2


def test_a_dead_workers_figures_are_retired_and_its_load_cleared(tmp_path: Path) -> None:
    from router.config import parse_config
    from router.workers import supervisor as workers

    cfg = parse_config({"server": {"workers": 2}, "backends": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    run_dir = str(tmp_path)
    board_of = workers.WorkerContext(0, 2, run_dir).board
    w0 = LoadTracker([BoardView(board_of(), 0)])
    w1 = LoadTracker([BoardView(board_of(), 1)])
    w0.track(("a", 0))
    w1.track(("a", 0))
    w1.start(("a", 0), 32)  # in flight when worker 1 dies
    for snap in (_snapshot(0, 3, 0, 1.0), _snapshot(1, 4, 0, 2.0)):
        SnapshotWriter(run_dir, snap.worker).path.write_bytes(msgspec.msgpack.encode(snap))

    def requests() -> str:
        text = render_merged(read_snapshots(run_dir)).decode()
        m = re.search(r"^kvrouter_requests_total\{[^}]*\} (\S+)$", text, re.M)
        assert m, text
        return m.group(1)

    assert requests() == "7.0" and w0.get(("a", 0)).active == 1
    sup = workers.Supervisor(cfg)
    sup._retire(1, run_dir)
    assert w0.get(("a", 0)).active == 0  # cleared at once, not when a replacement starts
    assert requests() == "7.0"  # the dead worker's 4 are kept
    sup._retire(1, run_dir)  # twice for one pid: counted once
    assert requests() == "7.0"
    # its replacement publishes from zero under a new pid: the sum carries on
    fresh = _snapshot(1, 2, 0, 3.0)
    fresh.pid = 4242
    SnapshotWriter(run_dir, 1).path.write_bytes(msgspec.msgpack.encode(fresh))
    assert requests() == "9.0"
    assert merge_dashboard({"totals": {}, "backends": []}, read_snapshots(run_dir))["totals"]["requests"] == 9


# --- the real thing: `kvrouter serve --workers 2` ------------------------------------------------------


def _serve_once(cfg: Path) -> subprocess.CompletedProcess[str]:
    """`kvrouter serve` expected to stop at start-up (its exit code and output)."""
    return subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_supervisor(cfg: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """``kvrouter serve`` with several workers, its output in tmp_path/router.log."""
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def _stop_supervisor(proc: subprocess.Popen[bytes], log: IO[bytes]) -> int:
    """SIGTERM, then its exit code (the whole group killed if it does not stop in 60 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    finally:
        log.close()


def _fresh(method: str, url: str, **kw: Any) -> httpx.Response:
    """One request on its own connection, so that the kernel picks a worker for it."""
    with httpx.Client(timeout=30) as c:
        return c.request(method, url, **kw)


def _workers_seen(url: str, tries: int) -> dict[int, int]:
    """worker index -> pid of the workers that answered ``tries`` fresh connections. A connection
    refused or reset (a worker dying with connections in its accept queue) just counts for nobody."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        try:
            h = _fresh("GET", f"{url}/health").json()
        except httpx.TransportError:
            continue
        seen[h["worker"]] = h["pid"]
    return seen


@pytest.fixture
def engine(ctx: zmq.Context[Any]) -> Any:
    e = FakeEngine("alpha", ctx)
    yield e
    e.close()


def test_two_workers_share_the_port_the_load_and_the_figures(engine: FakeEngine, tmp_path: Path) -> None:
    port = _free_port()
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(
        f'block_size = {BS}\n[server]\nport = {port}\nworkers = 2\nlog_level = "warning"\n'
        "drain_timeout_s = 5\n"
        f'[[backends]]\nname = "alpha"\nurl = "{engine.url}"\nkv_events = "{engine.kv_events}"\n'
        f'kv_replay = "{engine.kv_replay}"\nmodels = ["toy"]\n'
    )
    proc, log = _start_supervisor(cfg, tmp_path)
    url = f"http://127.0.0.1:{port}"
    stalled: list[httpx.Response] = []
    try:

        def ready() -> bool:
            try:
                return _fresh("GET", f"{url}/ready").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, "router ready", timeout=180)  # a first start may compile the index kernels
        # a second router on the same port is refused, not silently given half the connections
        second = _serve_once(cfg)
        assert second.returncode == 1 and "cannot serve" in second.stderr, second.stderr
        # both processes answer on the one port
        wait_for(lambda: len(_workers_seen(url, 8)) == 2, "both workers answering", timeout=60)

        # each worker subscribes to the engine itself: both index what it announces
        tokens = list(range(1, 8 * BS + 1))
        wait_for(
            lambda: (
                engine.announce(tokens, BS) > 0
                and all(_fresh("GET", f"{url}/debug/index").json()["residencies"] >= 8 for _ in range(6))
            ),
            "both workers indexing the engine's blocks",
        )

        # a request in flight on one worker is load every worker sees
        engine.mode = "stall"
        body = {"model": "toy", "prompt": tokens, "max_tokens": 1}
        uncached = {"model": "toy", "prompt": list(range(1000, 1000 + 4 * BS)), "max_tokens": 1}
        t = threading.Thread(
            target=lambda: stalled.append(_fresh("POST", f"{url}/v1/completions", json=uncached))
        )
        t.start()
        wait_for(lambda: len(engine.requests) == 1, "the stalled request reaching the engine")
        for _ in range(10):
            cand = _fresh("POST", f"{url}/route", json=body).json()["candidates"][0]
            # its 4 uncached blocks are prefill every worker's score waits behind
            assert cand["inflight"] == 1 and cand["queued_blocks"] == 4, cand
        engine.mode = "ok"
        t.join(30)
        assert stalled and stalled[0].status_code == 200

        # requests handled by both workers add up in one /metrics
        for _ in range(20):
            assert _fresh("POST", f"{url}/v1/completions", json=body).status_code == 200
        pattern = re.compile(
            r'^kvrouter_requests_total\{backend="alpha",model="toy",status="2xx"\} (\S+)$', re.M
        )

        def total() -> float:
            m = pattern.search(_fresh("GET", f"{url}/metrics").text)
            return float(m.group(1)) if m else -1.0

        wait_for(lambda: total() == 21.0, "/metrics summing both workers")
        data = _fresh("GET", f"{url}/dashboard/data").json()
        assert data["workers"] == 2 and data["totals"]["requests"] == 21

        # a worker that dies is replaced, and the sums carry on (Prometheus would read a drop as a
        # reset of every series)
        pids = _workers_seen(url, 16)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: _workers_seen(url, 8).get(1, pids[1]) != pids[1], "worker 1 restarted", timeout=180)
        for _ in range(10):
            assert _fresh("POST", f"{url}/v1/completions", json=body).status_code == 200
        wait_for(lambda: total() == 31.0, "/metrics carrying on after the restart")
    finally:
        engine.mode = "ok"
        code = _stop_supervisor(proc, log)
    assert code == 0, (tmp_path / "router.log").read_text()[-3000:]
    with pytest.raises(httpx.ConnectError):
        _fresh("GET", f"{url}/health")


def test_a_restarted_worker_serves_the_config_as_reloaded_and_sighup_never_kills_a_starting_one(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """A worker restarted after a reload started from the config the supervisor first read: a
    revoked key worked again there. And a SIGHUP while a worker was still importing killed it (the
    default action), counted as a quick death. An admin drain that the reload of a changed file
    readmitted was drained again by the restarted worker's journal replay (reloads were not in
    the journal)."""
    port = _free_port()
    cfg = tmp_path / "fleet.toml"
    server = f'[server]\nport = {port}\nworkers = 2\nlog_level = "info"\n'
    backend = f'[[backends]]\nname = "alpha"\nurl = "{engine.url}"\nmodels = ["toy"]\n'
    admin = {"authorization": "Bearer adm"}
    cfg.write_text(f'block_size = {BS}\napi_keys = ["old-key"]\nadmin_keys = ["adm"]\n' + server + backend)
    proc, log = _start_supervisor(cfg, tmp_path)
    url = f"http://127.0.0.1:{port}"

    def statuses(key: str, n: int = 12) -> set[int]:
        out = set()
        for _ in range(n):
            try:
                out.add(
                    _fresh("GET", f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code
                )
            except httpx.TransportError:
                continue
        return out

    try:
        # (the supervisor's own handler is set before it starts workers; before, as for any daemon,
        # SIGHUP's default action applies)
        wait_for(lambda: b"worker 1 started" in (tmp_path / "router.log").read_bytes(), "workers spawned")
        deadline = time.monotonic() + 180
        while True:  # reload requests all through the workers' start
            proc.send_signal(signal.SIGHUP)
            try:
                if _fresh("GET", f"{url}/ready").status_code == 200 and len(_workers_seen(url, 8)) == 2:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "never ready"
            time.sleep(0.05)  # (the pace of the signals, not a wait for a condition)
        assert b"exited" not in (tmp_path / "router.log").read_bytes()  # no worker died of a SIGHUP

        def alpha_states() -> dict[int, str]:
            """worker index -> alpha's state there, from fresh connections."""
            out: dict[int, str] = {}
            for _ in range(12):
                try:
                    r = _fresh("GET", f"{url}/admin/backends", headers=admin).json()
                except httpx.TransportError:
                    continue
                out[int(r["worker"].split(":")[0])] = {b["name"]: b["state"] for b in r["backends"]}["alpha"]
            return out

        assert _fresh("POST", f"{url}/admin/backends/alpha/drain", headers=admin).status_code == 200
        wait_for(lambda: alpha_states() == {0: "draining", 1: "draining"}, "alpha drained in both workers")
        keys = 'api_keys = ["new-key"]\nadmin_keys = ["adm"]\n'
        cfg.write_text(f"block_size = {BS}\n" + keys + server + backend)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: statuses("old-key") == {401}, "the old key revoked by both workers")
        wait_for(lambda: alpha_states() == {0: "ready", 1: "ready"}, "alpha readmitted by the changed file")
        pids = _workers_seen(url, 16)
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: _workers_seen(url, 8).get(1, pids[1]) != pids[1], "worker 1 restarted", timeout=180)
        assert statuses("old-key", 16) == {401} and statuses("new-key", 16) == {200}
        wait_for(lambda: alpha_states() == {0: "ready", 1: "ready"}, "alpha ready in the restarted one too")
    finally:
        _stop_supervisor(proc, log)


def test_bind_mode_events_need_one_worker(tmp_path: Path) -> None:
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(
        '[server]\nworkers = 2\n[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
        'kv_events = "tcp://127.0.0.1:5557"\nkv_bind = true\n'
    )
    out = _serve_once(cfg)
    assert out.returncode == 2
    assert "backends[0].kv_bind" in out.stderr and "server.workers" in out.stderr


def test_a_broken_tokenizer_stops_start_up_before_any_worker(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("this is not a tokenizer")
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(
        f'tokenizer = "{broken}"\n[server]\nworkers = 2\n'
        '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    out = _serve_once(cfg)
    assert out.returncode == 2 and "cannot start" in out.stderr, out.stderr
    assert "worker" not in out.stderr


def test_the_supervisor_gives_up_on_workers_that_keep_dying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.config import parse_config
    from router.workers import supervisor as workers

    cfg = parse_config(
        {
            "server": {"port": _free_port(), "workers": 2, "drain_timeout_s": 1},
            "backends": [{"name": "a", "url": "http://127.0.0.1:9"}],
        }
    )
    # a worker whose entry point fails at once: sys.exit called with two arguments raises TypeError,
    # so the spawned process exits 1 right after starting
    monkeypatch.setattr(workers, "worker_main", sys.exit)
    monkeypatch.setattr(workers.Supervisor, "_pause", lambda self, seconds: None)
    sup = workers.Supervisor(cfg)
    assert sup.run() == 1
    assert all(not p.is_alive() for p in sup._procs.values())
