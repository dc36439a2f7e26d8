"""Other routers' load as decisions read it: kept per target in int64 columns as the peers' shares
arrive (the cluster's peer table, the workers' load board) and gathered for every candidate by the
kernel in one pass, the same figures as summing each target's peers one by one."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import msgspec
import pytest
from test_explain_kernel import _VOLATILE, _fleet, _kernel

from router.cluster.peers import PeerTable
from router.cluster.wire import LoadRow
from router.decision import _kernel as kernel
from router.decision.policy import Policy
from router.decision.record import Inputs
from router.fleet.load import BoardView, LoadBoard, LoadTracker, PeerColumns, TargetLoad


def _gathered(columns: PeerColumns, slots: list[int]) -> list[tuple[int, int, int]]:
    out = bytearray(len(slots) * 24)
    c = columns
    kernel.gather(out, c.table, c.base, c.stride, c.rows, c.skip, array("q", slots).tobytes())
    q = memoryview(out).cast("q")
    return [(q[i * 3], q[i * 3 + 1], q[i * 3 + 2]) for i in range(len(slots))]


def test_the_kernel_adds_the_gathered_figures_as_summed_load_records() -> None:
    rng = random.Random(7)
    for case in range(600):
        cfg, fleet = _fleet(rng)
        seed = rng.randrange(2**32)
        n = len(fleet.loads)
        extra = [
            (rng.choice([0, 0, 1, 5]), rng.choice([0, 1]), rng.choice([0, 0, 16, 3000, 2**53 + 7]))
            for _ in range(n)
        ]
        summed = [
            TargetLoad(
                active=ld.active + e[0],
                pending_prefill_tokens=ld.pending_prefill_tokens + e[2],
                engine_waiting=ld.engine_waiting,
            )
            for ld, e in zip(fleet.loads, extra, strict=True)
        ]
        want, want_state = _kernel(cfg, seed, type(fleet)(**{**fleet.__dict__, "loads": summed}))
        rng2 = random.Random(seed)
        decision = Policy(cfg, rng2).decide(
            Inputs(list(zip(fleet.names, fleet.ranks, strict=True))),
            fleet.prompt_tokens // fleet.block_size,
            fleet.block_size,
            fleet.matched,
            fleet.loads,
            media=fleet.media,
            dry_run=True,
            extra=bytearray(array("q", [v for e in extra for v in e]).tobytes()),
        )
        assert decision.scored is not None
        got = msgspec.json.decode(_VOLATILE.sub(b"", want))
        assert (decision.backend, decision.dp_rank) == (got["backend"], got["dp_rank"]), case
        assert rng2.getstate() == want_state, case
        scores = decision.scored.scores(decision.outcome)
        assert [c.score for c in scores] == [c["score"] for c in got["candidates"]], case
        assert [c.inflight for c in scores] == [c["inflight"] for c in got["candidates"]], case


def test_gather_refuses_slots_past_the_table_and_short_buffers() -> None:
    table = array("q", [1, 2, 3, 4, 5, 6])
    with pytest.raises(IndexError):
        kernel.gather(bytearray(24), table, 0, 3, 1, -1, array("q", [2]).tobytes())
    with pytest.raises(ValueError):
        kernel.gather(bytearray(16), table, 0, 3, 1, -1, array("q", [0]).tobytes())
    with pytest.raises(ValueError):  # rows wider than the stride
        kernel.gather(bytearray(24), table, 0, 3, 2, -1, array("q", [0]).tobytes())
    assert _gathered(PeerColumns(table, 0, 3, 1, -1), [1, -1, 0]) == [(4, 5, 6), (0, 0, 0), (1, 2, 3)]
    with pytest.raises(ValueError):
        kernel.score((1, 16, 0, 1.0, 1.0, 1.0, 1.0, 1, 0.0, 1.0, 1.0, 0.0, 0.0), [0], None, None, None,
                     [TargetLoad()], None, None, random.Random(), None, 0, bytearray(8))  # fmt: skip


def test_the_peer_table_keeps_the_watched_targets_sums_as_messages_arrive() -> None:
    table = PeerTable()
    a, b, c = ("a", 0), ("a", 1), ("b", 0)
    table.watch(a)
    table.watch(b)
    p1 = table.heard("r1", 0.0)
    p2 = table.heard("r2", 0.0)
    assert p1 is not None and p2 is not None
    table.set_loads(p1, [LoadRow("a", 0, 2, 1, 64), LoadRow("b", 0, 1, 1, 16)], False)
    table.set_loads(p2, [LoadRow("a", 0, 1, 0, 0), LoadRow("a", 1, 3, 3, 300)], False)
    table.watch(c)  # (watched after its figures came: starts from the sums)
    cols = PeerColumns(table.cells, 0, 3, 1, -1)
    slots = [table.slot_of(t) for t in (a, b, c)]
    want = [(3, 1, 64), (3, 3, 300), (1, 1, 16)]
    assert _gathered(cols, slots) == [table.others(t) for t in (a, b, c)] == want
    table.set_loads(p2, [LoadRow("a", 1, 1, 0, 0)], True)  # a full table: r2's ("a", 0) drops to zero
    assert _gathered(cols, slots) == [(2, 1, 64), (1, 0, 0), (1, 1, 16)]
    table.drop("r1")
    assert _gathered(cols, slots) == [(0, 0, 0), (1, 0, 0), (0, 0, 0)]
    table.unwatch(b)
    assert table.slot_of(b) == -1
    table.watch(("z", 0))  # (reuses the freed slot, from zero)
    assert table.slot_of(("z", 0)) == slots[1]
    assert _gathered(cols, [slots[1]]) == [(0, 0, 0)]


def test_the_load_board_columns_sum_the_other_workers(tmp_path: Path) -> None:
    targets = [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    path = str(tmp_path / "board")
    trackers = [LoadTracker([BoardView(LoadBoard(path, 3), w)]) for w in range(3)]
    for t in trackers:
        for target in targets[:3]:
            t.track(target)
    trackers[1].start(("a", 1), 64)
    trackers[2].start(("a", 1), 16)
    ticket = trackers[2].start(("b", 0), 32)
    trackers[2].first_byte(ticket)
    trackers[0].start(("a", 0), 8)  # (its own: not in its peers' figures)
    for w, t in enumerate(trackers):
        (slots,) = t.peer_slots(targets)
        view = t.peers[0]
        got = _gathered(view.columns(), list(memoryview(slots).cast("q")))
        want = [view.others(target) if target in t._loads else (0, 0, 0) for target in targets]
        assert got == want, w
    first = trackers[0]
    slots0 = list(memoryview(first.peer_slots(targets)[0]).cast("q"))
    assert _gathered(first.peers[0].columns(), slots0)[:3] == [(0, 0, 0), (2, 2, 80), (1, 0, 0)]
