"""The sampling half of a CPU buffer: draw, gather, and a buffer's part of a sample
over several buffers.

:class:`SamplingMixin` is composed into :class:`fastper.buffers.PrioritizedReplayBuffer`
and its siblings; the rules it applies (stratified targets, IS weights) are
:mod:`fastper.policy`'s, through the sampler. Under the buffer's lock it
checks, moves the schedules and draws; rows are read by :meth:`SamplingMixin.gather`
without the lock, or under it by :meth:`SamplingMixin.sample`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernels import order as _order
from ._validation import as_1d as _as_1d
from ._validation import (
    as_index_array,
    as_value_array,
    check_int,
    check_real,
    show,
    to_numpy,
)
from .batch import SMALL_BATCH, SMALL_ROW, Gathered, MassSample, SampleBatch, check_batch_size
from .buffer_core import locked
from .buffer_state import StateMixin
from .errors import EmptyBufferError, InvalidIndexError
from .frames import FrameStore
from .samplers import NO_PERM, NO_ROWS, NORM_CODES
from .storage import PlacedByMass, check_record_bytes

#: what a storage without records gives the search to prefetch: nothing
_NO_RECORDS = (NO_ROWS, 0)

__all__ = ["SamplingMixin"]


class SamplingMixin(StateMixin):
    """``get`` / ``sample`` / ``draw`` / ``gather`` / ``sample_mass`` of a CPU buffer (see the module)."""

    _frames: FrameStore | None
    _stratified: bool
    _shuffle: bool
    _weight_norm: str
    _gather_can_fail: bool
    _concurrent_gather: bool
    _placed: PlacedByMass | None
    _row_nbytes: int
    _last_draw: tuple[int, Any] | None = None  # (step after it, what to put back): see undraw
    _perm_out: np.ndarray | None = None
    #: the storage's ``record_bytes`` last checked (see _draw)
    _records_checked: tuple[np.ndarray, int] | None = None

    @property
    def num_valid(self) -> int:  # pragma: no cover - the buffer's
        raise NotImplementedError

    def _gather(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        data = self._storage.gather(idx)
        return data if self._frames is None else self._frames.gather(data)

    @locked
    def probabilities(self, indices: Any, batch_size: int | None = None) -> np.ndarray:
        """P(i) one draw picks each slot with, under the law ``sample`` uses. O(B) (rank: O(B log N)).

        ``batch_size`` matters only to a rank-based buffer with ``segments=True``
        (default: the last sample's batch size).
        """
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, minimum=1)
        if len(self) == 0:
            return np.empty(0, dtype=np.float64)
        if self._validity.all_valid:
            return self._sampler.probabilities(idx, len(self), batch_size)
        nv = self.num_valid
        valid = self._validity.valid(idx)
        prob = np.zeros(idx.shape[0], dtype=np.float64)
        if nv and valid.any():
            prob[valid] = self._sampler.probabilities(idx[valid], nv, batch_size)
        return prob

    # -- read ------------------------------------------------------------------
    @locked
    def get(self, indices: Any) -> dict[str, np.ndarray]:
        """The rows stored in slots ``indices``, read without sampling. O(B) (B slots).

        Returns the fields a :class:`SampleBatch` holds for the same slots
        (``batch.data``: every stored field, ``discount`` with n-step returns,
        frame stacks rebuilt for ``frame_stack`` buffers), each with a leading
        dimension of ``len(indices)`` (a single index gives one row), as new
        arrays. Slots are ring positions, as in ``batch.indices``; use
        :meth:`keys` for the transition each holds. Draws nothing and changes
        nothing: the random generator, the step and the priorities stay as
        they were (a tiered storage may move chunks between its tiers, as any
        read does).

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``, a slot never
                written, or a slot made invalid (see :meth:`invalidate`;
                a frame buffer's slot whose frames were overwritten).
            TypeError, ValueError: indices that are not integers, or not 1-D.
        """
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        if self._validity.n_invalid:
            bad = idx[~self._validity.valid(idx)]
            if bad.size:
                why = (
                    "their frames were overwritten in the frame ring"
                    if self._frames is not None
                    else "see invalidate()"
                )
                raise InvalidIndexError(
                    f"`indices` must name valid slots, got invalid slots "
                    f"{show(np.unique(bad)[:8])} ({why})"
                )
        return self._gather(idx)

    # -- sample ----------------------------------------------------------------
    def sample(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` transitions with replacement. O(B log N).

        With an alpha schedule, alpha changes only at steps that are
        multiples of :attr:`alpha_every` (each change re-weighs every priority,
        O(N)); the probabilities and weights are those of the alpha in force.

        The rows are read under the buffer's lock, so that a read that fails
        (a disk error) can put back everything the draw changed. To read slow
        storage without blocking other threads' adds, use :meth:`draw` and
        :meth:`gather` (as :class:`~fastper.RateLimitedBuffer` does).

        Args:
            batch_size: number of draws, >= 1 (may exceed ``len(self)``).
            beta: IS exponent; by default the beta schedule at :attr:`step`.

        Returns:
            A frozen :class:`SampleBatch`, in random order unless ``shuffle=False``.

        Raises:
            EmptyBufferError: the buffer holds nothing.
            ZeroPriorityError: every priority is zero (proportional).
            ValueError, TypeError: a bad ``batch_size`` (at most 2^24, or what
                fits in memory) or ``beta``.
        """
        # (not @locked, nor `with`: acquire and release cost less than a context
        # manager's calls, on the most frequent calls)
        lock = self._lock
        lock.acquire()
        try:
            if self._run_count:  # new transitions' priorities not yet in the index
                self._flush_run()
            idx, prob, weights, keys, beta_v, undo = self._draw(batch_size, beta)
            try:
                data = self._gather(idx)
            except BaseException:
                if undo is not None:
                    self._undo_draw(undo)
                raise
            self._after_draw()
            return SampleBatch._made(data, idx, weights, prob, keys, beta_v)
        finally:
            lock.release()

    @locked
    def draw(
        self, batch_size: int, beta: float | None = None, *, advance: bool = True
    ) -> SampleBatch:
        """The first half of :meth:`sample`: indices, keys, probabilities and weights. O(B log N).

        Draws exactly as ``sample`` does (same generator, same step), but
        reads no rows: ``data`` is empty. Read them with :meth:`gather`, which
        does not hold the buffer's lock while it reads (for storages whose reads
        may run beside writes: RAM and disk), so a slow read does not block
        other threads' adds meanwhile.

        Args:
            batch_size, beta: as for :meth:`sample` (the batch's ``beta`` says
                which was used).
            advance: ``False`` for draws that belong to a sample already
                counted (rows drawn again because theirs were overwritten
                during the read): :attr:`step` stays, and so do the schedules.

        Raises:
            As :meth:`sample`.
        """
        idx, prob, weights, keys, beta_v, undo = self._draw(batch_size, beta)
        if advance:
            self._after_draw()
            self._last_draw = None if undo is None else (self._step, undo)
        return SampleBatch({}, idx, weights, prob, keys, beta_v)

    @locked
    def undraw(self) -> bool:
        """Put back the latest :meth:`draw` when reading its rows failed. O(1).

        Restores the random generator, :attr:`step`, alpha and a rank-based
        sampler's counters, if no other draw or sample came since, the draw
        switched no scheme (updates since then went to the new index) and the
        storage's reads can fail at all. Returns whether it did.
        """
        last = self._last_draw
        self._last_draw = None
        if last is None or last[0] != self._step or last[1][1] is not self._sampler:
            return False
        self._undo_draw(last[1])
        self._step -= 1
        return True

    def gather(self, indices: Any, keys: Any) -> Gathered:
        """The rows of drawn slots, read without holding the lock while reading. O(B).

        Args:
            indices, keys: from :meth:`draw`.

        Returns:
            ``(data, fresh)`` (a :class:`~fastper.batch.Gathered`): the rows,
            and a bool per row that is False where the slot was overwritten (its
            key changed), made invalid or emptied (a ``clear``) since the draw:
            that row belongs to another transition (or none), and must be
            dropped or drawn again, never used with the drawn key.

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)``.
            ValueError: keys of another length.
        """
        with self._lock:
            idx = as_index_array("indices", indices, self._capacity)
            key_arr = _as_1d("keys", keys, "iu")
            if key_arr.shape[0] != idx.shape[0]:
                raise ValueError(
                    f"`keys` must have {idx.shape[0]} entries (one per index), got keys with "
                    f"{key_arr.shape[0]}"
                )
        if self._concurrent_gather:
            data = self._gather(idx)  # outside the lock: adds may overwrite rows meanwhile
        else:  # a storage whose reads change its own state (tiers) reads under the lock
            with self._lock:
                data = self._gather(idx)
        with self._lock:
            stored = idx < len(self)
            fresh = stored.copy()
            if stored.any():
                live = idx[stored]
                fresh[stored] = (self._writer.keys(live) == key_arr[stored]) & (
                    self._validity.valid(live)
                )
        return Gathered(data, fresh)

    def _draw(
        self, batch_size: int, beta: float | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, Any]:
        """Check, then draw (the caller holds the lock). When a later read may fail
        (``gather_can_fail``), what the draw changed comes back too, for :meth:`_undo_draw`."""
        b = batch_size
        if type(b) is not int or not 0 < b <= SMALL_BATCH or self._row_nbytes > SMALL_ROW:
            b = check_batch_size(batch_size, self._row_nbytes)
        beta_v = self._check_beta(self._beta_schedule(self._step) if beta is None else beta)
        n = self._writer.size - self._validity.n_invalid
        if n <= 0:
            self._sampleable()  # raises, saying why
        # a storage that reads files can fail in gather: everything the draw changes
        # (the generator, a scheme switch that fell due, alpha, the sampler's
        # counters) is then put back
        undo = (
            (
                self._rng.bit_generator.state, self._sampler, self._scheme,
                self._scheme_options, self._alpha_schedule, self._pending_switch,
                self._sampler.alpha, self._sampler.draw_state(),
            )
            if self._gather_can_fail
            else None
        )  # fmt: skip
        # a records storage's rows are prefetched by the search, for the gather (what
        # the storage says of them is checked when it changes, before anything else)
        records = getattr(self._storage, "record_bytes", _NO_RECORDS)
        if records is not self._records_checked:
            check_record_bytes(records, self._capacity)
            self._records_checked = records
        rows, row_bytes = records
        pending = self._pending_switch
        if pending is not None and self._step >= pending["at_step"]:
            self._switch(pending)  # checks before it changes anything
        alpha = self._alpha_at(self._step)
        old_alpha = self._sampler.alpha
        try:
            self._apply_alpha(alpha)
            self._sampler.check_sampleable(n)
        except BaseException:
            self._apply_alpha(old_alpha)
            raise
        # Nothing below can fail on valid state, so the generator only advances
        # once every check has passed: a raising call leaves it untouched.
        # Slices come out in slot order, so a batch is shuffled (minibatches cut
        # from it would each get a contiguous piece of the ring): B uniforms for
        # the targets, then B for the order (fastper.policy, "Batch order").
        shuffle = self._shuffle and b > 1
        draws = self._rng.random(2 * b if shuffle else b)
        w = self._writer
        sampler = self._sampler
        norm = NORM_CODES[self._weight_norm]
        permuted = getattr(sampler, "sample_permuted", None)  # orders the draws itself
        if permuted is not None:  # (the batch order too, from draws[b:])
            idx, prob, weights, keys = permuted(
                draws, NO_PERM, n, beta_v, self._stratified, norm, w.key_base, w.added, rows,
                row_bytes, shuffle,
            )  # fmt: skip
            return idx, prob, weights, keys, beta_v, undo
        idx, prob, weights, keys = sampler.sample(
            draws[:b], n, beta_v, self._stratified, norm, w.key_base, w.added
        )
        if not shuffle:
            return idx, prob, weights, keys, beta_v, undo
        perm = self._permutation(draws[b:])
        return idx[perm], prob[perm], weights[perm], keys[perm], beta_v, undo

    def _permutation(self, v: np.ndarray) -> np.ndarray:
        """:func:`fastper.policy.batch_order` of uniforms ``v`` (float64, 1-D), in a reused
        array (the caller holds the lock; the array is only read before the next draw).

        The kernel is called directly: both arrays are made here, so the policy
        function's checks of them (about 0.4 us) would only repeat what holds.
        """
        b = v.shape[0]
        perm = self._perm_out
        if perm is None or perm.shape[0] != b:
            perm = self._perm_out = np.empty(b, dtype=np.int64)
        _order.batch_order(v, perm)
        return perm

    def _undo_draw(self, undo: tuple[Any, ...]) -> None:
        """Put back what :meth:`_draw` changed (a read of its rows failed)."""
        rng, sampler, scheme, options, alpha_schedule, pending, alpha, counters = undo
        self._rng.bit_generator.state = rng
        # a switch built a new index over the same raw priorities: the old one is intact
        self._sampler, self._scheme, self._scheme_options = sampler, scheme, options
        self._alpha_schedule, self._pending_switch = alpha_schedule, pending
        self._apply_alpha(alpha)
        sampler.restore_draw_state(counters)

    def _after_draw(self) -> None:
        self._last_draw = None  # another draw came: an earlier one can no longer be put back
        placed = self._placed
        if placed is not None and placed.wants_masses:  # a tiered storage places chunks by mass
            placed.rebalance(self._sampler.chunk_masses(placed.mass_chunk_size, len(self)))
        self._step += 1

    def _sampleable(self) -> int:
        """The number of slots a draw may pick; raises when there is none. O(1)."""
        if len(self) == 0:
            raise EmptyBufferError("cannot sample from an empty buffer (len(buffer) == 0)")
        n = self.num_valid
        if n == 0:
            why = (
                "the frame ring overwrote their frames; raise `frame_capacity`"
                if self._frames is not None
                else "every stored slot was invalidated"
            )
            raise EmptyBufferError(
                f"cannot sample: none of the {len(self)} stored transitions is valid ({why})"
            )
        return n

    # -- a part of a sample over several buffers ---------------------------------
    @locked
    def sample_mass(self, targets: Any, view_total: float | None = None) -> MassSample:
        """The slots under given points of this buffer's sampling mass. O(B log N).

        A buffer's half of a sample drawn over several buffers (the shards of
        :mod:`fastper.distributed`): a coordinator that knows every buffer's
        total mass draws stratified points over their union and sends each
        buffer the points that fall in its share, as offsets into its mass
        (``p_i ** alpha`` per slot when proportional, 1 per slot when uniform).
        If the mass changed since the coordinator's view ``view_total``, the
        points are rescaled to the current total: the buffer's share stays the
        one the coordinator drew with, the slot within it follows the current
        priorities, and the masses returned are the ones actually used.

        Uses no randomness and does not advance :attr:`step`: the caller owns
        the draws, beta and the weights (``masses`` and ``total`` give them).

        Args:
            targets: points in ``[0, view_total]`` (``[0, total]`` without a view).
            view_total: the total the points were drawn against, or ``None``.

        Raises:
            EmptyBufferError: nothing stored. ZeroPriorityError: all masses zero.
            TypeError: rank-based sampling (its mass is not additive).
            ValueError: points outside the range, not finite, or not 1-D.
        """
        n = self._sampleable()
        sampler = self._sampler
        total, min_mass = sampler.mass_stats(n)
        sampler.check_sampleable(n)
        arr = to_numpy(targets)
        if arr.ndim != 1:
            raise ValueError(f"`targets` must be 1-D, got targets with shape {arr.shape}")
        view = total if view_total is None else check_real("view_total", view_total)
        if not view > 0.0:
            raise ValueError(f"`view_total` must be > 0, got view_total={view!r}")
        t = as_value_array("targets", arr, arr.shape[0], nonnegative=True)
        if t.size and t.max() > view:
            raise ValueError(
                f"`targets` must be <= view_total={view!r}, got max target {float(t.max())!r}"
            )
        if view != total:
            t = t * (total / view)
        idx, masses = sampler.mass_find(t, n)
        w = self._writer
        return MassSample(
            data=self._gather(idx),
            indices=idx,
            keys=w.keys(idx),
            masses=masses,
            total=total,
            min_mass=min_mass,
            size=n,
            added=w.added,
        )

    @locked
    def mass_stats(self) -> tuple[float, float, int, int]:
        """(total mass, smallest positive mass, size, transitions ever added), O(1).

        What a coordinator of several buffers needs to split a sample among
        them (see :meth:`sample_mass`); rank-based buffers raise TypeError.
        """
        n = self.num_valid
        total, min_mass = self._sampler.mass_stats(n)
        return total, min_mass, n, self._writer.added
