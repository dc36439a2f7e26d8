"""Kubernetes discovery against a stand-in API server (tests/k8s_standin.py): pod lifecycles, bad
pods, expired watches, outages, annotations, InferencePools. The engines behind the pods are real
(harness.FakeEngine with KV publishers): a pod's IP is 127.0.0.1 and its container ports are the
engine's ports.

What this does not show (README, "Kubernetes discovery"): lightkube against a real API server, TLS
and service-account tokens, RBAC. The stand-in serves the documented wire format only.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import zmq
from harness import TIMEOUT, FakeEngine, RouterRunner, wait_for
from k8s_standin import KubeStandIn, selector_matches

from router.config import ConfigError, KubernetesConfig
from router.fleet.sources.kubernetes import SkipPod, parse_selector, pod_backend

BS = 4


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def ports(e: FakeEngine) -> dict[str, int]:
    port = urlsplit(e.url).port
    assert port is not None
    return {"http": port, "kv-events": port_of(e.kv_events), "kv-replay": port_of(e.kv_replay)}


@pytest.fixture
def standin() -> Iterator[KubeStandIn]:
    s = KubeStandIn()
    yield s
    s.stop()


@pytest.fixture
def engines(ctx: zmq.Context[Any]) -> Iterator[dict[str, FakeEngine]]:
    made = {n: FakeEngine(n, ctx) for n in ("e1", "e2", "e3")}
    yield made
    for e in made.values():
        e.close()


@pytest.fixture
def router(standin: KubeStandIn, tmp_path: Path) -> Iterator[RouterRunner]:
    kubeconfig = tmp_path / "kubeconfig"
    standin.kubeconfig(kubeconfig)
    toml = (
        f"block_size = {BS}\n[health]\ninterval_s = 2.0\n[membership]\ndrain_timeout_s = 30\n"
        "[membership.kubernetes]\nenabled = true\n"
        f'kubeconfig = "{kubeconfig}"\nlabel_selector = "app=vllm,tier notin (canary)"\n'
        "backoff_s = 0.05\nmax_backoff_s = 0.2\nwatch_timeout_s = 3\n"
    )
    r = RouterRunner(toml, tmp_path)
    yield r
    r.stop()


def debug(router: RouterRunner) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{router.url}/debug/index", timeout=TIMEOUT).json()
    return out


def members(router: RouterRunner) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in debug(router)["backends"]}


def state(router: RouterRunner, name: str) -> str | None:
    m = members(router).get(name)
    return None if m is None else str(m["state"])


def served_by(router: RouterRunner, n: int = 6) -> set[str]:
    out = set()
    for i in range(n):
        r = httpx.post(
            f"{router.url}/v1/completions", json={"model": "toy", "prompt": f"q{i}"}, timeout=TIMEOUT
        )
        assert r.status_code == 200, r.text
        out.add(r.headers["x-kvrouter-backend"])
    return out


def metric(router: RouterRunner, name: str, labels: str = "") -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_pods_life_drives_its_membership(
    standin: KubeStandIn, engines: dict[str, FakeEngine], router: RouterRunner
) -> None:
    e1, e2 = engines["e1"], engines["e2"]
    prompt = [5 + i for i in range(6 * BS)]
    e2.announce(prompt, BS)  # in e2's replay buffer before its pod exists
    standin.add_pod("vllm-0", ports(e1))
    standin.add_pod("vllm-1", ports(e2))
    standin.add_pod("other", ports(e1), labels={"app": "web"})  # not selected
    standin.add_pod("canary", ports(e1), labels={"app": "vllm", "tier": "canary"})  # excluded by notin
    wait_for(lambda: debug(router)["membership"]["kubernetes"]["connected"], "the watch")
    assert members(router) == {}  # Pending, no IP: nothing yet
    standin.start_pod("vllm-0")
    standin.start_pod("other")
    standin.start_pod("canary")
    wait_for(lambda: state(router, "vllm-0") == "ready", "vllm-0 ready")
    assert served_by(router) == {"vllm-0"}
    standin.start_pod("vllm-1")
    wait_for(lambda: state(router, "vllm-1") == "ready", "vllm-1 ready")
    assert sorted(members(router)) == ["vllm-0", "vllm-1"]
    m = members(router)["vllm-1"]
    assert m["origin"] == "kubernetes" and m["url"] == e2.url and m["kv_replay"] == e2.kv_replay
    routed = httpx.post(f"{router.url}/route", json={"model": "toy", "prompt": prompt}).json()
    assert routed["backend"] == "vllm-1" and routed["matched_blocks"] == 6  # bootstrapped from replay
    # a readiness flap: skipped like a failed probe, its index kept, back when Ready
    standin.set_ready("vllm-1", False)
    wait_for(lambda: not members(router)["vllm-1"]["discovery_ready"], "vllm-1 not ready")
    assert members(router)["vllm-1"]["state"] == "ready"  # not a membership change
    assert served_by(router) == {"vllm-0"}
    assert "vllm-1" in {s["instance"] for s in debug(router)["sources"]}  # still subscribed
    standin.set_ready("vllm-1", True)
    wait_for(lambda: members(router)["vllm-1"]["discovery_ready"], "vllm-1 ready again")
    routed = httpx.post(f"{router.url}/route", json={"model": "toy", "prompt": prompt}).json()
    assert routed["backend"] == "vllm-1" and routed["matched_blocks"] == 6  # the cache survived
    # terminating: drained and removed; then the object goes
    standin.terminate("vllm-1")
    wait_for(lambda: "vllm-1" not in members(router), "vllm-1 removed")
    standin.delete("vllm-1")
    standin.delete("vllm-0")
    wait_for(lambda: members(router) == {}, "vllm-0 removed on delete")
    changes = [(t["backend"], t["change"]) for t in debug(router)["membership"]["transitions"]]
    assert changes.count(("vllm-1", "removed")) == 1 and ("vllm-0", "removed") in changes
    assert metric(router, "kvrouter_discovery_events_total", '{type="DELETED"}') == 2
    assert metric(router, "kvrouter_discovery_connected") == 1


def test_bad_pods_are_skipped_named_and_counted_and_discovery_goes_on(
    standin: KubeStandIn,
    engines: dict[str, FakeEngine],
    router: RouterRunner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    e1 = engines["e1"]
    good = ports(e1)
    standin.add_pod("no-http", {"kv-events": good["kv-events"]})
    standin.add_pod("bad-dp", good, annotations={"kvrouter.io/dp-size": "two"})
    standin.add_pod("bad-role", good, annotations={"kvrouter.io/role": "chef"})
    standin.add_pod("bad-port", good, annotations={"kvrouter.io/kv-events-port": "nope"})
    for name in ("no-http", "bad-dp", "bad-role", "bad-port"):
        standin.start_pod(name)
    wait_for(
        lambda: metric(router, "kvrouter_discovery_skipped_total", '{reason="bad_annotation"}') == 2, "skips"
    )
    assert metric(router, "kvrouter_discovery_skipped_total", '{reason="missing_port"}') == 2
    assert members(router) == {}
    logged = caplog.text
    for name in ("no-http", "bad-dp", "bad-role", "bad-port"):
        assert f"pod {name} skipped" in logged
    standin.add_pod("fine", good)
    standin.start_pod("fine")
    wait_for(lambda: state(router, "fine") == "ready", "a good pod still joins")
    # a bad pod that gets fixed joins
    standin.set_annotation("bad-dp", "kvrouter.io/dp-size", "1")
    wait_for(lambda: state(router, "bad-dp") is not None, "the fixed pod joins")


def test_an_expired_watch_relists_and_catches_up_with_what_it_missed(
    standin: KubeStandIn, engines: dict[str, FakeEngine], router: RouterRunner
) -> None:
    e1, e2, e3 = engines["e1"], engines["e2"], engines["e3"]
    for name, e in (("p1", e1), ("p2", e2)):
        standin.add_pod(name, ports(e))
        standin.start_pod(name)
    wait_for(lambda: sorted(members(router)) == ["p1", "p2"], "two pods")
    relists = debug(router)["membership"]["kubernetes"]["relists"]
    standin.refuse = True  # an outage: the watch breaks and reconnects fail for a while
    standin.drop_watches()
    wait_for(lambda: not debug(router)["membership"]["kubernetes"]["connected"], "the outage seen")
    standin.refuse = False
    standin.expire()  # ... and by the time it is back, the history it would resume from is gone
    standin.delete("p1")  # changes it did not see as events
    standin.add_pod("p3", ports(e3))
    standin.start_pod("p3")
    wait_for(lambda: sorted(members(router)) == ["p2", "p3"], "caught up after relisting")
    k8s = debug(router)["membership"]["kubernetes"]
    assert k8s["relists"] > relists and k8s["failures"] >= 1
    # an open watch ended by 410 Expired relists too
    relists = k8s["relists"]
    standin.expire()
    wait_for(lambda: debug(router)["membership"]["kubernetes"]["relists"] > relists, "relisted on 410")
    assert sorted(members(router)) == ["p2", "p3"]
    # bookmarks only move the version
    standin.bookmarks = True
    standin.drop_watches()
    wait_for(lambda: metric(router, "kvrouter_discovery_events_total", '{type="BOOKMARK"}') > 0, "a bookmark")
    assert sorted(members(router)) == ["p2", "p3"]


def test_a_pod_recreated_with_new_endpoints_rejoins(
    standin: KubeStandIn, engines: dict[str, FakeEngine], router: RouterRunner
) -> None:
    e1, e2 = engines["e1"], engines["e2"]
    standin.add_pod("sts-0", ports(e1))
    standin.start_pod("sts-0")
    wait_for(lambda: state(router, "sts-0") == "ready", "sts-0 ready")
    assert members(router)["sts-0"]["url"] == e1.url
    # the StatefulSet pod is replaced under the same name; the watch sees it modified in one go
    standin.delete("sts-0")
    standin.add_pod("sts-0", ports(e2))
    standin.start_pod("sts-0")
    wait_for(lambda: members(router).get("sts-0", {}).get("url") == e2.url, "sts-0 on its new address")
    wait_for(lambda: state(router, "sts-0") == "ready", "sts-0 ready again")
    assert served_by(router) == {"sts-0"}
    assert {s["endpoint"] for s in debug(router)["sources"]} == {e2.kv_events}


def kcfg(**kw: Any) -> KubernetesConfig:
    return KubernetesConfig(enabled=True, label_selector="app=vllm", **kw)


def pod(**meta: Any) -> dict[str, Any]:
    ports = meta.pop(
        "ports", [{"name": "http", "containerPort": 8000}, {"name": "kv-events", "containerPort": 5557}]
    )
    return {
        "metadata": {
            "name": "p",
            "annotations": meta.pop("annotations", {}),
            "labels": meta.pop("labels", {}),
        },
        "spec": {"containers": [{"name": "sidecar"}, {"name": "vllm", "ports": ports}]},
        "status": {"phase": "Running", "podIP": meta.pop("ip", "10.0.0.7")},
    }


def test_pod_to_backend() -> None:
    b = pod_backend(pod(), kcfg())
    assert (b.url, b.kv_events, b.kv_replay, b.dp_size, b.role) == (
        "http://10.0.0.7:8000",
        "tcp://10.0.0.7:5557",
        None,  # no kv-replay port declared: no replay
        1,
        "both",
    )
    ann = {
        "kvrouter.io/dp-size": "4",
        "kvrouter.io/role": "prefill",
        "kvrouter.io/models": "m1, m2",
        "kvrouter.io/kv-topic": "kv",
        "kvrouter.io/kv-replay-port": "5600",
    }
    b = pod_backend(pod(annotations=ann, ip="fd00::7"), kcfg(dp_size=2))
    assert (b.dp_size, b.role, b.models, b.kv_topic, b.kv_replay) == (
        4,
        "prefill",
        ["m1", "m2"],
        "kv",
        "tcp://[fd00::7]:5600",
    )
    assert pod_backend(pod(labels={"llm-d.ai/role": "decode"}), kcfg()).role == "decode"
    assert pod_backend(pod(labels={"llm-d.ai/role": "prefill-decode"}), kcfg(role="decode")).role == "both"
    assert pod_backend(pod(annotations={"kvrouter.io/kv-events-port": "none"}), kcfg()).kv_events is None
    # no KV-events port declared: the engine lists its streams (GET /kv_event_sources)
    http_only = pod(
        ports=[{"name": "http", "containerPort": 8000}], annotations={"kvrouter.io/kv-replay-port": "5600"}
    )
    assert (pod_backend(http_only, kcfg()).kv_events, pod_backend(http_only, kcfg()).kv_replay) == (
        "auto",
        None,
    )
    assert pod_backend(http_only, kcfg(kv_events_port="")).kv_events is None
    assert (
        pod_backend(pod(annotations={"kvrouter.io/http-port": "9000"}), kcfg()).url == "http://10.0.0.7:9000"
    )
    for bad, reason in (
        (pod(annotations={"kvrouter.io/dp-size": "0"}), "bad_annotation"),
        (pod(annotations={"kvrouter.io/http-port": "70000"}), "bad_annotation"),
        (pod(annotations={"kvrouter.io/models": " , "}), "bad_annotation"),
        (pod(ports=[]), "missing_port"),
        (pod(ip=""), "no_ip"),
    ):
        with pytest.raises(SkipPod) as exc:
            pod_backend(bad, kcfg())
        assert exc.value.reason == reason


def test_label_selectors() -> None:
    from lightkube.core.selector import build_selector

    for text, labels, expected in (
        ("app=vllm", {"app": "vllm"}, True),
        ("app==vllm,tier!=canary", {"app": "vllm", "tier": "canary"}, False),
        ("app in (vllm, sglang),!legacy", {"app": "sglang"}, True),
        ("app in (vllm, sglang),!legacy", {"app": "sglang", "legacy": "1"}, False),
        ("gpu,app notin (web)", {"gpu": "a100", "app": "x"}, True),
        ("gpu", {"app": "x"}, False),
    ):
        # what kvrouter sends (lightkube's encoding of our parse) selects what the text selects
        encoded = build_selector(parse_selector(text))
        assert selector_matches(encoded, labels) == selector_matches(text, labels) == expected, (
            text,
            encoded,
        )
    with pytest.raises(ConfigError):
        parse_selector("app=(")


def _watcher(standin: KubeStandIn, tmp_path: Path, **cfg: Any) -> Any:
    from router.fleet.membership import Membership
    from router.fleet.sources.kubernetes import PodWatcher

    kubeconfig = tmp_path / "kubeconfig"
    standin.kubeconfig(kubeconfig)
    k8s = KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig), label_selector="app=vllm", **cfg)
    return PodWatcher(k8s, Membership())


def test_watches_refused_while_lists_work_back_off(standin: KubeStandIn, tmp_path: Path) -> None:
    """A successful list reset the backoff, so a watch refused at once (403 on watch, 429 under
    API priority and fairness) meant a full list every backoff_s, for good, from every replica."""
    import asyncio

    standin.refuse_watches = True
    watcher = _watcher(standin, tmp_path, backoff_s=0.1, max_backoff_s=10.0)

    async def scenario() -> list[float]:
        watcher.start()
        lists: list[float] = []
        seen = 0
        deadline = time.monotonic() + TIMEOUT
        try:
            while len(lists) < 5:
                assert time.monotonic() < deadline, lists
                n = sum(1 for u in standin.requests if "watch" not in u)
                if n > seen:
                    lists += [time.monotonic()] * (n - seen)
                    seen = n
                await asyncio.sleep(0.01)
        finally:
            await watcher.stop()
        return [b - a for a, b in itertools.pairwise(lists)]

    gaps = asyncio.run(scenario())
    # 0.1, 0.2, 0.4, 0.8 s (a sleep is never shorter; each gap holds one list and one refusal too)
    assert gaps[2] >= 0.35 and gaps[3] >= 0.75, gaps
    assert watcher.failures >= 4


def test_a_watch_that_worked_backs_off_anew_when_it_fails(
    standin: KubeStandIn, engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    """A failure after a watch that delivered events starts the backoff at backoff_s again; it
    doubled over the router's whole life, so a few blips made every later one cost max_backoff_s."""
    import asyncio

    watcher = _watcher(standin, tmp_path, backoff_s=0.2, max_backoff_s=30.0)

    async def scenario() -> list[float]:
        watcher.start()
        delays = []
        deadline = time.monotonic() + TIMEOUT
        try:
            for i in range(6):  # doubling would reach 0.2 * 2**5 = 6.4 s

                def watching() -> bool:  # every list followed by its watch (the failed ones aside)
                    w = sum("watch" in u for u in standin.requests)
                    return w - watcher.failures >= len(standin.requests) - w >= 1

                while not watching():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                standin.add_pod(f"p{i}", ports(engines["e1"]))  # an event: the watch works
                while watcher.events.get("ADDED", 0) <= i:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                lists = watcher.relists
                failures = watcher.failures
                standin.fail_watches = 1
                standin.drop_watches()  # the stream ends; its resumption gets a 500
                while watcher.failures == failures:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                failed_at = time.monotonic()
                while watcher.relists == lists:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                delays.append(time.monotonic() - failed_at)
        finally:
            await watcher.stop()
        return delays

    delays = asyncio.run(scenario())
    assert max(delays) < 3.0, delays  # each about backoff_s (plus a list), not 0.2 * 2**i


def test_a_watch_that_goes_silent_is_relisted(
    standin: KubeStandIn, engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    """lightkube reads a watch with no read timeout: a link that died without a FIN or RST froze
    discovery for good (no relist, no failure, ``connected`` still true)."""
    import asyncio

    watcher = _watcher(standin, tmp_path, watch_timeout_s=1.0, backoff_s=0.05)
    standin.silent_watches = True

    async def scenario() -> None:
        watcher.start()
        try:
            deadline = time.monotonic() + TIMEOUT
            while watcher.relists < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            # a pod that starts while the watch says nothing: only a relist can bring it
            standin.add_pod("p1", ports(engines["e1"]))
            standin.start_pod("p1")
            while "p1" not in watcher.membership.members:
                assert time.monotonic() < deadline, watcher.relists
                await asyncio.sleep(0.01)
        finally:
            standin.silent_watches = False
            await watcher.stop()

    asyncio.run(scenario())
    assert watcher.silences >= 1 and watcher.failures == 0


def test_an_admin_drain_of_a_discovered_pod_holds_through_its_status_updates() -> None:
    """Any MODIFIED event of the pod (a condition's timestamp, a restart count) readmitted a pod
    the operator had drained, and cleared a DELETE's removal."""
    from router.fleet.membership import Membership
    from router.fleet.sources.kubernetes import PodWatcher

    def pod(version: str, ip: str = "10.0.0.5") -> dict[str, Any]:
        return {
            "metadata": {"name": "vllm-0", "resourceVersion": version, "labels": {"app": "vllm"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }

    ms = Membership()
    cfg = KubernetesConfig(enabled=True, label_selector="app=vllm", models=["m"])
    watcher = PodWatcher(cfg, ms, client_factory=lambda: None)
    watcher.on_event("ADDED", pod("1"))
    m = ms.get("vllm-0")
    assert m is not None
    m.healthy = True
    ms.tick(lambda m: 0, lambda m: True)
    ms.drain("vllm-0", remove=False, reason="POST /admin/backends/vllm-0/drain")
    watcher.on_event("MODIFIED", pod("2"))
    assert m.state == "draining" and not m.routable
    ms.drain("vllm-0", remove=True, reason="DELETE /admin/backends/vllm-0")
    watcher.on_event("MODIFIED", pod("3"))
    assert m.state == "draining" and m.remove_when_drained
    watcher.on_event("MODIFIED", pod("4", ip="10.0.0.6"))  # the pod on new endpoints: a new engine
    assert m.state == "joining" and not m.remove_when_drained


# --- discovery from a Gateway API InferencePool ---------------------------------------------------


@pytest.fixture
def pool_router(standin: KubeStandIn, tmp_path: Path) -> Iterator[RouterRunner]:
    kubeconfig = tmp_path / "kubeconfig"
    standin.kubeconfig(kubeconfig)
    toml = (
        f"block_size = {BS}\n[health]\ninterval_s = 2.0\n[membership]\ndrain_timeout_s = 30\n"
        "[membership.kubernetes]\nenabled = true\n"
        f'kubeconfig = "{kubeconfig}"\ninference_pool = "vllm-pool"\nnamespace = "engines"\n'
        "backoff_s = 0.05\nmax_backoff_s = 0.2\nwatch_timeout_s = 3\n"
    )
    r = RouterRunner(toml, tmp_path)
    yield r
    r.stop()


def pool_info(router: RouterRunner) -> dict[str, Any]:
    out: dict[str, Any] = debug(router)["membership"]["kubernetes"]["inference_pool"]
    return out


def test_the_inference_pools_selector_and_port_drive_the_membership(
    standin: KubeStandIn,
    engines: dict[str, FakeEngine],
    pool_router: RouterRunner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = pool_router
    e1, e2 = engines["e1"], engines["e2"]
    http1, http2 = ports(e1)["http"], ports(e2)["http"]
    # a's and b's own named http ports differ; the pool's target port is what the gateway uses
    standin.add_pod("a", ports(e1), labels={"app": "vllm"})
    standin.add_pod("b", ports(e2), labels={"app": "vllm", "tier": "canary"})
    standin.add_pod("c", ports(e2), labels={"app": "sglang"})
    standin.add_pod("elsewhere", ports(e1), labels={"app": "vllm"}, namespace="other")
    for name in ("a", "b", "c"):
        standin.start_pod(name)
    standin.start_pod("elsewhere", namespace="other")
    wait_for(lambda: pool_info(router)["connected"], "the pool's watch")
    assert not pool_info(router)["exists"] and members(router) == {}  # no pool yet: no pods

    standin.put_pool("vllm-pool", {"app": "vllm"}, [http1])
    standin.put_pool("another-pool", {"app": "sglang"}, [http2])  # not the one configured
    wait_for(lambda: sorted(members(router)) == ["a", "b"], "the pool's pods join")
    wait_for(lambda: {state(router, "a"), state(router, "b")} == {"ready"}, "a and b ready")
    m = members(router)
    assert m["a"]["url"] == m["b"]["url"] == e1.url  # the target port, not b's own http port
    assert m["a"]["kv_events"] == e1.kv_events and m["b"]["kv_events"] == e2.kv_events  # named ports
    assert m["a"]["origin"] == "kubernetes"
    assert served_by(router) <= {"a", "b"}
    k8s = debug(router)["membership"]["kubernetes"]
    assert k8s["label_selector"] == "app=vllm" and pool_info(router)["target_port"] == http1

    # the selector narrows: a leaves, b stays as it was (no re-join); widened again, a is back
    def changes_of(name: str) -> list[str]:
        return [t["change"] for t in debug(router)["membership"]["transitions"] if t["backend"] == name]

    of_b = changes_of("b")
    standin.put_pool("vllm-pool", {"app": "vllm", "tier": "canary"}, [http1])
    wait_for(lambda: sorted(members(router)) == ["b"], "a leaves with the narrower selector")
    standin.put_pool("vllm-pool", {"app": "vllm"}, [http1])
    wait_for(lambda: sorted(members(router)) == ["a", "b"], "a back")
    assert changes_of("b") == of_b and changes_of("a").count("removed") == 1
    reasons = {t["reason"] for t in debug(router)["membership"]["transitions"] if t["backend"] == "a"}
    assert "pod not listed" in reasons  # deselected, not deleted

    # the port changes: the pods re-join on it; another selector: other pods
    standin.put_pool("vllm-pool", {"app": "sglang"}, [http2, 9999])
    wait_for(lambda: sorted(members(router)) == ["c"], "the sglang pod replaces the vllm ones")
    wait_for(lambda: state(router, "c") == "ready", "c ready")
    assert members(router)["c"]["url"] == e2.url
    assert "only the first" in caplog.text  # the second target port is not followed
    changes = pool_info(router)["changes"]

    # a pool the API server would refuse is ignored; the last good one stays followed
    standin.put_pool("vllm-pool", {}, [http2])
    wait_for(
        lambda: metric(router, "kvrouter_discovery_skipped_total", '{reason="bad_pool"}') == 1, "bad pool"
    )
    assert sorted(members(router)) == ["c"] and pool_info(router)["changes"] == changes

    # an expired watch relists and still follows the pool
    relists = pool_info(router)["relists"]
    standin.expire()
    wait_for(lambda: pool_info(router)["relists"] > relists, "the pool relisted")
    standin.put_pool("vllm-pool", {"app": "sglang"}, [http2])  # good again, the same target
    wait_for(lambda: pool_info(router)["resource_version"] == str(standin.version), "the pool's event")
    assert sorted(members(router)) == ["c"] and pool_info(router)["changes"] == changes

    # the pool deleted: its pods leave (logged); created again: they come back
    standin.delete_pool("vllm-pool")
    wait_for(lambda: members(router) == {}, "the pool's pods leave with it")
    assert not pool_info(router)["exists"]
    assert "InferencePool vllm-pool is gone: its 1 pods leave" in caplog.text
    removed = [t for t in debug(router)["membership"]["transitions"] if t["change"] == "removed"]
    assert any(t["backend"] == "c" for t in removed)
    draining = [t for t in debug(router)["membership"]["transitions"] if t["change"] == "draining"]
    assert draining[-1]["reason"] == "InferencePool vllm-pool deleted"
    standin.put_pool("vllm-pool", {"app": "vllm"}, [http1])
    wait_for(lambda: sorted(members(router)) == ["a", "b"], "the pool back, its pods too")
    # the namespace's other pods never joined, and the other pool was never followed
    assert "elsewhere" not in members(router)
    assert any("fieldSelector=metadata.name%3Dvllm-pool" in u for u in standin.requests)


def test_pool_targets_and_the_pool_port_over_the_pods_own() -> None:
    from router.fleet.sources.inferencepool import BadPool, pool_target

    def pool(labels: Any, ports: Any) -> dict[str, Any]:
        return {"spec": {"selector": {"matchLabels": labels}, "targetPorts": ports}}

    assert pool_target(pool({"b": "2", "app.kubernetes.io/name": "vllm"}, [{"number": 8000}])) == (
        ((("app.kubernetes.io/name", "vllm"), ("b", "2")), 8000),
        1,
    )
    assert pool_target(pool({"a": ""}, [{"number": 1}, {"number": 2}]))[1] == 2
    bad: dict[str, Any]
    for bad in (
        {"spec": {}},
        pool({}, [{"number": 8000}]),
        pool({"a": "b"}, []),
        pool({"a": "b"}, [{"number": 0}]),
        pool({"a": "b"}, [{"number": True}]),
        pool({"a": "b"}, [{"number": "8000"}]),
        pool({"a": "b"}, [{"number": 1}] * 9),
        pool({"a": 1}, [{"number": 8000}]),
        pool({"a b": "c"}, [{"number": 8000}]),
        pool({"a": "c,d"}, [{"number": 8000}]),  # would widen the selector we send
        pool({f"k{i}": "v" for i in range(65)}, [{"number": 8000}]),
    ):
        with pytest.raises(BadPool):
            pool_target(bad)
    # the pool's port wins over the pod's annotation and the http_port setting
    b = pod_backend(pod(annotations={"kvrouter.io/http-port": "9000"}), kcfg(), http_port=8100)
    assert b.url == "http://10.0.0.7:8100" and b.kv_events == "tcp://10.0.0.7:5557"
    http_only = pod(ports=[])  # no container ports at all: the pool's port still names the server
    b = pod_backend(http_only, kcfg(), http_port=8100)
    assert (b.url, b.kv_events) == ("http://10.0.0.7:8100", "auto")


def test_inference_pool_config() -> None:
    from router.config import parse_config

    base = {"membership": {"kubernetes": {"enabled": True}}}
    k8s = parse_config(
        {"membership": {"kubernetes": {"enabled": True, "inference_pool": "vllm-pool", "namespace": "ns"}}}
    ).membership.kubernetes
    assert (k8s.inference_pool, k8s.namespace, k8s.label_selector) == ("vllm-pool", "ns", "")
    for bad in (
        {},  # neither a selector nor a pool
        {"inference_pool": "vllm-pool", "label_selector": "app=vllm"},  # two sources of the selector
        {"inference_pool": "Vllm_Pool"},
        {"inference_pool": "x" * 254},
    ):
        with pytest.raises(ConfigError):
            parse_config({"membership": {"kubernetes": {**base["membership"]["kubernetes"], **bad}}})


def test_a_cluster_without_the_pool_crd_is_retried_until_the_pool_exists(
    standin: KubeStandIn, engines: dict[str, FakeEngine], tmp_path: Path
) -> None:
    """No InferencePool CRD (the Inference Extension not installed yet): a failure, retried with the
    backoff and logged, not a crash; once the pool exists its pods join."""
    import asyncio

    from router.fleet.membership import Membership
    from router.fleet.sources.kubernetes import PodWatcher

    kubeconfig = tmp_path / "kubeconfig"
    standin.kubeconfig(kubeconfig)
    cfg = KubernetesConfig(
        enabled=True,
        kubeconfig=str(kubeconfig),
        inference_pool="vllm-pool",
        backoff_s=0.05,
        max_backoff_s=0.2,
    )
    watcher = PodWatcher(cfg, Membership())
    standin.no_pool_crd = True
    standin.add_pod("p1", ports(engines["e1"]))
    standin.start_pod("p1")

    async def scenario() -> None:
        watcher.start()
        deadline = time.monotonic() + TIMEOUT
        try:
            while watcher.failures < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert "InferencePool vllm-pool: API error 404" in watcher.last_error
            assert watcher.membership.members == {} and watcher.pool is not None
            assert not watcher.pool.connected
            standin.no_pool_crd = False  # installed, and the pool applied
            standin.put_pool("vllm-pool", {"app": "vllm"}, [ports(engines["e1"])["http"]])
            while "p1" not in watcher.membership.members:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert watcher.pool.connected and watcher.pool.exists
        finally:
            await watcher.stop()
        assert watcher.pool._task is None  # the pod watch stopped with it

    asyncio.run(scenario())
