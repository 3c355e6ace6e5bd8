"""Index memory stays within the budget of issue #3 (<= 24 bytes per slot).

Fixed overheads (a few KB of scratch) matter only for tiny buffers, so the
budget is checked at realistic sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastper


@pytest.mark.parametrize("capacity", [2**16, 2**16 + 3, 100_000])
def test_proportional_index_bytes_per_slot(capacity: int) -> None:
    buf = fastper.PrioritizedReplayBuffer(capacity, {"obs": ((4,), np.float32)})
    sizes = buf.nbytes()
    assert sizes["data"] == 16 * capacity
    # raw priorities (8) + sum-tree leaves (8) + inner nodes of both trees (~2.3)
    assert sizes["index"] / capacity <= 24.0, sizes["index"] / capacity
