"""Adapters that give fastper's pieces the call shape of other replay libraries.

Each adapter is its own submodule, imported on demand; ``import fastper``
never imports this package.

* :mod:`fastper.compat.dopamine`: Dopamine's sum tree (both the NumPy one and
  the vectorised one of its JAX code) and an ``OutOfGraphPrioritizedReplayBuffer``
  with Dopamine's call shape (imports neither Dopamine nor JAX).
* :mod:`fastper.compat.sb3`: prioritized replay buffers and ``PERDQN``,
  ``PERSAC``, ``PERTD3`` for Stable-Baselines3 (extra ``sb3``; importing it
  imports stable-baselines3 and torch).
* :mod:`fastper.compat.torchrl`: prioritized, rank-based and uniform samplers
  for TorchRL's replay buffers, and a ``TensorDictPrioritizedReplayBuffer``
  (extra ``torchrl``; importing it imports torchrl, tensordict and torch).
"""

from __future__ import annotations

__all__: list[str] = []
