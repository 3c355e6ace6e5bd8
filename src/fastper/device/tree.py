"""Sum / min trees as float64 torch tensors on a device, updated without host syncs.

Layout. A tree over ``capacity`` leaves keeps its levels as tensors: level 0
(the leaves) padded to a multiple of ``K = 64``, level ``l`` holding one node
per 64 entries of level ``l - 1`` (padded to a multiple of 64 again), up to
a single root. At N = 2^24 that is 4 levels above the leaves (8 for the
8-ary numba tree): every batched operation is a fixed sequence of tensor
operations per level, so fewer, wider levels mean fewer kernel launches.

Exact and drift-free, as the numba trees (:mod:`fastper._kernels.tree`):
an internal node is always *recomputed* from its 64 children by a fixed
pairwise sum (six rounds of adding neighbours), never adjusted by a delta,
so the tree is a pure function of its leaves whatever the order of updates.
The min tree shares the leaves and counts a zero leaf as ``+inf``.

Search. Each target descends from the root: at a node, the inclusive
cumulative sums of its 64 children give the first child whose prefix sum
exceeds the target, i.e. the same rule as :meth:`fastper.SumTree.find`
(smallest ``i`` with ``t < leaf[0] + .. + leaf[i]``). The sums are formed in a
different order than the numba tree's, so the two agree on every target
except those within rounding of a boundary between two leaves (a few ulps of
the total); with exactly representable sums (integer priorities) they agree
on every target. A target at or past a node's sum (the total itself, or
rounding) takes the node's last positive child, so a zero leaf is never
returned while the total is positive.

Costs: ``set`` / ``find`` of B items, O(B log64 N) work in O(log64 N) tensor
operations; ``rebuild`` O(N). Memory: 8 bytes per leaf, about 1/63 of that
per tree for the internal nodes, plus an int64 scratch per slot (8 bytes)
for last-duplicate-wins updates.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._torch import check_device, torch

K = 64  # children per node


def layout(capacity: int) -> list[int]:
    """Sizes of the levels, leaves first; the last level is the root (size 1)."""
    sizes = [-(-capacity // K) * K]
    while True:
        nodes = sizes[-1] // K
        if nodes == 1:
            sizes.append(1)
            return sizes
        sizes.append(-(-nodes // K) * K)


def max_leaf(capacity: int) -> float:
    """Largest leaf value that keeps any sum of all (padded) leaves finite."""
    return float(np.finfo(np.float64).max) / (2 * layout(capacity)[0])


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """A tensor on ``device``; lists and scalars go through numpy (float64, not float32)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.as_tensor(np.asarray(value), device=device)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of 2) by adding neighbours, one round per halving.

    A fixed order of IEEE additions (each round sums pairs, and a sum of two
    numbers has one correctly rounded result in any order): the same children
    give the same bits on any device and for any number of rows, whereas
    ``torch.sum``'s order over many entries is not specified.
    """
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


class DeviceSumTree:
    """Sum tree (optionally with a zero-skipping min tree) of float64 tensors on ``device``.

    The device counterpart of :class:`fastper.SumTree`, with the same
    contract: leaves start at 0, ``set`` keeps the last of duplicate
    indices, ``find`` never returns a zero leaf while the total is positive.
    :meth:`set`, :meth:`get` and :meth:`find` validate their input, which
    reads values back from the device (a host sync); the buffers use the
    unchecked methods (:meth:`write_unchecked`, :meth:`fill_run`,
    :meth:`fix_range`, :meth:`find_unchecked`, :meth:`last_wins`), which never
    synchronise and trust the caller's indices and values.

    Args:
        capacity: number of leaves (>= 1).
        device: a torch device (default ``"cpu"``).
        track_min: also keep the smallest positive leaf (:attr:`min_positive`).
    """

    def __init__(self, capacity: int, *, device: Any = "cpu", track_min: bool = False) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity` must be an int >= 1, got capacity={capacity!r}")
        self.capacity = capacity
        self.device = check_device(device)
        self.track_min = bool(track_min)
        sizes = layout(capacity)
        self.depth = len(sizes) - 1
        f64, dev = torch.float64, self.device
        self.levels = [torch.zeros(s, dtype=f64, device=dev) for s in sizes]  # [0]: leaves
        # how many nodes of level l have children (the rest is padding)
        self.nodes = [0] + [size // K for size in sizes[:-1]]
        self.min_levels = [self.levels[0]] + (
            [torch.full((s,), math.inf, dtype=f64, device=dev) for s in sizes[1:]]
            if track_min
            else []
        )
        self._winner = torch.empty(0, dtype=torch.int64, device=self.device)
        self._down = torch.full((1, 1), -math.inf, dtype=f64, device=dev)  # nextafter's direction
        self.max_value = max_leaf(capacity)

    # -- unchecked, sync-free core (the buffers call these) ---------------------------
    @property
    def leaves(self) -> torch.Tensor:
        """The leaf tensor itself (padded to a multiple of 64)."""
        return self.levels[0]

    @property
    def total(self) -> torch.Tensor:
        """Sum of all leaves: a 0-dim float64 tensor on the device (``float()`` syncs). O(1)."""
        return self.levels[-1][0]

    @property
    def min_positive(self) -> torch.Tensor:
        """Smallest positive leaf (``inf`` if none), 0-dim tensor. Needs ``track_min``. O(1)."""
        if not self.track_min:
            raise AttributeError("`min_positive` needs a DeviceSumTree built with track_min=True")
        return self.min_levels[-1][0]

    def last_wins(self, idx: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """For each entry, the position of the last kept entry with the same index (-1: none).

        One scatter of positions into a per-slot scratch with ``amax`` (an
        order-free reduction, so the result is deterministic on every device).
        ``idx`` must lie in ``[0, capacity)``. O(B), no sync.
        """
        if self._winner.shape[0] == 0:
            self._winner = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        pos = torch.arange(idx.shape[0], dtype=torch.int64, device=self.device)
        if keep is not None:
            pos = torch.where(keep, pos, -1)
        w = self._winner
        w.scatter_reduce_(0, idx, pos, reduce="amax", include_self=True)
        win = w.index_select(0, idx)
        w.index_fill_(0, idx, -1)  # back to all -1 for the next call
        return win

    def write_unchecked(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Set leaves ``idx`` to ``values`` and fix their paths. Duplicates must carry
        equal values (see :meth:`last_wins`); ``idx`` in range. O(B log N), no sync.

        Writes are ``index_put_`` without accumulation: every duplicate writes the
        same value, so the result does not depend on which write lands last (and
        ``torch.use_deterministic_algorithms`` has a path for it).
        """
        self.levels[0].index_put_((idx,), values)
        self._fix(idx)

    def _fix(self, idx: torch.Tensor) -> None:
        j = idx
        for lv in range(1, self.depth + 1):
            j = torch.div(j, K, rounding_mode="floor")
            children = self.levels[lv - 1].view(-1, K).index_select(0, j)
            self.levels[lv].index_put_((j,), pairwise_sum(children))
            if self.track_min:
                if lv == 1:
                    m = torch.where(children > 0, children, math.inf).amin(1)
                else:
                    m = self.min_levels[lv - 1].view(-1, K).index_select(0, j).amin(1)
                self.min_levels[lv].index_put_((j,), m)

    def fill_run(self, start: int, count: int, value: torch.Tensor) -> None:
        """Leaves ``start .. start+count-1`` (no wrap) all get ``value`` (0-dim tensor). No sync.

        Unchecked: the run must lie in ``[0, capacity)`` and ``value`` be finite,
        >= 0 and <= :attr:`max_value`. O(count + log N).
        """
        self.levels[0][start : start + count].copy_(value.expand(count))
        self.fix_range(start, start + count - 1)

    def fix_range(self, lo: int, hi: int) -> None:
        """Recompute the ancestors of leaves ``lo .. hi`` (contiguous), after the caller
        wrote those leaves in :attr:`leaves` directly. O(hi - lo + log N), no sync."""
        for lv in range(1, self.depth + 1):
            lo //= K
            hi //= K
            children = self.levels[lv - 1][lo * K : (hi + 1) * K].view(-1, K)
            self.levels[lv][lo : hi + 1] = pairwise_sum(children)
            if self.track_min:
                if lv == 1:
                    m = torch.where(children > 0, children, math.inf).amin(1)
                else:
                    m = self.min_levels[lv - 1][lo * K : (hi + 1) * K].view(-1, K).amin(1)
                self.min_levels[lv][lo : hi + 1] = m

    def find_unchecked(self, targets: torch.Tensor) -> torch.Tensor:
        """Leaf of each target (float64 tensor in ``[0, total]``). O(B log N), no sync.

        Unchecked (:meth:`find` checks): with a zero total every target gives leaf 0.

        Per level: the children's inclusive prefix sums, the target capped just
        below their total (so that a target at or past it takes the last
        positive child, and a zero node child 0), the count of prefix sums
        ``<= t`` (``searchsorted``) is the child, minus the prefix before it.
        """
        j = torch.zeros(targets.shape[0], 1, dtype=torch.int64, device=self.device)
        t = targets.unsqueeze(1)
        for lv in range(self.depth, 0, -1):
            cs = self.levels[lv - 1].view(-1, K).index_select(0, j.view(-1)).cumsum_(1)
            t = torch.minimum(t, cs[:, -1:].nextafter(self._down))
            c = torch.searchsorted(cs, t, right=True)
            t = t - torch.nn.functional.pad(cs, (1, 0)).gather(1, c)
            j = torch.add(c, j, alpha=K)
        return j.view(-1)

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves. O(N), no sync."""
        for lv in range(1, self.depth + 1):
            n = self.nodes[lv]
            children = self.levels[lv - 1].view(-1, K)
            self.levels[lv][:n] = pairwise_sum(children)
            if self.track_min:
                if lv == 1:
                    m = torch.where(children > 0, children, math.inf).amin(1)
                else:
                    m = self.min_levels[lv - 1].view(-1, K).amin(1)
                self.min_levels[lv][:n] = m

    def clear(self) -> None:
        """All leaves back to 0. O(N)."""
        for lv in self.levels:
            lv.zero_()
        for lv in self.min_levels[1:]:
            lv.fill_(math.inf)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory held (levels and the update scratch)."""
        tensors = [*self.levels, *self.min_levels[1:], self._winner]
        return int(sum(t.numel() * t.element_size() for t in tensors))

    # -- validated API (reads values back: syncs) ----------------------------------
    def _index(self, indices: Any) -> torch.Tensor:
        idx = _as_tensor(indices, self.device)
        if idx.ndim > 1 or (
            idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool)
        ):
            raise ValueError(
                f"`indices` must be a 1-D array of integers, got dtype {idx.dtype} shape {tuple(idx.shape)}"
            )
        idx = idx.reshape(-1).to(torch.int64)
        if idx.numel() and bool(((idx < 0) | (idx >= self.capacity)).any()):
            bad = idx[(idx < 0) | (idx >= self.capacity)][:8].tolist()
            raise IndexError(f"`indices` must lie in [0, {self.capacity}), got {bad}")
        return idx

    def _values(self, name: str, values: Any, n: int, upper: float, what: str) -> torch.Tensor:
        v = _as_tensor(values, self.device).reshape(-1)
        if v.dtype == torch.bool or v.is_complex():
            raise ValueError(f"`{name}` must hold real numbers, got dtype {v.dtype}")
        v = v.to(torch.float64)
        if v.shape[0] != n:
            raise ValueError(f"`{name}` must have {n} entries (one per index), got {v.shape[0]}")
        bad = ~torch.isfinite(v) | (v < 0) | (v > upper)
        if v.numel() and bool(bad.any()):
            raise ValueError(
                f"`{name}` must be finite, >= 0 and <= {what} = {upper:.6g}, got {v[bad][:8].tolist()}"
            )
        return v + 0.0  # -0.0 -> +0.0

    def set(self, indices: Any, values: Any) -> None:
        """Write ``values`` at ``indices``; the last of duplicate indices wins. O(B log N).

        Raises:
            IndexError: an index outside ``[0, capacity)``.
            ValueError: values not finite, negative or too large, or lengths differ.
        """
        idx = self._index(indices)
        v = self._values("values", values, idx.shape[0], self.max_value, "max_value")
        if idx.shape[0] == 0:
            return
        win = self.last_wins(idx)
        self.write_unchecked(idx, v.index_select(0, win))

    def get(self, indices: Any) -> torch.Tensor:
        """Leaf values at ``indices`` (float64 tensor). O(B)."""
        return self.levels[0].index_select(0, self._index(indices))

    def find(self, targets: Any) -> torch.Tensor:
        """Prefix-sum search: for each ``t``, the smallest ``i`` with ``t < leaf[0] + .. + leaf[i]``.

        Targets equal to the total (or within rounding of it) give the last
        positive leaf. O(B log N).

        Raises:
            ValueError: the total is zero, or a target is not finite or outside ``[0, total]``.
        """
        total = float(self.total)
        if not total > 0.0:
            raise ValueError(f"`find` needs a positive total, got total={total!r}")
        t = self._values(
            "targets", targets, _as_tensor(targets, self.device).numel(), total, "total"
        )
        return self.find_unchecked(t)

    def leaves_copy(self) -> torch.Tensor:
        """A copy of the addressable leaves. O(N)."""
        return self.levels[0][: self.capacity].clone()

    def __len__(self) -> int:
        return self.capacity
