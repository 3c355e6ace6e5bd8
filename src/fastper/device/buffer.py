"""Replay buffers whose rows, priorities and trees live on a torch device.

:class:`DevicePrioritizedReplayBuffer` (proportional) and
:class:`DeviceReplayBuffer` (uniform) follow the CPU buffers' decisions (see
``docs/concepts.md``): float64 trees that never drift, new transitions at
the largest priority ever recorded, stratified draws handed back in random
order, IS weights normalised buffer-wide by default, keys that make updates
of overwritten slots drop, last duplicate wins, a call that raises changes
nothing (random state included).

No host synchronisation in ``sample`` and ``update_priorities``: every
quantity that depends on the data (the total, the min, the keys, the
priorities, the count of entries applied) stays a device tensor; shapes
depend only on the batch size. What is known on the host without asking the
device (the number of stored transitions, the ring cursor, the key counter)
is kept on the host. Where a check of the *values* would need a sync, the
``validate`` flag chooses:

* ``validate=True`` (default): ``update_priorities`` (and ``add`` with
  explicit priorities) read one flag back from the device, and raise with
  the CPU buffers' messages on a bad index, a non-finite td error, a priority
  too large or a key never issued; the buffer is then unchanged. With
  ``eps == 0`` (where every priority could be zero) ``sample`` also reads the
  total back to refuse an all-zero buffer. An ``add`` of a tensor whose dtype
  narrows to its field's (float64 into float32, int64 into int32) reads one
  flag back too, and refuses a value the cast would change as the CPU
  buffers do (see :mod:`fastper.device.storage`). An ``add`` of a float
  reward tensor reads one flag back and refuses a NaN or inf reward, as the
  CPU buffers do (``allow_nonfinite_rewards=True`` stores them, unread).
* ``validate=False`` (the sync-free fast path): nothing is read back. Bad
  entries of an update are dropped and counted in :attr:`invalid_updates`
  (they never reach the tree); bad explicit priorities of an ``add`` are
  replaced by the new-transition priority and counted; a narrowing cast is
  torch's, unchecked; rewards given as tensors are stored unchecked (host
  arrays are still checked on the host).

Tensors that track gradients (a loss as td errors, rows computed by a model)
are used detached: the buffer never holds an autograd graph. A ``device``
that is not available (``"cuda"`` without a GPU or a CUDA build of torch)
is refused at construction with a ValueError that says what to pass.

Costs: ``add`` O(B log N); ``sample`` and ``update_priorities`` O(B log N)
work in O(log N) tensor operations (see :mod:`fastper.device.tree`). Data
given as host arrays is checked on the host; tensors are checked by shape
and dtype (see :mod:`fastper.device.storage`). n-step windows are built on
the host by the CPU buffers' :class:`fastper.nstep.NStepWriter` (the same
plan, write, commit order): with ``n_step > 1`` or stream tracking, added
tensors are copied to the host first and the completed rows copied back.

Draws follow :mod:`fastper.policy` (stratified targets, P(i), IS weights).
The ``"numba"`` back end (the CPU device's default) runs the CPU buffers'
samplers, so given the same uniforms it returns their slots, probabilities
and weights bit for bit (weights as float32). The ``"torch"`` back end
evaluates the same expressions with torch operations: torch's ``pow`` may
differ from the C library's in the last bit, and the 64-ary tree sums in
another order, so P(i) and weights can differ in the last bit (and a
target within rounding of a boundary between two slots can land on the
neighbour).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np

from .. import checkpoint as _ckpt
from .. import schedules as _sched
from .._validation import (
    as_1d,
    as_index_array,
    as_value_array,
    check_finite_rewards,
    check_int,
    check_real,
    check_row_ids,
    dtype_error,
    ndim_error,
    show,
    unwrap_batch,
)
from ..batch import check_batch_size
from ..buffer_core import BufferCore, check_flag, constructor_args
from ..buffer_state import (
    locked,
    restore_schedule,  # the checkpoint loader's rule for schedules
)
from ..errors import CheckpointError, EmptyBufferError, ZeroPriorityError
from ..samplers import check_priority_array
from ..storage import FieldLike, coerce_batch
from ..writer import RingWriter
from ._torch import check_device, torch
from .index import NORMS, NumbaIndex, TorchIndex, priority_limit, slot_keys
from .storage import TorchStorage

__all__ = ["DeviceBatch", "DevicePrioritizedReplayBuffer", "DeviceReplayBuffer", "load"]


@dataclass(frozen=True)
class DeviceBatch:
    """One sampled minibatch, every tensor on the buffer's device.

    Attributes:
        data: ``{field: tensor}`` with a leading ``batch_size`` dimension (new tensors).
        indices: slots sampled (int64), for ``update_priorities``.
        weights: importance-sampling weights (float32, for the loss).
        probabilities: P(i) of each sampled slot (float64).
        keys: insertion counter of each slot's occupant (int64).
    """

    data: dict[str, torch.Tensor]
    indices: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor
    keys: torch.Tensor

    def __getitem__(self, field: str) -> torch.Tensor:
        return self.data[field]

    def __len__(self) -> int:
        return int(self.indices.shape[0])


def _tensor(name: str, value: Any, kinds: str, device: torch.device) -> torch.Tensor:
    """A 1-D tensor on ``device``, int64 (``kinds="iu"``) or float64 (``"iuf"``), detached.

    Host values (numpy arrays, lists, numbers) go through the CPU buffers'
    converter (:func:`fastper._validation.as_1d`: floats stay float64, the
    same messages). Tensors are checked by dtype and shape only (metadata: no
    host sync), with the same messages; a value of another kind (floats as
    indices, bools, complex) is refused. A tensor that tracks gradients (a
    loss, say) is detached: the buffer never holds an autograd graph.
    """
    dtype = torch.int64 if kinds == "iu" else torch.float64
    if not isinstance(value, torch.Tensor):
        arr = as_1d(name, value, kinds)
        return torch.from_numpy(arr).to(device)
    t = value.detach()
    if type(t) is torch.Tensor and t.dtype == dtype and t.ndim == 1:
        # the common case: tensors straight from a DeviceBatch
        return t if t.device == device else t.to(device)
    kind = _kind(t.dtype)
    if t.numel() and kind not in kinds:
        raise dtype_error(name, kinds, t.dtype)
    if t.ndim == 0:
        t = t.reshape(1)
    if t.ndim != 1:
        raise ndim_error(name, tuple(t.shape))
    return t.to(device=device, dtype=dtype)


def _kind(dtype: torch.dtype) -> str:
    """The numpy kind letter of a torch dtype (b, c, f, u, i)."""
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if not dtype.is_signed else "i"


class _DeviceBuffer(BufferCore):
    """Shared machinery; use :class:`DevicePrioritizedReplayBuffer` or :class:`DeviceReplayBuffer`."""

    _prioritized: ClassVar[bool] = True
    _default_alpha: ClassVar[float] = 0.6
    _default_beta: ClassVar[float] = 0.4

    def __init__(
        self,
        capacity: int,
        fields: Mapping[str, FieldLike],
        *,
        device: Any = "cpu",
        alpha: _sched.ScheduleLike | None = None,
        beta: _sched.ScheduleLike | None = None,
        eps: float = 1e-6,
        clip: float | None = None,
        max_priority: str | float = "ever",
        stratified: bool = True,
        shuffle: bool = True,
        weight_norm: str = "buffer",
        alpha_every: int | None = None,
        priority_noise: _sched.ScheduleLike = 0.0,
        n_step: int = 1,
        gamma: float = 0.99,
        n_envs: int | None = None,
        autoreset: str | None = None,
        nstep_keys: Mapping[str, str | None] | None = None,
        seed: int | None = None,
        validate: bool = True,
        backend: str | None = None,
        allow_nonfinite_rewards: bool = False,
    ) -> None:
        self._device = check_device(device)
        stored, alpha0 = self._configure(
            capacity, fields, alpha=alpha, beta=beta, eps=eps, clip=clip,
            max_priority=max_priority, policies=("ever",), stratified=stratified,
            shuffle=shuffle, weight_norm=weight_norm, norms=NORMS, alpha_every=alpha_every,
            priority_noise=priority_noise, n_step=n_step, gamma=gamma, n_envs=n_envs,
            autoreset=autoreset, nstep_keys=nstep_keys, seed=seed,
            allow_nonfinite_rewards=allow_nonfinite_rewards,
        )  # fmt: skip
        self._validate = check_flag("validate", validate)
        seed = self._seed
        self._storage = TorchStorage(
            stored, self._capacity, self._device, check_values=self._validate
        )
        dev, f64 = self._device, torch.float64
        self._gen = torch.Generator(device=dev)
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)
        if backend is None:
            backend = "numba" if dev.type == "cpu" else "torch"
        if backend not in ("torch", "numba"):
            raise ValueError(f"`backend` must be 'torch', 'numba' or None, got backend={backend!r}")
        self._backend = backend
        index_cls = TorchIndex if backend == "torch" else NumbaIndex
        self._index: TorchIndex | NumbaIndex = index_cls(
            self._capacity, alpha0, self._prioritized, weight_norm == "buffer", dev
        )
        self._max_seen = torch.ones((), dtype=f64, device=dev)
        self._stale = torch.zeros((), dtype=torch.int64, device=dev)
        self._invalid = torch.zeros((), dtype=torch.int64, device=dev)
        # may a stored priority be zero? (only then does sample check the total)
        self._may_be_zero = self._eps == 0.0
        self._lock = threading.RLock()

    # -- introspection -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where rows, priorities and trees live."""
        return self._device

    @property
    def storage(self) -> TorchStorage:
        """The device columns."""
        return cast(TorchStorage, self._storage)

    @property
    def backend(self) -> str:
        """``"torch"`` (tensor operations, sync-free) or ``"numba"`` (compiled kernels, CPU only)."""
        return self._backend

    @property
    def validate(self) -> bool:
        """Whether updates are checked (one host sync each; see the module docstring)."""
        return self._validate

    @property
    def alpha(self) -> float:
        """The alpha in force: the one the stored probabilities and weights use."""
        return self._index.alpha

    @property
    def step(self) -> int:
        """Schedule step: counts successful ``sample`` calls."""
        return self._step

    @property
    def max_priority(self) -> torch.Tensor:
        """The priority a new transition gets now: a 0-dim float64 device tensor. O(1)."""
        return self._new_priority()

    @property
    def max_priority_ever(self) -> float:
        """Largest priority ever recorded (reads the device: syncs)."""
        return float(self._max_seen)

    @property
    def stale_updates(self) -> int:
        """Updates dropped because their slot was overwritten since sampled (syncs)."""
        return int(self._stale)

    @property
    def invalid_updates(self) -> int:
        """Entries dropped (``validate=False``) for a bad index, td error, priority or key (syncs)."""
        return int(self._invalid)

    def _new_priority(self) -> torch.Tensor:
        cap = self._priority_cap()
        if self._max_policy == "ever":
            return self._max_seen.clamp(max=cap)
        return torch.full((), min(float(self._max_policy), cap), dtype=torch.float64,
                          device=self._device)  # fmt: skip

    def _keys(self, idx: torch.Tensor) -> torch.Tensor:
        w = self._writer
        return slot_keys(idx, w.key_base, w.added, self._capacity)

    def _slots(self, indices: Any) -> torch.Tensor:
        """Validated slots (host check: syncs), for the introspection methods.

        The CPU buffers' check and messages (InvalidIndexError for a slot out of
        range or never written)."""
        idx = _tensor("indices", indices, "iu", self._device)
        as_index_array("indices", idx.cpu().numpy(), self._capacity, written=len(self))
        return idx

    @locked
    def keys(self, indices: Any) -> torch.Tensor:
        """Key of the current occupant of each slot. O(B); checks the indices (syncs)."""
        return self._keys(self._slots(indices))

    @locked
    def priorities(self, indices: Any) -> torch.Tensor:
        """Raw priorities p_i of written slots (float64 tensor). O(B); syncs to check."""
        return self._index.raw.index_select(0, self._slots(indices))

    @locked
    def probabilities(self, indices: Any) -> torch.Tensor:
        """P(i) one draw picks each slot with (float64 tensor): the sampling mass
        over the total (:func:`fastper.policy.probabilities`), as ``sample``
        reports it. O(B); syncs to check the indices."""
        return self._index.probabilities(self._slots(indices), len(self))

    @locked
    def get(self, indices: Any) -> dict[str, torch.Tensor]:
        """The rows stored in slots ``indices``, read without sampling. O(B); syncs to check.

        Returns the fields a :class:`DeviceBatch` holds for the same slots
        (``batch.data``: every stored field, ``discount`` with n-step
        returns), new tensors on the device with a leading dimension of
        ``len(indices)`` (a single index gives one row). Slots are ring
        positions, as in ``batch.indices``; :meth:`keys` gives the transition
        each holds. Draws nothing and changes nothing (generator, step and
        priorities stay as they were).

        Raises:
            InvalidIndexError: an index outside ``[0, capacity)`` or a slot never
                written (the CPU buffers' check, on the host).
            TypeError, ValueError: indices that are not integers, or not 1-D.
        """
        return self._storage.gather(self._slots(indices))

    # -- schedules ---------------------------------------------------------------------
    def _apply_alpha(self, alpha: float) -> None:
        index = self._index
        if alpha == index.alpha:
            return
        if alpha > 1.0 and self._prioritized:
            # p ** alpha may overflow the tree only for alpha > 1: read the largest priority
            limit = math.exp(math.log(index.max_value) / alpha)
            if float(self._max_seen) > limit:
                raise ValueError(
                    f"`alpha`={alpha!r} would overflow the sum tree: priorities must stay "
                    f"<= {limit:.3e}, the largest is {float(self._max_seen)!r}"
                )
        index.set_alpha(alpha, len(self))

    # -- add ---------------------------------------------------------------------------
    @locked
    def add(
        self, transition: Mapping[str, Any], priorities: Any = None, *, env_ids: Any = None
    ) -> torch.Tensor:
        """Store one transition or a batch (leading dimension). O(B log N).

        Two phases, as the CPU buffers: every check and the n-step windows'
        plan first, then the rows are written, then the ring, the priorities
        and the windows move. A call that raises (bad input, or a storage
        write that fails) changes nothing.

        Args:
            transition: ``{field: value}``; torch tensors (on any device) or host
                arrays (see :mod:`fastper.device.storage` for the checks). A
                tensor that tracks gradients is stored detached.
            priorities: optional raw priorities (>= 0, finite), one per row;
                by default each gets :attr:`max_priority`. Not with n-step.
            env_ids: stream of each row, for n-step windows (as the CPU buffers).

        Returns:
            The slots written, an int64 tensor on the device; with n-step,
            those of the transitions completed by this call (possibly none).

        Raises:
            ValueError: missing / unknown fields, wrong shapes, an empty batch,
                a batch larger than the capacity (with n-step: one that would
                also complete more), bad priorities or stream ids.
            FieldTypeError: a value that the field's dtype cannot hold (as
                the CPU buffers; see :mod:`fastper.device.storage`).
        """
        nstep = self._nstep
        if nstep is not None:
            self._refuse_priorities_with_windows(priorities)
            # the windows are kept on the host: tensors are read there (detached)
            batch, k = coerce_batch(nstep.fields, transition, None)
            self._check_rewards(batch)
            plan = self._plan_windows(batch, k, env_ids)
            m = plan.count
            if m == 0:
                nstep.commit(plan)
                return torch.empty(0, dtype=torch.int64, device=self._device)
            # the rows first, the windows after: a write that fails leaves both as they were
            slots = self._write(plan.out, m, None)
            nstep.commit(plan)
            return slots
        prepared, k = self._storage.prepare(transition)
        if self._reward_check is not None:
            self._check_device_rewards(prepared)
        check_row_ids(env_ids, k)
        if priorities is None:
            return self._write(prepared, k, None)
        p = _tensor("priorities", priorities, "iuf", self._device)
        if p.shape[0] != k:
            raise ValueError(
                f"`priorities` must have {k} entries (one per row), got priorities with "
                f"{p.shape[0]}"
            )
        p, may_be_zero, invalid = self._checked_add_priorities(p)
        slots = self._write(prepared, k, p)
        if may_be_zero:
            self._may_be_zero = True
        if invalid is not None:
            self._invalid += invalid
        return slots

    def _check_device_rewards(self, prepared: Mapping[str, Any]) -> None:
        """Refuse NaN / inf rewards: host arrays on the host; a tensor with one flag read
        back (``validate=True``), unread with ``validate=False``. Changes nothing."""
        field = self._reward_check
        assert field is not None
        rewards = prepared[field]
        if not isinstance(rewards, torch.Tensor):
            self._check_rewards(prepared)
        elif self._validate and rewards.is_floating_point():
            if not bool(torch.isfinite(rewards).all()):  # the one read-back
                check_finite_rewards(field, rewards.detach().to(torch.float64).cpu().numpy())

    def _checked_add_priorities(
        self, p: torch.Tensor
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """``add``'s priorities, checked: (the priorities to write, may one be zero,
        the count of bad entries replaced, ``validate=False`` only). Changes nothing."""
        limit = self._index.limit
        bad = ~torch.isfinite(p) | (p < 0) | (p > limit)
        if self._validate:
            if bool(bad.any()):  # the one read-back of a validated add with priorities
                # the CPU buffers' messages for non-finite and negative values
                as_value_array("priorities", p.cpu().numpy(), p.shape[0])
                raise ValueError(
                    f"`priorities` must be <= {limit:.3e} (so the sum tree stays finite), got "
                    f"priorities={show(p[bad][:8].cpu().numpy())}"
                )
            zero = self._eps == 0.0 or bool((p == 0).any())
            return p + 0.0, zero, None
        # unread: assume a zero may be there; bad entries get the new-transition priority
        return torch.where(bad, self._new_priority(), p) + 0.0, True, bad.sum()

    def _write(self, prepared: Mapping[str, Any], k: int, p: torch.Tensor | None) -> torch.Tensor:
        """Write ``k`` checked rows from the cursor on (``p``: their priorities, or None
        for the new-transition priority); the slots, an int64 device tensor.

        The storage write comes first: if it raises, nothing has changed. The
        rest cannot fail. More than ``capacity`` rows (an episode end flushing
        n-step windows; ``p`` is None then) land in ring order, so the ring keeps
        the last ``capacity`` of them, as if added one by one; only those are
        copied. O(min(k, capacity) log N).
        """
        cap = self._capacity
        w = self._writer
        start = w.cursor
        kept = min(k, cap)
        at = (start + k - kept) % cap  # the slot of the first row that stays
        rows = prepared if kept == k else {f: a[k - kept :] for f, a in prepared.items()}
        self._storage.write(at, rows, kept)
        # committed: nothing below can fail
        for lo in range(0, k, cap):
            w.advance(min(cap, k - lo))
        first = min(kept, cap - at)  # the run, and its wrapped rest
        if p is None:
            value = self._new_priority()
            self._index.fill(at, first, value)
            if first < kept:
                self._index.fill(0, kept - first, value)
        else:
            self._max_seen = torch.maximum(self._max_seen, p.max())
            self._index.write(at, p[:first])
            if first < kept:
                self._index.write(0, p[first:])
        return (start + torch.arange(k, dtype=torch.int64, device=self._device)) % cap

    # -- sample ------------------------------------------------------------------------
    @locked
    def sample(self, batch_size: int, beta: float | None = None) -> DeviceBatch:
        """Draw ``batch_size`` transitions with replacement. O(B log N), no host sync.

        Returns:
            A :class:`DeviceBatch` (tensors on the device, weights float32), in
            random order unless ``shuffle=False``.

        Raises:
            EmptyBufferError: the buffer holds nothing.
            ZeroPriorityError: every priority is zero (checked only when one
                can be: ``eps == 0`` or explicit zero priorities, with ``validate``).
        """
        b = check_batch_size(batch_size)  # at most 2^24 draws: an absurd size fails here
        beta_v = check_real(
            "beta", self._beta_schedule(self._step) if beta is None else beta, minimum=0.0
        )
        n = len(self)
        if n == 0:
            raise EmptyBufferError("cannot sample from an empty buffer (len(buffer) == 0)")
        old_alpha = self._index.alpha
        self._apply_alpha(self._alpha_at(self._step))
        try:
            if self._prioritized and self._validate and self._may_be_zero:
                if not float(self._index.total) > 0.0:
                    raise ZeroPriorityError(
                        f"cannot sample: all {n} stored priorities are zero (raise `eps` above 0 "
                        "or update priorities)"
                    )
        except BaseException:
            self._apply_alpha(old_alpha)
            raise
        dev, f64 = self._device, torch.float64
        u = torch.rand(b, generator=self._gen, dtype=f64, device=dev)
        w = self._writer
        # slices come out in slot order: minibatches cut from a batch would each
        # get a contiguous piece of the ring
        perm = (
            torch.randperm(b, generator=self._gen, device=dev) if self._shuffle and b > 1 else None
        )
        idx, prob, weights, keys = self._index.draw(
            u, n, beta_v, self._stratified, self._weight_norm, w.key_base, w.added, perm
        )
        batch = DeviceBatch(
            data=self._storage.gather(idx),
            indices=idx,
            weights=weights,
            probabilities=prob,
            keys=keys,
        )
        self._step += 1
        return batch

    # -- update ------------------------------------------------------------------------
    @locked
    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> torch.Tensor:
        """Set p_i = min(|td_i|, clip) + eps for sampled slots. O(B log N).

        Duplicate indices: the last one wins. With ``keys``, entries whose slot
        was overwritten since it was sampled are dropped (:attr:`stale_updates`).
        No host sync with ``validate=False``; with ``validate=True`` one read
        of a flag (see the module docstring). ``td_errors`` may be a tensor that
        tracks gradients (a loss): its values are used, detached.
        ``update_priorities(batch, td_errors)`` takes the batch's indices and keys.

        Returns:
            The number of priorities applied: a 0-dim int64 device tensor.

        Raises (``validate=True``):
            InvalidIndexError: an index out of range or never written.
            ValueError: td errors not finite or too large, lengths differ, keys
                never issued.
        """
        dev = self._device
        indices, keys = unwrap_batch(indices, keys)
        idx = _tensor("indices", indices, "iu", dev)
        td = _tensor("td_errors", td_errors, "iuf", dev)
        use_keys = keys is not None
        key_t = _tensor("keys", keys, "iu", dev) if use_keys else None
        b = idx.shape[0]
        for name, t in (("td_errors", td), ("keys", key_t)):
            if t is not None and t.shape[0] != b:
                raise ValueError(
                    f"`{name}` must have {b} entries (one entry per index), got {name} with {t.shape[0]}"
                )
        if b == 0:
            return torch.zeros((), dtype=torch.int64, device=dev)
        sigma = check_real("priority_noise", self._noise_schedule(self._step), minimum=0.0)
        gen_state = self._gen.get_state() if sigma else None
        if sigma:
            z = torch.randn(b, generator=self._gen, dtype=torch.float64, device=dev)
            td = td.abs() * torch.exp(sigma * z)
        w = self._writer
        try:
            applied, pmax, stale, invalid = self._index.update(
                idx, td, key_t, self._eps, self._clip, len(self), w.key_base, w.added,
                self._validate, bool(sigma),
            )  # fmt: skip
        except BaseException:
            if gen_state is not None:
                self._gen.set_state(gen_state)
            raise
        if isinstance(applied, torch.Tensor):  # device values: no sync
            self._max_seen = torch.maximum(self._max_seen, cast(torch.Tensor, pmax))
            self._stale += stale
            if not self._validate:
                self._invalid += invalid
            return applied
        # host numbers (the numba back end, CPU only): skip the no-op tensor calls
        if float(pmax) > float(self._max_seen):
            self._max_seen = torch.tensor(float(pmax), dtype=torch.float64)
        if stale:
            self._stale += stale
        if invalid and not self._validate:
            self._invalid += invalid
        return torch.tensor(applied)

    # -- housekeeping ------------------------------------------------------------------
    @locked
    def clear(self) -> None:
        """Drop every transition and pending window; keeps the generator, step, key counter and max priority."""
        self._storage.clear()
        self._index.clear()
        self._writer.clear()
        if self._nstep is not None:
            self._nstep.clear()

    def nbytes(self) -> dict[str, int]:
        """Device memory held: ``data`` (columns) and ``index`` (priorities, trees, scratch)."""
        return {"data": self._storage.nbytes(), "index": self._index.nbytes()}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, len={len(self)}, "
            f"device={self._device}, fields={list(self._storage.fields)}, alpha={self.alpha:g})"
        )

    # -- state -------------------------------------------------------------------------
    @locked
    def state_dict(self) -> dict[str, Any]:
        """The whole state as host objects (numpy arrays in its parts). O(N); syncs."""
        n = len(self)
        return {
            "kind": self.kind,
            "settings": self._settings(),
            "schedules": self._schedules_state(),
            "buffer": {
                "max_priority_ever": float(self._max_seen),
                "stale_updates": int(self._stale),
                "invalid_updates": int(self._invalid),
                "may_be_zero": self._may_be_zero,
                "step": self._step,
                "rng": self._gen.get_state().numpy().copy(),
                "rng_device": self._device.type,
            },
            "writer": self._writer.state_dict(),
            "sampler": {
                "alpha": self.alpha,
                "priorities": self._index.raw[:n].cpu().numpy().copy(),
            },
            "storage": self._storage.state_dict(n),
            "nstep": None if self._nstep is None else self._nstep.state_dict(),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a checkpoint (fastper's pickle-free format, atomically). O(N); syncs."""
        state = self.state_dict()
        _ckpt.write_state(path, state)

    @locked
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with ``state`` (this class's ``state_dict``, or a CPU
        buffer's of the same scheme and settings). Checked first: a refused state
        changes nothing. O(N)."""
        other = _from_state(state, self._device, self._alpha_schedule, self._beta_schedule,
                            validate=self._validate, expect=type(self),
                            backend=self._backend)  # fmt: skip
        if other._settings() != self._settings() | {"seed": other._seed}:
            raise ValueError("`state` must come from a buffer with this buffer's settings")
        self.__dict__.update({k: v for k, v in other.__dict__.items() if k != "_lock"})

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, device: Any = "cpu", validate: bool = True,
        backend: str | None = None, alpha: _sched.ScheduleLike | None = None,
        beta: _sched.ScheduleLike | None = None,
    ) -> _DeviceBuffer:  # fmt: skip
        """A new device buffer holding ``state``: a device buffer's, or a CPU buffer's
        (``PrioritizedReplayBuffer`` / ``ReplayBuffer``, scheme unchanged). A CPU state's
        numpy random state cannot drive a torch generator: the new generator is
        seeded from the settings' seed (or fresh entropy). O(N)."""
        return _from_state(
            state, device, alpha, beta, validate=validate, expect=cls, backend=backend
        )

    def _take_state(self, state: Mapping[str, Any], cpu: bool) -> None:
        """Fill this new, empty buffer (built from ``state``'s settings) with ``state``'s
        contents: a device state, or a CPU buffer's (``cpu``). Every part is
        checked before any is taken. O(N)."""
        buf_state = dict(state["buffer"])
        writer = RingWriter(self._capacity)
        writer.load_state_dict(state["writer"])
        n = writer.size
        sampler = state["sampler"]
        pri = check_priority_array("priorities", sampler["priorities"], n)
        max_seen = check_real("max_priority_ever", buf_state["max_priority_ever"], minimum=1.0)
        if n and float(pri.max()) > max_seen:
            raise ValueError(f"max_priority_ever={max_seen!r} is below a stored priority")
        step = check_int("step", buf_state["step"], minimum=0)
        alpha_v = check_real("alpha", sampler["alpha"], minimum=0.0)
        limit = priority_limit(self._index.max_value, alpha_v)
        if n and float(pri.max()) > limit:
            raise ValueError(f"a stored priority exceeds {limit:.3e}, the device tree's limit")
        stale = check_int("stale_updates", buf_state["stale_updates"], minimum=0)
        invalid = check_int("invalid_updates", buf_state.get("invalid_updates", 0), minimum=0)
        if not cpu:
            rng = buf_state["rng"]
            if not isinstance(rng, np.ndarray) or rng.dtype != np.uint8 or rng.ndim != 1:
                raise ValueError("random state must be a 1-D uint8 array")
            # a CPU and a CUDA generator keep different states: across device types
            # the new buffer keeps its generator, seeded from the settings' seed
            if buf_state.get("rng_device", "cpu") == self._device.type:
                try:
                    self._gen.set_state(torch.from_numpy(rng.copy()))
                except (RuntimeError, ValueError) as exc:
                    raise ValueError(
                        f"random state is invalid for a {self._device} generator: {exc}"
                    ) from None
        nstep_state = state.get("nstep")
        if (nstep_state is None) != (self._nstep is None):
            raise ValueError("the n-step state does not match the n-step settings")
        self._storage.load_state_dict(state["storage"], n)
        if self._nstep is not None and nstep_state is not None:
            self._nstep.load_state_dict(nstep_state)
        self._writer = writer
        self._step = step
        dev = self._device
        self._index.load(pri, n, alpha_v)
        self._max_seen = torch.tensor(max_seen, dtype=torch.float64, device=dev)
        self._stale = torch.tensor(stale, device=dev)
        self._invalid = torch.tensor(invalid, device=dev)
        zero = bool(buf_state.get("may_be_zero", True)) if not cpu else True
        self._may_be_zero = zero or self._eps == 0.0


_CPU_KINDS = {"proportional": "device_proportional", "uniform": "device_uniform"}
_KINDS: dict[str, type[_DeviceBuffer]] = {}


def _from_state(
    state: Mapping[str, Any], device: Any, alpha: Any, beta: Any, *, validate: bool,
    expect: type[_DeviceBuffer] | None = None, backend: str | None = None,
) -> _DeviceBuffer:  # fmt: skip
    kind = state.get("kind")
    cpu = kind in _CPU_KINDS
    cls = _KINDS.get(_CPU_KINDS.get(str(kind), str(kind)))
    if cls is None:
        raise ValueError(
            f"unknown buffer kind {kind!r} for a device buffer (one of {sorted(_KINDS)} or the "
            f"CPU kinds {sorted(_CPU_KINDS)})"
        )
    if expect is not None and expect is not _DeviceBuffer and cls is not expect:
        raise ValueError(f"a {kind!r} state cannot be loaded into a {expect.__name__}")
    s = dict(state["settings"])
    buf_state = dict(state["buffer"])
    if cpu:
        if buf_state.get("scheme") != kind or buf_state.get("pending_switch") is not None:
            raise ValueError(
                "only a CPU state sampling with its own scheme and no pending switch can move to "
                f"a device, got scheme {buf_state.get('scheme')!r}"
            )
        if s.get("max_priority") == "current":
            raise ValueError("`max_priority='current'` is not kept by device buffers")
    # the CPU buffers' own settings (rank options, ...) have no device counterpart
    shared = ("capacity", "fields", "nstep", "eps", "clip", "max_priority", "stratified",
              "shuffle", "weight_norm", "alpha_every", "gamma", "seed")  # fmt: skip
    args = constructor_args({k: s.get(k) for k in shared})
    sch = state["schedules"]
    buf = cls(
        **args, device=device, validate=validate, backend=backend,
        alpha=restore_schedule(sch["alpha"], alpha, "alpha"),
        beta=restore_schedule(sch["beta"], beta, "beta"),
        priority_noise=restore_schedule(sch["priority_noise"], None, "priority_noise"),
    )  # fmt: skip
    buf._take_state(state, cpu)
    return buf


def load(
    path: str | os.PathLike[str], *, device: Any = "cpu", validate: bool = True,
    backend: str | None = None, alpha: _sched.ScheduleLike | None = None,
    beta: _sched.ScheduleLike | None = None,
) -> _DeviceBuffer:  # fmt: skip
    """Load a device buffer saved with ``save`` (or a CPU buffer's checkpoint) onto ``device``.

    Raises:
        CheckpointError: a truncated, altered or malformed file, or contents
            that do not make a consistent buffer.
        ValueError: ``device`` is not a device available here (checked first).
    """
    device = check_device(device)  # a bad argument is a ValueError, not a bad file
    try:
        state, _ = _ckpt.read_state(path)
        return _from_state(state, device, alpha, beta, validate=validate, backend=backend)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: inconsistent checkpoint contents: {exc}") from None


class DevicePrioritizedReplayBuffer(_DeviceBuffer):
    """Proportional prioritized replay on a torch device (see the module docstring).

    Arguments as :class:`fastper.PrioritizedReplayBuffer`, plus ``device``
    (default ``"cpu"``) and ``validate`` (default ``True``). Not supported on
    the device: ``max_priority="current"`` and rank-based sampling.
    """

    kind = "device_proportional"


class DeviceReplayBuffer(_DeviceBuffer):
    """Uniform replay on a torch device: P(i) = 1/N, weights 1.

    Priorities may still be updated (kept, not used), as with
    :class:`fastper.ReplayBuffer`.
    """

    kind = "device_uniform"
    _prioritized = False
    _default_alpha = 1.0
    _default_beta = 0.0


_KINDS.update({c.kind: c for c in (DevicePrioritizedReplayBuffer, DeviceReplayBuffer)})
