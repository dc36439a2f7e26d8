"""The router's configuration: a TOML file decoded into typed structs with documented defaults.

Every struct here is mirrored by the README's configuration table. A config error stops start-up
with a :class:`ConfigError` whose message names the key and the problem, e.g.
``backends[1].dp_size: Expected `int`, got `str```.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from index.kvindex import IndexConfig
from index.subscriber import SubscriberConfig
from router.cluster.config import ClusterConfig, ClusterError, validate_cluster
from router.decision.policy import POLICIES, PolicyConfig
from router.fleet.breaker import BreakerConfig
from router.observe.checks import ChecksConfig
from router.pd.config import PDConfig


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key (``field``: the offending field
    of a backend, for the admin API's 400 answer)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HTTP server and proxy settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 16 * 1024 * 1024
    """Requests with larger bodies get 413, as soon as it is known: their content-length, else the
    bytes held so far (a chunked body is held in one buffer, so 2-byte chunks cost what they weigh,
    not the 28 times a list of them did)."""
    head_timeout_s: float = 10.0
    """A request's whole head (request line and headers) must arrive within this long of its first
    byte, else 408 and the connection is closed; a new connection that sends nothing for this long
    is closed. A deadline for the whole head, not for the silence between bytes: a client sending a
    byte a second (slowloris) held its connection, and a slot of ``max_client_connections``, for
    ever. A head is at most 64 KiB: any real client sends it in milliseconds."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive within this long of its head, else 408 and the connection
    is closed, so that a body trickled in cannot hold its buffer and its connection without end. At
    the default ``max_body_bytes`` that asks 2.2 Mbit/s of a client sending the largest body."""
    max_client_connections: int = 10_000
    """Open client connections per router process; a connection past it is answered 503 (with
    Retry-After) and closed. Lowered at start to what the file descriptor limit can hold (which the
    router first raises to the hard limit): half of what remains after a reserve of up to 256,
    since every client connection may hold a backend connection too. Without a cap, the connections
    an idle crowd opened used the descriptors up, and accept() then reset new clients unanswered
    (kvrouter_fd_limit, kvrouter_open_fds and kvrouter_client_connections show the headroom)."""
    connect_timeout_s: float = 5.0
    """Connecting to a backend; a failure is retried once on the next-best candidate, then 502."""
    read_timeout_s: float = 600.0
    """Longest silence between two chunks of a streamed response; 504 before the first byte."""
    max_connections: int = 256
    """Idle keep-alive connections kept per backend (the proxy's own HTTP/1.1 pool)."""
    keepalive_expiry_s: float = 4.0
    """Idle connections older than this are not reused (vLLM's uvicorn closes them after 5 s)."""
    drain_timeout_s: float = 30.0
    """On shutdown, in-flight requests and streams get this long to finish."""
    write_timeout_s: float = 60.0
    """A client that reads nothing of its response for this long is disconnected (and its upstream
    request cancelled), so a stuck client cannot pin a stream and its engine slot forever."""
    keepalive_timeout_s: float = 75.0
    """Idle client connections are closed after this long. Longer than the common clients' own
    expiry (httpx and the openai client: 5 s) so that the client, not the router, closes first."""
    forward_kv_report_mode: bool = False
    """Pass a request's ``vllm_xargs.kv_cache_report_mode`` on to the engine. Off (the default), the
    router removes it: with ``"full"`` vLLM announces the request's cached prefix again as new
    BlockStored events that no BlockRemoved ever matches, so every such request would add a
    reference the engine's eviction never takes back, and those blocks would stay in the index as
    cached after the engine evicted them (predicted hits that are not there). On only for a
    fleet where another consumer of the events needs it (counted: kvrouter_kv_report_mode_removed_total)."""
    log_level: str = "info"
    access_log: bool = False
    workers: int = 1
    """Router processes sharing the port (SO_REUSEPORT). Each runs the whole router with its own
    index copy (every process subscribes to every engine); in-flight load is shared between them and
    /metrics and the dashboard sum them, but predict-on-route stays per process. One process
    saturates near 7k proxied req/s on the reference box; 2 processes gave +25-35% there
    (BENCHMARKS.md). Needs connect-mode KV events (kv_bind = false): only one process can bind."""


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Active health checks (GET /health) and optional engine metrics scraping."""

    interval_s: float = 5.0
    timeout_s: float = 2.0
    """Bound on each probe request (``/health``, ``/v1/models``, ``/metrics``), connect included."""
    unhealthy_after: int = 2
    """Consecutive failed checks before a backend is skipped (its index is kept)."""
    scrape_metrics: bool = False
    """Also read vllm:num_requests_waiting/running and kv_cache_usage_perc from each engine's /metrics."""
    breaker: BreakerConfig = BreakerConfig()


Role = Literal["both", "prefill", "decode"]
"""What an engine does in a prefill/decode disaggregated fleet; "both" is an ordinary engine."""


class BackendConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM engine (all its DP ranks): a ``[[backends]]`` table, an admin API body, or what
    Kubernetes discovery read from a pod."""

    name: str
    url: str
    """Base URL of the engine's OpenAI server, e.g. http://10.0.0.5:8000."""
    kv_events: str | None = None
    """Engine's KV event PUB endpoint for rank 0 (rank r at port + r), e.g. tcp://10.0.0.5:5557.
    None: no events from this engine (routed by load only)."""
    kv_replay: str | None = None
    """Engine's replay ROUTER endpoint for rank 0 (rank r at port + r); enables gap recovery."""
    kv_bind: bool = False
    """True when the engine's endpoint has no ``*`` and connects to us: kv_events is then the address
    we bind (rank r at port + r)."""
    kv_topic: str | None = None
    """Topic the engine publishes; default: the top-level ``kv_topic``."""
    dp_size: int = 1
    """Data-parallel ranks; the chosen rank goes upstream as the X-data-parallel-rank header."""
    models: list[str] | None = None
    """Models served; default: read from the backend's /v1/models (and refreshed with health checks)."""
    api_key: str | None = None
    """Bearer key the backend expects, if any (clients' keys are never forwarded)."""
    role: Role = "both"
    """"both" (default: prefill and decode on this engine), "prefill" or "decode" (P/D disaggregation)."""


class KubernetesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pod discovery: every Ready, non-terminating pod matching the selector is a backend (README,
    "Kubernetes discovery", lists the annotations that override these defaults per pod)."""

    enabled: bool = False
    namespace: str = ""
    """Namespace to watch; "" = the router's own namespace when in a cluster, else "default"."""
    label_selector: str = ""
    """Label selector of the engine pods, e.g. ``app=vllm`` (required when enabled)."""
    kubeconfig: str = ""
    """Path of a kubeconfig for running outside the cluster; "" = the in-cluster service account,
    else $KUBECONFIG or ~/.kube/config."""
    context: str = ""
    """kubeconfig context; "" = its current context."""
    http_port: str = "http"
    """Container port (name or number) of vLLM's OpenAI server."""
    kv_events_port: str = "kv-events"
    """Container port (name or number) of rank 0's KV event publisher; "" = no events."""
    kv_replay_port: str = "kv-replay"
    """Container port (name or number) of rank 0's replay socket; "" or absent = no replay."""
    dp_size: int = 1
    role: Role = "both"
    models: list[str] | None = None
    kv_topic: str | None = None
    api_key: str | None = None
    """Bearer key the engines expect (KVROUTER_BACKEND_API_KEY overrides it, for a Secret)."""
    backoff_s: float = 1.0
    """First reconnect delay after the watch fails (doubles up to ``max_backoff_s``)."""
    max_backoff_s: float = 30.0
    watch_timeout_s: float = 290.0
    """Server-side timeout of one watch request; the watch is then resumed from its resourceVersion."""


class MembershipConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the fleet may change at run time (README, "A fleet that changes")."""

    watch_config: bool = True
    """Re-read the config file when it changes on disk (it is always re-read on SIGHUP)."""
    watch_interval_s: float = 2.0
    """How often the file's modification time and size are checked."""
    join_timeout_s: float = 10.0
    """A joining backend that answers its health probe becomes ready when its event streams finished
    their bootstrap replay, or after this long whatever the replay does."""
    drain_timeout_s: float = 600.0
    """A draining backend is removed when its in-flight requests finish, or after this long (the
    requests still running then are not cut: they end on their own)."""
    kubernetes: KubernetesConfig = KubernetesConfig()


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole file."""

    backends: list[BackendConfig] = []
    """The static fleet (may be empty when Kubernetes discovery or the admin API fills it)."""
    block_size: int | None = 16
    """Engines' block size; checked against events (None: learn it from them)."""
    tokenizer: str | None = None
    """HF tokenizer.json or model directory used for every model (chat template read from it)."""
    tokenizers: dict[str, str] = {}
    """Per-model tokenizer paths, overriding ``tokenizer``."""
    tokenizer_cache_mib: float = 32.0
    """Memory for the token ids of prompt text segments (between added tokens), per tokenizer and
    worker, so that resent messages are not tokenized again (router.decision.segments); 0: off."""
    remote_tokenize: bool = True
    """Without a local tokenizer, ask the backend's POST /tokenize (one call per request)."""
    tokenizer_max_chars: int = 2 << 20
    """Prompt text longer than this (characters; a chat request's after its template) is not
    tokenized by the router: routed on load only, the engine still gets the whole request. ~500k
    tokens of English text, more than most models' context; tokenizing holds ~300 bytes per token
    while it runs and ~40 ms of GIL-held work per million tokens (their id list, block keys), so a
    16 MiB prompt cost GBs and stalled the loop."""
    kv_topic: str = ""
    api_keys: list[str] = []
    """Bearer keys accepted from clients; empty: no authentication."""
    admin_keys: list[str] = []
    """Bearer keys of the admin API (/admin/...); empty: the admin API is off (404)."""
    auth_exempt_probes: bool = True
    """Let /health and /ready through without a key (Kubernetes probes send none)."""
    server: ServerConfig = ServerConfig()
    health: HealthConfig = HealthConfig()
    policy: PolicyConfig = PolicyConfig()
    index: IndexConfig = IndexConfig()
    recent_decisions: int = 50
    """Decisions kept for the dashboard."""
    membership: MembershipConfig = MembershipConfig()
    checks: ChecksConfig = ChecksConfig()
    cluster: ClusterConfig = ClusterConfig()
    """Router replicas sharing load, predictions and session pins (router/cluster)."""
    pd: PDConfig = PDConfig()
    """Prefill/decode disaggregation, for models served by ``role = "prefill"`` engines."""


_PATH_RE = re.compile(r"\$\.?(.*)$")


def _key_path(msg: str) -> tuple[str, str]:
    """Split msgspec's "... - at `$.a[0].b`" into (a[0].b, message)."""
    if " - at `" in msg:
        text, _, where = msg.rpartition(" - at `")
        m = _PATH_RE.match(where.rstrip("`"))
        return (m.group(1) if m else where.rstrip("`")) or "(top level)", text
    return "(top level)", msg


def parse_config(data: dict[str, Any]) -> RouterConfig:
    """Validate a decoded TOML document."""
    try:
        cfg = msgspec.convert(data, RouterConfig, strict=True)
    except msgspec.ValidationError as exc:
        key, text = _key_path(str(exc))
        for prefix, what in (
            ("Object contains unknown field", "unknown key"),
            ("Object missing required", "required"),
        ):
            if text.startswith(prefix):
                field = text.split("`")[1] if "`" in text else text
                raise ConfigError(f"{key + '.' if key != '(top level)' else ''}{field}: {what}") from None
        raise ConfigError(f"{key}: {text}") from None
    validate(cfg)
    return cfg


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


def validate_backend(b: BackendConfig, where: str) -> None:
    """The checks one backend must pass, wherever it comes from (file, admin API, discovery)."""
    if not b.name:
        raise ConfigError(f"{where}.name: must not be empty", "name")
    if not _NAME_RE.match(b.name):
        raise ConfigError(
            f"{where}.name: {b.name!r} must be 1-128 letters, digits or . _ : @ - (it is used in "
            "URLs, metric labels and headers)",
            "name",
        )
    if not re.match(r"^https?://[^/\s]+", b.url):
        raise ConfigError(f"{where}.url: {b.url!r} is not an http(s) URL", "url")
    if b.dp_size < 1:
        raise ConfigError(f"{where}.dp_size: must be >= 1", "dp_size")
    for key in ("kv_events", "kv_replay"):
        ep = getattr(b, key)
        if ep is not None and not re.match(r"^(tcp|ipc|inproc)://", ep):
            raise ConfigError(f"{where}.{key}: {ep!r} is not a ZMQ endpoint (tcp://host:port)", key)
        if ep is not None and b.dp_size > 1 and not ep.startswith(("tcp://", "inproc://")):
            raise ConfigError(f"{where}.{key}: DP ranks need tcp:// or inproc:// (vLLM offsets ports)", key)
        if ep is not None and ep.startswith("tcp://") and not re.search(r":\d+$", ep):
            raise ConfigError(f"{where}.{key}: {ep!r} has no port", key)
        if ep is not None and ep.startswith("tcp://*") and (key == "kv_replay" or not b.kv_bind):
            # (the engine's own bind address pasted in: ZMQ refuses to connect to it)
            raise ConfigError(
                f"{where}.{key}: {ep!r} is the engine's bind address; give the engine's host "
                f"(e.g. {ep.replace('*', '10.0.0.5', 1)}), or set kv_bind = true if the router binds",
                key,
            )
    if b.kv_replay is not None and b.kv_events is None:
        raise ConfigError(f"{where}.kv_replay: set without kv_events", "kv_replay")
    if b.models is not None and not all(m for m in b.models):
        raise ConfigError(f"{where}.models: model names must not be empty", "models")


def parse_backend(data: Any, name: str, workers: int = 1) -> BackendConfig:
    """A backend from a JSON object holding a ``[[backends]]`` table's fields, named ``name`` (the
    admin API's PUT body); raises ConfigError naming the offending field."""
    if not isinstance(data, dict):
        raise ConfigError("the body must be a JSON object with the fields of a [[backends]] table")
    if "name" in data and data["name"] != name:
        raise ConfigError(f"name: {data['name']!r} differs from the name in the path ({name!r})", "name")
    try:
        b = msgspec.convert({**data, "name": name}, BackendConfig, strict=True)
    except msgspec.ValidationError as exc:
        key, text = _key_path(str(exc))
        if text.startswith("Object contains unknown field"):
            field = text.split("`")[1] if "`" in text else text
            raise ConfigError(f"{field}: unknown key", field) from None
        if text.startswith("Object missing required"):
            field = text.split("`")[1] if "`" in text else text
            raise ConfigError(f"{field}: required", field) from None
        bad = key.split(".")[0].split("[")[0] if key != "(top level)" else None
        raise ConfigError(f"{key}: {text}", bad) from None
    validate_backend(b, "backend")
    if workers > 1 and b.kv_bind:
        raise ConfigError("kv_bind: bind-mode KV events need server.workers = 1", "kv_bind")
    return b


def validate(cfg: RouterConfig) -> None:
    """Checks msgspec's types cannot express."""
    k8s = cfg.membership.kubernetes
    if not cfg.backends and not k8s.enabled and not cfg.admin_keys:
        raise ConfigError(
            "backends: at least one [[backends]] entry is required (or membership.kubernetes.enabled, "
            "or admin_keys to add backends at run time)"
        )
    seen: set[str] = set()
    for i, b in enumerate(cfg.backends):
        where = f"backends[{i}]"
        validate_backend(b, where)
        if b.name in seen:
            raise ConfigError(f"{where}.name: duplicate backend name {b.name!r}", "name")
        seen.add(b.name)
    if k8s.enabled and not k8s.label_selector:
        raise ConfigError("membership.kubernetes.label_selector: required when discovery is enabled")
    if k8s.dp_size < 1:
        raise ConfigError("membership.kubernetes.dp_size: must be >= 1")
    if k8s.backoff_s <= 0 or k8s.max_backoff_s < k8s.backoff_s or k8s.watch_timeout_s <= 0:
        raise ConfigError(
            "membership.kubernetes: backoff_s > 0, max_backoff_s >= backoff_s and watch_timeout_s > 0"
        )
    m = cfg.membership
    if m.watch_interval_s < 0.05 or m.join_timeout_s < 0 or m.drain_timeout_s < 0:
        raise ConfigError("membership: watch_interval_s >= 0.05, join_timeout_s and drain_timeout_s >= 0")
    overlap = set(cfg.api_keys) & set(cfg.admin_keys)
    if overlap:
        raise ConfigError("admin_keys: a key is also in api_keys (admin keys must be distinct)")
    if cfg.block_size is not None and not 1 <= cfg.block_size <= 4096:
        raise ConfigError("block_size: must be between 1 and 4096")
    if not 1 <= cfg.index.subscriber.io_threads <= 64:
        raise ConfigError("index.subscriber.io_threads: must be between 1 and 64")
    if cfg.policy.name not in POLICIES:
        raise ConfigError(f"policy.name: must be one of {', '.join(POLICIES)}")
    pol = cfg.policy
    for key in ("gpu_credit", "cpu_credit", "storage_credit", "predicted_credit", "load_weight",
                "decode_weight", "waiting_weight", "temperature"):  # fmt: skip
        value = getattr(pol, key)
        if not math.isfinite(value) or value < 0:  # (NaN compares false both ways: scores undefined)
            raise ConfigError(f"policy.{key}: must be a finite number >= 0")
    if not 0.0 <= pol.min_match_ratio <= 1.0:  # (false for NaN)
        raise ConfigError("policy.min_match_ratio: must be between 0 and 1")
    if cfg.pd.min_uncached_tokens < 0 or cfg.pd.max_prefill_queue_tokens < 0:
        raise ConfigError("pd: min_uncached_tokens and max_prefill_queue_tokens must be >= 0")
    if cfg.pd.prefill_timeout_s <= 0:
        raise ConfigError("pd.prefill_timeout_s: must be positive")
    if not 0 < cfg.server.port < 65536:
        raise ConfigError("server.port: must be between 1 and 65535")
    if cfg.server.max_body_bytes < 1024:
        raise ConfigError("server.max_body_bytes: must be at least 1024")
    if cfg.server.log_level not in ("debug", "info", "warning", "error", "critical"):
        raise ConfigError("server.log_level: must be debug, info, warning, error or critical")
    for key in ("connect_timeout_s", "read_timeout_s", "keepalive_expiry_s"):
        if getattr(cfg.server, key) <= 0:
            raise ConfigError(f"server.{key}: must be positive")
    if not 1 <= cfg.server.workers <= 63:  # (a worker is one bit of a signed 64-bit board cell)
        raise ConfigError("server.workers: must be between 1 and 63")
    if cfg.server.workers > 1:
        for i, b in enumerate(cfg.backends):
            if b.kv_bind:
                raise ConfigError(
                    f"backends[{i}].kv_bind: bind-mode KV events need server.workers = 1 "
                    "(only one process can bind the address); use connect mode with several workers"
                )
    for key in ("head_timeout_s", "body_timeout_s"):
        if not getattr(cfg.server, key) > 0:  # (false for NaN too)
            raise ConfigError(f"server.{key}: must be positive")
    if cfg.server.max_client_connections < 1:
        raise ConfigError("server.max_client_connections: must be at least 1")
    if cfg.server.drain_timeout_s < 0:
        raise ConfigError("server.drain_timeout_s: must not be negative")
    if cfg.health.interval_s < 0.1 or cfg.health.timeout_s <= 0 or cfg.health.unhealthy_after < 1:
        raise ConfigError("health: interval_s must be >= 0.1, timeout_s > 0 and unhealthy_after >= 1")
    if cfg.tokenizer_max_chars < 1:
        raise ConfigError("tokenizer_max_chars: must be at least 1")
    if not 0 <= cfg.tokenizer_cache_mib <= 65536:
        raise ConfigError("tokenizer_cache_mib: must be between 0 (off) and 65536")
    for key in ("tokenizer",):
        path = getattr(cfg, key)
        if path is not None and not Path(path).exists():
            raise ConfigError(f"{key}: {path!r} does not exist")
    for model, path in cfg.tokenizers.items():
        if not Path(path).exists():
            raise ConfigError(f"tokenizers.{model}: {path!r} does not exist")
    try:  # [cluster] (router/cluster)
        validate_cluster(cfg.cluster)
    except ClusterError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a TOML file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse_config(data)


def with_overrides(cfg: RouterConfig, **values: Any) -> RouterConfig:
    """Apply command-line / environment overrides (None values are ignored)."""
    server = cfg.server
    for key, kind in (("host", str), ("port", int), ("log_level", str), ("workers", int)):
        value = values.get(key)
        if value is None:
            continue
        try:
            server = msgspec.structs.replace(server, **{key: kind(value)})
        except ValueError:
            raise ConfigError(f"server.{key}: {value!r} is not a whole number") from None
    policy = cfg.policy
    if values.get("policy") is not None:
        policy = msgspec.structs.replace(policy, name=values["policy"])
    keys = {}
    for key in ("api_keys", "admin_keys"):
        if values.get(key):
            keys[key] = [k.strip() for k in values[key].split(",") if k.strip()]
    out = msgspec.structs.replace(cfg, server=server, policy=policy, **keys)
    validate(out)
    return out


def env_overrides() -> dict[str, Any]:
    """KVROUTER_HOST, KVROUTER_PORT, KVROUTER_POLICY, KVROUTER_API_KEYS, KVROUTER_ADMIN_KEYS,
    KVROUTER_LOG_LEVEL, KVROUTER_WORKERS."""
    return {
        "admin_keys": os.environ.get("KVROUTER_ADMIN_KEYS"),
        "host": os.environ.get("KVROUTER_HOST"),
        "port": os.environ.get("KVROUTER_PORT"),
        "policy": os.environ.get("KVROUTER_POLICY"),
        "api_keys": os.environ.get("KVROUTER_API_KEYS"),
        "log_level": os.environ.get("KVROUTER_LOG_LEVEL"),
        "workers": os.environ.get("KVROUTER_WORKERS"),
    }


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's rule for DP rank r: tcp port + r, inproc suffix ``_dp{r}``; rank 0 unchanged."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    m = re.match(r"^(tcp://.*):(\d+)$", endpoint)
    if not m:
        raise ConfigError(f"{endpoint!r}: DP ranks need a tcp:// endpoint with a port")
    port = int(m.group(2))
    return endpoint if port == 0 else f"{m.group(1)}:{port + rank}"


__all__ = [
    "BackendConfig",
    "ClusterConfig",
    "ConfigError",
    "HealthConfig",
    "IndexConfig",
    "KubernetesConfig",
    "MembershipConfig",
    "PDConfig",
    "Role",
    "RouterConfig",
    "ServerConfig",
    "SubscriberConfig",
    "env_overrides",
    "load_config",
    "parse_backend",
    "parse_config",
    "rank_endpoint",
    "validate_backend",
    "with_overrides",
]
