"""Rank-based replay (exact ranks) against proportional replay, in one process.

Usage:
    python benchmarks/rank.py [--capacities 1048576 4194304] [--fills 1.0 0.5]
                              [--batch-size 256] [--calls 200] [--rounds 15]
                              [--out benchmarks/results/rank.md] [--quick]

For each capacity and fill (full, half full), both buffers are built in this
process with CartPole-like fields (obs (4,) float32, action int64, reward
float32, next_obs (4,) float32, terminated bool), filled, and given random
priorities (|N(0, 1)| TD errors for every stored slot, so the rank tree holds
an arbitrary order and has split its way to its natural shape). Then, in
interleaved rounds (rank, proportional, rank, ...), each round times
``calls`` iterations of the learner loop

    add(1 transition) + sample(B) + update_priorities(B fresh |N(0, 1)|, keys)

on each buffer. Reported: the median over rounds of each round's median
(us per iteration, and per phase), and the median over rounds of the
per-round ratio rank / proportional. The machine is shared and noisy
(figures move by +-30% between runs), hence the interleaving and medians.

``--quick`` runs a small case (2^12 slots, 2 rounds of 20 calls) and writes
nothing unless ``--out`` is given: a smoke test of this script.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fastper._bench import NSTEP_FIELDS, _batch, cpu_name

HERE = Path(__file__).resolve().parent
FIELDS = {k: v for k, v in NSTEP_FIELDS.items() if k != "truncated"}  # CartPole-like
PHASES = ("add", "sample", "update", "loop")


def transitions(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    """`fastper bench`'s CartPole-like rows, its `done` flag as `terminated`."""
    rows = _batch(rng, k)
    rows["terminated"] = rows.pop("done") != 0
    return rows


def build(kind: str, capacity: int, fill: float, seed: int = 0) -> Any:
    """A buffer of ``kind`` holding ``fill * capacity`` transitions with random priorities."""
    import fastper

    cls = {"rank": fastper.RankBasedReplayBuffer, "proportional": fastper.PrioritizedReplayBuffer}
    buf = cls[kind](capacity, FIELDS, seed=seed)
    rng = np.random.default_rng(seed)
    n = max(1, int(capacity * fill))
    chunk = 1 << 16
    for lo in range(0, n, chunk):
        buf.add(transitions(rng, min(chunk, n - lo)))
    for lo in range(0, n, chunk):
        idx = np.arange(lo, min(lo + chunk, n))
        buf.update_priorities(idx, np.abs(rng.standard_normal(idx.shape[0])))
    return buf


def time_loop(buf: Any, rng: np.random.Generator, batch: int, calls: int) -> np.ndarray:
    """Median us of (add, sample, update, whole loop) over ``calls`` iterations."""
    one = transitions(rng, 1)
    out = np.empty((calls, 4))
    clock = time.perf_counter_ns
    for i in range(calls):
        td = np.abs(rng.standard_normal(batch))
        t0 = clock()
        buf.add(one)
        t1 = clock()
        s = buf.sample(batch)
        t2 = clock()
        buf.update_priorities(s.indices, td, keys=s.keys)
        t3 = clock()
        out[i] = (t1 - t0, t2 - t1, t3 - t2, t3 - t0)
    return np.median(out, axis=0) / 1e3


def measure(capacity: int, fill: float, batch: int, calls: int, rounds: int) -> dict[str, Any]:
    """Both buffers at one capacity and fill, timed in interleaved rounds."""
    t_build = time.perf_counter()
    bufs = {kind: build(kind, capacity, fill) for kind in ("rank", "proportional")}
    t_build = time.perf_counter() - t_build
    rngs = {kind: np.random.default_rng(1) for kind in bufs}
    for kind, buf in bufs.items():  # warm-up: compiled code, caches
        time_loop(buf, rngs[kind], batch, max(5, calls // 10))
    per_round: dict[str, list[np.ndarray]] = {kind: [] for kind in bufs}
    for _ in range(rounds):
        for kind, buf in bufs.items():
            per_round[kind].append(time_loop(buf, rngs[kind], batch, calls))
    rank = np.array(per_round["rank"])
    prop = np.array(per_round["proportional"])
    out = {
        "capacity": capacity,
        "fill": fill,
        "rank": np.median(rank, axis=0),
        "proportional": np.median(prop, axis=0),
        "ratio": np.median(rank / prop, axis=0),
        "ratio_range": (float((rank / prop)[:, 3].min()), float((rank / prop)[:, 3].max())),
        "index_bytes_per_slot": {
            kind: buf.nbytes()["index"] / capacity for kind, buf in bufs.items()
        },
        "build_s": t_build,
    }
    del bufs
    gc.collect()
    return out


def _log2(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def report(results: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    import numba

    import fastper

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Rank-based (exact) vs proportional replay: the learner loop",
        "",
        f"`python benchmarks/rank.py` on {when} ({seconds:.0f} s); fastper "
        f"{fastper.__version__}, numpy {np.__version__}, numba {numba.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()} ({cpu_name()}).",
        "",
        f"One iteration: `add(1)` + `sample({args.batch_size})` + "
        f"`update_priorities({args.batch_size}, keys)`, CartPole-like fields, "
        "random |N(0, 1)| priorities. Both buffers live in one process and are "
        f"timed in {args.rounds} interleaved rounds of {args.calls} iterations; "
        "each figure is the median over rounds of the round's median, in us; the "
        "ratio is the median over rounds of rank / proportional (its range over "
        "rounds in brackets). Index bytes per slot: `nbytes()['index']` / capacity "
        "(reserved; the rank tree's leaf pool is mapped only as it is used).",
        "",
        "| N | fill | proportional loop | rank loop | ratio | rank: add / sample / update "
        "| proportional: add / sample / update | index B/slot (rank, prop) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        lo, hi = r["ratio_range"]
        rk, pp = r["rank"], r["proportional"]
        mem = r["index_bytes_per_slot"]
        lines.append(
            f"| {_log2(r['capacity'])} | {r['fill']:g} | {pp[3]:.0f} | {rk[3]:.0f} "
            f"| {r['ratio'][3]:.2f} [{lo:.2f}, {hi:.2f}] "
            f"| {rk[0]:.0f} / {rk[1]:.0f} / {rk[2]:.0f} | {pp[0]:.0f} / {pp[1]:.0f} / {pp[2]:.0f} "
            f"| {mem['rank']:.1f}, {mem['proportional']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacities", type=int, nargs="+", default=[1 << 20, 1 << 22])
    ap.add_argument("--fills", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="a small smoke run; writes no file")
    args = ap.parse_args(argv)
    if args.quick:
        args.capacities, args.calls, args.rounds = [1 << 12], 20, 2
    elif args.out is None:
        args.out = HERE / "results" / "rank.md"
    t0 = time.perf_counter()
    results = []
    for capacity in args.capacities:
        for fill in args.fills:
            r = measure(capacity, fill, args.batch_size, args.calls, args.rounds)
            results.append(r)
            print(
                f"N={_log2(capacity)} fill={fill:g}: proportional {r['proportional'][3]:.0f} us, "
                f"rank {r['rank'][3]:.0f} us, ratio {r['ratio'][3]:.2f} "
                f"(built in {r['build_s']:.1f} s)",
                flush=True,
            )
    text = report(results, args, time.perf_counter() - t0)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
