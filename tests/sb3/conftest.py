"""Shared set-up of the Stable-Baselines3 tests (each module skips itself without SB3).

torch runs on one thread here: the networks are tiny, and OpenMP threads that
spin while other processes share the cores made these tests 5-10x slower.

SB3's logger makes a folder for every ``learn()``: ``$SB3_LOGDIR``, else a new
``SB3-<date>`` folder in the system's temp folder, which nothing removes.
Every test here points ``SB3_LOGDIR`` into its own ``tmp_path``.
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
def sb3_logs_in_tmp_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    if th is None:  # pragma: no cover
        yield
        return
    before = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(before)
