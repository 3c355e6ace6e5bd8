"""Ring and key arithmetic, and the validation of priority updates (numba only).

The k-th transition added since the last clear (at key counter ``key_base``)
lives in slot ``k % capacity``; its key is ``key_base + k``. No key array is
stored: a slot's key follows from the slot and the counters.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit


@njit(cache=True, nogil=True, inline="always")
def _laps(since_clear, capacity):  # pragma: no cover - compiled
    """``(w, r)`` with ``since_clear - 1 = w * capacity + r`` and ``0 <= r < capacity``.

    The last transition added went to slot ``r`` in lap ``w`` of the ring.
    """
    w = (since_clear - 1) // capacity
    return w, since_clear - 1 - w * capacity


@njit(cache=True, nogil=True, inline="always")
def _slot_key(s, key_base, capacity, w, r):  # pragma: no cover - compiled
    """Key of the occupant of slot ``s`` (``0 <= s < capacity``), given :func:`_laps`.

    That is ``key_base + s + capacity * floor((since_clear - 1 - s) / capacity)``:
    the last lap wrote slots ``0..r``, the one before it the rest. One integer
    division per batch instead of one per slot (a 64-bit division costs tens
    of cycles on many x86 CPUs).
    """
    return key_base + s + capacity * (w if s <= r else w - 1)


@njit(cache=True, nogil=True)
def slot_keys(indices, key_base, added, capacity, out):  # pragma: no cover - compiled
    """Key (insertion counter) of the occupant of each slot (each in ``[0, capacity)``).

    Since the last clear (at counter ``key_base``) the k-th transition went to
    slot ``k % capacity``, so slot ``s`` holds the latest such k.
    """
    w, r = _laps(added - key_base, capacity)
    for k in range(indices.shape[0]):
        out[k] = _slot_key(indices[k], key_base, capacity, w, r)


@njit(cache=True, nogil=True)
def td_priorities(
    indices,
    td,
    keys,
    use_keys,
    eps,
    clip,
    p_limit,
    size,
    key_base,
    added,
    capacity,
    out_idx,
    out_p,
    status,
):  # pragma: no cover - compiled
    """Validate an update, drop stale entries, compute ``min(|td|, clip) + eps``.

    Writes the surviving slots and priorities to ``out_idx`` / ``out_p``.
    ``status`` (int64[4]) receives [error code, position of the first bad
    entry, entries kept, entries dropped as stale]. Error codes: 1 index out
    of range, 2 slot never written, 3 td not finite, 4 priority above
    ``p_limit`` (the largest whose ``p**alpha`` the tree can hold; one compare
    instead of a log per entry), 5 a key never issued. On an error nothing is
    kept.
    Returns the largest kept priority (0.0 if none).
    """
    b = indices.shape[0]
    status[0] = 0
    status[1] = -1
    status[2] = 0
    status[3] = 0
    for k in range(b):
        i = indices[k]
        if i < 0 or i >= capacity:
            status[0] = 1
        elif i >= size:
            status[0] = 2
        elif not np.isfinite(td[k]):
            status[0] = 3
        else:
            p = min(abs(td[k]), clip) + eps
            if p > p_limit:
                status[0] = 4
            elif use_keys and (keys[k] < 0 or keys[k] >= added):
                status[0] = 5
        if status[0] != 0:
            status[1] = k
            return 0.0
    w, r = _laps(added - key_base, capacity)
    kept = 0
    pmax = 0.0
    for k in range(b):
        i = indices[k]
        if use_keys and keys[k] != _slot_key(i, key_base, capacity, w, r):
            status[3] += 1
            continue
        p = min(abs(td[k]), clip) + eps
        out_idx[kept] = i
        out_p[kept] = p
        kept += 1
        if p > pmax:
            pmax = p
    status[2] = kept
    return pmax


@njit(cache=True, nogil=True)
def all_finite(values):  # pragma: no cover - compiled
    """Whether every entry of ``values`` (1-D float32 or float64) is finite. O(B), no
    allocation: a numpy test costs microseconds of calls for the few rewards of a
    vector step."""
    for i in range(values.shape[0]):
        if not np.isfinite(values[i]):
            return False
    return True
