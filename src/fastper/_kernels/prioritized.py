"""Kernels of the proportional sampler: raw priorities + sum tree + min tree.

They combine the tree kernels of :mod:`fastper._kernels.tree` with the key
arithmetic of :mod:`fastper._kernels.ring` into one compiled call per buffer
operation (each dispatch costs about 1 us).
"""

from __future__ import annotations

import numpy as np

from ._intrinsics import prefetch
from ._jit import njit
from .order import order_batch
from .ring import slot_keys, td_priorities
from .tree import (
    MIN_POSITIVE,
    SUM,
    K,
    _combine,
    _descend,
    _find_careful,
    _sum8,
    _u,
    fix_max_paths,
    fix_max_range,
    fix_paths,
    fix_sum_min_paths,
    rebuild,
)
from .weights import is_weights_into


@njit(cache=True, nogil=True)
def prop_write(
    raw, leaves, sinner, minner, offs, depth, indices, p, alpha, scratch, with_min
):  # pragma: no cover
    """Set raw priorities ``p`` and leaves ``p ** alpha``; last duplicate wins.

    The min tree shares the sum tree's leaves and skips zeros: a zero-priority
    slot is never sampled, so it must not set the largest weight either. It is
    only kept up to date ``with_min`` (weights normalised buffer-wide). Leaves
    are made here and in :func:`prop_rebuild` by the same scalar pow, so a
    rebuilt tree is bit-identical to an updated one.

    Random slots miss the cache, so the write loop prefetches the slots 16
    items ahead (measured: about 15% faster at N = 2^20, B = 256 than no
    prefetch).
    """
    b = indices.shape[0]
    for k in range(b):
        if k + 16 < b:
            prefetch(leaves, _u(indices[k + 16]))
            prefetch(raw, _u(indices[k + 16]))
        i = _u(indices[k])
        raw[i] = p[k]
        leaves[i] = p[k] ** alpha if p[k] > 0.0 else 0.0  # 0**0 would be 1
    if with_min:
        fix_sum_min_paths(leaves, sinner, minner, offs, depth, indices, scratch)
    else:
        fix_paths(leaves, sinner, offs, depth, indices, scratch, SUM)


@njit(cache=True, nogil=True)
def prop_write_run(
    raw, leaves, sinner, minner, offs, depth, start, count, p, alpha, with_min
):  # pragma: no cover
    """Give the ``count`` slots from ``start`` (no wrap) the same priority ``p``.

    What ``add`` does with new transitions: one pow, sequential writes, and
    each level recomputes only the contiguous range of parents above the run.
    Same result as :func:`prop_write` with those slots.
    """
    leaf = p**alpha if p > 0.0 else 0.0
    for i in range(start, start + count):
        raw[i] = p
        leaves[i] = leaf
    lo = start
    hi = start + count - 1
    for level in range(1, depth + 1):
        lo //= K
        hi //= K
        here = offs[level]
        below = 0 if level == 1 else offs[level - 1]
        a = leaves if level == 1 else sinner  # the children, per level (see tree._combine)
        m = leaves if level == 1 else minner
        first = level == 1
        for j in range(lo, hi + 1):
            sinner[_u(here + j)] = _sum8(a, below + K * j)
            if with_min:
                minner[_u(here + j)] = _combine(m, below + K * j, MIN_POSITIVE, first)


@njit(cache=True, nogil=True)
def prop_rebuild(raw, n, leaves, sinner, minner, offs, depth, alpha, with_min):  # pragma: no cover
    """Recompute every leaf from raw priorities (slots ``0..n-1``), then all nodes."""
    for i in range(n):
        leaves[i] = raw[i] ** alpha if raw[i] > 0.0 else 0.0
    rebuild(leaves, sinner, offs, depth, SUM)
    if with_min:
        rebuild(leaves, minner, offs, depth, MIN_POSITIVE)


@njit(cache=True, nogil=True)
def prop_update(
    raw,
    leaves,
    sinner,
    minner,
    offs,
    depth,
    indices,
    td,
    keys,
    use_keys,
    eps,
    clip,
    alpha,
    p_limit,
    size,
    key_base,
    added,
    capacity,
    out_p,
    scratch,
    status,
    with_min,
):  # pragma: no cover - compiled
    """:func:`td_priorities` then :func:`prop_write` in one call (one dispatch).

    ``scratch`` holds at least ``2 * len(indices)`` int64: the kept slots,
    then the search scratch.
    """
    b = indices.shape[0]
    kept_idx = scratch[:b]
    pmax = td_priorities(
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
        kept_idx,
        out_p,
        status,
    )
    kept = status[2]
    if status[0] == 0 and kept > 0:
        prop_write(
            raw,
            leaves,
            sinner,
            minner,
            offs,
            depth,
            kept_idx[:kept],
            out_p[:kept],
            alpha,
            scratch[b:],
            with_min,
        )
    return pmax


# ---------------------------------------------------------------------------
# the same writes keeping a max tree of the raw priorities (max_priority="current")
# ---------------------------------------------------------------------------
# Separate kernels, so that buffers without that tree pass no array more (each
# costs the dispatch a little) and compile nothing more. Each is its plain
# kernel, then the max tree's paths: one dispatch instead of two, about 1.5 us a
# call. ``raw`` is the whole padded priority array here (the max tree's leaves:
# its padding holds 0), ``max_inner`` the inner nodes of that tree, laid out as
# the sum tree's.


@njit(cache=True, nogil=True)
def prop_write_max(
    raw, leaves, sinner, minner, offs, depth, indices, p, alpha, scratch, with_min, max_inner
):  # pragma: no cover
    """:func:`prop_write`, then the max tree's paths above ``indices``."""
    prop_write(raw, leaves, sinner, minner, offs, depth, indices, p, alpha, scratch, with_min)
    fix_max_paths(raw, max_inner, offs, depth, indices, scratch)


@njit(cache=True, nogil=True)
def prop_write_run_max(
    raw, leaves, sinner, minner, offs, depth, start, count, p, alpha, with_min, max_inner
):  # pragma: no cover
    """:func:`prop_write_run`, then the max tree's nodes above the run."""
    prop_write_run(raw, leaves, sinner, minner, offs, depth, start, count, p, alpha, with_min)
    fix_max_range(raw, max_inner, offs, depth, start, count)


@njit(cache=True, nogil=True)
def prop_update_max(
    raw, leaves, sinner, minner, offs, depth, indices, td, keys, use_keys, eps, clip, alpha,
    p_limit, size, key_base, added, capacity, out_p, scratch, status, with_min, max_inner,
):  # pragma: no cover - compiled  # fmt: skip
    """:func:`prop_update`, then the max tree's paths above the slots it wrote (those
    it kept: ``scratch[:kept]``; the paths' scratch after them)."""
    pmax = prop_update(
        raw, leaves, sinner, minner, offs, depth, indices, td, keys, use_keys, eps, clip,
        alpha, p_limit, size, key_base, added, capacity, out_p, scratch, status, with_min,
    )  # fmt: skip
    kept = status[2]
    if status[0] == 0 and kept > 0:
        b = indices.shape[0]
        fix_max_paths(raw, max_inner, offs, depth, scratch[:kept], scratch[b:])
    return pmax


@njit(cache=True, nogil=True, inline="always")
def _target(u, perm, k, stratified, width, total):  # pragma: no cover - compiled
    """The point draw ``k`` searches: that of stratum ``perm[k]`` (``k`` without a perm).

    fastper.policy.stratified_targets: ``(s + u_s) * (total / B)``, or
    ``u_s * total`` for independent draws.
    """
    s = perm[k] if perm.shape[0] else k
    return (s + u[s]) * width if stratified else u[s] * total


@njit(cache=True, nogil=True)
def prop_sample(
    leaves,
    sinner,
    minner,
    offs,
    depth,
    u,
    perm,
    shuffle,
    stratified,
    beta,
    n,
    norm_mode,
    key_base,
    added,
    capacity,
    out_idx,
    out_prob,
    out_w,
    out_keys,
    rows,
    row_bytes,
):  # pragma: no cover - compiled
    """Draw ``B = len(out_idx)`` leaves, their probabilities, importance weights and keys.

    ``u`` holds uniforms in ``[0, 1)``: ``B`` for the targets, then with
    ``shuffle`` ``B`` more that put the draws in random order
    (:func:`~fastper._kernels.order.batch_order` of ``u[B:]``, computed here: one
    dispatch less). Stratified: draw ``k`` lands in the ``k``-th of ``B`` equal
    slices of the total mass. ``perm`` (a permutation of ``0..B-1``, or empty;
    not read with ``shuffle``) puts the draws in random order: entry ``k`` of
    every output is draw ``perm[k]``, as indexing the outputs with ``perm``
    would give, without the four copies. ``norm_mode``: 0 = divide by the
    buffer-wide largest weight (smallest positive leaf, from the min tree),
    1 = by the batch's largest weight, 2 = no normalisation. Keys as
    :func:`slot_keys` (``key_base``, ``added``, ``capacity``): one call does
    what several did, and each call costs a dispatch of about 1 us. ``rows``
    (uint8) holds the storage's records, ``row_bytes`` each (0: no records):
    the drawn rows are prefetched while the weights are computed
    (:func:`~fastper._kernels.weights.is_weights_into`).
    """
    total = sinner[offs[depth]]
    b = out_idx.shape[0]
    if shuffle:
        perm = np.empty(b, dtype=np.int64)
    order_batch(u, perm, b, shuffle)
    width = total / b
    t = np.empty(b)
    for k in range(b):
        t[k] = _target(u, perm, k, stratified, width, total)
    _descend(leaves, sinner, offs, depth, t, out_idx)
    # out_prob holds raw leaves until the weights are done: ratios of leaves
    # are exact where ratios of probabilities would round twice.
    for k in range(b):
        leaf = leaves[_u(out_idx[k])]
        if not t[k] < leaf:  # rounding or a zero leaf: search that one carefully
            out_idx[k] = _find_careful(
                leaves, sinner, offs, depth, _target(u, perm, k, stratified, width, total)
            )
            leaf = leaves[_u(out_idx[k])]
        out_prob[k] = leaf
    # the min tree is read only for the buffer-wide normalisation (without it, empty)
    lmin = minner[offs[depth]] if norm_mode == 0 else 0.0
    # (the drawn rows, if any, come into the cache meanwhile)
    is_weights_into(out_prob, total, lmin, n, beta, norm_mode, out_w, out_idx, rows, row_bytes)
    for k in range(b):
        out_prob[k] = out_prob[k] / total
    slot_keys(out_idx, key_base, added, capacity, out_keys)
