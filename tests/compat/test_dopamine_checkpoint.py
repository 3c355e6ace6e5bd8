"""Checkpoints of the Dopamine-shaped buffer: Dopamine's save / load calls, fastper's safe files."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from fastper.compat.dopamine import OutOfGraphPrioritizedReplayBuffer, ReplayElement
from fastper.errors import CheckpointError

FRAME = (4, 4)


def filled(rng_arg: object = 0, capacity: int = 30) -> OutOfGraphPrioritizedReplayBuffer:
    buf = OutOfGraphPrioritizedReplayBuffer(
        FRAME, 4, capacity, 8, update_horizon=3, rng=rng_arg,  # type: ignore[arg-type]
        extra_storage_types=[ReplayElement("logp", (), np.float32)],
    )  # fmt: skip
    data = np.random.default_rng(1)
    for t in range(45):  # wraps the ring
        buf.add(data.integers(0, 256, FRAME, dtype=np.uint8), t % 3, float(t), t % 11 == 10,
                np.float32(t), priority=float(data.uniform(0.1, 2.0)),
                episode_end=t % 17 == 16)  # fmt: skip
    return buf


def same(a: OutOfGraphPrioritizedReplayBuffer, b: OutOfGraphPrioritizedReplayBuffer) -> None:
    assert a.add_count == b.add_count and a.cursor() == b.cursor()
    assert a.episode_end_indices == b.episode_end_indices
    slots = np.arange(30, dtype=np.int32)
    np.testing.assert_array_equal(a.get_priority(slots), b.get_priority(slots))
    assert a.sum_tree.max_recorded_priority == b.sum_tree.max_recorded_priority
    valid = [i for i in range(30) if a.is_valid_transition(i)]
    assert valid == [i for i in range(30) if b.is_valid_transition(i)]
    for x, y in zip(a.sample_transition_batch(indices=valid),
                    b.sample_transition_batch(indices=valid), strict=True):  # fmt: skip
        np.testing.assert_array_equal(x, y)


def test_save_and_load_round_trip_and_keep_sampling_alike(tmp_path: Path) -> None:
    buf = filled(rng_arg=5)
    buf.save(tmp_path, 7)
    assert (tmp_path / "fastper_replay_ckpt.7.fpk").is_file()
    again = filled(rng_arg=99, capacity=30)
    again.add(np.zeros(FRAME, np.uint8), 0, 0.0, False, np.float32(0), priority=9.0)
    again.load(tmp_path, "7")
    same(buf, again)
    # the generator's state came back too: both draw the same next batches
    np.testing.assert_array_equal(buf.sample_index_batch(16), again.sample_index_batch(16))
    # and both go on alike
    for b in (buf, again):
        b.add(np.ones(FRAME, np.uint8), 1, 1.0, False, np.float32(1), priority=0.5)
    same(buf, again)


def test_random_instance_state_restored_and_global_random_untouched(tmp_path: Path) -> None:
    buf = filled(rng_arg=random.Random(3))
    buf.save(tmp_path, 0)
    other = filled(rng_arg=random.Random(4))
    random.seed(123)
    before = random.getstate()
    other.load(tmp_path, 0)
    assert other.sample_index_batch(8).tolist() == buf.sample_index_batch(8).tolist()
    module = filled(rng_arg=random)
    module.load(tmp_path, 0)  # draws from the global random: its state is the program's
    assert random.getstate() == before


def test_old_iterations_removed_as_dopamine_does(tmp_path: Path) -> None:
    buf = filled()
    for it in range(6):
        buf.save(tmp_path, it)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"fastper_replay_ckpt.{i}.fpk" for i in (2, 3, 4, 5)
    ]


def test_bad_checkpoints_are_refused_and_change_nothing(tmp_path: Path) -> None:
    buf = filled()
    buf.save(tmp_path, 1)
    with pytest.raises(FileNotFoundError, match="existing directory"):
        buf.save(tmp_path / "missing", 1)
    with pytest.raises(FileNotFoundError, match="no replay checkpoint"):
        buf.load(tmp_path, 2)
    target = filled(rng_arg=1)
    reference = filled(rng_arg=1)
    other = OutOfGraphPrioritizedReplayBuffer(FRAME, 2, 30, 8, update_horizon=3, rng=0,
        extra_storage_types=[ReplayElement("logp", (), np.float32)])  # fmt: skip
    with pytest.raises(ValueError, match="other settings.*stack_size"):
        other.load(tmp_path, 1)
    assert other.add_count == 0
    state = buf.state_dict()
    bad_prio = {**state, "tree": {**state["tree"], "priorities": -state["tree"]["priorities"]}}
    bad_ring = {**state, "ring": {**state["ring"], "add_count": -1}}
    bad_col = {**state, "storage": {**state["storage"], "columns/observation": np.zeros(3)}}
    bad_rng = {**state, "rng": {"kind": "numpy", "state": {"bit_generator": "nope"}}}
    for bad in (bad_prio, bad_ring, bad_col, bad_rng, {"format": "x"}, None):
        with pytest.raises((ValueError, TypeError)):
            target.load_state_dict(bad)  # type: ignore[arg-type]
        same(target, reference)
    # a damaged file: the checksum says so
    path = tmp_path / "fastper_replay_ckpt.1.fpk"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        target.load(tmp_path, 1)
    same(target, reference)
