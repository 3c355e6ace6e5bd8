"""Kernels for the rank sampler's batched writes: changes of many slots at once.

A change of one key is cheap in comparisons and dear in cache misses (see
:mod:`fastper._kernels.rank_tree`). The kernels here apply a batch of
priority changes in groups of :data:`WARM` whose paths are routed and
prefetched together first (:func:`_warm`), reusing the paths the last draw
recorded (:func:`_remember` / :func:`_lookup`) for the slots it drew; and
they keep the list of deferred changes (:func:`apply_pending`). They are
separate from the tree, which they only drive through its single-key
operations, and from the draws, which only read it.
"""

from __future__ import annotations

from ._intrinsics import prefetch
from ._jit import njit
from .rank_tree import (
    _HOT,
    CORRUPT,
    FULL,
    HEIGHT,
    MAXH,
    OK,
    PCOUNT,
    PLEN,
    ROOT,
    VERSION,
    F,
    L,
    _change,
    _delete,
    _delete_at,
    _fetch,
    _insert,
    _insert_at,
    _room,
    _route,
)

WARM = 32  # changes whose paths are prefetched together (see :func:`_warm`)


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
    ``stab`` and paths ``spaths``, see :func:`fastper._kernels.rank._select`) and no split
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
