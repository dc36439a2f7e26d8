"""The router's configuration: a TOML file decoded into typed structs with documented defaults.

Every struct here is mirrored by the README's configuration table. A config error stops start-up
with a :class:`ConfigError` whose message names the key and the problem, e.g.
``backends[1].dp_size: Expected `int`, got `str```.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect

from index.kvindex import IndexConfig
from index.subscriber import SubscriberConfig
from router.cluster.config import ClusterConfig, ClusterError, validate_cluster
from router.decision.policy import POLICIES, PolicyConfig
from router.fleet.breaker import BreakerConfig
from router.flow.config import FlowConfig, FlowError, validate_flow
from router.observe.checks import ChecksConfig
from router.pd.config import PDConfig


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key (``field``: the offending field
    of a backend, for the admin API's 400 answer)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.key = field or ""
        """The whole key path (``backends[1].dp_size``), when known."""


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HTTP server and proxy settings."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 8000
    """Listen port."""
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
    upstream_max_head_bytes: int = 65536
    """Largest response head (status line and headers, interim 1xx heads included) an engine may
    send; a larger one is a 502 and its connection is closed, after at most this many bytes were
    read. vLLM's heads are ~200 bytes; without a bound an engine streaming headers without end
    grew the router's memory with them (the parser holds a header line whole). The same bound
    applies to a chunked body's framing that carries no data (chunk extensions, trailers)."""
    upstream_max_header_lines: int = 100
    """Most header lines in an engine's response head (vLLM sends about five); more: 502."""
    upstream_head_timeout_s: float = 10.0
    """From the first byte of an engine's response head to its end; longer: 502 and the connection
    closed. An engine writes its head at once, so one that trickles it would hold the request (and
    a client) for nothing; the wait for that first byte (a non-streamed answer is computed whole
    first) is ``read_timeout_s``'s."""
    max_sse_event_bytes: int = 16 * 1024 * 1024
    """Largest unfinished SSE event held while relaying a stream (the router forwards whole events
    only, and reads usage from them); a larger one ends the stream with an error event and closes
    the connection. A vLLM event is one token's delta (under 1 KiB, a few KiB with top logprobs);
    the largest legitimate one carries an echoed prompt's logprobs (~150 bytes per prompt token),
    hence the margin; each stream can hold up to this much."""
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
    """Log level; ``debug`` logs every decision with all its terms."""
    access_log: bool = False
    """One log line per request (logger ``kvrouter.access``)."""
    workers: int = 1
    """Router processes sharing the port (SO_REUSEPORT). Each runs the whole router with its own
    index copy (every process subscribes to every engine); in-flight load is shared between them and
    /metrics and the dashboard sum them, but predict-on-route stays per process. One process
    saturates near 7k proxied req/s on the reference box; 2 processes gave +25-35% there
    on 2 shared cores. Needs connect-mode KV events (kv_bind = false): only one process can bind."""


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Active health checks (GET /health) and optional engine metrics scraping."""

    interval_s: float = 5.0
    """Period of the active ``GET /health`` probe of every backend."""
    timeout_s: float = 2.0
    """Bound on each probe request (``/health``, ``/v1/models``, ``/metrics``), connect included."""
    unhealthy_after: int = 2
    """Consecutive failed checks before a backend is skipped (its index is kept)."""
    scrape_metrics: bool = False
    """Also read vllm:num_requests_waiting/running and kv_cache_usage_perc from each engine's /metrics."""
    kv_sources_refresh_s: float = 30.0
    """A backend with ``kv_events = "auto"`` has its ``GET /kv_event_sources`` read again on a
    successful probe at most this often (besides its first probe and its first one after a failed
    probe, which always read it): that is how a DP size or ports changed by a restart too quick
    for the probes to see are followed. 0: only then."""
    breaker: BreakerConfig = BreakerConfig()


AUTO = "auto"
"""``kv_events = "auto"``: the engine lists its event streams itself (router/fleet/kvsources.py)."""

Role = Literal["both", "prefill", "decode"]
"""What an engine does in a prefill/decode disaggregated fleet; "both" is an ordinary engine."""


class BackendConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM engine (all its DP ranks): a ``[[backends]]`` table, an admin API body, or what
    Kubernetes discovery read from a pod."""

    name: str
    """Unique name of the backend (metric labels, the dashboard, ``/route``)."""
    url: str
    """Base URL of the engine's OpenAI server, e.g. http://10.0.0.5:8000."""
    kv_events: str | None = None
    """Engine's KV event PUB endpoint for rank 0 (rank r at port + r), e.g. tcp://10.0.0.5:5557.
    ``"auto"``: read from the engine's ``GET /kv_event_sources`` (every DP rank it lists, with its
    replay endpoint and topic; that also sets dp_size), again when the engine comes back after a
    failed probe and every ``health.kv_sources_refresh_s``; an engine without that endpoint (404)
    is followed at vLLM's default publisher port, tcp://<url host>:5557 (rank r at 5557 + r),
    without replay, with ``kv_topic`` and this dp_size. None: no events from this engine (routed by
    load only)."""
    kv_replay: str | None = None
    """Engine's replay ROUTER endpoint for rank 0 (rank r at port + r); enables gap recovery (with
    ``kv_events = "auto"`` the engine's listing gives it: leave it unset)."""
    kv_bind: bool = False
    """True when the engine's endpoint has no ``*`` and connects to us: kv_events is then the address
    we bind (rank r at port + r)."""
    kv_topic: str | None = None
    """Topic the engine publishes; default: the top-level ``kv_topic``."""
    dp_size: int = 1
    """Data-parallel ranks; the chosen rank goes upstream as the X-data-parallel-rank header (with
    ``kv_events = "auto"``, until the engine lists its ranks)."""
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
    """Discover engine pods (docs/discovery.md)."""
    namespace: str = ""
    """Namespace to watch; "" = the router's own namespace when in a cluster, else "default"."""
    label_selector: str = ""
    """Label selector of the engine pods, e.g. ``app=vllm`` (this or ``inference_pool`` is required
    when enabled)."""
    inference_pool: str = ""
    """Name of a Gateway API InferencePool (``inference.networking.k8s.io/v1``) in ``namespace`` whose
    pods are the fleet, instead of ``label_selector`` (set one of the two): its
    ``spec.selector.matchLabels`` select the pods and its first ``spec.targetPorts`` number is their
    HTTP port, overriding ``http_port`` and the ``kvrouter.io/http-port`` annotation (the gateway
    sends there). Changes to the pool are followed; the pool deleted, its pods leave. Needs get, list
    and watch on ``inferencepools``."""
    kubeconfig: str = ""
    """Path of a kubeconfig for running outside the cluster; "" = the in-cluster service account,
    else $KUBECONFIG or ~/.kube/config."""
    context: str = ""
    """kubeconfig context; "" = its current context."""
    http_port: str = "http"
    """Container port (name or number) of vLLM's OpenAI server."""
    kv_events_port: str = "kv-events"
    """Container port (name or number) of rank 0's KV event publisher; "" = no events. A pod that
    declares no port of that name (nor a ``kvrouter.io/kv-events-port`` annotation) gets
    ``kv_events = "auto"``: its engine's ``GET /kv_event_sources`` says where its streams are."""
    kv_replay_port: str = "kv-replay"
    """Container port (name or number) of rank 0's replay socket; "" or absent = no replay."""
    dp_size: int = 1
    """Default DP size of a pod (the ``kvrouter.io/dp-size`` annotation overrides it)."""
    role: Role = "both"
    """Default role (the ``kvrouter.io/role`` annotation or the ``llm-d.ai/role`` label override it)."""
    models: list[str] | None = None
    """Models the pods serve; default: read from each pod's /v1/models (``kvrouter.io/models`` overrides)."""
    kv_topic: str | None = None
    """The pods' KV event topic; default: the top-level ``kv_topic``."""
    api_key: str | None = None
    """Bearer key the engines expect (KVROUTER_BACKEND_API_KEY overrides it, for a Secret)."""
    backoff_s: float = 1.0
    """First reconnect delay after the watch fails (doubles up to ``max_backoff_s``)."""
    max_backoff_s: float = 30.0
    """Longest reconnect delay of the watch."""
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


class EppConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """kvrouter as a Gateway API Inference Extension endpoint picker (docs/gateway.md): an Envoy
    ext_proc gRPC server beside the HTTP front door, deciding with the same code as the proxy and
    ``/route``. Off by default: without a gateway in front nothing would call it."""

    enabled: bool = False
    """Start the picker's gRPC ports with ``kvrouter serve``."""
    host: str = "127.0.0.1"
    """Listen address of both gRPC ports ("0.0.0.0" in a pod, where the gateway is another host)."""
    port: int = 9002
    """The ext_proc service (``envoy.service.ext_proc.v3.ExternalProcessor``), the EPP convention."""
    health_port: int = 9003
    """gRPC health only (services ``liveness``, ``readiness`` and the ext_proc service name), for
    probes that must not share the data port's TLS; the data port answers health too."""
    fallbacks: int = 2
    """Next-best endpoints listed after the chosen one (``ip:port,ip:port,...``): where the gateway's
    retry goes when the first refuses. Other backends only (a dead engine's other DP ranks share its
    address); 0: the choice alone (what an ORIGINAL_DST cluster needs: it reads one address)."""
    max_streams: int = 4096
    """Requests the picker holds at once (decided and not yet finished, or still arriving); one
    past it is shed: an ImmediateResponse 429 with Retry-After, the protocol's answer for a request
    dropped under load. Bounds the memory the per-request state and bodies take."""
    destination_namespace: str = "envoy.lb"
    """Dynamic metadata namespace of the picked endpoints, and where the served endpoint is read
    from on the response (``x-gateway-destination-endpoint``, ``...-served``)."""
    subset_namespace: str = "envoy.lb.subset_hint"
    """Filter metadata namespace of the gateway's subset hint
    (``x-gateway-destination-endpoint-subset``: pick only from these addresses)."""
    tls_cert_file: str = ""
    """PEM certificate chain of both gRPC ports; "" (with ``tls_key_file``): plaintext."""
    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file``; both set or both empty."""
    tls_client_ca_file: str = ""
    """PEM CA bundle: when set, clients (the gateway) must present a certificate it signed (mTLS)."""
    message_timeout_s: float = 30.0
    """Longest wait for the next message of a request's stream while the picker still needs one
    (its body); past it the stream gets an ImmediateResponse 408, so a gateway that stalls cannot
    hold a slot of ``max_streams`` for ever."""
    response_body_every: int = 8
    """With the gateway's response body mode NONE (docs/gateway.md: no message per SSE chunk), ask
    Envoy for the body of one in this many checkable responses (``mode_override``: the filter
    needs ``allow_mode_override: true``) to read their usage for the prediction self-check; 0 never."""
    estimate_prefill: bool = True
    """For a response seen without its body (response body mode NONE), end its pending prefill when
    the prefill time measured on the bodies the picker did see says so (router/epp/prefill.py),
    not at the response headers, which a vLLM stream sends before its prefill; false: at the
    headers (an engine that sends them only once its prefill is over)."""


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
    """ZMQ topic the engines publish on (vLLM's ``topic``), matched exactly."""
    api_keys: list[str] = []
    """Bearer keys accepted from clients; empty: no authentication."""
    trusted_api_keys: list[str] = []
    """Keys of ``api_keys`` whose requests may carry the body fields only the router sets for the
    engines (``kv_transfer_params``, the P/D legs' transfer parameters), passed on as sent. From
    every other request the router removes them (counted: kvrouter_client_fields_removed_total):
    in a NIXL fleet they name blocks for a decode engine to pull from another engine's cache, so any
    client could have an engine read other tenants' prompts. Only for a component that runs P/D
    legs of its own through the router; the router's own legs still set their own parameters.
    Empty (the default): no client is trusted."""
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
    epp: EppConfig = EppConfig()
    """The Envoy ext_proc endpoint picker (docs/gateway.md); off by default."""
    flow: FlowConfig = FlowConfig()
    """Flow control: hold requests in the router while every candidate is saturated (router/flow)."""


_PATH_RE = re.compile(r"\$\.?(.*)$")


def _key_path(msg: str) -> tuple[str, str]:
    """Split msgspec's "... - at `$.a[0].b`" into (a[0].b, message)."""
    if " - at `" in msg:
        text, _, where = msg.rpartition(" - at `")
        m = _PATH_RE.match(where.rstrip("`"))
        return (m.group(1) if m else where.rstrip("`")) or "(top level)", text
    return "(top level)", msg


def parse_config(data: dict[str, Any]) -> RouterConfig:
    """Validate a decoded TOML document. msgspec stops at the first bad field: the error lists every
    one (a line each), found by converting again without the keys already reported."""
    try:
        cfg = msgspec.convert(data, RouterConfig, strict=True)
    except msgspec.ValidationError:
        backends = data.get("backends")
        errors = []
        if isinstance(backends, list):  # (each alone: a backend dropped would renumber the next)
            for i, b in enumerate(backends):
                errors += _field_errors(b, BackendConfig, f"backends[{i}].")
            data = {**data, "backends": []}
        errors += _field_errors(data, RouterConfig, "")
        raise ConfigError("\n".join(str(e) for e in errors), errors[0].field) from None
    validate(cfg)
    return cfg


def _field_errors(data: Any, kind: Any, prefix: str) -> list[ConfigError]:
    """Every field error of ``data`` as a ``kind`` (keys named from ``prefix``): after each, the key
    at fault is dropped (its default stands in) and the rest converted again."""
    doc = copy.deepcopy(data)
    errors: list[ConfigError] = []
    while len(errors) < 100:
        try:
            msgspec.convert(doc, kind, strict=True)
            break
        except msgspec.ValidationError as exc:
            err = _decode_error(exc, kind)
            errors.append(ConfigError(f"{prefix}{err}", prefix.split("[")[0] or err.field))
            key = re.sub(r"(\[\d+\])+$", "", err.key)  # (a bad list item: the list goes)
            if str(err).endswith(": required"):
                key = key.rpartition(".")[0]  # (the table missing it goes)
            *parents, last = key.split(".") if key != "(top level)" else [""]
            holder = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, parents, doc)
            if not last or not isinstance(holder, dict) or holder.pop(last, None) is None:
                break  # (nothing left to drop: the document itself is wrong)
    return errors


def _decode_error(exc: msgspec.ValidationError, kind: Any = RouterConfig) -> ConfigError:
    """msgspec's error as a ConfigError naming the key (its ``field``: the key's first part, which
    for a backend's own table is the offending field; ``key``: the whole path). An invalid choice
    lists the valid ones, as the same mistake through a flag or the environment does."""
    key, text = _key_path(str(exc))
    for prefix, what in (
        ("Object contains unknown field", "unknown key"),
        ("Object missing required", "required"),
    ):
        if text.startswith(prefix):
            field = text.split("`")[1] if "`" in text else text
            key = f"{key}.{field}" if key != "(top level)" else field
            text = what
            break
    if text.startswith("Invalid enum value") and (choices := _choices(kind, key)):
        text += f"; must be one of {', '.join(map(str, choices))}"
    err = ConfigError(f"{key}: {text}", key.split(".")[0].split("[")[0] if key != "(top level)" else None)
    err.key = key
    return err


def _choices(kind: Any, key: str) -> tuple[Any, ...]:
    """The values of the Literal type at ``key`` (``a.b[0].c``) of ``kind``; () if it is none."""
    info = msgspec.inspect.type_info(kind)
    for part in re.findall(r"\w+|\[\d+\]", key):
        while isinstance(info, msgspec.inspect.UnionType):  # (``X | None``)
            info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), info)
        if part.startswith("[") and isinstance(info, msgspec.inspect.ListType | msgspec.inspect.TupleType):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else info.item_types[0]
        elif isinstance(info, msgspec.inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), msgspec.inspect.AnyType())
        else:
            return ()
    return info.values if isinstance(info, msgspec.inspect.LiteralType) else ()


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 controls (CR, LF, NUL, ...), DEL and C1 controls."""
_VISIBLE_RE = re.compile(r"[\x21-\x7e]+")
"""Printable ASCII without spaces: what a request line, a header value's token or a socket address
can carry as it is."""


def _control_at(value: Any, path: str = "") -> str | None:
    """The key path of the first string in ``value`` (a struct, list, dict or string, walked whole:
    dictionary keys too) that holds a control character, or None."""
    if isinstance(value, str):
        return path if _CONTROL_RE.search(value) else None
    items: Any = ()
    if isinstance(value, msgspec.Struct):
        items = ((f".{f}" if path else f, getattr(value, f)) for f in value.__struct_fields__)
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for k in value:
            if isinstance(k, str) and _CONTROL_RE.search(k):
                return f"{path}.{k!r}" if path else repr(k)
        items = ((f".{k}" if path else str(k), v) for k, v in value.items())
    for step, v in items:
        found = _control_at(v, path + step)
        if found is not None:
            return found
    return None


def _no_control(value: Any, where: str) -> None:
    """ConfigError naming the first string of ``value`` holding a control character (its value is
    not repeated: it may be a key)."""
    at = _control_at(value)
    if at is not None:
        raise ConfigError(
            f"{where + '.' if where else ''}{at}: must not hold control characters (CR, LF, NUL, ...): "
            "it would end up in a header, a URL, a log line or a socket address",
            at.split(".")[0].split("[")[0],
        )


def validate_backend(b: BackendConfig, where: str) -> None:
    """The checks one backend must pass, wherever it comes from (file, admin API, discovery)."""
    if not b.name:
        raise ConfigError(f"{where}.name: must not be empty", "name")
    if not _NAME_RE.fullmatch(b.name):
        raise ConfigError(
            f"{where}.name: {b.name!r} must be 1-128 letters, digits or . _ : @ - (it is used in "
            "URLs, metric labels and headers)",
            "name",
        )
    _no_control(b, where)
    url = urlsplit(b.url) if _VISIBLE_RE.fullmatch(b.url) else None
    try:
        if url is None or url.scheme not in ("http", "https") or not url.hostname or url.port == 0:
            raise ValueError
    except ValueError:  # (a port out of range or not a number)
        raise ConfigError(
            f"{where}.url: {b.url!r} is not an http(s) URL (printable ASCII, no spaces: it goes into the "
            "request line and the Host header)",
            "url",
        ) from None
    if b.api_key and not _VISIBLE_RE.fullmatch(b.api_key):
        raise ConfigError(
            f"{where}.api_key: must be printable ASCII without spaces (it is sent in the Authorization "
            "header)",
            "api_key",
        )
    if b.dp_size < 1:
        raise ConfigError(f"{where}.dp_size: must be >= 1", "dp_size")
    if b.kv_events == AUTO:
        if b.kv_replay is not None:
            raise ConfigError(
                f'{where}.kv_replay: set with kv_events = "auto" (the engine\'s /kv_event_sources '
                "lists its replay endpoint)",
                "kv_replay",
            )
        if b.kv_bind:
            raise ConfigError(
                f'{where}.kv_bind: set with kv_events = "auto" (the engine\'s endpoint says who binds)',
                "kv_bind",
            )
    for key in ("kv_events", "kv_replay"):
        ep = getattr(b, key)
        if ep == AUTO and key == "kv_events":
            continue
        if ep is not None and not (re.match(r"(tcp|ipc|inproc)://", ep) and _VISIBLE_RE.fullmatch(ep)):
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


def _body_field(f: msgspec.structs.FieldInfo) -> tuple[Any, ...]:
    if f.name == "name":
        return (f.name, f.type, "")
    return (f.name, f.type) if f.required else (f.name, f.type, f.default)


_BackendBody = msgspec.defstruct(
    "_BackendBody",
    [_body_field(f) for f in msgspec.structs.fields(BackendConfig)],
    kw_only=True,
    forbid_unknown_fields=True,
)
"""A ``[[backends]]`` table whose name may be left out (the admin API takes it from the path)."""


def _checked_backend(b: BackendConfig, workers: int) -> BackendConfig:
    """``b`` when it passes :func:`validate_backend` and fits the worker count."""
    validate_backend(b, "backend")
    if workers > 1 and b.kv_bind:
        raise ConfigError("kv_bind: bind-mode KV events need server.workers = 1", "kv_bind")
    return b


def parse_backend(data: Any, name: str, workers: int = 1) -> BackendConfig:
    """A backend from a JSON object holding a ``[[backends]]`` table's fields, named ``name``;
    raises ConfigError naming the offending field."""
    if not isinstance(data, dict):
        raise ConfigError("the body must be a JSON object with the fields of a [[backends]] table")
    if "name" in data and data["name"] != name:
        raise ConfigError(f"name: {data['name']!r} differs from the name in the path ({name!r})", "name")
    try:
        b = msgspec.convert({**data, "name": name}, BackendConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise _decode_error(exc, BackendConfig) from None
    return _checked_backend(b, workers)


def decode_backend(raw: bytes, name: str, workers: int = 1) -> BackendConfig:
    """A backend from the JSON bytes of a ``[[backends]]`` table, named ``name`` (the admin API's
    PUT body), decoded straight into its typed fields: any nesting where a field wants a string or
    a list of them is an error at that field, at its first level (a body 100k arrays deep fails
    there, instead of recursing). Raises ConfigError naming the offending field (None when the body
    is not JSON at all)."""
    if not raw.strip():
        raise ConfigError("the body must be a JSON object with the fields of a [[backends]] table")
    try:
        body = msgspec.json.decode(raw, type=_BackendBody)
    except msgspec.ValidationError as exc:
        if "Expected `object`" in str(exc) and " - at `" not in str(exc):
            raise ConfigError(
                "the body must be a JSON object with the fields of a [[backends]] table"
            ) from None
        raise _decode_error(exc, BackendConfig) from None
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # (invalid UTF-8: ValueError)
        raise ConfigError(f"The body is not valid JSON: {exc}") from None
    fields = msgspec.structs.asdict(body)
    if fields["name"] and fields["name"] != name:
        raise ConfigError(f"name: {fields['name']!r} differs from the name in the path ({name!r})", "name")
    return _checked_backend(BackendConfig(**{**fields, "name": name}), workers)


_K8S_NAME_RE = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
"""A DNS-subdomain object name, as the API server requires of an InferencePool's."""


def validate(cfg: RouterConfig) -> None:
    """Checks msgspec's types cannot express. Each section stops at its first problem, and every
    section is checked, so a file with mistakes in several tables hears of them all at once (one
    line each, the error's ``field`` the first's)."""
    errors: list[ConfigError] = []
    for check in _CHECKS:
        try:
            check(cfg)
        except ConfigError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigError("\n".join(str(e) for e in errors), errors[0].field)


def _check_backends(cfg: RouterConfig) -> None:
    """At least one backend (or a way to add them), each valid, names unique."""
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


def _check_strings(cfg: RouterConfig) -> None:
    """No control character in any string: keys, topics, models, hosts, names, paths."""
    _no_control(cfg, "")  # (every other string: keys, topics, models, hosts, names, paths)


def _check_membership(cfg: RouterConfig) -> None:
    """``[membership]`` and its Kubernetes discovery."""
    k8s = cfg.membership.kubernetes
    if k8s.api_key and not _VISIBLE_RE.fullmatch(k8s.api_key):
        raise ConfigError(
            "membership.kubernetes.api_key: must be printable ASCII without spaces (it is sent in the "
            "Authorization header)"
        )
    if k8s.enabled and not k8s.label_selector and not k8s.inference_pool:
        raise ConfigError(
            "membership.kubernetes.label_selector: required when discovery is enabled (or inference_pool)"
        )
    if k8s.label_selector and k8s.inference_pool:
        raise ConfigError(
            "membership.kubernetes.inference_pool: the pool's selector chooses the pods; "
            "leave label_selector unset"
        )
    if k8s.inference_pool and not _K8S_NAME_RE.fullmatch(k8s.inference_pool):
        raise ConfigError(
            "membership.kubernetes.inference_pool: not a Kubernetes object name "
            "(lowercase letters, digits, '-' and '.', at most 253)"
        )
    if k8s.dp_size < 1:
        raise ConfigError("membership.kubernetes.dp_size: must be >= 1")
    if k8s.backoff_s <= 0 or k8s.max_backoff_s < k8s.backoff_s or k8s.watch_timeout_s <= 0:
        raise ConfigError(
            "membership.kubernetes: backoff_s > 0, max_backoff_s >= backoff_s and watch_timeout_s > 0"
        )
    m = cfg.membership
    if m.watch_interval_s < 0.05 or m.join_timeout_s < 0 or m.drain_timeout_s < 0:
        raise ConfigError("membership: watch_interval_s >= 0.05, join_timeout_s and drain_timeout_s >= 0")


def _check_keys(cfg: RouterConfig) -> None:
    """API and admin keys apart; trusted keys among the API keys."""
    overlap = set(cfg.api_keys) & set(cfg.admin_keys)
    if overlap:
        raise ConfigError("admin_keys: a key is also in api_keys (admin keys must be distinct)")
    if not set(cfg.trusted_api_keys) <= set(cfg.api_keys):
        raise ConfigError(
            "trusted_api_keys: every key must also be in api_keys (trust is given to known clients)"
        )


def _check_index(cfg: RouterConfig) -> None:
    """The block size and the subscriber's threads."""
    if cfg.block_size is not None and not 1 <= cfg.block_size <= 4096:
        raise ConfigError("block_size: must be between 1 and 4096")
    if not 1 <= cfg.index.subscriber.io_threads <= 64:
        raise ConfigError("index.subscriber.io_threads: must be between 1 and 64")


def _check_policy(cfg: RouterConfig) -> None:
    """The policy's name and weights."""
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


def _check_pd(cfg: RouterConfig) -> None:
    """``[pd]``."""
    if cfg.pd.min_uncached_tokens < 0 or cfg.pd.max_prefill_queue_tokens < 0:
        raise ConfigError("pd: min_uncached_tokens and max_prefill_queue_tokens must be >= 0")
    if cfg.pd.prefill_timeout_s <= 0:
        raise ConfigError("pd.prefill_timeout_s: must be positive")


def _check_server(cfg: RouterConfig) -> None:
    """``[server]``."""
    if not 0 < cfg.server.port < 65536:
        raise ConfigError("server.port: must be between 1 and 65535")
    if cfg.server.max_body_bytes < 1024:
        raise ConfigError("server.max_body_bytes: must be at least 1024")
    if cfg.server.log_level not in ("debug", "info", "warning", "error", "critical"):
        raise ConfigError("server.log_level: must be debug, info, warning, error or critical")
    for key in ("connect_timeout_s", "read_timeout_s", "keepalive_expiry_s", "upstream_head_timeout_s"):
        if getattr(cfg.server, key) <= 0:
            raise ConfigError(f"server.{key}: must be positive")
    for key in ("upstream_max_head_bytes", "max_sse_event_bytes"):
        if getattr(cfg.server, key) < 1024:
            raise ConfigError(f"server.{key}: must be at least 1024")
    if cfg.server.upstream_max_header_lines < 1:
        raise ConfigError("server.upstream_max_header_lines: must be at least 1")
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


def _check_health(cfg: RouterConfig) -> None:
    """``[health]``."""
    if cfg.health.interval_s < 0.1 or cfg.health.timeout_s <= 0 or cfg.health.unhealthy_after < 1:
        raise ConfigError("health: interval_s must be >= 0.1, timeout_s > 0 and unhealthy_after >= 1")
    if not cfg.health.kv_sources_refresh_s >= 0:  # (false for NaN)
        raise ConfigError("health.kv_sources_refresh_s: must be >= 0 (0: read only after a failed probe)")


def _check_tokenizers(cfg: RouterConfig) -> None:
    """Tokenizer bounds and paths."""
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


def _check_epp(cfg: RouterConfig) -> None:
    """``[epp]``."""
    _validate_epp(cfg.epp)


def _check_cluster(cfg: RouterConfig) -> None:
    """``[cluster]``, by router/cluster's rules."""
    try:
        validate_cluster(cfg.cluster)
    except ClusterError as exc:
        raise ConfigError(str(exc)) from None


def _check_flow(cfg: RouterConfig) -> None:
    """``[flow]``, by router/flow's rules."""
    try:
        validate_flow(cfg.flow)
    except FlowError as exc:
        raise ConfigError(str(exc)) from None


_CHECKS: tuple[Callable[[RouterConfig], None], ...] = (
    _check_backends,
    _check_strings,
    _check_membership,
    _check_keys,
    _check_index,
    _check_policy,
    _check_pd,
    _check_server,
    _check_health,
    _check_tokenizers,
    _check_epp,
    _check_cluster,
    _check_flow,
)


def _validate_epp(e: EppConfig) -> None:
    """``[epp]``: ports, bounds, and a TLS pair that is whole and readable."""
    for key in ("port", "health_port"):
        if not 0 <= getattr(e, key) < 65536:
            raise ConfigError(f"epp.{key}: must be between 0 (any free port) and 65535")
    if e.enabled and e.port and e.port == e.health_port:
        raise ConfigError("epp.health_port: must differ from epp.port")
    if not 0 <= e.fallbacks <= 16:
        raise ConfigError("epp.fallbacks: must be between 0 and 16")
    if e.max_streams < 1:
        raise ConfigError("epp.max_streams: must be at least 1")
    if e.response_body_every < 0:
        raise ConfigError("epp.response_body_every: must be 0 (never) or more")
    if not e.message_timeout_s > 0:
        raise ConfigError("epp.message_timeout_s: must be positive")
    for key in ("destination_namespace", "subset_namespace"):
        if not getattr(e, key):
            raise ConfigError(f"epp.{key}: must not be empty")
    if bool(e.tls_cert_file) != bool(e.tls_key_file):
        raise ConfigError("epp.tls_cert_file, epp.tls_key_file: give both or neither")
    if e.tls_client_ca_file and not e.tls_cert_file:
        raise ConfigError("epp.tls_client_ca_file: needs epp.tls_cert_file and epp.tls_key_file")
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(e, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"epp.{key}: {path!r} is not a readable file")
    if e.tls_cert_file:
        _validate_epp_tls(e)


_PEM_MAX_BYTES = 1 << 20
"""A PEM file past this is not a certificate chain or a key (one certificate is ~1-2 KiB)."""
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PEM_KEY = re.compile(rb"-----BEGIN (?:RSA |EC |ENCRYPTED )?PRIVATE KEY-----")


def _pem(label: str, path: str, what: str, marker: re.Pattern[bytes]) -> bytes:
    """The file's bytes, or the ConfigError (``label``: the key and its value) saying what is wrong."""
    try:
        if Path(path).stat().st_size > _PEM_MAX_BYTES:
            raise ConfigError(f"{label}: larger than {_PEM_MAX_BYTES >> 20} MiB, not a PEM {what}")
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label}: not a readable file ({exc.strerror})") from None
    if not marker.search(data):
        raise ConfigError(f"{label}: holds no PEM {what}")
    return data


def _validate_epp_tls(e: EppConfig) -> None:
    """The TLS files parse and belong together, checked here with the standard library's OpenSSL:
    gRPC reads them only when the port is bound and then says no more than that it "failed to
    bind", which reads like a port in use. gRPC takes no passphrase, so an encrypted key is refused."""
    # optional: the ssl module only for a config with [epp] TLS files
    import ssl

    cert = f"epp.tls_cert_file: {e.tls_cert_file!r}"
    key = f"epp.tls_key_file: {e.tls_key_file!r}"
    _pem(cert, e.tls_cert_file, "certificate", _PEM_CERT)
    data = _pem(key, e.tls_key_file, "private key", _PEM_KEY)
    encrypted = f"{key}: the key is encrypted; gRPC takes no passphrase, give it unencrypted"
    if b"ENCRYPTED" in data:  # (PKCS#8 "ENCRYPTED PRIVATE KEY", or a legacy "Proc-Type: 4,ENCRYPTED")
        raise ConfigError(encrypted)

    def no_password() -> bytes:  # (never a prompt on the terminal)
        raise ConfigError(encrypted)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(e.tls_cert_file, e.tls_key_file, password=no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{key}: not the key of {cert}") from None
        raise ConfigError(
            f"{cert}, {key}: not a usable PEM certificate chain and key ({exc.reason or 'unreadable'})"
        ) from None
    if e.tls_client_ca_file:
        ca = f"epp.tls_client_ca_file: {e.tls_client_ca_file!r}"
        _pem(ca, e.tls_client_ca_file, "certificate", _PEM_CERT)
        try:
            ctx.load_verify_locations(cafile=e.tls_client_ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{ca}: holds no usable PEM certificate ({exc.reason or 'unreadable'})"
            ) from None


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
    "AUTO",
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
    "decode_backend",
    "env_overrides",
    "load_config",
    "parse_backend",
    "parse_config",
    "rank_endpoint",
    "validate_backend",
    "with_overrides",
]
