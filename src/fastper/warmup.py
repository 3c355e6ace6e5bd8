"""Compile fastper's kernels into the on-disk cache ahead of their first use.

``python -m fastper.warmup`` (or ``fastper warmup``) runs every buffer kind
through a few small calls (add, sample, update, n-step, image frames, rank
order, checkpoints, sharded replay in one process, the Dopamine layout,
tiered storage), so that each numba kernel is compiled once and saved. Run it
once per machine, e.g. as a step of a Dockerfile or a CI job: later processes
load the compiled kernels instead of compiling them (the first learner step
then takes well under a second instead of several).

A wheel built from the source tree already carries the kernels compiled on
the machine that built it (see ``setup.py``); this command is for other
machines, other numba versions, or installs that skipped that step. Where
the cache lives: :mod:`fastper._kernels._jit`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ._kernels._jit import cache_counts, cache_dirs
from .buffer_state import from_state_dict
from .buffers import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer
from .storage import Storage
from .trees import MinTree, SumTree

__all__ = ["WarmupReport", "main", "warmup"]

FIELDS = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "terminated": ((), np.bool_),
}
N = 64  # slots: the kernels' types do not depend on the size


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` did."""

    compiled: int  #: kernel signatures compiled (and saved) by this call
    loaded: int  #: kernel signatures already in the cache
    seconds: float  #: wall time of the calls
    cache_dir: str | None  #: where compiled kernels are saved (None: nowhere writable)
    writable: bool  #: whether anything could be saved
    skipped: tuple[str, ...]  #: parts not warmed, each with why (an extra not installed)


def _counts() -> tuple[int, int]:
    """(signatures compiled, signatures loaded from the cache) over all kernels so far."""
    counts = cache_counts().values()
    return sum(c for c, _ in counts), sum(loaded for _, loaded in counts)


def _batch(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.standard_normal((n, 4), dtype=np.float32),
        "action": rng.integers(0, 2, n),
        "reward": rng.standard_normal(n).astype(np.float32),
        "next_obs": rng.standard_normal((n, 4), dtype=np.float32),
        "terminated": rng.random(n) < 0.1,
    }


def _learner_steps(buf: Any, rng: np.random.Generator, updates: bool = True) -> None:
    """Adds of one row, of a batch and of a wrapping batch; samples; updates."""
    one = {k: v[0] for k, v in _batch(rng, 1).items()}
    buf.add(one)
    buf.add(_batch(rng, 40))
    if updates:
        buf.add(_batch(rng, 40), priorities=rng.random(40) + 0.1)
    for _ in range(2):
        batch = buf.sample(16)
        if updates:
            buf.update_priorities(batch.indices, rng.standard_normal(16), keys=batch.keys)
            buf.update_priorities(batch.indices, rng.standard_normal(16))
    buf.get(np.arange(4))
    buf.probabilities(np.arange(4))
    buf.invalidate(np.array([40]))  # a slot none of the calls below names


def _rank_compaction(rng: np.random.Generator) -> None:
    """Keys pushed to the end of the order until the rank tree's node pools run out."""
    from .rank_sampler import RankSampler

    cap = 2000
    sampler = RankSampler(cap, 0.7)
    sampler.write_run(0, cap, 1.0)
    for step in range(1, 40):
        slots = rng.choice(cap, 100, replace=False)
        sampler.write(slots, np.full(100, 0.5**step) * (1.0 + rng.random(100)))
    sampler.order  # noqa: B018 - reads the order (a kernel of its own)


def _buffers(rng: np.random.Generator) -> None:
    for cls in (ReplayBuffer, PrioritizedReplayBuffer):
        _learner_steps(cls(N, FIELDS, seed=0), rng, updates=cls is not ReplayBuffer)
    buf = PrioritizedReplayBuffer(N, FIELDS, alpha=0.6, seed=0)
    _learner_steps(buf, rng)
    # the writes that keep the max tree of max_priority="current" (in the index's
    # own calls; a rank-based index leaves it to the tree's)
    for kind in (PrioritizedReplayBuffer, RankBasedReplayBuffer):
        _learner_steps(kind(N, FIELDS, max_priority="current", seed=0), rng)
    buf.set_alpha(0.5)
    buf.priorities(np.arange(4))
    buf.keys(np.arange(4))
    from_state_dict(buf.state_dict())
    rank = RankBasedReplayBuffer(N, FIELDS, seed=0)
    _learner_steps(rank, rng)
    rank.sort()
    rank.ranks(np.arange(4))
    rank.set_alpha(0.5)
    from_state_dict(rank.state_dict())
    seg = RankBasedReplayBuffer(N, FIELDS, segments=True, sort_every=2, seed=0)
    _learner_steps(seg, rng)
    seg.sort()
    _rank_compaction(rng)
    for sum_tree in (SumTree(N), SumTree(N, track_min=True)):
        sum_tree.set(np.arange(8), np.linspace(0.5, 1.0, 8))
        sum_tree.find(np.array([0.1, 1.0]))
        sum_tree.get(np.arange(4))
        sum_tree.rebuild()
    min_tree = MinTree(N)
    min_tree.set(np.arange(8), np.linspace(0.5, 1.0, 8))
    min_tree.rebuild()
    _checks()


def _checks() -> None:
    """The reward checks of batch adds, for both float widths."""
    from ._validation import rewards_finite

    for dtype in (np.float32, np.float64):
        rewards_finite(np.zeros(16, dtype))  # (a few values are checked without the kernel)


def _nstep_steps(buf: Any, rng: np.random.Generator) -> None:
    for t in range(12):
        buf.add({**_batch(rng, 2), "truncated": np.array([False, t % 6 == 5])})
    for _ in range(4):  # vector steps with no episode end: the steady-state plan
        calm = {**_batch(rng, 2), "terminated": np.zeros(2, bool)}
        buf.add({**calm, "truncated": np.zeros(2, bool)})
    buf.sample(8)


def _nstep_and_frames(rng: np.random.Generator) -> None:
    fields = {**FIELDS, "truncated": ((), np.bool_)}
    # the n-step kernels take the storage's arrays: strided views of records (these
    # fields, by default) or contiguous columns (large rows, or a layout asked for)
    columns = PrioritizedReplayBuffer(
        N, fields, n_step=3, gamma=0.99, n_envs=2, seed=0,
        storage=lambda f, c: Storage(f, c, layout="columns"),
    )  # fmt: skip
    _nstep_steps(columns, rng)
    for cls in (
        ReplayBuffer,
        PrioritizedReplayBuffer,
        RankBasedReplayBuffer,
    ):
        buf = cls(N, fields, n_step=3, gamma=0.99, n_envs=2, seed=0)
        _nstep_steps(buf, rng)
        frames = {
            "obs": ((8, 8), np.uint8),
            "next_obs": ((8, 8), np.uint8),
            "action": ((), np.int64),
            "reward": ((), np.float32),
            "terminated": ((), np.bool_),
            "truncated": ((), np.bool_),
        }
        img = cls(N, frames, frame_stack={"obs": 4}, frame_capacity=32, n_envs=2, n_step=3, seed=0)
        seq = rng.integers(0, 256, (41, 2, 8, 8), dtype=np.uint8)  # frames of 2 envs
        for t in range(40):  # more rows than slots: old frames are overwritten
            img.add({
                "obs": seq[t],
                "next_obs": seq[t + 1],
                "action": np.zeros(2, np.int64),
                "reward": np.ones(2, np.float32),
                "terminated": np.array([t % 5 == 4, False]),
                "truncated": np.array([False, t % 6 == 5]),
            })  # fmt: skip
        img.sample(8)
        from_state_dict(img.state_dict())


def _dopamine(rng: np.random.Generator) -> None:
    from .compat.dopamine import OutOfGraphPrioritizedReplayBuffer

    replay = OutOfGraphPrioritizedReplayBuffer(
        observation_shape=(8, 8), stack_size=4, replay_capacity=N, batch_size=8,
        update_horizon=3, gamma=0.99, rng=0,
    )  # fmt: skip
    for t in range(40):
        frame = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        replay.add(frame, t % 4, 1.0, t % 20 == 19, priority=1.0)
    *_, indices, _ = replay.sample_transition_batch()
    replay.set_priority(indices, np.ones(len(indices)))


def _sharded(rng: np.random.Generator) -> None:
    from .distributed import ShardedReplayBuffer

    buf = ShardedReplayBuffer.local(2, N, FIELDS, buffer_kwargs={"alpha": 0.6}, seed=0)
    buf.add(_batch(rng, 40))
    batch = buf.sample(16)
    buf.update_priorities(batch.indices, rng.standard_normal(16), keys=batch.keys)
    buf.sample(16)


def _tiers(rng: np.random.Generator) -> None:
    from .tiers import TieredStorage, available_codecs

    fields = {"obs": ((4, 8, 8), np.uint8), "action": ((), np.int64)}
    # lz4 has kernels of its own (extra `tiers`); zlib is always there, and says nothing
    codec = "lz4" if "lz4" in available_codecs() else "zlib"
    with tempfile.TemporaryDirectory() as tmp:
        storage = TieredStorage(
            fields, 256, chunk_size=16, hot_bytes=4096, warm_bytes=8192, cold_dir=tmp,
            codec=codec, prefetch=False,
        )  # fmt: skip
        buf = PrioritizedReplayBuffer(256, fields, alpha=0.6, storage=storage, seed=0)
        for _ in range(4):
            buf.add({"obs": rng.integers(0, 256, (64, 4, 8, 8), dtype=np.uint8),
                     "action": np.zeros(64, np.int64)})  # fmt: skip
            batch = buf.sample(32)
            buf.update_priorities(batch.indices, rng.random(32) * 10, keys=batch.keys)
        storage.close()


DESCRIPTION = (
    "Compile fastper's numba kernels (every buffer kind, n-step, frames, checkpoints, "
    "sharded and tiered storage) into the on-disk cache, so that later processes load "
    "them instead of compiling them: run it once per machine, e.g. in a Dockerfile or a "
    "CI job. Prints what it compiled and where it saved it (--json: as JSON). Takes about "
    "a minute with an empty cache, a few seconds with a full one."
)

#: the parts of :func:`warmup`, in order
PARTS: dict[str, Callable[[np.random.Generator], None]] = {
    "buffers": _buffers,
    "n-step and frames": _nstep_and_frames,
    "dopamine": _dopamine,
    "sharded": _sharded,
    "tiers": _tiers,
}


def warmup(progress: Callable[[str], None] | None = None) -> WarmupReport:
    """Compile (or load) every kernel the buffers use; see the module. O(1) work:
    the buffers are tiny; the time is numba compiling what the cache lacks.

    Args:
        progress: called with one line per part done (e.g. ``print``).
    """
    dirs = cache_dirs()
    before = _counts()
    rng = np.random.default_rng(0)
    skipped: list[str] = []
    t0 = time.perf_counter()
    for name, part in PARTS.items():
        t = time.perf_counter()
        try:
            part(rng)
        except ImportError as exc:  # an extra this part needs is not installed
            skipped.append(f"{name} ({exc})")
            continue
        if progress is not None:
            progress(f"  {name}: {time.perf_counter() - t:.1f} s")
    seconds = time.perf_counter() - t0
    after = _counts()
    return WarmupReport(
        compiled=after[0] - before[0],
        loaded=after[1] - before[1],
        seconds=seconds,
        cache_dir=None if dirs.first is None else str(dirs.first),
        writable=dirs.writable,
        skipped=tuple(skipped),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastper.warmup [--quiet] [--json]``; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="python -m fastper.warmup", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fastper warmup``."""
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run :func:`warmup` and print its report as ``args`` say."""
    quiet = args.quiet or args.json
    if not quiet:
        print("fastper warmup: compiling the kernels the cache lacks ...", flush=True)
    report = warmup(progress=None if quiet else lambda line: print(line, flush=True))
    if args.json:
        print(json.dumps(asdict(report)))
    elif not quiet:
        where = report.cache_dir if report.writable else "nowhere (no writable cache directory)"
        print(
            f"{report.compiled} kernel signatures compiled, {report.loaded} loaded from the "
            f"cache, in {report.seconds:.1f} s; saved to {where}"
        )
        for line in report.skipped:
            print(f"  not warmed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
