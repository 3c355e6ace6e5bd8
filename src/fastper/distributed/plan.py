"""The arithmetic of one sample over several shards: pure numpy, no Ray.

A sample over K shards is drawn exactly as one buffer holding all their
transitions would draw it: the coordinator knows each shard's total mass
(``p_i ** alpha`` summed; 1 per transition for uniform replay), draws the
stratified points over the sum of the totals, and gives each shard the points
that fall in its share, as offsets into its own mass. Laid end to end in
shard order, the shards' sum trees are one sum tree, so the shard and the
slot found for a point are the ones a single tree over all leaves would find.

Under concurrent writes a shard's total may have moved between the
coordinator's view and the search. Then the shard rescales its points to its
current total (:meth:`fastper.PrioritizedReplayBuffer.sample_mass`), and the
probability of a draw is the one actually used::

    P(i) = (view_total[s] / view_sum) * mass_i / current_total[s]

which is ``mass_i / sum of all masses`` whenever nothing moved.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["ShardView", "Split", "combine_weights", "rendezvous", "split_points"]


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

    def draws_of(self, s: int) -> np.ndarray:
        """Positions (in draw order) of the draws that went to shard ``s``."""
        return np.flatnonzero(self.shard == s)


def split_points(u: np.ndarray, totals: np.ndarray, stratified: bool) -> Split:
    """Assign ``len(u)`` draws to shards by their totals. O(B log K).

    ``u`` are uniforms in [0, 1); stratified draw ``j`` lands in the ``j``-th
    of ``B`` equal slices of the summed mass (``(j + u_j) * sum / B``, the
    single buffer's formula), otherwise at ``u_j * sum``. A point goes to the
    first shard whose running total exceeds it (shards of zero mass get none),
    as a sum tree over all shards' leaves in shard order would send it.
    """
    totals = np.asarray(totals, dtype=np.float64)
    b = u.shape[0]
    cum = np.cumsum(totals)
    view_sum = float(cum[-1])
    if stratified:
        points = (np.arange(b, dtype=np.float64) + u) * view_sum / b
    else:
        points = u * view_sum
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

    Args:
        split: the draws' assignment.
        masses: each draw's mass (as found by its shard).
        current_totals: each shard's total when it searched (the view's for
            shards that got no draw).
        current_mins: each shard's smallest positive mass then.
        size: transitions over all shards (the N of ``(N P)^-beta``).
        beta: IS exponent.
        norm: ``"buffer"`` (divide by the largest weight over all shards: the
            smallest probability), ``"batch"`` or ``"none"``.
    """
    share = split.view_totals / split.view_sum  # each shard's share of the draws
    s = split.shard
    prob = share[s] * masses / current_totals[s]
    if norm == "buffer":
        with np.errstate(divide="ignore", invalid="ignore"):
            per_shard = np.where(current_totals > 0, share * current_mins / current_totals, np.inf)
        pmin = float(per_shard.min())
        weights = np.power(prob / pmin, -beta)
    elif norm == "batch":
        weights = np.power(prob / prob.min(), -beta)
    else:
        weights = np.power(size * prob, -beta)
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
