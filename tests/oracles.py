"""Naive reference implementations and state snapshots for the tests."""

from __future__ import annotations

import copy
import math
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest


def naive_find(leaves: np.ndarray, target: float) -> int:
    """Smallest i with target < leaves[0] + ... + leaves[i], by exact fsum prefixes."""
    acc = []
    for i in range(len(leaves)):
        acc.append(float(leaves[i]))
        if target < math.fsum(acc):
            return i
    nz = np.flatnonzero(leaves > 0)
    return int(nz[-1])


def proportional_probs(p: np.ndarray, alpha: float) -> np.ndarray:
    w = np.power(p.astype(np.float64), alpha)
    return w / w.sum()


def rank_probs(p: np.ndarray, alpha: float) -> np.ndarray:
    """P(i) for rank-based replay: rank 1 = largest p, ties -> smaller index first."""
    n = len(p)
    order = sorted(range(n), key=lambda i: (-p[i], i))
    ranks = np.empty(n)
    for r, i in enumerate(order):
        ranks[i] = r + 1
    w = ranks ** (-alpha)
    return w / w.sum()


def snapshot(buffer: Any) -> dict[str, Any]:
    """Every piece of a buffer's state, deep-copied, for before/after comparisons."""
    state: dict[str, Any] = {}
    for name, col in buffer._storage.columns.items():
        state[f"data/{name}"] = col.copy()
    state["size"] = buffer._storage.size
    state["cursor"] = buffer._storage.cursor
    state["key_base"] = buffer._key_base
    state["added"] = buffer._added
    state["max_priority"] = buffer._max_priority
    state["stale"] = buffer._stale_updates
    state["step"] = buffer._step
    state["rng"] = copy.deepcopy(buffer._rng.bit_generator.state)
    state["alpha"] = buffer._sampler.alpha
    for name, value in vars(buffer._sampler).items():
        if name.startswith("_"):  # scratch space and caches, not state
            continue
        if isinstance(value, np.ndarray):
            state[f"sampler/{name}"] = value.copy()
        elif isinstance(value, int | float | bool) or value is None:
            state[f"sampler/{name}"] = value
    if buffer._nstep is not None:
        for name, arr in buffer._nstep.pending.items():
            state[f"nstep/{name}"] = arr.copy()
    return state


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            assert np.array_equal(va, vb, equal_nan=va.dtype.kind == "f"), k
        else:
            assert va == vb, k


def refusal_cost(
    read: Callable[[Any], Any], path: Any, error: Any
) -> tuple[BaseException, int, float]:
    """Call ``read(path)``, which must raise ``error``; return the error, the peak
    memory traced while it ran (bytes) and its duration (seconds)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value, peak, time.perf_counter() - t0
