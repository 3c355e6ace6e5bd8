"""DQN, SAC and TD3 of Stable-Baselines3 with prioritized replay.

:class:`PERDQN`, :class:`PERSAC` and :class:`PERTD3` subclass SB3's ``DQN``,
``SAC`` and ``TD3`` and change only three things:

* the default ``replay_buffer_class`` is
  :class:`~fastper.compat.sb3_buffers.PrioritizedReplayBuffer` (Dict
  observations: ``DictPrioritizedReplayBuffer``), and ``n_steps > 1`` is
  handed to it (fastper's per-env n-step windows);
* ``train()`` is SB3's update, step for step, with the TD loss weighted by
  the IS weights (``mean(w_i * loss_i)``) and ``|TD|`` written back as
  priorities, with the sample's keys so that updates of slots overwritten
  meanwhile are dropped;
* beta is annealed linearly from the buffer's ``beta`` to 1 over ``learn()``:
  ``beta = beta0 + (1 - beta0) * (1 - progress_remaining)``, written into the
  fastper buffer's beta before each ``train()`` call, so that the buffer (its
  ``sample``, its checkpoint files, copies of its state) is the one source of
  the beta in force (``anneal_beta=False`` keeps it; a ``fastper.schedules``
  beta given to the buffer is used as is, on the buffer's own step).

Priority of an actor-critic transition: the mean over the critics of
``|Q_k(s, a) - y|``, with ``y`` the usual clipped-double-Q target. The mean
(rather than the min or the max) is what the summed critic loss is made of,
and keeps one critic's outlier from dominating. The actor (and SAC's entropy
coefficient) losses are unweighted by default, as in the PER paper (which
weights the TD update) and Tianshou's SAC / TD3 with PER; ``weight_actor_loss=True``
weights them too.

With ``n_steps > 1``, a ``learn()`` that resets the env (SB3's default)
first drops the pending n-step windows of the episodes it cuts (at most
``n_steps - 1`` transitions per env), so no window spans two episodes.

``save_replay_buffer`` / ``load_replay_buffer`` write and read fastper's
pickle-free checkpoint file (SB3's default pickles the buffer); the buffer
itself refuses to be pickled. Everything else (``learn``, callbacks,
``save`` / ``load``, VecNormalize, several envs) is SB3's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN, SAC, TD3
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.type_aliases import MaybeCallback
from stable_baselines3.common.utils import polyak_update
from torch.nn import functional as F

from .sb3_buffers import (
    DictPrioritizedReplayBuffer,
    PathOrFile,
    PrioritizedReplayBuffer,
)

__all__ = ["PERDQN", "PERSAC", "PERTD3", "load_replay_buffer", "save_replay_buffer"]


def _prioritized(model: Any) -> PrioritizedReplayBuffer:
    buf = getattr(model, "replay_buffer", None)
    if not isinstance(buf, PrioritizedReplayBuffer):
        raise TypeError(
            "the model's replay buffer must be a fastper.compat.sb3 PrioritizedReplayBuffer "
            f"(replay_buffer_class=PrioritizedReplayBuffer), got {type(buf).__name__}"
        )
    return buf


def save_replay_buffer(model: Any, path: PathOrFile) -> None:
    """Write ``model``'s fastper-backed replay buffer to ``path``, without pickle. O(N).

    For any SB3 off-policy algorithm using a
    :class:`~fastper.compat.sb3_buffers.PrioritizedReplayBuffer` (SB3's own
    ``model.save_replay_buffer`` would pickle it, which the buffer refuses).

    Raises:
        TypeError: the model's buffer is not a fastper.compat.sb3 buffer.
    """
    _prioritized(model).save(path)


def load_replay_buffer(model: Any, path: PathOrFile) -> None:
    """Load a file written by :func:`save_replay_buffer` into ``model``'s buffer. O(N).

    The file brings the rows, priorities, settings and random state; the
    buffer keeps the model's device. See
    :meth:`~fastper.compat.sb3_buffers.PrioritizedReplayBuffer.load`.

    Raises:
        TypeError: the model's buffer is not a fastper.compat.sb3 buffer.
        ValueError: the file was made for other spaces, capacity or n_steps.
        fastper.CheckpointError: a corrupt file or not a fastper checkpoint.
    """
    buf = _prioritized(model)
    buf.load(path)
    buf.device = model.device


def _weighted_mean(values: th.Tensor, weights: th.Tensor | None) -> th.Tensor:
    """``mean(weights * values)``, or the plain mean without weights (both ``(B, 1)``)."""
    return (values if weights is None else weights * values).mean()


class _PrioritizedAlgorithm(OffPolicyAlgorithm):
    """What PERDQN, PERSAC and PERTD3 share: the buffer choice, beta, buffer files."""

    anneal_beta: bool

    def _setup_model(self) -> None:
        if self.replay_buffer_class is None:
            self.replay_buffer_class = (
                DictPrioritizedReplayBuffer
                if isinstance(self.observation_space, spaces.Dict)
                else PrioritizedReplayBuffer
            )
        cls = self.replay_buffer_class
        if not (isinstance(cls, type) and issubclass(cls, PrioritizedReplayBuffer)):
            raise TypeError(
                f"`replay_buffer_class` of {type(self).__name__} must be a fastper.compat.sb3 "
                f"PrioritizedReplayBuffer (or subclass), got {getattr(cls, '__name__', cls)}; "
                f"use SB3's {type(self).__mro__[2].__name__} for SB3's buffers"
            )
        n_steps = self.n_steps
        if n_steps > 1:
            self.replay_buffer_kwargs = {
                "n_steps": n_steps, "gamma": self.gamma, **self.replay_buffer_kwargs
            }  # fmt: skip
        # SB3 warns that `n_steps` is ignored when a buffer class is given: this
        # one takes it from replay_buffer_kwargs, so SB3 is shown n_steps = 1
        self.n_steps = 1
        try:
            super()._setup_model()
        finally:
            self.n_steps = n_steps

    def _setup_learn(
        self,
        total_timesteps: int,
        callback: MaybeCallback = None,
        reset_num_timesteps: bool = True,
        tb_log_name: str = "run",
        progress_bar: bool = False,
    ) -> tuple[int, BaseCallback]:
        buf = self.replay_buffer
        if isinstance(buf, PrioritizedReplayBuffer) and (
            reset_num_timesteps or self._last_obs is None
        ):
            # SB3 resets the env now: n-step windows of the cut episodes end here
            buf.drop_pending()
        return super()._setup_learn(
            total_timesteps, callback, reset_num_timesteps, tb_log_name, progress_bar
        )

    def _prioritized_buffer(self) -> PrioritizedReplayBuffer:
        return _prioritized(self)

    def _anneal(self) -> PrioritizedReplayBuffer:
        """Write this ``train()`` call's beta (annealed by progress) into the buffer; log it. O(1)."""
        buf = self._prioritized_buffer()
        start = buf.beta_start
        if self.anneal_beta and start is not None:
            done = min(max(1.0 - self._current_progress_remaining, 0.0), 1.0)
            buf.beta = start + (1.0 - start) * done
        self.logger.record("train/per_beta", buf.beta)
        return buf

    def save_replay_buffer(self, path: PathOrFile) -> None:
        """Write the replay buffer as a fastper checkpoint (pickle-free, checksummed). O(N).

        ``path``: a file path (parent folders are created; no suffix is
        added) or a writable binary file object.
        """
        save_replay_buffer(self, path)

    def load_replay_buffer(self, path: PathOrFile, truncate_last_traj: bool = True) -> None:
        """Load a replay buffer written by :meth:`save_replay_buffer`. O(N).

        ``truncate_last_traj`` is accepted for SB3's signature and unused (it
        concerns ``HerReplayBuffer``). See :func:`load_replay_buffer`.
        """
        load_replay_buffer(self, path)


class PERDQN(_PrioritizedAlgorithm, DQN):
    """SB3's DQN with prioritized replay (Schaul et al. 2016).

    Takes every argument of ``stable_baselines3.DQN`` (pass fastper's
    ``alpha``, ``beta``, ``eps``, ``scheme``... in ``replay_buffer_kwargs``),
    plus:

    Args:
        anneal_beta: anneal the buffer's constant beta linearly to 1 over
            ``learn()`` (default True).

    The loss is SB3's Huber loss per transition, weighted by the IS weights:
    ``mean(w_i * huber(Q(s_i, a_i) - y_i))``; priorities ``|Q(s_i, a_i) - y_i|``
    (before the gradient step). Costs per gradient step: SB3's, plus one
    ``sample`` and one ``update_priorities`` (O(B log N) each).
    """

    def __init__(self, *args: Any, anneal_beta: bool = True, **kwargs: Any) -> None:
        self.anneal_beta = bool(anneal_beta)
        super().__init__(*args, **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """``gradient_steps`` IS-weighted updates of the Q-network, priorities written back."""
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        buf = self._anneal()
        losses = []
        for _ in range(gradient_steps):
            batch = buf.sample(batch_size, env=self._vec_normalize_env)
            discount = self.gamma if batch.discounts is None else batch.discounts
            with th.no_grad():
                # greedy value of the next state under the target network
                next_value = self.q_net_target(batch.next_observations).max(dim=1).values
                target = batch.rewards + (1 - batch.dones) * discount * next_value.reshape(-1, 1)
            q_taken = th.gather(self.q_net(batch.observations), dim=1, index=batch.actions.long())
            td = q_taken - target
            loss = _weighted_mean(
                F.smooth_l1_loss(q_taken, target, reduction="none"), batch.weights
            )
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            buf.update_priorities(batch.indices, td.detach(), batch.keys)
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))


class PERSAC(_PrioritizedAlgorithm, SAC):
    """SB3's SAC with prioritized replay.

    Takes every argument of ``stable_baselines3.SAC``, plus:

    Args:
        anneal_beta: anneal the buffer's constant beta linearly to 1 over
            ``learn()`` (default True).
        weight_actor_loss: also weight the actor and entropy-coefficient
            losses by the IS weights (default False: only the critics').

    Critic loss: ``0.5 * sum_k mean(w_i * (Q_k(s_i, a_i) - y_i)^2)``;
    priority: ``mean_k |Q_k(s_i, a_i) - y_i|`` (before the gradient step).
    """

    def __init__(
        self,
        *args: Any,
        anneal_beta: bool = True,
        weight_actor_loss: bool = False,
        **kwargs: Any,
    ) -> None:
        self.anneal_beta = bool(anneal_beta)
        self.weight_actor_loss = bool(weight_actor_loss)
        super().__init__(*args, **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """``gradient_steps`` SAC updates with IS-weighted critic losses, priorities written back."""
        self.policy.set_training_mode(True)
        optimizers = [self.actor.optimizer, self.critic.optimizer]
        if self.ent_coef_optimizer is not None:
            optimizers.append(self.ent_coef_optimizer)
        self._update_learning_rate(optimizers)
        buf = self._anneal()
        ent_coef_losses, ent_coefs, actor_losses, critic_losses = [], [], [], []
        for gradient_step in range(gradient_steps):
            batch = buf.sample(batch_size, env=self._vec_normalize_env)
            discount = self.gamma if batch.discounts is None else batch.discounts
            actor_w = batch.weights if self.weight_actor_loss else None
            if self.use_sde:  # log_std may have moved since the last step
                self.actor.reset_noise()
            actions_pi, log_prob = self.actor.action_log_prob(batch.observations)
            log_prob = log_prob.reshape(-1, 1)

            # entropy temperature: tuned on a detached log-probability
            ent_coef_loss = None
            if self.ent_coef_optimizer is not None and self.log_ent_coef is not None:
                ent_coef = th.exp(self.log_ent_coef.detach())
                assert isinstance(self.target_entropy, float)
                ent_coef_loss = _weighted_mean(
                    -self.log_ent_coef * (log_prob + self.target_entropy).detach(), actor_w
                )
                ent_coef_losses.append(ent_coef_loss.item())
                self.ent_coef_optimizer.zero_grad()
                ent_coef_loss.backward()
                self.ent_coef_optimizer.step()
            else:
                ent_coef = self.ent_coef_tensor
            ent_coefs.append(ent_coef.item())

            with th.no_grad():
                next_actions, next_log_prob = self.actor.action_log_prob(batch.next_observations)
                next_q = th.cat(self.critic_target(batch.next_observations, next_actions), dim=1)
                next_q = next_q.min(dim=1, keepdim=True).values
                next_q = next_q - ent_coef * next_log_prob.reshape(-1, 1)
                target = batch.rewards + (1 - batch.dones) * discount * next_q

            tds = [q - target for q in self.critic(batch.observations, batch.actions)]
            critic_loss = 0.5 * sum(_weighted_mean(td.pow(2), batch.weights) for td in tds)
            assert isinstance(critic_loss, th.Tensor)
            critic_losses.append(critic_loss.item())
            self.critic.optimizer.zero_grad()
            critic_loss.backward()
            self.critic.optimizer.step()
            priority = th.cat(tds, dim=1).detach().abs().mean(dim=1)
            buf.update_priorities(batch.indices, priority, batch.keys)

            q_pi = th.cat(self.critic(batch.observations, actions_pi), dim=1)
            min_q_pi = q_pi.min(dim=1, keepdim=True).values
            actor_loss = _weighted_mean(ent_coef * log_prob - min_q_pi, actor_w)
            actor_losses.append(actor_loss.item())
            self.actor.optimizer.zero_grad()
            actor_loss.backward()
            self.actor.optimizer.step()

            if gradient_step % self.target_update_interval == 0:
                polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
                polyak_update(self.batch_norm_stats, self.batch_norm_stats_target, 1.0)

        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/ent_coef", np.mean(ent_coefs))
        self.logger.record("train/actor_loss", np.mean(actor_losses))
        self.logger.record("train/critic_loss", np.mean(critic_losses))
        if ent_coef_losses:
            self.logger.record("train/ent_coef_loss", np.mean(ent_coef_losses))


class PERTD3(_PrioritizedAlgorithm, TD3):
    """SB3's TD3 with prioritized replay.

    Takes every argument of ``stable_baselines3.TD3``, plus:

    Args:
        anneal_beta: anneal the buffer's constant beta linearly to 1 over
            ``learn()`` (default True).
        weight_actor_loss: also weight the (delayed) actor loss by the IS
            weights (default False: only the critics').

    Critic loss: ``sum_k mean(w_i * (Q_k(s_i, a_i) - y_i)^2)``; priority:
    ``mean_k |Q_k(s_i, a_i) - y_i|`` (before the gradient step).
    """

    def __init__(
        self,
        *args: Any,
        anneal_beta: bool = True,
        weight_actor_loss: bool = False,
        **kwargs: Any,
    ) -> None:
        self.anneal_beta = bool(anneal_beta)
        self.weight_actor_loss = bool(weight_actor_loss)
        super().__init__(*args, **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """``gradient_steps`` TD3 updates with IS-weighted critic losses, priorities written back."""
        self.policy.set_training_mode(True)
        self._update_learning_rate([self.actor.optimizer, self.critic.optimizer])
        buf = self._anneal()
        actor_losses, critic_losses = [], []
        for _ in range(gradient_steps):
            self._n_updates += 1
            batch = buf.sample(batch_size, env=self._vec_normalize_env)
            discount = self.gamma if batch.discounts is None else batch.discounts
            with th.no_grad():
                # target policy smoothing: clipped Gaussian noise on the target action
                noise = th.randn_like(batch.actions) * self.target_policy_noise
                noise = noise.clamp(-self.target_noise_clip, self.target_noise_clip)
                next_actions = (self.actor_target(batch.next_observations) + noise).clamp(-1, 1)
                next_q = th.cat(self.critic_target(batch.next_observations, next_actions), dim=1)
                next_q = next_q.min(dim=1, keepdim=True).values
                target = batch.rewards + (1 - batch.dones) * discount * next_q

            tds = [q - target for q in self.critic(batch.observations, batch.actions)]
            critic_loss = sum(_weighted_mean(td.pow(2), batch.weights) for td in tds)
            assert isinstance(critic_loss, th.Tensor)
            critic_losses.append(critic_loss.item())
            self.critic.optimizer.zero_grad()
            critic_loss.backward()
            self.critic.optimizer.step()
            priority = th.cat(tds, dim=1).detach().abs().mean(dim=1)
            buf.update_priorities(batch.indices, priority, batch.keys)

            if self._n_updates % self.policy_delay == 0:
                q_pi = self.critic.q1_forward(batch.observations, self.actor(batch.observations))
                actor_w = batch.weights if self.weight_actor_loss else None
                actor_loss = -_weighted_mean(q_pi, actor_w)
                actor_losses.append(actor_loss.item())
                self.actor.optimizer.zero_grad()
                actor_loss.backward()
                self.actor.optimizer.step()
                polyak_update(self.critic.parameters(), self.critic_target.parameters(), self.tau)
                polyak_update(self.actor.parameters(), self.actor_target.parameters(), self.tau)
                polyak_update(
                    self.critic_batch_norm_stats, self.critic_batch_norm_stats_target, 1.0
                )
                polyak_update(self.actor_batch_norm_stats, self.actor_batch_norm_stats_target, 1.0)

        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if actor_losses:
            self.logger.record("train/actor_loss", np.mean(actor_losses))
        self.logger.record("train/critic_loss", np.mean(critic_losses))
