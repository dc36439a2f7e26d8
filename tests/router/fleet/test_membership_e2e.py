"""A fleet that changes under a running router: the admin API, config reloads, drains, workers.

Real things only: scriptable engines with real KV publishers and replay sockets (harness.FakeEngine),
the real router on `kvrouter serve`'s HTTP server, real HTTP clients; `kvrouter serve` processes for signals
and several workers.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import zmq
from harness import TIMEOUT, FakeEngine, RouterRunner, wait_for

BS = 4
ADMIN = "admin-secret"
CLIENT = "client-secret"
ROOT = Path(__file__).resolve().parents[3]


def ids(seed: int, n: int) -> list[int]:
    return [5 + (seed * 131 + i * 17) % 2000 for i in range(n)]


@pytest.fixture
def engines(ctx: zmq.Context[Any]) -> Iterator[dict[str, FakeEngine]]:
    made = {n: FakeEngine(n, ctx) for n in ("a", "b", "c")}
    yield made
    for e in made.values():
        e.close()


def spec(e: FakeEngine) -> dict[str, Any]:
    return {"url": e.url, "kv_events": e.kv_events, "kv_replay": e.kv_replay}


def start_router(tmp: Path, backends: list[FakeEngine], extra: str = "", **kw: Any) -> RouterRunner:
    toml = (
        f'block_size = {BS}\nadmin_keys = ["{ADMIN}"]\napi_keys = ["{CLIENT}"]\n'
        "[health]\ninterval_s = 5.0\n[membership]\nwatch_interval_s = 0.1\n" + extra + "\n"
    )
    toml += "\n".join(e.backend_toml() for e in backends)
    return RouterRunner(toml, tmp, **kw)


def admin(router: RouterRunner, method: str, path: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{router.url}{path}", headers=headers, timeout=TIMEOUT, **kw)


def post(router: RouterRunner, path: str, body: Any, key: str = CLIENT) -> httpx.Response:
    """A client request (the client's key by default)."""
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{router.url}{path}", json=body, headers=headers, timeout=TIMEOUT)


def routed_to(router: RouterRunner, prompt: Any) -> str:
    backend: str = post(router, "/route", {"model": "toy", "prompt": prompt}).json()["backend"]
    return backend


def members(router: RouterRunner) -> dict[str, dict[str, Any]]:
    r = admin(router, "GET", "/admin/backends")
    assert r.status_code == 200, r.text
    return {b["name"]: b for b in r.json()["backends"]}


class Traffic:
    """A steady stream of requests through the router from a thread; records who served each."""

    def __init__(self, router: RouterRunner) -> None:
        self.router = router
        self.served: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        headers = {"authorization": f"Bearer {CLIENT}"}
        with httpx.Client(timeout=TIMEOUT, headers=headers) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    r = client.post(
                        f"{self.router.url}/v1/completions", json={"model": "toy", "prompt": ids(i, 3 * BS)}
                    )
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                else:
                    self.served.append((time.monotonic(), r.headers["x-kvrouter-backend"]))
                self._stop.wait(0.01)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(TIMEOUT)

    def first(self, backend: str, after: float) -> float | None:
        return next((t for t, b in list(self.served) if b == backend and t >= after), None)


def test_the_admin_api_is_off_without_admin_keys_and_guarded_with_them(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    off = RouterRunner(
        f"block_size = {BS}\n" + engines["a"].backend_toml(), tmp_path
    )  # no admin_keys: the API does not exist
    try:
        assert admin(off, "GET", "/admin/backends").status_code == 404
    finally:
        off.stop()
    router = start_router(tmp_path, [engines["a"]])
    try:
        assert admin(router, "GET", "/admin/backends", key="").status_code == 401
        assert admin(router, "GET", "/admin/backends", key="wrong").status_code == 401
        r = admin(router, "GET", "/admin/backends", key=CLIENT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert list(members(router)) == ["a"] and members(router)["a"]["origin"] == "config"
        # the admin key is not a client key
        r = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "toy", "prompt": "x"},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 401
        # validated like the config file: 400 naming the field
        for body, field in (
            ({"url": "ftp://x"}, "url"),
            ({"url": "http://x:1", "dp_size": 0}, "dp_size"),
            ({"url": "http://x:1", "dp_size": "2"}, "dp_size"),
            ({"url": "http://x:1", "kv_events": "http://x"}, "kv_events"),
            ({"url": "http://x:1", "colour": "red"}, "colour"),
            ({"kv_events": "tcp://x:1"}, "url"),
            ({"url": "http://x:1", "name": "other"}, "name"),
            ({"url": "http://x:1", "role": "chef"}, "role"),
        ):
            r = admin(router, "PUT", "/admin/backends/new", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, (body, r.json())
        assert admin(router, "PUT", "/admin/backends/new", content=b"{nope").status_code == 400
        assert (
            admin(router, "PUT", "/admin/backends/bad%20name", json={"url": "http://x:1"}).status_code == 400
        )
        assert admin(router, "DELETE", "/admin/backends/nobody").status_code == 404
        assert admin(router, "POST", "/admin/backends/nobody/drain").status_code == 404
        assert list(members(router)) == ["a"]  # nothing half-applied
    finally:
        router.stop()


def test_a_backend_added_while_traffic_flows_takes_requests_at_once_with_its_cache_indexed(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    a, b = engines["a"], engines["b"]
    prompt = ids(999, 8 * BS)
    b.announce(prompt, BS)  # b's cache before the router knows b: only its replay buffer has it
    router = start_router(tmp_path, [a])
    try:
        with Traffic(router) as traffic:
            wait_for(lambda: len(traffic.served) > 5, "traffic")
            t0 = time.monotonic()
            r = admin(router, "PUT", "/admin/backends/b", json=spec(b))
            assert r.status_code == 201, r.text
            assert r.json()["state"] in ("joining", "ready") and r.json()["origin"] == "admin"
            wait_for(lambda: traffic.first("b", t0) is not None, "a request served by b")
            first = traffic.first("b", t0)
            assert first is not None and first - t0 < 1.0  # well within one health interval (5 s)
            route = httpx.post(
                f"{router.url}/route",
                json={"model": "toy", "prompt": prompt},
                headers={"authorization": f"Bearer {CLIENT}"},
            ).json()
            assert route["backend"] == "b" and route["matched_blocks"] == 8  # bootstrapped from replay
            time.sleep(0.2)  # keep sending a little while both serve
        assert traffic.errors == []
        assert members(router)["b"]["state"] == "ready"
        again = admin(router, "PUT", "/admin/backends/b", json=spec(b))
        assert again.status_code == 200  # the same spec again: unchanged, not a second join
        kinds = [
            t["change"] for t in router_debug(router)["membership"]["transitions"] if t["backend"] == "b"
        ]
        assert kinds == ["joined", "ready"]
    finally:
        router.stop()


def router_debug(router: RouterRunner) -> dict[str, Any]:
    r = httpx.get(f"{router.url}/debug/index", headers={"authorization": f"Bearer {CLIENT}"}, timeout=TIMEOUT)
    assert r.status_code == 200
    out: dict[str, Any] = r.json()
    return out


def metric(router: RouterRunner, name: str, labels: str = "") -> float:
    text = httpx.get(f"{router.url}/metrics", headers={"authorization": f"Bearer {CLIENT}"}).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_drained_backend_finishes_its_streams_takes_nothing_new_then_leaves(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    a, b = engines["a"], engines["b"]
    router = start_router(tmp_path, [a, b])
    auth = {"authorization": f"Bearer {CLIENT}"}
    prompt = ids(7, 6 * BS)
    b.announce(prompt, BS)
    wait_for(lambda: routed_to(router, prompt) == "b", "b holds the prefix")
    b.mode = "held_stream"
    chunks: list[bytes] = []
    done = threading.Event()

    def stream() -> None:
        body = {"model": "toy", "prompt": prompt, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=auth, timeout=60) as r:
            assert r.headers["x-kvrouter-backend"] == "b"
            for chunk in r.iter_raw():
                chunks.append(chunk)
        done.set()

    t = threading.Thread(target=stream, daemon=True)
    try:
        t.start()
        wait_for(lambda: len(chunks) >= 2, "the stream started")
        r = admin(router, "DELETE", "/admin/backends/b")
        assert r.status_code == 200 and r.json()["state"] == "draining" and r.json()["inflight"] == 1
        # no new request goes to b, even the one whose prefix b caches
        for _ in range(5):
            r2 = httpx.post(
                f"{router.url}/v1/completions", json={"model": "toy", "prompt": prompt}, headers=auth
            )
            assert r2.status_code == 200 and r2.headers["x-kvrouter-backend"] == "a"
        assert members(router)["b"]["state"] == "draining"  # still serving its stream
        b.release = True
        wait_for(done.is_set, "the stream to end", timeout=60)
        body = b"".join(chunks).decode()
        assert body.endswith("data: [DONE]\n\n") and body.count("data: ") == b.streamed + 1  # intact
        assert b.streamed > 2 and f" w{b.streamed}" in body
        wait_for(lambda: "b" not in members(router), "b removed")
        # unsubscribed and its entries freed by the subscriber thread (asynchronously, in slices)
        wait_for(lambda: [s["instance"] for s in router_debug(router)["sources"]] == ["a"], "b unsubscribed")
        debug = router_debug(router)
        assert [x["name"] for x in debug["backends"]] == ["a"]
        dash = httpx.get(f"{router.url}/dashboard/data", headers=auth).json()
        assert [x["name"] for x in dash["backends"]] == ["a"]
        assert metric(router, "kvrouter_inflight_requests", '{backend="b",dp_rank="0"}') == 0.0
        assert metric(router, "kvrouter_backends", '{state="ready"}') == 1.0
        assert (
            metric(router, "kvrouter_membership_changes_total", '{change="removed",origin="config"}') == 1.0
        )
        changes = [(x["backend"], x["change"]) for x in debug["membership"]["transitions"]]
        assert ("b", "draining") in changes and changes[-1] == ("b", "removed")
        # drain without removing, then readmit with a PUT
        assert admin(router, "POST", "/admin/backends/a/drain").json()["state"] == "draining"
        r3 = post(router, "/v1/completions", {"model": "toy", "prompt": "x"})
        assert r3.status_code == 503  # nobody to take it
        wait_for(lambda: members(router)["a"]["reason"] == "drained", "a drained")
        assert admin(router, "PUT", "/admin/backends/a", json=spec(a)).json()["state"] == "ready"
        r4 = post(router, "/v1/completions", {"model": "toy", "prompt": "x"})
        assert r4.status_code == 200
    finally:
        t.join(TIMEOUT)
        router.stop()


def test_the_config_file_is_reloaded_when_it_changes_and_a_bad_one_is_rejected(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    a, b, c = engines["a"], engines["b"], engines["c"]
    router = start_router(tmp_path, [a], config_file=True)
    head = router.path.read_text().split("[[backends]]")[0]

    def write(text: str) -> None:
        tmp = router.path.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, router.path)  # as a ConfigMap update does: a new inode

    try:
        write(head + a.backend_toml() + b.backend_toml())
        wait_for(lambda: members(router).get("b", {}).get("state") == "ready", "b joined from the file")
        assert members(router)["b"]["origin"] == "config"
        before = metric(router, "kvrouter_config_reloads_total", '{result="rejected"}')
        write(head + a.backend_toml() + b.backend_toml() + '[[backends]]\nname = "bad"\nurl = "nope"\n')
        wait_for(
            lambda: metric(router, "kvrouter_config_reloads_total", '{result="rejected"}') == before + 1,
            "the bad file rejected",
        )
        assert sorted(members(router)) == ["a", "b"]  # the running fleet is kept, nothing half-applied
        assert "backends[2].url" in router_debug(router)["membership"]["config_file"]["last_error"]
        write(head + "not toml [[[")
        wait_for(
            lambda: metric(router, "kvrouter_config_reloads_total", '{result="rejected"}') == before + 2,
            "the broken file rejected",
        )
        # an admin-added backend survives reloads; one the file drops is drained and removed
        assert admin(router, "PUT", "/admin/backends/c", json=spec(c)).status_code == 201
        write(head + a.backend_toml())
        wait_for(lambda: "b" not in members(router), "b removed by the reload")
        assert sorted(members(router)) == ["a", "c"]
        # client keys are reloaded too
        write(head.replace(CLIENT, "rotated") + a.backend_toml())
        wait_for(
            lambda: (
                httpx.get(f"{router.url}/v1/models", headers={"authorization": "Bearer rotated"}).status_code
                == 200
            ),
            "the rotated key accepted",
        )
    finally:
        router.stop()


def serve(tmp_path: Path, toml: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`kvrouter serve` on a config file, its output in tmp_path/router.log."""
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(toml)
    with (tmp_path / "router.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    return proc, cfg


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_an_authorized_probe_with_the_old_key_is_refused_once_the_keys_change(
    engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    """With probes authorized, a ``/health`` probe answered 200 with a key is refused (401) as soon
    as a reload has rotated that key away, however often it was answered before."""
    import socket

    from harness import NativeServer

    a = engines["a"]
    toml = f'block_size = {BS}\nauth_exempt_probes = false\napi_keys = ["{CLIENT}"]\n' + a.backend_toml()
    router = RouterRunner(toml, tmp_path, config_file=True)
    server = cast(NativeServer, router.server).server
    probe = f"GET /health HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {CLIENT}\r\n\r\n".encode()

    def ask() -> int:
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
            s.sendall(probe)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                assert chunk, data
                data += chunk
            return int(data.split(b" ", 2)[1])

    try:
        wait_for(lambda: ask() == 200 and ask() == 200, "the probe answered, twice")
        router.path.write_text(toml.replace(CLIENT, "rotated", 1))
        rotated = {"authorization": "Bearer rotated"}
        wait_for(
            lambda: httpx.get(f"{router.url}/v1/models", headers=rotated).status_code == 200,
            "the rotated key accepted",
        )
        assert ask() == 401
    finally:
        router.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_reloads_and_admin_changes_reach_every_worker(
    engines: dict[str, FakeEngine], tmp_path: Path, workers: int
) -> None:
    a, b, c = engines["a"], engines["b"], engines["c"]
    port = free_port()
    head = (
        f'block_size = {BS}\nadmin_keys = ["{ADMIN}"]\n[server]\nport = {port}\nworkers = {workers}\n'
        "[membership]\nwatch_config = false\n"
    )
    proc, cfg = serve(tmp_path, head + a.backend_toml())
    url = f"http://127.0.0.1:{port}"

    def views() -> list[dict[str, Any]]:
        """/admin/backends from as many workers as answer (a new connection each time)."""
        auth = {"authorization": f"Bearer {ADMIN}"}
        out = []
        for _ in range(8 * workers):
            try:
                r = httpx.get(f"{url}/admin/backends", headers=auth, timeout=5)
            except httpx.HTTPError:
                return []
            if r.status_code == 200:
                out.append(r.json())
        return out

    def everyone(pred: Any) -> bool:
        got = views()
        seen = {v["worker"] for v in got}
        return len(seen) == workers and all(pred({b["name"]: b for b in v["backends"]}) for v in got)

    try:
        wait_for(lambda: everyone(lambda m: m.get("a", {}).get("state") == "ready"), "router up", timeout=120)
        cfg.write_text(head + a.backend_toml() + b.backend_toml())
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: everyone(lambda m: "b" in m), "b from the reloaded file in every worker")
        r = httpx.put(f"{url}/admin/backends/c", json=spec(c), headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201
        wait_for(lambda: everyone(lambda m: m.get("c", {}).get("origin") == "admin"), "c in every worker")
        r = httpx.delete(f"{url}/admin/backends/c", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200
        wait_for(lambda: everyone(lambda m: "c" not in m), "c gone from every worker")
        assert proc.poll() is None  # SIGHUP never killed anything
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    assert code == 0, (tmp_path / "router.log").read_text()[-3000:]
    assert "take effect" not in (tmp_path / "router.log").read_text()  # the flags are not a change


def test_a_removed_backend_leaves_no_series(engines: dict[str, FakeEngine], tmp_path: Path) -> None:
    """Per-backend series, ejection counts and idle connections of removed backends were kept for
    good: with pod churn (new names at every rollout) /metrics and memory grew without bound."""
    a, b = engines["a"], engines["b"]
    router = start_router(tmp_path, [a, b])
    try:
        wait_for(lambda: all(m["state"] == "ready" for m in members(router).values()), "both ready")
        for prompt in ("one two", "three four", "five six", "seven eight"):
            assert post(router, "/v1/completions", {"model": "toy", "prompt": prompt}).status_code == 200

        def series(name: str) -> list[str]:
            r = admin(router, "GET", "/metrics", key=CLIENT)
            assert r.status_code == 200, r.text
            return [line for line in r.text.splitlines() if f'backend="{name}"' in line]

        served = [n for n in ("a", "b") if any("kvrouter_requests_total" in s for s in series(n))]
        assert served, "no request series at all"
        gone = served[0]
        assert admin(router, "DELETE", f"/admin/backends/{gone}").status_code == 200
        wait_for(lambda: gone not in members(router), "removed")
        assert series(gone) == []
        assert gone not in router.app.metrics.per_backend
        # what a request still in flight at the removal writes when it ends (a drain that timed
        # out, a long stream): gone again at the next sweep, its counts kept as departed
        app = router.app
        departed = app.metrics.departed.requests
        app.metrics.finished(gone, "toy", 200, 0.01)
        app.metrics.observe_ttft(gone, 0.01)
        app.breakers.failure(gone)
        app.breakers.ejected_total[gone] = 1
        assert app.checks is not None
        app.checks.counts[(gone, "match")] = 1
        key = app._forget.recent[gone][1]  # (its address: an idle place a late request gave back)
        app.pool._idle.setdefault(key, [])
        assert series(gone) != []
        app._forget.sweep()
        assert series(gone) == []
        assert gone not in app.metrics.per_backend and app.metrics.departed.requests == departed + 1
        assert gone not in app.breakers.ejected_total and gone not in app.breakers._states
        assert all(k[0] != gone for k in app.checks.counts)
        assert key not in app.pool.idle_keys()
        if len(served) > 1:  # the members keep theirs
            assert any("kvrouter_requests_total" in s for s in series(served[1]))
        # late failures that eject it, then the name joins again before a sweep: the new member
        # starts with a closed breaker
        for _ in range(100):
            if app.breakers.failure(gone):
                break
        assert app.breakers.state(gone) == "open"
        engine = a if gone == "a" else b
        spec = {
            "url": engine.url,
            "kv_events": engine.kv_events,
            "kv_replay": engine.kv_replay,
            "models": ["toy"],
        }
        assert admin(router, "PUT", f"/admin/backends/{gone}", json=spec).status_code == 201
        assert app.breakers.state(gone) == "closed" and gone not in app._forget.recent
    finally:
        router.stop()


def test_a_failing_housekeeping_turn_does_not_stop_housekeeping(
    engines: dict[str, FakeEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The housekeeping task (expired predictions, the removal sweep) logs a turn that raises and
    runs the next: a dead task would have stopped both for good, silently."""
    import router.app as app_module

    monkeypatch.setattr(app_module, "_HOUSEKEEPING_S", 0.05)
    router = start_router(tmp_path, [engines["a"]])
    try:
        index = router.app.index
        real = index.purge_predictions
        calls: list[int] = []

        def purge() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("an unforeseen failure in a housekeeping turn")
            real()

        monkeypatch.setattr(index, "purge_predictions", purge)
        wait_for(lambda: len(calls) >= 3, "housekeeping turns after the one that failed")
    finally:
        router.stop()


def _refusing_port() -> socket.socket:
    """A socket bound to an ephemeral port but not listening: connections to it are refused (an
    engine that is down), and no other test can take the port meanwhile."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s


def test_a_fleet_not_reached_yet_answers_503_with_retry_after_not_404(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every engine down at start, no `models` configured: nobody knows yet which models the fleet
    serves, so an unknown model is "no backend available yet" (503, Retry-After), not "does not
    exist" (404). A backend whose models are configured is known: another model is a 404."""
    down, known = _refusing_port(), _refusing_port()
    toml = (
        "[health]\ninterval_s = 5.0\n"
        f'[[backends]]\nname = "down"\nurl = "http://127.0.0.1:{down.getsockname()[1]}"\nkv_events = "auto"\n'
    )
    caplog.set_level(logging.INFO, logger="kvrouter")
    router = RouterRunner(toml, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "1"
        error = caught.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert (error["type"], error["code"]) == ("service_unavailable", "no_backend_yet"), error
        for path, body in (
            ("/v1/completions", {"model": "m", "prompt": "hi"}),
            ("/route", {"model": "m", "prompt": "hi"}),
        ):
            resp = httpx.post(router.url + path, json=body, timeout=TIMEOUT)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_backend_yet", resp.text
        ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvrouter ready")]
        assert ready and ready[0].endswith(
            '0/0 event sources connected, 1 backend(s) with kv_events = "auto" not listed yet'
        ), ready
    finally:
        router.stop()
    toml = (
        "[health]\ninterval_s = 5.0\n"
        f'[[backends]]\nname = "known"\nurl = "http://127.0.0.1:{known.getsockname()[1]}"\nmodels = ["m"]\n'
        f'kv_events = "tcp://127.0.0.1:{known.getsockname()[1]}"\n'
    )
    caplog.clear()
    router = RouterRunner(toml, tmp_path)
    try:
        other = httpx.post(
            router.url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=TIMEOUT
        )
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found", other.text
        served = httpx.post(
            router.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=TIMEOUT
        )
        assert served.status_code == 503 and served.json()["error"]["code"] == "no_healthy_backend"
        assert served.headers["retry-after"] == "1"
        ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvrouter ready")]
        assert ready and ready[0].endswith(", 0/1 event sources connected"), ready
    finally:
        router.stop()
        down.close()
        known.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_shutdown_on_sigterm_is_logged_when_it_starts_and_when_it_is_done(
    tmp_path: Path, workers: int
) -> None:
    """SIGTERM drains for up to server.drain_timeout_s and logged nothing: an operator could not tell
    a router shutting down from one hung."""
    down = _refusing_port()
    port = free_port()
    toml = (
        f"[server]\nport = {port}\nworkers = {workers}\n"
        f'[[backends]]\nname = "down"\nurl = "http://127.0.0.1:{down.getsockname()[1]}"\nkv_events = "auto"\n'
    )
    proc, _ = serve(tmp_path, toml)
    log = tmp_path / "router.log"
    try:
        wait_for(lambda: log.read_text().count("kvrouter listening on") == workers, "router up", timeout=120)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        down.close()
    text = log.read_text()
    assert code == 0, text[-3000:]
    said: dict[str, list[str]] = {}  # process (the router or supervisor, each worker) -> what it said
    for line in text.splitlines():
        for what in ("kvrouter shutting down", "kvrouter stopped (shutdown took"):
            if what in line:
                worker = re.search(r" (worker-\d+) ", line)
                said.setdefault(worker.group(1) if worker else "main", []).append(what)
    expected = ["main"] + [f"worker-{i}" for i in range(workers) if workers > 1]
    assert sorted(said) == expected, text[-3000:]
    assert all(s == ["kvrouter shutting down", "kvrouter stopped (shutdown took"] for s in said.values()), (
        said
    )
    if workers > 1:  # (the supervisor names the signal)
        assert "kvrouter shutting down (SIGTERM): stopping 2 workers" in text, text[-3000:]
