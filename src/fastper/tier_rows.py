"""The rows of :class:`fastper.tiers.TieredStorage`: writes into the ring and reads.

:class:`TierRowsMixin` holds the storage protocol's row access: ``prepare``
and ``write`` (into the open chunk, always hot; entering a chunk that holds
rows makes it hot, its rows not yet overwritten served from where they were),
``gather`` (a batch: one take over the hot pool, the warm rows decoded in one
compiled call where the codec has it, the cold ones block by block) and
``read`` (a range, decompressing as needed). It is separate because it is the
hot path and what a buffer calls; where chunks are and how they move is the
other parts' (:mod:`fastper.tier_placement`, :mod:`fastper.tier_prefetch`,
:mod:`fastper.tier_chunks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._kernels.tiers import hot_rows
from .storage import coerce_batch
from .tier_chunks import COLD, EMPTY, HOT, WARM
from .tier_placement import PlacementMixin

__all__ = ["TierRowsMixin"]


class TierRowsMixin(PlacementMixin):
    """``prepare`` / ``write`` / ``gather`` / ``read`` of a tiered storage (see the module)."""

    # -- protocol: writing ------------------------------------------------------------------
    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast one transition or a batch; writes nothing. O(B)."""
        return coerce_batch(self.fields, transition, self.capacity)

    def write(self, start: int, prepared: Mapping[str, np.ndarray], k: int) -> None:
        """Write ``k`` prepared rows from slot ``start`` on (wrapping). O(k) amortised.

        Entering a chunk makes it hot (the open chunk) and may demote another
        (one chunk compressed per ``chunk_size`` rows written). A chunk that
        held rows is not decoded: its rows not yet overwritten are served from
        where they were until the ring has passed them. Writes out of ring
        order (never made by a buffer) may have to decode them, the one way
        this can fail (:class:`TierDataError`).
        """
        self._install(wait=False)
        cs, cap = self.chunk_size, self.capacity
        done = 0
        while done < k:
            slot0 = (start + done) % cap
            c = slot0 >> self._shift
            lo = slot0 - (c << self._shift)
            end = min((c + 1) * cs, cap) - c * cs
            m = min(k - done, end - lo)
            if c != self._open:
                self._open_chunk(c)
            elif self._sealed:  # rewritten without being reopened (a one-chunk ring)
                self._unseal(c)
            if lo > self._fill:  # a gap: the old rows below `lo` must be decoded first
                self._merge_old()
            base = int(self._slot[c]) * cs + lo
            for name, pool in self._pool.items():
                pool[base : base + m] = prepared[name][done : done + m]
            self._fill = max(self._fill, lo + m)
            if self._old is not None and self._fill >= end:
                self._drop_old()
            if lo + m == end and self._fill >= end:
                self._seal(c)
            done += m

    def _open_chunk(self, c: int) -> None:
        """Make chunk ``c`` the open (hot, pinned) chunk."""
        if self._pending[c]:  # its promotion must land first
            self._install(wait=True)
        if self._old is not None:
            self._merge_old()
        self._open = -1
        self._sealed = False
        self._fill = self.chunk_size
        if self._tier[c] == HOT:
            if self._packing[c]:  # the packer reads the rows about to be rewritten
                self._install(wait=True)
            self._drop_packed(c)  # its kept copy goes stale
        else:
            tier = int(self._tier[c])
            old = self._source(c) if tier in (WARM, COLD) else None
            slot = self._free_slot(exclude=c)
            if old is None:
                for pool in self._pool.values():
                    pool[slot * self.chunk_size : (slot + 1) * self.chunk_size] = 0
            self._warm.pop(c, None)  # the old rows live on in `_old` (a cold file stays)
            self._cold.pop(c, None)
            self._comp[c] = 0
            self._tier[c], self._slot[c] = HOT, slot
            self._slot_owner[slot] = c
            if old is not None:
                self._old, self._fill = old, 0
        self._open = c
        self._opened += 1
        self._seq[c] = self._opened
        self._mass[c] = np.inf  # unknown until weighed: kept hot until the next rebalance
        self._avg[c] = np.nan  # new rows: the average starts again

    def _merge_old(self) -> None:
        """Decode the open chunk's old rows from ``_fill`` on into its hot slot."""
        assert self._old is not None
        rows = self._decode_source(self._old)
        base, lo = int(self._slot[self._open]) * self.chunk_size, self._fill
        for name, pool in self._pool.items():
            pool[base + lo : base + self.chunk_size] = rows[name][lo:]
        self._fill = self.chunk_size
        self._drop_old()

    def _drop_old(self) -> None:
        assert self._old is not None
        tier, _, path = self._old
        self._old = None
        if tier == COLD:
            self._remove_file(path)

    def _seal(self, c: int) -> None:
        """The open chunk ``c`` is full: it may be packed from now on."""
        self._sealed = True
        if self.pack_ahead is None:
            self._pack_in_background(c)
        else:
            self._pack_ahead()

    def _unseal(self, c: int) -> None:
        if self._packing[c]:
            self._install(wait=True)
        self._drop_packed(c)
        self._sealed = False

    # -- protocol: reading ------------------------------------------------------------------
    def gather(self, indices: Any) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices`` for every field. O(B) plus one block per cold/warm block hit.

        Raises:
            TierDataError: a cold chunk file is missing, truncated or corrupted.
        """
        self._install(wait=False)
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        self._gathers_since += 1
        n = idx.shape[0]
        rows = np.empty(n, dtype=np.int64)
        hot = np.empty(n, dtype=np.bool_)
        shadowed = self._open if self._old is not None else -1  # rows not yet rewritten
        n_hot = hot_rows(idx, self._tier, self._slot, self._shift, shadowed, self._fill, rows, hot)
        # one take over the whole batch (as the RAM storage): the few rows from
        # warm / cold chunks are then written over their placeholders
        out = {name: pool.take(rows, axis=0) for name, pool in self._pool.items()}
        self._counts["rows_hot"] += n_hot
        if n_hot == n:
            return out
        rpb, bpc = self.rows_per_block, self.blocks_per_chunk
        dst = [(out[name].reshape(n, -1).view(np.uint8), a, w) for name, a, w in self._blocks.cuts]
        if self._warm_gather is not None:  # warm rows: one compiled call, C decoder
            blocks, got, bad = self._warm_gather(
                idx, hot, self._tier, shadowed, rpb, self._shift, self._warm.addr,
                self._warm.size, self._blocks.nbytes, self._blocks.starts, self._blocks.widths,
                tuple(d for d, _, _ in dst),
            )  # fmt: skip
            if bad >= 0:
                g = int(idx[bad]) // rpb
                self._blocks.refuse(self._warm[g // bpc][g % bpc], self._where((WARM, None, "")))
            self._counts["decompressions"] += blocks
            self._counts["rows_warm"] += got
            n_hot += got
            if n_hot == n:
                return out
        # the other rows (cold; warm without a C decoder), one at a time (numpy's
        # per-call cost would dominate): each block decoded once, each row copied
        # straight from it into `out`
        sel = np.flatnonzero(~hot)
        dec, nbytes = self.codec.decompress, self._blocks.nbytes
        raws: dict[int, Any] = {}
        sources: dict[int, tuple[int, Any, str]] = {}
        cold = 0
        for pos, slot in zip(sel.tolist(), idx[sel].tolist(), strict=True):
            g, r = divmod(slot, rpb)  # block g of the ring, row r in it
            c = g // bpc
            src = sources.get(c)
            if src is None:
                src = sources[c] = self._source(c)
            cold += src[0] == COLD
            raw = raws.get(g)
            if raw is None:
                piece = src[1][g % bpc] if src[0] == WARM else self._pieces(src, [g % bpc])[0]
                try:
                    data = dec(piece, nbytes)
                except Exception:  # the codecs raise their own error types
                    data = b""
                if len(data) != nbytes:  # says what is wrong, naming the chunk
                    self._blocks.refuse(piece, self._where(src))
                raw = raws[g] = np.frombuffer(data, dtype=np.uint8)
            for d, a, w in dst:
                d[pos] = raw[a + r * w : a + (r + 1) * w]
        self._counts["decompressions"] += len(raws)
        self._counts["rows_cold"] += cold
        self._counts["rows_warm"] += n - n_hot - cold
        return out

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A copy of rows ``lo .. hi-1`` of field ``name`` (decompressing as needed). O(hi - lo)."""
        self._install(wait=True)
        f = self.fields[name]
        out = np.empty((hi - lo, *f.shape), dtype=f.dtype)
        cs = self.chunk_size
        for c in range(lo >> self._shift, -(-hi // cs)):
            a, b = max(lo, c * cs), min(hi, (c + 1) * cs)
            if self._tier[c] == HOT:
                base = int(self._slot[c]) * cs - c * cs
                out[a - lo : b - lo] = self._pool[name][base + a : base + b]
                if c == self._open and self._old is not None and b > c * cs + self._fill:
                    s = max(a, c * cs + self._fill)  # rows the ring has not reached yet
                    rows = self._decode_source(self._old)[name]
                    out[s - lo : b - lo] = rows[s - c * cs : b - c * cs]
            elif self._tier[c] == EMPTY:
                out[a - lo : b - lo] = 0
            else:
                rows = self._decode_source(self._source(c))[name]
                out[a - lo : b - lo] = rows[a - c * cs : b - c * cs]
        return out
