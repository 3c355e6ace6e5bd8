"""Double DQN (optionally dueling) with uniform, proportional or rank-based replay.

One file, read top to bottom: hyperparameters, networks, the update, the loop.
The loss is the importance-sampling-weighted Huber loss of the Double DQN
target ``r + discount * Q_target(s', argmax_a Q(s', a))``; the absolute TD
errors go back to the buffer as priorities, with the sample's keys so that
errors for slots overwritten meanwhile are dropped. Beta rises linearly to 1
over all the training's sample calls (``beta_schedule``: or along a cosine;
the options beyond the paper's are described in :mod:`.replay`). With
``n_step > 1`` the buffer stores n-step returns and the bootstrap
``discount`` (gamma^m, or 0 on termination).

Several envs (``num_envs``) are stepped together, one n-step window each;
``total_steps``, ``learning_starts``, ``train_freq`` and the exploration
schedule count environment steps of all envs together. Image observations
(3-D, e.g. MinAtar's 10x10xC grids) get MinAtar's small CNN. Every
``eval_every`` steps and at the end, ``eval_episodes`` greedy episodes on a
separate environment go to ``evaluations.csv``.

Needs the ``agents`` extra (torch, gymnasium); MinAtar ids the ``minatar`` extra.
"""

from __future__ import annotations

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
    linear_epsilon,
    make_vec_env,
    phases_due,
    resolve_network,
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


@dataclass
class DQNConfig:
    """Hyperparameters of Double DQN (defaults tuned for CartPole-v1)."""

    env_id: str = "CartPole-v1"  # Gymnasium environment with a Discrete action space
    total_steps: int = 50_000  # environment steps to train for, all envs together
    num_envs: int = 1  # envs stepped together (a sync vector env), one n-step stream each
    replay: str = "per"  # "uniform", "per" (proportional) or "rank"
    seed: int = 0  # seeds torch, the envs (env i: seed + i), exploration and the buffer
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
    network: str = "auto"  # "mlp", "cnn" (MinAtar's) or "auto" (cnn for 3-D observations)
    hidden: tuple[int, ...] = (128, 128)  # hidden layer widths of the MLP Q-network
    dueling: bool = False  # dueling value / advantage heads
    max_grad_norm: float = 10.0  # gradient norm clip
    alpha: float | None = None  # priority exponent (None: paper default of the replay kind)
    beta0: float | None = None  # initial IS exponent, annealed to 1 (None: paper default)
    priority_eps: float = 1e-6  # p_i = |delta_i| + priority_eps
    beta_schedule: str = "linear"  # beta0 -> 1 over the run: "linear" or "cosine" (half-cosine)
    weight_norm: str = "buffer"  # IS weights / their max over the "buffer" (paper) or the "batch"
    alpha_end: float | None = None  # alpha moves linearly to this over the run (None: constant)
    switch_at: float = 0.0  # replay="rank": proportional from this share of total_steps (0: never)
    priority_noise_late: float = 0.0  # sigma of |td| * exp(sigma z) from the switch on (0: none)
    grad_clip_is: float = 0.0  # also clip grad norm at this x batch max IS weight (0: off)
    new_priority: str = "ever"  # new p: max "ever" (paper), held now "max_td", last batch "last_td"
    eval_every: int = 5_000  # environment steps between evaluations (0: none, not even at the end)
    eval_episodes: int = 5  # episodes per evaluation
    eval_epsilon: float = 0.0  # random-action rate in evaluation (0: greedy)
    eval_max_steps: int = 27_000  # cap on an evaluation episode's length (MinAtar has no limit)
    device: str = "cpu"  # torch device
    checkpoint_every: int = 25_000  # env steps between checkpoints in the run's directory (0: none)

    def __post_init__(self) -> None:
        check_config(
            self,
            positive=("total_steps", "buffer_size", "batch_size", "lr", "train_freq",
                      "gradient_steps", "target_update", "tau"),
            fractions=("gamma", "tau", "eps_start", "eps_end", "eps_fraction", "eval_epsilon"),
        )  # fmt: skip


class _Head(nn.Module):
    """Q-values from features: a linear head, or with ``dueling`` V(s) + A(s, a) - mean_a A."""

    def _make_head(self, width: int, n_actions: int, dueling: bool) -> None:
        self.dueling = dueling
        if dueling:
            self.value = nn.Linear(width, 1)
            self.advantage = nn.Linear(width, n_actions)
        else:
            self.head = nn.Linear(width, n_actions)

    def _q(self, h: Any) -> Any:
        if not self.dueling:
            return self.head(h)
        adv = self.advantage(h)
        return self.value(h) + adv - adv.mean(dim=1, keepdim=True)


class QNetwork(_Head):
    """MLP Q-network over flattened observations (any dtype, read as float32)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: tuple[int, ...], dueling: bool):
        super().__init__()
        layers: list[nn.Module] = []
        last = obs_dim
        for width in hidden:
            layers += [nn.Linear(last, width), nn.ReLU()]
            last = width
        self.body = nn.Sequential(*layers)
        self._make_head(last, n_actions, dueling)

    def forward(self, x: Any) -> Any:
        return self._q(self.body(x.float().reshape(x.shape[0], -1)))


class ConvQNetwork(_Head):
    """MinAtar's Q-network for (height, width, channels) observations (Young & Tian 2019).

    Conv2d(C, 16, 3, stride 1) -> ReLU -> flatten -> Linear(16 (H-2) (W-2), 128)
    -> ReLU -> Q-values (for MinAtar's 10x10 grids: 16 * 8 * 8 = 1024 features).
    Observations arrive channels last, as MinAtar and Gymnasium image spaces
    give them, in their own dtype (MinAtar: bool); they are read as float32,
    uint8 images scaled to [0, 1].
    """

    def __init__(self, obs_shape: tuple[int, ...], n_actions: int, dueling: bool):
        super().__init__()
        h, w, c = (int(d) for d in obs_shape)
        self.body = nn.Sequential(
            nn.Conv2d(c, 16, kernel_size=3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * (h - 2) * (w - 2), 128),
            nn.ReLU(),
        )
        self._make_head(128, n_actions, dueling)

    def forward(self, x: Any) -> Any:
        scale = 1.0 / 255.0 if x.dtype == torch.uint8 else 1.0
        image = x.float().permute(0, 3, 1, 2) * scale  # (N, H, W, C) -> (N, C, H, W)
        return self._q(self.body(image))


def make_q_network(cfg: DQNConfig, obs_shape: tuple[int, ...], n_actions: int) -> _Head:
    """The Q-network ``cfg.network`` asks for (``"auto"``: CNN for 3-D observations)."""
    if resolve_network(cfg.network, obs_shape, cfg.env_id) == "cnn":
        return ConvQNetwork(obs_shape, n_actions, cfg.dueling)
    return QNetwork(int(np.prod(obs_shape)), n_actions, tuple(cfg.hidden), cfg.dueling)


def greedy_policy(
    q: nn.Module, device: Any, epsilon: float = 0.0, rng: np.random.Generator | None = None
) -> Callable[[np.ndarray], np.ndarray]:
    """Observations (a batch) -> argmax_a Q(obs, a) per row, as int64.

    With ``epsilon`` > 0 each row takes a uniformly random action with that
    probability, drawn from ``rng`` (keep it apart from training's generators).
    """
    gen = rng if rng is not None else np.random.default_rng()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            q_values = q(torch.as_tensor(obs, device=device))
        actions = q_values.argmax(dim=1).cpu().numpy().astype(np.int64)
        if epsilon > 0:
            explore = gen.random(len(actions)) < epsilon
            actions[explore] = gen.integers(q_values.shape[1], size=int(explore.sum()))
        return actions

    return act


def td_step(
    q: nn.Module,
    q_target: nn.Module,
    optimizer: Any,
    batch: dict[str, Any],
    gamma: float,
    max_grad_norm: float,
    grad_clip_is: float = 0.0,
) -> tuple[Any, float]:
    """One gradient step on a batch from ``SampleBatch.to_torch``.

    Returns the absolute TD errors (detached, one per sample) and the loss.
    The loss is ``mean_i w_i * huber(delta_i)``: the IS weights scale each
    sample's gradient, as in Algorithm 1 of the paper. The gradient norm is
    clipped at ``max_grad_norm``, or at ``grad_clip_is`` times the batch's
    largest IS weight where that is smaller (``grad_clip_is`` > 0, see
    :mod:`.replay`).
    """
    obs = batch["obs"]  # in the stored dtype: the networks read it as float32
    actions = batch["action"].long().reshape(-1, 1)
    reward = batch["reward"].float()
    next_obs = batch["next_obs"]
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
    nn.utils.clip_grad_norm_(q.parameters(), clip_threshold(max_grad_norm, grad_clip_is, weights))
    optimizer.step()
    return delta.detach().abs(), float(loss.item())


def train(
    config: DQNConfig,
    out_dir: str | Path | None = None,
    progress: bool = True,
    resume: bool = False,
) -> RunResult:
    """Train Double DQN on ``config.env_id``; log episodes and evaluations to ``out_dir``.

    Runs ``total_steps // num_envs`` steps of the ``num_envs`` envs together.
    Each env explores on its own (epsilon-greedy, one draw per env); a
    training phase of ``gradient_steps`` updates comes at every multiple of
    ``train_freq`` environment steps past ``learning_starts``, so the
    updates per environment step do not depend on ``num_envs``.

    With ``checkpoint_every`` > 0 and ``out_dir``, the run checkpoints itself
    into ``out_dir/checkpoints/`` every ``checkpoint_every`` environment steps
    and at its end; ``resume=True`` continues from the newest checkpoint
    there, and the run ends exactly as an uninterrupted one would (see
    :mod:`fastper.agents.resume`).

    Returns:
        The :class:`RunResult`: episode returns and the steps they ended at,
        and the evaluations.

    Raises:
        ValueError: an action space that is not Discrete, or a ``network``
            that does not fit the observations.
        ImportError: a MinAtar id without the minatar package.
        ResumeError: ``resume`` without a checkpoint in ``out_dir``, with one
            of another config, or with a damaged one.
    """
    cfg = config
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)  # exploration
    envs: Any = make_vec_env(cfg.env_id, cfg.num_envs)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    if type(action_space).__name__ != "Discrete":
        envs.close()
        raise ValueError(f"DQN needs a Discrete action space, got {action_space} for {cfg.env_id}")
    obs_shape = tuple(int(d) for d in obs_space.shape)
    n_actions = int(action_space.n)
    device = torch.device(cfg.device)

    q = make_q_network(cfg, obs_shape, n_actions).to(device)
    q_target = make_q_network(cfg, obs_shape, n_actions).to(device)
    q_target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=cfg.lr, foreach=True)
    # evaluation draws (eval_epsilon > 0) from its own generator: training is not disturbed
    eval_rng = np.random.default_rng([cfg.seed, 1])
    evaluate = greedy_policy(q, device, cfg.eval_epsilon, eval_rng)
    agent = AgentParts(
        modules={"q": q, "q_target": q_target},
        optimizers={"adam": optimizer},
        generators={"explore": rng, "eval": eval_rng},
    )

    try:
        saved = None if not resume else read_checkpoint(_out_dir(out_dir), "dqn", cfg)
        buffer = agent_replay(cfg, envs) if saved is None else saved.buffer
        run = Collector("dqn", cfg, envs, buffer, out_dir, progress, saved=saved)
    except BaseException:  # a refused resume: nothing is left open
        envs.close()
        raise
    k = cfg.num_envs
    iterations = vector_steps(cfg)
    grad_steps = 0
    if saved is not None:
        agent.load(saved.state)  # torch's generator too: after everything that draws from it
        grad_steps = int(saved.meta["counters"]["grad_steps"])
    decay = int(cfg.eps_fraction * cfg.total_steps)
    for it in range(run.iteration + 1, iterations + 1):
        step = it * k  # environment steps once this step of every env is taken
        eps = linear_epsilon(step, cfg.eps_start, cfg.eps_end, decay)
        explore = rng.random(k) < eps
        actions = np.empty(k, dtype=np.int64)
        if explore.any():
            actions[explore] = rng.integers(n_actions, size=int(explore.sum()))
        if not explore.all():
            with torch.no_grad():
                x = torch.as_tensor(run.obs[~explore], device=device)
                actions[~explore] = q(x).argmax(dim=1).cpu().numpy()
        run.step(step, actions)

        # len(buffer) > 0: with n_step > 1 the first n - 1 steps store nothing yet
        phases = phases_due(step, k, cfg.learning_starts, cfg.train_freq) if len(buffer) else 0
        for _ in range(phases):
            for _ in range(cfg.gradient_steps):
                sample = buffer.sample(cfg.batch_size)
                abs_td, loss = td_step(
                    q, q_target, optimizer, sample.to_torch(device), cfg.gamma,
                    cfg.max_grad_norm, cfg.grad_clip_is,
                )  # fmt: skip
                buffer.update_priorities(sample.indices, abs_td, keys=sample.keys)
                grad_steps += 1
                if grad_steps % cfg.target_update == 0:
                    with torch.no_grad():
                        for p, tp in zip(q.parameters(), q_target.parameters(), strict=True):
                            tp.lerp_(p, cfg.tau)
            if grad_steps % 100 < cfg.gradient_steps:
                run.log.scalar("train/loss", loss, step)
                run.log.scalar("train/beta", buffer.beta, step)
        run.maybe_evaluate(step, evaluate, final=it == iterations)
        if it < iterations:
            run.maybe_checkpoint(agent, {"grad_steps": grad_steps})
    run.checkpoint(agent, {"grad_steps": grad_steps}, final=True)
    return run.close()
