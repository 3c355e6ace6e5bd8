"""What every sampler shares: the base class, the priority array and its helpers.

A sampler (:mod:`fastper.samplers`: uniform and proportional;
:mod:`fastper.rank_sampler`: rank-based) owns the raw priorities ``p_i`` of
every slot and the index it draws from; see :mod:`fastper.samplers` for the
contract every sampler keeps. This module holds the base class (raw
priorities only) and the helpers the schemes share: the keys of sampled
slots, the padded priority array, the max tree over it (``max_priority=
"current"``) and the checks of a state's priorities.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from . import policy as _policy
from ._kernels import ring as _ring
from ._kernels import tree as _tk
from .storage import check_record_bytes

NORM_CODES = _policy.NORM_CODES
NO_PERM = np.empty(0, dtype=np.int64)  # sample_permuted: draws in stratum order
NO_ROWS = np.empty(0, dtype=np.uint8)  # sample_permuted: no rows to prefetch


def slot_keys(idx: np.ndarray, key_base: int, added: int, capacity: int) -> np.ndarray:
    """Key (insertion counter) of the occupant of each slot in ``idx``.

    ``key_base``: the counter at the last clear; ``added``: transitions ever
    written (see :func:`fastper._kernels.ring.slot_keys`).
    """
    out = np.empty(idx.shape[0], dtype=np.int64)
    _ring.slot_keys(idx, key_base, added, capacity, out)
    return out


def new_priorities(capacity: int) -> np.ndarray:
    """A zeroed priority array padded to whole 8-entry cache lines, 64-byte aligned.

    The padding lets a max tree use it as its leaves (see :class:`PriorityMax`).
    Slice ``[:capacity]`` for the addressable part.
    """
    n_leaves, _, _ = _tk.layout(capacity)
    return _tk.aligned_full(n_leaves, 0.0)


def copy_priorities(raw: np.ndarray, n: int, out: np.ndarray | None) -> np.ndarray:
    """``raw[:n]`` copied, into ``out`` when it is given (pages the caller touched
    before taking a lock: a save copies 8 bytes per slot while holding it)."""
    if out is None or out.shape[0] < n or out.dtype != np.float64:
        return raw[:n].copy()
    dest = out[:n]
    dest[...] = raw[:n]
    return dest


def normalised_weights(
    masses: np.ndarray, total: float, min_mass: float, n: int, beta: float, norm: int
) -> np.ndarray:
    """IS weights by the kernels' norm code (see :func:`fastper.policy.is_weights`)."""
    return _policy.is_weights(masses, total, min_mass, n, beta, _policy.NORMS[norm])


def check_order(u: np.ndarray, perm: np.ndarray, shuffle: bool) -> int:
    """The batch size of a ``sample_permuted`` call, after checking its order; O(B) for a
    given ``perm``, O(1) otherwise.

    ``shuffle``: ``u`` must hold 2B uniforms (B for the draws, B for the order).
    Else ``perm`` must be empty or B int64 entries in ``[0, B)``: the compiled
    samplers index with it unchecked.

    Raises:
        ValueError: an odd count of uniforms with ``shuffle``, or a ``perm`` of
            another length, dtype or range.
    """
    if shuffle:
        if u.shape[0] % 2:
            raise ValueError(
                f"`u` must hold 2B uniforms with shuffle=True (B for the draws, B for the "
                f"order), got {u.shape[0]}"
            )
        return u.shape[0] // 2
    b = u.shape[0]
    if perm.shape[0]:
        if perm.ndim != 1 or perm.shape[0] != b or perm.dtype != np.int64:
            raise ValueError(
                f"`perm` must be empty or {b} int64 entries (one per draw), got {perm.dtype} "
                f"of shape {perm.shape}"
            )
        if int(perm.min()) < 0 or int(perm.max()) >= b:
            raise ValueError(
                f"`perm` must hold positions in [0, {b}), got values from {int(perm.min())} "
                f"to {int(perm.max())}"
            )
    return b


def check_priority_array(name: str, p: Any, n: int) -> np.ndarray:
    """A state's priorities: float64, one per stored slot, finite and >= 0."""
    if (
        not isinstance(p, np.ndarray)
        or p.shape != (n,)
        or p.dtype != np.float64
        or not np.isfinite(p).all()
        or (n and p.min() < 0)
    ):
        raise ValueError(
            f"`{name}` must be {n} finite float64 priorities >= 0, got "
            + (f"{p.dtype}{p.shape}" if isinstance(p, np.ndarray) else type(p).__name__)
        )
    return p


class PriorityMax:
    """Max tree over a sampler's raw priorities: the largest priority held now. O(log N) per write.

    It uses the priority array itself as its leaves (padded, see
    :func:`new_priorities`), so it adds only internal nodes: about 1.2 bytes
    per slot. Empty slots hold 0.
    """

    def __init__(self, raw_leaves: np.ndarray) -> None:
        self.leaves = raw_leaves
        n_leaves = raw_leaves.shape[0]
        _, self.offs, self.depth = _tk.layout(n_leaves)
        self.inner = _tk.aligned_full(int(self.offs[-1]), 0.0)
        self.root = int(self.offs[self.depth])  #: the root's position in ``inner``
        self._scratch = np.empty(256, dtype=np.int64)
        self.rebuild()

    def fix(self, slots: np.ndarray) -> None:
        """Bring the tree up to date after writes to the leaves at ``slots`` (int64).

        ``slots`` must name every leaf written since the tree was last whole:
        a path stops where a node keeps its value (:func:`~fastper._kernels.tree.fix_max_paths`).
        """
        if self._scratch.shape[0] < slots.shape[0]:
            self._scratch = np.empty(slots.shape[0], dtype=np.int64)
        _tk.fix_max_paths(self.leaves, self.inner, self.offs, self.depth, slots, self._scratch)

    def fix_run(self, start: int, count: int) -> None:
        """Bring the tree up to date after writes to the leaves ``start .. start+count-1``
        (no wrap): each parent above the range once. O(count + log N)."""
        _tk.fix_max_range(self.leaves, self.inner, self.offs, self.depth, start, count)

    def rebuild(self) -> None:
        _tk.rebuild(self.leaves, self.inner, self.offs, self.depth, _tk.MAX)

    @property
    def max(self) -> float:
        return float(self.inner[self.root])


class Sampler:
    """Base: raw priorities only."""

    kind: ClassVar[str] = ""

    #: log of the largest allowed ``p ** alpha`` (only trees need a bound)
    log_limit = math.inf
    _limit_alpha: float  # (see _priority_limit)
    _limit: float

    def priority_limit(self, alpha: float | None = None) -> float:
        """Largest raw priority ``p`` with ``p ** alpha <= exp(log_limit)`` (inf if none)."""
        a = self.alpha if alpha is None else alpha
        if a <= 0.0 or self.log_limit == math.inf:
            return math.inf
        try:
            return math.exp(self.log_limit / a)
        except OverflowError:  # every finite p is allowed
            return math.inf

    def _priority_limit(self) -> float:
        """:meth:`priority_limit` of the alpha in force, computed once per alpha (for
        the compiled updates: ``log_limit`` is fixed when the sampler is made)."""
        if self._limit_alpha != self.alpha:
            self._limit = self.priority_limit()
            self._limit_alpha = self.alpha
        return self._limit

    #: the max tree over the raw priorities this sampler's writes keep up to date
    #: themselves (see :meth:`keep_max`); None: the caller fixes its own
    max_tree: PriorityMax | None = None

    def keep_max(self, tree: PriorityMax) -> None:
        """Offer to keep ``tree`` (a :class:`PriorityMax` over :attr:`raw_leaves`) up to
        date in :meth:`write`, :meth:`update_from_td` and :meth:`write_run`; the
        sampler took it if :attr:`max_tree` is ``tree`` afterwards. Here: never
        (the caller fixes the tree after each write)."""

    def __init__(self, capacity: int, alpha: float, raw_leaves: np.ndarray | None = None) -> None:
        self.capacity = capacity
        self.alpha = float(alpha)
        # padded and aligned so that a PriorityMax can share it; buffers switching
        # scheme hand the same array to the next sampler
        self.raw_leaves = new_priorities(capacity) if raw_leaves is None else raw_leaves
        self.raw = self.raw_leaves[:capacity]
        self._limit_alpha = math.nan  # the alpha _limit was computed for (none yet)
        self._limit = math.inf

    def write(self, slots: np.ndarray, p: np.ndarray, new: bool = False) -> None:
        _tk.write_leaves(self.raw, slots, p)

    def update_from_td(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, size: int, key_base: int, added: int, status: np.ndarray,
    ) -> float:  # fmt: skip
        """Validate an update, drop stale entries, write the rest (see
        :func:`fastper._kernels.ring.td_priorities` for ``status``); returns
        the largest priority written. The largest priority allowed is
        :meth:`priority_limit` (a subclass may lower it), here and in
        :meth:`check_priorities`."""
        b = idx.shape[0]
        out_idx = np.empty(b, dtype=np.int64)
        out_p = np.empty(b, dtype=np.float64)
        pmax = _ring.td_priorities(
            idx, td, keys, use_keys, eps, clip, self.priority_limit(), size, key_base,
            added, self.capacity, out_idx, out_p, status,
        )  # fmt: skip
        if status[0] == 0 and status[2]:
            self.write(out_idx[: status[2]], out_p[: status[2]])
        return float(pmax)

    def write_run(self, start: int, count: int, p: float) -> None:
        """Give new slots ``start .. start+count-1`` (no wrap) priority ``p``."""
        slots = np.arange(start, start + count, dtype=np.int64)
        self.write(slots, np.full(count, p), new=True)

    def set_alpha(self, alpha: float, n: int) -> None:
        self.alpha = float(alpha)

    def invalidate(self, slots: np.ndarray, n: int) -> None:
        """Give distinct stored ``slots`` zero mass: never drawn until written as new.

        ``n``: the stored slots are ``0 .. n-1``. O(B log N).
        """
        self.write(slots, np.zeros(slots.shape[0]))

    def all_valid(self) -> None:
        """Every stored slot is valid again (an index kept for invalid slots may go). O(1)."""

    def draw_state(self) -> Any:
        """What :meth:`sample` changes besides the draw (restored when reading rows fails)."""
        return None

    def restore_draw_state(self, state: Any) -> None:
        """Put back a :meth:`draw_state`."""

    def check_sampleable(self, n: int) -> None:
        """Raise if nothing can be drawn (only proportional can refuse)."""

    def check_priorities(self, name: str, p: np.ndarray, alpha: float | None = None) -> None:
        """Raise if priorities ``p`` (under ``alpha``) could overflow the index."""

    def sample(
        self,
        u: np.ndarray,
        n: int,
        beta: float,
        stratified: bool,
        norm: int,
        key_base: int,
        added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError

    def probabilities(self, idx: np.ndarray, n: int, batch_size: int | None = None) -> np.ndarray:
        """P(i) of a single exact draw for each slot in ``idx``. O(B)."""
        return np.full(idx.shape[0], 1.0 / n)

    def mass_find(self, targets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots under points of the sampling mass and their masses (see ``sample_mass``)."""
        raise TypeError(
            f"{self.kind} sampling has no additive mass to split across buffers; "
            "use uniform or proportional replay"
        )

    def mass_stats(self, n: int) -> tuple[float, float]:
        """(total mass, smallest positive mass) over the ``n`` stored slots."""
        raise TypeError(
            f"{self.kind} sampling has no additive mass to split across buffers; "
            "use uniform or proportional replay"
        )

    def chunk_masses(self, chunk_size: int, n: int) -> np.ndarray:
        """Sampling mass under each aligned chunk of ``chunk_size`` slots. O(N / chunk_size).

        Here (uniform, and rank-based, whose mass is not aggregated anywhere:
        an approximation there) the number of stored slots in each chunk; the
        stored slots are ``0 .. n-1``. For a tiered storage's placement.
        """
        n_chunks = -(-self.capacity // chunk_size)
        out = np.zeros(n_chunks, dtype=np.float64)
        full, rest = divmod(n, chunk_size)
        out[:full] = chunk_size
        if rest:
            out[full] = rest
        return out

    def clear(self) -> None:
        self.raw_leaves[:] = 0.0

    def reset_priorities(self, p: np.ndarray, n: int) -> None:
        """Take raw priorities ``p`` for slots ``0..n-1`` (0 beyond) and rebuild. O(N)."""
        if not np.shares_memory(p, self.raw):  # a switch hands over the same array
            self.raw[:n] = p
        self.raw_leaves[n:] = 0.0
        self.set_alpha(self.alpha, n)

    # checkpoints: JSON-able values and top-level numpy arrays
    def state_dict(self, n: int, out: np.ndarray | None = None) -> dict[str, Any]:
        """Priorities of the first ``n`` slots (a copy, into ``out[:n]`` if given) and
        the alpha in force. O(N)."""
        return {"alpha": self.alpha, "priorities": copy_priorities(self.raw, n, out)}

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """Where a loader may read this state's arrays in place (views of own memory)."""
        return {"priorities": self.raw[:n]}

    def load_state_dict(self, state: dict[str, Any], n: int) -> None:
        """Check ``state`` completely, then apply it (nothing changes on error). O(N)."""
        if set(state) != {"alpha", "priorities"}:
            raise ValueError(
                f"sampler state must have the entries ['alpha', 'priorities'], got {sorted(state)}"
            )
        p = check_priority_array("priorities", state["priorities"], n)
        alpha = float(state["alpha"])
        if not (math.isfinite(alpha) and alpha >= 0.0):
            raise ValueError(f"`alpha` must be finite and >= 0, got alpha={alpha!r}")
        self.check_priorities("priorities", p, alpha)
        self.alpha = alpha
        self.reset_priorities(p, n)


class PermutedSampler(Sampler):
    """A sampler whose compiled draw can also order its batch and prefetch the drawn
    rows: :meth:`sample_permuted` (the buffer calls it when a sampler has it);
    :meth:`sample` is that draw in stratum order."""

    def sample(
        self, u: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        return self.sample_permuted(u, NO_PERM, n, beta, stratified, norm, key_base, added)

    def sample_permuted(
        self, u: np.ndarray, perm: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int, rows: np.ndarray = NO_ROWS, row_bytes: int = 0,
        shuffle: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """:meth:`sample`, with every output indexed by ``perm`` (int64, a permutation
        of ``0 .. B-1``, B draws; empty: none). O(B log N).

        ``shuffle``: ``u`` holds ``2B`` uniforms, ``B`` for the draws and then
        ``B`` that order the batch (:func:`fastper.policy.batch_order` of
        ``u[B:]``); ``perm`` is not read. ``rows``: the storage's records as
        uint8, ``row_bytes`` per slot (see
        :attr:`fastper.storage.Storage.record_bytes`), whose drawn ones the draw
        prefetches for the gather after it. A hint only: the outputs are the
        same without it.
        """
        raise NotImplementedError  # pragma: no cover - each sampler's own

    def _permuted_batch(
        self, u: np.ndarray, perm: np.ndarray, shuffle: bool, rows: np.ndarray, row_bytes: int
    ) -> int:
        """The batch size of a :meth:`sample_permuted` call, its records and order
        checked (:func:`~fastper.storage.check_record_bytes`, :func:`check_order`)."""
        if row_bytes and rows.shape[0] < self.capacity * row_bytes:
            check_record_bytes((rows, row_bytes), self.capacity)  # raises, saying why
        if shuffle and not u.shape[0] & 1:  # the buffer's call: 2B uniforms, no perm
            return u.shape[0] >> 1
        return check_order(u, perm, shuffle)
