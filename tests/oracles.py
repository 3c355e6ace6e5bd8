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


def _internals(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """Public-looking attributes of a sampler (and its trees): arrays and scalars, copied."""
    for name, value in vars(obj).items():
        if name.startswith("_"):  # scratch space and caches, not state
            continue
        key = f"{prefix}/{name}"
        if isinstance(value, np.ndarray):
            out[key] = value.copy()
        elif isinstance(value, int | float | bool | str) or value is None:
            out[key] = value
        elif hasattr(value, "kernel_arrays"):  # a SumTree
            for field, arr in value.kernel_arrays()._asdict().items():
                out[f"{key}/{field}"] = arr.copy() if isinstance(arr, np.ndarray) else arr


def snapshot(buffer: Any) -> dict[str, Any]:
    """Every piece of a buffer's state, deep-copied, for before/after comparisons.

    The buffer's ``state_dict`` (settings, counters, random state, arrays),
    plus what a state does not hold: every storage row (also past ``len``) and
    the sampler's internal structures (trees, rank index).
    """
    from fastper.checkpoint import split_state

    meta, arrays = split_state(buffer.state_dict())
    state: dict[str, Any] = {"meta": copy.deepcopy(meta)}
    for name, arr in arrays.items():
        state[f"array/{name}"] = np.array(arr, copy=True)
    for name, col in getattr(buffer.storage, "columns", {}).items():
        state[f"data/{name}"] = col.copy()
    state["max_priority"] = buffer.max_priority
    _internals(buffer._sampler, "sampler", state)
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


def naive_nstep_streams(
    rows: list[tuple[int, dict[str, Any]]],
    n: int,
    gamma: float,
    *,
    reward: str = "reward",
    next_obs: str = "next_obs",
    terminated: str | None = "terminated",
    truncated: str | None = "truncated",
    autoreset: str | None = None,
) -> tuple[list[list[dict[str, Any]]], dict[int, int], int]:
    """n-step transitions of interleaved streams, one row at a time, from the definition.

    ``rows`` lists ``(stream id, {field: value})`` in arrival order. Each stream
    keeps a plain list of its open steps. Returns ``(completed, pending,
    dropped)``: ``completed[i]`` holds the transitions row ``i`` completes,
    oldest first, each a dict of every field plus ``discount`` and ``_m`` (the
    window length); ``pending[s]`` counts stream ``s``'s waiting transitions;
    ``dropped`` counts rows dropped by ``autoreset="next_step"`` (the row after
    an episode end of the same stream).
    """

    def ends(row: dict[str, Any], key: str | None) -> bool:
        return key is not None and bool(np.any(np.asarray(row[key]) != 0))

    open_steps: dict[int, list[dict[str, Any]]] = {}
    after_end: set[int] = set()
    dropped = 0
    completed: list[list[dict[str, Any]]] = []
    for stream, row in rows:
        done_here: list[dict[str, Any]] = []
        completed.append(done_here)
        if autoreset == "next_step" and stream in after_end:
            after_end.discard(stream)
            dropped += 1
            continue
        steps = open_steps.setdefault(stream, [])
        steps.append(row)
        episode_over = ends(row, terminated) or ends(row, truncated)
        if not episode_over and len(steps) < n:
            continue
        # the oldest open step's window is full, or the episode ended: every
        # open step's window stops here
        count = len(steps) if episode_over else 1
        for _ in range(count):
            ret = np.zeros(np.shape(steps[0][reward]), dtype=np.float64)
            for j, step in enumerate(steps):
                ret = ret + gamma**j * np.asarray(step[reward], dtype=np.float64)
            out = {k: np.asarray(v) for k, v in steps[0].items()}
            out[reward] = ret
            out[next_obs] = np.asarray(row[next_obs])
            for key in (terminated, truncated):
                if key is not None:
                    out[key] = np.asarray(row[key])
            out["discount"] = 0.0 if ends(row, terminated) else gamma ** len(steps)
            out["_m"] = len(steps)
            done_here.append(out)
            steps.pop(0)
        if episode_over and autoreset == "next_step":
            after_end.add(stream)
    pending = {s: len(steps) for s, steps in open_steps.items()}
    return completed, pending, dropped
