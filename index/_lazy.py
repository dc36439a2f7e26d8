"""A module imported on first attribute access: numpy serves only the Python ingest path (events
the C core hands over: LoRA, extra keys, ...) and tests, so a router that never needs it does not
pay its ~15 MB and ~0.1 s at start-up."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for a module until an attribute is first read, then imports it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._mod: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._mod is None:
            self._mod = importlib.import_module(self._name)
        return getattr(self._mod, attr)
