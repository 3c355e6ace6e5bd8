"""Kernel for the n-step writer: per-stream window bookkeeping.

Each stream (environment, actor) keeps its pending steps in a ring of ``w``
window rows (``w = n - 1``, or less while no window has needed more: a huge
``n`` costs memory only for the steps actually pending). Stream row ``r`` owns
the flat window rows ``r * w .. r * w + w - 1``, and its ``c``-th row ever
(counting every row, dropped or not) sits at ring position ``c % w``. The
pending steps are always the stream's latest rows (a dropped row follows an
episode end, which empties the window), so a clock and a length locate them.
With ``n_envs`` every add is one row of each env: all clocks agree, and an
add's rows go to one ring position, a plain slice.

:func:`plan_batch` walks one batch in row order and says, without touching
that state, which transitions complete, where their first step comes from,
their returns and discounts, and what the touched streams' state becomes. The
caller moves the field data with numpy, so the kernel never sees observations.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit

# ``meta`` columns: rows seen (the clock), pending count, 1 if the stream's
# next row follows an episode end (autoreset next_step), scratch for the
# kernel (0 outside it)
CLOCK = 0
LENGTH = 1
SKIP = 2
LOC = 3
META_COLS = 4

# result flags: how the emitted transitions map onto the batch, for the
# caller's numpy fast paths
FIRST_ALL_WINDOW = 1  # every first step is a pending (window) row
FIRST_IS_BATCH = 2  # transition i starts at batch row i, for every row
LAST_IS_BATCH = 4  # transition i ends at batch row i, for every row
STORE_IS_BATCH = 8  # batch row i is stored (stays pending), for every row
TOUCHED_IS_RANGE = 16  # the touched streams are rows 0 .. U - 1, in order


@njit(cache=True, nogil=True)
def plan_batch(
    rows, term, trunc, meta, n, w_read, w_store, autoreset, rwin, rb, gpow, ibuf, rout, dout
):  # pragma: no cover - compiled
    """Plan one batch of ``k`` rows; O(k + m * L * R) for ``m`` transitions of
    at most ``L`` steps (``L <= n``) and rewards of ``R`` entries.

    Args:
        rows: (k,) int64 stream row of each batch row.
        term, trunc: (k,) bool termination / truncation of each row.
        meta: (S, META_COLS) int64 per-stream state, read only but for the
            ``LOC`` scratch column (0 on entry and on return). Rows of
            streams new in this batch are zero.
        n: window length; ``autoreset``: drop the row after an episode end.
        w_read, w_store: ring sizes of the windows read (``rwin`` and the
            first-step codes) and of those the stored rows go to (larger when
            the caller grows them with this batch); ``w_store`` must be at
            least every new pending length.
        rwin: (S * w_read, R) float64 pending rewards; ``rb``: (k, R) batch
            rewards.
        gpow: float64, ``gpow[j] = gamma ** j`` for every window length j
            that can occur (``j <= min(n, w_store + 1)``).
        ibuf: int64 output, ``2 * M + 6 * k`` entries for ``M = len(dout)``,
            an upper bound on the transitions completed: first-step codes (>=
            0: flat window row, < 0: ``-1 - batch row``), last-step batch
            rows, touched stream rows, their new meta rows (3 each), window
            rows to store into and the batch rows stored there.
        rout: (M, R) output returns (float64 sums cast to its dtype).
        dout: (M,) output discounts.

    Returns:
        (m transitions, U touched streams, s rows to store, rows dropped,
        change of the pending count, longest new window, flags).
    """
    k = rows.shape[0]
    nr = rb.shape[1]
    cap_out = dout.shape[0]
    o_last = cap_out
    o_urows = 2 * cap_out
    o_umeta = o_urows + k
    o_dst = o_umeta + 3 * k
    o_src = o_dst + k

    # scratch per touched stream: clock of virtual index 0, old pending count,
    # next virtual index, first pending virtual index, skip flag, its rows in
    # the batch, length and start of its ubat segment (one allocation: each
    # costs about as much as a short batch). Virtual index j of a stream:
    # j < old are its pending rows, later ones its batch rows; it is the
    # stream's row at clock hd + j.
    scratch = np.zeros(8 * k, np.int64)
    hd = scratch[:k]
    old = scratch[k : 2 * k]
    vend = scratch[2 * k : 3 * k]
    vstart = scratch[3 * k : 4 * k]
    sk = scratch[4 * k : 5 * k]
    rows_of = scratch[5 * k : 6 * k]
    q = scratch[6 * k : 7 * k]
    seg = scratch[7 * k :]
    n_u = 0
    for b in range(k):
        r = rows[b]
        if meta[r, LOC] != 0:
            rows_of[meta[r, LOC] - 1] += 1
        else:
            rows_of[n_u] = 1
            meta[r, LOC] = n_u + 1
            ibuf[o_urows + n_u] = r
            hd[n_u] = meta[r, CLOCK] - meta[r, LENGTH]
            old[n_u] = meta[r, LENGTH]
            vend[n_u] = meta[r, LENGTH]
            sk[n_u] = meta[r, SKIP]
            n_u += 1
    # batch row of virtual index j of stream u: ubat[seg[u] + j % q[u]], where
    # q[u] = min(n, old + its rows) bounds the indices live at once
    total = 0
    for u in range(n_u):
        q[u] = min(n, old[u] + rows_of[u])
        seg[u] = total
        total += q[u]
    ubat = np.empty(total, np.int64)

    m = 0
    dropped = 0
    first_window = True
    first_batch = True
    last_batch = True
    for b in range(k):
        r = rows[b]
        u = meta[r, LOC] - 1
        if autoreset and sk[u]:
            sk[u] = 0
            dropped += 1
            hd[u] += 1  # the window is empty: later virtual indices move on a row
            first_batch = False
            last_batch = False
            continue
        e = vend[u]
        ubat[seg[u] + e % q[u]] = b
        vend[u] = e + 1
        j0 = vstart[u]
        if term[b] or trunc[b]:
            vstart[u] = e + 1  # flush: every pending transition ends here
            if autoreset:
                sk[u] = 1
        elif e + 1 - j0 == n:
            vstart[u] = j0 + 1  # the oldest window is complete
        else:
            continue
        for j in range(j0, vstart[u]):
            mm = vend[u] - j
            if j < old[u]:
                ibuf[m] = r * w_read + (hd[u] + j) % w_read
                first_batch = False
            else:
                fb = ubat[seg[u] + j % q[u]]
                ibuf[m] = -1 - fb
                first_window = False
                if fb != m:
                    first_batch = False
            ibuf[o_last + m] = b
            if b != m:
                last_batch = False
            # summed in the order of the definition, in float64
            for c in range(nr):
                acc = 0.0
                for i in range(mm):
                    jj = j + i
                    if jj < old[u]:
                        x = rwin[r * w_read + (hd[u] + jj) % w_read, c]
                    else:
                        x = rb[ubat[seg[u] + jj % q[u]], c]
                    acc += gpow[i] * x
                rout[m, c] = acc
            dout[m] = 0.0 if term[b] else gpow[mm]
            m += 1

    n_store = 0
    delta = 0
    longest = 0
    store_batch = True
    touched_range = True
    for u in range(n_u):
        r = ibuf[o_urows + u]
        if r != u:
            touched_range = False
        a = vstart[u]
        z = vend[u]
        ibuf[o_umeta + 3 * u + CLOCK] = hd[u] + z
        ibuf[o_umeta + 3 * u + LENGTH] = z - a
        ibuf[o_umeta + 3 * u + SKIP] = sk[u]
        delta += (z - a) - old[u]
        longest = max(longest, z - a)
        for j in range(max(a, old[u]), z):
            fb = ubat[seg[u] + j % q[u]]
            ibuf[o_dst + n_store] = r * w_store + (hd[u] + j) % w_store
            ibuf[o_src + n_store] = fb
            if fb != n_store:
                store_batch = False
            n_store += 1
        meta[r, LOC] = 0
    flags = 0
    if m > 0 and first_window:
        flags |= FIRST_ALL_WINDOW
    if m == k and first_batch:
        flags |= FIRST_IS_BATCH
    if m == k and last_batch:
        flags |= LAST_IS_BATCH
    if n_store == k and store_batch:
        flags |= STORE_IS_BATCH
    if touched_range:
        flags |= TOUCHED_IS_RANGE
    return m, n_u, n_store, dropped, delta, longest, flags


@njit(cache=True, nogil=True)
def lockstep(meta, k, n, w, term, trunc, rb, rwin, gpow, check, out, disc_out, disc, start):  # pragma: no cover - compiled
    """A vector step of ``k`` envs (stream row i = env i) in the steady state:
    planned, its returns stored and its rewards committed to the windows.

    The steady state: every env at one pending length, no autoreset skip, no
    episode end in the step (``term``, ``trunc``: (k,) flags, any nonzero
    entry an end), and, with ``check``, every reward ``rb[i]`` finite. Then
    either no window completes (code 0: the length grows by one, within the
    ring of ``w`` rows) or every env's does (code 1: the returns, summed as
    :func:`plan_batch` sums them, the same bits, go to ``out[start + i]``
    and the discount ``disc`` to ``disc_out[start + i]``, i < k: columns of
    the storage; the caller stores the other fields). Either way
    the step's rewards go to the windows' ring row ``clock % w`` and every
    env's clock (and, while the windows fill, pending length) moves on.
    Code -1, changing nothing, for anything else (the caller takes
    :func:`plan_batch`). Returns ``(code, clock, length)``: the envs' clock
    and pending length before the step. ``rwin``: (S * w, 1) float64
    pending rewards; ``gpow`` as in :func:`plan_batch`. O(k n).
    """
    length = meta[0, LENGTH]
    clock = meta[0, CLOCK]  # every env's: one step each per add
    for i in range(k):
        if meta[i, LENGTH] != length or meta[i, SKIP] != 0 or term[i] != 0 or trunc[i] != 0:
            return -1, clock, length
        if check and not np.isfinite(rb[i]):
            return -1, clock, length
    at = clock % w  # this step's ring row: the oldest pending step's when full
    if length + 1 < n:
        if length + 1 > w:
            return -1, clock, length
        for i in range(k):
            rwin[i * w + at, 0] = rb[i]
            meta[i, CLOCK] = clock + 1
            meta[i, LENGTH] = length + 1
        return 0, clock, length
    for i in range(k):
        acc = 0.0
        for j in range(w):
            acc += gpow[j] * rwin[i * w + (at + j) % w, 0]
        acc += gpow[w] * rb[i]
        out[start + i] = acc
        disc_out[start + i] = disc
        rwin[i * w + at, 0] = rb[i]
        meta[i, CLOCK] = clock + 1
    return 1, clock, length
