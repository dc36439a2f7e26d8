"""A stand-in for the Kubernetes API server's pod and InferencePool list and watch endpoints, for
discovery tests.

No real cluster runs here, so discovery is tested against this: it serves exactly the JSON the API
server serves for ``GET /api/v1/namespaces/{ns}/pods`` (a ``PodList`` with
``metadata.resourceVersion``; label selectors with =, ==, !=, in, notin, exists and !exists) and for
the same path with ``watch=1`` (newline-delimited ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR,
"object": ...}``, from a ``resourceVersion``, ending after ``timeoutSeconds``; BOOKMARK only when
``allowWatchBookmarks`` asks for it; a version older than the retained history is answered with an
ERROR event holding a ``Status`` of code 410, reason ``Expired``, as the real server does). Tests
drive pod lifecycles (Pending -> Running/Ready -> readiness flaps -> Terminating -> deleted, IP
changes), expire the history, and drop watch connections.

InferencePools (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``) are served the
same way at ``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`` (an
``InferencePoolList``; list and watch, ``fieldSelector=metadata.name=...``), sharing the server's
resourceVersion sequence and history with the pods, as one API server does.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from harness import ThreadedServer

TOKEN = "standin-service-account-token"
POOL_API = "inference.networking.k8s.io/v1"


def field_matches(selector: str, obj: dict[str, Any]) -> bool:
    """``metadata.name`` / ``metadata.namespace`` field selectors (= and ==; != too), the ones the
    API server supports on every resource."""
    for part in (p.strip() for p in selector.split(",")):
        if not part:
            continue
        m = re.match(r"^metadata\.(name|namespace)\s*(==|=|!=)\s*(\S*)$", part)
        if m is None:
            raise ValueError(f"unsupported field selector {part!r}")
        equal = obj["metadata"].get(m.group(1)) == m.group(3)
        if equal != (m.group(2) != "!="):
            return False
    return True


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """The API server's label selector semantics (equality- and set-based)."""
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part.startswith("!"):
            if part[1:].strip() in labels:
                return False
            continue
        m = re.match(r"^([\w./-]+)\s+(in|notin)\s*\(([^)]*)\)$", part)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            has = labels.get(m.group(1)) in values
            if has != (m.group(2) == "in"):
                return False
            continue
        m = re.match(r"^([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)$", part)
        if m:
            equal = labels.get(m.group(1)) == m.group(3)
            if equal != (m.group(2) != "!="):
                return False
            continue
        if part not in labels:
            return False
    return True


class KubeStandIn:
    """The pod endpoints of one API server; every mutation runs on the server's own event loop."""

    def __init__(self) -> None:
        self.version = 100
        self.oldest = 100  # watches from an older version get 410
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.pools: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.watchers: set[asyncio.Queue[tuple[str, dict[str, Any]] | None]] = set()
        self.requests: list[str] = []
        self.refuse = False  # answer 500 to everything (an outage)
        self.refuse_watches = False  # lists work, watches get 403 (RBAC without watch; a proxy)
        self.fail_watches = 0  # the next this many watch requests get 500 (a blip of the API server)
        self.silent_watches = False
        """Watches are accepted, then nothing comes, past their timeout: a link that died without a
        FIN or RST (a control-plane node or a load balancer gone)."""
        self.bookmarks = False
        self.no_pool_crd = False
        """InferencePools answer 404, as a cluster without the Inference Extension's CRDs does."""
        """Send BOOKMARKs even when not asked (a client must tolerate them; kvrouter's does not ask)."""
        self.server = ThreadedServer(self._app()).start()
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self._call(self._close_watches)
        self.server.stop()

    def kubeconfig(self, path: Any, namespace: str = "engines") -> None:
        """A kubeconfig file pointing at this stand-in (no TLS; a bearer token it checks)."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                    "contexts": [
                        {
                            "name": "standin",
                            "context": {"cluster": "standin", "namespace": namespace, "user": "router"},
                        }
                    ],
                    "current-context": "standin",
                    "users": [{"name": "router", "user": {"token": TOKEN}}],
                }
            )
        )

    # --- driving it from a test (any thread) -----------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        loop = self.loop
        if loop is None:  # no request served yet: nothing runs on the server's loop
            return fn(*args)
        done = threading.Event()
        out: list[Any] = []

        def run() -> None:
            out.append(fn(*args))
            done.set()

        loop.call_soon_threadsafe(run)
        if not done.wait(10):
            raise RuntimeError("stand-in loop did not run the change")
        return out[0]

    def add_pod(
        self,
        name: str,
        ports: dict[str, int],
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        namespace: str = "engines",
    ) -> None:
        """A new pod: Pending, no IP yet."""
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": _now(),
                "labels": dict(labels or {"app": "vllm"}),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:latest",
                        "ports": [
                            {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()
                        ],
                    }
                ],
                "nodeName": "node-1",
            },
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]},
        }
        self._call(self._put, "ADDED", pod)

    def start_pod(self, name: str, ip: str = "127.0.0.1", namespace: str = "engines") -> None:
        """Running with an IP and Ready."""

        def change(pod: dict[str, Any]) -> None:
            pod["status"] = {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "hostIP": "10.1.0.1",
                "startTime": _now(),
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": _now()},
                    {"type": "Ready", "status": "True", "lastTransitionTime": _now()},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": _now()},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()},
                ],
            }

        self._call(self._modify, namespace, name, change)

    def set_ready(self, name: str, ready: bool, namespace: str = "engines") -> None:
        def change(pod: dict[str, Any]) -> None:
            for cond in pod["status"]["conditions"]:
                if cond["type"] in ("Ready", "ContainersReady"):
                    cond["status"] = "True" if ready else "False"
                    cond["lastTransitionTime"] = _now()

        self._call(self._modify, namespace, name, change)

    def set_annotation(self, name: str, key: str, value: str, namespace: str = "engines") -> None:
        def change(pod: dict[str, Any]) -> None:
            pod["metadata"]["annotations"][key] = value

        self._call(self._modify, namespace, name, change)

    def terminate(self, name: str, namespace: str = "engines") -> None:
        """kubectl delete: deletionTimestamp set, the pod still listed while it shuts down."""

        def change(pod: dict[str, Any]) -> None:
            pod["metadata"]["deletionTimestamp"] = _now()
            pod["metadata"]["deletionGracePeriodSeconds"] = 30

        self._call(self._modify, namespace, name, change)

    def delete(self, name: str, namespace: str = "engines") -> None:
        """The pod object is gone."""
        self._call(self._delete, namespace, name)

    def put_pool(
        self,
        name: str,
        match_labels: dict[str, str],
        target_ports: list[int],
        namespace: str = "engines",
    ) -> None:
        """Create an InferencePool, or replace its spec (kubectl apply): ADDED, then MODIFIED."""

        def put() -> None:
            key = (namespace, name)
            old = self.pools.get(key)
            pool: dict[str, Any] = (
                copy.deepcopy(old)
                if old is not None
                else {
                    "apiVersion": POOL_API,
                    "kind": "InferencePool",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "uid": str(uuid.uuid4()),
                        "creationTimestamp": _now(),
                        "generation": 0,
                        "labels": {},
                    },
                }
            )
            pool["metadata"]["generation"] += 1
            pool["spec"] = {
                "selector": {"matchLabels": dict(match_labels)},
                "targetPorts": [{"number": n} for n in target_ports],
                "endpointPickerRef": {"name": "kvrouter-epp", "port": {"number": 9002}},
            }
            pool["status"] = {"parents": []}
            self._bump(pool)
            self.pools[key] = pool
            self._emit("MODIFIED" if old is not None else "ADDED", pool)

        self._call(put)

    def delete_pool(self, name: str, namespace: str = "engines") -> None:
        def delete() -> None:
            pool = self.pools.pop((namespace, name))
            self._bump(pool)
            self._emit("DELETED", pool)

        self._call(delete)

    def expire(self) -> None:
        """The retained history is compacted: open watches end with 410 Expired, and so does any
        watch from a version before now (clients must relist)."""
        self._call(self._expire)

    def drop_watches(self) -> None:
        """Watch connections break without an event (a network blip, an API server restart)."""
        self._call(self._close_watches)

    # --- state (server loop only) ------------------------------------------------------------------
    def _bump(self, pod: dict[str, Any]) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)

    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(pod)
        self.history.append((self.version, kind, snapshot))
        for q in list(self.watchers):
            q.put_nowait((kind, snapshot))

    def _put(self, kind: str, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._bump(pod)
        self.pods[key] = pod
        self._emit(kind, pod)

    def _modify(self, namespace: str, name: str, change: Any) -> None:
        pod = self.pods[(namespace, name)]
        change(pod)
        self._bump(pod)
        self._emit("MODIFIED", pod)

    def _delete(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name))
        self._bump(pod)
        self._emit("DELETED", pod)

    def _expire(self) -> None:
        self.oldest = self.version + 1
        self.history.clear()
        for q in list(self.watchers):
            q.put_nowait(("ERROR", self._gone(self.version)))
            q.put_nowait(None)

    def _close_watches(self) -> None:
        for q in list(self.watchers):
            q.put_nowait(None)

    def _gone(self, asked: int) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {asked} ({self.oldest})",
            "reason": "Expired",
            "code": 410,
        }

    # --- the HTTP API ----------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI()
        standin = self

        @app.get("/api/v1/namespaces/{namespace}/pods")
        async def pods(namespace: str, request: Request) -> Response:
            return await standin._serve("Pod", namespace, request)

        @app.get(f"/apis/{POOL_API}/namespaces/{{namespace}}/inferencepools")
        async def pools(namespace: str, request: Request) -> Response:
            return await standin._serve("InferencePool", namespace, request)

        return app

    async def _serve(self, kind: str, namespace: str, request: Request) -> Response:
        """A list or a watch of one kind of object (Pod, InferencePool) in one namespace."""
        standin = self
        standin.loop = asyncio.get_running_loop()
        standin.requests.append(str(request.url))
        q = request.query_params
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 401}
            return JSONResponse(status, status_code=401)
        if standin.refuse:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500}
            return JSONResponse(status, status_code=500)
        if kind == "InferencePool" and standin.no_pool_crd:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
            return JSONResponse({**status, "reason": "NotFound", "message": "404 page not found"}, 404)
        selector = q.get("labelSelector", "")
        fields = q.get("fieldSelector", "")
        if q.get("watch") in ("1", "true") and standin.fail_watches > 0:
            standin.fail_watches -= 1
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500}
            return JSONResponse(status, status_code=500)
        if q.get("watch") in ("1", "true") and standin.refuse_watches:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403}
            return JSONResponse(status, status_code=403)
        if q.get("watch") in ("1", "true") and standin.silent_watches:
            return StreamingResponse(standin._silent(), media_type="application/json")
        if q.get("watch") in ("1", "true"):
            since = int(q.get("resourceVersion") or standin.version)
            timeout = float(q.get("timeoutSeconds") or 1800)
            bookmarks = q.get("allowWatchBookmarks") in ("1", "true") or standin.bookmarks
            return StreamingResponse(
                standin._watch(kind, namespace, selector, fields, since, timeout, bookmarks),
                media_type="application/json",
            )
        store = standin.pods if kind == "Pod" else standin.pools
        items = [
            copy.deepcopy(p)
            for (ns, _), p in sorted(store.items())
            if ns == namespace
            and selector_matches(selector, p["metadata"]["labels"])
            and field_matches(fields, p)
        ]
        for item in items:  # a list carries no kind/apiVersion per item
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return JSONResponse(
            {
                "kind": f"{kind}List",
                "apiVersion": "v1" if kind == "Pod" else POOL_API,
                "metadata": {"resourceVersion": str(standin.version)},
                "items": items,
            }
        )

    async def _silent(self) -> AsyncIterator[bytes]:
        while self.silent_watches:
            await asyncio.sleep(0.05)
        return
        yield b""  # (an async generator that sends nothing)

    async def _watch(
        self,
        kind_watched: str,
        namespace: str,
        selector: str,
        fields: str,
        since: int,
        timeout: float,
        bookmarks: bool,
    ) -> AsyncIterator[bytes]:
        def line(kind: str, obj: dict[str, Any]) -> bytes:
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        if since < self.oldest - 1:
            yield line("ERROR", self._gone(since))
            return
        q: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        for version, kind, pod in self.history:
            if version > since:
                q.put_nowait((kind, pod))
        self.watchers.add(q)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return  # the server-side timeout: the stream simply ends
                try:
                    item = await asyncio.wait_for(q.get(), min(left, 0.5))
                except TimeoutError:
                    if bookmarks:
                        meta = {"resourceVersion": str(self.version)}
                        api = "v1" if kind_watched == "Pod" else POOL_API
                        yield line("BOOKMARK", {"kind": kind_watched, "apiVersion": api, "metadata": meta})
                    continue
                if item is None:
                    return
                kind, pod = item
                if kind == "ERROR":
                    yield line(kind, pod)
                    continue
                if pod["kind"] != kind_watched or pod["metadata"]["namespace"] != namespace:
                    continue
                if not selector_matches(selector, pod["metadata"]["labels"]):
                    continue
                if not field_matches(fields, pod):
                    continue
                yield line(kind, pod)
        finally:
            self.watchers.discard(q)
