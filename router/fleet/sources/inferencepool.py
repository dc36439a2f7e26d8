"""Discovery from a Gateway API InferencePool (``[membership.kubernetes] inference_pool``).

The pool (``inference.networking.k8s.io/v1``, one object named in the discovery namespace) says
which pods the gateway sends to: ``spec.selector.matchLabels`` and ``spec.targetPorts``. Reading it,
rather than repeating its selector and port in kvrouter's config, keeps the picker's fleet the
gateway's fleet when the pool is edited. The pool is listed and watched like the pods (resume on the
watch's timeout, relist on 410 or a silent watch, backoff on failures); the pods it selects are
followed by the ordinary pod watcher (router/fleet/sources/kubernetes.py: readiness, annotations,
KV event ports, ``kv_events = "auto"``), restarted with the new selector whenever the pool's selector
or port changes: its relist removes the pods no longer selected and adds the new ones, and keeps
the pods in both (same endpoints: no re-join). The pool deleted (or absent): every discovered pod
leaves, logged, until it is back.

Only the first target port is a pod's HTTP port: a kvrouter backend is one OpenAI server per pod
(its DP ranks behind that one port), so further ports are logged once and not followed. A pool the
API server would not have admitted (no matchLabels, no port, a bad label or port) is logged,
counted as ``kvrouter_discovery_skipped_total{reason="bad_pool"}`` and ignored: the last good one
stays followed, as a rejected config file keeps the running fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any, Protocol

from router.config import KubernetesConfig
from router.fleet.sources.listwatch import list_and_watch

log = logging.getLogger("kvrouter.discovery")

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
MAX_LABELS = 64
"""More matchLabels than any real pool has; a bound on what one object can make us build."""
MAX_PORTS = 8
"""The API's own limit on ``spec.targetPorts``."""
_LABEL_KEY = re.compile(
    r"(?=.{1,317}$)([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")

Target = tuple[tuple[tuple[str, str], ...], int]
"""(the pool's matchLabels, sorted; its HTTP port): what the pod watch follows."""


class PodWatch(Protocol):
    """What the follower drives of the pod watcher (router/fleet/sources/kubernetes.py PodWatcher)."""

    cfg: KubernetesConfig
    namespace: str
    selector: list[tuple[str, Any]]
    selector_text: str
    http_port: int | None
    connected: bool
    skipped: dict[str, int]

    def client(self) -> Any: ...
    async def watch_pods(self) -> None: ...
    def remove_all(self, reason: str) -> int: ...
    def failed(self, error: str) -> None: ...


class BadPool(Exception):
    """The pool cannot be followed; the message says why."""


def _resource() -> Any:
    # optional: lightkube only with Kubernetes discovery
    from lightkube.generic_resource import create_namespaced_resource

    return create_namespaced_resource(GROUP, VERSION, "InferencePool", "inferencepools")


def pool_target(pool: dict[str, Any]) -> tuple[Target, int]:
    """The pods' selector and HTTP port an InferencePool names, and how many target ports it has."""
    spec = pool.get("spec")
    selector = spec.get("selector") if isinstance(spec, dict) else None
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise BadPool("spec.selector.matchLabels is missing or empty")
    if len(labels) > MAX_LABELS:
        raise BadPool(f"spec.selector.matchLabels has {len(labels)} labels (at most {MAX_LABELS})")
    pairs = []
    for k, v in labels.items():
        if not isinstance(v, str) or not _LABEL_KEY.fullmatch(k) or not _LABEL_VALUE.fullmatch(v):
            raise BadPool(f"spec.selector.matchLabels: {k!r}: {v!r} is not a label")
        pairs.append((k, v))
    ports = spec.get("targetPorts") if isinstance(spec, dict) else None
    if not isinstance(ports, list) or not ports or len(ports) > MAX_PORTS:
        raise BadPool(f"spec.targetPorts must list 1 to {MAX_PORTS} ports")
    first = ports[0].get("number") if isinstance(ports[0], dict) else None
    if not isinstance(first, int) or isinstance(first, bool) or not 0 < first < 65536:
        raise BadPool(f"spec.targetPorts[0].number {first!r} is not a port number")
    return (tuple(sorted(pairs)), first), len(ports)


class PoolFollower:
    """Keeps a PodWatcher on the pods one InferencePool selects (see the module docstring)."""

    def __init__(self, pods: PodWatch) -> None:
        self.pods = pods
        self.name = pods.cfg.inference_pool
        self.target: Target | None = None
        """What the pod watch follows now (None: no pool, no pods)."""
        self.exists = False
        self.connected = False
        self.resource_version = ""
        self.events: dict[str, int] = {}
        self.changes = 0
        """Times the followed selector or port changed (the first pool seen included)."""
        self.relists = 0
        self._bad = ""  # the last rejected pool's message (logged once per change)
        self._ports_logged = 0
        self.delivered = False
        self._task: asyncio.Task[None] | None = None

    @property
    def selector(self) -> str:
        return self.pods.selector_text

    async def apply(self, pool: dict[str, Any] | None) -> None:
        """Follow this version of the pool (None: deleted or absent)."""
        if pool is None:
            self.exists = False
            if self.target is not None or self._task is not None:
                await self._stop_pods()
                self.target = None
                self.changes += 1
                n = self.pods.remove_all(f"InferencePool {self.name} deleted")
                log.warning("InferencePool %s is gone: its %d pods leave", self.name, n)
            return
        self.exists = True
        try:
            target, nports = pool_target(pool)
        except BadPool as exc:
            if str(exc) != self._bad:
                self._bad = str(exc)
                self.pods.skipped["bad_pool"] = self.pods.skipped.get("bad_pool", 0) + 1
                log.warning("InferencePool %s ignored (the last good one stays followed): %s", self.name, exc)
            return
        self._bad = ""
        if nports > 1 and nports != self._ports_logged:
            self._ports_logged = nports
            log.warning(
                "InferencePool %s lists %d target ports: only the first (%d) is followed",
                self.name,
                nports,
                target[1],
            )
        if target == self.target and self._task is not None:
            return
        await self._stop_pods()
        self.target = target
        self.changes += 1
        labels, port = target
        self.pods.selector = list(labels)
        self.pods.selector_text = ",".join(f"{k}={v}" for k, v in labels)
        self.pods.http_port = port
        log.info("InferencePool %s: pods %r on port %d", self.name, self.pods.selector_text, port)
        self._task = asyncio.get_running_loop().create_task(
            self.pods.watch_pods(), name="kvrouter-discovery-pods"
        )

    async def _stop_pods(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self.pods.connected = False

    async def _list(self, client: Any) -> str:
        pool_kind = _resource()
        found: dict[str, Any] | None = None
        listing = client.list(pool_kind, namespace=self.pods.namespace, fields={"metadata.name": self.name})
        async for pool in listing:
            d = pool.to_dict()
            if (d.get("metadata") or {}).get("name") == self.name:
                found = d
        self.relists += 1
        if found is None:
            log.warning(
                "InferencePool %s not found in %s: no pods until it exists", self.name, self.pods.namespace
            )
        await self.apply(found)
        self.resource_version = str(listing.resourceVersion)
        return self.resource_version

    async def _watch(self, client: Any, version: str) -> None:
        """Apply the pool's events until the watch ends or goes silent."""
        # optional: lightkube only with Kubernetes discovery
        from lightkube.types import on_error_raise

        cfg = self.pods.cfg
        stream = client.watch(
            _resource(),
            namespace=self.pods.namespace,
            fields={"metadata.name": self.name},
            resource_version=version or None,
            server_timeout=int(cfg.watch_timeout_s),
            on_error=on_error_raise,
        ).__aiter__()
        silent_s = cfg.watch_timeout_s + min(30.0, cfg.watch_timeout_s)  # (as the pod watch: a dead link)
        while True:
            try:
                kind, pool = await asyncio.wait_for(stream.__anext__(), silent_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                log.info("InferencePool %s: nothing from the watch for %.0fs: relisting", self.name, silent_s)
                return
            self.delivered = True  # the watch works: a failure after this backs off anew
            self.events[kind] = self.events.get(kind, 0) + 1
            seen = getattr(getattr(pool, "metadata", None), "resourceVersion", None)
            if seen:
                self.resource_version = str(seen)
            if kind == "BOOKMARK":
                continue
            d = pool.to_dict()
            if (d.get("metadata") or {}).get("name") != self.name:
                continue  # (the field selector already says so; a server that ignored it)
            await self.apply(None if kind == "DELETED" else d)

    async def run(self) -> None:
        """List, then watch the pool, forever; the pod watch runs beside it (cancel to stop both)."""
        try:
            await list_and_watch(
                f"InferencePool {self.name}",
                self,
                self.pods.cfg,
                self.pods.client,
                self._list,
                self._watch,
                lambda error: self.pods.failed(f"InferencePool {self.name}: {error}"),
            )
        finally:
            await self._stop_pods()


__all__ = ["BadPool", "PoolFollower", "pool_target"]
