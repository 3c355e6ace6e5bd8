"""Sharded prioritized replay: K shards sampled exactly as one buffer (Ray optional).

``ShardedReplayBuffer`` is the learner's side; shards are fastper buffers
behind :class:`Shard`, reached through a transport: :class:`LocalTransport`
(this process; needs nothing more) or Ray actors (extra ``fastper[ray]``,
imported only when asked for). See :mod:`.plan` for what is exact.
"""

from __future__ import annotations

from .coordinator import MANIFEST, ShardedReplayBuffer, ShardLostWarning
from .plan import ShardView, rendezvous, split_points
from .shard import Shard
from .transport import LocalTransport, ShardLostError, Transport

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
]
