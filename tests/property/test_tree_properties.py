"""Property-based tests of SumTree / MinTree, plus a long-run drift test."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fastper.trees import MinTree, SumTree

SEED = 1234567
EPS = 2.0**-52

# values: exact zeros, "ordinary" floats, tiny and huge magnitudes, subnormals
VALUES = st.one_of(
    st.just(0.0),
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1e-12, max_value=1e-6),
    st.floats(min_value=1e6, max_value=1e12),
    st.floats(min_value=0.0, max_value=1e-300),
)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@st.composite
def update_batches(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray]:
    """A capacity and one batch of (index, value) pairs, often with duplicate indices."""
    capacity = draw(st.integers(min_value=1, max_value=70))
    # draw indices from a sub-range now and then so duplicates are common
    hi = draw(st.integers(min_value=0, max_value=capacity - 1))
    n = draw(st.integers(min_value=0, max_value=3 * capacity + 5))
    idx = draw(st.lists(st.integers(min_value=0, max_value=hi), min_size=n, max_size=n))
    vals = draw(st.lists(VALUES, min_size=n, max_size=n))
    return capacity, np.array(idx, dtype=np.int64), np.array(vals, dtype=np.float64)


@st.composite
def leaf_vectors(draw: st.DrawFn, min_size: int = 1, max_size: int = 70) -> np.ndarray:
    leaves = draw(st.lists(VALUES, min_size=min_size, max_size=max_size))
    return np.array(leaves, dtype=np.float64)


def depth(tree: SumTree | MinTree) -> int:
    return int(tree._depth)


# ---------------------------------------------------------------------------
# batched set == sequential set
# ---------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(update_batches(), st.data())
def test_batched_set_equals_sequential(batch: tuple, data: st.DataObject) -> None:
    capacity, idx, vals = batch
    for cls in (SumTree, MinTree):
        batched, one_by_one, chunked = cls(capacity), cls(capacity), cls(capacity)
        batched.set(idx, vals)
        for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
            one_by_one.set([i], [v])
        # the same pairs in arbitrary consecutive chunks
        cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(idx)), max_size=4)))
        for lo, hi in zip([0, *cuts], [*cuts, len(idx)], strict=True):
            chunked.set(idx[lo:hi], vals[lo:hi])
        assert bits_equal(batched.state(), one_by_one.state())
        assert bits_equal(batched.state(), chunked.state())
        # the last occurrence of each index is what the leaf holds
        expected = np.full(capacity, cls._fill)
        for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
            expected[i] = v
        assert bits_equal(batched.leaves(), expected)


# ---------------------------------------------------------------------------
# the tree is a pure function of its leaves
# ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(leaf_vectors(), st.randoms(use_true_random=False), st.lists(VALUES, max_size=30))
def test_tree_is_pure_function_of_leaves(leaves: np.ndarray, rnd, noise: list[float]) -> None:
    n = len(leaves)
    for cls in (SumTree, MinTree):
        # 1) in index order, in one batch
        a = cls(n)
        a.set(np.arange(n), leaves)
        # 2) in a random order, one at a time, after writing noise to random slots
        b = cls(n)
        noise_idx = [rnd.randrange(n) for _ in noise]
        b.set(noise_idx, noise)
        order = list(range(n))
        rnd.shuffle(order)
        for i in order:
            b.set(i, leaves[i])
        # 3) in another random order, as one batch with the noise interleaved first
        c = cls(n)
        rnd.shuffle(order)
        c.set(noise_idx + order, noise + [float(leaves[i]) for i in order])
        # 4) leaves written straight into the array, then rebuilt
        d = cls(n)
        d._leaves[:n] = leaves
        d.rebuild()
        assert bits_equal(a.state(), b.state())
        assert bits_equal(a.state(), c.state())
        assert bits_equal(a.state(), d.state())


# ---------------------------------------------------------------------------
# total, min, find against exact references
# ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(update_batches())
def test_total_matches_fsum(batch: tuple) -> None:
    capacity, idx, vals = batch
    tree = SumTree(capacity)
    tree.set(idx, vals)
    exact = math.fsum(tree.leaves())
    assert exact == tree.fsum()
    assert abs(tree.total - exact) <= 1e-12 * exact
    if exact == 0.0:
        assert tree.total == 0.0
    else:
        assert tree.total > 0.0


@settings(max_examples=150, deadline=None)
@given(update_batches())
def test_min_tree_min_is_min_of_written_leaves(batch: tuple) -> None:
    capacity, idx, vals = batch
    tree = MinTree(capacity)
    tree.set(idx, vals)
    written = {}
    for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
        written[i] = v
    expected = min(written.values()) if written else math.inf
    assert tree.min == expected
    unwritten = [i for i in range(capacity) if i not in written]
    assert np.all(tree.get(np.array(unwritten, dtype=np.int64)) == math.inf)


@settings(max_examples=150, deadline=None)
@given(
    leaf_vectors(),
    st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=20),
)
def test_find_lands_in_the_right_interval(leaves: np.ndarray, fracs: list[float]) -> None:
    if not (leaves > 0).any():
        leaves = np.append(leaves, 1.0)
    n = len(leaves)
    tree = SumTree(n)
    tree.set(np.arange(n), leaves)
    total = tree.total
    # exact exclusive prefixes: before[i] = leaves[0] + ... + leaves[i-1]
    before = [math.fsum(leaves[:i]) for i in range(n + 1)]
    # rounding allowance: a few ulps per level, plus a few subnormal steps for tiny totals
    tol = 4 * (depth(tree) + 1) * EPS * total + 8 * 5e-324
    targets = [min(f * total, total) for f in fracs] + [total]
    got = tree.find(targets)
    assert got.dtype == np.int64
    for t, i in zip(targets, got.tolist(), strict=True):
        assert 0 <= i < n
        assert leaves[i] > 0.0, (t, i)
        assert before[i] <= t + tol, (t, i)
        if t < total:
            assert t < before[i + 1] + tol, (t, i)
        else:  # t == total: the last positive leaf (up to rounding), never a zero one
            assert t <= before[i + 1] + tol, (t, i)


@settings(max_examples=100, deadline=None)
@given(
    leaf_vectors(),
    st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=40),
)
def test_batched_find_equals_one_target_at_a_time(leaves: np.ndarray, fracs: list[float]) -> None:
    if not (leaves > 0).any():
        leaves = np.append(leaves, 1.0)
    n = len(leaves)
    tree = SumTree(n)
    tree.set(np.arange(n), leaves)
    total = tree.total
    targets = np.array([min(f * total, total) for f in fracs] + [total, 0.0])
    batched = tree.find(targets)
    single = np.array([int(tree.find(float(t))) for t in targets])
    np.testing.assert_array_equal(batched, single)
    # order of the targets within a batch does not matter either
    rev = tree.find(targets[::-1])
    np.testing.assert_array_equal(rev[::-1], batched)


# ---------------------------------------------------------------------------
# no drift over millions of updates
# ---------------------------------------------------------------------------


def test_no_drift_over_two_million_updates() -> None:
    rng = np.random.default_rng(SEED)
    capacity = 2**16
    n_batches, batch = 2000, 1024
    st_tree, mt_tree = SumTree(capacity), MinTree(capacity)
    mirror = np.zeros(capacity)
    checkpoints = 0
    for b in range(n_batches):
        idx = rng.integers(0, capacity, size=batch)
        vals = 10.0 ** rng.uniform(-12.0, 12.0, size=batch)
        vals[rng.random(batch) < 0.05] = 0.0
        if b % 10 == 0:  # a few batches hammer a small hot set, with duplicates
            idx = rng.integers(0, 64, size=batch)
        st_tree.set(idx, vals)
        mt_tree.set(idx, vals)
        # last occurrence of each index wins
        uniq, first_from_end = np.unique(idx[::-1], return_index=True)
        mirror[uniq] = vals[::-1][first_from_end]
        if (b + 1) % 250 == 0:
            checkpoints += 1
            leaves = st_tree.leaves()
            assert bits_equal(leaves, mirror)
            exact = math.fsum(leaves)
            assert exact > 0.0
            assert abs(st_tree.total - exact) <= 1e-9 * exact, (b, st_tree.total, exact)
            written = mt_tree.leaves()
            assert mt_tree.min == float(np.min(written[np.isfinite(written)]))
    assert checkpoints == n_batches // 250
    # after 2M+ updates the tree is still exactly what a rebuild from its leaves gives
    fresh = SumTree(capacity)
    fresh.set(np.arange(capacity), mirror)
    assert bits_equal(st_tree.state(), fresh.state())
    before = st_tree.state()
    st_tree.rebuild()
    assert bits_equal(st_tree.state(), before)
    assert abs(st_tree.total - math.fsum(mirror)) <= 1e-9 * math.fsum(mirror)
    # drain: zero every big leaf, so the total drops by ~20 orders of magnitude; any
    # error carried over from the big values (delta updates) would now dominate
    big = np.flatnonzero(mirror > 1e-3)
    for lo in range(0, big.size, batch):
        st_tree.set(big[lo : lo + batch], np.zeros(big[lo : lo + batch].size))
    mirror[big] = 0.0
    exact = math.fsum(mirror)
    assert 0.0 < exact < 1e-3 * capacity
    assert abs(st_tree.total - exact) <= 1e-9 * exact, (st_tree.total, exact)
