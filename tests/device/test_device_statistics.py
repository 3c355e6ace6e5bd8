"""Sampling distributions of the device buffers (CPU device, both back ends).

As in ``tests/statistical``: every buffer is seeded (seed 0, never chosen to make
a test pass), so each p-value is deterministic; the threshold 1e-3 would fail by
chance about once in a thousand honest seeds. Cells are sized so every expected
count is >= 5. Stratified draws vary less than independent ones, so their
p-values sit near 1 (the test is conservative there), but a wrong expectation is
still rejected outright: ``test_wrong_distributions_are_rejected`` runs the same
machinery on the same counts against wrong laws.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare, spearmanr

torch = pytest.importorskip("torch")
fd = pytest.importorskip("fastper.device")

from tests.oracles import proportional_probs  # noqa: E402

BACKENDS = ("torch", "numba")
FIELDS = {"x": ((), np.float32)}
SEED = 0
P_MIN = 1e-3
N_DRAWS = 200_000
BATCH = 200  # torch on a 2-core CPU is fastest per draw below its threading grain
ALPHA = 0.6
# six decades of priorities over 20 slots, in no particular order
WIDE = np.random.default_rng(SEED).permutation(np.geomspace(1e-3, 1e3, 20))


def _gof(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` against ``probs`` (every cell expected >= 5)."""
    probs = np.asarray(probs, dtype=np.float64)
    assert counts.shape == probs.shape
    assert np.isclose(probs.sum(), 1.0, rtol=1e-12)
    expected = probs * counts.sum()
    assert expected.min() >= 5, f"test design: expected count {expected.min():.2f} < 5"
    return float(chisquare(counts, expected).pvalue)


def _draw(buf, n_draws: int = N_DRAWS, batch: int = BATCH, check=None) -> np.ndarray:
    """Counts per slot over ``n_draws`` draws; ``check(batch)`` runs on every batch."""
    n = len(buf)
    counts = torch.zeros(n, dtype=torch.int64)
    for _ in range(n_draws // batch):
        s = buf.sample(batch)
        assert int(s.indices.min()) >= 0 and int(s.indices.max()) < n
        counts += torch.bincount(s.indices, minlength=n)
        if check is not None:
            check(s)
    return counts.numpy()


def _prop_buffer(backend: str, stratified: bool):
    buf = fd.DevicePrioritizedReplayBuffer(
        WIDE.shape[0], FIELDS, alpha=ALPHA, stratified=stratified, seed=SEED, backend=backend
    )
    buf.add({"x": np.arange(WIDE.shape[0], dtype=np.float32)}, priorities=WIDE)
    return buf


_COUNTS: dict = {}


def _proportional_counts(backend: str, stratified: bool) -> np.ndarray:
    """The draws of one configuration (shared with the negative control)."""
    key = (backend, stratified)
    if key not in _COUNTS:
        buf = _prop_buffer(backend, stratified)
        probs = proportional_probs(WIDE, ALPHA)

        def check(s) -> None:  # P(i) handed back with each draw is that of its index
            idx = s.indices.numpy()
            np.testing.assert_allclose(s.probabilities.numpy(), probs[idx], rtol=1e-12)

        _COUNTS[key] = _draw(buf, check=check)
    return _COUNTS[key]


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_proportional_frequencies(backend, stratified):
    probs = proportional_probs(WIDE, ALPHA)
    counts = _proportional_counts(backend, stratified)
    assert counts.sum() == N_DRAWS
    assert _gof(counts, probs) > P_MIN
    # every slot, the rarest (P ~ 9e-5) included, is drawn
    assert counts.min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_distributions_are_rejected(backend):
    counts = _proportional_counts(backend, False)
    n = WIDE.shape[0]
    assert _gof(counts, np.full(n, 1.0 / n)) < 1e-12  # uniform
    assert _gof(counts, proportional_probs(WIDE, 0.5)) < 1e-12  # a nearby alpha
    # a swap of two slots of neighbouring priority is detected too
    order = np.argsort(WIDE)
    swapped = WIDE.copy()
    swapped[order[-1]], swapped[order[-2]] = WIDE[order[-2]], WIDE[order[-1]]
    assert _gof(counts, proportional_probs(swapped, ALPHA)) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_probabilities_handed_back_are_those_of_the_index(backend):
    buf = _prop_buffer(backend, True)
    rng = np.random.default_rng(SEED)
    for _ in range(20):
        s = buf.sample(64)
        # (the numba tree's leaves hold its own p ** alpha: equal within an ulp or two)
        np.testing.assert_allclose(
            s.probabilities.numpy(), buf.probabilities(s.indices).numpy(), rtol=1e-14
        )
        # after an update, the next batch reports the new law
        td = torch.from_numpy(rng.uniform(0.0, 100.0, 64))
        buf.update_priorities(s.indices, td, keys=s.keys)
        p = buf.priorities(torch.arange(20)).numpy()
        probs = proportional_probs(p, ALPHA)
        s = buf.sample(64)
        np.testing.assert_allclose(s.probabilities.numpy(), probs[s.indices.numpy()], rtol=1e-12)


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_frequencies(backend, stratified):
    n = 37
    buf = fd.DeviceReplayBuffer(64, FIELDS, stratified=stratified, seed=SEED, backend=backend)
    buf.add({"x": np.arange(n, dtype=np.float32)})
    buf.update_priorities(np.arange(5), np.full(5, 1e3))  # kept, not used
    counts = _draw(buf, batch=BATCH - 1)
    assert counts.sum() == (N_DRAWS // (BATCH - 1)) * (BATCH - 1)
    assert _gof(counts, np.full(n, 1.0 / n)) > P_MIN
    # the control: the same counts against the law the priorities would give
    assert _gof(counts, proportional_probs(buf.priorities(range(n)).numpy(), 0.2)) < 1e-12


# ---------------------------------------------------------------------------
# batch order
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_shuffled_batches_come_in_random_order(backend):
    # equal priorities and batch == len: one draw in each slot's slice, so every batch
    # is a permutation of the slots; shuffled, the position of slot 0 is uniform
    n, n_batches = 32, 1_600
    buf = fd.DevicePrioritizedReplayBuffer(n, FIELDS, seed=SEED, backend=backend)
    buf.add({"x": np.arange(n, dtype=np.float32)})
    where = np.zeros(n, dtype=np.int64)
    positions, indices = [], []
    for _ in range(n_batches):
        idx = buf.sample(n).indices
        assert torch.equal(torch.sort(idx).values, torch.arange(n))
        where[int(torch.argmin(idx))] += 1
        if len(positions) < 200:
            positions.append(np.arange(n))
            indices.append(idx.numpy())
    assert _gof(where, np.full(n, 1.0 / n)) > P_MIN
    rho, p = spearmanr(np.concatenate(positions), np.concatenate(indices))
    assert abs(rho) < 0.05 and p > P_MIN
    # the control: the same statistics reject an unshuffled buffer (slot 0 always first)
    plain = fd.DevicePrioritizedReplayBuffer(n, FIELDS, shuffle=False, seed=SEED, backend=backend)
    plain.add({"x": np.arange(n, dtype=np.float32)})
    where = np.zeros(n, dtype=np.int64)
    for _ in range(200):
        idx = plain.sample(n).indices
        assert idx.tolist() == list(range(n))
        where[int(torch.argmin(idx))] += 1
    assert _gof(where, np.full(n, 1.0 / n)) < 1e-12


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unshuffled_batches_come_in_slice_order(backend, stratified):
    buf = fd.DevicePrioritizedReplayBuffer(
        20, FIELDS, alpha=ALPHA, shuffle=False, stratified=stratified, seed=SEED, backend=backend
    )
    buf.add({"x": np.arange(20, dtype=np.float32)}, priorities=WIDE)
    shuffled = fd.DevicePrioritizedReplayBuffer(
        20, FIELDS, alpha=ALPHA, stratified=stratified, seed=SEED, backend=backend
    )
    shuffled.add({"x": np.arange(20, dtype=np.float32)}, priorities=WIDE)
    unsorted = 0
    for _ in range(50):
        idx = buf.sample(64).indices
        if stratified:  # slice k lies left of slice k + 1: indices never decrease
            assert bool((idx[1:] >= idx[:-1]).all())
            assert spearmanr(np.arange(64), idx.numpy())[0] > 0.9
        other = shuffled.sample(64).indices
        unsorted += int(not bool((other[1:] >= other[:-1]).all()))
    assert unsorted == 50
    if not stratified:  # independent draws, unshuffled: the draws' own order, unsorted
        assert not bool((idx[1:] >= idx[:-1]).all())
