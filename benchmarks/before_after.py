"""`fastper bench` of two versions of the package, interleaved, in one run.

A change to the core must not slow the buffers down: this times the working
tree's `src/` against another revision's (`git archive REV src`), each in its
own process, alternating A, B, A, B... for `--rounds` rounds so that a noisy,
shared machine weighs on both alike, and prints the median over the rounds of
each operation's median time and their ratio (new / base).

    python benchmarks/before_after.py --base HEAD~1 --rounds 3

Operations: add (one transition; batches of 1000), sample, update and the
learner step (sample + update) of each scheme at capacity 2^18, B = 256
(`fastper bench --kind K`), and the workloads of real runs (`fastper bench
--workloads`: n-step adds, vector-env steps, schedules, at 2^20).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("proportional", "uniform", "rank")


def _archive(rev: str, dest: Path) -> Path:
    """``rev``'s ``src/`` unpacked under ``dest``; returns the folder to put on the path."""
    blob = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True
    ).stdout
    tar = dest / "src.tar"
    tar.write_bytes(blob)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    return dest / "src"


def _bench(src: Path, args: list[str], cache: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-m", "fastper", "bench", *args],
        check=True, capture_output=True, text=True, env=env, cwd=str(ROOT),
    )  # fmt: skip
    return out.stdout


def _rows(text: str, workloads: bool) -> dict[str, float]:
    """``{operation: median us}`` from ``fastper bench``'s markdown table."""
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        col = 1 if workloads else 2
        if len(cells) > col and re.fullmatch(r"[0-9.]+", cells[col]) and cells[0] != "init":
            found[cells[0]] = float(cells[col])
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="the revision to compare with (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    p.add_argument("--capacity", type=int, default=2**18, help="buffer capacity (default 2^18)")
    args = p.parse_args(argv)
    times: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": _archive(args.base, Path(tmp)), "new": ROOT / "src"}
        for r in range(args.rounds):
            for side, src in sides.items():
                cache = Path(tmp) / f"numba-{side}"
                for kind in KINDS:
                    text = _bench(src, ["--kind", kind, "--capacity", str(args.capacity),
                                        "--calls", "400"], cache)  # fmt: skip
                    for op, us in _rows(text, False).items():
                        times[(kind, op, side)].append(us)
                for op, us in _rows(_bench(src, ["--workloads"], cache), True).items():
                    times[("workloads", op, side)].append(us)
                print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    print(f"base = {args.base}, new = the working tree; median over {args.rounds} rounds of "
          "each run's median (us)\n")  # fmt: skip
    print("| scheme | operation | base | new | new / base |")
    print("|---|---|---:|---:|---:|")
    for kind, op in sorted({(k, o) for k, o, _ in times}):
        base, new = times.get((kind, op, "base")), times.get((kind, op, "new"))
        if base and new:
            b, n = statistics.median(base), statistics.median(new)
            print(f"| {kind} | {op} | {b:.3f} | {n:.3f} | {n / b:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
