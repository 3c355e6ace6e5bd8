"""The SB3 adapter's seams: beta has one source (the fastper buffer), and unprioritized replay warns.

Loggers write to ``tmp_path`` (SB3 would make a folder in the system's temp
folder for every model without one).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.logger import configure  # noqa: E402

import fastper  # noqa: E402
from fastper.compat.sb3 import PERDQN, PrioritizedReplayBuffer  # noqa: E402

OBS = spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT = spaces.Discrete(2)


def quiet(model, folder):
    model.set_logger(configure(str(folder), []))  # no output, no folder elsewhere
    return model


def filled(rows: int = 32, **kwargs) -> PrioritizedReplayBuffer:
    buf = PrioritizedReplayBuffer(rows, OBS, ACT, "cpu", seed=0, **kwargs)
    rng = np.random.default_rng(0)
    for _ in range(rows):
        obs = rng.uniform(-1, 1, (1, 3)).astype(np.float32)
        buf.add(obs, obs, np.array([[rng.integers(2)]]), rng.normal(size=1), [False], [{}])
    return buf


def unprioritized(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "no priority was ever updated" in str(w.message)]


# -- beta: the fastper buffer's schedule is its one source ----------------------------
def test_defect_annealed_beta_is_the_fastper_buffers_beta(tmp_path) -> None:
    model = quiet(
        PERDQN(
            "MlpPolicy",
            "CartPole-v1",
            buffer_size=64,
            learning_starts=0,
            seed=0,
            policy_kwargs={"net_arch": [8]},
            replay_buffer_kwargs={"beta": 0.8, "seed": 3},
        ),
        tmp_path,
    )
    buf = model.replay_buffer
    rng = np.random.default_rng(0)
    for _ in range(40):
        obs = rng.normal(size=(1, 4)).astype(np.float32)
        buf.add(obs, obs, np.array([[rng.integers(2)]]), rng.normal(size=1), [False], [{}])
    buf.update_priorities(np.arange(40), rng.exponential(1.0, 40))
    model._current_progress_remaining = 0.5
    model.train(gradient_steps=1, batch_size=8)
    # annealed half-way from 0.8 to 1, and it is the fastper buffer's beta
    assert buf.beta == pytest.approx(0.9) and buf.fastper_buffer.beta == pytest.approx(0.9)
    assert buf.beta_start == 0.8
    # a copy of the fastper buffer's state samples exactly what the adapter samples
    clone = fastper.from_state_dict(buf.fastper_buffer.state_dict())
    expected = clone.sample(16)
    got = buf.sample(16)
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_array_equal(got.weights.numpy().ravel(), expected.weights.astype(np.float32))
    # and its file brings that beta along; the annealing start stays this buffer's
    buf.save(tmp_path / "replay.fpk")
    other = PrioritizedReplayBuffer(64, buf.observation_space, buf.action_space, "cpu", beta=0.8)
    other.load(tmp_path / "replay.fpk")
    assert other.beta == pytest.approx(0.9) and other.beta_start == 0.8
    a, b = buf.sample(16), other.sample(16)
    assert th.equal(a.weights, b.weights)


def test_setting_beta_replaces_the_schedule_and_none_restores_it() -> None:
    buf = filled(beta=fastper.schedules.linear(0.4, 1.0, 10))
    assert buf.beta_start is None and buf.beta == pytest.approx(0.4)
    buf.beta = 0.7
    assert buf.fastper_buffer.beta == 0.7
    for _ in range(5):
        buf.sample(4)
    assert buf.beta == 0.7  # a constant now, on the buffer's own step
    buf.beta = None  # the schedule given, at the buffer's step (5 samples)
    assert buf.beta == pytest.approx(0.7) and buf.fastper_buffer.beta == pytest.approx(0.7)
    buf.sample(4)
    assert buf.beta == pytest.approx(0.76)
    with pytest.raises(ValueError, match="`beta` must be >= 0.0"):
        buf.beta = -1.0


def test_a_file_with_a_beta_schedule_is_used_as_given(tmp_path) -> None:
    scheduled = filled(beta=fastper.schedules.linear(0.5, 1.0, 100))
    scheduled.save(tmp_path / "r.fpk")
    buf = PrioritizedReplayBuffer(32, OBS, ACT, "cpu", beta=0.4)
    buf.load(tmp_path / "r.fpk")
    assert buf.beta_start is None and buf.beta == pytest.approx(0.5)  # not annealed
    buf.sample(4)
    assert buf.beta == pytest.approx(0.505)


# -- a prioritized buffer whose priorities are never updated says so -----------------
def test_defect_plain_dqn_with_a_prioritized_buffer_warns_it_replays_uniformly(tmp_path) -> None:
    model = quiet(
        DQN(
            "MlpPolicy",
            "CartPole-v1",
            buffer_size=64,
            learning_starts=0,
            train_freq=1,
            batch_size=8,
            seed=0,
            policy_kwargs={"net_arch": [8]},
            replay_buffer_class=PrioritizedReplayBuffer,
        ),
        tmp_path,
    )
    model.replay_buffer.warn_unprioritized_after = 20
    with pytest.warns(UserWarning, match="replays uniformly .*PERDQN") as record:
        model.learn(40)
    assert len(unprioritized(record.list)) == 1
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        model.learn(40)
    assert unprioritized(again) == []  # once


def test_rank_based_buffer_without_updates_warns_of_slot_order() -> None:
    buf = filled(scheme="rank")
    buf.warn_unprioritized_after = 5
    with pytest.warns(UserWarning, match="by slot order"):
        for _ in range(5):
            buf.sample(4)


def test_no_warning_when_priorities_move_or_replay_is_uniform(tmp_path) -> None:
    def sampled(buf: PrioritizedReplayBuffer, times: int = 6) -> list[str]:
        buf.warn_unprioritized_after = 5
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(times):
                s = buf.sample(4)
        del s
        return unprioritized(record)

    assert sampled(filled(scheme="uniform")) == []
    updated = filled()
    s = updated.sample(4)
    updated.update_priorities(s.indices, np.ones(4) * 3.0, s.keys)
    assert sampled(updated) == []
    direct = filled()  # updated through the fastper buffer itself
    direct.fastper_buffer.update_priorities(np.arange(4), np.full(4, 2.0))
    assert sampled(direct) == []
    model = quiet(
        PERDQN(
            "MlpPolicy",
            "CartPole-v1",
            buffer_size=64,
            learning_starts=0,
            train_freq=1,
            batch_size=8,
            seed=0,
            policy_kwargs={"net_arch": [8]},
        ),
        tmp_path,
    )
    model.replay_buffer.warn_unprioritized_after = 5
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.learn(30)
    assert unprioritized(record) == []
