"""TorchRL samplers over fastper's exact float64 trees.

The samplers of :mod:`fastper.compat.torchrl`. Each subclasses TorchRL's
``PrioritizedSampler`` (so TorchRL's buffers route priority updates to it)
but builds none of TorchRL's compiled trees: the index is one of fastper's
samplers (:mod:`fastper.samplers`), and the draws, probabilities and
importance weights are fastper's (:mod:`fastper.policy`).

How TorchRL's replay buffer calls a sampler, and what each call does here:

* ``mark_update(index)``: the writer reports slots it just (over)wrote. The
  slots get the max priority and their write generation advances by one.
* ``sample(storage, batch_size)``: ``(index, info)`` with ``info`` holding
  ``"priority_weight"`` (the IS weights, read by TorchRL's losses) and
  ``"slot_generation"`` (each slot's write generation when it was drawn).
  A :class:`~tensordict.TensorDict` buffer puts both into the sample.
* ``update_priority(index, priority)``: new priorities (``priority + eps``
  is the ``p`` of ``P(i) = p_i^alpha / sum_k p_k^alpha``).
* ``add`` / ``extend``: nothing (``mark_update`` already saw the write).
* ``state_dict`` / ``load_state_dict``, ``dumps`` / ``loads``: tensors,
  JSON and ``.npy`` files; nothing is pickled.

Stale updates. An update for a slot overwritten since it was sampled is
dropped, never applied to the new occupant, when the sampler can tell which
sample the update answers: the ``index`` tensor is the very tensor ``sample``
returned (the ``"index"`` entry of a sample, or of ``info``), or the caller
passes ``generation=`` (the sample's ``"slot_generation"``). Anything else
(an index copied, moved to another device, sliced, or built by hand) is taken
as "the item in that slot now", which is also what priorities given at insert
time and whole-buffer refreshes need.
"""

from __future__ import annotations

import json
import math
import numbers
import weakref
from collections.abc import Mapping
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import missing_extra

try:
    import torch
    from torchrl.data.replay_buffers.samplers import (
        PrioritizedSampler as _TorchRLPrioritizedSampler,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_extra("fastper.compat.torchrl", exc, "torchrl") from None

from .._validation import check_int, check_real, show, to_numpy
from ..errors import CheckpointError, EmptyBufferError, InvalidIndexError
from ..policy import NORMS
from ..rank_sampler import RankSampler
from ..sampler_base import NORM_CODES, PriorityMax, new_priorities
from ..sampler_base import Sampler as _CoreSampler
from ..samplers import ProportionalSampler
from ..samplers import UniformSampler as _CoreUniform

__all__ = ["PrioritizedSampler", "RankBasedSampler", "UniformSampler"]

#: version of :meth:`PrioritizedSampler.state_dict` and of the ``dumps`` directory
STATE_VERSION = 1
#: the sampled tensordict's entry holding each slot's write generation
GENERATION_KEY = "slot_generation"
#: the sampled tensordict's entry holding the IS weights (the key TorchRL's losses read)
WEIGHT_KEY = "priority_weight"

_REDUCTIONS = ("max", "min", "mean", "median", "sum")
_STATE_KEYS = (
    "version", "kind", "capacity", "alpha", "beta", "eps", "max_priority",
    "priorities", "held", "generation", "dropped_updates",
)  # fmt: skip


def _as_index(name: str, value: Any) -> np.ndarray:
    """1-D int64 copy of an index (int, list, array or tensor on any device)."""
    arr = to_numpy(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(
            f"`{name}` must be 1-D (fastper's TorchRL samplers support storages with "
            f"ndim=1 only), got {name} with shape {arr.shape}"
        )
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iu"):
        raise TypeError(f"`{name}` must hold integers, got {name} with dtype {arr.dtype}")
    return np.array(arr, dtype=np.int64, copy=True)


def _as_priority(value: Any, length: int) -> np.ndarray:
    """``length`` float64 priorities: finite and >= 0 (a single value is broadcast)."""
    arr = to_numpy(value)
    if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iuf"):
        raise TypeError(f"`priority` must hold real numbers, got priority with dtype {arr.dtype}")
    if arr.size == 1:
        out = np.full(length, float(arr.reshape(-1)[0]))
    elif arr.size == length and (arr.ndim == 1 or arr.squeeze().ndim == 1):
        out = np.array(arr.reshape(-1), dtype=np.float64)
    else:
        raise ValueError(
            f"`priority` must be one number or one per index ({length}), got priority "
            f"with shape {tuple(arr.shape)}"
        )
    bad = ~np.isfinite(out) | (out < 0)
    if bad.any():
        raise ValueError(
            f"`priority` must be finite and >= 0, got priority={show(out[bad][:8])} "
            "(pass |TD error|, not the signed error)"
        )
    return out + 0.0  # -0.0 -> +0.0


def _last_wins(slots: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct slot. O(B log B)."""
    _, first_in_reversed = np.unique(slots[::-1], return_index=True)
    return np.sort(slots.shape[0] - 1 - first_in_reversed)


class PrioritizedSampler(_TorchRLPrioritizedSampler):
    r"""Proportional prioritized replay for TorchRL buffers: P(i) = p_i^alpha / sum_k p_k^alpha.

    A drop-in for ``torchrl.data.PrioritizedSampler`` (same positional
    arguments), built on fastper's float64 sum tree instead of TorchRL's
    compiled extension::

        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(100_000),
            sampler=PrioritizedSampler(100_000, alpha=0.6, beta=0.4),
            priority_key="td_error",
        )

    ``p_i = priority_i + eps``, where ``priority_i`` is the last value given
    for slot ``i`` (``rb.update_priority`` / ``rb.update_tensordict_priority``)
    or, for an item just written, the max priority. The IS weights
    ``w_i = (N P(i))^-beta`` come normalised by the largest weight over the
    whole buffer (``weight_norm="buffer"``, TorchRL's choice), over the batch
    (``"batch"``) or not at all (``"none"``), in ``info["priority_weight"]``.

    Args:
        max_capacity: number of slots; the storage's ``max_size``.
        alpha: priority exponent, >= 0 (0: uniform). Settable (O(N) re-weight).
        beta: IS exponent, >= 0. Settable, e.g. by TorchRL's ``LinearScheduler``.
        eps: added to every priority, >= 0. An item whose ``priority + eps``
            is 0 is never drawn.
        dtype: dtype of the returned weights, ``torch.float32`` or
            ``torch.float64`` (the trees are float64 either way).
        reduction: how a TensorDict buffer reduces a priority with more than
            one value per item: ``"max"``, ``"min"``, ``"mean"``, ``"median"``
            or ``"sum"``.
        max_priority_within_buffer: ``False``: new items get the largest
            priority ever given (1.0 before any); ``True``: the largest held
            now by an item not being overwritten (1.0 in an empty buffer).
        device: ``None`` or ``"cpu"``; the trees live in host memory (indices
            and weights come back on the CPU; TorchRL moves the batch to the
            storage's device).
        stratified: ``False`` (TorchRL's law): independent draws;
            ``True``: draw ``k`` of ``B`` in the ``k``-th of ``B`` equal slices
            of the mass (lower variance, the paper's sampler).
        weight_norm: ``"buffer"``, ``"batch"`` or ``"none"`` (see above).

    Costs: a draw O(log N); an update or a write of B slots O(B log N);
    ``alpha`` set, ``state_dict``, ``load_state_dict`` O(N). Memory: about 26
    bytes per slot (priority, sum and min tree, write generation), 9 more
    with ``max_priority_within_buffer``.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range.
    """

    kind: ClassVar[str] = "proportional"

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
        *,
        stratified: bool = False,
        weight_norm: str = "buffer",
    ) -> None:
        # TorchRL's __init__ is not called: it builds the compiled trees this
        # class replaces. Everything the buffer reads is defined here.
        self._capacity = check_int("max_capacity", max_capacity, minimum=1)
        alpha = check_real("alpha", alpha, minimum=0.0)
        self._beta = check_real("beta", beta, minimum=0.0)
        self._eps = check_real("eps", eps, minimum=0.0)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"`dtype` must be torch.float32 or torch.float64 (the weights' dtype), got dtype={dtype!r}"
            )
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {list(_REDUCTIONS)}, got reduction={reduction!r}"
            )
        if not isinstance(max_priority_within_buffer, bool):
            raise TypeError(
                "`max_priority_within_buffer` must be a bool, got "
                f"max_priority_within_buffer={show(max_priority_within_buffer)}"
            )
        try:
            device_type = None if device is None else torch.device(device).type
        except (RuntimeError, TypeError):
            device_type = repr(device)
        if device_type not in (None, "cpu"):
            raise ValueError(
                f"`device` must be None or 'cpu': fastper's trees live in host memory, got device={device!r}"
            )
        if not isinstance(stratified, bool):
            raise TypeError(f"`stratified` must be a bool, got stratified={show(stratified)}")
        if weight_norm not in NORMS:
            raise ValueError(
                f"`weight_norm` must be one of {list(NORMS)}, got weight_norm={weight_norm!r}"
            )
        self.dtype = dtype
        self.reduction = reduction
        self._within = max_priority_within_buffer
        self._stratified = stratified
        self._weight_norm = weight_norm
        self._core = self._make_core(alpha)
        #: write generation of each slot: -1 never written, then 0, 1, ... per write
        self._gen = np.full(self._capacity, -1, dtype=np.int64)
        self._n_held = 0  # slots with generation >= 0
        self._max_seen: float | None = None  # largest priority given (before eps)
        # max_priority_within_buffer: the priorities given (before eps) and a max tree over them
        self._held_p = new_priorities(self._capacity) if self._within else None
        self._held_max = PriorityMax(self._held_p) if self._held_p is not None else None
        self._issued: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray]] = {}
        #: priority updates dropped because their slot was overwritten since it was sampled
        self.dropped_updates = 0

    # -- the index ---------------------------------------------------------------------
    def _make_core(self, alpha: float) -> _CoreSampler:
        return ProportionalSampler(self._capacity, alpha, track_min=self._weight_norm == "buffer")

    def _core_slots(self) -> int:
        """Slots the core indexes (``n`` of its whole-state calls)."""
        return self._capacity

    def _check_new_slots(self, new: np.ndarray) -> None:
        """Raise if these never-written slots cannot join the index (rank-based: order)."""

    # -- properties TorchRL reads --------------------------------------------------------
    @property
    def max_size(self) -> int:
        return self._capacity

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def alpha(self) -> float:
        """Priority exponent. Setting it re-weights every stored priority exactly. O(N)."""
        return self._core.alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        alpha = check_real("alpha", value, minimum=0.0)
        raw = self._core.raw
        self._core.check_priorities("priorities", raw[raw > 0], alpha)
        self._core.set_alpha(alpha, self._core_slots())

    @property
    def beta(self) -> float:
        """IS exponent, >= 0."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = check_real("beta", value, minimum=0.0)

    @property
    def eps(self) -> float:
        """Added to every priority."""
        return self._eps

    @property
    def stratified(self) -> bool:
        return self._stratified

    @property
    def weight_norm(self) -> str:
        return self._weight_norm

    @property
    def default_priority(self) -> float:
        """Priority (before ``eps``) an item written now gets: the max-priority rule. O(1)."""
        if self._held_max is not None:
            return self._held_max.max if self._n_held else 1.0
        return 1.0 if self._max_seen is None else self._max_seen

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_capacity={self._capacity}, alpha={self.alpha}, "
            f"beta={self._beta}, eps={self._eps}, stratified={self._stratified}, "
            f"weight_norm={self._weight_norm!r})"
        )

    # -- writes -------------------------------------------------------------------------
    def _write_slots(self, index: Any) -> np.ndarray:
        """Slots of a writer's ``index`` (``-1``: not written, skipped), checked."""
        if index is None:
            return np.empty(0, dtype=np.int64)
        if isinstance(index, tuple):
            raise ValueError(
                "fastper's TorchRL samplers support storages with ndim=1 only, got a "
                "multi-dimensional index"
            )
        slots = _as_index("index", index)
        slots = slots[slots != -1]
        bad = (slots < 0) | (slots >= self._capacity)
        if bad.any():
            raise InvalidIndexError(
                f"`index` must lie in [0, {self._capacity}) (the sampler's max_capacity; give "
                f"max_capacity=storage.max_size), got index={show(slots[bad][:8])}"
            )
        return slots

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """Slots just (over)written: they get the max priority, their generation advances.

        TorchRL's writers call it (through the buffer) on every write. O(B log N).
        """
        slots = self._write_slots(index)
        if slots.shape[0] == 0:
            return
        uniq = np.unique(slots)
        fresh = self._gen[uniq] < 0
        self._check_new_slots(uniq[fresh])
        # checked: apply
        np.add.at(self._gen, slots, 1)  # a slot written twice in one call advances twice
        self._n_held += int(fresh.sum())
        if self._held_max is not None and self._held_p is not None:
            self._held_p[uniq] = 0.0  # the old occupants no longer count
            self._held_max.fix(uniq)
            held_elsewhere = self._n_held - uniq.shape[0] > 0
            p = self._held_max.max if held_elsewhere else 1.0
            self._held_p[uniq] = p
            self._held_max.fix(uniq)
        else:
            p = self.default_priority
            self._max_seen = p
        self._core.write(uniq, np.full(uniq.shape[0], p + self._eps), new=True)

    def add(self, index: Any) -> None:
        """Nothing: the writer's ``mark_update`` already recorded the write."""

    def extend(self, index: Any) -> None:
        """Nothing: the writer's ``mark_update`` already recorded the write."""

    def track(self, index: torch.Tensor, generation: Any) -> None:
        """Remember that the slots in ``index`` were sampled at these write generations.

        A later :meth:`update_priority` given this same tensor object drops
        the entries whose slot was overwritten since. :meth:`sample` does this
        for the index it returns. O(B).
        """
        if not isinstance(index, torch.Tensor):
            raise TypeError(f"`index` must be a torch.Tensor, got {type(index).__name__}")
        gens = _as_index("generation", generation)
        if index.ndim > 1 or gens.shape[0] != index.numel():
            raise ValueError(
                f"`generation` must have one entry per index, got {gens.shape[0]} for index "
                f"with shape {tuple(index.shape)}"
            )
        key = id(index)
        issued = self._issued

        def forget(_: Any, key: int = key) -> None:
            issued.pop(key, None)

        issued[key] = (weakref.ref(index, forget), gens)

    def _tracked(self, index: Any) -> np.ndarray | None:
        entry = self._issued.get(id(index))
        if entry is None or entry[0]() is not index:
            return None
        return entry[1]

    def update_priority(
        self,
        index: Any,
        priority: Any,
        *,
        storage: Any = None,
        generation: Any = None,
    ) -> None:
        """Set the priorities of the items in slots ``index`` (``-1`` entries skipped).

        Duplicate slots: the last value wins. Entries whose slot was
        overwritten since it was sampled are dropped (counted in
        :attr:`dropped_updates`) when the sampled generations are known: from
        ``generation`` (a sample's ``"slot_generation"``) or because ``index``
        is the tensor :meth:`sample` returned. Bad input raises and changes
        nothing. O(B log N).

        Args:
            index: slots (int, sequence or tensor).
            priority: one priority, or one per index; finite and >= 0.
            storage: the buffer's storage (TorchRL passes it): slots below
                ``len(storage)`` that this sampler never saw written (a storage
                filled before the buffer was built) are taken as held.
            generation: the write generation of each slot when it was sampled.

        Raises:
            ValueError: a priority not finite or negative, shapes that do not match.
            TypeError: an index that is not integer, a priority that is not real.
            InvalidIndexError: a slot out of range or never written.
        """
        if isinstance(index, tuple):
            raise ValueError(
                "fastper's TorchRL samplers support storages with ndim=1 only, got a "
                "multi-dimensional index"
            )
        gens = self._tracked(index) if generation is None else _as_index("generation", generation)
        slots = _as_index("index", index)
        p = _as_priority(priority, slots.shape[0])
        if gens is not None and gens.shape[0] != slots.shape[0]:
            raise ValueError(
                f"`generation` must have one entry per index ({slots.shape[0]}), got {gens.shape[0]}"
            )
        keep = slots != -1
        if not keep.all():
            slots, p = slots[keep], p[keep]
            gens = gens[keep] if gens is not None else None
        if slots.shape[0] == 0:
            return
        bad = (slots < 0) | (slots >= self._capacity)
        if bad.any():
            raise InvalidIndexError(
                f"`index` must lie in [0, {self._capacity}) (or be -1: skipped), got "
                f"index={show(slots[bad][:8])}"
            )
        stored = len(storage) if storage is not None else 0
        unseen = self._gen[slots] < 0
        if unseen.any():
            never = slots[unseen & (slots >= stored)]
            if never.size:
                raise InvalidIndexError(
                    f"`index` must name written slots, got never-written index={show(never[:8])}"
                )
            self._check_new_slots(np.unique(slots[unseen]))
        self._core.check_priorities("priority", p + self._eps)
        # everything checked: apply
        if unseen.any():
            adopted = np.unique(slots[unseen])
            self._gen[adopted] = 0
            self._n_held += adopted.shape[0]
        if gens is not None:
            live = self._gen[slots] == gens
            if not live.all():
                self.dropped_updates += int((~live).sum())
                slots, p = slots[live], p[live]
                if slots.shape[0] == 0:
                    return
        self._core.write(slots, p + self._eps)  # the kernels keep the last of duplicates
        if self._held_max is not None and self._held_p is not None:
            last = _last_wins(slots)  # numpy's fancy assignment does not promise an order
            self._held_p[slots[last]] = p[last]
            self._held_max.fix(slots[last])
        else:
            top = float(p.max())  # as TorchRL: the largest value given
            if self._max_seen is None or top > self._max_seen:
                self._max_seen = top

    # -- sampling -----------------------------------------------------------------------
    def _stored(self, storage: Any) -> int:
        ndim = getattr(storage, "ndim", 1)
        if ndim != 1:
            raise ValueError(
                f"fastper's TorchRL samplers support storages with ndim=1 only, got ndim={ndim}"
            )
        n = len(storage)
        if n > self._capacity:
            raise ValueError(
                f"the storage holds {n} items but the sampler's max_capacity is "
                f"{self._capacity}: give max_capacity=storage.max_size"
            )
        if n == 0:
            raise EmptyBufferError("cannot sample from an empty storage: add data first")
        return n

    def _check_sampleable(self, n: int) -> None:
        self._core.check_sampleable(n)

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Draw ``batch_size`` slots: ``(index, {"priority_weight", "slot_generation"})``.

        Uniforms come from the buffer's generator (``generator=`` of the
        buffer, else torch's global one). O(B log N).

        Raises:
            EmptyBufferError: the storage is empty.
            ZeroPriorityError: every stored priority is zero (``eps=0``).
        """
        b = check_int("batch_size", batch_size, minimum=1)
        n = self._stored(storage)
        self._check_sampleable(n)
        u = torch.rand(b, dtype=torch.float64, generator=self._rng).numpy()
        idx, _prob, w, _keys = self._core.sample(
            u, n, self._beta, self._stratified, NORM_CODES[self._weight_norm], 0, 0
        )
        index = torch.from_numpy(idx)
        gens = self._gen[idx]
        self.track(index, gens)
        return index, {
            WEIGHT_KEY: torch.from_numpy(w).to(self.dtype),
            GENERATION_KEY: torch.from_numpy(gens),
        }

    def probabilities(self, index: Any, storage: Any) -> torch.Tensor:
        """P(i) of one independent draw for each slot in ``index`` (float64). O(B).

        For a ``stratified`` sampler, the average over the draws of a batch.
        """
        n = self._stored(storage)
        slots = self._write_slots(index)
        return torch.from_numpy(self._core.probabilities(slots, n))

    # -- whole state ----------------------------------------------------------------------
    def _empty(self) -> None:
        self._core.clear()
        self._gen[:] = -1
        self._n_held = 0
        self._max_seen = None
        if self._held_max is not None and self._held_p is not None:
            self._held_p[:] = 0.0
            self._held_max.rebuild()
        self._issued.clear()
        self.dropped_updates = 0

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: numbers, strings and CPU tensors (``torch.load(weights_only=True)``
        reads it). O(N).

        ``priorities``: ``priority + eps`` per slot (0: never written);
        ``held``: the priorities given, before ``eps`` (only with
        ``max_priority_within_buffer``, else ``None``); ``generation``: write
        generation per slot (-1: never written).
        """
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "capacity": self._capacity,
            "alpha": self.alpha,
            "beta": self._beta,
            "eps": self._eps,
            "max_priority": self._max_seen,
            "priorities": torch.from_numpy(self._core.raw.copy()),
            "held": None
            if self._held_p is None
            else torch.from_numpy(self._held_p[: self._capacity].copy()),
            "generation": torch.from_numpy(self._gen.copy()),
            "dropped_updates": self.dropped_updates,
        }

    def _check_state(self, state: Any) -> dict[str, Any]:
        """Check a state completely; return it with numpy arrays. Raises CheckpointError."""

        def fail(what: str) -> CheckpointError:
            return CheckpointError(f"not a {type(self).__name__} state: {what}")

        if not isinstance(state, Mapping):
            raise fail(f"expected a mapping, got {type(state).__name__}")
        if set(state) != set(_STATE_KEYS):
            raise fail(
                f"entries must be {sorted(_STATE_KEYS)}, got missing="
                f"{sorted(set(_STATE_KEYS) - set(state))}, unknown={sorted(map(str, set(state) - set(_STATE_KEYS)))}"
            )
        if state["version"] != STATE_VERSION:
            raise fail(f"version must be {STATE_VERSION}, got {state['version']!r}")
        if state["kind"] != self.kind:
            raise fail(f"it holds {state['kind']!r} sampling, this sampler is {self.kind!r}")
        if state["capacity"] != self._capacity:
            raise fail(f"capacity {state['capacity']!r} differs from max_capacity={self._capacity}")
        out: dict[str, Any] = {}
        for name in ("alpha", "beta", "eps", "max_priority"):
            v = state[name]
            if v is None and name == "max_priority":
                out[name] = None
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, numbers.Real)
                or not 0 <= float(v) < math.inf
            ):
                what = "None or " if name == "max_priority" else ""
                raise fail(f"`{name}` must be {what}a finite number >= 0, got {show(v)}")
            out[name] = float(v)
        d = state["dropped_updates"]
        if not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 0:
            raise fail(f"`dropped_updates` must be an int >= 0, got {show(d)}")
        out["dropped_updates"] = int(d)

        def array(name: str, dtype: Any) -> np.ndarray:
            v = state[name]
            arr = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
            if (
                not isinstance(arr, np.ndarray)
                or arr.dtype != dtype
                or arr.shape != (self._capacity,)
            ):
                got = f"{arr.dtype}{arr.shape}" if isinstance(arr, np.ndarray) else type(v).__name__
                raise fail(f"`{name}` must be {self._capacity} {np.dtype(dtype)} values, got {got}")
            return np.array(arr, copy=True)

        p = array("priorities", np.float64)
        gen = array("generation", np.int64)
        if not np.isfinite(p).all() or (p < 0).any():
            raise fail("`priorities` must be finite and >= 0")
        if (gen < -1).any():
            raise fail("`generation` must be >= -1")
        if (p[gen < 0] != 0).any():
            raise fail("a never-written slot (generation -1) holds a priority")
        out.update(priorities=p, generation=gen)
        if (state["held"] is None) != (self._held_p is None):
            raise fail(
                "`held` must be given exactly when max_priority_within_buffer=True "
                f"(this sampler: {self._within})"
            )
        out["held"] = None
        if state["held"] is not None:
            held = array("held", np.float64)
            if not np.isfinite(held).all() or (held < 0).any():
                raise fail("`held` must be finite and >= 0")
            out["held"] = held
        self._check_state_order(gen, fail)
        try:
            self._core.check_priorities("priorities", p[p > 0], out["alpha"])
        except ValueError as exc:
            raise fail(str(exc)) from None
        return out

    def _check_state_order(self, gen: np.ndarray, fail: Any) -> None:
        """Raise ``fail(...)`` if the written slots cannot be indexed (rank-based: a prefix)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; everything is checked before anything changes. O(N).

        Raises:
            CheckpointError: a missing or unknown entry, another kind of
                sampler or capacity, or a bad value (named in the message).
        """
        s = self._check_state(state_dict)
        self._beta, self._eps = s["beta"], s["eps"]
        self._gen[:] = s["generation"]
        self._n_held = int((self._gen >= 0).sum())
        self._max_seen = s["max_priority"]
        self.dropped_updates = s["dropped_updates"]
        n = self._core_slots()
        self._core.alpha = s["alpha"]
        self._core.reset_priorities(s["priorities"][:n], n)
        self._core.set_alpha(s["alpha"], n)
        if self._held_max is not None and self._held_p is not None:
            self._held_p[: self._capacity] = s["held"]
            self._held_max.rebuild()
        self._issued.clear()

    def dumps(self, path: str | Path) -> None:
        """Write the state into directory ``path``: ``sampler.json`` and ``.npy`` arrays. O(N)."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        arrays = {k: v.numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}
        meta = {k: v for k, v in state.items() if k not in arrays}
        meta["held"] = None if state["held"] is None else "held.npy"
        for name, arr in arrays.items():
            np.save(path / f"{name}.npy", arr, allow_pickle=False)
        (path / "sampler.json").write_text(json.dumps(meta, indent=1))

    def loads(self, path: str | Path) -> None:
        """Read a :meth:`dumps` directory (no pickle); checked before anything changes. O(N).

        Raises:
            CheckpointError: a file missing, unreadable or holding a bad state.
        """
        path = Path(path).absolute()
        try:
            meta = json.loads((path / "sampler.json").read_text())
            if not isinstance(meta, dict):
                raise ValueError("sampler.json does not hold an object")
            state: dict[str, Any] = dict(meta)
            for name in ("priorities", "generation") + (("held",) if meta.get("held") else ()):
                state[name] = torch.from_numpy(np.load(path / f"{name}.npy", allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read a sampler from {path}: {exc}") from None
        self.load_state_dict(state)

    def _config(self) -> dict[str, Any]:
        return {
            "max_capacity": self._capacity, "alpha": self.alpha, "beta": self._beta,
            "eps": self._eps, "dtype": self.dtype, "reduction": self.reduction,
            "max_priority_within_buffer": self._within, "stratified": self._stratified,
            "weight_norm": self._weight_norm,
        }  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:
            raise RuntimeError(
                f"a {type(self).__name__} cannot be shared between processes: sample and "
                "update priorities in the process that owns the buffer"
            )
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, **state["config"])
        self.load_state_dict(state["state"])


class RankBasedSampler(PrioritizedSampler):
    r"""Rank-based prioritized replay: P(i) = rank(i)^-alpha / sum_r r^-alpha.

    Rank 1 is the largest ``priority + eps`` (ties: the smaller slot ranks
    first). Same arguments and calls as :class:`PrioritizedSampler`; IS
    weights ``(N P(i))^-beta``, normalised as ``weight_norm`` says. The
    ranks are kept exact by an order-statistics tree
    (:class:`fastper.samplers.RankSampler`): a draw, an update or a write
    of one slot O(log N).

    The writer must fill slots in order (TorchRL's round-robin writers do):
    a write that would leave an unwritten slot below a written one is
    refused.

    Memory: about 65 bytes per slot reserved (the order-statistics tree's
    node pools included).
    """

    kind: ClassVar[str] = "rank"

    def _make_core(self, alpha: float) -> _CoreSampler:
        return RankSampler(self._capacity, alpha)

    def _core_slots(self) -> int:
        return self._n_held

    def _check_new_slots(self, new: np.ndarray) -> None:
        expected = np.arange(self._n_held, self._n_held + new.shape[0])
        if not np.array_equal(new, expected):
            raise InvalidIndexError(
                "rank-based sampling needs slots written in order (a round-robin writer): "
                f"{self._n_held} slots are held, got new slots {show(new[:8])}"
            )

    def _check_state_order(self, gen: np.ndarray, fail: Any) -> None:
        held = gen >= 0
        k = int(held.sum())
        if not held[:k].all():
            raise fail("rank-based sampling needs the written slots to be 0 .. n-1")

    def _check_sampleable(self, n: int) -> None:
        if self._n_held != n:
            raise ValueError(
                f"rank-based sampling needs a priority for every stored item: {self._n_held} "
                f"of the storage's {n} items have one"
            )


class UniformSampler(PrioritizedSampler):
    """Uniform replay with the prioritized samplers' calls: switch PER off in one line.

    Every stored item is drawn with probability 1/N and every weight is 1
    (``info["priority_weight"]``); priority updates are checked and kept
    but do not change the law. Same arguments as :class:`PrioritizedSampler`
    (``alpha`` and ``beta`` default to 0 and have no effect).
    """

    kind: ClassVar[str] = "uniform"

    def __init__(
        self,
        max_capacity: int,
        alpha: float = 0.0,
        beta: float = 0.0,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
        *,
        stratified: bool = False,
        weight_norm: str = "buffer",
    ) -> None:
        super().__init__(
            max_capacity, alpha, beta, eps, dtype, reduction, max_priority_within_buffer,
            device, stratified=stratified, weight_norm=weight_norm,
        )  # fmt: skip

    def _make_core(self, alpha: float) -> _CoreSampler:
        return _CoreUniform(self._capacity, alpha)
