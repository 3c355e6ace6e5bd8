"""The batched tree kernels against their references, bit for bit.

* Path recomputation after a batch of writes (item by item on the big
  levels, whole levels on the small ones) leaves every internal node exactly
  as a rebuild from the leaves does, for sum, zero-skipping min and max trees,
  with duplicates, sorted, contiguous and random batches, and batches larger
  than whole levels.
* The proportional sampler's fused draw finds the leaves the tree's search
  finds, and its permuted form equals the plain form indexed by the
  permutation.
* A shuffling buffer draws the permutation ``rng.permutation(B)`` would give.
* Slot keys from one division per batch equal the per-slot formula.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer
from fastper._kernels import ring as _ring
from fastper._kernels import tree as _tk
from fastper.policy import stratified_targets
from fastper.sampler_base import PriorityMax, new_priorities
from fastper.samplers import ProportionalSampler
from fastper.trees import MinTree, SumTree

SEED = 20261202
# 8, 64, 512: one, two, three full levels; 9, 65, 513: a partial line above each
CAPACITIES = [1, 5, 8, 9, 64, 65, 512, 513, 4099, 40_000]


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def batches(rng: np.random.Generator, capacity: int) -> list[np.ndarray]:
    """Batches of every shape the kernels special-case."""
    out = [
        np.empty(0, dtype=np.int64),
        rng.integers(0, capacity, 1),
        rng.integers(0, capacity, 37),
        np.sort(rng.integers(0, capacity, 300)),
        rng.integers(0, capacity, 3000),  # more items than the lower levels have nodes
        np.arange(min(capacity, 700), dtype=np.int64),  # contiguous: runs of equal parents
        np.repeat(rng.integers(0, capacity, 20), 5),  # duplicates next to each other
    ]
    return [b.astype(np.int64) for b in out]


def values(rng: np.random.Generator, n: int) -> np.ndarray:
    v = 10.0 ** rng.uniform(-5.0, 5.0, n)
    v[rng.random(n) < 0.2] = 0.0
    return v


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_sampler_writes_leave_the_trees_a_rebuild_makes(capacity: int) -> None:
    rng = np.random.default_rng(SEED + capacity)
    s = ProportionalSampler(capacity, 0.6)
    s.write(np.arange(capacity, dtype=np.int64), values(rng, capacity))
    for idx in batches(rng, capacity):
        s.write(idx, values(rng, idx.shape[0]))
        ref = ProportionalSampler(capacity, 0.6)
        ref.raw[:] = s.raw
        ref.set_alpha(0.6, capacity)  # leaves and both trees from the raw priorities
        for name in ("leaves", "sinner", "minner"):
            assert bits(getattr(s, name)) == bits(getattr(ref, name)), (name, idx.shape[0])


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_tree_set_matches_rebuild_for_sum_min_and_max(capacity: int) -> None:
    rng = np.random.default_rng(SEED - capacity)
    trees = [SumTree(capacity, track_min=True), MinTree(capacity)]
    raw = new_priorities(capacity)
    pmax = PriorityMax(raw)
    for idx in batches(rng, capacity):
        vals = values(rng, idx.shape[0]) + (0.0 if idx.shape[0] % 2 else 0.5)
        for tree in trees:
            tree.set(idx, vals)
        for k in range(idx.shape[0]):  # last duplicate wins
            raw[idx[k]] = vals[k]
        pmax.fix(idx)
        for tree in trees:
            before = tree.state()
            min_before = tree.min_positive if isinstance(tree, SumTree) else None
            tree.rebuild()
            assert bits(tree.state()) == bits(before)
            if min_before is not None:
                assert tree.min_positive == min_before
        inner = pmax.inner.copy()
        pmax.rebuild()
        assert bits(pmax.inner) == bits(inner)


@pytest.mark.parametrize("capacity", [1, 9, 513, 40_000])
@pytest.mark.parametrize("stratified", [True, False])
def test_fused_draw_finds_what_the_tree_search_finds(capacity: int, stratified: bool) -> None:
    rng = np.random.default_rng(SEED)
    s = ProportionalSampler(capacity, 1.0)
    leaves = values(rng, capacity)
    leaves[-1] = 1.0  # a positive total, and zeros around it
    s.write(np.arange(capacity, dtype=np.int64), leaves)
    total = s.total
    for b in (1, 7, 256):
        u = rng.random(b)
        u[-1] = np.nextafter(1.0, 0.0)  # the last point a few ulps under the total
        idx, prob, w, keys = s.sample(u, capacity, 0.5, stratified, 2, 0, capacity)
        positions = np.arange(b, dtype=np.float64) if stratified else None
        want = np.empty(b, dtype=np.int64)
        targets = stratified_targets(u, total, positions)
        _tk.sum_find(s.leaves, s.sinner, s.offs, s.depth, targets, want)
        np.testing.assert_array_equal(idx, want)
        assert (s.leaves[idx] > 0.0).all()
        np.testing.assert_array_equal(prob, s.leaves[idx] / total)


@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("norm", [0, 1, 2])
def test_permuted_draw_equals_the_draw_indexed_by_the_permutation(
    stratified: bool, norm: int
) -> None:
    rng = np.random.default_rng(SEED)
    capacity = 5000
    s = ProportionalSampler(capacity, 0.7)
    s.write(np.arange(capacity, dtype=np.int64), values(rng, capacity) + 1e-3)
    for b in (2, 3, 256):
        u = rng.random(b)
        perm = rng.permutation(b)
        plain = s.sample(u, capacity, 0.4, stratified, norm, 11, 3 * capacity + 5)
        permuted = s.sample_permuted(u, perm, capacity, 0.4, stratified, norm, 11, 3 * capacity + 5)
        for a, p in zip(plain, permuted, strict=True):
            assert bits(a[perm]) == bits(p)


def test_shuffled_batch_is_the_stratum_order_batch_permuted_by_the_generator() -> None:
    fields = {"x": ((), np.float32)}
    bufs = [
        PrioritizedReplayBuffer(1000, fields, seed=3, shuffle=shuffle) for shuffle in (True, False)
    ]
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal(1000).astype(np.float32)
    p = np.abs(rng.standard_normal(1000)) + 0.01
    for buf in bufs:
        buf.add({"x": x})
        buf.update_priorities(np.arange(1000), p)
    shuffled, ordered = (buf.sample(64) for buf in bufs)
    gen = np.random.Generator(np.random.PCG64(3))
    gen.random(64)
    perm = gen.permutation(64)
    for name in ("indices", "probabilities", "weights", "keys"):
        assert bits(getattr(shuffled, name)) == bits(getattr(ordered, name)[perm]), name
    assert bits(shuffled.data["x"]) == bits(ordered.data["x"][perm])
    # the next draw starts where permutation() left the generator
    nxt = bufs[0].sample(64)
    u = gen.random(64)
    perm = gen.permutation(64)
    t = stratified_targets(u, bufs[0]._sampler.total, np.arange(64, dtype=np.float64))
    want = np.empty(64, dtype=np.int64)
    s = bufs[0]._sampler
    _tk.sum_find(s.leaves, s.sinner, s.offs, s.depth, t, want)
    np.testing.assert_array_equal(nxt.indices, want[perm])


@pytest.mark.parametrize("capacity", [1, 2, 7, 8, 1000, 2**20])
def test_slot_keys_equal_the_per_slot_formula(capacity: int) -> None:
    rng = np.random.default_rng(SEED)
    for added in (0, 1, capacity - 1, capacity, capacity + 1, 3 * capacity + 5, 10**12 + 7):
        for key_base in sorted({0, 5, added}):
            if key_base > added:
                continue
            slots = rng.integers(0, capacity, 300)
            slots[:2] = (0, capacity - 1)
            out = np.empty(300, dtype=np.int64)
            _ring.slot_keys(slots, key_base, added, capacity, out)
            since = added - key_base
            want = key_base + slots + capacity * ((since - 1 - slots) // capacity)
            np.testing.assert_array_equal(out, want)
