"""Tiered storage: where each gathered row lives (numba only).

See :mod:`fastper.tiers` for the design: ``chunk_size`` (a power of 2) slots
per chunk; a chunk's tier (0 hot, 1 warm, 2 cold, 3 empty) and, when hot, the
hot-pool slot that holds its rows.
"""

from __future__ import annotations

from ._jit import njit


@njit(cache=True, nogil=True)
def hot_rows(idx, tier, slot, shift, open_chunk, fill, rows, hot):  # pragma: no cover - compiled
    """Fill ``rows`` (pool rows of the hot indices, 0 for the others) and ``hot``.

    ``open_chunk`` >= 0: the chunk being rewritten whose rows from ``fill`` on
    are still served from where they were (not hot); -1: none. Returns the
    number of hot rows. O(B).
    """
    mask = (1 << shift) - 1
    n_hot = 0
    for i in range(idx.shape[0]):
        c = idx[i] >> shift
        off = idx[i] & mask
        h = tier[c] == 0 and not (c == open_chunk and off >= fill)
        hot[i] = h
        if h:
            rows[i] = (slot[c] << shift) + off
            n_hot += 1
        else:
            rows[i] = 0
    return n_hot
