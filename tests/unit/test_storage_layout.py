"""The RAM storage's two layouts: records (small rows) and columns (large rows).

A sampled row of a small transition is read as one record (one or two cache
lines) instead of one line per field. Both layouts must be the same storage
to every reader: the same rows written, gathered, read, saved and loaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fastper
from fastper import checkpoint as ckpt
from fastper.storage import RECORD_ROW_BYTES, Storage

FIELDS = {
    "obs": ((3,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "flag": ((), np.bool_),
    "pair": ((2,), np.int16),
}


def _rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.standard_normal((k, 3)).astype(np.float32),
        "action": rng.integers(-(2**40), 2**40, k),
        "reward": rng.standard_normal(k).astype(np.float32),
        "flag": rng.random(k) < 0.5,
        "pair": rng.integers(-300, 300, (k, 2)).astype(np.int16),
    }


def test_auto_layout_stores_small_rows_as_records_and_large_rows_as_columns() -> None:
    cartpole = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
                "next_obs": ((4,), np.float32), "done": ((), np.float32)}  # fmt: skip
    assert Storage(cartpole, 8).layout == "records"  # 48 bytes, no padding
    assert Storage({**cartpole, "done": ((), np.bool_)}, 8).layout == "records"  # 45 in 48
    assert Storage(FIELDS, 8).layout == "records"  # 29 bytes in a 32-byte record
    assert Storage({"a": ((), np.int64), "done": ((), np.bool_)}, 8).layout == "columns"
    assert Storage({"x": ((4,), np.float32)}, 8).layout == "columns"  # one field
    big = {"frame": ((RECORD_ROW_BYTES + 4,), np.uint8), "r": ((), np.float32)}
    assert Storage(big, 8).layout == "columns"
    edge = {"frame": ((RECORD_ROW_BYTES - 4,), np.uint8), "r": ((), np.float32)}
    assert Storage(edge, 8).layout == "records"
    assert Storage(FIELDS, 8, layout="columns").layout == "columns"
    assert Storage(big, 8, layout="records").layout == "records"
    with pytest.raises(ValueError, match="`layout` must be 'auto', 'records' or 'columns'"):
        Storage(FIELDS, 8, layout="rows")


def test_records_are_chosen_only_where_padding_takes_at_most_an_eighth_of_a_record() -> None:
    """By default records pad a slot by at most 1/8 of the record; asked for,
    records pad each slot as much as it takes for every field of every slot
    to be aligned."""
    even = {"a": ((), np.int64), "b": ((3,), np.float32), "c": ((), np.float32)}  # 24 bytes
    odd = {"a": ((), np.int64), "b": ((), np.uint8), "c": ((3,), np.float32)}  # 21 bytes
    assert Storage(even, 100).layout == "records"
    assert Storage(even, 100).nbytes() == Storage(even, 100, layout="columns").nbytes() == 2400
    assert Storage(odd, 100).layout == "records"  # 3 bytes of 24: exactly 1/8
    assert Storage(odd, 100).nbytes() == 2400
    wider = {**odd, "d": ((), np.uint8)}  # 22 bytes: 2 of 24 are padding
    assert Storage(wider, 100).layout == "records"
    thin = {"a": ((), np.int64), "b": ((), np.uint8), "c": ((2,), np.float32)}  # 17 of 24
    assert Storage(thin, 100).layout == "columns"
    assert Storage(thin, 100).nbytes() == 1700
    for fields in (thin, odd):  # 17 and 21 bytes, padded to a multiple of 8
        padded = Storage(fields, 100, layout="records")
        assert padded.nbytes() == 100 * 24
        for name, (shape, dtype) in fields.items():
            col = padded.columns[name]
            assert col.shape == (100, *shape) and col.dtype == np.dtype(dtype)
            assert col.flags.aligned and col.strides[0] % col.dtype.itemsize == 0


def test_both_layouts_store_gather_read_and_round_trip_the_same_rows() -> None:
    rng = np.random.default_rng(5)
    cap = 23
    rec, col = Storage(FIELDS, cap, layout="records"), Storage(FIELDS, cap, layout="columns")
    direct = [s.direct_rows() for s in (rec, col)]
    start = 0
    for step in range(60):
        k = int(rng.integers(1, 9))
        rows = _rows(rng, k)
        if step % 3 == 0:  # the no-cast path: one row, a batch of one, a batch (no wrap)
            k = min(k, cap - start)
            one = {n: v[0] for n, v in rows.items()} if k == 1 else {n: v[:k] for n, v in rows.items()}
            for d in direct:
                matched = d.match(one)
                assert matched is not None
                d.write(start, *matched)
        else:
            for s in (rec, col):
                prepared, n = s.prepare(rows)
                s.write(start, prepared, n)  # wraps at the end of the ring
        start = (start + k) % cap
        idx = rng.integers(0, cap, 17)
        a, b = rec.gather(idx), col.gather(idx)
        for name in FIELDS:
            assert a[name].flags.c_contiguous and a[name].dtype == b[name].dtype
            np.testing.assert_array_equal(a[name], b[name])
        lo = int(rng.integers(0, cap))
        for name in FIELDS:
            np.testing.assert_array_equal(rec.read(name, lo, cap), col.read(name, lo, cap))
    # a gathered copy is the caller's: writing it changes nothing stored
    got = rec.gather(np.array([0, 1]))
    got["obs"][:] = 99.0
    assert not (rec.columns["obs"][:2] == 99.0).any()
    # a state of one layout loads into the other
    for src, dst in ((rec, Storage(FIELDS, cap, layout="columns")),
                     (col, Storage(FIELDS, cap, layout="records"))):  # fmt: skip
        dst.load_state_dict(src.state_dict(cap), cap)
        for name in FIELDS:
            np.testing.assert_array_equal(dst.columns[name], src.columns[name])


def test_gather_of_records_returns_each_field_as_its_own_array_of_any_shape() -> None:
    """A record's fields come apart as C-contiguous arrays of (indices' shape, *field's
    shape) and the field's dtype, equal to the columns layout's: fields of several
    axes, of none, of zero size, and index arrays of one axis, two, none (0-d), or
    of no entries."""
    fields = {"m": ((2, 3), np.float32), "v": ((3,), np.int16), "s": ((), np.float64),
              "z": ((0,), np.float32), "b": ((), np.bool_), "u": ((1,), np.uint8)}  # fmt: skip
    rng = np.random.default_rng(11)
    rows = {
        "m": rng.standard_normal((40, 2, 3)).astype(np.float32),
        "v": rng.integers(-99, 99, (40, 3)).astype(np.int16),
        "s": rng.standard_normal(40),
        "z": np.zeros((40, 0), np.float32),
        "b": rng.random(40) < 0.5,
        "u": rng.integers(0, 256, (40, 1)).astype(np.uint8),
    }
    rec, col = Storage(fields, 40, layout="records"), Storage(fields, 40, layout="columns")
    for st in (rec, col):
        st.write(0, *st.prepare(rows))
    indices = (rng.integers(0, 40, 7), rng.integers(0, 40, (3, 4)), np.zeros(0, np.int64),
               np.array(5))  # fmt: skip
    for idx in indices:
        got, want = rec.gather(idx), col.gather(idx)
        for name, values in rows.items():
            assert got[name].shape == (*idx.shape, *fields[name][0]), name
            assert got[name].dtype == values.dtype and got[name].flags.c_contiguous, name
            np.testing.assert_array_equal(got[name], values[idx], err_msg=name)
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        got["m"][...] = -1.0  # the caller's copy
    assert not (rec.columns["m"] == -1.0).any()


def test_the_compiled_gather_copies_every_field_width_and_refuses_what_take_refuses() -> None:
    """The buffers' indices (int64, one axis) are gathered by a compiled copy of each
    field's bytes: fields of every width it copies its own way (4, 8, 16 bytes, and
    others, at offsets of any alignment) come out equal to the columns layout's, each
    its own aligned C-contiguous array; any other indices (int32, strided) take numpy's
    way with the same result (as do read-only ones); an index past the end raises
    IndexError as numpy's take does, a negative one counts from the end as it does."""
    fields = {"f4": ((), np.float32), "f8": ((), np.float64), "v16": ((4,), np.int32),
              "b1": ((), np.bool_), "u3": ((3,), np.uint8), "h2": ((), np.int16),
              "w24": ((3,), np.float64), "h6": ((3,), np.int16), "c12": ((3,), np.float32),
              "z0": ((0,), np.float32)}  # fmt: skip
    rng = np.random.default_rng(5)
    n = 50
    rows = {
        name: (rng.random((n, *shape)) < 0.5 if dtype is np.bool_ else
               (rng.standard_normal((n, *shape)) * 1000).astype(dtype))
        for name, (shape, dtype) in fields.items()
    }  # fmt: skip
    rec, col = Storage(fields, n, layout="records"), Storage(fields, n, layout="columns")
    assert rec.layout == "records"
    for st in (rec, col):
        st.write(0, *st.prepare(rows))
    for b in (1, 5, 64, 257):
        idx = rng.integers(0, n, b)
        for variant in (idx, idx.astype(np.int32), np.repeat(idx, 2)[::2]):
            got, want = rec.gather(variant), col.gather(variant)
            assert list(got) == list(fields)
            # the compiled gather (the buffers' int64 indices: contiguous, as numpy
            # counts one entry at any stride) puts every field in one new array
            compiled = variant.dtype == np.int64 and variant.flags.c_contiguous
            assert compiled or variant is not idx
            bases = [a.base for a in got.values()]
            assert (bases[0] is not None and all(x is bases[0] for x in bases)) is compiled
            for name, values in rows.items():
                g = got[name]
                assert g.shape == (b, *fields[name][0]) and g.dtype == values.dtype, name
                assert g.flags.c_contiguous and g.flags.aligned and g.flags.writeable, name
                np.testing.assert_array_equal(g, values[idx], err_msg=name)
                np.testing.assert_array_equal(g, want[name], err_msg=name)
    got = rec.gather(np.arange(n))
    before = {name: a.copy() for name, a in got.items()}
    names = list(fields)
    for i, name in enumerate(names):  # each field's array is its own: writing one
        got[name][...] = 0  # changes no other (nor the rows stored)
        for other in names[i + 1 :]:
            np.testing.assert_array_equal(got[other], before[other], err_msg=f"{name}: {other}")
    for name, values in rows.items():
        np.testing.assert_array_equal(rec.columns[name], values, err_msg=name)
    readonly = np.arange(n)
    readonly.flags.writeable = False  # (another signature: numpy's way, the same rows)
    for name, values in rec.gather(readonly).items():
        np.testing.assert_array_equal(values, rows[name], err_msg=name)
    for bad in (np.array([0, n]), np.array([n + 10**6]), np.array([-n - 1, 0])):
        with pytest.raises(IndexError, match="out of bounds"):
            rec.gather(bad)
    back = rec.gather(np.array([-1, -n]))  # from the end, as numpy's take counts
    for name, values in rows.items():
        np.testing.assert_array_equal(back[name], values[[n - 1, 0]], err_msg=name)


ALIGNED = {"obs": ((3,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
           "flags": ((8,), np.uint8)}  # fmt: skip  (32 bytes: records by default)


def _aligned_rows(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    rows = _rows(rng, k)
    return {"obs": rows["obs"], "action": rows["action"], "reward": rows["reward"],
            "flags": rng.integers(0, 256, (k, 8)).astype(np.uint8)}  # fmt: skip


def _filled(layout: str, n: int = 300) -> Any:
    rng = np.random.default_rng(1)
    buf = fastper.PrioritizedReplayBuffer(
        512, ALIGNED, seed=0, storage=lambda f, c: Storage(f, c, layout=layout)
    )
    buf.add(_aligned_rows(rng, n))
    s = buf.sample(64)
    buf.update_priorities(s, rng.standard_normal(64))
    return buf


@pytest.mark.parametrize("chunk", [None, 40])
def test_a_record_buffer_saves_and_loads_in_chunks_of_rows(tmp_path, monkeypatch, chunk) -> None:
    """Checkpoints are the same bytes for both layouts, and a file loads straight
    into the strided columns of a record storage a chunk of rows at a time (a
    chunk of 40 bytes: a few rows each, so many chunks and a partial last one)."""
    if chunk is not None:
        monkeypatch.setattr(ckpt, "_CHUNK", chunk)
        monkeypatch.setattr(ckpt, "_LAZY_CHUNK", chunk)
    rec, col = _filled("records"), _filled("columns")
    assert rec.storage.layout == "records" and col.storage.layout == "columns"
    rec.save(tmp_path / "rec.fpk")
    col.save(tmp_path / "col.fpk")
    assert (tmp_path / "rec.fpk").read_bytes() == (tmp_path / "col.fpk").read_bytes()
    loaded = fastper.load(tmp_path / "col.fpk")
    assert loaded.storage.layout == "records"  # the default for these fields
    for name in ALIGNED:
        np.testing.assert_array_equal(loaded.storage.columns[name], rec.storage.columns[name])
    a, b = loaded.sample(32), rec.sample(32)
    np.testing.assert_array_equal(a.indices, b.indices)
    for name in ALIGNED:
        np.testing.assert_array_equal(a.data[name], b.data[name])
    # a buffer keeps the layout it was made with when it loads a state
    kept = _filled("columns", n=10)
    kept.load_state_dict(loaded.state_dict())
    assert kept.storage.layout == "columns"
    for name in ALIGNED:
        np.testing.assert_array_equal(kept.storage.columns[name], rec.storage.columns[name])
    np.testing.assert_array_equal(kept.sample(32).indices, loaded.sample(32).indices)


def test_padded_records_are_the_same_buffer_as_columns(tmp_path) -> None:
    """Rows that a record pads (a bool flag beside 4- and 8-byte fields) take records
    by default, and a buffer on them samples, updates and saves exactly as one
    on columns: the same slots, data, weights and checkpoint bytes, through
    single adds, batches, long runs copied as items and wraps."""
    rng = np.random.default_rng(11)
    bufs = {
        layout: fastper.PrioritizedReplayBuffer(
            700, FIELDS, seed=3, storage=lambda f, c, layout=layout: Storage(f, c, layout=layout)
        )
        for layout in ("records", "columns")
    }
    default = fastper.PrioritizedReplayBuffer(700, FIELDS, seed=3)
    assert default.storage.layout == "records"  # 29 bytes in a 32-byte record
    bufs["default"] = default
    for step in range(40):
        k = (1, 4, 300, 17)[step % 4]
        rows = _rows(rng, k)
        if k == 1:
            rows = {name: v[0] for name, v in rows.items()}
        td = np.abs(rng.standard_normal(32))
        got = []
        for buf in bufs.values():
            buf.add(rows)
            s = buf.sample(32)
            buf.update_priorities(s, td)
            got.append(s)
        first = got[0]
        for other in got[1:]:
            np.testing.assert_array_equal(other.indices, first.indices)
            np.testing.assert_array_equal(other.weights, first.weights)
            for name in FIELDS:
                np.testing.assert_array_equal(other.data[name], first.data[name])
    for layout, buf in bufs.items():
        buf.save(tmp_path / f"{layout}.fpk")
    files = {(tmp_path / f"{layout}.fpk").read_bytes() for layout in bufs}
    assert len(files) == 1


@pytest.mark.parametrize("chunk", [None, 40])
def test_strided_arrays_are_written_and_read_in_place_a_chunk_of_rows_at_a_time(
    tmp_path, monkeypatch, chunk
) -> None:
    """A state holding the record storage's own views (strided) is written as the
    same bytes as contiguous copies, and read back straight into strided targets."""
    if chunk is not None:
        monkeypatch.setattr(ckpt, "_CHUNK", chunk)
        monkeypatch.setattr(ckpt, "_LAZY_CHUNK", chunk)
    rng = np.random.default_rng(3)
    src = Storage(FIELDS, 50, layout="records")
    prepared, k = src.prepare(_rows(rng, 50))
    src.write(0, prepared, k)
    views = src.state_dict(50)
    assert not views["columns/obs"].flags.c_contiguous  # the case under test
    ckpt.write_state(tmp_path / "views.fpk", {"storage": views})
    copies = {name: np.ascontiguousarray(v) for name, v in views.items()}
    ckpt.write_state(tmp_path / "copies.fpk", {"storage": copies})
    assert (tmp_path / "views.fpk").read_bytes() == (tmp_path / "copies.fpk").read_bytes()
    dst = Storage(FIELDS, 50, layout="records")
    targets = {f"storage/{name}": v for name, v in dst.state_targets(50).items()}
    state, _ = ckpt.read_state(tmp_path / "views.fpk", lambda _state: targets)
    for name, arr in state["storage"].items():
        assert np.shares_memory(arr, dst.columns[name.split("/", 1)[1]])  # read in place
    for name in FIELDS:
        np.testing.assert_array_equal(dst.columns[name], src.columns[name])


@pytest.mark.parametrize("k", [3, 300, 1000])
def test_long_runs_are_copied_as_items_with_the_same_bytes(k: int) -> None:
    """Runs of many rows go into the records as opaque items (the general write and
    the no-cast write alike, wrapping or not, every field width including odd ones);
    rows of another dtype or layout take the plain strided copy. Same bytes."""
    fields = {**FIELDS, "odd": ((3,), np.uint8), "wide": ((2,), np.float64)}
    rng = np.random.default_rng(k)

    def rows() -> dict[str, np.ndarray]:
        out = _rows(rng, k)
        out["odd"] = rng.integers(0, 256, (k, 3)).astype(np.uint8)
        out["wide"] = rng.standard_normal((k, 2))
        return out

    cap = 1100
    rec, col = Storage(fields, cap, layout="records"), Storage(fields, cap, layout="columns")
    for start in (0, cap - k // 2):  # the second one wraps
        batch = rows()
        batch["pair"] = np.asfortranarray(batch["pair"])  # not C-contiguous: strided copy
        batch["action"] = batch["action"].astype(np.int32)  # another dtype: cast first
        for s in (rec, col):
            prepared, n = s.prepare(batch)
            s.write(start, prepared, n)
        for name in fields:
            np.testing.assert_array_equal(rec.columns[name], col.columns[name], err_msg=name)
    direct = [s.direct_rows() for s in (rec, col)]
    batch = rows()
    for d in direct:  # the no-cast path of a batch (no wrap)
        matched = d.match(batch)
        assert matched is not None
        d.write(7, *matched)
    for name in fields:
        np.testing.assert_array_equal(rec.columns[name], col.columns[name], err_msg=name)


@pytest.mark.parametrize("layout", ["records", "columns"])
def test_a_copy_of_a_storage_is_a_storage_of_its_own(layout: str) -> None:
    import copy
    import pickle

    rng = np.random.default_rng(2)
    src = Storage(ALIGNED, 300, layout=layout)
    prepared, k = src.prepare(_aligned_rows(rng, 300))
    src.write(0, prepared, k)  # (a long run: the storage's writers are made)
    before = {n: c.copy() for n, c in src.columns.items()}
    for dup in (copy.deepcopy(src), pickle.loads(pickle.dumps(src))):
        assert dup.layout == layout
        again, k2 = dup.prepare(_aligned_rows(rng, 300))
        dup.write(0, again, k2)
        got = dup.gather(np.arange(300))
        for name in ALIGNED:
            np.testing.assert_array_equal(src.columns[name], before[name])  # untouched
            np.testing.assert_array_equal(got[name], again[name])  # the copy's own rows


def test_the_item_copy_and_its_fallbacks_store_the_same_rows() -> None:
    """The writer of a field of records: C-contiguous rows of the field's dtype
    (one axis, several, none) as items; other rows by numpy's strided copy."""
    fields = {"m": ((2, 3), np.float32), "v": ((3,), np.int16), "s": ((), np.float64),
              "pad": ((2,), np.int16)}  # fmt: skip
    st = Storage(fields, 600, layout="records")
    assert st.layout == "records"
    rng = np.random.default_rng(8)
    k = 300
    cases = {
        "m": rng.standard_normal((k, 2, 3)).astype(np.float32),
        "v": rng.integers(-99, 99, (k, 3)).astype(np.int16),
        "s": rng.standard_normal(k),
        "pad": rng.integers(-99, 99, (k, 2)).astype(np.int16),
    }
    for name, rows in cases.items():
        put = st._putter(name)
        # a scalar field is copied by its slice: numpy's strided scalar copy is as fast
        assert put.__name__ == ("put" if name == "s" else "put_items")
        put(10, rows)  # as items
        np.testing.assert_array_equal(st.columns[name][10 : 10 + k], rows)
        other = rows[::-1].copy().astype(np.float64 if name != "s" else np.float32)
        put(250, other)  # another dtype: numpy's cast and strided copy
        np.testing.assert_array_equal(st.columns[name][250 : 250 + k], other.astype(rows.dtype))
        strided = np.asfortranarray(rows) if rows.ndim > 1 else rows[::-1]
        put(0, strided)  # not C-contiguous (or reversed): numpy's strided copy
        np.testing.assert_array_equal(st.columns[name][:k], strided)
    big = Storage({"x": ((2**31,), np.uint8)}, 1)  # no record dtype is built for it
    assert big.layout == "columns"


def test_the_records_a_sampler_prefetches_are_the_records_as_bytes() -> None:
    rec, col = Storage(FIELDS, 30, layout="records"), Storage(FIELDS, 30, layout="columns")
    rows, row_bytes = rec.record_bytes
    assert row_bytes == rec.nbytes() // 30 and rows.dtype == np.uint8
    assert rows.shape == (30 * row_bytes,)
    rng = np.random.default_rng(3)
    rec.write(0, _rows(rng, 30), 30)
    for slot in (0, 17, 29):  # record ``slot`` is bytes slot * row_bytes ...
        seen = rows[slot * row_bytes : (slot + 1) * row_bytes]
        assert seen.tobytes() == rec._records[slot : slot + 1].tobytes()
    assert col.record_bytes[1] == 0 and col.record_bytes[0].size == 0  # nothing to prefetch
