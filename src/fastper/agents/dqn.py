"""Double DQN (optionally dueling) with uniform, proportional or rank-based replay.

One file, read top to bottom: hyperparameters, network, the training loop.
The loss is the importance-sampling-weighted Huber loss of the Double DQN
target ``r + discount * Q_target(s', argmax_a Q(s', a))``; the absolute TD
errors go back to the buffer as priorities, with the sample's keys so that
errors for slots overwritten meanwhile are dropped. Beta rises linearly to 1
over all the training's sample calls. With ``n_step > 1`` the buffer stores
n-step returns and the bootstrap ``discount`` (gamma^m, or 0 on termination).

Needs the ``agents`` extra (torch, gymnasium).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._common import Collector, RunResult, agent_replay, check_config, linear_epsilon

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastper's agents need PyTorch and Gymnasium: pip install 'fastper[agents]'"
    ) from exc


@dataclass
class DQNConfig:
    """Hyperparameters of Double DQN (defaults tuned for CartPole-v1)."""

    env_id: str = "CartPole-v1"  # Gymnasium environment with a Discrete action space
    total_steps: int = 50_000  # environment steps to train for
    replay: str = "per"  # "uniform", "per" (proportional) or "rank"
    seed: int = 0  # seeds torch, the environment, exploration and the buffer
    buffer_size: int = 50_000  # replay capacity (transitions)
    batch_size: int = 128  # transitions per gradient step
    lr: float = 5e-4  # Adam step size
    gamma: float = 0.99  # discount factor
    n_step: int = 1  # n-step returns (1 = plain one-step targets)
    learning_starts: int = 1_000  # environment steps before the first gradient step
    train_freq: int = 2  # environment steps between training phases
    gradient_steps: int = 1  # gradient steps per training phase
    target_update: int = 1  # gradient steps between target-network updates
    tau: float = 0.01  # target update rate: 1 copies, < 1 moves the target by tau (Polyak)
    eps_start: float = 1.0  # initial exploration rate
    eps_end: float = 0.01  # final exploration rate
    eps_fraction: float = 0.1  # share of total_steps over which exploration decays
    hidden: tuple[int, ...] = (128, 128)  # hidden layer widths of the Q-network
    dueling: bool = False  # dueling value / advantage heads
    max_grad_norm: float = 10.0  # gradient norm clip
    alpha: float | None = None  # priority exponent (None: paper default of the replay kind)
    beta0: float | None = None  # initial IS exponent, annealed to 1 (None: paper default)
    priority_eps: float = 1e-6  # p_i = |delta_i| + priority_eps
    device: str = "cpu"  # torch device

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=("total_steps", "buffer_size", "batch_size", "lr", "train_freq",
                      "gradient_steps", "target_update", "tau"),
            fractions=("gamma", "tau", "eps_start", "eps_end", "eps_fraction"),
        )  # fmt: skip


class QNetwork(nn.Module):
    """MLP Q-network; with ``dueling`` the head is V(s) + A(s, a) - mean_a A(s, a)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: tuple[int, ...], dueling: bool):
        super().__init__()
        layers: list[nn.Module] = []
        last = obs_dim
        for width in hidden:
            layers += [nn.Linear(last, width), nn.ReLU()]
            last = width
        self.body = nn.Sequential(*layers)
        self.dueling = dueling
        if dueling:
            self.value = nn.Linear(last, 1)
            self.advantage = nn.Linear(last, n_actions)
        else:
            self.head = nn.Linear(last, n_actions)

    def forward(self, x: Any) -> Any:
        h = self.body(x)
        if not self.dueling:
            return self.head(h)
        adv = self.advantage(h)
        return self.value(h) + adv - adv.mean(dim=1, keepdim=True)


def td_step(
    q: QNetwork,
    q_target: QNetwork,
    optimizer: Any,
    batch: dict[str, Any],
    gamma: float,
    max_grad_norm: float,
) -> tuple[Any, float]:
    """One gradient step on a batch from ``SampleBatch.to_torch``.

    Returns the absolute TD errors (detached, one per sample) and the loss.
    The loss is ``mean_i w_i * huber(delta_i)``: the IS weights scale each
    sample's gradient, as in Algorithm 1 of the paper.
    """
    obs = batch["obs"].float()
    actions = batch["action"].long().reshape(-1, 1)
    reward = batch["reward"].float()
    next_obs = batch["next_obs"].float()
    if "discount" in batch:  # n-step buffers store gamma^m (0 on termination)
        discount = batch["discount"].float()
    else:
        discount = gamma * (1.0 - batch["terminated"].float())
    with torch.no_grad():
        best = q(next_obs).argmax(dim=1, keepdim=True)  # Double DQN: online net picks
        next_value = q_target(next_obs).gather(1, best).squeeze(1)  # target net rates
        target = reward + discount * next_value
    q_sa = q(obs).gather(1, actions).squeeze(1)
    delta = q_sa - target
    weights = batch["weights"].float()
    loss = (weights * F.smooth_l1_loss(q_sa, target, reduction="none")).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(q.parameters(), max_grad_norm)
    optimizer.step()
    return delta.detach().abs(), float(loss.item())


def train(config: DQNConfig, out_dir: str | Path | None = None, progress: bool = True) -> RunResult:
    """Train Double DQN on ``config.env_id``; log episodes to ``out_dir``.

    Returns:
        The :class:`RunResult` (episode returns and the steps they ended at).
    """
    import gymnasium as gym

    cfg = config
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    env: Any = gym.make(cfg.env_id)
    if type(env.action_space).__name__ != "Discrete":
        raise ValueError(
            f"DQN needs a Discrete action space, got {env.action_space} for {cfg.env_id}"
        )
    obs_dim = int(np.prod(env.observation_space.shape))
    n_actions = int(env.action_space.n)
    device = torch.device(cfg.device)

    q = QNetwork(obs_dim, n_actions, tuple(cfg.hidden), cfg.dueling).to(device)
    q_target = QNetwork(obs_dim, n_actions, tuple(cfg.hidden), cfg.dueling).to(device)
    q_target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=cfg.lr, foreach=True)

    buffer = agent_replay(cfg, env)
    run = Collector("dqn", cfg, env, buffer, out_dir, progress)
    grad_steps = 0
    decay = int(cfg.eps_fraction * cfg.total_steps)
    for step in range(1, cfg.total_steps + 1):
        eps = linear_epsilon(step, cfg.eps_start, cfg.eps_end, decay)
        if rng.random() < eps:
            action = int(rng.integers(n_actions))
        else:
            with torch.no_grad():
                x = torch.as_tensor(run.obs, dtype=torch.float32, device=device).reshape(1, -1)
                action = int(q(x).argmax(dim=1).item())
        run.step(step, action)

        if step > cfg.learning_starts and step % cfg.train_freq == 0 and len(buffer) > 0:
            for _ in range(cfg.gradient_steps):
                sample = buffer.sample(cfg.batch_size)
                abs_td, loss = td_step(
                    q, q_target, optimizer, sample.to_torch(device), cfg.gamma, cfg.max_grad_norm
                )
                buffer.update_priorities(sample.indices, abs_td, keys=sample.keys)
                grad_steps += 1
                if grad_steps % cfg.target_update == 0:
                    with torch.no_grad():
                        for p, tp in zip(q.parameters(), q_target.parameters(), strict=True):
                            tp.lerp_(p, cfg.tau)
            if grad_steps % 100 < cfg.gradient_steps:
                run.log.scalar("train/loss", loss, step)
                run.log.scalar("train/beta", buffer.beta, step)
    return run.close()
