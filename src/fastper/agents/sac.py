"""Soft Actor-Critic (twin Q, automatic entropy tuning) with uniform or prioritized replay.

One file, read top to bottom: hyperparameters, networks, the update, the loop.

Where the IS weights go: they scale each sample's term in the critic loss and
in the actor loss (both are expectations over the replay distribution, which
prioritization biases), but not the entropy-temperature loss, whose target
is the policy's entropy, not a value estimated from replay.

Which TD error becomes the priority: the mean of the two critics' absolute
errors against their shared target. Both critics are regressed on every
sample, so a sample matters as long as either still has something to learn
from it; the mean tracks the critic loss being minimised, while the minimum
would hide a sample one critic still gets badly wrong and the maximum would
let a single noisy critic dominate.

Several envs (``num_envs``) are stepped together, one n-step window each;
``total_steps``, ``learning_starts`` and ``train_freq`` count environment
steps of all envs together. Every ``eval_every`` steps and at the end,
``eval_episodes`` deterministic episodes (the policy's mean action) on a
separate environment go to ``evaluations.csv``. Observations must be flat
(1-D); image observations are for the DQN agent.

Needs the ``agents`` extra (torch, gymnasium).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    Collector,
    RunResult,
    agent_replay,
    check_config,
    make_vec_env,
    phases_due,
    vector_steps,
)
from .replay import clip_threshold
from .resume import AgentParts
from .resume import out_dir_of as _out_dir
from .resume import read as read_checkpoint

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastper's agents need PyTorch and Gymnasium: pip install 'fastper[agents]'"
    ) from exc

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclass
class SACConfig:
    """Hyperparameters of SAC (defaults tuned for Pendulum-v1)."""

    env_id: str = "Pendulum-v1"  # Gymnasium environment with Box actions and flat observations
    total_steps: int = 15_000  # environment steps to train for, all envs together
    num_envs: int = 1  # envs stepped together (a sync vector env), one n-step stream each
    replay: str = "per"  # "uniform", "per" (proportional) or "rank"
    seed: int = 0  # seeds torch, the envs (env i: seed + i), warm-up actions and the buffer
    buffer_size: int = 100_000  # replay capacity (transitions)
    batch_size: int = 256  # transitions per gradient step
    actor_lr: float = 3e-4  # Adam step size of the policy
    critic_lr: float = 1e-3  # Adam step size of the twin Q-networks
    alpha_lr: float = 1e-3  # Adam step size of the log entropy temperature
    gamma: float = 0.99  # discount factor
    tau: float = 0.005  # Polyak averaging rate of the target critics
    n_step: int = 1  # n-step returns (1 = plain one-step targets)
    learning_starts: int = 1_000  # random-action steps before learning
    train_freq: int = 1  # environment steps between training phases
    gradient_steps: int = 1  # gradient steps per training phase
    hidden: tuple[int, ...] = (64, 64)  # hidden layer widths of every network
    init_temperature: float = 1.0  # initial entropy temperature
    target_entropy: float | None = None  # None: -(action dimension)
    alpha: float | None = None  # priority exponent (None: paper default of the replay kind)
    beta0: float | None = None  # initial IS exponent, annealed to 1 (None: paper default)
    priority_eps: float = 1e-6  # p_i = |delta_i| + priority_eps
    beta_schedule: str = "linear"  # beta0 -> 1 over the run: "linear" or "cosine" (half-cosine)
    weight_norm: str = "buffer"  # IS weights / their max over the "buffer" (paper) or the "batch"
    alpha_end: float | None = None  # alpha moves linearly to this over the run (None: constant)
    switch_at: float = 0.0  # replay="rank": proportional from this share of total_steps (0: never)
    priority_noise_late: float = 0.0  # sigma of |td| * exp(sigma z) from the switch on (0: none)
    grad_clip_is: float = 0.0  # clip critics' grad norm at this x batch max IS weight (0: off)
    new_priority: str = "ever"  # new p: max "ever" (paper), held now "max_td", last batch "last_td"
    eval_every: int = 1_500  # environment steps between evaluations (0: none, not even at the end)
    eval_episodes: int = 5  # episodes per evaluation (deterministic: the mean action)
    eval_max_steps: int = 27_000  # cap on an evaluation episode's length
    device: str = "cpu"  # torch device
    checkpoint_every: int = 25_000  # env steps between checkpoints in the run's directory (0: none)

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=("total_steps", "buffer_size", "batch_size", "actor_lr", "critic_lr",
                      "alpha_lr", "train_freq", "gradient_steps", "init_temperature"),
            fractions=("gamma", "tau"),
        )  # fmt: skip


def mlp(inp: int, out: int, hidden: tuple[int, ...]) -> Any:
    layers: list[Any] = []
    last = inp
    for width in hidden:
        layers += [nn.Linear(last, width), nn.ReLU()]
        last = width
    layers.append(nn.Linear(last, out))
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """Tanh-squashed Gaussian policy, rescaled to the action box."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...], low: Any, high: Any):
        super().__init__()
        self.net = mlp(obs_dim, 2 * act_dim, hidden)
        self.scale: torch.Tensor
        self.bias: torch.Tensor
        self.register_buffer("scale", torch.as_tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("bias", torch.as_tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, obs: Any, deterministic: bool = False) -> tuple[Any, Any]:
        mean, log_std = self.net(obs).chunk(2, dim=-1)
        log_std = torch.clamp(log_std, LOG_STD_MIN, LOG_STD_MAX)
        std = log_std.exp()
        u = mean if deterministic else mean + std * torch.randn_like(mean)
        a = torch.tanh(u)
        # log N(u; mean, std) minus the log-Jacobian of tanh and of the rescaling
        log_prob = (-0.5 * ((u - mean) / std).pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(
            -1
        )
        log_prob = log_prob - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1)
        log_prob = log_prob - torch.log(self.scale).sum()
        return a * self.scale + self.bias, log_prob


class TwinQ(nn.Module):
    """Two independent Q(s, a) networks."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1, hidden)
        self.q2 = mlp(obs_dim + act_dim, 1, hidden)

    def forward(self, obs: Any, act: Any) -> tuple[Any, Any]:
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


@dataclass
class SACState:
    """Networks, optimisers and the entropy temperature of one SAC learner."""

    actor: Any
    critic: Any
    critic_target: Any
    log_temp: Any
    actor_opt: Any
    critic_opt: Any
    temp_opt: Any
    target_entropy: float


def update(
    st: SACState, batch: dict[str, Any], gamma: float, tau: float, grad_clip_is: float = 0.0
) -> tuple[Any, dict[str, float]]:
    """One SAC gradient step on a batch from ``SampleBatch.to_torch``.

    Returns the per-sample priorities' TD errors (mean of the two critics'
    absolute errors, detached) and the three losses. ``grad_clip_is`` > 0
    clips the critics' gradient norm at ``grad_clip_is`` times the batch's
    largest IS weight (see :mod:`.replay`); the actor's is not clipped.
    """
    obs = batch["obs"].float()
    act = batch["action"].float()
    reward = batch["reward"].float()
    next_obs = batch["next_obs"].float()
    if "discount" in batch:  # n-step buffers store gamma^m (0 on termination)
        discount = batch["discount"].float()
    else:
        discount = gamma * (1.0 - batch["terminated"].float())
    w = batch["weights"].float()
    temp = st.log_temp.exp().detach()

    with torch.no_grad():
        next_act, next_logp = st.actor(next_obs)
        t1, t2 = st.critic_target(next_obs, next_act)
        target = reward + discount * (torch.min(t1, t2) - temp * next_logp)
    q1, q2 = st.critic(obs, act)
    d1, d2 = q1 - target, q2 - target
    critic_loss = (w * (d1.pow(2) + d2.pow(2))).mean() * 0.5
    st.critic_opt.zero_grad(set_to_none=True)
    critic_loss.backward()
    if grad_clip_is:
        limit = clip_threshold(math.inf, grad_clip_is, w)
        nn.utils.clip_grad_norm_(st.critic.parameters(), limit)
    st.critic_opt.step()

    new_act, logp = st.actor(obs)
    p1, p2 = st.critic(obs, new_act)
    actor_loss = (w * (temp * logp - torch.min(p1, p2))).mean()
    st.actor_opt.zero_grad(set_to_none=True)
    actor_loss.backward()
    st.actor_opt.step()

    # unweighted: the temperature tracks the policy's entropy, not a replay estimate
    temp_loss = -(st.log_temp * (logp.detach() + st.target_entropy)).mean()
    st.temp_opt.zero_grad(set_to_none=True)
    temp_loss.backward()
    st.temp_opt.step()

    with torch.no_grad():
        for p, tp in zip(st.critic.parameters(), st.critic_target.parameters(), strict=True):
            tp.mul_(1.0 - tau).add_(p, alpha=tau)
    td = 0.5 * (d1.detach().abs() + d2.detach().abs())
    losses = {
        "critic": float(critic_loss.item()),
        "actor": float(actor_loss.item()),
        "temperature": float(temp.item()),
    }
    return td, losses


def make_state(
    obs_dim: int, act_dim: int, low: Any, high: Any, cfg: SACConfig, device: Any
) -> SACState:
    actor = Actor(obs_dim, act_dim, tuple(cfg.hidden), low, high).to(device)
    critic = TwinQ(obs_dim, act_dim, tuple(cfg.hidden)).to(device)
    critic_target = TwinQ(obs_dim, act_dim, tuple(cfg.hidden)).to(device)
    critic_target.load_state_dict(critic.state_dict())
    for p in critic_target.parameters():
        p.requires_grad_(False)
    log_temp = torch.tensor(math.log(cfg.init_temperature), device=device, requires_grad=True)
    target_entropy = -float(act_dim) if cfg.target_entropy is None else cfg.target_entropy
    return SACState(
        actor=actor,
        critic=critic,
        critic_target=critic_target,
        log_temp=log_temp,
        actor_opt=torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr, foreach=True),
        critic_opt=torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr, foreach=True),
        temp_opt=torch.optim.Adam([log_temp], lr=cfg.alpha_lr),
        target_entropy=target_entropy,
    )


def deterministic_policy(actor: Actor, device: Any) -> Callable[[np.ndarray], np.ndarray]:
    """Observations (a batch) -> the policy's mean action per row, squashed and rescaled.

    Draws no random numbers, so evaluating does not move torch's generator.
    """

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.as_tensor(obs, dtype=torch.float32, device=device).reshape(len(obs), -1)
            return actor(x, deterministic=True)[0].cpu().numpy()

    return act


def train(
    config: SACConfig,
    out_dir: str | Path | None = None,
    progress: bool = True,
    resume: bool = False,
) -> RunResult:
    """Train SAC on ``config.env_id``; log episodes and evaluations to ``out_dir``.

    Runs ``total_steps // num_envs`` steps of the ``num_envs`` envs together;
    actions are uniformly random until ``learning_starts`` environment
    steps, then sampled from the policy. A training phase of
    ``gradient_steps`` updates comes at every multiple of ``train_freq``
    environment steps past ``learning_starts``.

    With ``checkpoint_every`` > 0 and ``out_dir``, the run checkpoints itself
    into ``out_dir/checkpoints/`` every ``checkpoint_every`` environment steps
    and at its end; ``resume=True`` continues from the newest checkpoint
    there, and the run ends exactly as an uninterrupted one would (see
    :mod:`fastper.agents.resume`).

    Returns:
        The :class:`RunResult`: episode returns and the steps they ended at,
        and the evaluations.

    Raises:
        ValueError: an action space that is not Box, or observations that
            are not flat (1-D).
        ResumeError: ``resume`` without a checkpoint in ``out_dir``, with one
            of another config, or with a damaged one.
    """
    cfg = config
    torch.manual_seed(cfg.seed)
    envs: Any = make_vec_env(cfg.env_id, cfg.num_envs)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    if type(action_space).__name__ != "Box":
        envs.close()
        raise ValueError(f"SAC needs a Box action space, got {action_space} for {cfg.env_id}")
    if len(getattr(obs_space, "shape", None) or ()) != 1:
        envs.close()
        raise ValueError(
            f"SAC needs flat (1-D Box) observations, got {obs_space} for {cfg.env_id}; "
            "image observations are for the DQN agent (its CNN)"
        )
    obs_dim = int(obs_space.shape[0])
    act_shape = tuple(action_space.shape)
    act_dim = int(np.prod(act_shape))
    low = np.asarray(action_space.low, dtype=np.float64).reshape(-1)
    high = np.asarray(action_space.high, dtype=np.float64).reshape(-1)
    device = torch.device(cfg.device)
    st = make_state(obs_dim, act_dim, low, high, cfg, device)
    evaluate = deterministic_policy(st.actor, device)

    agent = AgentParts(
        modules={"actor": st.actor, "critic": st.critic, "critic_target": st.critic_target},
        optimizers={"actor": st.actor_opt, "critic": st.critic_opt, "temperature": st.temp_opt},
        tensors={"log_temp": st.log_temp},
    )
    try:
        saved = None if not resume else read_checkpoint(_out_dir(out_dir), "sac", cfg)
        buffer = agent_replay(cfg, envs) if saved is None else saved.buffer
        run = Collector("sac", cfg, envs, buffer, out_dir, progress, saved=saved)
    except BaseException:  # a refused resume: nothing is left open
        envs.close()
        raise
    k = cfg.num_envs
    iterations = vector_steps(cfg)
    grad_steps = 0
    if saved is not None:
        agent.load(saved.state)  # torch's generator too: after everything that draws from it
        grad_steps = int(saved.meta["counters"]["grad_steps"])
    for it in range(run.iteration + 1, iterations + 1):
        step = it * k  # environment steps once this step of every env is taken
        if step <= cfg.learning_starts:
            actions = run.random_actions().astype(np.float32)
        else:
            with torch.no_grad():
                x = torch.as_tensor(run.obs, dtype=torch.float32, device=device).reshape(k, -1)
                actions = st.actor(x)[0].cpu().numpy().reshape(k, *act_shape)
        run.step(step, actions)

        # len(buffer) > 0: with n_step > 1 the first n - 1 steps store nothing yet
        phases = phases_due(step, k, cfg.learning_starts, cfg.train_freq) if len(buffer) else 0
        for _ in range(phases):
            for _ in range(cfg.gradient_steps):
                sample = buffer.sample(cfg.batch_size)
                td, losses = update(
                    st, sample.to_torch(device), cfg.gamma, cfg.tau, cfg.grad_clip_is
                )
                buffer.update_priorities(sample.indices, td, keys=sample.keys)
                grad_steps += 1
            if grad_steps % 200 < cfg.gradient_steps:
                for name, value in losses.items():
                    run.log.scalar(f"train/{name}", value, step)
        run.maybe_evaluate(step, evaluate, final=it == iterations)
        if it < iterations:
            run.maybe_checkpoint(agent, {"grad_steps": grad_steps})
    run.checkpoint(agent, {"grad_steps": grad_steps}, final=True)
    return run.close()
