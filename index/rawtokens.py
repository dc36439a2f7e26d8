"""Token ids as slices of a uint64 buffer (:class:`TokenIds`), a read-only sequence of ints.

The ingest path no longer builds these: the C core (:mod:`index._kvcore`) parses payloads and
hashes their token arrays itself. The Python ingest path (index/ingest.py) still accepts events whose
``token_ids`` is a :class:`TokenIds` (hashed from the buffer without Python ints), which tests and
tools use to hand it uint64 arrays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

import msgspec

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U64 = npt.NDArray[np.uint64]

_list_decoder = msgspec.msgpack.Decoder(list[int])


class TokenIds(Sequence[int]):
    """A BlockStored's token ids as a slice of a uint64 buffer: a read-only sequence of ints.

    Compares equal to the list msgspec would have decoded; becomes a Python list only when read.
    """

    __slots__ = ("_list", "buf", "negative", "off", "size", "source")

    def __init__(self, buf: U64, off: int, size: int, negative: bool = False, source: bytes = b"") -> None:
        self.buf = buf
        """The token buffer (possibly shared by several events)."""
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
