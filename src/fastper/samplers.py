"""Sampling schemes: uniform, proportional and rank-based.

A sampler owns the raw priorities ``p_i`` of every slot and whatever index it
needs to draw from them (nothing for uniform, a sum tree and a min tree for
proportional, a sorted order for rank-based). It never draws randomness: the
buffer hands it uniforms in ``[0, 1)`` from its own ``numpy.random.Generator``,
so samplers are deterministic functions of their state and those uniforms.

Common contract:
    ``write(slots, p)``: set raw priorities (last duplicate wins). O(B log N).
    ``sample(u, n, beta, stratified, norm, key_base, added)``: indices, P(i),
    IS weights and the key of each sampled slot's occupant (:func:`slot_keys`).
    ``set_alpha(alpha, n)``: re-weight every stored priority exactly. O(N).

IS weights ``w_i = (N P(i))^-beta`` are normalised by (``norm``) 0: the
largest weight in the whole buffer, 1: the largest in the batch, 2: nothing.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from ._kernels import rank as _rk
from ._kernels import tree as _tk
from .errors import ZeroPriorityError

NORM_CODES = {"buffer": 0, "batch": 1, "none": 2}


def slot_keys(idx: np.ndarray, key_base: int, added: int, capacity: int) -> np.ndarray:
    """Key (insertion counter) of the occupant of each slot in ``idx``.

    ``key_base``: the counter at the last clear; ``added``: transitions ever
    written (see :func:`fastper._kernels.tree.slot_keys`).
    """
    out = np.empty(idx.shape[0], dtype=np.int64)
    _tk.slot_keys(idx, key_base, added, capacity, out)
    return out


def _normalised_weights(
    prob: np.ndarray, pmin: float, n: int, beta: float, norm: int
) -> np.ndarray:
    if norm == 0:
        return np.power(prob / pmin, -beta)
    if norm == 1:
        return np.power(prob / prob.min(), -beta)
    return np.power(n * prob, -beta)


class Sampler:
    """Base: raw priorities only."""

    kind: ClassVar[str] = ""

    #: log of the largest allowed ``p ** alpha`` (only trees need a bound)
    log_limit = math.inf

    def priority_limit(self, alpha: float | None = None) -> float:
        """Largest raw priority ``p`` with ``p ** alpha <= exp(log_limit)`` (inf if none)."""
        a = self.alpha if alpha is None else alpha
        if a <= 0.0 or self.log_limit == math.inf:
            return math.inf
        try:
            return math.exp(self.log_limit / a)
        except OverflowError:  # every finite p is allowed
            return math.inf

    def __init__(self, capacity: int, alpha: float) -> None:
        self.capacity = capacity
        self.alpha = float(alpha)
        self.raw = np.zeros(capacity, dtype=np.float64)

    def write(self, slots: np.ndarray, p: np.ndarray) -> None:
        _tk.write_leaves(self.raw, slots, p)

    def update_from_td(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, size: int, key_base: int, added: int, status: np.ndarray,
    ) -> float:  # fmt: skip
        """Validate an update, drop stale entries, write the rest (see
        :func:`fastper._kernels.tree.td_priorities` for ``status``); returns
        the largest priority written."""
        b = idx.shape[0]
        out_idx = np.empty(b, dtype=np.int64)
        out_p = np.empty(b, dtype=np.float64)
        pmax = _tk.td_priorities(
            idx, td, keys, use_keys, eps, clip, self.priority_limit(), size, key_base,
            added, self.capacity, out_idx, out_p, status,
        )  # fmt: skip
        if status[0] == 0 and status[2]:
            self.write(out_idx[: status[2]], out_p[: status[2]])
        return float(pmax)

    def write_run(self, start: int, count: int, p: float) -> None:
        """Give slots ``start .. start+count-1`` (no wrap) priority ``p``."""
        slots = np.arange(start, start + count, dtype=np.int64)
        self.write(slots, np.full(count, p))

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)

    def check_sampleable(self, n: int) -> None:
        """Raise if nothing can be drawn (only proportional can refuse)."""

    def check_priorities(self, name: str, p: np.ndarray, alpha: float | None = None) -> None:
        """Raise if priorities ``p`` (under ``alpha``) could overflow the index."""

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError

    def clear(self) -> None:
        self.raw[:] = 0.0

    # checkpoint support: arrays over the first n slots, plus small JSON state
    def state_arrays(self, n: int) -> dict[str, np.ndarray]:
        return {"priorities": self.raw[:n].copy()}

    def state_meta(self) -> dict[str, Any]:
        return {}

    def load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], n: int) -> None:
        self.raw[:n] = arrays["priorities"]
        self.set_alpha(self.alpha, n)


class UniformSampler(Sampler):
    """P(i) = 1/N; every weight is 1. Priorities are kept but not used."""

    kind = "uniform"

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        b = u.shape[0]
        if stratified:
            pos = (np.arange(b, dtype=np.float64) + u) * (n / b)
        else:
            pos = u * n
        idx = np.minimum(pos.astype(np.int64), n - 1)
        prob = np.full(b, 1.0 / n)
        keys = slot_keys(idx, key_base, added, self.capacity)
        return idx, prob, np.ones(b, dtype=np.float64), keys


class ProportionalSampler(Sampler):
    """P(i) = p_i^alpha / sum_k p_k^alpha, from a sum tree; weights from a min tree.

    The min tree shares the sum tree's leaves and only adds internal nodes
    (about 1/7 of a float64 per slot); it skips zero leaves. Only weights
    normalised by the buffer-wide largest weight need it: with
    ``track_min=False`` it is not built, and every priority write skips its
    half of the path updates.
    """

    kind = "proportional"

    def __init__(self, capacity: int, alpha: float, track_min: bool = True) -> None:
        super().__init__(capacity, alpha)
        n_leaves, self.offs, self.depth = _tk.layout(capacity)
        self.track_min = bool(track_min)
        # nodes must not straddle cache lines: see aligned_full
        self.leaves = _tk.aligned_full(n_leaves, 0.0)
        self.sinner = _tk.aligned_full(int(self.offs[-1]), 0.0)
        # without the min tree the kernels still take an array; they never index it
        self.minner = _tk.aligned_full(int(self.offs[-1]) if track_min else 1, np.inf)
        self.log_limit = math.log(float(np.finfo(np.float64).max / (2 * n_leaves)))
        self._root = int(self.offs[self.depth])  # the root's position in ``sinner``
        self._scratch = np.empty(1024, dtype=np.int64)  # kernels' int64 work space
        self._pscratch = np.empty(512, dtype=np.float64)  # priorities of an update

    def write(self, slots: np.ndarray, p: np.ndarray) -> None:
        if self._scratch.shape[0] < slots.shape[0]:
            self._scratch = np.empty(slots.shape[0], dtype=np.int64)
        _tk.prop_write(
            self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
            slots, p, self.alpha, self._scratch, self.track_min,
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
        return float(
            _tk.prop_update(
                self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
                idx, td, keys, use_keys, eps, clip, self.alpha, self.priority_limit(), size,
                key_base, added, self.capacity, self._pscratch, self._scratch, status,
                self.track_min,
            )
        )  # fmt: skip

    def write_run(self, start: int, count: int, p: float) -> None:
        _tk.prop_write_run(
            self.raw, self.leaves, self.sinner, self.minner, self.offs, self.depth,
            start, count, p, self.alpha, self.track_min,
        )  # fmt: skip

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)
        _tk.prop_rebuild(
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

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        # keys come from the same kernel call: one dispatch instead of two
        if norm == 0 and not self.track_min:
            raise RuntimeError("buffer-wide weight normalisation needs the min tree (track_min)")
        b = u.shape[0]
        idx = np.empty(b, dtype=np.int64)
        prob = np.empty(b, dtype=np.float64)
        w = np.empty(b, dtype=np.float64)
        keys = np.empty(b, dtype=np.int64)
        _tk.prop_sample(
            self.leaves, self.sinner, self.minner, self.offs, self.depth,
            u, stratified, beta, n, norm, key_base, added, self.capacity, idx, prob, w, keys,
        )  # fmt: skip
        return idx, prob, w, keys

    def probabilities(self, idx: np.ndarray) -> np.ndarray:
        return self.leaves[idx] / self.total

    def clear(self) -> None:
        super().clear()
        self.leaves[:] = 0.0
        self.sinner[:] = 0.0
        self.minner[:] = np.inf


class RankSampler(Sampler):
    """P(i) = rank(i)^-alpha / sum_{r=1..N} r^-alpha, rank 1 = largest priority.

    Ties are broken by slot index (smaller slot = better rank), so the
    distribution is a deterministic function of the priorities.

    ``order`` keeps the slots sorted by priority. Changed slots are marked and
    merged back lazily, in one O(N + k log k) pass, the next time the order is
    needed. With ``sort_every=None`` (exact, the default) that is every sample
    after a change; with ``sort_every=K`` changes to existing slots are merged
    only every K samples (the paper re-sorts every 10^6 steps), while slots
    written for the first time are always merged before sampling.

    ``segments=True`` samples as the paper does: the rank distribution is cut
    into ``B`` segments of (about) equal probability and one rank is drawn
    uniformly inside each. The reported probabilities and weights are those
    of this actual scheme: ``1 / (B * len(segment))``. With fewer stored items
    than ``B`` it falls back to exact draws.
    """

    kind = "rank"

    def __init__(
        self, capacity: int, alpha: float, *, sort_every: int | None = None, segments: bool = False
    ) -> None:
        super().__init__(capacity, alpha)
        self.sort_every = sort_every
        self.segments = segments
        self.order = np.zeros(capacity, dtype=np.int64)
        self._scratch = np.zeros(capacity, dtype=np.int64)
        self.m = 0  # valid entries in order
        self.changed = np.zeros(capacity, dtype=np.bool_)
        self.n_changed = 0
        self.samples_since_sort = 0
        self.prefix = np.empty(capacity, dtype=np.float64)
        _rk.rank_weights_prefix(self.alpha, capacity, self.prefix)
        self._seg_cache: tuple[int, int, np.ndarray] | None = None

    def write(self, slots: np.ndarray, p: np.ndarray) -> None:
        _tk.write_leaves(self.raw, slots, p)
        self.changed[slots] = True
        self.n_changed += int(slots.shape[0])

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)
        _rk.rank_weights_prefix(self.alpha, self.capacity, self.prefix)
        self._seg_cache = None

    def sort(self, n: int) -> None:
        """Merge every pending change into the order now. O(N + k log k)."""
        if self.n_changed == 0:
            return
        ch = np.flatnonzero(self.changed[:n])
        ch_sorted = ch[np.lexsort((ch, -self.raw[ch]))]
        m = _rk.merge_order(self.order, self.m, self.changed, self.raw, ch_sorted, self._scratch)
        self.order, self._scratch = self._scratch, self.order
        self.m = int(m)
        self.changed[ch] = False
        self.n_changed = 0
        self.samples_since_sort = 0

    def _maybe_sort(self, n: int) -> None:
        if self.n_changed == 0:
            return
        if self.sort_every is None or self.m != n or self.samples_since_sort >= self.sort_every:
            self.sort(n)

    def ranks_of(self, n: int) -> np.ndarray:
        """0-based rank of each slot ``0..n-1`` in the current order."""
        ranks = np.empty(n, dtype=np.int64)
        ranks[self.order[: self.m]] = np.arange(self.m)
        return ranks

    def _bounds(self, n: int, b: int) -> np.ndarray:
        if self._seg_cache is not None and self._seg_cache[:2] == (n, b):
            return self._seg_cache[2]
        total = self.prefix[n - 1]
        targets = np.arange(1, b, dtype=np.float64) * (total / b)
        raw_b = np.searchsorted(self.prefix[:n], targets, side="right")
        j = np.arange(1, b)
        # Segment j starts at the rank holding mass j/B; then force every segment
        # to be non-empty: (start_j - j) must be non-decreasing, in [0, n - b].
        inner = j + np.minimum(np.maximum.accumulate(np.maximum(raw_b - j, 0)), n - b)
        bounds = np.concatenate(([0], inner, [n])).astype(np.int64)
        self._seg_cache = (n, b, bounds)
        return bounds

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        self._maybe_sort(n)
        self.samples_since_sort += 1
        b = u.shape[0]
        if self.segments and n >= b:
            bounds = self._bounds(n, b)
            lengths = np.diff(bounds)
            if stratified:
                seg = np.arange(b)
                frac = u
            else:
                scaled = u * b
                seg = np.minimum(scaled.astype(np.int64), b - 1)
                frac = scaled - seg
            ranks = bounds[seg] + np.minimum(
                (frac * lengths[seg]).astype(np.int64), lengths[seg] - 1
            )
            prob = 1.0 / (b * lengths[seg].astype(np.float64))
            pmin = 1.0 / (b * float(lengths.max()))
        else:
            total = self.prefix[n - 1]
            if stratified:
                t = (np.arange(b, dtype=np.float64) + u) * (total / b)
            else:
                t = u * total
            ranks = np.minimum(np.searchsorted(self.prefix[:n], t, side="right"), n - 1)
            prob = np.power(ranks + 1.0, -self.alpha) / total
            pmin = float(n) ** (-self.alpha) / total
        idx = self.order[ranks]
        weights = _normalised_weights(prob, pmin, n, beta, norm)
        return idx, prob, weights, slot_keys(idx, key_base, added, self.capacity)

    def clear(self) -> None:
        super().clear()
        self.m = 0
        self.changed[:] = False
        self.n_changed = 0
        self.samples_since_sort = 0

    def state_arrays(self, n: int) -> dict[str, np.ndarray]:
        return {
            "priorities": self.raw[:n].copy(),
            "order": self.order[: self.m].copy(),
            "changed": self.changed[:n].copy(),
        }

    def state_meta(self) -> dict[str, Any]:
        return {"n_changed": self.n_changed, "samples_since_sort": self.samples_since_sort}

    def load_state(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], n: int) -> None:
        order = arrays["order"]
        changed = arrays["changed"]
        if order.shape[0] > n or (order.size and (order.min() < 0 or order.max() >= n)):
            raise ValueError("rank order holds slots outside the stored range")
        if np.unique(order).shape[0] != order.shape[0]:
            raise ValueError("rank order repeats a slot")
        if changed.shape != (n,) or changed.dtype != np.bool_:
            raise ValueError("rank change mask must be one bool per stored slot")
        covered = changed.copy()
        covered[order] = True
        if not covered.all():
            raise ValueError("rank order misses stored slots that are not marked changed")
        self.raw[:n] = arrays["priorities"]
        self.order[: order.shape[0]] = order
        self.m = int(order.shape[0])
        self.changed[:n] = changed
        marked = int(np.count_nonzero(changed))
        n_changed = int(meta["n_changed"])
        if n_changed < marked or (n_changed == 0) != (marked == 0):
            raise ValueError(f"rank change count {n_changed} disagrees with {marked} marked slots")
        self.n_changed = n_changed
        self.samples_since_sort = int(meta["samples_since_sort"])
        self.set_alpha(self.alpha, n)
