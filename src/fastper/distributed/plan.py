"""The arithmetic of one sample over several shards: pure numpy, no Ray.

A sample over K shards is drawn exactly as one buffer holding all their
transitions would draw it: the coordinator knows each shard's total mass
(``p_i ** alpha`` summed; 1 per transition for uniform replay), draws the
stratified points over the sum of the totals, and gives each shard the points
that fall in its share, as offsets into its own mass. Laid end to end in
shard order, the shards' sum trees are one sum tree, so the shard and the
slot found for a point are the ones a single tree over all leaves would find.
The rules are :mod:`fastper.policy`'s, the ones every buffer uses:
:func:`~fastper.policy.stratified_targets` for the points,
:func:`~fastper.policy.probabilities` and :func:`~fastper.policy.is_weights`
for what comes back.

Under concurrent writes a shard's total may have moved between the
coordinator's view ``T_s`` and the search. Then the shard rescales its points
to its current total ``C_s`` (:meth:`fastper.PrioritizedReplayBuffer.sample_mass`),
and a draw's mass *in the split's units* is ``g_i = m_i * T_s / C_s``; the
probability of a draw is the one actually used::

    P(i) = g_i / T = (T_s / T) * m_i / C_s        (T = sum of the view totals)

When the view of the draw's shard is current (``T_s == C_s``) the draw's mass
is its own mass ``m_i``, unscaled, so with one shard and an up-to-date view
the probabilities and weights are bit-identical to one buffer's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..policy import is_weights, probabilities, stratified_targets

__all__ = [
    "ShardView", "Split", "combine_weights", "draw_masses", "global_masses", "group_by_shard",
    "rendezvous",
    "split_points",
]  # fmt: skip


@dataclass
class ShardView:
    """What the coordinator last heard from one shard (every reply carries it)."""

    total: float
    min_mass: float
    size: int
    added: int


@dataclass
class Split:
    """Points of one sample, assigned to shards.

    Attributes:
        shard: the shard of each draw (int64, in draw order).
        local: each draw's offset into its shard's mass (float64).
        view_totals: the shard totals the points were drawn against.
        view_sum: their sum.
    """

    shard: np.ndarray
    local: np.ndarray
    view_totals: np.ndarray
    view_sum: float


def group_by_shard(shard: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries grouped by shard, keeping their order within each: ``(order, bounds)``.

    Shard ``s``'s entries are ``order[bounds[s]:bounds[s + 1]]``, in the order
    given (a stable sort, skipped when one shard has them all). O(B log B + K).
    """
    counts = np.bincount(shard, minlength=k)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    if int(np.count_nonzero(counts)) > 1:
        return np.argsort(shard, kind="stable"), bounds
    return np.arange(shard.shape[0], dtype=np.int64), bounds


def split_points(u: np.ndarray, totals: np.ndarray, stratified: bool) -> Split:
    """Assign ``len(u)`` draws to shards by their totals. O(B log K).

    ``u`` are uniforms in [0, 1), one batch (``(B,)``) or ``M`` batches drawn
    over the same views (``(M, B)``: each batch its own strata, the draws
    end to end in the result); the points are
    :func:`fastper.policy.stratified_targets` over the summed mass (stratified
    draw ``j`` at ``(j + u_j) * sum / B``, the single buffer's formula;
    otherwise ``u_j * sum``). A point goes to the first shard whose running
    total exceeds it (shards of zero mass get none), as a sum tree over all
    shards' leaves in shard order would send it.
    """
    totals = np.asarray(totals, dtype=np.float64)
    cum = np.cumsum(totals)
    view_sum = float(cum[-1])
    if u.ndim == 2:  # several batches over the same views, each its own strata, end to end
        b = u.shape[1]
        positions = np.arange(b, dtype=np.float64)[:, None] if stratified else None
        points = np.ascontiguousarray(stratified_targets(u.T, view_sum, positions).T).ravel()
    else:
        positions = np.arange(u.shape[0], dtype=np.float64) if stratified else None
        points = stratified_targets(u, view_sum, positions)
    shard = np.searchsorted(cum, points, side="right")
    # a point at (or rounded onto) the sum: the last shard with mass, as the tree does
    last = int(np.flatnonzero(totals > 0.0)[-1])
    over = shard > last
    shard[over] = last
    while True:  # a point on the boundary of an empty shard moves to the next with mass
        empty = totals[shard] <= 0.0
        if not empty.any():
            break
        shard[empty] += 1
        shard[shard > last] = last
    start = cum[shard] - totals[shard]
    local = np.clip(points - start, 0.0, totals[shard])
    return Split(shard.astype(np.int64), local, totals.copy(), view_sum)


def global_masses(
    split: Split, masses: np.ndarray, current_totals: np.ndarray, current_mins: np.ndarray
) -> tuple[np.ndarray, float]:
    """Each draw's mass in the split's units, and the smallest such mass. O(B + K).

    See :func:`draw_masses`; ``split`` gives each draw's shard and the view totals.
    """
    return draw_masses(split.shard, masses, split.view_totals, current_totals, current_mins)


def draw_masses(
    shard: np.ndarray,
    masses: np.ndarray,
    view_totals: np.ndarray,
    current_totals: np.ndarray,
    current_mins: np.ndarray,
) -> tuple[np.ndarray, float]:
    """Each draw's mass in the split's units, and the smallest such mass. O(B + K).

    A draw from shard ``s`` with mass ``m`` has mass ``m * T_s / C_s`` in the
    split's units (``T_s`` the view total it was drawn against, ``C_s`` the
    shard's total when it searched); exactly ``m`` where ``T_s == C_s`` (the
    factor is then exactly 1). The smallest is taken over the shards the
    split could draw from (``T_s > 0``) that still hold mass, each shard's
    smallest positive mass scaled alike (``inf`` when there is none); a NaN
    minimum (a shard that keeps none) comes out as NaN. ``shard`` and
    ``masses`` may hold the draws of several batches drawn over the same views.
    """
    vt = np.asarray(view_totals, dtype=np.float64)
    ct = np.asarray(current_totals, dtype=np.float64)
    mins = np.asarray(current_mins, dtype=np.float64)
    drawable = (vt > 0.0) & (ct > 0.0)
    scale = np.ones_like(vt)
    np.divide(vt, ct, out=scale, where=drawable & (ct != vt))
    g = masses * scale[shard]
    if not drawable.any():
        return g, float("inf")
    return g, float((mins * scale)[drawable].min())


def combine_weights(
    split: Split,
    masses: np.ndarray,
    current_totals: np.ndarray,
    current_mins: np.ndarray,
    size: int,
    beta: float,
    norm: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities actually used and IS weights of the draws. O(B + K).

    :func:`fastper.policy.probabilities` and :func:`fastper.policy.is_weights`
    of the draws' masses in the split's units (:func:`global_masses`) over the
    split's total: ratios of masses, as one buffer takes them.

    Args:
        split: the draws' assignment.
        masses: each draw's mass (as found by its shard).
        current_totals: each shard's total when it searched (or reported its
            view in the same round trip, for shards that got no draw).
        current_mins: each shard's smallest positive mass then.
        size: transitions over all shards (the N of ``(N P)^-beta``).
        beta: IS exponent.
        norm: ``"buffer"`` (divide by the largest weight over all shards: the
            smallest mass), ``"batch"`` or ``"none"``.
    """
    if norm == "buffer":
        g, g_min = global_masses(split, masses, current_totals, current_mins)
    else:  # the minimum is not read: shards need not keep it
        g, _ = global_masses(split, masses, current_totals, np.ones_like(split.view_totals))
        g_min = 1.0
    prob = probabilities(g, split.view_sum)
    weights = is_weights(g, split.view_sum, g_min, size, beta, norm)
    return prob, weights


def rendezvous(key: object, shards: list[int]) -> int:
    """The shard ``key`` goes to by rendezvous (highest random weight) hashing.

    Each (key, shard) pair gets a score from a keyed BLAKE2b hash (the same on
    every process and machine, unlike Python's salted ``hash``); the highest
    wins. Removing a shard moves only the keys it held. O(K).
    """
    if not shards:
        raise ValueError("`shards` must not be empty: no shard is left to place data on")
    text = repr(key).encode()
    best, best_score = shards[0], -1
    for s in shards:
        score = int.from_bytes(
            hashlib.blake2b(text, digest_size=8, key=str(int(s)).encode()).digest(), "little"
        )
        if score > best_score:
            best, best_score = s, score
    return best
