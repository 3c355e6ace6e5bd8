"""Soft Actor-Critic with n-step prioritized replay on a Gymnasium vector env, in one file.

    python examples/sac_per.py                      # Pendulum-v1, 4 envs, ~2-3 min on a CPU
    python examples/sac_per.py --env-id HalfCheetah-v5 --total-timesteps 1000000 \\
        --learning-starts 10000 --hidden 256 --device cuda  # pip install 'gymnasium[mujoco]'
    python examples/sac_per.py --help                       # every argument

What it shows: the same fastper pieces as ``examples/dqn_per.py``, for
continuous actions.

* ``n_envs=num_envs`` and ``autoreset=autoreset_mode(envs)``: one n-step
  window per env; the row Gymnasium returns when it resets an env (the step
  after the episode ended) is dropped by the buffer, not stored;
* ``n_step=3``: ``reward`` holds the discounted 3-step return and
  ``discount`` the bootstrap factor (gamma^m, 0 after a termination), so the
  soft target is ``reward + discount * (min(Q1', Q2') - temperature * log pi)``
  at ``next_obs``. Pendulum never terminates: its 200-step episodes are
  truncated, and a truncated window still bootstraps (with gamma^m, m <= 3);
* PER: the priority of a sample is the mean of the two critics' absolute TD
  errors against their shared target (both critics regress on every sample,
  so it stays high while either still has something to learn from it); the
  importance-sampling weights scale the critic loss, the regression whose
  expectation prioritization biases. The actor and temperature losses use the
  sampled states unweighted, a common choice (the project's
  ``fastper.agents.sac`` weights the actor loss too). Beta rises linearly
  from 0.4 to 1 over all the run's ``sample`` calls;
* automatic entropy tuning: the temperature is learned so that the policy's
  entropy stays near ``-(action dimension)``.

The layout follows CleanRL's single-file scripts: the arguments, the env
factory, the networks, then one training loop. ``total_timesteps`` and
``learning_starts`` count environment steps of all envs together; each
``envs.step`` is followed by ``gradient_steps`` updates (by default one per
env step). It prints a line every ``--log-every`` steps: the mean return of
the episodes that ended since the last line, beta, the temperature, the mean
|TD error|, the critic loss and the steps per second. ``main(argv)`` returns
a summary (returns seen, updates, losses, the buffer), which is what
``tests/unit/test_cleanrl_examples.py`` checks.

Needs torch and gymnasium (``pip install 'fastper[agents]'``).
"""

import argparse
import dataclasses
import math
import time
import typing
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fastper
from fastper.nstep import autoreset_mode
from fastper.spaces import fields_from_spaces


def arg(default: Any, help: str) -> Any:
    """A field of ``Args`` with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    # experiment
    seed: int = arg(1, "seeds torch, the random actions, the envs' first reset and the buffer")
    device: str = arg("cpu", "torch device: cpu, cuda, cuda:1, ...")
    log_every: int = arg(2_000, "print a progress line every this many env steps")
    # environment
    env_id: str = arg("Pendulum-v1", "Gymnasium env id with a Box action space")
    num_envs: int = arg(4, "envs stepped together (gym.make_vec, sync)")
    total_timesteps: int = arg(10_000, "env steps of all envs together")
    max_episode_steps: int = arg(0, "cut episodes after this many steps (0: the env's limit)")
    # replay
    buffer_size: int = arg(100_000, "replay capacity in transitions")
    n_step: int = arg(3, "n-step returns (1: one-step targets)")
    per_alpha: float = arg(0.6, "priority exponent (0: uniform replay)")
    per_beta_start: float = arg(0.4, "initial importance-sampling exponent, annealed to 1")
    priority_eps: float = arg(1e-6, "priority = |TD error| + priority_eps")
    # learning
    gamma: float = arg(0.99, "discount factor")
    tau: float = arg(0.005, "Polyak rate of the target critics")
    batch_size: int = arg(256, "transitions per gradient step")
    hidden: int = arg(128, "width of the two hidden layers of every network")
    learning_starts: int = arg(1_000, "env steps of random actions before learning")
    gradient_steps: int = arg(4, "gradient steps after each envs.step")
    policy_lr: float = arg(3e-4, "Adam step size of the actor")
    q_lr: float = arg(1e-3, "Adam step size of the critics")
    autotune: bool = arg(True, "learn the entropy temperature")
    temperature: float = arg(0.2, "initial (or, without --autotune, fixed) temperature")


def parse_args(argv: list[str] | None = None) -> Args:
    """``--kebab-case`` flags for every field of ``Args`` (booleans: --x / --no-x)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hints = typing.get_type_hints(Args)
    for f in dataclasses.fields(Args):
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        doc = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc
            )
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=doc, metavar=kind.__name__)
    return Args(**vars(parser.parse_args(argv)))


def make_envs(env_id: str, num_envs: int, max_episode_steps: int) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` stepped in this process, recording episode returns."""
    limit = max_episode_steps if max_episode_steps > 0 else None  # None: the env's own
    envs = gym.make_vec(
        env_id, num_envs=num_envs, vectorization_mode="sync", max_episode_steps=limit
    )
    # adds infos["episode"]["r"] / ["l"] and the mask infos["_episode"] when an episode ends
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)


class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim + act_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.network(torch.cat([obs, action], dim=1)).squeeze(1)


LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """A Gaussian squashed by tanh, then scaled to the action box."""

    scale: torch.Tensor
    center: torch.Tensor

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, low: Any, high: Any):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)
        self.register_buffer("scale", torch.as_tensor((high - low) / 2, dtype=torch.float32))
        self.register_buffer("center", torch.as_tensor((high + low) / 2, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled action (reparameterised, so gradients flow) and its log-probability."""
        h = self.trunk(obs)
        mean = self.mean(h)
        log_std = self.log_std(h).clamp(LOG_STD_MIN, LOG_STD_MAX)
        noise = torch.randn_like(mean)
        u = mean + log_std.exp() * noise  # reparameterised sample of N(mean, std)
        log_prob = -0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        # change of variables: log|d tanh(u)/du| = 2 (log 2 - u - softplus(-2u)), stable for large |u|
        log_prob = log_prob - 2 * (math.log(2) - u - F.softplus(-2 * u))
        log_prob = log_prob.sum(1) - torch.log(self.scale).sum()
        return torch.tanh(u) * self.scale + self.center, log_prob


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    # seeding: torch here, the envs by their first reset, the buffer by its seed
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    # env setup
    envs = make_envs(args.env_id, args.num_envs, args.max_episode_steps)
    assert isinstance(envs.single_action_space, gym.spaces.Box), "needs a Box action space"
    envs.action_space.seed(args.seed)  # the random actions before learning_starts
    obs_dim = gym.spaces.flatdim(envs.single_observation_space)
    act_dim = gym.spaces.flatdim(envs.single_action_space)
    low = envs.single_action_space.low.astype(np.float64)
    high = envs.single_action_space.high.astype(np.float64)

    actor = Actor(obs_dim, act_dim, args.hidden, low, high).to(device)
    qf1 = SoftQNetwork(obs_dim, act_dim, args.hidden).to(device)
    qf2 = SoftQNetwork(obs_dim, act_dim, args.hidden).to(device)
    qf1_target = SoftQNetwork(obs_dim, act_dim, args.hidden).to(device)
    qf2_target = SoftQNetwork(obs_dim, act_dim, args.hidden).to(device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam(
        [*qf1.parameters(), *qf2.parameters()], lr=args.q_lr, foreach=True
    )
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr, foreach=True)
    target_entropy = -float(act_dim)
    log_temp = torch.tensor(math.log(args.temperature), device=device, requires_grad=True)
    temp_optimizer = torch.optim.Adam([log_temp], lr=args.q_lr)
    temperature = args.temperature

    # replay: one n-step window per env, the reset rows dropped, beta annealed to 1
    num_iterations = args.total_timesteps // args.num_envs
    first_update = args.learning_starts // args.num_envs + 1  # first iteration that trains
    # sample calls over the run: beta reaches 1 on the last
    planned_updates = max(1, (num_iterations - first_update + 1) * args.gradient_steps)
    rb = fastper.PrioritizedReplayBuffer(
        args.buffer_size,
        fields_from_spaces(envs.single_observation_space, envs.single_action_space),
        alpha=args.per_alpha,
        beta=fastper.schedules.linear(args.per_beta_start, 1.0, planned_updates),
        eps=args.priority_eps,
        n_step=args.n_step,
        gamma=args.gamma,
        n_envs=args.num_envs,
        autoreset=autoreset_mode(envs),
        seed=args.seed,
    )

    episodes: list[tuple[int, float]] = []  # (global_step, episodic return)
    losses: list[float] = []  # IS-weighted critic loss of each update
    abs_td: list[float] = []  # mean |TD error| of each update (unweighted)
    n_updates = 0
    start_time = time.time()
    last_log, last_episode = 0, 0
    obs, _ = envs.reset(seed=args.seed)  # env i gets seed + i
    for iteration in range(1, num_iterations + 1):
        global_step = iteration * args.num_envs

        if iteration < first_update:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions, _ = actor(torch.as_tensor(obs, dtype=torch.float32, device=device))
            actions = actions.cpu().numpy().reshape(envs.action_space.shape)

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            for i in np.flatnonzero(infos["_episode"]):
                episodes.append((global_step, float(infos["episode"]["r"][i])))

        # one row per env; next_obs is the true last observation (the env resets next step)
        rb.add({"obs": obs, "action": actions, "reward": rewards, "next_obs": next_obs,
                "terminated": terminations, "truncated": truncations})  # fmt: skip
        obs = next_obs

        # training
        for _ in range(args.gradient_steps if iteration >= first_update and len(rb) > 0 else 0):
            batch = rb.sample(args.batch_size)
            data = batch.to_torch(device)
            b_obs, b_next_obs = data["obs"].float(), data["next_obs"].float()
            b_actions = data["action"].float().reshape(-1, act_dim)
            with torch.no_grad():
                next_actions, next_log_pi = actor(b_next_obs)
                min_next_q = torch.min(
                    qf1_target(b_next_obs, next_actions), qf2_target(b_next_obs, next_actions)
                )
                soft_value = min_next_q - temperature * next_log_pi
                td_target = data["reward"].float() + data["discount"].float() * soft_value
            td1 = qf1(b_obs, b_actions) - td_target
            td2 = qf2(b_obs, b_actions) - td_target
            weights = data["weights"].float()  # IS weights, the largest in the buffer = 1
            q_loss = (weights * (td1.pow(2) + td2.pow(2))).mean()
            q_optimizer.zero_grad()
            q_loss.backward()
            q_optimizer.step()
            td_abs = 0.5 * (td1.detach().abs() + td2.detach().abs())  # mean of the two critics
            rb.update_priorities(batch.indices, td_abs.cpu().numpy(), keys=batch.keys)

            pi, log_pi = actor(b_obs)
            min_q = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))
            actor_loss = (temperature * log_pi - min_q).mean()
            actor_optimizer.zero_grad()
            actor_loss.backward()
            actor_optimizer.step()

            if args.autotune:
                temp_loss = -(log_temp.exp() * (log_pi.detach() + target_entropy)).mean()
                temp_optimizer.zero_grad()
                temp_loss.backward()
                temp_optimizer.step()
                temperature = log_temp.exp().item()

            with torch.no_grad():
                for net, target in ((qf1, qf1_target), (qf2, qf2_target)):
                    for p, tp in zip(net.parameters(), target.parameters(), strict=True):
                        tp.lerp_(p, args.tau)
            losses.append(q_loss.item())
            abs_td.append(td_abs.mean().item())
            n_updates += 1

        if global_step - last_log >= args.log_every or iteration == num_iterations:
            recent = [r for _, r in episodes[last_episode:]]
            mean_return = f"{np.mean(recent):8.1f}" if recent else "       -"
            mean_td = f"{np.mean(abs_td[-100:]):.3f}" if abs_td else "-"
            mean_loss = f"{np.mean(losses[-100:]):.2e}" if losses else "-"
            sps = int(global_step / (time.time() - start_time))
            print(f"global_step={global_step:>7}  episodes={len(episodes):>4}  "
                  f"return={mean_return}  beta={rb.beta:.3f}  temperature={temperature:.3f}  "
                  f"|td|={mean_td}  q_loss={mean_loss}  SPS={sps}")  # fmt: skip
            last_log, last_episode = global_step, len(episodes)

    envs.close()
    print(f"{len(rb)} transitions from {args.num_envs} envs ({rb.n_pending} waiting for their "
          f"window, {rb.n_dropped} reset rows dropped), {n_updates} updates")  # fmt: skip
    return {
        "args": args,
        "episodes": episodes,
        "losses": losses,
        "abs_td": abs_td,
        "n_updates": n_updates,
        "steps": num_iterations,
        "buffer": rb,
        "actor": actor,
    }


if __name__ == "__main__":
    main()
