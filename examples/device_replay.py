"""Prioritized replay that never leaves the GPU: add, sample, learn, update, save, load.

The learner fits Q(s, a) on a contextual bandit (reward = obs[action] plus
noise; every step ends the episode, so the target is the reward): eight
environments step at once, their transitions are added as device tensors, and
the sampled batch, its IS weights and the new priorities stay on the device.
Runs on CUDA when there is one, else on the CPU device.

Run: python examples/device_replay.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

import fastper
import fastper.device as fd


def main(
    steps: int = 600, seed: int = 0, device: str | None = None
) -> tuple[list[float], fd.DevicePrioritizedReplayBuffer]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    n_envs, n_actions, batch_size = 8, 4, 128
    fields = {
        "obs": ((n_actions,), np.float32),
        "action": ((), np.int64),
        "reward": ((), np.float32),
    }
    buf = fd.DevicePrioritizedReplayBuffer(
        50_000, fields, device=dev, alpha=0.6,
        beta=fastper.schedules.linear(0.4, 1.0, steps), seed=seed,
    )  # fmt: skip
    q = torch.nn.Sequential(
        torch.nn.Linear(n_actions, 64), torch.nn.ReLU(), torch.nn.Linear(64, n_actions)
    ).to(dev)
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    gen = torch.Generator(device=dev).manual_seed(seed)
    losses = []
    for _ in range(steps):
        obs = torch.randn(n_envs, n_actions, generator=gen, device=dev)
        with torch.no_grad():
            greedy = q(obs).argmax(1)
        explore = torch.rand(n_envs, generator=gen, device=dev) < 0.3
        action = torch.where(
            explore, torch.randint(0, n_actions, (n_envs,), generator=gen, device=dev), greedy
        )
        reward = obs.gather(1, action[:, None])[:, 0] + 0.1 * torch.randn(
            n_envs, generator=gen, device=dev
        )
        buf.add({"obs": obs, "action": action, "reward": reward})
        if len(buf) < batch_size:
            continue
        batch = buf.sample(batch_size)  # tensors on `dev`; weights float32
        pred = q(batch["obs"]).gather(1, batch["action"][:, None])[:, 0]
        td = batch["reward"] - pred
        loss = (batch.weights * td.pow(2)).mean()  # IS weights correct the sampling bias
        opt.zero_grad()
        loss.backward()
        opt.step()
        buf.update_priorities(batch.indices, td.detach(), keys=batch.keys)
        losses.append(float(td.detach().pow(2).mean()))  # the demo's logging syncs, not the buffer
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.fpk"
        buf.save(path)  # pickle-free, as the CPU buffers' checkpoints
        again = fd.load(path, device=dev)
        assert torch.equal(again.sample(8).indices, buf.sample(8).indices)
    return losses, buf


if __name__ == "__main__":
    losses, buf = main()
    print(
        f"{buf!r}\nloss: first 100 steps {np.mean(losses[:100]):.4f}, last 100 {np.mean(losses[-100:]):.4f}"
    )
