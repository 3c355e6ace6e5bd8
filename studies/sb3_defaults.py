"""SB3's DQN against fastper's PERDQN with the same hyper-parameters.

Three settings, each run by both algorithms over the same seeds:

* ``sb3-defaults``: SB3 2.x ``DQN``'s own defaults (1M-slot buffer, batch 32,
  learning rate 1e-4, target copied every 10,000 steps...) on CartPole-v1,
  50,000 steps;
* ``zoo-cartpole``: the RL Zoo's tuned DQN for CartPole-v1
  (rl-baselines3-zoo ``hyperparams/dqn.yml``), 30,000 steps (the Zoo: 50,000);
* ``zoo-acrobot``: the RL Zoo's tuned DQN for Acrobot-v1, 15,000 steps (the
  Zoo: 100,000, one gradient step per env step).

The budgets are cut from the Zoo's to fit a shared 2-core machine;
``--timesteps`` runs the Zoo's own.

PERDQN runs with the buffer's defaults: nothing is passed in
``replay_buffer_kwargs`` (``--buffer-kwargs`` overrides them, for screening
other settings). On ``sb3-defaults`` a third arm, ``perdqn-buffer``, divides
the IS weights by the buffer's largest (``weight_norm="buffer"``, the PER
paper's normalisation) instead of the batch's. Every run writes one small CSV: the training episodes'
returns averaged in 50 bins of the budget, then a greedy evaluation
(10 episodes on a separately seeded env) at the end.

    python studies/sb3_defaults.py run --setting zoo-cartpole --algo perdqn --seed 0
    python studies/sb3_defaults.py report          # summary.md and curves.png

The shell wrapper ``studies/sb3_defaults.sh`` runs the whole grid.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "docs" / "results" / "sb3"

#: the RL Zoo's tuned DQN settings (hyperparams/dqn.yml), verbatim
ZOO_CARTPOLE: dict[str, Any] = {
    "learning_rate": 2.3e-3,
    "batch_size": 64,
    "buffer_size": 100_000,
    "learning_starts": 1_000,
    "gamma": 0.99,
    "target_update_interval": 10,
    "train_freq": 256,
    "gradient_steps": 128,
    "exploration_fraction": 0.16,
    "exploration_final_eps": 0.04,
    "policy_kwargs": {"net_arch": [256, 256]},
}
ZOO_ACROBOT: dict[str, Any] = {
    "learning_rate": 6.3e-4,
    "batch_size": 128,
    "buffer_size": 50_000,
    "learning_starts": 0,
    "gamma": 0.99,
    "target_update_interval": 250,
    "train_freq": 4,
    "gradient_steps": -1,
    "exploration_fraction": 0.12,
    "exploration_final_eps": 0.1,
    "policy_kwargs": {"net_arch": [256, 256]},
}
#: setting -> (env id, env steps, DQN keyword arguments)
SETTINGS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "sb3-defaults": ("CartPole-v1", 50_000, {}),
    # the Zoo trains 50,000 and 100,000 steps: shortened to fit this study's CPU budget
    "zoo-cartpole": ("CartPole-v1", 30_000, ZOO_CARTPOLE),
    "zoo-acrobot": ("Acrobot-v1", 15_000, ZOO_ACROBOT),
}
#: "perdqn-buffer": PERDQN with the IS weights divided by the buffer's largest
#: (``weight_norm="buffer"``, the PER paper's and the buffer's earlier default)
ALGOS = ("dqn", "perdqn", "perdqn-buffer")
BINS = 50
EVAL_EPISODES = 10


def run_one(
    setting: str,
    algo: str,
    seed: int,
    out: Path,
    timesteps: int | None = None,
    buffer_kwargs: dict[str, Any] | None = None,
    tag: str | None = None,
) -> Path:
    """Train one run; write ``out/runs/<setting>/<algo|tag>_seed<seed>.csv``; return its path."""
    import gymnasium as gym
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.monitor import Monitor

    from fastper.compat.sb3 import PERDQN

    torch.set_num_threads(1)
    # SB3's logger makes a folder per learn(): $SB3_LOGDIR, else a new SB3-<date> in /tmp
    logs = tempfile.mkdtemp(prefix="sb3-defaults-logs-")
    os.environ["SB3_LOGDIR"] = logs
    env_id, default_steps, kwargs = SETTINGS[setting]
    steps = default_steps if timesteps is None else timesteps
    env = Monitor(gym.make(env_id))
    cls: Any = DQN if algo == "dqn" else PERDQN
    given = dict(buffer_kwargs or {})
    if algo == "perdqn-buffer":
        given.setdefault("weight_norm", "buffer")
    extra: dict[str, Any] = {"replay_buffer_kwargs": given} if algo != "dqn" and given else {}
    model = cls("MlpPolicy", env, seed=seed, verbose=0, **kwargs, **extra)
    start = time.perf_counter()
    model.learn(steps)
    seconds = time.perf_counter() - start
    eval_env = Monitor(gym.make(env_id))
    eval_env.reset(seed=10_000 + seed)
    returns, _ = evaluate_policy(
        model, eval_env, EVAL_EPISODES, deterministic=True, return_episode_rewards=True
    )

    ends = np.cumsum(env.get_episode_lengths())
    rets = np.asarray(env.get_episode_rewards(), dtype=np.float64)
    edges = np.linspace(0, steps, BINS + 1)
    which = np.clip(np.searchsorted(edges, ends, side="left") - 1, 0, BINS - 1)
    name = tag or algo
    path = out / "runs" / setting / f"{name}_seed{seed}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "step", "return", "episodes"])
        for b in range(BINS):
            sel = rets[which == b]
            mean = f"{sel.mean():.2f}" if sel.size else ""
            w.writerow(["train", int(edges[b + 1]), mean, int(sel.size)])
        for r in returns:
            w.writerow(["eval", steps, f"{float(r):.2f}", 1])
        w.writerow(["seconds", steps, f"{seconds:.1f}", 0])
    shutil.rmtree(logs, ignore_errors=True)
    return path


# -- report ---------------------------------------------------------------------------
def _read(path: Path) -> dict[str, Any]:
    steps, curve, evals, seconds = [], [], [], math.nan
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["kind"] == "train":
                steps.append(int(row["step"]))
                curve.append(float(row["return"]) if row["return"] else math.nan)
            elif row["kind"] == "eval":
                evals.append(float(row["return"]))
            elif row["kind"] == "seconds":
                seconds = float(row["return"])
    arr = np.array(curve)
    # a bin without an episode end carries the last mean forward (long episodes)
    for i in range(1, arr.size):
        if math.isnan(arr[i]):
            arr[i] = arr[i - 1]
    return {"steps": np.array(steps), "curve": arr, "eval": float(np.mean(evals)),
            "last10": float(np.nanmean(arr[-BINS // 10:])), "seconds": seconds}  # fmt: skip


def bootstrap_ci(
    values: np.ndarray, n_boot: int = 10_000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean over ``values`` (resampled with replacement)."""
    rng = np.random.default_rng(seed)
    values = np.asarray(values, dtype=np.float64)
    means = rng.choice(values, size=(n_boot, values.size), replace=True).mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _bootstrap_curve(curves: np.ndarray, n_boot: int = 2_000) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile-bootstrap band of the mean curve (NaN where no run has an episode yet)."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, curves.shape[0], size=(n_boot, curves.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # bins before the first episode end
        means = np.nanmean(curves[idx], axis=1)
        return np.nanquantile(means, 0.025, axis=0), np.nanquantile(means, 0.975, axis=0)


def collect(out: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{setting: {algo: [run, ...]}}`` from every CSV under ``out/runs``."""
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for setting in SETTINGS:
        for path in sorted((out / "runs" / setting).glob("*_seed*.csv")):
            algo = path.name.rsplit("_seed", 1)[0]
            run = _read(path)
            run["seed"] = int(path.stem.rsplit("_seed", 1)[1])
            found.setdefault(setting, {}).setdefault(algo, []).append(run)
    return found


def report(out: Path) -> str:
    """Write ``out/summary.md`` and ``out/curves.png``; return the summary text."""
    out.mkdir(parents=True, exist_ok=True)
    found = collect(out)
    lines = [
        "# SB3 DQN vs fastper PERDQN, same hyper-parameters",
        "",
        "Written by `python studies/sb3_defaults.py report` from the per-run CSVs in `runs/`.",
        "Final return: greedy (deterministic) policy after training, mean of "
        f"{EVAL_EPISODES} episodes on a separately seeded env, then averaged over seeds; "
        "95% percentile-bootstrap CI of the mean over seeds (10,000 resamples). "
        "Last 10%: mean training-episode return (epsilon-greedy) over the last tenth "
        "of the budget.",
        "",
        "| setting | env | steps | algorithm | seeds | final return (mean) | 95% CI | "
        "last 10% (mean) | 95% CI | per-seed final |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, algos in found.items():
        env_id, steps, _ = SETTINGS[setting]
        for algo, runs in sorted(algos.items()):
            runs = sorted(runs, key=lambda r: r["seed"])
            finals = np.array([r["eval"] for r in runs])
            lo, hi = bootstrap_ci(finals)
            lasts = np.array([r["last10"] for r in runs])
            llo, lhi = bootstrap_ci(lasts)
            per_seed = ", ".join(f"{v:.1f}" for v in finals)
            lines.append(
                f"| {setting} | {env_id} | {steps:,} | {algo} | {len(runs)} | "
                f"{finals.mean():.1f} | [{lo:.1f}, {hi:.1f}] | {lasts.mean():.1f} | "
                f"[{llo:.1f}, {lhi:.1f}] | {per_seed} |"
            )
    screen = sorted((out / "screen").glob("*/*_seed*.csv"))
    if screen:
        lines += [
            "",
            "## Screening runs (one seed, before the defaults were chosen)",
            "",
            "PERDQN with the IS weights divided by the buffer's largest (`per-buffer`, the "
            "buffer's earlier default) or the batch's largest (`per-batch`, the default "
            "now), eps 1e-6 both, next to SB3's DQN; `screen/<setting>/`. zoo-cartpole ran "
            "15,000 steps here.",
            "",
            "| setting | run | final return | last 10% |",
            "|---|---|---|---|",
        ]
        for path in screen:
            run = _read(path)
            lines.append(
                f"| {path.parent.name} | {path.stem} | {run['eval']:.1f} | {run['last10']:.1f} |"
            )
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    _plot(found, out / "curves.png")
    return text


def _plot(found: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 3.8), squeeze=False)
    for ax, (setting, algos) in zip(axes[0], found.items(), strict=True):
        env_id = SETTINGS[setting][0]
        for algo, runs in sorted(algos.items()):
            curves = np.stack([r["curve"] for r in runs])
            x = runs[0]["steps"] / 1000
            lo, hi = _bootstrap_curve(curves)
            label = {
                "dqn": "SB3 DQN",
                "perdqn": "fastper PERDQN",
                "perdqn-buffer": 'PERDQN, weight_norm="buffer"',
            }.get(algo, algo)
            seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(curves, axis=0)
            (line,) = ax.plot(x, mean, label=f"{label} ({seeds})")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(f"{setting} ({env_id})")
        ax.set_xlabel("environment steps (thousands)")
        ax.set_ylabel("training episode return")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Mean over seeds, shaded: 95% bootstrap CI of the mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train one (setting, algorithm, seed)")
    r.add_argument("--setting", choices=list(SETTINGS), required=True)
    r.add_argument("--algo", choices=ALGOS, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--timesteps", type=int, default=None, help="override the setting's budget")
    r.add_argument("--buffer-kwargs", default=None, help="JSON replay_buffer_kwargs (PERDQN)")
    r.add_argument("--tag", default=None, help="file name instead of the algorithm's")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p = sub.add_parser("report", help="summary.md and curves.png from the run CSVs")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.cmd == "run":
        kw = json.loads(args.buffer_kwargs) if args.buffer_kwargs else None
        path = run_one(args.setting, args.algo, args.seed, args.out, args.timesteps, kw, args.tag)
        print(path, os.path.getsize(path), "bytes")
    else:
        print(report(args.out))


if __name__ == "__main__":
    main()
