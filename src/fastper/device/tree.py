"""A sum tree of float64 tensors on a device, searched and updated in a fixed number of ops.

Layout. The leaves are cut into blocks of ``K = 64``; the tree keeps one
*summary* per block, ``blocks[0, b]`` (the sum of its 64 leaves) and
``blocks[1, b]`` (its smallest positive leaf, ``inf`` if none). That is the
whole tree: there are no levels above the blocks. A search takes the
prefix sums of the block sums on the fly (one ``cumsum`` over
``capacity / 64`` numbers, a few microseconds on a GPU at 2^24 leaves), finds
the block of each target in them and then the leaf in its block. So a
batched search, and a batched update, is the same handful of tensor
operations at any capacity: on a GPU each operation is a kernel launch, and
a tree whose operations grew with its depth would be launch-bound.

The leaves hold one spare block past the last real one (``spare``): writes
that must land somewhere harmless (a dropped entry of a batched update) go
there; it never enters a sum.

Exact and drift-free, as the numba trees (:mod:`fastper._kernels.tree`): a
block summary is always *recomputed* from its 64 leaves (``cumsum``, the last
prefix, and ``amin``), never adjusted by a delta, so the tree is a pure
function of its leaves whatever the order of updates, and a rebuilt tree is
bit-identical to an updated one.

Search. ``find`` returns, for each target ``t``, the same leaf as
:meth:`fastper.SumTree.find`: the smallest ``i`` with
``t < leaf[0] + .. + leaf[i]``. The sums are formed in another order than
the numba tree's (a running sum over blocks, then within the block), so the
two agree on every target except those within rounding of a boundary between
two leaves (a few ulps of the total); with exactly representable sums
(integer leaves) they agree on every target. A target at or past the total
takes the last positive leaf. On the CPU every prefix is a sequential sum,
so a zero leaf is never returned while the total is positive. On a GPU,
torch's parallel ``cumsum`` may round the prefixes of a run of zero leaves
a unit apart; a target within that unit of such a run could land in it (the
fused paths of :class:`~fastper.device.index.TorchIndex` rule this out
whenever every stored priority is positive, their default).

Costs: ``set`` / ``find`` of B items, O(B * 64 + N / 64) work in a fixed
number of tensor operations; ``rebuild`` O(N). Memory: 8 bytes per leaf,
24 bytes per block, plus an int64 scratch per leaf for :meth:`set` (made on
first use).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._torch import check_device, torch

K = 64  # leaves per block


def num_blocks(capacity: int) -> int:
    """Blocks of ``K`` leaves that hold ``capacity`` leaves (the spare block not counted)."""
    return -(-capacity // K)


def max_leaf(capacity: int) -> float:
    """Largest leaf value that keeps any sum of all (padded) leaves finite."""
    return float(np.finfo(np.float64).max) / (2 * num_blocks(capacity) * K)


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """A tensor on ``device``; lists and scalars go through numpy (float64, not float32)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.as_tensor(np.asarray(value), device=device)


class DeviceSumTree:
    """Sum tree (with the smallest positive leaf) of float64 tensors on ``device``.

    The device counterpart of :class:`fastper.SumTree`, with the same
    contract: leaves start at 0, ``set`` keeps the last of duplicate
    indices, ``find`` never returns a zero leaf while the total is positive
    (see the module docstring for GPUs). :meth:`set`, :meth:`get` and
    :meth:`find` validate their input, which reads values back from the
    device (a host sync); the buffers use the unchecked methods
    (:meth:`write_unchecked`, :meth:`fill_run`, :meth:`fix_range`,
    :meth:`fix_blocks`, :meth:`find_unchecked`, :meth:`last_wins`), which
    never synchronise and trust the caller's indices and values.

    Args:
        capacity: number of leaves (>= 1).
        device: a torch device (default ``"cpu"``).
        track_min: expose the smallest positive leaf (:attr:`min_positive`);
            the block minima are kept either way (one row of 8 bytes per block).
        leaves: optional float64 tensor of ``(num_blocks(capacity) + 1) * 64``
            elements on ``device`` to use as the leaves (a view into a larger
            table, say); it must hold zeros wherever a block is read.
    """

    def __init__(
        self, capacity: int, *, device: Any = "cpu", track_min: bool = False,
        leaves: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity` must be an int >= 1, got capacity={capacity!r}")
        self.capacity = capacity
        self.device = check_device(device)
        self.track_min = bool(track_min)
        nb = num_blocks(capacity)
        self.num_blocks = nb
        self.spare = nb * K  # first leaf of the spare block
        f64, dev = torch.float64, self.device
        size = (nb + 1) * K
        if leaves is None:
            leaves = torch.zeros(size, dtype=f64, device=dev)
        elif leaves.shape != (size,) or leaves.dtype != f64 or leaves.device != dev:
            raise ValueError(
                f"`leaves` must be a float64 tensor of {size} elements on {dev}, got "
                f"{leaves.dtype} {tuple(leaves.shape)} on {leaves.device}"
            )
        self.leaves = leaves
        #: row 0: the sum of each block; row 1: its smallest positive leaf (inf if none)
        self.blocks = torch.zeros(2, nb + 1, dtype=f64, device=dev)
        self.blocks[1] = math.inf
        #: scratch of the searches: prefix[0] = 0, prefix[b + 1] = sum of blocks 0..b
        self.prefix = torch.zeros(nb + 2, dtype=f64, device=dev)
        self._neg_inf = torch.full((), -math.inf, dtype=f64, device=dev)  # nextafter's direction
        self._inf = torch.full((), math.inf, dtype=f64, device=dev)
        self._winner = torch.empty(0, dtype=torch.int64, device=dev)
        self.max_value = max_leaf(capacity)

    # -- block summaries ---------------------------------------------------------------
    def summarize(self, tile: torch.Tensor, positive: bool = False) -> torch.Tensor:
        """Summaries of the blocks in ``tile`` (rows of 64 leaves): a (2, rows) tensor
        of their sums (the last of the running sums) and smallest positive leaves.

        ``positive``: the caller knows every leaf is positive (no zero to skip). O(rows * 64).
        """
        sums = tile.cumsum(1)[:, -1]
        mins = tile.amin(1) if positive else torch.where(tile > 0, tile, self._inf).amin(1)
        return torch.stack([sums, mins])

    def fix_blocks(self, blocks: torch.Tensor, positive: bool = False) -> None:
        """Recompute the summaries of ``blocks`` (int tensor; repeats allowed) from
        their leaves. O(len(blocks) * 64), no sync."""
        tile = self.leaves.view(-1, K).index_select(0, blocks)
        self.blocks[:, blocks] = self.summarize(tile, positive)

    def fix_range(self, lo: int, hi: int) -> None:
        """Recompute the summaries of the blocks holding leaves ``lo .. hi`` (contiguous),
        after the caller wrote those leaves in :attr:`leaves`. O(hi - lo + 64), no sync."""
        b0, b1 = lo // K, hi // K + 1
        self.blocks[:, b0:b1] = self.summarize(self.leaves[b0 * K : b1 * K].view(-1, K))

    def rebuild(self, upto: int | None = None) -> None:
        """Recompute the summaries of the blocks holding leaves ``0 .. upto - 1``
        (all by default). O(upto), no sync."""
        nb = self.num_blocks if upto is None else num_blocks(max(upto, 1))
        self.blocks[:, :nb] = self.summarize(self.leaves[: nb * K].view(-1, K))

    def total_of(self, nblocks: int) -> torch.Tensor:
        """Sum of the first ``nblocks`` blocks (a 0-dim view of :attr:`prefix`, valid until
        the next search). O(nblocks), no sync."""
        torch.cumsum(self.blocks[0, :nblocks], 0, out=self.prefix[1 : nblocks + 1])
        return self.prefix[nblocks]

    # -- unchecked, sync-free core (the buffers call these) ---------------------------
    @property
    def total(self) -> torch.Tensor:
        """Sum of all leaves: a 0-dim float64 tensor on the device (``float()`` syncs).
        O(N / 64)."""
        return self.total_of(self.num_blocks).clone()

    @property
    def min_positive(self) -> torch.Tensor:
        """Smallest positive leaf (``inf`` if none), 0-dim tensor. Needs ``track_min``. O(N / 64)."""
        if not self.track_min:
            raise AttributeError("`min_positive` needs a DeviceSumTree built with track_min=True")
        return self.blocks[1, : self.num_blocks].amin()

    def last_wins(self, idx: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """For each entry, the position of the last kept entry with the same index (-1: none).

        One scatter of positions into a per-leaf scratch with ``amax`` (an
        order-free reduction, so the result is deterministic on every device);
        ``include_self=False`` makes stale scratch values irrelevant, so
        nothing needs resetting. ``idx`` must lie in ``[0, capacity)``. O(B), no sync.
        """
        if self._winner.shape[0] == 0:
            self._winner = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        pos = torch.arange(idx.shape[0], dtype=torch.int64, device=self.device)
        if keep is not None:
            pos = torch.where(keep, pos, -1)
        w = self._winner
        w.scatter_reduce_(0, idx, pos, reduce="amax", include_self=False)
        return w.index_select(0, idx)

    def write_unchecked(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Set leaves ``idx`` to ``values`` and fix their blocks. Duplicates must carry
        equal values (see :meth:`last_wins`); ``idx`` in range. O(B * 64), no sync."""
        self.leaves.index_put_((idx,), values)
        self.fix_blocks(torch.div(idx, K, rounding_mode="floor"))

    def fill_run(self, start: int, count: int, value: torch.Tensor) -> None:
        """Leaves ``start .. start+count-1`` (no wrap) all get ``value`` (0-dim tensor). No sync.

        Unchecked: the run must lie in ``[0, capacity)`` and ``value`` be finite,
        >= 0 and <= :attr:`max_value`. O(count + 64).
        """
        self.leaves[start : start + count].copy_(value.expand(count))
        self.fix_range(start, start + count - 1)

    def find_unchecked(
        self, targets: torch.Tensor, size: int | None = None, summed: bool = False
    ) -> torch.Tensor:
        """Leaf of each target (float64 tensor in ``[0, total]``). No sync.

        Unchecked (:meth:`find` checks): with a zero total every target gives leaf 0.
        ``size``: search only leaves ``0 .. size - 1`` (all by default).
        ``summed``: :attr:`prefix` already holds the prefix sums of those blocks
        (:meth:`total_of` was just called for them).

        A target is capped just below the total, its block is the count of
        block prefix sums ``<= t``, and within the block the same rule runs
        on the block's own running sums with the remainder (capped just below
        the block's sum, so that a remainder rounded up to it takes the last
        positive leaf). O(B * 64 + size / 64) in 11 tensor operations.
        """
        n = self.capacity if size is None else size
        last = num_blocks(n) - 1
        total = self.prefix[last + 1] if summed else self.total_of(last + 1)
        t = torch.minimum(targets, torch.nextafter(total, self._neg_inf))
        b = torch.searchsorted(self.prefix[1 : last + 2], t, right=True).clamp_(max=last)
        rest = t - self.prefix.index_select(0, b)
        cs = self.leaves.view(-1, K).index_select(0, b).cumsum(1)
        rest = torch.minimum(rest.unsqueeze(1), torch.nextafter(cs[:, -1:], self._neg_inf))
        c = torch.searchsorted(cs, rest, right=True)
        return torch.add(c.view(-1), b, alpha=K).clamp_(max=n - 1)

    def clear(self) -> None:
        """All leaves back to 0. O(N)."""
        self.leaves.zero_()
        self.blocks[0].zero_()
        self.blocks[1].fill_(math.inf)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory held (leaves, block summaries, prefix and the scratch)."""
        tensors = [self.leaves, self.blocks, self.prefix, self._winner]
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
        """Write ``values`` at ``indices``; the last of duplicate indices wins. O(B * 64).

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
        return self.leaves.index_select(0, self._index(indices))

    def find(self, targets: Any) -> torch.Tensor:
        """Prefix-sum search: for each ``t``, the smallest ``i`` with ``t < leaf[0] + .. + leaf[i]``.

        Targets equal to the total (or within rounding of it) give the last
        positive leaf. O(B * 64 + N / 64).

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
        return self.leaves[: self.capacity].clone()

    def __len__(self) -> int:
        return self.capacity
