"""Sampling through the SB3 drop-in against SB3's own buffer, in one process.

    python benchmarks/sb3_sample.py [--capacity 1048576] [--rounds 15]
                                    [--out benchmarks/results/sb3_sample.md]

A full buffer of CartPole-like rows (obs float32[4], a Discrete(2) action,
reward, done, timeout), B = 256, tensors on the CPU. Timed in interleaved
rounds of 300 calls each: SB3's uniform ``ReplayBuffer.sample``, fastper's
SB3 drop-in ``PrioritizedReplayBuffer.sample`` alone and followed by its
``update_priorities`` (the PER learner's step), the core buffer's
``sample`` alone and with ``SampleBatch.to_torch()``. Each figure is the
median over rounds of the round's median, in us; the ratio is the median
over rounds of the round's ratio to SB3's sample (its range in brackets).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

B = 256


def _fill_sb3_like(buf: Any, rng: np.random.Generator) -> None:
    """Every row stored through SB3's public arrays (the drop-in admits them on ``full``)."""
    buf.observations[:] = rng.standard_normal(buf.observations.shape).astype(np.float32)
    buf.next_observations[:] = rng.standard_normal(buf.next_observations.shape).astype(np.float32)
    buf.actions[:] = rng.integers(0, 2, buf.actions.shape)
    buf.rewards[:] = rng.standard_normal(buf.rewards.shape).astype(np.float32)
    buf.dones[:] = rng.random(buf.dones.shape) < 0.05
    buf.full = True


def cases(capacity: int) -> dict[str, Callable[[], Any]]:
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer

    import fastper
    from fastper.compat.sb3_buffers import PrioritizedReplayBuffer

    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    rng = np.random.default_rng(0)
    sb3 = SB3ReplayBuffer(capacity, obs_space, act_space, device="cpu")
    drop = PrioritizedReplayBuffer(capacity, obs_space, act_space, device="cpu", seed=0)
    for buf in (sb3, drop):
        _fill_sb3_like(buf, rng)
    drop.update_priorities(np.arange(capacity), np.abs(rng.standard_normal(capacity)))
    fields = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "next_obs": ((4,), np.float32), "done": ((), np.float32)}  # fmt: skip
    core = fastper.PrioritizedReplayBuffer(capacity, fields, seed=0)
    core.add({
        "obs": rng.standard_normal((capacity, 4)).astype(np.float32),
        "action": rng.integers(0, 2, capacity),
        "reward": rng.standard_normal(capacity).astype(np.float32),
        "next_obs": rng.standard_normal((capacity, 4)).astype(np.float32),
        "done": (rng.random(capacity) < 0.05).astype(np.float32),
    })  # fmt: skip
    core.update_priorities(np.arange(capacity), np.abs(rng.standard_normal(capacity)))
    tds = [np.abs(rng.standard_normal(B)) for _ in range(8)]
    step = [0]

    def drop_step() -> None:
        s = drop.sample(B)
        step[0] += 1
        drop.update_priorities(s.indices, tds[step[0] % 8], s.keys)

    return {
        "SB3 ReplayBuffer.sample (uniform, the reference)": lambda: sb3.sample(B),
        "fastper SB3 drop-in sample": lambda: drop.sample(B),
        "fastper SB3 drop-in sample + update_priorities": drop_step,
        "fastper sample (numpy)": lambda: core.sample(B),
        "fastper sample + to_torch()": lambda: core.sample(B).to_torch(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=2**20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import stable_baselines3
    import torch

    import fastper

    warnings.simplefilter("ignore")  # the drop-in's sample alone warns of unchanged priorities
    fns = cases(args.capacity)
    for fn in fns.values():  # warm up: compiled code, caches
        for _ in range(50):
            fn()
    got: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times = []
            for _ in range(300):
                t0 = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - t0)
            got[name].append(float(np.median(times)) / 1e3)
    ref = np.asarray(next(iter(got.values())))
    lines = [
        "# Sampling through the SB3 drop-in against SB3's own buffer",
        "",
        f"`python benchmarks/sb3_sample.py` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"fastper {fastper.__version__}, stable-baselines3 {stable_baselines3.__version__}, "
        f"torch {torch.__version__}, python {platform.python_version()}. "
        f"N = {args.capacity} (full), B = {B}, CartPole-like rows, tensors on the CPU; "
        f"medians of {args.rounds} interleaved rounds of 300 calls; ratio = the round's "
        "time over SB3's sample in the same round, median [range].",
        "",
        "| operation | us/call | ratio to SB3's sample [rounds] |",
        "|---|---:|---|",
    ]
    for name, values in got.items():
        r = np.asarray(values) / ref
        lines.append(
            f"| {name} | {np.median(values):.1f} | "
            f"{np.median(r):.2f}x [{r.min():.2f}, {r.max():.2f}] |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
