"""Rank-based sampling draws ranks from the law it reports, after the tree has churned.

Each buffer first takes many rounds of sample + update with random TD errors
(keys move between leaves, leaves split, updates delete along the sample's
paths), then its priorities stay fixed while draws are counted per rank.
Ranks come from a naive oracle (a sort of the raw priorities, ties to the
smaller slot), not from the buffer. Chi-square goodness of fit at fixed
seeds, threshold 1e-3 (see ``test_sampling_distributions.py``); every
expected count is >= 5. ``test_a_wrong_law_is_rejected`` shows the test can
fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import fastper

FIELDS = {"x": ((), np.float32)}
CAPACITY = 3000
ALPHA = 0.7
BATCH = 250
N_DRAWS = 150_000
P_MIN = 1e-3


def _churned(seed: int, **kwargs) -> fastper.RankBasedReplayBuffer:
    """A full buffer after 300 rounds of sample + update (and some wrapping adds)."""
    rng = np.random.default_rng(seed)
    buf = fastper.RankBasedReplayBuffer(CAPACITY, FIELDS, alpha=ALPHA, seed=seed, **kwargs)
    buf.add({"x": np.zeros(CAPACITY, dtype=np.float32)})
    for i in range(300):
        s = buf.sample(BATCH)
        td = rng.choice([0.0, 0.5, 1.0, 2.0], size=BATCH)  # ties
        fresh = rng.random(BATCH) < 0.5
        td[fresh] = rng.exponential(size=int(fresh.sum()))
        buf.update_priorities(s.indices, td, keys=s.keys)
        if i % 50 == 0:
            buf.add({"x": np.zeros(7, dtype=np.float32)})  # wraps: new slots at max priority
    return buf


def _rank_counts(buf: fastper.RankBasedReplayBuffer) -> np.ndarray:
    """Draws per 0-based rank, the ranks taken from a sort of the raw priorities."""
    p = buf.priorities(np.arange(CAPACITY))
    rank_of = np.empty(CAPACITY, dtype=np.int64)
    rank_of[np.lexsort((np.arange(CAPACITY), -p))] = np.arange(CAPACITY)
    np.testing.assert_array_equal(buf.ranks(np.arange(CAPACITY)) - 1, rank_of)
    counts = np.zeros(CAPACITY, dtype=np.int64)
    for _ in range(N_DRAWS // BATCH):
        counts += np.bincount(rank_of[buf.sample(BATCH).indices], minlength=CAPACITY)
    return counts


def _pvalue(counts: np.ndarray, law: np.ndarray) -> float:
    assert np.isclose(law.sum(), 1.0, rtol=1e-12)
    expected = law * counts.sum()
    assert expected.min() >= 5, f"test design: expected count {expected.min():.2f} < 5"
    return float(chisquare(counts, expected).pvalue)


def _exact_law() -> np.ndarray:
    w = np.arange(1, CAPACITY + 1, dtype=np.float64) ** -ALPHA
    return w / w.sum()


def _segment_law(b: int) -> np.ndarray:
    """P(rank) when one rank is drawn uniformly in each of ``b`` segments of about
    equal mass, from the segment bounds recomputed here from the exact law."""
    cdf = np.cumsum(np.arange(1, CAPACITY + 1, dtype=np.float64) ** -ALPHA)
    raw = np.searchsorted(cdf, np.arange(1, b) * (cdf[-1] / b), side="right")
    j = np.arange(1, b)
    inner = j + np.minimum(np.maximum.accumulate(np.maximum(raw - j, 0)), CAPACITY - b)
    bounds = np.concatenate(([0], inner, [CAPACITY]))
    lengths = np.diff(bounds)
    return np.repeat(1.0 / (b * lengths), lengths)


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_exact_rank_law_after_churn(stratified):
    buf = _churned(11, stratified=stratified)
    law = _exact_law()
    np.testing.assert_allclose(
        buf.probabilities(np.arange(CAPACITY)),
        law[buf.ranks(np.arange(CAPACITY)) - 1],
        rtol=1e-9,
    )
    assert _pvalue(_rank_counts(buf), law) > P_MIN


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_segment_law_after_churn(stratified):
    buf = _churned(12, segments=True, stratified=stratified)
    law = _segment_law(BATCH)
    np.testing.assert_allclose(
        buf.probabilities(np.arange(CAPACITY)),
        law[buf.ranks(np.arange(CAPACITY)) - 1],
        rtol=1e-12,
    )
    assert _pvalue(_rank_counts(buf), law) > P_MIN


def test_deferred_sorting_draws_by_the_order_in_force():
    """With sort_every, draws follow the order last sorted, not the latest priorities."""
    buf = _churned(13, sort_every=10_000)
    sampler = buf._sampler
    assert sampler.n_changed > 0
    assert not np.array_equal(sampler.ranked[:CAPACITY], buf.priorities(np.arange(CAPACITY)))
    rank_of = np.empty(CAPACITY, dtype=np.int64)
    rank_of[np.lexsort((np.arange(CAPACITY), -sampler.ranked[:CAPACITY]))] = np.arange(CAPACITY)
    np.testing.assert_array_equal(buf.ranks(np.arange(CAPACITY)) - 1, rank_of)
    counts = np.zeros(CAPACITY, dtype=np.int64)
    for _ in range(N_DRAWS // BATCH):
        counts += np.bincount(rank_of[buf.sample(BATCH).indices], minlength=CAPACITY)
    assert _pvalue(counts, _exact_law()) > P_MIN
    buf.sort()
    assert sampler.n_changed == 0
    assert _pvalue(_rank_counts(buf), _exact_law()) > P_MIN


def test_a_wrong_law_is_rejected():
    buf = _churned(14)
    wrong = np.arange(1, CAPACITY + 1, dtype=np.float64) ** -(ALPHA * 1.05)
    assert _pvalue(_rank_counts(buf), wrong / wrong.sum()) < 1e-6
