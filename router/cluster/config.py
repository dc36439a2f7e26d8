"""The ``[cluster]`` table: router replicas sharing load, predictions and session pins over Redis/Valkey.

Kept in its own module so that :mod:`router.config` only embeds it; the checks msgspec's types
cannot express are in :func:`validate_cluster`, called from the config's own validation.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import msgspec

_HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")


class ClusterError(ValueError):
    """A ``[cluster]`` key is unusable; the message names it."""


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Replicas that act as one router (README, "Router replicas")."""

    redis_url: str | None = None
    """``redis://[user:password@]host:port/db`` or ``rediss://`` (TLS), Redis >= 7 or Valkey; None: this
    replica works alone (session affinity, when configured, is then local to it)."""
    key_prefix: str = "kvrouter"
    """Prefix of every key and channel this router uses, so several router deployments can share
    one store; replicas of one deployment must use the same prefix (and the same backend names)."""
    replica_name: str = ""
    """How peers show this replica (/debug/index, dashboard); "" = $HOSTNAME (the pod name in
    Kubernetes) or the host name, with the port."""
    publish_interval_s: float = 0.002
    """Least time between two messages of this replica (its in-flight load, predictions and session
    pins that changed meanwhile go out together): bounds the message rate whatever the request rate
    (500/s at 2 ms). A change after a quiet spell is sent at once; under load a peer's view is at
    most about this plus the store's round trip behind."""
    heartbeat_s: float = 1.0
    """Every replica re-sends its whole in-flight table this often (and stores it as its snapshot), so
    a lost message is repaired within a heartbeat."""
    peer_timeout_s: float = 5.0
    """A peer not heard from for this long (on this replica's own clock) is dropped with everything it
    contributed: a dead replica's load never outlives it by more than this."""
    connect_timeout_s: float = 1.0
    """Connecting to the store and each command to it; a slower store counts as down."""
    reconnect_min_s: float = 0.1
    """First delay before reconnecting after a failure (doubles, with jitter, up to the maximum)."""
    reconnect_max_s: float = 2.0
    """Longest delay between reconnect attempts: the store's return is noticed within this."""
    share_predictions: bool = True
    """Send predict-on-route residencies to the other replicas (only the blocks not already known
    cached from the engines' events, which every replica follows itself)."""
    max_pending_keys: int = 262_144
    """Predicted block keys waiting to be sent at most (a slow store cannot grow memory); beyond,
    predictions are dropped and counted."""
    max_reply_bytes: int = 32 << 20
    """Largest reply the store may send, all of it (a bulk string announcing more fails at its
    header): beyond, the connection counts as broken (kvrouter_cluster_failures_total{kind=
    "protocol"}), is closed and reconnected with the backoff, so a broken or hostile store cannot
    make the router buffer without bound. The largest reply the link asks for is a message of
    ``max_pending_keys`` predicted keys (8 bytes each, 2 MiB by default) and its loads; 32 MiB
    leaves room. At least 1 MiB and 16 x ``max_pending_keys``."""
    max_reply_items: int = 100_000
    """Array elements in one reply, at every level together (each becomes an object in the router's
    memory); beyond, as for ``max_reply_bytes``. The largest arrays the link reads are pages of SCAN
    (COUNT 1000) and the replica registry's HKEYS. At least 4096."""
    max_reply_depth: int = 8
    """Arrays nested in one reply; beyond, as for ``max_reply_bytes``. The link's replies nest two
    deep (SCAN's cursor and keys). Between 2 and 64."""
    session_header: str | None = None
    """Request header (e.g. ``x-session-id``) whose value pins a conversation to the target it was
    first routed to; None: no session affinity."""
    session_ttl_s: float = 600.0
    """A pin lasts this long after the conversation's last request (each request renews it)."""
    session_load_factor: float = 2.0
    """Overload bound of a pin: the pinned target is used while its requests in flight (all replicas')
    plus this one stay within factor x the mean over the candidates (plus one), as in consistent
    hashing with bounded loads; otherwise the policy decides and the conversation is re-pinned."""
    max_sessions: int = 100_000
    """Pins kept per replica (the least recently used go first)."""
    assume_concurrent_decisions: bool = True
    """Count the decisions other replicas are making at the same moment (a burst split across the
    replicas), which no replica can see yet, as load on the candidates they would pick: the replicas
    then spread a burst as one router would instead of all choosing the same engines
    (router/cluster/unseen.py)."""
    stagger_bursts: bool = True
    """In a burst, the replica ranked r among the routing ones holds its decisions r x (publish
    interval + lag) so that it sees the decisions of the replicas ranked before it, as one router
    placing a burst in order would (at most 20 ms; a clock wait, never a store wait); no decision is
    assumed then. Needs ``assume_concurrent_decisions``; False keeps the assumption alone
    (router/cluster/unseen.py)."""


def validate_cluster(c: ClusterConfig) -> None:
    """Checks msgspec's types cannot express."""
    if c.redis_url is not None:
        parts = urlsplit(c.redis_url)
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path):
            raise ClusterError(
                f"cluster.redis_url: {c.redis_url!r} is not a redis://host:port/db, rediss:// or unix:// URL"
            )
    if not re.match(r"^[A-Za-z0-9_.:-]{1,64}$", c.key_prefix):
        raise ClusterError("cluster.key_prefix: 1-64 letters, digits or _ . : -")
    if c.session_header is not None and not _HEADER_RE.match(c.session_header):
        raise ClusterError(f"cluster.session_header: {c.session_header!r} is not a header name")
    if not 0 <= c.publish_interval_s <= 1:
        raise ClusterError("cluster.publish_interval_s: must be between 0 and 1")
    if c.heartbeat_s <= 0 or c.peer_timeout_s < 2 * c.heartbeat_s:
        raise ClusterError("cluster: heartbeat_s > 0 and peer_timeout_s >= 2 x heartbeat_s")
    if c.connect_timeout_s <= 0 or c.reconnect_min_s <= 0 or c.reconnect_max_s < c.reconnect_min_s:
        raise ClusterError(
            "cluster: connect_timeout_s > 0, reconnect_min_s > 0 and reconnect_max_s >= reconnect_min_s"
        )
    if c.max_reply_bytes < max(1 << 20, 16 * c.max_pending_keys):
        raise ClusterError("cluster.max_reply_bytes: at least 1 MiB (1048576) and 16 x max_pending_keys")
    if c.max_reply_items < 4096 or not 2 <= c.max_reply_depth <= 64:
        raise ClusterError("cluster: max_reply_items >= 4096 and max_reply_depth between 2 and 64")
    if c.session_ttl_s <= 0 or c.session_load_factor < 1 or c.max_sessions < 1 or c.max_pending_keys < 0:
        raise ClusterError(
            "cluster: session_ttl_s > 0, session_load_factor >= 1, max_sessions >= 1, max_pending_keys >= 0"
        )


__all__ = ["ClusterConfig", "ClusterError", "validate_cluster"]
