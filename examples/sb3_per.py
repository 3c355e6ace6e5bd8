"""Stable-Baselines3's DQN with fastper's prioritized replay, on CartPole-v1.

    python examples/sb3_per.py                       # 8,000 steps, then 10 greedy episodes
    python examples/sb3_per.py --timesteps 20000 --seed 1
    python examples/sb3_per.py --n-steps 1           # one-step returns (learns more slowly)

The only changes from SB3: ``from fastper.compat.sb3 import PERDQN`` instead
of ``from stable_baselines3 import DQN``, and the replay settings in
``replay_buffer_kwargs``. Hyperparameters: rl-zoo's DQN set for CartPole-v1
(learning rate 2.3e-3, batch 64, 128 gradient steps after every 256 env
steps, target network copied every 10 steps, exploration 1 -> 0.04 over the
first 16%) on a 64x64 network, plus 3-step returns (fastper's per-env
n-step windows) and PER (alpha 0.6, beta 0.4 annealed to 1 over the run;
IS weights normalised by the batch's largest, the SB3 buffer's default).

It prints the settings, the seconds spent in ``learn`` and the greedy
policy's mean return (and standard deviation) over 10 evaluation episodes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from stable_baselines3.common.evaluation import evaluate_policy

from fastper.compat.sb3 import PERDQN


def main(
    total_timesteps: int = 8_000, seed: int = 0, n_steps: int = 3, n_eval_episodes: int = 10
) -> tuple[Any, float, float]:
    """Train, then evaluate greedily. Returns (model, mean return, seconds spent learning)."""
    result = train_and_evaluate(total_timesteps, seed, n_steps, n_eval_episodes)
    return result[0], result[1], result[3]


def train_and_evaluate(
    total_timesteps: int, seed: int, n_steps: int, n_eval_episodes: int
) -> tuple[Any, float, float, float]:
    """Train, then evaluate greedily: (model, mean return, its std, seconds spent learning)."""
    model = PERDQN(
        "MlpPolicy",
        "CartPole-v1",
        learning_rate=2.3e-3,
        batch_size=64,
        buffer_size=100_000,
        learning_starts=1_000,
        gamma=0.99,
        target_update_interval=10,
        train_freq=256,
        gradient_steps=128,
        exploration_fraction=0.16,
        exploration_final_eps=0.04,
        n_steps=n_steps,
        policy_kwargs={"net_arch": [64, 64]},
        replay_buffer_kwargs={"alpha": 0.6, "beta": 0.4},
        seed=seed,
    )
    start = time.perf_counter()
    model.learn(total_timesteps)
    seconds = time.perf_counter() - start
    mean, std = evaluate_policy(model, model.get_env(), n_eval_episodes, deterministic=True)
    return model, float(mean), float(std), seconds


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=8_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny networks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    episodes = 10
    model, mean, std, seconds = train_and_evaluate(
        args.timesteps, args.seed, args.n_steps, episodes
    )
    print(
        f"PERDQN on CartPole-v1: {args.timesteps:,} steps, seed {args.seed}, "
        f"n_steps={args.n_steps}, torch threads {args.threads}"
    )
    print(f"learn(): {seconds:.1f} s")
    print(
        f"greedy mean return over {episodes} episodes: {mean:.1f} (std {std:.1f}; "
        "random play: about 22, the most: 500)"
    )
