"""Stable-Baselines3's DQN with fastper's prioritized replay, on CartPole-v1.

    python examples/sb3_per.py                       # 6,000 steps, then 10 greedy episodes
    python examples/sb3_per.py --timesteps 20000 --seed 1
    python examples/sb3_per.py --n-steps 1           # one-step returns (learns more slowly)

The only changes from SB3: ``from fastper.compat.sb3 import PERDQN`` instead
of ``from stable_baselines3 import DQN``, and the replay settings in
``replay_buffer_kwargs``. Hyperparameters: rl-zoo's DQN set for CartPole-v1
(learning rate 2.3e-3, batch 64, 128 gradient steps after every 256 env
steps, target network copied every 10 steps, exploration 1 -> 0.04 over the
first 16%) on a 64x64 network, plus 3-step returns (fastper's per-env
n-step windows) and PER (alpha 0.6, beta 0.4 annealed to 1 over the run).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from stable_baselines3.common.evaluation import evaluate_policy

from fastper.compat.sb3 import PERDQN


def main(
    total_timesteps: int = 6_000, seed: int = 0, n_steps: int = 3, n_eval_episodes: int = 10
) -> tuple[Any, float, float]:
    """Train, then evaluate greedily. Returns (model, mean return, seconds spent learning)."""
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
    mean, _ = evaluate_policy(model, model.get_env(), n_eval_episodes, deterministic=True)
    return model, float(mean), seconds


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=6_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny networks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, mean, seconds = main(args.timesteps, args.seed, args.n_steps)
    print(f"learned in {seconds:.1f} s; greedy mean return {mean:.1f} (random play: about 22)")
