"""fastper.compat.sb3's buffers against SB3's own ReplayBuffer / DictReplayBuffer.

The oracle: SB3's buffer fed the same ``add`` calls. Every sampled row must be
the transition SB3 stores at the same (step, env) (slot = step * n_envs +
env), with SB3's shapes, dtypes and device, and ``pos`` / ``full`` /
``size()`` must follow SB3's after every add, ring wrap included.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import gymnasium as gym  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

import fastper  # noqa: E402
from fastper.compat.sb3 import (  # noqa: E402
    DictPrioritizedReplayBuffer,
    DictPrioritizedReplayBufferSamples,
    PrioritizedReplayBuffer,
    PrioritizedReplayBufferSamples,
)

OBS_SPACES = {
    "box": spaces.Box(-1.0, 1.0, (3,), np.float32),
    "discrete": spaces.Discrete(5),
    "multibinary": spaces.MultiBinary(4),
    "dict": spaces.Dict(
        {"vec": spaces.Box(-1.0, 1.0, (2, 3), np.float32), "pos": spaces.Discrete(4)}
    ),
}
ACTION_SPACES = {
    "box": spaces.Box(-1.0, 1.0, (2,), np.float32),
    "discrete": spaces.Discrete(3),
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
}
SB3_FIELDS = ("observations", "actions", "next_observations", "dones", "rewards")


def stack(space: spaces.Space, n: int) -> np.ndarray | dict[str, np.ndarray]:
    """One vector-env step of ``space``: n samples with a leading env dimension."""
    if isinstance(space, spaces.Dict):
        return {key: np.stack([sub.sample() for _ in range(n)]) for key, sub in space.items()}
    return np.stack([space.sample() for _ in range(n)])


def make_pair(obs_kind: str, act_kind: str, n_envs: int, rows: int, **kwargs):
    obs_space, act_space = OBS_SPACES[obs_kind], ACTION_SPACES[act_kind]
    obs_space.seed(1)
    act_space.seed(2)
    is_dict = obs_kind == "dict"
    ours = (DictPrioritizedReplayBuffer if is_dict else PrioritizedReplayBuffer)(
        rows * n_envs, obs_space, act_space, device="cpu", n_envs=n_envs, seed=0, **kwargs
    )
    ref = (DictReplayBuffer if is_dict else ReplayBuffer)(
        rows * n_envs, obs_space, act_space, device="cpu", n_envs=n_envs
    )
    return ours, ref


def fill(ours, ref, steps: int, n_envs: int, rng: np.random.Generator) -> None:
    """The same random steps into both (dones, some of them time-limit truncations)."""
    for _ in range(steps):
        obs = stack(ours.observation_space, n_envs)
        next_obs = stack(ours.observation_space, n_envs)
        action = stack(ours.action_space, n_envs)
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.4
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        # SB3's DictReplayBuffer reshapes the dict it is given in place
        ours.add(copy.deepcopy(obs), copy.deepcopy(next_obs), action, reward, done, infos)
        if ref is not None:
            ref.add(obs, next_obs, action, reward, done, infos)
            assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size())


def stored(ref, name: str, row: np.ndarray, env: np.ndarray):
    """SB3's stored value of field ``name`` at (row, env), as its sample would give it."""
    if name == "dones":
        return (ref.dones[row, env] * (1 - ref.timeouts[row, env])).reshape(-1, 1)
    if name == "rewards":
        return ref.rewards[row, env].reshape(-1, 1)
    arr = getattr(ref, name)
    if isinstance(arr, dict):
        return {k: v[row, env] for k, v in arr.items()}
    return arr[row, env]


def assert_same_layout(ours_value, ref_value, batch: int) -> None:
    if isinstance(ref_value, dict):
        assert ours_value.keys() == ref_value.keys()
        for key in ref_value:
            assert_same_layout(ours_value[key], ref_value[key], batch)
        return
    assert isinstance(ours_value, th.Tensor)
    assert ours_value.dtype == ref_value.dtype
    assert ours_value.device == ref_value.device
    assert ours_value.shape == (batch, *ref_value.shape[1:])


def assert_equal_rows(ours_value, expected) -> None:
    if isinstance(expected, dict):
        for key in expected:
            assert_equal_rows(ours_value[key], expected[key])
        return
    got = ours_value.numpy()
    np.testing.assert_array_equal(got, np.asarray(expected).reshape(got.shape))


# ---------------------------------------------------------------------------
# the oracle: SB3's buffer fed the same data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_envs", [1, 4])
@pytest.mark.parametrize("act_kind", sorted(ACTION_SPACES))
@pytest.mark.parametrize("obs_kind", sorted(OBS_SPACES))
def test_samples_are_the_stored_transitions_in_sb3_layout(obs_kind, act_kind, n_envs) -> None:
    rows, batch = 12, 96
    ours, ref = make_pair(obs_kind, act_kind, n_envs, rows)
    fill(ours, ref, 30, n_envs, np.random.default_rng(0))  # wraps the ring twice
    assert ours.full and ours.size() == rows
    s = ours.sample(batch)
    r = ref.sample(batch)
    kind = (
        DictPrioritizedReplayBufferSamples if obs_kind == "dict" else PrioritizedReplayBufferSamples
    )
    assert type(s) is kind
    row, env = np.divmod(s.indices, n_envs)
    for name in SB3_FIELDS:
        assert_same_layout(getattr(s, name), getattr(r, name), batch)
        assert_equal_rows(getattr(s, name), stored(ref, name, row, env))
    assert s.discounts is None and r.discounts is None
    assert s.weights.shape == (batch, 1) and s.weights.dtype == th.float32
    assert float(s.weights.max()) <= 1.0 and float(s.weights.min()) > 0.0
    assert s.indices.dtype == np.int64 and s.keys.dtype == np.int64
    np.testing.assert_array_equal(s.keys, ours.fastper_buffer.keys(s.indices))
    # every stored transition can come out: many draws reach every slot
    seen = np.concatenate([ours.sample(256).indices for _ in range(8)])
    assert set(seen.tolist()) == set(range(rows * n_envs))


def test_pos_full_and_size_follow_sb3_before_and_after_a_wrap() -> None:
    ours, ref = make_pair("box", "box", 2, 5)
    assert (ours.pos, ours.full, ours.size()) == (0, False, 0)
    fill(ours, ref, 13, 2, np.random.default_rng(3))  # checks after every add
    ours.reset()
    ref.reset()
    assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size()) == (0, False, 0)
    assert len(ours.fastper_buffer) == 0
    fill(ours, ref, 3, 2, np.random.default_rng(4))


def test_buffer_size_is_split_between_envs_as_in_sb3() -> None:
    buf = PrioritizedReplayBuffer(10, OBS_SPACES["box"], ACTION_SPACES["box"], n_envs=4)
    assert buf.buffer_size == 2 and buf.fastper_buffer.capacity == 8
    tiny = PrioritizedReplayBuffer(2, OBS_SPACES["box"], ACTION_SPACES["box"], n_envs=4)
    assert tiny.buffer_size == 1 and tiny.fastper_buffer.capacity == 4


def test_is_an_sb3_replay_buffer_and_defaults_to_proportional() -> None:
    buf = PrioritizedReplayBuffer(8, OBS_SPACES["box"], ACTION_SPACES["box"])
    assert isinstance(buf, ReplayBuffer) and buf.scheme == "proportional"
    assert buf.device == th.device("cpu") or buf.device.type == "cuda"  # "auto"
    dict_buf = DictPrioritizedReplayBuffer(8, OBS_SPACES["dict"], ACTION_SPACES["box"])
    assert isinstance(dict_buf, DictReplayBuffer) and isinstance(dict_buf, ReplayBuffer)
    assert "PrioritizedReplayBuffer(buffer_size=8" in repr(buf)


# ---------------------------------------------------------------------------
# timeouts
# ---------------------------------------------------------------------------


def two_env_step(buf) -> None:
    """env 0 ends by its time limit, env 1 terminates, both done."""
    obs = np.zeros((2, 3), np.float32)
    buf.add(
        obs,
        obs + 1,
        np.zeros((2, 2), np.float32),
        np.ones(2, np.float32),
        np.array([True, True]),
        [{"TimeLimit.truncated": True}, {"TimeLimit.truncated": False}],
    )


def test_time_limit_truncation_is_not_done_as_in_sb3() -> None:
    ours = PrioritizedReplayBuffer(4, OBS_SPACES["box"], ACTION_SPACES["box"], "cpu", n_envs=2)
    ref = ReplayBuffer(4, OBS_SPACES["box"], ACTION_SPACES["box"], "cpu", n_envs=2)
    two_env_step(ours)
    two_env_step(ref)
    s = ours.sample(64)
    np.testing.assert_array_equal(s.dones.numpy().ravel(), (s.indices == 1).astype(np.float32))
    assert set(s.indices.tolist()) == {0, 1}
    r = ref.sample(64)  # SB3 masks the same way
    assert float(r.dones.sum()) == pytest.approx(64 - float((1 - r.dones).sum()))
    data = ours.fastper_buffer.storage.gather(np.array([0, 1]))
    np.testing.assert_array_equal(data["done"], [1.0, 1.0])  # SB3's columns, as SB3 fills them
    np.testing.assert_array_equal(data["timeout"], [1.0, 0.0])
    np.testing.assert_array_equal(ours.dones[0], ref.dones[0])
    np.testing.assert_array_equal(ours.timeouts[0], ref.timeouts[0])


def test_without_timeout_handling_every_done_terminates() -> None:
    ours = PrioritizedReplayBuffer(
        4,
        OBS_SPACES["box"],
        ACTION_SPACES["box"],
        "cpu",
        n_envs=2,
        handle_timeout_termination=False,
    )
    two_env_step(ours)
    assert float(ours.sample(32).dones.min()) == 1.0


# ---------------------------------------------------------------------------
# errors: clear, and nothing changes
# ---------------------------------------------------------------------------


def test_optimize_memory_usage_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="optimize_memory_usage.*must be False.*next observation"):
        PrioritizedReplayBuffer(
            8, OBS_SPACES["box"], ACTION_SPACES["box"], optimize_memory_usage=True
        )


def test_wrong_class_for_the_observation_space() -> None:
    with pytest.raises(ValueError, match="needs DictPrioritizedReplayBuffer"):
        PrioritizedReplayBuffer(8, OBS_SPACES["dict"], ACTION_SPACES["box"])
    with pytest.raises(ValueError, match="needs PrioritizedReplayBuffer"):
        DictPrioritizedReplayBuffer(8, OBS_SPACES["box"], ACTION_SPACES["box"])


def test_bad_settings() -> None:
    box, act = OBS_SPACES["box"], ACTION_SPACES["box"]
    with pytest.raises(ValueError, match="`scheme` must be one of"):
        PrioritizedReplayBuffer(8, box, act, scheme="sorted")
    with pytest.raises(TypeError, match="`capacity` is set by PrioritizedReplayBuffer"):
        PrioritizedReplayBuffer(8, box, act, capacity=3)
    with pytest.raises(TypeError, match="did you mean 'max_priority'"):
        PrioritizedReplayBuffer(8, box, act, max_prio=2.0)
    with pytest.raises(ValueError, match="`n_steps` must be 1 with a Dict"):
        DictPrioritizedReplayBuffer(8, OBS_SPACES["dict"], act, n_steps=3)
    with pytest.raises(ValueError, match="`n_envs` must be"):
        PrioritizedReplayBuffer(8, box, act, n_envs=0)


def test_bad_add_raises_and_changes_nothing() -> None:
    buf = PrioritizedReplayBuffer(8, OBS_SPACES["box"], ACTION_SPACES["box"], n_envs=2, seed=0)
    obs, act = np.zeros((2, 3), np.float32), np.zeros((2, 2), np.float32)
    rew, done, infos = np.zeros(2, np.float32), np.zeros(2, bool), [{}, {}]
    buf.add(obs, obs, act, rew, done, infos)
    before = buf.fastper_buffer.state_dict()["writer"]
    with pytest.raises(ValueError, match="`obs` must hold n_envs=2 values of shape \\(3,\\)"):
        buf.add(np.zeros((3, 3), np.float32), obs, act, rew, done, infos)
    with pytest.raises(
        ValueError, match="`infos` must hold one dict per env \\(n_envs=2\\), got 1"
    ):
        buf.add(obs, obs, act, rew, done, [{}])
    with pytest.raises(fastper.FieldTypeError):  # 1e40 does not fit in float32
        buf.add(obs, obs, act, np.full(2, 1e40), done, infos)
    assert buf.fastper_buffer.state_dict()["writer"] == before
    assert (buf.pos, len(buf.fastper_buffer)) == (1, 2)


def _same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


class _TruncatedInfo(dict):  # type: ignore[type-arg]
    """An info dict whose own ``get`` answers for the time limit (its items hold none)."""

    def __init__(self, flag: bool) -> None:
        super().__init__()
        self.flag = flag

    def get(self, key: Any, default: Any = None) -> Any:
        return self.flag if key == "TimeLimit.truncated" else super().get(key, default)


class _AnswersOnce(dict):  # type: ignore[type-arg]
    """An info dict whose ``get`` takes the item out: a second read finds nothing."""

    def get(self, key: Any, default: Any = None) -> Any:
        return self.pop(key, default)


def test_time_limit_flags_are_read_from_any_infos_of_a_vector_step() -> None:
    """The flags of a vector step are read by each info's own ``get``, once: dicts,
    other mappings (or dicts missing the key), a dict whose ``get`` is its own and
    one whose ``get`` answers only once give the same columns, also where the
    buffer declines the shortest add after the flags were read."""
    from collections import UserDict

    obs_space, act_space = OBS_SPACES["box"], ACTION_SPACES["discrete"]
    rng = np.random.default_rng(4)
    kinds = {
        "dict": dict,
        "mapping": UserDict,
        "own get": lambda d: _TruncatedInfo(bool(d.get("TimeLimit.truncated", False))),
        "read once": _AnswersOnce,
        "read once, general add": _AnswersOnce,
    }
    bufs = {k: PrioritizedReplayBuffer(32, obs_space, act_space, device="cpu", n_envs=3, seed=0)
            for k in kinds}  # fmt: skip
    # a buffer not in its common state (a save in progress, ...) declines the shortest
    # add: the flags already read go to the general one
    bufs["read once, general add"].fastper_buffer._add_exact = lambda *args: False
    for step in range(20):
        obs = rng.standard_normal((3, 3)).astype(np.float32)
        nxt = rng.standard_normal((3, 3)).astype(np.float32)
        action = rng.integers(0, 3, 3)
        reward = rng.standard_normal(3).astype(np.float32)
        done = rng.random(3) < 0.5
        flags = [bool(d and rng.random() < 0.5) for d in done]
        for kind, make in kinds.items():
            infos = [make({"TimeLimit.truncated": f} if (step + j) % 3 else {})
                     for j, f in enumerate(flags)]  # fmt: skip
            bufs[kind].add(obs, nxt, action, reward, done, infos)
    a = bufs["dict"]
    for other in ("mapping", "own get", "read once", "read once, general add"):
        np.testing.assert_array_equal(a.timeouts, bufs[other].timeouts)
        np.testing.assert_array_equal(a.dones, bufs[other].dones)
    assert a.timeouts.any() and a.dones.any() and not a.timeouts.all()
    with pytest.raises(ValueError, match="one dict per env"):
        a.add(obs, nxt, action, reward, done, [{}, {}])
    # flags of another shape are refused by name, however the infos answer
    for make in (dict, _AnswersOnce):
        infos = [make({"TimeLimit.truncated": np.array([True])}) for _ in range(3)]
        size, flags = len(a.fastper_buffer), a.timeouts.copy()
        with pytest.raises(ValueError, match="timeout"):
            a.add(obs, nxt, action, reward, np.ones(3, bool), infos)
        assert len(a.fastper_buffer) == size
        np.testing.assert_array_equal(a.timeouts, flags)


@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("timeouts", [True, False])
def test_the_common_add_stores_and_refuses_what_the_general_add_does(
    n_envs: int, n_steps: int, timeouts: bool
) -> None:
    """Arrays of exactly SB3's shapes with bool dones take a shorter way into the
    buffer (one env: a transition of Python values); the buffer it leaves, and the
    calls it refuses, are those of the general way."""
    kw = {"device": "cpu", "n_envs": n_envs, "n_steps": n_steps, "seed": 0,
          "handle_timeout_termination": timeouts}  # fmt: skip
    obs_space, act_space = OBS_SPACES["box"], ACTION_SPACES["discrete"]
    fast = PrioritizedReplayBuffer(40, obs_space, act_space, **kw)
    slow = PrioritizedReplayBuffer(40, obs_space, act_space, **kw)
    slow._plain_rows = slow._vector_exact = None  # every add takes the general way
    exact = fast.fastper_buffer._add_exact
    taken = []  # the adds that went the shortest way (arrays of the fields' dtypes)

    def counted(*args: object) -> object:
        out = exact(*args)
        taken.append(out is not None)
        return out

    fast.fastper_buffer._add_exact = counted
    rng = np.random.default_rng(3)
    for step in range(60):
        obs = rng.standard_normal((n_envs, 3)).astype(np.float32)
        nxt = rng.standard_normal((n_envs, 3)).astype(np.float32)
        # Discrete actions as SB3's buffer stores them, or as its DQN passes them
        action = rng.integers(0, 3, (n_envs, 1) if step % 3 else n_envs)
        # float64 rewards are cast to the float32 column, as SB3's buffer does
        reward = rng.standard_normal(n_envs).astype(np.float32 if step % 2 else np.float64)
        done = rng.random(n_envs) < 0.3
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        fast.add(obs, nxt, action, reward, done, infos)
        slow.add(obs, nxt, action, reward, done, infos)
        if step % 7 == 6:
            a, b = fast.sample(8), slow.sample(8)
            for name in SB3_FIELDS:
                th.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
            td = rng.standard_normal(8)
            fast.update_priorities(a.indices, td, keys=a.keys)
            slow.update_priorities(b.indices, td, keys=b.keys)
    _same(fast.fastper_buffer.state_dict(), slow.fastper_buffer.state_dict())
    assert (fast.pos, fast.full) == (slow.pos, slow.full)
    # one-step buffers take it for the float32 rewards (every other step) that fit
    # before the ring's end; n-step windows never do
    assert (sum(taken) > 20) if n_steps == 1 else not taken

    obs = np.zeros((n_envs, 3), np.float32)
    act = np.zeros((n_envs, 1), np.int64)
    rew, done, infos = np.zeros(n_envs, np.float32), np.zeros(n_envs, bool), [{}] * n_envs
    bad = [
        ((obs, obs, act, np.full(n_envs, np.nan, np.float32), done, infos), ValueError),
        ((obs, obs, act, np.full(n_envs, 1e40), done, infos), fastper.FieldTypeError),
        ((obs, obs, np.full((n_envs, 1), 0.5), rew, done, infos), fastper.FieldTypeError),
        ((obs.astype(np.float64) + 1e300, obs, act, rew, done, infos), fastper.FieldTypeError),
        ((obs, obs, act, np.full(n_envs, 0.5, object), done, infos), fastper.FieldTypeError),
        ((obs, obs, act, np.full(n_envs, 5, "m8[ns]"), done, infos), fastper.FieldTypeError),
    ]
    before = fast.fastper_buffer.state_dict()
    for args, error in bad:
        for buf in (fast, slow):
            with pytest.raises(error):
                buf.add(*args)
    _same(fast.fastper_buffer.state_dict(), before)
    if not timeouts:  # infos are not read then: any object passes, as SB3's buffer allows
        for buf in (fast, slow):
            buf.add(obs, obs, act, rew, done, None)
        _same(fast.fastper_buffer.state_dict(), slow.fastper_buffer.state_dict())


def test_the_shortest_add_follows_a_loaded_field_order_and_refuses_odd_flags(tmp_path) -> None:
    """The add of arrays in the stored dtypes writes the storage by field order: a
    file that holds the fields in another order is loaded with its own, and adds
    after it store each value in its field, as the general way does. Time-limit
    flags that are not one per env are refused with the general way's error, and
    change nothing, even on a full ring."""
    obs_space, act_space = OBS_SPACES["box"], ACTION_SPACES["discrete"]
    kw = {"device": "cpu", "seed": 0}
    ours = PrioritizedReplayBuffer(8, obs_space, act_space, **kw)
    fields = ours.fastper_buffer.storage.fields
    order = ["next_obs", "action", "reward", "obs", "timeout", "done"]
    other = fastper.PrioritizedReplayBuffer(8, {k: fields[k] for k in order}, seed=0)
    other.save(tmp_path / "other.fpk")
    ours.load(tmp_path / "other.fpk")
    assert list(ours.fastper_buffer.storage.fields) == order
    obs, nxt = np.full((1, 3), 1, np.float32), np.full((1, 3), 2, np.float32)
    ours.add(obs, nxt, np.array([[1]]), np.array([0.5], np.float32), np.array([True]),
             [{"TimeLimit.truncated": False}])  # fmt: skip
    row = ours.fastper_buffer.storage.gather(np.array([0]))
    np.testing.assert_array_equal(row["obs"], obs)
    np.testing.assert_array_equal(row["next_obs"], nxt)
    assert (row["action"][0, 0], row["reward"][0], row["done"][0], row["timeout"][0]) == (
        1, 0.5, 1.0, 0.0
    )

    vec = PrioritizedReplayBuffer(8, obs_space, act_space, n_envs=2, **kw)
    rng = np.random.default_rng(0)
    for _ in range(4):  # a full ring: 4 rows of 2 envs
        vec.add(rng.standard_normal((2, 3)).astype(np.float32),
                rng.standard_normal((2, 3)).astype(np.float32), rng.integers(0, 3, 2),
                rng.standard_normal(2).astype(np.float32), np.zeros(2, bool), [{}, {}])  # fmt: skip
    assert vec.full
    before = vec.fastper_buffer.state_dict()
    odd = [{"TimeLimit.truncated": np.array([True])}, {"TimeLimit.truncated": np.array([False])}]
    with pytest.raises(ValueError, match="timeout"):
        vec.add(np.full((2, 3), 9, np.float32), np.full((2, 3), 9, np.float32),
                np.ones((2, 1), np.int64), np.full(2, 5, np.float32), np.ones(2, bool), odd)  # fmt: skip
    _same(vec.fastper_buffer.state_dict(), before)


def test_sampling_an_empty_buffer() -> None:
    buf = PrioritizedReplayBuffer(8, OBS_SPACES["box"], ACTION_SPACES["box"])
    with pytest.raises(fastper.EmptyBufferError):
        buf.sample(4)


# ---------------------------------------------------------------------------
# priorities and weights
# ---------------------------------------------------------------------------


def filled(n_envs: int = 2, rows: int = 16, **kwargs) -> PrioritizedReplayBuffer:
    ours, ref = make_pair("box", "box", n_envs, rows, **kwargs)
    fill(ours, ref, rows, n_envs, np.random.default_rng(5))
    return ours


def test_update_priorities_writes_td_plus_eps_to_the_power_alpha_into_the_tree() -> None:
    alpha, eps = 0.7, 1e-3
    buf = filled(alpha=alpha, eps=eps)
    n = len(buf.fastper_buffer)
    s = buf.sample(12)
    td = th.linspace(-2.0, 3.0, 12).reshape(-1, 1).requires_grad_()  # (B, 1), on the graph
    idx, keep = np.unique(s.indices[::-1], return_index=True)  # duplicates: the last one wins
    td_last = td.detach().numpy().astype(np.float64).ravel()[::-1][keep]
    assert buf.update_priorities(s.indices, td, s.keys) == 12
    np.testing.assert_allclose(buf.fastper_buffer.priorities(idx), np.abs(td_last) + eps)
    leaves = buf.fastper_buffer._sampler.tree.get(np.arange(n))  # white box: the sum tree
    expected = np.ones(n)  # new transitions: max priority 1.0 (1**alpha)
    expected[idx] = (np.abs(td_last) + eps) ** alpha
    np.testing.assert_allclose(leaves, expected, rtol=1e-12)
    np.testing.assert_allclose(  # and the public law agrees
        buf.fastper_buffer.probabilities(np.arange(n)), expected / expected.sum(), rtol=1e-12
    )


def test_weights_are_the_is_weights_normalised_over_the_batch_by_default() -> None:
    buf = filled(alpha=0.6, beta=0.5)
    assert buf.fastper_buffer.weight_norm == "batch"
    n = len(buf.fastper_buffer)
    buf.update_priorities(np.arange(n), np.linspace(0.1, 5.0, n))
    s = buf.sample(64)
    p = buf.fastper_buffer.probabilities(np.arange(n))
    expected = (p[s.indices] / p[s.indices].min()) ** -0.5
    np.testing.assert_allclose(s.weights.numpy().ravel(), expected, rtol=1e-6)
    assert s.weights.max() == 1.0
    buf.beta = 1.0  # what the PER algorithms set while annealing
    s = buf.sample(64)
    np.testing.assert_allclose(
        s.weights.numpy().ravel(), p[s.indices].min() / p[s.indices], rtol=1e-6
    )
    buf.beta = None
    assert buf.beta == 0.5 and buf.beta_start == 0.5


def test_weights_normalised_over_the_buffer_on_request() -> None:
    buf = filled(alpha=0.6, beta=0.5, weight_norm="buffer")
    n = len(buf.fastper_buffer)
    buf.update_priorities(np.arange(n), np.linspace(0.1, 5.0, n))
    s = buf.sample(64)
    p = buf.fastper_buffer.probabilities(np.arange(n))
    np.testing.assert_allclose(
        s.weights.numpy().ravel(), (p[s.indices] / p.min()) ** -0.5, rtol=1e-6
    )
    with pytest.raises(ValueError, match="weight_norm"):
        filled(weight_norm="max")


def test_stale_keys_drop_the_update() -> None:
    buf = filled(n_envs=2, rows=4)
    s = buf.sample(8)
    fill(buf, None, 4, 2, np.random.default_rng(9))  # overwrites all 8 slots
    assert buf.update_priorities(s.indices, np.ones(8), s.keys) == 0
    assert buf.fastper_buffer.stale_updates == 8


def test_rank_and_uniform_schemes() -> None:
    rank = filled(scheme="rank")
    assert rank.scheme == "rank" and rank.beta == 0.5  # the rank-based paper default
    s = rank.sample(32)
    rank.update_priorities(s.indices, th.rand(32), s.keys)
    uniform = filled(scheme="uniform")
    assert float(uniform.sample(32).weights.min()) == 1.0


def test_a_beta_schedule_is_kept_and_not_annealable() -> None:
    buf = filled(beta=fastper.schedules.linear(0.4, 1.0, 10))
    assert buf.beta_start is None
    for _ in range(10):
        buf.sample(4)
    assert buf.beta == 1.0


# ---------------------------------------------------------------------------
# VecNormalize
# ---------------------------------------------------------------------------


def test_vecnormalize_normalises_samples_exactly_as_sb3() -> None:
    venv = VecNormalize(
        DummyVecEnv([lambda: gym.make("Pendulum-v1")]), clip_obs=2.0, clip_reward=3.0
    )
    venv.obs_rms.mean = np.array([0.5, -0.5, 1.0])
    venv.obs_rms.var = np.array([0.25, 4.0, 9.0])
    venv.ret_rms.var = np.array(2.5)
    obs_space, act_space = venv.observation_space, venv.action_space
    ours = PrioritizedReplayBuffer(32, obs_space, act_space, "cpu", seed=0)
    ref = ReplayBuffer(32, obs_space, act_space, "cpu")
    rng = np.random.default_rng(1)
    for _ in range(20):
        args = (
            rng.normal(size=(1, 3)).astype(np.float32) * 3,
            rng.normal(size=(1, 3)).astype(np.float32) * 3,
            rng.uniform(-1, 1, size=(1, 1)).astype(np.float32),
            (rng.normal(size=1) * 8).astype(np.float32),
            np.array([False]),
            [{}],
        )
        ours.add(*args)
        ref.add(*args)
    s = ours.sample(40, env=venv)
    r = ref.sample(40, env=venv)
    row = s.indices
    raw = ref.observations[row, 0]
    np.testing.assert_allclose(s.observations.numpy(), venv.normalize_obs(raw), rtol=1e-6)
    np.testing.assert_allclose(
        s.next_observations.numpy(), venv.normalize_obs(ref.next_observations[row, 0]), rtol=1e-6
    )
    np.testing.assert_allclose(
        s.rewards.numpy().ravel(), venv.normalize_reward(ref.rewards[row, 0]), rtol=1e-6
    )
    assert np.abs(s.observations.numpy()).max() <= 2.0  # clipped as configured
    for name in SB3_FIELDS:
        assert_same_layout(getattr(s, name), getattr(r, name), 40)
    venv.close()


# ---------------------------------------------------------------------------
# files and pickling
# ---------------------------------------------------------------------------


def test_save_and_load_give_the_same_next_samples(tmp_path) -> None:
    buf = filled(n_envs=2, rows=16, alpha=0.5, beta=0.6)
    s = buf.sample(16)
    buf.update_priorities(s.indices, np.linspace(0, 2, 16), s.keys)
    path = tmp_path / "sub" / "replay.fpk"  # folders are made, as SB3 does
    buf.save(path)
    raw = path.read_bytes()
    assert raw[:8] == b"\x89FPCKPT\n" and raw[0] != pickle.PROTO[0]  # not a pickle stream
    with pytest.raises((pickle.UnpicklingError, ValueError)):
        pickle.loads(raw)
    other = PrioritizedReplayBuffer(32, buf.observation_space, buf.action_space, "cpu", n_envs=2)
    other.load(path)
    assert (other.pos, other.full, other.beta, other.fastper_buffer.alpha) == (
        buf.pos,
        buf.full,
        0.6,
        0.5,
    )
    for _ in range(3):
        a, b = buf.sample(32), other.sample(32)
        np.testing.assert_array_equal(a.indices, b.indices)
        for name in (*SB3_FIELDS, "weights"):
            assert th.equal(getattr(a, name), getattr(b, name))
    # a plain fastper checkpoint: fastper.load reads it
    assert len(fastper.load(path)) == len(buf.fastper_buffer)


def test_save_and_load_through_file_objects() -> None:
    buf = filled()
    stream = io.BytesIO()
    buf.save(stream)
    other = PrioritizedReplayBuffer(32, buf.observation_space, buf.action_space, "cpu", n_envs=2)
    other.load(io.BytesIO(stream.getvalue()))
    np.testing.assert_array_equal(buf.sample(8).indices, other.sample(8).indices)


def test_a_file_for_other_spaces_is_refused_and_changes_nothing(tmp_path) -> None:
    buf = filled()
    buf.save(tmp_path / "r.fpk")
    other = PrioritizedReplayBuffer(
        32, spaces.Box(-1, 1, (4,), np.float32), ACTION_SPACES["box"], n_envs=2
    )
    with pytest.raises(ValueError, match="does not fit this buffer: fields="):
        other.load(tmp_path / "r.fpk")
    smaller = PrioritizedReplayBuffer(16, buf.observation_space, buf.action_space, n_envs=2)
    with pytest.raises(ValueError, match="capacity=32 in the file, 16 here"):
        smaller.load(tmp_path / "r.fpk")
    assert len(other.fastper_buffer) == len(smaller.fastper_buffer) == 0
    (tmp_path / "bad.fpk").write_bytes(b"not a checkpoint")
    with pytest.raises(fastper.CheckpointError):
        smaller.load(tmp_path / "bad.fpk")


def test_pickling_is_refused_with_a_pointer_to_the_checkpoint_format() -> None:
    buf = filled()
    with pytest.raises(TypeError, match="not picklable.*save_replay_buffer"):
        pickle.dumps(buf)
    with pytest.raises(TypeError, match="not picklable"):
        copy.deepcopy(buf)


# ---------------------------------------------------------------------------
# n-step returns per env
# ---------------------------------------------------------------------------


def test_n_step_returns_per_env_match_a_hand_computation() -> None:
    gamma, n, n_envs, steps = 0.9, 3, 2, 40
    buf = PrioritizedReplayBuffer(
        1000,
        OBS_SPACES["box"],
        ACTION_SPACES["box"],
        "cpu",
        n_envs=n_envs,
        n_steps=n,
        gamma=gamma,
        seed=0,
    )
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=(steps, n_envs)).astype(np.float32)
    dones = rng.random((steps, n_envs)) < 0.15
    truncs = dones & (rng.random((steps, n_envs)) < 0.5)
    for t in range(steps):
        obs = np.stack([np.full(3, 100 * e + t, np.float32) for e in range(n_envs)])
        infos = [{"TimeLimit.truncated": bool(truncs[t, e])} for e in range(n_envs)]
        buf.add(obs, obs + 0.5, np.zeros((n_envs, 2)), rewards[t], dones[t], infos)
    s = buf.sample(256)
    assert s.discounts is not None and s.discounts.shape == (256, 1)
    for i in range(256):
        code = int(s.observations[i, 0])
        env, t = divmod(code, 100)
        ret, m, end = 0.0, 0, t
        for j in range(n):  # the window stops at the first episode end
            ret += gamma**j * float(rewards[t + j, env])
            m, end = j + 1, t + j
            if dones[t + j, env]:
                break
        terminated = bool(dones[end, env] and not truncs[end, env])
        assert float(s.rewards[i, 0]) == pytest.approx(ret, rel=1e-5)
        assert float(s.dones[i, 0]) == float(terminated)
        assert float(s.discounts[i, 0]) == pytest.approx(0.0 if terminated else gamma**m)
        assert float(s.next_observations[i, 0]) == 100 * env + end + 0.5


def test_import_fastper_loads_neither_sb3_nor_torch() -> None:
    code = (
        "import sys, fastper, fastper.compat; "
        "print(sorted(m for m in ('torch', 'stable_baselines3', 'gymnasium') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_samples_follow_a_device_set_after_the_buffer_is_made() -> None:
    """SB3 sets a loaded buffer's ``device`` to its model's: samples follow it (a meta
    device here, where tensors have no data), and come back on the CPU after."""
    buf = PrioritizedReplayBuffer(32, OBS_SPACES["box"], ACTION_SPACES["box"], "cpu", n_envs=2)
    fill(buf, None, 8, 2, np.random.default_rng(0))
    on_cpu = buf.sample(8)
    for name in (*SB3_FIELDS, "weights"):
        assert getattr(on_cpu, name).device.type == "cpu"
    buf.device = th.device("meta")
    s = buf.sample(8)
    for name in (*SB3_FIELDS, "weights"):
        t, ref = getattr(s, name), getattr(on_cpu, name)
        assert t.device.type == "meta" and (t.dtype, t.shape) == (ref.dtype, ref.shape), name
    buf.device = th.device("cpu")
    assert buf.sample(8).observations.device.type == "cpu"


@pytest.mark.skipif(not th.cuda.is_available(), reason="needs a CUDA device")
def test_samples_land_on_the_device_and_device_td_errors_update() -> None:
    buf = PrioritizedReplayBuffer(32, OBS_SPACES["box"], ACTION_SPACES["box"], "cuda", n_envs=2)
    fill(buf, None, 8, 2, np.random.default_rng(0))
    s = buf.sample(8)
    for name in (*SB3_FIELDS, "weights"):
        assert getattr(s, name).device.type == "cuda"
    td = th.arange(8, dtype=th.float32, device="cuda").reshape(-1, 1)
    assert buf.update_priorities(s.indices, td, s.keys) == 8


@pytest.mark.parametrize("n_envs", [1, 4])
def test_a_current_max_buffer_gives_new_steps_what_the_general_add_gives(
    n_envs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``max_priority="current"`` the common add (which builds no slots) still
    records the priority each new step gets, so the maximum held is right once the
    slot that set it (far from them in the index) is lowered: the steps that
    overwrote the ring hold it now."""
    steps = 16  # fill the ring; the top slot lies 8 steps (8 * n_envs slots) from slot 0
    obs_space, act_space = OBS_SPACES["box"], ACTION_SPACES["discrete"]
    zeros = np.zeros((n_envs, 3), np.float32)
    args = (zeros, zeros, np.zeros(n_envs, np.int64), np.ones(n_envs, np.float32),
            np.zeros(n_envs, bool), [{}] * n_envs)  # fmt: skip
    results = []
    for common in (True, False):
        buf = PrioritizedReplayBuffer(
            steps * n_envs, obs_space, act_space, device="cpu", n_envs=n_envs, seed=0,
            max_priority="current",
        )  # fmt: skip
        core = buf._buffer
        exact = core._add_exact
        taken: list[bool] = []
        if common:

            def counted(*a: Any, exact: Any = exact, taken: list[bool] = taken) -> bool:
                taken.append(exact(*a))
                return taken[-1]

            monkeypatch.setattr(core, "_add_exact", counted)
        else:
            monkeypatch.setattr(core, "_add_exact", lambda *a: False)
        top = np.array([8 * n_envs])
        for _ in range(steps):
            buf.add(*args)  # the ring is full: priority 1 everywhere
        core.update_priorities(top, np.array([10.0]))
        buf.add(*args)  # overwrites slots 0 .. n_envs - 1: they get the current max, 10
        core.update_priorities(top, np.array([0.5]))
        results.append((core.max_priority, core.priorities(np.arange(steps * n_envs))))
        monkeypatch.undo()
        assert taken == ([True] * (steps + 1) if common else [])
    for max_held, priorities in results:
        assert max_held == pytest.approx(10.0)
        np.testing.assert_allclose(priorities[:n_envs], 10.0)
    np.testing.assert_array_equal(results[0][1], results[1][1])
