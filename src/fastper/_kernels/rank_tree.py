"""Kernels for the rank-based buffer: an order-statistics B+ tree over slots.

This module holds the tree itself: its layout and node pools, the searches
inside one node, splits, single-key inserts and deletes, bulk loading and
compaction. It knows nothing of priorities as a sampling law: the batched
writes of the rank sampler (:mod:`fastper._kernels.rank_writes`) and its
draws (:mod:`fastper._kernels.rank`) are built on it.

Order. Slots are ordered by the key ``(priority, slot)``: larger priority
first, equal priorities by the smaller slot. The 0-based position of a slot
in this order is its rank (rank 0 = largest priority).

Layout. The tree is eight flat arrays, always passed in this order:

* ``meta`` (int64): root, height, leaves and inner nodes used, keys stored,
  and the pending-change list's length and live count (:data:`ROOT` ..).
* leaves, ``L`` keys each, sorted: ``lp`` (float64 priorities) and ``ls``
  (int32 slots), both ``[leaf * L + j]``. A leaf's key count is its count in
  its parent.
* inner nodes, up to ``F`` children each: ``ip`` / ``isl`` (separator key of
  each child: every key in child ``j`` is at or after separator ``j`` and
  before separator ``j + 1``; separator 0 is ``+inf``), ``ic`` (int32 keys
  under each child), ``ich`` (int32 child id), all ``[node * F + j]``, and
  ``inn`` (int32 children of each node). Level-1 nodes have leaves as children.

Unused key positions of leaves and nodes hold the priority ``-inf`` (and a
count of 0), which ranks after every real key, and separator 0 of a node is
``+inf``, before every key: a position is then found by a binary search over
the whole node whose steps add instead of branch (:func:`_leading`).

Why a B+ tree and these sizes: at N = 2^22 the leaves (about 70 MB) live in
DRAM, so a change costs its cache misses more than its comparisons. A leaf of
64 keys is 12 cache lines; the inner levels above it (1/12 of the leaves, then
1/144, ..) mostly stay in the caches. A pointer-chasing binary tree would miss
on most of its ~22 levels. Changes are applied in groups of
:data:`~fastper._kernels.rank_writes.WARM` whose paths are prefetched together
first (:func:`~fastper._kernels.rank_writes._warm`).

Costs (N keys): select by rank, rank of a key: O(F log_F N + L); insert /
delete: O(F log_F N + L) plus, amortised, O(1) for compaction (see below);
a rebuild from sorted keys: O(N).

Nodes are never merged: a delete only removes the key from its leaf and
decrements the counts on its path, so separators stay valid and empty leaves
are harmless (a count of 0 is never selected). Inserts split full nodes on
the way down (half / half, or 3/4 : 1/4 when the key goes to the very end, so
that ascending runs, such as new transitions at the largest priority, fill
leaves to 3/4 rather than 1/2). Nodes come from fixed pools with room for
about twice the leaves a full tree needs; when a pool runs out, the tree is
compacted: its keys are read in order and the tree is rebuilt 3/4 full, in
O(N). A node created by a split needs at least L/4 more inserts before it
splits again, so at least N/6 inserts separate two compactions: O(1)
amortised per insert.

Every kernel is exact: keys are only compared, never computed with. No
fastmath.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._intrinsics import prefetch
from ._jit import njit

L = 64  # keys per leaf: 512 bytes of priorities + 256 of slots
F = 16  # children per inner node: separators 128 bytes, counts / ids 64 bytes each
PAD = -np.inf  # the priority of an unused key position: after every real key
MAX_CAPACITY = 2**31 - 1  # slots and counts are int32

MAXH = 24  # the longest path a warmed change records (heights stay far below)

# meta fields; VERSION counts changes of the routing (splits, rebuilds)
ROOT, HEIGHT, LEAVES, INNERS, SIZE, PLEN, PCOUNT, VERSION = range(8)
META_LEN = 8

# Options of the kernels that run per item. ``_nrt=False`` (numba's flag for
# "no reference counting"): with it on, every inlined helper that takes the
# tree's arrays adds an atomic incref / decref pair per array per call, which
# cost about 100 ns per priority change (measured: 256 no-op changes took
# 17 us instead of 3). These kernels cannot allocate: when the node pools run
# out they stop and return, and the caller runs :func:`compact` (which does).
_HOT = {"cache": True, "nogil": True, "_nrt": False}

OK, FULL, CORRUPT = 0, 1, 2  # what a change reports


@intrinsic
def _move(typingctx, arr, dst, src, count):  # pragma: no cover - compiled
    """``arr[dst : dst + count] = arr[src : src + count]`` as one ``memmove``.

    The shifts inside a leaf overlap their source, so numba's slice copy would
    allocate a temporary, and a loop copying element by element was not
    vectorised: 40 ns for an average shift against 10 with ``memmove``.
    """
    sig = types.void(arr, dst, src, count)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        to = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        frm = cgutils.get_item_pointer(context, builder, aryty, ary, [args[2]])
        itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        cgutils.raw_memmove(builder, to, frm, args[3], itemsize)
        return context.get_dummy_value()

    return sig, codegen


def pools(capacity: int) -> tuple[int, int]:
    """(leaf pool, inner pool) sizes for ``capacity`` slots.

    Leaves: twice what ``capacity`` keys need at 3/4 fill, plus slack. Inner
    nodes: a quarter of the leaf pool, far more than a tree 3/4 full uses
    (1/12 of its leaves, then 1/144, ..). A pool that runs out triggers a
    compaction; an inner split needs at least F/4 leaf splits below it, so
    the inner pool never runs out sooner than the leaf pool's bound allows.
    """
    n_leaves = -(-2 * capacity // L) + 4
    n_inner = n_leaves // 4 + 64
    return n_leaves, n_inner


def _aligned(n: int, dtype: type) -> np.ndarray:
    """``n`` zeros of ``dtype`` starting on a 64-byte boundary (rows stay on cache lines)."""
    size = np.dtype(dtype).itemsize
    base = np.zeros(n + 64 // size, dtype=dtype)
    start = (-base.ctypes.data % 64) // size
    return base[start : start + n]


def new_tree(capacity: int) -> tuple[np.ndarray, ...]:
    """An empty tree for ``capacity`` slots: ``(meta, lp, ls, ip, isl, ic, ich, inn)``.

    The arrays are zero-filled by ``np.zeros``, whose pages are mapped when
    first written: a pool's unused tail costs address space, not memory.
    """
    n_leaves, n_inner = pools(capacity)
    st = (
        np.zeros(META_LEN, dtype=np.int64),
        _aligned(n_leaves * L, np.float64),
        _aligned(n_leaves * L, np.int32),
        _aligned(n_inner * F, np.float64),
        _aligned(n_inner * F, np.int32),
        _aligned(n_inner * F, np.int32),
        _aligned(n_inner * F, np.int32),
        np.zeros(n_inner, dtype=np.int32),
    )
    bulk_load(*st, np.empty(0, dtype=np.float64), np.empty(0, dtype=np.int32))
    return st


# ---------------------------------------------------------------------------
# searching inside one node
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _at_or_before(kp, ks, p, s):  # pragma: no cover - compiled
    """Key ``(kp, ks)`` ranks at or before ``(p, s)``: a larger priority, or a tie and
    a slot at or below ``s`` (the slot is read only on a tie)."""
    c = kp > p
    if kp == p:
        c = ks <= s
    return c


@njit(cache=True, nogil=True, inline="always")
def _leading(kp, ks, base, n, p, s):  # pragma: no cover - compiled
    """How many of the sorted keys ``base .. base+n-1`` (``n`` a power of two) rank at
    or before ``(p, s)``.

    A binary search whose steps add 0 or ``step`` instead of branching: which
    way a search goes is a coin flip the processor would mispredict half the
    time. Measured on a 64-key leaf in cache: 30 ns, against 65 for a count
    over all keys (numba did not vectorise it).
    """
    pos = 0
    step = n >> 1
    while step > 0:
        if _at_or_before(kp[base + pos + step - 1], ks[base + pos + step - 1], p, s):
            pos += step
        step >>= 1
    if _at_or_before(kp[base + pos], ks[base + pos], p, s):
        pos += 1
    return pos


@njit(cache=True, nogil=True, inline="always")
def _route(ip, isl, node, p, s):  # pragma: no cover - compiled
    """Child of inner ``node`` whose key range holds ``(p, s)``: the number of
    separators at or before the key, less one (separator 0 is ``+inf``)."""
    return _leading(ip, isl, node * F, F, p, s) - 1


@njit(cache=True, nogil=True, inline="always")
def _leaf_pos(lp, ls, leaf, p, s):  # pragma: no cover - compiled
    """Number of keys in ``leaf`` at or before ``(p, s)``: its position if it is not
    there, its position + 1 if it is (padding never counts)."""
    return _leading(lp, ls, leaf * L, L, p, s)


@njit(cache=True, nogil=True, inline="always")
def _fetch(lp, ls, ip, ic, ich, node, level):  # pragma: no cover - compiled
    """Prefetch every line a visit of ``node`` reads (a leaf when ``level`` is 0).

    A descent learns a node's address only when it reaches it; fetching all
    its lines at once turns several misses in a row into one wait.
    """
    if level == 0:
        base = node * L
        for j in range(0, L, 8):
            prefetch(lp, base + j)
        for j in range(0, L, 16):
            prefetch(ls, base + j)
    else:
        base = node * F
        prefetch(ip, base)
        prefetch(ip, base + F - 1)
        prefetch(ic, base)
        prefetch(ich, base)


@njit(cache=True, nogil=True, inline="always")
def _pad_inner(ip, isl, ic, ich, node, lo):  # pragma: no cover - compiled
    """Mark child positions ``lo..F-1`` of ``node`` unused."""
    base = node * F
    for j in range(lo, F):
        ip[base + j] = PAD
        isl[base + j] = 0
        ic[base + j] = 0
        ich[base + j] = 0


@njit(cache=True, nogil=True, inline="always")
def _open(ip, isl, ic, ich, inn, node, i):  # pragma: no cover - compiled
    """Shift children ``i..`` of a non-full ``node`` one place right."""
    base = node * F
    for j in range(inn[node], i, -1):
        ip[base + j] = ip[base + j - 1]
        isl[base + j] = isl[base + j - 1]
        ic[base + j] = ic[base + j - 1]
        ich[base + j] = ich[base + j - 1]
    inn[node] += 1


# ---------------------------------------------------------------------------
# splits (rare: not inlined)
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _split_leaf(meta, lp, ls, ip, isl, ic, ich, inn, parent, i, at):  # pragma: no cover
    """Move keys ``at..`` of child ``i`` of ``parent`` (a full leaf) to a new leaf after it."""
    left = ich[parent * F + i]
    right = meta[LEAVES]
    meta[LEAVES] += 1
    meta[VERSION] += 1
    lb = left * L
    rb = right * L
    moved = L - at
    for j in range(moved):
        lp[rb + j] = lp[lb + at + j]
        ls[rb + j] = ls[lb + at + j]
        lp[lb + at + j] = PAD
        ls[lb + at + j] = 0
    for j in range(moved, L):
        lp[rb + j] = PAD
        ls[rb + j] = 0
    _open(ip, isl, ic, ich, inn, parent, i + 1)
    q = parent * F + i + 1
    ip[q] = lp[rb]
    isl[q] = ls[rb]
    ich[q] = right
    ic[q] = moved
    ic[q - 1] -= moved
    return right


@njit(cache=True, nogil=True)
def _split_inner(meta, ip, isl, ic, ich, inn, parent, i, at):  # pragma: no cover
    """Move children ``at..`` of child ``i`` of ``parent`` (a full node) to a new node after it."""
    left = ich[parent * F + i]
    right = meta[INNERS]
    meta[INNERS] += 1
    meta[VERSION] += 1
    lb = left * F
    rb = right * F
    moved_children = inn[left] - at
    moved = 0
    for j in range(moved_children):
        ip[rb + j] = ip[lb + at + j]
        isl[rb + j] = isl[lb + at + j]
        ic[rb + j] = ic[lb + at + j]
        ich[rb + j] = ich[lb + at + j]
        moved += ic[lb + at + j]
    _pad_inner(ip, isl, ic, ich, right, moved_children)
    _pad_inner(ip, isl, ic, ich, left, at)
    inn[left] = at
    inn[right] = moved_children
    _open(ip, isl, ic, ich, inn, parent, i + 1)
    q = parent * F + i + 1
    ip[q] = ip[rb]
    isl[q] = isl[rb]
    ip[rb] = np.inf  # separator 0 of every node
    isl[rb] = 0
    ich[q] = right
    ic[q] = moved
    ic[q - 1] -= moved
    return right


# ---------------------------------------------------------------------------
# single-key insert / delete
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _insert(meta, lp, ls, ip, isl, ic, ich, inn, p, s):  # pragma: no cover - compiled
    """Insert key ``(p, s)`` (not present), splitting full nodes on the way down.

    The caller makes sure the pools hold what this may take (:func:`_room`).
    """
    root = meta[ROOT]
    if inn[root] == F:  # grow a new root above the full one; the loop splits the old
        new = meta[INNERS]
        meta[INNERS] += 1
        meta[VERSION] += 1
        _pad_inner(ip, isl, ic, ich, new, 1)
        nb = new * F
        ip[nb] = np.inf
        isl[nb] = 0
        ich[nb] = root
        ic[nb] = meta[SIZE]
        inn[new] = 1
        meta[ROOT] = new
        meta[HEIGHT] += 1
        root = new
    node = root
    level = meta[HEIGHT]
    while True:
        i = _route(ip, isl, node, p, s)
        nb = node * F
        child = ich[nb + i]
        if level == 1:
            if ic[nb + i] == L:
                at = L // 2
                if _leaf_pos(lp, ls, child, p, s) == L:
                    at = L - L // 4  # appending: leave the left leaf 3/4 full
                right = _split_leaf(meta, lp, ls, ip, isl, ic, ich, inn, node, i, at)
                if not (p > ip[nb + i + 1] or (p == ip[nb + i + 1] and s < isl[nb + i + 1])):
                    i += 1
                    child = right
            n = ic[nb + i]
            ic[nb + i] = n + 1
            pos = _leaf_pos(lp, ls, child, p, s)
            base = child * L
            _move(lp, base + pos + 1, base + pos, n - pos)
            _move(ls, base + pos + 1, base + pos, n - pos)
            lp[base + pos] = p
            ls[base + pos] = s
            break
        if inn[child] == F:
            at = F // 2
            if _route(ip, isl, child, p, s) == F - 1:
                at = F - F // 4  # appending, as for leaves
            right = _split_inner(meta, ip, isl, ic, ich, inn, node, i, at)
            if not (p > ip[nb + i + 1] or (p == ip[nb + i + 1] and s < isl[nb + i + 1])):
                i += 1
                child = right
        ic[nb + i] += 1
        node = child
        level -= 1
    meta[SIZE] += 1


@njit(cache=True, nogil=True, inline="always")
def _remove_in_leaf(meta, lp, ls, base, pos, n):  # pragma: no cover - compiled
    """Close the gap of key ``pos`` in the leaf at ``base`` holding ``n`` keys."""
    _move(lp, base + pos, base + pos + 1, n - 1 - pos)
    _move(ls, base + pos, base + pos + 1, n - 1 - pos)
    lp[base + n - 1] = PAD
    ls[base + n - 1] = 0
    meta[SIZE] -= 1


@njit(cache=True, nogil=True, inline="always")
def _delete(meta, lp, ls, ip, isl, ic, ich, inn, p, s):  # pragma: no cover - compiled
    """Remove key ``(p, s)``; False if it is not there (the tree is then corrupt)."""
    node = meta[ROOT]
    q = 0
    for _ in range(meta[HEIGHT]):
        q = node * F + _route(ip, isl, node, p, s)
        ic[q] -= 1
        node = ich[q]
    n = ic[q] + 1
    pos = _leaf_pos(lp, ls, node, p, s) - 1
    base = node * L
    if pos < 0 or lp[base + pos] != p or ls[base + pos] != s:
        return False
    _remove_in_leaf(meta, lp, ls, base, pos, n)
    return True


@njit(cache=True, nogil=True, inline="always")
def _delete_at(meta, lp, ls, ic, ich, path, off, p, s):  # pragma: no cover - compiled
    """:func:`_delete` along a recorded path (``path[off + level]``: the child
    position taken at each level, top down), without routing again; the
    key's position in its leaf is looked up only if ``path[off + MAXH - 1]``
    (a hint, or -1) does not hold it.

    False, with nothing changed, if the key is not in the leaf the path ends
    at: the path was recorded for another key of the slot.
    """
    h = meta[HEIGHT]
    q = path[off + h - 1]
    leaf = ich[q]
    n = ic[q]
    base = leaf * L
    pos = path[off + MAXH - 1]
    if not (0 <= pos < n and lp[base + pos] == p and ls[base + pos] == s):
        pos = _leaf_pos(lp, ls, leaf, p, s) - 1
        if pos < 0 or lp[base + pos] != p or ls[base + pos] != s:
            return False
    for level in range(h):
        ic[path[off + level]] -= 1
    _remove_in_leaf(meta, lp, ls, base, pos, n)
    return True


@njit(cache=True, nogil=True, inline="always")
def _insert_at(meta, lp, ls, ic, ich, path, off, p, s):  # pragma: no cover - compiled
    """:func:`_insert` along a recorded path; False (nothing done) if the leaf is
    full. Only a leaf split changes inner nodes, so a leaf with room is all an
    insert needs."""
    h = meta[HEIGHT]
    q = path[off + h - 1]
    n = ic[q]
    if n == L:
        return False
    for level in range(h):
        ic[path[off + level]] += 1
    leaf = ich[q]
    pos = _leaf_pos(lp, ls, leaf, p, s)
    base = leaf * L
    _move(lp, base + pos + 1, base + pos, n - pos)
    _move(ls, base + pos + 1, base + pos, n - pos)
    lp[base + pos] = p
    ls[base + pos] = s
    meta[SIZE] += 1
    return True


@njit(cache=True, nogil=True, inline="always")
def _room(meta, lp, inn):  # pragma: no cover - compiled
    """The pools hold what one insert may take: a leaf and ``height + 2`` inner nodes."""
    return meta[LEAVES] < lp.shape[0] // L and meta[INNERS] + meta[HEIGHT] + 2 <= inn.shape[0]


@njit(cache=True, nogil=True, inline="always")
def _change(meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, p):  # pragma: no cover - compiled
    """Give slot ``s`` the key ``(p, s)``; ``ranked[s] < 0`` means it is not in the tree.

    FULL (nothing done) when the pools may run out: the caller compacts and
    comes back. CORRUPT if the old key was not found.
    """
    old = ranked[s]
    if old == p:
        return OK
    if not _room(meta, lp, inn):
        return FULL
    if old >= 0.0:
        if not _delete(meta, lp, ls, ip, isl, ic, ich, inn, old, s):
            return CORRUPT
    _insert(meta, lp, ls, ip, isl, ic, ich, inn, p, s)
    ranked[s] = p
    return OK


# ---------------------------------------------------------------------------
# bulk: load from sorted keys, read in order, compact
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def bulk_load(meta, lp, ls, ip, isl, ic, ich, inn, keys_p, keys_s):  # pragma: no cover
    """Rebuild the tree from keys already in order, leaves and nodes 3/4 full. O(N).

    Leaves the pending-change fields of ``meta`` alone.
    """
    m = keys_p.shape[0]
    fill = (3 * L) // 4
    n_leaves = max(1, (m + fill - 1) // fill)
    cur = np.empty(n_leaves, dtype=np.int64)
    size = np.empty(n_leaves, dtype=np.int64)  # keys under each node of the level
    first_p = np.empty(n_leaves, dtype=np.float64)  # the first key under each node
    first_s = np.empty(n_leaves, dtype=np.int32)
    for j in range(n_leaves):
        lo = j * m // n_leaves
        hi = (j + 1) * m // n_leaves
        base = j * L
        for k in range(L):
            if lo + k < hi:
                lp[base + k] = keys_p[lo + k]
                ls[base + k] = keys_s[lo + k]
            else:
                lp[base + k] = PAD
                ls[base + k] = 0
        cur[j] = j
        size[j] = hi - lo
        first_p[j] = lp[base]  # PAD for the one leaf of an empty tree: never read
        first_s[j] = ls[base]
    meta[LEAVES] = n_leaves
    meta[INNERS] = 0
    width = n_leaves
    height = 0
    fill = (3 * F) // 4
    while True:
        nodes = max(1, (width + fill - 1) // fill)
        nxt = np.empty(nodes, dtype=np.int64)
        nsize = np.empty(nodes, dtype=np.int64)
        nfirst_p = np.empty(nodes, dtype=np.float64)
        nfirst_s = np.empty(nodes, dtype=np.int32)
        for j in range(nodes):
            lo = j * width // nodes
            hi = (j + 1) * width // nodes
            node = meta[INNERS]
            meta[INNERS] += 1
            _pad_inner(ip, isl, ic, ich, node, hi - lo)
            total = 0
            for c in range(lo, hi):
                child = cur[c]
                q = node * F + c - lo
                ich[q] = child
                ip[q] = first_p[c] if c > lo else np.inf  # separator 0 of every node
                isl[q] = first_s[c] if c > lo else 0
                ic[q] = size[c]
                total += size[c]
            inn[node] = hi - lo
            nxt[j] = node
            nsize[j] = total
            nfirst_p[j] = first_p[lo]
            nfirst_s[j] = first_s[lo]
        height += 1
        cur = nxt
        size = nsize
        first_p = nfirst_p
        first_s = nfirst_s
        width = nodes
        if nodes == 1:
            break
    meta[ROOT] = cur[0]
    meta[HEIGHT] = height
    meta[SIZE] = m
    meta[VERSION] += 1


@njit(cache=True, nogil=True)
def read_in_order(meta, lp, ls, ip, isl, ic, ich, inn, out_p, out_s):  # pragma: no cover
    """Write every key in rank order into ``out_p`` / ``out_s``; returns the count. O(N)."""
    cur = np.empty(1, dtype=np.int64)
    cur[0] = meta[ROOT]
    for _ in range(meta[HEIGHT] - 1):
        total = 0
        for j in range(cur.shape[0]):
            total += inn[cur[j]]
        nxt = np.empty(total, dtype=np.int64)
        k = 0
        for j in range(cur.shape[0]):
            node = cur[j]
            for c in range(inn[node]):
                nxt[k] = ich[node * F + c]
                k += 1
        cur = nxt
    m = 0
    for j in range(cur.shape[0]):  # level-1 nodes: their children are the leaves
        node = cur[j]
        for c in range(inn[node]):
            leaf = ich[node * F + c]
            for k in range(ic[node * F + c]):
                out_p[m] = lp[leaf * L + k]
                out_s[m] = ls[leaf * L + k]
                m += 1
    return m


@njit(cache=True, nogil=True)
def compact(meta, lp, ls, ip, isl, ic, ich, inn):  # pragma: no cover - compiled
    """Rebuild the tree 3/4 full from its own keys, freeing every empty node. O(N)."""
    m = meta[SIZE]
    keys_p = np.empty(m, dtype=np.float64)
    keys_s = np.empty(m, dtype=np.int32)
    read_in_order(meta, lp, ls, ip, isl, ic, ich, inn, keys_p, keys_s)
    bulk_load(meta, lp, ls, ip, isl, ic, ich, inn, keys_p, keys_s)
