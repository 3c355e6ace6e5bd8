"""The torch index's fused draw and update against the guarded path and the numba back end.

When every stored priority is known positive, ``TorchIndex.draw`` searches
the blocks without the zero-leaf guards and reads slot, mass and key with one
gather; ``update`` summarises blocks without masking zeros. While the last
block of 64 slots is partly written, both tell its empty slots by their key
(-1). These tests pin that path to the guarded one and to the CPU kernels, on
sums that are exact (integer masses), so that every target, boundaries
included, must give the same slot.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastper.device as fd  # noqa: E402
from fastper import InvalidIndexError  # noqa: E402

FIELDS = {"obs": ((3,), np.float32), "id": ((), np.int64)}
F64 = torch.float64


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + k, dtype=np.int64)
    return {"obs": np.stack([ids, -ids, ids], axis=1).astype(np.float32), "id": ids}


def _same(a, b, what: str = "") -> None:
    for name in ("indices", "keys", "weights", "probabilities"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name} {what}"
    assert torch.equal(a.data["id"], b.data["id"]), what


@pytest.mark.parametrize("capacity", [256, 200])
@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_the_fused_path_draws_what_the_numba_kernels_draw_over_a_long_run(
    stratified, norm, capacity
):
    # alpha = 1, eps = 1 and integer td errors: masses and sums are exact integers,
    # every stored priority is >= 1 (the fused path); 256 slots are four whole blocks,
    # of 200 the last block (8 slots) is partly written for good
    kw = dict(alpha=1.0, beta=0.6, eps=1.0, stratified=stratified, weight_norm=norm, seed=5)
    torch_buf = fd.DevicePrioritizedReplayBuffer(capacity, FIELDS, backend="torch", **kw)
    numba_buf = fd.DevicePrioritizedReplayBuffer(capacity, FIELDS, backend="numba", **kw)
    bufs = (torch_buf, numba_buf)
    rng = np.random.default_rng(11)
    added, whole = 0, 0
    for it in range(120):
        k = int(rng.integers(1, 60))
        pri = rng.integers(1, 30, k).astype(np.float64) if it % 4 == 0 else None
        for b in bufs:
            b.add(rows(k, added), priorities=pri)
        added += k
        size = int(rng.choice([64, 128, 256, int(rng.integers(1, 300))]))  # 2^k or not
        whole += len(torch_buf) % 64 == 0  # steps with whole blocks only
        a, b = (buf.sample(size) for buf in bufs)
        _same(a, b, f"step {it}")
        td = torch.from_numpy(rng.integers(-25, 26, size).astype(np.float64))
        td[::9] = td[0]
        idx = a.indices.clone()
        idx[1::7] = idx[0]  # duplicates: the last one wins
        counts = [buf.update_priorities(idx, td, keys=a.keys) for buf in bufs]
        assert int(counts[0]) == int(counts[1])
    assert torch_buf._index.positive  # the fused path ran every step
    # both states ran: whole blocks in most steps at 256, a partly written block at 200
    assert whole > 60 if capacity == 256 else whole == 0
    every = torch.arange(capacity)
    assert torch.equal(torch_buf.priorities(every), numba_buf.priorities(every))
    assert torch_buf.max_priority_ever == numba_buf.max_priority_ever
    assert torch_buf.stale_updates == numba_buf.stale_updates > 0
    _same(torch_buf.sample(256), numba_buf.sample(256))
    # the block summaries the updates left are those of the stored masses, the empty
    # slots of a partly written last block not counted as its smallest
    blocks = torch_buf._index.tree.blocks.clone()
    torch_buf._index.tree.rebuild(capacity)
    assert torch.equal(blocks, torch_buf._index.tree.blocks)


@pytest.mark.parametrize("n", [1024, 1000, 65, 37])  # whole blocks, or a partly written last
@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
def test_the_fused_and_the_guarded_draw_agree_on_every_target(norm, n):
    buf = fd.DevicePrioritizedReplayBuffer(
        1024, FIELDS, backend="torch", alpha=1.0, weight_norm=norm, seed=1
    )
    rng = np.random.default_rng(3)
    buf.add(rows(n), priorities=rng.integers(1, 9, n).astype(np.float64))
    index = buf._index
    assert len(buf) == n
    for b in (256, 100):
        for u in (
            torch.zeros(b, dtype=F64),  # targets on block and leaf boundaries
            torch.full((b,), 1.0 - 2.0**-53, dtype=F64),  # the last target at the total
            torch.rand(b, dtype=F64, generator=torch.Generator().manual_seed(b)),
        ):
            for stratified in (True, False):
                perm = torch.randperm(b, generator=torch.Generator().manual_seed(7))
                index.positive = True
                fused = index.draw(u, n, 0.5, stratified, norm, 0, n, perm)
                index.positive = False
                guarded = index.draw(u, n, 0.5, stratified, norm, 0, n, perm)
                for x, y in zip(fused, guarded, strict=True):
                    assert torch.equal(x, y)
                assert int(fused[0].max()) < n and bool((fused[1] > 0).all())
    index.positive = buf._positive()


def test_a_cleared_buffer_refills_without_reading_old_slots() -> None:
    buf = fd.DevicePrioritizedReplayBuffer(4096, FIELDS, backend="torch", seed=2)
    buf.add(rows(4096), priorities=np.full(4096, 50.0))
    old = buf.sample(64)
    buf.clear()
    buf.add(rows(100, 5000), priorities=np.full(100, 0.5))
    for size in (64, 256):
        batch = buf.sample(size)
        assert int(batch.indices.max()) < 100
        assert torch.equal(batch.keys, batch.indices + 4096)
        assert torch.equal(batch.data["id"], batch.indices + 5000)
    assert torch.allclose(buf.probabilities(range(100)).sum(), torch.tensor(1.0, dtype=F64))
    # keys issued before the clear are stale for their slots now, or name empty slots
    applied = buf.update_priorities(old.indices, torch.ones(64), keys=old.keys)
    assert int(applied) == 0
    with pytest.raises(InvalidIndexError):  # slots >= 100 were never written since
        buf.check()


@pytest.mark.parametrize("clip", [None, 0.1])
def test_float32_td_errors_give_the_cpu_buffers_priorities(clip) -> None:
    """|td| + eps (and the clip) in float64 whatever the td dtype, as the CPU kernels."""
    td = torch.tensor([0.5, -0.05, 3.3, 1e-9], dtype=torch.float32)
    got = []
    for backend in ("torch", "numba"):
        buf = fd.DevicePrioritizedReplayBuffer(64, FIELDS, backend=backend, clip=clip, seed=0)
        buf.add(rows(64))
        buf.update_priorities([0, 1, 2, 3], td)
        got.append(buf.priorities([0, 1, 2, 3]))
    assert torch.equal(got[0], got[1])
    mag = np.abs(td.numpy().astype(np.float64))
    want = (mag if clip is None else np.minimum(mag, clip)) + 1e-6
    np.testing.assert_array_equal(got[0].numpy(), want)


def test_a_state_whose_key_counter_the_torch_index_cannot_tell_from_empty_is_refused() -> None:
    """Empty slots are told by their key's top byte (-1): a torch index takes key
    counters up to 2^55 (keys stay below 2^56 for 2^55 more adds); the numba back
    end takes any counter the writer does."""
    buf = fd.DevicePrioritizedReplayBuffer(100, FIELDS, backend="torch", seed=0)
    buf.add(rows(100))
    state = buf.state_dict()
    for shift, ok in ((2**55 - 100, True), (2**55 - 99, False), (2**60, False)):
        state["writer"] = {**state["writer"]}
        state["writer"]["key_base"] = shift
        state["writer"]["total_added"] = shift + 100
        if ok:
            back = fd.DevicePrioritizedReplayBuffer.from_state_dict(state, backend="torch")
            batch = back.sample(256)
            assert int(batch.keys.min()) >= shift and int(batch.indices.max()) < 100
        else:
            with pytest.raises(ValueError, match="total_added.*torch back end"):
                fd.DevicePrioritizedReplayBuffer.from_state_dict(state, backend="torch")
            back = fd.DevicePrioritizedReplayBuffer.from_state_dict(state, backend="numba")
            assert int(back.sample(8).keys.min()) >= shift
