"""One env step into a replay buffer: fastper beside SB3's own ``ReplayBuffer.add``.

    python benchmarks/single_add.py [--rounds 7] [--calls 2000] [--out benchmarks/results/single_add.md]

What most training loops pay most often: SB3, CleanRL and most actor loops
add one env step at a time. Times, in one process and in interleaved rounds
(this shared machine's speed drifts within minutes), the same CartPole-like
step (obs float32[4], a discrete action, a float reward, a done flag):

- SB3's ``ReplayBuffer.add`` (uniform, the reference),
- fastper's ``PrioritizedReplayBuffer.add`` with the row as numpy values and
  as the Python numbers an env loop has,
- fastper's SB3 drop-in (``fastper.compat.sb3.PrioritizedReplayBuffer``,
  the same call as SB3's),
- the same with a 4-env vector step (SB3's buffer with ``n_envs=4``),
- a 256-row batch add of the core API, so that a faster single add is seen
  not to slow batch adds.

Each figure is the median over rounds of the mean per call of a round.
Needs the ``sb3`` extra.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

CAPACITY = 2**16


def _per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def cases() -> dict[str, tuple[Callable[[], object], str]]:
    """name -> (one call, the reference it is compared with)."""
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    import fastper
    from fastper.compat.sb3 import PrioritizedReplayBuffer as DropIn

    rng = np.random.default_rng(0)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    fields = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "next_obs": ((4,), np.float32), "done": ((), np.float32)}  # fmt: skip
    out: dict[str, tuple[Callable[[], object], str]] = {}
    for n_envs in (1, 4):
        sb3 = SB3Buffer(CAPACITY, obs_space, act_space, device="cpu", n_envs=n_envs)
        drop = DropIn(CAPACITY, obs_space, act_space, device="cpu", n_envs=n_envs, seed=0)
        o = rng.standard_normal((n_envs, 4)).astype(np.float32)
        a = rng.integers(0, 2, n_envs)  # Discrete actions as SB3's DQN passes them
        r = rng.standard_normal(n_envs).astype(np.float32)
        d = np.zeros(n_envs, dtype=bool)
        # (as SB3's VecEnvs give them: every info names the time-limit flag)
        infos: list[dict[str, object]] = [{"TimeLimit.truncated": False} for _ in range(n_envs)]
        ref = f"SB3 ReplayBuffer.add, n_envs={n_envs}"
        out[ref] = ((lambda b=sb3, o=o, a=a, r=r, d=d, i=infos: b.add(o, o, a, r, d, i)), ref)
        out[f"fastper SB3 drop-in add, n_envs={n_envs}"] = (
            (lambda b=drop, o=o, a=a, r=r, d=d, i=infos: b.add(o, o, a, r, d, i)), ref
        )
    core = fastper.PrioritizedReplayBuffer(CAPACITY, fields, seed=0)
    o = rng.standard_normal(4).astype(np.float32)
    numpy_row = {"obs": o, "action": np.int64(1), "reward": np.float32(0.5), "next_obs": o,
                 "done": np.float32(0.0)}  # fmt: skip
    python_row = {"obs": o, "action": 1, "reward": 0.5, "next_obs": o, "done": False}
    ref1 = "SB3 ReplayBuffer.add, n_envs=1"
    out["fastper add, one row of numpy values"] = ((lambda: core.add(numpy_row)), ref1)
    out["fastper add, one row of Python numbers"] = ((lambda: core.add(python_row)), ref1)
    vec = {"obs": rng.standard_normal((4, 4)).astype(np.float32), "action": np.ones(4, np.int64),
           "reward": np.zeros(4, np.float32), "next_obs": rng.standard_normal((4, 4)).astype(np.float32),
           "done": np.zeros(4, np.float32)}  # fmt: skip
    out["fastper add, 4-env vector step"] = ((lambda: core.add(vec)), "SB3 ReplayBuffer.add, n_envs=4")
    big = {k: np.repeat(v[:1], 256, axis=0) for k, v in vec.items()}
    out["fastper add, 256-row batch (per row)"] = ((lambda: core.add(big)), "")
    return out


def run(rounds: int, calls: int) -> dict[str, list[float]]:
    table = cases()
    times: dict[str, list[float]] = {name: [] for name in table}
    for fn, _ in table.values():  # warm up (compiles the kernels)
        _per_call(fn, 50)
    for _ in range(rounds):
        for name, (fn, _) in table.items():
            n = calls // 64 if "256-row" in name else calls
            per = _per_call(fn, n)
            times[name].append(per / 256 if "256-row" in name else per)
    return times


def report(times: dict[str, list[float]], rounds: int, calls: int) -> str:
    import fastper
    from fastper._bench import cpu_name

    refs = {name: ref for name, (_, ref) in cases().items()}
    med = {name: float(np.median(v)) for name, v in times.items()}
    lines = [
        "# One env step into a replay buffer",
        "",
        f"`python benchmarks/single_add.py` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"fastper {fastper.__version__}, python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores ({cpu_name()}). Median over {rounds} interleaved rounds of the mean of "
        f"{calls} calls (a capacity of {CAPACITY}); spread = min - max over rounds; ratio = "
        "the median over rounds of the round's ratio to its reference (range in brackets).",
        "",
        "| add | us/call | spread | reference | ratio to reference (rounds) |",
        "|---|---:|---|---|---:|",
    ]
    for name, v in times.items():
        ref = refs[name]
        ratio = "-"
        if ref and ref != name:  # each round's pair was timed back to back: the ratio per round
            per_round = np.asarray(v) / np.asarray(times[ref])
            ratio = f"{np.median(per_round):.2f}x ({per_round.min():.2f} - {per_round.max():.2f})"
        lines.append(
            f"| {name} | {med[name]:.2f} | {min(v):.2f} - {max(v):.2f} | {ref if ref != name else '-'} "
            f"| {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    text = report(run(args.rounds, args.calls), args.rounds, args.calls)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
