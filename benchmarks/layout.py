"""Records against columns: the RAM storage's two layouts, side by side in one process.

    python benchmarks/layout.py [--rounds 9] [--out benchmarks/results/layout.md]

The same proportional buffer (CartPole-like 48-byte rows, B = 256) built on
``Storage(fields, capacity, layout="records")`` and on ``layout="columns"``,
timed in interleaved rounds: the learner step (``sample(256)`` +
``update_priorities``) on a full buffer at several capacities, and adds of
1, 64, 256 and 1024 rows at a time. Then the same rows with a bool ``done``
flag (45 bytes of fields, in a 48-byte record: the default layout takes
records where the padding is at most 1/8 of the record). Each figure is the median over rounds of
the round's median (learner step) or mean (adds) per call; the ratio is the
median over rounds of records / columns in the same round (its range in
brackets): below 1, records are faster.
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

FIELDS = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
          "next_obs": ((4,), np.float32), "done": ((), np.float32)}  # fmt: skip
BOOL_FIELDS = {**FIELDS, "done": ((), np.bool_)}  # 45 bytes: a record pads them to 48
LAYOUTS = ("columns", "records")
B = 256


def _rows(rng: np.random.Generator, k: int, flag: bool = False) -> dict[str, np.ndarray]:
    done = rng.random(k) < 0.05
    return {"obs": rng.standard_normal((k, 4)).astype(np.float32), "action": rng.integers(0, 2, k),
            "reward": rng.standard_normal(k).astype(np.float32),
            "next_obs": rng.standard_normal((k, 4)).astype(np.float32),
            "done": done if flag else done.astype(np.float32)}  # fmt: skip


def _buffer(layout: str, capacity: int, flag: bool = False) -> object:
    import fastper
    from fastper.storage import Storage

    return fastper.PrioritizedReplayBuffer(
        capacity, BOOL_FIELDS if flag else FIELDS, seed=0, storage=lambda f, c: Storage(f, c, layout=layout)
    )


def _pairs(fns: dict[str, Callable[[], float]], rounds: int) -> tuple[dict[str, float], list[float]]:
    """Medians per layout and the rounds' ratios records / columns."""
    got: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(fn())
    ratios = list(np.asarray(got["records"]) / np.asarray(got["columns"]))
    return {name: float(np.median(v)) for name, v in got.items()}, ratios


def learner_steps(
    capacity: int, rounds: int, flag: bool = False
) -> tuple[dict[str, float], list[float]]:
    rng = np.random.default_rng(0)
    data = _rows(rng, capacity, flag)
    tds = [np.abs(rng.standard_normal(B)) for _ in range(8)]
    fns = {}
    for layout in LAYOUTS:
        buf = _buffer(layout, capacity, flag)
        buf.add(data)  # type: ignore[attr-defined]
        buf.update_priorities(np.arange(capacity), np.abs(rng.standard_normal(capacity)) + 0.01)  # type: ignore[attr-defined]

        def one_round(buf: object = buf) -> float:
            times = []
            for i in range(200):
                t0 = time.perf_counter_ns()
                s = buf.sample(B)  # type: ignore[attr-defined]
                buf.update_priorities(s, tds[i % 8])  # type: ignore[attr-defined]
                times.append(time.perf_counter_ns() - t0)
            return float(np.median(times)) / 1e3

        one_round()  # warm up
        fns[layout] = one_round
    return _pairs(fns, rounds)


def adds(k: int, rounds: int, flag: bool = False) -> tuple[dict[str, float], list[float]]:
    rng = np.random.default_rng(1)
    rows = _rows(rng, k, flag)
    row = {name: v[0] for name, v in rows.items()} if k == 1 else rows
    calls = max(20, 40_000 // k)
    fns = {}
    for layout in LAYOUTS:
        buf = _buffer(layout, 2**16, flag)

        def one_round(buf: object = buf) -> float:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                buf.add(row)  # type: ignore[attr-defined]
            return (time.perf_counter_ns() - t0) / calls / 1e3

        one_round()
        fns[layout] = one_round
    return _pairs(fns, rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--capacities", type=int, nargs="+", default=[2**16, 2**18, 2**20, 2**22])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import fastper
    from fastper._bench import cpu_name

    lines = [
        "# Records against columns (the RAM storage's layouts)",
        "",
        f"`python benchmarks/layout.py` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, fastper "
        f"{fastper.__version__}, python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores ({cpu_name()}). CartPole-like 48-byte rows, proportional, B = {B}; "
        f"medians of {args.rounds} interleaved rounds; ratio = records / columns in the same "
        "round, median [range]: below 1, records are faster.",
        "",
        "| operation | columns, us | records, us | ratio [rounds] |",
        "|---|---:|---:|---|",
    ]
    cases: list[tuple[str, Callable[[], tuple[dict[str, float], list[float]]]]] = [
        (f"learner step, N = 2^{c.bit_length() - 1}", lambda c=c: learner_steps(c, args.rounds))
        for c in args.capacities
    ]
    cases += [
        (f"add of {k} row{'s' if k > 1 else ''} (per call)", lambda k=k: adds(k, args.rounds))
        for k in (1, 64, 256, 1024)
    ]
    cases += [
        (f"bool flag: learner step, N = 2^{c.bit_length() - 1}",
         lambda c=c: learner_steps(c, args.rounds, True))
        for c in args.capacities if c >= 2**20
    ]  # fmt: skip
    cases += [
        (f"bool flag: add of {k} row{'s' if k > 1 else ''} (per call)",
         lambda k=k: adds(k, args.rounds, True))
        for k in (1, 64, 256, 1024)
    ]  # fmt: skip
    for name, run in cases:
        med, ratios = run()
        line = (
            f"| {name} | {med['columns']:.2f} | {med['records']:.2f} | "
            f"{np.median(ratios):.3f} [{min(ratios):.2f}, {max(ratios):.2f}] |"
        )
        print(line, flush=True)
        lines.append(line)
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
