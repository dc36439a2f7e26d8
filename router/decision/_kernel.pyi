from typing import Any

COLUMNS: int

def score(
    params: tuple[float | int, ...],
    matched: list[int],
    media: list[dict[str, int] | None] | None,
    offs: list[list[int] | None] | None,
    roles: bytes | None,
    loads: list[Any],
    assumed: list[float] | None,
    spread: tuple[float, float] | None,
    rng: Any,
    order: list[int] | None,
    turn: int,
    extra: Any = None,
) -> tuple[bytes, int, bool, int]: ...
def gather(out: Any, table: Any, base: int, stride: int, rows: int, skip: int, slots: Any) -> None: ...
def take(record: bytes, n: int, picked: list[int]) -> bytes: ...
def reasons(record: bytes, n: int, best: int, prefix: bool, kv: bool) -> bytes: ...
def render(
    record: bytes,
    n: int,
    best: int,
    codes: bytes,
    names: list[bytes],
    ranks: list[int],
    media: list[dict[str, int] | None] | None,
    offs: list[list[int] | None] | None,
    medium_names: tuple[str, ...],
    policy: bytes,
    encode: Any,
) -> bytes: ...
def top(record: bytes, n: int, best: int, k: int) -> list[int]: ...
