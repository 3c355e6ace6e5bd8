"""The rank tree's building blocks: bit and vector operations, tombstone leaves,
recorded paths across splits, and the fused update and sampling kernels.

The whole-tree oracle checks (select and rank against a sort) are in
``test_rank_structure.py``; here each new piece is checked on its own, and a
walk over the tree's arrays checks every invariant the kernels rely on.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

import fastper
from fastper import policy
from fastper._kernels import rank as _rk
from fastper._kernels import rank_bits as rb
from fastper.sampler_base import NO_PERM as _NO_PERM
from fastper.sampler_base import NO_ROWS as _NO_ROWS
from fastper.sampler_base import Sampler, normalised_weights
from fastper.samplers import RankSampler
from tests.unit.test_rank_structure import CHOICES, oracle_order, select

MASK64 = (1 << 64) - 1


def bits_of(word: int) -> list[int]:
    u = int(word) & MASK64
    return [j for j in range(64) if (u >> j) & 1]


# ---------------------------------------------------------------------------
# bit and vector operations
# ---------------------------------------------------------------------------


@njit
def _bit_ops(xs, out):  # pragma: no cover - compiled
    for i in range(xs.shape[0]):
        x = xs[i]
        out[i, 0] = rb.popcount(x)
        out[i, 1] = rb.ctz(x)
        out[i, 2] = rb.clz(x)
        out[i, 3] = rb.lshr(x, i % 64)
        out[i, 4] = rb.low_bits(i % 65)


@njit
def _select_bit(x, r):  # pragma: no cover - compiled
    return rb.select_bit(x, r)


def test_bit_operations_match_python_integers():
    rng = np.random.default_rng(0)
    xs = rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64)
    xs[:5] = [0, -1, 1, -(2**63), 2**63 - 1]
    out = np.empty((300, 5), dtype=np.int64)
    _bit_ops(xs, out)
    for i, x in enumerate(xs):
        u = int(x) & MASK64
        on = bits_of(x)
        assert out[i, 0] == len(on)
        assert out[i, 1] == (on[0] if on else 64)
        assert out[i, 2] == (63 - on[-1] if on else 64)
        assert int(out[i, 3]) & MASK64 == u >> (i % 64)
        assert int(out[i, 4]) & MASK64 == (1 << (i % 65)) - 1
    for x in xs[1:40]:
        for r, pos in enumerate(bits_of(x)):
            assert _select_bit(x, r) == pos


def _mask_kernel(name: str):  # noqa: ANN202 - a compiled test helper
    fn = getattr(rb, name)

    @njit
    def call(arr, base, x):  # pragma: no cover - compiled
        return fn(arr, base, x)

    return call


@pytest.mark.parametrize("n", [16, 32, 64])
def test_vector_compares_and_child_search_match_numpy(n):
    rng = np.random.default_rng(n)
    gt, eq, le = (_mask_kernel(f"{op}{n}") for op in ("gt", "eq", "le"))
    child = _mask_kernel(f"child_at{n}")
    vals = np.round(rng.random(4 * n), 1)  # ties
    vals[5] = -np.inf
    vals[6] = np.inf
    slots = rng.integers(0, 10, 4 * n).astype(np.int32)
    for base in (0, n, 2 * n):
        for x in (0.0, 0.3, 0.55, 1.0):
            assert bits_of(gt(vals, base, x)) == [j for j in range(n) if vals[base + j] > x]
            assert bits_of(eq(vals, base, x)) == [j for j in range(n) if vals[base + j] == x]
        assert bits_of(le(slots, base, 4)) == [j for j in range(n) if slots[base + j] <= 4]
    counts = np.zeros(2 * n, dtype=np.int32)
    for _ in range(200):
        k = int(rng.integers(1, n + 1))
        counts[:] = 0
        counts[n : n + k] = rng.integers(0, 6, k)  # zeros: empty leaves are skipped
        total = int(counts.sum())
        if not total:
            continue
        r = int(rng.integers(0, total))
        running = np.cumsum(counts[n:])
        j = int((running <= r).sum())
        assert child(counts, n, r) == (j, int(running[j - 1]) if j else 0)


# ---------------------------------------------------------------------------
# the tree's invariants, walked in Python
# ---------------------------------------------------------------------------


def check_invariants(s: RankSampler, n: int) -> None:
    """Every invariant the kernels rely on, over the tree of ``s`` (slots 0..n-1)."""
    meta, lp, ls, lm, ip, isl, ic, ich, inn = s._tree
    leaf_w, fan = _rk.L, _rk.F
    seen: list[tuple[float, int]] = []

    def walk(node: int, level: int, lo: tuple[float, int] | None, hi: tuple[float, int] | None):
        """Live keys under ``node``, checking counts and ranges; ``lo``/``hi``: its range."""
        total = 0
        k = int(inn[node])
        assert 1 <= k <= fan
        assert ip[node * fan] == np.inf  # separator 0
        for j in range(fan):
            q = node * fan + j
            if j >= k:
                assert ip[q] == -np.inf and ic[q] == 0  # unused positions
                continue
            c_lo = lo if j == 0 else (float(ip[q]), int(isl[q]))
            c_hi = hi if j == k - 1 else (float(ip[q + 1]), int(isl[q + 1]))
            if level == 1:
                got = walk_leaf(int(ich[q]), c_lo, c_hi)
            else:
                got = walk(int(ich[q]), level - 1, c_lo, c_hi)
            assert ic[q] == got, "a count differs from the live keys under it"
            total += got
        return total

    def before(a: tuple[float, int], b: tuple[float, int]) -> bool:
        return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])

    def walk_leaf(leaf: int, lo, hi) -> int:
        base = leaf * leaf_w
        live = bits_of(lm[leaf])
        used = [j for j in range(leaf_w) if lp[base + j] != -np.inf]
        assert used == list(range(len(used))), "unused positions must be the last ones"
        assert set(live) <= set(used)
        keys = [(float(lp[base + j]), int(ls[base + j])) for j in used]
        for a, b in zip(keys, keys[1:], strict=False):
            assert not before(b, a), "keys in use must be sorted, dead ones included"
        for j in live:
            key = keys[j]
            assert lo is None or not before(key, lo), "a live key before its leaf's range"
            assert hi is None or before(key, hi), "a live key past its leaf's range"
            seen.append(key)
        return len(live)

    size = walk(int(meta[_rk.ROOT]), int(meta[_rk.HEIGHT]), None, None)
    assert size == meta[_rk.SIZE] == len(seen)
    ranked = s.ranked[:n]
    want = {(float(ranked[i]), i) for i in range(n) if ranked[i] >= 0}
    assert set(seen) == want, "the live keys must be exactly (ranked priority, slot)"
    assert len(seen) == len(want)
    np.testing.assert_array_equal(
        s.order, oracle_order(np.where(ranked >= 0, ranked, -1.0))[: len(want)]
    )




def _priorities(rng: np.random.Generator, k: int) -> np.ndarray:
    p = rng.choice(CHOICES, size=k)
    fresh = rng.random(k) < 0.4
    p[fresh] = rng.exponential(size=int(fresh.sum()))
    return p


@pytest.mark.parametrize("capacity", [40, 700, 5000])
def test_random_operations_keep_every_invariant(capacity):
    """Writes, draws then updates of the drawn slots (recorded paths), removals
    (tombstones), re-insertions of a removed key with the same priority,
    deferred changes and compactions, each followed by the invariant walk."""
    rng = np.random.default_rng(capacity)
    s = RankSampler(capacity, 0.7)
    d = RankSampler(capacity, 0.7, sort_every=3)
    for t in (s, d):
        t.write_run(0, capacity, 1.0)
    for step in range(60):
        op = step % 6
        for t in (s, d):
            if op == 0:  # a draw, then an update of its slots: deletes along the paths
                idx, _, _, _ = t.sample(rng.random(64), capacity, 0.5, True, 0, 0, capacity)
                t.write(rng.permutation(idx), _priorities(rng, idx.shape[0]))
            elif op == 1:  # many changes: splits, and compactions at small capacities
                slots = rng.integers(0, capacity, 3 * capacity // 2)
                t.write(slots, _priorities(rng, slots.shape[0]))
            elif op == 2 and t is s:  # tombstones, then the same keys back
                gone = np.unique(rng.integers(0, capacity, max(1, capacity // 10)))
                old = t.raw[gone].copy()
                t.invalidate(gone, capacity)
                check_invariants(t, capacity)
                t.write(gone, old, new=True)  # the dead key's twin comes back
            elif op == 3:  # a draw, then splits, then the update of the drawn slots
                idx, _, _, _ = t.sample(rng.random(32), capacity, 0.5, False, 0, 0, capacity)
                others = rng.integers(0, capacity, capacity)
                t.write(others, np.full(capacity, 1e-9 * (step + 1)))
                t.write(idx, _priorities(rng, idx.shape[0]))
            elif op == 4:
                t.write_run(int(rng.integers(0, capacity)), 1, float(rng.choice(CHOICES)))
            else:
                t.sort(capacity)
            check_invariants(t, capacity)
    for t in (s, d):
        t.sort(capacity)
        check_invariants(t, capacity)
        want = oracle_order(t.ranked[:capacity])
        np.testing.assert_array_equal(select(t, np.arange(capacity)), want)


def test_a_removed_key_inserted_again_is_found_among_its_dead_twins():
    s = RankSampler(64, 1.0)
    s.write_run(0, 64, 1.0)  # every key equal: ties by slot
    for _ in range(3):
        s.invalidate(np.array([5, 9]), 64)
        s.write(np.array([5, 9]), np.array([1.0, 1.0]), new=True)
    s.write(np.array([5]), np.array([2.0]))  # deletes the live (1.0, 5) only
    check_invariants(s, 64)
    assert s.order[:2].tolist() == [5, 0]
    np.testing.assert_array_equal(s.ranks(np.array([5, 9, 10]), 64), [0, 9, 10])


def test_compaction_drops_tombstones():
    s = RankSampler(300, 0.7)
    s.write_run(0, 300, 1.0)
    s.invalidate(np.arange(0, 300, 2), 300)
    _rk.compact(*s._tree)
    meta, lp, ls, lm, *_ = s._tree
    for leaf in range(int(meta[_rk.LEAVES])):
        used = int((lp[leaf * _rk.L : (leaf + 1) * _rk.L] != -np.inf).sum())
        assert bits_of(lm[leaf]) == list(range(used))  # every used position live
    check_invariants(s, 300)


def test_deferred_changes_that_need_several_compactions(monkeypatch):
    """Re-ranking every slot at once can exhaust the node pools more than once."""
    cap = 3000
    rng = np.random.default_rng(4)
    s = RankSampler(cap, 0.7, sort_every=10**6)
    s.write_run(0, cap, 1.0)
    for r in range(6):  # new transitions (ranked at once) pushed to the end: splits
        s.write(rng.permutation(cap), np.full(cap, 0.5 ** (r + 1)), new=True)
    s.write(np.arange(cap), rng.choice([0.0, 0.5, 1.0, 2.0], size=cap))
    assert s.n_changed == cap
    calls = []
    compact = _rk.compact
    monkeypatch.setattr(_rk, "compact", lambda *t: calls.append(1) or compact(*t))
    s.sort(cap)
    assert len(calls) >= 2
    assert s.n_changed == 0
    check_invariants(s, cap)


# ---------------------------------------------------------------------------
# the fused kernels against the shared rules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_sampled_weights_are_the_shared_rule_bit_for_bit(norm):
    rng = np.random.default_rng(norm)
    s = RankSampler(4000, 0.7)
    s.write(np.arange(4000), rng.exponential(size=4000), new=True)
    for n in (1, 3, 4000):
        for beta in (0.0, 0.4, 1.0, 1.7):
            idx, prob, w, keys = s.sample(rng.random(300), n, beta, True, norm, 7, 4000 + 7)
            pmin = float(n) ** (-s.alpha) / s.prefix[n - 1]
            np.testing.assert_array_equal(w, normalised_weights(prob, 1.0, pmin, n, beta, norm))
            np.testing.assert_array_equal(
                w, policy.is_weights(prob, 1.0, pmin, n, beta, policy.NORMS[norm])
            )
            np.testing.assert_array_equal(keys, idx + 7)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("norm", [0, 1, 2])
def test_permuted_draw_equals_the_draw_indexed_by_the_permutation(segments, stratified, norm):
    """The rank sampler orders its batch as the proportional one does: a given
    ``perm``, or (``shuffle``) the batch order of B more uniforms, computed in the
    same call; every output is the plain draw's indexed by it, bit for bit, and the
    draw's recorded paths still serve the update after it."""
    rng = np.random.default_rng(11 + norm)
    cap = 3000
    s = RankSampler(cap, 0.7, segments=segments)
    s.write(np.arange(cap), rng.exponential(size=cap), new=True)
    rows = np.zeros(cap * 24, np.uint8)  # records to prefetch: a hint, the same outputs
    for b in (2, 3, 256):
        u = rng.random(b)
        perm = rng.permutation(b)
        plain = s.sample(u, cap, 0.4, stratified, norm, 7, cap + 7)
        permuted = s.sample_permuted(u, perm, cap, 0.4, stratified, norm, 7, cap + 7)
        for a, p in zip(plain, permuted, strict=True):
            np.testing.assert_array_equal(a[perm], p)
        perm.flags.writeable = False  # a read-only order is read, never written
        again = s.sample_permuted(u, perm, cap, 0.4, stratified, norm, 7, cap + 7)
        for a, p in zip(permuted, again, strict=True):
            np.testing.assert_array_equal(a, p)
        v = rng.random(b)
        shuffled = s.sample_permuted(
            np.concatenate((u, v)), _NO_PERM, cap, 0.4, stratified, norm, 7, cap + 7, rows, 24,
            shuffle=True,
        )  # fmt: skip
        order = policy.batch_order(v)
        for a, p in zip(plain, shuffled, strict=True):
            np.testing.assert_array_equal(a[order], p)
        # the update of the shuffled draw's slots goes along its recorded paths
        idx = shuffled[0]
        new_p = rng.exponential(size=b)
        s.write(idx, new_p)
        last = {int(i): float(p) for i, p in zip(idx, new_p, strict=True)}  # last one wins
        np.testing.assert_array_equal(s.raw[list(last)], list(last.values()))
        check_invariants(s, cap)
        np.testing.assert_array_equal(s.order, oracle_order(s.raw[:cap]))


def test_permuted_draw_refuses_what_does_not_fit_the_batch():
    rng = np.random.default_rng(12)
    s = RankSampler(100, 0.7)
    s.write(np.arange(100), rng.exponential(size=100), new=True)
    s.sample(rng.random(8), 100, 0.4, True, 0, 0, 100)  # a draw whose paths an update may use

    def state():  # noqa: ANN202 - what a draw changes
        return (s.samples_since_sort, s.last_batch_size, s._sample.tolist(), s.order.tolist(),
                s.raw.tolist(), s._spaths.tolist(), s._stab.tolist())  # fmt: skip

    before = state()
    with pytest.raises(ValueError, match="2B uniforms"):
        s.sample_permuted(rng.random(5), _NO_PERM, 100, 0.4, True, 0, 0, 100, shuffle=True)
    for bad in (np.arange(3), np.arange(4, dtype=np.int32), np.arange(4).reshape(2, 2)):
        with pytest.raises(ValueError, match="`perm` must be empty or 4 int64 entries"):
            s.sample_permuted(rng.random(4), bad, 100, 0.4, True, 0, 0, 100)
    for bad in (np.array([0, 1, 2, 4]), np.array([-1, 0, 1, 2])):  # read unchecked when compiled
        with pytest.raises(ValueError, match="`perm` must hold positions in \\[0, 4\\)"):
            s.sample_permuted(rng.random(4), bad, 100, 0.4, True, 0, 0, 100)
    with pytest.raises(ValueError, match="`record_bytes` must hold capacity \\* row_bytes"):
        s.sample_permuted(rng.random(4), _NO_PERM, 100, 0.4, True, 0, 0, 100,
                          np.zeros(99 * 24, np.uint8), 24)  # fmt: skip
    assert state() == before  # refused before anything changed
    # the kernel itself refuses uniforms, a perm or scratch shorter than the batch
    i64 = [np.empty(4, np.int64) for _ in range(4)]
    for u, perm, shuffle, sel in ((rng.random(3), _NO_PERM, False, 4),
                                  (rng.random(7), np.empty(4, np.int64), True, 4),
                                  (rng.random(8), np.empty(3, np.int64), True, 4),
                                  (rng.random(4), np.arange(3), False, 4),
                                  (rng.random(4), _NO_PERM, False, 3)):  # fmt: skip
        with pytest.raises(ValueError, match="shorter than the batch"):
            _rk.sample_exact(
                *s._tree, s.prefix, s._guide, s._scale, 100, u, perm, shuffle, True, 0.7,
                *i64[:3], np.empty(sel, np.int64), i64[3], np.empty(4), s._spaths, s._sample, 0,
                100, np.empty(4, np.int64), 0.4, 0, 1.0, np.empty(4), _NO_ROWS, 0,
            )  # fmt: skip


@pytest.mark.parametrize("segments", [False, True])
def test_shuffled_rank_batches_in_a_vector_env_loop(segments):
    """A rank-based buffer in an actor-learner loop (4-env vector steps between
    samples, n-step windows per env, a beta schedule, updates of the shuffled
    batches): each batch is the stratum-order batch of the same uniforms, in the
    order the generator's next B uniforms give, rows included."""
    fields = {"obs": ((3,), np.float32), "reward": ((), np.float32),
              "next_obs": ((3,), np.float32), "terminated": ((), np.bool_),
              "truncated": ((), np.bool_)}  # fmt: skip
    opts = dict(n_step=3, gamma=0.9, n_envs=4, segments=segments, sort_every=None,
                beta=fastper.schedules.Linear(0.4, 1.0, 50), seed=5)  # fmt: skip
    buf = fastper.RankBasedReplayBuffer(600, fields, **opts)
    twin = fastper.RankBasedReplayBuffer(600, fields, shuffle=False, **opts)
    rng = np.random.default_rng(13)
    for step in range(120):
        env = {
            "obs": rng.standard_normal((4, 3)).astype(np.float32),
            "reward": rng.standard_normal(4).astype(np.float32),
            "next_obs": rng.standard_normal((4, 3)).astype(np.float32),
            "terminated": rng.random(4) < 0.05,
            "truncated": rng.random(4) < 0.02,
        }
        for b in (buf, twin):
            b.add(env)
        if len(buf) < 64:
            continue
        gen = np.random.Generator(np.random.PCG64())
        gen.bit_generator.state = buf._rng.bit_generator.state
        twin._rng.bit_generator.state = buf._rng.bit_generator.state
        got, want = buf.sample(64), twin.sample(64)
        gen.random(64)
        perm = policy.batch_order(gen.random(64))
        for name in ("indices", "probabilities", "weights", "keys"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name)[perm], name)
        for name in fields:
            np.testing.assert_array_equal(got.data[name], want.data[name][perm], name)
        assert got.beta == want.beta
        # the same priority per slot in both (so a repeated slot's order cannot matter)
        td = np.cos(got.indices * 0.37 + step)
        buf.update_priorities(got, td)
        twin.update_priorities(got.indices, td, keys=got.keys)
        np.testing.assert_array_equal(buf.ranks(np.arange(len(buf))),
                                      twin.ranks(np.arange(len(twin))))  # fmt: skip
    check_invariants(buf._sampler, len(buf))


def _base_update(s: RankSampler, *args):  # noqa: ANN202
    return Sampler.update_from_td(s, *args)


@pytest.mark.parametrize("sort_every", [None, 5])
def test_fused_update_equals_the_checked_write(sort_every):
    """The one-call update keeps the base class's rules: stale keys dropped,
    errors leave everything unchanged, the last duplicate wins."""
    cap = 500
    rng = np.random.default_rng(8)
    a, b = (
        RankSampler(cap, 0.7, sort_every=sort_every),
        RankSampler(cap, 0.7, sort_every=sort_every),
    )
    for t in (a, b):
        t.write(np.arange(cap), np.linspace(0.1, 2.0, cap), new=True)
    added = cap + 37  # the ring wrapped: slots below 37 hold newer transitions
    for step in range(30):
        idx = rng.integers(0, cap, 200)
        td = rng.standard_normal(200)
        keys = np.where(idx < 37, idx + cap, idx)
        keys[rng.random(200) < 0.2] -= cap  # stale: these slots were overwritten since
        keys = np.maximum(keys, 0)
        if step == 7:
            td[3] = np.nan  # an error: nothing changes
        if step == 9:
            idx[5] = cap + 3  # out of range
        st_a, st_b = np.zeros(4, np.int64), np.zeros(4, np.int64)
        args = (idx, td, keys, True, 1e-3, 1.5, cap, 0, added)
        pa = a.update_from_td(*args, st_a)
        pb = _base_update(b, *args, st_b)
        assert pa == pb
        np.testing.assert_array_equal(st_a, st_b)
        np.testing.assert_array_equal(a.raw, b.raw)
        np.testing.assert_array_equal(a.ranked, b.ranked)
        np.testing.assert_array_equal(a.order, b.order)
    check_invariants(a, cap)


@pytest.mark.parametrize("segments", [False, True])
def test_updates_of_a_drawn_batch_find_its_paths_by_position_or_by_slot(segments):
    """An update that gives the batch back as drawn (or its first entries) finds
    each draw's path by its position (no table of the draws' slots is built);
    one given back reordered, with repeats or with entries dropped as stale
    finds them through that table. Either way the order is the oracle's and a twin that routes every
    key (no recorded paths) holds the same tree."""
    cap = 3000
    rng = np.random.default_rng(12)
    a = RankSampler(cap, 0.7, segments=segments)
    twin = RankSampler(cap, 0.7, segments=segments)
    p0 = rng.exponential(size=cap)
    for t in (a, twin):
        t.write_run(0, cap, 1.0)
        t.write(np.arange(cap), p0)
    status = np.zeros(4, np.int64)
    for step in range(48):
        shuffle = step % 3 != 2
        u = rng.random(512 if shuffle else 256)
        perm = _NO_PERM if shuffle or step % 2 else rng.permutation(256)
        idx, _, _, keys = a.sample_permuted(u, perm, cap, 0.5, step % 2 == 0, 0, 0, cap,
                                            shuffle=shuffle)  # fmt: skip
        how = step % 6
        if how == 1:
            idx, keys = idx[::-1], keys[::-1]  # reordered
        elif how == 2:
            idx, keys = idx[:100], keys[:100]  # cut
        elif how == 3:  # entry 7 names another issued key: stale, dropped
            keys = keys.copy()
            keys[7] = keys[7] - 1 if keys[7] > 0 else 1
        elif how == 4:
            idx, keys = np.concatenate([idx, idx[:9]]), np.concatenate([keys, keys[:9]])
        td = rng.standard_normal(idx.shape[0])
        args = (idx, td, keys, True, 1e-3, np.inf, cap, 0, cap)
        a.update_from_td(*args, status)
        assert status[0] == 0 and status[3] == (how == 3)
        # as drawn, or its first entries: by position only; else the table was needed
        assert a._sample[2] == (0 if how in (0, 2, 5) else 1), how
        twin._sample[0] = 0  # no recorded paths: every key routed
        twin.update_from_td(*args, np.zeros(4, np.int64))
        np.testing.assert_array_equal(a.ranked, twin.ranked)
        np.testing.assert_array_equal(a.order, twin.order)
    np.testing.assert_array_equal(a.order, oracle_order(a.ranked[:cap]))
    check_invariants(a, cap)


def test_fused_update_compacts_when_the_pools_run_out():
    cap = 64
    s = RankSampler(cap, 0.7)
    s.write_run(0, cap, 1.0)
    rng = np.random.default_rng(9)
    status = np.zeros(4, np.int64)
    for step in range(40):  # keys pushed to the end again and again: splits
        idx = rng.permutation(cap)
        s.update_from_td(idx, np.full(cap, 0.5**step), idx, False, 0.0, np.inf, cap, 0, cap,
                         status)  # fmt: skip
        assert status[0] == 0 and status[2] == cap
        check_invariants(s, cap)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_weights_of_an_underflowing_law_follow_numpy():
    """alpha = 400: every probability past rank 1 underflows to 0; the compiled
    weights divide by zero as numpy does (inf, nan), never raising."""
    s = RankSampler(50, 400.0)
    s.write(np.arange(50), np.arange(50.0), new=True)
    u = np.linspace(0.0, 0.999, 64)
    for norm in (0, 1, 2):
        idx, prob, w, _ = s.sample(u, 50, 0.5, True, norm, 0, 50)
        pmin = 50.0**-400.0 / s.prefix[49]
        assert pmin == 0.0
        np.testing.assert_array_equal(w, normalised_weights(prob, 1.0, pmin, 50, 0.5, norm))


def test_a_draw_that_raises_leaves_the_last_draws_records_or_none():
    """A failed draw writes no record: the last complete draw's records stay
    (an update of its batch still finds its paths), or, where the failed draw
    replaced the tables (a larger batch than ever), there are none and an
    update routes its keys."""
    s = RankSampler(64, 0.7)
    s.write(np.arange(64), np.linspace(0.1, 2.0, 64), new=True)
    idx, _, _, _ = s.sample(np.linspace(0.0, 0.99, 16), 64, 0.5, True, 0, 0, 64)
    assert s._sample[0] == 16
    with pytest.raises((ZeroDivisionError, IndexError, ValueError)):
        s.sample(np.linspace(0.0, 0.99, 16), 0, 0.5, True, 0, 0, 64)  # no slot to draw
    assert s._sample[0] == 16
    status = np.zeros(4, np.int64)
    s.update_from_td(idx, np.linspace(0.5, 1.5, 16), idx, False, 0.0, np.inf, 64, 0, 64, status)
    assert status[2] == 16 and s._sample[2] == 0  # by position: the records were the batch's
    np.testing.assert_array_equal(s.order, oracle_order(s.ranked[:64]))
    with pytest.raises((ZeroDivisionError, IndexError, ValueError)):
        s.sample(np.linspace(0.0, 0.99, 300), 0, 0.5, True, 0, 0, 64)  # no slot to draw
    assert s._sample[0] == 0
    s.write(np.arange(64), np.linspace(2.0, 0.1, 64))  # every key routed
    np.testing.assert_array_equal(s.order, oracle_order(s.ranked[:64]))


def test_an_integral_beta_weighs_as_the_float_one():
    s = RankSampler(64, 0.7)
    s.write(np.arange(64), np.linspace(0.1, 2.0, 64), new=True)
    u = np.linspace(0.0, 0.99, 32)
    for norm in (0, 1, 2):
        _, _, w_int, _ = s.sample(u, 64, 3, True, norm, 0, 64)
        _, _, w_float, _ = s.sample(u, 64, 3.0, True, norm, 0, 64)
        np.testing.assert_array_equal(w_int.view(np.int64), w_float.view(np.int64))
