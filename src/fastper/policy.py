"""The sampling rules every front end shares: stratified targets, IS weights, batch order.

One implementation of each rule, written with array operators only (``+``,
``*``, ``/``, ``**``, ``min``), so the same function serves numpy arrays (the
CPU buffer, the sharded coordinator) and torch tensors (the device buffer).
The compiled CPU samplers (proportional and rank-based) take their weights
from :func:`fastper._kernels.weights.is_weights_into`, which evaluates the
same expressions in the same order, so that, given the same
uniforms, every front end returns bit-identical probabilities and weights
(``tests/unit/test_parity.py`` checks it). The one exception to "operators
only": the power of a numpy array is taken element by element with the C
library's ``pow``, as the kernel takes it (:mod:`fastper._kernels.weights`),
since numpy's vectorised ``**`` rounds differently in the last bit on some
CPUs.

The rules:

* **Stratified targets.** Draw ``k`` of ``B`` lands at
  ``(k + u_k) * (total / B)``: the ``k``-th of ``B`` equal slices of the mass.
  Independent draws land at ``u_k * total``.
* **Probabilities** are ``mass / total``, where a slot's mass is
  ``p_i ** alpha`` (proportional), ``1`` (uniform) or its rank weight.
* **IS weights** ``w_i = (N P(i)) ** -beta``, normalised by the largest
  weight of the whole buffer (``"buffer"``: that of the smallest positive
  mass), of the batch (``"batch"``), or not at all (``"none"``). Ratios are
  taken between masses, not probabilities: ``P(i) / P(min) = m_i / m_min``
  exactly, where dividing both by the total first would round twice.
* **Batch order.** A shuffled batch of ``B`` draws takes ``2B`` uniforms from
  the generator: the targets' ``B``, then ``B`` that order the batch
  (:func:`batch_order`). The device buffer orders its batches with its own
  generator (``torch.randperm``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernels import order as _order
from ._kernels import weights as _weights

#: weight normalisations, in the order of the kernels' codes
NORMS = ("buffer", "batch", "none")
NORM_CODES = {name: code for code, name in enumerate(NORMS)}


def batch_order(v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The order of a shuffled batch: a random permutation of ``0 .. B-1`` (int64) from
    ``B`` uniforms ``v`` in [0, 1) (float64), into ``out`` if given. O(B).

    Entry ``k`` of a shuffled batch is draw ``order[k]`` of the batch in stratum
    order. Fisher-Yates, position ``i`` swapping with ``floor(v[i] * (i + 1))``.
    """
    if not (isinstance(v, np.ndarray) and v.dtype == np.float64 and v.ndim == 1):
        raise TypeError(f"`v` must be a 1-D float64 array of uniforms, got {v!r:.80}")
    if out is None:
        out = np.empty(v.shape[0], dtype=np.int64)
    elif not (
        isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == v.shape
        and out.flags.writeable
    ):  # fmt: skip
        raise TypeError(
            f"`out` must be a writable int64 array of shape {v.shape} (one entry per "
            f"uniform), got {out!r:.80}"
        )
    _order.batch_order(v, out)
    return out


def stratified_targets(u: Any, total: Any, positions: Any | None, scaled: bool = False) -> Any:
    """Points in ``[0, total]`` for uniforms ``u`` in [0, 1). O(B).

    Args:
        u: ``B`` uniforms (numpy array or torch tensor, float64).
        total: the mass the points fall in.
        positions: ``0, 1, ..., B-1`` as the same kind of array as ``u``
            (stratified draws), or ``None`` (independent draws).
        scaled: ``positions`` hold ``k / B`` for a power-of-two ``B``: the
            points are then ``(k / B + u / B) * total``, the same numbers
            (dividing by a power of two is exact, so both round the same real
            number, for totals above ``2^-1014 * B``) in one operation less.
    """
    b = u.shape[0]
    if positions is None:
        return u * total
    if scaled:
        add = getattr(positions, "add", None)  # torch: one fused operation
        x = add(u, alpha=1.0 / b) if add is not None else positions + u / b
        return x * total
    out = positions + u  # a new array (or tensor): the in-place step below touches only it
    out *= total / b
    return out


def is_weights(masses: Any, total: Any, min_mass: Any, n: int, beta: float, norm: str) -> Any:
    """IS weights of draws with these ``masses``. O(B).

    Args:
        masses: each draw's sampling mass (numpy array or torch tensor, float64).
        total: the whole mass the draws were made from.
        min_mass: the smallest positive mass held (only read for ``"buffer"``).
        n: the number of slots that can be drawn (the N of ``(N P)^-beta``).
        beta: IS exponent, >= 0.
        norm: ``"buffer"``, ``"batch"`` or ``"none"``.
    """
    return weights_from_base(weight_base(masses, total, min_mass, n, norm), beta)


def weight_base(masses: Any, total: Any, min_mass: Any, n: int, norm: str) -> Any:
    """What the IS weights raise to ``-beta``: ``N P(i)`` over its normaliser. O(B).

    Arguments as :func:`is_weights`; the device buffer raises it to the power
    apart (outside a captured CUDA graph), with :func:`weights_from_base`.
    """
    if norm == "buffer":
        return masses / min_mass
    if norm == "batch":
        return masses / masses.min()
    return n * (masses / total)


def weights_from_base(base: Any, beta: float) -> Any:
    """IS weights from :func:`weight_base`: its power ``-beta``. O(B)."""
    return _power(base, -beta)


def _power(base: Any, exponent: float) -> Any:
    """``base ** exponent``; a numpy array's by the C library's ``pow`` (see the module)."""
    if isinstance(base, np.ndarray) and base.ndim == 1 and base.dtype == np.float64:
        out = np.empty_like(base)
        _weights.power_into(base, float(exponent), out)
        return out
    return base ** exponent


def probabilities(masses: Any, total: Any) -> Any:
    """P(i) of draws with these masses: ``mass / total``. O(B)."""
    return masses / total
