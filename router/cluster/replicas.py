"""What the rest of the router holds for "replicas": the session pins and the store link, either
optional, built from the ``[cluster]`` table.

- no ``[cluster]`` keys: nothing (a router alone, as before);
- ``session_header`` alone: session affinity local to this replica;
- ``redis_url``: the :class:`~router.cluster.node.Cluster` link, added to the load tracker as one more
  :class:`~router.fleet.load.PeerLoads` and to the index as its prediction listener, sharing the pins
  too when ``session_header`` is set.

Nothing of the store link is imported or started in the first two cases.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from index.kvindex import KVIndex
from router.cluster.affinity import SessionAffinity
from router.cluster.config import ClusterConfig
from router.cluster.unseen import UnseenPeers, replica_ranks
from router.fleet.load import LoadTracker
from router.observe.exposition import Registry


class Replicas:
    """Session affinity and the cluster link of one router process (each may be None)."""

    def __init__(
        self,
        config: ClusterConfig,
        index: KVIndex,
        loads: LoadTracker,
        *,
        port: int = 0,
        worker: int | None = None,
        group: str = "",
    ) -> None:
        self.config = config
        self.affinity: SessionAffinity | None = None
        if config.session_header:
            self.affinity = SessionAffinity(
                config.session_header, config.session_ttl_s, config.session_load_factor, config.max_sessions
            )
        self.cluster: Any = None
        self.unseen: UnseenPeers | None = None
        """Peer decisions assumed but not seen yet (``assume_concurrent_decisions``, with a store)."""
        if config.redis_url:
            # optional: the Redis client only with cluster.redis_url
            from router.cluster.node import Cluster

            host = config.replica_name or os.environ.get("HOSTNAME") or socket.gethostname()
            name = config.replica_name or f"{host}:{port}" + (f"/w{worker}" if worker is not None else "")
            self.cluster = Cluster(config, index, self.affinity, name=name, group=group)
            loads.add_peers(self.cluster)
            if config.share_predictions:
                index.prediction_listener = self.cluster.predicted
            if config.assume_concurrent_decisions:
                ranks = replica_ranks(group or self.cluster.id, self.cluster.replica_keys)
                self.unseen = UnseenPeers(ranks, self.cluster.unseen_window, stagger=config.stagger_bursts)

    def register(self, registry: Registry) -> None:
        """Export the cluster and affinity metrics from ``registry``."""
        if self.affinity is None and self.cluster is None:
            return
        # optional: the cluster's figures only with cluster.redis_url
        from router.cluster.metrics import ClusterCollector

        registry.register(ClusterCollector(self.cluster, self.affinity, self.unseen))

    def start(self) -> None:
        """Start the store link, if any (returns at once)."""
        if self.cluster is not None:
            self.cluster.start()

    async def stop(self) -> None:
        """Say goodbye to the peers and close the link."""
        if self.cluster is not None:
            await self.cluster.stop()

    def describe(self) -> dict[str, Any]:
        """``/debug/index``'s and the dashboard's ``cluster`` section."""
        out: dict[str, Any] = {"enabled": self.cluster is not None}
        if self.cluster is not None:
            out.update(self.cluster.describe())
        if self.unseen is not None:
            u = self.unseen
            rank, n = u.ranks()
            out["assumed"] = {
                "rank": rank,
                "replicas": n,
                "burst_share": round(u.burst_share, 3),
                "request_blocks": round(u.request_blocks, 1),
                "window_ms": round(u.window_s() * 1e3, 2),
                "total": round(u.assumed_total, 1),
                "staggered": u.stagger,
                "held": u.held,
            }
        if self.affinity is not None:
            a = self.affinity
            out["sessions"] = {
                "header": self.config.session_header,
                "pins": len(a.pins),
                "ttl_s": a.ttl_s,
                "load_factor": a.load_factor,
                "results": dict(a.results),
            }
        return out


__all__ = ["Replicas"]
