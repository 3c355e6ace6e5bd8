"""Replay on a torch device: columns, priorities and float64 trees as tensors.

Needs PyTorch (``pip install 'fastper[torch]'``); ``import fastper`` never
imports it. ``sample`` and ``update_priorities`` never synchronise with the
host, and on the torch back end each is a fixed few tensor operations at any
capacity; ``graphed_step`` replays them from CUDA graphs on a GPU (see
:mod:`fastper.device.buffer`).

>>> import torch, fastper.device as fd
>>> buf = fd.DevicePrioritizedReplayBuffer(
...     1024, {"obs": ((4,), "float32"), "action": ((), "int64")}, device="cpu", seed=0)
>>> slots = buf.add({"obs": torch.zeros(8, 4), "action": torch.arange(8)})
>>> batch = buf.sample(4)
>>> int(buf.update_priorities(batch.indices, torch.ones(4), keys=batch.keys))
4
"""

from __future__ import annotations

from .buffer import (
    DeviceBatch,
    DevicePrioritizedReplayBuffer,
    DeviceReplayBuffer,
    GraphedStep,
    load,
)
from .storage import TorchStorage
from .tree import DeviceSumTree

__all__ = [
    "DeviceBatch",
    "DevicePrioritizedReplayBuffer",
    "DeviceReplayBuffer",
    "DeviceSumTree",
    "GraphedStep",
    "TorchStorage",
    "load",
]
