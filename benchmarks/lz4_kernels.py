"""What lz4's compiled kernels buy a tiered buffer, against the lz4 package's Python API.

Usage:
    python -m benchmarks.lz4_kernels [--rounds 7] [--slots 8192] [--iters 400]
                                     [--calls 300] [--chunks 10] [--hot 0.20] [--warm 0.05]
                                     [--out FILE]

One process, one run; the paths are timed in interleaved rounds (the order
reversed every other round: a busy, shared machine slows all of them alike),
and only ratios within a round are compared. Paths:

* ``kernels``: the lz4 codec with :mod:`fastper._kernels.lz4` (LZ4's C
  functions called from compiled code), storage defaults (so ``prefetch`` on:
  a background thread decodes promotions and compresses chunks ahead of their
  demotion).
* ``pure``: the same codec made with ``FASTPER_LZ4_KERNELS=0``: every block
  goes through ``lz4.block.compress`` / ``decompress``; storage defaults (so
  ``prefetch`` off: moves inline), what a user gets without the kernels.
* ``pure + thread`` (loop only): ``pure`` with ``prefetch=True``, what the
  storage could default to without the kernels (``lz4.block`` releases the
  interpreter lock while it works).

Measured:

1. gather: median us of ``TieredStorage.gather`` of 32 rows, all from warm
   (compressed, in RAM) chunks, and of 32 rows all hot (for reference), on
   the storages of 3. after their loop (placement settled, nothing in flight);
   ``--calls`` gathers per round and path.
2. move: median ms to compress one 64-row chunk of image transitions into
   its blocks (``BlockLayout.pack``: a demotion's work) and to decode it into
   its hot rows (``BlockLayout.decode_into``: a promotion's), ``--chunks``
   chunks per round and path.
3. loop: as ``benchmarks/tiers.py`` (``skewed`` layout, hot ``--hot`` +
   warm ``--warm`` of the data, ``--slots`` image transitions (4, 84, 84)
   uint8): ``--iters`` iterations of add 4 + sample 32 + update 32; samples/s
   (iterations per second of the time in ``sample`` + ``update_priorities``)
   and loop/s (of the whole loop), with the RAM buffer for reference.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.tiers import (
    ALPHA,
    FIELDS,
    PRIO_FILE,
    TD_FILE,
    Run,
    _fill,
    _loop,
    atari_stacks,
    warm_row_cost,
)
from fastper import PrioritizedReplayBuffer
from fastper.storage import make_fields
from fastper.tier_codecs import LZ4_KERNELS_ENV, BlockLayout, Codec, make_codec
from fastper.tiers import TieredStorage

HOT, WARM = 0.20, 0.05  # default shares of the data: the 1/4 RAM budget of benchmarks/tiers.py
#: path -> (lz4 kernels on, prefetch)
PATHS: dict[str, tuple[bool, bool | None]] = {
    "kernels": (True, None),
    "pure": (False, None),
    "pure + thread": (False, True),
}


@contextlib.contextmanager
def kernels_env(on: bool) -> Iterator[None]:
    """``FASTPER_LZ4_KERNELS`` set for the codecs made inside (restored after)."""
    old = os.environ.get(LZ4_KERNELS_ENV)
    os.environ[LZ4_KERNELS_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[LZ4_KERNELS_ENV]
        else:
            os.environ[LZ4_KERNELS_ENV] = old


def lz4_codec(on: bool) -> Codec:
    with kernels_env(on):
        codec = make_codec("lz4")
    if (codec.warm_rows is not None) != on:
        raise SystemExit(f"lz4 codec with kernels={on} not available here")
    return codec


def make_buffers(
    slots: int, tmp: str, stacks: np.ndarray, hot: float, warm: float
) -> dict[str, Run]:
    prio = np.load(PRIO_FILE).astype(np.float64)
    td = np.load(TD_FILE).astype(np.float64)
    row_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in FIELDS.values())
    data = slots * row_bytes
    runs = {}
    for i, name in enumerate(["RAM", *PATHS]):
        storage = None
        if name != "RAM":
            on, prefetch = PATHS[name]
            with kernels_env(on):
                storage = TieredStorage(
                    FIELDS, slots, chunk_size=64, hot_bytes=int(hot * data),
                    warm_bytes=int(warm * data), cold_dir=os.path.join(tmp, str(i)),
                    codec="lz4", prefetch=prefetch,
                )  # fmt: skip
            assert (storage.codec.warm_rows is not None) == on, name
        buf = PrioritizedReplayBuffer(slots, FIELDS, alpha=ALPHA, beta=0.4, seed=7, storage=storage)
        runs[name] = Run(buf, prio, td, "skewed")
    return runs


def move_times(
    blocks: BlockLayout, chunks: list[list[np.ndarray]], target: dict[str, np.ndarray]
) -> tuple[float, float]:
    """Median ms of packing a chunk and of decoding it back into ``target``."""
    t_pack, t_dec = [], []
    for cols in chunks:
        t0 = time.perf_counter()
        pieces = blocks.pack(cols)
        t1 = time.perf_counter()
        blocks.decode_into(pieces, target, "chunk")
        t2 = time.perf_counter()
        t_pack.append(t1 - t0)
        t_dec.append(t2 - t1)
        for (name, _, _), c in zip(blocks.cuts, cols, strict=True):
            if not np.array_equal(target[name], c):
                raise AssertionError(f"{name}: decoded rows differ")
    return statistics.median(t_pack) * 1e3, statistics.median(t_dec) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--slots", type=int, default=8192)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--calls", type=int, default=300, help="gathers per round and path")
    p.add_argument("--chunks", type=int, default=10, help="chunks packed per round and path")
    p.add_argument("--hot", type=float, default=HOT, help="hot tier, share of the data")
    p.add_argument("--warm", type=float, default=WARM, help="warm tier, share of the data")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    stacks = atari_stacks(2048, seed=2)
    rng = np.random.default_rng(0)
    fields = make_fields(FIELDS)
    codecs = {"kernels": lz4_codec(True), "pure": lz4_codec(False)}
    layouts = {k: BlockLayout(fields, 64, 1 << 15, c) for k, c in codecs.items()}
    chunk_cols = [
        [
            stacks[(lo := int(rng.integers(0, stacks.shape[0] - 64))) : lo + 64],
            rng.integers(0, 4, 64),
            rng.standard_normal(64).astype(np.float32),
            rng.random(64) < 0.01,
        ]
        for _ in range(args.chunks)
    ]
    target = {n: np.empty((64, *f.shape), dtype=f.dtype) for n, f in fields.items()}
    gather_paths = ("kernels", "pure")
    res: dict[str, dict[str, list[float]]] = {
        k: {m: [] for m in ("gather32", "gather0", "pack", "decode", "sample", "loop")}
        for k in ["RAM", *PATHS]
    }
    with tempfile.TemporaryDirectory(prefix="fastper-lz4-bench-") as tmp:
        runs = make_buffers(args.slots, tmp, stacks, args.hot, args.warm)
        for run in runs.values():
            _fill(run, stacks)
            _loop(run, stacks, args.iters // 2, seed=99)  # warm-up: placement settles
        hits: dict[str, list[float]] = {k: [] for k in PATHS}
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for name in order:  # 3. the loop
                gc.collect()
                st = runs[name].buf.storage
                before = st.stats() if isinstance(st, TieredStorage) else None
                whole, part = _loop(runs[name], stacks, args.iters, seed=r)
                res[name]["loop"].append(args.iters / whole)
                res[name]["sample"].append(args.iters / part)
                if isinstance(st, TieredStorage):
                    st.settle()  # nothing of this path left running in the next one's time
                    after = st.stats()
                    got = [after[f"rows_{t}"] - before[f"rows_{t}"] for t in ("hot", "warm")]
                    total = sum(
                        after[f"rows_{t}"] - before[f"rows_{t}"] for t in ("hot", "warm", "cold")
                    )
                    hits[name].append(got[0] / max(total, 1))
            for name in gather_paths if r % 2 == 0 else gather_paths[::-1]:  # 1. gathers
                gc.collect()
                cost = warm_row_cost(runs[name].buf.storage, calls=args.calls, ks=(0, 32))
                res[name]["gather0"].append(cost[0])
                res[name]["gather32"].append(cost[32])
            for name in gather_paths if r % 2 == 0 else gather_paths[::-1]:  # 2. moves
                gc.collect()
                pack, dec = move_times(layouts[name], chunk_cols, target)
                res[name]["pack"].append(pack)
                res[name]["decode"].append(dec)
            print(
                f"round {r}: "
                + ", ".join(
                    f"{k} loop {v['loop'][-1]:.0f}/s sample {v['sample'][-1]:.0f}/s"
                    for k, v in res.items()
                ),
                file=sys.stderr,
            )
        for run in runs.values():
            if isinstance(run.buf.storage, TieredStorage):
                run.buf.storage.close()
    text = report(args, res, hits, time.perf_counter() - t_start)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


def report(
    args: argparse.Namespace,
    res: dict[str, dict[str, list[float]]],
    hits: dict[str, list[float]],
    secs: float,
) -> str:
    med = statistics.median

    def speedup(what: str, path: str, rate: bool) -> str:
        """Median (range) over the rounds of the same-round speed-up of the kernels over
        ``path``: its time over the kernels' (``rate``: the kernels' rate over its)."""
        ks, ps = res["kernels"][what], res[path][what]
        rs = [(k / p if rate else p / k) for k, p in zip(ks, ps, strict=True)]
        return f"{med(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"

    def cell(name: str, what: str, fmt: str) -> str:
        xs = res[name][what]
        return f"{med(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    lines = [
        f"`python -m benchmarks.lz4_kernels {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        f"on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{secs:.0f} s; {args.rounds} interleaved rounds (order reversed every other round). "
        "Medians over the rounds, ranges in brackets; `pure / kernels`: median (range) of the "
        "same-round ratios of the pure path's time to the kernels' (> 1: the kernels are "
        "faster).",
        "",
        "| measure | kernels | pure | pure / kernels |",
        "|---|---:|---:|---:|",
        f"| gather 32 rows, all warm (us) | {cell('kernels', 'gather32', '.0f')} "
        f"| {cell('pure', 'gather32', '.0f')} | {speedup('gather32', 'pure', False)} |",
        f"| gather 32 rows, all hot (us) | {cell('kernels', 'gather0', '.0f')} "
        f"| {cell('pure', 'gather0', '.0f')} | {speedup('gather0', 'pure', False)} |",
        f"| compress a 64-row chunk (demotion, ms) | {cell('kernels', 'pack', '.2f')} "
        f"| {cell('pure', 'pack', '.2f')} | {speedup('pack', 'pure', False)} |",
        f"| decode a 64-row chunk into its hot rows (promotion, ms) "
        f"| {cell('kernels', 'decode', '.2f')} | {cell('pure', 'decode', '.2f')} "
        f"| {speedup('decode', 'pure', False)} |",
        "",
        f"Loop ({args.slots} slots, skewed, hot {args.hot:.2f} + warm {args.warm:.2f}, {args.iters} "
        "iterations a round): `sample/s` iterations per second of the time in `sample` + "
        "`update_priorities`; `loop/s` of the whole loop (add 4 + sample 32 + update 32); "
        "ratios: the kernels' rate over this path's, same round (> 1: the kernels are faster); "
        "`hot hits`: share of gathered rows served hot.",
        "",
        "| path | prefetch | hot hits | sample/s | kernels / this | loop/s | kernels / this |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in ["RAM", *PATHS]:
        pf = "-" if name == "RAM" else {None: "default", True: "on"}[PATHS[name][1]]
        if name == "pure":
            pf = "default (off)"
        elif name == "kernels":
            pf = "default (on)"
        h = f"{med(hits[name]):.3f}" if name in hits else "1"
        lines.append(
            f"| {name} | {pf} | {h} | {cell(name, 'sample', '.0f')} "
            f"| {speedup('sample', name, True)} | {cell(name, 'loop', '.0f')} "
            f"| {speedup('loop', name, True)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
