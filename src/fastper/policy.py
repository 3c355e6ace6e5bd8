"""The sampling rules every front end shares: stratified targets and IS weights.

One implementation of each rule, written with array operators only (``+``,
``*``, ``/``, ``**``, ``min``), so the same function serves numpy arrays (the
CPU buffer, the sharded coordinator) and torch tensors (the device buffer).
The compiled CPU kernel (:func:`fastper._kernels.prioritized.prop_sample`)
evaluates the same expressions in the same order, so that, given the same
uniforms, every front end returns bit-identical probabilities and weights
(``tests/unit/test_parity.py`` checks it).

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
"""

from __future__ import annotations

from typing import Any

#: weight normalisations, in the order of the kernels' codes
NORMS = ("buffer", "batch", "none")
NORM_CODES = {name: code for code, name in enumerate(NORMS)}


def stratified_targets(u: Any, total: Any, positions: Any | None) -> Any:
    """Points in ``[0, total]`` for uniforms ``u`` in [0, 1). O(B).

    Args:
        u: ``B`` uniforms (numpy array or torch tensor, float64).
        total: the mass the points fall in.
        positions: ``0, 1, ..., B-1`` as the same kind of array as ``u``
            (stratified draws), or ``None`` (independent draws).
    """
    b = u.shape[0]
    if positions is None:
        return u * total
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
    if norm == "buffer":
        return (masses / min_mass) ** (-beta)
    if norm == "batch":
        return (masses / masses.min()) ** (-beta)
    return (n * (masses / total)) ** (-beta)


def probabilities(masses: Any, total: Any) -> Any:
    """P(i) of draws with these masses: ``mass / total``. O(B)."""
    return masses / total
