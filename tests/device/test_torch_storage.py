"""TorchStorage follows the storage protocol: it plugs into the CPU buffers too."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastper  # noqa: E402
from fastper.buffer_state import _SaveGuard  # noqa: E402
from fastper.device import TorchStorage  # noqa: E402
from fastper.errors import FieldTypeError  # noqa: E402
from fastper.storage import ReplayStorage  # noqa: E402

FIELDS = {"obs": ((3,), np.float32), "action": ((), np.int64), "done": ((), np.bool_)}


def _rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    return {
        "obs": np.arange(start, start + 3 * k, dtype=np.float32).reshape(k, 3),
        "action": np.arange(start, start + k),
        "done": np.arange(k) % 2 == 0,
    }


def test_is_a_replay_storage_and_wraps_like_the_ram_storage() -> None:
    dev, ram = TorchStorage(FIELDS, 10), fastper.Storage(FIELDS, 10)
    assert isinstance(dev, ReplayStorage)
    for start, k in ((0, 6), (6, 7)):  # the second write wraps
        for st in (dev, ram):
            prepared, n = st.prepare(_rows(k, start))
            st.write(start % 10, prepared, n)
    idx = np.array([9, 0, 2, 5])
    got = dev.gather(torch.as_tensor(idx))
    want = ram.gather(idx)
    for name in FIELDS:
        assert isinstance(got[name], torch.Tensor)
        assert np.array_equal(got[name].numpy(), want[name])
        assert np.array_equal(dev.read(name, 2, 8), ram.read(name, 2, 8))
    # a slot's fields side by side, padded to the widest element (8 bytes): 21 -> 24 (the
    # RAM storage takes records by default where padding is at most 1/8 of a record)
    assert ram.layout == "records"
    assert ram.nbytes() == 10 * 24 and dev.nbytes() == 10 * 24


def test_tensors_are_checked_by_shape_and_dtype() -> None:
    st = TorchStorage(FIELDS, 10)
    good = {
        "obs": torch.zeros(4, 3, dtype=torch.float64),  # float64 -> float32 is allowed
        "action": torch.arange(4, dtype=torch.int32),
        "done": torch.zeros(4, dtype=torch.bool),
    }
    prepared, k = st.prepare(good)
    assert k == 4
    st.write(8, prepared, k)  # wraps
    assert st.columns["obs"].dtype == torch.float32
    assert st.columns["action"][[8, 9, 0, 1]].tolist() == [0, 1, 2, 3]
    with pytest.raises(FieldTypeError, match="action"):
        st.prepare({**good, "action": torch.zeros(4)})  # float -> int would truncate
    with pytest.raises(ValueError, match="shape"):
        st.prepare({**good, "obs": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="one length"):
        st.prepare({**good, "done": torch.zeros(3, dtype=torch.bool)})
    with pytest.raises(ValueError, match="missing"):
        st.prepare({"obs": torch.zeros(3), "action": torch.tensor(1)})
    with pytest.raises(ValueError, match="capacity"):
        st.prepare({k: torch.cat([v] * 3) for k, v in good.items()})
    with pytest.raises(FieldTypeError, match="action"):  # host data: the RAM storage's checks
        st.prepare({**_rows(2), "action": np.array([0.5, 1.0])})


def test_a_cpu_buffer_with_torch_storage_samples_tensors_and_saves(tmp_path) -> None:
    buf = fastper.PrioritizedReplayBuffer(
        64, FIELDS, seed=0, storage=lambda fields, cap: TorchStorage(fields, cap, "cpu")
    )
    buf.add(_rows(40))
    batch = buf.sample(8)
    assert isinstance(batch.data["obs"], torch.Tensor)
    assert np.array_equal(batch.data["action"].numpy(), batch.indices)
    # a save in progress copies overwritten rows aside: from tensors, as host arrays
    guard = _SaveGuard(buf.storage, len(buf))
    guard.before_write(np.arange(5))
    buf.storage.columns["obs"][:5] = -1.0
    assert np.array_equal(guard.read("obs", 0, 10), _rows(40)["obs"][:10])
    buf.save(tmp_path / "b.fpk")
    again = fastper.load(tmp_path / "b.fpk")
    assert np.array_equal(again.storage.columns["action"][:40], np.arange(40))


def test_unsupported_dtype_is_refused_with_the_choices() -> None:
    with pytest.raises(TypeError, match="uint32"):
        TorchStorage({"x": ((), np.uint32)}, 4)


MIXED = {
    "frame": ((2, 3), np.uint8), "half": ((2,), np.float16), "count": ((), np.int32),
    "flag": ((), np.bool_), "value": ((), np.float64), "small": ((3,), np.int8),
}  # fmt: skip


def _mixed_rows(k: int, start: int) -> dict[str, np.ndarray]:
    r = np.arange(start, start + k)
    return {
        "frame": (r[:, None, None] * 7 + np.arange(6).reshape(2, 3)).astype(np.uint8),
        "half": np.stack([r * 0.5, -r * 0.25], axis=1).astype(np.float16),
        "count": (r * 1000 - 7).astype(np.int32),
        "flag": r % 3 == 0,
        "value": r * 1.0e200,
        "small": np.stack([r, -r, r * 2], axis=1).astype(np.int8),
    }


def test_fields_of_every_dtype_are_views_of_one_tensor_of_rows_and_gather_at_once() -> None:
    from tests.device.op_count import count_ops

    dev, ram = TorchStorage(MIXED, 12), fastper.Storage(MIXED, 12)
    assert dev.rows is not None
    # widest element first, each field at a multiple of its element's size
    assert [name for name, _, _ in dev._layout][:2] == ["value", "count"]
    for name, off, _ in dev._layout:
        assert off % MIXED[name][1]().itemsize == 0
        assert (
            dev.columns[name].untyped_storage().data_ptr() == dev.rows.untyped_storage().data_ptr()
        )
    assert dev.rows.shape == (12, 32)  # 8 + 4 + 4 + 6 + 1 + 3 = 26 bytes, padded to 32
    for start, k in ((0, 7), (7, 9)):  # wraps
        for st in (dev, ram):
            prepared, n = st.prepare(_mixed_rows(k, start))
            st.write(start % 12, prepared, n)
    idx = torch.tensor([11, 0, 3, 3, 8])
    with count_ops() as ops:
        got = dev.gather(idx)
    assert ops.count == 1  # one gather of whole rows; the fields are views of it
    want = ram.gather(idx.numpy())
    for name, (shape, dtype) in MIXED.items():
        assert got[name].shape == (5, *shape) and got[name].dtype == getattr(
            torch, np.dtype(dtype).name
        )
        np.testing.assert_array_equal(got[name].numpy(), want[name])
        np.testing.assert_array_equal(dev.read(name, 0, 12), ram.read(name, 0, 12))
    again = TorchStorage(MIXED, 12)
    again.load_state_dict(dev.state_dict(12), 12)
    assert torch.equal(again.rows, dev.rows)


def test_one_field_keeps_its_tensor_and_an_empty_field_is_an_empty_view() -> None:
    from tests.device.op_count import count_ops

    one = TorchStorage({"obs": ((4,), np.float32)}, 8)
    assert one.rows is None and one.columns["obs"].is_contiguous()
    fields = {"obs": ((4,), np.uint8), "none": ((3, 0), np.float64), "id": ((), np.int32)}
    st = TorchStorage(fields, 8)
    assert st.rows is not None and st.rows.shape == (8, 8)  # 4 + 4, a multiple of 8
    prepared, n = st.prepare(
        {"obs": np.ones((2, 4), np.uint8), "none": np.ones((2, 3, 0)), "id": np.array([5, 6])}
    )
    st.write(0, prepared, n)
    with count_ops() as ops:
        got = st.gather(torch.tensor([1, 0]))
    assert ops.count == 1
    assert got["obs"].tolist() == [[1] * 4] * 2 and got["id"].tolist() == [6, 5]
    assert got["none"].shape == (2, 3, 0) and got["none"].dtype == torch.float64
    assert TorchStorage({"a": ((0,), np.float32), "b": ((0,), np.int64)}, 4).rows is None


def test_host_rows_cross_to_the_device_as_whole_rows(monkeypatch) -> None:
    """On a GPU, host values are laid out as whole rows in a (pinned) staging, then
    cross in one copy into the rows (two where they wrap), whatever the fields. The
    same path runs here on the CPU, forced; it stores what the field path stores."""
    from torch.utils._python_dispatch import TorchDispatchMode

    staged, direct = TorchStorage(MIXED, 12), TorchStorage(MIXED, 12)
    assert not staged._stage_rows  # (CPU device: written field by field)
    staged._stage_rows = True
    rows_ptr = staged.rows.untyped_storage().data_ptr()

    class CopiesIntoRows(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "copy_" in str(func) and args[0].untyped_storage().data_ptr() == rows_ptr:
                CopiesIntoRows.count += 1
                # one plain copy of whole rows: contiguous bytes to contiguous bytes
                assert args[0].is_contiguous() and args[1].is_contiguous()
                assert args[1].dtype == torch.uint8
            return func(*args, **(kwargs or {}))

    def no_field_path(*args, **kwargs):
        raise AssertionError("host rows are staged whole")

    monkeypatch.setattr(staged, "_source", no_field_path)
    tensors = {
        name: torch.from_numpy(v).to(torch.float64) if v.dtype.kind == "f" else torch.from_numpy(v)
        for name, v in _mixed_rows(5, 40).items()
    }  # CPU tensors, floats as float64: cast into the fields' dtypes on the way
    for start, batch, copies in (
        (0, _mixed_rows(7, 0), 1),
        (7, _mixed_rows(9, 7), 2),
        (4, tensors, 1),
    ):
        for st in (staged, direct):
            prepared, n = st.prepare(batch)
            CopiesIntoRows.count = 0
            with CopiesIntoRows():
                st.write(start, prepared, n)
            if st is staged:
                assert CopiesIntoRows.count == copies
        assert torch.equal(staged.rows, direct.rows)


def test_the_row_staging_grows_to_the_largest_write_and_never_past_the_capacity() -> None:
    capacity = 150
    staged, direct = TorchStorage(MIXED, capacity), TorchStorage(MIXED, capacity)
    staged._stage_rows = True
    one = {name: v[0] for name, v in _mixed_rows(1, 3).items()}  # a single transition
    flags = {**_mixed_rows(100, 0), "half": np.ones((100, 2), bool)}  # bools into float16
    sizes = []
    for start, batch in ((0, one), (5, flags), (120, _mixed_rows(capacity, 9))):  # wraps
        for st in (staged, direct):
            prepared, n = st.prepare(batch)
            st.write(start, prepared, n)
        sizes.append(staged._rows_staging.shape[0])
        assert torch.equal(staged.rows, direct.rows)
    assert sizes == [64, 128, capacity]  # at least 64, doubled, capped at the capacity
