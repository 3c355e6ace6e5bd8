"""The chunk table of :class:`fastper.tiers.TieredStorage` and its packed copies.

:class:`ChunkTableMixin` holds what the storage knows of each chunk (its
tier, its hot slot, its mass, when it was opened, its compressed size) and
the packed copies of chunks: warm pieces in RAM (:class:`fastper.tier_warm.WarmPieces`)
and cold files on disk. Its methods read a packed chunk back (a block, or the
whole chunk decoded), pack a hot chunk, drop a copy, and spill warm chunks
to disk when compressed RAM is over ``warm_bytes``: the moves that need
neither the background thread (:mod:`fastper.tier_prefetch`) nor a placement
decision (:mod:`fastper.tier_placement`), on which all the others are built.
It is separate so that the state every other part reads and writes is
defined, and reset, in one place.
"""

from __future__ import annotations

import os
import secrets
import warnings
from typing import Any

import numpy as np

from .storage import Field
from .tier_codecs import BlockLayout, Codec, OpenFiles, remove_files, write_chunk_file
from .tier_warm import WarmPieces

__all__ = ["COLD", "EMPTY", "HOT", "TIER_NAMES", "WARM", "ChunkTableMixin"]

HOT, WARM, COLD, EMPTY = 0, 1, 2, 3
TIER_NAMES = ("hot", "warm", "cold")


class ChunkTableMixin:
    """The per-chunk state of a tiered storage and its packed copies (see the module).

    The settings and the layout are set by :class:`fastper.tiers.TieredStorage`'s
    constructor; :meth:`_reset_state` makes the per-chunk state.
    """

    capacity: int
    fields: dict[str, Field]
    chunk_size: int
    _shift: int
    hot_bytes: int
    warm_bytes: int
    rebalance_every: int
    hysteresis: float
    smoothing: float
    max_moves: int | None
    pack_ahead: int | None
    codec: Codec
    prefetch: bool
    row_bytes: int
    _blocks: BlockLayout
    _warm_gather: Any
    rows_per_block: int
    blocks_per_chunk: int
    n_chunks: int
    chunk_bytes: int
    n_hot_slots: int
    cold_dir: str
    _pool: dict[str, np.ndarray]
    _cold_paths: list[str]
    _files: OpenFiles

    # -- state ----------------------------------------------------------------------
    def _reset_state(self) -> None:
        c = self.n_chunks
        # cold files of this state: a fresh name prefix, never reused
        self._prefix = os.path.join(self.cold_dir, secrets.token_hex(4) + "-")
        self._tier = np.full(c, EMPTY, dtype=np.int8)
        self._slot = np.full(c, -1, dtype=np.int64)
        self._mass = np.zeros(c, dtype=np.float64)  # for placement (inf: not yet weighed)
        self._avg = np.full(c, np.nan, dtype=np.float64)  # averaged masses (nan: none yet)
        self._weighed = np.zeros(c, dtype=np.float64)  # the last masses given, for stats
        self._seq = np.zeros(c, dtype=np.int64)  # when a chunk was last opened
        self._comp = np.zeros(c, dtype=np.int64)  # compressed bytes (warm / cold)
        self._pending = np.zeros(c, dtype=np.bool_)  # a promotion in flight
        self._packing = np.zeros(c, dtype=np.bool_)  # a background pack in flight
        self._sealed = False  # the open chunk is full and was handed to the packer
        self._comp_est = self.chunk_bytes  # compressed size of the last chunk packed
        self._slot_owner = np.full(self.n_hot_slots, -1, dtype=np.int64)  # -2: reserved
        self._warm = WarmPieces(
            c * self.blocks_per_chunk, self.blocks_per_chunk, track=self._warm_gather is not None
        )
        self._cold: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._open = -1
        self._old: tuple[int, Any, str] | None = None  # the open chunk's rows not yet rewritten
        self._fill = 0  # rows of the open chunk written since it was opened (from row 0)
        self._opened = 0
        self._gathers_since = 0
        self._counts = {
            "rows_hot": 0, "rows_warm": 0, "rows_cold": 0, "decompressions": 0,
            "disk_bytes_read": 0, "disk_bytes_written": 0, "promotions": 0, "demotions": 0,
            "rebalances": 0, "packs": 0, "inline_packs": 0, "prefetch_failures": 0,
            "rebalance_errors": 0, "spill_errors": 0,
        }  # fmt: skip

    def _path(self, c: int) -> str:
        return f"{self._prefix}{c:07d}.fpc"

    def _remove_file(self, path: str) -> None:
        self._files.forget(path)
        remove_files([path])
        if path in self._cold_paths:
            self._cold_paths.remove(path)

    # -- packed copies: made, dropped, spilled to disk, read back ----------------------
    def _pack(self, c: int) -> list[bytes]:
        """Compress hot chunk ``c``: one piece per block, its fields' rows one after another."""
        base = int(self._slot[c]) * self.chunk_size
        return self._blocks.pack([p[base : base + self.chunk_size] for p in self._pool.values()])

    def _warm_used(self) -> int:
        """RAM held by compressed chunks: warm ones and the copies kept for hot ones. O(1)."""
        return self._warm.nbytes

    def _spill(self) -> None:
        """While compressed RAM exceeds ``warm_bytes``: drop the kept copies of hot
        chunks (least mass first: a copy only saves a demotion's compression), then
        least-mass warm chunks to disk. O(C log C)."""
        # the copies of promotions in flight become kept copies (and give way) when installed
        moving = int(self._comp[self._pending & (self._tier == WARM)].sum())
        excess = self._warm_used() - moving - self.warm_bytes
        if excess <= 0:
            return
        kept = np.fromiter((c for c in self._warm if self._tier[c] == HOT), dtype=np.int64)
        for c in kept[np.lexsort((self._seq[kept], self._mass[kept]))].tolist():
            excess -= int(self._comp[c])
            del self._warm[c]
            self._comp[c] = 0
            if excess <= 0:
                return
        warm = np.flatnonzero((self._tier == WARM) & ~self._pending)
        order = warm[np.lexsort((self._seq[warm], self._mass[warm]))]
        n = int(np.searchsorted(np.cumsum(self._comp[order]), excess)) + 1
        try:
            for c in order[:n].tolist():
                self._to_cold(c)
        except OSError as exc:  # e.g. a full disk: stay in RAM (over budget), say so once
            self._counts["spill_errors"] += 1
            if self._counts["spill_errors"] == 1:
                warnings.warn(
                    f"fastper.tiers: cannot write cold chunks to {self.cold_dir!r} ({exc}); "
                    "keeping them warm, over warm_bytes",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _to_cold(self, c: int) -> None:
        pieces = self._warm[c]
        path = self._path(c)
        self._files.forget(path)
        offsets, crcs = write_chunk_file(path, pieces)  # raises before anything changes
        self._cold_paths.append(path)
        del self._warm[c]
        self._cold[c] = (offsets, crcs)
        self._tier[c] = COLD
        self._counts["disk_bytes_written"] += int(offsets[-1])

    def _drop_packed(self, c: int) -> None:
        self._warm.pop(c, None)
        if self._cold.pop(c, None) is not None:
            self._remove_file(self._path(c))
        self._comp[c] = 0

    def _source(self, c: int) -> tuple[int, Any, str]:
        """(tier, warm pieces or cold index, file) of the packed rows of chunk ``c``."""
        if c == self._open and self._old is not None:
            return self._old
        tier = int(self._tier[c])
        if tier == WARM:
            return tier, self._warm[c], ""
        return tier, self._cold[c], self._path(c)

    def _pieces(self, src: tuple[int, Any, str], which: np.ndarray | list[int]) -> list[bytes]:
        """The packed blocks ``which`` of a chunk (read from its file when cold)."""
        tier, packed, path = src
        which = which.tolist() if isinstance(which, np.ndarray) else which
        if tier == WARM:
            return [packed[j] for j in which]
        out = self._files.read(path, packed[0], packed[1], which)
        self._counts["disk_bytes_read"] += sum(len(p) for p in out)
        return out

    def _decode(self, pieces: list[bytes], where: str, count: bool = True) -> dict[str, np.ndarray]:
        """Decode blocks: ``{field: (len(pieces), rows_per_block, *shape)}``. O(bytes)."""
        if count:  # not from the background thread: install counts its work
            self._counts["decompressions"] += len(pieces)
        return self._blocks.decode(pieces, where)

    @staticmethod
    def _where(src: tuple[int, Any, str]) -> str:
        return f"cold chunk file {src[2]!r}" if src[0] == COLD else "a warm chunk"

    def _decode_source(self, src: tuple[int, Any, str]) -> dict[str, np.ndarray]:
        """Every row of a packed chunk: ``{field: (chunk_size, *shape)}``."""
        rows = self._decode(self._pieces(src, np.arange(self.blocks_per_chunk)), self._where(src))
        return {name: r.reshape(self.chunk_size, *r.shape[2:]) for name, r in rows.items()}
