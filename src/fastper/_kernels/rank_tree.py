"""Kernels for the rank-based buffer: an order-statistics B+ tree over slots.

This module holds the tree itself: its layout and node pools, the searches
inside one node, splits, single-key inserts and deletes (by routing or along
a recorded path), bulk loading and compaction. It knows nothing of
priorities as a sampling law: the batched writes of the rank sampler
(:mod:`fastper._kernels.rank_writes`) and its draws
(:mod:`fastper._kernels.rank`) are built on it.

Order. Slots are ordered by the key ``(priority, slot)``: larger priority
first, equal priorities by the smaller slot. The 0-based position of a slot
in this order is its rank (rank 0 = largest priority).

Layout. The tree is nine flat arrays, always passed in this order:

* ``meta`` (int64): root, height, leaves and inner nodes used, keys stored,
  the pending-change list's length and live count, and a counter of
  changes of the routing (:data:`ROOT` .. :data:`VERSION`).
* leaves, ``L`` key positions each: ``lp`` (float64 priorities) and ``ls``
  (int32 slots), both ``[leaf * L + j]``, and ``lm`` (int64, one word per
  leaf): bit ``j`` marks position ``j`` live. The keys at the positions in
  use, live or not, are sorted; a leaf's live count is its count in its
  parent.
* inner nodes, up to ``F`` children each: ``ip`` / ``isl`` (separator key of
  each child: every key in child ``j`` is at or after separator ``j`` and
  before separator ``j + 1``; separator 0 is ``+inf``), ``ic`` (int32 live
  keys under each child), ``ich`` (int32 child id), all ``[node * F + j]``,
  and ``inn`` (int32 children of each node). Level-1 nodes have leaves as
  children.

Unused key positions of leaves and nodes hold the priority ``-inf`` (and a
count of 0), which ranks after every real key, and separator 0 of a node is
``+inf``, before every key. Unused positions of a leaf are its last ones.

Deletes leave tombstones. A delete clears the key's live bit and decrements
the counts on its path: nothing moves, so it touches the lines a draw of
that key has just read (its path, its slot, its leaf's word), and a dead key
keeps its place as a fence of the sorted order. An insert finds its position
among all the keys in use, dead ones included, then shifts the keys between
it and the nearest free position (dead or unused) by one: a short shift in a
leaf with tombstones. A leaf splits only when its ``L`` positions are all live.
The slot at rank ``r`` inside a leaf is at the position of its ``r``-th live
bit, and the rank of a key inside its leaf is the count of live bits before
it (:mod:`fastper._kernels.rank_bits`).

Why a B+ tree and these sizes: at N = 2^22 the leaves (about 70 MB) live in
DRAM, so a change costs its cache misses more than its comparisons. A leaf of
32 keys is 6 cache lines (4 of priorities, all compared at once, 2 of
slots); the inner levels above it (1/12 of the leaves, then 1/144, ..)
mostly stay in the caches. A pointer-chasing binary tree would miss on most
of its ~22 levels. Measured on the learner loop (a draw of 256, then an
update of the drawn slots), 32-key leaves did as well as 16 and better than
64, and 16 children per node as well as 32 and better than 64 at N = 2^22.
Changes are applied in groups whose paths are routed and prefetched
together first (:mod:`fastper._kernels.rank_writes`).

Searches inside a node count: the separators (or leaf keys) before a key
are counted over all of them at once, with vector compares and no branch on
the data (:mod:`fastper._kernels.rank_bits`).

Costs (N keys): select by rank, rank of a key: O(F log_F N + L); insert /
delete: O(F log_F N + L) plus, amortised, O(1) for compaction (see below);
a rebuild from sorted keys: O(N).

Nodes are never merged: empty leaves are harmless (a count of 0 is never
selected). Inserts split full nodes on the way down (half / half, or 3/4 :
1/4 when the key goes to the very end, so that ascending runs, such as new
transitions at the largest priority, fill leaves to 3/4 rather than 1/2).
Nodes come from fixed pools with room for about twice the leaves a full tree
needs; when a pool runs out, the tree is compacted: its live keys are read in
order and the tree is rebuilt 3/4 full, in O(N), which also drops every
tombstone. A node created by a split needs at least L/4 more live keys before
it splits again, so at least N/6 inserts separate two compactions: O(1)
amortised per insert.

Paths. A draw records the path it took to each key (the child position at
each level, top down, and the key's position in its leaf): an update of the
drawn slots deletes their keys along it without routing. A recorded path is
checked before use, so it stays safe whatever happened since: each position
must be a child of the node reached so far, starting at the root, and the
slot's live key must be at the recorded leaf position (:func:`_delete_path`).
A path routed for an insert is checked likewise when the routing changed
since (a split), and the key must still fall in its leaf's range
(:func:`_insert_path`).

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
from .rank_bits import (
    child_at16,
    child_at32,
    child_at64,
    clz,
    ctz,
    eq16,
    eq32,
    eq64,
    gt16,
    gt32,
    gt64,
    le16,
    le32,
    le64,
    low_bits,
    lshr,
    popcount,
)

L = 32  # keys per leaf: 256 bytes of priorities + 128 of slots, one live word
F = 16  # children per inner node: separators 128 bytes, counts / ids 64 bytes each
PAD = -np.inf  # the priority of an unused key position: after every real key
MAX_CAPACITY = 2**31 - 1  # slots and counts are int32
ALL_LIVE = -1 if L == 64 else (1 << L) - 1  # a leaf word with every position live
# vector compares over one leaf's keys, and over one inner node's separators and counts
_VEC = {16: (gt16, eq16, le16, child_at16), 32: (gt32, eq32, le32, child_at32),
        64: (gt64, eq64, le64, child_at64)}  # fmt: skip
_GT_LEAF, _EQ_LEAF, _LE_LEAF, _ = _VEC[L]
_GT_NODE, _EQ_NODE, _LE_NODE, CHILD_AT = _VEC[F]

MAXH = 24  # path entries per recorded path: levels, then the leaf position last
# A draw's record (the paths a sample keeps for the update after it) has the same
# MAXH entries: its path's levels, then at DRAW the draw behind output position k
# (the record of output k holds it), at SLOT the slot drawn, and the leaf position
# last. Paths of DRAW levels or more are never recorded (unreachable below 2^31 slots).
DRAW, SLOT = MAXH - 3, MAXH - 2

# meta fields; VERSION counts changes of the routing (splits, rebuilds)
ROOT, HEIGHT, LEAVES, INNERS, SIZE, PLEN, PCOUNT, VERSION = range(8)
META_LEN = 8

# Options of the kernels that run per item. ``_nrt=False`` (numba's flag for
# "no reference counting"): with it on, every inlined helper that takes the
# tree's arrays adds an atomic incref / decref pair per array per call, which
# cost about 100 ns per priority change (measured: 256 no-op changes took
# 17 us instead of 3). These kernels cannot allocate: when the node pools run
# out they stop and return, and the caller runs :func:`compact` (which does).
# ``error_model="numpy"``: a float division by zero gives inf or nan, as in
# numpy (the IS weights of an absurdly large alpha, whose smallest probability
# underflows to 0, are 0, as the shared rule computes them), instead of
# raising; no zero check is compiled into the divisions by node sizes.
_HOT = {"cache": True, "nogil": True, "_nrt": False, "error_model": "numpy"}

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


@njit(cache=True, nogil=True, inline="always")
def _shift(arr, dst, src, count):  # pragma: no cover - compiled
    """``arr[dst : dst + count] = arr[src : src + count]`` (``|dst - src| = 1``): a
    loop for the few keys a shift inside a leaf with tombstones usually moves,
    else :func:`_move` (a call costs more than a short loop)."""
    if count > 4:
        _move(arr, dst, src, count)
    elif dst > src:
        for j in range(count - 1, -1, -1):
            arr[dst + j] = arr[src + j]
    else:
        for j in range(count):
            arr[dst + j] = arr[src + j]


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
    """An empty tree for ``capacity`` slots: ``(meta, lp, ls, lm, ip, isl, ic, ich, inn)``.

    The arrays are zero-filled by ``np.zeros``, whose pages are mapped when
    first written: a pool's unused tail costs address space, not memory.
    """
    n_leaves, n_inner = pools(capacity)
    st = (
        np.zeros(META_LEN, dtype=np.int64),
        _aligned(n_leaves * L, np.float64),
        _aligned(n_leaves * L, np.int32),
        _aligned(n_leaves, np.int64),
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
def _route(ip, isl, node, p, s):  # pragma: no cover - compiled
    """Child of inner ``node`` whose key range holds ``(p, s)``: the number of
    separators at or before the key, less one (separator 0 is ``+inf``).

    One vector compare over the node's separators; slots are compared only
    where a separator's priority equals ``p``.
    """
    base = node * F
    c = popcount(_GT_NODE(ip, base, p))
    e = _EQ_NODE(ip, base, p)
    if e != 0:
        c += popcount(e & _LE_NODE(isl, base, s))
    return c - 1


@njit(cache=True, nogil=True, inline="always")
def _leaf_pos(lp, ls, leaf, p, s):  # pragma: no cover - compiled
    """Number of key positions of ``leaf`` at or before ``(p, s)``, dead keys
    included (unused positions never count): the keys are sorted, so this is
    where ``(p, s)`` goes.

    Vector compares over the whole leaf (four lines of priorities, all
    fetched together), slots compared only where a priority equals ``p``: a
    binary search would wait for each line in turn.
    """
    base = leaf * L
    c = popcount(_GT_LEAF(lp, base, p))
    e = _EQ_LEAF(lp, base, p)
    if e != 0:
        c += popcount(e & _LE_LEAF(ls, base, s))
    return c


@njit(cache=True, nogil=True, inline="always")
def _leaf_find(lp, ls, lm, leaf, p, s):  # pragma: no cover - compiled
    """Position of the live key ``(p, s)`` in ``leaf``, or -1.

    Equal keys sit together; all but one of them are dead (a key deleted,
    then inserted again with the same priority).
    """
    base = leaf * L
    m = lm[leaf]
    pos = _leaf_pos(lp, ls, leaf, p, s) - 1
    while pos >= 0 and lp[base + pos] == p and ls[base + pos] == s:
        if (m >> pos) & 1:
            return pos
        pos -= 1
    return -1


@njit(cache=True, nogil=True, inline="always")
def _fetch(lp, ls, lm, ip, ic, ich, node, level):  # pragma: no cover - compiled
    """Prefetch every line a visit of ``node`` reads (a leaf when ``level`` is 0).

    A descent learns a node's address only when it reaches it; fetching all
    its lines at once turns several misses in a row into one wait.
    """
    if level == 0:
        base = node * L
        prefetch(lm, node)
        for j in range(0, L, 8):
            prefetch(lp, base + j)
        for j in range(0, L, 16):
            prefetch(ls, base + j)
    else:
        base = node * F
        for j in range(0, F, 8):
            prefetch(ip, base + j)
        for j in range(0, F, 16):
            prefetch(ic, base + j)
            prefetch(ich, base + j)


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
# one leaf: insert into a free position, delete by clearing a live bit
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _leaf_insert(lp, ls, lm, leaf, p, s):  # pragma: no cover - compiled
    """Put key ``(p, s)`` in its place in ``leaf``, which has a free position.

    The keys between its place and the nearest free position (a dead key or
    the first unused one) move one step towards it; those are all live, so
    the positions live afterwards are the same plus the free one.
    """
    base = leaf * L
    pos = _leaf_pos(lp, ls, leaf, p, s)  # the key goes before position ``pos``
    m = lm[leaf]
    free = ~m & ALL_LIVE
    right = lshr(free, pos) if pos < L else 0
    to_right = ctz(right)  # keys to move right (64: no free position at or after pos)
    below = free & low_bits(pos)
    gap_left = 63 - clz(below)  # the nearest free position before pos (-1: none)
    to_left = pos - 1 - gap_left if below != 0 else 64
    if to_right <= to_left:
        gap = pos + to_right
        _shift(lp, base + pos + 1, base + pos, to_right)
        _shift(ls, base + pos + 1, base + pos, to_right)
        at = pos
    else:
        gap = gap_left
        _shift(lp, base + gap, base + gap + 1, to_left)
        _shift(ls, base + gap, base + gap + 1, to_left)
        at = pos - 1
    lp[base + at] = p
    ls[base + at] = s
    lm[leaf] = m | (1 << gap)


# ---------------------------------------------------------------------------
# splits (rare: not inlined)
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _split_leaf(meta, lp, ls, lm, ip, isl, ic, ich, inn, parent, i, at):  # pragma: no cover
    """Move keys ``at..`` of child ``i`` of ``parent`` (a leaf with every position
    live) to a new leaf after it."""
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
    lm[left] = low_bits(at)
    lm[right] = low_bits(moved)
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
def _insert(meta, lp, ls, lm, ip, isl, ic, ich, inn, p, s):  # pragma: no cover - compiled
    """Insert key ``(p, s)`` (not live), splitting full nodes on the way down.

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
                right = _split_leaf(meta, lp, ls, lm, ip, isl, ic, ich, inn, node, i, at)
                if not (p > ip[nb + i + 1] or (p == ip[nb + i + 1] and s < isl[nb + i + 1])):
                    i += 1
                    child = right
            ic[nb + i] += 1
            _leaf_insert(lp, ls, lm, child, p, s)
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
def _delete(meta, lp, ls, lm, ip, isl, ic, ich, inn, p, s):  # pragma: no cover - compiled
    """Remove key ``(p, s)``; False if it is not there (the tree is then corrupt)."""
    node = meta[ROOT]
    q = 0
    for _ in range(meta[HEIGHT]):
        q = node * F + _route(ip, isl, node, p, s)
        ic[q] -= 1
        node = ich[q]
    pos = _leaf_find(lp, ls, lm, node, p, s)
    if pos < 0:
        return False
    lm[node] &= ~(1 << pos)
    meta[SIZE] -= 1
    return True


@njit(cache=True, nogil=True, inline="always")
def _path_leaf(meta, ich, inn, path, off):  # pragma: no cover - compiled
    """The leaf a recorded path leads to, or -1 if it is not a path of the tree now.

    ``path[off + level]`` (top down) must be a child position of the node
    reached so far, starting at the root: then it is the leaf's ancestry.
    """
    h = meta[HEIGHT]
    if h >= DRAW:  # pragma: no cover - unreachable below 2^31 slots
        return -1
    node = meta[ROOT]
    for level in range(h):
        q = path[off + level]
        base = node * F
        if q < base or q >= base + inn[node]:
            return -1
        node = ich[q]
    return node


@njit(cache=True, nogil=True, inline="always")
def _delete_path(meta, lp, ls, lm, ic, ich, inn, path, off, p, s, check):  # pragma: no cover
    """:func:`_delete` along a recorded path (``path[off + level]`` top down, the
    leaf position last, at ``off + MAXH - 1``), without routing.

    ``check``: the routing may have changed since the path was recorded; it
    is then checked (:func:`_path_leaf`). The live key of slot ``s`` must be
    at the recorded position, or, if keys moved inside the leaf since, found
    in the leaf by ``(p, s)``. False, with nothing changed, if the path is
    not the key's.
    """
    if check:
        leaf = _path_leaf(meta, ich, inn, path, off)
        if leaf < 0:
            return False
    else:
        leaf = ich[path[off + meta[HEIGHT] - 1]]
    pos = path[off + MAXH - 1]
    m = lm[leaf]
    if not (0 <= pos < L and ls[leaf * L + pos] == s and (m >> pos) & 1):
        pos = _leaf_find(lp, ls, lm, leaf, p, s)
        if pos < 0:
            return False
    lm[leaf] = m & ~(1 << pos)
    for level in range(meta[HEIGHT]):
        ic[path[off + level]] -= 1
    meta[SIZE] -= 1
    return True


@njit(cache=True, nogil=True, inline="always")
def _insert_path(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, path, off, p, s, check
):  # pragma: no cover
    """:func:`_insert` along a path routed for ``(p, s)``; False (nothing done) if
    the leaf has no free position (a split routes again).

    ``check``: the routing changed since the path was routed; it is then
    checked (:func:`_path_leaf`) and the key must still fall before the end
    of its leaf's range: the separator after the path's entry at the
    deepest level where one follows (a split moves the end of a node's
    range, never its start).
    """
    h = meta[HEIGHT]
    q = path[off + h - 1]
    if check:
        if _path_leaf(meta, ich, inn, path, off) < 0:
            return False
        for level in range(h - 1, -1, -1):
            nxt = path[off + level] + 1
            node = (nxt - 1) // F
            if nxt < node * F + inn[node]:
                sp = ip[nxt]
                if sp > p or (sp == p and isl[nxt] <= s):
                    return False
                break
    leaf = ich[q]
    if lm[leaf] == ALL_LIVE:
        return False
    for level in range(h):
        ic[path[off + level]] += 1
    _leaf_insert(lp, ls, lm, leaf, p, s)
    meta[SIZE] += 1
    return True


@njit(cache=True, nogil=True, inline="always")
def _room(meta, lp, inn, k):  # pragma: no cover - compiled
    """The pools hold what ``k`` inserts may take: ``k`` leaves and ``k * (height + 2)``
    inner nodes."""
    return (
        meta[LEAVES] + k <= lp.shape[0] // L
        and meta[INNERS] + k * (meta[HEIGHT] + 2) <= inn.shape[0]
    )


@njit(cache=True, nogil=True, inline="always")
def _change(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, s, p):  # pragma: no cover
    """Give slot ``s`` the key ``(p, s)``; ``ranked[s] < 0`` means it is not in the tree.

    FULL (nothing done) when the pools may run out: the caller compacts and
    comes back. CORRUPT if the old key was not found.
    """
    old = ranked[s]
    if old == p:
        return OK
    if not _room(meta, lp, inn, 1):
        return FULL
    if old >= 0.0:
        if not _delete(meta, lp, ls, lm, ip, isl, ic, ich, inn, old, s):
            return CORRUPT
    _insert(meta, lp, ls, lm, ip, isl, ic, ich, inn, p, s)
    ranked[s] = p
    return OK


# ---------------------------------------------------------------------------
# bulk: load from sorted keys, read in order, compact
# ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def bulk_load(meta, lp, ls, lm, ip, isl, ic, ich, inn, keys_p, keys_s):  # pragma: no cover
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
        lm[j] = low_bits(hi - lo)
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
def read_in_order(meta, lp, ls, lm, ip, isl, ic, ich, inn, out_p, out_s):  # pragma: no cover
    """Write every live key in rank order into ``out_p`` / ``out_s``; returns the count. O(N)."""
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
            live = lm[leaf]
            while live != 0:
                k = ctz(live)
                out_p[m] = lp[leaf * L + k]
                out_s[m] = ls[leaf * L + k]
                m += 1
                live &= ~(1 << k)
    return m


@njit(cache=True, nogil=True)
def compact(meta, lp, ls, lm, ip, isl, ic, ich, inn):  # pragma: no cover - compiled
    """Rebuild the tree 3/4 full from its live keys, freeing every empty node and
    dropping every tombstone. O(N)."""
    m = meta[SIZE]
    keys_p = np.empty(m, dtype=np.float64)
    keys_s = np.empty(m, dtype=np.int32)
    read_in_order(meta, lp, ls, lm, ip, isl, ic, ich, inn, keys_p, keys_s)
    bulk_load(meta, lp, ls, lm, ip, isl, ic, ich, inn, keys_p, keys_s)
