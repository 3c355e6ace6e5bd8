"""Replay buffers: columnar storage + a sampler (+ an optional n-step writer).

One API for three sampling schemes:

* :class:`ReplayBuffer`: uniform, P(i) = 1/N, weights 1.
* :class:`PrioritizedReplayBuffer`: proportional, P(i) = p_i^alpha / sum p^alpha.
* :class:`RankBasedReplayBuffer`: P(i) proportional to rank(i)^-alpha.

Decisions (see the README for the reasoning):

* Priorities: ``p_i = min(|td_i|, clip) + eps``. New transitions get the
  largest priority ever recorded (1.0 at first, never decreasing) unless
  ``add`` is given priorities.
* Sampling is with replacement and stratified by default (the mass is cut into
  ``batch_size`` equal slices, one draw in each); ``stratified=False`` draws
  independently. A slot with priority zero is never drawn by the proportional
  buffer.
* IS weights ``w_i = (N P(i))^-beta / max_j (N P(j))^-beta``, the max over the
  whole buffer by default (``weight_norm="buffer"``), or over the batch
  (``"batch"``), or none (``"none"``). N is the current length.
* Every sample carries ``keys``: the insertion counter of each slot's
  occupant. ``update_priorities(..., keys=...)`` drops (and counts) updates
  for slots overwritten since they were sampled.
* A call that raises leaves the buffer exactly as it was, random state
  included. Public methods hold a re-entrant lock, so threads may share a
  buffer.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from . import schedules as _sched
from ._validation import (
    as_index_array,
    as_value_array,
    check_int,
    check_real,
    show,
    to_numpy,
)
from .errors import EmptyBufferError
from .nstep import NStepWriter
from .samplers import (
    NORM_CODES,
    ProportionalSampler,
    RankSampler,
    Sampler,
    UniformSampler,
    slot_keys,
)
from .storage import Field, FieldLike, Storage, coerce_batch, make_fields

F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: _Buffer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class SampleBatch:
    """One sampled minibatch.

    Attributes:
        data: ``{field: array}``, each with a leading ``batch_size`` dimension
            (copies: writing to them does not touch the buffer).
        indices: slots sampled (int64), to pass back to ``update_priorities``.
        weights: importance-sampling weights (float64).
        probabilities: P(i) of each sampled slot (float64).
        keys: insertion counter of each slot's occupant (int64); pass it back
            so that updates for overwritten slots are dropped.
    """

    data: dict[str, np.ndarray]
    indices: np.ndarray
    weights: np.ndarray
    probabilities: np.ndarray
    keys: np.ndarray

    def __getitem__(self, field: str) -> np.ndarray:
        return self.data[field]

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """``data`` plus ``weights`` / ``indices`` as torch tensors (imports torch)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("to_torch needs PyTorch: pip install 'fastper[agents]'") from exc
        out = {k: torch.as_tensor(v, device=device) for k, v in self.data.items()}
        out["weights"] = torch.as_tensor(self.weights, device=device)
        out["indices"] = torch.as_tensor(self.indices, device=device)
        return out


_NO_KEYS = np.empty(0, dtype=np.int64)


def _as_1d(name: str, value: Any, kinds: str) -> np.ndarray:
    """Cheap conversion to a 1-D int64 / float64 array; ranges are checked later."""
    dtype = np.int64 if kinds == "iu" else np.float64
    if type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1:
        return value  # the common case: arrays straight from a SampleBatch
    arr = to_numpy(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got {name} with shape {arr.shape}")
    if arr.dtype.kind not in kinds and arr.size:
        what = "integers" if kinds == "iu" else "real numbers"
        raise TypeError(f"`{name}` must hold {what}, got {name} with dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


class _Buffer:
    """Shared machinery; use one of the three public buffers."""

    kind: ClassVar[str] = ""
    _default_alpha: ClassVar[float] = 1.0
    _default_beta: ClassVar[float] = 0.0

    def __init__(
        self,
        capacity: int,
        fields: Mapping[str, FieldLike],
        *,
        alpha: _sched.ScheduleLike | None = None,
        beta: _sched.ScheduleLike | None = None,
        eps: float = 1e-6,
        clip: float | None = None,
        stratified: bool = True,
        weight_norm: str = "buffer",
        n_step: int = 1,
        gamma: float = 0.99,
        seed: int | None = None,
        nstep_keys: Mapping[str, str] | None = None,
    ) -> None:
        self._capacity = check_int("capacity", capacity, minimum=1)
        input_fields = make_fields(fields)
        self._eps = check_real("eps", eps, minimum=0.0)
        self._clip = None if clip is None else check_real("clip", clip, minimum=0.0)
        self._clip_value = np.inf if self._clip is None else self._clip
        if not isinstance(stratified, bool | np.bool_):
            raise TypeError(f"`stratified` must be a bool, got stratified={show(stratified)}")
        self._stratified = bool(stratified)
        if weight_norm not in NORM_CODES:
            raise ValueError(
                f"`weight_norm` must be one of {list(NORM_CODES)}, got weight_norm={weight_norm!r}"
            )
        self._weight_norm = weight_norm
        n_step = check_int("n_step", n_step, minimum=1)
        self._nstep: NStepWriter | None = None
        stored = input_fields
        if n_step > 1:
            self._nstep = NStepWriter(input_fields, n_step, gamma, **dict(nstep_keys or {}))
            stored = self._nstep.output_fields
        else:
            check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        self._gamma = float(gamma)
        self._alpha_schedule = _sched.as_schedule(
            "alpha", self._default_alpha if alpha is None else alpha
        )
        self._beta_schedule = _sched.as_schedule(
            "beta", self._default_beta if beta is None else beta
        )
        self._step = 0
        alpha0 = self._checked_alpha(self._alpha_schedule(0))
        self._check_beta(self._beta_schedule(0))
        if seed is not None:
            seed = check_int("seed", seed, minimum=0)
        self._seed = seed
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._storage = Storage(stored, self._capacity)
        self._sampler = self._make_sampler(alpha0)
        self._added = 0  # transitions ever written = the next transition's key
        self._key_base = 0  # _added at the last clear: slot = (key - base) % capacity
        self._max_priority = 1.0
        self._stale_updates = 0
        self._lock = threading.RLock()
        self._status = np.zeros(4, dtype=np.int64)  # update kernels' result codes

    # -- construction hooks --------------------------------------------------
    def _make_sampler(self, alpha: float) -> Sampler:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sampler_settings(self) -> dict[str, Any]:
        return {}

    # -- introspection ---------------------------------------------------------
    def __len__(self) -> int:
        return self._storage.size

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    @property
    def fields(self) -> dict[str, Field]:
        """The stored field spec (with ``discount`` for n-step buffers)."""
        return dict(self._storage.fields)

    @property
    def max_priority(self) -> float:
        """Largest priority ever recorded (starts at 1.0, never decreases)."""
        return self._max_priority

    @property
    def stale_updates(self) -> int:
        """Priority updates dropped because their slot was overwritten since sampled."""
        return self._stale_updates

    @property
    def total_added(self) -> int:
        """Transitions ever written to storage (the next transition's key)."""
        return self._added

    @property
    def alpha(self) -> float:
        """The alpha currently applied to the stored priorities."""
        return self._sampler.alpha

    @property
    def beta(self) -> float:
        """beta at the current step (used when ``sample`` gets no beta)."""
        return float(self._beta_schedule(self._step))

    @property
    def step(self) -> int:
        """Schedule step: counts successful ``sample`` calls; may be set."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        with self._lock:
            value = check_int("step", value, minimum=0)
            self._check_beta(self._beta_schedule(value))
            self._apply_alpha(self._checked_alpha(self._alpha_schedule(value)))
            self._step = value

    @property
    def n_pending(self) -> int:
        """Transitions held back by the n-step writer, not yet stored."""
        return 0 if self._nstep is None else self._nstep.n_pending

    @_locked
    def keys(self, indices: Any) -> np.ndarray:
        """Key (insertion counter) of the current occupant of each slot. O(B)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._keys_of(idx)

    def _keys_of(self, idx: np.ndarray) -> np.ndarray:
        return slot_keys(idx, self._key_base, self._added, self._capacity)

    @_locked
    def priorities(self, indices: Any) -> np.ndarray:
        """Raw priorities p_i (before alpha) of written slots. O(B)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._sampler.raw[idx].copy()

    @_locked
    def probabilities(self, indices: Any) -> np.ndarray:
        """P(i) a single draw picks each slot, under exact (non-stratified) sampling. O(N) for rank."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        return self._probabilities(idx)

    def _probabilities(self, idx: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _checked_alpha(self, value: Any) -> float:
        if type(value) is float and 0.0 <= value < math.inf:  # fast path, no ABC checks
            return value
        return check_real("alpha", value, minimum=0.0)

    @staticmethod
    def _check_beta(value: Any) -> float:
        if type(value) is float and 0.0 <= value < math.inf:
            return value
        return check_real("beta", value, minimum=0.0)

    def _apply_alpha(self, alpha: float) -> None:
        if alpha != self._sampler.alpha:
            self._sampler.check_priorities("priorities", self._sampler.raw[: len(self)], alpha)
            self._sampler.check_priorities("max_priority", np.asarray([self._max_priority]), alpha)
            self._sampler.set_alpha(alpha, len(self))

    @_locked
    def set_alpha(self, alpha: _sched.ScheduleLike) -> None:
        """Replace alpha (a number or a schedule); re-weights all priorities. O(N)."""
        schedule = _sched.as_schedule("alpha", alpha)
        value = self._checked_alpha(schedule(self._step))
        self._alpha_schedule = schedule
        self._apply_alpha(value)

    @_locked
    def set_beta(self, beta: _sched.ScheduleLike) -> None:
        """Replace beta (a number or a schedule). O(1)."""
        schedule = _sched.as_schedule("beta", beta)
        self._check_beta(schedule(self._step))
        self._beta_schedule = schedule

    # -- priorities ------------------------------------------------------------
    def _priority_from_td(self, td: np.ndarray) -> np.ndarray:
        mag = np.abs(td)
        if self._clip is not None:
            mag = np.minimum(mag, self._clip)
        return mag + self._eps

    # -- add ---------------------------------------------------------------------
    @_locked
    def add(self, transition: Mapping[str, Any], priorities: Any = None) -> np.ndarray:
        """Store one transition or a batch (leading dimension); O(B log N).

        Args:
            transition: ``{field: value}`` for every field; a value of the
                field's shape is one transition, one with an extra leading
                dimension a batch. Values are cast to the field's dtype where no
                value changes (e.g. float64 -> float32, integral floats -> int).
                NaN and inf in float fields are stored as given, unchecked.
            priorities: optional raw priorities p_i (>= 0, finite), one per
                transition; by default each gets :attr:`max_priority`. Not
                accepted with ``n_step > 1``.

        Returns:
            The slots written (int64); with n-step, those of the transitions
            completed by this call (possibly none).

        Raises:
            ValueError: missing / unknown fields, wrong shapes, an empty batch,
                a batch larger than the capacity (with n-step: one that would
                also complete more), or bad priorities.
            FieldTypeError: a value that cannot be cast safely.
        """
        if self._nstep is not None:
            if priorities is not None:
                raise ValueError("`priorities` cannot be given to add() when n_step > 1")
            batch, k = coerce_batch(self._nstep.fields, transition, None)
            out, m, pending = self._nstep.process(batch, k)
            cap = self._capacity
            if m > cap and k > cap:
                raise ValueError(
                    f"a batch must not complete more than capacity={cap} "
                    f"transitions, got {m}"
                )
            self._nstep.pending = pending
            if m == 0:
                return np.empty(0, dtype=np.int64)
            if m <= cap:
                return self._write(out, m, None)
            # An episode end flushes the pending window with the batch: more than
            # `capacity` may complete from a batch that fits. Written in ring order,
            # so the ring keeps the last `capacity`, as if added one by one.
            parts = [
                self._write({f: a[lo : lo + cap] for f, a in out.items()}, min(cap, m - lo), None)
                for lo in range(0, m, cap)
            ]
            return np.concatenate(parts)
        prepared, k = self._storage.prepare(transition)
        p = None
        if priorities is not None:
            arr = to_numpy(priorities)
            p = as_value_array("priorities", arr.reshape(-1) if arr.ndim == 0 else arr, k)
            self._sampler.check_priorities("priorities", p)
        return self._write(prepared, k, p)

    def _write(
        self, prepared: Mapping[str, np.ndarray], k: int, p: np.ndarray | None
    ) -> np.ndarray:
        start = self._storage.cursor
        slots = self._storage.commit(prepared, k)
        self._added += k
        if p is None:
            # new transitions: one priority for a contiguous run (two if it wraps)
            first = min(k, self._capacity - start)
            self._sampler.write_run(start, first, self._max_priority)
            if first < k:
                self._sampler.write_run(0, k - first, self._max_priority)
        else:
            self._max_priority = max(self._max_priority, float(p.max()))
            self._sampler.write(slots, p)
        return slots

    # -- sample ----------------------------------------------------------------
    @_locked
    def sample(self, batch_size: int, beta: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` transitions with replacement. O(B log N).

        Args:
            batch_size: number of draws, >= 1 (may exceed ``len(self)``).
            beta: IS exponent; by default the beta schedule at :attr:`step`.

        Returns:
            A frozen :class:`SampleBatch`.

        Raises:
            EmptyBufferError: the buffer holds nothing.
            ZeroPriorityError: every priority is zero (proportional).
            ValueError, TypeError: a bad ``batch_size`` or ``beta``.
        """
        b = batch_size if type(batch_size) is int and batch_size >= 1 else None
        if b is None:
            b = check_int("batch_size", batch_size, minimum=1)
        beta_v = self._check_beta(self._beta_schedule(self._step) if beta is None else beta)
        n = len(self)
        if n == 0:
            raise EmptyBufferError("cannot sample from an empty buffer (len(buffer) == 0)")
        alpha = self._checked_alpha(self._alpha_schedule(self._step))
        old_alpha = self._sampler.alpha
        try:
            self._apply_alpha(alpha)
            self._sampler.check_sampleable(n)
        except BaseException:
            self._apply_alpha(old_alpha)
            raise
        # Nothing below can fail on valid state, so the generator only advances
        # once every check has passed: a raising call leaves it untouched.
        u = self._rng.random(b)
        idx, prob, w, keys = self._sampler.sample(
            u, n, beta_v, self._stratified, NORM_CODES[self._weight_norm], self._key_base,
            self._added,
        )  # fmt: skip
        batch = SampleBatch(
            data=self._storage.gather(idx),
            indices=idx,
            weights=w,
            probabilities=prob,
            keys=keys,
        )
        self._step += 1
        return batch

    # -- update ----------------------------------------------------------------
    @_locked
    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> int:
        """Set p_i = min(|td_i|, clip) + eps for sampled slots. O(B log N).

        Duplicate indices: the last one wins. With ``keys`` (from
        :class:`SampleBatch`), entries whose slot now holds a different
        transition are dropped and counted in :attr:`stale_updates`.

        Returns:
            The number of priorities applied.

        Raises:
            InvalidIndexError: an index out of range or never written.
            ValueError: td errors not finite, lengths differ, bad keys.
        """
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
        status = self._status  # the kernel resets it; the lock keeps it ours
        pmax = self._sampler.update_from_td(
            idx, td, key_arr, use_keys, self._eps, self._clip_value, len(self),
            self._key_base, self._added, status,
        )  # fmt: skip
        if status[0]:
            self._raise_update_error(int(status[0]), idx, td, key_arr)
        kept = int(status[2])
        if kept:
            self._max_priority = max(self._max_priority, pmax)
        self._stale_updates += int(status[3])
        return kept

    def _raise_update_error(
        self, code: int, idx: np.ndarray, td: np.ndarray, keys: np.ndarray
    ) -> None:
        """Turn a kernel's error code into the validators' message (slow path)."""
        as_index_array("indices", idx, self._capacity, written=len(self))
        as_value_array("td_errors", td, idx.shape[0], nonnegative=False)
        self._sampler.check_priorities("td_errors", self._priority_from_td(td))
        if code == 5:
            bad = keys[(keys < 0) | (keys >= self._added)]
            raise ValueError(
                f"`keys` must be keys issued by this buffer, in [0, {self._added}), "
                f"got keys={show(bad[:8])}"
            )
        raise ValueError(f"invalid priority update (code {code})")  # pragma: no cover

    # -- housekeeping ----------------------------------------------------------
    @_locked
    def clear(self) -> None:
        """Drop every transition and pending n-step window. O(N).

        Keeps the random state, the step, the key counter (so old keys stay
        stale) and :attr:`max_priority` (which never decreases).
        """
        self._storage.clear()
        self._sampler.clear()
        self._key_base = self._added
        if self._nstep is not None:
            self._nstep.clear()

    def nbytes(self) -> dict[str, int]:
        """Memory held: ``data`` (storage), ``index`` (raw priorities and trees; keys are derived, not stored)."""
        data = sum(c.nbytes for c in self._storage.columns.values())
        index = sum(a.nbytes for a in vars(self._sampler).values() if isinstance(a, np.ndarray))
        return {"data": int(data), "index": int(index)}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, len={len(self)}, "
            f"fields={list(self._storage.fields)}, alpha={self.alpha:g})"
        )

    @_locked
    def save(self, path: Any) -> None:
        """Write a checkpoint atomically (temporary file + rename). O(N).

        See :func:`fastper.load`. Never uses pickle. Temporary files left by
        earlier saves to ``path`` that were killed are removed first (see
        :mod:`fastper.checkpoint`).
        """
        from .checkpoint import save_buffer

        save_buffer(self, path)


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
        n_step, gamma: write n-step returns (see :mod:`fastper.nstep`).
        seed: seed of the buffer's random generator.
        eps, clip: priority = min(|td|, clip) + eps.
    """

    kind = "uniform"

    def _make_sampler(self, alpha: float) -> Sampler:
        return UniformSampler(self._capacity, alpha)

    def _probabilities(self, idx: np.ndarray) -> np.ndarray:
        return np.full(idx.shape[0], 1.0 / len(self))


class PrioritizedReplayBuffer(_Buffer):
    """Proportional prioritized replay (Schaul et al. 2016).

    P(i) = p_i^alpha / sum_k p_k^alpha from a float64 sum tree; the buffer-wide
    largest IS weight comes from a min tree.

    Args:
        capacity: number of slots (>= 1).
        fields: the field spec, as for :class:`ReplayBuffer`.
        alpha: number or schedule, >= 0 (paper: 0.6). Changing it re-weights
            every stored priority exactly.
        beta: number or schedule, >= 0 (paper: 0.4 annealed to 1).
        eps: added to |td| (> 0 keeps every transition sampleable).
        clip: optional cap on |td| before eps.
        stratified: stratified (default) or independent draws.
        weight_norm: ``"buffer"`` (default), ``"batch"`` or ``"none"``. Only
            ``"buffer"`` keeps a min tree; the others skip its upkeep (an
            update of B = 256 at N = 2^20 took about 0.7x the time).
        n_step, gamma: n-step returns.
        seed: seed of the buffer's random generator.
    """

    kind = "proportional"
    _default_alpha = 0.6
    _default_beta = 0.4

    def _make_sampler(self, alpha: float) -> Sampler:
        # only buffer-wide normalisation reads the min tree: the others skip its upkeep
        return ProportionalSampler(self._capacity, alpha, track_min=self._weight_norm == "buffer")

    def _probabilities(self, idx: np.ndarray) -> np.ndarray:
        s = self._sampler
        assert isinstance(s, ProportionalSampler)
        return s.probabilities(idx)


class RankBasedReplayBuffer(_Buffer):
    """Rank-based prioritized replay: P(i) proportional to rank(i)^-alpha.

    rank 1 is the largest priority; ties go to the smaller slot index.

    Args:
        capacity, fields, beta, eps, clip, stratified, weight_norm, n_step,
            gamma, seed: as for :class:`PrioritizedReplayBuffer`.
        alpha: number or schedule (paper: 0.7, beta 0.5 annealed to 1).
        sort_every: ``None`` (default): exact ranks at every sample; the order
            is brought up to date lazily in O(N + k log k). An integer K:
            changes to existing slots reach the order only every K samples
            (the paper re-sorts every 10^6 steps); :meth:`sort` forces it.
        segments: sample as the paper does, one uniform pick in each of
            ``batch_size`` equal-probability rank segments (probabilities and
            weights then describe that scheme); default ``False``: exact draws.
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

    def _make_sampler(self, alpha: float) -> Sampler:
        return RankSampler(
            self._capacity, alpha, sort_every=self._sort_every, segments=self._segments
        )

    def _sampler_settings(self) -> dict[str, Any]:
        return {"sort_every": self._sort_every, "segments": self._segments}

    @_locked
    def sort(self) -> None:
        """Bring the rank order up to date now. O(N + k log k)."""
        s = self._sampler
        assert isinstance(s, RankSampler)
        s.sort(len(self))

    @_locked
    def ranks(self, indices: Any) -> np.ndarray:
        """1-based rank of each slot in the order sampling uses. O(N)."""
        idx = as_index_array("indices", indices, self._capacity, written=len(self))
        s = self._sampler
        assert isinstance(s, RankSampler)
        s._maybe_sort(len(self))
        return s.ranks_of(len(self))[idx] + 1

    def _probabilities(self, idx: np.ndarray) -> np.ndarray:
        s = self._sampler
        assert isinstance(s, RankSampler)
        n = len(self)
        s._maybe_sort(n)
        r = s.ranks_of(n)[idx] + 1.0
        return np.power(r, -s.alpha) / s.prefix[n - 1]
