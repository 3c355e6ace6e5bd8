"""Placement of :class:`fastper.tiers.TieredStorage`'s chunks by sampling mass.

:class:`PlacementMixin` decides where chunks live: at each
:meth:`PlacementMixin.rebalance` the heaviest chunks go hot up to
``hot_bytes``, the next warm up to ``warm_bytes``, the rest cold, with
hysteresis, averaged masses and at most ``max_moves`` moves; and when the ring
needs a hot slot, which hot chunk is demoted to free one. It is separate
because it is policy: it reads the chunk table and orders moves, which the
chunk table (:mod:`fastper.tier_chunks`) and the background jobs
(:mod:`fastper.tier_prefetch`) carry out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._validation import show
from .tier_chunks import COLD, HOT, WARM
from .tier_prefetch import PrefetchMixin

__all__ = ["PlacementMixin"]


class PlacementMixin(PrefetchMixin):
    """Where each chunk lives, by its sampling mass (see the module)."""

    @property
    def mass_chunk_size(self) -> int:
        """The chunk size a buffer passes to ``sampler.chunk_masses`` for :meth:`rebalance`."""
        return self.chunk_size

    @property
    def wants_masses(self) -> bool:
        """True once ``rebalance_every`` gathers passed since the last rebalance. O(1).

        The buffer calls, after a sample (see :class:`fastper.storage.PlacedByMass`),
        ``rebalance(sampler.chunk_masses(mass_chunk_size, len(buffer)))``.
        """
        return self._gathers_since >= self.rebalance_every

    def rebalance(self, masses: Any) -> None:
        """Place chunks by their sampling mass, with hysteresis. O(C log C), C chunks.

        Best effort: never raises for a disk error (the chunk stays warm;
        counted in ``stats()["rebalance_errors"]``). Promotions are decoded
        in the background with ``prefetch=True``.

        Args:
            masses: the mass under each chunk (length ``n_chunks``), e.g.
                ``sampler.chunk_masses(chunk_size, n)``.

        Raises:
            ValueError: ``masses`` of the wrong length, negative or not finite.
        """
        m = np.asarray(masses, dtype=np.float64)
        if m.shape != (self.n_chunks,) or not (np.isfinite(m).all() and (m >= 0).all()):
            raise ValueError(
                f"`masses` must be {self.n_chunks} finite values >= 0 (one per chunk), "
                f"got masses={show(m)}"
            )
        self._install(wait=False)  # chunks still in flight are left where they are
        self._gathers_since = 0
        self._counts["rebalances"] += 1
        avg = self._avg
        fresh = np.isnan(avg)
        avg[fresh] = m[fresh]
        avg[~fresh] += self.smoothing * (m[~fresh] - avg[~fresh])
        self._mass[:] = avg
        self._weighed = m.copy()
        if self._open >= 0:
            self._mass[self._open] = np.inf  # pinned: being written
        try:
            self._place_hot()
            self._place_warm()
        except OSError:
            self._counts["rebalance_errors"] += 1
        self._pack_ahead()

    def _left(self, used: int) -> int:
        return 1 << 62 if self.max_moves is None else self.max_moves - used

    def _swaps(self, cand: np.ndarray, held: np.ndarray, limit: int) -> int:
        """How many of ``cand`` (heaviest first) displace ``held`` (lightest first)."""
        k = min(cand.shape[0], held.shape[0], limit)
        wins = self._mass[cand[:k]] > self.hysteresis * self._mass[held[:k]]
        return int(np.argmin(wins)) if not wins.all() else k

    def _place_hot(self) -> None:
        """Promote the heaviest warm / cold chunks into free hot slots, then swap
        while a candidate outweighs the lightest hot chunk by ``hysteresis``.

        With ``prefetch``, only hot chunks with a packed copy are swapped out
        (a demotion then compresses nothing on the sampling path); those that
        would have been swapped but have none are packed in the background,
        ready for the next rebalance.
        """
        held = np.flatnonzero(self._tier == HOT)
        held = held[held != self._open]
        held = held[np.argsort(self._mass[held], kind="stable")]
        cand = np.flatnonzero(((self._tier == WARM) | (self._tier == COLD)) & ~self._pending)
        cand = cand[np.argsort(-self._mass[cand], kind="stable")]
        cand = cand[self._mass[cand] > 0]
        free = int(np.count_nonzero(self._slot_owner == -1))
        fill = min(free, cand.shape[0], self._left(0))
        if self.prefetch:
            copied = np.array([c in self._warm or c in self._cold for c in held.tolist()], bool)
            wanted = held[: self._swaps(cand[fill:], held, self._left(fill))]
            for c in wanted[~copied[: wanted.shape[0]]].tolist():
                self._pack_in_background(c)  # no-op while its pack is in flight
            held = held[copied]
        n_swap = self._swaps(cand[fill:], held, self._left(fill))
        for c in held[:n_swap].tolist():
            self._demote(c)
        for c in cand[: fill + n_swap].tolist():
            self._promote(c)

    def _place_warm(self) -> None:
        warm = np.flatnonzero((self._tier == WARM) & ~self._pending)
        warm = warm[np.argsort(self._mass[warm], kind="stable")]
        cold = np.flatnonzero((self._tier == COLD) & ~self._pending)
        cold = cold[np.argsort(-self._mass[cold], kind="stable")]
        # kept copies of hot chunks (and of promotions in flight) give way to warm chunks
        room = self.warm_bytes - int(self._comp[warm].sum())
        n_fill = int(np.searchsorted(np.cumsum(self._comp[cold]), room, side="right"))
        if self.max_moves is not None:
            n_fill = min(n_fill, self.max_moves)
        n_swap = self._swaps(cold[n_fill:], warm, self._left(n_fill))
        for c in cold[: n_fill + n_swap].tolist():
            self._to_warm(c)
        self._spill()

    def _to_warm(self, c: int) -> None:
        pieces = self._pieces(self._source(c), np.arange(self.blocks_per_chunk))
        self._drop_packed(c)
        self._warm[c] = pieces
        self._comp[c] = sum(len(p) for p in pieces)
        self._tier[c] = WARM

    def _promote(self, c: int) -> None:
        """Warm / cold chunk ``c`` into a free hot slot: in the background with ``prefetch``."""
        free = np.flatnonzero(self._slot_owner == -1)
        if not free.size:
            return
        slot = int(free[0])
        self._slot_owner[slot] = -2  # reserved until installed
        base = slot * self.chunk_size
        target = {name: p[base : base + self.chunk_size] for name, p in self._pool.items()}
        tier = int(self._tier[c])
        source = self._warm[c] if tier == WARM else self._cold[c]
        self._pending[c] = True
        path = self._path(c) if tier == COLD else ""
        self._submit(("promote", c, slot, path, source, target))

    def _demote(self, c: int) -> None:
        """Hot chunk ``c`` to warm (then warm overflow to cold), or back to its cold file.

        A chunk not written since it was packed still has its packed copy
        (kept at promotion): the demotion then costs nothing. Frees its slot.
        """
        if self._packing[c]:  # its packed copy is on the way
            self._install(wait=True)
        if c not in self._cold and c not in self._warm:
            self._warm[c] = pieces = self._pack(c)  # before the slot is let go
            self._counts["inline_packs"] += 1
            self._comp[c] = sum(len(p) for p in pieces)
        self._slot_owner[self._slot[c]] = -1
        self._slot[c] = -1
        if c == self._open:
            self._open = -1
            self._sealed = False
        self._counts["demotions"] += 1
        if c in self._cold:
            self._tier[c] = COLD
            return
        self._tier[c] = WARM
        self._spill()

    def _free_slot(self, exclude: int) -> int:
        free = np.flatnonzero(self._slot_owner == -1)
        if free.size:
            return int(free[0])
        hot = np.flatnonzero((self._tier == HOT) & ~self._pending)
        hot = hot[hot != exclude]
        if not hot.size:
            raise RuntimeError("no hot slot to free")  # unreachable: n_hot_slots >= 1
        # least mass first; among equal (unweighed: inf) masses the oldest
        order = hot[np.lexsort((self._seq[hot], self._mass[hot]))]
        victim = int(order[0])
        if self.prefetch:  # among the next in line, one already packed costs nothing
            near = order[: max(1, self.pack_ahead or 0)]
            # ... if it is about as light (within the hysteresis factor)
            near = near[self._mass[near] <= self.hysteresis * self._mass[victim]].tolist()
            copied = [c for c in near if c in self._warm or c in self._cold]
            idle = [c for c in near if not self._packing[c]]
            victim = (copied or idle or near)[0]
        slot = int(self._slot[victim])
        self._demote(victim)
        return slot
