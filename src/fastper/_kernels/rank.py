"""Kernels for the rank-based buffer: an order-statistics B+ tree over slots.

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
on most of its ~22 levels. Changes are applied in groups of :data:`WARM`
whose paths are prefetched together first (:func:`_warm`).

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
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._intrinsics import prefetch

L = 64  # keys per leaf: 512 bytes of priorities + 256 of slots
F = 16  # children per inner node: separators 128 bytes, counts / ids 64 bytes each
PAD = -np.inf  # the priority of an unused key position: after every real key
MAX_CAPACITY = 2**31 - 1  # slots and counts are int32
WARM = 32  # changes whose paths are prefetched together (see :func:`_warm`)
GUIDE = 4  # ranks per guide-table bucket (see :func:`guide_table`)

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


# ---------------------------------------------------------------------------
# the rank sampler's batched writes
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _hash(stab, s):  # pragma: no cover - compiled
    """Home bucket of slot ``s`` in ``stab`` (pairs ``[slot, k]``; a power-of-two
    number of buckets, at least twice the batch, so probes stay short)."""
    return ((s * 0x9E3779B1) >> 7) & (stab.shape[0] // 2 - 1)


@njit(cache=True, nogil=True, inline="always")
def _remember(stab, s, k):  # pragma: no cover - compiled
    """Record that sample item ``k`` drew slot ``s`` (the first item that did)."""
    mask = stab.shape[0] // 2 - 1
    h = _hash(stab, s)
    while stab[2 * h] >= 0:
        if stab[2 * h] == s:
            return
        h = (h + 1) & mask
    stab[2 * h] = s
    stab[2 * h + 1] = k


@njit(cache=True, nogil=True, inline="always")
def _lookup(stab, s):  # pragma: no cover - compiled
    """The sample item that drew slot ``s``, or -1."""
    mask = stab.shape[0] // 2 - 1
    h = _hash(stab, s)
    while stab[2 * h] >= 0:
        if stab[2 * h] == s:
            return stab[2 * h + 1]
        h = (h + 1) & mask
    return -1


@njit(cache=True, nogil=True, inline="always")
def _warm(
    meta, lp, ls, ip, isl, ic, ich, ranked, raw, pending, slots, p, from_raw, j0, j1, paths,
    how, sample, stab, spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Route both keys of each change ``slots[j0:j1]`` at once, prefetching as they go.

    The new priority of ``slots[j]`` is ``raw[s]`` if ``from_raw`` else
    ``p[j]``. All the paths descend together, a level at a time, each
    prefetching its next node, so that their cache misses overlap (unwarmed,
    a change at N = 2^20 missed about six times in a row: its slot's entries,
    two inner nodes, two leaves). Each path is recorded in ``paths``
    (``MAXH`` entries per key, old key then new key; int64 scratch of
    ``2 * WARM * MAXH``), so that :func:`_change_warm` need not route again;
    ``how[j - j0]`` says where the old key's path came from: 1 the sample,
    0 routed here, -1 none (the slot was not in the tree). Only reads.

    The old key is not routed when the last sample recorded a path for the
    slot (``sample = (count, version)``, its slots in the hash table
    ``stab`` and paths ``spaths``, see :func:`_select`) and no split
    happened since: updates usually come for the slots just sampled.
    """
    h = meta[HEIGHT]
    if h >= MAXH:  # pragma: no cover - unreachable below 2^31 slots: route in the change
        return
    use_sample = sample[0] > 0 and sample[1] == meta[VERSION]
    for j in range(j0, j1):
        s = slots[j]
        prefetch(ranked, s)  # the change reads these three
        prefetch(raw, s)
        prefetch(pending, s)
        off = 2 * MAXH * (j - j0)
        how[j - j0] = 0
        paths[off + MAXH - 1] = -1  # no position hint
        if use_sample:
            k = _lookup(stab, s)
            if k >= 0:
                for level in range(h):
                    q = spaths[k * MAXH + level]
                    paths[off + level] = q
                    prefetch(ic, q)  # the delete decrements these counts
                pos = spaths[k * MAXH + MAXH - 1]
                paths[off + MAXH - 1] = pos
                # the delete reads the key at ``pos`` and moves the keys after it
                base = ich[paths[off + h - 1]] * L
                for jj in range(pos - pos % 8, L, 8):
                    prefetch(lp, base + jj)
                for jj in range(pos - pos % 16, L, 16):
                    prefetch(ls, base + jj)
                how[j - j0] = 1
    root = meta[ROOT]
    for level in range(h):
        for j in range(j0, j1):
            s = slots[j]
            jj = j - j0
            off = 2 * MAXH * jj
            if how[jj] == 0:
                old = ranked[s]
                if old >= 0.0:
                    nd = root if level == 0 else ich[paths[off + level - 1]]
                    q = nd * F + _route(ip, isl, nd, old, s)
                    paths[off + level] = q
                    _fetch(lp, ls, ip, ic, ich, ich[q], h - 1 - level)
                else:
                    how[jj] = -1
            v = raw[s] if from_raw else p[j]
            off += MAXH
            nd = root if level == 0 else ich[paths[off + level - 1]]
            q = nd * F + _route(ip, isl, nd, v, s)
            paths[off + level] = q
            _fetch(lp, ls, ip, ic, ich, ich[q], h - 1 - level)


@njit(cache=True, nogil=True, inline="always")
def _change_warm(
    meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, p, paths, how, jj, version
):  # pragma: no cover - compiled
    """:func:`_change` along the paths :func:`_warm` recorded for change ``jj`` of
    its group, while no split happened since (``version``).

    A recorded old path is used only if its leaf holds the slot's current key
    (an earlier change of the group may have moved it); then it is the leaf's
    ancestry, since the tree's shape has not changed. Otherwise it routes.
    """
    old = ranked[s]
    if old == p:
        return OK
    if not _room(meta, lp, inn):
        return FULL
    valid = meta[VERSION] == version
    off = 2 * MAXH * jj
    if old >= 0.0:
        if not (valid and how[jj] >= 0 and _delete_at(meta, lp, ls, ic, ich, paths, off, old, s)):
            if not _delete(meta, lp, ls, ip, isl, ic, ich, inn, old, s):
                return CORRUPT
    if not (valid and _insert_at(meta, lp, ls, ic, ich, paths, off + MAXH, p, s)):
        _insert(meta, lp, ls, ip, isl, ic, ich, inn, p, s)
    ranked[s] = p
    return OK


@njit(cache=True, nogil=True)
def _compact_pending(meta, pending, plist):  # pragma: no cover - compiled
    """Drop stale and repeated entries from the pending list (every slot once)."""
    k = 0
    for j in range(meta[PLEN]):
        s = plist[j]
        if pending[s]:
            pending[s] = False  # so that a repeat of ``s`` is dropped
            plist[k] = s
            k += 1
    for j in range(k):
        pending[plist[j]] = True
    meta[PLEN] = k


@njit(**_HOT)
def write(
    meta, lp, ls, ip, isl, ic, ich, inn, ranked, raw, pending, plist, slots, p, defer, paths,
    how, sample, stab, spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Set ``raw[slots] = p`` in order (the last duplicate wins) and re-rank the slots.

    With ``defer``, a slot already in the tree keeps its key and is only
    marked pending (see :func:`apply_pending`); a slot not in the tree yet is
    always inserted now. Without, each slot is re-ranked now (a pending mark
    is dropped). O(B log N), amortised.

    Returns how many items were done: ``B``, or fewer when the pools ran out
    (item ``k`` untouched: :func:`compact`, then call again with the rest),
    or -1 if the tree was found corrupt. ``paths`` / ``how``: scratch, and
    ``sample`` / ``stab`` / ``spaths``: the last sample's paths, for
    :func:`_warm`.
    """
    b = slots.shape[0]
    version = -1
    for k in range(b):
        if not defer and k % WARM == 0:
            _warm(meta, lp, ls, ip, isl, ic, ich, ranked, raw, pending, slots, p, False, k,
                  min(k + WARM, b), paths, how, sample, stab, spaths)  # fmt: skip
            version = meta[VERSION] if meta[HEIGHT] < MAXH else -1
        s = slots[k]
        v = p[k]
        if defer and ranked[s] >= 0.0:
            if not pending[s]:
                if meta[PLEN] == plist.shape[0]:
                    _compact_pending(meta, pending, plist)
                pending[s] = True
                plist[meta[PLEN]] = s
                meta[PLEN] += 1
                meta[PCOUNT] += 1
        else:
            if defer:  # a slot new to the tree: nothing warmed
                code = _change(meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, v)
            else:
                code = _change_warm(meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, v, paths,
                                    how, k % WARM, version)  # fmt: skip
            if code != OK:
                return k if code == FULL else -1
            if pending[s]:
                pending[s] = False  # its stale list entry is skipped later
                meta[PCOUNT] -= 1
        raw[s] = v
    return b


@njit(**_HOT)
def write_run(
    meta, lp, ls, ip, isl, ic, ich, inn, ranked, raw, pending, start, count, p
):  # pragma: no cover - compiled
    """New transitions: slots ``start .. start+count-1`` get priority ``p``, ranked now.

    Returns how many were done, as :func:`write` does.
    """
    for k in range(count):
        s = start + k
        code = _change(meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, p)
        if code != OK:
            return k if code == FULL else -1
        if pending[s]:
            pending[s] = False
            meta[PCOUNT] -= 1
        raw[s] = p
    return count


@njit(**_HOT)
def remove(meta, lp, ls, ip, isl, ic, ich, inn, ranked, raw, pending, slots):  # pragma: no cover
    """Take ``slots`` out of the order (slots not in it are skipped): they cannot be
    drawn until a write ranks them again. Their raw priority becomes 0 and a
    pending re-ranking is dropped. O(B log N).

    Returns how many slots left the order, or -1 if the tree was found corrupt.
    """
    out = 0
    for k in range(slots.shape[0]):
        s = slots[k]
        old = ranked[s]
        if old >= 0.0:
            if not _delete(meta, lp, ls, ip, isl, ic, ich, inn, old, s):
                return -1
            ranked[s] = -1.0
            out += 1
        if pending[s]:
            pending[s] = False
            meta[PCOUNT] -= 1
        raw[s] = 0.0
    meta[VERSION] += 1  # paths recorded by the last sample may pass through changed leaves
    return out


@njit(**_HOT)
def apply_pending(
    meta, lp, ls, ip, isl, ic, ich, inn, ranked, raw, pending, plist, paths, how, sample, stab,
    spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Re-rank every pending slot by its current raw priority. O(k log N), amortised.

    Returns 1 when done, 0 when the pools ran out (:func:`compact`, then call
    again: the slots done are no longer pending), -1 if the tree is corrupt.
    """
    m = meta[PLEN]
    version = -1
    for j in range(m):
        if j % WARM == 0:
            _warm(meta, lp, ls, ip, isl, ic, ich, ranked, raw, pending, plist, raw, True, j,
                  min(j + WARM, m), paths, how, sample, stab, spaths)  # fmt: skip
            version = meta[VERSION] if meta[HEIGHT] < MAXH else -1
        s = plist[j]
        if pending[s]:
            code = _change_warm(meta, lp, ls, ip, isl, ic, ich, inn, ranked, s, raw[s], paths,
                                how, j % WARM, version)  # fmt: skip
            if code != OK:
                return 0 if code == FULL else -1
            pending[s] = False
    meta[PLEN] = 0
    meta[PCOUNT] = 0
    return 1


# ---------------------------------------------------------------------------
# reads: select by rank, rank of a slot, draws
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _select(meta, ls, ic, ich, inn, ranks, node, rem, out, spaths, stab):  # pragma: no cover
    """``out[k]`` = the slot at 0-based rank ``ranks[k]`` (each ``< meta[SIZE]``).

    All ranks descend together, one level at a time; each prefetches the
    lines its next level reads, so the misses of a batch overlap.
    ``node`` / ``rem``: int64 scratch, as long as ``ranks``. The path taken
    (child position per level, top down) and, last, the position in the leaf
    are recorded in ``spaths[k * MAXH ..]`` (``len(ranks) * MAXH`` int64)
    and ``k`` under its slot in the hash table ``stab`` (see
    :func:`_lookup`): a later update of these slots deletes their keys along
    it instead of routing (:func:`_warm`).
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
            last = inn[nd] - 1
            j = 0
            while j < last and r >= ic[base + j]:
                r -= ic[base + j]
                j += 1
            if level < MAXH - 1:
                spaths[k * MAXH + level] = base + j
            child = ich[base + j]
            node[k] = child
            rem[k] = r
            if level < h - 1:
                prefetch(ic, child * F)
                prefetch(ich, child * F)
            else:
                prefetch(ls, child * L + r)
    for j in range(stab.shape[0]):
        stab[j] = -1
    for k in range(b):
        s = ls[node[k] * L + rem[k]]
        out[k] = s
        spaths[k * MAXH + MAXH - 1] = rem[k]  # the key's position in its leaf
        _remember(stab, s, k)


@njit(**_HOT)
def select(
    meta, lp, ls, ip, isl, ic, ich, inn, ranks, node, rem, out, spaths, stab
):  # pragma: no cover - compiled
    """``out[k]`` = the slot at 0-based rank ``ranks[k]``; see :func:`_select`."""
    _select(meta, ls, ic, ich, inn, ranks, node, rem, out, spaths, stab)


@njit(**_HOT)
def rank_of(meta, lp, ls, ip, isl, ic, ich, inn, ranked, slots, out):  # pragma: no cover
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
            _fetch(lp, ls, ip, ic, ich, node, level)
            for j in range(i):
                acc += ic[base + j]
        out[k] = acc + _leaf_pos(lp, ls, node, p, s) - 1


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
    meta, lp, ls, ip, isl, ic, ich, inn, prefix, guide, scale, n, u, stratified, alpha, ranks,
    node, rem, out, prob, spaths, stab,
):  # fmt: skip  # pragma: no cover - compiled
    """Draw ranks from P(r) = (r + 1)^-alpha / prefix[n - 1] (0-based r), then their slots.

    ``u``: uniforms in [0, 1); stratified: draw ``k`` lands in the ``k``-th of
    ``B`` equal slices of the mass. Writes ``ranks``, the slots ``out`` and
    ``prob``. O(B log N). Two passes over the batch: the first finds where each
    search starts and prefetches its prefix sums, so that their misses overlap.
    """
    b = u.shape[0]
    total = prefix[n - 1]
    for k in range(b):
        t = (k + u[k]) * (total / b) if stratified else u[k] * total
        r = _guess(guide, scale, n, t)
        ranks[k] = r
        prefetch(prefix, r)
        if r > 0:
            prefetch(prefix, r - 1)
    for k in range(b):
        t = (k + u[k]) * (total / b) if stratified else u[k] * total
        r = _find_rank(prefix, n, t, ranks[k])
        ranks[k] = r
        prob[k] = (r + 1.0) ** (-alpha) / total
    _select(meta, ls, ic, ich, inn, ranks, node, rem, out, spaths, stab)


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
