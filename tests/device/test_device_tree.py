"""DeviceSumTree against the numba SumTree: same leaves, same picks, no drift, and a
fixed number of tensor operations at any capacity."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastper import SumTree  # noqa: E402
from fastper.device.tree import DeviceSumTree, K, num_blocks  # noqa: E402

from .op_count import count_ops  # noqa: E402

#: torch on one thread (tests/conftest.py): on small CPU tensors OpenMP threads that
#: spin while other processes share the cores made these tests ten times slower
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CAPACITIES = [1, 7, 63, 64, 65, 1000, 4096, 4097, 70_000]


def _pair(capacity: int, track_min: bool = True) -> tuple[SumTree, DeviceSumTree]:
    return SumTree(capacity, track_min=track_min), DeviceSumTree(capacity, track_min=track_min)


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_same_leaves_for_the_same_targets_as_the_numba_tree(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    cpu, dev = _pair(capacity)
    for _ in range(10):
        idx = rng.integers(0, capacity, size=int(rng.integers(1, 400)))
        vals = 10.0 ** rng.uniform(-12, 12, size=idx.shape[0])
        vals[rng.random(idx.shape[0]) < 0.2] = 0.0  # zero leaves are never picked
        cpu.set(idx, vals)
        dev.set(idx, vals)
    assert np.array_equal(cpu.leaves(), dev.leaves_copy().numpy())
    total = float(dev.total)
    assert total == pytest.approx(cpu.total, rel=1e-13)
    assert float(dev.min_positive) == cpu.min_positive
    if total == 0.0:
        return
    targets = rng.random(50_000) * min(total, cpu.total)
    got = dev.find(targets).numpy()
    assert np.array_equal(got, cpu.find(targets))
    assert (cpu.leaves()[got] > 0).all()


@pytest.mark.parametrize("capacity", [1, 9, 64, 65, 1000, 5000])
def test_exact_sums_agree_on_every_boundary(capacity: int) -> None:
    """Integer leaves: every sum is exact, so every integer target (boundaries included) agrees."""
    rng = np.random.default_rng(7)
    cpu, dev = _pair(capacity, track_min=False)
    vals = rng.integers(0, 4, size=capacity).astype(np.float64)
    vals[0] = 1.0
    cpu.set(np.arange(capacity), vals)
    dev.set(np.arange(capacity), vals)
    total = cpu.total
    assert float(dev.total) == total == vals.sum()
    targets = np.arange(0.0, total + 1.0)  # the last one is the total itself
    got = dev.find(targets).numpy()
    assert np.array_equal(got, cpu.find(targets))
    # smallest i with t < prefix(i), and the total gives the last positive leaf
    prefix = np.cumsum(vals)
    want = np.searchsorted(prefix, targets[:-1], side="right")
    assert np.array_equal(got[:-1], want)
    assert got[-1] == np.flatnonzero(vals)[-1]


def test_totals_stay_exact_after_a_million_updates_spanning_24_decades() -> None:
    capacity = 4096
    rng = np.random.default_rng(1)
    cpu, dev = _pair(capacity)
    for _ in range(1000):  # 10^6 writes
        idx = rng.integers(0, capacity, size=1000)
        vals = 10.0 ** rng.uniform(-12, 12, size=1000)
        cpu.set(idx, vals)
        dev.set(idx, vals)
    exact = math.fsum(dev.leaves_copy().tolist())
    assert abs(float(dev.total) - exact) <= 1e-12 * exact
    assert abs(float(dev.total) - cpu.total) <= 1e-12 * exact
    # a rebuilt tree is bit-identical to the updated one: nothing accumulated
    before = dev.blocks.clone()
    dev.rebuild()
    assert torch.equal(dev.blocks, before)


def test_batched_set_equals_the_same_writes_one_by_one() -> None:
    rng = np.random.default_rng(2)
    a, b = DeviceSumTree(3000, track_min=True), DeviceSumTree(3000, track_min=True)
    idx = rng.integers(0, 3000, size=500)
    idx[100:120] = idx[0]  # duplicates: the last one wins
    vals = rng.random(500)
    a.set(idx, vals)
    for i, v in zip(idx, vals, strict=True):
        b.set([i], [v])
    assert torch.equal(a.leaves, b.leaves) and torch.equal(a.blocks, b.blocks)
    assert torch.equal(a.min_positive, b.min_positive)
    assert float(a.get([idx[0]])[0]) == vals[119]


def test_target_at_the_total_never_lands_on_a_zero_leaf() -> None:
    tree = DeviceSumTree(200)
    vals = np.zeros(200)
    vals[[3, 70, 150]] = [0.1, 0.2, 0.3]
    tree.set(np.arange(200), vals)
    total = float(tree.total)
    got = tree.find([0.0, total, np.nextafter(total, 0.0), 0.1, 0.3 - 1e-17]).tolist()
    assert got[:3] == [3, 150, 150]
    assert all(vals[g] > 0 for g in got)


def test_padding_and_layout() -> None:
    for capacity in CAPACITIES:
        tree = DeviceSumTree(capacity)
        nb = num_blocks(capacity)
        assert nb * K >= capacity > (nb - 1) * K
        # the leaves hold one spare block past the real ones; it never enters a sum
        assert tree.leaves.shape == ((nb + 1) * K,) and tree.spare == nb * K
        assert tree.blocks.shape == (2, nb + 1)
    tree = DeviceSumTree(100, track_min=True)
    tree.leaves[tree.spare :] = 5.0  # whatever lands in the spare block
    tree.set([3, 99], [1.0, 2.0])
    assert float(tree.total) == 3.0 and float(tree.min_positive) == 1.0


def test_find_and_set_are_a_fixed_number_of_operations() -> None:
    """No loop over levels: the same operations at 2^12 and 2^20 leaves."""
    counts = []
    for capacity in (4096, 1 << 20):
        tree = DeviceSumTree(capacity, track_min=True)
        idx = torch.arange(0, capacity, capacity // 256)
        vals = torch.rand(idx.shape[0], dtype=torch.float64) + 0.5
        tree.write_unchecked(idx, vals)
        targets = torch.rand(256, dtype=torch.float64) * float(tree.total)
        with count_ops() as find_ops:
            tree.find_unchecked(targets)
        with count_ops() as write_ops:
            tree.write_unchecked(idx, vals)
        assert find_ops.count <= 14 and write_ops.count <= 9, (find_ops.ops, write_ops.ops)
        counts.append((find_ops.ops, write_ops.ops))
    assert counts[0] == counts[1]


def test_bad_input_raises_and_changes_nothing() -> None:
    tree = DeviceSumTree(100, track_min=True)
    tree.set(np.arange(10), np.arange(1.0, 11.0))
    before = [tree.leaves.clone(), tree.blocks.clone()]
    for idx, vals, exc, word in [
        ([1, 100], [1.0, 1.0], IndexError, "indices"),
        ([-1], [1.0], IndexError, "indices"),
        ([1], [-1.0], ValueError, ">= 0"),
        ([1], [math.nan], ValueError, "finite"),
        ([1], [math.inf], ValueError, "finite"),
        ([1], [1e308], ValueError, "<="),
        ([1, 2], [1.0], ValueError, "entries"),
        ([0.5], [1.0], ValueError, "integers"),
    ]:
        with pytest.raises(exc, match=word):
            tree.set(idx, vals)
    with pytest.raises(ValueError, match="total"):
        tree.find([float(tree.total) * 2])
    after = [tree.leaves, tree.blocks]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(ValueError, match="positive total"):
        DeviceSumTree(5).find([0.0])


def test_exact_pow_does_not_depend_on_the_batch() -> None:
    # torch's CPU pow gives an element computed in a SIMD vector and one left
    # over at the end of a run different last bits: a priority's mass must not
    # depend on the batch it was written in (a buffer loaded from a checkpoint
    # rebuilds every mass at once and must sample the same probabilities)
    from fastper.device.index import exact_pow

    torch.manual_seed(0)
    p = torch.rand(70_000, dtype=torch.float64) * 10  # past one block (32768)
    whole = exact_pow(p, 0.7)
    # the same values as plain pow, to the last bit or one unit of it
    assert torch.allclose(whole, p.pow(0.7), rtol=4e-16, atol=0.0)
    for lo, n in [(0, 1), (3, 7), (0, 23), (5, 31), (40, 64), (32_760, 20), (65_000, 5000)]:
        assert torch.equal(exact_pow(p[lo : lo + n], 0.7), whole[lo : lo + n]), (lo, n)
    for i in (0, 17, 32_767, 32_768, 69_999):
        assert torch.equal(exact_pow(p[i], 0.7), whole[i])  # 0-dim
    two = exact_pow(p[:64].reshape(8, 8), 0.7)
    assert torch.equal(two.reshape(-1), whole[:64])
