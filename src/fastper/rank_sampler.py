"""Rank-based sampling: P(i) proportional to rank(i)^-alpha, over an order-statistics tree.

The sampler of :class:`fastper.RankBasedReplayBuffer` (and of a buffer
switched to rank-based replay). Its tree and draws are the compiled kernels
of :mod:`fastper._kernels.rank`; this module keeps the pending re-rankings
(``sort_every``), the segment law of the paper's sampler, and the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._kernels import order as _order
from ._kernels import rank as _rk
from .sampler_base import (
    NO_ROWS,
    PermutedSampler,
    check_priority_array,
    copy_priorities,
    normalised_weights,
    slot_keys,
)

__all__ = ["RankSampler"]


class RankSampler(PermutedSampler):
    """P(i) = rank(i)^-alpha / sum_{r=1..N} r^-alpha, rank 1 = largest priority.

    Ties are broken by slot index (smaller slot = better rank), so the
    distribution is a deterministic function of the priorities.

    The ranks come from an order-statistics B+ tree over the keys
    ``(priority, slot)`` (:mod:`fastper._kernels.rank`): changing one slot's
    priority (a delete and an insert), the slot at a rank and the rank of a
    slot each cost O(log N), amortised (nodes come from fixed pools that are
    compacted in O(N) after at least N/6 inserts). A draw picks a rank from
    the exact law by inverting the prefix sums of ``r^-alpha`` with a guide
    table (O(1) expected, O(log N) at worst), then the slot at that rank
    (O(log N)); the IS weights and keys come from the same compiled call. An
    update is one compiled call too: it checks the entries, drops stale ones,
    then re-ranks in groups whose cache misses overlap, deleting the old keys
    of slots just sampled along the paths the sample took (a delete only
    marks the key dead: nothing moves).

    ``sort_every=None`` (exact, the default): every write re-ranks its slots
    at once. ``sort_every=K``: priority updates of slots already stored stay
    pending (``pending``) and reach the order every K samples (the paper
    re-sorts every 10^6 steps), in O(k log N) for k pending slots; slots
    written by ``add`` (``write(..., new=True)``, :meth:`write_run`), a slot
    overwritten when the ring wraps included, are ranked at once.

    ``segments=True`` samples as the paper does: the rank distribution is cut
    into ``B`` segments of (about) equal probability and one rank is drawn
    uniformly inside each. The reported probabilities and weights are those
    of this actual scheme: ``1 / (B * len(segment))``. With fewer stored items
    than ``B`` it falls back to exact draws.

    Memory per slot, beyond the 8-byte raw priority: 8 (``ranked``, the
    priority each slot is ranked by), 8 + 1 (``prefix``, the prefix sums of
    ``r^-alpha``, and its guide table), 1 + 4 (pending mark and list), and
    the tree: a leaf pool with room for 2 keys of 12 bytes per slot and a
    word of live marks per 32 keys (24.5 bytes, of which a tree 3/4 full
    touches 16.5: pages never written are not mapped) and an inner-node pool
    of about 5 bytes (1.2 in use). About 52 bytes reserved, about 40 in use.
    """

    kind = "rank"

    def __init__(
        self, capacity: int, alpha: float, *, sort_every: int | None = None,
        segments: bool = False, raw_leaves: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        if capacity > _rk.MAX_CAPACITY:
            raise ValueError(
                f"`capacity` must be <= {_rk.MAX_CAPACITY} for rank-based sampling (slots "
                f"are int32 in the rank tree), got capacity={capacity}"
            )
        super().__init__(capacity, alpha, raw_leaves)
        self.sort_every = sort_every
        self.segments = segments
        self.samples_since_sort = 0
        #: batch size of the last ``sample`` call (the segment law depends on it)
        self.last_batch_size: int | None = None
        self.prefix = np.empty(capacity, dtype=np.float64)
        _rk.rank_weights_prefix(self.alpha, capacity, self.prefix)
        self._guide, self._scale = _rk.guide_table(self.prefix)
        #: priority each slot is ranked by (differs from ``raw`` while pending); -1: unranked
        self.ranked = np.full(capacity, -1.0)
        #: slots whose priority changed but whose rank waits for the next sort
        self.pending = np.zeros(capacity, dtype=np.bool_)
        self._plist = np.zeros(capacity, dtype=np.int32)  # pending slots (may hold stale ones)
        (
            self._meta, self._lp, self._ls, self._lm, self._ip, self._isl, self._ic, self._ich,
            self._inn,
        ) = self._tree = _rk.new_tree(capacity)  # fmt: skip
        self._seg_cache: tuple[int, int, np.ndarray] | None = None
        self._scratch = np.empty((5, 256), dtype=np.int64)  # ranks, descent, order, slots
        self._views: tuple[Any, ...] | None = None  # of _scratch for one batch size
        # a write's scratch (paths routed ahead, what each change does, the group's
        # slots) and the last sample's records (count of draws, the routing version
        # then, whether the slot -> draw table is built; the table, built by the first
        # update that needs it; the records: paths, slots, batch order): see
        # _kernels.rank_writes._prepare and _drawn
        self._sample = np.zeros(3, dtype=np.int64)
        self._stab = np.empty(2 * 512, dtype=np.int64)
        self._spaths = np.empty(256 * _rk.MAXH, dtype=np.int64)
        self._warm_state = self._new_warm_state()
        # an update's priorities kept (slots, values), and how many of them the tree
        # did not take (the node pools ran out)
        self._kept_idx = np.empty(256, dtype=np.int64)
        self._kept_p = np.empty(256, dtype=np.float64)
        self._left = np.zeros(1, dtype=np.int64)

    def _new_warm_state(self) -> tuple[np.ndarray, ...]:
        return (
            np.empty(4 * _rk.WARM * _rk.MAXH, dtype=np.int64),
            np.empty(2 * _rk.WARM, dtype=np.int64),
            np.empty(8 * _rk.WARM, dtype=np.int64),
            self._sample, self._stab, self._spaths,
        )  # fmt: skip

    # -- writes ------------------------------------------------------------------
    def _run(self, call: Callable[[int], int], total: int, first: int | None = None) -> None:
        """Run a kernel that stops when the tree's node pools run out.

        ``call(k)`` resumes at item ``k`` and returns how many items it did
        (-1: the tree is corrupt). In between the tree is compacted: O(N),
        after at least N/6 inserts (see :mod:`fastper._kernels.rank`).
        ``first``: what a first call, already made, returned.
        """
        k = 0
        compacted = False
        while True:
            if first is None:
                done = call(k)
            else:
                done, first = first, None
            if done < 0 or (compacted and done == 0):  # pragma: no cover - only a bug
                raise RuntimeError("the rank tree is corrupt: internal error, please report it")
            k += done
            if k >= total:
                return
            _rk.compact(*self._tree)
            compacted = True

    def write(self, slots: np.ndarray, p: np.ndarray, new: bool = False) -> None:
        """Set raw priorities ``p`` (last duplicate wins). O(B log N), amortised.

        ``new``: the slots were just written by ``add`` and are ranked now even
        with ``sort_every``; otherwise ``sort_every`` defers their re-ranking.
        """
        defer = self.sort_every is not None and not new
        t, ranked, raw, pending, plist = (
            self._tree, self.ranked, self.raw, self.pending, self._plist,
        )  # fmt: skip
        self._run(
            lambda k: _rk.write(
                *t, ranked, raw, pending, plist, slots[k:], p[k:], defer, *self._warm_state
            ),
            slots.shape[0],
        )

    def update_from_td(
        self, idx: np.ndarray, td: np.ndarray, keys: np.ndarray, use_keys: bool, eps: float,
        clip: float, size: int, key_base: int, added: int, status: np.ndarray,
    ) -> float:  # fmt: skip
        """The base class's update (checks, stale keys dropped, then :meth:`write`) in
        one compiled call."""
        b = idx.shape[0]
        if self._kept_idx.shape[0] < b:
            self._kept_idx = np.empty(b, dtype=np.int64)
            self._kept_p = np.empty(b, dtype=np.float64)
        kept_idx, kept_p, left = self._kept_idx, self._kept_p, self._left
        pmax = _rk.update(
            *self._tree, self.ranked, self.raw, self.pending, self._plist,
            self.sort_every is not None, *self._warm_state, idx, td, keys, use_keys, eps, clip,
            self._priority_limit(), size, key_base, added, self.capacity, kept_idx, kept_p,
            status, left,
        )  # fmt: skip
        if left[0]:  # the node pools ran out: the rest after a compaction
            kept = int(status[2])
            d = kept - int(left[0])
            if d < 0:  # pragma: no cover - only a bug
                raise RuntimeError("the rank tree is corrupt: internal error, please report it")
            _rk.compact(*self._tree)
            self.write(kept_idx[d:kept].copy(), kept_p[d:kept].copy())
        return pmax

    def write_run(self, start: int, count: int, p: float) -> None:
        """New transitions in slots ``start .. start+count-1``: priority ``p``, ranked now."""
        t, ranked, raw, pending = self._tree, self.ranked, self.raw, self.pending
        done = _rk.write_run(*t, ranked, raw, pending, start, count, p)
        if done != count:  # the pools ran out (or a bug): the rest through _run
            self._run(
                lambda k: _rk.write_run(*t, ranked, raw, pending, start + k, count - k, p),
                count, done,
            )  # fmt: skip

    def draw_state(self) -> Any:
        """The counters a sample moves: samples since the last sort, the last batch size.

        A re-ranking that fell due during the sample stays applied when they
        are put back (the next sample would have applied it anyway)."""
        return (self.samples_since_sort, self.last_batch_size)

    def restore_draw_state(self, state: Any) -> None:
        self.samples_since_sort, self.last_batch_size = state

    def invalidate(self, slots: np.ndarray, n: int) -> None:
        """Take distinct ``slots`` out of the order: never drawn until written as new. O(B log N)."""
        t, ranked, raw, pending = self._tree, self.ranked, self.raw, self.pending
        if _rk.remove(*t, ranked, raw, pending, slots) < 0:  # pragma: no cover - only a bug
            raise RuntimeError("the rank tree is corrupt: internal error, please report it")
        self._seg_cache = None

    def set_alpha(self, alpha: float, n: int) -> None:
        """New alpha: the ranks stay, their weights are recomputed. O(N)."""
        self.alpha = float(alpha)
        _rk.rank_weights_prefix(self.alpha, self.capacity, self.prefix)
        self._guide, self._scale = _rk.guide_table(self.prefix)
        self._seg_cache = None

    def sort(self, n: int) -> None:
        """Re-rank every pending slot now; restarts the ``sort_every`` count. O(k log N)."""
        if self._meta[_rk.PLEN]:
            t, ranked, raw, pending, plist = (
                self._tree, self.ranked, self.raw, self.pending, self._plist,
            )  # fmt: skip
            meta = self._meta
            compacted = False
            while True:  # a re-ranking may take several compactions (each frees room
                # for at least N/6 inserts); none re-ranked after one is a bug
                left = int(meta[_rk.PCOUNT])
                code = _rk.apply_pending(*t, ranked, raw, pending, plist, *self._warm_state)
                if code == 1:
                    break
                stuck = compacted and int(meta[_rk.PCOUNT]) == left
                if code < 0 or stuck:  # pragma: no cover - only a bug
                    raise RuntimeError("the rank tree is corrupt: internal error, please report it")
                _rk.compact(*self._tree)
                compacted = True
        self.samples_since_sort = 0

    def _maybe_sort(self, n: int) -> None:
        if self.sort_every is not None and self.samples_since_sort >= self.sort_every:
            self.sort(n)

    # -- queries -------------------------------------------------------------------
    @property
    def n_changed(self) -> int:
        """Slots whose priority changed since the last sort (pending re-ranking)."""
        return int(self._meta[_rk.PCOUNT])

    @property
    def m(self) -> int:
        """Slots in the order."""
        return int(self._meta[_rk.SIZE])

    @property
    def order(self) -> np.ndarray:
        """Every ranked slot, best rank first (a copy, for inspection). O(N)."""
        keys_p = np.empty(self.m, dtype=np.float64)
        keys_s = np.empty(self.m, dtype=np.int32)
        _rk.read_in_order(*(*self._tree, keys_p, keys_s))
        return keys_s.astype(np.int64)

    def ranks(self, idx: np.ndarray, n: int) -> np.ndarray:
        """0-based rank of each slot in ``idx`` (slots < ``n``) in the order the next
        sample uses (a sort that is due is done first). O(B log N)."""
        self._maybe_sort(n)
        out = np.empty(idx.shape[0], dtype=np.int64)
        _rk.rank_of(*self._tree, self.ranked, idx, out)
        return out

    def probabilities(self, idx: np.ndarray, n: int, batch_size: int | None = None) -> np.ndarray:
        """P(i) of one draw for each slot in ``idx``, under the law ``sample`` uses.

        Exact draws: ``rank^-alpha / sum_r r^-alpha`` (``batch_size`` unused).
        Segments: ``1 / (B * len(segment))`` for ``B = batch_size``, by default
        the last sample's batch size (exact draws when ``n < B``). O(B log N).

        Raises:
            ValueError: a segments sampler, no ``batch_size`` and no sample yet.
        """
        b = self.last_batch_size if batch_size is None else batch_size
        if self.segments and b is None:
            raise ValueError(
                "`batch_size` must be given before the first sample of a segments=True "
                "buffer (its law depends on the batch size), got batch_size=None"
            )
        r = self.ranks(idx, n)
        if self.segments and b is not None and n >= b:
            bounds = self._bounds(n, b)
            seg = np.searchsorted(bounds, r, side="right") - 1
            return 1.0 / (b * np.diff(bounds)[seg].astype(np.float64))
        return np.power(r + 1.0, -self.alpha) / self.prefix[n - 1]

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

    # -- sampling ------------------------------------------------------------------
    def sample_permuted(
        self, u: np.ndarray, perm: np.ndarray, n: int, beta: float, stratified: bool, norm: int,
        key_base: int, added: int, rows: np.ndarray = NO_ROWS, row_bytes: int = 0,
        shuffle: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """:meth:`PermutedSampler.sample_permuted`. Exact draws order the batch and
        prefetch the rows inside their compiled call; the segment law orders its
        outputs after its draw. O(B log N)."""
        b = self._permuted_batch(u, perm, shuffle, rows, row_bytes)
        if self.sort_every is not None:
            self._sample[0] = 0  # a sort that falls due routes its keys (no draw's paths)
            self._maybe_sort(n)
        self.samples_since_sort += 1
        self.last_batch_size = b
        views = self._views
        if views is None or views[0] != b:
            views = self._batch_views(b)
        _, ranks, node, rem, shuffled, sel = views
        idx = np.empty(b, dtype=np.int64)
        if self.segments and n >= b:
            bounds = self._bounds(n, b)
            lengths = np.diff(bounds)
            if stratified:
                seg = np.arange(b)
                frac = u[:b]
            else:
                scaled = u[:b] * b
                seg = np.minimum(scaled.astype(np.int64), b - 1)
                frac = scaled - seg
            ranks[:] = bounds[seg] + np.minimum(
                (frac * lengths[seg]).astype(np.int64), lengths[seg] - 1
            )
            prob = 1.0 / (b * lengths[seg].astype(np.float64))
            pmin = 1.0 / (b * float(lengths.max()))
            # the draws' paths, for an update of these slots (it need not route)
            _rk.select(*self._tree, ranks, node, rem, idx, self._spaths, self._sample)
            keys = slot_keys(idx, key_base, added, self.capacity)
            weights = normalised_weights(prob, 1.0, pmin, n, beta, norm)
            if shuffle:
                perm = np.empty(b, dtype=np.int64)
                _order.batch_order(u[b : 2 * b], perm)
            if perm.shape[0]:
                idx, prob, weights, keys = idx[perm], prob[perm], weights[perm], keys[perm]
                self._spaths[_rk.DRAW : b * _rk.MAXH : _rk.MAXH] = perm  # output k: draw perm[k]
            return idx, prob, weights, keys
        prob = np.empty(b, dtype=np.float64)
        weights = np.empty(b, dtype=np.float64)
        keys = np.empty(b, dtype=np.int64)
        pmin = float(n) ** (-self.alpha) / self.prefix[n - 1]
        if shuffle:
            order = shuffled  # filled there
        else:  # (the kernel may write its order argument: a read-only one is copied)
            order = perm if perm.flags.writeable else perm.copy()
        # the kernel records the draws' paths and their count (self._sample): an
        # update of these slots need not route
        _rk.sample_exact(
            *self._tree, self.prefix, self._guide, self._scale, n, u, order, shuffle,
            stratified, self.alpha, ranks, node, rem, sel, idx, prob, self._spaths, self._sample,
            key_base, added, keys, float(beta), norm, pmin, weights, rows, row_bytes,
        )  # fmt: skip
        return idx, prob, weights, keys

    def _batch_views(self, b: int) -> tuple[Any, ...]:
        """The scratch of a draw of ``b`` (grown when ``b`` is larger than ever):
        ``(b, ranks, node, rem, order, slots)``, kept for the next draw of ``b``."""
        if self._scratch.shape[1] < b:
            self._scratch = np.empty((5, b), dtype=np.int64)
            self._stab = np.empty(4 << int(b - 1).bit_length(), dtype=np.int64)
            self._spaths = np.empty(b * _rk.MAXH, dtype=np.int64)
            self._sample[0] = 0  # the recorded paths were in the tables replaced
            self._warm_state = self._new_warm_state()
        sc = self._scratch
        self._views = (b, sc[0, :b], sc[1, :b], sc[2, :b], sc[3, :b], sc[4, :b])
        return self._views

    # -- whole-state operations ------------------------------------------------------
    def _rebuild(self, n: int) -> None:
        """The tree from ``ranked[:n]``: a stable sort, then a bulk load. O(N log N)."""
        slots = np.argsort(-self.ranked[:n], kind="stable")
        _rk.bulk_load(*(*self._tree, self.ranked[slots], slots.astype(np.int32)))

    def _set_ranked(self, n: int, slots: np.ndarray, old: np.ndarray) -> None:
        """Rank slots ``0..n-1`` by ``raw``, the ``slots`` pending with keys ``old``."""
        self._sample[0] = 0  # the last sample's paths die with the tree
        self.ranked[:n] = self.raw[:n]
        self.ranked[slots] = old
        self.ranked[n:] = -1.0
        self.pending[:] = False
        self.pending[slots] = True
        k = slots.shape[0]
        self._plist[:k] = slots
        self._meta[_rk.PLEN] = k
        self._meta[_rk.PCOUNT] = k
        self._rebuild(n)

    def clear(self) -> None:
        super().clear()
        self._set_ranked(0, _NO_SLOTS, _NO_PRIORITIES)
        self.samples_since_sort = 0

    def reset_priorities(self, p: np.ndarray, n: int) -> None:
        """Slots ``0..n-1`` get raw priorities ``p`` (0 beyond), all ranked now, nothing
        pending. O(N log N).

        Raises:
            ValueError: ``p`` is not ``n`` finite float64 priorities >= 0.
        """
        check_priority_array("p", p, n)
        if not np.shares_memory(p, self.raw):
            self.raw[:n] = p
        self.raw_leaves[n:] = 0.0
        self._set_ranked(n, _NO_SLOTS, _NO_PRIORITIES)
        self.samples_since_sort = 0

    _STATE_KEYS = (
        "alpha", "priorities", "pending_slots", "pending_ranked", "samples_since_sort",
        "last_batch_size",
    )  # fmt: skip

    def state_dict(self, n: int, out: np.ndarray | None = None) -> dict[str, Any]:
        """What the order cannot be rebuilt without, over slots ``0..n-1``. O(N).

        ``alpha``; ``priorities``: raw p_i (a copy, into ``out[:n]`` if given);
        ``pending_slots`` (ascending) and ``pending_ranked``: the slots whose
        re-ranking waits for the next sort and the priority each is ranked by
        until then; ``samples_since_sort``; ``last_batch_size`` (None before
        the first sample). The tree itself is rebuilt on load.
        """
        pend = np.flatnonzero(self.pending[:n]).astype(np.int64)
        return {
            "alpha": self.alpha,
            "priorities": copy_priorities(self.raw, n, out),
            "pending_slots": pend,
            "pending_ranked": self.ranked[pend].copy(),
            "samples_since_sort": int(self.samples_since_sort),
            "last_batch_size": self.last_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any], n: int) -> None:
        """Restore a :meth:`state_dict` over slots ``0..n-1``. O(N log N).

        Everything is checked before anything changes.

        Raises:
            ValueError: a missing or unknown entry, or one with a bad type,
                shape or value (named in the message).
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"rank sampler state must be a mapping, got {type(state).__name__}")
        missing = [k for k in self._STATE_KEYS if k not in state]
        unknown = sorted(str(k) for k in state if k not in self._STATE_KEYS)
        if missing or unknown:
            raise ValueError(
                f"rank sampler state must have exactly the entries {list(self._STATE_KEYS)}, "
                f"got missing={missing}, unknown={unknown}"
            )
        if not 0 <= n <= self.capacity:
            raise ValueError(f"`n` must be in [0, {self.capacity}], got n={n}")
        alpha = state["alpha"]
        number = isinstance(alpha, int | float) and not isinstance(alpha, bool)
        if not (number and 0 <= alpha < math.inf):
            raise ValueError(f"`alpha` must be a finite number >= 0, got alpha={alpha!r}")
        p = check_priority_array("priorities", state["priorities"], n)
        slots = state["pending_slots"]
        if not (isinstance(slots, np.ndarray) and slots.ndim == 1 and slots.dtype.kind in "iu"):
            what = f"{slots.dtype}{slots.shape}" if isinstance(slots, np.ndarray) else type(slots)
            raise ValueError(f"`pending_slots` must be a 1-D integer array, got {what}")
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= n):
            raise ValueError(
                f"`pending_slots` must lie in [0, {n}), got values from {int(slots.min())} "
                f"to {int(slots.max())}"
            )
        if np.unique(slots).shape[0] != slots.shape[0]:
            raise ValueError("`pending_slots` must not repeat a slot")
        if slots.size and self.sort_every is None:
            raise ValueError(
                f"`pending_slots` must be empty with sort_every=None (exact ranks), "
                f"got {slots.shape[0]} pending slots"
            )
        old = check_priority_array("pending_ranked", state["pending_ranked"], slots.shape[0])
        since = state["samples_since_sort"]
        if type(since) is not int or since < 0:
            raise ValueError(
                f"`samples_since_sort` must be an int >= 0, got samples_since_sort={since!r}"
            )
        last = state["last_batch_size"]
        if last is not None and (type(last) is not int or last < 1):
            raise ValueError(
                f"`last_batch_size` must be None or an int >= 1, got last_batch_size={last!r}"
            )
        # everything checked: apply
        self.raw[:n] = p
        self.raw_leaves[n:] = 0.0
        self._set_ranked(n, slots.astype(np.int64), old)
        self.samples_since_sort = since
        self.last_batch_size = last
        self.set_alpha(float(alpha), n)


_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_PRIORITIES = np.empty(0, dtype=np.float64)
