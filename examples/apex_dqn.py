"""Ape-X-style distributed prioritized replay (Horgan et al., 2018) on Ray, in one file.

    python examples/apex_dqn.py                     # CartPole-v1: 2 actors, 2 shards, about 4 min on 2 cores
    python examples/apex_dqn.py --num-actors 4 --num-shards 4 --samples-per-insert 0
    python examples/apex_dqn.py --help              # every argument

What runs where:

* **actors** (Ray actors, ``--num-actors``): each steps its own Gymnasium
  vector env of ``--envs-per-actor`` CartPoles with a CPU copy of the
  Q-network (one torch thread). Every env copy explores with its own fixed
  epsilon, Ape-X's ``eps_i = 0.4 ** (1 + 7 i / (N - 1))`` over all
  ``N = num_actors * envs_per_actor`` copies (env ``j`` of actor ``a`` is
  ``i = a * envs_per_actor + j``; with one env per actor, the paper's
  per-actor epsilons). It turns 1-step transitions into
  n-step ones itself (fastper's per-stream :class:`~fastper.nstep.NStepWriter`,
  one window per env: a truncated episode bootstraps, a terminated one does
  not), computes their initial priorities ``|TD| + eps`` under its network copy
  (as in the Ape-X paper; the copy both picks and rates the next action), and
  sends them in batches of about ``--add-batch`` rows straight to the shards
  through a :class:`~fastper.distributed.ShardRouter`, a few batches in flight;
* **shards** (Ray actors, ``--num-shards``): fastper
  ``PrioritizedReplayBuffer`` s (proportional, alpha 0.6), ``--shard-capacity``
  transitions each;
* **the learner** (this process): samples batches of ``--batch-size`` from a
  :class:`~fastper.distributed.ShardedReplayBuffer`, the exact global
  prioritized sample over all shards, with beta annealed from 0.4 to 1 over
  the run; trains Double DQN with the IS-weighted Huber loss; sends ``|TD|``
  back with the sample's keys (asynchronous: updates for slots overwritten
  meanwhile are dropped by the shards); every ``--publish-every`` updates puts
  its weights on a small parameter actor, from which the actors pull every
  ``--pull-every`` vector steps. A thread draws the next batch (and sends the
  last priorities) while the learner trains (``--prefetch 0``: no thread): a
  replay call is a round trip of milliseconds to other processes. IS weights
  are divided by the largest in the batch (``--weight-norm batch``, as
  Dopamine does); with fastper's default, the largest over the whole memory,
  the updates shrink with the lowest priority anywhere (see "Importance-sampling weights" in
  ``docs/concepts.md``);
* **a rate limiter** (Ray actor, ``--samples-per-insert`` > 0): holds the
  learner's samples per inserted transition near that ratio; the side that
  runs ahead waits.

The run is a fixed number of learner updates (``--total-updates``); greedy
evaluation episodes are played by the learner every ``--eval-every`` updates
and at the end. The cluster is local (node address 127.0.0.1, no dashboard,
Ray's token authentication with a fresh token in ``RAY_AUTH_TOKEN`` unless one
is set, so nothing is written to ``~/.ray``) and shut down at the end
(``ray.shutdown()``: no process is left). Ray 2.60's GCS port still listens on
every interface: see "Who may connect" in ``docs/guides/ray.md`` before running it on a
shared network. ``main(argv)``
returns a summary, also written as JSON with ``--summary-json``; ``--save-dir``
checkpoints the shards (a manifest and one fastper file per shard) at the end.

Measured on the project's shared 2-core machine (``docs/guides/ray.md``): the
defaults ran 8,000 updates in 203-238 s of learning (211-250 s in all) at
34-39 updates/s, the actors inserting 1,100-1,300 transitions/s; the final
greedy means over 10 episodes for seeds 0-4 were 500.0, 329.2, 445.7, 500.0 and
500.0. At this budget the run (not reproducible from the seed on Ray) still
matters.

Needs torch, gymnasium and Ray: ``pip install 'fastper[agents,ray]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch
import torch.nn.functional as F
from torch import nn

import fastper
from fastper.distributed import ShardedReplayBuffer
from fastper.distributed.ray_backend import ray_shards
from fastper.distributed.ray_limiter import RateLimitedSharded, rate_limiter
from fastper.limiter import RateLimiterCancelled, RateLimitTimeout
from fastper.nstep import NStepWriter, autoreset_mode
from fastper.spaces import fields_from_spaces
from fastper.storage import coerce_batch


def arg(default: Any, help: str) -> Any:
    """A field of ``Args`` with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    # experiment
    seed: int = arg(0, "seeds torch, the actors' envs and exploration, the sampler")
    env_id: str = arg("CartPole-v1", "Gymnasium env id with a Discrete action space")
    log_every: int = arg(1_000, "print a progress line every this many learner updates")
    eval_every: int = arg(5_000, "greedy evaluation every this many updates (0: only at the end)")
    eval_episodes: int = arg(10, "episodes per evaluation")
    summary_json: str = arg("", "write the run's summary to this JSON file")
    save_dir: str = arg("", "checkpoint the shards here at the end (a manifest + a file each)")
    ray_temp_dir: str = arg("", "Ray's session directory (default: a new temporary one)")
    ray_cpus: int = arg(2, "CPUs the local Ray cluster reports (every actor asks for 0)")
    # actors
    num_actors: int = arg(2, "Ray actors stepping envs")
    envs_per_actor: int = arg(4, "CartPoles per actor, in one sync vector env")
    add_batch: int = arg(50, "an actor sends its n-step transitions in batches of this many rows")
    pull_every: int = arg(100, "actors pull the latest weights every this many vector steps")
    eps_base: float = arg(
        0.4, "Ape-X epsilon of env copy i: eps_base ** (1 + eps_alpha i / (N - 1))"
    )
    eps_alpha: float = arg(7.0, "spread of the env copies' epsilons (Ape-X: 7)")
    # replay
    num_shards: int = arg(2, "Ray actors holding replay shards")
    shard_capacity: int = arg(25_000, "transitions each shard holds")
    n_step: int = arg(3, "n-step returns, computed by the actors")
    per_alpha: float = arg(0.6, "priority exponent")
    per_beta_start: float = arg(0.4, "initial IS exponent, annealed to 1 over the run")
    weight_norm: str = arg("batch", "IS weights / their largest in the batch or buffer (see above)")
    priority_eps: float = arg(1e-3, "priority = |TD error| + priority_eps")
    samples_per_insert: float = arg(16.0, "rate limiter's samples per inserted transition (0: off)")
    learning_starts: int = arg(2_000, "transitions in the shards before the first update")
    # learner
    total_updates: int = arg(8_000, "learner updates (gradient steps): the run's budget")
    batch_size: int = arg(512, "transitions per update")
    learning_rate: float = arg(5e-4, "Adam step size")
    gamma: float = arg(0.99, "discount factor")
    tau: float = arg(0.01, "target network update rate per update (1: copy)")
    max_grad_norm: float = arg(10.0, "gradient norm clip")
    publish_every: int = arg(50, "learner updates between weight publications")
    prefetch: int = arg(1, "1: a thread samples the next batch while the learner trains; 0: not")


def parse_args(argv: list[str] | None = None) -> Args:
    """``--kebab-case`` flags for every field of ``Args``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    hints = typing.get_type_hints(Args)
    for f in dataclasses.fields(Args):
        kind = hints[f.name]
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=f.default,
            help=f"{f.metadata['help']} (default: {f.default})", metavar=kind.__name__,
        )  # fmt: skip
    return Args(**vars(parser.parse_args(argv)))


def apex_epsilon(i: int, n: int, base: float, spread: float) -> float:
    """Ape-X's fixed exploration rate of explorer ``i`` of ``n``: ``base ** (1 + spread i / (n - 1))``."""
    return base if n == 1 else base ** (1.0 + spread * i / (n - 1))


class QNetwork(nn.Module):
    """CleanRL's CartPole Q-network: 2 hidden layers of 128."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, 128), nn.ReLU(),
            nn.Linear(128, 128), nn.ReLU(),
            nn.Linear(128, n_actions),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def make_envs(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` in this process, recording episode returns."""
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)


def weights_of(net: nn.Module) -> dict[str, np.ndarray]:
    """The network's parameters as numpy copies (what travels to the actors)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in net.state_dict().items()}


# -- the parameter actor: latest weights, actors' reports, the stop signal ------------------
class ParameterServer:
    """Holds the newest weights; actors pull them (and learn when to stop). O(1) per call."""

    def __init__(self) -> None:
        self.version = -1
        self.weights: dict[str, np.ndarray] | None = None
        self.stopped = False
        self.reports: dict[int, dict[str, Any]] = {}

    def publish(self, version: int, weights: dict[str, np.ndarray]) -> None:
        self.version, self.weights = version, weights

    def pull(self, actor: int, have: int, report: dict[str, Any]) -> tuple[int, Any, bool]:
        """(version, weights if newer than ``have`` else None, stop?); keeps the actor's report."""
        self.reports[actor] = report
        return self.version, self.weights if self.version > have else None, self.stopped

    def stop(self) -> None:
        self.stopped = True

    def all_reports(self) -> dict[int, dict[str, Any]]:
        return dict(self.reports)


# -- the actors ---------------------------------------------------------------------------
class NStep:
    """fastper's n-step windows outside a buffer: one step of every env in, finished rows out."""

    def __init__(self, step_fields: dict[str, Any], n: int, gamma: float, envs: Any) -> None:
        self.writer = NStepWriter(
            step_fields, n, gamma, n_envs=envs.num_envs, autoreset=autoreset_mode(envs)
        )
        self.fields = self.writer.output_fields  # the step's fields + ``discount`` (gamma^m or 0)

    def __call__(self, step: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch, k = coerce_batch(self.writer.fields, step, None)
        plan = self.writer.prepare(batch, k)
        self.writer.commit(plan)
        return {name: np.array(a) for name, a in plan.out.items()}  # copies: plans share memory


class Actor:
    """Steps envs (a fixed epsilon each), computes n-step rows and priorities, inserts them."""

    def __init__(
        self, index: int, args: Args, router: Any, params: Any, epsilons: list[float]
    ) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(args.seed + 1000 + index)
        self.index, self.args, self.router, self.params = index, args, router, params
        self.epsilons = np.asarray(epsilons)
        self.rng = np.random.default_rng([args.seed, index])
        self.envs = make_envs(args.env_id, args.envs_per_actor)
        space = self.envs.single_observation_space
        self.n_actions = int(self.envs.single_action_space.n)
        self.q = QNetwork(gym.spaces.flatdim(space), self.n_actions)
        step_fields = fields_from_spaces(space, self.envs.single_action_space)
        self.nstep = NStep(step_fields, args.n_step, args.gamma, self.envs)
        self.version = -1
        self.loaded = 0  # weight versions taken in
        self.first_version = -1

    def _pull(self, report: dict[str, Any]) -> bool:
        """Take newer weights if there are; True when the learner says stop."""
        version, weights, stop = ray.get(self.params.pull.remote(self.index, self.version, report))
        if weights is not None:
            self.q.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
            self.version = version
            self.loaded += 1
            if self.first_version < 0:
                self.first_version = version
        return bool(stop)

    def _priorities(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """Initial priorities ``|TD| + eps`` of n-step rows under this actor's network copy."""
        with torch.no_grad():
            obs, next_obs = torch.as_tensor(rows["obs"]), torch.as_tensor(rows["next_obs"])
            action = torch.as_tensor(rows["action"]).long().unsqueeze(1)
            q_sa = self.q(obs).gather(1, action).squeeze(1)
            target = (
                torch.as_tensor(rows["reward"])
                + torch.as_tensor(rows["discount"]) * self.q(next_obs).max(dim=1).values
            )
        return (q_sa - target).abs().numpy().astype(np.float64) + self.args.priority_eps

    def run(self) -> dict[str, Any]:
        """Act until the learner stops; returns this actor's counts."""
        a = self.args
        obs, _ = self.envs.reset(seed=a.seed + 100 * self.index)
        returns: list[float] = []
        pending: list[dict[str, np.ndarray]] = []
        n_pending = sent = batches = vector_steps = 0
        report: dict[str, Any] = {}
        while True:
            if vector_steps % a.pull_every == 0:
                recent = returns[-20:]
                report = {"env_steps": vector_steps * a.envs_per_actor, "episodes": len(returns),
                          "recent_return": float(np.mean(recent)) if recent else None,
                          "rows_sent": sent, "version": self.version}  # fmt: skip
                if self._pull(report):
                    break
            with torch.no_grad():
                actions = self.q(torch.as_tensor(obs)).argmax(dim=1).numpy()
            explore = self.rng.random(a.envs_per_actor) < self.epsilons
            actions = np.where(
                explore, self.rng.integers(self.n_actions, size=len(actions)), actions
            )
            next_obs, rewards, terminated, truncated, infos = self.envs.step(actions)
            vector_steps += 1
            if "episode" in infos:
                returns += [float(r) for r in infos["episode"]["r"][infos["_episode"]]]
            rows = self.nstep({"obs": obs, "action": actions, "reward": rewards,
                               "next_obs": next_obs, "terminated": terminated,
                               "truncated": truncated})  # fmt: skip
            obs = next_obs
            if len(rows["obs"]):
                pending.append(rows)
                n_pending += len(rows["obs"])
            if n_pending >= a.add_batch:
                batch = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
                pending, n_pending = [], 0
                try:  # a different key per batch spreads the batches over the shards
                    self.router.add(
                        batch, key=(self.index, batches), priorities=self._priorities(batch)
                    )
                except RateLimiterCancelled:
                    break  # the learner is done: it cancelled the limiter
                sent += len(batch["obs"])
                batches += 1
        inserted = self.router.flush()  # waits for the batches still in flight
        self.envs.close()
        return {"actor": self.index, "epsilons": self.epsilons.tolist(),
                "env_steps": vector_steps * a.envs_per_actor, "episodes": len(returns),
                "recent_return": float(np.mean(returns[-20:])) if returns else None,
                "rows_sent": sent, "inserted": inserted, "dropped": self.router.dropped,
                "batches": batches, "weights_loaded": self.loaded,
                "first_version": self.first_version, "last_version": self.version}  # fmt: skip


# -- the learner ----------------------------------------------------------------------------
class Prefetcher:
    """Samples the next batch and sends the last priorities in a thread while the learner trains.

    Every replay call is a round trip to other processes (milliseconds), the
    gradient step is torch work that releases the GIL: overlapping them hides
    most of the replay's latency. Only this thread touches the replay while it
    runs. A batch is drawn before the priorities of the one or two batches
    still in training are sent, a lag Ape-X's asynchronous updates have anyway.
    """

    def __init__(self, replay: Any, batch_size: int, check: Any) -> None:
        self.replay, self.batch_size, self.check = replay, batch_size, check
        self.batches: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.updates: queue.SimpleQueue[tuple[np.ndarray, ...]] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.sent = self.waits = 0
        self.thread = threading.Thread(target=self._run, name="replay", daemon=True)
        self.thread.start()

    def _send_updates(self) -> None:
        while True:
            try:
                idx, td, keys = self.updates.get_nowait()
            except queue.Empty:
                return
            self.sent += self.replay.update_priorities(idx, td, keys)  # not awaited

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._send_updates()
                try:
                    batch = self.replay.sample(self.batch_size)
                except RateLimitTimeout:  # the actors are behind: look again
                    self.waits += 1
                    continue
                while not self.stopping.is_set():
                    try:
                        self.batches.put(batch, timeout=0.01)
                        break
                    except queue.Full:
                        self._send_updates()  # the learner's newest priorities go out at once
        except BaseException as exc:  # noqa: BLE001 - handed to the learner by get()
            self.error = exc

    def get(self) -> Any:
        """The next batch (waits for it; raises what the thread or an actor raised)."""
        while True:
            try:
                return self.batches.get(timeout=1.0)
            except queue.Empty:
                if self.error is not None:
                    raise self.error from None
                self.check()

    def update(self, indices: np.ndarray, td: np.ndarray, keys: np.ndarray) -> None:
        """Queue priorities for the thread to send."""
        self.updates.put((indices, td, keys))

    def close(self) -> None:
        """Stop the thread and send the updates still queued."""
        self.stopping.set()
        self.thread.join()
        self._send_updates()
        if self.error is not None:
            raise self.error


def evaluate(q: nn.Module, env_id: str, episodes: int, seed: int) -> list[float]:
    """Greedy episodes on a fresh env in this process; their returns."""
    env = gym.make(env_id)
    out = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                action = int(q(torch.as_tensor(obs).unsqueeze(0)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        out.append(total)
    env.close()
    return out


def start_ray(args: Args) -> str:
    """A local Ray cluster (node address 127.0.0.1, no dashboard); returns its temporary directory."""
    # a token in the environment keeps Ray >= 2.5x from writing ~/.ray/auth_token
    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    tmp = args.ray_temp_dir or tempfile.mkdtemp(prefix="apex-")  # short: socket paths live here
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=True, configure_logging=False,
             object_store_memory=200 * 2**20, namespace="fastper-apex")  # fmt: skip
    return tmp


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()
    tmp = start_ray(args)
    try:
        return learn(args, t_start)
    finally:
        ray.shutdown()
        if not args.ray_temp_dir:
            shutil.rmtree(tmp, ignore_errors=True)


def learn(args: Args, t_start: float) -> dict[str, Any]:
    """Start shards, limiter, parameter actor and actors; train; stop them; the run's summary."""
    probe = make_envs(args.env_id, args.envs_per_actor)
    obs_dim = gym.spaces.flatdim(probe.single_observation_space)
    n_actions = int(probe.single_action_space.n)
    row_fields = NStep(
        fields_from_spaces(probe.single_observation_space, probe.single_action_space),
        args.n_step, args.gamma, probe,
    ).fields  # fmt: skip
    probe.close()

    q = QNetwork(obs_dim, n_actions)
    q_target = QNetwork(obs_dim, n_actions)
    q_target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate)

    # replay: K shard actors, the exact global sample over them, beta annealed to 1
    transport = ray_shards(
        args.num_shards, args.shard_capacity,
        {name: (f.shape, f.dtype.str) for name, f in row_fields.items()},
        buffer_kwargs={"alpha": args.per_alpha, "eps": args.priority_eps},
        placement="local", num_cpus=0,
    )  # fmt: skip
    sharded = ShardedReplayBuffer(
        transport, beta=fastper.schedules.linear(args.per_beta_start, 1.0, args.total_updates),
        weight_norm=args.weight_norm, seed=args.seed,
    )  # fmt: skip
    limiter = None
    replay: Any = sharded
    if args.samples_per_insert > 0:
        # the range must fit a learner batch, and a batch from every actor at once
        biggest_add = args.add_batch + args.envs_per_actor * args.n_step
        spi = args.samples_per_insert
        error_buffer = max(args.batch_size + spi, args.num_actors * biggest_add * spi)
        limiter = rate_limiter(
            args.samples_per_insert, args.learning_starts, error_buffer,
            capacity=args.num_shards * args.shard_capacity,
        )  # fmt: skip
        replay = RateLimitedSharded(sharded, limiter, timeout=1.0)
    router = transport.router(placement="local", max_in_flight=4, limiter=limiter)

    params = ray.remote(ParameterServer).options(num_cpus=0).remote()
    version = 0
    params.publish.remote(version, weights_of(q))
    n, e = args.num_actors * args.envs_per_actor, args.envs_per_actor
    eps = [apex_epsilon(i, n, args.eps_base, args.eps_alpha) for i in range(n)]
    actor_cls = ray.remote(Actor).options(num_cpus=0, max_restarts=0)
    actors = [
        actor_cls.remote(a, args, router, params, eps[a * e : (a + 1) * e])
        for a in range(args.num_actors)
    ]
    runs = [a.run.remote() for a in actors]
    print(f"{args.num_actors} actors x {e} envs (epsilons {eps[0]:.2g} .. {eps[-1]:.2g}), "
          f"{args.num_shards} shards of {args.shard_capacity}, limiter "
          f"{'off' if limiter is None else f'{args.samples_per_insert:g} samples/insert'}; "
          f"started in {time.monotonic() - t_start:.1f} s", flush=True)  # fmt: skip

    def check_actors() -> None:
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        if done:
            ray.get(done)  # raises an actor's error
            raise RuntimeError("an actor stopped before the learner told it to")

    # wait for the first transitions (the limiter does this by itself)
    while limiter is None:
        sharded.refresh()
        if len(sharded) >= args.learning_starts:
            break
        check_actors()
        time.sleep(0.05)

    replay_thread = Prefetcher(replay, args.batch_size, check_actors) if args.prefetch else None
    updates = sent_entries = waits = 0
    losses: list[float] = []
    abs_td: list[float] = []
    evals: list[dict[str, Any]] = []
    t_learn = time.monotonic()
    t_log, n_log = t_learn, 0
    while updates < args.total_updates:
        if replay_thread is not None:
            batch = replay_thread.get()  # drawn while the last update trained
        else:
            try:
                batch = replay.sample(args.batch_size)
            except RateLimitTimeout:  # the actors are behind: look again
                waits += 1
                check_actors()
                continue
        data = {k: torch.as_tensor(v) for k, v in batch.data.items()}
        with torch.no_grad():  # Double DQN: the online net picks, the target net rates
            best = q(data["next_obs"]).argmax(dim=1, keepdim=True)
            next_value = q_target(data["next_obs"]).gather(1, best).squeeze(1)
            target = data["reward"] + data["discount"] * next_value
        q_taken = q(data["obs"]).gather(1, data["action"].long().unsqueeze(1)).squeeze(1)
        weights = torch.as_tensor(batch.weights, dtype=torch.float32)
        loss = (weights * F.smooth_l1_loss(q_taken, target, reduction="none")).mean()
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(q.parameters(), args.max_grad_norm)
        optimizer.step()
        td = (q_taken - target).detach().abs().numpy()
        if replay_thread is not None:
            replay_thread.update(batch.indices, td, batch.keys)
        else:
            sent_entries += sharded.update_priorities(batch.indices, td, batch.keys)  # not awaited
        with torch.no_grad():
            for p, tp in zip(q.parameters(), q_target.parameters(), strict=True):
                tp.lerp_(p, args.tau)
        updates += 1
        losses.append(loss.item())
        abs_td.append(float(td.mean()))
        if updates % args.publish_every == 0:
            version += 1
            params.publish.remote(version, weights_of(q))  # not awaited; in order per caller
        if args.eval_every and updates % args.eval_every == 0 and updates < args.total_updates:
            r = evaluate(q, args.env_id, args.eval_episodes, seed=10_000 + updates)
            evals.append({"updates": updates, "mean": float(np.mean(r)), "returns": r})
            print(f"  eval at {updates} updates: greedy mean {np.mean(r):.1f} "
                  f"(min {min(r):.0f}, max {max(r):.0f})", flush=True)  # fmt: skip
        if updates % args.log_every == 0:
            now = time.monotonic()
            reports = ray.get(params.all_reports.remote()).values()
            recent = [r["recent_return"] for r in reports if r["recent_return"] is not None]
            sent = sum(r["rows_sent"] for r in reports)
            print(f"updates={updates:>6}  {(updates - n_log) / (now - t_log):4.0f} upd/s  "
                  f"actors: sent~{sent:>7} return={np.mean(recent) if recent else 0:6.1f}  "
                  f"|td|={np.mean(abs_td[-200:]):.3f}  loss={np.mean(losses[-200:]):.2e}  "
                  f"t={now - t_start:5.1f}s", flush=True)  # fmt: skip
            t_log, n_log = now, updates
    if replay_thread is not None:
        replay_thread.close()  # sends the last updates
        sent_entries, waits = replay_thread.sent, replay_thread.waits
    learn_s = time.monotonic() - t_learn

    # shut down in order: actors stop (the limiter wakes any that wait), updates land
    params.stop.remote()
    if limiter is not None:
        ray.get(limiter.cancel.remote())
    actor_stats = ray.get(runs, timeout=60)
    sharded.flush()
    sharded.refresh()
    limiter_stats = replay.stats() if limiter is not None else None
    views = sharded.views()
    stale = sum(
        transport.results([transport.submit(s, "stale_updates") for s in range(len(views))])
    )
    if args.save_dir:
        Path(args.save_dir).mkdir(parents=True, exist_ok=True)
        sharded.save(args.save_dir)
    final = evaluate(q, args.env_id, args.eval_episodes, seed=20_000)
    evals.append({"updates": updates, "mean": float(np.mean(final)), "returns": final})
    summary = {
        "args": dataclasses.asdict(args),
        "updates": updates,
        "learn_seconds": learn_s,
        "wall_seconds": time.monotonic() - t_start,
        "sampled": updates * args.batch_size,
        "priority_entries_sent": sent_entries,
        "stale_dropped": stale + sharded.stale_updates,
        "published_versions": version,
        "limiter_timeouts": waits,
        "limiter": limiter_stats,
        "shards": [{"size": v.size, "added": v.added, "total": v.total} for v in views],
        "actors": actor_stats,
        "evaluations": evals,
        "final_eval_mean": float(np.mean(final)),
    }
    transport.close()
    inserted = sum(v.added for v in views)
    print(f"done: {updates} updates in {learn_s:.1f} s ({updates / learn_s:.0f}/s), "
          f"{inserted} transitions inserted ({inserted / learn_s:.0f}/s, "
          f"{updates * args.batch_size / max(inserted, 1):.1f} samples per insert), "
          f"{summary['stale_dropped']} stale priority updates dropped, {version} weight versions")  # fmt: skip
    print(f"final greedy evaluation: mean {np.mean(final):.1f} over {len(final)} episodes "
          f"(min {min(final):.0f}, max {max(final):.0f}); wall {summary['wall_seconds']:.1f} s")  # fmt: skip
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
