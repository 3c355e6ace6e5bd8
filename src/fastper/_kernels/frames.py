"""Frame streams: which frames one add writes, and stacks of frame ids (numba only).

Frames have absolute ids (the k-th frame ever written has id k) and live in
a ring of ``capacity`` slots (id ``f`` in slot ``f % capacity``). Each frame
records the id of the frame before it in its episode (``-1``: the episode's
first frame). See :mod:`fastper.frames` for the design.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit

#: ``prev`` of a frame whose predecessor was lost (overwritten before the
#: stream went on): a stack that reaches it is invalid.
LOST = -2


@njit(cache=True, nogil=True)
def frame_plan(
    srow,
    done,
    last,
    pend,
    autoreset,
    fadded,
    capacity,
    obs_id,
    next_id,
    src_row,
    src_next,
    new_prev,
    check_ref,
):  # pragma: no cover - compiled
    """Assign frame ids to one add's rows, in row order, per stream.

    ``srow[r]``: the stream (row of the stream table) of batch row ``r``;
    ``done[r]``: the row ends its episode. ``last`` / ``pend`` (copies, updated
    in place): the id of each stream's latest frame (``-1``: none, the next
    row starts an episode) and whether the next row is an autoreset row
    (dropped as a transition; its next frame starts an episode).

    Writes ``obs_id`` / ``next_id`` per row and, per new frame ``j`` (id
    ``fadded + j``), the row and field it comes from and its ``prev``.
    ``check_ref[r]``: the frame id the row's observation must equal (it
    reuses the stream's latest frame), or ``-1`` when nothing is reused.
    Returns the number of new frames.
    """
    m = 0
    for r in range(srow.shape[0]):
        s = srow[r]
        if autoreset and pend[s]:
            pend[s] = False
            obs_id[r] = -1
            check_ref[r] = -1
            src_row[m] = r
            src_next[m] = True
            new_prev[m] = -1
            next_id[r] = fadded + m
            last[s] = fadded + m
            m += 1
            continue
        f = last[s]
        if f >= 0 and f >= fadded + m - capacity:
            obs_id[r] = f  # the stream goes on from its latest frame
            check_ref[r] = f
        else:
            src_row[m] = r
            src_next[m] = False
            # a stream whose latest frame was overwritten goes on, but its stacks
            # cannot be rebuilt: they reach a lost frame and are invalid
            new_prev[m] = LOST if f >= 0 else -1
            obs_id[r] = fadded + m
            check_ref[r] = -1
            m += 1
        src_row[m] = r
        src_next[m] = True
        new_prev[m] = obs_id[r]
        next_id[r] = fadded + m
        m += 1
        if done[r]:
            last[s] = -1
            pend[s] = autoreset
        else:
            last[s] = next_id[r]
    return m


@njit(cache=True, nogil=True)
def stack_ids(heads, prev, stack, oldest, capacity, repeat, out):  # pragma: no cover
    """Ids of the ``stack`` frames ending at each head, oldest first.

    ``out`` is ``(len(heads), stack)``. Before an episode's first frame:
    ``-1`` (zero padding) or, with ``repeat``, the first frame again. Returns
    a bool per head: every frame of its stack is still stored (ids >= ``oldest``).
    """
    n = heads.shape[0]
    ok = np.ones(n, dtype=np.bool_)
    for i in range(n):
        f = heads[i]
        if f < oldest:
            ok[i] = False
        first = f
        for j in range(stack - 1, -1, -1):
            if f >= 0:
                first = f
                out[i, j] = f
                if f < oldest:
                    ok[i] = False
                    f = -1
                elif j > 0:
                    f = prev[f % capacity]
                    if f == LOST:
                        ok[i] = False
                        f = -1
            else:
                out[i, j] = first if repeat else -1
    return ok


@njit(cache=True, nogil=True)
def push_refs(oldest, keys, head_ref, next_ref, fcap, key_base, tcap):  # pragma: no cover
    """Record that transition ``keys[i]`` needs frames back to frame ``oldest[i]``.

    Per frame slot, ``head_ref`` holds the newest key whose oldest frame it
    is; per transition slot (``(key - key_base) % tcap``, the buffer's ring),
    ``next_ref`` the next older key with the same oldest frame. ``keys``
    ascend, so every list runs newest to oldest. O(len(keys)).
    """
    for i in range(keys.shape[0]):
        t = keys[i]
        fs = oldest[i] % fcap
        next_ref[(t - key_base) % tcap] = head_ref[fs]
        head_ref[fs] = t


@njit(cache=True, nogil=True)
def pop_refs(frame_slots, head_ref, next_ref, key_base, added, tcap, out):  # pragma: no cover
    """The keys of the stored transitions that need the frames in ``frame_slots``,
    which are being overwritten; empties those lists. Returns how many keys were
    written to ``out`` (one per transition slot is enough).

    A list is walked newest to oldest and stops at the first key the ring no
    longer stores (keys below ``max(key_base, added - tcap)``): every older one
    has left too, and its link slot may belong to a newer transition. Only
    stored transitions were ever linked, so a stored key's link is its own.
    O(keys found + len(frame_slots)).
    """
    lo = max(key_base, added - tcap)
    m = 0
    for j in range(frame_slots.shape[0]):
        fs = frame_slots[j]
        t = head_ref[fs]
        head_ref[fs] = -1
        while t >= lo and t < added:
            out[m] = t
            m += 1
            t = next_ref[(t - key_base) % tcap]
    return m


@njit(cache=True, nogil=True)
def gather_stacks_last(frames, slots, out):  # pragma: no cover - compiled
    """Stack frames with the stack axis last: ``out[b, p, j] = frames[slots[b, j], p]``.

    ``frames`` is ``(slots, F)`` (each frame flattened), ``slots`` ``(B, K)``
    and ``out`` ``(B, F, K)``. Each frame is read in order once, into one
    output row (a few KB, cached) written ``K`` values apart: numpy's
    transposing copy (``moveaxis``) walks the frames ``F`` values apart
    instead, several times slower. O(B K F).
    """
    b_n, k_n = slots.shape
    f_n = frames.shape[1]
    for b in range(b_n):
        for j in range(k_n):
            s = slots[b, j]
            for p in range(f_n):
                out[b, p, j] = frames[s, p]
