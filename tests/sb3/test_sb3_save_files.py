"""A refused or failed ``save_replay_buffer`` leaves no file behind, or the previous one intact."""

from __future__ import annotations

import errno
import io
import os

import pytest

pytest.importorskip("stable_baselines3")

from stable_baselines3 import SAC  # noqa: E402

from fastper.compat.sb3 import PERDQN, PrioritizedReplayBuffer  # noqa: E402


def sac_with_fastper_buffer() -> SAC:
    model = SAC(
        "MlpPolicy", "Pendulum-v1", buffer_size=64, learning_starts=8, batch_size=8,
        replay_buffer_class=PrioritizedReplayBuffer, policy_kwargs={"net_arch": [8]}, seed=0,
    )  # fmt: skip
    model.learn(16)
    return model


@pytest.mark.filterwarnings("ignore:Path .* does not exist. Will create it")
@pytest.mark.parametrize("name", ["replay", "replay.pkl", "sub/replay"])
def test_sb3s_own_save_is_refused_and_leaves_no_file(tmp_path, name) -> None:
    model = sac_with_fastper_buffer()
    folder = tmp_path / "files"
    folder.mkdir()
    with pytest.raises(TypeError, match="not picklable"):
        model.save_replay_buffer(folder / name)  # SB3's method: pickles the buffer
    # SB3 opened `<name>.pkl` (making `sub/`) before the buffer refused: the file is gone
    assert [p.name for p in folder.rglob("*") if p.is_file()] == []


def test_sb3s_own_save_into_a_file_object_writes_nothing() -> None:
    model = sac_with_fastper_buffer()
    stream = io.BytesIO(b"theirs")
    stream.seek(0, io.SEEK_END)
    with pytest.raises(TypeError, match="not picklable"):
        model.save_replay_buffer(stream)
    assert stream.getvalue() == b"theirs" and not stream.closed


def test_a_failed_fastper_save_keeps_the_previous_file(tmp_path, monkeypatch) -> None:
    model = PERDQN("MlpPolicy", "CartPole-v1", buffer_size=256, learning_starts=16, seed=0,
                   policy_kwargs={"net_arch": [8]})  # fmt: skip
    model.learn(64)
    folder = tmp_path / "files"
    path = folder / "replay.fpk"
    model.save_replay_buffer(path)
    previous = path.read_bytes()
    model.learn(64, reset_num_timesteps=False)  # the buffer changes

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        model.save_replay_buffer(path)
    monkeypatch.undo()
    assert path.read_bytes() == previous  # the old file, byte for byte
    assert sorted(p.name for p in folder.iterdir()) == ["replay.fpk"]  # no temporary left
    model.load_replay_buffer(path)
    assert model.replay_buffer.size() == 64
