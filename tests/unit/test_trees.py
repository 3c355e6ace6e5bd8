"""Unit tests for :class:`fastper.trees.SumTree` and :class:`fastper.trees.MinTree`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fastper.errors import InvalidIndexError
from fastper.trees import MinTree, SumTree
from tests.oracles import naive_find

SEED = 20240611
CAPACITIES = [1, 2, 3, 5, 7, 8, 1000]
EPS = 2.0**-52


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Same dtype, same shape and the very same bytes (so -0.0 != 0.0, NaN == NaN)."""
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def random_leaves(rng: np.random.Generator, n: int, zero_frac: float = 0.25) -> np.ndarray:
    """Log-uniform leaves over many decades, with a fraction of exact zeros."""
    vals = 10.0 ** rng.uniform(-6.0, 6.0, size=n)
    vals[rng.random(n) < zero_frac] = 0.0
    return vals


def fsum_prefixes(leaves: np.ndarray) -> np.ndarray:
    """Exactly rounded inclusive prefix sums: out[i] = fsum(leaves[: i + 1])."""
    return np.array([math.fsum(leaves[: i + 1]) for i in range(len(leaves))])


def filled_sum_tree(capacity: int, seed: int = SEED) -> SumTree:
    rng = np.random.default_rng(seed)
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), random_leaves(rng, capacity, zero_frac=0.2) + 0.5)
    return tree


def filled_min_tree(capacity: int, seed: int = SEED) -> MinTree:
    rng = np.random.default_rng(seed)
    tree = MinTree(capacity)
    tree.set(np.arange(capacity), random_leaves(rng, capacity, zero_frac=0.2) + 0.5)
    return tree


# ---------------------------------------------------------------------------
# construction and basic properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_sum_tree_starts_empty(capacity: int) -> None:
    tree = SumTree(capacity)
    assert tree.capacity == capacity
    assert len(tree) == capacity
    assert tree.total == 0.0
    assert_bits_equal(tree.leaves(), np.zeros(capacity))
    assert_bits_equal(tree.get(np.arange(capacity)), np.zeros(capacity))
    assert tree.nbytes == tree.state().nbytes
    assert tree._leaves.shape[0] >= capacity


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_min_tree_starts_at_inf(capacity: int) -> None:
    tree = MinTree(capacity)
    assert tree.capacity == capacity
    assert len(tree) == capacity
    assert tree.min == math.inf
    assert np.all(tree.leaves() == math.inf)
    assert np.all(tree.get(np.arange(capacity)) == math.inf)
    tree.set([capacity - 1], [3.0])
    assert tree.min == 3.0
    assert tree.get([capacity - 1]).tolist() == [3.0]


@pytest.mark.parametrize("cls", [SumTree, MinTree])
@pytest.mark.parametrize(
    ("capacity", "exc", "match"),
    [
        (0, ValueError, r"`capacity` must be >= 1"),
        (-3, ValueError, r"`capacity` must be >= 1"),
        (2.0, TypeError, r"`capacity` must be an integer"),
        (True, TypeError, r"`capacity` must be an integer"),
        ("8", TypeError, r"`capacity` must be an integer"),
    ],
)
def test_bad_capacity(cls: type, capacity: object, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        cls(capacity)


def test_numpy_integer_capacity_accepted() -> None:
    tree = SumTree(np.int64(5))
    assert tree.capacity == 5
    assert type(tree.capacity) is int


# ---------------------------------------------------------------------------
# hand-drawn trees
# ---------------------------------------------------------------------------


def test_find_by_hand_1_0_3_2() -> None:
    # prefixes: 1, 1, 4, 6
    tree = SumTree(4)
    tree.set([0, 1, 2, 3], [1.0, 0.0, 3.0, 2.0])
    assert tree.total == 6.0
    assert_bits_equal(tree._inner[tree._offs[1] : tree._offs[1] + 1], np.array([6.0]))
    targets = [0.0, 0.99, 1.0, 3.99, 4.0, 5.99, 6.0]
    expected = [0, 0, 2, 2, 3, 3, 3]
    assert tree.find(targets).tolist() == expected
    for t, e in zip(targets, expected, strict=True):
        got = tree.find(t)
        assert np.ndim(got) == 0
        assert int(got) == e


def test_find_by_hand_non_power_of_two_with_zero_leaves() -> None:
    # capacity 7: leaves [0, 2, 0, 0, 5, 0, 0]; prefixes 0, 2, 2, 2, 7, 7, 7
    tree = SumTree(7)
    tree.set([1, 4], [2.0, 5.0])
    assert tree.total == 7.0
    assert tree.find([0.0, 1.999, 2.0, 6.5, 7.0]).tolist() == [1, 1, 4, 4, 4]


def test_find_by_hand_single_positive_leaf_surrounded_by_zeros() -> None:
    tree = SumTree(5)
    tree.set([2], [5.0])
    assert tree.find([0.0, 2.5, 5.0]).tolist() == [2, 2, 2]


def test_find_by_hand_leading_zeros_target_zero() -> None:
    tree = SumTree(3)
    tree.set([0, 1, 2], [0.0, 0.0, 1.0])
    assert int(tree.find(0.0)) == 2


def test_capacity_one() -> None:
    tree = SumTree(1)
    tree.set([0], [2.5])
    assert tree.total == 2.5
    assert tree.get([0]).tolist() == [2.5]
    assert tree[0] == 2.5
    assert tree.find([0.0, 1.0, 2.5]).tolist() == [0, 0, 0]
    mt = MinTree(1)
    mt.set(0, 4.0)
    assert mt.min == 4.0


def test_duplicates_last_wins_by_hand() -> None:
    tree = SumTree(3)
    tree.set([1, 1, 0, 1], [5.0, 6.0, 1.0, 7.0])
    assert tree.get([0, 1, 2]).tolist() == [1.0, 7.0, 0.0]
    assert tree.total == 8.0
    mt = MinTree(3)
    mt.set([2, 2], [0.5, 9.0])
    assert mt.min == 9.0
    assert mt.get([2]).tolist() == [9.0]


def test_overwrite_to_zero_and_min_tree_with_zero() -> None:
    tree = SumTree(5)
    tree.set([0, 4], [3.0, 4.0])
    tree.set([4], [0.0])
    assert tree.total == 3.0
    assert int(tree.find(3.0)) == 0
    mt = MinTree(5)
    mt.set([0, 3], [3.0, 0.0])
    assert mt.min == 0.0


def test_scalar_index_and_value() -> None:
    tree = SumTree(4)
    tree.set(2, 1.5)
    assert tree.get(2).tolist() == [1.5]
    assert tree[2] == 1.5
    assert tree.total == 1.5


def test_empty_batch_is_a_no_op() -> None:
    tree = filled_sum_tree(7)
    before = tree.state()
    tree.set([], [])
    tree.set(np.empty(0, dtype=np.int64), np.empty(0))
    assert_bits_equal(tree.state(), before)
    assert tree.get([]).shape == (0,)
    assert tree.find(np.empty(0)).shape == (0,)


def test_int_values_accepted_as_float() -> None:
    tree = SumTree(3)
    tree.set(np.array([0, 2], dtype=np.int32), np.array([4, 5], dtype=np.int64))
    assert tree.get([0, 1, 2]).dtype == np.float64
    assert tree.get([0, 1, 2]).tolist() == [4.0, 0.0, 5.0]


# ---------------------------------------------------------------------------
# random data against numpy / oracles
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_get_total_min_against_numpy(capacity: int) -> None:
    rng = np.random.default_rng(SEED + capacity)
    st, mt = SumTree(capacity), MinTree(capacity)
    mirror_s = np.zeros(capacity)
    mirror_m = np.full(capacity, np.inf)
    for _ in range(20):
        k = int(rng.integers(1, 2 * capacity + 1))
        idx = rng.integers(0, capacity, size=k)
        vals = random_leaves(rng, k)
        st.set(idx, vals)
        mt.set(idx, vals)
        for i, v in zip(idx, vals, strict=True):  # sequential semantics: last wins
            mirror_s[i] = v
            mirror_m[i] = v
        assert_bits_equal(st.leaves(), mirror_s)
        assert_bits_equal(mt.leaves(), mirror_m)
        q = rng.integers(0, capacity, size=17)
        assert_bits_equal(st.get(q), mirror_s[q])
        assert_bits_equal(mt.get(q), mirror_m[q])
        assert st.total == pytest.approx(math.fsum(mirror_s), rel=1e-13, abs=0.0)
        assert st.total == pytest.approx(float(np.sum(mirror_s)), rel=1e-12, abs=0.0)
        assert st.fsum() == math.fsum(mirror_s)
        assert mt.min == float(np.min(mirror_m))


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_find_against_naive_find_integer_leaves(capacity: int) -> None:
    # integer-valued leaves: all prefix sums are exact, so boundaries are tested too
    rng = np.random.default_rng(SEED + 7 * capacity)
    leaves = rng.integers(0, 5, size=capacity).astype(np.float64)
    leaves[-1] = 0.0 if capacity > 1 else 1.0
    if leaves.sum() == 0:
        leaves[0] = 1.0
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), leaves)
    total = tree.total
    assert total == leaves.sum()
    prefixes = np.cumsum(leaves)
    # naive_find is O(n^2) per target: test at most 60 boundaries of a big tree
    bounds = rng.choice(prefixes, size=min(capacity, 60), replace=False)
    targets = np.concatenate(
        [
            rng.uniform(0.0, total, size=100),
            bounds[bounds < total],  # exact boundaries
            np.nextafter(bounds, 0.0),  # just under boundaries
            [0.0, total],
        ]
    )
    got = tree.find(targets)
    assert got.dtype == np.int64
    expected = np.array([naive_find(leaves, float(t)) for t in targets])
    np.testing.assert_array_equal(got, expected)
    assert np.all(leaves[got] > 0)


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_find_against_naive_find_random_float_leaves(capacity: int) -> None:
    rng = np.random.default_rng(SEED + 13 * capacity)
    leaves = random_leaves(rng, capacity)
    if not (leaves > 0).any():
        leaves[capacity // 2] = 1.0
    tree = SumTree(capacity)
    tree.set(rng.permutation(capacity), random_leaves(rng, capacity))  # noise, overwritten below
    tree.set(np.arange(capacity), leaves)
    prefixes = fsum_prefixes(leaves)
    total = tree.total
    raw = rng.uniform(0.0, total, size=160)
    # keep only targets that are not within 1e-9 (relative to total) of a prefix boundary
    near = np.abs(raw[:, None] - prefixes[None, :]).min(axis=1) <= 1e-9 * total
    targets = raw[~near]
    assert targets.size >= 150
    got = tree.find(targets)
    expected = np.array([naive_find(leaves, float(t)) for t in targets])
    np.testing.assert_array_equal(got, expected)
    assert np.all(leaves[got] > 0)


# ---------------------------------------------------------------------------
# targets at / just under the total never land on a zero leaf
# ---------------------------------------------------------------------------


def _top_targets(total: float) -> list[float]:
    return [total] + [total * (1.0 - k * EPS) for k in range(1, 5)]


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("trailing_zeros", [0, 1, 3])
def test_find_at_total_returns_last_positive_leaf(capacity: int, trailing_zeros: int) -> None:
    rng = np.random.default_rng(SEED + 31 * capacity + trailing_zeros)
    leaves = random_leaves(rng, capacity, zero_frac=0.3)
    tz = min(trailing_zeros, capacity - 1)
    if tz:
        leaves[-tz:] = 0.0
    last = capacity - 1 - tz
    leaves[last] = max(leaves[last], 1.0)  # last positive leaf is not tiny
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), leaves)
    targets = _top_targets(tree.total)
    got = tree.find(targets)
    assert np.all(leaves[got] > 0), (targets, got)
    # the last positive leaf holds >= 1e-6 of the mass, far more than 4 ulps of the total
    assert got.tolist() == [last] * len(targets)


@pytest.mark.parametrize(
    "leaves",
    [
        [1.0, 2.0, 3.0, 0.0, 0.0],
        [0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.0],
        [1e12, 1e-12, 0.0, 0.0, 0.0],
        [1.0, 1e-300, 0.0],
        [0.0, 0.0, 5e-324, 0.0, 0.0],
        [0.1] * 10 + [0.0] * 3,
        [1e-12] * 999 + [0.0],
        [3.0] + [1e-17] * 6 + [0.0],
    ],
)
def test_find_near_total_never_zero_leaf(leaves: list[float]) -> None:
    arr = np.array(leaves)
    tree = SumTree(len(arr))
    tree.set(np.arange(len(arr)), arr)
    targets = _top_targets(tree.total)
    targets += [float(np.nextafter(tree.total, 0.0))]
    got = tree.find(targets)
    assert np.all(arr[got] > 0), (targets, got)
    assert np.all(got <= np.flatnonzero(arr > 0)[-1])


def test_find_near_total_many_random_trees() -> None:
    rng = np.random.default_rng(SEED + 99)
    for _ in range(300):
        capacity = int(rng.integers(1, 40))
        leaves = random_leaves(rng, capacity, zero_frac=0.5)
        leaves[rng.random(capacity) < 0.2] *= 1e-15  # tiny leaves that vanish in sums
        if not (leaves > 0).any():
            leaves[int(rng.integers(0, capacity))] = 1e-9
        tree = SumTree(capacity)
        tree.set(rng.permutation(capacity), random_leaves(rng, capacity))  # overwritten below
        tree.set(np.arange(capacity), leaves)
        got = tree.find(_top_targets(tree.total))
        assert np.all(leaves[got] > 0), (leaves, got)


# ---------------------------------------------------------------------------
# rebuild
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_rebuild_reproduces_incremental_tree(capacity: int) -> None:
    st = filled_sum_tree(capacity)
    mt = filled_min_tree(capacity)
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, capacity, size=3 * capacity)
    vals = random_leaves(rng, idx.size)
    st.set(idx, vals)
    mt.set(idx, vals)
    for tree in (st, mt):
        before = tree.state()
        # corrupt every internal node, then rebuild from the leaves
        tree._inner[:] = 12345.0
        tree.rebuild()
        assert_bits_equal(tree.state(), before)
    assert mt.min == float(np.min(mt.leaves()))


# ---------------------------------------------------------------------------
# bad inputs: right exception, message names the problem, tree unchanged
# ---------------------------------------------------------------------------


CAP = 5

BAD_SET_CASES = [
    # (id, indices, values, exception, match)
    ("nan", [0, 1], [1.0, math.nan], ValueError, r"`values` must be finite"),
    ("inf", [0, 1], [math.inf, 1.0], ValueError, r"`values` must be finite"),
    ("-inf", [2], [-math.inf], ValueError, r"`values` must be finite"),
    ("negative", [0, 1], [1.0, -1.0], ValueError, r"`values` must be >= 0"),
    ("negative-tiny", [3], [-5e-324], ValueError, r"`values` must be >= 0"),
    ("index-minus-1", [0, -1], [1.0, 2.0], InvalidIndexError, r"`indices` must lie in \[0, 5\)"),
    ("index-capacity", [CAP], [1.0], InvalidIndexError, r"`indices` must lie in \[0, 5\)"),
    ("index-huge", [0, 2**40], [1.0, 1.0], InvalidIndexError, r"must lie in \[0, 5\)"),
    ("scalar-index-oob", CAP, 1.0, InvalidIndexError, r"`indices` must lie in \[0, 5\)"),
    ("float-indices", [0.0, 1.0], [1.0, 2.0], TypeError, r"`indices` must hold integers"),
    ("float-index-array", np.array([1.5]), [1.0], TypeError, r"`indices` must hold integers"),
    ("bool-indices", np.array([True]), [1.0], TypeError, r"`indices` must hold integers"),
    ("2d-indices", [[0, 1]], [[1.0, 2.0]], ValueError, r"`indices` must be 1-D"),
    ("2d-values", [0, 1], [[1.0], [2.0]], ValueError, r"`values` must be 1-D"),
    ("too-few-values", [0, 1, 2], [1.0, 2.0], ValueError, r"`values` must have 3 entries"),
    ("too-many-values", [0], [1.0, 2.0], ValueError, r"`values` must have 1 entries"),
    ("bool-values", [0], np.array([True]), TypeError, r"`values` must hold real numbers"),
    ("str-values", [0], ["1.0"], TypeError, r"`values` must hold real numbers"),
]


@pytest.mark.parametrize("cls", [SumTree, MinTree])
@pytest.mark.parametrize(
    ("indices", "values", "exc", "match"),
    [c[1:] for c in BAD_SET_CASES],
    ids=[c[0] for c in BAD_SET_CASES],
)
def test_bad_set_raises_and_changes_nothing(
    cls: type, indices: object, values: object, exc: type, match: str
) -> None:
    tree = filled_sum_tree(CAP) if cls is SumTree else filled_min_tree(CAP)
    before = tree.state()
    with pytest.raises(exc, match=match):
        tree.set(indices, values)
    assert_bits_equal(tree.state(), before)


def test_invalid_index_error_is_index_and_value_error() -> None:
    tree = filled_sum_tree(CAP)
    before = tree.state()
    with pytest.raises(IndexError, match=r"out-of-range"):
        tree.set([CAP], [1.0])
    with pytest.raises(ValueError, match=r"out-of-range"):
        tree.set([-1], [1.0])
    assert issubclass(InvalidIndexError, IndexError)
    assert issubclass(InvalidIndexError, ValueError)
    assert_bits_equal(tree.state(), before)


@pytest.mark.parametrize("cls", [SumTree, MinTree])
@pytest.mark.parametrize(
    ("bad_value", "exc", "match"),
    [
        (math.nan, ValueError, r"`values` must be finite"),
        (math.inf, ValueError, r"`values` must be finite"),
        (-1.0, ValueError, r"`values` must be >= 0"),
        ("index", InvalidIndexError, r"`indices` must lie in \[0, 1000\)"),
    ],
)
def test_batch_valid_except_last_writes_nothing(
    cls: type, bad_value: object, exc: type, match: str
) -> None:
    capacity = 1000
    tree = filled_sum_tree(capacity) if cls is SumTree else filled_min_tree(capacity)
    before = tree.state()
    rng = np.random.default_rng(SEED + 5)
    idx = rng.integers(0, capacity, size=256)
    vals = rng.uniform(0.0, 10.0, size=256)
    if bad_value == "index":
        idx[-1] = capacity
    else:
        vals[-1] = bad_value
    with pytest.raises(exc, match=match):
        tree.set(idx, vals)
    assert_bits_equal(tree.state(), before)
    # and the same batch minus the bad entry does change the tree
    tree.set(idx[:-1], vals[:-1])
    assert tree.state().tobytes() != before.tobytes()


@pytest.mark.parametrize("cls", [SumTree, MinTree])
@pytest.mark.parametrize(
    ("indices", "exc", "match"),
    [
        ([-1], InvalidIndexError, r"`indices` must lie in \[0, 5\)"),
        ([0, CAP], InvalidIndexError, r"`indices` must lie in \[0, 5\)"),
        ([1.0], TypeError, r"`indices` must hold integers"),
        ([[0, 1]], ValueError, r"`indices` must be 1-D"),
    ],
)
def test_bad_get_raises_and_changes_nothing(
    cls: type, indices: object, exc: type, match: str
) -> None:
    tree = filled_sum_tree(CAP) if cls is SumTree else filled_min_tree(CAP)
    before = tree.state()
    with pytest.raises(exc, match=match):
        tree.get(indices)
    assert_bits_equal(tree.state(), before)


def test_getitem_out_of_range() -> None:
    tree = filled_sum_tree(CAP)
    with pytest.raises(InvalidIndexError, match=r"must lie in \[0, 5\)"):
        tree[CAP]
    with pytest.raises(InvalidIndexError, match=r"must lie in \[0, 5\)"):
        tree[-1]


@pytest.mark.parametrize("capacity", [1, 5, 8])
def test_find_on_all_zero_tree_raises(capacity: int) -> None:
    tree = SumTree(capacity)
    before = tree.state()
    with pytest.raises(ValueError, match=r"`find` needs a positive total"):
        tree.find([0.0])
    # a tree whose leaves were all written back to zero is also empty
    tree.set(np.arange(capacity), np.ones(capacity))
    tree.set(np.arange(capacity), np.zeros(capacity))
    assert_bits_equal(tree.state(), before)
    with pytest.raises(ValueError, match=r"`find` needs a positive total"):
        tree.find(0.0)
    assert_bits_equal(tree.state(), before)


@pytest.mark.parametrize(
    ("targets", "exc", "match"),
    [
        ([-1.0], ValueError, r"`targets` must be >= 0"),
        ([1.0, -1e-300], ValueError, r"`targets` must be >= 0"),
        ([math.nan], ValueError, r"`targets` must be finite"),
        ([math.inf], ValueError, r"`targets` must be finite"),
        ("total+1", ValueError, r"`targets` must be <= total"),
        ("total+ulp", ValueError, r"`targets` must be <= total"),
        ("mixed", ValueError, r"`targets` must be <= total"),
        (["a"], TypeError, r"`targets` must hold real numbers"),
    ],
)
def test_bad_find_targets_raise_and_change_nothing(targets: object, exc: type, match: str) -> None:
    tree = filled_sum_tree(7)
    total = tree.total
    if targets == "total+1":
        targets = [total + 1.0]
    elif targets == "total+ulp":
        targets = [float(np.nextafter(total, math.inf))]
    elif targets == "mixed":
        targets = [0.0, total * 0.5, total, total * 2.0]
    before = tree.state()
    with pytest.raises(exc, match=match):
        tree.find(targets)
    assert_bits_equal(tree.state(), before)
    # the scalar form of a lone bad target fails the same way
    if isinstance(targets, list) and len(targets) == 1:
        with pytest.raises(exc, match=match):
            tree.find(targets[0])
    assert_bits_equal(tree.state(), before)


@pytest.mark.parametrize("capacity", [1, 9, 1000, 70_001])
def test_tree_arrays_start_on_cache_lines(capacity: int) -> None:
    # A node's 8 children fill one 64-byte line only if the arrays start on a
    # line: numpy alone aligns to 16 bytes, which split every node in two.
    from fastper import PrioritizedReplayBuffer
    from tests.conftest import CARTPOLE_FIELDS

    arrays = [SumTree(capacity)._leaves, SumTree(capacity)._inner, MinTree(capacity)._inner]
    sampler = PrioritizedReplayBuffer(capacity, CARTPOLE_FIELDS)._sampler
    arrays += [sampler.leaves, sampler.sinner, sampler.minner]
    for a in arrays:
        assert a.ctypes.data % 64 == 0
        assert a.dtype == np.float64 and a.flags.c_contiguous
