"""Adapters that give fastper's pieces the call shape of other replay libraries.

Each adapter is its own submodule, imported on demand; ``import fastper``
never imports this package, and importing an adapter never imports the
framework it imitates.

* :mod:`fastper.compat.dopamine`: Dopamine's sum tree (both the NumPy one and
  the vectorised one of its JAX code) and an ``OutOfGraphPrioritizedReplayBuffer``
  with Dopamine's call shape.
"""

from __future__ import annotations

__all__: list[str] = []
