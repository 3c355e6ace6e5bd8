"""Prioritized replay for TorchRL: change one constructor.

>>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
>>> from fastper.compat.torchrl import PrioritizedSampler
>>> rb = TensorDictReplayBuffer(
...     storage=LazyTensorStorage(1000),
...     sampler=PrioritizedSampler(1000, alpha=0.6, beta=0.4),  # was torchrl.data.PrioritizedSampler
...     priority_key="td_error",
... )

Everything else stays TorchRL's: ``rb.extend``, ``rb.sample`` (a sample
holds ``"index"``, ``"priority_weight"`` and ``"slot_generation"``),
``rb.update_tensordict_priority(sample)``, ``rb.update_priority(index,
priority)``, ``rb.state_dict()``, ``rb.dumps(path)``, and TorchRL's losses,
which read ``"priority_weight"``.

The pieces:

* :class:`PrioritizedSampler`: proportional PER (``P(i) ∝ (priority_i +
  eps)^alpha``), TorchRL's ``PrioritizedSampler`` arguments, on fastper's
  float64 sum tree. It needs no compiled TorchRL extension (TorchRL's own
  sampler does, and that extension only loads with the torch build it was
  compiled against).
* :class:`RankBasedSampler`: rank-based PER (``P(i) ∝ rank(i)^-alpha``).
* :class:`UniformSampler`: uniform replay with the same calls, weights 1.
* :class:`TensorDictPrioritizedReplayBuffer`: TorchRL's class of that name
  (same arguments) over :class:`PrioritizedSampler`; its
  ``update_tensordict_priority`` drops updates for items overwritten since
  they were sampled even when the sample was copied or moved to a GPU.

Needs ``pip install 'fastper[torchrl]'`` (torchrl, tensordict, torch; tested
with torchrl 0.14.1). ``import fastper`` and ``import fastper.compat`` never
import this module.

What differs from TorchRL's ``PrioritizedSampler``: storages with one
dimension only (``ndim=1``); the trees are float64 on the CPU (``dtype``
sets the weights' dtype); priorities must be finite and >= 0 (a bad update
raises and changes nothing); duplicate slots in one update: the last value
wins; with ``max_priority_within_buffer=True`` a new item gets the largest
priority still held (not 1.0 once the largest was overwritten); an item
whose ``priority + eps`` is 0 is never drawn; draws use torch's generator
(the buffer's ``generator=``, else the global one, so ``torch.manual_seed``
makes runs repeatable).
"""

from __future__ import annotations

from typing import Any, cast

from ..errors import missing_extra

try:
    import torch
    from tensordict import TensorDictBase
    from torchrl.data import ListStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.storages import Storage
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise missing_extra("fastper.compat.torchrl", exc, "torchrl") from None

from .torchrl_samplers import (
    GENERATION_KEY,
    WEIGHT_KEY,
    PrioritizedSampler,
    RankBasedSampler,
    UniformSampler,
)

__all__ = [
    "GENERATION_KEY",
    "WEIGHT_KEY",
    "PrioritizedSampler",
    "RankBasedSampler",
    "TensorDictPrioritizedReplayBuffer",
    "UniformSampler",
]


class TensorDictPrioritizedReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer`` over fastper's :class:`PrioritizedSampler`.

    Same arguments as TorchRL's class (``alpha``, ``beta``, ``priority_key``,
    ``eps``, ``storage``, ``reduction``, and every ``TensorDictReplayBuffer``
    argument such as ``batch_size``, ``transform``, ``prefetch``,
    ``generator``), plus the sampler's ``max_priority_within_buffer``,
    ``stratified`` and ``weight_norm``. ``storage`` defaults to
    ``ListStorage(1000)``, as in TorchRL; the sampler's capacity is the
    storage's ``max_size``.

    :meth:`update_tensordict_priority` reads the sample's
    ``"slot_generation"`` entry, so an update for an item overwritten since
    it was sampled is dropped even when the sample was copied, sliced or
    moved to another device on the way (it travels with the tensordict).

    Refused: ``sync=False`` and a ``sampler_device`` other than the CPU
    (the sampler lives in the buffer's process and in host memory), and a
    ``sampler=`` (this class builds its own).
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        priority_key: str = "td_error",
        eps: float = 1e-8,
        storage: Storage | None = None,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        stratified: bool = False,
        weight_norm: str = "buffer",
        sampler_device: Any = None,
        sync: bool = True,
        **kwargs: Any,
    ) -> None:
        if sync is not True:
            raise ValueError(
                "`sync` must be True: fastper's sampler lives in the process that owns the "
                f"buffer, got sync={sync!r}"
            )
        if "sampler" in kwargs:
            raise TypeError(
                "`sampler` cannot be given: this buffer builds its PrioritizedSampler; use "
                "TensorDictReplayBuffer(sampler=...) for another sampler"
            )
        if storage is None:
            storage = ListStorage(max_size=1000)
        sampler = PrioritizedSampler(
            storage.max_size, alpha, beta, eps, reduction=reduction,
            max_priority_within_buffer=max_priority_within_buffer, device=sampler_device,
            stratified=stratified, weight_norm=weight_norm,
        )  # fmt: skip
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, **kwargs)

    @property
    def prioritized_sampler(self) -> PrioritizedSampler:
        """The sampler that holds the priorities."""
        return cast(PrioritizedSampler, self.sampler)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Priorities from ``data[priority_key]`` for the slots in ``data["index"]``.

        Entries whose slot was overwritten since ``data`` was sampled are
        dropped (see :attr:`PrioritizedSampler.dropped_updates`).
        """
        if data.ndim == 1:
            generation = data.get(GENERATION_KEY, None)
            index = data.get("index", None)
            if (
                isinstance(generation, torch.Tensor)
                and isinstance(index, torch.Tensor)
                and index.ndim == 1
                and generation.shape == index.shape
            ):
                # TorchRL hands this very tensor to the sampler's update_priority,
                # which drops the entries of a tracked tensor that went stale.
                self.prioritized_sampler.track(index, generation)
        super().update_tensordict_priority(data)
