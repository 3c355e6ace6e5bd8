"""Frame buffers sample only valid transitions, with the law they report.

A frame ring too small for one-step episodes (2 frames per transition)
leaves only the newest transitions valid. Chi-square tests (fixed seeds)
compare the draws with uniform over the valid keys (``ReplayBuffer``) and
with p_i^alpha / sum over the valid ones (``PrioritizedReplayBuffer``);
no draw may land on an invalid transition.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy.stats import chisquare

from fastper import PrioritizedReplayBuffer, ReplayBuffer

SHAPE = (2, 2)
FIELDS = {
    "obs": (SHAPE, np.uint8), "next_obs": (SHAPE, np.uint8), "action": ((), np.int64),
    "reward": ((), np.float32), "terminated": ((), bool), "truncated": ((), bool),
}  # fmt: skip


def filled(cls: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    buf = cls(60, FIELDS, frame_stack={"obs": 2}, frame_capacity=80, seed=seed)
    for t in range(150):  # one-step episodes: every row writes two frames
        buf.add({
            "obs": rng.integers(0, 255, SHAPE, dtype=np.uint8),
            "next_obs": rng.integers(0, 255, SHAPE, dtype=np.uint8),
            "action": t, "reward": 0.0, "terminated": True, "truncated": False,
        })  # fmt: skip
    return buf


@pytest.mark.parametrize("cls", [ReplayBuffer, PrioritizedReplayBuffer])
def test_draws_follow_the_reported_law_over_valid_transitions(cls: Any) -> None:
    buf = filled(cls, seed=4)
    assert buf.num_valid == 40 and len(buf) == 60
    slots = np.arange(len(buf))
    if cls is PrioritizedReplayBuffer:
        rng = np.random.default_rng(0)
        buf.update_priorities(slots, rng.exponential(size=60) + 0.05)
    probs = buf.probabilities(slots)
    valid = probs > 0
    assert valid.sum() == 40
    counts = np.zeros(len(buf))
    for _ in range(400):
        s = buf.sample(64)
        assert np.all(buf.keys(s.indices) == s.keys)
        assert buf.is_valid(s.indices).all()
        np.add.at(counts, s.indices, 1)
    assert counts[~valid].sum() == 0
    expected = probs[valid] * counts.sum()
    assert chisquare(counts[valid], expected).pvalue > 1e-3
