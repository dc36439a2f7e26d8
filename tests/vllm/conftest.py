"""The real-vLLM tier: markers, when it runs, and the engines' fixtures.

Every test here is marked ``vllm``. It needs the venv tests/vllm/install.sh makes (outside the
clone): without it the tests are skipped, except in CI (``CI=true``), where they fail, so a CI that
lost its vLLM install cannot pass silently. ``KVROUTER_VLLM_UNAVAILABLE`` (set by .ci/run when pip
could not reach the index) turns that failure into a skip naming the reason. Tests also marked
``vllm_full`` run only under ``make test-vllm`` (``KVROUTER_VLLM_TIER=full``): the default run
keeps the CI share of engine time small.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from vllm_tier import Tier

from sim.vllm_engines import VENV, venv_ready

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs real vLLM engines (tests/vllm, needs its venv)")
    config.addinivalue_line("markers", "vllm_full: real-vLLM test run only by `make test-vllm`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full = os.environ.get("KVROUTER_VLLM_TIER") == "full"
    for item in items:
        if _HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.vllm)
        item.add_marker(pytest.mark.timeout(1200))  # (engine start-up counts in the first test)
        if not full and item.get_closest_marker("vllm_full") is not None:
            item.add_marker(pytest.mark.skip(reason="real-vLLM full tier: run by `make test-vllm`"))


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv, or the skip (outside CI) / failure (in CI) saying why it is missing."""
    if venv_ready():
        return VENV
    unavailable = os.environ.get("KVROUTER_VLLM_UNAVAILABLE")
    if unavailable:
        pytest.skip(f"real vLLM not installed: {unavailable}")
    why = f"no vLLM venv at {VENV} (run tests/vllm/install.sh, or `make test-vllm`)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs the real-vLLM tier but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def tier(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    """Engines are made with ``tier.serve(kind, block_size)`` (a module-scoped fixture each)."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield Tier(tmp_path_factory.mktemp("vllm-models"), tmp_path_factory, ctx)
    ctx.term()
