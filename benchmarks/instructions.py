"""Instructions per call of the hot operations, for two versions of the package.

    python benchmarks/instructions.py [--base HEAD] [--calls 200] [--out FILE]

Time on a shared machine drifts by more than a small change gains; the
number of instructions a call executes does not. This runs one worker
process per version (the working tree's `src/` and `--base`'s, from `git
archive`) under valgrind's callgrind, which counts every instruction the
process executes. Each operation runs inside a ctypes callback, and callgrind
counts only inside callbacks (`--toggle-collect`) and writes one count per
callback (`--dump-after`; the last ones are the operations'): each operation is timed with ``calls`` and with
``2 * calls`` calls, and the difference over ``calls`` is its instructions
per call, without the set-up. Numba's kernels are compiled into a cache by a
first run of the worker outside valgrind, so the counted run only loads them;
both compile for one named CPU and its features (``NUMBA_CPU_NAME=haswell``:
AVX2, which valgrind runs), since numba would take valgrind's virtual CPU for
another machine and compile again, under valgrind, for many minutes.

Instructions are not time: a cache miss costs hundreds of cycles and one
instruction. Read these figures beside the timed benchmarks (`layout.py`,
`peers.py`), not instead of them. Needs valgrind; takes a few minutes.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from before_after import _archive  # noqa: E402  (the other revision's src/, unpacked)

CAPACITY = 2**16
B = 256


def _room(rows: int) -> int:
    """The smallest power of two that holds ``rows``."""
    return 1 << max(rows - 1, 1).bit_length()


def _operations(calls: int) -> dict[str, Callable[[], object]]:
    """The operations, each a call on its own buffer built here (a fixed seed), for a
    worker that calls each ``7 * calls`` times."""
    import numpy as np

    import fastper

    fields = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
              "next_obs": ((4,), np.float32), "done": ((), np.float32)}  # fmt: skip
    rng = np.random.default_rng(0)

    def rows(k: int) -> dict[str, np.ndarray]:
        return {"obs": rng.standard_normal((k, 4)).astype(np.float32),
                "action": rng.integers(0, 2, k), "reward": rng.standard_normal(k).astype(np.float32),
                "next_obs": rng.standard_normal((k, 4)).astype(np.float32),
                "done": (rng.random(k) < 0.05).astype(np.float32)}  # fmt: skip

    def full() -> fastper.PrioritizedReplayBuffer:
        buf = fastper.PrioritizedReplayBuffer(CAPACITY, fields, seed=0)
        buf.add(rows(CAPACITY))
        buf.update_priorities(np.arange(CAPACITY), np.abs(rng.standard_normal(CAPACITY)) + 0.01)
        return buf

    learner, sampler, updater = full(), full(), full()
    batch = updater.sample(B)
    tds = np.abs(rng.standard_normal(B))
    idx = rng.integers(0, CAPACITY, B)
    storage = sampler._storage  # the RAM storage of a default buffer
    # one env step as an env loop has it: float32 observations, Python numbers
    one = {"obs": np.array([0.1, -0.2, 0.3, 0.0], np.float32), "action": 1, "reward": 1.0,
           "next_obs": np.array([0.2, -0.1, 0.3, 0.1], np.float32), "done": 0.0}  # fmt: skip
    # room for every add the worker makes (7 * calls of each: warm-ups, then the
    # two counted loops): no batch wraps round the ring
    adder = fastper.PrioritizedReplayBuffer(_room(7 * calls * (1 + 256 + 1024)), fields, seed=0)
    r256, r1024 = rows(256), rows(1024)
    flagged = {**{k: v for k, v in fields.items() if k != "done"},
               "terminated": ((), np.bool_), "truncated": ((), np.bool_)}  # fmt: skip
    nstep = fastper.PrioritizedReplayBuffer(CAPACITY, flagged, n_step=3, gamma=0.99, seed=0)
    step = {**{k: v for k, v in one.items() if k != "done"},
            "terminated": np.False_, "truncated": np.False_}  # fmt: skip
    # a 4-env vector step, n-step and plain (the same fields: the n-step reference)
    vec = fastper.PrioritizedReplayBuffer(CAPACITY, flagged, n_step=3, gamma=0.99, n_envs=4,
                                          seed=0)  # fmt: skip
    plain, plain_one = (fastper.PrioritizedReplayBuffer(CAPACITY, flagged, seed=0) for _ in "ab")
    r4 = {**{k: v for k, v in rows(4).items() if k != "done"},
          "terminated": np.zeros(4, bool), "truncated": np.zeros(4, bool)}  # fmt: skip

    def learner_step() -> None:
        s = learner.sample(B)
        learner.update_priorities(s, tds)

    # an actor-learner step (one add, then sample and update) on a rank-based buffer and
    # on a proportional one (its reference)
    rank = fastper.RankBasedReplayBuffer(CAPACITY, fields, seed=0)
    rank.add(rows(CAPACITY))
    rank.update_priorities(np.arange(CAPACITY), np.abs(rng.standard_normal(CAPACITY)) + 0.01)
    actor_prop = full()

    def actor_step(buf: Any) -> Callable[[], None]:
        def step() -> None:
            buf.add(one)
            s = buf.sample(B)
            buf.update_priorities(s, tds)

        return step

    return {
        "add, one transition": lambda: adder.add(one),
        "add, 256 rows": lambda: adder.add(r256),
        "add, 1024 rows": lambda: adder.add(r1024),
        "n-step add (n=3), one transition": lambda: nstep.add(step),
        "add, one transition (the n-step fields)": lambda: plain_one.add(step),
        "n-step add (n=3), 4-env vector step": lambda: vec.add(r4),
        "add, 4 rows (the n-step fields)": lambda: plain.add(r4),
        **_sb3_adds(),
        f"gather of {B} rows (Storage.gather)": lambda: storage.gather(idx),
        f"sample({B})": lambda: sampler.sample(B),
        f"update_priorities({B})": lambda: updater.update_priorities(batch, tds),
        f"learner step (sample({B}) + update)": learner_step,
        f"rank-based step (add + sample({B}) + update)": actor_step(rank),
        f"proportional step (add + sample({B}) + update; the reference)": actor_step(actor_prop),
    }


def _sb3_adds() -> dict[str, Callable[[], object]]:
    """One env step through fastper's SB3 drop-in and, as the reference, through SB3's
    own ``ReplayBuffer.add`` (the same in both columns), for 1 and 4 envs; none
    without SB3 (the ``sb3`` extra)."""
    try:
        import gymnasium as gym
        from stable_baselines3.common.buffers import ReplayBuffer
    except ImportError:
        return {}
    import numpy as np

    from fastper.compat.sb3 import PrioritizedReplayBuffer as DropIn

    rng = np.random.default_rng(1)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    out: dict[str, Callable[[], object]] = {}
    for n_envs in (1, 4):
        obs = rng.standard_normal((n_envs, 4)).astype(np.float32)
        nxt = rng.standard_normal((n_envs, 4)).astype(np.float32)
        act = rng.integers(0, 2, n_envs)  # Discrete actions as SB3's DQN passes them
        rew = rng.standard_normal(n_envs).astype(np.float32)
        done = np.zeros(n_envs, dtype=bool)
        # (as SB3's VecEnvs give them: every info names the time-limit flag)
        infos: list[dict[str, object]] = [{"TimeLimit.truncated": False} for _ in range(n_envs)]
        step = (obs, nxt, act, rew, done, infos)
        drop = DropIn(CAPACITY, obs_space, act_space, device="cpu", n_envs=n_envs, seed=0)
        sb3 = ReplayBuffer(CAPACITY, obs_space, act_space, device="cpu", n_envs=n_envs)
        envs = "one env" if n_envs == 1 else f"{n_envs} envs"
        out[f"SB3 drop-in add, {envs}"] = _adding(drop, step)
        out[f"SB3's own ReplayBuffer.add, {envs} (the reference)"] = _adding(sb3, step)
    return out


def _adding(buffer: Any, step: tuple[Any, ...]) -> Callable[[], object]:
    """A call of ``buffer.add(*step)``."""
    return lambda: buffer.add(*step)


def worker(calls: int) -> None:
    """Run every operation ``calls`` and ``2 * calls`` times, each in a ctypes callback."""
    ops = _operations(calls)
    for fn in ops.values():  # every lazy load and set-up (numba's cache) outside the count:
        for _ in range(3 * calls):  # a kernel loaded inside a callback would be counted
            fn()  # there, and llvmlite's own callbacks would toggle the count
    callback = ctypes.CFUNCTYPE(None)
    keep = []
    # no cyclic collection inside a count: one would land in a loop at random (its
    # cost grows with the heap, not with the operation)
    gc.collect()
    gc.disable()
    for fn in ops.values():
        # warmed again right before its count: the interpreter's specialised code,
        # tuned to the operation run before, takes hundreds of calls to settle, and
        # the first count would carry them
        for _ in range(calls):
            fn()
        for n in (calls, 2 * calls):

            def loop(fn: Callable[[], object] = fn, n: int = n) -> None:
                for _ in range(n):
                    fn()

            keep.append(callback(loop))
            keep[-1]()
    gc.enable()
    print("\n".join(ops))


# the features of the named CPU, given too: numba otherwise reads the machine's, and
# valgrind's differ from the host's (a cache miss again)
_HASWELL = ",".join(
    "+" + f for f in (
        "64bit avx avx2 bmi bmi2 cmov cx16 cx8 f16c fma fsgsbase fxsr lzcnt mmx movbe pclmul "
        "popcnt sahf sse sse2 sse3 sse4.1 sse4.2 ssse3 xsave"
    ).split()
)  # fmt: skip


def _count(src: Path, calls: int, tmp: Path, side: str) -> dict[str, float]:
    # kernels compiled for one named CPU (AVX2, which valgrind runs), so that the
    # cache filled by the first run is the one the counted run loads: with the
    # host's own CPU, valgrind's (another CPU to numba) would compile every kernel
    # again under valgrind, for many minutes
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(tmp / f"numba-{side}"),
           "PYTHONHASHSEED": "0", "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": _HASWELL}  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(calls)]
    subprocess.run([*cmd[:-1], "2"], check=True, capture_output=True, env=env)  # fill the cache
    out = tmp / f"callgrind-{side}"
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no",
         "--toggle-collect=_CallPythonObject", "--dump-after=_CallPythonObject",
         f"--callgrind-out-file={out}", *cmd],
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    names = [n for n in run.stdout.splitlines() if n]
    # one count per callback, in order: the last ones are the counted loops (the
    # earlier ones are callbacks of the imports: numba's cache, ...)
    dumps = sorted(tmp.glob(f"callgrind-{side}.*"), key=lambda f: int(f.suffix[1:]))
    if len(dumps) < 2 * len(names):
        raise RuntimeError(f"callgrind wrote {len(dumps)} counts for {2 * len(names)} loops")
    totals = []
    for dump in dumps[-2 * len(names) :]:
        text = dump.read_text()
        totals.append(int(re.search(r"^summary: (\d+)", text, re.M).group(1)))  # type: ignore[union-attr]
    per_call = {
        name: (totals[2 * j + 1] - totals[2 * j]) / calls for j, name in enumerate(names)
    }
    # a callback run inside a loop would shift the counts: each pair must be about
    # n and 2n calls (the set-up of a loop is small beside n calls)
    ratios = [totals[2 * j + 1] / max(totals[2 * j], 1) for j in range(len(names))]
    if not all(1.8 < r < 2.05 for r in ratios):
        raise RuntimeError(f"counts out of step with the loops (2n / n: {ratios})")
    return per_call


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--calls", type=int, default=200, help="calls counted per operation")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = _count(_archive(args.base, Path(tmp)), args.calls, Path(tmp), "base")
        new = _count(ROOT / "src", args.calls, Path(tmp), "new")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Instructions per call (callgrind), two versions",
        "",
        f"`python benchmarks/instructions.py --base {args.base}` on {now}, python "
        f"{platform.python_version()}: base = {rev}, new = the working tree. CartPole-like "
        f"48-byte rows, proportional, capacity {CAPACITY}; instructions per call over "
        f"{args.calls} calls (set-up excluded). Not time: a cache miss is one instruction.",
        "",
        "| operation | base | new | new / base |",
        "|---|---:|---:|---:|",
    ]
    for name, b in base.items():
        n = new.get(name)
        if n is not None:
            lines.append(f"| {name} | {b:,.0f} | {n:,.0f} | {n / b:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
