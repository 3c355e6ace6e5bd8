"""The power in the IS weights, element by element as the compiled samplers take it (numba).

``x ** e`` on a numpy array may use a vectorised pow (numpy does on CPUs with
AVX-512) whose last bit differs from the C library's ``pow`` in a few percent
of cases; the compiled sampling kernels call ``pow`` per element. The shared
IS-weight rule (:func:`fastper.policy.is_weights`) takes numpy arrays through
this kernel, so every host front end computes the same bits on every CPU.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit


@njit(cache=True, nogil=True)
def power_into(base, exponent, out):  # pragma: no cover - compiled
    """``out[i] = base[i] ** exponent`` (float64), one ``pow`` per element. O(B)."""
    for i in range(base.shape[0]):
        out[i] = base[i] ** exponent


@njit(cache=True, nogil=True, error_model="numpy")
def is_weights_into(masses, total, min_mass, n, beta, norm, out):  # pragma: no cover - compiled
    """The IS weights of draws with these ``masses``, into ``out``, for the compiled samplers.

    :func:`fastper.policy.is_weights`'s expressions in its order (the same
    bits): ``norm`` 0 divides by the buffer-wide largest weight (``min_mass``:
    the smallest positive mass held), 1 by the batch's, 2 not at all
    (``(n * (mass / total)) ** -beta``). A division by zero (an underflowing
    law) gives inf or NaN, as numpy's does, rather than raising. O(B).
    """
    b = masses.shape[0]
    if norm == 0:
        for k in range(b):
            out[k] = (masses[k] / min_mass) ** (-beta)
    elif norm == 1:
        low = np.inf
        for k in range(b):
            if masses[k] < low:
                low = masses[k]
        for k in range(b):
            out[k] = (masses[k] / low) ** (-beta)
    else:
        for k in range(b):
            out[k] = (n * (masses[k] / total)) ** (-beta)
