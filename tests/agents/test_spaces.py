"""Field specs from Gymnasium spaces (duck-typed; gymnasium itself only where installed)."""

from __future__ import annotations

import numpy as np
import pytest

import fastper
from fastper.spaces import fields_from_space, fields_from_spaces
from fastper.storage import Field


class Box:
    def __init__(self, shape: tuple[int, ...], dtype: type) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)


class Discrete:
    def __init__(self, n: int) -> None:
        self.n, self.shape, self.dtype = n, (), np.dtype(np.int64)


class Dict:
    def __init__(self, spaces: dict) -> None:
        self.spaces = spaces


class Text:
    pass


def test_box_and_discrete_layout() -> None:
    f = fields_from_spaces(Box((4,), np.float32), Discrete(2))
    assert f == {
        "obs": Field((4,), np.dtype(np.float32)),
        "action": Field((), np.dtype(np.int64)),
        "reward": Field((), np.dtype(np.float32)),
        "next_obs": Field((4,), np.dtype(np.float32)),
        "terminated": Field((), np.dtype(np.bool_)),
        "truncated": Field((), np.dtype(np.bool_)),
    }


def test_image_observations_keep_uint8() -> None:
    f = fields_from_spaces(Box((84, 84, 4), np.uint8), Discrete(6), truncated=False, next_obs=False)
    assert f["obs"] == Field((84, 84, 4), np.dtype(np.uint8))
    assert "next_obs" not in f and "truncated" not in f


def test_dict_observation_flattens_with_dotted_names() -> None:
    space = Dict({"pos": Box((2,), np.float64), "goal": Dict({"xy": Box((2,), np.float32)})})
    f = fields_from_space("obs", space)
    assert set(f) == {"obs.pos", "obs.goal.xy"}
    assert f["obs.pos"].dtype == np.float64


def test_extra_fields_and_collisions() -> None:
    f = fields_from_spaces(
        Box((3,), np.float32), Box((1,), np.float32), extra={"logp": ((), np.float32)}
    )
    assert f["logp"] == Field((), np.dtype(np.float32))
    with pytest.raises(ValueError, match="`extra` must not repeat a transition field"):
        fields_from_spaces(Box((3,), np.float32), Discrete(2), extra={"reward": ((), np.float32)})


def test_unsupported_space_is_refused() -> None:
    with pytest.raises(TypeError, match="`space` must be a Box, Discrete"):
        fields_from_spaces(Text(), Discrete(2))


def test_buffer_from_real_gymnasium_env_round_trips() -> None:
    gym = pytest.importorskip("gymnasium")
    env = gym.make("CartPole-v1")
    buf = fastper.PrioritizedReplayBuffer(
        64, fields_from_spaces(env.observation_space, env.action_space), seed=0
    )
    obs, _ = env.reset(seed=0)
    for _ in range(10):
        a = env.action_space.sample()
        nxt, r, term, trunc, _ = env.step(a)
        buf.add({"obs": obs, "action": a, "reward": r, "next_obs": nxt,
                 "terminated": term, "truncated": trunc})  # fmt: skip
        obs = nxt if not (term or trunc) else env.reset()[0]
    batch = buf.sample(8)
    assert batch["obs"].dtype == np.float32 and batch["obs"].shape == (8, 4)
    assert batch["action"].dtype == np.int64
