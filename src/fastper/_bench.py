"""`fastper bench`: a short self-benchmark of the proportional buffer.

Times add (batched fill and single transitions), sample (indices + IS weights
+ data gathered), update_priorities and a learner step (sample + update) at a
given capacity and batch size, and prints medians and p90 in microseconds.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import __version__
from .buffers import BaseBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer

FIELDS = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "done": ((), np.float32),
}
#: The smallest capacity ``run_workloads`` can time (its n-step test adds 4-env vector steps).
MIN_WORKLOAD_CAPACITY = 4

KINDS: dict[str, type[BaseBuffer]] = {
    "uniform": ReplayBuffer,
    "proportional": PrioritizedReplayBuffer,
    "rank": RankBasedReplayBuffer,
}


def cpu_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``, macOS's ``sysctl``; else what
    ``platform`` knows, at least the architecture): benchmark reports name it, as
    figures differ between CPUs of one architecture (caches, vector width) more
    than between runs."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True, text=True, timeout=5, check=False,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            return out
    known = platform.processor()
    return known if known and known != "unknown" else platform.machine()


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
    fill_batch = min(1000, capacity)  # a batch must not exceed the capacity
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
        _summary(f"add (batches of {fill_batch})", "per transition", fill, fill_batch),
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
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()} "
        f"({cpu_name()})",
        "",
        "| op | unit | median (us) | p90 (us) | calls |",
        "|---|---|---:|---:|---:|",
    ]
    for t in timings:
        lines.append(f"| {t.op} | {t.unit} | {t.median_us:.3f} | {t.p90_us:.3f} | {t.calls} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# workloads: the loops real runs have, each next to its reference
# ---------------------------------------------------------------------------

NSTEP_FIELDS = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}


#: The largest acceptable cost of each feature, as a ratio to its reference.
#: Batch-wide weight normalisation skips the min tree, so it must cost no more
#: than the default; the max tree of ``max_priority="current"`` is one more
#: O(log N) path per write.
TARGETS = {
    "alpha schedule": 1.1, "rank": 1.5, "n-step": 1.5, "batch norm": 1.0, "current max": 1.2,
}  # fmt: skip


@dataclass(frozen=True)
class Pair:
    """One workload timed beside its reference, in interleaved rounds."""

    name: str
    reference: str
    median_us: float
    reference_us: float
    target: float | None  # the largest acceptable ratio median / reference (None: none set)
    #: the lowest and highest ratio of one round (workload and reference timed back to back)
    spread: tuple[float, float] = (float("nan"), float("nan"))

    @property
    def ratio(self) -> float:
        return self.median_us / self.reference_us


def _interleaved(
    fns: tuple[Callable[[], object], Callable[[], object]], rounds: int, calls: int
) -> tuple[float, float, tuple[float, float]]:
    """Medians over rounds of each round's median per call, A and B alternating,
    and the range of the rounds' ratios A / B."""
    meds: list[list[float]] = [[], []]
    for _ in range(rounds):
        for j, fn in enumerate(fns):
            meds[j].append(float(np.median(_time(fn, calls, warmup=3))))
    ratios = np.asarray(meds[0]) / np.asarray(meds[1])
    return (
        float(np.median(meds[0])),
        float(np.median(meds[1])),
        (float(ratios.min()), float(ratios.max())),
    )


def _filled(kind: str, capacity: int, n: int, seed: int = 0, **kw: object) -> BaseBuffer:
    rng = np.random.default_rng(seed)
    buf = KINDS[kind](capacity, FIELDS, seed=seed, **kw)  # type: ignore[arg-type]
    chunk = 65536
    for lo in range(0, n, chunk):
        k = min(chunk, n - lo)
        buf.add(_batch(rng, k), priorities=rng.random(k) + 0.05)
    return buf


def _actor_learner(buf: BaseBuffer, batch: int, seed: int = 1) -> Callable[[], object]:
    """One add, one sample, one update with the sample's keys: a learner step with an actor."""
    rng = np.random.default_rng(seed)
    one = {k: v[0] for k, v in _batch(rng, 1).items()}
    tds = [rng.standard_normal(batch) for _ in range(8)]
    turn = [0]

    def step() -> None:
        buf.add(one)
        s = buf.sample(batch)
        turn[0] += 1
        buf.update_priorities(s.indices, tds[turn[0] % 8], keys=s.keys)

    return step


def run_workloads(
    capacity: int, batch_size: int = 256, rounds: int = 5, calls: int = 100
) -> list[Pair]:
    """Time the workload loops at ``capacity``; each with its reference and target ratio.

    ``capacity`` must be at least :data:`MIN_WORKLOAD_CAPACITY`.
    """
    if capacity < MIN_WORKLOAD_CAPACITY:
        raise ValueError(
            f"`capacity` must be >= {MIN_WORKLOAD_CAPACITY} for the workloads, got capacity={capacity}"
        )
    from . import schedules

    out: list[Pair] = []
    for frac, label in ((1.0, "full"), (0.5, "half full")):
        n = int(capacity * frac)
        prop = _filled("proportional", capacity, n)
        # 1. an alpha schedule vs a constant alpha (learner step with an actor)
        sched = _filled("proportional", capacity, n, alpha=schedules.linear(0.4, 0.9, 10**9))
        a, b, spread = _interleaved(
            (_actor_learner(sched, batch_size), _actor_learner(prop, batch_size)), rounds, calls
        )
        out.append(Pair(f"proportional, linear alpha schedule, {label}", "constant alpha", a, b,
                        TARGETS["alpha schedule"], spread))  # fmt: skip
        del sched
        # 2. each buffer kind vs proportional
        for kind in ("rank", "uniform"):
            other = _filled(kind, capacity, n)
            a, b, spread = _interleaved(
                (_actor_learner(other, batch_size), _actor_learner(prop, batch_size)),
                rounds, calls,
            )  # fmt: skip
            target = TARGETS["rank"] if kind == "rank" else None
            out.append(Pair(f"{kind}, add+sample+update, {label}", "proportional", a, b, target,
                            spread))  # fmt: skip
            del other
        # 3. the options that change what an update keeps up to date
        for option, value, key in (
            ("weight_norm", "batch", "batch norm"), ("max_priority", "current", "current max"),
        ):  # fmt: skip
            options: dict[str, Any] = {option: value}
            other = _filled("proportional", capacity, n, **options)
            a, b, spread = _interleaved(
                (_actor_learner(other, batch_size), _actor_learner(prop, batch_size)),
                rounds, calls,
            )  # fmt: skip
            out.append(Pair(f'proportional, {option}="{value}", {label}', "defaults", a, b,
                            TARGETS[key], spread))  # fmt: skip
            del other
        del prop
    # 4. n-step adds vs plain adds of the same rows
    rng = np.random.default_rng(2)
    rows = _nstep_rows(rng, 4)
    plain = PrioritizedReplayBuffer(capacity, NSTEP_FIELDS, seed=0)
    nstep = PrioritizedReplayBuffer(capacity, NSTEP_FIELDS, n_step=3, gamma=0.99, seed=0)
    one = {k: v[0] for k, v in rows.items()}
    a, b, spread = _interleaved((lambda: nstep.add(one), lambda: plain.add(one)), rounds, calls * 5)
    out.append(Pair("n-step add (n=3), one transition", "plain add, one transition", a, b,
                    TARGETS["n-step"], spread))  # fmt: skip
    vec_plain = PrioritizedReplayBuffer(capacity, NSTEP_FIELDS, seed=0)
    vec = PrioritizedReplayBuffer(capacity, NSTEP_FIELDS, n_step=3, gamma=0.99, n_envs=4, seed=0)
    a, b, spread = _interleaved((lambda: vec.add(rows), lambda: vec_plain.add(rows)), rounds,
                                calls * 5)  # fmt: skip
    out.append(Pair("n-step add (n=3), 4-env vector step", "plain add, 4-row batch", a, b,
                    TARGETS["n-step"], spread))  # fmt: skip
    return out


def _nstep_rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    """:func:`_batch` with the episode-end flags n-step needs (no episode ends)."""
    rows = _batch(rng, k)
    del rows["done"]
    return {**rows, "terminated": np.zeros(k, dtype=bool), "truncated": np.zeros(k, dtype=bool)}


def format_workloads(pairs: list[Pair], capacity: int, batch_size: int) -> str:
    lines = [
        f"#### N = {capacity}"
        + (f" (2^{capacity.bit_length() - 1})" if capacity & (capacity - 1) == 0 else "")
        + f", B = {batch_size}",
        "",
        "| workload | us/call | reference | us/call | ratio | rounds' ratios | target |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for p in pairs:
        if p.target is None:
            goal = "-"
        else:
            goal = f"<= {p.target:g}x ({'met' if p.ratio <= p.target else 'not reached'})"
        lines.append(
            f"| {p.name} | {p.median_us:.1f} | {p.reference} | {p.reference_us:.1f} | "
            f"{p.ratio:.2f}x | {p.spread[0]:.2f} - {p.spread[1]:.2f} | {goal} |"
        )
    return "\n".join(lines)
