"""Shared set-up of the TorchRL tests (each module skips itself without torchrl).

torch runs on one thread here: the tensors are tiny, and OpenMP threads that
spin while other processes share the cores only slow the tests down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

torch: Any
try:
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    if torch is None:  # pragma: no cover
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def quiet_torchrl() -> Iterator[None]:
    """TorchRL logs every storage it initialises at INFO level."""
    logger = logging.getLogger("torchrl")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)
