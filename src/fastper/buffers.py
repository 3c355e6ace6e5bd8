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

Decisions (see ``docs/concepts.md`` for the reasoning):

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
    unwrap_batch,
)
from .batch import SampleBatch
from .buffer_core import MaxPriorityPolicy
from .buffer_rows import RowsMixin
from .buffer_state import StorageLike, locked
from .frames import FrameStore, frame_store_for
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
    make_fields,
)
from .validity import Validity

__all__ = ["PrioritizedReplayBuffer", "RankBasedReplayBuffer", "ReplayBuffer", "SampleBatch"]


_NO_KEYS = np.empty(0, dtype=np.int64)


class _Buffer(RowsMixin):
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
        allow_nonfinite_rewards: bool = False,
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
            self._frames = frame_store_for(
                self._input_fields, capacity, frame_stack, frame_capacity, frame_pad, n_envs,
                autoreset, nstep_keys,
            )  # fmt: skip
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
            allow_nonfinite_rewards=allow_nonfinite_rewards,
        )  # fmt: skip
        self._clip_value = np.inf if self._clip is None else self._clip
        self._rng = np.random.Generator(np.random.PCG64(self._seed))
        self._storage = self._make_storage(storage, stored)
        # optional parts of the storage protocol (see fastper.storage.ReplayStorage)
        self._gather_can_fail = bool(getattr(self._storage, "gather_can_fail", True))
        self._concurrent_gather = bool(getattr(self._storage, "concurrent_gather", False))
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
        if self._current_max is not None:  # (kept by the sampler's writes where it can)
            self._sampler.keep_max(self._current_max)
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
            if self._run_count:
                self._flush_run()
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
        if policy == "ever":  # (the default, on every add: no call where nothing clips)
            p = self._max_seen
            return p if self._clip is None else min(p, self._priority_cap())
        if policy == "current":  # (on every add: the tree's root read directly)
            tree = self._current_max
            assert tree is not None
            held = float(tree.inner[tree.root]) if self._writer.size else 0.0
            p = held if held > 0.0 else 1.0
            return p if self._clip is None else min(p, self._priority_cap())
        elif policy == "last":
            p = self._last_max
        else:
            p = float(policy)
        return min(p, self._priority_cap())

    @property
    def frame_store(self) -> FrameStore | None:
        """The frame ring of a ``frame_stack`` buffer (``None`` otherwise)."""
        return self._frames

    # -- update ----------------------------------------------------------------
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
        # (not @locked, nor `with`: acquire and release cost less than a context
        # manager's calls, on the most frequent calls)
        lock = self._lock
        lock.acquire()
        try:
            if self._run_count:  # new transitions' priorities not yet in the index
                self._flush_run()
            if type(indices) is SampleBatch and keys is None:  # the learner's usual call
                indices, keys = indices.indices, indices.keys
            elif type(indices) is not np.ndarray:  # a sampled batch stands for its indices and keys
                indices, keys = unwrap_batch(indices, keys)
            idx = _as_1d("indices", indices, "iu")
            td = _as_1d("td_errors", td_errors, "iuf")
            use_keys = keys is not None
            key_arr = _as_1d("keys", keys, "iu") if use_keys else _NO_KEYS
            b = idx.shape[0]
            if td.shape[0] != b or (use_keys and key_arr.shape[0] != b):
                name, arr = ("td_errors", td) if td.shape[0] != b else ("keys", key_arr)
                raise ValueError(
                    f"`{name}` must have {b} entries (one entry per index), "
                    f"got {name} with {arr.shape[0]}"
                )
            invalid = 0
            if self._validity.n_invalid:
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
                idx, td, key_arr, use_keys, self._eps, self._clip_value, w.size,
                w.key_base, w.added, status,
            )  # fmt: skip
            code, _, kept, stale = status.tolist()  # (one call: cheaper than four reads)
            if code:
                if rng_state is not None:
                    self._rng.bit_generator.state = rng_state
                self._raise_update_error(code, idx, given, key_arr)
                # the input was fine: the noise pushed a priority out of range
                raise ValueError(
                    f"`priority_noise` sigma={sigma!r} made a priority non-finite or too large "
                    f"for the sum tree; use a smaller sigma (kernel code {code})"
                )
            if kept:
                if pmax > self._max_seen:
                    self._max_seen = pmax
                self._last_max = pmax
                tree = self._current_max
                if tree is not None and self._sampler.max_tree is not tree:
                    tree.fix(idx)
            self._stale_updates += stale + invalid
            return kept
        finally:
            lock.release()

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
        allow_nonfinite_rewards: ``False`` (default): :meth:`add` refuses a
            NaN or infinite value in the reward field (the one ``nstep_keys``
            names, else ``reward`` / ``rewards`` / ``rew``, when it is a float
            field) with a ValueError and stores nothing; ``True`` stores them
            as given. Other fields are stored as given either way. O(1) for
            one transition, O(B) for a batch.
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
        allow_nonfinite_rewards: ``False`` (default) refuses NaN / inf
            rewards on :meth:`add`; ``True`` stores them (see :class:`ReplayBuffer`).
    """

    kind = "proportional"
    _default_alpha = 0.6
    _default_beta = 0.4


class RankBasedReplayBuffer(_Buffer):
    """Rank-based prioritized replay: P(i) proportional to rank(i)^-alpha.

    rank 1 is the largest priority; ties go to the smaller slot index.

    ``capacity``, ``fields``, ``beta``, ``eps``, ``clip``, ``stratified``,
    ``weight_norm``, ``n_step``, ``gamma``, ``seed`` and
    ``allow_nonfinite_rewards`` are as for :class:`PrioritizedReplayBuffer`.

    Args:
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
        """1-based rank of each slot in the order the next sample uses. O(B log N).

        Raises:
            InvalidIndexError: an index out of range or never written.
            ValueError: an invalid slot (see :meth:`invalidate`): it has no rank.
        """
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        if self._validity.n_invalid:
            bad = idx[~self._validity.valid(idx)]
            if bad.size:
                raise ValueError(
                    f"`indices` must name valid slots (an invalid slot is out of the order), "
                    f"got invalid slots {show(bad[:8])}"
                )
        return self._rank_sampler().ranks(idx, self.num_valid) + 1
