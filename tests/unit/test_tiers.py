"""TieredStorage: exact rows across tiers, placement by mass, stats, checkpoints, bad files."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import fastper
from fastper import PrioritizedReplayBuffer, ReplayBuffer
from fastper import tier_codecs as C
from fastper import tiers as T
from fastper.samplers import ProportionalSampler, UniformSampler
from fastper.storage import Storage
from fastper.tiers import TierDataError, TieredStorage

FIELDS = {"obs": ((3, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
ROW = 15 + 8 + 4
CODECS = T.available_codecs()
COMPILED_LZ4 = "lz4" in CODECS and C.make_codec("lz4").warm_rows is not None
needs_compiled_lz4 = pytest.mark.skipif(
    not COMPILED_LZ4, reason="lz4 (extra fastper[tiers]) with a reachable C decoder"
)


def rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.integers(0, 4, (k, 3, 5)).astype(np.uint8),  # compressible, not constant
        "action": rng.integers(0, 5, k),
        "reward": rng.random(k).astype(np.float32),
    }


def tiered(tmp_path, capacity: int = 300, **kw) -> TieredStorage:
    opts = {
        "chunk_size": 8, "hot_bytes": 3 * 8 * ROW, "warm_bytes": 600, "block_bytes": 2 * ROW,
        "rebalance_every": 2, "cold_dir": tmp_path / "cold", "prefetch": False,
    }  # fmt: skip
    opts.update(kw)
    return TieredStorage(FIELDS, capacity, **opts)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def drive(ram, tier, steps: int, seed: int = 0, batch: int = 16) -> None:
    """Same adds, samples and updates on both buffers; every batch must be identical."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tr = rows(rng, int(rng.integers(1, 12)))
        ram.add(tr)
        tier.add(tr)
        sa, sb = ram.sample(batch), tier.sample(batch)
        assert np.array_equal(sa.indices, sb.indices)
        assert np.array_equal(sa.weights, sb.weights)
        assert_same(sa.data, sb.data)
        td = rng.random(batch) ** 4 * 10  # heavy-tailed: masses differ a lot
        ram.update_priorities(sa.indices, td, keys=sa.keys)
        tier.update_priorities(sb.indices, td, keys=sb.keys)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("prefetch", [True, False])
def test_batches_equal_ram_storage_across_tiers_and_wrap(tmp_path, codec, prefetch):
    st = tiered(tmp_path, codec=codec, prefetch=prefetch)
    ram = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=3)
    buf = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=3, storage=st)
    drive(ram, buf, 150)  # ~900 rows: the ring wraps three times
    s = st.stats()
    assert s["rebalances"] > 10 and s["promotions"] > 0 and s["demotions"] > 0
    assert all(s["hit_rate"][t] > 0 for t in ("hot", "warm", "cold")), s["hit_rate"]
    assert all(s["chunks"][t] > 0 for t in ("hot", "warm", "cold")), s["chunks"]
    for name in FIELDS:
        assert np.array_equal(st.read(name, 0, 300), ram.storage.read(name, 0, 300))
    assert_warm_addresses(st)
    st.close()


def refuse_in_python(st: TieredStorage, **calls) -> None:
    """Replace the codec's Python calls (e.g. with one that fails the test), everywhere."""
    st.codec = st._blocks.codec = dataclasses.replace(st.codec, **calls)


def assert_warm_addresses(st: TieredStorage) -> None:
    """The compiled gather's table: each warm block's address and size while held, else 0."""
    table = st._warm
    if not table.track:
        assert table.addr.size == 0 and st._warm_gather is None
        return
    addr, size = np.zeros_like(table.addr), np.zeros_like(table.size)
    for c, pieces in table.items():
        for j, piece in enumerate(pieces):
            at = c * st.blocks_per_chunk + j
            addr[at] = np.frombuffer(piece, dtype=np.uint8).ctypes.data
            size[at] = len(piece)
    assert np.array_equal(table.addr, addr) and np.array_equal(table.size, size)


def test_uniform_buffer_and_chunk_size_not_dividing_capacity(tmp_path):
    st = tiered(tmp_path, capacity=301, chunk_size=16, hot_bytes=16 * ROW, block_bytes=1)
    ram = ReplayBuffer(301, FIELDS, seed=1)
    buf = ReplayBuffer(301, FIELDS, seed=1, storage=st)
    drive(ram, buf, 100, seed=2)
    assert st.stats()["chunks"]["cold"] > 0


def test_prefetch_does_not_change_results(tmp_path):
    out = []
    for prefetch in (True, False):
        st = tiered(tmp_path / str(prefetch), prefetch=prefetch, max_moves=None)
        buf = PrioritizedReplayBuffer(300, FIELDS, alpha=0.7, seed=9, storage=st)
        rng = np.random.default_rng(4)
        got = []
        for _ in range(80):
            buf.add(rows(rng, 7))
            s = buf.sample(8)
            got.append((s.indices, s.data["obs"], s.data["reward"]))
            buf.update_priorities(s.indices, rng.random(8) ** 3, keys=s.keys)
        out.append(got)
        st.close()
    for a, b in zip(*out, strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)


def filled(tmp_path, **kw) -> tuple[TieredStorage, dict[str, np.ndarray]]:
    st = tiered(tmp_path, capacity=128, **kw)  # 16 chunks of 8
    data = rows(np.random.default_rng(0), 128)
    prepared, k = st.prepare(data)
    st.write(0, prepared, k)
    return st, data


@needs_compiled_lz4
@pytest.mark.parametrize("rows_per_block", [1, 2, 8])
def test_warm_rows_decoded_in_compiled_code(tmp_path, rows_per_block):
    st, data = filled(tmp_path, codec="lz4", block_bytes=rows_per_block * ROW, warm_bytes=10**6)
    assert st.rows_per_block == rows_per_block

    def refuse(data, nbytes):
        raise AssertionError("a warm row decoded in Python")

    refuse_in_python(st, decompress=refuse)
    warm = np.flatnonzero(st._tier == T.WARM)
    hot = np.flatnonzero(st._tier == T.HOT)
    assert warm.size >= 8 and hot.size >= 2
    warm_slots = (warm[:, None] * 8 + np.arange(8)).ravel()
    hot_slots = (hot[:, None] * 8 + np.arange(8)).ravel()
    rng = np.random.default_rng(5)
    for _ in range(30):  # repeats, several rows of a block, hot rows between them
        idx = rng.choice(np.concatenate([warm_slots, hot_slots]), int(rng.integers(1, 80)))
        before = st.stats()
        assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})
        after = st.stats()
        in_warm = np.isin(idx, warm_slots)
        assert after["rows_warm"] - before["rows_warm"] == in_warm.sum()
        blocks = np.unique(idx[in_warm] // rows_per_block).size
        assert after["decompressions"] - before["decompressions"] == blocks


@needs_compiled_lz4
@pytest.mark.parametrize("rows_per_block", [1, 2, 8])
def test_chunks_packed_in_compiled_code_read_back_by_both_paths(tmp_path, rows_per_block):
    def refuse(data, itemsize):
        raise AssertionError("a chunk compressed in Python")

    st = tiered(tmp_path, capacity=128, codec="lz4", block_bytes=rows_per_block * ROW)
    refuse_in_python(st, compress=refuse)
    data = rows(np.random.default_rng(3), 128)
    prepared, k = st.prepare(data)
    st.write(0, prepared, k)  # 16 chunks through 3 hot slots: 13 packed on the way out
    assert st.stats()["inline_packs"] == 13
    assert np.count_nonzero(st._tier == T.WARM) and np.count_nonzero(st._tier == T.COLD)
    idx = np.arange(128)
    assert_same(st.gather(idx), data)  # warm: compiled decoder; cold: Python's lz4
    st._warm_gather = None
    assert_same(st.gather(idx), data)  # warm too in Python
    for c, pieces in st._warm.items():  # the Python codec reads the compiled blocks
        raw = [st.codec.decompress(p, st._blocks.nbytes) for p in pieces]
        assert all(len(r) == st._blocks.nbytes for r in raw), c


@needs_compiled_lz4
def test_warm_chunk_promoted_in_compiled_code(tmp_path):
    st, data = filled(tmp_path, codec="lz4", warm_bytes=10**6, max_moves=None, hysteresis=1.0)

    def refuse(data, nbytes):
        raise AssertionError("a warm chunk decoded in Python")

    refuse_in_python(st, decompress=refuse)
    warm = np.flatnonzero(st._tier == T.WARM)
    masses = np.ones(st.n_chunks)
    masses[warm[:2]] = 100.0  # the two heaviest are warm: promoted, two hot ones demoted
    st.rebalance(masses)
    assert set(warm[:2].tolist()) <= set(np.flatnonzero(st._tier == T.HOT).tolist())
    assert st.stats()["promotions"] == 2 and st.stats()["prefetch_failures"] == 0
    before = st.stats()["rows_hot"]
    idx = (warm[:2, None] * 8 + np.arange(8)).ravel()
    assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})
    assert st.stats()["rows_hot"] - before == idx.size
    assert_warm_addresses(st)


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_promotion_of_a_corrupted_warm_chunk_fails_and_leaves_it_warm(tmp_path, damage):
    st, data = filled(tmp_path, warm_bytes=10**6, max_moves=None)
    c = int(np.flatnonzero(st._tier == T.WARM)[0])
    pieces = st._warm[c]
    st._warm[c] = (pieces[0][:-3] if damage == "truncated" else b"", *pieces[1:])
    with pytest.raises(TierDataError, match="a warm chunk"):
        st.gather(np.array([c * 8 + 1, c * 8]))
    masses = np.ones(st.n_chunks)
    masses[c] = 1e6
    st.rebalance(masses)  # its promotion fails: it stays warm, counted
    assert st._tier[c] == T.WARM and st.stats()["prefetch_failures"] == 1
    assert st.stats()["promotions"] == 0 and not st._pending.any()
    st._warm[c] = pieces
    st.rebalance(masses)
    assert st._tier[c] == T.HOT and st.stats()["promotions"] == 1
    idx = c * 8 + np.arange(8)
    assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})


def test_prefetch_by_default_only_with_compiled_kernels(tmp_path):
    for codec in CODECS:
        st = TieredStorage(FIELDS, 64, chunk_size=8, codec=codec, cold_dir=tmp_path / codec)
        assert st.prefetch is (codec == "lz4" and COMPILED_LZ4), codec
        assert TieredStorage(FIELDS, 64, codec=codec, prefetch=False).prefetch is False
        st.close()
    with pytest.raises(TypeError, match="prefetch"):
        TieredStorage(FIELDS, 64, prefetch=1)


@pytest.mark.skipif("lz4" not in CODECS, reason="needs lz4 (extra fastper[tiers])")
def test_lz4_without_its_compiled_kernels_works_in_python(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastper._kernels.lz4", None)  # the import fails
    assert C._lz4_kernels.__wrapped__() == (None, None)
    monkeypatch.setattr(C, "_lz4_kernels", lambda: (None, None))
    st, data = filled(tmp_path, codec="lz4", warm_bytes=10**6)
    assert st._warm_gather is None and st._warm.addr.size == 0
    assert st.codec.pack_blocks is None and st.stats()["inline_packs"] > 0
    idx = np.arange(128)
    assert_same(st.gather(idx), data)
    assert st.stats()["rows_warm"] > 0


def test_warm_and_cold_rows_same_with_and_without_compiled_decoder(tmp_path):
    got = []
    for compiled in (True, False):
        st, data = filled(tmp_path / str(compiled), codec=CODECS[0], warm_bytes=300)
        if not compiled:
            st._warm_gather = None
        assert np.count_nonzero(st._tier == T.WARM) and np.count_nonzero(st._tier == T.COLD)
        rng = np.random.default_rng(2)
        for _ in range(20):
            idx = rng.integers(0, 128, int(rng.integers(1, 64)))
            batch = st.gather(idx)
            assert_same(batch, {k: v[idx] for k, v in data.items()})
            got.append(batch)
        st.close()
    half = len(got) // 2
    for a, b in zip(got[:half], got[half:], strict=True):
        assert_same(a, b)


def test_placement_follows_mass(tmp_path):
    st, _ = filled(tmp_path, hot_bytes=4 * 8 * ROW, max_moves=None, hysteresis=1.0, smoothing=1.0)
    masses = np.random.default_rng(1).permutation(np.arange(1.0, 17.0) ** 3)
    for _ in range(2):  # the second fills the slots the first freed
        st.rebalance(masses)
        st.settle()
    tiers = st._tier
    hot = set(np.flatnonzero(tiers == T.HOT).tolist())
    open_chunk = st._open
    top = set(np.argsort(-masses)[:3].tolist())  # 4 hot slots, one pinned to the open chunk
    assert top <= hot and len(hot) == 4 and open_chunk in hot
    warm, cold = np.flatnonzero(tiers == T.WARM), np.flatnonzero(tiers == T.COLD)
    assert warm.size and cold.size
    assert masses[warm].min() >= masses[cold].max()  # the heavier of the rest are warm
    assert st.stats()["bytes"]["warm"] <= st.warm_bytes


def settled(st, masses):
    """Place by ``masses`` until settled: (tiers, the lightest hot chunk, the heaviest other)."""
    for _ in range(2):
        st.rebalance(masses)
        st.settle()
    before = st._tier.copy()
    held = [c for c in np.flatnonzero(before == T.HOT) if c != st._open]
    rest = np.flatnonzero(before != T.HOT)
    return before, min(held, key=lambda c: masses[c]), int(rest[np.argmax(masses[rest])])


def test_hysteresis_small_changes_move_nothing(tmp_path):
    st, _ = filled(tmp_path, hot_bytes=4 * 8 * ROW, max_moves=None, hysteresis=2.0, smoothing=1.0)
    masses = np.arange(16, 0, -1, dtype=float)  # chunk 0 heaviest
    before, lightest_hot, best_cold = settled(st, masses)
    nudged = masses.copy()
    nudged[best_cold] = 1.9 * masses[lightest_hot]  # heavier, but not by the factor
    st.rebalance(nudged)
    st.settle()
    assert np.array_equal(st._tier, before)
    moved = st.stats()["promotions"]
    nudged[best_cold] = 2.1 * masses[lightest_hot]
    st.rebalance(nudged)
    st.settle()
    assert st.stats()["promotions"] == moved + 1 and st._tier[best_cold] == T.HOT


def test_smoothing_ignores_a_one_off_spike(tmp_path):
    st, _ = filled(tmp_path, hot_bytes=4 * 8 * ROW, max_moves=None, hysteresis=2.0, smoothing=0.5)
    masses = np.arange(16, 0, -1, dtype=float)
    before, light, best = settled(st, masses)
    spiked = masses.copy()
    spiked[best] = 3.0 * masses[light]  # past the factor once: averaged, it is not
    st.rebalance(spiked)
    st.settle()
    assert np.array_equal(st._tier, before)
    for _ in range(4):  # it stays heavy: the average catches up and it moves
        st.rebalance(spiked)
        st.settle()
    assert st._tier[best] == T.HOT


def test_full_chunks_are_packed_in_the_background(tmp_path):
    # a sealed chunk is compressed off the sampling path: its demotion compresses nothing
    st = tiered(tmp_path, capacity=64, hot_bytes=8 * 8 * ROW, warm_bytes=10**6, prefetch=True)
    st.write(0, st.prepare(rows(np.random.default_rng(0), 40))[0], 40)  # chunks 0..4 full
    st.settle()
    assert sorted(st._warm) == [0, 1, 2, 3, 4] and not st._packing.any()
    packed = dict(st._warm)
    st._demote(2)
    assert st._tier[2] == T.WARM and st._warm[2] is packed[2]  # the same bytes, not redone
    got = st.gather(np.arange(40))
    assert_same(got, {k: v[:40] for k, v in rows(np.random.default_rng(0), 40).items()})
    # no warm room: the copy goes to the chunk's cold file instead
    st2 = tiered(tmp_path / "b", capacity=64, hot_bytes=8 * 8 * ROW, warm_bytes=0, prefetch=True)
    st2.write(0, st2.prepare(rows(np.random.default_rng(0), 16))[0], 16)
    st2.settle()
    assert sorted(st2._cold) == [0, 1] and os.path.exists(st2._path(0))
    st2._demote(0)
    assert st2._tier[0] == T.COLD and st2.stats()["demotions"] == 1


@pytest.mark.parametrize("pack_ahead", [None, 0, 1])
def test_pack_ahead_does_not_change_batches(tmp_path, pack_ahead):
    # a hot tier of 6 chunks: with 0 or 1 packed ahead most demotions compress inline
    st = tiered(tmp_path, hot_bytes=6 * 8 * ROW, pack_ahead=pack_ahead, prefetch=True)
    ram = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=3)
    buf = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=3, storage=st)
    drive(ram, buf, 120, seed=5)
    s = st.stats()
    assert s["demotions"] > 10 and all(s["chunks"][t] > 0 for t in ("hot", "warm", "cold"))
    if pack_ahead == 0:
        assert not any(st._tier[c] == T.HOT for c in st._warm) and not st._cold.keys() & set(
            np.flatnonzero(st._tier == T.HOT).tolist()
        )  # no hot chunk holds a copy: nothing was packed ahead
    st.close()


def test_pack_ahead_packs_the_next_to_be_demoted(tmp_path):
    st, data = filled(
        tmp_path, hot_bytes=16 * 8 * ROW, warm_bytes=10**6, pack_ahead=3, prefetch=True
    )
    masses = np.random.default_rng(2).permutation(np.arange(1.0, 17.0))
    st.rebalance(masses)  # every chunk stays hot; the 3 lightest full ones get copies
    st.settle()
    # while written (unweighed) the 3 oldest full chunks were next in line: 0, 1, 2;
    # weighed, the 3 lightest (the open chunk is pinned hot, never next)
    full = [c for c in range(16) if c != st._open]
    lightest = sorted(full, key=lambda c: masses[c])[:3]
    assert set(st._warm) == {0, 1, 2} | set(lightest) and not st._packing.any()
    assert st.stats()["packs"] == len(st._warm) and st.stats()["inline_packs"] == 0
    kept = st._warm[lightest[0]]
    st._demote(lightest[0])  # costs nothing: the copy made ahead
    assert st._tier[lightest[0]] == T.WARM and st._warm[lightest[0]] is kept
    assert st.stats()["inline_packs"] == 0
    heavy = max(set(full) - {0, 1, 2}, key=lambda c: masses[c])
    assert heavy not in st._warm
    st._demote(heavy)  # no copy: compressed now, rows intact
    assert st._tier[heavy] == T.WARM and st.stats()["inline_packs"] == 1
    idx = np.array([lightest[0] * 8 + 3, heavy * 8, heavy * 8 + 7])
    assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})


def test_corrupted_warm_block_is_named(tmp_path):
    st, data = filled(tmp_path, hot_bytes=8 * ROW, warm_bytes=10**6)
    c = int(np.flatnonzero(st._tier == T.WARM)[0])
    pieces = st._warm[c]
    good = pieces[0]
    st._warm[c] = (good[: len(good) // 2], *pieces[1:])
    with pytest.raises(TierDataError, match="a warm chunk: a block"):
        st.gather(np.array([c * 8]))
    st._warm[c] = pieces
    assert_same(st.gather(np.array([c * 8])), {k: v[[c * 8]] for k, v in data.items()})


def test_file_truncated_while_open_is_named(tmp_path):
    # regression: cold files stay open between gathers; a later truncation must still be caught
    st, data = filled(tmp_path, hot_bytes=8 * ROW, warm_bytes=0)
    c = int(np.flatnonzero(st._tier == T.COLD)[0])
    assert_same(st.gather(np.array([c * 8])), {k: v[[c * 8]] for k, v in data.items()})
    assert st._path(c) in st._files.fds
    with open(st._path(c), "r+b") as f:
        f.truncate(os.path.getsize(st._path(c)) - 5)
    with pytest.raises(TierDataError, match="truncated or altered"):
        st.gather(np.array([c * 8]))
    st.close()
    assert not st._files.fds


def test_rebalance_with_prefetch_never_compresses_on_the_sampling_path(tmp_path):
    # nothing packed ahead: a hot chunk to be swapped out has no copy; the
    # rebalance packs it in the background and demotes it at the next one
    st, data = filled(
        tmp_path, hot_bytes=4 * 8 * ROW, warm_bytes=10**6, max_moves=None, hysteresis=1.0,
        smoothing=1.0, pack_ahead=0, prefetch=True,
    )  # fmt: skip
    assert sorted(np.flatnonzero(st._tier == T.HOT).tolist()) == [12, 13, 14, 15]
    assert not {12, 13, 14} & (st._warm.keys() | st._cold.keys())  # no copies
    masses = np.full(16, 1.0)
    masses[0] = 100.0  # chunk 0 (warm or cold) outweighs every hot chunk
    inline = st.stats()["inline_packs"]
    st.rebalance(masses)
    assert st._tier[0] != T.HOT and not st._pending[0]  # no slot freed yet: nothing promoted
    assert st._tier[12] == T.HOT  # the swap waits for its copy
    st.settle()
    assert 12 in st._warm and st.stats()["inline_packs"] == inline
    st.rebalance(masses)  # the copy is there: demoted for free, 0 promoted into its slot
    st.settle()
    assert st._tier[12] == T.WARM and st._tier[0] == T.HOT
    assert st.stats()["inline_packs"] == inline and st.stats()["promotions"] == 1
    idx = np.array([0, 7, 12 * 8 + 1, 13 * 8 + 5])
    assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})
    # inline moves (prefetch=False) swap at once, compressing on the spot
    st2, _ = filled(
        tmp_path / "b", hot_bytes=4 * 8 * ROW, warm_bytes=10**6, max_moves=None,
        hysteresis=1.0, smoothing=1.0,
    )  # fmt: skip
    before = st2.stats()["inline_packs"]
    st2.rebalance(masses)
    assert st2._tier[0] == T.HOT and st2.stats()["inline_packs"] == before + 1


def test_ring_frees_a_packed_hot_slot_first(tmp_path):
    # the chunk the ring enters needs a hot slot: among the next in line for
    # demotion (pack_ahead of them) one with a packed copy goes, not the
    # lightest without one (which would be compressed, or waited for, on the
    # spot), if it is about as light (within the hysteresis factor, 1.5)
    st, data = filled(tmp_path, hot_bytes=4 * 8 * ROW, warm_bytes=10**6, pack_ahead=2,
                      prefetch=True)  # fmt: skip
    masses = np.full(16, 0.1)
    masses[[12, 13, 14]] = [1.0, 2.0, 3.0]
    st.rebalance(masses)
    st.settle()
    assert {12, 13} <= st._warm.keys() and 14 not in st._warm  # the two lightest packed
    st._mass[14] = 0.9  # now the lightest, without a copy; 12 (1.0) within the factor
    inline = st.stats()["inline_packs"]
    new = rows(np.random.default_rng(9), 16)
    st.write(0, st.prepare(new)[0], 8)  # enters chunk 0: a hot slot is freed
    assert st._tier[12] == T.WARM and st._tier[14] == T.HOT and st._tier[0] == T.HOT
    assert st.stats()["inline_packs"] == inline
    st._mass[14] = 0.1  # far lighter than 13 (2.0, packed): 14 goes, not 13
    st.write(8, st.prepare({k: v[8:] for k, v in new.items()})[0], 8)  # enters chunk 1
    assert st._tier[14] == T.WARM and st._tier[13] == T.HOT and st._tier[1] == T.HOT
    data = {k: np.concatenate([new[k], v[16:]]) for k, v in data.items()}
    idx = np.array([3, 9, 12 * 8 + 2, 13 * 8, 14 * 8 + 6, 100])
    assert_same(st.gather(idx), {k: v[idx] for k, v in data.items()})


def test_warm_bytes_kept_in_step_with_the_pieces(tmp_path):
    # the running total of compressed RAM (read on every move) equals a recount
    st = tiered(tmp_path, hot_bytes=5 * 8 * ROW, warm_bytes=900, prefetch=True, pack_ahead=2)
    ram = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=4)
    buf = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=4, storage=st)
    for seed in range(4):
        drive(ram, buf, 30, seed=seed)
        st.settle()
        recount = sum(len(p) for pieces in st._warm.values() for p in pieces)
        assert st.stats()["bytes"]["warm"] == st._warm.nbytes == recount
        assert recount == int(st._comp[list(st._warm)].sum())
    assert st.stats()["demotions"] > 10 and st.stats()["chunks"]["cold"] > 0
    st._warm.clear()
    assert st._warm.nbytes == 0
    st.close()


def test_stats_consistent_with_counts(tmp_path):
    st, data = filled(tmp_path, hot_bytes=2 * 8 * ROW, warm_bytes=300)
    masses = np.arange(1.0, 17.0)
    st.rebalance(masses)
    st.settle()
    idx = np.random.default_rng(2).integers(0, 128, 500)
    got = st.gather(idx)
    assert_same(got, {k: v[idx] for k, v in data.items()})
    tiers = st._tier[idx >> 3]
    s = st.stats()
    for t, name in enumerate(T.TIER_NAMES):
        assert s[f"rows_{name}"] == np.count_nonzero(tiers == t)
        assert s["hit_rate"][name] == pytest.approx(np.mean(tiers == t))
        assert s["chunks"][name] == np.count_nonzero(st._tier == t)
    hot = masses[st._tier == T.HOT].sum() / masses.sum()
    assert s["mass_fraction"]["hot"] == pytest.approx(hot)
    assert sum(s["mass_fraction"].values()) == pytest.approx(1.0)
    assert s["bytes"]["cold"] > 0 and s["disk_bytes_read"] > 0 and s["decompressions"] > 0


def test_checkpoint_round_trip(tmp_path):
    st = tiered(tmp_path)
    ram = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=5)
    buf = PrioritizedReplayBuffer(300, FIELDS, alpha=0.6, beta=0.4, seed=5, storage=st)
    drive(ram, buf, 60)
    buf.save(tmp_path / "tiered.fpr")
    ram.save(tmp_path / "ram.fpr")
    loaded = fastper.load(tmp_path / "tiered.fpr")
    assert_same(loaded.state_dict()["storage"], ram.state_dict()["storage"])
    back = PrioritizedReplayBuffer(
        300, FIELDS, alpha=0.6, beta=0.4, seed=0, storage=tiered(tmp_path / "b")
    )
    back.load_state_dict(loaded.state_dict())
    drive(fastper.load(tmp_path / "ram.fpr"), back, 30, seed=8)


def test_corrupted_or_truncated_cold_file_names_the_file(tmp_path):
    st, data = filled(tmp_path, hot_bytes=8 * ROW, warm_bytes=0)
    cold = np.flatnonzero(st._tier == T.COLD)
    c = int(cold[0])
    path = st._path(c)
    before = st._tier.copy()
    with open(path, "r+b") as f:  # flip a payload byte: the checksum catches it
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(TierDataError, match=f"{path}.*checksum"):
        st.gather(np.array([c * 8 + 7]))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)
    with pytest.raises(TierDataError, match=f"{path}.*truncated"):
        st.gather(np.array([c * 8]))
    assert np.array_equal(st._tier, before)  # nothing moved
    other = int(cold[1]) * 8 + 2
    assert_same(st.gather(np.array([other])), {k: v[[other]] for k, v in data.items()})


def test_corrupted_file_leaves_the_buffer_unchanged(tmp_path):
    st = tiered(tmp_path, capacity=64, hot_bytes=8 * ROW, warm_bytes=0, rebalance_every=10**6)
    buf = ReplayBuffer(64, FIELDS, seed=0, storage=st)
    buf.add(rows(np.random.default_rng(0), 64))
    for f in os.listdir(tmp_path / "cold"):
        with open(tmp_path / "cold" / f, "wb") as fh:
            fh.write(b"junk")
    p = buf.priorities(np.arange(64))
    rng_state = buf._rng.bit_generator.state
    with pytest.raises(TierDataError, match="cold chunk file .* truncated or altered"):
        buf.sample(64)
    # the rows, priorities, ring, step and random generator stay as they were
    assert len(buf) == 64 and buf.step == 0 and np.array_equal(buf.priorities(np.arange(64)), p)
    assert buf._rng.bit_generator.state == rng_state


@pytest.mark.parametrize(
    "bad",
    [
        {"obs": np.zeros((3, 4), np.uint8), "action": 1, "reward": 0.5},
        {"obs": np.full((3, 5), 300), "action": 1, "reward": 0.5},
        {"obs": np.zeros((3, 5)), "action": 1.5, "reward": 0.5},
        {"obs": np.zeros((3, 5)), "action": 1},
    ],
)
def test_bad_rows_raise_as_ram_storage(tmp_path, bad):
    st = tiered(tmp_path)
    with pytest.raises(Exception) as want:
        Storage(FIELDS, 300).prepare(bad)
    with pytest.raises(type(want.value)) as got:
        st.prepare(bad)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"chunk_size": 12}, r"`chunk_size` must be a power of 2, got chunk_size=12"),
        ({"hysteresis": 0.5}, r"`hysteresis` must be >= 1.0, got hysteresis=0.5"),
        ({"smoothing": 0.0}, r"`smoothing` must be > 0.0, got smoothing=0.0"),
        ({"smoothing": 1.5}, r"`smoothing` must be <= 1.0, got smoothing=1.5"),
        ({"codec": "snappy"}, r"`codec` must be one of .*got codec='snappy'"),
        ({"hot_bytes": -1}, r"`hot_bytes` must be >= 0, got hot_bytes=-1"),
        ({"pack_ahead": -1}, r"`pack_ahead` must be >= 0, got pack_ahead=-1"),
    ],
)
def test_argument_errors(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        tiered(tmp_path, **kw)


def test_cold_dir_of_another_storage_is_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "x-0000001.fpc").write_bytes(b"")
    with pytest.raises(ValueError, match="`cold_dir` must not hold chunk files"):
        tiered(tmp_path, cold_dir=d)


def test_rebalance_checks_masses(tmp_path):
    st = tiered(tmp_path)
    with pytest.raises(ValueError, match=r"`masses` must be 38 finite values >= 0"):
        st.rebalance(np.ones(3))
    with pytest.raises(ValueError, match="`masses` must be"):
        st.rebalance(np.full(38, -1.0))


@pytest.mark.parametrize("chunk", [1, 4, 8, 16, 64, 512])
@pytest.mark.parametrize("capacity", [5, 100, 4096, 5000])
def test_chunk_masses_equal_naive_sums(chunk, capacity):
    s = ProportionalSampler(capacity, 0.6)
    s.write(np.arange(capacity), np.random.default_rng(0).random(capacity))
    n_chunks = -(-capacity // chunk)
    naive = np.zeros(n_chunks * chunk)
    naive[:capacity] = s.raw[:capacity] ** 0.6
    assert np.allclose(s.chunk_masses(chunk, capacity), naive.reshape(n_chunks, chunk).sum(1))
    u = UniformSampler(capacity, 0.0).chunk_masses(chunk, capacity - 1)
    assert u.sum() == capacity - 1 and u.shape == (n_chunks,)


def test_clear_removes_cold_files_and_rows(tmp_path):
    st, _ = filled(tmp_path, hot_bytes=8 * ROW, warm_bytes=0)
    assert os.listdir(tmp_path / "cold")
    st.clear()
    assert not os.listdir(tmp_path / "cold") and st.stats()["chunks"]["cold"] == 0


def test_auto_codec_falls_back_to_zlib(monkeypatch):
    def missing():
        raise ImportError("not installed")

    monkeypatch.setattr(C, "_MAKERS", {**C._MAKERS, **dict.fromkeys(C.AUTO_ORDER, missing)})
    with pytest.warns(UserWarning, match="using zlib"):
        assert T.make_codec("auto").name == "zlib"


def test_import_fastper_imports_no_codec():
    code = "import sys, fastper; print([m for m in ('lz4', 'zstandard', 'blosc2') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("fast", [True, False])
def test_addresses_of_warm_pieces(fast):
    # the compiled gather reads warm blocks by address: the fast path (CPython's
    # layout, checked at import) and the ctypes one agree with numpy's view
    from fastper import tier_warm

    offset = tier_warm.BYTES_OFFSET if fast else None
    if fast and offset is None:
        pytest.skip("this interpreter's bytes layout is not CPython's")
    pieces = (b"", b"a", bytes(range(256)) * 3, np.arange(9, dtype=np.int64).tobytes())
    want = [np.frombuffer(p, dtype=np.uint8).ctypes.data if p else None for p in pieces]
    got = tier_warm.piece_addresses(pieces, offset)
    assert [g if p else None for g, p in zip(got, pieces, strict=True)] == want

