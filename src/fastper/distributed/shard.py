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
from ..errors import EmptyBufferError, ZeroPriorityError
from ..loading import load as _load
from .plan import ShardView

__all__ = ["DRAW_EMPTY", "DRAW_OK", "DRAW_ZERO", "Shard"]

#: ``step`` reply ``counts[3]``: the draw was made / the shard was empty / all its masses were 0
DRAW_OK, DRAW_EMPTY, DRAW_ZERO = 0, 1, 2

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

    def step(
        self,
        slots: np.ndarray | None = None,
        td_errors: np.ndarray | None = None,
        keys: np.ndarray | None = None,
        targets: np.ndarray | None = None,
        view_total: float = 0.0,
    ) -> dict[str, np.ndarray]:
        """A learner step's one call: apply priority updates, then find the rows under points.

        The updates (``slots``, ``td_errors``, ``keys``; stale keys dropped,
        the last of duplicate slots wins) are applied first, then the
        ``targets`` (points into the coordinator's view ``view_total`` of this
        shard's mass, rescaled to the current total as in
        :meth:`fastper.PrioritizedReplayBuffer.sample_mass`) are searched.

        Returns one array per field, no per-row objects: ``indices``,
        ``keys``, ``masses``, ``data.<field>`` for each field, ``stats``
        (float64 ``[total, min_mass]`` after the call) and ``counts`` (int64
        ``[size, added, applied updates, draw status]``; the status is
        :data:`DRAW_OK`, or :data:`DRAW_EMPTY` / :data:`DRAW_ZERO` when there
        was nothing to draw from, in which case the updates still count and
        no rows come back). O(U log N + B log N) for U updates and B points.
        """
        applied = 0
        if slots is not None and len(slots):
            applied = int(self.buffer.update_priorities(slots, td_errors, keys=keys))
        out: dict[str, np.ndarray] = {}
        status = DRAW_OK
        if targets is not None and len(targets):
            try:
                m = self.buffer.sample_mass(targets, view_total)
            except EmptyBufferError:
                status = DRAW_EMPTY
            except ZeroPriorityError:
                status = DRAW_ZERO
            else:
                out["indices"], out["keys"], out["masses"] = m.indices, m.keys, m.masses
                for name, arr in m.data.items():
                    out["data." + name] = arr
        total, min_mass, size, added = self.buffer.mass_stats()
        out["stats"] = np.array([total, min_mass], dtype=np.float64)
        out["counts"] = np.array([size, added, applied, status], dtype=np.int64)
        return out

    def channel_step(
        self, args: dict[str, Any], arrays: dict[str, np.ndarray]
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """:meth:`step` for the socket channel (:mod:`.wire`): arguments as named arrays."""
        keys = arrays.get("keys") if args.get("keyed") else None
        out = self.step(arrays.get("slots"), arrays.get("td_errors"), keys, arrays.get("targets"),
                        float(args.get("view_total", 0.0)))  # fmt: skip
        return {}, out

    def save(self, path: str) -> ShardView:
        """Checkpoint the buffer to ``path`` (atomic, pickle-free); the view it saved."""
        self.buffer.save(path)
        return self.view()

    def stale_updates(self) -> int:
        """Updates this shard dropped because their slot was overwritten since sampled."""
        return int(self.buffer.stale_updates)
