"""n-step prioritized replay fed by a Gymnasium vector env (8 CartPoles).

    python examples/vector_env.py

Each ``envs.step`` is one step of every env: with ``n_envs=8`` the buffer keeps
one n-step window per env (row i = env i). Gymnasium >= 1.0 vector envs reset
an env on the step *after* its episode ended ("next_step" autoreset): that
row is not a transition, and ``autoreset="next_step"`` drops it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import fastper
from fastper.nstep import autoreset_mode
from fastper.spaces import fields_from_spaces


def main(steps: int = 2_000, n_envs: int = 8, seed: int = 0) -> fastper.PrioritizedReplayBuffer:
    envs = gym.make_vec("CartPole-v1", num_envs=n_envs, vectorization_mode="sync")
    buf = fastper.PrioritizedReplayBuffer(
        100_000,
        fields_from_spaces(envs.single_observation_space, envs.single_action_space),
        n_step=3,
        gamma=0.99,
        n_envs=n_envs,
        autoreset=autoreset_mode(envs),  # "next_step"; SAME_STEP envs are refused
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    for t in range(steps):
        actions = rng.integers(0, 2, n_envs)  # your policy here
        next_obs, rewards, terminated, truncated, _ = envs.step(actions)
        buf.add({"obs": obs, "action": actions, "reward": rewards, "next_obs": next_obs,
                 "terminated": terminated, "truncated": truncated})  # fmt: skip
        obs = next_obs
        if len(buf) >= 256 and t % 4 == 0:
            batch = buf.sample(64)  # random order; n-step returns in batch["reward"]
            td = rng.standard_normal(64)  # your learner's TD errors here
            buf.update_priorities(batch.indices, td, keys=batch.keys)
    envs.close()
    print(f"{len(buf)} transitions from {n_envs} envs, {buf.n_pending} waiting for their "
          f"window, {buf.n_dropped} reset rows dropped")  # fmt: skip
    return buf


if __name__ == "__main__":
    main()
