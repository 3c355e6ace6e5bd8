"""What a new user meets first: reading rows back (``get``), NaN / inf rewards refused,
``save`` into a folder that does not exist yet, and ``nstep_keys`` messages that name
the argument as it was written."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
from fastper.checkpoint import split_state
from fastper.disk import DiskStorage
from fastper.distributed import ShardedReplayBuffer
from fastper.tiers import TieredStorage
from tests.oracles import assert_same_state, snapshot

FIELDS = {
    "obs": ((3,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((3,), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}
KINDS = (fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer)


def rows(k: int, start: int = 0, reward: Any = None) -> dict[str, np.ndarray]:
    """k transitions of one episode whose values encode their order."""
    t = np.arange(start, start + k)
    return {
        "obs": np.repeat(t[:, None], 3, axis=1).astype(np.float32),
        "action": t % 4,
        "reward": (t * 0.5).astype(np.float32) if reward is None else np.asarray(reward),
        "next_obs": np.repeat(t[:, None] + 1, 3, axis=1).astype(np.float32),
        "terminated": np.zeros(k, dtype=np.bool_),
        "truncated": np.zeros(k, dtype=np.bool_),
    }


def put(buf: Any, batch: dict[str, Any], streams: bool = True) -> Any:
    """``buf.add(batch)``, the rows one stream's consecutive steps (``env_ids`` zeros)."""
    k = np.shape(batch["action"])[0] if np.ndim(batch["action"]) else 0
    return buf.add(batch, env_ids=np.zeros(k, dtype=np.int64) if k and streams else None)


def storages(tmp_path: Path) -> dict[str, Any]:
    return {
        "ram": None,
        "disk": lambda f, c: DiskStorage(f, c, tmp_path / "disk", ram_budget=0),
        "tiers": lambda f, c: TieredStorage(f, c, chunk_size=4, hot_bytes=64, warm_bytes=256,
                                            cold_dir=tmp_path / "cold", codec="zlib"),
    }  # fmt: skip


# --------------------------------------------------------------------------- get
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["ram", "disk", "tiers"])
def test_get_reads_the_rows_a_sample_holds_and_changes_nothing(tmp_path, kind, where) -> None:
    buf = kind(32, FIELDS, seed=1, storage=storages(tmp_path)[where])
    buf.add(rows(24))
    buf.add(rows(16, 24))  # wraps: slot s holds transition 32 + s for s < 8
    batch = buf.sample(64)
    before = snapshot(buf)
    got = buf.get(batch.indices)
    assert set(got) == set(batch.data)
    for name, column in batch.data.items():
        assert got[name].dtype == column.dtype and np.array_equal(got[name], column), name
    assert_same_state(snapshot(buf), before)  # generator, step, priorities: untouched
    one = buf.get(5)
    assert one["obs"].shape == (1, 3) and one["action"].tolist() == [(32 + 5) % 4]
    assert buf.get([])["obs"].shape == (0, 3)
    again = buf.sample(64)  # the next draw is the one it would have been without get
    fresh = kind(32, FIELDS, seed=1)
    fresh.add(rows(24))
    fresh.add(rows(16, 24))
    fresh.sample(64)
    assert np.array_equal(again.indices, fresh.sample(64).indices)


def test_get_refuses_bad_slots_and_changes_nothing() -> None:
    buf = fastper.PrioritizedReplayBuffer(16, FIELDS, seed=0)
    buf.add(rows(6))
    buf.invalidate([2, 4])
    before = snapshot(buf)
    cases = [
        ([16], fastper.InvalidIndexError, r"must lie in \[0, 16\), got out-of-range"),
        ([-1], fastper.InvalidIndexError, "out-of-range"),
        ([0, 9], fastper.InvalidIndexError, "never-written indices"),
        ([1, 4, 2, 4], fastper.InvalidIndexError, r"must name valid slots, got invalid slots .*2, 4"),
        ([[0, 1]], ValueError, "must be 1-D"),
        ([0.0], TypeError, "must hold integers"),
    ]  # fmt: skip
    for indices, error, match in cases:
        with pytest.raises(error, match=match):
            buf.get(indices)
        assert_same_state(snapshot(buf), before)
    assert buf.get([0, 1, 3])["action"].tolist() == [0, 1, 3]


def test_get_of_an_nstep_and_a_frame_buffer_matches_their_samples() -> None:
    nstep = fastper.PrioritizedReplayBuffer(16, FIELDS, n_step=3, gamma=0.5, seed=0)
    frames = fastper.PrioritizedReplayBuffer(16, FIELDS, frame_stack={"obs": 2}, seed=0)
    for buf in (nstep, frames):
        put(buf, rows(10))
        batch = buf.sample(32)
        got = buf.get(batch.indices)
        assert set(got) == set(batch.data)
        for name in got:
            assert np.array_equal(got[name], batch.data[name]), name
    # the n-step return of slot 0: 0 + 0.5 * 0.5 + 0.25 * 1.0
    assert nstep.get(0)["reward"].tolist() == [0.5]
    assert nstep.get(0)["discount"].tolist() == [0.125]
    assert frames.get(3)["obs"].shape == (1, 2, 3)
    assert frames.get(3)["obs"][0, :, 0].tolist() == [2.0, 3.0]  # the two latest frames


def test_device_get_matches_its_sample_and_refuses_bad_slots() -> None:
    pytest.importorskip("torch")
    import fastper.device as fd

    buf = fd.DevicePrioritizedReplayBuffer(16, FIELDS, seed=0)
    buf.add(rows(12))
    buf.add(rows(8, 12))
    batch = buf.sample(32)
    state = buf.state_dict()["buffer"]["rng"].copy()
    got = buf.get(batch.indices)
    for name, column in batch.data.items():
        assert got[name].dtype == column.dtype and bool((got[name] == column).all()), name
    assert np.array_equal(buf.state_dict()["buffer"]["rng"], state) and buf.step == 1
    with pytest.raises(fastper.InvalidIndexError, match="out-of-range"):
        buf.get([16])
    small = fd.DeviceReplayBuffer(8, FIELDS, seed=0)
    small.add(rows(3))
    with pytest.raises(fastper.InvalidIndexError, match="never-written"):
        small.get([3])


def test_sharded_get_reads_global_indices_from_their_shards() -> None:
    sharded = ShardedReplayBuffer.local(3, 8, FIELDS, seed=0)
    for k in range(3):
        sharded.add(rows(5, 10 * k))  # one batch a shard: shard s holds 10 s .. 10 s + 4
    batch = sharded.sample(32)
    got = sharded.get(batch.indices)
    assert set(got) == set(batch.data)
    for name, column in batch.data.items():
        assert got[name].dtype == column.dtype and np.array_equal(got[name], column), name
    assert sharded.get([16, 0, 9])["action"].tolist() == [20 % 4, 0, 11 % 4]
    assert sharded.get([])["obs"].shape == (0, 3)
    with pytest.raises(fastper.InvalidIndexError, match="out-of-range"):
        sharded.get([24])
    with pytest.raises(fastper.InvalidIndexError, match=r"a shard refused .*never-written"):
        sharded.get([1, 7])  # shard 0 filled slots 0 to 4 only


# --------------------------------------------------------------------------- rewards
BAD_REWARDS = [np.nan, np.inf, -np.inf]


def _device_snapshot(buf: Any) -> dict[str, Any]:
    meta, arrays = split_state(buf.state_dict())
    snap: dict[str, Any] = {"meta": copy.deepcopy(meta)}
    snap.update({f"array/{k}": np.array(v, copy=True) for k, v in arrays.items()})
    snap.update({f"column/{k}": c.clone().numpy() for k, c in buf.storage.columns.items()})
    return snap


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "options", [{}, {"n_step": 3}, {"n_envs": 2}, {"frame_stack": {"obs": 2}}], ids=str
)
@pytest.mark.parametrize("bad", BAD_REWARDS)
def test_a_nonfinite_reward_is_refused_and_changes_nothing(kind, options, bad) -> None:
    buf = kind(16, FIELDS, seed=0, **options)
    streams = "n_envs" not in options
    k = 4 if streams else 2
    put(buf, rows(k), streams)
    buf.sample(4)
    before = snapshot(buf)
    pending = buf.n_pending
    assert pending or "n_step" not in options  # windows are open: they must stay as they were
    one = {name: v[0] for name, v in rows(1, 10, reward=[bad]).items()}
    reward = np.array([1.0, bad, 2.0, bad][:k], dtype=np.float32)
    for add in (
        lambda: put(buf, rows(k, 20, reward=reward), streams),
        lambda: buf.add(one) if streams else buf.add(rows(2, 30, [bad, bad])),
    ):
        with pytest.raises(
            ValueError, match=r"`reward` must be finite .*allow_nonfinite_rewards=True"
        ):
            add()
        assert_same_state(snapshot(buf), before)
        assert buf.n_pending == pending
    with pytest.raises(ValueError, match=r"in rows \[1, 3\]" if k == 4 else r"in rows \[1\]"):
        put(buf, rows(k, 20, reward=reward), streams)


def test_the_refusal_covers_every_float_reward_dtype_and_named_field(tmp_path) -> None:
    disk = fastper.ReplayBuffer(
        8, FIELDS, storage=lambda f, c: DiskStorage(f, c, tmp_path / "d", ram_budget=0)
    )
    f64 = fastper.ReplayBuffer(8, {**FIELDS, "reward": ((), np.float64)})
    vec = fastper.ReplayBuffer(8, {**FIELDS, "reward": ((2,), np.float16)})
    named = fastper.ReplayBuffer(8, {"o": ((), np.float32), "r": ((), np.float32)},
                                 nstep_keys={"reward": "r"})  # fmt: skip
    for buf, bad in ((disk, rows(1, reward=[np.nan])), (f64, rows(2, reward=[0.0, -np.inf])),
                     (vec, rows(1, reward=[[1.0, np.inf]])), (named, {"o": 0.0, "r": np.nan})):  # fmt: skip
        with pytest.raises(ValueError, match="must be finite"):
            buf.add(bad)
        assert len(buf) == 0
    # integer rewards cannot be NaN; other float fields (observations) are stored as given
    ints = fastper.ReplayBuffer(8, {**FIELDS, "reward": ((), np.int32)})
    ints.add(rows(2, reward=[1, 2]))
    plain = fastper.ReplayBuffer(8, FIELDS)
    nan_obs = rows(1)
    nan_obs["obs"][0, 0] = np.nan
    plain.add(nan_obs)
    assert np.isnan(plain.get(0)["obs"][0, 0])


def test_allow_nonfinite_rewards_stores_them_and_survives_a_checkpoint(tmp_path) -> None:
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0, allow_nonfinite_rewards=True)
    buf.add(rows(3, reward=[np.nan, np.inf, 1.0]))
    got = buf.get([0, 1, 2])["reward"]
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 1.0
    buf.save(tmp_path / "b.fpk")
    back = fastper.load(tmp_path / "b.fpk")
    back.add(rows(1, reward=[-np.inf]))  # the option came back with the checkpoint
    assert back.get(3)["reward"][0] == -np.inf
    default = fastper.PrioritizedReplayBuffer(8, FIELDS)
    # the default is not written into a checkpoint: the settings of old files stay valid
    assert "allow_nonfinite_rewards" not in default.state_dict()["settings"]
    with pytest.raises(TypeError, match="`allow_nonfinite_rewards` must be a bool"):
        fastper.ReplayBuffer(8, FIELDS, allow_nonfinite_rewards="yes")


def test_device_buffers_refuse_nonfinite_rewards_too() -> None:
    torch = pytest.importorskip("torch")
    import fastper.device as fd

    for options in ({}, {"n_step": 3}):
        buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0, **options)
        put(buf, rows(3), bool(options))
        before = _device_snapshot(buf)
        tensors = {k: torch.as_tensor(v) for k, v in rows(3, 5, [0.0, np.nan, 1.0]).items()}
        for bad in (rows(3, 5, [0.0, np.nan, 1.0]), tensors):
            with pytest.raises(ValueError, match=r"`reward` must be finite.*in rows \[1\]"):
                put(buf, bad, bool(options))
            snap = _device_snapshot(buf)
            assert snap.keys() == before.keys()
            for key in snap:
                a, b = snap[key], before[key]
                same = np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                assert same, key
    # validate=False reads nothing back: tensors go in as given; the opt-out stores them
    fast = fd.DevicePrioritizedReplayBuffer(8, FIELDS, validate=False)
    fast.add(tensors)
    assert bool(torch.isnan(fast.get([1])["reward"]).all())
    allowed = fd.DevicePrioritizedReplayBuffer(8, FIELDS, allow_nonfinite_rewards=True)
    allowed.add(rows(3, 5, [0.0, np.nan, 1.0]))
    assert len(allowed) == 3


# --------------------------------------------------------------------------- save
def test_save_creates_the_checkpoint_folder(tmp_path) -> None:
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add(rows(3))
    target = tmp_path / "runs" / "a" / "ckpt" / "replay.fpk"
    buf.save(target)
    assert np.array_equal(fastper.load(target).get([0, 1, 2])["action"], [0, 1, 2])
    disk = fastper.ReplayBuffer(
        8, FIELDS, storage=lambda f, c: DiskStorage(f, c, tmp_path / "rows", ram_budget=0)
    )
    disk.add(rows(2))
    disk.save(tmp_path / "new" / "disk.fpk")
    assert (tmp_path / "new" / "disk.fpk").is_file()
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match=r"'.*file' is a file, not a folder"):
        buf.save(tmp_path / "file" / "sub" / "replay.fpk")
    assert sorted(tmp_path.rglob("*")) == before  # nothing made


def test_device_and_sharded_save_create_their_folders(tmp_path) -> None:
    sharded = ShardedReplayBuffer.local(2, 8, FIELDS, seed=0)
    sharded.add(rows(4))
    manifest = sharded.save(tmp_path / "ckpt" / "set")
    assert manifest.is_file() and len(list(manifest.parent.glob("shard-*.fpk"))) == 2
    pytest.importorskip("torch")
    import fastper.device as fd

    dev = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0)
    dev.add(rows(2))
    dev.save(tmp_path / "dev" / "x" / "d.fpk")
    assert len(fd.load(tmp_path / "dev" / "x" / "d.fpk")) == 2


# --------------------------------------------------------------------------- nstep_keys
@pytest.mark.parametrize(
    ("nstep_keys", "match"),
    [
        ({"reward": "r"}, r"`nstep_keys\['reward'\]` must name one of the fields \[.*\], got 'r'"),
        ({"next_obs_key": "o2"}, r"`nstep_keys\['next_obs_key'\]` must name one of the fields"),
        ({"terminated": "reward"}, r"must differ, got nstep_keys\['reward'\]='reward', "
                                   r"nstep_keys\['next_obs'\]='next_obs', "
                                   r"nstep_keys\['terminated'\]='reward'"),
        ({"reward": 3}, r"`nstep_keys` values must be field names or None, got "
                        r"nstep_keys\['reward'\]=3"),
        ({"rewards": "reward"}, r"`nstep_keys` names roles among .* got nstep_keys key 'rewards'"),
    ],
)  # fmt: skip
def test_nstep_keys_errors_spell_the_argument_as_written(nstep_keys, match) -> None:
    for kind in KINDS:
        with pytest.raises((ValueError, TypeError), match=match) as info:
            kind(8, FIELDS, n_step=3, nstep_keys=nstep_keys)
        assert "reward_key" not in str(info.value).replace("nstep_keys['reward_key']", "")


def test_a_missing_end_field_suggests_nstep_keys() -> None:
    fields = {k: v for k, v in FIELDS.items() if k != "truncated"}
    with pytest.raises(ValueError, match=r"pass nstep_keys=\{'truncated': None\} if") as info:
        fastper.PrioritizedReplayBuffer(8, fields, n_step=3)
    assert "truncated_key" not in str(info.value)
