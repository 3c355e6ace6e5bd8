"""Sampling schemes: uniform, proportional and rank-based.

A sampler owns the raw priorities ``p_i`` of every slot and whatever index it
needs to draw from them (nothing for uniform, a :class:`~fastper.SumTree` that
also keeps the smallest positive leaf for proportional, a rank structure for
rank-based). It never draws randomness: the buffer hands it uniforms in
``[0, 1)`` from its own ``numpy.random.Generator``, so samplers are
deterministic functions of their state and those uniforms.

Common contract (the buffer holds its lock around every call):
    ``write(slots, p, new=False)``: set raw priorities (last duplicate wins).
    O(B log N). ``new``: the slots were just written by ``add``.
    ``write_run(start, count, p)``: new slots ``start..start+count-1``, one priority.
    ``update_from_td(...)``: validate an update, drop stale entries, write the rest.
    ``sample(u, n, beta, stratified, norm, key_base, added)``: indices, P(i),
    IS weights and the key of each sampled slot's occupant (:func:`slot_keys`).
    ``sample_permuted(u, perm, n, ..., rows=, row_bytes=, shuffle=)`` (optional;
    the proportional sampler): ``sample``'s outputs indexed by ``perm`` (or, with
    ``shuffle``, by the batch order of ``B`` more uniforms after the ``B`` of
    ``u``), made in that order by one call, which also prefetches the drawn rows
    of a records storage.
    ``set_alpha(alpha, n)``: re-weight every stored priority exactly. O(N).
    ``state_dict(n)`` / ``load_state_dict(state, n)``: the checkpointed state.
    ``reset_priorities(p, n)``: take these priorities and rebuild. O(N log N).

IS weights ``w_i = (N P(i))^-beta`` are normalised by (``norm``) 0: the
largest weight in the whole buffer, 1: the largest in the batch, 2: nothing.

The base class and the shared helpers live in :mod:`fastper.sampler_base`,
the rank-based sampler in :mod:`fastper.rank_sampler`; all are importable
from here.
"""

from __future__ import annotations

import math

import numpy as np

from . import policy as _policy
from ._kernels import prioritized as _pk
from ._kernels import tree as _tk
from .errors import ZeroPriorityError
from .rank_sampler import RankSampler
from .sampler_base import (
    NO_PERM,
    NO_ROWS,
    NORM_CODES,
    PermutedSampler,
    PriorityMax,
    Sampler,
    check_priority_array,
    copy_priorities,
    new_priorities,
    slot_keys,
)
from .trees import SumTree

__all__ = [
    "NORM_CODES",
    "NO_PERM",
    "NO_ROWS",
    "PriorityMax",
    "ProportionalSampler",
    "RankSampler",
    "Sampler",
    "UniformSampler",
    "check_priority_array",
    "copy_priorities",
    "new_priorities",
    "slot_keys",
]


class UniformSampler(Sampler):
    """P(i) = 1/N over the valid slots; every weight is 1. Priorities are kept but not used.

    While every stored slot is valid, the index is implicit (slot ``floor(t)``
    under point ``t``). Once a slot is invalidated, a count tree (a
    :class:`~fastper.SumTree` of 1 per valid slot) holds the mass: writes then
    cost O(log N) more, until no invalid slot is left.
    """

    kind = "uniform"

    def __init__(self, capacity: int, alpha: float, raw_leaves: np.ndarray | None = None) -> None:
        super().__init__(capacity, alpha, raw_leaves)
        self.count: SumTree | None = None
        self._unit = np.ones(0)

    def _ones(self, k: int) -> np.ndarray:
        if self._unit.shape[0] < k:
            self._unit = np.ones(k)
        return self._unit[:k]

    def write(self, slots: np.ndarray, p: np.ndarray, new: bool = False) -> None:
        _tk.write_leaves(self.raw, slots, p)
        if new and self.count is not None:
            self.count.set(slots, self._ones(slots.shape[0]))

    def invalidate(self, slots: np.ndarray, n: int) -> None:
        if self.count is None:
            self.count = SumTree(self.capacity)
            self.count.set(np.arange(n, dtype=np.int64), self._ones(n))
        zeros = np.zeros(slots.shape[0])
        self.count.set(slots, zeros)
        # an invalid slot holds no priority, as under the other schemes (the
        # "current" max-priority policy's max counts only what is held)
        _tk.write_leaves(self.raw, slots, zeros)

    def all_valid(self) -> None:
        """No slot is invalid any more: drop the count tree. O(1)."""
        self.count = None

    def clear(self) -> None:
        super().clear()
        self.count = None

    def reset_priorities(self, p: np.ndarray, n: int) -> None:
        super().reset_priorities(p, n)
        self.count = None  # every slot valid; the buffer invalidates again what is not

    def _find(self, targets: np.ndarray, n: int) -> np.ndarray:
        if self.count is None:
            return np.minimum(targets.astype(np.int64), n - 1)
        return self.count.find(targets)

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        b = u.shape[0]
        positions = np.arange(b, dtype=np.float64) if stratified else None
        idx = self._find(_policy.stratified_targets(u, float(n), positions), n)
        prob = np.full(b, 1.0 / n)
        keys = slot_keys(idx, key_base, added, self.capacity)
        return idx, prob, np.ones(b, dtype=np.float64), keys

    def mass_find(self, targets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self._find(targets, n)  # unit mass per valid slot
        return idx, np.ones(idx.shape[0], dtype=np.float64)

    def mass_stats(self, n: int) -> tuple[float, float]:
        return float(n), (1.0 if n else math.inf)


class ProportionalSampler(PermutedSampler):
    """P(i) = p_i^alpha / sum_k p_k^alpha, from a :class:`~fastper.SumTree`.

    The tree holds ``p_i ** alpha`` and, with ``track_min``, the smallest
    positive leaf (internal nodes only, about 1/7 of a float64 per slot) for
    buffer-wide weight normalisation; without it every priority write skips
    half of the path updates. The kernels of :mod:`fastper._kernels.prioritized`
    update raw priorities and the tree in one compiled call.
    """

    kind = "proportional"

    def __init__(
        self, capacity: int, alpha: float, track_min: bool = True,
        raw_leaves: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        super().__init__(capacity, alpha, raw_leaves)
        self.track_min = bool(track_min)
        self.tree = SumTree(capacity, track_min=self.track_min)
        self.leaves, self.sinner, self.minner, self.offs, self.depth = self.tree.kernel_arrays()
        n_leaves = self.leaves.shape[0]
        self.log_limit = math.log(float(np.finfo(np.float64).max / (2 * n_leaves)))
        self._root = int(self.offs[self.depth])  # the root's position in ``sinner``
        self._scratch = np.empty(1024, dtype=np.int64)  # kernels' int64 work space
        self._pscratch = np.empty(512, dtype=np.float64)  # priorities of an update

    def keep_max(self, tree: PriorityMax) -> None:
        """Keep ``tree`` (a max tree over this sampler's raw priorities, laid out
        as its sum tree) up to date in the writes' own compiled calls:
        :meth:`write`, :meth:`update_from_td` and :meth:`write_run`."""
        if (
            tree.leaves is self.raw_leaves
            and tree.depth == self.depth
            and np.array_equal(tree.offs, self.offs)
        ):
            self.max_tree = tree

    def write(self, slots: np.ndarray, p: np.ndarray, new: bool = False) -> None:
        if self._scratch.shape[0] < slots.shape[0]:
            self._scratch = np.empty(slots.shape[0], dtype=np.int64)
        if self.max_tree is None:
            _pk.prop_write(
                self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                slots, p, self.alpha, self._scratch, self.track_min,
            )  # fmt: skip
        else:
            _pk.prop_write_max(
                self.raw_leaves, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                slots, p, self.alpha, self._scratch, self.track_min, self.max_tree.inner,
            )  # fmt: skip

    def update_from_td(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, size: int, key_base: int, added: int, status: np.ndarray,
    ) -> float:  # fmt: skip
        b = idx.shape[0]
        if self._scratch.shape[0] < 2 * b:
            self._scratch = np.empty(2 * b, dtype=np.int64)
        if self._pscratch.shape[0] < b:
            self._pscratch = np.empty(b, dtype=np.float64)
        if self.max_tree is None:
            return float(
                _pk.prop_update(
                    self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                    idx, td, keys, use_keys, eps, clip, self.alpha, self._priority_limit(),
                    size, key_base, added, self.capacity, self._pscratch, self._scratch,
                    status, self.track_min,
                )
            )  # fmt: skip
        return float(
            _pk.prop_update_max(
                self.raw_leaves, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                idx, td, keys, use_keys, eps, clip, self.alpha, self._priority_limit(), size,
                key_base, added, self.capacity, self._pscratch, self._scratch, status,
                self.track_min, self.max_tree.inner,
            )
        )  # fmt: skip

    def write_run(self, start: int, count: int, p: float) -> None:
        if self.max_tree is None:
            _pk.prop_write_run(
                self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                start, count, p, self.alpha, self.track_min,
            )  # fmt: skip
        else:
            _pk.prop_write_run_max(
                self.raw_leaves, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                start, count, p, self.alpha, self.track_min, self.max_tree.inner,
            )  # fmt: skip

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)
        _pk.prop_rebuild(
            self.raw, n, self.leaves, self.sinner, self.minner, self.offs, self.depth, self.alpha,
            self.track_min,
        )  # fmt: skip

    @property
    def total(self) -> float:
        return float(self.sinner[self._root])

    def check_priorities(self, name: str, p: np.ndarray, alpha: float | None = None) -> None:
        a = self.alpha if alpha is None else alpha
        pmax = float(p.max()) if p.size else 0.0
        if pmax > self.priority_limit(a):
            raise ValueError(
                f"`{name}` must keep p**alpha <= {math.exp(self.log_limit):.3e} so the sum tree "
                f"stays finite, got max {name}={pmax!r} with alpha={a!r}"
            )

    def check_sampleable(self, n: int) -> None:
        if not self.total > 0.0:
            raise ZeroPriorityError(
                f"cannot sample: all {n} stored priorities are zero (raise `eps` above 0 "
                "or update priorities)"
            )

    def sample_permuted(
        self, u: np.ndarray, perm: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int, rows: np.ndarray = NO_ROWS, row_bytes: int = 0,
        shuffle: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """:meth:`PermutedSampler.sample_permuted`: the targets, the search, the batch
        order, keys, probabilities and weights in one compiled call (one dispatch
        instead of several, and no copies to put the draws in random order)."""
        if norm == 0 and not self.track_min:
            raise RuntimeError("buffer-wide weight normalisation needs the min tree (track_min)")
        b = self._permuted_batch(u, perm, shuffle, rows, row_bytes)
        idx = np.empty(b, dtype=np.int64)
        prob = np.empty(b, dtype=np.float64)
        w = np.empty(b, dtype=np.float64)
        keys = np.empty(b, dtype=np.int64)
        _pk.prop_sample(
            self.leaves, self.sinner, self.minner, self.offs, self.depth, u, perm, shuffle,
            stratified, beta, n, norm, key_base, added, self.capacity, idx, prob, w, keys, rows,
            row_bytes,
        )  # fmt: skip
        return idx, prob, w, keys

    def mass_find(self, targets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.empty(targets.shape[0], dtype=np.int64)
        _tk.sum_find(self.leaves, self.sinner, self.offs, self.depth, targets, idx)
        return idx, self.leaves[idx]

    def mass_stats(self, n: int) -> tuple[float, float]:
        if not self.track_min:
            return self.total, math.nan  # buffer-wide minimum not kept (weight_norm != "buffer")
        return self.total, float(self.minner[self._root])

    def probabilities(self, idx: np.ndarray, n: int, batch_size: int | None = None) -> np.ndarray:
        return self.leaves[idx] / self.total

    def chunk_masses(self, chunk_size: int, n: int) -> np.ndarray:
        """Sum of ``p_i ** alpha`` under each aligned chunk of ``chunk_size`` slots.

        Read from the tree: with ``chunk_size = c * 8**l`` (``l`` as large as
        the tree allows) each chunk is ``c`` nodes of level ``l``, so the cost
        is O(N / 8**l): O(N / chunk_size) for a power of 8.
        """
        n_chunks = -(-self.capacity // chunk_size)
        level = 0
        while chunk_size % 8 ** (level + 1) == 0 and level < self.depth:
            level += 1
        group = chunk_size // 8**level
        nodes = self.leaves if level == 0 else self.sinner[self.offs[level] : self.offs[level + 1]]
        need = n_chunks * group
        if nodes.shape[0] < need:
            nodes = np.concatenate((nodes, np.zeros(need - nodes.shape[0])))
        masses = nodes[:need]
        return masses.reshape(n_chunks, group).sum(axis=1) if group > 1 else masses.copy()

    def clear(self) -> None:
        super().clear()
        self.leaves[:] = 0.0
        self.sinner[:] = 0.0
        self.minner[:] = np.inf
