"""A learner step on the torch back end is a fixed, small number of tensor operations.

On a GPU each operation is a kernel launch, so a step of a few hundred
operations is bound by launch latency whatever the GPU. The counter of
:mod:`tests.device.op_count` counts every non-view ATen operation that
``sample`` and ``update_priorities`` dispatch on the CPU device (the same
Python code runs on a GPU); views and aliases are metadata and not counted
(the rule is in that module).

Measured at B = 256 with the buffer's defaults (proportional, validate=True,
stratified, shuffled, buffer-wide weight normalisation, keys), two fields,
float32 td errors: at capacity 4096 and at 2^24 alike (the 2^24 index is
allocated untouched: a block is initialised when the buffer first reaches it).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastper.device as fd  # noqa: E402

from .op_count import count_ops  # noqa: E402
from .sync_guard import forbid_sync  # noqa: E402

#: the target: sample + update of 256 at any capacity
BUDGET = 40
B = 256
FIELDS = {"obs": ((4,), np.uint8), "action": ((), np.int64)}  # 9 bytes a row: 2^24 rows fit


def _rss_mib() -> float:
    pages = int(open("/proc/self/statm").read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _buffer(capacity: int, **kw) -> fd.DevicePrioritizedReplayBuffer:
    buf = fd.DevicePrioritizedReplayBuffer(capacity, FIELDS, backend="torch", seed=0, **kw)
    n = 4096
    buf.add({"obs": torch.zeros(n, 4, dtype=torch.uint8), "action": torch.arange(n)})
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # warm: the first call of a batch size makes its scratch buffers
        batch = buf.sample(B)
        buf.update_priorities(batch, torch.rand(B, generator=gen) * 4)
    return buf


def _step_counts(buf: fd.DevicePrioritizedReplayBuffer) -> tuple[count_ops, count_ops]:
    td = torch.rand(B, generator=torch.Generator().manual_seed(2))  # float32, as a loss gives
    with forbid_sync(), count_ops() as sample_ops:
        batch = buf.sample(B)
    with forbid_sync(), count_ops() as update_ops:
        buf.update_priorities(batch.indices, td, keys=batch.keys)
    return sample_ops, update_ops


def test_a_learner_step_is_a_fixed_number_of_operations_at_any_capacity() -> None:
    counts = {}
    for capacity in (4096, 1 << 24):
        before = _rss_mib() if sys.platform == "linux" else math.nan
        buf = _buffer(capacity)
        grown = _rss_mib() - before
        s, u = _step_counts(buf)
        counts[capacity] = (s.ops, u.ops)
        total = s.count + u.count
        assert total <= BUDGET, f"N={capacity}: sample {s.count} {s.ops}, update {u.count} {u.ops}"
        buf.check()  # the step was valid: nothing to report
        # the 2^24 index (about 650 MB) is allocated, not touched
        assert not grown > 256, f"{grown:.0f} MiB committed for capacity {capacity}"
    assert counts[4096] == counts[1 << 24]  # nothing per level, nothing per N


#: a CartPole-like transition: five fields of three dtypes
FIVE = {
    "obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
    "next_obs": ((4,), np.float32), "done": ((), np.bool_),
}  # fmt: skip


@pytest.mark.parametrize(
    ("capacity", "fill"),
    [
        (4096, 4096),  # whole blocks of 64
        (4096, 1000),  # filling: the last block is partly written
        (100_000, 100_000),  # full, and the last block is never whole
        (1_000_000, 4099),
    ],
)
@pytest.mark.parametrize("fields", [FIELDS, FIVE, {"obs": ((4,), np.float32)}], ids=["2", "5", "1"])
def test_the_budget_holds_whatever_the_fill_the_capacity_and_the_fields(capacity, fill, fields):
    """The fields are gathered at once (stored side by side), and a partly written last
    block costs one operation more in each call, never the guarded path."""
    buf = fd.DevicePrioritizedReplayBuffer(capacity, fields, backend="torch", seed=0)
    buf.add({
        name: torch.zeros((fill, *shape), dtype=getattr(torch, np.dtype(dtype).name))
        for name, (shape, dtype) in fields.items()
    })  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = buf.sample(B)
        buf.update_priorities(batch, torch.rand(B, generator=gen) * 4)
    s, u = _step_counts(buf)
    partial = fill % 64 != 0
    assert (s.count, u.count) == ((19, 21) if partial else (18, 20)), (s.ops, u.ops)
    assert s.count + u.count <= BUDGET
    assert s.ops["aten.index_select.default"] == 4  # targets' order, block, its prefix, rows
    buf.check()


def test_the_count_does_not_depend_on_validation_or_on_how_the_batch_is_passed() -> None:
    checked, unchecked = _buffer(4096), _buffer(4096, validate=False)
    a = sum(c.count for c in _step_counts(checked))
    b = sum(c.count for c in _step_counts(unchecked))
    assert a == b <= BUDGET
    td = torch.rand(B)
    batch = checked.sample(B)
    with count_ops() as whole:
        checked.update_priorities(batch, td)  # the batch itself: its indices and keys
    idx, keys = batch.indices.clone(), batch.keys.clone()
    with count_ops() as copies:  # separate tensors: one stack more
        checked.update_priorities(idx, td, keys=keys)
    checked.update_priorities(batch.indices, td)  # its first call makes its scratch
    with count_ops() as no_keys:
        checked.update_priorities(batch.indices, td)
    s, u = _step_counts(checked)
    assert whole.count == u.count and copies.count == u.count + 1
    assert no_keys.count <= u.count
    checked.check()


@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": False},
        {"stratified": False},
        {"weight_norm": "batch"},
        {"weight_norm": "none"},
        {"clip": 2.0},
        {"eps": 0.0, "validate": False},  # priorities may be zero: the guarded path
        {"priority_noise": 0.1},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_other_settings_stay_within_a_few_operations_of_the_budget(options) -> None:
    """Settings that add a guard, a draw or a reduction cost a few more, never a loop."""
    small, large = _buffer(4096, **options), _buffer(1 << 16, **options)
    a = sum(c.count for c in _step_counts(small))
    b = sum(c.count for c in _step_counts(large))
    assert a == b <= BUDGET + 10
