"""Device buffers on the CPU device: behaviour, the README's decisions, and agreement
with the CPU buffers and between the two back ends ("torch" tensor operations, the
path a GPU runs, and "numba" compiled kernels on the same memory).

Every buffer is seeded; a test that compares two buffers seeds both alike. The
device buffers draw from a torch generator, the CPU buffers from numpy, so the
comparisons with the CPU buffer give both the same indices and td errors rather
than comparing their draws.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
fd = pytest.importorskip("fastper.device")

import fastper  # noqa: E402  (after the skips: fastper.device needs torch)
from fastper.checkpoint import split_state  # noqa: E402
from tests.device.sync_guard import forbid_sync  # noqa: E402
from tests.oracles import _internals, assert_same_state, proportional_probs  # noqa: E402

BACKENDS = ("torch", "numba")
FIELDS = {"obs": ((3,), np.float32), "id": ((), np.int64)}
F64 = torch.float64


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    """k transitions whose values encode their insertion order."""
    ids = np.arange(start, start + k, dtype=np.int64)
    obs = np.stack([ids, -ids, 0.5 * ids], axis=1).astype(np.float32)
    return {"obs": obs, "id": ids}


def trows(k: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(a) for name, a in rows(k, start).items()}


def make(backend: str, capacity: int = 16, **kw) -> fd.DevicePrioritizedReplayBuffer:
    kw.setdefault("seed", 0)
    return fd.DevicePrioritizedReplayBuffer(capacity, FIELDS, backend=backend, **kw)


def snapshot(buf) -> dict:
    """Everything a device buffer holds, copied: its state (counters, random state,
    priorities, rows) plus every column row, the raw priorities and the trees."""
    meta, arrays = split_state(buf.state_dict())
    snap: dict = {"meta": copy.deepcopy(meta)}
    for name, arr in arrays.items():
        snap[f"array/{name}"] = np.array(arr, copy=True)
    for name, col in buf.storage.columns.items():
        snap[f"column/{name}"] = col.detach().clone().numpy()
    snap["raw"] = buf._index.raw[: len(buf)].clone().numpy()
    snap["max_priority"] = float(buf.max_priority)
    snap["len"] = len(buf)
    if buf.backend == "torch":
        for name, arr in buf._index.snapshot(len(buf)).items():
            snap[f"index/{name}"] = arr
    else:
        _internals(buf._index.sampler, "sampler", snap)
    return snap


def assert_same_batch(a, b) -> None:
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.keys, b.keys)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.probabilities, b.probabilities)
    assert a.data.keys() == b.data.keys()
    for name in a.data:
        assert torch.equal(a.data[name], b.data[name]), name


# ---------------------------------------------------------------------------
# samples, slots, keys
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_shapes_dtypes_and_devices(backend):
    buf = make(backend, capacity=32)
    buf.add(rows(20))
    batch = buf.sample(8)
    assert isinstance(batch, fd.DeviceBatch) and len(batch) == 8
    assert batch["obs"].shape == (8, 3) and batch["obs"].dtype == torch.float32
    assert batch["id"].shape == (8,) and batch["id"].dtype == torch.int64
    assert batch.indices.shape == (8,) and batch.indices.dtype == torch.int64
    assert batch.weights.shape == (8,) and batch.weights.dtype == torch.float32
    assert batch.probabilities.shape == (8,) and batch.probabilities.dtype == torch.float64
    assert batch.keys.shape == (8,) and batch.keys.dtype == torch.int64
    tensors = [*batch.data.values(), batch.indices, batch.weights, batch.probabilities, batch.keys]
    assert all(t.device == buf.device == torch.device("cpu") for t in tensors)
    assert buf.backend == backend
    # the rows are those of the sampled slots (id == slot before the ring wraps)
    assert torch.equal(batch["id"], batch.indices)
    assert torch.equal(batch["obs"][:, 0], batch.indices.to(torch.float32))
    assert torch.equal(batch.keys, batch.indices)
    # equal priorities: every weight is 1, every P(i) = 1/20
    assert torch.equal(batch.weights, torch.ones(8))
    assert torch.allclose(batch.probabilities, torch.full((8,), 1 / 20, dtype=F64), rtol=1e-12)
    # the batch holds copies: writing into it leaves the buffer's rows alone
    batch["obs"].fill_(-7.0)
    assert torch.equal(buf.storage.columns["obs"][:20, 0], torch.arange(20, dtype=torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_writes_a_fifo_ring_and_keys_match_the_cpu_buffer(backend):
    cap = 7
    buf = make(backend, capacity=cap)
    cpu = fastper.PrioritizedReplayBuffer(cap, FIELDS, seed=0)
    added = 0
    for k in (3, 5, 1, 7, 2, 6, 4):
        slots = buf.add(rows(k, added))
        assert slots.dtype == torch.int64 and slots.device == buf.device
        assert slots.tolist() == [(added + j) % cap for j in range(k)]
        np.testing.assert_array_equal(cpu.add(rows(k, added)), slots.numpy())
        added += k
        assert buf.total_added == added and len(buf) == min(added, cap)
        n = len(buf)
        np.testing.assert_array_equal(buf.keys(np.arange(n)).numpy(), cpu.keys(np.arange(n)))
    # slot s holds the latest transition t with t % cap == s
    expected = [max(t for t in range(added) if t % cap == s) for s in range(cap)]
    assert buf.storage.columns["id"].tolist() == expected
    assert buf.keys(torch.arange(cap)).tolist() == expected
    np.testing.assert_array_equal(buf.storage.columns["obs"].numpy(), cpu.storage.columns["obs"])
    # a sample's keys are the keys of its slots
    batch = buf.sample(16)
    assert torch.equal(batch.keys, buf.keys(batch.indices))
    assert torch.equal(batch["id"], batch.keys)


# ---------------------------------------------------------------------------
# agreement with the CPU buffer and between the back ends
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_priorities_probabilities_and_weights_match_the_cpu_buffer(backend, norm):
    cap, beta = 24, 0.55
    kw = dict(alpha=0.7, beta=beta, eps=1e-3, clip=50.0, weight_norm=norm, seed=3)
    cpu = fastper.PrioritizedReplayBuffer(cap, FIELDS, **kw)
    dev = fd.DevicePrioritizedReplayBuffer(cap, FIELDS, backend=backend, **kw)
    rng = np.random.default_rng(11)
    added = 0
    for it in range(30):
        k = int(rng.integers(1, 6))
        if it % 4 == 1:
            p = rng.uniform(0.0, 20.0, k)
            cpu.add(rows(k, added), priorities=p)
            dev.add(trows(k, added), priorities=torch.from_numpy(p))
        else:
            cpu.add(rows(k, added))
            dev.add(rows(k, added))
        added += k
        n = len(cpu)
        idx = rng.integers(0, n, 8)
        idx[-1] = idx[0]  # a duplicate: the last one wins on both
        td = rng.normal(0.0, 30.0, 8)  # negative, and some above the clip
        keys = cpu.keys(idx)
        if it % 3 == 0:
            keys[1] = max(keys[1] - cap, 0)  # an issued key, mostly of a former occupant
        n_cpu = cpu.update_priorities(idx, td, keys=keys)
        n_dev = dev.update_priorities(torch.from_numpy(idx), torch.from_numpy(td), keys=keys)
        assert n_dev.dtype == torch.int64 and n_dev.ndim == 0 and int(n_dev) == n_cpu
    n = len(cpu)
    assert len(dev) == n and dev.total_added == cpu.total_added
    every = np.arange(n)
    np.testing.assert_array_equal(dev.priorities(every).numpy(), cpu.priorities(every))
    probs = cpu.probabilities(every)
    np.testing.assert_allclose(dev.probabilities(every).numpy(), probs, rtol=1e-12)
    assert dev.max_priority_ever == cpu.max_priority_ever
    assert float(dev.max_priority) == cpu.max_priority
    assert dev.stale_updates == cpu.stale_updates
    np.testing.assert_array_equal(dev.keys(every).numpy(), cpu.keys(every))
    for _ in range(5):
        batch = dev.sample(16)
        idx = batch.indices.numpy()
        p = probs[idx]
        if norm == "buffer":
            expected = (p / probs.min()) ** -beta
        elif norm == "batch":
            expected = (p / p.min()) ** -beta
        else:
            expected = (n * p) ** -beta
        np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(batch.probabilities.numpy(), p, rtol=1e-12)
    if norm == "buffer":  # the slot of smallest P gets weight 1, the others less
        assert batch.weights.max() <= 1.0


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_backends_draw_identical_batches_over_a_long_mixed_run(stratified, norm):
    # alpha = 1, eps = 0 and integer td errors: every leaf and every sum is an exact
    # integer, so no target falls within rounding of a leaf boundary on one back end only
    kw = dict(alpha=1.0, beta=0.6, eps=0.0, stratified=stratified, weight_norm=norm, seed=5)
    bufs = [fd.DevicePrioritizedReplayBuffer(50, FIELDS, backend=b, **kw) for b in BACKENDS]
    rng = np.random.default_rng(7)
    added = 0
    for it in range(150):
        k = int(rng.integers(1, 8))
        pri = rng.integers(0, 30, k).astype(np.float64) if it % 5 == 0 else None
        if it == 0 and pri is not None:
            pri[0] = 1.0  # not all zero: something must be sampleable
        slots = [b.add(rows(k, added), priorities=pri) for b in bufs]
        assert torch.equal(slots[0], slots[1])
        added += k
        size = int(rng.integers(1, 40))
        batches = [b.sample(size) for b in bufs]
        assert_same_batch(*batches)
        s = batches[0]
        td = torch.from_numpy(rng.integers(-25, 26, len(s)).astype(np.float64))
        keys = s.keys if it % 2 else None
        counts = [b.update_priorities(s.indices, td, keys=keys) for b in bufs]
        assert int(counts[0]) == int(counts[1])
    every = torch.arange(50)
    assert torch.equal(bufs[0].priorities(every), bufs[1].priorities(every))
    assert bufs[0].max_priority_ever == bufs[1].max_priority_ever
    assert bufs[0].stale_updates == bufs[1].stale_updates
    assert_same_batch(bufs[0].sample(256), bufs[1].sample(256))


# ---------------------------------------------------------------------------
# priorities of new transitions
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_items_get_the_largest_priority_ever_recorded(backend):
    eps = 1e-6
    buf = make(backend, eps=eps)
    cpu = fastper.PrioritizedReplayBuffer(16, FIELDS, eps=eps, seed=0)
    assert buf.max_priority_ever == 1.0
    m = buf.max_priority
    assert m.dtype == F64 and m.ndim == 0 and float(m) == 1.0
    steps = [
        ("add", 4, None),
        ("update", [0], [5.0]),  # raises the max
        ("add", 2, None),
        ("update", [0, 4], [0.1, 0.2]),  # lowers those slots: the max stays
        ("add", 2, None),
        ("add", 1, [9.0]),  # an explicit priority raises it too
        ("add", 2, None),
        ("update", [8], [3.0]),
        ("add", 1, None),
    ]
    added = 0
    for op, a, b in steps:
        if op == "add":
            buf.add(rows(a, added), priorities=b)
            cpu.add(rows(a, added), priorities=b)
            added += a
        else:
            buf.update_priorities(a, b)
            cpu.update_priorities(a, b)
        assert buf.max_priority_ever == cpu.max_priority_ever
        assert float(buf.max_priority) == cpu.max_priority
    got = buf.priorities(torch.arange(added)).tolist()
    assert got == pytest.approx(
        [0.1 + eps, 1, 1, 1, 0.2 + eps, 5 + eps, 5 + eps, 5 + eps, 3 + eps, 9, 9, 9],
        rel=1e-15,
    )
    np.testing.assert_array_equal(got, cpu.priorities(np.arange(added)))
    assert buf.max_priority_ever == 9.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_item_priority_never_exceeds_clip_plus_eps(backend):
    eps = 1e-3
    low = make(backend, clip=0.1, eps=eps)  # below the initial 1.0
    slots = low.add(rows(3))
    assert low.priorities(slots).tolist() == [0.1 + eps] * 3
    assert float(low.max_priority) == 0.1 + eps and low.max_priority_ever == 1.0
    buf = make(backend, clip=2.0, eps=eps)
    slots = buf.add(rows(3))
    assert buf.priorities(slots).tolist() == [1.0] * 3
    buf.update_priorities([1], [10.0])  # clipped to 2 + eps
    assert buf.priorities([1]).tolist() == [2.0 + eps]
    assert buf.max_priority_ever == 2.0 + eps
    new = buf.add(rows(2, 3))
    assert buf.priorities(new).tolist() == [2.0 + eps] * 2
    # an explicit priority above the cap raises the record, not the new-item priority
    buf.add(rows(1, 5), priorities=[7.0])
    assert buf.max_priority_ever == 7.0 and float(buf.max_priority) == 2.0 + eps
    assert buf.priorities(buf.add(rows(1, 6))).tolist() == [2.0 + eps]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_max_priority(backend):
    buf = make(backend, max_priority=0.25)
    assert float(buf.max_priority) == 0.25
    slots = buf.add(rows(4))
    assert buf.priorities(slots).tolist() == [0.25] * 4
    buf.update_priorities([0], [10.0])
    assert buf.max_priority_ever == pytest.approx(10.0 + 1e-6, rel=1e-15)
    assert buf.priorities(buf.add(rows(2, 4))).tolist() == [0.25] * 2
    assert float(buf.max_priority) == 0.25


def test_max_priority_current_and_bad_policies_are_refused():
    with pytest.raises(ValueError, match="current"):
        fd.DevicePrioritizedReplayBuffer(8, FIELDS, max_priority="current")
    with pytest.raises(ValueError, match="max_priority"):
        fd.DevicePrioritizedReplayBuffer(8, FIELDS, max_priority="largest")
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="max_priority"):
            fd.DevicePrioritizedReplayBuffer(8, FIELDS, max_priority=bad)


# ---------------------------------------------------------------------------
# duplicates and stale keys
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_indices_the_last_one_wins(backend):
    eps = 1e-6
    buf = make(backend, capacity=8, eps=eps)
    cpu = fastper.PrioritizedReplayBuffer(8, FIELDS, eps=eps, seed=0)
    for b in (buf, cpu):
        b.add(rows(8))
        b.add(rows(4, 8))  # slots 0..3 now hold keys 8..11
    idx, td = [3, 5, 3, 3, 5, 6], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    applied = buf.update_priorities(torch.tensor(idx), torch.tensor(td))
    assert int(applied) == cpu.update_priorities(idx, td) == 6
    assert buf.priorities([3, 5, 6]).tolist() == [4.0 + eps, 5.0 + eps, 6.0 + eps]
    # with keys: the last duplicate is stale (key 3 was overwritten by key 11), so the
    # last *fresh* one wins, as if the entries were applied one by one
    idx, td, keys = [3, 3, 3, 1], [7.0, 8.0, 9.0, 2.0], [11, 11, 3, 1]
    applied = buf.update_priorities(idx, td, keys=keys)
    assert int(applied) == cpu.update_priorities(idx, td, keys=keys) == 2
    assert buf.priorities([3, 1]).tolist() == [8.0 + eps, 1.0]
    assert buf.stale_updates == cpu.stale_updates == 2
    np.testing.assert_array_equal(buf.priorities(range(8)).numpy(), cpu.priorities(range(8)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_keys_are_dropped_after_the_slot_is_overwritten(backend):
    buf = make(backend, capacity=8, shuffle=False)
    buf.add(rows(8))
    batch = buf.sample(8)  # equal priorities, one draw per slice: every slot once
    assert batch.indices.tolist() == list(range(8)) and batch.keys.tolist() == list(range(8))
    buf.update_priorities([4], [6.0])  # max ever 6 + eps: the new occupants get it
    buf.add(rows(3, 8))  # overwrites slots 0, 1, 2
    new_p = buf.priorities([0, 1, 2]).clone()
    assert new_p.tolist() == [6.0 + 1e-6] * 3
    applied = buf.update_priorities(batch.indices, torch.full((8,), 0.5), keys=batch.keys)
    assert applied.ndim == 0 and applied.dtype == torch.int64 and int(applied) == 5
    assert buf.stale_updates == 3
    assert torch.equal(buf.priorities([0, 1, 2]), new_p)  # the new occupants keep theirs
    assert buf.priorities(range(3, 8)).tolist() == [0.5 + 1e-6] * 5
    # fresh keys of the new occupants apply
    assert int(buf.update_priorities([0], [2.0], keys=buf.keys([0]))) == 1
    assert buf.priorities([0]).tolist() == [2.0 + 1e-6] and buf.stale_updates == 3


# ---------------------------------------------------------------------------
# bad input: refused with a message, and the buffer is left exactly as it was
# ---------------------------------------------------------------------------


def _prepared(backend: str, **kw):
    """16 slots, 12 written (12..15 never), priorities updated, one sample drawn."""
    buf = make(backend, capacity=16, alpha=0.7, **kw)
    buf.add(rows(10))
    s = buf.sample(6)
    buf.update_priorities(s.indices, torch.arange(1.0, 7.0, dtype=F64), keys=s.keys)
    buf.add(rows(2, 10), priorities=[0.5, 3.0])
    return buf


def _upd(idx, td, keys=None):
    return lambda b: b.update_priorities(idx, td, keys=keys)


def _add(data, priorities=None, env_ids=None):
    return lambda b: b.add(data, priorities=priorities, env_ids=env_ids)


def _one(obs=(0.0, 0.0, 0.0), id_=1):
    return {"obs": np.asarray(obs, dtype=np.float64), "id": id_}


_T_OBS, _T_ID = torch.zeros(2, 3), torch.tensor([1, 2])
InvalidIndexError, FieldTypeError = fastper.InvalidIndexError, fastper.FieldTypeError

BAD_CALLS = {
    # update_priorities
    "index out of range": (InvalidIndexError, r"indices.*\[0, 16\)", _upd([1, 16], [1.0, 1.0])),
    "negative index": (InvalidIndexError, r"indices.*-1", _upd([-1], [1.0])),
    "never-written index": (InvalidIndexError, r"written.*13", _upd([2, 13], [1.0, 2.0])),
    "nan td": (ValueError, r"td_errors.*finite", _upd([1, 2], [1.0, math.nan])),
    "inf td": (ValueError, r"td_errors.*finite", _upd([1], [-math.inf])),
    "td too large": (ValueError, r"td_errors.*<=", _upd([1, 2], [1.0, 1e308])),
    "key never issued": (ValueError, r"keys.*issued.*12", _upd([1, 2], [1.0, 1.0], keys=[1, 12])),
    "negative key": (ValueError, r"keys.*issued", _upd([1], [1.0], keys=[-1])),
    "td length mismatch": (ValueError, r"td_errors.*2 entries", _upd([1, 2], [1.0])),
    "keys length mismatch": (ValueError, r"keys.*2 entries", _upd([1, 2], [1.0, 1.0], keys=[1])),
    "2-D indices": (ValueError, r"indices.*1-D", _upd([[1, 2]], [[1.0, 2.0]])),
    "2-D td": (ValueError, r"td_errors.*1-D", _upd([1, 2], [[1.0, 2.0]])),
    "text td": (TypeError, r"td_errors", _upd([1], ["a"])),
    "bool td tensor": (TypeError, r"td_errors", _upd(torch.tensor([3]), torch.tensor([True]))),
    # add
    "negative priority at add": (ValueError, r"priorities.*-1", _add(rows(2, 12), [1.0, -1.0])),
    "nan priority at add": (ValueError, r"priorities.*finite", _add(rows(2, 12), [math.nan, 1.0])),
    "priority too large at add": (ValueError, r"priorities.*<=", _add(rows(1, 12), [1e308])),
    "priority count at add": (ValueError, r"priorities.*2 entries", _add(rows(2, 12), [1.0])),
    "2-D priorities at add": (ValueError, r"priorities", _add(rows(2, 12), [[1.0], [2.0]])),
    "2-D tensor priorities at add": (
        ValueError,
        r"priorities",
        _add(trows(2, 12), torch.ones(2, 1, dtype=F64)),
    ),
    "tensor priorities at add": (
        ValueError,
        r"priorities",
        _add(trows(2, 12), torch.tensor([1.0, -math.inf], dtype=F64)),
    ),
    "missing field": (ValueError, r"missing fields \['id'\]", _add({"obs": np.zeros(3)})),
    "unknown field": (ValueError, r"unknown fields \['z'\]", _add({**_one(), "z": 1})),
    "wrong shape": (ValueError, r"obs.*shape", _add(_one(obs=(0.0, 0.0)))),
    "batch lengths differ": (
        ValueError,
        r"one length.*obs: 2, id: 3",
        _add({"obs": np.zeros((2, 3)), "id": [1, 2, 3]}),
    ),
    "non-integral float into int field": (FieldTypeError, r"id", _add(_one(id_=1.5))),
    "float64 overflowing float32": (FieldTypeError, r"obs", _add(_one(obs=(1e300, 0, 0)))),
    "text into float field": (
        FieldTypeError,
        r"obs.*numbers",
        _add({"obs": ["a", "b", "c"], "id": 1}),
    ),
    "empty batch": (
        ValueError,
        r"must not be empty",
        _add({"obs": np.zeros((0, 3)), "id": np.zeros(0)}),
    ),
    "batch larger than capacity": (ValueError, r"capacity", _add(rows(17, 12))),
    "bad env_ids": (ValueError, r"env_ids", _add(rows(2, 12), env_ids=[0])),
    "tensor missing field": (ValueError, r"missing fields \['id'\]", _add({"obs": torch.zeros(3)})),
    "tensor unknown field": (
        ValueError,
        r"unknown fields \['z'\]",
        _add({"obs": _T_OBS, "id": _T_ID, "z": _T_ID}),
    ),
    "tensor wrong shape": (
        ValueError,
        r"obs.*shape",
        _add({"obs": torch.zeros(2, 4), "id": _T_ID}),
    ),
    "tensor float into int field": (
        FieldTypeError,
        r"id.*float",
        _add({"obs": _T_OBS, "id": torch.tensor([1.0, 2.0])}),
    ),
    "tensor batch lengths differ": (
        ValueError,
        r"one length",
        _add({"obs": _T_OBS, "id": torch.tensor([1, 2, 3])}),
    ),
    "tensor empty batch": (
        ValueError,
        r"empty",
        _add({"obs": torch.zeros(0, 3), "id": torch.zeros(0, dtype=torch.int64)}),
    ),
    # sample, schedules, reads
    "batch size 0": (ValueError, r"batch_size", lambda b: b.sample(0)),
    "negative beta": (ValueError, r"beta", lambda b: b.sample(4, beta=-0.5)),
    "negative alpha": (ValueError, r"alpha", lambda b: b.set_alpha(-0.1)),
    "negative beta schedule": (ValueError, r"beta", lambda b: b.set_beta(-1.0)),
    "read of a never-written slot": (InvalidIndexError, r"14", lambda b: b.priorities([0, 14])),
}


#: bad values in tensors: the numba back end (host memory) refuses them at once; the
#: torch back end checks them on the device, drops them and reports at the next check
#: (test_tensor_updates_are_checked_on_the_device_and_reported_once below)
DEFERRED = {
    "tensor index out of range": (
        InvalidIndexError, r"1 invalid entry.*1 with an index outside \[0, 12\)",
        torch.tensor([3, 20]), torch.tensor([1.0, 1.0]), None, 0,
    ),
    "tensor nan td": (
        ValueError, r"1 invalid entry.*td error that is not finite",
        torch.tensor([3, 4]), torch.tensor([math.nan, 2.0]), None, 1,
    ),
    "tensor key never issued": (
        ValueError, r"1 invalid entry.*1 with a key never issued",
        torch.tensor([3, 4]), torch.tensor([1.0, 2.0]), torch.tensor([99, 4]), 1,
    ),
}  # fmt: skip
for _case, (_err, _msg, _idx, _td, _keys, _) in DEFERRED.items():
    BAD_CALLS[f"numba: {_case}"] = (_err, r"indices|td_errors|keys", _upd(_idx, _td, _keys))


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_and_leaves_the_buffer_unchanged(backend, case):
    if case.startswith("numba: ") and backend == "torch":
        pytest.skip("the torch back end reports bad tensor values at the next check")
    error, message, call = BAD_CALLS[case]
    buf, twin = _prepared(backend), _prepared(backend)
    before = snapshot(buf)
    assert_same_state(before, snapshot(twin))
    with pytest.raises(error, match=message):
        call(buf)
    assert_same_state(snapshot(buf), before)
    # and it behaves as the twin that never saw the failed call
    a, b = buf.sample(8), twin.sample(8)
    assert_same_batch(a, b)
    td = torch.arange(8, dtype=F64) - 3.0
    assert int(buf.update_priorities(a.indices, td, keys=a.keys)) == int(
        twin.update_priorities(b.indices, td, keys=b.keys)
    )
    buf.add(rows(3, 12))
    twin.add(rows(3, 12))
    assert_same_batch(buf.sample(8), twin.sample(8))
    assert_same_state(snapshot(buf), snapshot(twin))


@pytest.mark.parametrize("case", list(DEFERRED))
def test_tensor_updates_are_checked_on_the_device_and_reported_once(case):
    error, message, idx, td, keys, good = DEFERRED[case]
    buf, twin = _prepared("torch"), _prepared("torch")
    with forbid_sync():  # checked on the device: no host sync, no exception yet
        applied = buf.update_priorities(idx, td, keys=keys)
    twin.update_priorities(idx[[good]], td[[good]], keys=None if keys is None else keys[[good]])
    assert int(applied) == 1
    with pytest.raises(error, match=message):
        buf.check()
    buf.check()  # reported once
    # the good entry applied, the bad one dropped: the tree is the twin's
    assert_same_state(buf._index.snapshot(12), twin._index.snapshot(12))
    assert buf.max_priority_ever == twin.max_priority_ever
    assert buf.invalid_updates == 1 and twin.invalid_updates == 0
    assert_same_batch(buf.sample(8), twin.sample(8))
    # any call that reads the device reports: a read of priorities, a state
    buf.update_priorities(idx, td, keys=keys)
    with pytest.raises(error, match=message):
        buf.priorities([0])
    buf.update_priorities(idx, td, keys=keys)
    with pytest.raises(error, match=message):
        buf.state_dict()
    # without validation bad entries are only counted
    quiet = _prepared("torch", validate=False)
    quiet.update_priorities(idx, td, keys=keys)
    quiet.check()
    assert quiet.invalid_updates == 1


def test_a_report_counts_every_reason_since_the_last_check():
    buf = _prepared("torch")
    idx = torch.tensor([3, 20, 4, 5, -1])
    td = torch.tensor([1.0, 1.0, math.inf, 1e308, 2.0], dtype=F64)
    keys = torch.tensor([3, 20, 4, 5, 1])
    buf.update_priorities(idx, td, keys=keys)
    buf.update_priorities(idx[:1], td[:1], keys=torch.tensor([-4]))
    with pytest.raises(InvalidIndexError) as info:
        buf.check()
    text = str(info.value)
    assert "5 invalid entries" in text
    assert "2 with an index outside [0, 12)" in text
    assert "2 with a td error that is not finite or gives a priority above" in text
    assert "2 with a key never issued" in text
    assert buf.invalid_updates == 5 and buf.stale_updates == 0


_INDEX_CALLS = {
    "update_priorities": lambda b, idx: b.update_priorities(idx, [2.0] * len(idx)),
    "priorities": lambda b, idx: b.priorities(idx),
    "probabilities": lambda b, idx: b.probabilities(idx),
    "keys": lambda b, idx: b.keys(idx),
}


@pytest.mark.parametrize("method", list(_INDEX_CALLS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_integer_indices_are_refused(backend, method):
    # the CPU buffer refuses float and bool indices (TypeError naming `indices`);
    # truncating 1.5 to slot 1 would act on a slot nobody named
    call = _INDEX_CALLS[method]
    cpu = fastper.PrioritizedReplayBuffer(16, FIELDS, seed=0)
    cpu.add(rows(10))
    with pytest.raises(TypeError, match="indices"):
        call(cpu, [1.5])
    buf = _prepared(backend)
    before = snapshot(buf)
    for bad in ([1.5], np.array([2.0]), torch.tensor([1.5]), [True]):
        with pytest.raises((TypeError, ValueError), match="indices"):
            call(buf, bad)
        assert_same_state(snapshot(buf), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_noisy_update_restores_the_random_state(backend):
    # with priority_noise the update draws normals first: a refused update must put
    # the generator back, so the next sample is the twin's
    buf, twin = _prepared(backend, priority_noise=0.3), _prepared(backend, priority_noise=0.3)
    before = snapshot(buf)
    with pytest.raises(fastper.InvalidIndexError):
        buf.update_priorities([1, 2, 14], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="td_errors|priority_noise"):
        buf.update_priorities([1, 2], [1.0, math.nan])
    assert_same_state(snapshot(buf), before)
    a, b = buf.sample(8), twin.sample(8)
    assert_same_batch(a, b)
    buf.update_priorities(a.indices, torch.ones(8), keys=a.keys)
    twin.update_priorities(b.indices, torch.ones(8), keys=b.keys)
    assert torch.equal(buf.priorities(range(12)), twin.priorities(range(12)))
    assert_same_batch(buf.sample(8), twin.sample(8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unvalidated_updates_drop_bad_entries_and_apply_the_rest(backend):
    eps = 1e-6
    buf = make(backend, capacity=16, validate=False, eps=eps)
    ref = make(backend, capacity=16, eps=eps)
    assert buf.validate is False and ref.validate is True
    for b in (buf, ref):
        b.add(rows(10))
    idx = torch.tensor([1, 16, 2, -1, 3, 12, 4, 5, 6, 2])
    td = torch.tensor([2.0, 3.0, math.nan, 1.0, math.inf, 1.0, 1e308, 7.0, 8.0, 9.0], dtype=F64)
    keys = torch.tensor([1, 16, 2, 0, 3, 12, 4, 5, 99, 2])
    applied = buf.update_priorities(idx, td, keys=keys)
    # good: (1, 2.0), (5, 7.0), (2, 9.0); bad: index 16, -1, 12, nan, inf, 1e308, key 99
    assert int(applied) == 3
    assert buf.invalid_updates == 7
    ref.update_priorities([1, 5, 2], [2.0, 7.0, 9.0])
    assert torch.equal(buf.priorities(range(10)), ref.priorities(range(10)))
    assert buf.max_priority_ever == ref.max_priority_ever == 9.0 + eps
    # a bad last duplicate is dropped: the earlier good entry of that slot wins
    buf.update_priorities([7, 7], [4.0, math.nan])
    assert buf.priorities([7]).tolist() == [4.0 + eps] and buf.invalid_updates == 8
    # bad explicit priorities of an add get the new-item priority instead, and count
    slots = buf.add(rows(3, 10), priorities=[math.nan, 2.0, -1.0])
    assert buf.priorities(slots).tolist() == [9.0 + eps, 2.0, 9.0 + eps]
    assert buf.invalid_updates == 10
    # the tree never saw a NaN: P(i) are finite, sum to 1, and match p^alpha / sum
    p = buf.priorities(range(13)).numpy()
    assert np.isfinite(p).all()
    probs = buf.probabilities(range(13)).numpy()
    np.testing.assert_allclose(probs, proportional_probs(p, buf.alpha), rtol=1e-12)
    batch = buf.sample(64)
    assert torch.isfinite(batch.weights).all() and torch.isfinite(batch.probabilities).all()
    assert int(batch.indices.max()) < 13


# ---------------------------------------------------------------------------
# zero priorities
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_never_returns_zero_priority_or_unwritten_slots(backend, stratified):
    rng = np.random.default_rng(2)
    n = 40
    p = rng.uniform(1e-3, 10.0, n)
    p[::3] = 0.0
    p[-6:] = 0.0  # trailing zeros: the last slice's targets end at the total
    buf = make(backend, capacity=64, eps=0.0, stratified=stratified)
    buf.add(rows(n), priorities=p)
    zero = torch.from_numpy(p == 0.0)
    assert buf.probabilities(torch.arange(n))[zero].eq(0).all()
    for _ in range(100):
        idx = buf.sample(128).indices
        assert int(idx.min()) >= 0 and int(idx.max()) < n
        assert not zero[idx].any()
    # priorities updated to zero (td 0, eps 0) are skipped too
    live = np.flatnonzero(p > 0)
    buf.update_priorities(live[:5], np.zeros(5))
    zero[live[:5]] = True
    for _ in range(50):
        assert not zero[buf.sample(128).indices].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_zero_priorities_raise_and_change_nothing(backend):
    buf = make(backend, eps=0.0)
    with pytest.raises(fastper.EmptyBufferError):
        buf.sample(4)
    buf.add(rows(5), priorities=np.zeros(5))
    before = snapshot(buf)
    with pytest.raises(fastper.ZeroPriorityError, match="zero"):
        buf.sample(4)
    assert_same_state(snapshot(buf), before)
    assert buf.step == 0
    buf.update_priorities([3], [2.0])
    assert buf.sample(16).indices.tolist() == [3] * 16
    buf.update_priorities([3], [0.0])  # all zero again, by an update
    with pytest.raises(fastper.ZeroPriorityError):
        buf.sample(4)
    assert buf.step == 1


# ---------------------------------------------------------------------------
# alpha and beta
# ---------------------------------------------------------------------------


P_WIDE = np.geomspace(1e-3, 1e3, 12)[[5, 0, 11, 3, 8, 1, 10, 6, 2, 9, 4, 7]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_alpha_reweighs_every_priority_exactly(backend):
    buf = make(backend, alpha=0.6, beta=0.0)
    buf.add(rows(12), priorities=P_WIDE)
    every = torch.arange(12)
    for alpha in (0.6, 0.0, 0.3, 1.0, 0.45):
        buf.set_alpha(alpha)
        assert buf.alpha == alpha
        expected = proportional_probs(P_WIDE, alpha)
        np.testing.assert_allclose(buf.probabilities(every).numpy(), expected, rtol=1e-12)
        batch = buf.sample(32)
        got = batch.probabilities.numpy()
        np.testing.assert_allclose(got, expected[batch.indices.numpy()], rtol=1e-12)
        # the raw priorities are untouched
        assert buf.priorities(every).numpy().tolist() == P_WIDE.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_schedule_is_applied_at_sample_steps(backend):
    schedule = fastper.schedules.linear(0.2, 1.0, 8)
    buf = make(backend, alpha=schedule, alpha_every=2)
    buf.add(rows(12), priorities=P_WIDE)
    assert buf.alpha == 0.2
    for step in range(12):
        assert buf.step == step
        batch = buf.sample(16)
        alpha = schedule(step - step % 2)
        assert buf.alpha == alpha
        expected = proportional_probs(P_WIDE, alpha)
        np.testing.assert_allclose(
            batch.probabilities.numpy(), expected[batch.indices.numpy()], rtol=1e-12
        )
        np.testing.assert_allclose(buf.probabilities(range(12)).numpy(), expected, rtol=1e-12)
    assert buf.alpha == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_beta_schedule_advances_with_the_step(backend):
    schedule = fastper.schedules.linear(0.0, 1.0, 4)
    buf = make(backend, alpha=1.0, beta=schedule, weight_norm="none")
    buf.add(rows(12), priorities=P_WIDE)
    probs = proportional_probs(P_WIDE, 1.0)
    for step in range(7):
        assert buf.step == step and buf.beta == schedule(step)
        batch = buf.sample(16)
        expected = (12 * probs[batch.indices.numpy()]) ** -schedule(step)
        np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-6)
    # an explicit beta overrides the schedule for one call; set_beta replaces it
    batch = buf.sample(16, beta=0.5)
    np.testing.assert_allclose(
        batch.weights.numpy(), (12 * probs[batch.indices.numpy()]) ** -0.5, rtol=1e-6
    )
    buf.set_beta(0.25)
    assert buf.beta == 0.25 and buf.step == 8
    batch = buf.sample(16)
    np.testing.assert_allclose(
        batch.weights.numpy(), (12 * probs[batch.indices.numpy()]) ** -0.25, rtol=1e-6
    )


# ---------------------------------------------------------------------------
# n-step
# ---------------------------------------------------------------------------

NSTEP_FIELDS = {
    "obs": ((2,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((2,), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}


def _steps(rng, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.normal(size=(k, 2)).astype(np.float32),
        "action": rng.integers(0, 4, k),
        "reward": rng.normal(size=k).astype(np.float32),
        "next_obs": rng.normal(size=(k, 2)).astype(np.float32),
        "terminated": rng.random(k) < 0.1,
        "truncated": rng.random(k) < 0.05,
    }


def _assert_same_rows(cpu, dev) -> None:
    n = len(cpu)
    assert len(dev) == n and dev.total_added == cpu.total_added
    assert dev.n_pending == cpu.n_pending and dev.n_dropped == cpu.n_dropped
    assert list(dev.storage.columns) == list(cpu.storage.columns)
    assert "discount" in dev.storage.columns
    for name, col in cpu.storage.columns.items():
        got = dev.storage.columns[name][:n].numpy()
        assert got.dtype == col.dtype, name
        np.testing.assert_array_equal(got, col[:n], err_msg=name)


@pytest.mark.parametrize("as_tensors", [False, True], ids=["host", "tensors"])
@pytest.mark.parametrize("mode", ["n_envs", "env_ids"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_n_step_rows_equal_the_cpu_buffer(backend, mode, as_tensors):
    rng = np.random.default_rng(4)
    kw = dict(n_step=3, gamma=0.9, seed=0)
    if mode == "n_envs":
        kw["n_envs"] = 2
    cpu = fastper.PrioritizedReplayBuffer(20, NSTEP_FIELDS, **kw)
    dev = fd.DevicePrioritizedReplayBuffer(20, NSTEP_FIELDS, backend=backend, **kw)
    for t in range(60):
        if mode == "n_envs":
            data, ids = _steps(rng, 2), None
        elif t % 5 == 4:
            data, ids = {k: v[0] for k, v in _steps(rng, 1).items()}, 5  # one row, no batch dim
        else:
            data, ids = _steps(rng, 2), ([5, 9] if t % 2 else [9, 5])
        given = {k: torch.as_tensor(v) for k, v in data.items()} if as_tensors else data
        dev_ids = torch.as_tensor(ids) if as_tensors and ids is not None else ids
        s_cpu = cpu.add(data, env_ids=ids)
        s_dev = dev.add(given, env_ids=dev_ids)
        np.testing.assert_array_equal(s_dev.numpy(), s_cpu)
    assert cpu.total_added > 20  # the ring wrapped
    _assert_same_rows(cpu, dev)
    assert dev.fields == cpu.fields
    with pytest.raises(ValueError, match="priorities"):
        dev.add(_steps(rng, 2), priorities=[1.0, 1.0], env_ids=[5, 9])
    _assert_same_rows(cpu, dev)


# ---------------------------------------------------------------------------
# uniform, clear, input forms
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_buffer_has_unit_weights_and_keeps_priorities(backend):
    buf = fd.DeviceReplayBuffer(10, FIELDS, backend=backend, seed=0)
    assert buf.alpha == 1.0 and buf.beta == 0.0
    buf.add(rows(7))
    for stratified_batch in (5, 50):
        batch = buf.sample(stratified_batch)
        assert batch.weights.dtype == torch.float32
        assert torch.equal(batch.weights, torch.ones(stratified_batch))
        assert torch.equal(batch.probabilities, torch.full((stratified_batch,), 1 / 7, dtype=F64))
        assert int(batch.indices.min()) >= 0 and int(batch.indices.max()) < 7
        assert torch.equal(batch["id"], batch.indices)
    assert int(buf.update_priorities([1, 2, 1], [3.0, -4.0, 5.0])) == 3
    assert buf.priorities([1, 2]).tolist() == [5.0 + 1e-6, 4.0 + 1e-6]
    assert buf.probabilities([1, 2, 3]).tolist() == [1 / 7] * 3
    assert buf.max_priority_ever == 5.0 + 1e-6
    assert buf.priorities(buf.add(rows(1, 7))).tolist() == [5.0 + 1e-6]
    batch = buf.sample(40, beta=1.0)
    assert torch.equal(batch.weights, torch.ones(40))
    assert torch.equal(batch.probabilities, torch.full((40,), 1 / 8, dtype=F64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clear_keeps_old_keys_stale_and_the_max_priority(backend):
    buf = make(backend, capacity=4)
    buf.add(rows(4))
    batch = buf.sample(4)
    buf.update_priorities([0], [5.0])
    step = buf.step
    buf.clear()
    assert len(buf) == 0 and buf.total_added == 4 and buf.step == step
    assert buf.max_priority_ever == 5.0 + 1e-6
    with pytest.raises(fastper.EmptyBufferError):
        buf.sample(1)
    slots = buf.add(rows(4, 4))
    assert slots.tolist() == [0, 1, 2, 3]
    assert buf.keys(slots).tolist() == [4, 5, 6, 7]
    assert buf.priorities(slots).tolist() == [5.0 + 1e-6] * 4
    assert int(buf.update_priorities(batch.indices, torch.ones(4), keys=batch.keys)) == 0
    assert buf.stale_updates == 4
    assert buf.priorities(slots).tolist() == [5.0 + 1e-6] * 4
    new = buf.sample(4)
    assert torch.equal(new["id"], new.keys) and int(new.keys.min()) >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_list_and_numpy_adds_store_the_same_rows(backend):
    fields = {"obs": ((2,), np.float32), "action": ((), np.int32), "done": ((), np.bool_)}
    obs64 = np.array([[0.1, 1e-8], [3.3, -2.5], [1 / 3, 7.0]])
    action = np.array([1, -2, 3])
    done = np.array([False, True, False])
    bufs = [fd.DevicePrioritizedReplayBuffer(8, fields, backend=backend) for _ in range(3)]
    bufs[0].add({"obs": obs64.astype(np.float32), "action": action.astype(np.int32), "done": done})
    bufs[1].add({"obs": obs64.tolist(), "action": action.tolist(), "done": done.tolist()})
    # float64 and int64 tensors into float32 / int32 fields: accepted, cast by value
    bufs[2].add(
        {
            "obs": torch.from_numpy(obs64),
            "action": torch.from_numpy(action),
            "done": torch.tensor(done),
        }
    )
    for b in bufs:
        assert b.storage.columns["done"].dtype == torch.bool
        assert b.storage.columns["action"].dtype == torch.int32
        np.testing.assert_array_equal(
            b.storage.columns["obs"][:3].numpy(), obs64.astype(np.float32)
        )
        np.testing.assert_array_equal(b.storage.columns["action"][:3].numpy(), action)
        np.testing.assert_array_equal(b.storage.columns["done"][:3].numpy(), done)
    # a single transition, no batch dimension, as host values and as tensors
    host = bufs[0].add({"obs": [9.5, -9.5], "action": 4, "done": True})
    dev = bufs[2].add(
        {"obs": torch.tensor([9.5, -9.5]), "action": torch.tensor(4), "done": torch.tensor(True)}
    )
    assert host.tolist() == dev.tolist() == [3]
    for b in (bufs[0], bufs[2]):
        assert b.storage.columns["obs"][3].tolist() == [9.5, -9.5]
        assert b.storage.columns["action"][3].item() == 4
        assert b.storage.columns["done"][3].item() is True
    batch = bufs[2].sample(16)
    assert batch["done"].dtype == torch.bool
    assert torch.equal(batch["done"], bufs[2].storage.columns["done"][batch.indices])
