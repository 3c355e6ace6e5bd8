"""The ring: where each transition goes, and the key of each slot's occupant.

Since the last clear (at key counter ``key_base``) the k-th transition added
lives in slot ``k % capacity`` and has key ``key_base + k``; ``added`` counts
every transition ever written, so keys never repeat, even across clears. A
slot's key follows from the slot and the two counters: no key array is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._kernels import ring as _ring
from ._validation import check_int

#: Key counters stay far inside int64 (10^18 transitions); the kernels use int64.
MAX_KEY = 2**62


class RingWriter:
    """Ring cursor, size and key counters of one buffer.

    Args:
        capacity: number of slots.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.cursor = 0  # the next slot written
        self.size = 0  # slots holding a transition
        self.added = 0  # transitions ever written = the next transition's key
        self.key_base = 0  # ``added`` at the last clear

    def advance(self, k: int) -> int:
        """Account for ``k <= capacity`` transitions written from :attr:`cursor`; returns the start. O(1).

        Also written out inline by the no-cast adds (``RowsMixin._store_direct``,
        rows that fit before the ring's end): a change here is a change there."""
        start, cap = self.cursor, self.capacity
        end = start + k  # (no % and no min(): this runs on every add)
        self.cursor = end if end < cap else end - cap
        size = self.size + k
        self.size = size if size < cap else cap
        self.added += k
        return start

    def slots(self, start: int, k: int) -> np.ndarray:
        """Slots ``start, start+1, ...`` (``k`` of them, wrapping). O(k)."""
        return (start + np.arange(k, dtype=np.int64)) % self.capacity

    def keys(self, idx: np.ndarray) -> np.ndarray:
        """Key of the current occupant of each slot in ``idx`` (all written). O(B)."""
        out = np.empty(idx.shape[0], dtype=np.int64)
        _ring.slot_keys(idx, self.key_base, self.added, self.capacity, out)
        return out

    def clear(self) -> None:
        """Empty the ring; keys issued before stay stale for ever."""
        self.cursor = 0
        self.size = 0
        self.key_base = self.added

    def state_dict(self) -> dict[str, Any]:
        """The counters: ``size``, ``cursor``, ``total_added``, ``key_base``."""
        return {
            "size": self.size,
            "cursor": self.cursor,
            "total_added": self.added,
            "key_base": self.key_base,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check the counters against each other, then take them."""
        n = check_int("size", state["size"], minimum=0)
        cursor = check_int("cursor", state["cursor"], minimum=0)
        added = check_int("total_added", state["total_added"], minimum=0)
        key_base = check_int("key_base", state["key_base"], minimum=0)
        if added > MAX_KEY:
            # a larger counter would load, then make every sample and update fail
            raise ValueError(f"key counter total_added={added} exceeds {MAX_KEY}")
        since_clear = added - key_base
        cap = self.capacity
        if not (key_base <= added and n == min(since_clear, cap) and cursor == since_clear % cap):
            raise ValueError(
                f"inconsistent ring state size={n} cursor={cursor} added={added} "
                f"key_base={key_base} for capacity={cap}"
            )
        self.size, self.cursor, self.added, self.key_base = n, cursor, added, key_base
