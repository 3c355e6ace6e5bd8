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
    assert dev.nbytes() == ram.nbytes()


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
