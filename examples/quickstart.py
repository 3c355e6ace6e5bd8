"""A complete PER loop on synthetic data: add, sample, learn, update, save, load.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import fastper


def main(steps: int = 2_000, seed: int = 0) -> fastper.PrioritizedReplayBuffer:
    fields = {
        "obs": ((4,), np.float32),
        "action": ((), np.int64),
        "reward": ((), np.float32),
        "next_obs": ((4,), np.float32),
        "terminated": ((), np.bool_),
        "truncated": ((), np.bool_),  # n-step windows must know how episodes end
    }
    buf = fastper.PrioritizedReplayBuffer(
        10_000,
        fields,
        alpha=0.6,
        beta=fastper.schedules.linear(0.4, 1.0, steps),  # annealed over sample() calls
        n_step=3,
        gamma=0.99,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    q = np.zeros(2)  # a toy "learner": one value per action
    obs = rng.standard_normal(4).astype(np.float32)
    for t in range(steps):
        action = int(rng.integers(2))
        next_obs = rng.standard_normal(4).astype(np.float32)
        terminated = bool(rng.random() < 0.05)
        truncated = not terminated and t % 200 == 199  # a time limit
        buf.add(
            {
                "obs": obs,
                "action": action,
                "reward": float(action),
                "next_obs": next_obs,
                "terminated": terminated,
                "truncated": truncated,
            }
        )
        done = terminated or truncated
        obs = rng.standard_normal(4).astype(np.float32) if done else next_obs
        if len(buf) >= 64 and t % 4 == 0:
            batch = buf.sample(32)
            target = batch["reward"] + batch["discount"] * q.max()
            td = target - q[batch["action"]]
            np.add.at(q, batch["action"], 0.01 * batch.weights * td)  # IS-weighted step
            buf.update_priorities(batch.indices, td, keys=batch.keys)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.fpk"
        buf.save(path)
        restored = fastper.load(path)
        assert np.array_equal(restored.sample(8).indices, buf.sample(8).indices)
    print(f"{len(buf)} transitions, max priority {buf.max_priority:.3f}, q = {q.round(3)}")
    return buf


if __name__ == "__main__":
    main()
