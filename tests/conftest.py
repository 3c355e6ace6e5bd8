from __future__ import annotations

from collections.abc import Iterator

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


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test: float sums then do not depend on the machine,
    and the tiny networks of the tests run several times faster than on OpenMP threads
    that spin while other processes share the cores."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
