"""kvrouter_gc_pause_seconds: every collection of the process timed by generation, while installed."""

from __future__ import annotations

import gc

from router.observe.gcpauses import GcPauses


def _count(p: GcPauses, generation: str) -> float:
    return sum(p.histogram.series[(generation,)][:-1])


def test_collections_are_timed_by_generation_only_while_installed() -> None:
    p = GcPauses()
    assert [_count(p, g) for g in "012"] == [0, 0, 0]  # (exported at zero from the start)
    p.install()
    p.install()  # (idempotent: one callback)
    try:
        gc.collect()
        gc.collect(0)
        assert _count(p, "2") == 1
        assert _count(p, "0") >= 1
        assert p.histogram.series[("2",)][-1] > 0  # (the pause's seconds summed)
    finally:
        p.remove()
    before = [_count(p, g) for g in "012"]
    gc.collect()
    assert [_count(p, g) for g in "012"] == before
    p.remove()  # (idempotent)
    fam = p.histogram.family()
    assert fam.name == "kvrouter_gc_pause_seconds"
