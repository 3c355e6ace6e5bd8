"""Checks every front end makes alike: a value a field cannot hold, an absurd batch size.

Regression tests: an integer past float16's range was stored as ``inf`` in a
float16 field (CPU and device buffers alike), and ``sample(10**12)`` on the
device and sharded buffers failed in the allocator instead of with a message.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastper
from fastper.distributed import ShardedReplayBuffer
from fastper.errors import FieldTypeError

HALF = {"x": ((), np.float16)}


def test_defect_an_integer_past_float16s_range_is_refused_not_stored_as_inf() -> None:
    buf = fastper.ReplayBuffer(4, HALF)
    with pytest.raises(FieldTypeError, match="float16; values overflow it"):
        buf.add({"x": np.int32(100_000)})
    assert len(buf) == 0
    buf.add({"x": np.array([1000, -65504], dtype=np.int32)})  # in range: stored (rounded)
    np.testing.assert_array_equal(buf.storage.gather(np.arange(2))["x"], [1000, -65504])


def test_defect_the_device_buffer_refuses_the_same_integers() -> None:
    torch = pytest.importorskip("torch")
    from fastper.device import DeviceReplayBuffer

    buf = DeviceReplayBuffer(4, HALF, device="cpu")
    with pytest.raises(FieldTypeError, match="float16; values overflow it"):
        buf.add({"x": torch.tensor([100_000], dtype=torch.int32)})
    assert len(buf) == 0
    buf.add({"x": torch.tensor([1000], dtype=torch.int32)})
    assert len(buf) == 1


def test_defect_device_and_sharded_buffers_refuse_an_absurd_batch_size() -> None:
    sharded = ShardedReplayBuffer.local(2, 8, HALF, seed=0)
    sharded.add({"x": np.zeros(4, np.float16)})
    with pytest.raises(ValueError, match="`batch_size` must be <="):
        sharded.sample(10**12)
    assert sharded.step == 0
    torch = pytest.importorskip("torch")
    from fastper.device import DeviceReplayBuffer

    dev = DeviceReplayBuffer(8, HALF, device="cpu", seed=0)
    dev.add({"x": torch.zeros(4, dtype=torch.float16)})
    with pytest.raises(ValueError, match="`batch_size` must be <="):
        dev.sample(10**12)
    assert dev.step == 0
