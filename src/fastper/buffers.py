"""Replay buffers: storage + ring writer + sampler (+ per-stream n-step windows).

One API for three sampling schemes:

* :class:`ReplayBuffer`: uniform, P(i) = 1/N, weights 1.
* :class:`PrioritizedReplayBuffer`: proportional, P(i) = p_i^alpha / sum p^alpha.
* :class:`RankBasedReplayBuffer`: P(i) proportional to rank(i)^-alpha.

The parts, each with ``state_dict()`` / ``load_state_dict()``: a storage
(:class:`~fastper.storage.ReplayStorage`, numpy columns in RAM by default)
holds the rows, a :class:`~fastper.writer.RingWriter` the ring cursor and the
keys, a sampler (:mod:`fastper.samplers`) the priorities and trees, and with
n-step returns or vector envs an :class:`~fastper.nstep.NStepWriter` the
pending window of every stream. This module only orchestrates them.

Decisions (see the README for the reasoning):

* Priorities: ``p_i = min(|td_i|, clip) + eps``. New transitions get the
  priority of the ``max_priority`` policy: ``"ever"`` (default, the paper) the
  largest ever recorded (1.0 at first, never decreasing), ``"current"`` the
  largest held now, ``"last"`` the largest written by the latest
  ``update_priorities`` (1.0 before the first), or a fixed number; never
  above ``clip + eps``.
* Sampling is with replacement and stratified by default (the mass is cut into
  ``batch_size`` equal slices, one draw in each); ``stratified=False`` draws
  independently. Batches come back in random order (``shuffle=False``: in
  the order of the slices). A slot with priority zero is never drawn by the
  proportional buffer.
* IS weights ``w_i = (N P(i))^-beta / max_j (N P(j))^-beta``, the max over the
  whole buffer by default (``weight_norm="buffer"``), or over the batch
  (``"batch"``), or none (``"none"``). N is the current length.
* Every sample carries ``keys``: the insertion counter of each slot's
  occupant. ``update_priorities(..., keys=...)`` drops (and counts) updates
  for slots overwritten since they were sampled.
* A call that raises leaves the buffer exactly as it was, random state
  included. Public methods hold a re-entrant lock, so threads may share a
  buffer; ``save`` holds it only to take a snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import schedules as _sched
from ._validation import (
    as_1d as _as_1d,
)
from ._validation import (
    as_index_array,
    as_value_array,
    check_int,
    check_real,
    show,
    to_numpy,
    unwrap_batch,
)
from .batch import Gathered, MassSample, SampleBatch, check_batch_size
from .buffer_core import MaxPriorityPolicy
from .buffer_state import StateMixin, StorageLike, locked
from .errors import EmptyBufferError
from .frames import FrameStore, default_frame_capacity
from .nstep import NEXT_OBS_KEYS, TERMINATED_KEYS, TRUNCATED_KEYS, NStepPlan
from .samplers import (
    NORM_CODES,
    PriorityMax,
    ProportionalSampler,
    RankSampler,
    Sampler,
    UniformSampler,
)
from .storage import (
    Field,
    FieldLike,
    PlacedByMass,
    ReplayStorage,
    Storage,
    coerce_batch,
    make_fields,
)
from .validity import Validity

__all__ = ["PrioritizedReplayBuffer", "RankBasedReplayBuffer", "ReplayBuffer", "SampleBatch"]


_NO_KEYS = np.empty(0, dtype=np.int64)


class _Buffer(StateMixin):
    """Shared machinery; use one of the three public buffers."""

    def __init__(
        self,
        capacity: int,
        fields: Mapping[str, FieldLike],
        *,
        alpha: _sched.ScheduleLike | None = None,
        beta: _sched.ScheduleLike | None = None,
        eps: float = 1e-6,
        clip: float | None = None,
        max_priority: MaxPriorityPolicy = "ever",
        stratified: bool = True,
        shuffle: bool = True,
        weight_norm: str = "buffer",
        alpha_every: int | None = None,
        priority_noise: _sched.ScheduleLike = 0.0,
        n_step: int = 1,
        gamma: float = 0.99,
        n_envs: int | None = None,
        autoreset: str | None = None,
        seed: int | None = None,
        nstep_keys: Mapping[str, str | None] | None = None,
        storage: StorageLike | None = None,
        frame_stack: Mapping[str, int] | None = None,
        frame_capacity: int | None = None,
        frame_pad: str = "zero",
    ) -> None:
        if self.kind == "uniform" and alpha is not None:
            raise ValueError(
                "`alpha` has no effect on uniform replay: ReplayBuffer draws every slot with "
                "P(i) = 1/N; use PrioritizedReplayBuffer or RankBasedReplayBuffer for "
                f"prioritized replay, got alpha={show(alpha)}"
            )
        self._input_fields = make_fields(fields)
        self._frames: FrameStore | None = None
        if frame_stack is not None:
            self._frames = self._frame_store(
                capacity, frame_stack, frame_capacity, frame_pad, n_envs, autoreset, nstep_keys
            )
            fields = {
                **self._input_fields,
                self._frames.name: Field((), np.dtype(np.int64)),
                self._frames.next_name: Field((), np.dtype(np.int64)),
            }
        stored, alpha0 = self._configure(
            capacity, fields, alpha=alpha, beta=beta, eps=eps, clip=clip,
            max_priority=max_priority, policies=("ever", "current", "last"), stratified=stratified,
            shuffle=shuffle, weight_norm=weight_norm, norms=tuple(NORM_CODES),
            alpha_every=alpha_every, priority_noise=priority_noise, n_step=n_step, gamma=gamma,
            n_envs=n_envs, autoreset=autoreset, nstep_keys=nstep_keys, seed=seed,
        )  # fmt: skip
        self._clip_value = np.inf if self._clip is None else self._clip
        self._rng = np.random.Generator(np.random.PCG64(self._seed))
        self._storage = self._make_storage(storage, stored)
        # optional parts of the storage protocol (see fastper.storage.ReplayStorage)
        self._gather_can_fail = bool(getattr(self._storage, "gather_can_fail", True))
        self._placed = self._storage if isinstance(self._storage, PlacedByMass) else None
        # bytes of one gathered row (frame stacks: both stacks), for the batch size check
        self._row_nbytes = sum(f.nbytes_per_item for f in self._storage.fields.values())
        if self._frames is not None:
            self._row_nbytes += 2 * self._frames.stack * self._frames.frame_bytes
        self._scheme = self.kind
        self._scheme_options: dict[str, Any] = self._default_scheme_options()
        self._sampler = self._build_sampler(self.kind, alpha0, self._scheme_options, None)
        self._pending_switch: dict[str, Any] | None = None
        self._max_seen = 1.0  # largest priority ever recorded ("ever" policy)
        self._last_max = 1.0  # largest priority of the latest update ("last" policy)
        self._current_max = (
            PriorityMax(self._sampler.raw_leaves) if self._max_policy == "current" else None
        )
        self._stale_updates = 0
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._guards = []  # saves in progress (see buffer_state)
        self._status = np.zeros(4, dtype=np.int64)  # update kernels' result codes
        self._validity = Validity(self._capacity)

    # -- construction ------------------------------------------------------------
    def _make_storage(self, storage: StorageLike | None, fields: dict[str, Field]) -> ReplayStorage:
        if storage is None:
            return Storage(fields, self._capacity)
        made = storage if isinstance(storage, ReplayStorage) else storage(fields, self._capacity)
        if not isinstance(made, ReplayStorage):
            raise TypeError(
                "`storage` must be a ReplayStorage or a factory (fields, capacity) -> "
                f"ReplayStorage, got storage={show(storage)}"
            )
        if made.capacity != self._capacity or dict(made.fields) != fields:
            raise ValueError(
                f"`storage` must have capacity={self._capacity} and fields {fields}, got "
                f"capacity={made.capacity} and fields {dict(made.fields)}"
            )
        return made

    def _frame_store(
        self,
        capacity: Any,
        frame_stack: Any,
        frame_capacity: Any,
        frame_pad: Any,
        n_envs: Any,
        autoreset: Any,
        nstep_keys: Mapping[str, str | None] | None,
    ) -> FrameStore:
        """Check the frame settings against the fields; the store of the frame stream."""
        if not isinstance(frame_stack, Mapping) or len(frame_stack) != 1:
            raise ValueError(
                "`frame_stack` must map one observation field to its stack size, e.g. "
                f"frame_stack={{'obs': 4}}, got frame_stack={show(frame_stack)}"
            )
        ((name, k),) = frame_stack.items()
        fields = self._input_fields
        keys = dict(nstep_keys or {})
        next_name = keys.get("next_obs") or f"next_{name}"
        if next_name not in fields and name == "obs":
            next_name = next((f for f in NEXT_OBS_KEYS if f in fields), next_name)
        for need in (name, next_name):
            if need not in fields:
                raise ValueError(
                    f"`frame_stack` names field {name!r}, whose next observation is field "
                    f"{next_name!r}: both must be fields (one frame each), got fields "
                    f"{list(fields)}"
                )
        if fields[name] != fields[next_name]:
            raise ValueError(
                f"fields {name!r} and {next_name!r} must have the same shape and dtype, got "
                f"{fields[name]} and {fields[next_name]}"
            )
        done: list[str] = []
        for role, names in (("terminated", TERMINATED_KEYS), ("truncated", TRUNCATED_KEYS)):
            if role in keys:
                key = keys[role]
                if key is not None:
                    if key not in fields:
                        raise ValueError(f"`nstep_keys` names {role} field {key!r}, not a field")
                    done.append(key)
                continue
            found = next((f for f in names if f in fields), None)
            if found is None:
                raise ValueError(
                    f"frame streams must know where episodes end: no {role} field found "
                    f"(looked for {list(names)}); add one, or say there is none with "
                    f"nstep_keys={{'{role}': None}}"
                )
            done.append(found)
        cap = check_int("capacity", capacity, minimum=1)
        fcap = default_frame_capacity(cap) if frame_capacity is None else frame_capacity
        return FrameStore(
            name, next_name, fields[name], k, fcap, pad=frame_pad,
            n_envs=None if n_envs is None else check_int("n_envs", n_envs, minimum=1),
            autoreset=autoreset, done_keys=tuple(done), transitions=cap,
        )  # fmt: skip

    def _default_scheme_options(self) -> dict[str, Any]:
        return {}

    def _settings(self) -> dict[str, Any]:
        settings = super()._settings()
        frames = self._frames
        if frames is not None:  # the fields as given (frames), not the stored frame ids
            settings["fields"] = [[k, f.to_dict()] for k, f in self._input_fields.items()]
            settings["frame_stack"] = {frames.name: frames.stack}
            settings["frame_capacity"] = frames.capacity
            settings["frame_pad"] = frames.pad
        return settings

    def _build_sampler(
        self, scheme: str, alpha: float, options: Mapping[str, Any], raw: np.ndarray | None
    ) -> Sampler:
        if scheme == "uniform":
            return UniformSampler(self._capacity, alpha, raw)
        if scheme == "proportional":
            # only buffer-wide normalisation reads the min tree: the others skip its upkeep
            return ProportionalSampler(
                self._capacity, alpha, track_min=self._weight_norm == "buffer", raw_leaves=raw
            )
        return RankSampler(
            self._capacity, alpha, sort_every=options.get("sort_every"),
            segments=bool(options.get("segments", False)), raw_leaves=raw,
        )  # fmt: skip

    # -- introspection ---------------------------------------------------------
    @property
    def storage(self) -> ReplayStorage:
        """The storage holding the rows."""
        return self._storage

    @property
    def scheme(self) -> str:
        """The sampling scheme in force: ``"uniform"``, ``"proportional"`` or ``"rank"``."""
        return self._scheme

    @property
    def max_priority(self) -> float:
        """The priority a new transition gets now, under the ``max_priority`` policy. O(1)."""
        return self._new_priority()

    @property
    def max_priority_ever(self) -> float:
        """Largest priority ever recorded (starts at 1.0, never decreases)."""
        return self._max_seen

    @property
    def stale_updates(self) -> int:
        """Priority updates dropped because their slot was overwritten since sampled."""
        return self._stale_updates

    @property
    def alpha(self) -> float:
        """The alpha in force: the one the stored probabilities and weights use."""
        return self._sampler.alpha

    @property
    def step(self) -> int:
        """Schedule step: counts successful ``sample`` calls; may be set."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        with self._lock:
            value = check_int("step", value, minimum=0)
            self._check_beta(self._beta_schedule(value))
            check_real("priority_noise", self._noise_schedule(value), minimum=0.0)
            self._apply_alpha(self._alpha_at(value))
            self._step = value

    @locked
    def keys(self, indices: Any) -> np.ndarray:
        """Key (insertion counter) of the current occupant of each slot. O(B)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._writer.keys(idx)

    @locked
    def priorities(self, indices: Any) -> np.ndarray:
        """Raw priorities p_i (before alpha) of written slots. O(B)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._sampler.raw[idx].copy()

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

    def _apply_alpha(self, alpha: float) -> None:
        if alpha != self._sampler.alpha:
            self._sampler.check_priorities("priorities", self._sampler.raw[: len(self)], alpha)
            self._sampler.check_priorities("max_priority", np.asarray([self._max_seen]), alpha)
            self._sampler.set_alpha(alpha, len(self))

    # -- priorities ------------------------------------------------------------
    def _priority_from_td(self, td: np.ndarray) -> np.ndarray:
        mag = np.abs(td)
        if self._clip is not None:
            mag = np.minimum(mag, self._clip)
        return mag + self._eps

    def _new_priority(self) -> float:
        policy = self._max_policy
        if policy == "ever":
            p = self._max_seen
        elif policy == "current":
            assert self._current_max is not None
            held = self._current_max.max if len(self) else 0.0
            p = held if held > 0.0 else 1.0
        elif policy == "last":
            p = self._last_max
        else:
            p = float(policy)
        return min(p, self._priority_cap())

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
                NaN and inf in float fields are stored as given, unchecked.
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
                also complete more), bad priorities, or a batch whose streams
                are unknown (n-step without ``env_ids`` or ``n_envs``).
            FieldTypeError: a value that cannot be cast safely.
        """
        if self._frames is not None:
            return self._add_frames(transition, priorities, env_ids)
        if self._nstep is not None:
            self._refuse_priorities_with_windows(priorities)
            batch, k = coerce_batch(self._nstep.fields, transition, None)
            plan = self._plan_windows(batch, k, env_ids)
            out, m = plan.out, plan.count
            # the rows first, the windows after: a storage whose write fails (a full
            # disk) leaves the windows as they were too
            slots = self._write_rows(out, m, None)
            self._nstep.commit(plan)
            return slots
        prepared, k = self._storage.prepare(transition)
        if env_ids is not None:
            ids = to_numpy(env_ids).reshape(-1)
            if ids.shape[0] != k or (ids.size and ids.dtype.kind not in "iu"):
                raise ValueError(
                    f"`env_ids` must hold one integer per row ({k}), got env_ids={show(ids)}"
                )
        return self._write(prepared, k, self._given_priorities(priorities, k))

    @staticmethod
    def _refuse_priorities_with_windows(priorities: Any) -> None:
        if priorities is not None:
            raise ValueError(
                "`priorities` cannot be given to add() when n_step > 1 or streams are tracked"
            )

    def _plan_windows(self, batch: Mapping[str, np.ndarray], k: int, env_ids: Any) -> NStepPlan:
        """The n-step plan of ``k`` rows; refuses a batch that completes too many."""
        assert self._nstep is not None
        plan = self._nstep.prepare(batch, k, env_ids)
        m, cap = plan.count, self._capacity
        if m > cap and k > cap:
            raise ValueError(
                f"a batch must not complete more than capacity={cap} transitions, got {m}"
            )
        return plan

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
        ``capacity`` may complete from a batch that fits. They are written in
        ring order, ``capacity`` at a time, so the ring keeps the last
        ``capacity``, as if added one by one (``p`` is None then: priorities are
        refused with n-step).
        """
        cap = self._capacity
        if m == 0:
            return np.empty(0, dtype=np.int64)
        if m <= cap:
            return self._write(out, m, p)
        return np.concatenate([
            self._write({f: a[lo : lo + cap] for f, a in out.items()}, min(cap, m - lo), None)
            for lo in range(0, m, cap)
        ])  # fmt: skip

    def _add_frames(self, transition: Any, priorities: Any, env_ids: Any) -> np.ndarray:
        """``add`` for a frame buffer: frames to the frame ring, ids to the transitions."""
        frames = self._frames
        assert frames is not None
        nstep = self._nstep
        if nstep is not None:
            self._refuse_priorities_with_windows(priorities)
        batch, k = coerce_batch(self._input_fields, transition, None)
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
        frames.invalidated += gone
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

    @property
    def frame_store(self) -> FrameStore | None:
        """The frame ring of a ``frame_stack`` buffer (``None`` otherwise)."""
        return self._frames

    def _gather(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        data = self._storage.gather(idx)
        return data if self._frames is None else self._frames.gather(data)

    def _write(
        self, prepared: Mapping[str, np.ndarray], k: int, p: np.ndarray | None
    ) -> np.ndarray:
        w = self._writer
        start = w.cursor
        slots = w.slots(start, k)
        for guard in self._guards:  # a save in progress keeps the rows it still needs
            guard.before_write(slots)
        priority = self._new_priority() if p is None else 0.0
        self._storage.write(start, prepared, k)
        w.advance(k)
        if p is None:
            self._admit_run(start, k, priority)
        else:
            self._max_seen = max(self._max_seen, float(p.max()))
            self._validity.admit(slots)
            self._sampler.write(slots, p, new=True)
            self._after_admit()
        if self._current_max is not None:
            self._current_max.fix(slots)
        return slots

    def _admit_run(self, start: int, k: int, priority: float) -> None:
        """New transitions in ``k`` slots from ``start`` (wrapping): valid, with one
        priority for a contiguous run (two if it wraps)."""
        first = min(k, self._capacity - start)
        self._validity.admit_run(start, first)
        self._sampler.write_run(start, first, priority)
        if first < k:
            self._validity.admit_run(0, k - first)
            self._sampler.write_run(0, k - first, priority)
        self._after_admit()

    def _after_admit(self) -> None:
        if self._validity.all_valid:
            self._sampler.all_valid()

    # -- sample ----------------------------------------------------------------
    @locked
    def sample(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` transitions with replacement. O(B log N).

        With an alpha schedule, alpha changes only at steps that are
        multiples of :attr:`alpha_every` (each change re-weighs every priority,
        O(N)); the probabilities and weights are those of the alpha in force.

        Args:
            batch_size: number of draws, >= 1 (may exceed ``len(self)``).
            beta: IS exponent; by default the beta schedule at :attr:`step`.

        Returns:
            A frozen :class:`SampleBatch`, in random order unless ``shuffle=False``.

        Raises:
            EmptyBufferError: the buffer holds nothing.
            ZeroPriorityError: every priority is zero (proportional).
            ValueError, TypeError: a bad ``batch_size`` or ``beta``.
        """
        idx, prob, weights, keys, rng_state = self._draw(batch_size, beta)
        try:
            data = self._gather(idx)
        except BaseException:
            if rng_state is not None:
                self._rng.bit_generator.state = rng_state
            raise
        self._after_draw()
        return SampleBatch(data=data, indices=idx, weights=weights, probabilities=prob, keys=keys)

    @locked
    def draw(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        """The first half of :meth:`sample`: indices, keys, probabilities and weights. O(B log N).

        Draws exactly as ``sample`` does (same generator, same step), but
        reads no rows: ``data`` is empty. Read them with :meth:`gather`, which
        does not hold the buffer's lock while it reads, so slow storage (disk,
        tiers) does not block other threads' adds meanwhile.

        Raises:
            As :meth:`sample`.
        """
        idx, prob, weights, keys, _ = self._draw(batch_size, beta)
        self._after_draw()
        return SampleBatch(data={}, indices=idx, weights=weights, probabilities=prob, keys=keys)

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
        data = self._gather(idx)  # outside the lock: adds may overwrite rows meanwhile
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
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]:
        """Check, then draw (the caller holds the lock). The generator's state before
        the draw comes back when a later read may fail and must restore it."""
        b = check_batch_size(batch_size, self._row_nbytes)
        beta_v = self._check_beta(self._beta_schedule(self._step) if beta is None else beta)
        n = self._sampleable()
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
        # A storage that reads files can fail in gather: the generator is then restored.
        rng_state = self._rng.bit_generator.state if self._gather_can_fail else None
        u = self._rng.random(b)
        w = self._writer
        idx, prob, weights, keys = self._sampler.sample(
            u, n, beta_v, self._stratified, NORM_CODES[self._weight_norm], w.key_base, w.added
        )
        if self._shuffle and b > 1:
            # slices come out in slot order: minibatches cut from a batch would
            # each get a contiguous piece of the ring
            perm = self._rng.permutation(b)
            idx, prob, weights, keys = idx[perm], prob[perm], weights[perm], keys[perm]
        return idx, prob, weights, keys, rng_state

    def _after_draw(self) -> None:
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

    # -- update ----------------------------------------------------------------
    @locked
    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> int:
        """Set p_i = min(|td_i|, clip) + eps for sampled slots. O(B log N).

        ``update_priorities(batch, td_errors)`` with the :class:`SampleBatch`
        itself takes its indices and keys.

        Duplicate indices: the last one wins. With ``keys`` (from
        :class:`SampleBatch`), entries whose slot now holds a different
        transition are dropped and counted in :attr:`stale_updates`. With
        ``priority_noise`` sigma > 0, |td_i| is first multiplied by
        ``exp(sigma * z_i)``, z_i standard normal from the buffer's generator.

        Returns:
            The number of priorities applied.

        Raises:
            InvalidIndexError: an index out of range or never written.
            ValueError: td errors not finite, lengths differ, bad keys.
        """
        indices, keys = unwrap_batch(indices, keys)
        idx = _as_1d("indices", indices, "iu")
        td = _as_1d("td_errors", td_errors, "iuf")
        use_keys = keys is not None
        key_arr = _as_1d("keys", keys, "iu") if use_keys else _NO_KEYS
        for name, arr in (("td_errors", td), ("keys", key_arr if use_keys else idx)):
            if arr.shape[0] != idx.shape[0]:
                raise ValueError(
                    f"`{name}` must have {idx.shape[0]} entries (one entry per index), "
                    f"got {name} with {arr.shape[0]}"
                )
        invalid = 0
        if not self._validity.all_valid:
            # invalid slots keep zero mass: drop their updates
            as_index_array("indices", idx, self._capacity, written=len(self))
            keep = self._validity.valid(idx)
            invalid = int(keep.shape[0] - np.count_nonzero(keep))
            if invalid:
                idx, td = idx[keep], td[keep]
                key_arr = key_arr[keep] if use_keys else key_arr
        sigma = self._noise_schedule(self._step)
        rng_state = None
        given = td
        if sigma:
            sigma = check_real("priority_noise", sigma, minimum=0.0)
            rng_state = self._rng.bit_generator.state
            with np.errstate(over="ignore", invalid="ignore"):
                td = np.abs(td) * np.exp(sigma * self._rng.standard_normal(td.shape[0]))
        status = self._status  # the kernel resets it; the lock keeps it ours
        w = self._writer
        pmax = self._sampler.update_from_td(
            idx, td, key_arr, use_keys, self._eps, self._clip_value, len(self),
            w.key_base, w.added, status,
        )  # fmt: skip
        if status[0]:
            if rng_state is not None:
                self._rng.bit_generator.state = rng_state
            self._raise_update_error(int(status[0]), idx, given, key_arr)
            # the input was fine: the noise pushed a priority out of range
            raise ValueError(
                f"`priority_noise` sigma={sigma!r} made a priority non-finite or too large "
                f"for the sum tree; use a smaller sigma (kernel code {int(status[0])})"
            )
        kept = int(status[2])
        if kept:
            self._max_seen = max(self._max_seen, pmax)
            self._last_max = pmax
            if self._current_max is not None:
                self._current_max.fix(idx)
        self._stale_updates += int(status[3]) + invalid
        return kept

    def _raise_update_error(
        self, code: int, idx: np.ndarray, td: np.ndarray, keys: np.ndarray
    ) -> None:
        """Turn a kernel's error code into the validators' message (slow path)."""
        as_index_array("indices", idx, self._capacity, written=len(self))
        as_value_array("td_errors", td, idx.shape[0], nonnegative=False)
        self._sampler.check_priorities("td_errors", self._priority_from_td(td))
        if code == 5:
            added = self._writer.added
            bad = keys[(keys < 0) | (keys >= added)]
            raise ValueError(
                f"`keys` must be keys issued by this buffer, in [0, {added}), "
                f"got keys={show(bad[:8])}"
            )
        if code not in (3, 4):  # pragma: no cover - every other code is reported above
            raise ValueError(f"invalid priority update (code {code})")

    # -- housekeeping ----------------------------------------------------------
    @locked
    def drop_pending(self) -> int:
        """Drop the n-step windows not yet stored (e.g. episodes cut by an env reset). O(streams).

        Returns how many transitions were dropped. Streams stay known (with
        their autoreset state); nothing stored changes.
        """
        if self._frames is not None:
            self._frames.end_episodes()  # the next row of every stream starts an episode
        if self._nstep is None:
            return 0
        n = self._nstep.n_pending
        self._nstep.clear()
        return int(n)

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

    @locked
    def clear(self) -> None:
        """Drop every transition and pending n-step window. O(N).

        Keeps the random state, the step, the key counter (so old keys stay
        stale), :attr:`max_priority_ever` (which never decreases) and the
        latest update's largest priority (``max_priority="last"``).
        """
        for guard in self._guards:  # a save in progress still writes the old rows
            guard.before_write(np.arange(len(self), dtype=np.int64))
        self._storage.clear()
        self._sampler.clear()
        self._writer.clear()
        if self._current_max is not None:
            self._current_max.rebuild()
        if self._nstep is not None:
            self._nstep.clear()
        self._validity.clear()
        if self._frames is not None:
            self._frames.clear()

    def nbytes(self) -> dict[str, int]:
        """Memory held: ``data`` (storage), ``index`` (priorities, trees, ranks; keys are derived, not stored)."""
        seen: dict[int, int] = {}
        parts: list[Any] = [self._sampler, *vars(self._sampler).values()]
        if self._current_max is not None:
            parts.append(self._current_max)
        for part in parts:
            for a in vars(part).values() if hasattr(part, "__dict__") else ():
                if isinstance(a, np.ndarray):
                    base = a
                    while isinstance(base.base, np.ndarray):
                        base = base.base
                    seen[id(base)] = base.nbytes
        data = self._storage.nbytes() + (0 if self._frames is None else self._frames.nbytes())
        index = sum(seen.values()) + self._validity.nbytes()
        return {"data": int(data), "index": int(index)}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, len={len(self)}, "
            f"fields={list(self._storage.fields)}, alpha={self.alpha:g})"
        )


#: the base class of the three buffers, for type annotations
BaseBuffer = _Buffer


class ReplayBuffer(_Buffer):
    """Uniform replay: P(i) = 1/N, importance weights all 1.

    Priorities may still be updated (they are kept, not used), so agents can
    switch buffers without changing code.

    Args:
        capacity: number of slots (>= 1).
        fields: ``{name: (shape, dtype)}``, e.g.
            ``{"obs": ((4,), np.float32), "action": ((), np.int64)}``.
        stratified: draw one index in each of ``batch_size`` equal slices of
            the buffer (default) or independently.
        shuffle: hand batches back in random order (default) or slice order.
        n_step, gamma: write n-step returns (see :mod:`fastper.nstep`).
        n_envs, autoreset: streams of a vector env (see
            :class:`PrioritizedReplayBuffer`).
        seed: seed of the buffer's random generator.
        eps, clip, max_priority: priority = min(|td|, clip) + eps; the
            priority of new transitions.
        storage: a :class:`~fastper.storage.ReplayStorage` or a factory
            ``(fields, capacity) -> storage``; default numpy columns in RAM.
    """

    kind = "uniform"


class PrioritizedReplayBuffer(_Buffer):
    """Proportional prioritized replay (Schaul et al. 2016).

    P(i) = p_i^alpha / sum_k p_k^alpha from a float64 sum tree, which also
    keeps the smallest positive leaf for the buffer-wide largest IS weight.

    Args:
        capacity: number of slots (>= 1).
        fields: the field spec, as for :class:`ReplayBuffer`.
        alpha: number or schedule, >= 0 (paper: 0.6). Changing it re-weighs
            every stored priority exactly, O(N); a schedule is applied at
            steps that are multiples of ``alpha_every``.
        beta: number or schedule, >= 0 (paper: 0.4 annealed to 1).
        eps: added to |td| (> 0 keeps every transition sampleable).
        clip: optional cap on |td| before eps.
        max_priority: priority of new transitions: ``"ever"`` (default, the
            paper: the largest ever recorded, 1.0 at first; O(1)),
            ``"current"`` (the largest held now: a max tree over the
            priorities, O(log N) more per write, about 1.2 bytes per slot),
            ``"last"`` (the largest priority computed by the latest
            :meth:`update_priorities` that kept any, duplicates included,
            1.0 before the first; O(1): it can fall as well as rise), or a
            fixed number. Never above ``clip + eps``.
        stratified: stratified (default) or independent draws.
        shuffle: batches in random order (default) or in slice order.
        weight_norm: ``"buffer"`` (default), ``"batch"`` or ``"none"``. Only
            ``"buffer"`` keeps the min tree; the others skip its upkeep (an
            update of B = 256 at N = 2^20 took about 0.7x the time).
        alpha_every: apply an alpha schedule every this many samples
            (default ``ceil(capacity / 256)``: the O(N) re-weighting then
            costs O(256) per sample, amortised; at N = 2^20 a linear schedule
            moves alpha at most every 4,096 samples).
        priority_noise: sigma (number or schedule, default 0): updates use
            ``|td| * exp(sigma * z)``, z standard normal, against premature
            convergence late in training.
        n_step, gamma: n-step returns.
        n_envs: a batch is one step of each of ``n_envs`` envs (row i = env
            i); otherwise pass ``env_ids`` to :meth:`add` (needed by n-step
            batches).
        autoreset: ``"next_step"`` for Gymnasium >= 1.0 vector envs (their
            default): the row after an episode end of an env is the reset
            step, not a transition, and is dropped. ``None``: every row is a
            transition. ``"same_step"`` is refused (see :mod:`fastper.nstep`).
        nstep_keys: field names of ``reward``, ``next_obs``, ``terminated``,
            ``truncated`` if not the usual ones; ``{"truncated": None}``
            states that episodes are never truncated.
        seed: seed of the buffer's random generator.
        storage: a :class:`~fastper.storage.ReplayStorage` or a factory.
    """

    kind = "proportional"
    _default_alpha = 0.6
    _default_beta = 0.4


class RankBasedReplayBuffer(_Buffer):
    """Rank-based prioritized replay: P(i) proportional to rank(i)^-alpha.

    rank 1 is the largest priority; ties go to the smaller slot index.

    Args:
        capacity, fields, beta, eps, clip, stratified, weight_norm, n_step,
            gamma, seed: as for :class:`PrioritizedReplayBuffer`.
        alpha: number or schedule (paper: 0.7, beta 0.5 annealed to 1).
        sort_every: ``None`` (default): exact ranks at every sample; every
            priority change re-ranks its slot at once, O(log N) amortised. An
            integer K: priority updates of stored slots reach the order only
            every K samples (the paper re-sorts every 10^6 steps), in
            O(k log N) for k changed slots; :meth:`sort` forces it. New
            transitions (a slot overwritten when the ring wraps included)
            are ranked by their priority at once either way.
        segments: sample as the paper does, one uniform pick in each of
            ``batch_size`` equal-probability rank segments (probabilities and
            weights then describe that scheme, for the batch size of the last
            sample unless given); default ``False``: exact draws.

    The ranks live in an order-statistics B+ tree (see
    :class:`~fastper.samplers.RankSampler` for its costs and memory): a draw,
    a priority change and a rank query each cost O(log N), amortised.
    """

    kind = "rank"
    _default_alpha = 0.7
    _default_beta = 0.5

    def __init__(
        self,
        capacity: int,
        fields: Mapping[str, FieldLike],
        *,
        sort_every: int | None = None,
        segments: bool = False,
        **kwargs: Any,
    ) -> None:
        self._sort_every = (
            None if sort_every is None else check_int("sort_every", sort_every, minimum=1)
        )
        if not isinstance(segments, bool | np.bool_):
            raise TypeError(f"`segments` must be a bool, got segments={show(segments)}")
        self._segments = bool(segments)
        super().__init__(capacity, fields, **kwargs)

    def _default_scheme_options(self) -> dict[str, Any]:
        return {"sort_every": self._sort_every, "segments": self._segments}

    def _class_settings(self) -> dict[str, Any]:
        return {"sort_every": self._sort_every, "segments": self._segments}

    def _rank_sampler(self) -> RankSampler:
        s = self._sampler
        if not isinstance(s, RankSampler):
            raise ValueError(f"this buffer samples with scheme {self._scheme!r} now, not 'rank'")
        return s

    @locked
    def sort(self) -> None:
        """Re-rank the slots whose update is pending (``sort_every``) now. O(k log N)."""
        self._rank_sampler().sort(len(self))

    @locked
    def ranks(self, indices: Any) -> np.ndarray:
        """1-based rank of each slot in the order the next sample uses. O(B log N)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._rank_sampler().ranks(idx, len(self)) + 1
