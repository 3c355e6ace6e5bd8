"""The warm pool of :class:`fastper.tiers.TieredStorage`: compressed chunks held in RAM.

:class:`WarmPieces` maps a chunk to its compressed blocks (one bytes object
per block) and keeps, in step with every change, each block's address and
size in arrays the compiled gather reads (:func:`fastper._kernels.lz4.warm_rows`)
and the bytes held (what ``warm_bytes`` bounds). It is separate from the
storage because it is a data structure with its own invariant (an address is
in the arrays exactly while its bytes are held), checked on its own, and
because finding where a bytes object's data lives is an interpreter detail
(:func:`piece_addresses`) that nothing else in the storage needs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BYTES_OFFSET", "WarmPieces", "bytes_offset", "piece_addresses"]


def bytes_offset() -> int | None:
    """Where a bytes object's data starts, from its ``id`` (CPython: its address),
    checked against ctypes on probes; None where that does not hold."""
    off = bytes.__basicsize__ - 1  # PyBytesObject: the header, then the bytes
    probes = [b"", b"x", bytes(range(7)), bytes(1000)]
    ok = all(ctypes.cast(ctypes.c_char_p(p), ctypes.c_void_p).value == id(p) + off for p in probes)
    return off if ok else None


#: :func:`bytes_offset` of this interpreter, found once at import
BYTES_OFFSET = bytes_offset()


def piece_addresses(pieces: tuple[bytes, ...], offset: int | None) -> list[int]:
    """Addresses of the data of bytes objects (stable while they live: bytes never move).

    Args:
        pieces: the bytes objects.
        offset: :data:`BYTES_OFFSET` (the fast way), or None: found through ctypes.
    """
    if offset is not None:  # ~0.1 us a piece against ~1 us through ctypes
        return [id(p) + offset for p in pieces]
    cast, void, char = ctypes.cast, ctypes.c_void_p, ctypes.c_char_p
    return [cast(char(p), void).value or 0 for p in pieces]  # c_char_p: no copy


class WarmPieces(dict[int, tuple[bytes, ...]]):
    """Warm chunks' compressed blocks (chunk -> a tuple of bytes, one per block),
    with each block's address and size kept in arrays for the compiled gather.

    The arrays are written on every change of the dict (set, delete, pop,
    clear: the only ones the storage makes; a chunk's pieces are a tuple, not
    changed in place), so an address is in them exactly while its bytes
    object is held here (bytes never move); with ``track`` False they stay
    empty (no compiled decoder).
    """

    def __init__(self, n_blocks: int, per_chunk: int, track: bool) -> None:
        super().__init__()
        self.per_chunk, self.track = per_chunk, track
        self.addr = np.zeros(n_blocks if track else 0, dtype=np.int64)
        self.size = np.zeros(n_blocks if track else 0, dtype=np.int64)
        #: bytes of all the pieces held (kept with every change: O(1) to read)
        self.nbytes = 0

    def _mark(self, c: int, pieces: tuple[bytes, ...] | None) -> None:
        if not self.track:
            return
        at = slice(c * self.per_chunk, (c + 1) * self.per_chunk)
        if pieces is None:
            self.addr[at] = 0
            self.size[at] = 0
        else:
            self.addr[at] = piece_addresses(pieces, BYTES_OFFSET)
            self.size[at] = [len(p) for p in pieces]

    def __setitem__(self, c: int, pieces: Sequence[bytes]) -> None:
        pieces = tuple(pieces)
        if self.track and not all(type(p) is bytes for p in pieces):
            raise TypeError("warm pieces must be bytes (immutable: their addresses stay valid)")
        self._mark(c, None)
        self.nbytes -= sum(len(p) for p in super().get(c, ()))
        super().__setitem__(c, pieces)
        self.nbytes += sum(len(p) for p in pieces)
        self._mark(c, pieces)

    def __delitem__(self, c: int) -> None:
        self.pop(c)  # KeyError if absent, as dict's

    def pop(self, c: int, *default: Any) -> Any:
        if c not in self:
            return super().pop(c, *default)  # the default, or KeyError
        pieces = super().pop(c)
        self.nbytes -= sum(len(p) for p in pieces)
        self._mark(c, None)
        return pieces

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0
        self.addr[:] = 0
        self.size[:] = 0
