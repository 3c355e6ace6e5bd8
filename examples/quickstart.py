# A complete prioritized replay loop on synthetic data: add, sample, learn, update, save, load.
# Run: python examples/quickstart.py
import tempfile
from pathlib import Path

import numpy as np

import fastper

fields = {  # name: (shape of one transition's value, dtype)
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "terminated": ((), np.bool_),
}
steps = 2_000
buf = fastper.PrioritizedReplayBuffer(
    10_000,
    fields,
    alpha=0.6,  # how much priorities count (0: uniform)
    beta=fastper.schedules.linear(0.4, 1.0, steps),  # IS correction, annealed to 1
    seed=0,
)
rng = np.random.default_rng(0)
q = np.zeros(2)  # a toy learner: one value per action
for t in range(steps):
    obs, next_obs = rng.standard_normal((2, 4), dtype=np.float32)
    action = int(rng.integers(2))
    buf.add({"obs": obs, "action": action, "reward": float(action),
             "next_obs": next_obs, "terminated": rng.random() < 0.05})  # fmt: skip
    if len(buf) >= 64 and t % 4 == 0:
        batch = buf.sample(32)  # drawn by priority, with IS weights
        target = batch["reward"] + 0.99 * q.max() * ~batch["terminated"]
        td = target - q[batch["action"]]
        np.add.at(q, batch["action"], 0.01 * batch.weights * td)  # IS-weighted step
        buf.update_priorities(batch.indices, td, keys=batch.keys)  # |td| -> priority

with tempfile.TemporaryDirectory() as tmp:  # a scratch folder, removed afterwards
    path = Path(tmp) / "replay.fpk"
    buf.save(path)  # pickle-free and checksummed
    restored = fastper.load(path)  # same rows, priorities and random state
    assert np.array_equal(restored.sample(8).indices, buf.sample(8).indices)
print(f"{len(buf)} transitions, max priority {buf.max_priority:.3f}, q = {q.round(3)}")
