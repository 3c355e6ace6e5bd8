"""fastper: fast, exact prioritized experience replay.

>>> import numpy as np, fastper
>>> buf = fastper.PrioritizedReplayBuffer(
...     1024, {"obs": ((4,), np.float32), "action": ((), np.int64)}, seed=0)
>>> slots = buf.add({"obs": np.zeros((8, 4)), "action": np.arange(8)})
>>> batch = buf.sample(4)
>>> buf.update_priorities(batch.indices, np.ones(4), keys=batch.keys)
4
"""

from __future__ import annotations

from . import disk, schedules
from ._version import __version__
from .buffer_state import from_state_dict, read_metadata
from .buffers import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer, SampleBatch
from .disk import DiskStorage, RecoveryReport
from .errors import (
    CapacityWarning,
    CheckpointError,
    DiskBufferError,
    DiskFullError,
    EmptyBufferError,
    FastPERError,
    FieldTypeError,
    InvalidIndexError,
    MissingExtraError,
    RecoveryWarning,
    ScheduleNotSerializableError,
    ZeroPriorityError,
)
from .limiter import RateLimitedBuffer, RateLimiter
from .loading import load
from .storage import Field, ReplayStorage, Storage
from .trees import MinTree, SumTree

__all__ = [
    "CapacityWarning",
    "CheckpointError",
    "DiskBufferError",
    "DiskFullError",
    "DiskStorage",
    "EmptyBufferError",
    "FastPERError",
    "Field",
    "FieldTypeError",
    "InvalidIndexError",
    "MinTree",
    "MissingExtraError",
    "PrioritizedReplayBuffer",
    "RankBasedReplayBuffer",
    "RateLimitedBuffer",
    "RateLimiter",
    "RecoveryReport",
    "RecoveryWarning",
    "ReplayBuffer",
    "ReplayStorage",
    "SampleBatch",
    "ScheduleNotSerializableError",
    "Storage",
    "SumTree",
    "ZeroPriorityError",
    "__version__",
    "disk",
    "from_state_dict",
    "load",
    "read_metadata",
    "schedules",
]
