"""Sharded prioritized replay: K shards sampled exactly as one buffer (Ray optional).

``ShardedReplayBuffer`` is the learner's side; shards are fastper buffers
behind :class:`Shard`, reached through a transport: :class:`LocalTransport`
(this process; needs nothing more) or Ray actors (extra ``fastper[ray]``,
imported only when asked for). See :mod:`.plan` for what is exact.
"""

from __future__ import annotations

from typing import Any

from .coordinator import MANIFEST, ShardedReplayBuffer
from .plan import ShardView, rendezvous, split_points
from .shard import Shard
from .transport import LocalTransport, ShardLostError, ShardLostWarning, Transport

__all__ = [
    "MANIFEST",
    "LocalTransport",
    "Shard",
    "ShardLostError",
    "ShardLostWarning",
    "ShardView",
    "ShardedReplayBuffer",
    "Transport",
    "rendezvous",
    "split_points",
    # Ray (extra ``fastper[ray]``), imported on first use:
    "RateLimitedSharded",
    "RayTransport",
    "ShardRouter",
    "load_on_ray",
    "rate_limiter",
    "ray_shards",
    "sharded_on_ray",
]

_RAY_NAMES = {
    "RayTransport": "ray_backend",
    "ray_shards": "ray_backend",
    "sharded_on_ray": "ray_backend",
    "load_on_ray": "ray_backend",
    "ShardRouter": "ray_router",
    "rate_limiter": "ray_limiter",
    "RateLimitedSharded": "ray_limiter",
}


def __getattr__(name: str) -> Any:
    # the Ray back end's names, without importing Ray for ``import fastper.distributed``
    module = _RAY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'fastper.distributed' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
