"""The disk tier (fastper.disk): rows in files, checked against the RAM storage."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import fastper
from fastper.disk import COUNTER, HEADER, DiskStorage, open_buffer
from fastper.errors import DiskBufferError, FieldTypeError
from fastper.storage import Storage

# every dtype kind and several shapes, one of them empty
FIELDS = {
    "obs": ((6, 5), np.uint8),
    "vec": ((3,), np.float32),
    "f64": ((), np.float64),
    "f16": ((2,), np.float16),
    "i8": ((), np.int8),
    "u16": ((2, 2), np.uint16),
    "i32": ((), np.int32),
    "action": ((), np.int64),
    "done": ((), np.bool_),
    "empty": ((0,), np.float32),
}


def batch(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.integers(0, 256, (k, 6, 5)).astype(np.uint8),
        "vec": rng.standard_normal((k, 3)).astype(np.float32),
        "f64": rng.standard_normal(k),
        "f16": rng.standard_normal((k, 2)).astype(np.float16),
        "i8": rng.integers(-128, 128, k).astype(np.int8),
        "u16": rng.integers(0, 2**16, (k, 2, 2)).astype(np.uint16),
        "i32": rng.integers(-(2**31), 2**31, k).astype(np.int32),
        "action": rng.integers(-(2**62), 2**62, k),
        "done": rng.random(k) < 0.5,
        "empty": np.zeros((k, 0), np.float32),
    }


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[f].dtype == b[f].dtype and a[f].shape == b[f].shape and np.array_equal(a[f], b[f])
        for f in a
    )


@pytest.mark.parametrize("ram_budget", [0, 2000, 1 << 20])
def test_ring_matches_ram_storage(tmp_path: Path, ram_budget: int) -> None:
    """Every sampled batch equals the RAM buffer's, through several wraps of the ring."""
    cap = 37
    disk = fastper.PrioritizedReplayBuffer(
        cap, FIELDS, alpha=0.7, beta=0.5, seed=3,
        storage=lambda f, c: DiskStorage(f, c, tmp_path / "d", ram_budget=ram_budget),
    )  # fmt: skip
    ram = fastper.PrioritizedReplayBuffer(cap, FIELDS, alpha=0.7, beta=0.5, seed=3)
    assert isinstance(disk.storage, DiskStorage)
    if ram_budget == 0:
        assert list(disk.storage.mirrors) == ["empty"] and disk.storage.nbytes() == 0
    rng = np.random.default_rng(0)
    for step in range(40):
        k = int(rng.integers(1, 12))
        b = batch(rng, k)
        if k == 1 and step % 2:  # one transition, without the leading dimension
            b = {f: v[0] for f, v in b.items()}
        np.testing.assert_array_equal(disk.add(b), ram.add(b))
        x, y = disk.sample(16), ram.sample(16)
        assert same(x.data, y.data)
        np.testing.assert_array_equal(x.indices, y.indices)
        td = rng.random(16)
        disk.update_priorities(x.indices, td, keys=x.keys)
        ram.update_priorities(y.indices, td, keys=y.keys)
    assert disk.total_added > 3 * cap
    st = disk.storage
    assert st.rows == disk.total_added and st.size == len(disk) == cap
    for name in FIELDS:
        np.testing.assert_array_equal(st.read(name, 3, 30), ram.storage.read(name, 3, 30))
        np.testing.assert_array_equal(
            st.state_dict(cap)[f"columns/{name}"], ram.storage.columns[name]
        )


def test_files_layout_and_costs(tmp_path: Path) -> None:
    st = DiskStorage(FIELDS, 10, tmp_path / "d", ram_budget=0)
    per_slot = sum(Storage(FIELDS, 1).nbytes_per_slot for _ in [0])
    assert st.nbytes_per_slot == per_slot and st.disk_nbytes() == 10 * per_slot
    names = sorted(os.listdir(tmp_path / "d"))
    assert HEADER in names and COUNTER in names and len(names) == 2 + len(FIELDS)
    sizes = sum((tmp_path / "d" / n).stat().st_size for n in names if n.startswith("field-"))
    assert sizes == 10 * per_slot
    mirrored = DiskStorage({"a": ((), np.int8), "b": ((100,), np.uint8)}, 10, tmp_path / "m",
                           ram_budget=50)  # fmt: skip
    assert list(mirrored.mirrors) == ["a"] and mirrored.nbytes() == 10


def test_checkpoint_does_not_copy_rows(tmp_path: Path) -> None:
    cap = 2000
    fields = {"obs": ((32, 32), np.uint8), "action": ((), np.int64)}
    buf = fastper.PrioritizedReplayBuffer(
        cap, fields, alpha=0.6, beta=0.4, seed=1,
        storage=DiskStorage(fields, cap, tmp_path / "d"),
    )  # fmt: skip
    rng = np.random.default_rng(1)
    for _ in range(6):
        buf.add({"obs": rng.integers(0, 256, (500, 32, 32)), "action": rng.integers(0, 4, 500)})
        s = buf.sample(64)
        buf.update_priorities(s.indices, rng.random(64), keys=s.keys)
    path = tmp_path / "ck.fpk"
    buf.save(path)
    data_bytes = cap * 32 * 32
    # priorities (8 B per slot) and the small state: far below the 2 MB of rows
    assert path.stat().st_size < 8 * cap + 16_000 < data_bytes // 50
    meta = fastper.read_metadata(path)
    assert meta["state"]["storage"]["reference"] == "fastper-disk"
    expected = [buf.sample(32) for _ in range(3)]
    buf.storage.close()
    loaded = fastper.load(path)
    assert isinstance(loaded.storage, DiskStorage) and len(loaded) == cap
    for e in expected:
        got = loaded.sample(32)
        assert same(got.data, e.data)
        np.testing.assert_array_equal(got.weights, e.weights)
    assert loaded.storage.recovery is not None and loaded.storage.recovery.lossless


def test_state_dict_moves_between_ram_and_disk(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    ram = fastper.PrioritizedReplayBuffer(20, FIELDS, alpha=0.5, seed=0)
    for _ in range(5):
        ram.add(batch(rng, 7))  # wraps: cursor 15 of a full ring
    disk = fastper.from_state_dict(
        ram.state_dict(), storage=lambda f, c: DiskStorage(f, c, tmp_path / "d")
    )
    back = fastper.from_state_dict(disk.state_dict())  # read-only maps of the files
    for _ in range(3):
        x, y, z = ram.sample(8), disk.sample(8), back.sample(8)
        assert same(x.data, y.data) and same(x.data, z.data)
    b = batch(rng, 9)
    ram.add(b), disk.add(b)
    assert same(ram.sample(20).data, disk.sample(20).data)
    assert disk.storage.rows % 20 == disk.cursor
    disk.save(tmp_path / "ck.fpk")
    disk.storage.close()
    again, report = open_buffer(tmp_path / "d", tmp_path / "ck.fpk")
    assert report.lossless and again.cursor == ram.cursor
    assert same(again.sample(20).data, ram.sample(20).data)


def test_clear_starts_a_new_epoch(tmp_path: Path) -> None:
    buf = fastper.PrioritizedReplayBuffer(
        8, FIELDS, seed=0, storage=lambda f, c: DiskStorage(f, c, tmp_path / "d")
    )
    buf.add(batch(np.random.default_rng(0), 5))
    buf.save(tmp_path / "ck.fpk")
    buf.clear()
    assert buf.storage.rows == 0 and buf.storage.epoch == 1
    buf.storage.close()
    with pytest.raises(DiskBufferError, match="cleared or reloaded after the checkpoint"):
        open_buffer(tmp_path / "d", tmp_path / "ck.fpk")
    again, report = open_buffer(tmp_path / "d")
    assert len(again) == 0 and report.recovered == 0


BAD_TRANSITIONS = [
    {"obs": np.zeros((6, 5))},  # missing fields
    {**batch(np.random.default_rng(0), 2), "extra": 1},
    {**batch(np.random.default_rng(0), 2), "obs": np.zeros((2, 5, 6), np.uint8)},
    {**batch(np.random.default_rng(0), 2), "vec": np.zeros((3, 3), np.float32)},
    {**batch(np.random.default_rng(0), 2), "i8": np.array([1000, 0])},
    {**batch(np.random.default_rng(0), 2), "action": np.array([0.5, 1.0])},
    {**batch(np.random.default_rng(0), 2), "done": np.array([2, 0])},
    batch(np.random.default_rng(0), 0),
    batch(np.random.default_rng(0), 9),  # more than the capacity
    [1, 2, 3],
]


@pytest.mark.parametrize("bad", BAD_TRANSITIONS)
def test_prepare_errors_match_ram_storage(tmp_path: Path, bad: object) -> None:
    ram = Storage(FIELDS, 8)
    disk = DiskStorage(FIELDS, 8, tmp_path / "d")
    with pytest.raises((ValueError, TypeError, FieldTypeError)) as expected:
        ram.prepare(bad)  # type: ignore[arg-type]
    with pytest.raises(type(expected.value), match=None) as got:
        disk.prepare(bad)  # type: ignore[arg-type]
    assert str(got.value) == str(expected.value)


def test_constructor_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity"):
        DiskStorage(FIELDS, 0, tmp_path / "a")
    with pytest.raises(ValueError, match="ram_budget"):
        DiskStorage(FIELDS, 4, tmp_path / "b", ram_budget=-1)
    with pytest.raises(ValueError, match="fields"):
        DiskStorage({}, 4, tmp_path / "c")
    assert not (tmp_path / "a").exists()
