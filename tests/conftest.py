from __future__ import annotations

import numpy as np
import pytest

CARTPOLE_FIELDS = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "done": ((), np.float32),
}


@pytest.fixture
def fields() -> dict:
    return dict(CARTPOLE_FIELDS)


def make_batch(k: int, start: int = 0) -> dict[str, np.ndarray]:
    """k CartPole-like transitions whose values encode their insertion order."""
    t = np.arange(start, start + k)
    return {
        "obs": np.repeat(t[:, None], 4, axis=1).astype(np.float32),
        "action": (t % 2).astype(np.int64),
        "reward": t.astype(np.float32),
        "next_obs": np.repeat(t[:, None] + 1, 4, axis=1).astype(np.float32),
        "done": np.zeros(k, dtype=np.float32),
    }
