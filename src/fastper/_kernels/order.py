"""The order of a shuffled batch, from uniforms (numba): :func:`fastper.policy.batch_order`."""

from __future__ import annotations

import numpy as np

from ._jit import njit


@njit(cache=True, nogil=True)
def batch_order(v, out):  # pragma: no cover - compiled
    """A random permutation of ``0 .. B-1`` into ``out`` (int64), from ``B`` uniforms ``v``
    in [0, 1). O(B).

    Fisher-Yates from the last position down: position ``i`` swaps with
    ``floor(v[i] * (i + 1))``, a uniform pick among ``0 .. i`` (``v[0]`` is not
    used). A 53-bit uniform picks each of at most ``2^24`` positions with a
    relative error of order ``2^-28`` (the product rounds too): far below what
    any number of batches can show. Several times cheaper than
    ``Generator.permutation``, which draws bounded integers one call at a time.
    """
    b = v.shape[0]
    for i in range(b):
        out[i] = i
    for i in range(b - 1, 0, -1):
        x = v[i] * (i + 1)
        # floor(x) for x in [0, i + 1); a value outside [0, 1) (NaN included) still
        # picks a position inside 0 .. i, so nothing is written outside ``out``
        j = np.int64(x) if x < i else i
        if j < 0:
            j = 0
        t = out[i]
        out[i] = out[j]
        out[j] = t


@njit(cache=True, nogil=True, inline="always")
def order_batch(u, perm, b, shuffle):  # pragma: no cover - compiled
    """The batch order of a compiled draw of ``b`` outputs: with ``shuffle``,
    :func:`batch_order` of ``u[b : 2b]`` into ``perm`` (``b`` int64); else ``perm``
    is read as given (``b`` positions, or empty: none).

    Raises ValueError if ``u`` or ``perm`` is shorter than that needs: numba
    reads past an array's end unchecked.
    """
    if u.shape[0] < (2 * b if shuffle else b) or (
        perm.shape[0] != b and (shuffle or perm.shape[0] != 0)
    ):
        raise ValueError("u or perm shorter than the batch")
    if shuffle:
        batch_order(u[b : 2 * b], perm)
