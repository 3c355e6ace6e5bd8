"""An n-step add that completes more transitions than the ring holds is one write.

Regression test: such an add was written ``capacity`` rows at a time, so a
storage write that failed after the first left those rows committed and the
n-step windows pending (a retry stored them twice).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer
from fastper.storage import Storage

FIELDS = {
    "obs": ((), np.float32), "reward": ((), np.float32), "next_obs": ((), np.float32),
    "terminated": ((), np.bool_), "truncated": ((), np.bool_),
}  # fmt: skip


class FailingStorage(Storage):
    """RAM storage that takes ``budget`` more writes, then raises (a disk filling up)."""

    budget: int | None = None  # None: no limit

    def write(self, start: int, prepared: Any, k: int) -> None:
        if self.budget is not None:
            if self.budget == 0:
                raise OSError("disk full")
            self.budget -= 1
        super().write(start, prepared, k)


def step(t: int, end: bool = False) -> dict[str, np.ndarray]:
    """Step ``t`` of two streams (rows 0 and 1)."""
    return {"obs": np.full(2, t, np.float32), "reward": np.ones(2, np.float32),
            "next_obs": np.full(2, t + 1, np.float32), "terminated": np.full(2, end),
            "truncated": np.zeros(2, bool)}  # fmt: skip


def _buffer() -> PrioritizedReplayBuffer:
    buf = PrioritizedReplayBuffer(4, FIELDS, n_step=3, seed=0, storage=FailingStorage)
    for t in range(3):  # 2 streams x 3 steps: 2 transitions stored, 4 pending
        buf.add(step(t), env_ids=[0, 1])
    return buf


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same_state(a[k], b[k])
        elif isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_defect_a_flush_past_capacity_is_one_write_that_changes_nothing_when_it_fails() -> None:
    buf = _buffer()
    before = buf.state_dict()
    buf.storage.budget = 0
    with pytest.raises(OSError, match="disk full"):
        buf.add(step(3, end=True), env_ids=[0, 1])  # completes 2 + 4 = 6 > capacity 4
    _same_state(buf.state_dict(), before)
    buf.storage.budget = 1  # one write for the whole add (it used to take two)
    slots = buf.add(step(3, end=True), env_ids=[0, 1])
    # as if added one by one: the ring moved past 6, keeps the last 4
    twin = PrioritizedReplayBuffer(4, FIELDS, n_step=3, seed=0)
    for t in range(3):
        twin.add(step(t), env_ids=[0, 1])
    twin_slots = twin.add(step(3, end=True), env_ids=[0, 1])
    np.testing.assert_array_equal(slots, twin_slots)
    assert buf.total_added == twin.total_added == 8 and buf.n_pending == twin.n_pending == 0
    _same_state(buf.state_dict()["storage"], twin.state_dict()["storage"])
    np.testing.assert_array_equal(buf.keys(np.arange(4)), twin.keys(np.arange(4)))
