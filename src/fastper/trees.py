"""Sum and min trees over flat float64 arrays.

Thin, validated wrappers around :mod:`fastper._kernels.tree` (8 children per
node, one cache line; see that module for the layout and why it cannot drift).
Every method checks its arguments completely before writing anything, so a
call that raises leaves the tree exactly as it was.

Threads: the kernels release the GIL, so each tree holds a lock around every
kernel call; threads may share a tree (calls are serialised). Without it two
threads' ``set`` ran at once over one scratch array and wrote out of bounds.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np

from ._kernels import tree as _k
from ._validation import as_index_array, as_value_array, check_int, show, to_numpy


class TreeArrays(NamedTuple):
    """The arrays of a :class:`SumTree`, for compiled callers (see ``kernel_arrays``).

    ``min_inner`` holds the zero-skipping min tree's internal nodes over the
    same leaves (one entry, unused, when the tree keeps no min).
    """

    leaves: np.ndarray
    inner: np.ndarray
    min_inner: np.ndarray
    offs: np.ndarray
    depth: int


class _Tree:
    _fill: float = 0.0

    def __init__(self, capacity: int) -> None:
        self._capacity = check_int("capacity", capacity, minimum=1)
        n_leaves, self._offs, self._depth = _k.layout(self._capacity)
        self._leaves = _k.aligned_full(n_leaves, self._fill)  # nodes within cache lines
        self._inner = _k.aligned_full(int(self._offs[-1]), self._fill)
        self._scratch = np.empty(0, dtype=np.int64)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Number of addressable leaves ``0 .. capacity - 1``."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Memory held by the tree's arrays, in bytes."""
        return int(self._leaves.nbytes + self._inner.nbytes)

    @property
    def max_value(self) -> float:
        """Largest storable value: keeps any sum of all leaves finite."""
        return float(np.finfo(np.float64).max / (2 * self._leaves.shape[0]))

    def __len__(self) -> int:
        return self._capacity

    def state(self) -> np.ndarray:
        """Every float of the tree (leaves, then internal nodes): a copy, for checks."""
        with self._lock:
            return np.concatenate((self._leaves, self._inner))

    def _checked(self, indices: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        idx = as_index_array("indices", indices, self._capacity)
        vals = as_value_array("values", values, idx.shape[0])
        if vals.size and vals.max() > self.max_value:
            raise ValueError(
                f"`values` must be <= {self.max_value:.3e} (so the total stays finite), "
                f"got values={show(vals[vals > self.max_value][:8])}"
            )
        return idx, vals

    def _write(self, idx: np.ndarray, vals: np.ndarray, mode: int) -> None:
        with self._lock:
            if self._scratch.shape[0] < idx.shape[0]:
                self._scratch = np.empty(idx.shape[0], dtype=np.int64)
            _k.write_leaves(self._leaves, idx, vals)
            _k.fix_paths(
                self._leaves, self._inner, self._offs, self._depth, idx, self._scratch, mode
            )

    def get(self, indices: Any) -> np.ndarray:
        """Leaf values at ``indices`` (float64 array). O(B)."""
        idx = as_index_array("indices", indices, self._capacity)
        out = np.empty(idx.shape[0], dtype=np.float64)
        with self._lock:
            _k.gather(self._leaves, idx, out)
        return out

    def leaves(self) -> np.ndarray:
        """A copy of all addressable leaves. O(capacity)."""
        with self._lock:
            return self._leaves[: self._capacity].copy()

    def __getitem__(self, index: int) -> float:
        return float(self.get(np.asarray([index]))[0])

    @property
    def _root(self) -> float:
        with self._lock:
            return float(self._inner[self._offs[self._depth]])


class SumTree(_Tree):
    """Sum tree: point updates and prefix-sum search in O(log N).

    Leaves start at 0. Any ``capacity >= 1`` works; padding leaves past
    ``capacity`` are zero and never addressable. Nodes have 8 children (one
    cache line), so operations touch ``log8 N`` cache lines.

    Args:
        capacity: number of leaves.

    Raises:
        TypeError, ValueError: ``capacity`` is not an integer >= 1.
    """

    _fill = 0.0

    def __init__(self, capacity: int, *, track_min: bool = False) -> None:
        super().__init__(capacity)
        if not isinstance(track_min, bool | np.bool_):
            raise TypeError(f"`track_min` must be a bool, got track_min={show(track_min)}")
        self._track_min = bool(track_min)
        # the min tree shares the leaves: only internal nodes (1/7 float per slot)
        self._min_inner = _k.aligned_full(int(self._offs[-1]) if track_min else 1, math.inf)

    @property
    def track_min(self) -> bool:
        """Whether the tree also keeps the smallest positive leaf (:attr:`min_positive`)."""
        return self._track_min

    @property
    def nbytes(self) -> int:
        """Memory held by the tree's arrays, in bytes."""
        extra = self._min_inner.nbytes if self._track_min else 0
        return int(self._leaves.nbytes + self._inner.nbytes + extra)

    def kernel_arrays(self) -> TreeArrays:
        """The tree's own arrays (not copies), for compiled callers. O(1).

        For the samplers of this package, whose kernels fuse tree updates with
        priority bookkeeping. Such callers must serialise their calls with
        their own lock and keep the invariants: every internal node equals the
        pairwise combination of its children (see :mod:`fastper._kernels.tree`).
        """
        return TreeArrays(self._leaves, self._inner, self._min_inner, self._offs, self._depth)

    def set(self, indices: Any, values: Any) -> None:
        """Write ``values`` at ``indices``. O(B log N).

        Duplicate indices: the last occurrence wins, exactly as if the pairs
        were written one by one.

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``.
            ValueError: values not finite, negative or too large, or lengths differ.
        """
        idx, vals = self._checked(indices, values)
        self._write(idx, vals, _k.SUM)
        if self._track_min:
            with self._lock:
                _k.fix_paths(
                    self._leaves, self._min_inner, self._offs, self._depth, idx, self._scratch,
                    _k.MIN_POSITIVE,
                )  # fmt: skip

    @property
    def min_positive(self) -> float:
        """Smallest positive leaf (``inf`` if none). O(1). Needs ``track_min=True``."""
        if not self._track_min:
            raise AttributeError("`min_positive` needs a SumTree built with track_min=True")
        with self._lock:
            return float(self._min_inner[self._offs[self._depth]])

    @property
    def total(self) -> float:
        """Sum of all leaves. O(1)."""
        return self._root

    def find(self, targets: Any) -> np.ndarray:
        """Prefix-sum search, O(B log N).

        For each target ``t`` returns the smallest ``i`` with
        ``t < leaf[0] + ... + leaf[i]``. Targets equal to the total (or within
        rounding of it) return the last positive leaf: a zero leaf is never
        returned.

        Raises:
            ValueError: the tree's total is zero, or a target is not finite or
                outside ``[0, total]``.
        """
        arr = to_numpy(targets)
        if arr.ndim > 1:
            raise ValueError(
                f"`targets` must be a scalar or 1-D, got targets with shape {arr.shape}"
            )
        scalar = arr.ndim == 0
        t = as_value_array("targets", arr.reshape(-1), arr.size, nonnegative=True)
        out = np.empty(t.shape[0], dtype=np.int64)
        with self._lock:  # the total checked is the total searched
            total = float(self._inner[self._offs[self._depth]])
            if not total > 0.0:
                raise ValueError(f"`find` needs a positive total, got total={total!r}")
            if t.size and t.max() > total:
                raise ValueError(
                    f"`targets` must be <= total={total!r}, got targets={show(t[t > total][:8])}"
                )
            _k.sum_find(self._leaves, self._inner, self._offs, self._depth, t, out)
        return out[0] if scalar else out

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves. O(N)."""
        with self._lock:
            _k.rebuild(self._leaves, self._inner, self._offs, self._depth, _k.SUM)
            if self._track_min:
                _k.rebuild(self._leaves, self._min_inner, self._offs, self._depth, _k.MIN_POSITIVE)

    def fsum(self) -> float:
        """Exactly rounded sum of the leaves (``math.fsum``), for checks. O(N)."""
        return math.fsum(self.leaves())


class MinTree(_Tree):
    """Min tree: point updates in O(log N), minimum in O(1).

    Leaves start at ``+inf`` (meaning "unwritten"); ``min`` of a tree with no
    written leaf is ``inf``.
    """

    _fill = math.inf

    def set(self, indices: Any, values: Any) -> None:
        """Write ``values`` at ``indices``; last duplicate wins. O(B log N).

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``.
            ValueError: values not finite, negative or too large, or lengths differ.
        """
        idx, vals = self._checked(indices, values)
        self._write(idx, vals, _k.MIN)

    @property
    def min(self) -> float:
        """Smallest leaf. O(1)."""
        return self._root

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves. O(N)."""
        with self._lock:
            _k.rebuild(self._leaves, self._inner, self._offs, self._depth, _k.MIN)
