"""The insert half of a CPU buffer: rows into the ring, and which of them may be drawn.

:class:`RowsMixin` is composed into :class:`fastper.buffers.PrioritizedReplayBuffer`
and its siblings. An add is two-phase: the stages (per-stream n-step windows,
:mod:`fastper.nstep`; frame de-duplication, :mod:`fastper.frames`) compute
the rows without changing anything, storage writes them, and only then are
the windows, the ring, the priorities and the validity committed, so a call
that raises leaves the buffer as it was. Validity is per slot
(:mod:`fastper.validity`): a slot made invalid (its frames overwritten, its
row torn on disk) has zero mass in the index of every scheme until a new
transition is written into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._validation import as_index_array, as_value_array, check_int, check_row_ids, to_numpy
from .buffer_core import locked
from .buffer_sampling import SamplingMixin
from .samplers import PriorityMax
from .storage import Field, coerce_batch

__all__ = ["RowsMixin"]


class RowsMixin(SamplingMixin):
    """``add`` / ``adopt`` / ``invalidate`` of a CPU buffer (see the module)."""

    _input_fields: dict[str, Field]
    _current_max: PriorityMax | None

    def _new_priority(self) -> float:  # pragma: no cover - the buffer's
        raise NotImplementedError

    # -- add ---------------------------------------------------------------------
    @locked
    def add(
        self, transition: Mapping[str, Any], priorities: Any = None, *, env_ids: Any = None
    ) -> np.ndarray:
        """Store one transition or a batch (leading dimension); O(B log N).

        Args:
            transition: ``{field: value}`` for every field; a value of the
                field's shape is one transition, one with an extra leading
                dimension a batch. Values are cast to the field's dtype where no
                value changes (e.g. float64 -> float32, integral floats -> int).
                A NaN or inf reward is refused unless the buffer was made with
                ``allow_nonfinite_rewards=True``; NaN and inf in the other float
                fields (observations) are stored as given, unchecked.
            priorities: optional raw priorities p_i (>= 0, finite), one per
                transition; by default each gets :attr:`max_priority`. Not
                accepted with n-step or stream tracking.
            env_ids: the stream (env / actor id, int >= 0) of each row, for
                n-step windows and ``autoreset``; rows of one stream in one
                batch are consecutive steps. Not needed with ``n_envs`` (a
                batch is one step of every env) or for single transitions of
                one env.

        Returns:
            The slots written (int64); with n-step, those of the transitions
            completed by this call (possibly none).

        Raises:
            ValueError: missing / unknown fields, wrong shapes, an empty batch,
                a batch larger than the capacity (with n-step: one that would
                also complete more), bad priorities, a NaN or inf reward, or a
                batch whose streams are unknown (n-step without ``env_ids`` or
                ``n_envs``).
            FieldTypeError: a value that cannot be cast safely.
        """
        if self._frames is not None:
            return self._add_frames(transition, priorities, env_ids)
        if self._nstep is not None:
            self._refuse_priorities_with_windows(priorities)
            batch, k = coerce_batch(self._nstep.fields, transition, None)
            self._check_rewards(batch)
            plan = self._plan_windows(batch, k, env_ids)
            out, m = plan.out, plan.count
            # the rows first, the windows after: a storage whose write fails (a full
            # disk) leaves the windows as they were too
            slots = self._write_rows(out, m, None)
            self._nstep.commit(plan)
            return slots
        prepared, k = self._storage.prepare(transition)
        if self._reward_check is not None:
            self._check_rewards(prepared)
        check_row_ids(env_ids, k)
        return self._write(prepared, k, self._given_priorities(priorities, k))

    def _given_priorities(self, priorities: Any, k: int) -> np.ndarray | None:
        """``add``'s ``priorities`` as k checked values (None: not given)."""
        if priorities is None:
            return None
        arr = to_numpy(priorities)
        p = as_value_array("priorities", arr.reshape(-1) if arr.ndim == 0 else arr, k)
        self._sampler.check_priorities("priorities", p)
        return p

    def _write_rows(self, out: dict[str, np.ndarray], m: int, p: np.ndarray | None) -> np.ndarray:
        """Write ``m`` checked rows (``p``: their priorities, or None); the slots.

        An episode end flushes pending n-step windows with the batch: more than
        ``capacity`` may complete from a batch that fits. The ring keeps the
        last ``capacity`` of them, as if added one by one: only those are
        written, in one storage write (so a write that fails changes nothing),
        and the ring moves past all ``m`` (``p`` is None then: priorities are
        refused with n-step). Returns the slot of each of the ``m``.
        """
        cap = self._capacity
        if m == 0:
            return np.empty(0, dtype=np.int64)
        if m <= cap:
            return self._write(out, m, p)
        lost = m - cap  # overwritten within this call: never written
        first = self._writer.cursor
        self._write({f: a[lost:m] for f, a in out.items()}, cap, None, lost=lost)
        return (first + np.arange(m, dtype=np.int64)) % cap

    def _add_frames(self, transition: Any, priorities: Any, env_ids: Any) -> np.ndarray:
        """``add`` for a frame buffer: frames to the frame ring, ids to the transitions."""
        frames = self._frames
        assert frames is not None
        nstep = self._nstep
        if nstep is not None:
            self._refuse_priorities_with_windows(priorities)
        frames.check_frame_shapes(transition)
        batch, k = coerce_batch(self._input_fields, transition, None)
        self._check_rewards(batch)
        fplan = frames.plan(batch, k, env_ids)
        rows = fplan.batch
        p = None
        if nstep is not None:
            plan = self._plan_windows(rows, k, env_ids)
            out, m = plan.out, plan.count
        else:
            out, m = coerce_batch(self._storage.fields, rows, self._capacity)
            p = self._given_priorities(priorities, k)
        # every check has passed; the rows are written first, so a storage whose
        # write fails (a full disk) leaves the frames and windows as they were
        first_key = self._writer.added
        slots = self._write_rows(out, m, p)
        w = self._writer
        # the new transitions are filed below, so only older ones can lose a frame here
        lost = frames.commit(fplan, w.key_base, first_key)
        if nstep is not None:
            nstep.commit(plan)
        keys = first_key + np.arange(m, dtype=np.int64)
        born = frames.reference(out[frames.name][:m], out[frames.next_name][:m], keys, w.key_base)
        gone = self._invalidate_keys(np.concatenate([lost, born]))
        frames.invalidated_total += gone
        return slots

    def _refile_frames(self, n: int) -> None:
        """File every stored valid transition under its oldest frame again (after a load). O(N k)."""
        frames = self._frames
        assert frames is not None
        frames.reset_refs()
        w = self._writer
        keys = np.arange(w.added - n, w.added, dtype=np.int64)
        slots = (keys - w.key_base) % self._capacity
        valid = self._validity.valid(slots)
        keys, slots = keys[valid], slots[valid]
        if keys.shape[0] == 0:
            return
        ids = self._storage.gather(slots)
        born = frames.reference(ids[frames.name], ids[frames.next_name], keys, w.key_base)
        self._invalidate_keys(born)

    def _invalidate_keys(self, keys: np.ndarray) -> int:
        """Make the stored transitions among ``keys`` invalid; how many became so."""
        if keys.shape[0] == 0:
            return 0
        w = self._writer
        keys = keys[keys >= w.added - w.size]
        return self._invalidate_slots((keys - w.key_base) % self._capacity)

    def _invalidate_slots(self, slots: np.ndarray) -> int:
        """Zero mass and mask for the valid ones of stored ``slots``. O(B log N)."""
        fresh = self._validity.fresh(slots)
        if fresh.shape[0] == 0:
            return 0
        self._sampler.invalidate(fresh, len(self))
        self._validity.invalidate(fresh)
        if self._current_max is not None:
            self._current_max.fix(fresh)
        return int(fresh.shape[0])

    @locked
    def invalidate(self, indices: Any) -> int:
        """Make stored slots invalid: never drawn, under every scheme. O(B log N).

        An invalid slot has zero mass in the index, is not counted in the N of
        the IS weights, and updates to it are dropped, until ``add`` writes a
        new transition into it. For storages that find rows they cannot trust
        (a disk buffer's rows torn by a crash).

        Returns:
            How many of the slots became invalid (those already invalid excluded).

        Raises:
            InvalidIndexError: an index out of range or never written.
        """
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._invalidate_slots(idx)

    @locked
    def is_valid(self, indices: Any) -> np.ndarray:
        """Whether each stored slot may be drawn (see :meth:`invalidate`). O(B)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._validity.valid(idx).copy()

    @property
    def num_valid(self) -> int:
        """Transitions that can be sampled: ``len(self)`` less the invalid ones. O(1)."""
        return len(self) - self._validity.n_invalid

    @locked
    def adopt(self, count: int) -> np.ndarray:
        """Take the next ``count`` rows of the ring as written: storage holds them already.

        For a storage that wrote rows itself (a disk buffer reopened after a
        crash): the ring advances over them and each gets the new-transition
        priority, exactly as :meth:`add` would have given it. Only the last
        ``capacity`` rows count when ``count`` is larger. O(count log N).

        Returns:
            The slots taken (int64).
        """
        count = check_int("count", count, minimum=0)
        if count and self._frames is not None:
            raise ValueError(
                "`adopt` cannot take rows into a frame_stack buffer: their frames were never "
                f"written to the frame ring, got count={count}"
            )
        out: list[np.ndarray] = []
        left = count
        while left > 0:
            k = min(self._capacity, left)
            w = self._writer
            start = w.cursor
            slots = w.slots(start, k)
            priority = self._new_priority()
            w.advance(k)
            self._admit_run(start, k, priority)
            out.append(slots)
            left -= k
        if self._current_max is not None and out:
            self._current_max.fix(np.concatenate(out))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def _write(
        self, prepared: Mapping[str, np.ndarray], k: int, p: np.ndarray | None, lost: int = 0
    ) -> np.ndarray:
        """Write ``k <= capacity`` prepared rows, then commit ring, priorities, validity.

        ``lost``: rows the ring moves past first, never written (the earlier
        transitions of a call that completed more than the ring holds). The
        storage write comes first: if it fails, nothing has changed.
        """
        w = self._writer
        cap = self._capacity
        start = w.cursor if not lost else (w.cursor + lost) % cap
        slots = w.slots(start, k)
        for guard in self._guards:  # a save in progress keeps the rows it still needs
            guard.before_write(slots)
        priority = self._new_priority() if p is None else 0.0
        self._storage.write(start, prepared, k)
        while lost > 0:  # counters only: cannot fail
            step = min(cap, lost)
            w.advance(step)
            lost -= step
        w.advance(k)
        if p is None:
            if self._validity.n_invalid:
                self._admit_run(start, k, priority)
            else:  # every slot valid (the common case): one run, two if it wraps
                first = min(k, cap - start)
                self._sampler.write_run(start, first, priority)
                if first < k:
                    self._sampler.write_run(0, k - first, priority)
        else:
            self._max_seen = max(self._max_seen, float(p.max()))
            validity = self._validity
            if validity.n_invalid:
                validity.admit(slots)
                if not validity.n_invalid:
                    self._sampler.all_valid()
            self._sampler.write(slots, p, new=True)
        if self._current_max is not None:
            self._current_max.fix(slots)
        return slots

    def _admit_run(self, start: int, k: int, priority: float) -> None:
        """New transitions in ``k`` slots from ``start`` (wrapping): valid, with one
        priority for a contiguous run (two if it wraps)."""
        first = min(k, self._capacity - start)
        validity = self._validity
        if validity.n_invalid:  # (an attribute test: the common case costs nothing more)
            validity.admit_run(start, first)
            if first < k:
                validity.admit_run(0, k - first)
            if not validity.n_invalid:
                self._sampler.all_valid()
        self._sampler.write_run(start, first, priority)
        if first < k:
            self._sampler.write_run(0, k - first, priority)
