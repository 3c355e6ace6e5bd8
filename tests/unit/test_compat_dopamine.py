"""Tests for :mod:`fastper.compat.dopamine`: Dopamine's sum trees and prioritized buffer API.

The sum tree tests restate, as behaviours, what Dopamine's own tests of its
NumPy tree and of its JAX-side vectorised tree check (errors, small
capacities, set / get, sampling, stratified sampling, the recorded maximum,
queries, clearing, state dicts); the statistical tests check sampling
frequencies with a chi-square test at a fixed seed.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from scipy import stats

from fastper.compat.dopamine import (
    DopamineTypeError,
    DopamineValueError,
    OutOfGraphPrioritizedReplayBuffer,
    ReplayElement,
    SumTree,
)
from fastper.errors import EmptyBufferError, FieldTypeError, InvalidIndexError, ZeroPriorityError

SEED = 20240917
P_MIN = 1e-4  # chi-square p-values below this fail (fixed seeds: deterministic)


def chi2_pvalue(counts: np.ndarray, weights: np.ndarray) -> float:
    expected = weights / weights.sum() * counts.sum()
    return float(stats.chisquare(counts, expected).pvalue)


# ---------------------------------------------------------------------------
# SumTree: construction and errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [-1, 0])
def test_non_positive_capacity_raises_value_and_assertion_error(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        SumTree(capacity)
    with pytest.raises(AssertionError):  # what Dopamine's JAX-side tree raises
        SumTree(capacity)


@pytest.mark.parametrize("capacity", [2.0, "3", True, None])
def test_non_integer_capacity_raises_type_error(capacity: object) -> None:
    with pytest.raises(DopamineTypeError, match="must be an integer"):
        SumTree(capacity)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        SumTree(capacity)  # type: ignore[arg-type]


def test_set_negative_value_raises_and_changes_nothing() -> None:
    tree = SumTree(100)
    with pytest.raises(ValueError, match="nonnegative"):
        tree.set(0, -1)
    with pytest.raises(AssertionError):
        tree.set(node_index=0, value=-1)
    # a batch with one bad value writes none of them
    with pytest.raises(DopamineValueError):
        tree.set(np.array([1, 2]), np.array([3.0, -0.5]))
    assert tree.root == 0.0
    assert tree.get(1) == 0.0
    assert tree.max_recorded_priority == 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_set_non_finite_value_raises(bad: float) -> None:
    tree = SumTree(4)
    with pytest.raises(ValueError, match="finite|nonnegative"):
        tree.set(0, bad)
    assert tree.root == 0.0


def test_set_shapes_must_match() -> None:
    tree = SumTree(10)
    with pytest.raises(DopamineValueError, match="same shape"):
        tree.set(np.array([1, 2]), np.array([1.0, 2.0, 3.0]))
    with pytest.raises(AssertionError):
        tree.set(np.array([1, 2]), 1.0)
    assert tree.root == 0.0


@pytest.mark.parametrize("index", [-1, 10, 128])
def test_index_out_of_range_raises_index_error(index: int) -> None:
    tree = SumTree(10)
    with pytest.raises(IndexError):
        tree.set(index, 1.0)
    with pytest.raises(IndexError):
        tree.get(index)
    assert tree.root == 0.0


def test_non_integer_index_raises_type_error() -> None:
    tree = SumTree(10)
    with pytest.raises(TypeError):
        tree.set(1.0, 1.0)
    with pytest.raises(TypeError):
        tree.get(np.array([0.5]))


def test_argument_names_of_both_dopamine_trees() -> None:
    tree = SumTree(8)
    tree.set(node_index=1, value=2.0)
    tree.set(indices=np.array([2, 3]), values=np.array([3.0, 4.0]))
    assert tree.get(node_index=1) == 2.0
    np.testing.assert_array_equal(tree.get(index=np.array([2, 3])), [3.0, 4.0])
    with pytest.raises(TypeError, match="not both"):
        tree.set(0, 1.0, indices=0)
    with pytest.raises(TypeError, match="missing"):
        tree.set(0)


def test_sample_from_empty_tree_raises() -> None:
    tree = SumTree(100)
    with pytest.raises(ZeroPriorityError, match="empty sum tree"):
        tree.sample()
    with pytest.raises(Exception, match="empty sum tree"):  # Dopamine raises bare Exception
        tree.stratified_sample(5)
    tree.set(3, 1.0)
    tree.set(3, 0.0)
    with pytest.raises(ZeroPriorityError):
        tree.sample(query_value=0.5)


@pytest.mark.parametrize("query_value", [-0.1, 1.1, float("nan"), float("inf")])
def test_sample_with_query_value_outside_unit_interval_raises(query_value: float) -> None:
    tree = SumTree(100)
    tree.set(5, 1.0)
    with pytest.raises(ValueError, match=r"query_value must be in \[0, 1\]"):
        tree.sample(query_value=query_value)


def test_sample_with_non_number_query_value_raises_type_error() -> None:
    tree = SumTree(10)
    tree.set(5, 1.0)
    with pytest.raises(TypeError):
        tree.sample(query_value="0.5")  # type: ignore[arg-type]


def test_stratified_sample_batch_size_checked() -> None:
    tree = SumTree(10)
    tree.set(0, 1.0)
    assert tree.stratified_sample(0) == []
    with pytest.raises(ValueError):
        tree.stratified_sample(-1)
    with pytest.raises(TypeError):
        tree.stratified_sample(2.0)  # type: ignore[arg-type]


def test_rng_argument_checked() -> None:
    with pytest.raises(TypeError, match="rng"):
        SumTree(4, rng="seed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rng"):
        SumTree(4, rng=-3)


# ---------------------------------------------------------------------------
# SumTree: Dopamine NumPy-tree behaviours
# ---------------------------------------------------------------------------


def test_small_capacities_have_one_and_two_levels() -> None:
    assert len(SumTree(1).nodes) == 1
    assert len(SumTree(2).nodes) == 2
    assert len(SumTree(3).nodes) == 3


def test_set_value_small_capacity() -> None:
    tree = SumTree(1)
    tree.set(0, 1.5)
    assert tree.get(0) == 1.5
    assert tree.root == 1.5
    assert tree.sample() == 0


def test_set_value_fills_only_the_leftmost_branch() -> None:
    tree = SumTree(100)
    tree.set(node_index=0, value=1.0)
    assert tree.get(0) == 1.0
    for level in tree.nodes:
        assert level[0] == 1.0
        assert not level[1:].any()


def test_padded_leaf_level_is_at_least_the_capacity() -> None:
    tree = SumTree(100)
    assert len(tree.nodes[-1]) == 128
    assert tree.to_state_dict()["nodes"].size == 255  # 2 ** 8 - 1, as the JAX-side tree


def test_nodes_is_a_snapshot() -> None:
    tree = SumTree(4)
    tree.set(np.arange(4), np.array([0.5, 1.0, 0.5, 0.5]))
    nodes = tree.nodes
    np.testing.assert_array_equal(nodes[1], [1.5, 1.0])
    nodes[-1][:] = 7.0
    assert tree.get(0) == 0.5


def test_sample_single_positive_leaf() -> None:
    tree = SumTree(100, rng=SEED)
    tree.set(node_index=5, value=1.0)
    assert all(tree.sample() == 5 for _ in range(100))
    assert tree.stratified_sample(10) == [5] * 10


def test_sample_with_query_value_is_deterministic() -> None:
    tree = SumTree(100)
    tree.set(node_index=2, value=1.0)
    tree.set(node_index=3, value=3.0)
    # 0.1 of the total (4.0) is 0.4, inside leaf 2's share [0, 1)
    assert {tree.sample(query_value=0.1) for _ in range(1000)} == {2}
    assert tree.sample(query_value=0.25) == 3  # 1.0 is the first point of leaf 3's share
    assert tree.sample(query_value=0.2499) == 2


def test_sample_query_value_boundaries_skip_zero_leaves() -> None:
    tree = SumTree(100)
    tree.set(np.array([0, 1, 2, 3]), np.array([0.0, 0.0, 3.0, 1.0]))
    assert tree.sample(query_value=0.0) == 2  # zero leaves are never returned
    assert tree.sample(query_value=0) == 2
    # 1.0 lands on the total: the last positive leaf (Dopamine walks to padding leaf 127)
    assert tree.sample(query_value=1.0) == 3


def test_seeded_sampling_is_reproducible_and_independent() -> None:
    tree = SumTree(100)
    tree.set(np.array([2, 3]), np.array([1.0, 3.0]))
    state = tree.to_state_dict()

    def draws(seed: int) -> list[int]:
        t = SumTree(100, rng=seed)
        t.from_state_dict(state)
        return [t.sample() for _ in range(50)] + t.stratified_sample(20)

    first = draws(1)
    assert draws(1) == first  # the same seed gives the same draws every time
    assert draws(2) != first
    # a shared Generator is used as is and advanced by each draw
    gen = np.random.default_rng(7)
    t = SumTree(100, rng=gen)
    t.from_state_dict(state)
    assert t.rng is gen
    before = gen.bit_generator.state
    t.sample()
    assert gen.bit_generator.state != before


def test_sampling_leaves_global_random_states_alone() -> None:
    random.seed(1)
    np.random.seed(1)  # noqa: NPY002 - checking that the legacy global state is untouched
    py_next, np_next = random.random(), np.random.random()  # noqa: NPY002
    random.seed(1)
    np.random.seed(1)  # noqa: NPY002
    tree = SumTree(16)
    tree.set(np.arange(16), np.arange(1.0, 17.0))
    tree.sample()
    tree.stratified_sample(32)
    assert random.random() == py_next
    assert np.random.random() == np_next  # noqa: NPY002
    # and seeding Python's random does not make this tree repeat itself
    draws = []
    for _ in range(200):
        random.seed(1)
        draws.append(tree.sample())
    assert len(set(draws)) > 1


def test_stratified_sampling_gives_one_leaf_per_slice() -> None:
    k = 32
    tree = SumTree(100, rng=SEED)
    for i in range(k):
        tree.set(node_index=i, value=1)
    for _ in range(20):
        samples = tree.stratified_sample(k)
        assert samples == list(range(k))
        assert all(type(s) is int for s in samples)


def test_max_recorded_priority() -> None:
    tree = SumTree(100)
    tree.set(node_index=0, value=0)
    assert tree.max_recorded_priority == 1.0  # starts at 1.0
    for i in range(1, 32):
        tree.set(node_index=i, value=i)
        assert tree.max_recorded_priority == i
    tree.set(5, 0.5)  # never lowered
    assert tree.max_recorded_priority == 31
    tree.set(np.array([1, 2]), np.array([40.0, 35.0]))  # the largest of a batch
    assert tree.max_recorded_priority == 40.0
    tree.clear()  # kept by clear, as in Dopamine
    assert tree.max_recorded_priority == 40.0
    tree.max_recorded_priority = 2.0  # assignable, like Dopamine's attribute
    assert tree.max_recorded_priority == 2.0
    with pytest.raises(ValueError):
        tree.max_recorded_priority = -1.0


# ---------------------------------------------------------------------------
# SumTree: JAX-side vectorised behaviours
# ---------------------------------------------------------------------------


def small_tree() -> SumTree:
    """Leaves [0.5, 1.0, 0.5, 0.5]: levels [2.5], [1.5, 1.0]."""
    tree = SumTree(4)
    tree.set(np.array([0, 1, 2, 3], dtype=np.int32), np.array([0.5, 1.0, 0.5, 0.5], np.float32))
    return tree


def test_vectorised_set_and_get() -> None:
    tree = SumTree(100)
    tree.set(np.array([1, 2], dtype=np.int32), np.array([3.0, 4.0], dtype=np.float32))
    assert tree.get(1) == 3.0
    assert tree.get(2) == 4.0
    assert tree.root == 7.0
    out = tree.get(np.array([[1, 2], [2, 0]]))
    assert out.dtype == np.float64 and out.shape == (2, 2)
    np.testing.assert_array_equal(out, [[3.0, 4.0], [4.0, 0.0]])
    assert isinstance(tree.get(1), float)
    assert tree.get(np.array([], dtype=np.int64)).shape == (0,)


def test_set_with_duplicate_indices() -> None:
    tree = SumTree(100)
    tree.set(np.array([1, 1, 1, 2, 2], dtype=np.int32), np.array([3.0, 3.0, 3.0, 4.0, 4.0]))
    assert tree.get(1) == 3.0
    assert tree.get(2) == 4.0
    assert tree.root == 7.0
    # differing values: the last one wins (Dopamine's JAX-side tree keeps the first)
    tree.set(np.array([5, 5, 5]), np.array([1.0, 2.0, 9.0]))
    assert tree.get(5) == 9.0
    assert tree.root == 16.0


def test_query_empty_tree_raises_value_error() -> None:
    tree = SumTree(100)
    with pytest.raises(ValueError, match="empty"):
        tree.query(1.0)
    with pytest.raises(ValueError):
        tree.query(0.0)


def test_query_outside_zero_to_root_raises() -> None:
    tree = small_tree()
    for bad in (-0.1, 2.5, 3.0, float("nan")):
        with pytest.raises(ValueError, match="interval"):
            tree.query(bad)
    with pytest.raises(ValueError):
        tree.query(np.array([0.0, 2.5]))
    with pytest.raises(TypeError):
        tree.query(np.array(["a"]))


def test_query_value() -> None:
    tree = SumTree(100)
    tree.set(5, 1.0)
    assert tree.query(0.99) == 5
    assert tree.query(0.0) == 5
    assert isinstance(tree.query(0.5), int)


def test_query_values_vectorised() -> None:
    tree = small_tree()
    assert tree.root == 2.5
    assert tree.to_state_dict()["nodes"].size == 7
    out = tree.query(np.array([1.5, 1.0]))
    np.testing.assert_array_equal(out, [2, 1])
    assert out.dtype == np.int64
    assert tree.query(np.array([[0.0, 0.49], [0.5, 2.49]])).tolist() == [[0, 0], [1, 3]]
    assert tree.query(np.array([])).shape == (0,)


def test_update_changes_sums_and_queries() -> None:
    tree = small_tree()
    tree.set(0, 0.25)
    assert tree.root == 2.25
    assert tree.query(0.249) == 0
    assert tree.query(0.5) == 1
    assert tree.query(1.25) == 2


def test_query_values_vectorised_larger_tree() -> None:
    tree = SumTree(8)
    tree.set(np.arange(8, dtype=np.int32), np.ones(8, dtype=np.float32))
    assert tree.root == 8.0
    assert len(tree.nodes) == 4
    assert tree.to_state_dict()["nodes"].size == 15
    np.testing.assert_array_equal(tree.query(np.arange(8, dtype=np.int32)), np.arange(8))


def test_state_dict_round_trip() -> None:
    tree = SumTree(100)
    tree.set(5, 1.0)
    tree.set(7, 3.0)
    state = tree.to_state_dict()
    assert set(state) == {"nodes", "max_recorded_priority"}
    nodes = state["nodes"]
    assert nodes.dtype == np.float64 and nodes.shape == (255,)
    assert nodes[0] == 4.0  # root first, leaves last (offset 127)
    assert nodes[127 + 5] == 1.0 and nodes[127 + 7] == 3.0
    assert state["max_recorded_priority"] == 3.0
    tree.from_state_dict(state)
    np.testing.assert_array_equal(tree.to_state_dict()["nodes"], nodes)
    assert tree.root == 4.0
    assert tree.get(5) == 1.0

    other = SumTree(100)
    other.from_state_dict(state)
    assert other.get(7) == 3.0 and other.root == 4.0
    assert other.max_recorded_priority == 3.0
    # the state dict is a copy: changing it later does not reach the tree
    state["nodes"][127 + 5] = 50.0
    assert other.get(5) == 1.0


def test_from_state_dict_takes_dopamine_layout_and_rebuilds_sums() -> None:
    # Dopamine's JAX-side state: {"nodes": heap}; internal sums may have drifted
    nodes = np.array([99.0, 5.0, -3.0, 0.5, 1.0, 0.5, 0.5])
    tree = SumTree(4)
    tree.max_recorded_priority = 6.0
    tree.from_state_dict({"nodes": nodes})
    assert tree.root == 2.5  # recomputed from the leaves
    assert tree.query(1.5) == 2
    assert tree.max_recorded_priority == 6.0  # absent from the dict: kept


def test_from_state_dict_errors_change_nothing() -> None:
    tree = small_tree()
    before = tree.to_state_dict()["nodes"]
    with pytest.raises(DopamineValueError, match="shape"):
        tree.from_state_dict({"nodes": np.zeros(15)})
    with pytest.raises(AssertionError):
        tree.from_state_dict({"nodes": np.zeros((7, 1))})
    with pytest.raises(ValueError, match="'nodes'"):
        tree.from_state_dict({})
    with pytest.raises(ValueError, match="nonnegative"):
        tree.from_state_dict({"nodes": np.array([0, 0, 0, -1.0, 0, 0, 0])})
    with pytest.raises(ValueError, match="finite"):
        tree.from_state_dict({"nodes": np.array([0, 0, 0, np.nan, 0, 0, 0])})
    three = SumTree(3)  # 4 leaves, the last one padding
    with pytest.raises(ValueError, match="padding"):
        three.from_state_dict({"nodes": np.array([0, 0, 0, 1.0, 1.0, 1.0, 2.0])})
    with pytest.raises(ValueError, match="max_recorded_priority"):
        tree.from_state_dict({"nodes": np.zeros(7), "max_recorded_priority": -2.0})
    np.testing.assert_array_equal(tree.to_state_dict()["nodes"], before)
    assert three.root == 0.0


def test_clear() -> None:
    tree = SumTree(100)
    tree.set(5, 1.0)
    tree.clear()
    assert tree.root == 0.0
    assert tree.get(5) == 0.0
    with pytest.raises(ZeroPriorityError):
        tree.sample()


def test_no_drift_unlike_delta_updates() -> None:
    """After many updates the root is still the sum of the leaves, and exactly 0 when they are.

    A Dopamine-style tree adds ``new - old`` along the path; the reference
    below does that for the root alone, and keeps a residue after zeroing.
    """
    rng = np.random.default_rng(SEED)
    n = 64
    tree = SumTree(n)
    leaves = np.zeros(n)
    delta_root = 0.0
    for _ in range(3000):
        i = int(rng.integers(n))
        v = float(rng.uniform(0.0, 1.0) * 10.0 ** rng.integers(-3, 4))
        delta_root += v - leaves[i]
        leaves[i] = v
        tree.set(i, v)
    assert tree.root == pytest.approx(np.sum(leaves), rel=1e-14)
    for i in range(n):  # zero every leaf, one delta at a time
        delta_root += 0.0 - leaves[i]
        tree.set(i, 0.0)
    assert tree.root == 0.0
    assert delta_root != 0.0  # the delta-add reference drifted
    with pytest.raises(ZeroPriorityError):
        tree.sample()


# ---------------------------------------------------------------------------
# SumTree: sampling frequencies
# ---------------------------------------------------------------------------


def weighted_tree(seed: int) -> tuple[SumTree, np.ndarray]:
    values = np.array([0.0, 1.0, 2.0, 0.5, 4.0, 0.0, 3.0, 1.5, 7.0, 0.25, 2.5])
    tree = SumTree(len(values), rng=seed)
    tree.set(np.arange(len(values)), values)
    return tree, values


def test_sample_frequencies_follow_values() -> None:
    tree, values = weighted_tree(SEED)
    draws = np.array([tree.sample() for _ in range(20000)])
    counts = np.bincount(draws, minlength=len(values))
    assert counts[values == 0].sum() == 0
    pos = values > 0
    assert chi2_pvalue(counts[pos], values[pos]) > P_MIN


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_stratified_sample_frequencies_follow_values(batch_size: int) -> None:
    tree, values = weighted_tree(SEED + batch_size)
    n_batches = 12000 // batch_size
    draws = np.concatenate([tree.stratified_sample(batch_size) for _ in range(n_batches)])
    counts = np.bincount(draws, minlength=len(values))
    assert counts[values == 0].sum() == 0
    pos = values > 0
    assert chi2_pvalue(counts[pos], values[pos]) > P_MIN


def test_query_frequencies_follow_values() -> None:
    _, values = weighted_tree(SEED)
    tree = SumTree(len(values))
    tree.set(np.arange(len(values)), values)
    rng = np.random.default_rng(SEED + 1)  # not the stream of the test above
    counts = np.bincount(tree.query(rng.random(50000) * tree.root), minlength=len(values))
    pos = values > 0
    assert counts[~pos].sum() == 0
    assert chi2_pvalue(counts[pos], values[pos]) > P_MIN


# ---------------------------------------------------------------------------
# OutOfGraphPrioritizedReplayBuffer
# ---------------------------------------------------------------------------

OBS = (3,)


def make_buffer(capacity: int = 10, **kwargs: object) -> OutOfGraphPrioritizedReplayBuffer:
    kwargs.setdefault("observation_dtype", np.float32)
    kwargs.setdefault("rng", SEED)
    return OutOfGraphPrioritizedReplayBuffer(OBS, 1, capacity, 4, **kwargs)  # type: ignore[arg-type]


def obs(i: int) -> np.ndarray:
    return np.full(OBS, i, dtype=np.float32)


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="replay_capacity` must cover update_horizon"):
        OutOfGraphPrioritizedReplayBuffer(OBS, 1, 1, 32)
    with pytest.raises(ValueError, match="stack_size = 7"):
        OutOfGraphPrioritizedReplayBuffer((84, 84), 4, 6, 32, update_horizon=3)
    with pytest.raises(ValueError, match="stack_size"):
        OutOfGraphPrioritizedReplayBuffer(OBS, 0, 100, 32)
    with pytest.raises(ValueError, match="update_horizon"):
        OutOfGraphPrioritizedReplayBuffer(OBS, 1, 100, 32, update_horizon=0)
    with pytest.raises(ValueError, match="gamma"):
        OutOfGraphPrioritizedReplayBuffer(OBS, 1, 100, 32, gamma=1.5)
    with pytest.raises(TypeError, match="observation_shape"):
        OutOfGraphPrioritizedReplayBuffer(4, 1, 100, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        OutOfGraphPrioritizedReplayBuffer(
            OBS, 1, 100, 32, extra_storage_types=[ReplayElement("indices", (), np.int32)]
        )


def test_defaults_match_dopamine() -> None:
    buf = OutOfGraphPrioritizedReplayBuffer(OBS, 1, 100, 32)
    names = [e.name for e in buf.get_transition_elements()]
    assert names == [
        "state",
        "action",
        "reward",
        "next_state",
        "next_action",
        "next_reward",
        "terminal",
        "indices",
        "sampling_probabilities",
    ]
    types = {e.name: np.dtype(e.type) for e in buf.get_transition_elements()}
    assert types["state"] == np.uint8 and types["action"] == np.int32
    assert types["reward"] == np.float32 and types["terminal"] == np.uint8
    assert types["indices"] == np.int32 and types["sampling_probabilities"] == np.float32
    assert buf.get_transition_elements()[0].shape == (32, 3, 1)
    assert buf.is_empty() and not buf.is_full() and buf.add_count == 0 and buf.cursor() == 0
    assert isinstance(buf.sum_tree, SumTree) and buf.sum_tree.capacity == 100


def test_add_with_priority_keyword_or_positional() -> None:
    buf = make_buffer()
    buf.add(obs(0), 0, 0.0, False, priority=2.5)
    assert buf.get_priority(np.array([0], dtype=np.int32)).tolist() == [2.5]
    buf.add(obs(1), 1, 1.0, False, 4.0)  # priority as the last positional argument
    assert buf.get_priority(np.array([1], np.int32)).tolist() == [4.0]
    # what Dopamine's agents give a new transition
    buf.add(obs(2), 2, 2.0, False, priority=buf.sum_tree.max_recorded_priority)
    assert buf.get_priority(np.array([2], np.int32)).tolist() == [4.0]
    assert buf.add_count == 3 and buf.cursor() == 3 and not buf.is_empty()
    # as in Dopamine, the prioritized buffer needs a priority
    with pytest.raises(ValueError, match="Add expects"):
        buf.add(obs(3), 3, 3.0, False)
    assert buf.add_count == 3


def test_add_errors_change_nothing() -> None:
    buf = make_buffer()
    buf.add(obs(0), 0, 0.0, False, priority=1.0)
    root = buf.sum_tree.root
    with pytest.raises(ValueError, match="shape"):
        buf.add(np.zeros(4), 0, 0.0, False, priority=1.0)
    with pytest.raises(ValueError, match="shape"):
        buf.add(obs(1), np.array([1, 2]), 0.0, False, priority=1.0)
    with pytest.raises(ValueError, match="Add expects"):
        buf.add(obs(1), 0, 0.0, False, 1.0, 2.0)
    with pytest.raises(ValueError, match="Add expects"):
        buf.add(obs(1), 0, 0.0, False, 1.0, priority=1.0)
    with pytest.raises(ValueError, match="nonnegative"):
        buf.add(obs(1), 0, 0.0, False, priority=-1.0)
    with pytest.raises(AssertionError):
        buf.add(obs(1), 0, 0.0, False, priority=-1.0)
    with pytest.raises(ValueError, match="finite"):
        buf.add(obs(1), 0, 0.0, False, priority=float("nan"))
    with pytest.raises(ValueError, match="scalar"):
        buf.add(obs(1), 0, 0.0, False, priority=np.ones(2))
    with pytest.raises(FieldTypeError):
        buf.add(obs(1), 0.5, 0.0, False, priority=1.0)  # 0.5 would be truncated to int32
    assert buf.add_count == 1
    assert buf.sum_tree.root == root
    assert buf.get_priority(np.array([1], np.int32)).tolist() == [0.0]


def test_sample_transition_batch_contents_and_order() -> None:
    buf = make_buffer(capacity=10)
    for i in range(6):
        buf.add(obs(i), i, 10.0 + i, i == 3, priority=float(i + 1))
    idx = np.array([0, 3, 4, 2])
    batch = buf.sample_transition_batch(indices=idx)
    elements = buf.get_transition_elements(4)
    assert len(batch) == len(elements) == 9
    for element, array in zip(elements, batch, strict=True):
        assert array.shape == element.shape, element.name
        assert array.dtype == np.dtype(element.type), element.name
    state, action, reward, next_state, next_action, next_reward, terminal, indices, probs = batch
    np.testing.assert_array_equal(state[:, :, 0], np.repeat(idx[:, None], 3, axis=1))
    np.testing.assert_array_equal(next_state[:, :, 0], np.repeat(idx[:, None] + 1, 3, axis=1))
    np.testing.assert_array_equal(action, idx)
    np.testing.assert_array_equal(reward, 10.0 + idx)
    np.testing.assert_array_equal(next_action, idx + 1)
    np.testing.assert_array_equal(next_reward, 11.0 + idx)
    np.testing.assert_array_equal(terminal, (idx == 3).astype(np.uint8))
    np.testing.assert_array_equal(indices, idx)
    np.testing.assert_array_equal(probs, idx + 1.0)  # Dopamine's name for the raw priorities
    # copies: writing into the batch leaves the buffer alone
    state[:] = -1
    again = buf.sample_transition_batch(indices=idx)
    np.testing.assert_array_equal(again[0][:, 0, 0], idx)

    sampled = buf.sample_transition_batch()
    assert sampled[0].shape == (4, 3, 1)  # the constructor's batch_size
    assert buf.sample_transition_batch(batch_size=7)[7].shape == (7,)


def test_sample_transition_batch_explicit_indices_checked() -> None:
    buf = make_buffer(capacity=10)
    for i in range(5):
        buf.add(obs(i), i, 0.0, False, priority=1.0)
    with pytest.raises(InvalidIndexError, match="valid"):
        buf.sample_transition_batch(indices=[0, 4])  # 4 is the newest: no successor yet
    with pytest.raises(InvalidIndexError):
        buf.sample_transition_batch(indices=[7])  # never written
    with pytest.raises(IndexError):
        buf.sample_transition_batch(indices=[10])
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample_transition_batch(batch_size=3, indices=[0, 1])


def test_extra_storage_types() -> None:
    extras = [ReplayElement("mask", [2], np.float32), ("step", [], np.int64)]
    buf = OutOfGraphPrioritizedReplayBuffer(
        OBS, 1, 10, 2, extra_storage_types=extras, observation_dtype=np.float32, rng=SEED
    )
    for i in range(4):
        buf.add(obs(i), i, 0.0, False, np.array([i, -i], np.float32), i * 100, priority=1.0)
    buf.add(obs(4), 4, 0.0, False, np.zeros(2), 400, 2.0)  # priority after the extras
    assert buf.get_priority(np.array([4], np.int32)).tolist() == [2.0]
    names = [e.name for e in buf.get_transition_elements()]
    assert names[8:] == ["mask", "step", "sampling_probabilities"]
    batch = buf.sample_transition_batch(indices=np.array([1, 2]))
    np.testing.assert_array_equal(batch[8], [[1.0, -1.0], [2.0, -2.0]])
    np.testing.assert_array_equal(batch[9], [100, 200])
    with pytest.raises(ValueError, match="Add expects"):
        buf.add(obs(5), 5, 0.0, False, priority=1.0)  # extras missing


def test_sample_index_batch_returns_only_valid_indices() -> None:
    buf = make_buffer(capacity=12, max_sample_attempts=10_000)
    rng = np.random.default_rng(SEED)
    for step in range(40):  # wraps around the ring more than three times
        terminal = step % 9 == 8
        cut = step % 7 == 6 and not terminal  # an episode cut short (a timeout)
        buf.add(obs(step), step % 4, 1.0, terminal, priority=float(rng.uniform(0.1, 5.0)),
                episode_end=cut)  # fmt: skip
        if buf.add_count < 2:
            continue
        newest = (buf.add_count - 1) % 12
        for _ in range(5):
            idx = buf.sample_index_batch(16)
            assert idx.dtype == np.int32 and idx.shape == (16,)
            assert all(buf.is_valid_transition(int(i)) for i in idx)
            assert newest not in idx
            if buf.is_full():
                assert buf.cursor() not in idx
            # the batch reads without complaint
            buf.sample_transition_batch(indices=idx)


def test_validity_rules() -> None:
    buf = make_buffer(capacity=6)
    buf.add(obs(0), 0, 0.0, False, priority=1.0)
    buf.add(obs(1), 0, 0.0, False, priority=1.0, episode_end=True)  # timeout: cut short
    buf.add(obs(2), 0, 0.0, True, priority=1.0)  # terminal: a valid transition
    buf.add(obs(3), 0, 0.0, False, priority=1.0)
    assert [buf.is_valid_transition(i) for i in range(6)] == [
        True,
        False,  # its successor belongs to the next episode
        True,
        False,  # the newest
        False,  # never written
        False,
    ]
    for i in range(4, 8):
        buf.add(obs(i), 0, 0.0, False, priority=1.0)
    # full: the newest (slot 1) and the slot at the cursor (slot 2) are invalid
    assert buf.is_full() and buf.cursor() == 2
    assert [buf.is_valid_transition(i) for i in range(6)] == [True, False, False] + [True] * 3
    assert not buf.is_valid_transition(-1) and not buf.is_valid_transition(6)


def test_sample_index_batch_errors() -> None:
    buf = make_buffer(capacity=10, max_sample_attempts=5)
    with pytest.raises(EmptyBufferError):
        buf.sample_index_batch(4)
    with pytest.raises(Exception, match="empty"):  # Dopamine raises a bare Exception
        buf.sample_transition_batch()
    buf.add(obs(0), 0, 0.0, False, priority=0.0)
    with pytest.raises(ZeroPriorityError):
        buf.sample_index_batch(4)
    buf.set_priority(np.array([0], np.int32), np.array([1.0]))
    with pytest.raises(RuntimeError, match="fewer than"):
        buf.sample_index_batch(4)
    with pytest.raises(ValueError):
        buf.sample_index_batch(-1)
    # only the newest (invalid) transition has mass: the redraws run out
    for i in range(1, 5):
        buf.add(obs(i), 0, 0.0, False, priority=0.0)
    buf.set_priority(np.array([0, 4], np.int32), np.array([0.0, 1.0]))
    state = buf.sum_tree.rng.bit_generator.state
    with pytest.raises(RuntimeError, match="Max sample attempts"):
        buf.sample_index_batch(4)
    assert buf.sum_tree.rng.bit_generator.state == state  # a failed call draws nothing
    assert buf.sample_index_batch(0).shape == (0,)


def test_set_and_get_priority_round_trip() -> None:
    buf = make_buffer(capacity=10)
    for i in range(8):
        buf.add(obs(i), i, 0.0, False, priority=1.0)
    idx = np.array([1, 5, 7], dtype=np.int32)
    buf.set_priority(idx, np.array([0.5, 2.0, 8.0], dtype=np.float32))
    out = buf.get_priority(idx)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0.5, 2.0, 8.0])
    assert buf.sum_tree.max_recorded_priority == 8.0
    buf.set_priority(np.array([3, 3], np.int32), [4.0, 6.0])  # the last duplicate wins
    assert buf.get_priority(np.array([3], np.int32)).tolist() == [6.0]
    assert buf.get_priority(np.array([9], np.int32)).tolist() == [0.0]  # never written
    root = buf.sum_tree.root
    with pytest.raises(ValueError, match="nonnegative"):
        buf.set_priority(np.array([1, 2], np.int32), np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="one entry per index"):
        buf.set_priority(np.array([1, 2], np.int32), np.array([1.0]))
    with pytest.raises(IndexError):
        buf.set_priority(np.array([10], np.int32), np.array([1.0]))
    with pytest.raises(IndexError):
        buf.get_priority(np.array([-1], np.int32))
    with pytest.raises(AssertionError):  # Dopamine asserts that indices are an array
        buf.get_priority(3)
    with pytest.raises(ValueError, match="1-D"):
        buf.set_priority(3, 1.0)
    assert buf.sum_tree.root == root
    np.testing.assert_array_equal(buf.get_priority(idx), [0.5, 2.0, 8.0])


def test_zero_priority_transition_is_not_sampled() -> None:
    buf = make_buffer(capacity=100, max_sample_attempts=10)
    buf.add(obs(0), 0, 0.0, 0, priority=0.0)
    for i in range(1, 4):
        buf.add(obs(i), 0, 0.0, 1, priority=1.0)
    for _ in range(100):
        terminals = buf.sample_transition_batch(batch_size=2)[6]
        assert (terminals == 1).all()


def test_sampling_frequencies_follow_priorities() -> None:
    capacity = 20
    buf = make_buffer(capacity=capacity, max_sample_attempts=100_000)
    rng = np.random.default_rng(SEED)
    priorities = rng.uniform(0.2, 5.0, size=capacity + 3)
    priorities[5] = 0.0
    for i in range(capacity + 3):  # full, wrapped: cursor at 3
        buf.add(obs(i), 0, 0.0, False, priority=float(priorities[i]), episode_end=i == 10)
    slot_priority = buf.get_priority(np.arange(capacity, dtype=np.int32)).astype(np.float64)
    valid = np.array([buf.is_valid_transition(i) for i in range(capacity)])
    assert not valid[[2, 3, 10]].any()  # newest, cursor, cut short
    draws = np.concatenate([buf.sample_index_batch(64) for _ in range(300)])
    counts = np.bincount(draws, minlength=capacity)
    assert counts[~valid].sum() == 0
    assert counts[5] == 0  # zero priority: never drawn
    keep = valid & (slot_priority > 0)
    assert chi2_pvalue(counts[keep], slot_priority[keep]) > P_MIN


def test_seeded_buffers_sample_alike() -> None:
    def run(seed: int) -> np.ndarray:
        buf = make_buffer(capacity=16, rng=seed)
        for i in range(16):
            buf.add(obs(i), 0, 0.0, False, priority=float(i % 5))
        return np.concatenate([buf.sample_index_batch(8) for _ in range(10)])

    np.testing.assert_array_equal(run(3), run(3))
    assert not np.array_equal(run(3), run(4))


def test_imports_stay_light() -> None:
    code = textwrap.dedent(
        """
        import sys
        import fastper
        assert "fastper.compat" not in sys.modules, "import fastper pulled in fastper.compat"
        import fastper.compat.dopamine
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                       {"tensorflow", "jax", "jaxlib", "gin", "torch"})
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
