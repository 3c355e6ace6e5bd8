"""Wall-clock cost of each replay scheme per environment step, in the MinAtar study's set-up.

Usage:
    python -m benchmarks.agent_cost [--env MinAtar/Breakout-v0] [--steps 3000]
                                    [--learning-starts 500] [--repeats 3] [--out FILE.md]

Double DQN with MinAtar's CNN as ``studies/minatar.sh`` runs it (replay
100k, batch 32, one gradient step per environment step, Adam 2.5e-4, one
torch thread), for ``--steps`` steps of which all after ``--learning-starts``
train; no evaluation, no checkpoints; one untimed warm-up run per scheme
first (numba compilation). The three schemes take turns, so a
busy machine slows them alike; the figures are medians over ``--repeats``
of the seconds per 1,000 training steps (the run's time after learning
starts, from its episode log) and their ratio to uniform. The study's own
run times (``summary.json``) are not used: runs were paused and resumed
while the machine was shared.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import tempfile
import time
from pathlib import Path

SCHEMES = ("uniform", "per", "rank")


def one_run(env: str, replay: str, steps: int, learning_starts: int, seed: int) -> float:
    """Seconds per 1,000 environment steps after ``learning_starts`` (from the episode log)."""
    import torch

    from fastper.agents import dqn

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fastper-agent-cost-") as out:
        cfg = dqn.DQNConfig(
            env_id=env, replay=replay, total_steps=steps, seed=seed, buffer_size=100_000,
            batch_size=32, lr=2.5e-4, learning_starts=learning_starts, train_freq=1,
            target_update=1000, tau=1.0, eps_end=0.1, eps_fraction=1.0, eval_every=0,
            checkpoint_every=0,
        )  # fmt: skip
        t0 = time.perf_counter()
        dqn.train(cfg, out_dir=Path(out), progress=False)
        total = time.perf_counter() - t0
        with open(Path(out) / "episodes.csv") as f:
            rows = list(csv.DictReader(f))
    # the episode that ends first after learning starts marks the start of the timed part
    after = [r for r in rows if int(r["step"]) >= learning_starts]
    if not after:
        return total / steps * 1000
    first = after[0]
    t_start, s_start = float(first["wall_s"]), int(first["step"])
    t_end = total
    return (t_end - t_start) / max(1, steps - s_start) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="MinAtar/Breakout-v0")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--learning-starts", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    for s in SCHEMES:  # warm-up: imports, numba compilation, torch's first steps
        one_run(args.env, s, args.learning_starts + 200, args.learning_starts, seed=99)
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for r in range(args.repeats):
        for s in SCHEMES:  # interleaved
            times[s].append(one_run(args.env, s, args.steps, args.learning_starts, seed=r))
    med = {s: statistics.median(v) for s, v in times.items()}
    lines = [
        f"# Cost per environment step: uniform vs proportional vs rank-based ({args.env})",
        "",
        f"`python -m benchmarks.agent_cost --env {args.env} --steps {args.steps} "
        f"--learning-starts {args.learning_starts} --repeats {args.repeats}` on "
        f"{platform.machine()}, Python {platform.python_version()}, one torch thread, "
        f"{time.perf_counter() - t0:.0f} s; the schemes take turns; medians over "
        f"{args.repeats} runs (seeds 0..{args.repeats - 1}).",
        "",
        "| scheme | s per 1,000 training steps (median) | runs | vs uniform |",
        "|---|---:|---|---:|",
    ]
    for s in SCHEMES:
        runs = ", ".join(f"{x:.2f}" for x in times[s])
        lines.append(f"| {s} | {med[s]:.2f} | {runs} | {med[s] / med['uniform']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
