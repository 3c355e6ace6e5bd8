"""Kernels for the rank sampler's batched writes: changes of many slots at once.

A change of one key is cheap in comparisons and dear in cache misses (see
:mod:`fastper._kernels.rank_tree`). The kernels here apply a batch of
priority changes in groups of :data:`WARM`, each in phases, so that the
misses of a group overlap instead of following each other. Preparing a
group only reads the tree (:func:`_prepare`):

1. each slot's entries (its ranked and raw priority) are fetched, and the
   repeats of a slot inside the group dropped (the last one wins);
2. the old keys of the slots the last draw recorded a path for
   (:func:`_drawn`) are located along it;
3. the new keys (and the other old keys) are routed together, a level at a
   time, each prefetching its next node.

Applying it (:func:`_apply_group`) deletes the old keys (tombstones: nothing
moves), then inserts the new keys along their routed paths. The next group
is prepared before a group is applied, so that its misses have a whole
group's work to arrive (:func:`_apply`); whatever the applied group changed
is checked when the next one is applied (a slot's key, a split on a path).

Deletes before inserts is safe inside a group: a slot appears once, and a
delete changes no routing. The kernels also keep the list of deferred
changes (:func:`apply_pending`). They drive the tree only through its
single-key operations, and know nothing of the draws, which only read it.

Tried and measured slower on the learner loop: groups of 16 or 64 (no
better than 32), and a software pipeline that moves each change one level
per step among the changes in flight (10 to 15 % slower: more bookkeeping
per step, no more overlap).
"""

from __future__ import annotations

from ._intrinsics import prefetch, prefetch_w
from ._jit import njit
from .rank_tree import (
    _HOT,
    CORRUPT,
    DRAW,
    FULL,
    HEIGHT,
    MAXH,
    OK,
    PCOUNT,
    PLEN,
    ROOT,
    SLOT,
    VERSION,
    F,
    L,
    _change,
    _delete,
    _delete_path,
    _fetch,
    _insert,
    _insert_path,
    _path_leaf,
    _room,
    _route,
)
from .ring import td_priorities

WARM = 32  # changes applied together (see the module's phases)

# what each change of a group does (``how``; a draw's number >= 0 while prepared: the
# old key lies on the path that draw recorded)
_SKIP = -4  # a repeat (a later change of the slot in the group wins), or not pending
_SAME = -3  # the key does not change: only the raw priority and pending mark
_UNROUTED = -2  # no old key was routed (there was none, or it was the new one)
_MOVE = -1  # the key changes (its old one was routed)


@njit(cache=True, nogil=True, inline="always")
def _hash(table, s):  # pragma: no cover - compiled
    """Home bucket of slot ``s`` in ``table`` (pairs ``[slot, value]``; a power-of-two
    number of buckets, at least twice the entries, so probes stay short)."""
    return ((s * 0x9E3779B1) >> 7) & (table.shape[0] // 2 - 1)


@njit(cache=True, nogil=True, inline="always")
def _remember(table, s, k):  # pragma: no cover - compiled
    """Record ``k`` under slot ``s`` unless the slot is there already; True if it was not."""
    mask = table.shape[0] // 2 - 1
    h = _hash(table, s)
    while table[2 * h] >= 0:
        if table[2 * h] == s:
            return False
        h = (h + 1) & mask
    table[2 * h] = s
    table[2 * h + 1] = k
    return True


@njit(cache=True, nogil=True, inline="always")
def _lookup(table, s):  # pragma: no cover - compiled
    """The value recorded under slot ``s``, or -1."""
    mask = table.shape[0] // 2 - 1
    h = _hash(table, s)
    while table[2 * h] >= 0:
        if table[2 * h] == s:
            return table[2 * h + 1]
        h = (h + 1) & mask
    return -1


@njit(cache=True, nogil=True, inline="always")
def _drawn(sample, stab, spaths, s, q):  # pragma: no cover - compiled
    """The last draw whose record (``spaths``, see
    :data:`~fastper._kernels.rank_tree.DRAW`) holds slot ``s``, or -1.

    ``q``: the output position the update's entry had in the draw's batch
    (-1: not known). An update usually gives back the batch as drawn, so the
    draw behind output ``q`` is tried first: one compare. Otherwise the hash
    table ``stab`` of the draws' slots is searched; it is built here the first
    time it is needed after a draw (``sample[2]`` says it is), in O(B).
    """
    b = sample[0]
    if 0 <= q < b:
        d = spaths[q * MAXH + DRAW]
        if 0 <= d < b and spaths[d * MAXH + SLOT] == s:
            return d
    if sample[2] == 0:
        for j in range(stab.shape[0]):
            stab[j] = -1
        for d in range(b):
            _remember(stab, spaths[d * MAXH + SLOT], d)
        sample[2] = 1
    return _lookup(stab, s)


@njit(cache=True, nogil=True, inline="always")
def _prepare(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p, from_raw, j0, j1,
    paths, how, seen, sample, stab, spaths, positional,
):  # fmt: skip  # pragma: no cover - compiled
    """Phases 1 to 3 of the changes ``j0 .. j1-1``: reads the tree and prefetches
    (it writes only scratch, and the table of the last draw's slots that
    :func:`_drawn` may build).
    ``positional``: change ``j`` was output ``j`` of the last draw, if it
    holds the same slot (:func:`_drawn`).

    ``how[jj]`` (for change ``j0 + jj``) becomes :data:`_SKIP` for a repeat
    of a slot later in the group, else the draw whose recorded path reaches
    the slot's key, or :data:`_MOVE` (-1) if none does. ``paths[2 * MAXH *
    jj ..]``: the new key's routed path, then the old key's (routed for the
    key the slot has now; :func:`_apply_group` checks it still is). ``seen``
    (``4 * WARM`` int64): the group's slots.
    """
    w = j1 - j0
    for i in range(seen.shape[0]):
        seen[i] = -1
    # 1. the last change of each slot wins; fetch the slots' entries
    for j in range(j1 - 1, j0 - 1, -1):
        s = slots[j]
        if _remember(seen, s, j):
            how[j - j0] = _MOVE
            prefetch_w(ranked, s)
            prefetch_w(raw, s)
            if from_raw or meta[PCOUNT] > 0:
                prefetch_w(pending, s)
        else:
            how[j - j0] = _SKIP
    # 2. the old keys on a path the last draw recorded (checked, unless nothing split
    # since the draw)
    h = meta[HEIGHT]
    if sample[0] > 0:
        fresh = sample[1] == meta[VERSION]
        for jj in range(w):
            if how[jj] == _SKIP:
                continue
            j = j0 + jj
            k = _drawn(sample, stab, spaths, slots[j], j if positional else -1)
            if k >= 0:
                if fresh:
                    leaf = ich[spaths[k * MAXH + h - 1]]
                else:
                    leaf = _path_leaf(meta, ich, inn, spaths, k * MAXH)
                if leaf >= 0:
                    how[jj] = k
                    prefetch(lm, leaf)
                    pos = spaths[k * MAXH + MAXH - 1]
                    if 0 <= pos < L:
                        prefetch(ls, leaf * L + pos)
    # 3. route the new keys, and the other old keys, together, a level at a time
    root = meta[ROOT]
    for level in range(h):
        for jj in range(w):
            if how[jj] == _SKIP:
                continue
            s = slots[j0 + jj]
            v = raw[s] if from_raw else p[j0 + jj]
            off = 2 * MAXH * jj
            nd = root if level == 0 else ich[paths[off + level - 1]]
            q = nd * F + _route(ip, isl, nd, v, s)
            paths[off + level] = q
            _fetch(lp, ls, lm, ip, ic, ich, ich[q], h - 1 - level)
            old = ranked[s]
            if level == 0 and how[jj] == _MOVE and not (old >= 0.0 and old != v):
                how[jj] = _UNROUTED
            if how[jj] == _MOVE:
                off += MAXH
                nd = root if level == 0 else ich[paths[off + level - 1]]
                q = nd * F + _route(ip, isl, nd, old, s)
                paths[off + level] = q
                _fetch(lp, ls, lm, ip, ic, ich, ich[q], h - 1 - level)


@njit(cache=True, nogil=True, inline="always")
def _apply_group(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p, from_raw, j0, j1,
    paths, how, version, spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Phases 4 and 5 of the changes ``j0 .. j1-1`` prepared by :func:`_prepare`
    (when the routing was at ``version``); the pools must hold what ``j1 - j0``
    inserts take (:func:`_room`). Returns OK, or CORRUPT if an old key was not
    found.

    Whatever changed since the preparation (an earlier group) is checked:
    which keys change is decided now, a recorded or routed path is used only
    if it still leads to the key (:func:`_delete_path`, :func:`_insert_path`),
    else the key is routed again.
    """
    w = j1 - j0
    with_pending = from_raw or meta[PCOUNT] > 0
    check = meta[VERSION] != version  # a split since the preparation: paths are checked
    # 4. delete the old keys (nothing moves), then insert the new ones
    for jj in range(w):
        k = how[jj]
        if k == _SKIP:
            continue
        s = slots[j0 + jj]
        v = raw[s] if from_raw else p[j0 + jj]
        if from_raw and not pending[s]:
            how[jj] = _SKIP
            continue
        old = ranked[s]
        if old == v:
            how[jj] = _SAME
            continue
        if old >= 0.0:
            done = False
            if k >= 0:
                done = _delete_path(meta, lp, ls, lm, ic, ich, inn, spaths, k * MAXH, old, s,
                                    check)  # fmt: skip
            elif k == _MOVE:
                off = 2 * MAXH * jj + MAXH
                paths[off + MAXH - 1] = -1  # no position in the leaf: searched
                done = _delete_path(meta, lp, ls, lm, ic, ich, inn, paths, off, old, s, check)
            if not done and not _delete(meta, lp, ls, lm, ip, isl, ic, ich, inn, old, s):
                return CORRUPT
        how[jj] = _MOVE
    for jj in range(w):
        if how[jj] != _MOVE:
            continue
        s = slots[j0 + jj]
        v = raw[s] if from_raw else p[j0 + jj]
        changed = meta[VERSION] != version
        if not _insert_path(meta, lp, ls, lm, ip, isl, ic, ich, inn, paths, 2 * MAXH * jj, v,
                            s, changed):  # fmt: skip
            _insert(meta, lp, ls, lm, ip, isl, ic, ich, inn, v, s)
    # 5. the slots' entries
    for jj in range(w):
        if how[jj] == _SKIP:
            continue
        s = slots[j0 + jj]
        v = raw[s] if from_raw else p[j0 + jj]
        ranked[s] = v
        raw[s] = v
        if with_pending and pending[s]:
            pending[s] = False  # its stale list entry is skipped later
            meta[PCOUNT] -= 1
    return OK


@njit(cache=True, nogil=True, inline="always")
def _apply(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p, from_raw, paths,
    how, seen, sample, stab, spaths, positional,
):  # fmt: skip  # pragma: no cover - compiled
    """Every change of ``slots``, in groups of :data:`WARM`: while one group is
    applied, the next is already prepared (:func:`_prepare`), so that its
    cache misses have the whole group's work to arrive. ``positional``: as
    :func:`_prepare` takes it.

    Scratch, for two groups each: ``paths`` (``4 * WARM * MAXH`` int64),
    ``how`` (``2 * WARM``), ``seen`` (``8 * WARM``). Returns how many changes
    were done: all, or fewer when the pools ran out (:func:`compact`, then
    call again with the rest), or -1 if the tree was found corrupt.
    """
    b = slots.shape[0]
    half_p = paths.shape[0] // 2
    half_s = seen.shape[0] // 2
    j = 0
    buf = 0
    ready = -1  # the group prepared in ``buf``: its first change and size
    ready_w = 0
    version = 0
    while j < b:
        w = min(WARM, b - j)
        while w > 0 and not _room(meta, lp, inn, w):
            w >>= 1
        if w == 0:
            return j
        if ready != j or ready_w != w:
            _prepare(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p,
                     from_raw, j, j + w, paths[buf * half_p : (buf + 1) * half_p],
                     how[buf * WARM : (buf + 1) * WARM], seen[buf * half_s : (buf + 1) * half_s],
                     sample, stab, spaths, positional)  # fmt: skip
            version = meta[VERSION]
        nxt = j + w
        nw = min(w, b - nxt)
        o = 1 - buf
        if nw > 0:
            _prepare(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p,
                     from_raw, nxt, nxt + nw, paths[o * half_p : (o + 1) * half_p],
                     how[o * WARM : (o + 1) * WARM], seen[o * half_s : (o + 1) * half_s],
                     sample, stab, spaths, positional)  # fmt: skip
        nversion = meta[VERSION]
        code = _apply_group(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending,
                            slots, p, from_raw, j, nxt, paths[buf * half_p : (buf + 1) * half_p],
                            how[buf * WARM : (buf + 1) * WARM], version, spaths)  # fmt: skip
        if code != OK:
            return -1
        version = nversion
        buf = o
        ready = nxt
        ready_w = nw
        j = nxt
    return b


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


@njit(cache=True, nogil=True, inline="always")
def _defer(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, slots, p):
    # pragma: no cover - compiled
    """``write`` with ``defer``: see :func:`write`."""
    for k in range(slots.shape[0]):
        s = slots[k]
        v = p[k]
        if ranked[s] >= 0.0:
            if not pending[s]:
                if meta[PLEN] == plist.shape[0]:
                    _compact_pending(meta, pending, plist)
                pending[s] = True
                plist[meta[PLEN]] = s
                meta[PLEN] += 1
                meta[PCOUNT] += 1
        else:  # a slot new to the tree
            code = _change(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, s, v)
            if code != OK:
                return k if code == FULL else -1
            if pending[s]:
                pending[s] = False
                meta[PCOUNT] -= 1
        raw[s] = v
    return slots.shape[0]


@njit(**_HOT)
def write(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, slots, p, defer, paths,
    how, seen, sample, stab, spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Set ``raw[slots] = p`` in order (the last duplicate wins) and re-rank the slots.

    With ``defer``, a slot already in the tree keeps its key and is only
    marked pending (see :func:`apply_pending`); a slot not in the tree yet is
    always inserted now. Without, each slot is re-ranked now (a pending mark
    is dropped). O(B log N), amortised.

    Returns how many items were done: ``B``, or fewer when the pools ran out
    (item ``k`` untouched: :func:`compact`, then call again with the rest),
    or -1 if the tree was found corrupt. ``paths`` / ``how`` / ``seen``:
    scratch, and ``sample`` / ``stab`` / ``spaths``: the last draw's paths
    (see :func:`_prepare`).
    """
    return _write(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, slots,
                  p, defer, paths, how, seen, sample, stab, spaths, False)  # fmt: skip


@njit(cache=True, nogil=True, inline="always")
def _write(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, slots, p, defer, paths,
    how, seen, sample, stab, spaths, positional,
):  # fmt: skip  # pragma: no cover - compiled
    """:func:`write`; ``positional`` as :func:`_prepare` takes it."""
    if defer:
        return _defer(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist,
                      slots, p)  # fmt: skip
    return _apply(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots, p,
                  False, paths, how, seen, sample, stab, spaths, positional)  # fmt: skip


@njit(**_HOT)
def update(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, defer, paths, how,
    seen, sample, stab, spaths, indices, td, keys, use_keys, eps, clip, p_limit, size,
    key_base, added, capacity, out_idx, out_p, status, left,
):  # fmt: skip  # pragma: no cover - compiled
    """:func:`fastper._kernels.ring.td_priorities` then :func:`write`, in one call.

    The priorities kept (``status[2]`` of them) are in ``out_idx`` /
    ``out_p``; ``left[0]`` receives how many of them :func:`write` did not
    do: 0 when all were done, else the pools ran out (compact, then write
    the last ``left[0]``), or more than were kept if the tree was found
    corrupt. Returns the largest kept priority.
    """
    pmax = td_priorities(indices, td, keys, use_keys, eps, clip, p_limit, size, key_base,
                         added, capacity, out_idx, out_p, status)  # fmt: skip
    kept = status[2]
    left[0] = 0
    if status[0] == 0 and kept > 0:
        # nothing dropped: entry j is output j of the batch given back, if it was the
        # last draw's (most often it is: one compare finds its draw's path)
        positional = kept == indices.shape[0]
        done = _write(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist,
                      out_idx[:kept], out_p[:kept], defer, paths, how, seen, sample, stab,
                      spaths, positional)  # fmt: skip
        left[0] = kept - done
    return pmax


@njit(**_HOT)
def write_run(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, start, count, p
):  # pragma: no cover - compiled
    """New transitions: slots ``start .. start+count-1`` get priority ``p``, ranked now.

    Returns how many were done, as :func:`write` does.
    """
    for k in range(count):
        s = start + k
        code = _change(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, s, p)
        if code != OK:
            return k if code == FULL else -1
        if pending[s]:
            pending[s] = False
            meta[PCOUNT] -= 1
        raw[s] = p
    return count


@njit(**_HOT)
def remove(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, slots
):  # pragma: no cover - compiled
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
            if not _delete(meta, lp, ls, lm, ip, isl, ic, ich, inn, old, s):
                return -1
            ranked[s] = -1.0
            out += 1
        if pending[s]:
            pending[s] = False
            meta[PCOUNT] -= 1
        raw[s] = 0.0
    return out


@njit(**_HOT)
def apply_pending(
    meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending, plist, paths, how, seen,
    sample, stab, spaths,
):  # fmt: skip  # pragma: no cover - compiled
    """Re-rank every pending slot by its current raw priority. O(k log N), amortised.

    Returns 1 when done, 0 when the pools ran out (:func:`compact`, then call
    again: the slots done are no longer pending), -1 if the tree is corrupt.
    """
    done = _apply(meta, lp, ls, lm, ip, isl, ic, ich, inn, ranked, raw, pending,
                  plist[: meta[PLEN]], raw, True, paths, how, seen, sample, stab, spaths,
                  False)  # fmt: skip
    if done < 0:
        return -1
    if done < meta[PLEN]:
        return 0
    meta[PLEN] = 0
    meta[PCOUNT] = 0
    return 1
