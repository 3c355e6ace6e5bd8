"""The batched tree kernels against their references, bit for bit.

* Path recomputation after a batch of writes (item by item on the big
  levels, whole levels on the small ones) leaves every internal node exactly
  as a rebuild from the leaves does, for sum, zero-skipping min and max trees,
  with duplicates, sorted, contiguous and random batches, and batches larger
  than whole levels; a max tree's paths that stop where a node keeps its
  value leave what whole paths leave.
* The proportional sampler's fused draw finds the leaves the tree's search
  finds, and its permuted form equals the plain form indexed by the
  permutation.
* A shuffling buffer orders its batch by :func:`fastper.policy.batch_order` of the
  B uniforms it draws after the targets' B; that order is a uniform permutation.
* Prefetching the drawn rows (records) changes no bit of a sample.
* Slot keys from one division per batch equal the per-slot formula.
* The descent's branch-free select is the conditional expression bit for bit,
  and the descent takes the steps its rule writes out.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer
from fastper._kernels import prioritized as _pk
from fastper._kernels import ring as _ring
from fastper._kernels import tree as _tk
from fastper._kernels import weights as _weights
from fastper.policy import batch_order, stratified_targets
from fastper.sampler_base import PriorityMax, new_priorities
from fastper.samplers import NO_PERM, NO_ROWS, ProportionalSampler
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


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_max_paths_that_stop_early_leave_what_full_paths_leave(capacity: int) -> None:
    # fix_max_paths stops a path at the first node that keeps its value; fix_paths
    # recomputes every ancestor. Values from a small set make ties (a leaf rising to
    # its parent's max, the max's holder falling while a sibling holds the same), and
    # rounds that only raise or only lower move the max up and down the tree.
    rng = np.random.default_rng(SEED + 7 * capacity)
    levels = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 1e300])
    raw = new_priorities(capacity)
    raw[:capacity] = rng.choice(levels[:5], capacity)
    _, offs, depth = _tk.layout(raw.shape[0])
    early = _tk.aligned_full(int(offs[-1]), 0.0)
    _tk.rebuild(raw, early, offs, depth, _tk.MAX)
    full = early.copy()
    for round_ in range(12):
        for idx in batches(rng, capacity):
            if round_ % 3 == 0:  # only raise
                vals = np.maximum(raw[idx], rng.choice(levels, idx.shape[0]))
            elif round_ % 3 == 1:  # only lower
                vals = np.minimum(raw[idx], rng.choice(levels[:4], idx.shape[0]))
            else:
                vals = rng.choice(levels[:5], idx.shape[0])
            for k in range(idx.shape[0]):  # last duplicate wins
                raw[idx[k]] = vals[k]
            scratch = np.empty(max(idx.shape[0], 1), dtype=np.int64)
            _tk.fix_max_paths(raw, early, offs, depth, idx, scratch)
            _tk.fix_paths(raw, full, offs, depth, idx, scratch, _tk.MAX)
            assert bits(early) == bits(full), (round_, idx.shape[0])
    rebuilt = early.copy()
    _tk.rebuild(raw, rebuilt, offs, depth, _tk.MAX)
    assert bits(rebuilt) == bits(early)
    assert early[offs[depth]] == raw.max()


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
        # shuffle: B more uniforms order the batch, in the same call
        v = rng.random(b)
        shuffled = s.sample_permuted(
            np.concatenate((u, v)), NO_PERM, capacity, 0.4, stratified, norm, 11,
            3 * capacity + 5, shuffle=True,
        )  # fmt: skip
        order = batch_order(v)
        for a, p in zip(plain, shuffled, strict=True):
            assert bits(a[order]) == bits(p)
    # the kernel itself refuses uniforms or a perm shorter than its outputs
    out = [np.empty(4, dtype=d) for d in (np.int64, np.float64, np.float64, np.int64)]
    for u_short, perm_bad, shuffle in ((rng.random(3), NO_PERM, False),
                                       (rng.random(7), NO_PERM, True),
                                       (rng.random(4), np.arange(3), False)):  # fmt: skip
        with pytest.raises(ValueError, match="shorter than the batch"):
            _pk.prop_sample(
                s.leaves, s.sinner, s.minner, s.offs, s.depth, u_short, perm_bad, shuffle,
                stratified, 0.4, capacity, norm, 0, capacity, capacity, *out, NO_ROWS, 0,
            )  # fmt: skip
    # a perm is checked before the kernel indexes with it unchecked
    with pytest.raises(ValueError, match="`perm` must hold positions in \\[0, 3\\)"):
        s.sample_permuted(rng.random(3), np.array([0, 3, 1]), capacity, 0.4, stratified, norm, 0,
                          capacity)  # fmt: skip
    with pytest.raises(ValueError, match="`perm` must be empty or 3 int64 entries"):
        s.sample_permuted(rng.random(3), np.arange(4), capacity, 0.4, stratified, norm, 0,
                          capacity)  # fmt: skip
    # shuffle needs 2B uniforms: an odd count cannot be split, and is refused
    with pytest.raises(ValueError, match="2B uniforms"):
        s.sample_permuted(rng.random(5), NO_PERM, capacity, 0.4, stratified, norm, 0, capacity,
                          shuffle=True)  # fmt: skip


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
    perm = batch_order(gen.random(64))
    assert sorted(perm.tolist()) == list(range(64)) and perm.tolist() != list(range(64))
    for name in ("indices", "probabilities", "weights", "keys"):
        assert bits(getattr(shuffled, name)) == bits(getattr(ordered, name)[perm]), name
    assert bits(shuffled.data["x"]) == bits(ordered.data["x"][perm])
    # the next draw starts where the order's uniforms left the generator
    nxt = bufs[0].sample(64)
    u = gen.random(64)
    perm = batch_order(gen.random(64))
    t = stratified_targets(u, bufs[0]._sampler.total, np.arange(64, dtype=np.float64))
    want = np.empty(64, dtype=np.int64)
    s = bufs[0]._sampler
    _tk.sum_find(s.leaves, s.sinner, s.offs, s.depth, t, want)
    np.testing.assert_array_equal(nxt.indices, want[perm])
    assert bufs[0]._rng.bit_generator.state == gen.bit_generator.state


@pytest.mark.parametrize("b", [2, 3, 5])
def test_batch_order_is_a_uniform_permutation(b: int) -> None:
    """Every one of the b! orders equally often (chi-square over 120,000 orders),
    and every position of a batch of 256 holds each draw equally often."""
    from math import factorial

    from scipy import stats

    rng = np.random.default_rng(SEED + b)
    n = 120_000
    v = rng.random((n, b))
    codes = np.empty(n, dtype=np.int64)
    out = np.empty(b, dtype=np.int64)
    for i in range(n):  # the order as a number in base b
        batch_order(v[i], out)
        codes[i] = int((out * b ** np.arange(b)).sum())
    _, counts = np.unique(codes, return_counts=True)
    assert counts.shape[0] == factorial(b)  # every permutation, and nothing else
    assert stats.chisquare(counts).pvalue > 1e-3
    # where draw 0 goes in a batch of 256: uniform over the 256 positions
    at = np.array([int(np.argmax(batch_order(rng.random(256)) == 0)) for _ in range(25_600)])
    assert stats.chisquare(np.bincount(at, minlength=256)).pvalue > 1e-3


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


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_weights_with_the_rows_prefetched_are_the_same_bits(norm: int) -> None:
    """The sampling kernel's weights while it prefetches the drawn rows: the shared
    rule's bits, for batches that are not a multiple of the prefetch group and
    records of one, two and several cache lines."""
    rng = np.random.default_rng(SEED + norm)
    capacity = 1000
    for row_bytes in (16, 48, 100, 256):
        rows = np.zeros(capacity * row_bytes, dtype=np.uint8)
        for b in (1, 7, 8, 9, 256, 301):
            masses = values(rng, b) + 1e-9
            slots = rng.integers(0, capacity, b)
            for low in (float(masses.min()) / 3, 0.0):  # 0: an underflowing law (inf)
                want = np.empty(b)
                got = np.full(b, np.nan)
                _weights.is_weights_into(
                    masses, 7.5, low, capacity, 0.4, norm, want, slots, NO_ROWS, 0
                )  # fmt: skip
                _weights.is_weights_into(
                    masses, 7.5, low, capacity, 0.4, norm, got, slots, rows, row_bytes
                )
                assert bits(got) == bits(want), (row_bytes, b, low)


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_sample_is_the_same_with_or_without_the_rows_prefetched(norm: str, shuffle: bool) -> None:
    fields = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
    bufs = [
        PrioritizedReplayBuffer(3000, fields, seed=7, shuffle=shuffle, weight_norm=norm)
        for _ in range(2)
    ]
    assert bufs[0]._storage.record_bytes[1] == 24  # the records are prefetched ...
    bufs[1]._storage.record_bytes = (NO_ROWS, 0)  # ... and here not
    rng = np.random.default_rng(SEED)
    rows = {
        "obs": rng.standard_normal((2500, 3)).astype(np.float32),
        "action": rng.integers(0, 9, 2500),
        "reward": rng.standard_normal(2500).astype(np.float32),
    }
    p = np.abs(rng.standard_normal(2500)) + 0.01
    for buf in bufs:
        buf.add(rows)
        buf.update_priorities(np.arange(2500), p)
    for b in (1, 5, 256):
        with_rows, without = (buf.sample(b) for buf in bufs)
        for name in ("indices", "probabilities", "weights", "keys"):
            assert bits(getattr(with_rows, name)) == bits(getattr(without, name)), (b, name)
        for name in fields:
            assert bits(with_rows.data[name]) == bits(without.data[name]), (b, name)
            assert bits(with_rows.data[name]) == bits(rows[name][with_rows.indices]), (b, name)


def test_batch_order_refuses_bad_arrays_and_stays_inside_its_output() -> None:
    with pytest.raises(TypeError, match="`v` must be a 1-D float64"):
        batch_order(np.zeros(4, dtype=np.float32))
    with pytest.raises(TypeError, match="`out` must be a writable int64 array of shape"):
        batch_order(np.zeros(4), np.empty(3, dtype=np.int64))
    with pytest.raises(TypeError, match="`out` must be a writable int64"):
        batch_order(np.zeros(4), np.empty(4, dtype=np.int32))
    # uniforms outside [0, 1) (NaN, negative, 1 and above) still give a permutation,
    # and nothing beside the output is written
    big = np.full(12, -7, dtype=np.int64)
    batch_order(np.array([0.5, np.nan, -3.0, 1.0, 7.5, 0.99]), big[3:9])
    assert sorted(big[3:9].tolist()) == list(range(6))
    assert (big[:3] == -7).all() and (big[9:] == -7).all()


def test_the_rows_to_prefetch_must_cover_the_capacity() -> None:
    s = ProportionalSampler(100, 1.0)
    s.write(np.arange(100, dtype=np.int64), np.ones(100))
    u = np.random.default_rng(SEED).random(8)
    with pytest.raises(ValueError, match="`record_bytes` must hold capacity \\* row_bytes"):
        s.sample_permuted(u, NO_PERM, 100, 0.4, True, 0, 0, 100, np.zeros(99 * 48, np.uint8), 48)
    got = s.sample_permuted(u, NO_PERM, 100, 0.4, True, 0, 0, 100, np.zeros(100 * 48, np.uint8), 48)
    want = s.sample_permuted(u, NO_PERM, 100, 0.4, True, 0, 0, 100)
    for a, b in zip(got, want, strict=True):
        assert bits(a) == bits(b)


@pytest.mark.parametrize(
    "bad, error",
    [
        ((np.zeros(10, np.uint8), 24), ValueError),  # too short for the capacity
        ((np.zeros(3000 * 24, np.float32), 24), TypeError),  # not bytes
        ((np.zeros(3000 * 24, np.uint8),), TypeError),  # not a pair
        ((np.zeros(3000 * 24, np.uint8), -1), TypeError),
    ],
)
def test_a_storage_that_misdescribes_its_records_is_refused_before_a_draw(
    bad: tuple, error: type
) -> None:
    fields = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
    buf, twin = (PrioritizedReplayBuffer(3000, fields, seed=7) for _ in range(2))
    rng = np.random.default_rng(SEED)
    rows = {
        "obs": rng.standard_normal((500, 3)).astype(np.float32),
        "action": rng.integers(0, 9, 500),
        "reward": rng.standard_normal(500).astype(np.float32),
    }
    for b in (buf, twin):
        b.add(rows)
        b.sample(32)
    good = buf._storage.record_bytes
    buf._storage.record_bytes = bad
    before = buf._rng.bit_generator.state, buf.step
    with pytest.raises(error, match="`record_bytes` must"):
        buf.sample(32)
    assert (buf._rng.bit_generator.state, buf.step) == before  # nothing drawn, no step
    buf._storage.record_bytes = good
    a, b = buf.sample(32), twin.sample(32)
    for name in ("indices", "weights", "keys"):
        assert bits(getattr(a, name)) == bits(getattr(b, name)), name


@pytest.mark.parametrize("portable", [False, True])
def test_take_if_ge_is_the_conditional_expression_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, portable: bool
) -> None:
    """The branch-free select of the descent (a compare's mask on x86-64, a plain
    select elsewhere: ``portable`` compiles that one here) gives what
    ``x if t >= x else 0.0`` gives, for every pair of special and ordinary values."""
    from numba import njit

    from fastper._kernels import _intrinsics
    from fastper._kernels._intrinsics import take_if_ge

    if portable:
        monkeypatch.setattr(_intrinsics, "_x86_64", lambda: False)

    @njit(cache=False)
    def masked(t: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
        for k in range(t.shape[0]):
            out[k] = take_if_ge(t[k], x[k])

    special = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324, 1.7976931348623157e308,
         np.nextafter(1.0, 0.0), np.nextafter(1.0, 2.0), 3.0],
    )  # fmt: skip
    t, x = (a.ravel() for a in np.meshgrid(special, special))
    rng = np.random.default_rng(SEED)
    r = rng.standard_normal((2, 20_000)) * 10.0 ** rng.integers(-300, 300, (2, 20_000))
    t = np.concatenate([t, r[0], r[0]])
    x = np.concatenate([x, r[1], r[0]])  # random pairs, then equal ones
    out = np.empty_like(t)
    masked(t, x, out)
    with np.errstate(invalid="ignore"):
        want = np.where(t >= x, x, 0.0)
    assert bits(out) == bits(want)
    # the form asked for was compiled: the mask on x86-64 hosts, the select elsewhere
    masks = "llvm.x86.sse2.cmp.sd" in "".join(masked.inspect_llvm().values())
    assert masks == (not portable and _intrinsics._x86_64())


@pytest.mark.parametrize("capacity", [9, 513, 40_000])
def test_the_descent_takes_the_documented_steps(capacity: int) -> None:
    """``sum_find`` against the rule written out in Python: at each node, halves,
    then quarters, then the child, each step taking ``t - sum`` where ``t >= sum``
    (the node's pairwise sums); a leaf that does not hold what is left of its
    target is searched carefully (positive leaves then, as the careful path
    guarantees)."""
    rng = np.random.default_rng(SEED)
    s = ProportionalSampler(capacity, 1.0)
    leaves = values(rng, capacity)
    leaves[-1] = 1.0
    s.write(np.arange(capacity, dtype=np.int64), leaves)
    a_leaves, inner, offs, depth = s.leaves, s.sinner, s.offs, s.depth
    targets = rng.random(512) * s.total
    targets[:8] = s.total * np.array([0.0, 1e-300, 0.5, 1.0 - 2**-52, 0.25, 0.75, 0.1, 0.9])
    got = np.empty(targets.shape[0], dtype=np.int64)
    _tk.sum_find(a_leaves, inner, offs, depth, targets, got)
    for k, t0 in enumerate(targets.tolist()):
        t, j, inside = t0, 0, True
        for level in range(depth, 0, -1):
            a = a_leaves if level == 1 else inner
            off = 0 if level == 1 else int(offs[level - 1])
            nodes = a_leaves.shape[0] // 8 if level == 1 else (offs[level] - offs[level - 1]) // 8
            if j >= nodes:  # past the level's end (rounding): the careful path
                inside = False
                break
            base = off + 8 * j
            h = (a[base] + a[base + 1]) + (a[base + 2] + a[base + 3])
            c = 0
            if t >= h:
                t, c = t - h, 4
            q = a[base + c] + a[base + c + 1]
            if t >= q:
                t, c = t - q, c + 2
            if t >= a[base + c]:
                t, c = t - a[base + c], c + 1
            j = 8 * j + c
        if inside and t < a_leaves[j]:
            assert got[k] == j, k
        else:
            assert a_leaves[got[k]] > 0.0, k
