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
is kept on the host.

Checks of values. ``update_priorities`` checks every entry of tensors on the
device (an index out of range or of a slot never written, a td error that is
not finite or gives a priority over the tree's limit, a key never issued):
a bad entry is dropped before it reaches the tree, the rest of the update
applies, and the count goes to device tallies. The ``validate`` flag decides
what happens next:

* ``validate=True`` (default): bad entries are reported, once, by the next
  call that reads the device anyway: :meth:`~_DeviceBuffer.check`,
  :attr:`~_DeviceBuffer.stale_updates`, :attr:`~_DeviceBuffer.invalid_updates`,
  :attr:`~_DeviceBuffer.max_priority_ever`, ``priorities``,
  ``probabilities``, ``keys``, ``get``, ``state_dict`` and ``save`` raise
  :class:`~fastper.errors.InvalidIndexError` (some index was bad) or
  ``ValueError`` naming how many entries failed which check. Values given
  as host arrays (numpy, lists) are checked on the host at once instead,
  with the CPU buffers' messages, and a bad one changes nothing. With
  ``eps == 0`` (where every priority could be zero) ``sample`` reads the
  total back to refuse an all-zero buffer. An ``add`` of a tensor whose
  dtype narrows to its field's (float64 into float32, int64 into int32)
  reads one flag back, and refuses a value the cast would change as the CPU
  buffers do (see :mod:`fastper.device.storage`); an ``add`` of a float
  reward tensor reads one flag back and refuses a NaN or inf reward, as the
  CPU buffers do (``allow_nonfinite_rewards=True`` stores them, unread); an
  ``add`` with explicit priorities reads their flag and minimum back.
* ``validate=False``: bad update entries are only counted in
  :attr:`~_DeviceBuffer.invalid_updates`; bad explicit priorities of an
  ``add`` are replaced by the new-transition priority and counted; a
  narrowing cast is torch's, unchecked; rewards given as tensors are stored
  unchecked (host arrays are still checked on the host). Nothing is read back.

Tensors that track gradients (a loss as td errors, rows computed by a model)
are used detached: the buffer never holds an autograd graph. A ``device``
that is not available (``"cuda"`` without a GPU or a CUDA build of torch)
is refused at construction with a ValueError that says what to pass.

Costs: ``add`` O(B + 64); ``sample`` and ``update_priorities`` O(B * 64 +
N / 64) work in a fixed number of tensor operations on the torch back end
(about 18 and 20 at the defaults with one field, whatever N: see
:mod:`fastper.device.index`), which :meth:`~_DeviceBuffer.graphed_step`
replays from CUDA graphs on a GPU. Data
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
differ from the C library's in the last bit, and its blocks of 64 leaves sum
in another order, so P(i) and weights can differ in the last bit (and a
target within rounding of a boundary between two slots can land on the
neighbour).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
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
from ..errors import CheckpointError, EmptyBufferError, InvalidIndexError, ZeroPriorityError
from ..samplers import check_priority_array
from ..storage import FieldLike, coerce_batch
from ..writer import RingWriter
from ._torch import check_device, torch
from .index import (
    KEY_LIMIT,
    MASS_FLOOR,
    NORMS,
    TALLIES,
    NumbaIndex,
    TorchIndex,
    finish_weights,
    priority_limit,
    slot_keys,
)
from .storage import TorchStorage

__all__ = [
    "DeviceBatch", "DevicePrioritizedReplayBuffer", "DeviceReplayBuffer", "GraphedStep", "load",
]  # fmt: skip

#: pending per-update tallies folded into the running ones (3 operations) every this many
_FOLD_EVERY = 256


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
    return _prep(name, value, kinds, device)[0]


def _prep(
    name: str, value: Any, kinds: str, device: torch.device, keep_float: bool = False
) -> tuple[torch.Tensor, np.ndarray | None]:
    """:func:`_tensor`, with the host array it came from (None for a tensor).

    ``keep_float``: a floating tensor keeps its dtype (float32 td errors are
    widened inside the update's first operation, not by a cast of their own).
    """
    dtype = torch.int64 if kinds == "iu" else torch.float64
    if not isinstance(value, torch.Tensor):
        arr = as_1d(name, value, kinds)
        return torch.from_numpy(arr).to(device), arr
    t = value.detach() if value.requires_grad else value
    if (
        type(t) is torch.Tensor
        and t.ndim == 1
        and (t.dtype == dtype or (keep_float and t.is_floating_point()))
    ):
        # the common case: tensors straight from a DeviceBatch, or a learner's td errors
        return (t if t.device == device else t.to(device)), None
    kind = _kind(t.dtype)
    if t.numel() and kind not in kinds:
        raise dtype_error(name, kinds, t.dtype)
    if t.ndim == 0:
        t = t.reshape(1)
    if t.ndim != 1:
        raise ndim_error(name, tuple(t.shape))
    return t.to(device=device, dtype=dtype), None


def _rows_of_one(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """``first`` and ``second`` as the two rows of one (2, B) tensor when they already are
    laid out so (a :class:`DeviceBatch`'s keys and indices are), else None. No copy."""
    b = first.shape[0]
    if (
        first.dtype == second.dtype
        and first.device == second.device
        and first.is_contiguous()
        and second.is_contiguous()
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and second.storage_offset() - first.storage_offset() == b
    ):
        return first.as_strided((2, b), (b, 1))
    return None


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
        dev = self._device
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
        # the largest priority ever recorded: a 0-dim tensor the index owns (updated in place)
        self._max_seen = self._index.max_seen
        self._max_seen.fill_(1.0)
        # counts of dropped update entries: host numbers (loaded, numba back end) ...
        self._stale0 = 0
        self._invalid0 = 0
        # ... bad explicit priorities of unvalidated adds (device) ...
        self._invalid_add = torch.zeros((), dtype=torch.int64, device=dev)
        # ... and the torch index's tallies (TALLIES): per update, folded now and then
        self._pending: list[tuple[torch.Tensor, int]] = []
        self._tally = torch.zeros(len(TALLIES), dtype=torch.int64, device=dev)
        self._tally_entries = 0
        self._reported = [0] * (len(TALLIES) + 1)  # tallies and entries at the last report
        # may a stored priority be zero? (only then does sample check the total)
        self._may_be_zero = self._eps == 0.0
        # smallest priority a stored slot can hold (its mass must stay positive)
        self._floor = self._eps
        self._index.set_sizes(0, 0)
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
        """Whether bad update entries raise (at the next check; see the module docstring)."""
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
        """Largest priority ever recorded (reads the device: syncs; a check, see :meth:`check`)."""
        self._report()
        return float(self._max_seen)

    @property
    def stale_updates(self) -> int:
        """Update entries dropped because their slot was overwritten since sampled
        (reads the device: syncs; a check, see :meth:`check`)."""
        self._report()
        return self._counts()[0]

    @property
    def invalid_updates(self) -> int:
        """Entries dropped for a bad index, td error, priority or key (reads the device:
        syncs; a check, see :meth:`check`). With ``validate=True`` a bad entry of a
        tensor update is dropped and counted here too, and reported by the check."""
        self._report()
        return self._counts()[1]

    # -- deferred checks ---------------------------------------------------------------
    @locked
    def check(self) -> None:
        """Report update entries the device found invalid since the last check. O(1), one sync.

        ``update_priorities`` checks tensors on the device without a host
        sync: a bad entry (an index out of range or of a slot never written, a
        td error that is not finite or gives a priority over the tree's limit,
        a key never issued) is dropped there and the rest of the update is
        applied; the tree never sees it. With ``validate=True`` it is reported
        here, at the next call that reads the device anyway (``check``,
        :attr:`stale_updates`, :attr:`invalid_updates`,
        :attr:`max_priority_ever`, :meth:`priorities`, :meth:`probabilities`,
        :meth:`keys`, :meth:`get`, :meth:`state_dict`, :meth:`save`), once:
        the report clears. Host arrays (numpy, lists) are checked on the host
        before anything happens and raise at once, as in the CPU buffers.

        Raises:
            InvalidIndexError: some entries named a slot out of range or never written.
            ValueError: some entries had a bad td error or key (and no bad index).
        """
        self._report()

    def _fold(self) -> None:
        """Add the pending per-update tallies to the running ones (3 ops, no sync)."""
        if self._pending:
            self._tally += torch.stack([t for t, _ in self._pending]).sum(0)
            self._tally_entries += sum(b for _, b in self._pending)
            self._pending.clear()

    def _read_tallies(self) -> tuple[list[int], int]:
        """The running tallies (TALLIES, then the entries counted) and the bad explicit
        priorities of unvalidated adds: one read of the device."""
        self._fold()
        *tally, bad_adds = torch.cat([self._tally, self._invalid_add.view(1)]).tolist()
        return [*tally, self._tally_entries], bad_adds

    @locked
    def _counts(self) -> tuple[int, int]:
        """(stale, invalid) entries dropped so far. Reads the device (syncs)."""
        (*tally, entries), bad_adds = self._read_tallies()
        ok, applied = tally[4], tally[5]
        return self._stale0 + ok - applied, self._invalid0 + entries - ok + bad_adds

    @locked
    def _report(self) -> None:
        """Raise for the invalid update entries counted since the last report (validate=True)."""
        if not (self._validate and isinstance(self._index, TorchIndex)):
            return
        if not (self._pending or self._tally_entries > self._reported[-1]):
            return
        now, _ = self._read_tallies()
        delta = [a - b for a, b in zip(now, self._reported, strict=True)]
        entries = delta[-1]
        bad = entries - delta[4]
        if bad <= 0:
            return
        self._reported = now
        keys, slots, prios = (entries - delta[i] for i in range(3))
        parts = [
            f"{slots} with an index outside [0, {len(self)}) or of a slot never written"
            if slots
            else "",
            f"{prios} with a td error that is not finite or gives a priority above "
            f"{self._index.limit:.3e}"
            + (" (priority_noise included)" if self._noise_schedule(self._step) else "")
            if prios
            else "",
            f"{keys} with a key never issued by this buffer" if keys else "",
        ]
        message = (
            f"update_priorities got {bad} invalid entr{'y' if bad == 1 else 'ies'} since the "
            f"last check ({'; '.join(p for p in parts if p)}): they were dropped, the rest of "
            "those updates applied. Tensors are checked on the device without a host sync, "
            "so the error surfaces at the next call that reads the device; pass host arrays "
            "to have them refused at once, or validate=False to only count them in "
            "`invalid_updates`"
        )
        raise (InvalidIndexError if slots else ValueError)(message)

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
        range or never written). A natural point to report deferred errors (:meth:`check`)."""
        self._report()
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
        p, host = _prep("priorities", priorities, "iuf", self._device)
        if p.shape[0] != k:
            raise ValueError(
                f"`priorities` must have {k} entries (one per row), got priorities with "
                f"{p.shape[0]}"
            )
        p, smallest, invalid = self._checked_add_priorities(p)
        if host is not None and not self._validate:
            # unread on the device, but known on the host: the smallest one kept (a bad
            # one gets the new-transition priority, which is positive)
            with np.errstate(invalid="ignore"):
                good = host[np.isfinite(host) & (host >= 0) & (host <= self._index.limit)]
            smallest = float(good.min()) if good.size else math.inf
        slots = self._write(prepared, k, p)
        self._floor = min(self._floor, smallest)
        if smallest == 0.0:
            self._may_be_zero = True
        if invalid is not None:
            self._invalid_add += invalid
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
    ) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """``add``'s priorities, checked: (the priorities to write, the smallest (0.0 when
        unread), the count of bad entries replaced, ``validate=False`` only). Changes nothing."""
        limit = self._index.limit
        bad = ~torch.isfinite(p) | (p < 0) | (p > limit)
        if self._validate:
            # the one read-back of a validated add with priorities: the flag and the minimum
            any_bad, smallest = torch.stack([bad.any().to(p.dtype), p.min()]).tolist()
            if any_bad:
                # the CPU buffers' messages for non-finite and negative values
                as_value_array("priorities", p.cpu().numpy(), p.shape[0])
                raise ValueError(
                    f"`priorities` must be <= {limit:.3e} (so the sum tree stays finite), got "
                    f"priorities={show(p[bad][:8].cpu().numpy())}"
                )
            return p + 0.0, smallest, None
        # unread: assume a zero may be there; bad entries get the new-transition priority
        return torch.where(bad, self._new_priority(), p) + 0.0, 0.0, bad.sum()

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
        key0 = w.added + k - kept  # the key of the first row that stays
        for lo in range(0, k, cap):
            w.advance(min(cap, k - lo))
        index = self._index
        index.ensure(w.size)
        first = min(kept, cap - at)  # the run, and its wrapped rest
        if p is None:
            value = self._new_priority()
            index.fill(at, first, value, key0)
            if first < kept:
                index.fill(0, kept - first, value, key0 + first)
        else:
            torch.maximum(self._max_seen, p.max(), out=self._max_seen)
            index.write(at, p[:first], key0)
            if first < kept:
                index.write(0, p[first:], key0 + first)
        index.set_sizes(w.size, w.added)
        return (start + torch.arange(k, dtype=torch.int64, device=self._device)) % cap

    # -- sample ------------------------------------------------------------------------
    @locked
    def sample(self, batch_size: int, beta: float | None = None) -> DeviceBatch:
        """Draw ``batch_size`` transitions with replacement. O(B * 64 + N / 64), no host sync.

        On the torch back end a fixed number of tensor operations whatever the
        capacity and the fields (18 at the defaults; 19 while the last block of
        64 slots is partly written).

        Returns:
            A :class:`DeviceBatch` (tensors on the device, weights float32), in
            random order unless ``shuffle=False``.

        Raises:
            EmptyBufferError: the buffer holds nothing.
            ZeroPriorityError: every priority is zero (checked only when one
                can be: ``eps == 0`` or explicit zero priorities, with ``validate``).
        """
        b, beta_v, n = self._begin_sample(batch_size, beta)
        u, perm = self._draws(b)
        w = self._writer
        idx, prob, weights, keys = self._index.draw(
            u, n, beta_v, self._stratified, self._weight_norm, w.key_base, w.added, perm
        )
        return self._end_sample(idx, prob, weights, keys, self._storage.gather(idx))

    def _begin_sample(self, batch_size: int, beta: float | None) -> tuple[int, float, int]:
        """A draw's host part: its checks and schedules (batch size, beta, n). Changes
        nothing if it raises."""
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
                if not float(self._index.total_for(n)) > 0.0:
                    raise ZeroPriorityError(
                        f"cannot sample: all {n} stored priorities are zero (raise `eps` above 0 "
                        "or update priorities)"
                    )
        except BaseException:
            self._apply_alpha(old_alpha)
            raise
        self._index.positive = self._positive()
        return b, beta_v, n

    def _draws(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The random numbers of a draw: B uniforms, then the order (``shuffle``)."""
        dev = self._device
        u = torch.rand(b, generator=self._gen, dtype=torch.float64, device=dev)
        # slices come out in slot order: minibatches cut from a batch would each
        # get a contiguous piece of the ring
        perm = (
            torch.randperm(b, generator=self._gen, device=dev) if self._shuffle and b > 1 else None
        )
        return u, perm

    def _end_sample(
        self, idx: torch.Tensor, prob: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
        data: dict[str, torch.Tensor],
    ) -> DeviceBatch:  # fmt: skip
        self._step += 1
        return DeviceBatch(data=data, indices=idx, weights=weights, probabilities=prob, keys=keys)

    def graphed_step(self, batch_size: int) -> GraphedStep:
        """A learner step of ``batch_size`` replayed from CUDA graphs (CUDA devices only).

        ``step = buf.graphed_step(256)``, then ``batch = step.sample()`` and
        ``step.update(td_errors)`` in the loop: the same draws, priorities and
        state as ``sample`` and ``update_priorities`` (with the default
        checks), each one graph launch instead of a few dozen kernel launches.
        The batch's tensors are the graph's: the next ``step.sample()``
        overwrites them. See :class:`fastper.device.GraphedStep`.

        Raises:
            ValueError: the buffer is not on a CUDA device (the eager
                ``sample`` / ``update_priorities`` are the CPU path), or not on
                the torch back end.
        """
        return GraphedStep(self, batch_size)

    # -- update ------------------------------------------------------------------------
    def _positive(self) -> bool:
        """Whether every stored priority is known to have a positive mass (host facts:
        ``eps``, the explicit priorities added): the index's fused paths then apply."""
        floor = self._floor
        return not self._may_be_zero and floor > 0.0 and floor**self._index.alpha >= MASS_FLOOR

    def _check_host_update(
        self, idx: np.ndarray | None, td: np.ndarray | None, keys: np.ndarray | None
    ) -> None:
        """Refuse bad entries given as host arrays at once, with the CPU buffers' messages
        (no device read: the values are on the host). Tensors are checked on the device."""
        if idx is not None:
            as_index_array("indices", idx, self._capacity, written=len(self))
        if td is not None:
            as_value_array("td_errors", td, td.shape[0], nonnegative=False)
            mag = np.abs(td.astype(np.float64))
            if self._clip is not None:
                mag = np.minimum(mag, self._clip)
            big = mag + self._eps > self._index.limit
            if big.any():
                raise ValueError(
                    f"`td_errors` must give priorities <= {self._index.limit:.3e} (so the sum "
                    f"tree stays finite), got td_errors={show(td[big][:8])}"
                )
        if keys is not None:
            added = self._writer.added
            bad = (keys < 0) | (keys >= added)
            if bad.any():
                raise ValueError(
                    f"`keys` must be keys issued by this buffer, in [0, {added}), "
                    f"got {show(keys[bad][:8])}"
                )

    @locked
    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> torch.Tensor:
        """Set p_i = min(|td_i|, clip) + eps for sampled slots. O(B * 64 + log N).

        Duplicate indices: the last one wins. With ``keys``, entries whose slot
        was overwritten since it was sampled are dropped (:attr:`stale_updates`).
        No host sync: tensors are checked on the device, their bad entries
        dropped and reported at the next :meth:`check` (``validate=True``) or
        only counted in :attr:`invalid_updates` (``validate=False``); host
        arrays are checked on the host at once (see the module docstring).
        ``td_errors`` may be a tensor that tracks gradients (a loss): its values
        are used, detached. ``update_priorities(batch, td_errors)`` takes the
        batch's indices and keys.

        Returns:
            The number of priorities applied: a 0-dim int64 device tensor.

        Raises:
            InvalidIndexError: (host arrays, ``validate=True``) an index out of
                range or never written.
            ValueError: lengths differ; (host arrays, ``validate=True``) td errors
                not finite or too large, keys never issued.
        """
        dev = self._device
        indices, keys = unwrap_batch(indices, keys)
        idx, idx_host = _prep("indices", indices, "iu", dev)
        index = self._index
        on_device = isinstance(index, TorchIndex)
        td, td_host = _prep("td_errors", td_errors, "iuf", dev, keep_float=on_device)
        key_t, keys_host = _prep("keys", keys, "iu", dev) if keys is not None else (None, None)
        b = idx.shape[0]
        for name, t in (("td_errors", td), ("keys", key_t)):
            if t is not None and t.shape[0] != b:
                raise ValueError(
                    f"`{name}` must have {b} entries (one entry per index), got {name} with {t.shape[0]}"
                )
        if b == 0:
            return torch.zeros((), dtype=torch.int64, device=dev)
        if self._validate and on_device:
            self._check_host_update(idx_host, td_host, keys_host)
        sigma = check_real("priority_noise", self._noise_schedule(self._step), minimum=0.0)
        gen_state = self._gen.get_state() if sigma else None
        if sigma:
            z = torch.randn(b, generator=self._gen, dtype=torch.float64, device=dev)
            td = td.abs() * torch.exp(sigma * z)
        w = self._writer
        index.positive = self._positive()
        stacked = _rows_of_one(key_t, idx) if on_device and key_t is not None else None
        try:
            applied, counts = index.update(
                idx, td, key_t, self._eps, self._clip, len(self), w.key_base, w.added,
                self._validate, bool(sigma), stacked,
            )  # fmt: skip
        except BaseException:
            if gen_state is not None:
                self._gen.set_state(gen_state)
            raise
        if isinstance(counts, torch.Tensor):  # device tallies: kept, folded now and then
            self._pending.append((counts, b))
            if len(self._pending) >= _FOLD_EVERY:
                self._fold()
        else:  # host numbers (the numba back end, CPU only)
            stale, invalid = counts
            self._stale0 += stale
            if not self._validate:
                self._invalid0 += invalid
        return applied

    # -- housekeeping ------------------------------------------------------------------
    @locked
    def clear(self) -> None:
        """Drop every transition and pending window; keeps the generator, step, key counter and max priority."""
        self._storage.clear()
        self._index.clear()
        self._writer.clear()
        self._index.set_sizes(0, self._writer.added)
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
        """The whole state as host objects (numpy arrays in its parts). O(N); syncs, and
        is a check (:meth:`check`): pending update errors raise first."""
        self._report()
        n = len(self)
        stale, invalid = self._counts()
        return {
            "kind": self.kind,
            "settings": self._settings(),
            "schedules": self._schedules_state(),
            "buffer": {
                "max_priority_ever": float(self._max_seen),
                "stale_updates": stale,
                "invalid_updates": invalid,
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
        if isinstance(self._index, TorchIndex) and writer.added > KEY_LIMIT:
            raise ValueError(
                f"key counter total_added={writer.added} exceeds {KEY_LIMIT} (2^55), the "
                "largest the torch back end takes: it tells an empty slot by its key; "
                "load this state with backend='numba' (CPU device)"
            )
        n = writer.size
        sampler = state["sampler"]
        pri = check_priority_array("priorities", sampler["priorities"], n)
        max_seen = check_real("max_priority_ever", buf_state["max_priority_ever"], minimum=1.0)
        if n:
            self._check_stored_max(float(pri.max()), max_seen)
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
        self._index.load(pri, n, alpha_v, writer.key_base, writer.added)
        self._max_seen.fill_(max_seen)
        self._stale0, self._invalid0 = stale, invalid
        smallest = float(pri.min()) if n else math.inf
        # a CPU state has no flag: its priorities tell whether one is zero
        zero = bool(buf_state.get("may_be_zero", True)) if not cpu else smallest == 0.0
        self._may_be_zero = zero or self._eps == 0.0
        self._floor = min(self._eps, smallest)


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


class GraphedStep:
    """A device buffer's ``sample`` and ``update_priorities`` replayed from CUDA graphs.

    Made by :meth:`DevicePrioritizedReplayBuffer.graphed_step` (or the
    uniform buffer's). A learner step on the torch back end is a few dozen
    small kernels; here each half is captured once in a CUDA graph and then
    launched as one, the batch size fixed::

        step = buf.graphed_step(256)
        for _ in range(steps):
            batch = step.sample()          # valid until the next step.sample()
            td = learn(batch)
            step.update(td)                # the priorities of that batch
            buf.add(...)                   # adds, checks, reads: as usual

    Results are those of ``buf.sample(256)`` and
    ``buf.update_priorities(batch, td)``: the same generator (registered with
    the graph, so a replay draws what the eager call would), the same
    operations, the same checks (bad entries of ``td`` are dropped and
    reported at the next :meth:`~DevicePrioritizedReplayBuffer.check`). The
    IS weights' power -beta and the copy of ``td`` in run outside the graphs
    (three small kernels), so beta schedules need no new capture.

    When graphs are used: the first ``sample`` / ``update`` pair runs eagerly
    (it loads every kernel the capture records), then both halves are
    captured and replayed. A graph bakes in the host facts of its capture
    (the number of stored transitions, alpha, whether every priority is
    positive): until the buffer is full, or while ``priority_noise`` is on,
    every call runs eagerly; when alpha changes (a schedule), the next call
    captures again.

    The batch's tensors belong to the graph: the next ``sample()`` overwrites
    them (clone what must outlive the step). ``update`` applies to the batch of
    the last ``sample()``.
    """

    def __init__(self, buffer: _DeviceBuffer, batch_size: int, *, _emulate: bool = False) -> None:
        dev = buffer.device
        if dev.type != "cuda" and not _emulate:
            raise ValueError(
                f"graphed_step needs a buffer on a CUDA device (CUDA graphs), this one is on "
                f"{dev}; on the CPU call buffer.sample and buffer.update_priorities (the same "
                "results: a graph only saves kernel launches)"
            )
        buf = buffer
        if not isinstance(buf._index, TorchIndex):
            raise ValueError("graphed_step needs the torch back end (backend='torch')")
        self.buffer = buffer
        self.batch_size = check_batch_size(batch_size)
        self._emulate = _emulate
        self._td = torch.zeros(self.batch_size, dtype=torch.float64, device=dev)
        self._facts: tuple[Any, ...] | None = None  # host facts of the captured graphs
        self._warm = False
        self._sample_graph: _Replay | None = None
        self._update_graph: _Replay | None = None
        self._last: DeviceBatch | None = None
        self._graphed_last = False

    def _host_facts(self, n: int) -> tuple[Any, ...] | None:
        """What a capture bakes in; None when graphs cannot be used now."""
        buf = self.buffer
        if n < buf.capacity or buf._noise_schedule(buf._step):
            return None
        index = buf._index
        return (n, index.alpha, index.positive, index.limit)

    def _capture(self, n: int) -> None:
        buf, b = self.buffer, self.batch_size
        index = cast(TorchIndex, buf._index)

        def sample_body() -> tuple[Any, ...]:
            u, perm = buf._draws(b)
            idx, prob, base, keys = index.draw_base(u, n, buf._stratified, buf._weight_norm, perm)
            return idx, prob, base, keys, buf._storage.gather(idx)

        sampled = _Replay(sample_body, buf._gen, None, self._emulate)

        def update_body() -> tuple[Any, ...]:
            idx, _, _, keys, _ = sampled.outputs
            w = buf._writer
            applied, counts = index.update(
                idx, self._td, keys, buf._eps, buf._clip, n, w.key_base, w.added,
                buf._validate, False, _rows_of_one(keys, idx),
            )  # fmt: skip
            buf._tally.add_(counts)
            return (applied,)

        self._sample_graph = sampled
        self._update_graph = None if self._emulate else _Replay(update_body, None, sampled, False)
        self._update_body = update_body

    def sample(self, beta: float | None = None) -> DeviceBatch:
        """The next batch (as ``buffer.sample(batch_size, beta)``); its tensors are the
        graph's until the next call. O(1) launches once captured."""
        buf = self.buffer
        with buf._lock:
            b, beta_v, n = buf._begin_sample(self.batch_size, beta)
            facts = self._host_facts(n) if self._warm else None
            if facts is None:
                u, perm = buf._draws(b)
                w = buf._writer
                idx, prob, weights, keys = buf._index.draw(
                    u, n, beta_v, buf._stratified, buf._weight_norm, w.key_base, w.added, perm
                )
                batch = buf._end_sample(idx, prob, weights, keys, buf._storage.gather(idx))
                self._graphed_last = False
            else:
                if facts != self._facts:
                    self._capture(n)
                    self._facts = facts
                sampled = cast(_Replay, self._sample_graph)
                sampled.replay()
                if self._update_graph is None:  # the update reads the sample's outputs
                    self._update_graph = _Replay(self._update_body, None, sampled, self._emulate)
                idx, prob, base, keys, data = sampled.outputs
                weights = finish_weights(base, beta_v, prob)
                batch = buf._end_sample(idx, prob, weights, keys, data)
                self._graphed_last = True
            self._last = batch
            return batch

    def update(self, td_errors: Any) -> torch.Tensor:
        """``buffer.update_priorities(batch, td_errors)`` for the batch of the last
        :meth:`sample`; the count applied (0-dim tensor, the graph's until the next call)."""
        buf, batch = self.buffer, self._last
        if batch is None:
            raise ValueError("call step.sample() before step.update(td_errors)")
        with buf._lock:
            n = len(buf)
            buf._index.positive = buf._positive()
            usable = self._graphed_last and self._host_facts(n) == self._facts
            if not usable or not isinstance(td_errors, torch.Tensor):
                self._warm = True
                return buf.update_priorities(batch, td_errors)
            td = td_errors.detach()
            if td.shape != (self.batch_size,):
                raise ValueError(
                    f"`td_errors` must have {self.batch_size} entries (one per sampled "
                    f"transition), got shape {tuple(td.shape)}"
                )
            if not (td.is_floating_point() or td.dtype in (torch.int32, torch.int64)):
                raise dtype_error("td_errors", "iuf", td.dtype)
            self._td.copy_(td)
            updated = cast(_Replay, self._update_graph)
            updated.replay()
            buf._tally_entries += self.batch_size
            return cast(torch.Tensor, updated.outputs[0])


class _Replay:
    """``body`` captured in a CUDA graph, replayed by :meth:`replay`; its outputs are
    the graph's static tensors (:attr:`outputs`).

    ``generator``: the torch generator the body draws from, registered with the
    graph so each replay advances it as the eager call would. ``after``: a
    graph this one shares memory with (captured and replayed before it).
    ``emulate``: no CUDA graph; each replay runs ``body`` again and copies
    its outputs into the first run's tensors (the same static-output
    behaviour, to test the bookkeeping on any device).
    """

    def __init__(
        self, body: Callable[[], tuple[Any, ...]], generator: torch.Generator | None,
        after: _Replay | None, emulate: bool,
    ) -> None:  # fmt: skip
        self._body = body
        #: the CUDA graph (None: emulated)
        self.graph: Any = None
        self.outputs: tuple[Any, ...] = ()
        if emulate:
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            register = getattr(graph, "register_generator_state", None)
            if register is None:  # pragma: no cover - torch < 2.4
                raise RuntimeError(
                    "this torch cannot register a generator with a CUDA graph "
                    "(CUDAGraph.register_generator_state, torch >= 2.4): use buffer.sample "
                    "and buffer.update_priorities"
                )
            register(generator)
        pool = None if after is None or after.graph is None else after.graph.pool()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = body()
        self.graph = graph

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        fresh = self._body()
        if not self.outputs:
            self.outputs = fresh
            return
        for old, new in zip(self.outputs, fresh, strict=True):
            if isinstance(old, torch.Tensor):
                old.copy_(new)
            elif isinstance(old, dict):
                for name, t in old.items():
                    t.copy_(new[name])
