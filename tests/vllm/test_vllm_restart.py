"""kill -9 of a real engine's whole process group, and a restart on the same ports.

While the engine is down the router keeps its index (a failed probe is not a membership change).
When the new engine process binds the same event ports, the router must see a new engine (its replay
buffer is empty after a reconnection), drop the old engine's blocks, read its /kv_event_sources
again, and index what the new engine caches. A block kept from the old engine would be predicted
and not served: the first requests after the restart would be over-predicted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_tier import Fleet, Tier, text, wait

pytestmark = pytest.mark.vllm_full


@pytest.fixture(scope="module")
def fleet(tier: Tier) -> Iterator[Fleet]:
    with tier.serve("llama", 32) as f:
        yield f


def test_a_killed_engine_restarted_on_the_same_ports_is_followed(fleet: Fleet) -> None:
    prompts = [f"restart {i} " + text(300 + i, 200) for i in range(3)]
    for i, p in enumerate(prompts):
        fleet.send(f"before/p{i}", {"prompt": p})
        fleet.send(f"before/p{i} again", {"prompt": p})
    fleet.assert_agreement(fleet.rows)
    before = fleet.source()
    assert before["blocks"].get("GPU", 0) >= 3 * 6, before

    reads = fleet.router.app.fleet.discovery.reads
    fleet.engine.kill()  # the API server, EngineCore and Worker at once (kill -9 of the group)
    wait(lambda: not fleet.backend()["healthy"], "the router to see the engine gone", 60)
    assert fleet.source()["blocks"] == before["blocks"]  # kept while it is only down

    fleet.engine.start()  # a new engine process on the same HTTP and event ports
    wait(
        lambda: fleet.source()["restarts"] > before["restarts"] and not fleet.source()["blocks"].get("GPU"),
        "the router to drop the old engine's blocks",
        120,
    )
    wait(lambda: fleet.backend()["healthy"], "the engine healthy again", 120)
    assert fleet.router.app.fleet.discovery.reads > reads  # its listing read again when it came back
    assert fleet.backend()["kv_sources"] == "listed"
    fleet.rebase()

    start = len(fleet.rows)
    for i, p in enumerate(prompts):
        fleet.send(f"after/p{i}", {"prompt": p})  # cold on the new engine: 0 predicted, 0 cached
        fleet.send(f"after/p{i} again", {"prompt": p})
    after = fleet.rows[start:]
    assert [r.engine_cached for r in after[::2]] == [0, 0, 0]
    fleet.assert_agreement(after)
    assert fleet.source()["blocks"].get("GPU", 0) >= 3 * 6  # indexed again
