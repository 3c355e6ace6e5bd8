"""Columnar ring storage: slot placement, validation and safe casts."""

from __future__ import annotations

import numpy as np
import pytest

from fastper import Field, FieldTypeError, ReplayStorage, Storage
from fastper.writer import RingWriter
from tests.conftest import make_batch


class _Ring:
    """Storage + ring writer, as a buffer drives them: the k-th row goes to slot k % capacity."""

    def __init__(self, fields, capacity):
        self.storage = Storage(fields, capacity)
        self.writer = RingWriter(capacity)

    def __getattr__(self, name):
        return getattr(self.storage, name)

    @property
    def cursor(self):
        return self.writer.cursor

    @property
    def size(self):
        return self.writer.size

    def add(self, transition):
        prepared, k = self.storage.prepare(transition)
        start = self.writer.cursor
        self.storage.write(start, prepared, k)
        self.writer.advance(k)
        return self.writer.slots(start, k)

    def clear(self):
        self.storage.clear()
        self.writer.clear()


def test_storage_follows_the_protocol_and_round_trips_its_state():
    s = Storage({"x": ((2,), np.float32), "y": np.int64}, 5)
    assert isinstance(s, ReplayStorage)
    prepared, k = s.prepare({"x": np.ones((3, 2)), "y": [1, 2, 3]})
    s.write(4, prepared, k)  # wraps: slots 4, 0, 1
    assert s.columns["y"].tolist() == [2, 3, 0, 0, 1]
    other = Storage({"x": ((2,), np.float32), "y": np.int64}, 5)
    other.load_state_dict({k: v.copy() for k, v in s.state_dict(5).items()}, 5)
    assert all(np.array_equal(other.columns[f], s.columns[f]) for f in s.columns)
    with pytest.raises(ValueError, match="column `y` must be int64"):
        other.load_state_dict({"columns/x": np.zeros((5, 2), np.float32),
                               "columns/y": np.zeros(5, np.float32)}, 5)
    assert other.columns["y"].tolist() == [2, 3, 0, 0, 1]  # refused: unchanged
    assert s.read("y", 1, 3).tolist() == [3, 0]


def _state(storage: _Ring) -> tuple[dict[str, np.ndarray], int, int]:
    cols = {name: col.copy() for name, col in storage.columns.items()}
    return cols, storage.cursor, storage.size


def _assert_unchanged(storage: _Ring, before: tuple[dict[str, np.ndarray], int, int]) -> None:
    cols, cursor, size = before
    assert storage.cursor == cursor
    assert storage.size == size
    for name, col in storage.columns.items():
        assert col.dtype == cols[name].dtype
        np.testing.assert_array_equal(col, cols[name], err_msg=name)


# --------------------------------------------------------------------------- spec parsing


def test_field_spec_forms_are_normalised() -> None:
    s = _Ring(
        {
            "a": ((4,), np.float32),
            "b": (3, "int16"),
            "c": np.uint8,
            "d": {"shape": (2, 2), "dtype": np.float64},
            "e": Field((5,), np.dtype(np.bool_)),
        },
        capacity=7,
    )
    assert s.fields["a"] == Field((4,), np.dtype(np.float32))
    assert s.fields["b"] == Field((3,), np.dtype(np.int16))
    assert s.fields["c"] == Field((), np.dtype(np.uint8))
    assert s.fields["d"] == Field((2, 2), np.dtype(np.float64))
    assert s.fields["e"] == Field((5,), np.dtype(np.bool_))
    assert s.columns["a"].shape == (7, 4) and s.columns["a"].dtype == np.float32
    assert s.columns["d"].shape == (7, 2, 2)
    assert s.columns["c"].shape == (7,)
    assert s.nbytes_per_slot == 4 * 4 + 3 * 2 + 1 + 4 * 8 + 5
    assert len(s.columns) == 5 and s.size == 0 and s.cursor == 0


@pytest.mark.parametrize(
    ("fields", "capacity", "exc", "match"),
    [
        ({}, 4, ValueError, "non-empty mapping"),
        ({"x": np.float32}, 0, ValueError, "`capacity` must be >= 1"),
        ({"x": np.float32}, 2.5, TypeError, "`capacity` must be an integer"),
        ({"x": np.float32}, True, TypeError, "`capacity` must be an integer"),
        ({"x": ((-1,), np.float32)}, 4, ValueError, "non-negative"),
        ({"x": ((2,), object)}, 4, TypeError, "bool, integer or floating"),
        ({"x": ((2,), np.complex64)}, 4, TypeError, "bool, integer or floating"),
        ({"x": ((2,), "not-a-dtype")}, 4, TypeError, "numpy dtype"),
        ({"x": {"shape": (2,), "dtype": np.float32, "extra": 1}}, 4, ValueError, "keys"),
        ({"": np.float32}, 4, TypeError, "non-empty strings"),
        ({3: np.float32}, 4, TypeError, "non-empty strings"),
    ],
)
def test_bad_field_spec_or_capacity(fields, capacity, exc, match) -> None:
    with pytest.raises(exc, match=match):
        _Ring(fields, capacity)


# --------------------------------------------------------------------------- ring placement


def test_single_transition_goes_to_cursor(fields) -> None:
    s = _Ring(fields, 3)
    one = {k: v[0] for k, v in make_batch(1, start=5).items()}
    slots = s.add(one)
    assert slots.dtype == np.int64
    np.testing.assert_array_equal(slots, [0])
    assert s.size == 1 and s.cursor == 1
    np.testing.assert_array_equal(s.columns["obs"][0], [5, 5, 5, 5])
    assert s.columns["reward"][0] == 5.0
    assert s.columns["action"][0] == 1


@pytest.mark.parametrize("capacity", [1, 2, 5, 8])
def test_kth_transition_lives_in_slot_k_mod_capacity(fields, capacity) -> None:
    s = _Ring(fields, capacity)
    rng = np.random.default_rng(0)
    added = 0
    for _ in range(20):
        k = int(rng.integers(1, capacity + 1))
        slots = s.add(make_batch(k, start=added))
        np.testing.assert_array_equal(slots, np.arange(added, added + k) % capacity)
        added += k
        assert s.cursor == added % capacity
        assert s.size == min(added, capacity)
        # every filled slot holds the most recent transition mapped to it
        for slot in range(s.size):
            latest = max(t for t in range(added) if t % capacity == slot)
            assert s.columns["reward"][slot] == latest
            np.testing.assert_array_equal(s.columns["obs"][slot], [latest] * 4)
            np.testing.assert_array_equal(s.columns["next_obs"][slot], [latest + 1] * 4)
            assert s.columns["action"][slot] == latest % 2


def test_full_capacity_batch_wraps_from_mid_ring(fields) -> None:
    s = _Ring(fields, 4)
    s.add(make_batch(3, start=0))
    slots = s.add(make_batch(4, start=3))
    np.testing.assert_array_equal(slots, [3, 0, 1, 2])
    np.testing.assert_array_equal(s.columns["reward"], [4, 5, 6, 3])
    assert s.cursor == 3 and s.size == 4


def test_gather_returns_copies(fields) -> None:
    s = _Ring(fields, 4)
    s.add(make_batch(4))
    got = s.gather(np.array([2, 0, 2]))
    np.testing.assert_array_equal(got["reward"], [2, 0, 2])
    got["reward"][:] = -1
    np.testing.assert_array_equal(s.columns["reward"], [0, 1, 2, 3])


def test_add_copies_input(fields) -> None:
    s = _Ring(fields, 4)
    batch = make_batch(2)
    s.add(batch)
    batch["obs"][:] = 99
    assert (s.columns["obs"][:2] != 99).all()


def test_clear_resets_cursor_and_size(fields) -> None:
    s = _Ring(fields, 4)
    s.add(make_batch(3))
    s.clear()
    assert s.size == 0 and s.cursor == 0
    np.testing.assert_array_equal(s.add(make_batch(1)), [0])


# --------------------------------------------------------------------------- rejected adds


def _bad_transitions() -> list[tuple[str, dict, str]]:
    good = make_batch(2)
    cases: list[tuple[str, dict, str]] = []
    missing = {k: v for k, v in good.items() if k != "done"}
    cases.append(("missing", missing, r"missing fields \['done'\]"))
    cases.append(("unknown", {**good, "extra": np.zeros(2)}, r"unknown fields \['extra'\]"))
    cases.append(("wrong-shape", {**good, "obs": np.zeros((2, 3))}, "field `obs` must have shape"))
    cases.append(
        ("wrong-rank", {**good, "obs": np.zeros((2, 2, 4))}, "field `obs` must have shape")
    )
    cases.append(("mismatched-len", {**good, "reward": np.zeros(3)}, "batches of one length"))
    mixed = {**good, "reward": np.float32(1.0)}
    cases.append(("single-vs-batch", mixed, "one transition or batches"))
    cases.append(("empty", make_batch(0), "must not be empty"))
    cases.append(("too-big", make_batch(5), "must not exceed the capacity.*capacity=4"))
    return cases


@pytest.mark.parametrize(("name", "transition", "match"), _bad_transitions())
def test_bad_add_raises_and_writes_nothing(fields, name, transition, match) -> None:
    s = _Ring(fields, 4)
    s.add(make_batch(3, start=10))
    before = _state(s)
    with pytest.raises(ValueError, match=match):
        s.add(transition)
    _assert_unchanged(s, before)
    # the ring carries on as if nothing happened
    np.testing.assert_array_equal(s.add(make_batch(1, start=13)), [3])


def test_non_mapping_transition_is_type_error(fields) -> None:
    s = _Ring(fields, 4)
    with pytest.raises(TypeError, match="must be a mapping"):
        s.add([1, 2, 3])  # type: ignore[arg-type]
    assert s.size == 0 and s.cursor == 0


# --------------------------------------------------------------------------- casts


def test_field_type_error_is_type_and_value_error() -> None:
    assert issubclass(FieldTypeError, TypeError)
    assert issubclass(FieldTypeError, ValueError)


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (np.float32, np.float64(0.1), np.float32(0.1)),
        (np.float32, 7, np.float32(7)),
        (np.float32, True, np.float32(1)),
        (np.float64, np.float32(0.25), 0.25),
        (np.int64, 3.0, 3),
        (np.int32, np.int64(-5), -5),
        (np.uint8, 255, 255),
        (np.uint8, 0.0, 0),
        (np.int8, True, 1),
        (np.bool_, 1, True),
        (np.bool_, np.int64(0), False),
        (np.bool_, True, True),
    ],
)
def test_safe_casts_are_accepted(dtype, value, expected) -> None:
    s = _Ring({"x": dtype}, 2)
    s.add({"x": value})
    assert s.columns["x"].dtype == np.dtype(dtype)
    assert s.columns["x"][0] == expected


@pytest.mark.parametrize(
    ("dtype", "value", "match"),
    [
        (np.int64, 1.5, "non-integral floats"),
        (np.int64, np.nan, "non-integral floats"),
        (np.int64, np.inf, "non-integral floats"),
        (np.uint8, 300, "overflow"),
        (np.uint8, -1, "overflow"),
        (np.int8, 128, "overflow"),
        (np.uint8, 256.0, "overflow"),
        (np.int32, 2.0**31, "overflow"),
        (np.int64, 2.0**63, "field `x`"),
        (np.uint64, 2.0**64, "field `x`"),
        (np.int64, np.uint64(2**63), "overflow"),
        (np.bool_, 1.0, "bool"),
        (np.bool_, 0.0, "bool"),
        (np.bool_, 2, "bool"),
        (np.float32, 1e300, "overflow"),
        (np.float16, 1e6, "overflow"),
    ],
)
def test_unsafe_casts_raise_field_type_error(dtype, value, match) -> None:
    s = _Ring({"x": dtype, "y": np.float32}, 2)
    s.add({"x": np.zeros((), dtype=dtype), "y": 1.0})
    before = _state(s)
    with pytest.raises(FieldTypeError, match=match):
        s.add({"x": value, "y": 2.0})
    _assert_unchanged(s, before)


def test_unsafe_cast_in_one_row_of_a_batch_rejects_whole_batch() -> None:
    s = _Ring({"a": ((2,), np.float32), "b": np.uint8}, 8)
    with pytest.raises(FieldTypeError, match=r"field `b` is uint8.*\[0, 300\]"):
        s.add({"a": np.ones((3, 2)), "b": np.array([0, 7, 300])})
    assert s.size == 0 and s.cursor == 0
    assert not s.columns["a"].any() and not s.columns["b"].any()


def test_non_numeric_values_raise_field_type_error() -> None:
    s = _Ring({"x": ((2,), np.float32)}, 4)
    with pytest.raises(FieldTypeError, match="must hold numbers"):
        s.add({"x": np.array(["a", "b"])})
    with pytest.raises(FieldTypeError, match="object array"):
        s.add({"x": np.array([1.0, None], dtype=object)})
    assert s.size == 0


def test_float64_batch_cast_to_float32_matches_numpy() -> None:
    s = _Ring({"x": ((3,), np.float32)}, 4)
    vals = np.random.default_rng(0).normal(size=(4, 3))
    s.add({"x": vals})
    np.testing.assert_array_equal(s.columns["x"], vals.astype(np.float32))
