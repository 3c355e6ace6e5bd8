"""Routing a learner's priority updates to the shards that own them (numba only).

The sharded coordinator's common case (every shard live, none restored
since it was sampled) in one pass over the batch: each global index is
checked against the range, its td error against NaN and inf, and its slot
and key against what its shard has written and issued; the owning shard and
the slot within it come out. Anything unusual stops the pass with a status,
and the coordinator's full (and slower) path then names the problem.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit

#: statuses of :func:`route_keyed`: routed, or the first entry the full path must look at
ROUTED, OUT_OF_RANGE, NOT_FINITE, UNKNOWN = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def route_keyed(idx, td, keys, offsets, written, added, owner, slots):  # pragma: no cover - compiled
    """Fill ``owner`` and ``slots`` for updates ``(idx, td, keys)``; the status and entry.

    ``offsets[s]`` is shard ``s``'s first global index (``offsets[K]`` the
    capacity); ``written[s]`` the slots it has filled and ``added[s]`` the
    keys it has issued. Returns ``(ROUTED, -1)`` or ``(status, j)`` for the
    first entry ``j`` that is out of range, not finite, or names a slot or
    key its shard does not know (``owner`` / ``slots`` are then partial).
    """
    k = offsets.shape[0] - 1
    capacity = offsets[k]
    for j in range(idx.shape[0]):
        i = idx[j]
        if i < 0 or i >= capacity:
            return OUT_OF_RANGE, j
        if not np.isfinite(td[j]):
            return NOT_FINITE, j
        lo = 0
        hi = k
        while hi - lo > 1:  # the last shard whose first index is <= i
            mid = (lo + hi) // 2
            if offsets[mid] <= i:
                lo = mid
            else:
                hi = mid
        slot = i - offsets[lo]
        key = keys[j]
        if slot >= written[lo] or key < 0 or key >= added[lo]:
            return UNKNOWN, j
        owner[j] = lo
        slots[j] = slot
    return ROUTED, -1
