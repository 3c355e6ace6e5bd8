"""`fastper bench`: a short self-benchmark of the proportional buffer.

Times add (batched fill and single transitions), sample (indices + IS weights
+ data gathered), update_priorities and a learner step (sample + update) at a
given capacity and batch size, and prints medians and p90 in microseconds.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import __version__
from .buffers import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer, _Buffer

FIELDS = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "done": ((), np.float32),
}
KINDS: dict[str, type[_Buffer]] = {
    "uniform": ReplayBuffer,
    "proportional": PrioritizedReplayBuffer,
    "rank": RankBasedReplayBuffer,
}


@dataclass(frozen=True)
class Timing:
    op: str
    unit: str
    median_us: float
    p90_us: float
    calls: int


def _batch(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.standard_normal((k, 4), dtype=np.float32),
        "action": rng.integers(0, 2, k),
        "reward": rng.standard_normal(k, dtype=np.float32),
        "next_obs": rng.standard_normal((k, 4), dtype=np.float32),
        "done": (rng.random(k) < 0.01).astype(np.float32),
    }


def _time(fn: Callable[[], object], calls: int, warmup: int = 20) -> np.ndarray:
    for _ in range(warmup):
        fn()
    out = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = (time.perf_counter_ns() - t0) / 1e3
    return out


def _summary(op: str, unit: str, us: np.ndarray, scale: float = 1.0) -> Timing:
    return Timing(
        op, unit, float(np.median(us)) / scale, float(np.percentile(us, 90)) / scale, len(us)
    )


def check_correct(kind: str) -> None:
    """Before timing: a small buffer must sample its known distribution."""
    buf = KINDS[kind](8, FIELDS, seed=1)
    buf.add(_batch(np.random.default_rng(0), 8))
    buf.update_priorities(np.arange(8), np.arange(1.0, 9.0))
    counts = np.bincount(
        np.concatenate([buf.sample(64).indices for _ in range(500)]), minlength=8
    ) / (64 * 500)
    expected = buf.probabilities(np.arange(8))
    if np.max(np.abs(counts - expected)) > 0.01:
        raise RuntimeError(f"self-check failed for {kind}: {counts} vs {expected}")


def run(
    capacity: int, batch_size: int, kind: str = "proportional", calls: int = 300, seed: int = 0
) -> list[Timing]:
    """Fill a buffer of ``capacity`` and time its operations."""
    check_correct(kind)
    rng = np.random.default_rng(seed)
    cls = KINDS[kind]
    fill_batch = 1000
    t0 = time.perf_counter()
    buf = cls(capacity, FIELDS, seed=seed)
    init_s = time.perf_counter() - t0
    chunk = _batch(rng, fill_batch)
    fills = []
    for _ in range(-(-capacity // fill_batch)):
        t0 = time.perf_counter_ns()
        buf.add(chunk)
        fills.append((time.perf_counter_ns() - t0) / 1e3)
    fill = np.asarray(fills)
    one = {k: v[0] for k, v in chunk.items()}
    single = _time(lambda: buf.add(one), calls)
    td = rng.standard_normal(batch_size)
    sample = _time(lambda: buf.sample(batch_size), calls)
    # each update gets the indices of its own fresh sample, as in training
    # (updating one batch over and over would time a cache-resident tree)
    batches = iter([buf.sample(batch_size) for _ in range(calls + 20)])

    def update_once() -> None:
        b = next(batches)
        buf.update_priorities(b.indices, td, keys=b.keys)

    update = _time(update_once, calls)

    def step() -> None:
        b = buf.sample(batch_size)
        buf.update_priorities(b.indices, td, keys=b.keys)

    learner = _time(step, calls)
    return [
        Timing("init", "per buffer", init_s * 1e6, init_s * 1e6, 1),
        _summary("add (batches of 1000)", "per transition", fill, fill_batch),
        _summary("add (one transition)", "per call", single),
        _summary(f"sample (B={batch_size}, weights + data)", "per call", sample),
        _summary(f"update (B={batch_size})", "per call", update),
        _summary(f"learner step (B={batch_size})", "per call", learner),
    ]


def format_table(timings: list[Timing], capacity: int, kind: str) -> str:
    lines = [
        f"fastper {__version__} bench: {kind}, capacity {capacity} (2^{capacity.bit_length() - 1})"
        if capacity & (capacity - 1) == 0
        else f"fastper {__version__} bench: {kind}, capacity {capacity}",
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}",
        "",
        "| op | unit | median (us) | p90 (us) | calls |",
        "|---|---|---:|---:|---:|",
    ]
    for t in timings:
        lines.append(f"| {t.op} | {t.unit} | {t.median_us:.3f} | {t.p90_us:.3f} | {t.calls} |")
    return "\n".join(lines)
