"""SB3's public arrays on fastper's SB3 buffers, and the offline-load idiom.

The oracle is SB3's own ReplayBuffer / DictReplayBuffer: same array names,
shapes and dtypes, the same contents after the same ``add`` calls, and the
same ``pos`` / ``full`` / ``size()`` after the same assignments. Ours are
views of the fastper storage, and setting ``pos`` / ``full`` admits the rows
written through them, so that ``sample`` draws those rows and no others.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from gymnasium import spaces  # noqa: E402
from scipy import stats  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer  # noqa: E402

from fastper.compat.sb3 import DictPrioritizedReplayBuffer, PrioritizedReplayBuffer  # noqa: E402

OBS = {
    "box": spaces.Box(-1.0, 1.0, (3,), np.float32),
    "image": spaces.Box(0, 255, (4, 4, 1), np.uint8),
    "discrete": spaces.Discrete(5),
    "dict": spaces.Dict({"vec": spaces.Box(-1.0, 1.0, (2,), np.float32), "id": spaces.Discrete(4)}),
}
ACT = {
    "box64": spaces.Box(-1.0, 1.0, (2,), np.float64),  # SB3 stores float64 actions as float32
    "discrete": spaces.Discrete(3),
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
}
ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


def pair(obs: str, act: str, size: int, n_envs: int, **kwargs):
    dict_obs = obs == "dict"
    ours = (DictPrioritizedReplayBuffer if dict_obs else PrioritizedReplayBuffer)(
        size, OBS[obs], ACT[act], "cpu", n_envs=n_envs, seed=0, **kwargs
    )
    ref = (DictReplayBuffer if dict_obs else ReplayBuffer)(
        size, OBS[obs], ACT[act], "cpu", n_envs=n_envs
    )
    return ours, ref


def as_dict(value):
    return value if isinstance(value, dict) else {"": value}


def step(space: spaces.Space, n: int, rng: np.random.Generator):
    space.seed(int(rng.integers(2**31)))
    if isinstance(space, spaces.Dict):
        return {k: np.stack([s.sample() for _ in range(n)]) for k, s in space.items()}
    return np.stack([space.sample() for _ in range(n)])


def add_same(ours, ref, steps: int, rng: np.random.Generator) -> None:
    n = ours.n_envs
    for _ in range(steps):
        args = (
            step(ours.observation_space, n, rng),
            step(ours.observation_space, n, rng),
            step(ours.action_space, n, rng),
            rng.normal(size=n).astype(np.float32),
            rng.random(n) < 0.3,
            [{"TimeLimit.truncated": bool(rng.random() < 0.5)} for _ in range(n)],
        )
        ours.add(*args)
        ref.add(*args)


@pytest.mark.parametrize("n_envs", [1, 3])
@pytest.mark.parametrize("act", sorted(ACT))
@pytest.mark.parametrize("obs", sorted(OBS))
def test_arrays_have_sb3s_shapes_dtypes_and_contents(obs, act, n_envs) -> None:
    ours, ref = pair(obs, act, 12, n_envs)
    rng = np.random.default_rng(0)
    for steps in (3, 4, 5):  # part-filled, full, wrapped
        add_same(ours, ref, steps, rng)
        assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size())
        rows = ref.buffer_size if ref.full else ref.pos
        for name in ARRAYS:
            a, b = as_dict(getattr(ours, name)), as_dict(getattr(ref, name))
            assert a.keys() == b.keys(), name
            for key in a:
                assert a[key].shape == b[key].shape, (name, key)
                assert a[key].dtype == b[key].dtype, (name, key)
                np.testing.assert_array_equal(a[key][:rows], b[key][:rows], err_msg=name)


def test_arrays_are_views_of_the_fastper_storage() -> None:
    ours, _ = pair("box", "box64", 8, 2)
    columns = ours.fastper_buffer.storage.columns
    for name, field in [("observations", "obs"), ("next_observations", "next_obs"),
                        ("actions", "action"), ("rewards", "reward"),
                        ("dones", "done"), ("timeouts", "timeout")]:  # fmt: skip
        view = getattr(ours, name)
        assert np.shares_memory(view, columns[field]), name
    ours.rewards[2, 1] = 7.5  # row 2, env 1: slot 2 * n_envs + 1
    assert columns["reward"][5] == 7.5
    d, _ = pair("dict", "discrete", 8, 2)
    assert np.shares_memory(d.observations["vec"], d.fastper_buffer.storage.columns["obs.vec"])


def offline_rows(ours, rows: int, rng: np.random.Generator) -> None:
    """Write ``rows`` rows of recognisable transitions through the public arrays."""
    n = ours.n_envs
    ours.observations[:rows] = rng.normal(size=(rows, n, 3))
    ours.next_observations[:rows] = rng.normal(size=(rows, n, 3))
    ours.actions[:rows] = rng.integers(0, 3, size=(rows, n, 1))
    ours.rewards[:rows] = np.arange(rows * n, dtype=np.float32).reshape(rows, n)  # = slot
    ours.dones[:rows] = 0.0


def test_offline_load_with_pos_samples_only_the_admitted_rows() -> None:
    ours, ref = pair("box", "discrete", 64, 2)  # 32 rows of 2 envs
    rng = np.random.default_rng(1)
    offline_rows(ours, 32, rng)  # the whole capacity written...
    ours.pos = ref.pos = 20  # ...20 rows admitted
    assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size()) == (20, False, 20)
    assert len(ours.fastper_buffer) == 40
    fb = ours.fastper_buffer
    np.testing.assert_array_equal(fb.priorities(np.arange(40)), fb.max_priority)
    draws = np.concatenate([ours.sample(256).indices for _ in range(40)])
    assert draws.max() < 40  # never a row past pos
    # equal priorities: uniform over the 40 admitted slots (chi-square, 10,240 draws)
    counts = np.bincount(draws, minlength=40)
    assert stats.chisquare(counts).pvalue > 1e-3
    s = ours.sample(128)
    np.testing.assert_array_equal(s.rewards.numpy().ravel(), s.indices.astype(np.float32))
    np.testing.assert_array_equal(
        s.observations.numpy(), ours.observations.reshape(64, 3)[s.indices]
    )
    # the next add goes to row 20, as in SB3
    obs = np.full((2, 3), 9.0, np.float32)
    args = (obs, obs, np.zeros((2, 1)), np.zeros(2, np.float32), np.zeros(2), [{}, {}])
    ours.add(*args)
    ref.add(*args)
    assert ours.pos == ref.pos == 21
    np.testing.assert_array_equal(ours.observations[20], obs)


def test_offline_load_with_full_admits_every_row_and_keeps_pos() -> None:
    ours, ref = pair("box", "discrete", 16, 1)
    offline_rows(ours, 16, np.random.default_rng(2))
    ours.full = ref.full = True
    assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size()) == (0, True, 16)
    draws = np.concatenate([ours.sample(256).indices for _ in range(20)])
    assert stats.chisquare(np.bincount(draws, minlength=16)).pvalue > 1e-3
    ours.pos = ref.pos = 5  # a full buffer's next write moves, as in SB3
    assert (ours.pos, ours.full, ours.size()) == (5, True, 16)
    assert ours.fastper_buffer.cursor == 5


def test_pos_forward_keeps_the_priorities_already_learnt() -> None:
    ours, _ = pair("box", "discrete", 16, 1)
    offline_rows(ours, 16, np.random.default_rng(3))
    ours.pos = 8
    s = ours.sample(8)
    ours.update_priorities(s.indices, np.full(8, 5.0), s.keys)
    before = ours.fastper_buffer.priorities(np.arange(8))
    ours.pos = 12
    np.testing.assert_array_equal(ours.fastper_buffer.priorities(np.arange(8)), before)
    fb = ours.fastper_buffer
    np.testing.assert_array_equal(fb.priorities(np.arange(8, 12)), fb.max_priority)


def test_pos_back_and_full_false_drop_rows_as_sb3_does() -> None:
    ours, ref = pair("box", "discrete", 16, 1)
    offline_rows(ours, 16, np.random.default_rng(4))
    ours.full = ref.full = True
    ours.pos = ref.pos = 3
    ours.full = ref.full = False
    assert (ours.pos, ours.full, ours.size()) == (ref.pos, ref.full, ref.size()) == (3, False, 3)
    assert np.concatenate([ours.sample(64).indices for _ in range(10)]).max() < 3
    ours.pos = ref.pos = 1
    assert ours.size() == ref.size() == 1
    assert set(ours.sample(64).indices.tolist()) == {0}


def state(buf):
    fb = buf.fastper_buffer
    n = len(fb)
    return (fb.cursor, n, fb.total_added, fb.priorities(np.arange(n)).tolist(),
            fb.state_dict()["buffer"]["rng"])  # fmt: skip


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("pos", 16, ValueError),  # past the last row: full = True is the way
        ("pos", -1, ValueError),
        ("pos", 2.5, TypeError),
        ("full", 1, TypeError),
        ("full", "yes", TypeError),
    ],
)
def test_bad_pos_or_full_is_refused_and_changes_nothing(name, value, error) -> None:
    ours, _ = pair("box", "discrete", 16, 1)
    offline_rows(ours, 16, np.random.default_rng(5))
    ours.pos = 6
    before = state(ours)
    with pytest.raises(error, match=name):
        setattr(ours, name, value)
    assert state(ours) == before


def test_whole_array_assignment_copies_into_the_storage() -> None:
    ours, ref = pair("box", "discrete", 8, 2)
    rewards = np.arange(8, dtype=np.float32).reshape(4, 2)
    ours.rewards = rewards
    np.testing.assert_array_equal(ours.fastper_buffer.storage.columns["reward"], rewards.ravel())
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        ours.rewards = np.zeros(8, np.float32)
    np.testing.assert_array_equal(ours.rewards, rewards)  # unchanged
    d, _ = pair("dict", "discrete", 8, 1)
    d.observations = {"vec": np.ones((8, 1, 2), np.float32), "id": np.full((8, 1, 1), 3)}
    assert (d.observations["id"] == 3).all()
    with pytest.raises(ValueError, match="keys"):
        d.observations = {"vec": np.ones((8, 1, 2), np.float32)}


def test_arrays_follow_a_loaded_file(tmp_path) -> None:
    src, _ = pair("box", "discrete", 8, 1)
    offline_rows(src, 8, np.random.default_rng(6))
    src.pos = 5
    src.save(tmp_path / "r.fpk")
    dst, _ = pair("box", "discrete", 8, 1)
    dst.load(tmp_path / "r.fpk")
    assert (dst.pos, dst.full) == (5, False)
    np.testing.assert_array_equal(dst.rewards[:5], src.rewards[:5])
    dst.rewards[0] = -1.0  # still a view of the storage now in use
    assert dst.fastper_buffer.storage.columns["reward"][0] == -1.0


def test_n_step_buffers_refuse_the_arrays_and_pos_with_the_reason() -> None:
    ours, _ = pair("box", "discrete", 8, 1, n_steps=3)
    for name in ARRAYS:
        with pytest.raises(ValueError, match="n_steps=3.*one-step"):
            getattr(ours, name)
    with pytest.raises(ValueError, match="n_steps=3"):
        ours.pos = 2
    with pytest.raises(ValueError, match="n_steps=3"):
        ours.full = True
    assert (ours.pos, ours.full, len(ours.fastper_buffer)) == (0, False, 0)


@pytest.mark.parametrize("n_envs", [2, 4, 300])
@pytest.mark.parametrize(
    "act", [spaces.Discrete(3), spaces.Box(-1.0, 1.0, (1,), np.float32), spaces.MultiDiscrete([4])]
)
def test_one_action_per_env_is_stored_as_sb3_stores_it_flat_or_as_a_column(act, n_envs) -> None:
    """Actions of one dimension come flat, ``(n_envs,)`` (SB3's DQN passes Discrete
    ones so), or as a column, ``(n_envs, 1)``; both are stored as SB3 stores them:
    by the shortest way (from the first step on, by blocks of ``n_envs`` rows, in
    long runs with 300 envs) and by the general add where the shortest way
    declines (an invalid slot) or refuses (a NaN reward: nothing changed)."""
    obs = spaces.Box(-1.0, 1.0, (3,), np.float32)
    ours = PrioritizedReplayBuffer(5, obs, act, "cpu", n_envs=n_envs, seed=0)
    ref = ReplayBuffer(5, obs, act, "cpu", n_envs=n_envs)
    fast = ours.fastper_buffer
    exact = fast._add_exact
    stored = []  # per call of the shortest way: whether it stored the step

    def counted(*args: object) -> bool:
        out = exact(*args)
        stored.append(out)
        return out

    fast._add_exact = counted
    rng = np.random.default_rng(0)
    for t in range(8):  # part-filled, full, wrapped
        o, o2 = (rng.normal(size=(n_envs, 3)).astype(np.float32) for _ in "ab")
        a = step(act, n_envs, rng)
        a = a.reshape(n_envs, 1) if t in (1, 3) else a.reshape(n_envs)  # column / flat
        r = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.3
        infos = [{"TimeLimit.truncated": bool(rng.random() < 0.3)} for _ in range(n_envs)]
        if t == 4:  # a NaN reward: refused, nothing changed
            before = {name: getattr(ours, name).copy() for name in ARRAYS}
            bad = r.copy()
            bad[-1] = np.nan
            with pytest.raises(ValueError, match="reward"):
                ours.add(o, o2, a, bad, done, infos)
            for name in ARRAYS:
                np.testing.assert_array_equal(getattr(ours, name), before[name], err_msg=name)
            assert ours.pos == ref.pos and stored.pop() is False
        if t == 6:  # an invalid slot: the shortest way declines, the general add stores
            fast.invalidate(np.array([0]))
        ours.add(o, o2, a, r, done, infos)
        ref.add(o, o2, a, r, done, infos)
        assert stored.pop() is (t != 6), t
        assert (ours.pos, ours.full) == (ref.pos, ref.full)
        for name in ARRAYS:
            mine, theirs = getattr(ours, name), getattr(ref, name)
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, name
            np.testing.assert_array_equal(mine, theirs, err_msg=f"{name} after step {t}")
    assert not stored
