"""Sampling distributions, reported probabilities and IS weights.

Frequencies are checked with a chi-square goodness-of-fit test. Every buffer
is seeded (seed 0 unless a test says otherwise, never chosen to make a test
pass), so each p-value is deterministic; the threshold 1e-3 would fail by
chance about once in a thousand honest seeds. Cells are sized so every
expected count is >= 5. ``test_wrong_distribution_is_rejected`` shows that the
same machinery rejects a wrong hypothesis, so these tests can fail.

Stratified draws vary less than independent ones (one draw per slice of the
mass), so their p-values sit near 1: the test is conservative there, but a
wrong expectation is still rejected outright.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import fastper
from tests.oracles import proportional_probs, rank_probs

FIELDS = {"x": ((), np.float32)}
N_DRAWS = 500_000
BATCH = 1_000
P_MIN = 1e-3
SEED = 0
# four decades of priorities over a non-power-of-two number of slots
WIDE = np.random.default_rng(SEED).permutation(np.geomspace(1e-3, 1e1, 60))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _data(k: int, start: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + k, dtype=np.float32)}


def _draw(buf, n_draws: int = N_DRAWS, batch: int = BATCH):
    """Counts per slot over ``n_draws`` draws, plus every batch drawn."""
    counts = np.zeros(len(buf), dtype=np.int64)
    batches = []
    for _ in range(n_draws // batch):
        s = buf.sample(batch)
        assert s.indices.min() >= 0 and s.indices.max() < len(buf)
        counts += np.bincount(s.indices, minlength=len(buf))
        batches.append(s)
    return counts, batches


def _gof(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` against ``probs`` (cells with P=0 must be empty)."""
    probs = np.asarray(probs, dtype=np.float64)
    assert counts.shape == probs.shape
    assert np.isclose(probs.sum(), 1.0, rtol=1e-12)
    assert counts[probs == 0].sum() == 0, "a zero-probability cell was drawn"
    live = probs > 0
    if live.sum() == 1:  # a single possible cell: the emptiness check above is the test
        return 1.0
    expected = probs[live] * counts.sum()
    assert expected.min() >= 5, f"test design: expected count {expected.min():.2f} < 5"
    return float(chisquare(counts[live], expected).pvalue)


def _positive_power(p: np.ndarray, alpha: float) -> np.ndarray:
    """P(i) proportional to p_i^alpha over positive p only (zero p is never drawn)."""
    w = np.where(p > 0, np.power(np.where(p > 0, p, 1.0), alpha), 0.0)
    return w / w.sum()


def _expected_weights(full_p: np.ndarray, idx: np.ndarray, beta: float, norm: str) -> np.ndarray:
    """w_i = (N P(i))^-beta, normalised over the buffer, the batch, or not at all."""
    n = full_p.shape[0]
    live = full_p > 0
    w_all = np.full(n, np.nan)
    w_all[live] = np.power(n * full_p[live], -beta)
    w = w_all[idx]
    if norm == "buffer":
        return w / w_all[live].max()
    if norm == "batch":
        return w / w.max()
    return w


def _slice_probs(mass: np.ndarray, b: int) -> np.ndarray:
    """(b, len(mass)): P(position j | draw k) when draw k is uniform on the k-th 1/b of the mass."""
    hi = np.cumsum(mass)
    lo = hi - mass
    total = hi[-1]
    out = np.empty((b, mass.shape[0]))
    for k in range(b):
        a, z = k * total / b, (k + 1) * total / b
        out[k] = np.clip(np.minimum(hi, z) - np.maximum(lo, a), 0.0, None) / (total / b)
    return out


def _prop_buffer(p, alpha, **kw):
    buf = fastper.PrioritizedReplayBuffer(p.shape[0], FIELDS, alpha=alpha, seed=SEED, **kw)
    buf.add(_data(p.shape[0]), priorities=p)
    return buf


# ---------------------------------------------------------------------------
# proportional
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_proportional_frequencies(alpha, stratified):
    buf = _prop_buffer(WIDE, alpha, stratified=stratified)
    probs = proportional_probs(WIDE, alpha)
    counts, batches = _draw(buf)
    assert _gof(counts, probs) > P_MIN
    for s in batches[:20]:
        np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-9)
    np.testing.assert_allclose(buf.probabilities(np.arange(60)), probs, rtol=1e-9)


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_wrong_distribution_is_rejected(stratified):
    """The same test rejects a wrong hypothesis: uniform, or the wrong alpha."""
    buf = _prop_buffer(WIDE, 1.0, stratified=stratified)
    counts, _ = _draw(buf)
    assert _gof(counts, proportional_probs(WIDE, 1.0)) > P_MIN
    assert _gof(counts, np.full(60, 1 / 60)) < 1e-12
    assert _gof(counts, proportional_probs(WIDE, 0.9)) < 1e-12
    # a single mislabelled slot pair is also caught
    swapped = proportional_probs(WIDE, 1.0)
    i, j = int(np.argmax(swapped)), int(np.argsort(swapped)[30])
    swapped[[i, j]] = swapped[[j, i]]
    assert _gof(counts, swapped) < 1e-12


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_zero_priority_slots_are_never_sampled(alpha, stratified):
    """README: a proportional buffer never returns a zero-priority slot (eps=0, td=0)."""
    p = np.geomspace(1e-2, 1e1, 40)
    p[[0, 7, 13, 39]] = 0.0
    buf = _prop_buffer(p, alpha, eps=0.0, stratified=stratified)
    buf.update_priorities([3, 21], [0.0, -0.0])  # |td| + eps = 0
    p[[3, 21]] = 0.0
    zero = np.flatnonzero(p == 0)
    np.testing.assert_array_equal(buf.priorities(np.arange(40)), p)
    counts, batches = _draw(buf, n_draws=200_000)
    assert counts[zero].sum() == 0, f"zero-priority slots drawn: {counts[zero]}"
    np.testing.assert_array_equal(buf.probabilities(zero), 0.0)
    probs = _positive_power(p, alpha)
    assert _gof(counts, probs) > P_MIN
    for s in batches[:10]:
        np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-9)
        np.testing.assert_allclose(
            s.weights, _expected_weights(probs, s.indices, 0.4, "buffer"), rtol=1e-9
        )


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_all_zero_priorities_raise(alpha):
    buf = _prop_buffer(np.zeros(10), alpha, eps=0.0)
    with pytest.raises(fastper.ZeroPriorityError):
        buf.sample(4)


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_proportional_wrapped_ring_non_power_of_two(stratified):
    """Capacity 100 (tree of 128 leaves), 250 transitions written: the ring wrapped twice."""
    cap, alpha = 100, 0.6
    rng = np.random.default_rng(SEED)
    buf = fastper.PrioritizedReplayBuffer(
        cap, FIELDS, alpha=alpha, seed=SEED, stratified=stratified
    )
    expected_p = np.zeros(cap)
    written = 0
    for k in (70, 60, 90, 30):  # 250 in all, batches straddle the end of the ring
        p = 10 ** rng.uniform(-2, 1, size=k)
        slots = buf.add(_data(k, written), priorities=p)
        np.testing.assert_array_equal(slots, (written + np.arange(k)) % cap)
        expected_p[slots] = p
        written += k
    assert len(buf) == cap and buf.total_added == 250
    np.testing.assert_array_equal(buf.priorities(np.arange(cap)), expected_p)
    np.testing.assert_array_equal(buf.keys(np.arange(cap)), 150 + (np.arange(cap) - 50) % cap)
    probs = proportional_probs(expected_p, alpha)
    counts, batches = _draw(buf)
    assert _gof(counts, probs) > P_MIN
    s = batches[0]
    np.testing.assert_array_equal(s["x"], s.keys.astype(np.float32))  # data belongs to the key
    np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-9)


# ---------------------------------------------------------------------------
# IS weights and reported probabilities (both prioritized buffers)
# ---------------------------------------------------------------------------


def _prioritized_after_updates(kind: str, norm: str):
    rng = np.random.default_rng(SEED)
    cls = (
        fastper.PrioritizedReplayBuffer if kind == "proportional" else fastper.RankBasedReplayBuffer
    )
    buf = cls(90, FIELDS, alpha=0.7, beta=0.55, weight_norm=norm, seed=SEED)
    buf.add(_data(90))
    raw = np.ones(90)
    for _ in range(6):
        s = buf.sample(32)
        td = rng.choice([0.05, 0.3, 1.0, 4.0, 20.0], size=32) * rng.choice([-1, 1], size=32)
        buf.update_priorities(s.indices, td)
        for i, t in zip(s.indices, td, strict=True):
            raw[i] = abs(t) + 1e-6
    np.testing.assert_array_equal(buf.priorities(np.arange(90)), raw)
    oracle = proportional_probs if kind == "proportional" else rank_probs
    return buf, oracle(raw, 0.7)


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("kind", ["proportional", "rank"])
def test_importance_weights_and_probabilities(kind, norm):
    buf, probs = _prioritized_after_updates(kind, norm)
    np.testing.assert_allclose(buf.probabilities(np.arange(90)), probs, rtol=1e-9)
    for beta in (None, 0.0, 1.0, 2.5):
        for _ in range(5):
            s = buf.sample(64, beta=beta)
            b = 0.55 if beta is None else beta
            np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-9)
            np.testing.assert_allclose(
                s.weights, _expected_weights(probs, s.indices, b, norm), rtol=1e-9
            )
            if norm != "none":
                assert s.weights.max() <= 1.0 + 1e-12
            if norm == "batch":
                assert s.weights.max() == pytest.approx(1.0, rel=1e-12)


# ---------------------------------------------------------------------------
# rank-based
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_rank_exact_matches_oracle_after_updates(stratified):
    """Ties (many equal priorities) are broken by the smaller slot index."""
    rng = np.random.default_rng(SEED)
    cap, alpha = 120, 0.7
    buf = fastper.RankBasedReplayBuffer(
        cap, FIELDS, alpha=alpha, eps=0.0, stratified=stratified, seed=SEED
    )
    buf.add(_data(cap))
    raw = np.ones(cap)  # all tied at the initial max priority
    for _ in range(5):
        s = buf.sample(40)
        td = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0], size=40)
        buf.update_priorities(s.indices, td, keys=s.keys)
        for i, t in zip(s.indices, td, strict=True):
            raw[i] = t
    assert len(np.unique(raw)) < 6  # heavy ties by construction
    probs = rank_probs(raw, alpha)
    ranks = buf.ranks(np.arange(cap))
    np.testing.assert_array_equal(np.sort(ranks), np.arange(1, cap + 1))
    expected_ranks = np.empty(cap, dtype=np.int64)
    expected_ranks[np.lexsort((np.arange(cap), -raw))] = np.arange(1, cap + 1)
    np.testing.assert_array_equal(ranks, expected_ranks)
    np.testing.assert_allclose(buf.probabilities(np.arange(cap)), probs, rtol=1e-9)
    counts, batches = _draw(buf)
    assert _gof(counts, probs) > P_MIN
    for s in batches[:20]:
        np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-9)


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_rank_segments_match_reported_probabilities(stratified):
    cap, b, beta = 100, 20, 0.5
    rng = np.random.default_rng(SEED)
    p = rng.permutation(np.geomspace(1e-3, 1e2, cap))
    buf = fastper.RankBasedReplayBuffer(
        cap, FIELDS, alpha=0.7, beta=beta, segments=True, stratified=stratified, seed=SEED
    )
    buf.add(_data(cap), priorities=p)
    reported = np.full(cap, np.nan)
    counts = np.zeros(cap, dtype=np.int64)
    kept = []
    for _ in range(200_000 // b):
        s = buf.sample(b)
        counts += np.bincount(s.indices, minlength=cap)
        seen = ~np.isnan(reported[s.indices])
        # each slot's reported probability is the same whenever it is drawn
        np.testing.assert_array_equal(reported[s.indices][seen], s.probabilities[seen])
        reported[s.indices] = s.probabilities
        if len(kept) < 100:
            kept.append(s)
    assert not np.isnan(reported).any(), "some slot was never drawn"
    assert reported.sum() == pytest.approx(1.0, rel=1e-12)
    # probabilities are 1 / (B * len(segment)) for integer segment lengths
    lengths = np.rint(1.0 / (b * reported)).astype(np.int64)
    np.testing.assert_allclose(reported, 1.0 / (b * lengths), rtol=1e-12)
    assert _gof(counts, reported) > P_MIN
    # higher priority never gets a smaller probability (segments follow rank order)
    by_rank = reported[np.argsort(-p, kind="stable")]
    assert np.all(np.diff(by_rank) <= 0)
    # IS weights of the segment scheme, normalised by the buffer-wide largest weight
    for s in kept:
        np.testing.assert_allclose(
            s.weights, _expected_weights(reported, s.indices, beta, "buffer"), rtol=1e-9
        )


# ---------------------------------------------------------------------------
# stratification: draw k lands in the k-th 1/B slice of the cumulative mass
# ---------------------------------------------------------------------------


def _check_slices(buf, slot_of_position: np.ndarray, mass: np.ndarray, b: int, n_batches: int):
    """Per draw position k: support inside slice k, frequencies match the slice."""
    cond = _slice_probs(mass, b)  # over positions in cumulative order
    n = mass.shape[0]
    pos_of_slot = np.empty(n, dtype=np.int64)
    pos_of_slot[slot_of_position] = np.arange(n)
    draws = np.stack([pos_of_slot[buf.sample(b).indices] for _ in range(n_batches)])
    for k in range(b):
        counts = np.bincount(draws[:, k], minlength=n)
        outside = counts[cond[k] == 0].sum()
        assert outside == 0, f"draw {k} left its slice {outside} times"
        assert _gof(counts, cond[k]) > P_MIN


def test_stratified_proportional_slices():
    p = np.array([5.0, 1.0, 3.0, 7.0, 2.0, 6.0, 4.0, 8.0])  # total 36
    b = 5  # slice edges 7.2, 14.4, 21.6, 28.8 fall inside slots 2, 3, 5, 7
    buf = _prop_buffer(p, 1.0, shuffle=False)
    _check_slices(buf, np.arange(8), p, b, 20_000)


def test_stratified_rank_slices():
    p = np.array([0.3, 9.0, 1.0, 4.0, 0.1, 2.5, 7.0, 5.0, 0.7, 3.0, 6.0])
    b, alpha = 3, 0.7
    buf = fastper.RankBasedReplayBuffer(11, FIELDS, alpha=alpha, seed=SEED, shuffle=False)
    buf.add(_data(11), priorities=p)
    order = np.argsort(-p, kind="stable")  # slot at rank 1, 2, ...
    mass = np.arange(1, 12, dtype=np.float64) ** -alpha
    _check_slices(buf, order, mass, b, 20_000)


def test_stratified_uniform_slices():
    buf = fastper.ReplayBuffer(10, FIELDS, seed=SEED, shuffle=False)
    buf.add(_data(10))
    _check_slices(buf, np.arange(10), np.ones(10), 4, 20_000)


@pytest.mark.parametrize("kind", ["uniform", "proportional", "rank"])
def test_stratified_batches_come_back_in_random_order(kind):
    """Regression (batches were sorted by slot): shuffle=True (default) keeps one draw in
    each slice but hands the batch back in a uniformly random order."""
    n, b = 12, 4  # equal masses: slice j holds exactly the slots 3j .. 3j+2
    cls = {"uniform": fastper.ReplayBuffer, "proportional": fastper.PrioritizedReplayBuffer,
           "rank": fastper.RankBasedReplayBuffer}[kind]  # fmt: skip
    # alpha 0: every slot (and rank) weighs 1; uniform replay has no alpha
    buf = cls(n, FIELDS, seed=SEED, **({} if kind == "uniform" else {"alpha": 0.0}))
    buf.add(_data(n))
    slot_of_rank = np.arange(n)  # uniform and alpha 0: the law is uniform over slots
    where = np.zeros((b, b), dtype=np.int64)  # [slice, position]
    for _ in range(20_000):
        s = buf.sample(b)
        sl = slot_of_rank[s.indices] // 3
        assert sorted(sl.tolist()) == [0, 1, 2, 3]  # stratification kept
        where[sl, np.arange(b)] += 1
    for j in range(b):  # each slice's draw lands at each position 1/B of the time
        assert _gof(where[j], np.full(b, 1.0 / b)) > P_MIN
    # and the batch as a whole is not in slot order more often than 1/B! of the time
    ordered = sum(
        bool(np.all(np.diff(buf.sample(b).indices) >= 0)) for _ in range(2_400)
    )
    assert ordered < 2_400 * (1 / 24) + 4 * np.sqrt(2_400 / 24)


@pytest.mark.parametrize("kind", ["uniform", "proportional", "rank"])
def test_independent_draws_are_not_stratified(kind):
    """stratified=False: every draw position has the full distribution."""
    p = np.array([5.0, 1.0, 3.0, 7.0, 2.0, 6.0, 4.0, 8.0])
    cls = {
        "uniform": fastper.ReplayBuffer,
        "proportional": fastper.PrioritizedReplayBuffer,
        "rank": fastper.RankBasedReplayBuffer,
    }[kind]
    alpha = {} if kind == "uniform" else {"alpha": 1.0}
    buf = cls(8, FIELDS, stratified=False, seed=SEED, **alpha)
    buf.add(_data(8), priorities=p)
    full = {
        "uniform": np.full(8, 1 / 8),
        "proportional": proportional_probs(p, 1.0),
        "rank": rank_probs(p, 1.0),
    }[kind]
    draws = np.stack([buf.sample(4).indices for _ in range(20_000)])
    for k in (0, 3):
        assert _gof(np.bincount(draws[:, k], minlength=8), full) > P_MIN


# ---------------------------------------------------------------------------
# uniform
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_uniform_frequencies_wrapped_ring(stratified):
    cap = 150
    buf = fastper.ReplayBuffer(cap, FIELDS, stratified=stratified, seed=SEED)
    for start in range(0, 400, 80):
        buf.add(_data(80, start))
    assert len(buf) == cap and buf.total_added == 400
    buf.update_priorities(np.arange(10), np.full(10, 50.0))  # kept, but not used
    counts, batches = _draw(buf, n_draws=300_000)
    assert _gof(counts, np.full(cap, 1 / cap)) > P_MIN
    for s in batches[:20]:
        np.testing.assert_array_equal(s.probabilities, np.full(BATCH, 1 / cap))
        np.testing.assert_array_equal(s.weights, np.ones(BATCH))
        np.testing.assert_array_equal(s["x"], s.keys.astype(np.float32))


def test_uniform_partially_filled_never_draws_unwritten_slots():
    buf = fastper.ReplayBuffer(128, FIELDS, seed=SEED)
    buf.add(_data(37))
    counts, _ = _draw(buf, n_draws=200_000)  # asserts every index < len(buf)
    assert _gof(counts, np.full(37, 1 / 37)) > P_MIN
