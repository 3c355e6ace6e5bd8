"""Shared set-up of the Stable-Baselines3 tests (each module skips itself without SB3).

torch runs on one thread here: the networks are tiny, and OpenMP threads that
spin while other processes share the cores made these tests 5-10x slower.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

th: Any
try:
    import torch as th
except ImportError:  # pragma: no cover - depends on the environment
    th = None


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    if th is None:  # pragma: no cover
        yield
        return
    before = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(before)
