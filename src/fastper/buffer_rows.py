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

from ._validation import (
    as_index_array,
    as_value_array,
    check_int,
    check_row_ids,
    to_numpy,
)
from .buffer_core import locked
from .buffer_sampling import SamplingMixin
from .samplers import PriorityMax
from .storage import DirectRows, Field, Storage, coerce_batch

__all__ = ["RowsMixin"]

#: the longest run of single adds whose priorities wait for the index: a flush
#: stays O(RUN_LIMIT + log N)
RUN_LIMIT = 1024
_INT64 = np.dtype(np.int64)
#: the most rows of a vector step whose size the no-cast stores learn (see
#: RowsMixin._learn_block): larger batches gain little from it
BLOCK_ROWS_MAX = 64
#: what :meth:`RowsMixin._store_direct` returns where its caller wants no slots
_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_SLOTS.setflags(write=False)


class RowsMixin(SamplingMixin):
    """``add`` / ``adopt`` / ``invalidate`` of a CPU buffer (see the module)."""

    _input_fields: dict[str, Field]
    _current_max: PriorityMax | None
    #: (storage, its no-cast path, that path's one-call store with the reward check):
    #: rebuilt when a load swaps the storage
    _direct: tuple[Any, DirectRows | None, Any] | None = None
    _run_start: int = 0
    _run_priority: float = 0.0
    #: (the no-cast path, its stores with the reward check for :meth:`_add_exact`): built
    #: on first use, rebuilt for another no-cast path
    _exact_put: tuple[DirectRows, Any] | None = None
    #: the rows of the vector steps this buffer's adds bring (the first of at most
    #: BLOCK_ROWS_MAX rows; None: none yet), which its no-cast stores take by blocks
    _block_rows: int | None = None
    #: the no-cast matcher of the n-step input (built on first use)
    _window_matcher: DirectRows | None = None

    def _new_priority(self) -> float:  # pragma: no cover - the buffer's
        raise NotImplementedError

    # -- add ---------------------------------------------------------------------
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
        # (not @locked, nor `with`: acquire and release cost less than a context
        # manager's calls, on the most frequent calls)
        lock = self._lock
        lock.acquire()
        try:
            if type(transition) is dict and priorities is None:
                nstep = self._nstep
                if nstep is not None:
                    # _add_window_row's most frequent case, without its call (the
                    # writer's step made for this storage, a buffer in its common
                    # state): a change there is a change here
                    cached, made = self._direct, nstep._step
                    if (
                        made is not None
                        and cached is not None
                        and made[0] is cached[1]
                        and cached[0] is self._storage
                        and made[1] is not None
                        and not self._guards
                        and not self._validity.n_invalid
                    ):
                        n = made[1](
                            nstep, transition, env_ids, self._reward_check is not None,
                            self._writer.cursor,
                        )  # fmt: skip
                        if n > 0:
                            return self._store_direct(None, None, n)
                        if n < 0:  # a vector step waits in the windows: nothing stored
                            return np.empty(0, dtype=np.int64)
                        slots = self._add_window_row(transition, env_ids, False)
                    else:
                        slots = self._add_window_row(transition, env_ids)
                    if slots is not None:
                        return slots
                elif env_ids is None:
                    # The no-cast add of rows on a buffer in its common state: the
                    # general path's rules at a fraction of its cost (one env step is
                    # most adds). The storage's one-call store (DirectRows.putter)
                    # checks the values, their room before the ring's end and the
                    # rewards, and stores nothing unless all pass. Anything else
                    # (frames, a save in progress, invalid slots, a batch that wraps,
                    # a value the general path would cast or refuse) takes the
                    # general path, changing nothing before it.
                    cached = self._direct  # (_direct_cache, without its call)
                    if cached is None or cached[0] is not self._storage:
                        cached = self._direct_cache()
                    put = cached[2]
                    if put is not None and not self._guards and not self._validity.n_invalid:
                        start = self._writer.cursor
                        n = put(transition, start)  # the checks, then the rows stored
                        if n:
                            slots = self._store_direct(None, None, n)
                            if 1 < n <= BLOCK_ROWS_MAX and self._block_rows is None:
                                self._learn_block(n)
                            return slots
            return self._add(transition, priorities, env_ids)
        finally:
            lock.release()

    def _add(self, transition: Mapping[str, Any], priorities: Any, env_ids: Any) -> np.ndarray:
        """``add`` by the general path: every value checked and cast (under the lock)."""
        if self._frames is not None:
            return self._add_frames(transition, priorities, env_ids)
        if self._nstep is not None:
            self._refuse_priorities_with_windows(priorities)
            batch, k = self._window_batch(transition)
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

    def _window_batch(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """The n-step input as checked arrays with a leading dimension, and the row count.

        Values that need no checked cast (see :class:`~fastper.storage.DirectRows`)
        skip the general coercion; anything else takes it, with its checks.
        """
        assert self._nstep is not None
        if type(transition) is dict:
            matcher = self._window_matcher
            if matcher is None:
                matcher = self._window_matcher = DirectRows(self._nstep.fields, self._capacity)
            matched = matcher.match(transition)
            if matched is not None:
                values, k = matched
                return matcher.as_batch(values, k), (1 if k == -1 else k)
        return coerce_batch(self._nstep.fields, transition, None)

    def _direct_rows(self) -> DirectRows | None:
        """The storage's no-cast path, rebuilt when a load swaps the storage; None where
        the buffer has none (a custom storage, frames)."""
        return self._direct_cache()[1]

    def _direct_cache(self) -> tuple[Any, DirectRows | None, Any]:
        """``_direct`` for the storage now (see there), built where it is not."""
        storage = self._storage
        cached = self._direct
        if cached is None or cached[0] is not storage:
            plain = self._frames is None
            rows = storage.direct_rows() if plain and type(storage) is Storage else None
            block = self._block_rows or 0
            put = rows.putter(self._reward_check, block) if rows is not None else None
            cached = self._direct = (storage, rows, put)
        return cached

    def _learn_block(self, rows: int) -> None:
        """Take ``rows`` (the first vector step's, 2 to :data:`BLOCK_ROWS_MAX` rows; a
        larger batch decides nothing) as the size of the vector steps to come:
        the next add makes the no-cast stores again, before it stores anything,
        with a branch that stores such a step by one integer index per field
        (:meth:`~fastper.storage.DirectRows.block_columns`). Once per buffer,
        after an add has committed its rows."""
        self._block_rows = rows
        self._direct = self._exact_put = None

    def _add_exact(self, values: list[Any], k: int, names: tuple[str, ...]) -> bool:
        """``add`` of rows a front end built itself, where its call shape fixes the
        fields (the SB3 drop-in), without the slots (that front end has no use for
        them); whether it stored them. False: not here (take :meth:`add`, which
        changes nothing before it has checked everything).

        ``values``: the value of each field ``names`` lists, in that order, each of
        the field's dtype and shape (``k == -1``: one transition) or with a leading
        dimension of ``k`` rows (a field of shape ``(1,)``: also flat, ``(k,)``), or
        of a dtype that converts exactly (bool flags into a float column); the
        caller has checked them, so there is no dict to read and no per-field match.
        ``names`` must be the storage's field order (a loaded file may have another:
        None then). The rewards are checked finite as :meth:`add` checks them
        (:meth:`~fastper.storage.DirectRows.exact_putter`). The rest is :meth:`add`'s
        no-cast path's: a buffer in its common state, rows that fit before the
        ring's end.
        """
        lock = self._lock
        lock.acquire()
        try:
            if self._nstep is not None:
                return False
            cached = self._direct  # (_direct_cache, without its call: the drop-in's every add)
            if cached is None or cached[0] is not self._storage:
                cached = self._direct_cache()
            rows = cached[1]
            if rows is None or self._guards or self._validity.n_invalid or rows.names != names:
                return False
            start = self._writer.cursor
            if start + (1 if k == -1 else k) > self._capacity:
                return False
            exact = self._exact_put
            if exact is None or exact[0] is not rows:
                block = self._block_rows or 0
                exact = self._exact_put = (rows, rows.exact_putter(self._reward_check, block))
            if not exact[1](start, values, k):
                return False  # a NaN or inf reward: the general path names the row
            self._store_direct(None, None, k, False)
            if 1 < k <= BLOCK_ROWS_MAX and self._block_rows is None:
                self._learn_block(k)
            return True
        finally:
            lock.release()

    def _store_direct(
        self, rows: DirectRows | None, values: Any, k: int, want_slots: bool = True
    ) -> np.ndarray:
        """Store matched rows at the cursor (they fit before the ring's end), then
        commit ring and priority; the slots (``want_slots=False``: an empty array,
        where the caller discards them). The tail of the no-cast adds.

        ``rows=None``: the ``k`` rows are already stored at the cursor (by
        :meth:`~fastper.storage.DirectRows.putter`'s store): commit them."""
        w = self._writer
        start = w.cursor
        if rows is not None:
            rows.write(start, values, k)
        n = 1 if k == -1 else k
        priority = self._new_priority()
        # (RingWriter.advance, without its call: every no-cast add)
        end = start + n  # (the rows fit before the ring's end: end <= capacity)
        w.cursor = end if end < w.capacity else 0
        size = w.size + n
        w.size = size if size < w.capacity else w.capacity
        w.added += n
        # (dtype positional, as numpy documents it: no keyword parsing; the stubs
        # know only the keyword)
        slots = np.arange(start, start + n, 1, _INT64) if want_slots else _NO_SLOTS  # type: ignore[call-overload]
        run = self._run_count
        if (
            run
            and self._run_start + run == start
            and priority == self._run_priority
            and run < RUN_LIMIT
            and self._frames is None
        ):  # _new_run's most frequent case, without its call (see there)
            self._run_count = run + n
            return slots
        self._new_run(start, n, priority)
        return slots

    def _add_window_row(
        self, transition: dict[str, Any], env_ids: Any, step_first: bool = True
    ) -> np.ndarray | None:
        """``add`` of one n-step step (one env's, or one of every env's) that needs no
        cast and ends nothing, on a buffer in its common state; None: not here (the
        general path, changing nothing).

        The general path's rules and order (the completed rows stored, then the
        windows committed) without its numpy batches: steps of known streams,
        values :class:`~fastper.storage.DirectRows` matches, finite rewards, no
        episode end (see :meth:`fastper.nstep.NStepWriter.step_function` and
        :meth:`~fastper.nstep.NStepWriter.prepare_row`). ``step_first=False``:
        the writer's step has just declined these values (see :meth:`add`).
        """
        nstep = self._nstep
        assert nstep is not None
        cached = self._direct  # (_direct_rows, without its call: every n-step add)
        rows = cached[1] if cached is not None and cached[0] is self._storage else self._direct_rows()
        if rows is None or self._guards or self._validity.n_invalid:
            return None
        matcher = self._window_matcher
        if matcher is None:
            matcher = self._window_matcher = DirectRows(nstep.fields, self._capacity)
        made = nstep._step  # (step_function, without its call: every n-step add)
        step = made[1] if made is not None and made[0] is rows else nstep.step_function(matcher, rows)
        check = self._reward_check is not None
        if step is not None and step_first:
            # complete windows (the most frequent call): the storage, then the windows
            # written; then the ring and the priorities
            n = step(nstep, transition, env_ids, check, self._writer.cursor)
            if n > 0:
                return self._store_direct(None, None, n)
            if n < 0:  # a vector step waits in the windows: nothing stored yet
                return np.empty(0, dtype=np.int64)
        matched = matcher.match(transition)
        if matched is None:
            return None
        values, k = matched
        if k != -1:  # a vector step not in the steady state: the general path's
            return None
        one = nstep.prepare_row(values, env_ids, check)
        if one is None:
            return None
        if one[0] is None:  # the step waits in its window: nothing stored yet
            nstep.commit_row(one[1])
            return np.empty(0, dtype=np.int64)
        if rows.names != tuple(nstep.output_fields):
            return None  # (a storage of these fields in another order: stored by name)
        slots = self._store_direct(rows, one[0], -1)
        nstep.commit_row(one[1])
        return slots

    def _new_run(self, start: int, count: int, priority: float) -> None:
        """Give ``count`` new slots from ``start`` (no wrap) their shared priority.

        Deferred: the index takes it with the next locked call, or with the
        next write that does not extend the run, so many single adds cost one
        write of a run. Written at once where something reads the priorities
        before that (frame invalidation). The "current" max-priority policy's
        max tree takes the run with the index. Until then it holds the
        priorities from before the run (those the run overwrites included),
        and its root is still the max ``M`` the run's priority was made from:
        ``min(M if M > 0 else 1.0, cap)``. The whole state would give the same,
        since every priority held besides the run's is at most ``M``. The
        case of a run extended is also read inline by
        :meth:`_store_direct` (the most frequent add): a change here is a
        change there.
        """
        run = self._run_count
        if self._frames is not None:
            if run:
                self._flush_run()
            self._write_run(start, count, priority)
        elif run and self._run_start + run == start and priority == self._run_priority and run < RUN_LIMIT:
            self._run_count = run + count
        else:
            if run:
                self._flush_run()
            self._run_start, self._run_priority, self._run_count = start, priority, count

    def _flush_run(self) -> None:
        """Give the deferred run of new slots their priority in the index. O(run + log N)."""
        count, self._run_count = self._run_count, 0
        self._write_run(self._run_start, count, self._run_priority)

    def _write_run(self, start: int, count: int, priority: float) -> None:
        """Give ``count`` new slots from ``start`` (no wrap) ``priority`` in the index,
        and in the "current" policy's max tree where the index does not keep it."""
        self._sampler.write_run(start, count, priority)
        tree = self._current_max
        if tree is not None and self._sampler.max_tree is not tree:
            tree.fix_run(start, count)

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
        if self._run_count:
            self._flush_run()
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
        tree = self._current_max
        if tree is not None and out and self._sampler.max_tree is not tree:
            tree.fix(np.concatenate(out))
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
        runs = p is None and not self._validity.n_invalid
        if runs:
            # every slot valid (the common case): one run, two if it wraps (the
            # max tree of the "current" policy takes them with the index)
            first = min(k, cap - start)
            self._new_run(start, first, priority)
            if first < k:
                self._new_run(0, k - first, priority)
        elif self._run_count:  # written below in place: the run goes first
            self._flush_run()
        if p is None:
            if self._validity.n_invalid:
                self._admit_run(start, k, priority)
        else:
            self._max_seen = max(self._max_seen, float(p.max()))
            validity = self._validity
            if validity.n_invalid:
                validity.admit(slots)
                if not validity.n_invalid:
                    self._sampler.all_valid()
            self._sampler.write(slots, p, new=True)
        tree = self._current_max
        if tree is not None and not runs and self._sampler.max_tree is not tree:
            tree.fix(slots)
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
