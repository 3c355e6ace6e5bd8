"""8-ary sum / min tree kernels over flat float64 arrays.

Layout. A tree over ``capacity`` leaves is two arrays:

* ``leaves``: ``capacity`` rounded up to a multiple of 8 (padding stays 0 for a
  sum tree, ``inf`` for a min tree, and is never addressable);
* ``inner``: the internal levels 1..D back to back; level ``l`` starts at
  ``offs[l]`` and node ``j`` of level ``l`` combines the 8 entries
  ``8j .. 8j+7`` of level ``l - 1`` (level 0 being ``leaves``). Level ``D``
  holds the root at ``inner[offs[D]]``.

Why 8 children: 8 float64 children fill one 64-byte cache line, so a search
or an update touches ``log8 N`` lines (7 at N = 2^20) instead of ``log2 N``
(20), and the lower levels of a large tree miss the cache on every line.

Why there is no drift: every internal node is always *recomputed* from its
children in a fixed order, never adjusted by a delta (``parent += new - old``).
The tree is therefore a pure function of its leaves: the same leaves give
bit-identical internal nodes whatever the order of updates, and the root's
relative error against an exact sum is bounded by about ``7 * depth * 2**-53``
(all terms are non-negative), never growing with the number of updates.
No ``fastmath``: it would let LLVM reassociate the sums.

Batched operations walk all their items one level at a time, so that many
independent memory loads are in flight at once instead of one miss after
another.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._intrinsics import prefetch

K = 8  # children per node; one cache line of float64


def layout(capacity: int) -> tuple[int, np.ndarray, int]:
    """(padded leaf count, level offsets into ``inner``, depth D) for ``capacity``.

    ``offs[l]`` for ``l = 1..D`` is where level ``l`` starts in ``inner``;
    ``offs[D + 1]`` is the length of ``inner``. ``offs[0]`` is unused (0).
    """
    n_leaves = -(-capacity // K) * K
    offs = [0, 0]
    width = n_leaves
    while True:
        nodes = width // K
        if nodes == 1:
            offs.append(offs[-1] + K)  # the root's level, padded to one line
            break
        width = -(-nodes // K) * K
        offs.append(offs[-1] + width)
    depth = len(offs) - 2
    return n_leaves, np.asarray(offs, dtype=np.int64), depth


def aligned_full(n: int, fill: float) -> np.ndarray:
    """A float64 array of ``n`` entries set to ``fill``, starting on a 64-byte boundary.

    numpy aligns its data to 16 bytes only; a tree array starting 16 bytes into
    a cache line puts every node's 8 children across two lines, so each node
    read or recomputed costs two misses. Aligned (measured at N = 2^22,
    B = 256): writing priorities and their sum / min paths took 44 us instead
    of 83, the search 47 us instead of 58. The array is a view into a slightly
    larger one.
    """
    extra = 64 // 8
    # zeros come from calloc: pages are mapped when first written, so a large
    # sum tree costs memory only as slots fill
    if fill == 0.0:
        base = np.zeros(n + extra, dtype=np.float64)
    else:
        base = np.full(n + extra, fill, dtype=np.float64)
    start = (-base.ctypes.data % 64) // 8
    return base[start : start + n]


# ---------------------------------------------------------------------------
# node recomputation
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _sum8(a, base):  # pragma: no cover - compiled
    """Pairwise sum of ``a[base:base+8]``, always in the same order.

    A running ``acc += x`` chain would put 8 dependent adds (about 32 cycles)
    on every node of every update; the pairwise tree is 3 adds deep and no less
    exact.
    """
    return ((a[base] + a[base + 1]) + (a[base + 2] + a[base + 3])) + (
        (a[base + 4] + a[base + 5]) + (a[base + 6] + a[base + 7])
    )


@njit(cache=True, nogil=True, inline="always")
def _min2(x, y):  # pragma: no cover - compiled
    return x if x < y else y


@njit(cache=True, nogil=True, inline="always")
def _pos(x):  # pragma: no cover - compiled
    """A zero leaf counts as ``+inf`` in the buffer's min tree (never sampled)."""
    return x if x > 0.0 else np.inf


@njit(cache=True, nogil=True, inline="always")
def _sum_node(leaves, inner, offs, level, j):  # pragma: no cover - compiled
    if level == 1:
        inner[offs[1] + j] = _sum8(leaves, K * j)
    else:
        inner[offs[level] + j] = _sum8(inner, offs[level - 1] + K * j)


@njit(cache=True, nogil=True, inline="always")
def _min_node(leaves, inner, offs, level, j, skip_zero):  # pragma: no cover - compiled
    """Min of the 8 children (pairwise); with ``skip_zero`` a zero leaf counts as ``inf``."""
    if level == 1:
        b = K * j
        if skip_zero:
            m = _min2(
                _min2(_min2(_pos(leaves[b]), _pos(leaves[b + 1])),
                      _min2(_pos(leaves[b + 2]), _pos(leaves[b + 3]))),
                _min2(_min2(_pos(leaves[b + 4]), _pos(leaves[b + 5])),
                      _min2(_pos(leaves[b + 6]), _pos(leaves[b + 7]))),
            )  # fmt: skip
        else:
            m = _min2(
                _min2(_min2(leaves[b], leaves[b + 1]), _min2(leaves[b + 2], leaves[b + 3])),
                _min2(_min2(leaves[b + 4], leaves[b + 5]), _min2(leaves[b + 6], leaves[b + 7])),
            )
    else:
        b = offs[level - 1] + K * j
        m = _min2(
            _min2(_min2(inner[b], inner[b + 1]), _min2(inner[b + 2], inner[b + 3])),
            _min2(_min2(inner[b + 4], inner[b + 5]), _min2(inner[b + 6], inner[b + 7])),
        )
    inner[offs[level] + j] = m


@njit(cache=True, nogil=True, inline="always")
def _max_node(leaves, inner, offs, level, j):  # pragma: no cover - compiled
    if level == 1:
        a = leaves
        b = K * j
    else:
        a = inner
        b = offs[level - 1] + K * j
    m = a[b]
    for c in range(1, K):
        if a[b + c] > m:
            m = a[b + c]
    inner[offs[level] + j] = m


SUM, MIN, MIN_POSITIVE, MAX = 0, 1, 2, 3  # what fix_paths / rebuild compute per node


@njit(cache=True, nogil=True, inline="always")
def _node(leaves, inner, offs, level, j, mode):  # pragma: no cover - compiled
    if mode == SUM:
        _sum_node(leaves, inner, offs, level, j)
    elif mode == MAX:
        _max_node(leaves, inner, offs, level, j)
    else:
        _min_node(leaves, inner, offs, level, j, mode == MIN_POSITIVE)


@njit(cache=True, nogil=True)
def fix_paths(leaves, inner, offs, depth, indices, scratch, mode):  # pragma: no cover - compiled
    """Recompute every ancestor of ``indices``' leaves, one level at a time.

    ``mode``: SUM, MIN, MIN_POSITIVE (zero leaves count as ``inf``) or MAX
    (of non-negative leaves: padding and empty slots hold 0).
    ``scratch`` is an int64 array at least as long as ``indices``. Runs of
    equal parents (sorted or contiguous indices) are recomputed once. Each
    item prefetches what the item 12 places later will read and write: with
    random slots in a large tree those lines miss the cache (measured at
    N = 2^20, B = 256: the pass takes about 0.7x the time without it).
    """
    b = indices.shape[0]
    for k in range(b):
        scratch[k] = indices[k]
    for level in range(1, depth + 1):
        prev = -1
        for k in range(b):
            if k + 12 < b:
                ahead = scratch[k + 12] // K
                if level == 1:
                    prefetch(leaves, K * ahead)
                else:
                    prefetch(inner, offs[level - 1] + K * ahead)
                prefetch(inner, offs[level] + ahead)
            j = scratch[k] // K
            scratch[k] = j
            if j != prev:
                _node(leaves, inner, offs, level, j, mode)
                prev = j


@njit(cache=True, nogil=True)
def fix_sum_min_paths(leaves, sinner, minner, offs, depth, indices, scratch):  # pragma: no cover
    """:func:`fix_paths` for a sum tree and a zero-skipping min tree sharing ``leaves``.

    One pass per level recomputes both parents of each item: the 8 leaves (or
    children) are read once for both, and the two parents' lines are
    prefetched together. Same nodes as two :func:`fix_paths` calls, bit for
    bit (measured at B = 256: 27 us instead of 31 at N = 2^22, 20 instead of
    23 at N = 2^20). It repeats :func:`fix_paths`' loop on purpose: a mode
    for both trees inside that loop made the pass about 1.5x slower.
    """
    b = indices.shape[0]
    for k in range(b):
        scratch[k] = indices[k]
    for level in range(1, depth + 1):
        prev = -1
        for k in range(b):
            if k + 12 < b:
                ahead = scratch[k + 12] // K
                if level == 1:
                    prefetch(leaves, K * ahead)
                prefetch(sinner, offs[level] + ahead)
                prefetch(minner, offs[level] + ahead)
            j = scratch[k] // K
            scratch[k] = j
            if j != prev:
                _sum_node(leaves, sinner, offs, level, j)
                _min_node(leaves, minner, offs, level, j, True)
                prev = j


@njit(cache=True, nogil=True)
def rebuild(leaves, inner, offs, depth, mode):  # pragma: no cover - compiled
    """Recompute every internal node from the leaves; padding nodes get the identity."""
    empty = 0.0 if mode == SUM or mode == MAX else np.inf
    for level in range(1, depth + 1):
        for j in range(offs[level + 1] - offs[level]):
            if level == 1 and K * j >= leaves.shape[0]:
                inner[offs[level] + j] = empty
            elif level > 1 and offs[level - 1] + K * j >= offs[level]:
                inner[offs[level] + j] = empty
            else:
                _node(leaves, inner, offs, level, j, mode)


# ---------------------------------------------------------------------------
# point writes (sequential semantics: duplicates -> the last one wins)
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def write_leaves(leaves, indices, values):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        leaves[indices[k]] = values[k]


@njit(cache=True, nogil=True)
def gather(src, indices, out):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        out[k] = src[indices[k]]


# ---------------------------------------------------------------------------
# prefix-sum search
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _pick_child(a, base, t):  # pragma: no cover - compiled
    """Child of the node ``a[base:base+8]`` whose range holds target ``t``.

    Returns ``(c, t')`` with ``t'`` = ``t`` minus the children before ``c``: a
    binary search over the node's pairwise partial sums (those :func:`_sum8`
    adds, so the two halves add up to exactly the node's stored value).
    Which child a random target takes is unpredictable, so the three steps are
    arithmetic, not branches (``g`` is 0.0 or 1.0, so ``t - v * g`` is exactly
    ``t`` or ``t - v``): a mispredicted branch per step cost more than the rest
    of the search. Measured at B = 256 against scanning the children in order:
    31 -> 17 us at N = 2^20, 37 -> 22 us at N = 2^22 (25 -> 23 us at 2^16).

    Nothing here guards against zero children or a target past the node's sum;
    :func:`sum_find` checks the leaf a descent ends on.
    """
    h = (a[base] + a[base + 1]) + (a[base + 2] + a[base + 3])
    g = 1.0 if t >= h else 0.0
    c = 4 * int(g)
    t = t - h * g
    q = a[base + c] + a[base + c + 1]
    g = 1.0 if t >= q else 0.0
    c += 2 * int(g)
    t = t - q * g
    v = a[base + c]
    g = 1.0 if t >= v else 0.0
    c += int(g)
    t = t - v * g
    return c, t


@njit(cache=True, nogil=True)
def _find_careful(leaves, inner, offs, depth, target):  # pragma: no cover - compiled
    """One target, scanning each node's children in order: the slow, careful path.

    Zero children are never entered, and a target at or past the computed sum
    of a node (a few ulps under the total, or rounding in the levels above)
    takes the node's last positive child and keeps the target at or past its
    end, so that the levels below do the same: the leaf found is positive
    whenever the root is.
    """
    j = 0
    t = target
    for level in range(depth, 0, -1):
        base = K * j if level == 1 else offs[level - 1] + K * j
        chosen = -1
        last = -1
        t_last = t
        for c in range(K):
            v = leaves[base + c] if level == 1 else inner[base + c]
            if v > 0.0:
                last = c
                t_last = t
                if t < v:
                    chosen = c
                    break
                t -= v
        if chosen < 0:
            chosen = last
            t = t_last
        j = K * j + chosen
    return j


@njit(cache=True, nogil=True)
def sum_find(leaves, inner, offs, depth, targets, out):  # pragma: no cover - compiled
    """For each target ``t``: the smallest leaf ``i`` with ``t < leaf[0] + .. + leaf[i]``.

    All targets descend together, one level at a time, by the branch-free
    :func:`_pick_child`; each item prefetches the line its next pass reads.

    Guards against rounding: a target that does not end strictly inside the
    leaf it reached (``0 <= t' < leaf`` fails: a zero leaf, a target at or a
    few ulps under the total, rounding at a boundary) is searched again by
    :func:`_find_careful`, which never enters a zero child. So a leaf found is
    always positive while the root is. Such a target may wander into a zero
    node on the way down, even a padding node whose children lie past the end
    of the level below: then the node index is clamped to the level's last
    node (nothing outside the arrays is read) and the target set to ``inf``,
    so that the check at the leaf sends it to the careful path.
    """
    b = targets.shape[0]
    t = targets.copy()
    for k in range(b):
        out[k] = 0
    for level in range(depth, 0, -1):
        a = leaves if level == 1 else inner
        off = 0 if level == 1 else offs[level - 1]
        # last node of this level whose 8 children are stored in the level below
        last = (leaves.shape[0] if level == 1 else offs[level] - offs[level - 1]) // K - 1
        for k in range(b):
            j = out[k]
            if j > last:  # went past the end (rounding): read inside, redo it carefully
                j = last
                t[k] = np.inf
            c, tk = _pick_child(a, off + K * j, t[k])
            t[k] = tk
            child = K * j + c
            out[k] = child
            # the next pass reads this child's 8 children: start fetching them now
            if level == 2:
                prefetch(leaves, K * child)
            elif level > 2:
                prefetch(inner, offs[level - 2] + K * child)
    for k in range(b):
        if not t[k] < leaves[out[k]]:
            out[k] = _find_careful(leaves, inner, offs, depth, targets[k])
