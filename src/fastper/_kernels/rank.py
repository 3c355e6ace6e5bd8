"""Kernels for the rank-based buffer.

The buffer keeps ``order``: the stored slots sorted by priority, largest
first, ties broken by the smaller slot index. Changed slots are not re-inserted
one by one (O(N) each); they are marked and merged back in one linear pass.
"""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True, inline="always")
def _before(prio, a, b):  # pragma: no cover - compiled
    pa = prio[a]
    pb = prio[b]
    return pa > pb or (pa == pb and a < b)


@njit(cache=True, nogil=True)
def merge_order(order, m_old, changed, prio, sorted_changed, out):  # pragma: no cover - compiled
    """Merge ``sorted_changed`` into ``order[:m_old]`` minus the changed slots.

    ``changed`` is a boolean mask over slots; ``sorted_changed`` lists the
    changed slots already in final order. Writes the new order into ``out``
    and returns its length.
    """
    n_out = 0
    j = 0
    n_new = sorted_changed.shape[0]
    for k in range(m_old):
        s = order[k]
        if changed[s]:
            continue
        while j < n_new and _before(prio, sorted_changed[j], s):
            out[n_out] = sorted_changed[j]
            n_out += 1
            j += 1
        out[n_out] = s
        n_out += 1
    while j < n_new:
        out[n_out] = sorted_changed[j]
        n_out += 1
        j += 1
    return n_out


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
