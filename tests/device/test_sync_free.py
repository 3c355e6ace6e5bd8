"""``sample`` and ``update_priorities`` never synchronise with the host.

On the CPU device the guard of :mod:`tests.device.sync_guard` makes every call
that would synchronise on a GPU raise; on a GPU (skipped here without one)
``torch.cuda.set_sync_debug_mode("error")`` does the same for real syncs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastper.device as fd  # noqa: E402
from fastper import schedules  # noqa: E402

from .sync_guard import HostSyncError, forbid_sync  # noqa: E402

FIELDS = {"obs": ((4,), np.float32), "action": ((), np.int64), "done": ((), np.bool_)}


def _filled(cls=fd.DevicePrioritizedReplayBuffer, device="cpu", n=3000, **kw):
    buf = cls(2048, FIELDS, device=device, seed=0, backend="torch", **kw)
    g = torch.Generator(device=device).manual_seed(1)
    for lo in range(0, n, 500):
        buf.add(
            {
                "obs": torch.randn(500, 4, generator=g, device=device),
                "action": torch.arange(lo, lo + 500, device=device),
                "done": torch.zeros(500, dtype=torch.bool, device=device),
            }
        )
    return buf


def _loop(buf, steps: int = 5, batch: int = 64, dup: bool = True, device="cpu") -> None:
    g = torch.Generator(device=device).manual_seed(2)
    for _ in range(steps):
        b = buf.sample(batch)
        idx = b.indices.clone()
        if dup:
            idx[1::7] = idx[0]  # duplicates in one update
        td = torch.randn(batch, generator=g, dtype=torch.float64, device=device)
        buf.update_priorities(idx, td, keys=b.keys)
        buf.add(  # the ring wraps: some sampled keys go stale before the next update
            {
                "obs": torch.zeros(300, 4, device=device),
                "action": torch.zeros(300, dtype=torch.int64, device=device),
                "done": torch.zeros(300, dtype=torch.bool, device=device),
            }
        )


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sample_update_and_tensor_add_do_not_sync(
    norm: str, stratified: bool, shuffle: bool
) -> None:
    buf = _filled(weight_norm=norm, stratified=stratified, shuffle=shuffle, validate=False)
    with forbid_sync() as guard:
        _loop(buf)
    assert guard.calls > 100  # the guard saw the calls it was meant to inspect
    assert buf.stale_updates > 0  # stale keys went through the sync-free drop
    assert buf.step == 5


def test_schedules_noise_and_alpha_changes_do_not_sync() -> None:
    buf = _filled(
        validate=False,
        alpha=schedules.linear(0.4, 0.9, 10),
        beta=schedules.cosine(0.4, 1.0, 10),
        priority_noise=0.3,
        alpha_every=2,
    )
    with forbid_sync():
        _loop(buf, steps=8)
    assert buf.alpha == schedules.linear(0.4, 0.9, 10)(6)


def test_uniform_buffer_does_not_sync() -> None:
    buf = _filled(fd.DeviceReplayBuffer, validate=False)
    with forbid_sync():
        _loop(buf)


@pytest.mark.parametrize("cls", [fd.DevicePrioritizedReplayBuffer, fd.DeviceReplayBuffer])
def test_validated_steps_do_not_sync(cls) -> None:
    """validate=True (the default) checks updates on the device: no read-back per step.

    Bad tensor entries are reported at the next check (test_device_buffer.py);
    the steady-state loop (sample, update with duplicates and stale keys, add
    of tensors) never synchronises.
    """
    buf = _filled(cls, validate=True)
    with forbid_sync() as guard:
        _loop(buf, steps=6)
    assert guard.calls > 100
    buf.check()  # nothing was invalid
    assert buf.stale_updates > 0 and buf.invalid_updates == 0


def test_the_check_is_the_read_back() -> None:
    """Negative control: the deferred check does read the device."""
    buf = _filled(validate=True)
    b = buf.sample(32)
    buf.update_priorities(b.indices, torch.ones(32), keys=b.keys)
    with pytest.raises(HostSyncError):
        with forbid_sync():
            buf.check()


def test_bad_entries_are_dropped_without_a_sync() -> None:
    buf = _filled(validate=False)
    b = buf.sample(8)
    td = torch.tensor([1.0, float("nan"), float("inf"), 2.0, 1e308, 3.0, 4.0, 5.0])
    idx = b.indices.clone()
    idx[6] = 10**6  # out of range
    idx[7] = -1
    before = buf.priorities(torch.arange(len(buf)))
    with forbid_sync():
        applied = buf.update_priorities(idx, td, keys=b.keys)
    assert buf.invalid_updates == 5
    assert int(applied) == len(set(b.indices[[0, 3, 5]].tolist()))
    after = buf.priorities(torch.arange(len(buf)))
    assert torch.isfinite(after).all() and torch.isfinite(buf._index.total_for(len(buf)))
    changed = (after != before).nonzero().view(-1).tolist()
    assert set(changed) <= set(b.indices[[0, 3, 5]].tolist())


def test_the_guard_catches_every_kind_of_sync() -> None:
    """Negative control: each forbidden call raises inside the guard."""
    t = torch.arange(4)
    for call in [
        lambda: t.sum().item(),
        lambda: t.tolist(),
        lambda: bool(t.any()),
        lambda: int(t[0]),
        lambda: float(t[0]),
        lambda: t.numpy(),
        lambda: t.nonzero(),
        lambda: t[t > 1],
        lambda: torch.where(t > 1),
        lambda: torch.unique(t),
        lambda: torch.masked_select(t, t > 1),
        lambda: np.asarray(t),
        lambda: torch.repeat_interleave(t, t),
    ]:
        with pytest.raises(HostSyncError):
            with forbid_sync():
                call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_on_a_gpu() -> None:
    buf = _filled(device="cuda", validate=False)
    _loop(buf, device="cuda")  # warm up (allocations, first launches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _loop(buf, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
