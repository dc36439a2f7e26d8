"""Our own chained 64-bit block keys, computed from token ids.

vLLM's block hash depends on the hash algorithm, PYTHONHASHSEED and the version, so we never try to
reproduce it: the index keys every block by a key of our own, and the router computes the same key
for a prompt. The key of block ``i`` commits to every token before it (a chain):

    m_i = fmix64(sum_k tokens[i*B + k] * R[k]  mod 2^64)  ^ extra_i      # content of block i
    S_i = S_{i-1} * C + m_i                                 mod 2^64      # chain, S_{-1} = root

``R`` are fixed odd 64-bit constants (one per position in a block), ``fmix64`` is the MurmurHash3
finaliser, ``C`` an odd multiplier, ``root`` a fixed non-zero salt for the base model or one derived
from the LoRA name, and ``extra_i`` a hash of the block's extra keys (cache_salt, multimodal ids)
when it has any.

Why this shape: the content hash is one numpy matrix-vector product over all blocks, and because
the chain is a linear recurrence it can also be computed for a whole prompt at once,
``S_i = C^i * cumsum(m_j * C^-j) + C^(i+1) * root``, so an 8k-token prompt costs tens of
microseconds, while events extend a known parent one block at a time with the
same arithmetic. Collisions only mis-route (the engine computes its own hashes), and they are
~2^-64 per pair for non-adversarial prompts.
"""

from __future__ import annotations

import functools
from _blake2 import blake2b  # (hashlib's blake2b, without loading OpenSSL's hashes at start-up)
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import msgspec

import index._kvcore as _kvcore
from index._lazy import LazyModule

M64 = (1 << 64) - 1
CHAIN_MUL = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
_CHAIN_INV = pow(CHAIN_MUL, -1, 1 << 64)
MAX_BLOCK_SIZE = 4096
"""The largest block size keys are computed for (one position multiplier per token of a block)."""

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U64 = npt.NDArray[np.uint64]
else:
    np = LazyModule("numpy")  # the Python ingest path only; prompts are hashed in C


def _splitmix(seed: int, n: int) -> list[int]:
    out = []
    x = seed & M64
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & M64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append((z ^ (z >> 31)) | 1)
    return out


@functools.cache
def _position_muls() -> U64:
    """The multipliers of the Python path (the C core has its own copy): made at first use, as
    4,096 Python-int rounds cost ~2.5 ms of every router's start."""
    return np.array(_splitmix(0x6B76726F75746572, MAX_BLOCK_SIZE), dtype=np.uint64)


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser (scalar)."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


_S33 = 33
_FMIX_M1 = 0xFF51AFD7ED558CCD
_FMIX_M2 = 0xC4CEB9FE1A85EC53


def _fmix64_vec(x: U64) -> U64:
    """:func:`fmix64` of every item; in place on two temporaries (512 items: ~4.6 vs ~6.5 us)."""
    s33, m1, m2 = np.uint64(_S33), np.uint64(_FMIX_M1), np.uint64(_FMIX_M2)
    y = x >> s33
    y ^= x
    y *= m1
    t = y >> s33
    y ^= t
    y *= m2
    np.right_shift(y, s33, out=t)
    y ^= t
    return y


def stable_hash(value: Any) -> int:
    """A process-independent 64-bit hash of a msgpack-encodable value (salts, extra keys)."""
    raw = msgspec.msgpack.encode(value)
    return int.from_bytes(blake2b(raw, digest_size=8).digest(), "little")


BASE_ROOT = stable_hash(["base-model"]) | 1
"""Chain root of the base model. Not 0: with a zero root, blocks whose content hash is 0 (all token
ids 0) would get key 0 at every depth and match at the wrong depth."""


def lora_root(lora_name: str | None) -> int:
    """The chain root: a fixed salt for the base model, one per LoRA adapter so adapters never match."""
    if not lora_name:
        return BASE_ROOT
    return stable_hash(["lora", lora_name]) | 1


def extra_hash(items: Sequence[Any]) -> int:
    """Salt for one block's extra keys (cache_salt, multimodal identifiers, prompt-embeds digests)."""
    return stable_hash(["extra", list(items)])


def request_extra_keys(
    block_size: int, cache_salt: str | None = None, media: Sequence[Sequence[Any]] | None = None
) -> dict[int, Sequence[Any]] | None:
    """Each block's extra key items for a prompt, as vLLM's events list them once the LoRA name is
    dropped (ingest drops it too): a block that a media range ``(offset, length, identifier)``
    touches carries ``[identifier, offset - block start]`` (negative for the blocks after the
    range's first), one pair per range in prompt order, then the cache salt on block 0."""
    out: dict[int, list[Any]] = {}
    for offset, length, ident in media or ():
        if length <= 0:
            continue
        for b in range(offset // block_size, (offset + length - 1) // block_size + 1):
            out.setdefault(b, []).append([ident, offset - b * block_size])
    if cache_salt:
        out.setdefault(0, []).append(cache_salt)
    return dict(out) if out else None


class _Powers:
    """Cached powers of C and C^-1 mod 2^64, grown on demand (shared per process, read-mostly)."""

    def __init__(self) -> None:
        self.fwd: U64 = None  # type: ignore[assignment]  # (made on first use: numpy is lazy)
        self.inv: U64 = None  # type: ignore[assignment]

    def ensure(self, n: int) -> None:
        have = 0 if self.fwd is None else len(self.fwd)
        if have >= n:
            return
        size = max(n, 2 * have, 1024)
        fwd = [1] * size
        inv = [1] * size
        for i in range(1, size):
            fwd[i] = (fwd[i - 1] * CHAIN_MUL) & M64
            inv[i] = (inv[i - 1] * _CHAIN_INV) & M64
        self.inv = np.array(inv, dtype=np.uint64)
        self.fwd = np.array(fwd, dtype=np.uint64)


powers = _Powers()
"""The process-wide power tables (read-mostly; grown on demand)."""


def block_contents(tokens: Sequence[int] | array[int], block_size: int) -> U64:
    """``m_i`` (before extra keys) for every full block of ``tokens``; a partial tail is ignored."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size {block_size} outside 1..{MAX_BLOCK_SIZE}")
    n = len(tokens) // block_size
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    if isinstance(tokens, array):
        buf = tokens
    else:
        buf = array("Q")
        if type(tokens) is list:
            buf.fromlist(tokens)  # ~30% faster than array("Q", tokens) (8k tokens: ~48 vs ~69 us)
        else:
            buf.extend(tokens)
    mat = np.frombuffer(buf, dtype=np.uint64, count=n * block_size).reshape(n, block_size)
    return _fmix64_vec(mat @ _position_muls()[:block_size])


def u64_block_contents(tokens: U64, block_size: int) -> U64:
    """:func:`block_contents` of a uint64 token array, compiled (same values, no temporaries).

    The Python ingest path, for decoded events whose ids are such arrays.
    """
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size {block_size} outside 1..{MAX_BLOCK_SIZE}")
    if not tokens.flags.c_contiguous:
        tokens = np.ascontiguousarray(tokens)
    return np.frombuffer(bytearray(_kvcore.block_contents(tokens, block_size)), dtype=np.uint64)


def chain(parent: int, contents: Sequence[int]) -> list[int]:
    """Extend a known key ``parent`` by blocks with contents ``m`` (scalar path, for events)."""
    out = []
    s = parent
    for m in contents:
        s = (s * CHAIN_MUL + m) & M64
        out.append(s)
    return out


def chain_vec(root: int, contents: U64) -> U64:
    """All chain keys from ``root`` at once (vectorised; equals :func:`chain`)."""
    n = len(contents)
    if n == 0:
        return contents
    powers.ensure(n + 1)
    acc = np.cumsum(contents * powers.inv[:n], dtype=np.uint64)
    keys = acc * powers.fwd[:n]
    if root:
        keys = keys + powers.fwd[1 : n + 1] * np.uint64(root)
    return keys


class TokenBuffer(Sequence[int]):
    """A prompt's token ids as native uint64 bytes (parsed from JSON by :func:`parse_token_ids`):
    hashing and matching read the bytes directly, so a long prompt never becomes Python ints."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        """The ids, 8 bytes each, native byte order."""

    def __len__(self) -> int:
        return len(self.raw) // 8

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        view = memoryview(self.raw).cast("Q")
        return view[index].tolist() if isinstance(index, slice) else int(view[index])

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self.raw).cast("Q").tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenBuffer):
            return self.raw == other.raw
        if isinstance(other, list):
            return memoryview(self.raw).cast("Q").tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # list semantics

    def first_above(self, max_id: int) -> int:
        """Index of the first id above ``max_id`` (-1: none), in one C loop."""
        at: int = _kvcore.first_above(self.raw, max_id)
        return at


def parse_token_ids(raw: bytes | memoryview) -> TokenBuffer | None:
    """A JSON array of non-negative ints (the bytes of one JSON value) as a :class:`TokenBuffer`, or
    None when it is anything else (the caller decodes it the generic way, which decides)."""
    ids = _kvcore.json_ids(raw)
    return None if ids is None else TokenBuffer(ids)


def prompt_keys_both(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: dict[int, Sequence[Any]] | None = None,
) -> tuple[list[int], bytes]:
    """:func:`prompt_keys` as a list and as the raw uint64 buffer the store's lookup takes (one C
    pass over the token list: no numpy on the request path)."""
    raw = prompt_keys_raw(tokens, block_size, lora_name, extra_keys)
    return memoryview(raw).cast("Q").tolist(), raw


def prompt_keys_raw(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None,
    extra_keys: dict[int, Sequence[Any]] | None,
) -> bytes:
    """:func:`prompt_keys` as the raw uint64 buffer the store's lookup takes (no Python ints)."""
    extras = None
    if extra_keys:
        extras = [(i, extra_hash(items)) for i, items in extra_keys.items() if items]
    if type(tokens) is TokenBuffer:
        src: Any = tokens.raw
    elif isinstance(tokens, list | tuple):
        src = tokens
    else:
        src = list(tokens)
    raw: bytes = _kvcore.prompt_keys(src, block_size, lora_root(lora_name), extras)
    return raw


def prompt_keys(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: dict[int, Sequence[Any]] | None = None,
) -> list[int]:
    """Keys of every full block of a prompt, as the index stores them for the same tokens.

    ``extra_keys`` maps a block index to that block's extra key items (e.g. ``{0: [cache_salt]}``).
    Raises ValueError for token ids outside 0..2^64-1.
    """
    return memoryview(prompt_keys_raw(tokens, block_size, lora_name, extra_keys)).cast("Q").tolist()


def unknown_root(sidx: int, parent: int) -> int:
    """The chain root of a block whose parent the source never reported: derived from (source,
    parent hash), never a prompt's root (those are the base and LoRA roots), so such chains can never
    match a prompt while their children still chain and their removals resolve (the C ingest
    computes the same value)."""
    root: int = _kvcore.unknown_root(sidx, parent)
    return root


def check_token_ids(ids: list[Any], max_id: int | None) -> int:
    """Index of the first id that is not a plain int (bools are not) in 0..``max_id``, -1 when all
    are: one C loop (a Python loop cost ~60 ns per id, 2 ms for a 32k-token prompt)."""
    bad: int = _kvcore.check_ids(ids, max_id)
    return bad
