"""Types of the compiled /route decision (router/decision/_explain.c)."""

from collections.abc import Callable
from typing import Any

def explain_kv(
    head: bytes,
    names: list[bytes],
    ranks: list[int],
    matched: list[int],
    media: list[dict[str, int] | None],
    loads: list[Any],
    params: tuple[float | int, ...],
    rng: Any,
    encode: Callable[[Any], bytes],
    clock: Callable[[], float],
    t0: float,
    t1: float,
    t2: float,
) -> bytes: ...
