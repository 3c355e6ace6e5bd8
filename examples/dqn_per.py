"""Double DQN with n-step prioritized replay on a Gymnasium vector env, in one file.

    python examples/dqn_per.py                            # CartPole-v1, 4 envs
    python examples/dqn_per.py --total-timesteps 20000 --num-envs 8 --seed 3
    python examples/dqn_per.py --help                     # every argument

What it shows: fastper's ``PrioritizedReplayBuffer`` fed straight from
``envs.step`` of a Gymnasium vector env, with nothing done by hand.

* ``n_envs=num_envs``: row i of every ``add`` is env i, so each env keeps its
  own n-step window and streams never mix;
* ``autoreset=autoreset_mode(envs)``: Gymnasium >= 1.0 resets an env on the
  step *after* its episode ended; that row is not a transition and the buffer
  drops it (``rb.n_dropped`` counts them);
* ``n_step=3``: the buffer stores the 3-step return in ``reward`` and the
  bootstrap factor in ``discount`` (gamma^m, 0 after a termination, where m
  <= 3 is the window's length), so the target is simply
  ``reward + discount * Q_target(next_obs, argmax_a Q(next_obs, a))``;
* PER: the importance-sampling weights scale each sample's Huber loss, the
  absolute TD errors go back as priorities with the sample's ``keys`` (updates
  for slots overwritten meanwhile are dropped), and beta rises linearly from
  0.4 to 1 over all the run's ``sample`` calls.

The layout follows CleanRL's single-file scripts: the arguments, the env
factory, the network, then one training loop. ``total_timesteps`` and
``learning_starts`` count environment steps of all envs together (one
``envs.step`` is ``num_envs`` of them). It prints a line every
``--log-every`` steps: the mean return of the episodes that ended since the
last line, the exploration rate, beta, the mean |TD error| of the last 100
updates, their IS-weighted loss and the steps per second. The weighted loss
shrinks far below the TD errors as beta nears 1: the weights are normalised
by the largest in the buffer, that of the transition with the lowest
priority. ``main(argv)`` returns a summary (returns seen, updates, losses, the buffer),
which is what ``tests/unit/test_cleanrl_examples.py`` checks.

Needs torch and gymnasium (``pip install 'fastper[agents]'``).
"""

import argparse
import dataclasses
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
    seed: int = arg(1, "seeds torch, exploration, the envs' first reset and the buffer")
    device: str = arg("cpu", "torch device: cpu, cuda, cuda:1, ...")
    log_every: int = arg(2_000, "print a progress line every this many env steps")
    # environment
    env_id: str = arg("CartPole-v1", "Gymnasium env id with a Discrete action space")
    num_envs: int = arg(4, "envs stepped together (gym.make_vec, sync)")
    total_timesteps: int = arg(40_000, "env steps of all envs together")
    # replay
    buffer_size: int = arg(50_000, "replay capacity in transitions")
    n_step: int = arg(3, "n-step returns (1: one-step targets)")
    per_alpha: float = arg(0.6, "priority exponent (0: uniform replay)")
    per_beta_start: float = arg(0.4, "initial importance-sampling exponent, annealed to 1")
    priority_eps: float = arg(1e-6, "priority = |TD error| + priority_eps")
    # learning
    learning_rate: float = arg(5e-4, "Adam step size")
    gamma: float = arg(0.99, "discount factor")
    batch_size: int = arg(128, "transitions per gradient step")
    learning_starts: int = arg(1_000, "env steps before the first gradient step")
    train_frequency: int = arg(1, "envs.step calls between gradient steps")
    tau: float = arg(0.01, "target network update rate (1: copy)")
    target_network_frequency: int = arg(1, "gradient steps between target updates")
    max_grad_norm: float = arg(10.0, "gradient norm clip")
    start_e: float = arg(1.0, "initial exploration rate")
    end_e: float = arg(0.02, "final exploration rate")
    exploration_fraction: float = arg(0.25, "share of total_timesteps over which it decays")


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


def make_envs(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` stepped in this process, recording episode returns."""
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
    # adds infos["episode"]["r"] / ["l"] and the mask infos["_episode"] when an episode ends
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, n_actions),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    return end if t >= duration else start + (end - start) * t / duration


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    # seeding: torch here, the envs by their first reset, the buffer by its seed
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)  # exploration
    device = torch.device(args.device)

    # env setup
    envs = make_envs(args.env_id, args.num_envs)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "needs Discrete actions"
    obs_dim = gym.spaces.flatdim(envs.single_observation_space)
    n_actions = int(envs.single_action_space.n)

    q_network = QNetwork(obs_dim, n_actions).to(device)
    target_network = QNetwork(obs_dim, n_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)

    # replay: one n-step window per env, the reset rows dropped, beta annealed to 1
    num_iterations = args.total_timesteps // args.num_envs
    first_update = args.learning_starts // args.num_envs + 1  # first iteration that trains
    trains = num_iterations // args.train_frequency - (first_update - 1) // args.train_frequency
    planned_updates = max(1, trains)  # sample calls over the run: beta reaches 1 on the last
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
    losses: list[float] = []  # IS-weighted Huber loss of each update
    abs_td: list[float] = []  # mean |TD error| of each update (unweighted)
    n_updates = 0
    start_time = time.time()
    last_log, last_episode = 0, 0
    obs, _ = envs.reset(seed=args.seed)  # env i gets seed + i
    for iteration in range(1, num_iterations + 1):
        global_step = iteration * args.num_envs

        # epsilon-greedy, one draw per env
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(obs, dtype=torch.float32, device=device))
        actions = q_values.argmax(dim=1).cpu().numpy()
        explore = rng.random(args.num_envs) < epsilon
        actions = np.where(explore, rng.integers(n_actions, size=args.num_envs), actions)

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        if "episode" in infos:
            for i in np.flatnonzero(infos["_episode"]):
                episodes.append((global_step, float(infos["episode"]["r"][i])))

        # one row per env; next_obs is the true last observation (the env resets next step)
        rb.add({"obs": obs, "action": actions, "reward": rewards, "next_obs": next_obs,
                "terminated": terminations, "truncated": truncations})  # fmt: skip
        obs = next_obs

        # training
        if iteration >= first_update and iteration % args.train_frequency == 0 and len(rb) > 0:
            batch = rb.sample(args.batch_size)
            data = batch.to_torch(device)
            with torch.no_grad():
                next_q = q_network(data["next_obs"].float())
                best = next_q.argmax(dim=1, keepdim=True)  # Double DQN: online net picks
                next_value = target_network(data["next_obs"].float()).gather(1, best).squeeze(1)
                td_target = data["reward"].float() + data["discount"].float() * next_value
            q_taken = q_network(data["obs"].float()).gather(1, data["action"].long()[:, None])
            q_taken = q_taken.squeeze(1)
            td_error = q_taken - td_target
            weights = data["weights"].float()  # IS weights, the largest in the buffer = 1
            loss = (weights * F.smooth_l1_loss(q_taken, td_target, reduction="none")).mean()

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
            optimizer.step()
            td_abs = td_error.detach().abs()  # |TD| back as priorities, with the sample's keys
            rb.update_priorities(batch.indices, td_abs.cpu().numpy(), keys=batch.keys)
            losses.append(loss.item())
            abs_td.append(td_abs.mean().item())
            n_updates += 1

            if n_updates % args.target_network_frequency == 0:
                with torch.no_grad():
                    for p, tp in zip(
                        q_network.parameters(), target_network.parameters(), strict=True
                    ):
                        tp.lerp_(p, args.tau)

        if global_step - last_log >= args.log_every or iteration == num_iterations:
            recent = [r for _, r in episodes[last_episode:]]
            mean_return = f"{np.mean(recent):7.1f}" if recent else "      -"
            mean_td = f"{np.mean(abs_td[-100:]):.3f}" if abs_td else "-"
            mean_loss = f"{np.mean(losses[-100:]):.2e}" if losses else "-"
            sps = int(global_step / (time.time() - start_time))
            print(f"global_step={global_step:>7}  episodes={len(episodes):>5}  "
                  f"return={mean_return}  epsilon={epsilon:.3f}  beta={rb.beta:.3f}  "
                  f"|td|={mean_td}  loss={mean_loss}  SPS={sps}")  # fmt: skip
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
        "q_network": q_network,
    }


if __name__ == "__main__":
    main()
