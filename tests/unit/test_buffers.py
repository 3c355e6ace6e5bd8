"""ReplayBuffer / PrioritizedReplayBuffer / RankBasedReplayBuffer behaviour."""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest
from scipy import stats

import fastper
from fastper import (
    EmptyBufferError,
    FieldTypeError,
    InvalidIndexError,
    PrioritizedReplayBuffer,
    RankBasedReplayBuffer,
    ReplayBuffer,
    SampleBatch,
    ZeroPriorityError,
    schedules,
)
from fastper.samplers import ProportionalSampler
from tests.conftest import CARTPOLE_FIELDS, make_batch
from tests.oracles import assert_same_state, proportional_probs, rank_probs, snapshot

ALL = [ReplayBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer]
PRIORITIZED = [PrioritizedReplayBuffer, RankBasedReplayBuffer]
all_buffers = pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
prioritized_buffers = pytest.mark.parametrize("cls", PRIORITIZED, ids=lambda c: c.__name__)


def make(cls, capacity: int = 16, n: int = 0, seed: int | None = 0, **kw):
    buf = cls(capacity, CARTPOLE_FIELDS, seed=seed, **kw)
    if n:
        buf.add(make_batch(n))
    return buf


def expected_probs(buf, alpha: float | None = None) -> np.ndarray:
    """P(i) over slots 0..len-1 computed in numpy from the public priorities."""
    n = len(buf)
    a = buf.alpha if alpha is None else alpha
    if isinstance(buf, ReplayBuffer):
        return np.full(n, 1.0 / n)
    p = buf.priorities(np.arange(n))
    if isinstance(buf, PrioritizedReplayBuffer):
        return proportional_probs(p, a)
    return rank_probs(p, a)


def assert_same_batch(a: SampleBatch, b: SampleBatch) -> None:
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.probabilities, b.probabilities)
    np.testing.assert_array_equal(a.keys, b.keys)
    assert a.data.keys() == b.data.keys()
    for k in a.data:
        np.testing.assert_array_equal(a.data[k], b.data[k])


def random_priorities(buf, seed: int = 1) -> np.ndarray:
    """Give every stored slot a distinct random priority via update_priorities."""
    rng = np.random.default_rng(seed)
    n = len(buf)
    td = rng.uniform(0.05, 3.0, size=n) * rng.choice([-1, 1], size=n)
    buf.update_priorities(np.arange(n), td)
    return buf.priorities(np.arange(n))


# --------------------------------------------------------------------------- basics


@all_buffers
def test_len_capacity_and_fields(cls) -> None:
    buf = make(cls, capacity=5)
    assert len(buf) == 0 and buf.capacity == 5
    assert set(buf.fields) == set(CARTPOLE_FIELDS)
    for size, added in [(3, 3), (5, 5), (5, 9)]:
        buf.add(make_batch(added - buf.total_added, start=buf.total_added))
        assert len(buf) == size
        assert buf.total_added == added
        assert buf.capacity == 5


@all_buffers
def test_add_returns_ring_slots(cls) -> None:
    buf = make(cls, capacity=4)
    np.testing.assert_array_equal(buf.add(make_batch(3)), [0, 1, 2])
    one = {k: v[0] for k, v in make_batch(1, start=3).items()}
    np.testing.assert_array_equal(buf.add(one), [3])
    np.testing.assert_array_equal(buf.add(make_batch(3, start=4)), [0, 1, 2])
    np.testing.assert_array_equal(buf.keys([0, 1, 2, 3]), [4, 5, 6, 3])


@all_buffers
def test_sample_batch_structure(cls) -> None:
    buf = make(cls, capacity=32, n=20)
    batch = buf.sample(8)
    assert isinstance(batch, SampleBatch)
    assert len(batch) == 8
    assert set(batch.data) == set(CARTPOLE_FIELDS)
    for name, (shape, dtype) in CARTPOLE_FIELDS.items():
        assert batch.data[name].shape == (8, *shape)
        assert batch.data[name].dtype == np.dtype(dtype)
    assert batch["obs"] is batch.data["obs"]
    assert batch.indices.dtype == np.int64 and batch.keys.dtype == np.int64
    assert batch.weights.dtype == np.float64 and batch.probabilities.dtype == np.float64
    assert ((batch.indices >= 0) & (batch.indices < 20)).all()
    # make_batch encodes the insertion counter in `reward`: data matches keys
    np.testing.assert_array_equal(batch["reward"], batch.keys)
    np.testing.assert_array_equal(batch.keys, buf.keys(batch.indices))
    np.testing.assert_array_equal(batch["obs"][:, 0], batch.indices)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.indices = np.zeros(8, dtype=np.int64)  # type: ignore[misc]
    # a sampled batch is made without the dataclass's __init__: it must hold what
    # that __init__ would set, every field with its default, and nothing else
    same = SampleBatch(
        batch.data, batch.indices, batch.weights, batch.probabilities, batch.keys, batch.beta
    )
    assert vars(batch).keys() == vars(same).keys() == {f.name for f in dataclasses.fields(same)}
    for f in dataclasses.fields(same):
        assert getattr(batch, f.name) is getattr(same, f.name)
    assert batch.staleness == 0 and batch.beta is not None


@all_buffers
def test_sample_data_is_a_copy(cls) -> None:
    buf = make(cls, capacity=8, n=8)
    batch = buf.sample(8)
    batch.data["obs"][:] = -7.0
    batch.data["reward"][:] = -7.0
    again = buf.sample(64)
    assert (again["obs"] >= 0).all() and (again["reward"] >= 0).all()


UNCHANGED_BY_SAMPLING = (
    "size",
    "cursor",
    "keys",
    "added",
    "max_priority",
    "stale",
    "alpha",
    "sampler/raw",
)


@all_buffers
def test_sampling_leaves_storage_and_priorities_unchanged(cls) -> None:
    buf = make(cls, capacity=16, n=12)
    random_priorities(buf)
    before = snapshot(buf)
    probs_before = buf.probabilities(np.arange(12))
    for b in (1, 5, 40):
        buf.sample(b)
    after = snapshot(buf)
    for key in before:
        if key.startswith("data/") or key in UNCHANGED_BY_SAMPLING:
            if isinstance(before[key], np.ndarray):
                np.testing.assert_array_equal(before[key], after[key], err_msg=key)
            else:
                assert before[key] == after[key], key
    np.testing.assert_array_equal(buf.probabilities(np.arange(12)), probs_before)
    assert buf.step == 3


@all_buffers
def test_batch_larger_than_len_samples_with_replacement(cls) -> None:
    buf = make(cls, capacity=16, n=3)
    batch = buf.sample(50)
    assert len(batch) == 50
    assert set(batch.indices.tolist()) == {0, 1, 2}


@all_buffers
@pytest.mark.parametrize("stratified", [True, False])
def test_empirical_frequencies_match_probabilities(cls, stratified) -> None:
    buf = make(cls, capacity=10, n=10, stratified=stratified, seed=123)
    random_priorities(buf, seed=5)
    probs = expected_probs(buf)
    np.testing.assert_allclose(buf.probabilities(np.arange(10)), probs, rtol=1e-12)
    counts = np.zeros(10)
    draws = 0
    for _ in range(100):
        batch = buf.sample(100)
        np.testing.assert_allclose(batch.probabilities, probs[batch.indices], rtol=1e-12)
        counts += np.bincount(batch.indices, minlength=10)
        draws += 100
    assert stats.chisquare(counts, probs * draws).pvalue > 1e-3


# --------------------------------------------------------------------------- priorities


@all_buffers
def test_new_items_get_max_priority_which_never_decreases(cls) -> None:
    buf = make(cls, capacity=8, eps=0.01)
    assert buf.max_priority == 1.0
    buf.add(make_batch(2))
    np.testing.assert_array_equal(buf.priorities([0, 1]), [1.0, 1.0])
    buf.update_priorities([0], [-4.0])
    assert buf.max_priority == pytest.approx(4.01)
    buf.add(make_batch(1, start=2))
    assert buf.priorities([2])[0] == pytest.approx(4.01)
    buf.update_priorities([0, 1, 2], [0.1, 0.2, 0.3])
    assert buf.max_priority == pytest.approx(4.01)
    buf.add(make_batch(1, start=3))
    np.testing.assert_allclose(buf.priorities([0, 1, 2, 3]), [0.11, 0.21, 0.31, 4.01])


@all_buffers
def test_add_with_given_priorities(cls) -> None:
    buf = make(cls, capacity=8)
    buf.add(make_batch(3), priorities=[0.5, 0.25, 0.75])
    np.testing.assert_array_equal(buf.priorities([0, 1, 2]), [0.5, 0.25, 0.75])
    assert buf.max_priority == 1.0
    buf.add(make_batch(2, start=3), priorities=np.array([3.0, 2.0]))
    assert buf.max_priority == 3.0
    buf.add({k: v[0] for k, v in make_batch(1, start=5).items()}, priorities=0.125)
    buf.add(make_batch(1, start=6))
    np.testing.assert_array_equal(buf.priorities(np.arange(7)), [0.5, 0.25, 0.75, 3, 2, 0.125, 3])


@all_buffers
def test_priority_is_clipped_td_plus_eps(cls) -> None:
    buf = make(cls, capacity=8, n=5, eps=0.01, clip=2.0)
    n = buf.update_priorities([0, 1, 2, 3, 4], [-3.0, 0.5, 0.0, -1.0, 2.0])
    assert n == 5
    np.testing.assert_allclose(buf.priorities(np.arange(5)), [2.01, 0.51, 0.01, 1.01, 2.01])
    assert buf.max_priority == pytest.approx(2.01)


@all_buffers
def test_update_priorities_duplicates_last_wins_like_sequential(cls) -> None:
    idx = [1, 2, 1, 3, 1, 0]
    td = [10.0, 2.0, 3.0, 4.0, 0.5, 7.0]
    vec = make(cls, capacity=8, n=6)
    seq = make(cls, capacity=8, n=6)
    assert vec.update_priorities(np.array(idx), np.array(td)) == 6
    for i, t in zip(idx, td, strict=True):
        seq.update_priorities([i], [t])
    np.testing.assert_allclose(vec.priorities([0, 1, 2, 3]), [7.0, 0.5, 2.0, 4.0], rtol=1e-5)
    assert_same_state(snapshot(vec), snapshot(seq))
    assert_same_batch(vec.sample(16), seq.sample(16))


def _bad_updates():
    # (indices, td_errors, keys, exception, match); slots 0..5 written, capacity 8
    return [
        ([0, 1, 2], [1.0, np.nan, 1.0], None, ValueError, "td_errors.*finite"),
        ([0, 1, 2], [1.0, 2.0, np.inf], None, ValueError, "td_errors.*finite"),
        ([0, 1, 8], [1.0, 2.0, 3.0], None, InvalidIndexError, r"must lie in \[0, 8\)"),
        ([0, -1], [1.0, 2.0], None, InvalidIndexError, r"must lie in \[0, 8\)"),
        ([0, 6], [1.0, 2.0], None, InvalidIndexError, "never-written"),
        ([0, 1, 2], [1.0, 2.0], None, ValueError, "must have 3 entries"),
        ([[0, 1]], [1.0, 2.0], None, ValueError, "1-D"),
        ([0.0, 1.0], [1.0, 2.0], None, TypeError, "integers"),
        ([0, 1], ["a", "b"], None, TypeError, "real numbers"),
        ([0, 1], [1.0, 2.0], [0], ValueError, "one entry per index"),
        ([0, 1], [1.0, 2.0], [0, 99], ValueError, "keys issued by this buffer"),
        ([0, 1], [1.0, 2.0], [0, -1], ValueError, "keys issued by this buffer"),
        ([0, 1], [1.0, 2.0], [0.0, 1.0], TypeError, "integers"),
    ]


@all_buffers
@pytest.mark.parametrize(("indices", "td", "keys", "exc", "match"), _bad_updates())
def test_bad_update_changes_nothing(cls, indices, td, keys, exc, match) -> None:
    buf = make(cls, capacity=8, n=6)
    twin = make(cls, capacity=8, n=6)
    for b in (buf, twin):
        b.update_priorities([0, 1, 2], [0.3, 0.6, 0.9])
    before = snapshot(buf)
    with pytest.raises(exc, match=match):
        buf.update_priorities(indices, td, keys=keys)
    assert_same_state(before, snapshot(buf))
    assert_same_batch(buf.sample(10), twin.sample(10))


def test_invalid_index_error_is_index_and_value_error() -> None:
    assert issubclass(InvalidIndexError, IndexError)
    assert issubclass(InvalidIndexError, ValueError)


@all_buffers
def test_priorities_and_keys_reject_unwritten_slots(cls) -> None:
    buf = make(cls, capacity=8, n=3)
    with pytest.raises(InvalidIndexError, match="never-written"):
        buf.priorities([3])
    with pytest.raises(InvalidIndexError, match="never-written"):
        buf.keys([0, 5])
    with pytest.raises(InvalidIndexError, match=r"\[0, 8\)"):
        buf.probabilities([8])
    np.testing.assert_array_equal(buf.keys(np.array([2, 0])), [2, 0])


# --------------------------------------------------------------------------- keys / staleness


@all_buffers
def test_stale_updates_dropped_fresh_applied(cls) -> None:
    buf = make(cls, capacity=4, n=4)
    old_keys = buf.keys([0, 1, 2, 3])
    np.testing.assert_array_equal(old_keys, [0, 1, 2, 3])
    buf.add(make_batch(2, start=4))  # overwrites slots 0 and 1
    np.testing.assert_array_equal(buf.keys([0, 1, 2, 3]), [4, 5, 2, 3])
    applied = buf.update_priorities([0, 1, 2, 3], [5.0, 6.0, 0.5, 0.25], keys=old_keys)
    assert applied == 2
    assert buf.stale_updates == 2
    np.testing.assert_allclose(buf.priorities([0, 1, 2, 3]), [1.0, 1.0, 0.5, 0.25], rtol=1e-5)
    # the dropped td errors did not raise the max priority
    assert buf.max_priority == 1.0
    # fresh keys are applied; counting accumulates
    assert buf.update_priorities([0, 3], [2.0, 3.0], keys=[4, 0]) == 1
    assert buf.stale_updates == 3
    np.testing.assert_allclose(buf.priorities([0, 3]), [2.0, 0.25], rtol=1e-5)


@all_buffers
def test_stale_updates_from_a_real_sample(cls) -> None:
    buf = make(cls, capacity=8, n=8, seed=3)
    batch = buf.sample(32)
    buf.add(make_batch(3, start=8))  # slots 0, 1, 2 now hold new transitions
    stale = np.isin(batch.indices, [0, 1, 2])
    assert stale.any() and (~stale).any()
    applied = buf.update_priorities(batch.indices, np.full(32, 0.5), keys=batch.keys)
    assert applied == int((~stale).sum())
    assert buf.stale_updates == int(stale.sum())
    np.testing.assert_array_equal(buf.priorities([0, 1, 2]), [1.0, 1.0, 1.0])
    touched = np.unique(batch.indices[~stale])
    np.testing.assert_allclose(buf.priorities(touched), 0.5 + 1e-6)


@all_buffers
def test_clear_keeps_key_counter_and_max_priority(cls) -> None:
    buf = make(cls, capacity=4, n=3)
    buf.update_priorities([1], [9.0])
    keys = buf.keys([0, 1, 2])
    buf.clear()
    assert len(buf) == 0 and buf.n_pending == 0
    with pytest.raises(EmptyBufferError):
        buf.sample(1)
    buf.add(make_batch(3, start=100))
    np.testing.assert_array_equal(buf.keys([0, 1, 2]), [3, 4, 5])
    assert buf.max_priority == pytest.approx(9.0 + 1e-6)
    assert buf.update_priorities([0, 1, 2], [1.0, 1.0, 1.0], keys=keys) == 0
    assert buf.stale_updates == 3


# --------------------------------------------------------------------------- IS weights


@prioritized_buffers
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_weights_buffer_norm_match_numpy(cls, beta) -> None:
    buf = make(cls, capacity=64, n=50, alpha=0.6, seed=7)
    random_priorities(buf)
    # one very low priority: almost never in the batch but defines the max weight
    buf.update_priorities([17], [1e-4])
    p = buf.priorities(np.arange(50))
    probs = expected_probs(buf)
    all_w = np.power(probs / probs.min(), -beta)
    assert all_w.max() == pytest.approx(1.0)
    batch = buf.sample(32, beta=beta)
    np.testing.assert_allclose(batch.probabilities, probs[batch.indices], rtol=1e-12)
    np.testing.assert_allclose(batch.weights, all_w[batch.indices], rtol=1e-10)
    if isinstance(buf, PrioritizedReplayBuffer):
        a = buf.alpha
        direct = np.power(p[batch.indices] ** a / np.min(p**a), -beta)
        np.testing.assert_allclose(batch.weights, direct, rtol=1e-10)
    assert (batch.weights <= 1.0 + 1e-12).all()
    if beta > 0 and 17 not in batch.indices:
        assert batch.weights.max() < 1.0  # normalised over the buffer, not the batch


@prioritized_buffers
def test_weights_batch_norm(cls) -> None:
    buf = make(cls, capacity=64, n=50, alpha=0.7, weight_norm="batch", seed=8)
    random_priorities(buf)
    probs = expected_probs(buf)
    batch = buf.sample(16, beta=0.5)
    expected = np.power(batch.probabilities / batch.probabilities.min(), -0.5)
    np.testing.assert_allclose(batch.weights, expected, rtol=1e-10)
    np.testing.assert_allclose(batch.probabilities, probs[batch.indices], rtol=1e-12)
    assert batch.weights.max() == pytest.approx(1.0, abs=1e-12)


@prioritized_buffers
def test_weights_no_norm(cls) -> None:
    buf = make(cls, capacity=64, n=50, alpha=0.5, weight_norm="none", seed=9)
    random_priorities(buf)
    probs = expected_probs(buf)
    batch = buf.sample(16, beta=0.8)
    np.testing.assert_allclose(batch.weights, np.power(50 * probs[batch.indices], -0.8), rtol=1e-10)
    assert batch.weights.max() > 1.0  # unnormalised: (N P)^-beta > 1 for rare items


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_proportional_without_buffer_norm_skips_the_min_tree(norm, tmp_path) -> None:
    # Only buffer-wide normalisation reads the min tree. Without it the tree is
    # not kept, yet draws, probabilities and the sum tree are bit for bit those
    # of a buffer that keeps it, through adds, updates, alpha changes and a
    # checkpoint.
    kw = {"capacity": 300, "alpha": 0.7, "beta": 0.6, "seed": 4}
    ref = PrioritizedReplayBuffer(**kw, fields=CARTPOLE_FIELDS, weight_norm="buffer")
    buf = PrioritizedReplayBuffer(**kw, fields=CARTPOLE_FIELDS, weight_norm=norm)
    rng = np.random.default_rng(5)
    for step in range(40):
        batch = make_batch(17, 17 * step)
        for b in (ref, buf):
            b.add(batch)
        got, want = buf.sample(32), ref.sample(32)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.probabilities, want.probabilities)
        np.testing.assert_array_equal(got.keys, want.keys)
        if norm == "batch":
            expected = np.power(got.probabilities / got.probabilities.min(), -0.6)
        else:
            expected = np.power(len(buf) * got.probabilities, -0.6)
        np.testing.assert_allclose(got.weights, expected, rtol=1e-12)
        td = rng.standard_normal(32) * (rng.random(32) < 0.9)  # some zero priorities too
        for b, s in ((ref, want), (buf, got)):
            b.update_priorities(s.indices, td, s.keys)
        if step == 20:
            for b in (ref, buf):
                b.set_alpha(0.5)
    sb, sr = buf._sampler, ref._sampler
    assert isinstance(sb, ProportionalSampler) and isinstance(sr, ProportionalSampler)
    assert not sb.track_min and sr.track_min
    np.testing.assert_array_equal(sb.leaves, sr.leaves)
    np.testing.assert_array_equal(sb.sinner, sr.sinner)
    assert sb.minner.size == 1 and buf.nbytes()["index"] < ref.nbytes()["index"]
    buf.save(tmp_path / "b.fpk")
    back = fastper.load(tmp_path / "b.fpk")
    assert not back._sampler.track_min
    np.testing.assert_array_equal(back._sampler.sinner, sb.sinner)
    np.testing.assert_array_equal(back.sample(32).indices, ref.sample(32).indices)


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
def test_uniform_weights_are_one(norm) -> None:
    buf = make(ReplayBuffer, capacity=16, n=10, weight_norm=norm, seed=0)
    random_priorities(buf)
    batch = buf.sample(12, beta=0.9)
    np.testing.assert_array_equal(batch.weights, np.ones(12))
    np.testing.assert_array_equal(batch.probabilities, np.full(12, 0.1))


@prioritized_buffers
def test_default_beta_and_beta_schedule(cls) -> None:
    buf = make(cls, capacity=32, n=20, beta=schedules.linear(0.0, 1.0, 4), seed=2)
    random_priorities(buf)
    probs = expected_probs(buf)
    for step in range(6):
        assert buf.step == step
        assert buf.beta == pytest.approx(min(step / 4, 1.0))
        batch = buf.sample(8)
        expected = np.power(probs[batch.indices] / probs.min(), -min(step / 4, 1.0))
        np.testing.assert_allclose(batch.weights, expected, rtol=1e-10)


# --------------------------------------------------------------------------- alpha changes


def _fresh_with(buf, alpha: float, seed: int = 0, **kw):
    n = len(buf)
    fresh = type(buf)(buf.capacity, CARTPOLE_FIELDS, alpha=alpha, seed=seed, **kw)
    fresh.add(make_batch(n), priorities=buf.priorities(np.arange(n)))
    return fresh


@prioritized_buffers
@pytest.mark.parametrize("new_alpha", [0.0, 0.3, 1.0, 1.7])
def test_set_alpha_reweights_exactly(cls, new_alpha) -> None:
    buf = make(cls, capacity=40, n=30, alpha=0.6, seed=4)
    random_priorities(buf)
    buf.update_priorities([3, 9, 3], [0.01, 8.0, 2.0])
    buf.set_alpha(new_alpha)
    assert buf.alpha == new_alpha
    fresh = _fresh_with(buf, new_alpha, seed=4)
    idx = np.arange(30)
    np.testing.assert_array_equal(buf.probabilities(idx), fresh.probabilities(idx))
    np.testing.assert_allclose(buf.probabilities(idx), expected_probs(buf, new_alpha), rtol=1e-12)
    assert_same_batch(buf.sample(25, beta=0.5), fresh.sample(25, beta=0.5))


@prioritized_buffers
def test_set_alpha_round_trip_is_bit_identical(cls) -> None:
    buf = make(cls, capacity=40, n=33, alpha=0.6, seed=4)
    random_priorities(buf)
    idx = np.arange(33)
    before = buf.probabilities(idx)
    buf.set_alpha(0.2)
    assert not np.array_equal(buf.probabilities(idx), before)
    buf.set_alpha(0.6)
    np.testing.assert_array_equal(buf.probabilities(idx), before)


@prioritized_buffers
def test_alpha_schedule_applies_at_step(cls) -> None:
    sched = schedules.step([2], [0.6, 0.2])
    buf = make(cls, capacity=32, n=20, alpha=sched, seed=6)
    random_priorities(buf)
    idx = np.arange(20)
    assert buf.alpha == 0.6
    buf.sample(4)
    buf.sample(4)
    assert buf.step == 2 and buf.alpha == 0.6
    batch = buf.sample(16)  # sampled at step 2 with alpha 0.2
    assert buf.alpha == 0.2
    fresh = _fresh_with(buf, 0.2)
    np.testing.assert_array_equal(buf.probabilities(idx), fresh.probabilities(idx))
    np.testing.assert_allclose(batch.probabilities, expected_probs(buf, 0.2)[batch.indices])
    # the step setter applies the schedule too, in both directions
    buf.step = 0
    assert buf.alpha == 0.6
    np.testing.assert_array_equal(buf.probabilities(idx), _fresh_with(buf, 0.6).probabilities(idx))
    buf.step = 10
    assert buf.alpha == 0.2


# --------------------------------------------------------------------------- seeding


def _drive(buf) -> list[SampleBatch]:
    out = []
    for i in range(6):
        buf.add(make_batch(5, start=5 * i))
        batch = buf.sample(7)
        out.append(batch)
        buf.update_priorities(batch.indices, np.linspace(0.1, 2.0, 7) * (i + 1), keys=batch.keys)
    return out


@all_buffers
def test_same_seed_same_samples(cls) -> None:
    a = _drive(make(cls, capacity=16, seed=42))
    b = _drive(make(cls, capacity=16, seed=42))
    for x, y in zip(a, b, strict=True):
        assert_same_batch(x, y)
    c = _drive(make(cls, capacity=16, seed=43))
    assert any(not np.array_equal(x.indices, z.indices) for x, z in zip(a, c, strict=True))


@all_buffers
def test_seed_none_and_bad_seed(cls) -> None:
    buf = make(cls, capacity=8, n=8, seed=None)
    assert len(buf.sample(4)) == 4
    with pytest.raises(ValueError, match="`seed` must be >= 0"):
        make(cls, seed=-1)
    with pytest.raises(TypeError, match="`seed` must be an integer"):
        make(cls, seed=1.5)


# --------------------------------------------------------------------------- failing calls


def _failing_calls():
    one = {k: v[0] for k, v in make_batch(1, start=50).items()}
    return [
        ("batch0", lambda b: b.sample(0), ValueError, "`batch_size` must be >= 1"),
        ("batch-1", lambda b: b.sample(-1), ValueError, "`batch_size` must be >= 1"),
        ("batch2.5", lambda b: b.sample(2.5), TypeError, "`batch_size` must be an integer"),
        ("batchTrue", lambda b: b.sample(True), TypeError, "`batch_size` must be an integer"),
        ("beta-neg", lambda b: b.sample(4, beta=-0.1), ValueError, "`beta` must be >= 0"),
        ("beta-nan", lambda b: b.sample(4, beta=math.nan), ValueError, "`beta` must be finite"),
        ("add-missing", lambda b: b.add({"obs": np.zeros(4)}), ValueError, "missing fields"),
        (
            "add-shape",
            lambda b: b.add({**one, "obs": np.zeros(3)}),
            ValueError,
            "field `obs` must have shape",
        ),
        (
            "add-cast",
            lambda b: b.add({**one, "action": 1.5}),
            FieldTypeError,
            "non-integral",
        ),
        ("add-empty", lambda b: b.add(make_batch(0)), ValueError, "must not be empty"),
        ("add-big", lambda b: b.add(make_batch(17)), ValueError, "must not exceed the capacity"),
        (
            "add-prio-len",
            lambda b: b.add(make_batch(2), priorities=[1.0]),
            ValueError,
            "`priorities` must have 2 entries",
        ),
        (
            "add-prio-neg",
            lambda b: b.add(make_batch(2), priorities=[1.0, -1.0]),
            ValueError,
            "`priorities` must be >= 0",
        ),
        (
            "add-prio-nan",
            lambda b: b.add(make_batch(2), priorities=[np.nan, 1.0]),
            ValueError,
            "`priorities` must be finite",
        ),
        ("update-nan", lambda b: b.update_priorities([0, 1], [1.0, np.nan]), ValueError, "finite"),
        ("set-alpha", lambda b: b.set_alpha(-0.5), ValueError, "`alpha` must be >= 0"),
        ("set-beta", lambda b: b.set_beta(-0.5), ValueError, "`beta` must be >= 0"),
        ("set-step", lambda b: setattr(b, "step", -1), ValueError, "`step` must be >= 0"),
    ]


@all_buffers
@pytest.mark.parametrize(
    ("name", "call", "exc", "match"), _failing_calls(), ids=[c[0] for c in _failing_calls()]
)
def test_raising_call_leaves_buffer_untouched(cls, name, call, exc, match) -> None:
    buf = make(cls, capacity=16, n=10, seed=11)
    twin = make(cls, capacity=16, n=10, seed=11)
    for b in (buf, twin):
        batch = b.sample(4)
        b.update_priorities(batch.indices, [0.5, 1.5, 2.5, 3.5], keys=batch.keys)
        b.add(make_batch(2, start=10))
    before = snapshot(buf)
    with pytest.raises(exc, match=match):
        call(buf)
    assert_same_state(before, snapshot(buf))
    assert_same_state(snapshot(twin), snapshot(buf))
    assert_same_batch(buf.sample(9), twin.sample(9))


@all_buffers
def test_empty_buffer_raises_and_changes_nothing(cls) -> None:
    buf = make(cls, capacity=8, seed=5)
    twin = make(cls, capacity=8, seed=5)
    before = snapshot(buf)
    with pytest.raises(EmptyBufferError, match="empty buffer"):
        buf.sample(4)
    assert_same_state(before, snapshot(buf))
    assert issubclass(EmptyBufferError, ValueError)
    for b in (buf, twin):
        b.add(make_batch(5))
    assert_same_batch(buf.sample(6), twin.sample(6))


def test_all_zero_priorities_raise_and_change_nothing() -> None:
    # an alpha schedule that changes at the failing step exercises the roll-back
    kw = dict(capacity=8, eps=0.0, alpha=schedules.step([1], [0.6, 0.3]), seed=5)
    buf = make(PrioritizedReplayBuffer, **kw)
    twin = make(PrioritizedReplayBuffer, **kw)
    for b in (buf, twin):
        b.add(make_batch(4))
        b.sample(3)
        b.update_priorities([0, 1, 2, 3], [0.0, 0.0, 0.0, 0.0])
    before = snapshot(buf)
    assert buf.alpha == 0.6
    with pytest.raises(ZeroPriorityError, match="all 4 stored priorities are zero"):
        buf.sample(4)
    assert_same_state(before, snapshot(buf))
    assert buf.alpha == 0.6
    for b in (buf, twin):
        b.update_priorities([1, 3], [1.0, 2.0])
    batch = buf.sample(8)
    assert_same_batch(batch, twin.sample(8))
    assert set(batch.indices.tolist()) <= {1, 3}


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.0])
def test_zero_priority_slots_are_never_drawn(alpha) -> None:
    buf = make(PrioritizedReplayBuffer, capacity=8, eps=0.0, alpha=alpha, seed=0)
    buf.add(make_batch(4), priorities=[0.0, 1.0, 0.0, 2.0])
    for batch in (buf.sample(200), buf.sample(1)):
        assert set(batch.indices.tolist()) <= {1, 3}
    np.testing.assert_array_equal(buf.probabilities([0, 2]), [0.0, 0.0])


@pytest.mark.parametrize("alpha", [0.6, 0.0])
def test_all_zero_priorities_raise_for_any_alpha(alpha) -> None:
    buf = make(PrioritizedReplayBuffer, capacity=8, eps=0.0, alpha=alpha, seed=0)
    buf.add(make_batch(3), priorities=[0.0, 0.0, 0.0])
    with pytest.raises(ZeroPriorityError, match="priorities are zero"):
        buf.sample(2)


# --------------------------------------------------------------------------- construction


@all_buffers
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"capacity": 0}, ValueError, "`capacity` must be >= 1"),
        ({"eps": -1e-3}, ValueError, "`eps` must be >= 0"),
        ({"clip": -1.0}, ValueError, "`clip` must be >= 0"),
        ({"alpha": -0.1}, ValueError, "`alpha` must be >= 0"),
        ({"beta": -0.1}, ValueError, "`beta` must be >= 0"),
        ({"weight_norm": "max"}, ValueError, "`weight_norm` must be one of"),
        ({"stratified": 1}, TypeError, "`stratified` must be a bool"),
        ({"gamma": 1.5}, ValueError, "`gamma` must be <= 1"),
    ],
)
def test_bad_construction(cls, kwargs, exc, match) -> None:
    kw = {"capacity": 8, **kwargs}
    capacity = kw.pop("capacity")
    if cls is ReplayBuffer and "alpha" in kw:  # uniform replay refuses any alpha
        match = "`alpha` has no effect on uniform replay"
    with pytest.raises(exc, match=match):
        cls(capacity, CARTPOLE_FIELDS, **kw)


def test_uniform_replay_refuses_alpha() -> None:
    with pytest.raises(ValueError, match="`alpha` has no effect on uniform replay"):
        ReplayBuffer(8, CARTPOLE_FIELDS, alpha=0.6)


# --------------------------------------------------------------------------- threads


@all_buffers
def test_threads_adding_while_sampling_and_updating(cls) -> None:
    capacity, n_writers, n_adds = 128, 4, 40
    buf = make(cls, capacity=capacity, n=8, seed=0)
    errors: list[BaseException] = []
    counts = {"applied": 0, "attempted": 0}
    start = threading.Barrier(n_writers + 1)

    def writer(tid: int) -> None:
        try:
            start.wait()
            for s in range(n_adds):
                obs = np.array([[tid, s, j, 0] for j in range(2)], dtype=np.float32)
                buf.add({**make_batch(2), "obs": obs, "reward": np.full(2, -1.0)})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def learner() -> None:
        try:
            rng = np.random.default_rng(0)
            start.wait()
            for _ in range(60):
                batch = buf.sample(16)
                assert len(batch) == 16
                assert (batch.indices < len(buf)).all()
                counts["attempted"] += 16
                counts["applied"] += buf.update_priorities(
                    batch.indices, rng.uniform(0.1, 2.0, 16), keys=batch.keys
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_writers)]
    threads.append(threading.Thread(target=learner))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    total = 8 + n_writers * n_adds * 2
    assert buf.total_added == total
    assert len(buf) == capacity
    keys = buf.keys(np.arange(capacity))
    np.testing.assert_array_equal(keys % capacity, np.arange(capacity))
    np.testing.assert_array_equal(np.sort(keys), np.arange(total - capacity, total))
    assert counts["applied"] + buf.stale_updates == counts["attempted"]
    # within one writer, later (seq, j) got later keys; each add of 2 got consecutive keys
    stored = buf._storage.columns["obs"]
    from_writers = buf._storage.columns["reward"] == -1.0
    for tid in range(n_writers):
        mine = np.flatnonzero((stored[:, 0] == tid) & from_writers)
        order = mine[np.argsort(keys[mine])]
        seq = stored[order, 1] * 2 + stored[order, 2]
        assert (np.diff(seq) > 0).all()
        pairs = {}
        for slot in mine:
            pairs.setdefault(int(stored[slot, 1]), []).append(int(keys[slot]))
        for ks in pairs.values():
            if len(ks) == 2:
                assert abs(ks[0] - ks[1]) == 1


@prioritized_buffers
def test_set_alpha_and_set_beta_accept_schedules(cls) -> None:
    buf = make(cls, capacity=16, n=10, seed=0)
    random_priorities(buf)
    buf.step = 5
    buf.set_alpha(schedules.linear(1.0, 0.0, 10))
    assert buf.alpha == pytest.approx(0.5)
    np.testing.assert_allclose(buf.probabilities(np.arange(10)), expected_probs(buf, 0.5))
    buf.set_beta(schedules.step([6], [0.2, 0.9]))
    assert buf.beta == 0.2
    buf.sample(2)
    assert buf.step == 6 and buf.beta == 0.9
    before = snapshot(buf)
    with pytest.raises(ValueError, match="`alpha` must be >= 0"):
        buf.set_alpha(schedules.linear(1.0, -1.0, 6))  # -1.0 at the current step
    assert_same_state(before, snapshot(buf))
