"""The rank sampler's order-statistics B+ tree against a naive oracle.

The oracle is a sort: rank r (0-based) holds the r-th slot by (priority
descending, slot ascending), ``np.lexsort((slots, -priorities))``. Random
sequences of inserts, changes (with ties and zeros), clears, rebuilds and
deferred changes are applied to a :class:`RankSampler` and to the oracle;
the slot at every rank and the rank of every slot must agree exactly.
Small capacities force splits and pool compactions early.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastper
from fastper._kernels import rank as _rk
from fastper.samplers import RankSampler

FIELDS = {"x": ((), np.float32)}
CHOICES = np.array([0.0, 0.25, 1.0, 1.0, 2.0, 7.5])  # few values: many ties, and zeros


def oracle_order(p: np.ndarray) -> np.ndarray:
    """Slots by rank: larger priority first, ties to the smaller slot."""
    return np.lexsort((np.arange(p.shape[0]), -p))


def select(s: RankSampler, ranks: np.ndarray) -> np.ndarray:
    b = ranks.shape[0]
    out = np.empty(b, dtype=np.int64)
    spaths = np.empty(b * _rk.MAXH, dtype=np.int64)
    _rk.select(*s._tree, ranks.astype(np.int64), np.empty(b, np.int64), np.empty(b, np.int64),
               out, spaths, np.zeros(3, np.int64))  # fmt: skip
    return out


def check(s: RankSampler, n: int) -> None:
    """Select and rank agree with the oracle over slots ``0..n-1``."""
    assert s.m == n
    want = oracle_order(s.ranked[:n])
    np.testing.assert_array_equal(s.order, want)
    np.testing.assert_array_equal(select(s, np.arange(n)), want)
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[want] = np.arange(n)
    np.testing.assert_array_equal(s.ranks(np.arange(n, dtype=np.int64), n), rank_of)


def random_priorities(rng: np.random.Generator, k: int) -> np.ndarray:
    p = rng.choice(CHOICES, size=k)
    fresh = rng.random(k) < 0.4
    p[fresh] = rng.exponential(size=int(fresh.sum()))
    return p


@pytest.mark.parametrize("capacity", [1, 7, 64, 65, 500, 3000])
def test_random_operations_match_a_sort(capacity):
    rng = np.random.default_rng(capacity)
    s = RankSampler(capacity, 0.7)
    n = 0
    for step in range(120):
        op = rng.integers(10)
        if op < 3 and n < capacity:  # new transitions, one priority (add's default path)
            k = int(rng.integers(1, capacity - n + 1))
            s.write_run(n, k, float(rng.choice(CHOICES)))
            n += k
        elif op < 7 and n:  # changes, with duplicates
            k = int(rng.integers(1, 3 * capacity + 2))
            slots = rng.integers(0, n, k)
            s.write(slots, random_priorities(rng, k))
        elif op == 7 and n:  # a batch that keeps moving keys to the end: splits, compactions
            k = min(n, 200)
            slots = rng.choice(n, k, replace=False)
            low = float(s.raw[:n].min())
            s.write(slots, np.full(k, low * 0.5))
        elif op == 8 and rng.random() < 0.3:
            s.clear()
            n = 0
        elif op == 9 and n:
            s.reset_priorities(random_priorities(rng, n), n)
        np.testing.assert_array_equal(s.ranked[:n], s.raw[:n])
        assert (s.ranked[n:] == -1.0).all()
        if step % 5 == 0 or capacity < 100:
            check(s, n)
    check(s, n)


def test_compaction_keeps_the_order():
    """Keys pushed to the end over and over exhaust the leaf pool: compactions happen."""
    cap = 2000
    s = RankSampler(cap, 0.7)
    s.write_run(0, cap, 1.0)
    rng = np.random.default_rng(0)
    compactions = 0
    low = 1.0
    for _ in range(60):
        slots = rng.choice(cap, 100, replace=False)
        low *= 0.5
        used = int(s._meta[_rk.LEAVES])
        s.write(slots, np.full(100, low) * (1.0 + rng.random(100)))
        compactions += int(s._meta[_rk.LEAVES]) < used
    assert compactions >= 2
    check(s, cap)


def test_batched_write_equals_sequential_writes():
    rng = np.random.default_rng(1)
    cap = 1500
    batched, sequential = RankSampler(cap, 0.7), RankSampler(cap, 0.7)
    for s in (batched, sequential):
        s.write_run(0, cap, 1.0)
    for _ in range(20):
        slots = rng.integers(0, cap, 300)
        p = random_priorities(rng, 300)
        batched.write(slots, p)
        for i in range(300):
            sequential.write(slots[i : i + 1], p[i : i + 1])
        np.testing.assert_array_equal(batched.raw, sequential.raw)
        np.testing.assert_array_equal(batched.order, sequential.order)
    check(batched, cap)


def test_duplicates_in_one_write_last_wins():
    s = RankSampler(10, 1.0)
    s.write_run(0, 10, 1.0)
    s.write(np.array([3, 5, 3, 3, 5]), np.array([9.0, 0.5, 0.0, 4.0, 2.0]))
    assert s.raw[3] == 4.0 and s.raw[5] == 2.0
    assert s.order[:2].tolist() == [3, 5]
    check(s, 10)


def test_updates_of_sampled_slots_in_any_order():
    """An update after a sample deletes along the sample's paths; shuffled,
    partial and repeated index lists must give the same tree as the oracle."""
    rng = np.random.default_rng(2)
    cap = 4000
    s = RankSampler(cap, 0.7)
    s.write_run(0, cap, 1.0)
    s.write(np.arange(cap), rng.exponential(size=cap))
    for step in range(40):
        idx, _, _, _ = s.sample(rng.random(256), cap, 0.5, step % 2 == 0, 0, 0, cap)
        if step % 4 == 1:
            idx = idx[rng.random(256) < 0.7]  # entries dropped as stale
        elif step % 4 == 2:
            idx = np.concatenate([idx, idx[:20]])  # repeats
        idx = rng.permutation(idx)
        s.write(idx, rng.exponential(size=idx.shape[0]))
        if step == 20:  # a write that never sampled these slots, and one that splits
            s.write(rng.integers(0, cap, 300), np.full(300, 1e-9))
    check(s, cap)


def test_draws_match_searchsorted_on_the_prefix_sums():
    """The guide-table inversion is the exact inverse CDF, edges included."""
    rng = np.random.default_rng(3)
    for alpha in (0.0, 0.7, 1.0, 3.0, 60.0):  # 60: terms underflow, the prefix goes flat
        cap = 5000
        s = RankSampler(cap, alpha)
        s.write_run(0, cap, 1.0)
        for n in (1, 2, 37, cap):
            total = s.prefix[n - 1]
            u = np.concatenate(
                [rng.random(2000), [0.0, np.nextafter(1.0, 0.0)],
                 s.prefix[: min(n, 50)] / total]  # targets exactly at rank edges
            )  # fmt: skip
            u = u[u < 1.0]
            for stratified in (False, True):
                b = u.shape[0]
                t = (np.arange(b) + u) * (total / b) if stratified else u * total
                want = np.minimum(np.searchsorted(s.prefix[:n], t, side="right"), n - 1)
                idx, prob, _, _ = s.sample(u, n, 0.0, stratified, 2, 0, n)
                np.testing.assert_array_equal(idx, oracle_order(s.ranked)[want])
                np.testing.assert_allclose(prob, (want + 1.0) ** -alpha / total, rtol=1e-15)


# ---------------------------------------------------------------------------
# sort_every: deferred changes
# ---------------------------------------------------------------------------


def test_sort_every_defers_updates_but_not_new_slots():
    s = RankSampler(6, 1.0, sort_every=3)
    s.write_run(0, 4, 1.0)
    s.write(np.array([2]), np.array([5.0]))  # an update: deferred
    assert s.n_changed == 1 and s.pending[2]
    assert s.order.tolist() == [0, 1, 2, 3]
    s.write_run(4, 1, 9.0)  # a new slot: ranked at once
    s.write(np.array([5]), np.array([3.0]), new=True)  # add with explicit priorities
    assert s.order.tolist() == [4, 5, 0, 1, 2, 3]
    s.write(np.array([2]), np.array([4.0]))  # pending again: last value wins at the sort
    u = np.zeros(1)
    for _ in range(3):
        s.sample(u, 6, 0.0, True, 2, 0, 6)
        assert s.order.tolist() == [4, 5, 0, 1, 2, 3]
    s.sample(u, 6, 0.0, True, 2, 0, 6)  # the 4th sample comes after 3: sorted first
    assert s.order.tolist() == [4, 2, 5, 0, 1, 3]
    assert s.n_changed == 0 and not s.pending.any()
    check(s, 6)


def test_a_new_write_to_a_pending_slot_ranks_it_now():
    s = RankSampler(4, 1.0, sort_every=100)
    s.write_run(0, 4, 1.0)
    s.write(np.array([1]), np.array([0.1]))
    assert s.pending[1]
    s.write_run(1, 1, 8.0)  # the ring wrapped onto slot 1
    assert not s.pending[1] and s.n_changed == 0
    assert s.order.tolist() == [1, 0, 2, 3]
    s.sort(4)
    assert s.order.tolist() == [1, 0, 2, 3]


def test_rank_new_transition_after_wrap_ranks_by_its_priority_with_sort_every():
    """Bug: after the ring wrapped, a new transition kept the rank of the slot's
    previous occupant (drawn 0 times in 200 samples with the largest priority)."""
    cap = 64
    buf = fastper.RankBasedReplayBuffer(cap, FIELDS, sort_every=1000, seed=0)
    buf.add({"x": np.zeros(cap)}, priorities=np.linspace(1.0, 2.0, cap))
    for _ in range(5):  # move every slot's pending priority down, unsorted
        s = buf.sample(32)
        buf.update_priorities(s.indices, np.full(32, 0.01), keys=s.keys)
    slot = int(buf.add({"x": np.zeros(1)})[0])  # wraps onto slot 0: max priority
    assert buf.priorities([slot])[0] == buf.max_priority
    assert buf.ranks([slot])[0] == 1
    drawn = sum(int((buf.sample(32).indices == slot).sum()) for _ in range(200))
    assert drawn > 200 * 32 * buf.probabilities([slot])[0] / 2


def test_rank_segments_probabilities_report_the_segment_law():
    """Bug: probabilities() reported the exact rank law for a segments buffer
    (off by up to 0.6 from what sample drew)."""
    cap, b = 50, 8
    buf = fastper.RankBasedReplayBuffer(cap, FIELDS, segments=True, alpha=0.7, seed=1)
    buf.add({"x": np.zeros(cap)}, priorities=np.random.default_rng(1).permutation(cap) + 1.0)
    with pytest.raises(ValueError, match="`batch_size` must be given before the first sample"):
        buf.probabilities(np.arange(cap))
    every = np.arange(cap)
    by_b = buf.probabilities(every, batch_size=b)
    assert by_b.sum() == pytest.approx(1.0, rel=1e-12)
    s = buf.sample(b)
    np.testing.assert_array_equal(buf.probabilities(s.indices), s.probabilities)
    np.testing.assert_array_equal(buf.probabilities(every), by_b)
    # the law: rank r lies in segment j and is drawn with 1 / (B * len(segment j))
    sampler = buf._sampler
    bounds = sampler._bounds(cap, b)
    ranks = buf.ranks(every) - 1
    seg = np.searchsorted(bounds, ranks, side="right") - 1
    np.testing.assert_array_equal(by_b, 1.0 / (b * np.diff(bounds)[seg]))
    exact = (ranks + 1.0) ** -0.7 / sampler.prefix[cap - 1]
    assert np.abs(by_b - exact).max() > 0.01  # the two laws differ: the old report was wrong
    # another batch size is another law; the default follows the last sample
    np.testing.assert_array_equal(
        buf.probabilities(every, batch_size=5), 1.0 / (5 * np.diff(sampler._bounds(cap, 5))[
            np.searchsorted(sampler._bounds(cap, 5), ranks, side="right") - 1])
    )  # fmt: skip
    buf.sample(5)
    np.testing.assert_array_equal(buf.probabilities(every), buf.probabilities(every, 5))
    # more draws than items: exact draws, and exact probabilities
    np.testing.assert_allclose(buf.probabilities(every, batch_size=cap + 1), exact, rtol=1e-12)


def test_exact_buffers_ignore_batch_size():
    buf = fastper.RankBasedReplayBuffer(10, FIELDS, alpha=1.0, seed=0)
    buf.add({"x": np.zeros(10)}, priorities=np.arange(10.0))
    p = buf.probabilities(np.arange(10))
    np.testing.assert_array_equal(buf.probabilities(np.arange(10), batch_size=3), p)
    np.testing.assert_allclose(p[::-1], 1.0 / np.arange(1, 11) / (1.0 / np.arange(1, 11)).sum())


# ---------------------------------------------------------------------------
# state: state_dict / load_state_dict / reset_priorities
# ---------------------------------------------------------------------------


def _busy(sort_every: int | None = 4) -> RankSampler:
    rng = np.random.default_rng(5)
    s = RankSampler(40, 0.6, sort_every=sort_every)
    s.write_run(0, 30, 1.0)
    s.write(rng.integers(0, 30, 25), random_priorities(rng, 25))
    s.sample(rng.random(7), 30, 0.5, True, 0, 0, 30)
    s.write(rng.integers(0, 30, 9), random_priorities(rng, 9))
    return s


def test_state_dict_round_trip_restores_pending_changes():
    s = _busy()
    assert s.n_changed > 0
    state = s.state_dict(30)
    assert set(state) == set(RankSampler._STATE_KEYS)
    assert state["last_batch_size"] == 7 and state["samples_since_sort"] == 1
    t = RankSampler(40, 0.1, sort_every=4)
    t.load_state_dict(state, 30)
    assert t.alpha == 0.6
    np.testing.assert_array_equal(t.prefix, s.prefix)
    for name in ("raw", "ranked", "pending"):
        np.testing.assert_array_equal(getattr(t, name), getattr(s, name), err_msg=name)
    np.testing.assert_array_equal(t.order, s.order)
    u = np.random.default_rng(6).random(9)
    for a, b in zip(s.sample(u, 30, 0.5, True, 0, 0, 30), t.sample(u, 30, 0.5, True, 0, 0, 30),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    s.sort(30)
    t.sort(30)
    np.testing.assert_array_equal(t.order, s.order)
    check(t, 30)


BAD_STATES = {
    "missing": (lambda st: st.pop("pending_slots"), "missing=\\['pending_slots'\\]"),
    "unknown": (lambda st: st.update(extra=1), "unknown=\\['extra'\\]"),
    "alpha": (lambda st: st.update(alpha=float("nan")), "`alpha` must be a finite number"),
    "priorities": (
        lambda st: st.update(priorities=-st["priorities"] - 1.0),
        "`priorities` must be",
    ),
    "priorities-shape": (
        lambda st: st.update(priorities=st["priorities"][:-1]),
        "`priorities` must be",
    ),
    "slots-dtype": (
        lambda st: st.update(pending_slots=st["pending_slots"].astype(float)),
        "`pending_slots` must be a 1-D integer array",
    ),
    "slots-range": (
        lambda st: st.update(pending_slots=st["pending_slots"] + 100),
        "`pending_slots` must lie in \\[0, 30\\)",
    ),
    "slots-repeat": (
        lambda st: st.update(
            pending_slots=np.repeat(st["pending_slots"][:1], 2),
            pending_ranked=np.ones(2),
        ),
        "must not repeat a slot",
    ),
    "ranked-length": (
        lambda st: st.update(pending_ranked=st["pending_ranked"][:-1]),
        "`pending_ranked` must be",
    ),
    "since": (
        lambda st: st.update(samples_since_sort=-1),
        "`samples_since_sort` must be an int >= 0",
    ),
    "last": (
        lambda st: st.update(last_batch_size=0),
        "`last_batch_size` must be None or an int >= 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_load_state_dict_checks_everything_first(case):
    s = _busy()
    state = s.state_dict(30)
    edit, match = BAD_STATES[case]
    edit(state)
    t = _busy()
    before = {k: v.copy() for k, v in vars(t).items() if isinstance(v, np.ndarray)}
    meta = t._meta.copy()
    with pytest.raises(ValueError, match=match):
        t.load_state_dict(state, 30)
    for k, v in before.items():
        np.testing.assert_array_equal(getattr(t, k), v, err_msg=k)
    np.testing.assert_array_equal(t._meta, meta)


def test_exact_sampler_refuses_pending_changes():
    state = _busy().state_dict(30)
    with pytest.raises(ValueError, match="must be empty with sort_every=None"):
        RankSampler(40, 0.6).load_state_dict(state, 30)


def test_reset_priorities_rebuilds_and_drops_pending():
    s = _busy()
    p = np.random.default_rng(7).exponential(size=30)
    s.reset_priorities(p, 30)
    assert s.n_changed == 0 and not s.pending.any() and s.samples_since_sort == 0
    np.testing.assert_array_equal(s.raw[:30], p)
    check(s, 30)
    with pytest.raises(ValueError, match="`p` must be 30 finite float64 priorities"):
        s.reset_priorities(np.full(30, np.inf), 30)


def test_capacity_beyond_int32_is_refused_before_allocating():
    with pytest.raises(ValueError, match="`capacity` must be <= 2147483647"):
        RankSampler(2**31, 0.7)
