"""Token ids parsed by compiled code on the ingest path: no Python int per token.

msgspec decoding ``token_ids`` into 16 Python ints per block (and freeing them with the batch) was
the largest cost of ingest (BENCHMARKS.md, issue 2). Even ``msgspec.Raw`` costs ~7 ns per token
here, as msgspec still walks the array to find its end. So one compiled pass per payload
(:func:`strip_tokens`) walks the msgpack structure itself: it parses every BlockStored's
``token_ids`` array (map events, vLLM >= 0.24, and tagged arrays, <= 0.23) into one uint64 buffer,
and rewrites a copy of the payload in place, each of those arrays replaced by an empty array
(:func:`strip_events`, the decoder's) or by its index (:func:`strip_tokens`). msgspec decodes that
small copy into the usual structs, and each event gets a :class:`TokenIds`, a read-only sequence
over its slice of the buffer, equal to the list msgspec would have decoded. The ingestor hashes the
buffer slices (:func:`index.keys.u64_block_contents`) with no Python object per token. The same
walk notes whether the hashes, parents, block sizes and media are already in the form the decoder
normalises to (most payloads), so that it can skip normalising. The buffer is the caller's, and
only ints come back: boxing a returned array cost ~0.5 us per call.

msgpack ints accepted as token ids: positive fixint, uint8/16/32/64, and int8/16/32/64 holding a
non-negative value (msgspec decodes all of them into ``list[int]``). Negative values mark the array
(the event is then skipped and counted at ingest, as before). Anything else (a token that is not
an int, ``token_ids`` that is not an array, any malformed msgpack) makes the pass give up, and the
caller decodes the payload the generic way, which raises the same errors as always.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import overload

import msgspec
import numba
import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

_PAD = bytes(8)
"""Appended to the payload so that an item's 8 bytes after its type byte can always be loaded."""


def _tables() -> tuple[U64, U64, U64, U64, U64, U64]:
    """Per msgpack type byte (the token loop looks these up instead of branching on the type)."""
    size = np.zeros(256, dtype=np.uint64)  # bytes after the type byte
    bad = np.ones(256, dtype=np.uint64)  # not an int: nil, bool, bin, ext, float, str, containers
    negative = np.zeros(256, dtype=np.uint64)  # negative fixint
    signed = np.zeros(256, dtype=np.uint64)  # int8..int64: negative when the sign bit is set
    shift = np.zeros(256, dtype=np.uint64)  # right shift of the 4 bytes after the type byte
    fixint = np.zeros(256, dtype=np.uint64)  # the type byte is the value
    bad[:0x80] = bad[0xE0:] = 0
    fixint[:0x80] = fixint[0xE0:] = 1
    negative[0xE0:] = 1
    for i, n in enumerate((1, 2, 4, 8)):
        for t in (0xCC + i, 0xD0 + i):  # uint8..uint64, int8..int64
            size[t] = n
            shift[t] = max(32 - 8 * n, 0)  # of the 4 bytes after the type byte
            bad[t] = 0
        signed[0xD0 + i] = 1
    return size, bad, negative, signed, shift, fixint


_SIZE, _BAD, _NEGATIVE, _SIGNED, _SHIFT, _FIXINT = _tables()
_INT = _SIZE | (_SHIFT << np.uint64(8)) | (_FIXINT << np.uint64(16)) | (_BAD << np.uint64(17))
_INT |= (_NEGATIVE << np.uint64(18)) | (_SIGNED << np.uint64(19))
"""The tables above packed into one word per type byte: one load per token instead of six."""


def _fixed_sizes() -> I64:
    """Total bytes of every msgpack value whose size its type byte gives (0: containers, var-length)."""
    fixed = np.zeros(256, dtype=np.int64)
    fixed[:0x80] = fixed[0xE0:] = 1  # fixints
    for b in range(0xA0, 0xC0):  # fixstr
        fixed[b] = 1 + (b & 0x1F)
    fixed[[0xC0, 0xC2, 0xC3]] = 1  # nil, false, true
    fixed[0xCA], fixed[0xCB] = 5, 9  # float32/64
    for i, n in enumerate((1, 2, 4, 8)):
        fixed[0xCC + i] = fixed[0xD0 + i] = 1 + n  # (u)int8..64
    for i, n in enumerate((1, 2, 4, 8, 16)):
        fixed[0xD4 + i] = 2 + n  # fixext1..16
    return fixed


_FIXED = _fixed_sizes()
_TOKEN_IDS = np.frombuffer(b"token_ids", dtype=np.uint8).copy()
_BLOCK_STORED = np.frombuffer(b"BlockStored", dtype=np.uint8).copy()
_BLOCK_HASHES = np.frombuffer(b"block_hashes", dtype=np.uint8).copy()
_PARENT = np.frombuffer(b"parent_block_hash", dtype=np.uint8).copy()
_BLOCK_SIZE = np.frombuffer(b"block_size", dtype=np.uint8).copy()
_MEDIUM = np.frombuffer(b"medium", dtype=np.uint8).copy()
ROW = 6
"""Words per token array in :func:`_strip`'s table."""

# Token positions are unsigned: numba then skips the negative-index wraparound on every byte load,
# which halved the cost per token (~5.0 -> ~2.7 ns). Parsing is one chain of dependent loads (each
# item's position depends on the previous item's type byte), so the loop has no data-dependent
# branch: token ids mix 2- and 4-byte encodings at random, and a mispredicted branch per token
# cost ~4 ns.
_ONE = np.uint64(1)
_NEG_BIT = np.uint64(1 << 18)
_U64 = np.dtype(np.uint64)


@numba.njit(cache=True, inline="always")
def _be(buf: bytearray, pos: int, size: int) -> int:  # pragma: no cover - compiled
    """Big-endian unsigned int of ``size`` (1, 2 or 4) bytes at ``pos``."""
    v = 0
    for i in range(size):
        v = (v << 8) | int(buf[pos + i])
    return v


@numba.njit(cache=True, inline="always")
def _u32(buf: bytearray, p: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    return (
        (np.uint64(buf[p]) << np.uint64(24))
        | (np.uint64(buf[p + np.uint64(1)]) << np.uint64(16))
        | (np.uint64(buf[p + np.uint64(2)]) << np.uint64(8))
        | np.uint64(buf[p + np.uint64(3)])
    )


@numba.njit(cache=True)
def _skip(buf: bytearray, pos: int, end: int) -> int:  # pragma: no cover - compiled
    """Position after the msgpack value at ``pos`` (containers included), or -1 if malformed."""
    need = 1
    while need > 0:
        if pos >= end:
            return -1
        need -= 1
        b = int(buf[pos])
        fixed = _FIXED[b]
        if fixed:  # scalars (most values): one table lookup
            pos += fixed
        elif b <= 0x8F:  # fixmap
            need += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:  # fixarray
            need += b & 0x0F
            pos += 1
        elif b <= 0xC6 or 0xD9 <= b <= 0xDB:  # bin8/16/32, str8/16/32
            size = 1 << (b - (0xC4 if b <= 0xC6 else 0xD9))
            if pos + 1 + size > end:
                return -1
            pos += 1 + size + _be(buf, pos + 1, size)
        elif 0xC7 <= b <= 0xC9:  # ext8/16/32: length, type byte, data
            size = 1 << (b - 0xC7)
            if pos + 1 + size > end:
                return -1
            pos += 2 + size + _be(buf, pos + 1, size)
        elif b >= 0xDC:  # array16/32, map16/32
            size = 2 if b == 0xDC or b == 0xDE else 4
            if pos + 1 + size > end:
                return -1
            n = _be(buf, pos + 1, size)
            need += n if b <= 0xDD else 2 * n
            pos += 1 + size
        else:  # 0xC1: never used
            return -1
    return pos if pos <= end else -1


@numba.njit(cache=True, inline="always")
def _container(buf: bytearray, pos: int, end: int, maps: bool) -> tuple[int, int]:  # pragma: no cover
    """(count, position after the header) of the array (or map) at ``pos``; count -1 if not one."""
    if pos >= end:
        return -1, end
    b = int(buf[pos])
    base = 0x80 if maps else 0x90
    if base <= b <= base + 0x0F:
        return b & 0x0F, pos + 1
    if b == (0xDE if maps else 0xDC) and pos + 3 <= end:
        return _be(buf, pos + 1, 2), pos + 3
    if b == (0xDF if maps else 0xDD) and pos + 5 <= end:
        return _be(buf, pos + 1, 4), pos + 5
    return -1, end


@numba.njit(cache=True, inline="always")
def _str_is(buf: bytearray, pos: int, end: int, text: U8) -> bool:  # pragma: no cover - compiled
    """Whether the value at ``pos`` is the string ``text`` (in any msgpack str encoding)."""
    if pos >= end:
        return False
    b = int(buf[pos])
    if 0xA0 <= b <= 0xBF:
        n, start = b & 0x1F, pos + 1
    elif 0xD9 <= b <= 0xDB and pos + 5 <= end:
        size = 1 << (b - 0xD9)
        n, start = _be(buf, pos + 1, size), pos + 1 + size
    else:
        return False
    if n != len(text) or start + n > end:
        return False
    for i in range(n):  # noqa: SIM110 - all() over a generator does not compile
        if buf[start + i] != text[i]:
            return False
    return True


@numba.njit(cache=True, inline="always")
def _is_uint(b: int) -> bool:  # pragma: no cover - compiled
    """Whether a type byte is a msgpack unsigned int (positive fixint, uint8..64)."""
    return b <= 0x7F or 0xCC <= b <= 0xCF


@numba.njit(cache=True)
def _uint_array(buf: bytearray, pos: int, end: int) -> bool:  # pragma: no cover - compiled
    """Whether the value at ``pos`` is an array of unsigned ints only."""
    count, p = _container(buf, pos, end, False)
    if count < 0:
        return False
    for _ in range(count):
        if p >= end:
            return False
        b = int(buf[p])
        if b <= 0x7F:
            p += 1
        elif 0xCC <= b <= 0xCF:
            p += 1 + (1 << (b - 0xCC))
        else:
            return False
    return p <= end


_FIELD_OTHER = 0
_FIELD_HASHES = 1
_FIELD_PARENT = 2
_FIELD_SIZE = 3
_FIELD_MEDIUM = 4


@numba.njit(cache=True)
def _field(buf: bytearray, pos: int, end: int) -> int:  # pragma: no cover - compiled
    """Which of the fields :func:`index.wire` normalises the map key at ``pos`` names, if any."""
    if _str_is(buf, pos, end, _BLOCK_HASHES):
        return _FIELD_HASHES
    if _str_is(buf, pos, end, _PARENT):
        return _FIELD_PARENT
    if _str_is(buf, pos, end, _BLOCK_SIZE):
        return _FIELD_SIZE
    if _str_is(buf, pos, end, _MEDIUM):
        return _FIELD_MEDIUM
    return _FIELD_OTHER


@numba.njit(cache=True)
def _normal(buf: bytearray, pos: int, end: int, field: int) -> bool:  # pragma: no cover - compiled
    """Whether the value at ``pos`` of a map event's ``field`` is already in the form the decoder
    normalises to: hashes and parents unsigned ints (or no parent), a block size that is not
    negative, a medium that is not nil."""
    if field == _FIELD_OTHER or pos >= end:
        return True
    b = int(buf[pos])
    if field == _FIELD_HASHES:
        return _uint_array(buf, pos, end)
    if field == _FIELD_PARENT:
        return b == 0xC0 or _is_uint(b)
    if field == _FIELD_SIZE:
        return _is_uint(b)
    return b != 0xC0  # medium


@numba.njit(cache=True)
def _strip(buf: bytearray, table: U64, cap: int, empty: bool) -> tuple[int, int, bool]:  # pragma: no cover
    """Strip the token arrays of ``payload + _PAD``, in place: (length of the stripped payload,
    number of token arrays k, clean); length -1 when giving up (``buf`` is then garbage).

    ``table`` (the caller's: no array to box on return, which costs ~0.5 us a call) gets k rows of
    :data:`ROW` words (first token, count, negative, start and end of the array in the payload,
    number of its event), at most ``cap`` rows (more: give up), then from word ``ROW * cap`` the
    tokens; it needs room for one token per payload byte. In the stripped payload each array is
    replaced by its row number, or by an empty array when ``empty`` (the copy then decodes with the
    ordinary decoders, token ids ``[]``); neither takes more room than the array did (else this
    gives up). ``clean``: every map event's block hashes, parent, block size and medium are already
    in normal form (see :func:`index.wire.decode_payload`; False for the legacy array shape).
    """
    end = len(buf) - 8
    fail = (-1, 0, False)
    n_top, pos = _container(buf, 0, end, False)
    if n_top < 2:
        return fail
    pos = _skip(buf, pos, end)  # ts
    n_events, pos = _container(buf, pos if pos >= 0 else end, end, False)
    if n_events < 0 or n_events > end - pos:  # (each event takes a byte)
        return fail
    if len(table) < ROW * cap + end:
        return fail
    clean = True
    o = 0  # bytes of the stripped payload written (never ahead of `copied`)
    copied = 0  # payload bytes already moved
    k = 0  # token arrays found
    t = np.uint64(ROW * cap)  # next token's slot
    for ev in range(n_events):
        # where this event's token_ids is: a map key, or item 3 of a ["BlockStored", ...] array
        n_items, first = _container(buf, pos, end, True)
        is_map = n_items >= 0
        if not is_map:
            clean = False
            n_items, first = _container(buf, pos, end, False)
            if n_items < 1 or not _str_is(buf, first, end, _BLOCK_STORED):
                pos = _skip(buf, pos, end)
                if pos < 0:
                    return fail
                continue
        pos = first
        for i in range(n_items):
            field = _FIELD_OTHER
            if is_map:
                is_tokens = _str_is(buf, pos, end, _TOKEN_IDS)
                if clean and not is_tokens:
                    field = _field(buf, pos, end)
                pos = _skip(buf, pos, end)  # the key
                if pos < 0:
                    return fail
            else:
                is_tokens = i == 3
            if not is_tokens:
                if field != _FIELD_OTHER and not _normal(buf, pos, end, field):
                    clean = False
                pos = _skip(buf, pos, end)
                if pos < 0:
                    return fail
                continue
            count, p = _container(buf, pos, end, False)
            if count < 0 or k >= cap:
                return fail
            start = pos
            t0 = t
            flags = np.uint64(0)  # bit 17: not an int; bit 18: negative
            up = np.uint64(p)
            uend = np.uint64(end)
            for _ in range(count):
                if up >= uend:
                    return fail
                b = buf[up]
                e = _INT[b]
                w = _u32(buf, up + _ONE)
                fix = (e >> np.uint64(16)) & _ONE
                # fixint: the type byte itself; else the top `size` bytes of w; no branch
                # (8-byte ids take the one branch: vocabularies are far below 2^32, so it is
                # never taken and costs nothing; the 4-byte load saves four loads per token)
                if e & np.uint64(8):
                    shifted = (w << np.uint64(32)) | _u32(buf, up + np.uint64(5))
                else:
                    shifted = w >> ((e >> np.uint64(8)) & np.uint64(0xFF))
                table[t] = (shifted & (fix - _ONE)) | (np.uint64(b) & (np.uint64(0) - fix))
                # negative: bit 18, or a signed type (bit 19) whose first byte has its sign bit set
                flags |= e | ((e >> _ONE) & (np.uint64(buf[up + _ONE]) << np.uint64(11)) & _NEG_BIT)
                t += _ONE
                up += _ONE + (e & np.uint64(0xFF))
            if flags & np.uint64(1 << 17) or up > uend:
                return fail
            pos = int(np.int64(up))
            placeholder = 1 if empty or k < 0x80 else 2 if k < 0x100 else 3  # [], fixint, uint8, uint16
            if pos - start < placeholder:  # (an empty array, row 128 or later)
                return fail
            row = ROW * k
            table[row] = t0
            table[row + 1] = count
            table[row + 2] = 1 if flags & _NEG_BIT else 0
            table[row + 3] = start
            table[row + 4] = pos
            table[row + 5] = ev
            for j in range(start - copied):  # move left (o <= copied): a forward copy is safe
                buf[o + j] = buf[copied + j]
            o += start - copied
            if empty:
                buf[o] = 0x90
            elif k < 0x80:
                buf[o] = k
            elif k < 0x100:
                buf[o] = 0xCC
                buf[o + 1] = k
            else:
                buf[o] = 0xCD
                buf[o + 1] = k >> 8
                buf[o + 2] = k & 0xFF
            o += placeholder
            copied = pos
            k += 1
    for _ in range(n_top - 2):  # data_parallel_rank and anything after it
        pos = _skip(buf, pos, end)
        if pos < 0:
            return fail
    if pos != end:
        return fail
    for j in range(end - copied):
        buf[o + j] = buf[copied + j]
    o += end - copied
    return o, k, clean


@numba.njit(cache=True)
def _contents(tokens: U64, block_size: int, muls: U64) -> U64:  # pragma: no cover - compiled
    """``fmix64(sum_k tokens[i*B+k] * R[k] mod 2^64)`` for every full block of ``tokens``."""
    n_blocks = len(tokens) // block_size
    out = np.empty(n_blocks, dtype=np.uint64)
    t = 0
    for blk in range(n_blocks):
        acc = np.uint64(0)
        for k in range(block_size):
            acc += tokens[t] * muls[k]
            t += 1
        x = acc
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
        out[blk] = x
    return out


def contents(tokens: U64, block_size: int, muls: U64) -> U64:
    """Content hashes of every full block of a uint64 token array (see :mod:`index.keys`)."""
    return _contents(tokens, block_size, muls)


_list_decoder = msgspec.msgpack.Decoder(list[int])


class TokenIds(Sequence[int]):
    """A BlockStored's token ids as a slice of a uint64 buffer: a read-only sequence of ints.

    Compares equal to the list msgspec would have decoded; becomes a Python list only when read.
    """

    __slots__ = ("_list", "buf", "negative", "off", "size", "source")

    def __init__(self, buf: U64, off: int, size: int, negative: bool = False, source: bytes = b"") -> None:
        self.buf = buf
        """The payload's token buffer (shared by its events)."""
        self.off = off
        """First token in ``buf``."""
        self.size = size
        """Number of token ids."""
        self.negative = negative
        """True when some id is negative (the ingestor skips such events; ``buf`` does not hold them)."""
        self.source = source
        """The msgpack array itself when ``negative``, to decode the exact values on demand."""
        self._list: list[int] | None = None

    def array(self) -> U64:
        """The ids as a uint64 view (meaningless when ``negative``)."""
        return self.buf[self.off : self.off + self.size]

    def _items(self) -> list[int]:
        if self._list is None:
            if self.negative:
                self._list = _list_decoder.decode(self.source)
            else:
                self._list = self.array().tolist()
        return self._list

    def tolist(self) -> list[int]:
        """The ids as a new Python list."""
        return list(self._items())

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._items()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._items() == other._items()
        if isinstance(other, list):
            return self._items() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # list semantics: unhashable

    def __repr__(self) -> str:
        return repr(self._items())


def _run(payload: bytes, empty: bool) -> tuple[bytearray, U64, int, int, bool] | None:
    """:func:`_strip` on a copy of ``payload``: (buffer, table, stripped length, arrays, clean)."""
    size = len(payload)
    buf = bytearray(payload)
    buf += _PAD
    cap = size // 12 + 1  # each token array takes 12 bytes or more ({"token_ids": []}): room enough
    table = np.empty(ROW * cap + size, _U64)
    n, k, clean = _strip(buf, table, cap, empty)
    if n < 0:
        return None
    return buf, table, n, k, clean


def _token_ids(payload: bytes, table: U64, k: int) -> list[tuple[int, TokenIds]]:
    """(event number, ids) of each of the k token arrays :func:`_strip` found."""
    out = []
    rows = table[: ROW * k].tolist()
    for r in range(0, ROW * k, ROW):
        first, count, negative, start, stop, ev = rows[r : r + ROW]
        if negative:
            out.append((ev, TokenIds(table, first, count, True, payload[start:stop])))
        else:
            out.append((ev, TokenIds(table, first, count)))
    return out


def strip_tokens(payload: bytes) -> tuple[memoryview, list[TokenIds]] | None:
    """(payload with each token_ids array replaced by its index, the arrays), or None when the
    payload is not plain enough for this path (the caller then decodes it the generic way)."""
    run = _run(payload, False)
    if run is None:
        return None
    buf, table, n, k, _ = run
    return memoryview(buf)[:n], [ids for _, ids in _token_ids(payload, table, k)]


def strip_events(payload: bytes) -> tuple[memoryview, list[tuple[int, TokenIds]], bool] | None:
    """(payload with each token_ids array replaced by an empty array, (event number, ids) of each
    array in order, clean), or None as :func:`strip_tokens`.

    The copy decodes with the ordinary decoders (token ids ``[]``), into the events the ids then go
    to. ``clean``: every map event's block hashes and parent are unsigned ints (or no parent), its
    block size is not negative and its medium is not nil, so normalising the batch would change
    nothing (False for the legacy array shape: normalising decides). The ingest path: one call per
    message, so the usual single array skips :func:`_token_ids`.
    """
    run = _run(payload, True)
    if run is None:
        return None
    buf, table, n, k, clean = run
    if k == 1:
        first, count, negative, _, _, ev = table[:ROW].tolist()
        if not negative:
            return memoryview(buf)[:n], [(ev, TokenIds(table, first, count))], clean
    return memoryview(buf)[:n], _token_ids(payload, table, k) if k else [], clean


@functools.cache
def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels now rather than on the first message
    (once per process).

    The first call compiles (~3.5 s with an empty cache, holding the GIL; ~0.2 s when loading
    from numba's cache in ``__pycache__``); call it at start-up, off any latency-sensitive path.
    """
    strip_events(msgspec.msgpack.encode([0.0, [{"token_ids": [1], "medium": "GPU"}], 0]))
    contents(np.ones(1, dtype=np.uint64), 1, np.ones(1, dtype=np.uint64))
