"""What an n-step add costs next to a plain add.

Usage:
    python benchmarks/nstep.py [--n 3] [--calls 20000] [--envs 4]

CartPole-like fields with ``terminated`` and ``truncated``; rows cycle through
a prepared trajectory with an episode end about every 100 steps (so flushes
are in the mix). The cases take turns call by call (so a busy machine slows
them alike), and each figure is the median per-call time in microseconds:

* ``storage``: ``Storage.prepare`` + its write (validate, cast, copy into the
  columns): what a plain add does besides the trees;
* ``writer``: ``NStepWriter.prepare`` + ``commit`` on an already validated
  batch: the n-step writer's own cost;
* ``n-step path``: ``coerce_batch`` + writer + the storage write of the
  completed transitions: ``storage`` plus what n-step adds;
* ``buffer``: ``PrioritizedReplayBuffer.add``, plain vs n-step (``env_ids=0``
  for one row, ``n_envs`` for the vector step); skipped, with a note, by a
  buffer that does not take them.

Each for one row (one env) and for one step of a ``--envs`` vector env
(``--envs`` rows, ``--envs`` streams).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastper import PrioritizedReplayBuffer
from fastper._bench import NSTEP_FIELDS
from fastper.nstep import NStepWriter
from fastper.storage import Storage, coerce_batch, make_fields

FIELDS = NSTEP_FIELDS  # CartPole-like, with both episode-end flags
CAPACITY = 1 << 16


def trajectory(length: int, n_envs: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``length`` steps of ``n_envs`` envs; a step is one row per env (no batch dim if 1)."""
    rng = np.random.default_rng(seed)
    u = rng.random((length, n_envs))
    steps = []
    for t in range(length):
        step = {
            "obs": rng.normal(size=(n_envs, 4)).astype(np.float32),
            "action": rng.integers(0, 2, size=n_envs).astype(np.int64),
            "reward": np.ones(n_envs, dtype=np.float32),
            "next_obs": rng.normal(size=(n_envs, 4)).astype(np.float32),
            "terminated": u[t] < 0.005,
            "truncated": (u[t] >= 0.005) & (u[t] < 0.01),
        }
        steps.append({k: v[0] for k, v in step.items()} if n_envs == 1 else step)
    return steps


def storage_write(storage: Storage) -> Callable[[dict[str, np.ndarray], int], None]:
    """The storage's write call, whichever protocol this checkout has."""
    if hasattr(storage, "commit"):
        return lambda prepared, k: storage.commit(prepared, k)  # type: ignore[attr-defined]
    cursor = [0]

    def write(prepared: dict[str, np.ndarray], k: int) -> None:
        start = cursor[0]
        if start + k > storage.capacity:
            start = 0
        storage.write(start, prepared, k)  # type: ignore[attr-defined]
        cursor[0] = start + k

    return write


def cases(n: int, n_envs: int) -> dict[str, Callable[[], object]]:
    fields = make_fields(FIELDS)
    out: dict[str, Callable[[], object]] = {}
    for rows in (1, n_envs):
        steps = trajectory(1000, rows)
        label = "1 row" if rows == 1 else f"{rows}-env step"
        storage = Storage(fields, CAPACITY)
        write = storage_write(storage)
        it = iter(range(1 << 62))

        def plain(steps=steps, storage=storage, write=write, it=it) -> None:
            prepared, k = storage.prepare(steps[next(it) % len(steps)])
            write(prepared, k)

        kw: dict[str, Any] = {} if rows == 1 else {"n_envs": rows}
        writer = NStepWriter(fields, n, 0.99, **kw)
        batches = [coerce_batch(fields, s, None) for s in steps]
        it2 = iter(range(1 << 62))

        def own(writer=writer, batches=batches, it=it2) -> None:
            batch, k = batches[next(it) % len(batches)]
            writer.commit(writer.prepare(batch, k, None))

        writer2 = NStepWriter(fields, n, 0.99, **kw)
        storage2 = Storage(writer2.output_fields, CAPACITY)
        write2 = storage_write(storage2)
        it3 = iter(range(1 << 62))

        def path(writer=writer2, write=write2, steps=steps, it=it3) -> None:
            batch, k = coerce_batch(writer.fields, steps[next(it) % len(steps)], None)
            plan = writer.prepare(batch, k, None)
            if plan.count:
                write(plan.out, plan.count)
            writer.commit(plan)

        out[f"storage, {label}"] = plain
        out[f"writer, {label}"] = own
        out[f"n-step path, {label}"] = path
        buffers = buffer_cases(n, rows, steps)
        for name, fn in buffers.items():
            out[f"{name}, {label}"] = fn
    return out


def buffer_cases(n: int, rows: int, steps: list[dict[str, np.ndarray]]) -> dict[str, Callable]:
    plain = PrioritizedReplayBuffer(CAPACITY, FIELDS, seed=0)
    try:
        if rows == 1:
            nstep = PrioritizedReplayBuffer(CAPACITY, FIELDS, n_step=n, gamma=0.99, seed=0)
            nstep.add(steps[0], env_ids=0)
            extra: dict[str, Any] = {"env_ids": 0}
        else:
            nstep = PrioritizedReplayBuffer(
                CAPACITY, FIELDS, n_step=n, gamma=0.99, seed=0, n_envs=rows
            )
            nstep.add(steps[0])
            extra = {}
    except TypeError as exc:  # the buffer does not take streams yet
        print(f"# buffer-level case skipped ({rows} row(s)): {exc}")
        return {}
    it, it2 = iter(range(1 << 62)), iter(range(1 << 62))
    return {
        "buffer plain add": lambda: plain.add(steps[next(it) % len(steps)]),
        "buffer n-step add": lambda: nstep.add(steps[next(it2) % len(steps)], **extra),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    fns = cases(args.n, args.envs)
    for fn in fns.values():  # compile and warm up
        for _ in range(200):
            fn()
    clock = time.perf_counter_ns
    times = np.empty((len(fns), args.calls))
    for i in range(args.calls):
        for j, fn in enumerate(fns.values()):
            t0 = clock()
            fn()
            times[j, i] = clock() - t0
    med = {name: float(np.median(times[j])) / 1e3 for j, name in enumerate(fns)}
    print(f"# n={args.n}, medians of {args.calls} calls per case, taken in turns, us/call")
    print("| case | us/call |")
    print("|---|---:|")
    for name, v in med.items():
        print(f"| {name} | {v:.2f} |")
    for label in ("1 row", f"{args.envs}-env step"):
        s, w, p = (med[f"{c}, {label}"] for c in ("storage", "writer", "n-step path"))
        print(f"{label}: writer / storage = {w / s:.2f}, n-step path / storage = {p / s:.2f}")
        b = f"buffer n-step add, {label}"
        if b in med:
            ratio = med[b] / med[f"buffer plain add, {label}"]
            print(f"{label}: buffer n-step / plain add = {ratio:.2f}")


if __name__ == "__main__":
    main()
