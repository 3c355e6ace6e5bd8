"""Frame streams: memory per slot and the cost of stacking at sample time.

Usage:
    python benchmarks/frames.py [--capacity 20000] [--calls 2000] [--out FILE.md]

Atari-shaped data: 84x84 uint8 frames, stacks of 4, uint8 actions, float32
rewards, terminated / truncated, episodes of ~400 steps from 4 envs
(``n_envs=4``). Two proportional buffers hold the same transitions:

* ``frames``: ``frame_stack={"obs": 4}``, one frame per step;
* ``plain``: ``obs`` and ``next_obs`` as full ``(4, 84, 84)`` fields.

``sample(32)`` (draws, weights, gather; stacks assembled for ``frames``)
takes turns between the two, so a busy machine slows both alike; the figures
are medians in microseconds and their ratio. Memory per slot is the buffer's
``nbytes()`` (data + index) over the capacity, and the formula for 1M slots.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from fastper import PrioritizedReplayBuffer
from fastper._bench import cpu_name
from fastper.frames import default_frame_capacity

FRAME = (84, 84)
K = 4
ENVS = 4


def fields(stacked: bool) -> dict[str, tuple[tuple[int, ...], object]]:
    shape = (K, *FRAME) if stacked else FRAME
    return {
        "obs": (shape, np.uint8), "next_obs": (shape, np.uint8), "action": ((), np.uint8),
        "reward": ((), np.float32), "terminated": ((), np.bool_), "truncated": ((), np.bool_),
    }  # fmt: skip


def fill(capacity: int, seed: int = 0) -> tuple[PrioritizedReplayBuffer, PrioritizedReplayBuffer]:
    rng = np.random.default_rng(seed)
    fb = PrioritizedReplayBuffer(
        capacity, fields(False), frame_stack={"obs": K}, n_envs=ENVS, seed=1
    )
    pb = PrioritizedReplayBuffer(capacity, fields(True), seed=1)
    stacks = np.zeros((ENVS, K, *FRAME), dtype=np.uint8)
    steps = capacity // ENVS + 1
    for _ in range(steps):
        new = rng.integers(0, 256, (ENVS, *FRAME), dtype=np.uint8)
        nxt = np.concatenate([stacks[:, 1:], new[:, None]], axis=1)
        done = rng.random(ENVS) < 1 / 400
        row = {
            "action": rng.integers(0, 18, ENVS).astype(np.uint8),
            "reward": rng.random(ENVS).astype(np.float32),
            "terminated": done,
            "truncated": np.zeros(ENVS, dtype=bool),
        }
        fb.add({"obs": stacks[:, -1], "next_obs": new, **row})
        pb.add({"obs": stacks, "next_obs": nxt, **row})
        stacks = np.where(done[:, None, None, None], 0, nxt)
    return fb, pb


def time_samples(bufs: dict[str, PrioritizedReplayBuffer], calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in bufs}
    for _ in range(calls):
        for name, buf in bufs.items():
            t0 = time.perf_counter()
            s = buf.sample(32)
            times[name].append(time.perf_counter() - t0)
            buf.update_priorities(s.indices, np.abs(s.weights) + 0.1, keys=s.keys)
    return {k: float(np.median(v)) * 1e6 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--calls", type=int, default=2_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    fb, pb = fill(args.capacity)
    s_f, s_p = fb.sample(32), pb.sample(32)  # warm up (compiles kernels)
    assert s_f.data["obs"].shape == s_p.data["obs"].shape == (32, K, *FRAME)
    med = time_samples({"frames": fb, "plain": pb}, args.calls)
    per = {}
    for name, buf in (("frames", fb), ("plain", pb)):
        nb = buf.nbytes()
        per[name] = (nb["data"] + nb["index"]) / args.capacity
    big = 1_000_000
    fbig = default_frame_capacity(big)
    frame = int(np.prod(FRAME))
    index = fb.nbytes()["index"] / args.capacity
    at_1m = (fbig + 1) * frame + fbig * 16 + big * (16 + 1 + 4 + 1 + 1) + index * big
    lines = [
        "# Frame streams: memory and sample cost",
        "",
        f"`python benchmarks/frames.py --capacity {args.capacity} --calls {args.calls}` on "
        f"{cpu_name()}, {time.strftime('%Y-%m-%d')}; "
        "84x84 uint8 frames, stacks of 4, 4 envs, episodes of ~400 steps.",
        "",
        "| buffer | bytes per slot (data + index) | sample(32) median, us |",
        "|---|---:|---:|",
        f"| frames (`frame_stack={{'obs': 4}}`) | {per['frames']:,.0f} | {med['frames']:,.0f} |",
        f"| plain `(4, 84, 84)` fields | {per['plain']:,.0f} | {med['plain']:,.0f} |",
        "",
        f"Ratio frames / plain for sample(32): **{med['frames'] / med['plain']:.2f}x** "
        "(medians of calls taking turns).",
        "",
        f"At 1M slots (default frame_capacity = {fbig:,}): {at_1m / 1e9:.3f} GB "
        f"({at_1m / big:,.1f} bytes per slot: {frame} per frame x {fbig / big:.4f} frames "
        f"per slot, 16 per frame of links, 16 of frame ids + 7 of other fields, "
        f"{index:.1f} of priorities and trees).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
