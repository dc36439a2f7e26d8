"""Kubernetes pod discovery as a source of membership (``[membership.kubernetes]``).

Pods of one namespace matching a label selector are listed, then watched from the list's
``resourceVersion``; a watch that ends (its server-side timeout) resumes from the last version seen,
an expired version (410 Gone, as a status or as an ERROR event) relists, and any other failure
reconnects after a backoff (``backoff_s`` doubling to ``max_backoff_s``; it starts again only after a
watch ran, so a watch refused at once by a server that lists fine backs off too). A watch silent
for ``watch_timeout_s`` + 30 s relists (a link that died without a FIN or RST). BOOKMARK events only move
the version. Client: lightkube (async, typed models, on httpx), in-cluster service-account auth or a
kubeconfig file.

A pod is a backend (named after the pod) when it is Ready and not terminating:

- it joins when it first becomes Ready;
- a readiness flap (Ready -> not Ready -> Ready) is treated like a failed health check: skipped,
  index kept, back when Ready again; it is *not* a removal;
- a terminating pod (``deletionTimestamp`` set) or a deleted one drains and is removed; a pod whose
  IP or ports change (a StatefulSet pod recreated under its name) re-joins with the new endpoints.

Where a pod's endpoints come from (README, "Kubernetes discovery", has the table): the HTTP, KV event
and replay ports are container ports named by the settings (``http``, ``kv-events``, ``kv-replay``
by default) or numbers; annotations ``kvrouter.io/http-port``, ``kvrouter.io/kv-events-port``,
``kvrouter.io/kv-replay-port`` override them per pod (a name or a number; ``"none"`` turns a stream
off). A pod with no KV-events port named or annotated gets ``kv_events = "auto"``: the engine's
``GET /kv_event_sources`` lists its streams (router/fleet/kvsources.py). ``kvrouter.io/dp-size``,
``kvrouter.io/role`` (or llm-d's label ``llm-d.ai/role``: ``prefill`` | ``decode`` |
``prefill-decode``), ``kvrouter.io/models`` (comma-separated) and
``kvrouter.io/kv-topic`` override the defaults. A pod that cannot be turned into a valid backend
(no IP yet is normal and waits; a missing port or a bad annotation is not) is skipped with one log
line naming it and counted in ``kvrouter_discovery_skipped_total{reason}``; discovery goes on.

With ``inference_pool`` set, the selector and the HTTP port come from a Gateway API InferencePool
instead, and follow it (router/fleet/sources/inferencepool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.config import AUTO, BackendConfig, ConfigError, KubernetesConfig, Role, validate_backend
from router.fleet.membership import Membership
from router.fleet.sources.inferencepool import PoolFollower
from router.fleet.sources.listwatch import list_and_watch

log = logging.getLogger("kvrouter.discovery")

ANNOTATION = "kvrouter.io/"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_ROLES: dict[str, Role] = {
    "both": "both",
    "prefill": "prefill",
    "decode": "decode",
    "prefill-decode": "both",
}
_SELECTOR_PART = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<nkey>[\w./-]+)"
    r"|(?P<key>[\w./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[\w.-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*$"
)


class SkipPod(Exception):
    """This pod cannot be a backend; the message says why (logged with its name)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_selector(selector: str) -> list[tuple[str, Any]]:
    """A label selector string (``a=b,c!=d,e in (f,g),h,!i``) as lightkube's (key, operator) list."""
    try:
        # optional: lightkube only with Kubernetes discovery
        from lightkube import operators
    except ImportError:
        raise ConfigError(
            "membership.kubernetes.enabled needs the Kubernetes client: pip install 'kvrouter[kubernetes]'"
        ) from None

    out: list[tuple[str, Any]] = []
    for part in _split_selector(selector):
        m = _SELECTOR_PART.match(part)
        if m is None or not part.strip():
            raise ConfigError(f"membership.kubernetes.label_selector: cannot parse {part.strip()!r}")
        if m.group("nkey"):
            out.append((m.group("nkey"), operators.not_exists()))
        elif m.group("setop"):
            values = [v.strip() for v in m.group("values").split(",") if v.strip()]
            setop: Any = operators.in_(values) if m.group("setop") == "in" else operators.not_in(values)
            out.append((m.group("key"), setop))
        elif m.group("op"):
            value = m.group("value")
            binop: Any = operators.not_equal(value) if m.group("op") == "!=" else operators.equal(value)
            out.append((m.group("key"), binop))
        else:
            out.append((m.group("key"), operators.exists()))
    return out


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _get(obj: Any, *path: str) -> Any:
    """A nested field of a pod as a plain dict (missing: None)."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def pod_ready(pod: dict[str, Any]) -> bool:
    """Running, condition Ready=True and not terminating."""
    if _get(pod, "metadata", "deletionTimestamp"):
        return False
    if _get(pod, "status", "phase") != "Running":
        return False
    for cond in _get(pod, "status", "conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _container_ports(pod: dict[str, Any]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for c in _get(pod, "spec", "containers") or []:
        for p in (c.get("ports") or []) if isinstance(c, dict) else []:
            if (
                isinstance(p, dict)
                and isinstance(p.get("name"), str)
                and isinstance(p.get("containerPort"), int)
            ):
                ports.setdefault(p["name"], p["containerPort"])
    return ports


def _port(pod: dict[str, Any], ports: dict[str, int], key: str, default: str, required: bool) -> int | None:
    ann = (_get(pod, "metadata", "annotations") or {}).get(f"{ANNOTATION}{key}")
    spec = ann if isinstance(ann, str) else default
    if spec in ("", "none"):
        if required:
            raise SkipPod("missing_port", f"no {key} configured")
        return None
    if spec.isdigit():
        port = int(spec)
        if not 0 < port < 65536:
            raise SkipPod("bad_annotation", f"{key} {spec!r} is not a port number")
        return port
    if spec in ports:
        return ports[spec]
    if required or ann is not None:
        raise SkipPod("missing_port", f"no container port named {spec!r} ({key})")
    return None  # an optional stream the pod does not declare: KV events "auto" / no replay


def pod_backend(
    pod: dict[str, Any],
    cfg: KubernetesConfig,
    default_topic: str | None = None,
    http_port: int | None = None,
) -> BackendConfig:
    """The backend a Ready pod stands for; SkipPod when it cannot be one. ``http_port``: an
    InferencePool's target port, which the gateway sends to whatever the pod says."""
    name = _get(pod, "metadata", "name")
    if not isinstance(name, str) or not name:
        raise SkipPod("bad_pod", "no metadata.name")
    ip = _get(pod, "status", "podIP")
    if not isinstance(ip, str) or not ip:
        raise SkipPod("no_ip", "no pod IP yet")
    host = f"[{ip}]" if ":" in ip else ip
    ann = _get(pod, "metadata", "annotations") or {}
    labels = _get(pod, "metadata", "labels") or {}
    if not isinstance(ann, dict) or not isinstance(labels, dict):
        raise SkipPod("bad_pod", "annotations or labels are not maps")
    ports = _container_ports(pod)
    http = http_port or _port(pod, ports, "http-port", cfg.http_port, required=True)
    kv = _port(pod, ports, "kv-events-port", cfg.kv_events_port, required=False)
    replay = _port(pod, ports, "kv-replay-port", cfg.kv_replay_port, required=False) if kv else None
    kv_ann = ann.get(f"{ANNOTATION}kv-events-port")
    # no KV-events port named or annotated (and not turned off): the engine lists its streams
    auto = kv is None and (kv_ann if isinstance(kv_ann, str) else cfg.kv_events_port) not in ("", "none")
    dp_raw = ann.get(f"{ANNOTATION}dp-size")
    dp_size = cfg.dp_size
    if dp_raw is not None:
        if not isinstance(dp_raw, str) or not dp_raw.isdigit() or int(dp_raw) < 1:
            raise SkipPod("bad_annotation", f"{ANNOTATION}dp-size {dp_raw!r} is not a positive integer")
        dp_size = int(dp_raw)
    role_raw = ann.get(f"{ANNOTATION}role", labels.get("llm-d.ai/role"))
    role: Role = cfg.role
    if role_raw is not None:
        if role_raw not in _ROLES:
            raise SkipPod("bad_annotation", f"role {role_raw!r} is not prefill, decode or both")
        role = _ROLES[role_raw]
    models = cfg.models
    models_raw = ann.get(f"{ANNOTATION}models")
    if models_raw is not None:
        models = [m.strip() for m in str(models_raw).split(",") if m.strip()]
        if not models:
            raise SkipPod("bad_annotation", f"{ANNOTATION}models is empty")
    topic = ann.get(f"{ANNOTATION}kv-topic", cfg.kv_topic)
    api_key = os.environ.get("KVROUTER_BACKEND_API_KEY") or cfg.api_key
    spec = BackendConfig(
        name=name,
        url=f"http://{host}:{http}",
        kv_events=f"tcp://{host}:{kv}" if kv else AUTO if auto else None,
        kv_replay=f"tcp://{host}:{replay}" if kv and replay else None,
        kv_topic=topic if isinstance(topic, str) else default_topic,
        dp_size=dp_size,
        models=models,
        api_key=api_key,
        role=role,
    )
    try:
        validate_backend(spec, f"pod {name}")
    except ConfigError as exc:
        raise SkipPod("invalid", str(exc)) from None
    return spec


class PodWatcher:
    """Keeps the members of origin "kubernetes" equal to the Ready pods (see the module docstring)."""

    def __init__(
        self,
        cfg: KubernetesConfig,
        membership: Membership,
        default_topic: str | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.membership = membership
        self.default_topic = default_topic
        self.selector = parse_selector(cfg.label_selector) if cfg.label_selector else []
        self.selector_text = cfg.label_selector
        """The selector the pods are listed with (an InferencePool's, when following one)."""
        self.http_port: int | None = None
        """The followed InferencePool's target port (None: the pods' own, by ``http_port``)."""
        self._client_factory = client_factory or self._make_client
        self._client: Any = None
        self.namespace = ""
        self.pods: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.skipped: dict[str, int] = {}
        """reason -> pods skipped, for kvrouter_discovery_skipped_total."""
        self.events: dict[str, int] = {}
        """watch event type -> count."""
        self.relists = 0
        self.failures = 0
        self.silences = 0
        self.delivered = False
        """The current watch delivered an event (then its failure starts the backoff anew)."""
        """Watches that went silent for watch_timeout_s + 30 s (then relisted; + watch_timeout_s
        when that is shorter)."""
        self.connected = False
        self.last_error = ""
        self._bad: dict[str, str] = {}  # pod -> last skip message (logged once per change)
        self._task: asyncio.Task[None] | None = None
        self.pool = PoolFollower(self) if cfg.inference_pool else None
        """The InferencePool follower (router/fleet/sources/inferencepool.py), when configured."""

    def client(self) -> Any:
        """The API client (made once; its namespace in ``namespace``)."""
        if self._client is None:
            self._client, self.namespace = self._client_factory()
        return self._client

    def _make_client(self) -> Any:
        # optional: lightkube only with Kubernetes discovery
        from lightkube import AsyncClient, KubeConfig

        if self.cfg.kubeconfig:
            config: Any = KubeConfig.from_file(self.cfg.kubeconfig)
            single = config.get(context_name=self.cfg.context or None)
            namespace = self.cfg.namespace or single.namespace
            return AsyncClient(config=single, namespace=namespace), namespace
        config = KubeConfig.from_env()
        single = config.get(context_name=self.cfg.context or None)
        namespace = self.cfg.namespace or single.namespace
        if not self.cfg.namespace and _SA_NAMESPACE.exists():
            namespace = _SA_NAMESPACE.read_text().strip() or namespace
        return AsyncClient(config=single, namespace=namespace), namespace

    # --- applying pods ---------------------------------------------------------------------------
    def _skip(self, name: str, exc: SkipPod) -> None:
        if self._bad.get(name) != str(exc):
            self._bad[name] = str(exc)
            if exc.reason != "no_ip":
                self.skipped[exc.reason] = self.skipped.get(exc.reason, 0) + 1
                log.warning("pod %s skipped (%s): %s", name, exc.reason, exc)

    def _apply(self, name: str, pod: dict[str, Any] | None, gone: str = "pod deleted") -> None:
        """Bring the member named after a pod in line with the pod (None: deleted, or no longer
        selected: ``gone`` says which, in the membership's transitions)."""
        m = self.membership.get(name)
        ours = m is not None and m.origin == "kubernetes"
        if pod is None or _get(pod, "metadata", "deletionTimestamp"):
            self._bad.pop(name, None)
            if ours:
                self.membership.drain(name, remove=True, reason=gone if pod is None else "pod terminating")
            return
        if not pod_ready(pod):
            if ours and m is not None and m.discovery_ready:
                m.discovery_ready = False  # a readiness flap: skipped like a failed probe, index kept
                log.info("pod %s is not ready: skipped until it is", name)
            return
        try:
            spec = pod_backend(pod, self.cfg, self.default_topic, self.http_port)
        except SkipPod as exc:
            self._skip(name, exc)
            return
        self._bad.pop(name, None)
        if m is not None and m.origin != "kubernetes":
            self._skip(name, SkipPod("name_taken", f"a backend named {name!r} comes from {m.origin}"))
            return
        if m is not None and m.state == "draining" and m.declared == spec:
            # drained by the admin API (discovery drains only pods that terminate or go): a status
            # update of the same pod does not readmit it; a PUT, or the pod's new endpoints, do
            if not m.discovery_ready:
                m.discovery_ready = True
            return
        member, _ = self.membership.upsert(spec, "kubernetes", "pod ready")
        if not member.discovery_ready:
            member.discovery_ready = True
            log.info("pod %s is ready again", name)

    def _resync(self, items: list[dict[str, Any]]) -> None:
        """A fresh list: apply every pod, and remove members whose pod is no longer listed."""
        listed = {}
        for pod in items:
            name = _get(pod, "metadata", "name")
            if isinstance(name, str):
                listed[name] = pod
        for name in list(self.pods):
            if name not in listed:
                self._apply(name, None, "pod not listed")
        for m in list(self.membership.members.values()):
            if m.origin == "kubernetes" and m.name not in listed:
                self._apply(m.name, None, "pod not listed")
        self.pods = listed
        for name, pod in listed.items():
            self._apply(name, pod)

    def on_event(self, kind: str, pod: dict[str, Any]) -> None:
        """One watch event (ADDED | MODIFIED | DELETED; BOOKMARK and ERROR handled by the caller)."""
        self.events[kind] = self.events.get(kind, 0) + 1
        name = _get(pod, "metadata", "name")
        if not isinstance(name, str):
            self.skipped["bad_pod"] = self.skipped.get("bad_pod", 0) + 1
            log.warning("watch event without a pod name skipped")
            return
        if kind == "DELETED":
            self.pods.pop(name, None)
            self._apply(name, None)
        else:
            self.pods[name] = pod
            self._apply(name, pod)

    # --- the list/watch loop ---------------------------------------------------------------------
    async def _list(self, client: Any) -> str:
        # optional: lightkube only with Kubernetes discovery
        from lightkube.resources.core_v1 import Pod

        items = []
        listing = client.list(Pod, namespace=self.namespace, labels=self.selector)
        async for pod in listing:
            items.append(pod.to_dict())
        self._resync(items)
        self.relists += 1
        log.info("kubernetes: %d pods match %r in %s", len(items), self.selector_text, self.namespace)
        self.resource_version = str(listing.resourceVersion)
        return self.resource_version

    async def _watch(self, client: Any, version: str) -> None:
        # optional: lightkube only with Kubernetes discovery
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import on_error_raise

        stream = client.watch(
            Pod,
            namespace=self.namespace,
            labels=self.selector,
            resource_version=version or None,
            server_timeout=int(self.cfg.watch_timeout_s),
            on_error=on_error_raise,  # the loop in run() decides: resume, relist or back off
        ).__aiter__()
        # lightkube reads a watch with no read timeout and resumes it after each server timeout: a
        # connection that died without a FIN or RST (a node or a load balancer gone) would block it
        # for good, with discovery frozen. Silence this long returns (run() relists): a quiet
        # namespace costs a relist every few minutes, a dead link no more than that.
        silent_s = self.cfg.watch_timeout_s + min(30.0, self.cfg.watch_timeout_s)
        while True:
            try:
                kind, pod = await asyncio.wait_for(stream.__anext__(), silent_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                log.info("kubernetes: nothing from the watch for %.0fs: relisting", silent_s)
                self.silences += 1
                return
            self.connected = True
            self.delivered = True
            seen = getattr(getattr(pod, "metadata", None), "resourceVersion", None)
            if seen:
                self.resource_version = str(seen)
            if kind == "BOOKMARK":
                self.events[kind] = self.events.get(kind, 0) + 1
                continue
            self.on_event(kind, pod.to_dict())

    async def run(self) -> None:
        """Follow the pods (or the InferencePool, which follows its pods) forever (cancel to stop)."""
        if self.pool is not None:
            await self.pool.run()
        else:
            await self.watch_pods()

    async def watch_pods(self) -> None:
        """List, then watch the selected pods, forever (cancel to stop)."""
        await list_and_watch("kubernetes", self, self.cfg, self.client, self._list, self._watch, self.failed)

    def remove_all(self, reason: str) -> int:
        """Drain and remove every discovered member (its pool is gone); how many there were."""
        self.pods.clear()
        self._bad.clear()
        gone = [m.name for m in self.membership.members.values() if m.origin == "kubernetes"]
        for name in gone:
            self.membership.drain(name, remove=True, reason=reason)
        return len(gone)

    def failed(self, error: str) -> None:
        """Count and log (rate-limited) one failure of the list/watch; the loop retries."""
        self.failures += 1
        self.last_error = error
        if self.failures <= 5 or self.failures % 100 == 0:
            log.warning("kubernetes discovery failed (%d so far), retrying: %s", self.failures, error)

    def start(self) -> None:
        """Start discovery in the background."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kvrouter-discovery")

    async def stop(self) -> None:
        """Stop discovery (members stay as they are)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["PodWatcher", "SkipPod", "parse_selector", "pod_backend", "pod_ready"]
