"""torch tensors in and out of the buffers (skipped without torch)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import fastper
from tests.conftest import CARTPOLE_FIELDS, make_batch

torch = pytest.importorskip("torch")


def test_import_fastper_does_not_import_torch() -> None:
    code = "import sys, fastper, fastper.agents, fastper.spaces; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_add_and_update_accept_tensors_with_grad() -> None:
    buf = fastper.PrioritizedReplayBuffer(32, CARTPOLE_FIELDS, seed=0)
    batch = {k: torch.as_tensor(v) for k, v in make_batch(8).items()}
    slots = buf.add(batch)
    np.testing.assert_array_equal(slots, np.arange(8))
    np.testing.assert_array_equal(buf.sample(4)["obs"][:, 0] % 1, 0)
    s = buf.sample(4)
    td = torch.tensor([0.5, -2.0, 3.0, 0.25], requires_grad=True) * 1.0  # non-leaf, has grad
    kept = buf.update_priorities(torch.as_tensor(s.indices), td, keys=torch.as_tensor(s.keys))
    assert kept == 4
    last = {}
    for i, v in zip(s.indices, np.abs(td.detach().numpy()), strict=True):
        last[int(i)] = v  # duplicates: last wins
    for i, v in last.items():
        assert buf.priorities([i])[0] == pytest.approx(v + 1e-6, rel=1e-6)


def test_to_torch_dtypes_and_values() -> None:
    buf = fastper.PrioritizedReplayBuffer(32, CARTPOLE_FIELDS, seed=0)
    buf.add(make_batch(16))
    s = buf.sample(5)
    t = s.to_torch("cpu")
    assert t["obs"].dtype == torch.float32 and t["action"].dtype == torch.int64
    np.testing.assert_array_equal(t["obs"].numpy(), s["obs"])
    np.testing.assert_array_equal(t["weights"].numpy(), s.weights)
    np.testing.assert_array_equal(t["indices"].numpy(), s.indices)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_to_torch_gives_what_as_tensor_gives_on_every_device(device: object) -> None:
    """On the CPU the tensors share the batch's arrays, as ``torch.as_tensor`` does
    there; on another device they are made there."""
    buf = fastper.PrioritizedReplayBuffer(32, CARTPOLE_FIELDS, seed=0)
    buf.add(make_batch(16))
    s = buf.sample(5)
    got = s.to_torch(device)
    arrays = {**s.data, "weights": s.weights, "indices": s.indices, "keys": s.keys,
              "probabilities": s.probabilities}  # fmt: skip
    assert sorted(got) == sorted(arrays)
    for name, arr in arrays.items():
        want = torch.as_tensor(arr, device=device)
        t = got[name]
        assert (t.dtype, t.shape, t.device) == (want.dtype, want.shape, want.device), name
        if t.device.type == "cpu":
            assert np.shares_memory(t.numpy(), arr), name
            np.testing.assert_array_equal(t.numpy(), arr)
