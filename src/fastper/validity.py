"""Validity per slot: which stored transitions may be drawn.

A stored transition can stop being sampleable without leaving the ring: its
frames were overwritten by the frame ring (:mod:`fastper.frames`), or a crash
tore its row on disk (:mod:`fastper.disk`). Such a slot is *invalid*: it has
zero mass in the index of every scheme (uniform, proportional, rank-based),
is never drawn, is not counted in the N of the IS weights, and updates to
it are dropped. It becomes valid again only when a new transition is
written into it.

:class:`Validity` is the mask half of that rule (the index half is the
sampler's ``invalidate``). It costs nothing until the first slot becomes
invalid: the mask (one byte per slot) is allocated then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Validity"]


class Validity:
    """A per-slot validity mask with a count of invalid slots.

    Not locked: the buffer holds its lock around every call.

    Args:
        capacity: number of slots.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._mask: np.ndarray | None = None  # True: valid; None: every slot valid
        self.n_invalid = 0

    @property
    def all_valid(self) -> bool:
        """No slot is invalid. O(1)."""
        return self.n_invalid == 0

    def valid(self, slots: np.ndarray) -> np.ndarray:
        """Whether each slot may be drawn (bool array). O(B)."""
        if self._mask is None or self.n_invalid == 0:
            return np.ones(slots.shape[0], dtype=np.bool_)
        return self._mask[slots]

    def fresh(self, slots: np.ndarray) -> np.ndarray:
        """Of ``slots`` (any order, repeats allowed), the distinct ones still valid. O(B)."""
        if self._mask is None:
            return np.unique(slots)
        u = np.unique(slots)
        return u[self._mask[u]]

    def invalidate(self, slots: np.ndarray) -> None:
        """Mark distinct valid ``slots`` invalid (see :meth:`fresh`). O(B)."""
        if slots.shape[0] == 0:
            return
        if self._mask is None:
            self._mask = np.ones(self.capacity, dtype=np.bool_)
        self._mask[slots] = False
        self.n_invalid += int(slots.shape[0])

    def admit(self, slots: np.ndarray) -> None:
        """New transitions were written into ``slots``: they are valid. O(B), O(1) when all are."""
        if self.n_invalid == 0 or self._mask is None:
            return
        was = self._mask[slots]
        if was.all():
            return
        self._mask[slots] = True
        # a slot may repeat (a batch larger than the ring): count each once
        self.n_invalid -= int(np.unique(slots[~was]).shape[0])

    def admit_run(self, start: int, count: int) -> None:
        """:meth:`admit` for slots ``start .. start+count-1`` (no wrap). O(count) when any is invalid."""
        if self.n_invalid == 0 or self._mask is None:
            return
        run = self._mask[start : start + count]
        gone = count - int(np.count_nonzero(run))
        if gone:
            run[:] = True
            self.n_invalid -= gone

    def clear(self) -> None:
        """Every slot valid again (the buffer was emptied). O(1)."""
        self._mask = None
        self.n_invalid = 0

    def invalid_slots(self, n: int) -> np.ndarray:
        """The invalid slots among ``0 .. n-1``, ascending (int64). O(N) when any is invalid."""
        if self._mask is None or self.n_invalid == 0:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(~self._mask[:n]).astype(np.int64)

    def nbytes(self) -> int:
        """Bytes held by the mask (0 until a slot was made invalid)."""
        return 0 if self._mask is None else int(self._mask.nbytes)

    # -- state ---------------------------------------------------------------------
    def state_dict(self, n: int) -> dict[str, Any]:
        """``{"invalid": slots}``: the invalid slots among the ``n`` stored ones. O(N)."""
        return {"invalid": self.invalid_slots(n)}

    @staticmethod
    def check_state(state: Any, n: int) -> np.ndarray:
        """The invalid slots of a :meth:`state_dict` over ``n`` stored slots, checked."""
        if not isinstance(state, Mapping) or set(state) != {"invalid"}:
            have = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"validity state must have the entry ['invalid'], got {have}")
        slots = state["invalid"]
        if not (isinstance(slots, np.ndarray) and slots.ndim == 1 and slots.dtype.kind in "iu"):
            what = f"{slots.dtype}{slots.shape}" if isinstance(slots, np.ndarray) else type(slots)
            raise ValueError(f"validity `invalid` must be a 1-D integer array, got {what}")
        slots = slots.astype(np.int64)
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= n):
            raise ValueError(
                f"validity `invalid` must name stored slots in [0, {n}), got values from "
                f"{int(slots.min())} to {int(slots.max())}"
            )
        if np.unique(slots).shape[0] != slots.shape[0]:
            raise ValueError("validity `invalid` must not repeat a slot")
        return slots
