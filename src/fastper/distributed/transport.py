"""How the coordinator reaches its shards: in this process, or as Ray actors.

A transport sends one method call to one shard and hands back a pending
call; ``results`` waits for several at once (they run in parallel on Ray).
A shard that is gone raises :class:`ShardLostError` naming it. The
coordinator's logic is written once against this small protocol; the local
transport runs it without Ray (tests, one process, and a shard can be
"killed" to exercise the failure policies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import FastPERError

__all__ = ["LocalTransport", "ShardLostError", "ShardLostWarning", "Transport"]


class ShardLostError(FastPERError, RuntimeError):
    """A shard (its process or machine) is gone.

    Attributes:
        shard: the shard's number.
    """

    def __init__(self, shard: int, why: str) -> None:
        super().__init__(f"shard {shard} is lost: {why}")
        self.shard = shard


class ShardLostWarning(RuntimeWarning):
    """A shard was lost and sharded replay went on without it."""


@runtime_checkable
class Transport(Protocol):
    """Calls on shards, answered later (see the module docstring)."""

    @property
    def n_shards(self) -> int:
        """Number of shards, lost ones included (shards keep their numbers)."""
        ...

    def submit(self, shard: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start ``shard.method(*args, **kwargs)``; returns a pending call."""
        ...

    def results(self, pending: Sequence[Any]) -> list[Any]:
        """Wait for pending calls; each result in order, or the first error raised.

        A gone shard raises :class:`ShardLostError`; an error raised by the
        shard's method is raised as itself.
        """
        ...

    def restart(self, shard: int, checkpoint: str) -> None:
        """Replace a lost shard by one loaded from its checkpoint file."""
        ...


class _Done:
    __slots__ = ("error", "shard", "value")

    def __init__(self, shard: int, value: Any = None, error: BaseException | None = None) -> None:
        self.shard, self.value, self.error = shard, value, error


class LocalTransport:
    """Shards as buffers in this process; calls run at once, in order.

    Args:
        shards: the buffers (any with ``sample_mass``, ``mass_stats``, ``add``,
            ``update_priorities``, ``save``).
        loader: makes a shard from a checkpoint file (default ``fastper.load``).
    """

    def __init__(self, shards: Sequence[Any], loader: Callable[[str], Any] | None = None) -> None:
        if not shards:
            raise ValueError("`shards` must hold at least one buffer")
        self.shards: list[Any] = list(shards)
        self._lost: set[int] = set()
        if loader is None:
            from ..loading import load as default_loader

            loader = default_loader
        self._loader: Callable[[str], Any] = loader

    @property
    def n_shards(self) -> int:
        """Number of shards, lost ones included."""
        return len(self.shards)

    def kill(self, shard: int) -> None:
        """Make ``shard`` unreachable, as if its process died (for tests and drills)."""
        self._lost.add(int(shard))

    def submit(self, shard: int, method: str, *args: Any, **kwargs: Any) -> _Done:
        """Run ``shard.method(*args, **kwargs)`` now; its value or error is kept for ``results``."""
        if shard in self._lost:
            return _Done(shard, error=ShardLostError(shard, "its process is gone"))
        try:
            return _Done(shard, getattr(self.shards[shard], method)(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to results(), like a remote error
            return _Done(shard, error=exc)

    def results(self, pending: Sequence[Any]) -> list[Any]:
        """The calls' values in order; the first error is raised (a lost shard: ShardLostError)."""
        for p in pending:
            if p.error is not None:
                raise p.error
        return [p.value for p in pending]

    def restart(self, shard: int, checkpoint: str) -> None:
        """Replace ``shard`` by one loaded from ``checkpoint`` and make it reachable again."""
        self.shards[shard] = self._loader(checkpoint)
        self._lost.discard(int(shard))
