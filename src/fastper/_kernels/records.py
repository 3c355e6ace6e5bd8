"""The gather of sampled rows out of a records storage (numba only).

A records storage keeps every field of a slot side by side in one record
(:class:`fastper.storage.Storage`); a batch hands each field back as its own
C-contiguous array. :func:`gather_records` copies the fields of the drawn
records straight into one block per field, in one pass per field: numpy's
take of the records followed by one copy per field made two passes and an
array more per field: about 6.3 us for 256 CartPole-like rows of a buffer of
2^16 slots, where this kernel and the arrays' views take about 4.4 (a 2-core
AMD EPYC VM).
"""

from __future__ import annotations

from ._intrinsics import copy2, copy4, copy8
from ._jit import njit


@njit(cache=True, nogil=True, inline="always")
def _copy(out, t, rows, s, nb):  # pragma: no cover - compiled
    """``out[t : t + nb] = rows[s : s + nb]``: the common widths as whole words, any
    other in words of 8, 4, 2 and a byte.

    The common widths are not left to the loop below, which copies them too: with
    their widths known where they are compiled, a gather of 256 CartPole-like rows
    took 4.7 us, against 6.3 us with the loop alone (2-core AMD EPYC VM)."""
    if nb == 4:
        copy4(out, t, rows, s)
    elif nb == 8:
        copy8(out, t, rows, s)
    elif nb == 16:
        copy8(out, t, rows, s)
        copy8(out, t + 8, rows, s + 8)
    else:
        j = 0
        while j + 8 <= nb:
            copy8(out, t + j, rows, s + j)
            j += 8
        if j + 4 <= nb:
            copy4(out, t + j, rows, s + j)
            j += 4
        if j + 2 <= nb:
            copy2(out, t + j, rows, s + j)
            j += 2
        if j < nb:
            out[t + j] = rows[s + j]


@njit(cache=True, nogil=True, _nrt=False)
def gather_records(rows, row_bytes, capacity, idx, plan, out):  # pragma: no cover - compiled
    """Copy each field of records ``idx`` into its block of ``out``; False (nothing
    useful written) if an index is outside ``[0, capacity)``.

    ``rows`` (uint8) holds ``capacity`` records of ``row_bytes`` bytes each.
    ``plan`` (int64) holds three entries per field: its offset in a record, its
    bytes per row ``nb`` and the offset of its block in ``out`` (uint8), where
    row ``k``'s bytes go at ``block + k * nb``. O(B * fields).

    One pass per field, so that the branch on its width goes the same way for
    every row; each index is checked where it is read (another thread may
    change the array meanwhile).
    """
    b = idx.shape[0]
    for f in range(plan.shape[0] // 3):
        off = plan[3 * f]
        nb = plan[3 * f + 1]
        d = plan[3 * f + 2]
        for k in range(b):
            i = idx[k]
            if not 0 <= i < capacity:
                return False
            _copy(out, d + k * nb, rows, i * row_bytes + off, nb)
    return True
