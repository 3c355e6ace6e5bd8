"""The power in the IS weights, element by element as the compiled samplers take it (numba).

``x ** e`` on a numpy array may use a vectorised pow (numpy does on CPUs with
AVX-512) whose last bit differs from the C library's ``pow`` in a few percent
of cases; the compiled sampling kernels call ``pow`` per element. The shared
IS-weight rule (:func:`fastper.policy.is_weights`) takes numpy arrays through
this kernel, so every host front end computes the same bits on every CPU.
"""

from __future__ import annotations

from ._jit import njit


@njit(cache=True, nogil=True)
def power_into(base, exponent, out):  # pragma: no cover - compiled
    """``out[i] = base[i] ** exponent`` (float64), one ``pow`` per element. O(B)."""
    for i in range(base.shape[0]):
        out[i] = base[i] ** exponent
