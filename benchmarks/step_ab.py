"""The learner step of two versions of the package, A/B, at small and large batches.

    python benchmarks/step_ab.py --base REV [--capacities 1048576 4194304] [--rounds 7]
                                 [--out benchmarks/results/step_before_after.md]

`benchmarks/before_after.py` compares `fastper bench` (B = 256, 2^18 slots);
this compares what a learner pays per step where the fixed cost of a call
matters: `sample(B)`, `update_priorities` (on a fresh sample's indices and
keys) and the two together, at B = 32 and B = 256, with the buffer's
defaults, and the step with `weight_norm="batch"` and with
`max_priority="current"` (B = 256). The base is `git archive REV src`; each
side runs in its own process per capacity (a full buffer, priorities
|N(0, 1)|), alternating base, new, base, new... for `--rounds` rounds; each
figure is the median over rounds of a round's median of 300 calls, and the
ratio is the median over rounds of new / base within the round.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from before_after import _archive as archive  # (a sibling script, as the others import theirs)

ROOT = Path(__file__).resolve().parents[1]
CALLS = 300

FIELDS = {
    "obs": ((4,), "float32"), "action": ((), "int64"), "reward": ((), "float32"),
    "next_obs": ((4,), "float32"), "done": ((), "float32"),
}  # fmt: skip


def measure(capacity: int, calls: int) -> dict[str, float]:
    """Median us per call of each operation, in this process (the package on the path)."""
    import time

    import numpy as np

    from fastper import PrioritizedReplayBuffer

    rng = np.random.default_rng(0)
    fields = {k: (shape, np.dtype(d)) for k, (shape, d) in FIELDS.items()}
    out: dict[str, float] = {}

    def filled(**options: object) -> PrioritizedReplayBuffer:
        buf = PrioritizedReplayBuffer(capacity, fields, alpha=0.6, beta=0.4, seed=0, **options)  # type: ignore[arg-type]
        chunk = 65536
        for lo in range(0, capacity, chunk):
            k = min(chunk, capacity - lo)
            buf.add({
                name: rng.standard_normal((k, *shape)).astype(np.dtype(d))
                for name, (shape, d) in FIELDS.items()
            })  # fmt: skip
        buf.update_priorities(np.arange(capacity), np.abs(rng.standard_normal(capacity)))
        return buf

    def timed(fn: object, n: int) -> float:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e6

    def case(buf: PrioritizedReplayBuffer, label: str, b: int) -> None:
        tds = [np.abs(rng.standard_normal(b)) for _ in range(64)]

        def step(i: int) -> None:
            s = buf.sample(b)
            buf.update_priorities(s.indices, tds[i % 64], s.keys)

        for i in range(50):  # warm-up
            step(i)
        if label == "defaults":
            out[f"sample, B={b}"] = timed(lambda i: buf.sample(b), calls)
            upd = []  # each update of a sample just drawn (its paths in cache, as in a step)
            for i in range(calls):
                s = buf.sample(b)
                t0 = time.perf_counter()
                buf.update_priorities(s.indices, tds[i % 64], s.keys)
                upd.append(time.perf_counter() - t0)
            out[f"update, B={b}"] = float(np.median(upd)) * 1e6
        out[f"learner step, {label}, B={b}"] = timed(step, calls)

    cases: list[tuple[str, dict[str, object], tuple[int, ...]]] = [
        ("defaults", {}, (32, 256)),
        ('weight_norm="batch"', {"weight_norm": "batch"}, (256,)),
        ('max_priority="current"', {"max_priority": "current"}, (256,)),
    ]
    for label, options, batches in cases:
        buf = filled(**options)
        for b in batches:
            case(buf, label, b)
        del buf
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--capacities", type=int, nargs="+", default=[2**20, 2**22])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=CALLS)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--single", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.single is not None:
        print(json.dumps(measure(args.single, args.calls)))
        return 0
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "base").mkdir()
        sides = {"base": archive(args.base, Path(tmp) / "base"), "new": ROOT / "src"}
        for cap in args.capacities:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
            for r in range(args.rounds):
                for side, src in sides.items():
                    env = {**os.environ, "PYTHONPATH": str(src),
                           "NUMBA_CACHE_DIR": str(Path(tmp) / f"numba-{side}")}  # fmt: skip
                    done = subprocess.run(
                        [sys.executable, __file__, "--single", str(cap), "--calls", str(args.calls)],
                        check=True, capture_output=True, text=True, env=env, cwd=str(ROOT),
                    )  # fmt: skip
                    runs[side].append(json.loads(done.stdout))
                print(f"N={cap}: round {r + 1}/{args.rounds} done", file=sys.stderr)
            name = f"2^{cap.bit_length() - 1}" if cap & (cap - 1) == 0 else f"{cap:,}"
            lines += [f"#### N = {name}", "", "| operation | base us | new us | new / base (rounds' range) |",
                      "|---|---:|---:|---:|"]  # fmt: skip
            for op in runs["new"][0]:
                if op not in runs["base"][0]:
                    continue
                b = [run[op] for run in runs["base"]]
                n = [run[op] for run in runs["new"]]
                ratios = [x / y for x, y in zip(n, b, strict=True)]
                lines.append(
                    f"| {op} | {statistics.median(b):.2f} | {statistics.median(n):.2f} | "
                    f"{statistics.median(ratios):.3f} ({min(ratios):.2f} - {max(ratios):.2f}) |"
                )
            lines.append("")
    from fastper._bench import cpu_name

    head = (
        f"# Learner step A/B: {args.base} against the working tree\n\n"
        f"`python benchmarks/step_ab.py --base {args.base} --rounds {args.rounds}` on "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, python {platform.python_version()}, "
        f"{os.cpu_count()} cores ({cpu_name()}). Each side in its own process per capacity, alternating, "
        f"{args.rounds} rounds of {args.calls} calls; figures are medians over rounds of a "
        "round's median, ratios the median over rounds of new / base.\n"
    )
    text = head + "\n" + "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
