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
