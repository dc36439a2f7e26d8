"""The other replicas as this one last heard them: their in-flight figures per target, summed.

Pure state, no I/O: the :class:`~router.cluster.node.Cluster` feeds it decoded messages and the
time they arrived (this replica's monotonic clock: a peer's own clock is never read). Sums are kept
up to date as figures change (when a peer's share arrives, not when a decision reads them), and a
peer that goes silent for ``peer_timeout_s`` (or says goodbye) is removed together with everything
it contributed. The sums of the targets this replica routes to are also kept in one int64 column
(:attr:`PeerTable.cells`, a slot per target): a decision reads every candidate's from there in one
compiled pass, whatever the fleet's width (router/decision/service.py).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

from router.cluster.wire import LoadRow
from router.fleet.load import Target

Figures = tuple[int, int, int]
"""(active, prefilling, pending prefill tokens)."""

_ZERO: Figures = (0, 0, 0)

log = logging.getLogger("kvrouter.cluster")


class Peer:
    """One other replica."""

    __slots__ = (
        "first_heard",
        "group",
        "id",
        "last_decided",
        "last_heard",
        "loads",
        "messages",
        "missed",
        "name",
        "seq",
    )

    def __init__(self, replica: str, now: float) -> None:
        self.id = replica
        self.name = ""
        self.group = ""
        self.first_heard = now
        self.last_heard = now
        self.last_decided = float("-inf")
        """When a message last showed this peer routing requests (:meth:`PeerTable.set_loads`)."""
        self.seq = -1
        self.messages = 0
        self.missed = 0
        self.loads: dict[Target, Figures] = {}

    def inflight(self) -> int:
        """Requests this peer has in flight, over every target."""
        return sum(f[0] for f in self.loads.values())


class PeerTable:
    """Every live peer and the sum of their figures per target (peers of ``group`` excluded from the
    sums: they are this process's sibling workers, whose load the local board already adds)."""

    MAX_PEERS = 1024
    MAX_TARGETS = 65_536

    def __init__(self, group: str = "") -> None:
        self.group = group
        self.peers: dict[str, Peer] = {}
        self.totals: dict[Target, Figures] = {}
        self.expired = 0
        self.missed = 0
        """Messages of peers never received (sequence gaps), over every peer ever heard."""
        self.refused = 0
        """Messages from new peers refused because :attr:`MAX_PEERS` were known."""
        self.cells = array("q")
        """The sums of the watched targets (:meth:`watch`), three int64 per slot."""
        self._slots: dict[Target, int] = {}
        self._free: list[int] = []

    def watch(self, target: Target) -> None:
        """Keep ``target``'s sums in :attr:`cells` (a target of this replica's fleet); at most
        :attr:`MAX_TARGETS` (past it a target's peers' load is not seen by decisions: logged)."""
        if target in self._slots:
            return
        if self._free:
            slot = self._free.pop()
        elif len(self._slots) >= self.MAX_TARGETS:
            log.error("cluster: %d targets watched; %s's peer load is not seen", len(self._slots), target)
            return
        else:
            slot = len(self.cells) // 3
            self.cells.extend(_ZERO)
        self._slots[target] = slot
        self.cells[slot * 3 : slot * 3 + 3] = array("q", self.totals.get(target, _ZERO))

    def unwatch(self, target: Target) -> None:
        """Stop keeping ``target``'s sums in :attr:`cells` (it left this replica's fleet)."""
        slot = self._slots.pop(target, None)
        if slot is not None:
            self.cells[slot * 3 : slot * 3 + 3] = array("q", _ZERO)
            self._free.append(slot)

    def slot_of(self, target: Target) -> int:
        """A watched target's slot in :attr:`cells` (-1: not watched)."""
        return self._slots.get(target, -1)

    def others(self, target: Target) -> Figures:
        """The peers' summed figures for one target."""
        return self.totals.get(target, _ZERO)

    def heard(self, replica: str, now: float, seq: int | None = None) -> Peer | None:
        """Note a message from ``replica`` at ``now``; the peer (None when the table is full)."""
        peer = self.peers.get(replica)
        if peer is None:
            if len(self.peers) >= self.MAX_PEERS:
                self.refused += 1
                return None
            peer = self.peers[replica] = Peer(replica, now)
        peer.last_heard = max(peer.last_heard, now)
        peer.messages += 1
        if seq is not None:
            if peer.seq >= 0 and seq > peer.seq + 1:
                peer.missed += seq - peer.seq - 1
                self.missed += seq - peer.seq - 1
            peer.seq = max(peer.seq, seq)
        return peer

    def counts(self, peer: Peer) -> bool:
        """Whether a peer's load is added to the sums (not a sibling worker of this process)."""
        return not (self.group and peer.group == self.group)

    def set_loads(self, peer: Peer, rows: Sequence[LoadRow], full: bool, now: float | None = None) -> None:
        """Apply a peer's figures: the listed targets change; with ``full`` the others drop to zero.

        With ``now``, the peer is marked as deciding then when the message shows requests of its
        own: a change of any target's figures (a peer sends only targets whose figures changed, even
        when a request came and went within one publish interval), or, in a full table, a request in
        flight or a zero row (a full table lists idle targets only when they just changed)."""
        if not full:  # (most messages: only what changed, applied row by row without a dict)
            if now is not None and rows:
                peer.last_decided = max(peer.last_decided, now)
            loads, limit = peer.loads, self.MAX_TARGETS
            for r in rows:
                target = (r.backend, r.rank)
                if target in loads or len(loads) < limit:
                    self._set(peer, target, (r.active, r.prefilling, r.pending_tokens))
            return
        new = {(r.backend, r.rank): (r.active, r.prefilling, r.pending_tokens) for r in rows}
        if now is not None and any(f[0] > 0 or f == _ZERO for f in new.values()):
            peer.last_decided = max(peer.last_decided, now)
        for target in list(peer.loads):
            if target not in new:
                self._set(peer, target, _ZERO)
        for target, figures in new.items():
            if target in peer.loads or len(peer.loads) < self.MAX_TARGETS:
                self._set(peer, target, figures)

    def _set(self, peer: Peer, target: Target, figures: Figures) -> None:
        old = peer.loads.get(target, _ZERO)
        if figures == _ZERO:
            peer.loads.pop(target, None)
        else:
            peer.loads[target] = figures
        if old == figures or not self.counts(peer):
            return
        t = self.totals.get(target, _ZERO)
        total = (t[0] + figures[0] - old[0], t[1] + figures[1] - old[1], t[2] + figures[2] - old[2])
        if total == _ZERO:
            self.totals.pop(target, None)
        else:
            self.totals[target] = total
        slot = self._slots.get(target)
        if slot is not None:
            cells = self.cells
            i = slot * 3
            cells[i], cells[i + 1], cells[i + 2] = total

    def drop(self, replica: str) -> Peer | None:
        """Forget a peer and withdraw its figures from the sums."""
        peer = self.peers.pop(replica, None)
        if peer is not None:
            for target in list(peer.loads):
                self._set(peer, target, _ZERO)
        return peer

    def expire(self, now: float, timeout_s: float) -> list[Peer]:
        """Drop every peer not heard from for ``timeout_s``; the dropped ones."""
        gone = [p for p in self.peers.values() if now - p.last_heard > timeout_s]
        for p in gone:
            self.drop(p.id)
        self.expired += len(gone)
        return gone

    def clear(self) -> None:
        """Forget every peer."""
        for replica in list(self.peers):
            self.drop(replica)


__all__ = ["Figures", "Peer", "PeerTable"]
