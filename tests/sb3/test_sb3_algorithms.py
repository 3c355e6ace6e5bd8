"""PERDQN, PERSAC and PERTD3: IS weights reach the loss, |TD| comes back, SB3 plumbing works.

The gradient checks predict the next minibatch from a copy of the buffer's
state (same random state: the same draws), then compute one SGD step by hand
(DQN: a linear Q-network, the Huber gradient written out; SAC / TD3: the
weighted critic loss written out on copies of the networks) and compare it
with what ``train`` did.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.logger import configure  # noqa: E402
from stable_baselines3.common.vec_env import VecNormalize  # noqa: E402

import fastper  # noqa: E402
from fastper.compat.sb3 import (  # noqa: E402
    PERDQN,
    PERSAC,
    PERTD3,
    DictPrioritizedReplayBuffer,
    PrioritizedReplayBuffer,
    load_replay_buffer,
    save_replay_buffer,
)

EPS = 1e-6


def quiet(model):
    model.set_logger(configure(None, []))  # train() logs; no output
    return model


def fill_random(model, steps: int, seed: int = 0) -> None:
    """Random transitions of the model's spaces, some done, then varied priorities."""
    buf = model.replay_buffer
    n = buf.n_envs
    rng = np.random.default_rng(seed)
    buf.observation_space.seed(seed)
    buf.action_space.seed(seed)
    for _ in range(steps):
        obs = np.stack([buf.observation_space.sample() for _ in range(n)])
        nxt = np.stack([buf.observation_space.sample() for _ in range(n)])
        act = np.stack([buf.action_space.sample() for _ in range(n)])
        done = rng.random(n) < 0.2
        buf.add(obs, nxt, act, rng.normal(size=n).astype(np.float32), done, [{}] * n)
    size = len(buf.fastper_buffer)
    buf.update_priorities(np.arange(size), rng.exponential(1.0, size))


def next_batch(buf: PrioritizedReplayBuffer, batch_size: int):
    """The minibatch ``buf`` will draw next (a copy of its state draws the same)."""
    clone = fastper.from_state_dict(buf.fastper_buffer.state_dict())
    return clone.sample(batch_size)  # the buffer's own beta schedule, as the adapter uses


# ---------------------------------------------------------------------------
# DQN: one SGD step by hand
# ---------------------------------------------------------------------------


def linear_dqn(**kwargs) -> PERDQN:
    return quiet(
        PERDQN(
            "MlpPolicy",
            "CartPole-v1",
            learning_rate=0.05,
            learning_starts=0,
            gamma=0.9,
            max_grad_norm=1e9,
            seed=0,
            anneal_beta=False,
            policy_kwargs={"net_arch": [], "optimizer_class": th.optim.SGD},
            replay_buffer_kwargs={"alpha": 0.6, "beta": 0.8, "seed": 3},
            **kwargs,
        )
    )


def test_dqn_step_follows_the_is_weighted_huber_gradient() -> None:
    model = linear_dqn()
    fill_random(model, 200)
    batch_size, lr, gamma = 32, 0.05, 0.9
    b = next_batch(model.replay_buffer, batch_size)
    layer = model.q_net.q_net[0]  # net_arch=[]: Q(s) = W s + c
    w0 = layer.weight.detach().numpy().astype(np.float64).copy()
    c0 = layer.bias.detach().numpy().astype(np.float64).copy()
    s, s2 = b["obs"].astype(np.float64), b["next_obs"].astype(np.float64)
    a = b["action"].ravel()
    r = b["reward"].astype(np.float64)
    term = (b["done"] * (1 - b["timeout"])).astype(np.float64)  # SB3's columns
    rows = np.arange(batch_size)
    q = (s @ w0.T + c0)[rows, a]
    y = r + (1 - term) * gamma * (s2 @ w0.T + c0).max(axis=1)  # the target net equals the net
    td = q - y
    weights = b.weights
    assert weights.min() < 0.9 * weights.max()  # the weights are not all the same

    def sgd_step(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = w * np.clip(td, -1.0, 1.0) / batch_size  # d mean(w huber(td)) / d q
        gw, gc = np.zeros_like(w0), np.zeros_like(c0)
        np.add.at(gw, a, g[:, None] * s)
        np.add.at(gc, a, g)
        return w0 - lr * gw, c0 - lr * gc

    model.train(gradient_steps=1, batch_size=batch_size)
    w_hand, c_hand = sgd_step(weights)
    np.testing.assert_allclose(layer.weight.detach().numpy(), w_hand, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(layer.bias.detach().numpy(), c_hand, rtol=1e-4, atol=1e-6)
    w_plain, _ = sgd_step(np.ones(batch_size))  # what an unweighted loss would have done
    assert (
        np.abs(w_plain - w_hand).max() > 100 * np.abs(layer.weight.detach().numpy() - w_hand).max()
    )
    # priorities |td| + eps, from the TD errors before the step
    np.testing.assert_allclose(
        model.replay_buffer.fastper_buffer.priorities(b.indices), np.abs(td) + EPS, rtol=1e-4
    )


def test_beta_is_annealed_to_one_by_progress() -> None:
    model = linear_dqn()
    model.anneal_beta = True
    fill_random(model, 50)
    buf = model.replay_buffer
    assert buf.beta_start == 0.8
    for remaining, beta in ((1.0, 0.8), (0.5, 0.9), (0.0, 1.0)):
        model._current_progress_remaining = remaining
        model.train(gradient_steps=1, batch_size=8)
        assert buf.beta == pytest.approx(beta)
    assert model.logger.name_to_value["train/per_beta"] == pytest.approx(1.0)


def test_learn_anneals_beta_and_writes_priorities() -> None:
    model = quiet(PERDQN("MlpPolicy", "CartPole-v1", learning_starts=50, train_freq=4, seed=1))
    model.learn(400)
    buf = model.replay_buffer
    assert buf.beta > 0.95  # 0.4 -> 1 as progress runs out
    p = buf.fastper_buffer.priorities(np.arange(len(buf.fastper_buffer)))
    assert (p != 1.0).sum() > 50  # sampled transitions got |td| + eps back


# ---------------------------------------------------------------------------
# SAC and TD3: the weighted critic loss and the mean-over-critics priority
# ---------------------------------------------------------------------------


def sgd_critic_step(critic, loss: th.Tensor, lr: float) -> dict[str, th.Tensor]:
    grads = th.autograd.grad(loss, list(critic.parameters()))
    return {
        name: p.detach() - lr * g
        for (name, p), g in zip(critic.named_parameters(), grads, strict=True)
    }


def assert_critic_is(critic, expected: dict[str, th.Tensor]) -> None:
    for name, p in critic.named_parameters():
        th.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-6)


def batch_tensors(b) -> tuple[th.Tensor, ...]:
    def t(x: np.ndarray) -> th.Tensor:
        return th.as_tensor(x)

    return (
        t(b["obs"]),
        t(b["action"]),
        t(b["next_obs"]),
        t(b["reward"]).reshape(-1, 1),
        t(b["done"] * (1 - b["timeout"])).reshape(-1, 1),
        t(b.weights.astype(np.float32)).reshape(-1, 1),
    )


def actor_critic(cls, **kwargs):
    return quiet(
        cls(
            "MlpPolicy",
            "Pendulum-v1",
            learning_rate=0.01,
            learning_starts=0,
            gamma=0.9,
            seed=0,
            anneal_beta=False,
            replay_buffer_kwargs={"beta": 0.7, "seed": 5},
            policy_kwargs={"net_arch": [16], "optimizer_class": th.optim.SGD},
            **kwargs,
        )
    )


def test_td3_critic_step_uses_the_is_weights_and_priorities_average_the_critics() -> None:
    model = actor_critic(PERTD3, target_policy_noise=0.0, policy_delay=2)
    fill_random(model, 200)
    b = next_batch(model.replay_buffer, 24)
    obs, act, nxt, rew, term, w = batch_tensors(b)
    critic = copy.deepcopy(model.critic)
    with th.no_grad():
        next_q = th.cat(model.critic_target(nxt, model.actor_target(nxt)), dim=1)
        y = rew + (1 - term) * 0.9 * next_q.min(dim=1, keepdim=True).values
    tds = [q - y for q in critic(obs, act)]
    loss = sum((w * td.pow(2)).mean() for td in tds)
    expected = sgd_critic_step(critic, loss, 0.01)
    actor_before = copy.deepcopy(model.actor.state_dict())
    model.train(gradient_steps=1, batch_size=24)
    assert_critic_is(model.critic, expected)
    priority = th.cat(tds, dim=1).detach().abs().mean(dim=1).double().numpy()
    np.testing.assert_allclose(
        model.replay_buffer.fastper_buffer.priorities(b.indices), priority + EPS, rtol=1e-5
    )
    for k, v in model.actor.state_dict().items():  # policy_delay=2: no actor step yet
        assert th.equal(v, actor_before[k])


def test_td3_weight_actor_loss_weights_the_policy_gradient() -> None:
    model = actor_critic(PERTD3, target_policy_noise=0.0, policy_delay=1, weight_actor_loss=True)
    fill_random(model, 200)
    b = next_batch(model.replay_buffer, 24)
    obs, _, _, _, _, w = batch_tensors(b)
    actor = copy.deepcopy(model.actor)
    model.train(gradient_steps=1, batch_size=24)
    # the actor steps on the critic just updated (which the polyak update leaves as it is)
    loss = -(w * model.critic.q1_forward(obs, actor(obs))).mean()
    grads = th.autograd.grad(loss, list(actor.parameters()))
    for (name, p), g in zip(actor.named_parameters(), grads, strict=True):
        th.testing.assert_close(
            dict(model.actor.named_parameters())[name].detach(), p.detach() - 0.01 * g
        )


def test_sac_critic_step_uses_the_is_weights() -> None:
    model = actor_critic(PERSAC, ent_coef=0.1)
    fill_random(model, 200)
    b = next_batch(model.replay_buffer, 24)
    obs, act, nxt, rew, term, w = batch_tensors(b)
    actor, critic = copy.deepcopy(model.actor), copy.deepcopy(model.critic)
    th.manual_seed(11)
    actor.action_log_prob(obs)  # train() draws the policy's actions first ...
    with th.no_grad():
        next_a, next_logp = actor.action_log_prob(nxt)  # ... then the next actions
        next_q = th.cat(model.critic_target(nxt, next_a), dim=1).min(dim=1, keepdim=True).values
        y = rew + (1 - term) * 0.9 * (next_q - 0.1 * next_logp.reshape(-1, 1))
    tds = [q - y for q in critic(obs, act)]
    loss = 0.5 * sum((w * td.pow(2)).mean() for td in tds)
    expected = sgd_critic_step(critic, loss, 0.01)
    th.manual_seed(11)
    model.train(gradient_steps=1, batch_size=24)
    # the actor step after the critic's does not touch the critic's parameters
    assert_critic_is(model.critic, expected)
    priority = th.cat(tds, dim=1).detach().abs().mean(dim=1).double().numpy()
    np.testing.assert_allclose(
        model.replay_buffer.fastper_buffer.priorities(b.indices), priority + EPS, rtol=1e-5
    )


def test_sac_with_vecnormalize_and_four_envs_learns_a_few_steps() -> None:
    env = VecNormalize(make_vec_env("Pendulum-v1", n_envs=4, seed=0))
    model = quiet(
        PERSAC(
            "MlpPolicy",
            env,
            learning_starts=64,
            batch_size=32,
            seed=0,
            policy_kwargs={"net_arch": [32]},
            weight_actor_loss=True,
        )
    )
    model.learn(400)
    buf = model.replay_buffer
    assert buf.n_envs == 4 and len(buf.fastper_buffer) == 400
    # stored observations are the raw ones (SB3 stores get_original_obs()): cos^2 + sin^2 = 1
    raw = buf.fastper_buffer.storage.gather(np.arange(400))["obs"]
    np.testing.assert_allclose(raw[:, 0] ** 2 + raw[:, 1] ** 2, 1.0, rtol=1e-5)
    s = buf.sample(8, env=model._vec_normalize_env)  # as train() samples
    np.testing.assert_allclose(s.observations.numpy(), env.normalize_obs(raw[s.indices]), rtol=1e-5)
    assert (buf.fastper_buffer.priorities(np.arange(400)) != 1.0).sum() > 50
    env.close()


def test_td3_learns_with_n_step_returns_without_sb3_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SB3 would warn that n_steps is ignored
        model = quiet(
            PERTD3(
                "MlpPolicy",
                "Pendulum-v1",
                n_steps=3,
                learning_starts=50,
                seed=0,
                policy_kwargs={"net_arch": [32]},
            )
        )
    buf = model.replay_buffer
    assert model.n_steps == 3 and buf.n_steps == 3
    model.learn(150)
    assert buf.sample(4).discounts is not None
    assert buf.n_pending == 2  # Pendulum's 200-step episodes: the last 2 steps wait
    stored = len(buf.fastper_buffer)
    model.learn(1)  # resets the env: the cut episode's windows are dropped, not run on
    assert (buf.n_pending, len(buf.fastper_buffer)) == (1, stored)
    model.learn(1, reset_num_timesteps=False)  # same episode: the window goes on
    assert (buf.n_pending, len(buf.fastper_buffer)) == (2, stored)


# ---------------------------------------------------------------------------
# SB3 plumbing: buffer classes, vector envs, save / load
# ---------------------------------------------------------------------------


def test_default_buffer_class_follows_the_observation_space() -> None:
    class DictObs(gym.ObservationWrapper):
        def __init__(self, env: gym.Env) -> None:
            super().__init__(env)
            self.observation_space = spaces.Dict({"state": env.observation_space})

        def observation(self, observation):
            return {"state": observation}

    model = PERDQN("MultiInputPolicy", DictObs(gym.make("CartPole-v1")), learning_starts=10)
    assert type(model.replay_buffer) is DictPrioritizedReplayBuffer
    quiet(model).learn(60)
    assert model.replay_buffer.sample(4).observations["state"].shape == (4, 4)
    with pytest.raises(TypeError, match="must be a fastper.compat.sb3 PrioritizedReplayBuffer"):
        PERDQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer)


def test_dqn_with_four_envs_stores_every_env() -> None:
    env = make_vec_env("CartPole-v1", n_envs=4, seed=0)
    model = quiet(PERDQN("MlpPolicy", env, learning_starts=40, train_freq=2, seed=0))
    model.learn(400)
    buf = model.replay_buffer
    assert (buf.n_envs, buf.pos, len(buf.fastper_buffer)) == (4, 100, 400)
    assert (buf.fastper_buffer.priorities(np.arange(400)) != 1.0).sum() > 50


def test_replay_buffer_files_round_trip_and_are_not_pickles(tmp_path) -> None:
    model = quiet(PERDQN("MlpPolicy", "CartPole-v1", learning_starts=50, seed=0))
    model.learn(300)
    path = tmp_path / "replay"
    model.save_replay_buffer(path)  # as given: SB3 would add ".pkl"
    assert path.read_bytes()[:8] == b"\x89FPCKPT\n"
    fresh = quiet(PERDQN("MlpPolicy", "CartPole-v1", seed=0))
    fresh.load_replay_buffer(path)
    # beta is the algorithm's (annealed by its progress, set at every train())
    fresh.replay_buffer.beta = model.replay_buffer.beta
    a, b = model.replay_buffer.sample(16), fresh.replay_buffer.sample(16)
    np.testing.assert_array_equal(a.indices, b.indices)
    assert th.equal(a.observations, b.observations) and th.equal(a.weights, b.weights)
    stream = io.BytesIO()
    save_replay_buffer(model, stream)
    load_replay_buffer(fresh, io.BytesIO(stream.getvalue()))
    np.testing.assert_array_equal(
        model.replay_buffer.sample(8).indices, fresh.replay_buffer.sample(8).indices
    )


def test_plain_sb3_algorithms_use_the_buffer_and_its_files(tmp_path) -> None:
    model = quiet(
        DQN(
            "MlpPolicy",
            "CartPole-v1",
            learning_starts=20,
            seed=0,
            replay_buffer_class=PrioritizedReplayBuffer,
        )
    )
    model.learn(100)
    with pytest.raises(TypeError, match="not picklable.*save_replay_buffer"):
        model.save_replay_buffer(tmp_path / "r.pkl")  # SB3's way pickles
    save_replay_buffer(model, tmp_path / "r.fpk")
    load_replay_buffer(model, tmp_path / "r.fpk")
    assert len(model.replay_buffer.fastper_buffer) == 100
    with pytest.raises(TypeError, match="must be a fastper.compat.sb3"):
        save_replay_buffer(quiet(DQN("MlpPolicy", "CartPole-v1")), tmp_path / "x")


def test_model_save_and_load_keep_the_settings_and_the_policy(tmp_path) -> None:
    model = quiet(
        PERDQN(
            "MlpPolicy",
            "CartPole-v1",
            learning_starts=50,
            seed=0,
            anneal_beta=False,
            replay_buffer_kwargs={"alpha": 0.5, "beta": 0.6, "scheme": "rank"},
        )
    )
    model.learn(300)
    model.save(tmp_path / "model.zip")
    model.save_replay_buffer(tmp_path / "replay.fpk")
    loaded = PERDQN.load(tmp_path / "model.zip", env=gym.make("CartPole-v1"))
    assert type(loaded.replay_buffer) is PrioritizedReplayBuffer
    assert loaded.anneal_beta is False and loaded.replay_buffer.scheme == "rank"
    obs = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    np.testing.assert_array_equal(
        model.predict(obs, deterministic=True)[0], loaded.predict(obs, deterministic=True)[0]
    )
    loaded.load_replay_buffer(tmp_path / "replay.fpk")
    np.testing.assert_array_equal(
        model.replay_buffer.sample(8).indices, loaded.replay_buffer.sample(8).indices
    )
    # the model file holds no pickled buffer: SB3 excludes it, and it would refuse
    with pytest.raises(TypeError):
        pickle.dumps(loaded.replay_buffer)
