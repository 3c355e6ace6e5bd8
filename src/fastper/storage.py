"""Columnar ring storage: one preallocated numpy array per field.

Storage knows nothing of priorities. The k-th transition ever added lives in
slot ``k % capacity`` (FIFO ring). Every check runs before anything is
written, so a rejected ``add`` leaves the arrays and the cursor untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._validation import check_int, show, to_numpy
from .errors import FieldTypeError


@dataclass(frozen=True)
class Field:
    """Shape (per transition) and dtype of one stored column."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes_per_item(self) -> int:
        return int(math.prod(self.shape)) * int(self.dtype.itemsize)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype.str}


FieldLike = Field | tuple[Any, Any] | Mapping[str, Any] | Any


def _as_field(name: str, spec: FieldLike) -> Field:
    shape: Any
    dtype: Any
    if isinstance(spec, Field):
        shape, dtype = spec.shape, spec.dtype
    elif isinstance(spec, Mapping):
        unknown = set(spec) - {"shape", "dtype"}
        if unknown:
            raise ValueError(
                f"field `{name}` spec must have keys 'shape' and 'dtype', got {sorted(spec)}"
            )
        shape, dtype = spec.get("shape", ()), spec.get("dtype", np.float32)
    elif isinstance(spec, tuple) and len(spec) == 2 and not all(isinstance(s, int) for s in spec):
        shape, dtype = spec
    else:  # a bare dtype: a scalar field
        shape, dtype = (), spec
    if isinstance(shape, int | np.integer):
        shape = (int(shape),)
    try:
        shape_t = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(
            f"field `{name}` shape must be a tuple of ints, got {show(shape)}"
        ) from None
    if any(s < 0 for s in shape_t):
        raise ValueError(f"field `{name}` shape must be non-negative, got shape={shape_t}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"field `{name}` dtype must be a numpy dtype, got dtype={show(dtype)}"
        ) from None
    if dt.kind not in "biuf" or dt.hasobject:
        raise TypeError(f"field `{name}` dtype must be bool, integer or floating, got dtype={dt}")
    return Field(shape_t, dt)


def make_fields(fields: Mapping[str, FieldLike]) -> dict[str, Field]:
    """Normalise a field spec ``{name: (shape, dtype) | Field | {...}}``."""
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError(
            f"`fields` must be a non-empty mapping name -> (shape, dtype), got {show(fields)}"
        )
    out: dict[str, Field] = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"field names must be non-empty strings, got {show(name)}")
        out[name] = _as_field(name, spec)
    return out


def _safe_cast(name: str, arr: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Copy of ``arr`` in ``dtype``; raises where the cast could change a value."""
    src = arr.dtype
    if src == dtype:
        return arr  # commit() copies it into the column
    if src.kind not in "biuf":
        raise FieldTypeError(f"field `{name}` must hold numbers, got dtype={src}")
    if dtype.kind == "b":
        if src.kind in "iu" and arr.size and not np.isin(arr, (0, 1)).all():
            raise FieldTypeError(
                f"field `{name}` is bool; integers other than 0/1 would change, got {show(arr)}"
            )
        if src.kind == "f":
            raise FieldTypeError(f"field `{name}` is bool, got float values of dtype={src}")
        return arr.astype(dtype)
    if dtype.kind in "iu":
        if src.kind == "f":
            if arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
                raise FieldTypeError(
                    f"field `{name}` is {dtype}; non-integral floats would be truncated, "
                    f"got {show(arr)}"
                )
        if src.kind != "b" and arr.size and not np.can_cast(src, dtype, casting="safe"):
            info = np.iinfo(dtype)
            lo, hi = arr.min(), arr.max()
            if src.kind == "f":
                # float(info.max) rounds up (2**63 - 1 -> 2**63): compare against max + 1
                bad = float(lo) < float(info.min) or float(hi) >= float(info.max) + 1.0
            else:
                bad = int(lo) < int(info.min) or int(hi) > int(info.max)
            if bad:
                raise FieldTypeError(
                    f"field `{name}` is {dtype}; values in [{lo}, {hi}] overflow [{info.min}, {info.max}]"
                )
        return arr.astype(dtype)
    # floating target: ints and bools always fit (possibly rounded); floats must not overflow
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
        out = arr.astype(dtype)
    if src.kind == "f" and dtype.itemsize < src.itemsize and arr.size:
        overflow = np.isfinite(arr) & ~np.isfinite(out)
        if overflow.any():
            raise FieldTypeError(
                f"field `{name}` is {dtype}; values overflow it, got {show(arr[overflow][:8])}"
            )
    return out


def coerce_batch(
    fields: Mapping[str, Field], transition: Mapping[str, Any], capacity: int | None
) -> tuple[dict[str, np.ndarray], int]:
    """Validate one transition or a batch; return cast copies with a leading dim.

    A value whose shape equals the field's shape is one transition; one with an
    extra leading dimension is a batch. All fields must agree.
    """
    if not isinstance(transition, Mapping):
        raise TypeError(f"a transition must be a mapping field -> value, got {show(transition)}")
    missing = [f for f in fields if f not in transition]
    unknown = [f for f in transition if f not in fields]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing fields {missing}")
        if unknown:
            parts.append(f"unknown fields {unknown}")
        raise ValueError(f"transition fields must be exactly {list(fields)}; " + ", ".join(parts))
    arrays: dict[str, np.ndarray] = {}
    lengths: dict[str, int | None] = {}
    for name, field in fields.items():
        arr = to_numpy(transition[name])
        if arr.dtype == object:
            raise FieldTypeError(
                f"field `{name}` must hold numbers, got an object array {show(arr)}"
            )
        if arr.shape == field.shape:
            lengths[name] = None
            arr = arr.reshape((1, *field.shape))
        elif arr.ndim == len(field.shape) + 1 and arr.shape[1:] == field.shape:
            lengths[name] = int(arr.shape[0])
        else:
            raise ValueError(
                f"field `{name}` must have shape {field.shape} (one transition) or "
                f"(B, {', '.join(map(str, field.shape))}{',' if len(field.shape) == 1 else ''}) "
                f"(a batch), got shape {arr.shape}"
            )
        arrays[name] = arr
    kinds = set(lengths.values())
    if len(kinds) > 1:
        raise ValueError(
            "all fields must be one transition or batches of one length, got "
            + ", ".join(f"{n}: {'single' if v is None else v}" for n, v in lengths.items())
        )
    (kind,) = kinds
    k = 1 if kind is None else kind
    if k == 0:
        raise ValueError("an added batch must not be empty, got a batch of 0 transitions")
    if capacity is not None and k > capacity:
        raise ValueError(
            f"a batch must not exceed the capacity, got a batch of {k} for capacity={capacity}"
        )
    out = {name: _safe_cast(name, arrays[name], fields[name].dtype) for name in fields}
    return out, k


class Storage:
    """Preallocated columnar ring storage.

    Not locked: a storage shared by threads needs the caller's lock, as the
    buffers hold theirs around every call.

    Args:
        fields: ``{name: (shape, dtype)}``, ``{name: Field}`` or
            ``{name: {"shape": ..., "dtype": ...}}``; a bare dtype is a scalar.
        capacity: number of slots.
    """

    def __init__(self, fields: Mapping[str, FieldLike], capacity: int) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields = make_fields(fields)
        self.columns: dict[str, np.ndarray] = {
            name: np.zeros((self.capacity, *f.shape), dtype=f.dtype)
            for name, f in self.fields.items()
        }
        self.cursor = 0
        self.size = 0

    @property
    def nbytes_per_slot(self) -> int:
        return sum(f.nbytes_per_item for f in self.fields.values())

    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast; writes nothing. O(B)."""
        return coerce_batch(self.fields, transition, self.capacity)

    def slots_for(self, k: int) -> np.ndarray:
        """The slots the next ``k`` transitions will occupy."""
        return (self.cursor + np.arange(k, dtype=np.int64)) % self.capacity

    def commit(self, prepared: Mapping[str, np.ndarray], k: int) -> np.ndarray:
        """Write prepared arrays (from :meth:`prepare`); cannot fail. O(B)."""
        start = self.cursor
        first = min(k, self.capacity - start)
        for name, col in self.columns.items():
            src = prepared[name]
            col[start : start + first] = src[:first]
            if first < k:
                col[: k - first] = src[first:]
        slots = self.slots_for(k)
        self.cursor = (start + k) % self.capacity
        self.size = min(self.capacity, self.size + k)
        return slots

    def add(self, transition: Mapping[str, Any]) -> np.ndarray:
        """Validate, then write one transition or a batch; returns the slots."""
        prepared, k = self.prepare(transition)
        return self.commit(prepared, k)

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices`` for every field. O(B)."""
        # take(axis=0) is several times faster than fancy indexing on 2-D columns
        return {name: col.take(indices, axis=0) for name, col in self.columns.items()}

    def clear(self) -> None:
        self.cursor = 0
        self.size = 0
