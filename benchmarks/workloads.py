"""The loops real runs have, each timed beside its reference in the same process.

    python benchmarks/workloads.py [--capacities 1048576 4194304] [--out benchmarks/results/workloads.md]

Rows (with their target ratios, `fastper._bench.TARGETS`), full and half full:
a linear alpha schedule vs a constant alpha (<= 1.1x), rank-based and uniform
replay vs proportional with one add, one sample and one update per step (rank
<= 1.5x), and the same step with `weight_norm="batch"` (no min tree: <= 1.0x)
and with `max_priority="current"` (a max tree: <= 1.2x) vs the defaults; then
an n-step add of one transition vs a plain one and a 4-env
vector step vs a plain 4-row batch (<= 1.5x). Each pair runs in interleaved
rounds (median of the rounds' medians, and the range of the rounds' ratios):
this shared 2-core machine's speed drifts by up to 2x within minutes.
Each capacity runs in its own process. `fastper bench --workloads` prints one
capacity's table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np


def one(capacity: int, batch: int, rounds: int, calls: int) -> str:
    from fastper import _bench

    pairs = _bench.run_workloads(capacity, batch, rounds=rounds, calls=calls)
    return _bench.format_workloads(pairs, capacity, batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacities", type=int, nargs="+", default=[2**20, 2**22])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--single", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single is not None:
        print(one(args.single, args.batch_size, args.rounds, args.calls))
        return 0
    parts = []
    for cap in args.capacities:
        cmd = [sys.executable, __file__, "--single", str(cap), "--batch-size",
               str(args.batch_size), "--rounds", str(args.rounds), "--calls", str(args.calls)]  # fmt: skip
        parts.append(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    import fastper
    from fastper._bench import cpu_name

    head = (
        f"# Workloads\n\n`python benchmarks/workloads.py` on {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"fastper {fastper.__version__}, python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores ({cpu_name()}). Medians of {args.rounds} interleaved rounds of {args.calls} calls "
        "(n-step rows: 5x the calls); ratio = workload / reference.\n"
    )
    text = head + "\n" + "\n\n".join(p.strip() for p in parts) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
