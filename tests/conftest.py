"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from sim.toy_tokenizer import build_toy_tokenizer


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A ZeroMQ context per test, terminated after it (every socket must be closed by then)."""
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE tokenizer with a chat template, built locally (nothing is downloaded)."""
    return build_toy_tokenizer(tmp_path_factory.mktemp("tok"))
