"""Where a learner step's time goes, next to what this machine's memory allows.

Usage:
    python benchmarks/breakdown.py [--capacities 65536 1048576 4194304]
                                   [--batch-size 256] [--calls 200] [--rounds 7]
                                   [--out benchmarks/results/breakdown.md]

For each capacity, one fresh process builds the proportional buffer of the
peers benchmark (CartPole-like fields, alpha 0.6, beta 0.4, every priority
random |N(0, 1)|) and times, in interleaved rounds (the median over rounds of
each round's median):

* the public calls: ``sample(B)``, ``update_priorities`` on the indices of a
  fresh sample each call (cold paths, as in ``peers.py``), and the learner
  step (sample + update);
* the same steps without the public call's checks, schedules and lock
  (uniforms, the search / weights / keys / batch order kernel, the storage's
  gather and the SampleBatch), the kernel alone (with its uniforms; it also prefetches the
  drawn rows of a records storage, which the gather then finds in cache), and
  the update kernel
  through the sampler; each part in the table is a difference of two of these
  timings, so it carries the noise of both;
* two properties of the machine: the time per cache line of independent
  random reads over arrays the size of the tree's leaves and of the data
  (what the prefetching kernels can at best approach), and the latency of one
  dependent random read (what a read costs when nothing overlaps it).

It writes a markdown table (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _median_us(fn: Callable[[], object], calls: int) -> float:
    clock = time.perf_counter_ns
    out = np.empty(calls)
    for i in range(calls):
        t0 = clock()
        fn()
        out[i] = (clock() - t0) / 1e3
    return float(np.median(out))


def measure(capacity: int, batch: int, calls: int, rounds: int) -> dict[str, float]:
    """All figures for one capacity (run in a fresh process)."""
    from numba import njit

    import fastper
    from fastper._bench import FIELDS
    from fastper._kernels import prioritized as tk

    @njit(nogil=True, cache=False)
    def independent_reads(a: np.ndarray, idx: np.ndarray) -> float:  # pragma: no cover
        s = 0.0
        for k in range(idx.shape[0]):
            s += a[idx[k]]
        return s

    @njit(nogil=True, cache=False)
    def dependent_reads(
        a: np.ndarray, nxt: np.ndarray, pos: np.ndarray, steps: int
    ) -> float:  # pragma: no cover
        j = pos[0]
        s = 0.0
        for _ in range(steps):
            s += a[j]
            j = nxt[j]
        pos[0] = j  # the next call goes on along the cycle: no line is read twice soon
        return s

    rng = np.random.default_rng(0)
    buf = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=0.6, beta=0.4, seed=0)
    chunk = {k: np.zeros((1000, *shape), dtype) for k, (shape, dtype) in FIELDS.items()}
    for start in range(0, capacity, 1000):
        m = min(1000, capacity - start)
        buf.add({k: v[:m] for k, v in chunk.items()})
    for start in range(0, capacity, 65536):
        idx = np.arange(start, min(capacity, start + 65536))
        buf.update_priorities(idx, np.abs(rng.standard_normal(idx.shape[0])))
    smp = buf._sampler
    storage = buf._storage
    tds = [np.abs(rng.standard_normal(batch)) for _ in range(8)]
    turn = [0]

    def td() -> np.ndarray:
        turn[0] += 1
        return tds[turn[0] % 8]

    def fresh_samples() -> list[fastper.SampleBatch]:
        return [buf.sample(batch) for _ in range(calls)]

    no_perm = np.empty(0, dtype=np.int64)  # draws in stratum order
    rows, row_bytes = storage.record_bytes  # the rows the search prefetches for the gather
    out_idx = np.empty(batch, np.int64)
    out_p = np.empty(batch)
    out_w = np.empty(batch)
    out_k = np.empty(batch, np.int64)
    status = np.zeros(4, np.int64)
    lines = max(1, smp.leaves.nbytes // 64)
    data_lines = max(1, sum(c.nbytes for c in storage.columns.values()) // 64)
    # a random cyclic permutation of the leaves' cache lines, for the dependent reads
    perm = rng.permutation(lines)
    nxt_lines = np.empty(lines, np.int64)
    nxt_lines[perm] = np.roll(perm, -1)
    nxt = np.zeros(smp.leaves.shape[0], np.int64)
    nxt[np.arange(lines) * 8] = nxt_lines * 8
    big = np.zeros(data_lines * 8)

    pos = np.zeros(1, np.int64)

    def per_line(a: np.ndarray, n_lines: int) -> Callable[[], object]:
        # fresh lines every call: reusing one index set would time the cache
        it = iter([rng.integers(0, n_lines, 4096) * 8 for _ in range(calls)])
        return lambda: independent_reads(a, next(it))

    def api_sample() -> Callable[[], object]:
        return lambda: buf.sample(batch)

    def api_update() -> Callable[[], object]:
        it = iter(fresh_samples())

        def f() -> None:
            s = next(it)
            buf.update_priorities(s.indices, td(), s.keys)

        return f

    def api_step() -> Callable[[], object]:
        def f() -> None:
            s = buf.sample(batch)
            buf.update_priorities(s.indices, td(), s.keys)

        return f

    def direct_sample() -> Callable[[], object]:
        # what sample() does, without its checks, schedules and lock
        from fastper.buffers import SampleBatch

        def f() -> SampleBatch:
            u = buf._rng.random(2 * batch)  # targets, then the batch order
            idx, prob, w, keys = smp.sample_permuted(
                u, no_perm, len(buf), 0.4, True, 0, 0, buf.total_added, rows, row_bytes, True
            )
            data = storage.gather(idx)
            return SampleBatch._made(data, idx, w, prob, keys, 0.4)

        return f

    def k_search() -> Callable[[], object]:
        n = len(buf)
        no_perm = np.empty(0, dtype=np.int64)  # draws in stratum order

        def f() -> object:
            u = buf._rng.random(2 * batch)  # targets, then the batch order
            return tk.prop_sample(
                smp.leaves, smp.sinner, smp.minner, smp.offs, smp.depth, u, no_perm, True, True,
                0.4, n, 0, 0, buf.total_added, capacity, out_idx, out_p, out_w, out_k, rows,
                row_bytes,
            )  # fmt: skip

        return f

    def k_update() -> Callable[[], object]:
        it = iter(fresh_samples())

        def f() -> None:
            s = next(it)
            smp.update_from_td(
                s.indices, td(), s.keys, True, 1e-6, np.inf, len(buf), 0, buf.total_added, status
            )

        return f

    ops = {
        "sample": api_sample,
        "update": api_update,
        "learner step": api_step,
        "sample, its steps called directly": direct_sample,
        "uniforms + search/weights/keys kernel": k_search,
        "update kernel": k_update,
        "leaves-size array: ns per random line": lambda: per_line(smp.leaves, lines),
        "data-size array: ns per random line": lambda: per_line(big, data_lines),
        "leaves-size array: ns per dependent read": lambda: (
            lambda: dependent_reads(smp.leaves, nxt, pos, 4096)
        ),
    }
    per_round: dict[str, list[float]] = {k: [] for k in ops}
    for make in ops.values():  # warm-up: compile, touch
        f = make()
        for _ in range(min(calls, 20)):
            f()
    for _ in range(rounds):
        for name, make in ops.items():
            per_round[name].append(_median_us(make(), calls))
    res = {k: statistics.median(v) for k, v in per_round.items()}
    for k in list(res):
        if k.startswith(("leaves-size", "data-size")):
            res[k] = res[k] * 1e3 / 4096  # us per 4096 reads -> ns per read
    res["depth"] = float(smp.depth)
    return res


def table(results: dict[int, dict[str, float]], batch: int) -> str:
    caps = sorted(results)
    def name(c: int) -> str:
        return f"N = 2^{c.bit_length() - 1}" if c & (c - 1) == 0 else f"N = {c:,}"

    head = "| | " + " | ".join(name(c) for c in caps) + " |"
    lines = [head, "|---|" + "---:|" * len(caps)]

    def row(label: str, fn: Callable[[dict[str, float]], float], fmt: str = "{:.1f}") -> None:
        lines.append(f"| {label} | " + " | ".join(fmt.format(fn(results[c])) for c in caps) + " |")

    row("`sample(B)`, us", lambda r: r["sample"])
    row(
        "- uniforms + search / weights / keys / batch order kernel (prefetching the rows)",
        lambda r: r["uniforms + search/weights/keys kernel"],
    )
    row(
        "- gather of the rows (5 fields) + SampleBatch",
        lambda r: (
            r["sample, its steps called directly"] - r["uniforms + search/weights/keys kernel"]
        ),
    )
    row(
        "- checks, schedules, lock",
        lambda r: r["sample"] - r["sample, its steps called directly"],
    )
    row("`update_priorities`, cold paths, us", lambda r: r["update"])
    row("- update kernel (through the sampler)", lambda r: r["update kernel"])
    row("- conversions, checks, lock", lambda r: r["update"] - r["update kernel"])
    row("learner step (sample + update), us", lambda r: r["learner step"])
    row("tree levels", lambda r: r["depth"], "{:.0f}")
    row(
        "random read, leaves-size array, ns per line",
        lambda r: r["leaves-size array: ns per random line"],
    )
    row(
        "random read, data-size array, ns per line",
        lambda r: r["data-size array: ns per random line"],
    )
    row(
        "dependent random read, leaves-size array, ns",
        lambda r: r["leaves-size array: ns per dependent read"],
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacities", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "breakdown.md")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure(args.worker, args.batch_size, args.calls, args.rounds)))
        return 0
    results: dict[int, dict[str, float]] = {}
    t0 = time.time()
    for cap in args.capacities:
        cmd = [sys.executable, __file__, "--worker", str(cap), "--batch-size", str(args.batch_size),
               "--calls", str(args.calls), "--rounds", str(args.rounds)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
        results[cap] = json.loads(proc.stdout.strip().splitlines()[-1])
    import fastper
    from fastper._bench import cpu_name

    text = (
        "# Where a learner step's time goes (fastper, proportional)\n\n"
        f"`python benchmarks/breakdown.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f" ({time.time() - t0:.0f} s); fastper {fastper.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({cpu_name()}, "
        f"{platform.machine()}).\n\n"
        f"B = {args.batch_size}; each figure is the median over {args.rounds} interleaved rounds of "
        f"the median of {args.calls} calls, one fresh process per capacity. Each indented row "
        "is the difference of two timed variants (the public call, the same steps called "
        "directly without checks and lock, the kernel alone), so it carries the noise of both; "
        "the parts need not add up exactly. The last three rows are the "
        "machine: time per cache line of 4096 independent random reads, and of one random read "
        "that depends on the previous one.\n\n" + table(results, args.batch_size) + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
