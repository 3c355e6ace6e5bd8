"""lz4 with and without its compiled kernels: the FASTPER_LZ4_KERNELS switch, same results."""

from __future__ import annotations

import numpy as np
import pytest

from fastper import PrioritizedReplayBuffer
from fastper import tier_codecs as C
from fastper.tiers import TieredStorage

pytest.importorskip("lz4.block", reason="lz4 (extra fastper[tiers])")

FIELDS = {"obs": ((3, 5), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
ROW = 15 + 8 + 4


def compiled_available(monkeypatch) -> bool:
    monkeypatch.delenv("FASTPER_LZ4_KERNELS", raising=False)
    return C.make_codec("lz4").warm_rows is not None


def rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.integers(0, 4, (k, 3, 5)).astype(np.uint8),  # compressible, not constant
        "action": rng.integers(0, 5, k),
        "reward": rng.random(k).astype(np.float32),
    }


def storage(tmp_path, prefetch: bool | None) -> TieredStorage:
    # 16 chunks of 8 rows: 3 hot, a few warm (600 bytes compressed), the rest cold
    return TieredStorage(
        FIELDS, 128, chunk_size=8, hot_bytes=3 * 8 * ROW, warm_bytes=600, block_bytes=2 * ROW,
        rebalance_every=2, cold_dir=tmp_path, codec="lz4", prefetch=prefetch,
    )  # fmt: skip


def test_lz4_kernels_env_zero_makes_the_codec_work_in_python(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPER_LZ4_KERNELS", "0")
    codec = C.make_codec("lz4")
    assert codec.warm_rows is None and codec.pack_blocks is None
    st = storage(tmp_path, prefetch=None)
    assert st.codec.warm_rows is None and st.prefetch is False  # moves inline by default
    data = rows(np.random.default_rng(0), 128)
    st.write(0, *st.prepare(data))
    assert st.stats()["chunks"]["warm"] > 0
    got = st.gather(np.arange(128))
    for name, col in data.items():
        assert np.array_equal(got[name], col), name
    assert st.stats()["rows_warm"] > 0 and st.stats()["inline_packs"] > 0
    st.close()


@pytest.mark.parametrize("value", ["", "1"])
def test_lz4_kernels_env_one_or_unset_keeps_the_kernels(monkeypatch, value):
    if not compiled_available(monkeypatch):
        pytest.skip("lz4's compiled kernels do not load here")
    monkeypatch.setenv("FASTPER_LZ4_KERNELS", value)
    codec = C.make_codec("lz4")
    assert codec.warm_rows is not None and codec.pack_blocks is not None


def test_lz4_kernels_env_other_value_is_refused(monkeypatch):
    monkeypatch.setenv("FASTPER_LZ4_KERNELS", "off")
    with pytest.raises(ValueError, match=r"`FASTPER_LZ4_KERNELS` must be 0 .* or 1 .*got "):
        C.make_codec("lz4")
    monkeypatch.delenv("FASTPER_LZ4_KERNELS")
    assert C.make_codec("lz4").name == "lz4"


@pytest.mark.parametrize("prefetch", [None, False])
def test_pure_lz4_path_gives_the_same_rows_and_samples_as_the_kernels(
    tmp_path, monkeypatch, prefetch
):
    """Same adds, samples and updates on a buffer with the kernels and one without:
    every batch (indices, weights, keys, rows) and every stored row the same."""
    if not compiled_available(monkeypatch):
        pytest.skip("lz4's compiled kernels do not load here")
    bufs, stores = [], []
    for on in ("1", "0"):
        monkeypatch.setenv("FASTPER_LZ4_KERNELS", on)
        st = storage(tmp_path / on, prefetch)
        assert (st.codec.warm_rows is not None) == (on == "1")
        stores.append(st)
        bufs.append(PrioritizedReplayBuffer(128, FIELDS, alpha=0.6, beta=0.4, seed=3, storage=st))
    rng = np.random.default_rng(1)
    for _ in range(120):  # ~700 rows: the ring wraps five times
        tr = rows(rng, int(rng.integers(1, 12)))
        for b in bufs:
            b.add(tr)
        sa, sb = (b.sample(16) for b in bufs)
        assert np.array_equal(sa.indices, sb.indices)
        assert np.array_equal(sa.weights, sb.weights)
        assert np.array_equal(sa.keys, sb.keys)
        assert sa.data.keys() == sb.data.keys()
        for name in sa.data:
            assert np.array_equal(sa.data[name], sb.data[name]), name
        td = rng.random(16) ** 4 * 10  # heavy-tailed: chunks move between tiers
        for b, s in zip(bufs, (sa, sb), strict=True):
            b.update_priorities(s.indices, td, keys=s.keys)
    for name in FIELDS:
        assert np.array_equal(stores[0].read(name, 0, 128), stores[1].read(name, 0, 128))
    stats = [st.stats() for st in stores]
    for s in stats:
        assert s["promotions"] > 0 and s["demotions"] > 0 and s["rows_warm"] > 0, s
    if prefetch is False:  # no thread: the same placement, row for row
        for t in ("rows_hot", "rows_warm", "rows_cold", "promotions", "demotions"):
            assert stats[0][t] == stats[1][t], t
    for st in stores:
        st.close()
