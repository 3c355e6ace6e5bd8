"""Hot / warm / cold storage (:class:`fastper.tiers.TieredStorage`): codecs and throughput.

Usage:
    python -m benchmarks.tiers [--slots 8192] [--iters 400] [--repeats 5] [--runs 1]
                               [--hot 0.05 0.1 0.2 0.25] [--big-hot 0.9]
                               [--out benchmarks/results/tiers.md] [--quick]
    python -m benchmarks.tiers --make-td   # rewrites benchmarks/data/cartpole_dqn_*.npy
    python -m benchmarks.tiers --priorities-of CHECKPOINT NAME
        # benchmarks/data/NAME_priorities.npy: a saved buffer's priorities, oldest first

Data:

* images: Atari-like frames, Breakout-shaped (walls, six rows of bricks that
  disappear over time, a paddle on a random walk, a bouncing ball, score
  digits), drawn at 210x160 and area-resized to 84x84 uint8 grey, as the
  DQN preprocessing does; stacks of 4 consecutive frames, (4, 84, 84).
  MinAtar is not used: its 10x10 boards are not Atari-sized.
* vectors: CartPole-v1 observations (float32, 4 per step) from random-action
  rollouts of gym's dynamics (``benchmarks.gil.cartpole_step``), with resets.
* priorities, measured: Double DQN with proportional PER on CartPole-v1
  (``fastper.agents.dqn``, 20000 steps, buffer 8192; ``--make-td``, about
  90 s): its final raw priorities in ring order (oldest first) and the |TD|
  of its last 8192 updated rows. For the mass table also the priorities of
  any other run saved with ``--priorities-of`` (e.g. the MinAtar study's
  Breakout runs, ``studies/minatar.sh``: image observations, 100k slots).

1. Codecs: ratio, compress and decompress MB/s (of raw bytes; medians over
   ``--repeats``) on blocks as the storage makes them: one image stack per
   block, 32 KiB blocks of CartPole observations.
2. Mass: the most sampling mass any placement can put in a hot tier of a
   given share of the slots (per slot, and per 64-slot chunk), from the run's
   priorities.
3. Throughput: a proportional buffer (alpha 0.6, beta 0.4) of ``--slots``
   image transitions (obs (4, 84, 84) uint8, action, reward, done), the RAM
   budget (hot + warm) a quarter of the raw data (``--big-hot``: hot tiers
   past it, to see the speed where the hot mass reaches 0.9). The loop, as
   DQN on Atari (4 env steps per learner step): ``add`` 4 transitions (max
   priority), ``sample(32)``, ``update_priorities`` with |TD| drawn from the
   run's. Timed for each hot-tier size against the all-in-RAM buffer, in
   interleaved rounds, medians; time in ``sample`` + ``update_priorities``
   and the whole loop; hit rates, mass and bytes per tier from ``stats()``.
   ``--runs N`` repeats the whole measurement N times (fresh buffers each
   time) and adds a table of the medians and ranges of the ratios over the
   runs, and how often the background thread beat inline moves in a pair.
   Layouts (see :class:`Run`): ``measured``, ``iid`` (pessimistic) and
   ``skewed`` (the run's values, 91% of the mass in 15% of the chunks: the
   target's condition, which real runs do not reach, made to hold).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fastper import PrioritizedReplayBuffer
from fastper.tiers import HOT, WARM, TieredStorage, available_codecs, make_codec

HERE = Path(__file__).resolve().parent
PRIO_FILE = HERE / "data" / "cartpole_dqn_priorities.npy"
TD_FILE = HERE / "data" / "cartpole_dqn_td.npy"
FIELDS: dict[str, Any] = {
    "obs": ((4, 84, 84), np.uint8),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
ALPHA = 0.6
#: layout "skewed": a random SKEW_SHARE of the 64-slot chunks get SKEW_MASS times the mass
SKEW_SHARE, SKEW_MASS = 0.15, 60.0


# -- data ------------------------------------------------------------------------------
def _area_matrix(src: int, dst: int) -> np.ndarray:
    """(dst, src) weights of an area resize (each output pixel averages its footprint)."""
    w = np.zeros((dst, src), dtype=np.float32)
    scale = src / dst
    for i in range(dst):
        a, b = i * scale, (i + 1) * scale
        for j in range(int(a), min(src, int(np.ceil(b)))):
            w[i, j] = min(b, j + 1) - max(a, j)
    return w / scale


def atari_frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` consecutive Breakout-like 84x84 uint8 frames (see the module docstring)."""
    rng = np.random.default_rng(seed)
    ry, rx = _area_matrix(210, 84), _area_matrix(160, 84).T
    bricks = np.ones((6, 18), dtype=bool)
    shades = np.array([200, 180, 160, 140, 120, 100], dtype=np.float32)
    paddle, bx, by, vx, vy = 72.0, 80.0, 120.0, 2.0, 3.0
    out = np.empty((n, 84, 84), dtype=np.uint8)
    big = np.zeros((210, 160), dtype=np.float32)
    for t in range(n):
        big[:] = 0.0
        big[17:32, :] = 142.0  # top wall
        big[17:196, :8] = 142.0
        big[17:196, 152:] = 142.0
        if t % 25 == 0 and bricks.any():  # a brick goes
            r, c = np.argwhere(bricks)[rng.integers(bricks.sum())]
            bricks[r, c] = False
        for r in range(6):
            row = np.repeat(bricks[r], 8) * shades[r]
            big[57 + 6 * r : 63 + 6 * r, 8:152] = row[None, :]
        paddle = float(np.clip(paddle + rng.normal(0, 3), 8, 136))
        big[189:193, int(paddle) : int(paddle) + 16] = 200.0
        bx, by = bx + vx, by + vy
        if not 8 <= bx <= 150:
            vx = -vx
        if not 93 <= by <= 186:
            vy = -vy
        big[int(by) : int(by) + 4, int(bx) : int(bx) + 2] = 200.0
        digits = rng.integers(0, 2, (5, 12)) * 142.0  # score: a few blocky digits
        big[5:15, 36:60] = np.kron(digits, np.ones((2, 2)))[:10, :24]
        out[t] = np.clip(ry @ big @ rx, 0, 255).astype(np.uint8)
    return out


def atari_stacks(n: int, seed: int = 0) -> np.ndarray:
    """``n`` stacks of 4 consecutive frames, (n, 4, 84, 84) uint8."""
    f = atari_frames(n + 3, seed)
    return np.stack([f[i : i + n] for i in range(4)], axis=1)


def cartpole_obs(n: int, seed: int = 0) -> np.ndarray:
    """``n`` CartPole-v1 observations (float32) of random-action rollouts with resets."""
    from benchmarks.gil import cartpole_step

    rng = np.random.default_rng(seed)
    out = np.empty((n, 4), dtype=np.float32)
    s = tuple(rng.uniform(-0.05, 0.05, 4))
    for t, a in enumerate(rng.integers(0, 2, n).tolist()):
        out[t] = s
        s, done = cartpole_step(s, a)
        if done:
            s = tuple(rng.uniform(-0.05, 0.05, 4))
    return out


def make_td(total_steps: int = 20_000, buffer_size: int = 8192, seed: int = 0) -> dict[str, Any]:
    """A real run's priorities: Double DQN with proportional PER on CartPole-v1.

    Runs :func:`fastper.agents.dqn.train` with the repo's defaults but for
    ``total_steps`` and ``buffer_size`` (no evaluation), capturing its buffer
    (``agent_replay`` wrapped) and every |TD| it returns to
    ``update_priorities``. Returns the final raw priorities p_i in ring order
    (oldest slot first: rotated by the cursor) and the |TD| of the last
    ``buffer_size`` updated rows, both float32.
    """
    import fastper.agents.dqn as dqn

    held: dict[str, Any] = {"tds": []}
    make = dqn.agent_replay

    def capture(cfg: Any, envs: Any) -> Any:
        buf = make(cfg, envs)
        update = buf.update_priorities

        def recorded(indices: Any, td_errors: Any, keys: Any = None) -> int:
            held["tds"].append(np.abs(np.asarray(td_errors, dtype=np.float32)).copy())
            return update(indices, td_errors, keys=keys)

        buf.update_priorities = recorded  # type: ignore[method-assign]
        held["buf"] = buf
        return buf

    cfg = dqn.DQNConfig(
        env_id="CartPole-v1", replay="per", total_steps=total_steps,
        buffer_size=buffer_size, seed=seed, eval_every=0,
    )  # fmt: skip
    dqn.agent_replay = capture  # type: ignore[assignment]
    try:
        dqn.train(cfg, progress=False)
    finally:
        dqn.agent_replay = make  # type: ignore[assignment]
    buf = held["buf"]
    n = len(buf)
    raw = buf.priorities(np.arange(n)).astype(np.float32)
    ring = np.roll(raw, -buf.cursor) if n == buf.capacity else raw  # oldest first
    tds = np.concatenate(held["tds"])[-buffer_size:]
    return {"priorities": ring, "td": tds}


# -- codecs ----------------------------------------------------------------------------
def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def codec_rows(repeats: int, quick: bool) -> list[dict[str, Any]]:
    images = atari_stacks(64 if quick else 512, seed=1)
    vectors = cartpole_obs(1 << (13 if quick else 16), seed=1)
    data = {
        "image (4,84,84) uint8, 1 stack/block": [bytes(r) for r in images],
        "CartPole obs float32, 32 KiB blocks": [
            bytes(vectors[i : i + 2048]) for i in range(0, vectors.shape[0], 2048)
        ],
    }
    item = {"image": 1, "CartPole": 4}
    rows = []
    for name in available_codecs():
        codec = make_codec(name)
        for what, blocks in data.items():
            size = item[what.split()[0]]
            raw = sum(len(b) for b in blocks)
            packed = [codec.compress(b, size) for b in blocks]
            comp, dec = codec.compress, codec.decompress
            t_c = _median_time(lambda b=blocks, s=size, f=comp: [f(x, s) for x in b], repeats)
            t_d = _median_time(
                lambda p=packed, b=blocks, f=dec: [f(x, len(y)) for x, y in zip(p, b, strict=True)],
                repeats,
            )
            assert all(dec(x, len(y)) == y for x, y in zip(packed, blocks, strict=True))
            rows.append({
                "codec": name, "data": what, "ratio": raw / sum(len(p) for p in packed),
                "compress": raw / t_c / 1e6, "decompress": raw / t_d / 1e6,
            })  # fmt: skip
    return rows


# -- throughput --------------------------------------------------------------------------
class Run:
    """One buffer in the throughput test, with its priority layout.

    ``measured``: the CartPole run's final priorities in ring order (oldest
    first), stretched to the capacity, laid onto the slots by age (slot
    ``i`` of a just-filled buffer is the ``i``-th oldest); ``iid``: the same
    values in a random order (no locality: the pessimistic case); ``skewed``:
    ``iid`` with the priorities of a random ``SKEW_SHARE`` of the 64-slot
    chunks (the same chunks for the whole run) scaled so that their mass is
    ``SKEW_MASS`` times (91% of the mass in 15% of the data: a hot tier
    within a quarter of the data can hold 90% of it). In the loop, as in a
    DQN, an added transition gets the buffer's max priority and a sampled one
    a |TD| drawn from the run's last updates (times the chunk's scale).
    """

    def __init__(
        self, buf: PrioritizedReplayBuffer, prio: np.ndarray, td: np.ndarray, layout: str
    ) -> None:
        self.buf, self.layout, self.td = buf, layout, td
        n = buf.capacity
        stretched = prio[(np.arange(n) * prio.shape[0]) // n]  # oldest .. newest
        if layout in ("iid", "skewed"):
            stretched = np.random.default_rng(3).permutation(stretched)
        #: per slot, the scale of its priorities (None: 1)
        self.scale: np.ndarray | None = None
        if layout == "skewed":
            chunks = -(-n // 64)
            heavy = np.random.default_rng(4).choice(chunks, round(SKEW_SHARE * chunks), False)
            self.scale = np.where(np.isin(np.arange(n) // 64, heavy), SKEW_MASS ** (1 / ALPHA), 1.0)
            stretched = stretched * self.scale
        self.initial = stretched

    def draw_td(self, k: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(self.td, k)


def _fill(run: Run, stacks: np.ndarray) -> None:
    """Fill the buffer, then give every slot its priority (a run already under way)."""
    buf = run.buf
    rng = np.random.default_rng(5)
    k = 256
    for lo in range(0, buf.capacity, k):
        idx = (np.arange(lo, lo + k)) % stacks.shape[0]
        buf.add({
            "obs": stacks[idx], "action": rng.integers(0, 4, k), "reward": np.zeros(k, np.float32),
            "done": np.zeros(k, bool),
        })  # fmt: skip
    buf.update_priorities(np.arange(buf.capacity), run.initial)


def _loop(run: Run, stacks: np.ndarray, iters: int, seed: int) -> tuple[float, float]:
    """Seconds for ``iters`` of: add 4, sample 32, update 32: (whole loop, sample + update)."""
    buf = run.buf
    rng = np.random.default_rng(seed)
    adds = rng.integers(0, stacks.shape[0], (iters, 4))
    tds = run.draw_td(iters * 32, rng).reshape(iters, 32)
    act, rew, done = np.zeros(4, np.int64), np.zeros(4, np.float32), np.zeros(4, bool)
    clock = time.perf_counter
    in_sample = 0.0
    t0 = clock()
    for i in range(iters):
        buf.add({"obs": stacks[adds[i]], "action": act, "reward": rew, "done": done})
        t1 = clock()
        s = buf.sample(32)
        td = tds[i] if run.scale is None else tds[i] * run.scale[s.indices]
        buf.update_priorities(s.indices, td, keys=s.keys)
        in_sample += clock() - t1
    return clock() - t0, in_sample


def warm_row_cost(
    storage: TieredStorage, calls: int = 2000, ks: tuple[int, ...] = (0, 1, 2, 8, 32)
) -> dict[int, float]:
    """Median us of ``gather`` of 32 rows with k of them from warm chunks (k in ``ks``).

    Rows drawn at random from the hot / warm chunks as placed; no adds, no
    moves, nothing in the background: the price of a warm row in a gather.
    """
    storage.settle()
    rng = np.random.default_rng(11)
    hot = np.flatnonzero(storage._tier == HOT)
    hot = hot[hot != storage._open]
    warm = np.flatnonzero(storage._tier == WARM)
    cs = storage.chunk_size
    out = {}
    for k in ks if warm.size else ():
        sets = [
            np.concatenate(
                [rng.choice(hot, 32 - k) * cs + rng.integers(0, cs, 32 - k),
                 rng.choice(warm, k) * cs + rng.integers(0, cs, k)]
            )
            for _ in range(calls)
        ]  # fmt: skip
        times = []
        for ix in sets:
            t0 = time.perf_counter()
            storage.gather(ix)
            times.append(time.perf_counter() - t0)
        out[k] = statistics.median(times) * 1e6
    return out


def throughput_rows(
    args: argparse.Namespace, prio: np.ndarray, td: np.ndarray, tmp: str
) -> list[dict[str, Any]]:
    slots = args.slots
    stacks = atari_stacks(1024 if args.quick else 2048, seed=2)
    row_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in FIELDS.values())
    data = slots * row_bytes
    budget = data // 4
    rows = []
    for layout in args.layouts:
        # (name, hot share, warm share, prefetch): None, the default (with lz4's
        # compiled kernels: the background thread), or False (moves inline)
        configs: list[tuple[str, float, float, bool | None]] = [("RAM (all hot)", 1.0, 0.0, None)]
        for h in args.hot:
            if budget / data - h > 1e-9:
                configs.append((f"hot {h:.2f} + warm", h, budget / data - h, None))
                configs.append((f"hot {h:.2f} + warm, inline", h, budget / data - h, False))
            configs.append((f"hot {h:.2f}, no warm", h, 0.0, None))
        for h in args.big_hot if layout == "measured" else []:  # past the 1/4 budget
            configs.append((f"hot {h:.2f} + warm (budget > 1/4)", h, 0.05, None))
            configs.append((f"hot {h:.2f} + warm (budget > 1/4), inline", h, 0.05, False))
        runs: dict[str, Run] = {}
        for i, (name, hot, warm_share, prefetch) in enumerate(configs):
            storage = None
            if name != "RAM (all hot)":
                storage = TieredStorage(
                    FIELDS, slots, chunk_size=64, hot_bytes=int(hot * data),
                    warm_bytes=max(0, int(warm_share * data)),
                    cold_dir=os.path.join(tmp, f"{layout}-{i}"), prefetch=prefetch,
                )  # fmt: skip
            buf = PrioritizedReplayBuffer(
                slots, FIELDS, alpha=ALPHA, beta=0.4, seed=7, storage=storage
            )
            run = runs[name] = Run(buf, prio, td, layout)
            _fill(run, stacks)
            _loop(run, stacks, args.iters // 2, seed=99)  # warm-up: placement settles
            if storage is not None:
                storage.settle()
                storage._counts.update(dict.fromkeys(("rows_hot", "rows_warm", "rows_cold"), 0))
                storage._counts.update(
                    dict.fromkeys(("promotions", "demotions", "packs", "inline_packs"), 0)
                )
        loop_t: dict[str, list[float]] = {name: [] for name, *_ in configs}
        samp_t: dict[str, list[float]] = {name: [] for name, *_ in configs}
        for r in range(args.repeats):
            for name, *_ in configs:  # interleaved: a busy machine slows all alike
                gc.collect()
                whole, part = _loop(runs[name], stacks, args.iters, seed=r)
                loop_t[name].append(args.iters / whole)
                samp_t[name].append(args.iters / part)
        ram_loop = statistics.median(loop_t["RAM (all hot)"])
        ram_samp = statistics.median(samp_t["RAM (all hot)"])
        for name, hot, warm_share, prefetch in configs:
            storage = runs[name].buf.storage
            st = storage.stats() if isinstance(storage, TieredStorage) else None
            lp, sp = statistics.median(loop_t[name]), statistics.median(samp_t[name])
            rows.append({
                "layout": layout, "config": name, "hot": min(hot, 1.0), "stats": st,
                "budget": hot + warm_share, "loop_per_s": lp, "loop_ratio": lp / ram_loop,
                "sample_per_s": sp, "sample_ratio": sp / ram_samp,
                "moves": None if st is None else st["promotions"] + st["demotions"],
            })  # fmt: skip
            if isinstance(storage, TieredStorage):
                if "budget > 1/4" in name and prefetch is False:
                    rows[-1]["warm_cost"] = warm_row_cost(storage)
                storage.close()
        del runs
        gc.collect()
    return rows


def best_mass(prio: np.ndarray, alpha: float, chunk: int) -> dict[str, Any]:
    """The most mass any placement can put in a hot tier of a given share of the slots."""
    out: dict[str, Any] = {}
    for name, size in (("slot", 1), ("chunk", chunk)):
        a = prio.astype(np.float64) ** alpha
        m = np.sort(a[: a.shape[0] // size * size].reshape(-1, size).sum(axis=1))[::-1]
        c = np.cumsum(m) / m.sum()
        out[name] = {f: float(c[max(0, int(f * m.shape[0]) - 1)]) for f in (0.05, 0.1, 0.2, 0.25)}
        out[name]["for_0.9"] = float((np.searchsorted(c, 0.9) + 1) / m.shape[0])
    deciles = np.array([x.sum() for x in np.array_split(prio.astype(np.float64) ** alpha, 10)])
    out["deciles"] = deciles / deciles.sum()
    return out


# -- report ------------------------------------------------------------------------------
def priorities_of(checkpoint: Path) -> np.ndarray:
    """A saved buffer's raw priorities in ring order (oldest slot first), float32."""
    import fastper

    buf = fastper.load(checkpoint)
    n = len(buf)
    raw = np.asarray(buf.priorities(np.arange(n)), dtype=np.float32)
    return np.roll(raw, -buf.cursor) if n == buf.capacity else raw


def other_runs() -> dict[str, np.ndarray]:
    """Priorities saved with ``--priorities-of``: ``{name: priorities}``."""
    return {
        f.name.removesuffix("_priorities.npy"): np.load(f).astype(np.float64)
        for f in sorted((HERE / "data").glob("*_priorities.npy"))
        if f != PRIO_FILE
    }


def runs_summary(all_runs: list[list[dict[str, Any]]]) -> list[str]:
    """Markdown: per configuration, median (range) of the ratios to RAM over the runs;
    and in how many pairs (a configuration, default vs inline, same run) the thread won."""
    n = len(all_runs)
    lines = [
        "",
        f"## Over {n} runs (fresh buffers each run; medians, ranges in brackets)",
        "",
        "| layout | config | hot mass | sample vs RAM | loop vs RAM |",
        "|---|---|---:|---:|---:|",
    ]
    keys = [(r["layout"], r["config"]) for r in all_runs[0] if r["stats"] is not None]

    def ratios(key: tuple[str, str], what: str) -> list[float]:
        return [r[what] for run in all_runs for r in run if (r["layout"], r["config"]) == key]

    def show_range(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    for key in keys:
        mass = [
            r["stats"]["mass_fraction"]["hot"]
            for run in all_runs for r in run if (r["layout"], r["config"]) == key
        ]  # fmt: skip
        lines.append(
            f"| {key[0]} | {key[1]} | {statistics.median(mass):.3f} "
            f"| {show_range(ratios(key, 'sample_ratio'))} | {show_range(ratios(key, 'loop_ratio'))} |"
        )
    pairs = [
        (key, (key[0], key[1].removesuffix(", inline")))
        for key in keys
        if key[1].endswith(", inline")
    ]
    for what, label in (("loop_ratio", "loop"), ("sample_ratio", "sample + update")):
        won = total = 0
        for inline, default in pairs:
            for a, b in zip(ratios(default, what), ratios(inline, what), strict=True):
                total += 1
                won += a > b
        lines.append("")
        lines.append(
            f"Background thread (default) against inline moves, same configuration and run: "
            f"faster {label} in {won} of {total} pairs."
        )
    return lines


def report(
    codecs: list[dict[str, Any]], thr: list[dict[str, Any]], best: dict[str, Any],
    args: argparse.Namespace, secs: float, others: dict[str, dict[str, Any]] | None = None,
    all_runs: list[list[dict[str, Any]]] | None = None,
) -> str:  # fmt: skip
    lines = [
        "# Hot / warm / cold storage: codecs and throughput",
        "",
        f"`python -m benchmarks.tiers {' '.join(sys.argv[1:])}`".replace("  ", " "),
        f"on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{secs:.0f} s. Medians over {args.repeats} interleaved repeats; the machine is "
        "shared and noisy.",
        "",
        "Priorities: `python -m benchmarks.tiers --make-td` (about 90 s) trains Double DQN "
        "with proportional PER on CartPole-v1 (`fastper.agents.dqn`, repo defaults but "
        "total_steps=20000, buffer_size=8192, eval_every=0, seed 0) and saves its final raw "
        "priorities in ring order (oldest first, `benchmarks/data/cartpole_dqn_priorities.npy`) "
        "and the |TD| of its last 8192 updated rows (`benchmarks/data/cartpole_dqn_td.npy`).",
        "",
        "## Codecs (MB/s of raw data, one thread)",
        "",
        "| codec | data | ratio | compress MB/s | decompress MB/s |",
        "|---|---|---:|---:|---:|",
    ]
    for r in codecs:
        lines.append(
            f"| {r['codec']} | {r['data']} | {r['ratio']:.1f} | {r['compress']:.0f} "
            f"| {r['decompress']:.0f} |"
        )
    sl, ch = best["slot"], best["chunk"]
    lines += [
        "",
        "## How much mass can a hot tier hold? (measured priorities, alpha 0.6)",
        "",
        "Mass share of the heaviest slots (any placement, one slot at a time) and of the "
        "heaviest 64-slot chunks (what the storage places), against the hot tier's share "
        "of the slots:",
        "",
        "| unit | 0.05 | 0.10 | 0.20 | 0.25 | share needed for 0.90 |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {u} | {d[0.05]:.3f} | {d[0.1]:.3f} | {d[0.2]:.3f} | {d[0.25]:.3f} "
            f"| {d['for_0.9']:.3f} |"
            for u, d in (("slot", sl), ("64-slot chunk", ch))
        ],
        "",
        "Mass by age decile (oldest first): "
        + " ".join(f"{x:.3f}" for x in best["deciles"]).rstrip()
        + ": no recency locality in this run.",
    ]
    for name, b in (others or {}).items():
        lines += [
            "",
            f"Another run, `benchmarks/data/{name}_priorities.npy` ({b['n']} slots): "
            f"slots: {b['slot'][0.25]:.3f} of the mass in the heaviest quarter, "
            f"{b['slot']['for_0.9']:.3f} of them for 0.90; 64-slot chunks: "
            f"{b['chunk'][0.25]:.3f} in a quarter, {b['chunk']['for_0.9']:.3f} for 0.90; "
            "by age decile (oldest first): " + " ".join(f"{x:.3f}" for x in b["deciles"]),
        ]
    row_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in FIELDS.values())
    lines += [
        "",
        f"## Throughput against hot-tier size ({args.slots} slots x {row_bytes} B = "
        f"{args.slots * row_bytes / 2**20:.0f} MiB; RAM budget hot + warm = 1/4 of it "
        "unless marked)",
        "",
        "Loop: add 4 (max priority) + sample(32) + update_priorities(32) (|TD| drawn from "
        "the run's last updates). `sample/s`: loop iterations per second of time in "
        "`sample` + `update_priorities` only; `loop/s`: of the whole loop; both against the "
        "RAM buffer of the same layout in the same interleaved rounds. `hot`: hot tier as a "
        "share of the data; `mass`: the tree's mass share per tier (hot / warm / cold) at "
        "the end; `hits`: share of gathered rows served per tier; `moves`: promotions + "
        "demotions in the timed rounds; `packs`: chunks compressed in the background ahead of "
        "a demotion / on the spot by a demotion; `inline`: `prefetch=False` (moves made "
        "inline), else the default (with lz4's compiled kernels: a background thread decodes "
        "promotions and compresses the `pack_ahead` = 16 chunks next in line for "
        "demotion); "
        "`MiB h/w/c`: bytes per tier (warm: compressed in "
        "RAM, including copies kept for hot chunks; cold: files).",
        "",
        "| layout | config | hot | chunks h+w+c | mass h/w/c | hits h/w/c | MiB h/w/c "
        "| moves | packs | sample/s | vs RAM | loop/s | vs RAM |",
        "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in thr:
        st = r["stats"]
        tail = (
            f"| {r['sample_per_s']:.0f} | {r['sample_ratio']:.2f} "
            f"| {r['loop_per_s']:.0f} | {r['loop_ratio']:.2f} |"
        )
        if st is None:
            lines.append(
                f"| {r['layout']} | {r['config']} | 1.00 | - | 1/0/0 | 1/0/0 | - | - | - {tail}"
            )
            continue
        m, h, c, b = st["mass_fraction"], st["hit_rate"], st["chunks"], st["bytes"]
        lines.append(
            f"| {r['layout']} | {r['config']} | {r['hot']:.2f} | {c['hot']}+{c['warm']}+{c['cold']} "
            f"| {m['hot']:.3f}/{m['warm']:.3f}/{m['cold']:.3f} "
            f"| {h['hot']:.3f}/{h['warm']:.3f}/{h['cold']:.3f} "
            f"| {b['hot'] / 2**20:.0f}/{b['warm'] / 2**20:.1f}/{b['cold'] / 2**20:.1f} "
            f"| {r['moves']} | {st['packs']}/{st['inline_packs']} {tail}"
        )
    tiered = [r for r in thr if r["stats"] is not None]
    in_budget = [r for r in tiered if r["budget"] <= 0.25 + 1e-9]
    near = max(in_budget, key=lambda r: r["stats"]["mass_fraction"]["hot"], default=None)
    hit = [r for r in tiered if r["stats"]["mass_fraction"]["hot"] >= 0.9]
    lines += [
        "",
        "Layouts: `measured`: the CartPole run's priorities laid onto the slots by age, "
        "as the run's ring held them; `iid`: the same values in a random order (the "
        "pessimistic case); `skewed`: `iid` with a random "
        f"{SKEW_SHARE:.0%} of the 64-slot chunks given {SKEW_MASS:.0f}x the mass (their "
        "priorities and the |TD| written to them scaled by "
        f"{SKEW_MASS:.0f}^(1/alpha)): the target's condition made to hold, which the real "
        "runs' priorities do not reach (see the mass table).",
        "",
    ]
    if near is not None:
        lines.append(
            "Target (>= 0.70 of RAM sampling throughput where the hot tier holds >= 90% of "
            "the mass, data 4x the RAM budget): within the 1/4 budget the most hot mass was "
            f"{near['stats']['mass_fraction']['hot']:.3f} ({near['layout']}, {near['config']}, "
            f"sample {near['sample_ratio']:.2f}, loop {near['loop_ratio']:.2f} of RAM)."
        )
    for r in hit:
        lines.append(
            f"With >= 90% hot mass ({r['layout']}, {r['config']}: "
            f"{r['stats']['mass_fraction']['hot']:.3f}, RAM budget {r['budget']:.2f} of the "
            f"data): sample {r['sample_ratio']:.2f}, loop {r['loop_ratio']:.2f} of RAM."
        )
    if all_runs is not None and len(all_runs) > 1:
        lines += runs_summary(all_runs)
    for r in thr:
        if r.get("warm_cost"):
            lines += [
                "",
                f"Price of a warm row ({r['config']}): median us of one `gather` of 32 rows "
                "with k from warm chunks (no adds, nothing in the background): "
                + ", ".join(f"k={k}: {v:.0f}" for k, v in r["warm_cost"].items())
                + ".",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=8192)
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--runs", type=int, default=1,
        help="repeat the throughput measurement this many times: medians and ranges over them",
    )  # fmt: skip
    p.add_argument("--hot", type=float, nargs="+", default=[0.05, 0.10, 0.20, 0.25])
    p.add_argument(
        "--big-hot", type=float, nargs="*", default=[0.90],
        help="hot shares past the 1/4 budget (measured layout): where the hot mass reaches 0.9",
    )  # fmt: skip
    p.add_argument(
        "--layouts", nargs="+", default=["measured", "iid", "skewed"],
        choices=["measured", "iid", "skewed"],
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="a small smoke run; writes nothing")
    p.add_argument("--make-td", action="store_true", help=f"write {PRIO_FILE.name}, {TD_FILE.name}")
    p.add_argument(
        "--priorities-of", nargs=2, metavar=("CHECKPOINT", "NAME"),
        help="write data/NAME_priorities.npy from a saved buffer (fastper.load), oldest first",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.priorities_of:
        path = HERE / "data" / f"{args.priorities_of[1]}_priorities.npy"
        np.save(path, priorities_of(Path(args.priorities_of[0])))
        print(f"wrote {path}")
        return 0
    if args.make_td:
        TD_FILE.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        got = make_td()
        np.save(PRIO_FILE, got["priorities"])
        np.save(TD_FILE, got["td"])
        print(f"wrote {PRIO_FILE} and {TD_FILE} in {time.perf_counter() - t0:.0f} s")
        return 0
    if args.quick:
        args.slots, args.iters, args.repeats, args.hot, args.big_hot = 2048, 40, 1, [0.1], []
    elif args.out is None:
        args.out = HERE / "results" / "tiers.md"
    prio = np.load(PRIO_FILE).astype(np.float64)
    td = np.load(TD_FILE).astype(np.float64)
    t0 = time.perf_counter()
    codecs = codec_rows(args.repeats, args.quick)
    all_runs = []
    for _ in range(max(1, args.runs)):
        with tempfile.TemporaryDirectory(prefix="fastper-tiers-bench-") as tmp:
            all_runs.append(throughput_rows(args, prio, td, tmp))
    thr = all_runs[-1]
    others = {
        name: {**best_mass(p, ALPHA, 64), "n": p.shape[0]} for name, p in other_runs().items()
    }
    text = report(
        codecs, thr, best_mass(prio, ALPHA, 64), args, time.perf_counter() - t0, others, all_runs
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
