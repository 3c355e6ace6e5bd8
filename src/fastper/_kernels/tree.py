"""Sum / min tree kernels over an implicit binary heap.

Layout: for a tree of ``size`` leaves (a power of two), the array has
``2 * size`` entries; node ``1`` is the root, node ``j`` has children ``2j`` and
``2j + 1`` and leaf ``i`` lives at ``size + i``. Entry ``0`` is unused.

Why there is no drift: every internal node is always *recomputed* from its two
children (``parent = left + right``) rather than adjusted by a delta
(``parent += new - old``). The tree is therefore a pure function of its leaves:
the same leaves give bit-identical internal nodes whatever the order of
updates, and the root's relative error against an exact sum of the leaves is
bounded by ``depth * 2**-53`` (all terms are non-negative), never accumulating
over millions of updates. No ``fastmath``: it would let LLVM reassociate sums.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# ---------------------------------------------------------------------------
# point updates (batched, sequential semantics: duplicates -> last one wins)
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def sum_set(tree, size, indices, values):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        pos = size + indices[k]
        tree[pos] = values[k]
        pos >>= 1
        while pos >= 1:
            tree[pos] = tree[2 * pos] + tree[2 * pos + 1]
            pos >>= 1


@njit(cache=True, nogil=True)
def min_set(tree, size, indices, values):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        pos = size + indices[k]
        tree[pos] = values[k]
        pos >>= 1
        while pos >= 1:
            left = tree[2 * pos]
            right = tree[2 * pos + 1]
            tree[pos] = left if left < right else right
            pos >>= 1


@njit(cache=True, nogil=True)
def sum_rebuild(tree, size):  # pragma: no cover - compiled
    for pos in range(size - 1, 0, -1):
        tree[pos] = tree[2 * pos] + tree[2 * pos + 1]


@njit(cache=True, nogil=True)
def min_rebuild(tree, size):  # pragma: no cover - compiled
    for pos in range(size - 1, 0, -1):
        left = tree[2 * pos]
        right = tree[2 * pos + 1]
        tree[pos] = left if left < right else right


@njit(cache=True, nogil=True)
def gather_leaves(tree, size, indices, out):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        out[k] = tree[size + indices[k]]


# ---------------------------------------------------------------------------
# prefix-sum search
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _descend(tree, size, target):  # pragma: no cover - compiled
    """Smallest leaf ``i`` with ``target < leaf[0] + ... + leaf[i]``.

    Guards against rounding: a child whose sum is zero is never entered, so the
    leaf found always holds a positive value as long as the root is positive,
    even for targets at or a few ulps above the computed total.
    """
    pos = 1
    t = target
    while pos < size:
        left = tree[2 * pos]
        if left > 0.0 and (t < left or tree[2 * pos + 1] <= 0.0):
            pos = 2 * pos
        else:
            t -= left
            pos = 2 * pos + 1
    return pos - size


@njit(cache=True, nogil=True)
def descend_batch(tree, size, targets, out):  # pragma: no cover - compiled
    """:func:`_descend` for many targets, one tree level at a time.

    Walking all targets down together keeps many independent memory loads in
    flight (the lower levels of a large tree miss the cache), where one walk
    after another would wait for each miss in turn. Same result as calling
    :func:`_descend` per target.
    """
    b = targets.shape[0]
    t = targets.copy()
    for k in range(b):
        out[k] = 1
    width = 1
    while width < size:
        for k in range(b):
            pos = out[k]
            left = tree[2 * pos]
            if left > 0.0 and (t[k] < left or tree[2 * pos + 1] <= 0.0):
                out[k] = 2 * pos
            else:
                t[k] -= left
                out[k] = 2 * pos + 1
        width *= 2
    for k in range(b):
        out[k] -= size


@njit(cache=True, nogil=True)
def sum_find(tree, size, targets, out):  # pragma: no cover - compiled
    descend_batch(tree, size, targets, out)


# ---------------------------------------------------------------------------
# fused operations for the proportional buffer
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def prop_set(raw, stree, mtree, size, indices, p, alpha):  # pragma: no cover - compiled
    """Write raw priorities and both trees; sequential, last duplicate wins.

    Leaves are ``p ** alpha`` computed here and in :func:`prop_rebuild` by the
    same scalar pow, so a rebuilt tree is bit-identical to an updated one.

    The min tree holds ``+inf`` for zero leaves: a zero-priority slot is never
    sampled, so it must not define the largest importance weight either.
    """
    for k in range(indices.shape[0]):
        i = indices[k]
        raw[i] = p[k]
        leaf = p[k] ** alpha if p[k] > 0.0 else 0.0  # 0**0 would be 1
        pos = size + i
        stree[pos] = leaf
        mtree[pos] = leaf if leaf > 0.0 else np.inf
        pos >>= 1
        while pos >= 1:
            stree[pos] = stree[2 * pos] + stree[2 * pos + 1]
            left = mtree[2 * pos]
            right = mtree[2 * pos + 1]
            mtree[pos] = left if left < right else right
            pos >>= 1


@njit(cache=True, nogil=True)
def prop_rebuild(raw, n, stree, mtree, size, alpha):  # pragma: no cover - compiled
    """Recompute every leaf from raw priorities (slots ``0..n-1``), then all nodes."""
    for i in range(n):
        leaf = raw[i] ** alpha if raw[i] > 0.0 else 0.0
        stree[size + i] = leaf
        mtree[size + i] = leaf if leaf > 0.0 else np.inf
    for pos in range(size - 1, 0, -1):
        stree[pos] = stree[2 * pos] + stree[2 * pos + 1]
        left = mtree[2 * pos]
        right = mtree[2 * pos + 1]
        mtree[pos] = left if left < right else right


@njit(cache=True, nogil=True)
def prop_sample(
    stree, mtree, size, u, stratified, beta, n, norm_mode, out_idx, out_prob, out_w
):  # pragma: no cover - compiled
    """Draw ``len(u)`` leaves, their probabilities and importance weights.

    ``u`` holds uniforms in ``[0, 1)``. Stratified: draw ``k`` lands in the
    ``k``-th of ``B`` equal slices of the total mass. ``norm_mode``: 0 = divide
    by the buffer-wide largest weight (smallest leaf, from the min tree),
    1 = by the batch's largest weight, 2 = no normalisation.
    """
    total = stree[1]
    b = u.shape[0]
    targets = np.empty(b)
    for k in range(b):
        if stratified:
            targets[k] = (k + u[k]) * total / b
        else:
            targets[k] = u[k] * total
    descend_batch(stree, size, targets, out_idx)
    # out_prob holds raw leaves until the weights are done: ratios of leaves
    # are exact where ratios of probabilities would round twice.
    for k in range(b):
        out_prob[k] = stree[size + out_idx[k]]
    if norm_mode == 0:
        lmin = mtree[1]
        for k in range(b):
            out_w[k] = (out_prob[k] / lmin) ** (-beta)
    elif norm_mode == 1:
        lmin = np.inf
        for k in range(b):
            if out_prob[k] < lmin:
                lmin = out_prob[k]
        for k in range(b):
            out_w[k] = (out_prob[k] / lmin) ** (-beta)
    else:
        for k in range(b):
            out_w[k] = (n * (out_prob[k] / total)) ** (-beta)
    for k in range(b):
        out_prob[k] = out_prob[k] / total


# ---------------------------------------------------------------------------
# generic helpers
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def scatter_last_wins(dst, indices, values):  # pragma: no cover - compiled
    for k in range(indices.shape[0]):
        dst[indices[k]] = values[k]
