"""A real Envoy for the tests: the binary tests/envoy/install.sh puts in its own venv, started on
127.0.0.1 with ephemeral ports (its listener's port read back from its admin API).

The bootstrap and the process are sim/gateway.py's (`kvrouter demo --gateway` runs them too): the
same filters and cluster as deploy/gateway/envoy.yaml, with the test's addresses. Outside CI a
missing Envoy skips the tests that need it; in CI (``CI=true``) it fails them, so a CI that lost
its install cannot pass silently. ``KVROUTER_ENVOY_UNAVAILABLE`` (set by .ci/run when pip could not
reach the index) makes it a skip.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sim.gateway import DEST, ENVOY_VERSION, EnvoyProcess, UpstreamTls, bootstrap, envoy_binary_path

BINARY = envoy_binary_path()


def envoy_binary() -> Path:
    """The Envoy binary, or the skip (outside CI) / failure (in CI) saying why it is missing."""
    if BINARY.exists():
        return BINARY
    unavailable = os.environ.get("KVROUTER_ENVOY_UNAVAILABLE")
    if unavailable:
        pytest.skip(f"Envoy not installed: {unavailable}")
    why = f"no Envoy at {BINARY} (run tests/envoy/install.sh)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs the Envoy tests but {why}", pytrace=False)
    pytest.skip(why)


class Envoy(EnvoyProcess):
    """One Envoy process for a bootstrap (the binary :func:`envoy_binary` finds); :attr:`url` is
    its listener."""

    def __init__(self, config: dict[str, Any], tmp: Path, name: str = "envoy") -> None:
        super().__init__(config, tmp, name, envoy_binary())


__all__ = ["BINARY", "DEST", "ENVOY_VERSION", "Envoy", "UpstreamTls", "bootstrap", "envoy_binary"]
