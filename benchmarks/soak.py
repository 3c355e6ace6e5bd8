"""Soak benchmark: millions of learner steps on one buffer, RSS and throughput over time.

Usage:
    python benchmarks/soak.py [--steps 10000000] [--capacity 65536] [--batch-size 32]
                              [--interval 250000] [--adds-per-step 4] [--kind proportional]
                              [--csv benchmarks/results/soak.csv]

Not a test (it runs for minutes): it checks that a buffer that runs for a
long time keeps flat memory and steady throughput. The buffer (CartPole-like
transitions, 48 bytes each) is first filled to ``--capacity``; then each
learner step is

    batch = sample(--batch-size)                 # the learner draws a batch
    add(batch of --adds-per-step transitions)    # actors keep adding meanwhile
    update_priorities(batch.indices, td, keys=batch.keys)

with td errors from a (scaled) normal distribution. The default ratio, 4 new
transitions per learner step of 32, is DQN's on Atari (one update every 4
environment steps); the ring wraps every N/4 steps, and the add between
sample and update overwrites a sampled slot now and then, so the stale-key
path runs too. ``--adds-per-step 0`` runs the learner alone.

Every ``--interval`` steps one row is printed and appended to the CSV: step,
elapsed seconds, steps/s over the window just ended, RSS (MiB) and the
relative gap between the sum tree's root and ``math.fsum`` of its leaves
(proportional only). A summary follows at the end (also after Ctrl-C).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import fastper
from fastper._bench import FIELDS, KINDS  # the workload and buffers of `fastper bench`

HERE = Path(__file__).resolve().parent


def rss_mib() -> float:
    """Resident set size now (Linux /proc), else the peak, in MiB."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def transitions(k: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    obs = rng.standard_normal((k, 4)).astype(np.float32)
    return {
        "obs": obs,
        "action": rng.integers(0, 2, size=k),
        "reward": np.ones(k, dtype=np.float32),
        "next_obs": obs + np.float32(0.01),
        "done": (rng.random(k) < 0.01).astype(np.float32),
    }


def tree_gap(buf) -> float:
    """|root - fsum(leaves)| / fsum(leaves) of a proportional buffer (0 otherwise)."""
    s = buf._sampler
    if not isinstance(s, fastper.samplers.ProportionalSampler):
        return 0.0
    exact = math.fsum(s.leaves[: len(buf)].tolist())
    return abs(s.total - exact) / exact if exact else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000_000, help="learner steps")
    ap.add_argument("--capacity", type=int, default=2**16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--interval", type=int, default=250_000, help="steps per reported window")
    ap.add_argument("--adds-per-step", type=int, default=4, help="transitions added per step")
    ap.add_argument("--kind", choices=list(KINDS), default="proportional")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", type=Path, default=HERE / "results" / "soak.csv")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    rss0 = rss_mib()
    buf = KINDS[args.kind](args.capacity, FIELDS, seed=args.seed)
    chunk = 4096
    for start in range(0, args.capacity, chunk):
        buf.add(transitions(min(chunk, args.capacity - start), rng))
    # a pool of pre-made inputs, so that the loop times the buffer, not numpy's RNG
    pool = 1024
    adds = [transitions(args.adds_per_step, rng) for _ in range(pool)] if args.adds_per_step else []
    tds = rng.standard_normal((pool, args.batch_size)) * rng.lognormal(0.0, 2.0, (pool, 1))
    buf.sample(args.batch_size)  # compile / warm up
    rss_filled = rss_mib()

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    header = ["step", "elapsed_s", "steps_per_s", "rss_mib", "tree_rel_gap", "stale_updates"]
    rows: list[dict[str, float]] = []
    print(
        f"soak: {args.kind} N={args.capacity} B={args.batch_size} "
        f"adds/step={args.adds_per_step} steps={args.steps:,} "
        f"(RSS {rss0:.1f} MiB before the buffer, {rss_filled:.1f} MiB filled)",
        flush=True,
    )
    print(f"{'step':>12} {'elapsed s':>10} {'steps/s':>10} {'RSS MiB':>9} {'tree gap':>9}")
    with open(args.csv, "w", newline="") as fcsv:
        writer = csv.DictWriter(fcsv, fieldnames=header)
        writer.writeheader()
        row0 = {
            "step": 0, "elapsed_s": 0.0, "steps_per_s": float("nan"), "rss_mib": rss_filled,
            "tree_rel_gap": tree_gap(buf), "stale_updates": buf.stale_updates,
        }  # fmt: skip
        writer.writerow(row0)
        rows.append(row0)
        t0 = last_t = time.perf_counter()
        step = 0
        sample, update, add = buf.sample, buf.update_priorities, buf.add
        b = args.batch_size
        try:
            while step < args.steps:
                window = min(args.interval, args.steps - step)
                for i in range(step, step + window):
                    j = i % pool
                    batch = sample(b)
                    if adds:
                        add(adds[j])
                    update(batch.indices, tds[j], keys=batch.keys)
                step += window
                now = time.perf_counter()
                row = {
                    "step": step,
                    "elapsed_s": round(now - t0, 3),
                    "steps_per_s": round(window / (now - last_t), 1),
                    "rss_mib": round(rss_mib(), 2),
                    "tree_rel_gap": tree_gap(buf),
                    "stale_updates": buf.stale_updates,
                }
                last_t = now
                writer.writerow(row)
                fcsv.flush()
                rows.append(row)
                print(
                    f"{row['step']:>12,} {row['elapsed_s']:>10.1f} {row['steps_per_s']:>10,.0f} "
                    f"{row['rss_mib']:>9.2f} {row['tree_rel_gap']:>9.1e}",
                    flush=True,
                )
        except KeyboardInterrupt:
            print("interrupted: summary of the steps done so far", flush=True)

    timed = rows[1:]
    if not timed:
        return 1
    rates = [r["steps_per_s"] for r in timed]
    rss = [r["rss_mib"] for r in rows]
    print(
        f"\nsummary: {timed[-1]['step']:,} steps in {timed[-1]['elapsed_s']:.1f} s; "
        f"steps/s first window {rates[0]:,.0f}, last {rates[-1]:,.0f}, median {statistics.median(rates):,.0f}, "
        f"min {min(rates):,.0f}, max {max(rates):,.0f}\n"
        f"RSS MiB: filled {rss[0]:.2f}, end {rss[-1]:.2f}, max {max(rss):.2f} "
        f"(growth after the first window {rss[-1] - rss[1]:+.2f}); "
        f"peak RSS of the process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB; "
        f"largest tree gap {max(r['tree_rel_gap'] for r in rows):.1e}; "
        f"stale updates {buf.stale_updates:,}\n"
        f"CSV: {args.csv}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
