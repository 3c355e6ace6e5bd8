"""One shard: a fastper buffer behind the few calls a coordinator and actors make.

Plain Python, so the same class runs in this process (tests, one machine) or
as a Ray actor (``ray.remote(Shard)``). Every reply carries the shard's
:class:`~fastper.distributed.plan.ShardView` (total mass, smallest mass, size,
transitions added), so the coordinator never needs a round trip only to
learn them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..batch import MassSample
from ..loading import load as _load
from .plan import ShardView

__all__ = ["Shard"]

_KINDS = ("proportional", "uniform")


class Shard:
    """A buffer serving its part of sharded replay.

    Args:
        buffer: a :class:`~fastper.PrioritizedReplayBuffer` or a
            :class:`~fastper.ReplayBuffer`. Only a prioritized buffer with
            the default ``weight_norm="buffer"`` keeps its smallest mass (its
            view reports NaN otherwise), which a coordinator normalising over
            the whole memory needs. Rank-based replay cannot be sharded
            exactly (a rank is a property of the whole memory).
    """

    def __init__(self, buffer: Any) -> None:
        kind = getattr(buffer, "scheme", None)
        if kind not in _KINDS:
            raise TypeError(
                f"a shard must hold proportional or uniform replay, got {type(buffer).__name__} "
                f"(scheme {kind!r}): rank-based probabilities depend on the whole memory"
            )
        self.buffer = buffer

    @classmethod
    def load(cls, path: str) -> Shard:
        """A shard from a fastper checkpoint file (pickle-free)."""
        return cls(_load(path))

    def view(self) -> ShardView:
        """Total mass, smallest positive mass, size, transitions added. O(1)."""
        total, min_mass, size, added = self.buffer.mass_stats()
        return ShardView(total, min_mass, size, added)

    def describe(self) -> dict[str, Any]:
        """Capacity, fields and scheme, for the coordinator's checks."""
        fields = {k: (list(f.shape), f.dtype.str) for k, f in self.buffer.fields.items()}
        return {"capacity": self.buffer.capacity, "fields": fields, "scheme": self.buffer.scheme,
                "view": self.view()}  # fmt: skip

    def add(
        self, transition: Mapping[str, Any], env_ids: Any = None, priorities: Any = None
    ) -> tuple[np.ndarray, ShardView]:
        """Store transitions (one or a batch); the slots written and the new view.

        ``priorities``: raw priorities computed by the actor (Ape-X), one per
        transition; by default the buffer's max-priority policy.
        """
        slots = self.buffer.add(transition, priorities, env_ids=env_ids)
        return slots, self.view()

    def get(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The rows in ``slots`` (see ``buffer.get``): no draw, nothing changes."""
        return self.buffer.get(slots)

    def sample_mass(self, targets: np.ndarray, view_total: float) -> MassSample:
        """The slots under the coordinator's points (see ``buffer.sample_mass``)."""
        return self.buffer.sample_mass(targets, view_total)

    def update_priorities(
        self, slots: np.ndarray, td_errors: np.ndarray, keys: np.ndarray | None
    ) -> tuple[int, ShardView]:
        """Apply priorities (stale keys dropped); the count applied and the new view."""
        applied = self.buffer.update_priorities(slots, td_errors, keys=keys)
        return int(applied), self.view()

    def save(self, path: str) -> ShardView:
        """Checkpoint the buffer to ``path`` (atomic, pickle-free); the view it saved."""
        self.buffer.save(path)
        return self.view()

    def stale_updates(self) -> int:
        """Updates this shard dropped because their slot was overwritten since sampled."""
        return int(self.buffer.stale_updates)
