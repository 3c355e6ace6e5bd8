"""What releasing the GIL in the compiled kernels buys a learner thread next to actor threads.

Usage:
    python benchmarks/gil.py [--capacity 1048576] [--batch-size 256] [--actors 2]
                             [--env-steps 16] [--seconds 3] [--repeats 3]

Set-up: a proportional buffer of ``--capacity`` CartPole-like transitions.
A *learner* thread loops ``sample(B)`` + ``update_priorities``. Each *actor*
thread loops: ``--env-steps`` steps of a pure-Python CartPole (holding the
GIL, as gym's CartPole does), then ``add`` of those transitions as one batch.

Every public buffer method holds the buffer's lock, so two buffer calls never
overlap whatever the GIL does. What the GIL release can overlap is a kernel
(inside the lock, GIL released) with *other* Python work, here the actors'
environment steps. The script measures, each for ``--seconds`` and
``--repeats`` times (medians reported):

* ``learner alone`` and ``actors alone``: throughput with the machine to itself;
* ``serialized``: one thread doing both kinds of work in turn, in the ratio
  the concurrent run reached (what running them without threads would give);
* ``threads, nogil kernels`` (as shipped) and ``threads, GIL-holding kernels``
  (the same kernels recompiled with ``nogil=False`` and swapped in).

``combined`` is learner/learner_alone + actors/actors_alone: the fraction of
one thread's solo throughput done per second, summed; 1.0 is what perfect
time-slicing of one core gives, above 1 means the two kinds of work ran in
parallel.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numba
import numpy as np

import fastper
from fastper._bench import FIELDS  # the CartPole-like workload of `fastper bench`
from fastper._kernels import prioritized as _tk

#: the kernels a learner step and an add run, in their module
KERNELS = ("prop_sample", "prop_update", "prop_write", "prop_write_run", "slot_keys")


def cartpole_step(s: tuple[float, float, float, float], action: int):
    """gym's CartPole-v1 dynamics, in plain Python."""
    x, x_dot, theta, theta_dot = s
    force = 10.0 if action else -10.0
    c, si = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot * theta_dot * si) / 1.1
    theta_acc = (9.8 * si - c * temp) / (0.5 * (4.0 / 3.0 - 0.1 * c * c / 1.1))
    x_acc = temp - 0.05 * theta_acc * c / 1.1
    nxt = (x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
           theta_dot + 0.02 * theta_acc)  # fmt: skip
    done = abs(nxt[0]) > 2.4 or abs(nxt[2]) > 0.2095
    return nxt, done


class Actor:
    def __init__(self, buf, env_steps: int, seed: int) -> None:
        self.buf, self.k = buf, env_steps
        self.rng = np.random.default_rng(seed)
        self.state = (0.0, 0.0, 0.01, 0.0)
        self.obs = np.empty((env_steps, 4), dtype=np.float32)
        self.nxt = np.empty((env_steps, 4), dtype=np.float32)
        self.act = np.empty(env_steps, dtype=np.int64)
        self.done = np.empty(env_steps, dtype=np.float32)
        self.rew = np.ones(env_steps, dtype=np.float32)

    def work(self) -> None:
        actions = self.rng.integers(0, 2, self.k).tolist()
        s = self.state
        for j, a in enumerate(actions):
            nxt, done = cartpole_step(s, a)
            self.obs[j], self.nxt[j], self.act[j], self.done[j] = s, nxt, a, done
            s = (0.0, 0.0, 0.01, 0.0) if done else nxt
        self.state = s
        self.buf.add({"obs": self.obs, "action": self.act, "reward": self.rew,
                      "next_obs": self.nxt, "done": self.done})  # fmt: skip


class Learner:
    def __init__(self, buf, batch_size: int, seed: int) -> None:
        self.buf, self.b = buf, batch_size
        self.td = np.random.default_rng(seed).standard_normal((64, batch_size))
        self.i = 0

    def work(self) -> None:
        s = self.buf.sample(self.b)
        self.buf.update_priorities(s.indices, self.td[self.i % 64], keys=s.keys)
        self.i += 1


def run_threads(workers: list[Callable[[], None]], seconds: float) -> list[int]:
    """Run each worker in its own thread for ``seconds``; calls done by each."""
    stop = threading.Event()
    counts = [0] * len(workers)
    start = threading.Barrier(len(workers) + 1)

    def loop(i: int, fn: Callable[[], None]) -> None:
        start.wait()
        n = 0
        while not stop.is_set():
            fn()
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return counts


def serialized(learner: Learner, actors: list[Actor], ratio: float, seconds: float):
    """One thread: ``ratio`` actor calls per learner step, in turn. Returns (steps/s, adds/s)."""
    owed = 0.0
    n_l = n_a = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        learner.work()
        n_l += 1
        owed += ratio
        while owed >= 1.0:
            actors[n_a % len(actors)].work()
            n_a += 1
            owed -= 1.0
    dt = time.perf_counter() - t0
    return n_l / dt, n_a / dt


def gil_holding_kernels() -> dict[str, object]:
    """The same kernels compiled with nogil=False (so they hold the GIL throughout)."""
    return {
        name: numba.njit(nogil=False, cache=False)(getattr(_tk, name).py_func) for name in KERNELS
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=2**20)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--env-steps", type=int, default=16, help="env steps per add (batch size)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    buf = fastper.PrioritizedReplayBuffer(args.capacity, FIELDS, seed=0)
    rng = np.random.default_rng(0)
    for lo in range(0, args.capacity, 2**16):
        k = min(2**16, args.capacity - lo)
        obs = rng.standard_normal((k, 4)).astype(np.float32)
        buf.add({"obs": obs, "action": rng.integers(0, 2, k), "reward": np.ones(k),
                 "next_obs": obs, "done": np.zeros(k)}, priorities=rng.random(k) + 0.1)  # fmt: skip
    learner = Learner(buf, args.batch_size, 1)
    actors = [Actor(buf, args.env_steps, 10 + i) for i in range(args.actors)]
    for _ in range(50):  # warm up every path
        learner.work()
        for a in actors:
            a.work()

    shipped = {name: getattr(_tk, name) for name in KERNELS}
    t0 = time.perf_counter()
    holding = gil_holding_kernels()
    for name, k in holding.items():  # compile now, outside the timings
        setattr(_tk, name, k)
    learner.work()
    actors[0].work()
    for name, k in shipped.items():
        setattr(_tk, name, k)
    print(f"compiled GIL-holding kernels in {time.perf_counter() - t0:.1f} s", flush=True)

    rows: dict[str, list[tuple[float, float]]] = {}

    def record(name: str, steps: float, adds: float) -> None:
        rows.setdefault(name, []).append((steps, adds))

    T = args.seconds
    for rep in range(args.repeats):
        (n,) = run_threads([learner.work], T)
        record("learner alone", n / T, 0.0)
        counts = run_threads([a.work for a in actors], T)
        record("actors alone", 0.0, sum(counts) * args.env_steps / T)
        for label, kernels in (("threads, nogil kernels", shipped),
                               ("threads, GIL-holding kernels", holding)):  # fmt: skip
            for name, k in kernels.items():
                setattr(_tk, name, k)
            counts = run_threads([learner.work] + [a.work for a in actors], T)
            record(label, counts[0] / T, sum(counts[1:]) * args.env_steps / T)
            if label.startswith("threads, nogil"):
                ratio = sum(counts[1:]) / max(counts[0], 1)
        for name, k in shipped.items():
            setattr(_tk, name, k)
        s, a = serialized(learner, actors, ratio, T)
        record("serialized (one thread)", s, a * args.env_steps)
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)

    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in rows.items()}  # fmt: skip
    l0 = med["learner alone"][0]
    a0 = med["actors alone"][1]
    print(
        f"\nN={args.capacity}, B={args.batch_size}, {args.actors} actors x {args.env_steps} "
        f"CartPole steps per add, {T:g} s x {args.repeats} (medians); "
        f"python {sys.version.split()[0]}, numba {numba.__version__}\n"
    )
    print("| run | learner steps/s | transitions added/s | combined |\n|---|---:|---:|---:|")
    for name, (s, a) in med.items():
        comb = s / l0 + a / a0
        print(f"| {name} | {s:,.0f} | {a:,.0f} | {comb:.2f} |")
    base = med["threads, GIL-holding kernels"]
    ours = med["threads, nogil kernels"]
    print(
        f"\nreleasing the GIL: learner x{ours[0] / base[0]:.2f}, actors x{ours[1] / base[1]:.2f}, "
        f"combined {base[0] / l0 + base[1] / a0:.2f} -> {ours[0] / l0 + ours[1] / a0:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
