"""Prometheus families of the replica link and of session affinity, read at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterable

from router.cluster.affinity import SessionAffinity
from router.cluster.node import Cluster
from router.cluster.unseen import UnseenPeers
from router.observe.exposition import CounterFamily, Family, GaugeFamily


class ClusterCollector:
    """``kvrouter_cluster_*`` (when a store is configured) and ``kvrouter_session_affinity_*``."""

    def __init__(
        self, cluster: Cluster | None, affinity: SessionAffinity | None, unseen: UnseenPeers | None = None
    ) -> None:
        self.cluster = cluster
        self.affinity = affinity
        self.unseen = unseen

    def collect(self) -> Iterable[Family]:
        c = self.cluster
        if c is not None:
            st = c.stats
            connected = GaugeFamily(
                "kvrouter_cluster_connected", "Connected to the shared store (1) or deciding alone (0)"
            )
            connected.add_metric([], 1.0 if c.connected else 0.0)
            yield connected
            now = time.monotonic()
            peers = list(c.table.peers.values())
            n = GaugeFamily("kvrouter_cluster_peers", "Other router replicas heard from recently")
            n.add_metric([], len(peers))
            yield n
            age = GaugeFamily(
                "kvrouter_cluster_peer_max_age_seconds",
                "Age of the stalest peer's last update (this replica's clock); 0 without peers",
            )
            age.add_metric([], max((now - p.last_heard for p in peers), default=0.0))
            yield age
            labelled: list[tuple[str, str, str, dict[str, int]]] = [
                ("kvrouter_cluster_messages", "Messages published and received", "direction", st.messages),
                ("kvrouter_cluster_bytes", "Message bytes published and received", "direction", st.bytes),
                (
                    "kvrouter_cluster_predicted_keys",
                    "Predicted block keys sent to and received from peers",
                    "direction",
                    st.predicted_keys,
                ),
                (
                    "kvrouter_cluster_pins",
                    "Session pins sent to and received from peers",
                    "direction",
                    st.pins,
                ),
                (
                    "kvrouter_cluster_failures",
                    "Store failures by kind (connect, publish, receive, decode, protocol: a broken or "
                    "oversized reply); never a failed request",
                    "kind",
                    st.failures,
                ),
                (
                    "kvrouter_cluster_dropped",
                    "Predictions and pins not shared (store down, or the pending cap)",
                    "what",
                    st.dropped,
                ),
            ]
            for name, doc, label, values in labelled:
                fam = CounterFamily(name, doc, labels=[label])
                for key, v in values.items():
                    fam.add_metric([key], v)
                yield fam
            expired = CounterFamily(
                "kvrouter_cluster_peers_expired", "Peers dropped after peer_timeout_s of silence"
            )
            expired.add_metric([], c.table.expired)
            yield expired
            missed = CounterFamily(
                "kvrouter_cluster_missed_messages", "Peer messages never received (sequence gaps)"
            )
            missed.add_metric([], c.table.missed)
            yield missed
            yield st.lag.family()
        if self.unseen is not None:
            assumed = CounterFamily(
                "kvrouter_cluster_assumed_decisions",
                "Other replicas' concurrent decisions assumed as load (not seen yet), summed over decisions",
            )
            assumed.add_metric([], self.unseen.assumed_total)
            yield assumed
            held = CounterFamily(
                "kvrouter_cluster_held_decisions",
                "Decisions held to see earlier-ranked replicas decide a burst first (stagger_bursts)",
                labels=["unit"],
            )
            held.add_metric(["decisions"], self.unseen.held)
            held.add_metric(["seconds"], self.unseen.held_s)
            yield held
        a = self.affinity
        if a is not None:
            res = CounterFamily(
                "kvrouter_session_affinity",
                "Requests with a session header: new, kept, steered, overloaded, unavailable",
                labels=["result"],
            )
            for result, v in a.results.items():
                res.add_metric([result], v)
            yield res
            pins = GaugeFamily("kvrouter_session_pins", "Session pins held by this replica")
            pins.add_metric([], len(a.pins))
            yield pins


__all__ = ["ClusterCollector"]
