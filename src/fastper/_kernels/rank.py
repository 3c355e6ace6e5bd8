"""Kernels for the rank-based buffer: draws by rank over an order-statistics B+ tree.

The kernels are split by responsibility:

* :mod:`fastper._kernels.rank_tree`: the tree over slots ordered by
  ``(priority, slot)``, larger priority first (rank 0 = largest priority):
  layout, node pools, inserts, deletes, bulk loading, compaction and their
  costs (a compaction needs at least N/6 inserts since the last one);
* :mod:`fastper._kernels.rank_writes`: batched priority changes along
  prefetched paths, and deferred changes;
* :mod:`fastper._kernels.rank_bits`: the bit operations on a leaf's word of
  live marks;
* this module: the reads (select by rank, rank of a slot) and the draws
  (rank weights' prefix sums, guide table, exact draws).

It also re-exports every name of the other two that the rank sampler uses, so
that ``from fastper._kernels import rank`` gives the whole set.
"""

from __future__ import annotations

import numpy as np

from ._intrinsics import prefetch
from ._jit import njit
from .order import order_batch
from .rank_bits import low_bits, popcount, select_bit
from .rank_tree import (
    _HOT,
    CHILD_AT,
    CORRUPT,
    DRAW,
    FULL,
    HEIGHT,
    INNERS,
    LEAVES,
    MAX_CAPACITY,
    MAXH,
    META_LEN,
    OK,
    PAD,
    PCOUNT,
    PLEN,
    ROOT,
    SIZE,
    SLOT,
    VERSION,
    F,
    L,
    _fetch,
    _leaf_find,
    _route,
    bulk_load,
    compact,
    new_tree,
    pools,
    read_in_order,
)
from .rank_writes import (
    WARM,
    apply_pending,
    remove,
    update,
    write,
    write_run,
)
from .ring import slot_keys
from .weights import is_weights_into

GUIDE = 4  # ranks per guide-table bucket (see :func:`guide_table`)

__all__ = [
    "CORRUPT",
    "DRAW",
    "F",
    "FULL",
    "GUIDE",
    "HEIGHT",
    "INNERS",
    "L",
    "LEAVES",
    "MAXH",
    "MAX_CAPACITY",
    "META_LEN",
    "OK",
    "PAD",
    "PCOUNT",
    "PLEN",
    "ROOT",
    "SIZE",
    "SLOT",
    "VERSION",
    "WARM",
    "apply_pending",
    "bulk_load",
    "compact",
    "guide_table",
    "new_tree",
    "pools",
    "rank_of",
    "rank_weights_prefix",
    "read_in_order",
    "remove",
    "sample_exact",
    "select",
    "update",
    "write",
    "write_run",
]


# ---------------------------------------------------------------------------
# reads: select by rank, rank of a slot, draws
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _select(meta, ls, lm, ic, ich, inn, ranks, node, rem, out, spaths):  # pragma: no cover
    """``out[k]`` = the slot at 0-based rank ``ranks[k]`` (each ``< meta[SIZE]``).

    All ranks descend together, one level at a time; each prefetches the
    lines its next level reads, so the misses of a batch overlap. Inside a
    node, the child holding rank ``r`` is the number of children whose
    running count stays at or below ``r`` (a vector prefix sum and compare,
    :func:`~fastper._kernels.rank_bits.child_at16` and wider); inside a leaf, it is
    the ``r``-th live position.
    ``node`` / ``rem``: int64 scratch, as long as ``ranks``. Draw ``k``'s
    record ``spaths[k * MAXH ..]`` (``len(ranks) * MAXH`` int64; see
    :data:`~fastper._kernels.rank_tree.DRAW`) receives the path taken (child
    position per level, top down), the slot and the position in the leaf: a
    later update of these slots deletes their keys along it instead of
    routing (:func:`~fastper._kernels.rank_writes._drawn` finds it). The
    caller writes each output position's draw (at ``DRAW``).
    """
    b = ranks.shape[0]
    h = meta[HEIGHT]
    for k in range(b):
        node[k] = meta[ROOT]
        rem[k] = ranks[k]
    for level in range(h):
        for k in range(b):
            nd = node[k]
            r = rem[k]
            base = nd * F
            j, before = CHILD_AT(ic, base, r)  # unused positions count 0: never past r
            r -= before
            if level < DRAW:
                spaths[k * MAXH + level] = base + j
            child = ich[base + j]
            node[k] = child
            rem[k] = r
            if level < h - 1:
                for c in range(0, F, 16):
                    prefetch(ic, child * F + c)
                    prefetch(ich, child * F + c)
            else:
                prefetch(lm, child)
                prefetch(ls, child * L + r)
    for k in range(b):
        leaf = node[k]
        pos = select_bit(lm[leaf], rem[k])
        s = ls[leaf * L + pos]
        out[k] = s
        spaths[k * MAXH + SLOT] = s
        spaths[k * MAXH + MAXH - 1] = pos  # the key's position in its leaf


@njit(**_HOT)
def select(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranks, node, rem, out, spaths, sample
):  # pragma: no cover - compiled
    """``out[k]`` = the slot at 0-based rank ``ranks[k]``; see :func:`_select`.

    The draws' records are those of the outputs as they are (output ``k`` is
    draw ``k``: a caller that reorders the outputs writes the draw of each at
    ``DRAW``); ``sample`` (int64[3]) receives their count, the routing's
    version then and 0 (no table of their slots yet: see
    :func:`~fastper._kernels.rank_writes._drawn`), the count 0 while the records are
    being written.
    """
    b = ranks.shape[0]
    sample[0] = 0
    _select(meta, ls, lm, ic, ich, inn, ranks, node, rem, out, spaths)
    for k in range(b):
        spaths[k * MAXH + DRAW] = k
    sample[0] = b
    sample[1] = meta[VERSION]
    sample[2] = 0


@njit(**_HOT)
def rank_of(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, slots, out):  # pragma: no cover
    """``out[k]`` = 0-based rank of slot ``slots[k]`` (which must be in the tree)."""
    for k in range(slots.shape[0]):
        s = slots[k]
        p = ranked[s]
        node = meta[ROOT]
        acc = 0
        for level in range(meta[HEIGHT] - 1, -1, -1):
            i = _route(ip, isl, node, p, s)
            base = node * F
            node = ich[base + i]
            _fetch(lp, ls, lm, ip, ic, ich, node, level)
            for j in range(i):
                acc += ic[base + j]
        pos = _leaf_find(lp, ls, lm, node, p, s)
        out[k] = acc + popcount(lm[node] & low_bits(pos))


def guide_table(prefix: np.ndarray) -> tuple[np.ndarray, float]:
    """A guide table for inverting the prefix sums: ``(guide, scale)``.

    ``guide[g]`` is the first rank whose prefix sum exceeds ``g / scale``, for
    ``G = len(prefix) / GUIDE`` buckets of equal mass (``scale = G / total``).
    A target ``t`` starts at ``guide[int(t * scale)]`` and steps forward, at
    most ``1 + GUIDE`` steps on average whatever the law (the guide-table
    method of inversion, Chen and Asau 1974): about one cache miss per draw,
    where a binary search over the prefix sums (8 bytes per slot) missed on
    most of its steps. 4 / GUIDE bytes per slot.
    """
    n = prefix.shape[0]
    g = max(1, n // GUIDE)
    scale = g / prefix[n - 1]
    bounds = np.arange(g, dtype=np.float64) / scale
    guide = np.minimum(np.searchsorted(prefix, bounds, side="right"), n - 1).astype(np.int32)
    return guide, float(scale)


@njit(cache=True, nogil=True, inline="always")
def _guess(guide, scale, n, t):  # pragma: no cover - compiled
    """Where the search for target ``t`` starts (see :func:`guide_table`)."""
    g = min(int(t * scale), guide.shape[0] - 1)
    return min(guide[g], n - 1)


@njit(cache=True, nogil=True, inline="always")
def _find_rank(prefix, n, t, r):  # pragma: no cover - compiled
    """``min(searchsorted(prefix[:n], t, side="right"), n - 1)``, starting at ``r``.

    Steps back while the rank before also exceeds ``t`` (rounding at a bucket
    edge), then forward while ``prefix[r] <= t``; after 64 steps either way it
    falls back to a binary search, so the worst case is O(log N).
    """
    steps = 0
    while r > 0 and prefix[r - 1] > t and steps < 64:
        r -= 1
        steps += 1
    while r < n - 1 and prefix[r] <= t and steps < 64:
        r += 1
        steps += 1
    if steps == 64:
        lo = 0
        hi = n
        while lo < hi:
            mid = (lo + hi) >> 1
            if prefix[mid] > t:
                hi = mid
            else:
                lo = mid + 1
        r = min(lo, n - 1)
    return r


@njit(**_HOT)
def sample_exact(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, prefix, guide, scale, n, u, perm, shuffle,
    stratified, alpha, ranks, node, rem, sel, out, prob, spaths, sample, key_base, added, keys,
    beta, norm, pmin, weights, rows, row_bytes,
):  # fmt: skip  # pragma: no cover - compiled
    """Draw ranks from P(r) = (r + 1)^-alpha / prefix[n - 1] (0-based r), then their slots.

    ``u``: uniforms in [0, 1); stratified: draw ``k`` lands in the ``k``-th of
    ``B`` equal slices of the mass. Writes ``ranks``, the slots ``out``,
    ``prob``, the slots' keys ``keys`` (:func:`fastper._kernels.ring.slot_keys`
    for ``key_base`` and ``added``) and the IS ``weights`` for ``beta``. O(B log N).
    Two passes over the batch: the first finds where each search starts and
    prefetches its prefix sums, so that their misses overlap.

    ``B = len(ranks)``. The batch order as in
    :func:`~fastper._kernels.prioritized.prop_sample`: with ``shuffle``, ``u``
    holds ``2B`` uniforms and ``u[B:2B]`` order the draws
    (:func:`~fastper._kernels.order.batch_order`, computed here into ``perm``,
    B int64 of scratch: this kernel allocates nothing); else entry ``k`` of
    every output is draw ``perm[k]`` (``perm`` empty: draw ``k``). The draws
    themselves are made in draw order (``ranks`` and ``sel``, B int64 of
    scratch: the slots in that order), ascending ranks when stratified, so
    that neighbouring descents share their nodes; only the outputs are
    permuted. The paths recorded for a later update are those of draw order;
    ``sample`` (int64[3]) receives their count, the routing's version
    (:data:`VERSION`) then and 0, as :func:`select` writes it.
    ``rows`` (uint8) holds the storage's records, ``row_bytes`` each (0: none):
    the drawn rows are prefetched while the weights are computed.

    The weights follow the shared rule (:func:`fastper.policy.is_weights`, the
    probabilities being the masses, of total 1) with its expressions in its
    order, one ``pow`` per element: the same bits. ``norm``: 0 buffer-wide
    (``pmin``: the smallest probability held), 1 the batch's, 2 none.
    """
    b = ranks.shape[0]
    if sel.shape[0] < b:  # (numba reads past an array's end unchecked)
        raise ValueError("sample_exact: sel shorter than the batch")
    order_batch(u, perm, b, shuffle)
    total = prefix[n - 1]
    width = total / b
    for k in range(b):
        t = (k + u[k]) * width if stratified else u[k] * total
        r = _guess(guide, scale, n, t)
        ranks[k] = r
        prefetch(prefix, r)
        if r > 0:
            prefetch(prefix, r - 1)
    for k in range(b):
        t = (k + u[k]) * width if stratified else u[k] * total
        ranks[k] = _find_rank(prefix, n, t, ranks[k])
    sample[0] = 0
    _select(meta, ls, lm, ic, ich, inn, ranks, node, rem, sel, spaths)
    permuted = perm.shape[0] != 0
    for k in range(b):
        d = perm[k] if permuted else k
        out[k] = sel[d]
        spaths[k * MAXH + DRAW] = d
        prob[k] = (ranks[d] + 1.0) ** (-alpha) / total
    sample[0] = b
    sample[1] = meta[VERSION]
    sample[2] = 0
    slot_keys(out, key_base, added, prefix.shape[0], keys)  # one prefix sum per slot
    # masses = probabilities; the drawn rows, if any, come into the cache meanwhile
    is_weights_into(prob, 1.0, pmin, n, beta, norm, weights, out, rows, row_bytes)


@njit(cache=True, nogil=True)
def rank_weights_prefix(alpha, n, out):  # pragma: no cover - compiled
    """``out[r] = sum_{k=1..r+1} k**-alpha`` for ``r < n``."""
    # Neumaier-compensated running sum: a plain one loses ~N ulps at N = 2**22.
    acc = 0.0
    comp = 0.0
    for r in range(n):
        x = (r + 1.0) ** (-alpha)
        t = acc + x
        if abs(acc) >= abs(x):
            comp += (acc - t) + x
        else:
            comp += (x - t) + acc
        acc = t
        out[r] = acc + comp
