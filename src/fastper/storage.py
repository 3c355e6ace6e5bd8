"""Replay storage: the protocol, and the default columnar storage in RAM.

Storage knows nothing of priorities and nothing of the ring: it holds one
row per slot for every field, writes rows where it is told and gathers rows
by slot. The writer (:class:`fastper.writer.RingWriter`) decides where the
k-th transition goes (slot ``k % capacity``) and keeps the keys; the sampler
keeps the priorities. Any object that follows :class:`ReplayStorage` can be
handed to a buffer (``storage=``): a disk, compressed, device or remote
storage plugs in without touching the buffer.

Every check runs before anything is written, so a rejected ``add`` leaves
the rows untouched.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._codegen import specialise
from ._kernels import records as _records
from ._validation import check_int, floats_finite, rewards_finite, show, to_numpy
from .errors import CapacityWarning, FieldTypeError


@dataclass(frozen=True)
class Field:
    """Shape (per transition) and dtype of one stored column."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes_per_item(self) -> int:
        """Bytes of one transition's value of this field."""
        return int(math.prod(self.shape)) * int(self.dtype.itemsize)

    def to_dict(self) -> dict[str, Any]:
        """``{"shape": [...], "dtype": "<f4"}``: JSON-able, as in a state's settings."""
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
    # floating target: bools always fit; ints fit rounded, except past float16's range
    # (65504); floats must not overflow
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
        out = arr.astype(dtype)
    narrows = src.kind == "f" and dtype.itemsize < src.itemsize
    if (narrows or (src.kind in "iu" and dtype.itemsize == 2)) and arr.size:
        overflow = np.isfinite(arr) & ~np.isfinite(out)
        if overflow.any():
            raise FieldTypeError(
                f"field `{name}` is {dtype}; values overflow it, got {show(arr[overflow][:8])}"
            )
    return out


def check_names(fields: Mapping[str, Field], transition: Any) -> None:
    """A transition must be a mapping with exactly the fields' names."""
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


def row_count(name: str, field: Field, shape: tuple[int, ...]) -> int | None:
    """``None`` for a value of one transition (the field's shape), B for a batch of B."""
    if shape == field.shape:
        return None
    if len(shape) == len(field.shape) + 1 and shape[1:] == field.shape:
        return int(shape[0])
    raise ValueError(
        f"field `{name}` must have shape {field.shape} (one transition) or "
        f"(B, {', '.join(map(str, field.shape))}{',' if len(field.shape) == 1 else ''}) "
        f"(a batch), got shape {shape}"
    )


def batch_length(lengths: Mapping[str, int | None], capacity: int | None) -> int:
    """The number of transitions given: every field one transition, or B rows each."""
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
    return k


def coerce_batch(
    fields: Mapping[str, Field], transition: Mapping[str, Any], capacity: int | None
) -> tuple[dict[str, np.ndarray], int]:
    """Validate one transition or a batch; return cast copies with a leading dim.

    A value whose shape equals the field's shape is one transition; one with an
    extra leading dimension is a batch. All fields must agree.
    """
    check_names(fields, transition)
    arrays: dict[str, np.ndarray] = {}
    lengths: dict[str, int | None] = {}
    for name, field in fields.items():
        arr = to_numpy(transition[name])
        if arr.dtype == object:
            raise FieldTypeError(
                f"field `{name}` must hold numbers, got an object array {show(arr)}"
            )
        lengths[name] = row_count(name, field, arr.shape)
        arrays[name] = arr.reshape((1, *field.shape)) if lengths[name] is None else arr
    k = batch_length(lengths, capacity)
    out = {name: _safe_cast(name, arrays[name], fields[name].dtype) for name in fields}
    return out, k


def physical_memory() -> int:
    """Bytes of RAM on this machine (2^40 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def warn_if_too_large(nbytes: int, what: str) -> None:
    """Warn (:class:`~fastper.errors.CapacityWarning`) when ``nbytes`` exceed the machine's RAM.

    Columns are mapped lazily, so such a buffer constructs at once and runs out
    of memory only as it fills: say so up front, with the sizes.
    """
    ram = physical_memory()
    if nbytes > ram:
        warnings.warn(
            f"{what} will take {nbytes / 2**30:.1f} GiB when full, more than this machine's "
            f"{ram / 2**30:.1f} GiB of memory: the process will run out of memory as it fills "
            "(use a smaller capacity, or fewer or smaller fields)",
            CapacityWarning,
            stacklevel=4,
        )


def check_columns(fields: Mapping[str, Field], state: Mapping[str, Any], n: int) -> None:
    """A storage state holds ``columns/<field>`` for every field: numpy, its dtype, ``n`` rows."""
    expected = {f"columns/{name}" for name in fields}
    if set(state) != expected:
        raise ValueError(f"storage state must hold {sorted(expected)}, got {sorted(state)}")
    for name, field in fields.items():
        a = state[f"columns/{name}"]
        if not isinstance(a, np.ndarray) or a.dtype != field.dtype or a.shape != (n, *field.shape):
            got = f"{a.dtype}{a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"column `{name}` must be {field.dtype}{(n, *field.shape)}, got {got}")


@runtime_checkable
class ReplayStorage(Protocol):
    """What a buffer needs from its storage.

    Attributes:
        fields: the stored field spec ``{name: Field}``.
        capacity: number of slots.

    A storage is not locked: the buffer holds its lock around every call.
    ``write`` and ``load_state_dict`` must not fail once their input was
    prepared / checked: the buffer relies on that to keep every call atomic.

    Optional: a storage whose rows are durable where they are (on disk,
    :class:`fastper.disk.DiskStorage`) has ``reference_state(n, cursor)``,
    a JSON-able dict that ``save`` writes instead of the rows (and that its
    ``load_state_dict`` accepts back); a storage that fails to write (a full
    disk) raises before the buffer advances anything. ``gather_can_fail``
    (default True): False promises that ``gather`` of written slots cannot
    raise, so ``sample`` need not keep the random state to restore it.
    ``concurrent_gather`` (default False): True promises that ``gather`` only
    reads and may run while another thread calls ``write`` (the buffer then
    reads rows for :meth:`~fastper.PrioritizedReplayBuffer.gather` without
    holding its lock, and checks their keys afterwards); a storage whose
    reads change its own state (a tiered storage promoting chunks) keeps the
    default. A storage that places its rows by sampling mass implements
    :class:`PlacedByMass` as well.
    """

    fields: dict[str, Field]
    capacity: int

    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast one transition or a batch; writes nothing. O(B)."""
        ...

    def write(self, start: int, prepared: Mapping[str, np.ndarray], k: int) -> None:
        """Write ``k`` prepared rows to slots ``start, start+1, ...`` (mod capacity). O(B)."""
        ...

    def gather(self, indices: Any) -> dict[str, Any]:
        """Copies of the rows at ``indices`` for every field. O(B).

        Arrays of the storage's kind: numpy arrays in RAM, tensors on a device
        (:class:`fastper.device.TorchStorage`); :meth:`read` is always numpy.
        """
        ...

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A copy of rows ``lo .. hi-1`` of field ``name`` (for checkpoints). O(hi - lo)."""
        ...

    def clear(self) -> None:
        """Forget every row (the buffer resets its ring)."""
        ...

    def nbytes(self) -> int:
        """Bytes of memory the storage holds (RAM; 0 for rows kept elsewhere)."""
        ...

    def state_dict(self, n: int) -> dict[str, Any]:
        """Rows ``0 .. n-1`` of every field as arrays (JSON-able settings beside them)."""
        ...

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """Writable arrays where a loader may read ``state_dict(n)``'s arrays in place."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], n: int) -> None:
        """Check, then take rows ``0 .. n-1`` from ``state``."""
        ...


@runtime_checkable
class PlacedByMass(Protocol):
    """A storage that places its rows by sampling mass (a tiered storage).

    After a sample, when ``wants_masses`` is True, the buffer hands it the
    mass under every aligned chunk of ``mass_chunk_size`` slots
    (``rebalance(masses)``). Recognised once, when the buffer is built.
    """

    @property
    def mass_chunk_size(self) -> int: ...

    @property
    def wants_masses(self) -> bool: ...

    def rebalance(self, masses: Any) -> None: ...


#: Python ints stored into a float column as is: exact in a double, so one rounding
#: to the column's dtype, as the general cast gives
_EXACT_INT = 2**53
_FLOAT, _INT, _BOOL = 0, 1, 2
#: the dtypes an array may come in: those that convert to a column's dtype exactly
#: (numpy's "safe" casts) are stored with no check
_NUMERIC = tuple(np.dtype(c) for c in "?bhilqBHILQefd")


class DirectRows:
    """The values an add can store with no checked cast, and their store into the columns.

    The common add is one env step of numpy arrays in the fields' dtypes and
    shapes, or of the Python numbers an env loop has (``reward=0.5``,
    ``done=False``, ``action=1``). :meth:`match` accepts exactly those values
    that :func:`coerce_batch` would accept and store unchanged: arrays of the
    field's dtype or of one that converts exactly (bool flags into a float
    column, int32 into int64: numpy's "safe" casts), Python numbers that fit
    the column. It answers ``None`` for anything else (another dtype, a torch
    tensor, a list, a value that would overflow, a missing field): the caller
    then takes the general path, which checks everything and names the
    problem. So a value stored here is bit for bit the one the general path
    stores, and no check is skipped. O(fields) with no numpy call.

    :meth:`match` and :meth:`write` run on every single add, so both are
    specialised to the fields once, when the object is made: their checks are
    written out field by field (:func:`_match_source`, :func:`_write_source`)
    with each field's shape, dtype and range bound as constants, with no loop
    over the fields and no per-field tuple to unpack.
    """

    __slots__ = (
        "columns", "columns_by_one", "count", "entries", "names", "capacity", "match", "write",
        "_constants", "_long_runs",
    )  # fmt: skip

    #: ``match(transition)``: the values in field order and the row count, or
    #: ``None`` (take the general path). A value of the field's shape is one
    #: transition (count -1: written as given), one with a leading dimension a
    #: batch of that many, as in :func:`coerce_batch`; all fields must agree.
    match: Callable[[dict[str, Any]], tuple[list[Any], int] | None]
    #: ``write(start, values, k)``: store matched values from slot ``start``
    #: (``k`` from :meth:`match`; no wrap). O(k).
    write: Callable[[int, list[Any], int], None]

    def __init__(
        self,
        fields: Mapping[str, Field],
        capacity: int,
        columns: Mapping[str, np.ndarray] | None = None,
        puts: list[Callable[[int, Any], None] | None] | None = None,
    ) -> None:
        self.capacity = capacity
        #: the columns :meth:`write` stores into (none: a matcher only)
        self.columns = tuple(columns.values()) if columns is not None else ()
        # views of shape (N, 1, *shape): a batch of one row is stored with no indexing
        self.columns_by_one = tuple(c.reshape(c.shape[0], 1, *c.shape[1:]) for c in self.columns)
        self.count = len(fields)
        entries = []
        for name, f in fields.items():
            dt = f.dtype
            kind = {"f": _FLOAT, "b": _BOOL}.get(dt.kind, _INT)
            if kind == _FLOAT:
                lo, hi = -float(np.finfo(dt).max), float(np.finfo(dt).max)
            elif kind == _INT:
                lo, hi = int(np.iinfo(dt).min), int(np.iinfo(dt).max)
            else:
                lo, hi = 0, 1
            exact = frozenset(d for d in _NUMERIC if np.can_cast(d, dt, casting="safe"))
            entries.append((name, f.shape, (1, *f.shape), exact, dt.type, kind, lo, hi, dt))
        self.entries = tuple(entries)
        #: the fields, in the order of :meth:`match`'s values and :meth:`write`'s columns
        self.names = tuple(fields)
        facts: dict[str, Any] = {
            "ndarray": np.ndarray, "cap": capacity, "EXACT_INT": _EXACT_INT,
            "INFS": (math.inf, -math.inf),
        }  # fmt: skip
        for i, (name, shape, one, exact, scalar, _, lo, hi, dtype) in enumerate(self.entries):
            facts.update({f"NAME{i}": name, f"SHAPE{i}": shape, f"ONE{i}": one, f"EXACT{i}": exact,
                          f"SCALAR{i}": scalar, f"LO{i}": lo, f"HI{i}": hi, f"DTYPE{i}": dtype})  # fmt: skip
        columns_by_name: dict[str, Any] = {}
        for i, (col, by_one) in enumerate(zip(self.columns, self.columns_by_one, strict=True)):
            columns_by_name[f"COL{i}"], columns_by_name[f"BY_ONE{i}"] = col, by_one
            # a long run goes through the storage's writer where it has one (records)
            columns_by_name[f"PUT{i}"] = puts[i] if puts is not None else None
        long_runs = tuple(puts[i] is not None for i in range(len(self.columns))) if puts else ()
        (self.match,) = specialise("DirectRows.match", _match_source(self.entries), facts, "match")
        write = _write_source(len(self.columns), long_runs)
        (self.write,) = specialise("DirectRows.write", write, columns_by_name, "write")
        self._constants = {**facts, **columns_by_name}
        self._long_runs = long_runs

    def check_lines(self) -> tuple[list[str], dict[str, Any]]:
        """:meth:`match`'s checks as source lines for a function specialised
        elsewhere (an n-step writer's one-call step), with the constants they read.

        The lines read ``transition`` and leave the values in ``v0, v1, ..``
        (the fields in :attr:`names` order) and the count (as :meth:`match`'s)
        in ``rows``; where :meth:`match` would answer ``None`` they return 0.
        """
        return _check_lines(self.entries, "0"), {
            k: v for k, v in self._constants.items() if not k.startswith(_STORE_NAMES)
        }

    def store_constants(self) -> dict[str, Any]:
        """The constants the lines of :meth:`store_lines` read (the columns)."""
        return {k: v for k, v in self._constants.items() if k.startswith(_STORE_NAMES)}

    def store_lines(
        self, values: Sequence[str | None], k: int, blocks: bool = False
    ) -> list[str]:
        """:meth:`write`'s stores as source lines for a function specialised elsewhere
        (which reads :meth:`store_constants`).

        ``values``: an expression per column, in :attr:`names` order (None: a
        column the function stores otherwise, no line for it); stored from
        slot ``start`` (they must fit before the ring's end): one transition
        (``k == -1``) or ``k >= 1`` rows, as :meth:`write` stores them.
        Indented for a function's body. ``blocks``: ``k`` rows from a slot that is
        a multiple of ``k`` are stored by one index per field, into the views of
        :meth:`block_columns` (``block_columns(k)``, which the function then reads
        too, where it has any).
        """
        if not self.columns:
            raise TypeError("a matcher only: no columns to write")
        if len(values) != len(self.columns):
            raise ValueError(
                f"one expression per column: {len(self.columns)} columns, got {len(values)}"
            )
        kind: int | str = k  # the branch write takes for k
        if k not in (-1, 1):
            kind = "long" if k >= _ITEM_ROWS and any(self._long_runs) else "run"
        body = _store_body(len(self.columns), self._long_runs, values, kind, str(k))
        if blocks and kind == "run" and self.block_columns(k):
            test, by_block = _block_lines(values, k, "")
            body = [f"if {test}:", *("    " + x for x in by_block), "else:", *("    " + x for x in body)]
        return ["    " + line for line in body]

    def putter(self, reward: str | None, block: int = 0) -> Callable[[dict[str, Any], int], int]:
        """``put(transition, start)``: :meth:`match` and :meth:`write` in one call, for
        the most frequent add (one env step, or one of every env's).

        It stores the matched values from slot ``start`` and returns how many
        rows it stored, or returns 0 having stored nothing: where :meth:`match`
        answers ``None``, where the rows do not fit before the ring's end, or
        where the field ``reward`` (None: no check) holds a NaN or an inf. The
        caller then takes the general path, which names the problem. O(fields)
        for one row. ``block``: the rows of the vector steps most adds bring (see
        :meth:`block_columns`; 0: none).
        """
        return self._with_reward_check(reward, _put_source, "put", block)

    def exact_putter(
        self, reward: str | None, block: int = 0
    ) -> Callable[[int, list[Any], int], bool]:
        """``put_exact(start, values, rows)``: :meth:`write` of values a caller has
        matched itself (see :meth:`write`), after the test that the field ``reward``
        (None: no test) holds no NaN or inf; whether it stored them (False:
        nothing stored, a reward refused). O(fields) for one row. ``block``: as
        :meth:`putter`'s.

        A field of shape ``(1,)`` also takes ``rows >= 1`` rows as a flat array of
        shape ``(rows,)`` (as SB3's DQN passes Discrete actions), stored into a
        view of its column without that axis: no view of the value to make. Its
        value must then be an array (the caller's checks): which form it is, is
        read from its ``ndim``."""
        return self._with_reward_check(reward, _exact_put_source, "put_exact", block, flat=True)

    def flat_columns(self, block: int, blocked: bool) -> dict[str, np.ndarray]:
        """The columns of the fields of shape ``(1,)`` as views without that axis:
        ``FLATi`` of shape ``(capacity,)`` and, where ``blocked`` (:meth:`block_columns`
        has views for ``block``), ``FLATBLOCKi`` of shape ``(capacity // block, block)``."""
        out: dict[str, np.ndarray] = {}
        for i, (col, entry) in enumerate(zip(self.columns, self.entries, strict=True)):
            if entry[1] != (1,):
                continue
            out[f"FLAT{i}"] = _view(col, (self.capacity,))
            if blocked:
                out[f"FLATBLOCK{i}"] = _view(col, (self.capacity // block, block))
        return out

    def block_columns(self, block: int) -> dict[str, np.ndarray]:
        """The columns as views of shape ``(capacity // block, block, *shape)``
        (``BLOCKi``), where a vector step of ``block`` rows from a slot that is a
        multiple of ``block`` is stored by one integer index; empty where
        ``block`` < 2 or does not divide the capacity (no such views)."""
        if block < 2 or self.capacity % block:
            return {}
        shape = (self.capacity // block, block)
        return {
            f"BLOCK{i}": _view(col, (*shape, *col.shape[1:])) for i, col in enumerate(self.columns)
        }

    def _with_reward_check(
        self, reward: str | None, source: Callable[..., str], name: str, block: int,
        flat: bool = False,
    ) -> Any:  # fmt: skip
        """The function ``name`` of ``source(entries, long_runs, reward's index,
        block)``, specialised for these columns (:meth:`putter`, :meth:`exact_putter`);
        ``flat``: with the views of :meth:`flat_columns` too."""
        if not self.columns:
            raise TypeError("a matcher only: no columns to write")
        if reward is not None and reward not in self.names:
            raise ValueError(f"no field {reward!r} to check rewards in; fields: {list(self.names)}")
        index = None if reward is None else self.names.index(reward)
        blocks = self.block_columns(block)
        constants = {
            **self._constants, **blocks, "ISFINITE": math.isfinite,
            "FLOATS_FINITE": floats_finite, "REWARDS_FINITE": rewards_finite,
        }  # fmt: skip
        if flat:
            constants.update(self.flat_columns(block, bool(blocks)))
        text = source(self.entries, self._long_runs, index, block if blocks else 0)
        (made,) = specialise(f"DirectRows.{name}", text, constants, name)
        return made

    def __reduce__(self) -> Any:
        # its functions write into the columns they were made for: a copy would too
        raise TypeError("a DirectRows is made from its storage (Storage.direct_rows), not copied")

    def as_batch(self, values: list[Any], k: int) -> dict[str, np.ndarray]:
        """Matched values as arrays with a leading dimension, in the fields' dtypes. O(k).

        For a stage that reads a batch (n-step windows): the same arrays
        :func:`coerce_batch` makes of these values, views where they can be.
        """
        out: dict[str, np.ndarray] = {}
        for (name, _, one, _, _, _, _, _, dtype), v in zip(self.entries, values, strict=True):
            if type(v) is np.ndarray:
                if v.dtype is not dtype and v.dtype != dtype:
                    v = v.astype(dtype)  # an exact conversion (see match)
                out[name] = v.reshape(one) if k == -1 else v
            else:
                out[name] = np.array((v,), dtype=dtype)
        return out


def _view(col: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``col`` reshaped to ``shape`` as a view of it, for the generated stores to write
    into. Splitting an axis, or dropping one of 1, never copies a C-contiguous column;
    an empty field has no memory to share."""
    view = col.reshape(shape)
    if col.size and not np.may_share_memory(view, col):
        raise AssertionError(f"a view of a column of shape {col.shape} as {shape} must be a view")
    return view


def check_record_bytes(record_bytes: Any, capacity: int) -> None:
    """Refuse a :attr:`Storage.record_bytes` that does not describe records of every
    slot: ``(rows, row_bytes)``, ``rows`` a 1-D uint8 array of at least
    ``capacity * row_bytes`` bytes, ``row_bytes`` an int >= 0 (0: no records to
    prefetch). O(1)."""
    ok = type(record_bytes) is tuple and len(record_bytes) == 2
    rows, row_bytes = record_bytes if ok else (None, None)
    if not (
        ok and type(row_bytes) is int and row_bytes >= 0 and isinstance(rows, np.ndarray)
        and rows.dtype == np.uint8 and rows.ndim == 1
    ):  # fmt: skip
        raise TypeError(
            "a storage's `record_bytes` must be (a 1-D uint8 array, the bytes of one "
            f"record as an int >= 0), got {record_bytes!r:.120}"
        )
    if row_bytes and rows.shape[0] < capacity * row_bytes:
        raise ValueError(
            f"a storage's `record_bytes` must hold capacity * row_bytes = {capacity} * "
            f"{row_bytes} bytes (its records), got {rows.shape[0]}"
        )


#: the names of the columns' constants in :meth:`DirectRows.write`'s source
_STORE_NAMES = ("COL", "BY_ONE", "PUT")


def _match_source(entries: tuple[tuple[Any, ...], ...]) -> str:
    """The source of :attr:`DirectRows.match` for these fields (see there).

    Every field must be there (a missing one: ``None``). Field ``i``'s checks,
    in order: an array must have an exact dtype (``DTYPEi`` or one in
    ``EXACTi``) and the field's shape (one transition, count -1), that shape
    with a leading 1 (count 1) or a leading batch of at most ``cap``; a
    scalar field also takes a Python float (float columns: in range, NaN and
    inf pass), a Python int (float columns: exact in a double, not float16;
    int columns: in range), a bool or a numpy scalar of its own dtype. Every
    field's count must be the first field's.
    """
    values = ", ".join(f"v{i}" for i in range(len(entries)))
    lines = ["def match(transition):", *_check_lines(entries, "None"), f"    return [{values}], rows"]
    return "\n".join(lines) + "\n"


def _check_lines(entries: tuple[tuple[Any, ...], ...], refuse: str) -> list[str]:
    """The body of :attr:`DirectRows.match`'s checks (see :func:`_match_source`), up
    to its answer: on success the values are ``v0, v1, ..`` and the count is
    ``rows``; on failure the code returns ``refuse``.

    A vector env's step of the fields' own dtypes and shapes (:func:`_vector_terms`)
    is told first, in one expression, and skips the checks value by value (the
    same rules)."""
    lines = [*_read_lines(entries), "    if not (", *_joined(_vector_terms(entries), "        ")]
    lines += ["    ):", *("    " + line for line in _value_check_lines(entries))]
    return _refusing(lines, refuse)


def _read_lines(entries: tuple[tuple[Any, ...], ...]) -> list[str]:
    """The values ``v0, v1, ..`` read from the dict ``transition`` (its length
    first), returning None where it holds other keys."""
    return [
        f"    if len(transition) != {len(entries)}:",
        "        return None",
        "    try:",
        *(f"        v{i} = transition[NAME{i}]" for i in range(len(entries))),
        "    except KeyError:",
        "        return None",
    ]


def _refusing(lines: list[str], refuse: str) -> list[str]:
    """``lines`` returning ``refuse`` where they return None."""
    if refuse == "None":
        return lines
    return [line.replace("return None", f"return {refuse}") for line in lines]


def _joined(terms: list[str], indent: str) -> list[str]:
    """``terms`` as the lines of one ``and`` expression (inside brackets)."""
    return [*(f"{indent}{t} and" for t in terms[:-1]), f"{indent}{terms[-1]}"]


def _vector_terms(entries: tuple[tuple[Any, ...], ...]) -> list[str]:
    """The test that values ``v0, v1, ..`` are a vector env's step: every value an
    array of its field's own dtype and shape with the same leading count
    ``rows`` (set by the test) of at least 2 and at most ``cap``. Scalar fields
    are tested first, so that one transition (whose scalars are no arrays)
    fails at the first term."""
    order = sorted(range(len(entries)), key=lambda i: len(entries[i][1]))
    terms: list[str] = []
    for j, i in enumerate(order):
        shape, v = entries[i][1], f"v{i}"
        terms += [f"type({v}) is ndarray", f"{v}.dtype is DTYPE{i}", f"{v}.ndim == {len(shape) + 1}"]
        terms.append(f"1 < (rows := len({v})) <= cap" if j == 0 else f"len({v}) == rows")
        if len(shape) == 1:
            terms.append(f"{v}.size == {shape[0]} * rows")
        elif shape:
            terms.append(f"{v}.shape[1:] == SHAPE{i}")
    return terms


def _value_check_lines(entries: tuple[tuple[Any, ...], ...]) -> list[str]:
    """:func:`_check_lines`'s checks value by value (they return None on failure)."""
    lines: list[str] = []
    for i, (_, shape, _, _, _, kind, _, _, dtype) in enumerate(entries):
        v = f"v{i}"
        lines += [
            f"    t = type({v})",
            "    if t is ndarray:",
            f"        d = {v}.dtype",
            f"        if d is not DTYPE{i} and d not in EXACT{i}:",
            "            return None",
            *_shape_lines(v, i, shape),
        ]
        if shape:
            lines += ["    else:", "        return None"]
        else:
            if kind == _FLOAT:
                lines += [
                    "    elif t is float:",
                    f"        if not (LO{i} <= {v} <= HI{i} or {v} != {v} or {v} in INFS):",
                    "            return None",
                    "        r = -1",
                    "    elif t is int:",
                ]
                if dtype.itemsize == 2:
                    lines += ["        return None"]
                else:
                    lines += [
                        f"        if not -EXACT_INT <= {v} <= EXACT_INT:",
                        "            return None",
                        "        r = -1",
                    ]
            else:
                lines += [
                    "    elif t is float:",
                    "        return None",
                    "    elif t is int:",
                    f"        if not LO{i} <= {v} <= HI{i}:",
                    "            return None",
                    "        r = -1",
                ]
            lines += [
                f"    elif t is bool or t is SCALAR{i}:",
                "        r = -1",
                "    else:",
                "        return None",
            ]
        if i == 0:
            lines.append("    rows = r")
        else:
            lines += ["    if r != rows:", "        return None"]
    return lines


def _shape_lines(v: str, i: int, shape: tuple[int, ...]) -> list[str]:
    """:func:`_match_source`'s count of the array ``v`` of field ``i`` (``r``: -1 for one
    transition, else the rows), or ``return None`` for a shape that is neither.

    A scalar field's array and a vector field's are told apart by ``ndim``,
    ``len`` and ``size``, which build nothing (a vector step's batch is the
    most frequent array of rows); deeper fields compare the ``shape`` tuple.
    """
    # the first field's count is checked in range; a later one's must equal it
    in_range = " or not 0 < r <= cap" if i == 0 else ""
    if not shape:
        return [
            f"        n = {v}.ndim",
            "        if n == 0:",
            "            r = -1",
            "        elif n == 1:",  # a batch (of one: count 1)
            f"            r = len({v})",
            *(["            if not 0 < r <= cap:", "                return None"] if i == 0 else []),
            "        else:",
            "            return None",
        ]
    if len(shape) == 1:
        return [
            f"        n = {v}.ndim",
            "        if n == 1:",
            f"            if len({v}) != {shape[0]}:",
            "                return None",
            "            r = -1",
            "        elif n == 2:",  # (rows, m) exactly: size = rows * m with rows > 0
            f"            r = len({v})",
            f"            if {v}.size != {shape[0]} * r{in_range}:",
            "                return None",
            "        else:",
            "            return None",
        ]
    return [
        f"        s = {v}.shape",
        f"        if s == SHAPE{i}:",
        "            r = -1",
        f"        elif s == ONE{i}:",
        "            r = 1",
        f"        elif len(s) == {len(shape) + 1} and s[1:] == SHAPE{i} and 0 < s[0] <= cap:",
        "            r = s[0]",
        "        else:",
        "            return None",
    ]


def _write_source(count: int, long_runs: tuple[bool, ...] = ()) -> str:
    """The source of :attr:`DirectRows.write` for ``count`` columns (see there);
    column ``i`` takes a long run through its writer ``PUTi`` where
    ``long_runs[i]`` (none: every column by slices)."""
    names = ", ".join(f"v{i}" for i in range(count))
    lines = ["def write(start, values, k):"]
    if count == 0:
        lines.append("    raise TypeError('a matcher only: no columns to write')")
        return "\n".join(lines) + "\n"
    lines.append(f"    {names}, = values")
    lines += _write_lines(count, long_runs)
    return "\n".join(lines) + "\n"


def _write_lines(
    count: int, long_runs: tuple[bool, ...], block: int = 0, flat: tuple[int, ...] = ()
) -> list[str]:
    """The stores of :attr:`DirectRows.write`: values ``v0, v1, ..`` of count ``k``
    (-1: one transition) into the columns from slot ``start``, one branch per kind
    of count (:func:`_store_body`; several rows: :func:`_rows_lines`, with its
    branch for ``block`` rows where ``block`` > 1). ``flat``: the columns (of
    fields of shape ``(1,)``) whose rows may also come flat (see
    :meth:`DirectRows.exact_putter`)."""
    v: list[str | None] = [f"v{i}" for i in range(count)]
    lines = ["    if k == -1:", *("        " + x for x in _store_body(count, long_runs, v, -1, "k"))]
    lines.append(
        "    elif k == 1:  # a batch of one row (a single env's step): an index beats a slice"
    )
    lines += ["        " + x for x in _store_body(count, long_runs, v, 1, "k")]
    rows = _rows_lines(count, long_runs, v, block, "k", flat)
    return [*lines, "    else:", *("        " + x for x in rows)]


def _store_body(
    count: int, long_runs: tuple[bool, ...], values: Sequence[str | None], kind: int | str,
    k: str, flat: tuple[int, ...] = (),
) -> list[str]:  # fmt: skip
    """The stores of one branch of :attr:`DirectRows.write`, unindented: expression
    ``values[i]`` into column ``i`` (None: no line) from slot ``start``. ``kind``:
    -1 (one transition), 1 (a batch of one row), ``"run"`` (``k`` rows, slices) or
    ``"long"`` (``k`` rows, through the columns' writers ``PUTi`` where
    ``long_runs[i]``); ``k``: the count's expression. The columns ``flat`` also
    take rows as a flat array (``"run"`` and ``"long"``: into the view ``FLATi``;
    a batch of one row broadcasts as it is)."""
    if kind == -1:
        return [f"COL{i}[start] = {x}" for i, x in enumerate(values) if x is not None]
    if kind == 1:
        return [f"BY_ONE{i}[start] = {x}" for i, x in enumerate(values) if x is not None]
    lines = [f"end = start + {k}"]
    for i, x in enumerate(values):
        if x is None:
            continue
        put = kind == "long" and long_runs[i]
        if i not in flat:
            lines.append(f"PUT{i}(start, {x})" if put else f"COL{i}[start:end] = {x}")
        elif put:
            lines.append(f"PUT{i}(start, {x} if {x}.ndim > 1 else {x}.reshape(-1, 1))")
        else:
            lines.append(f"(FLAT{i} if {x}.ndim == 1 else COL{i})[start:end] = {x}")
    return lines


def _block_lines(
    values: Sequence[str | None], block: int, k: str, flat: tuple[int, ...] = ()
) -> tuple[str, list[str]]:
    """The test and the stores (unindented) of a branch for ``block`` rows stored
    from a slot that is a multiple of ``block`` (a vector env's steps, one after
    another): each into the column viewed as blocks of that many rows
    (``BLOCKi``, see :meth:`DirectRows.block_columns`), by one integer index,
    which costs less than a slice. ``k``: the count's expression ("": ``block``
    rows are stored). The columns ``flat`` also take flat rows (into
    ``FLATBLOCKi``, see :meth:`DirectRows.flat_columns`)."""
    test = f"{k} == {block} and not start % {block}" if k else f"not start % {block}"
    body = [f"b = start // {block}"]
    for i, x in enumerate(values):
        if x is not None:
            to = f"(FLATBLOCK{i} if {x}.ndim == 1 else BLOCK{i})" if i in flat else f"BLOCK{i}"
            body.append(f"{to}[b] = {x}")
    return test, body


def _rows_lines(
    count: int, long_runs: tuple[bool, ...], values: Sequence[str | None], block: int, k: str,
    flat: tuple[int, ...] = (),
) -> list[str]:  # fmt: skip
    """The stores of ``k`` rows (an expression; at least 2), unindented: by blocks
    where ``block`` > 1 (:func:`_block_lines`), as a long run through the columns'
    writers where a column has one and ``k`` reaches :data:`_ITEM_ROWS`, else
    by slices (:func:`_store_body`). ``flat``: as :func:`_store_body`'s."""
    branches = []
    if block > 1:
        branches.append(_block_lines(values, block, k, flat))
    last = _store_body(count, long_runs, values, "run", k, flat)
    if any(long_runs):
        branches.append((f"{k} < {_ITEM_ROWS}", last))
        last = _store_body(count, long_runs, values, "long", k, flat)
    lines = []
    for j, (test, body) in enumerate(branches):
        lines += [f"{'el' if j else ''}if {test}:", *("    " + x for x in body)]
    if not branches:
        return last
    return [*lines, "else:", *("    " + x for x in last)]


def _put_source(
    entries: tuple[tuple[Any, ...], ...], long_runs: tuple[bool, ...], reward: int | None,
    block: int = 0,
) -> str:  # fmt: skip
    """The source of :meth:`DirectRows.putter`'s function: :attr:`DirectRows.match`'s
    checks, the rows' room before the ring's end, the reward field's finiteness
    (field ``reward``; None: unchecked), then :attr:`DirectRows.write`'s stores.
    Nothing is stored before every check has passed."""
    lines = ["def put(transition, start):", *_refusing(_read_lines(entries), "0")]
    lines += _vector_arm(entries, long_runs, reward, block)
    lines += _refusing(_value_check_lines(entries), "0")
    lines += ["    n = 1 if rows == -1 else rows", "    if start + n > cap:", "        return 0"]
    lines += _reward_lines(entries, reward, "0")
    lines += ["    k = rows", *_write_lines(len(entries), long_runs, block), "    return n"]
    return "\n".join(lines) + "\n"


def _exact_put_source(
    entries: tuple[tuple[Any, ...], ...], long_runs: tuple[bool, ...], reward: int | None,
    block: int = 0,
) -> str:  # fmt: skip
    """The source of :meth:`DirectRows.exact_putter`'s function: the reward field's
    finiteness (field ``reward``; None: unchecked), then :attr:`DirectRows.write`'s
    stores; nothing stored where a reward is refused."""
    values = ", ".join(f"v{i}" for i in range(len(entries)))
    lines = ["def put_exact(start, values, rows):", f"    {values}, = values"]
    lines += _reward_lines(entries, reward, "False")
    flat = tuple(i for i, entry in enumerate(entries) if entry[1] == (1,))
    stores = _write_lines(len(entries), long_runs, block, flat)
    lines += ["    k = rows", *stores, "    return True"]
    return "\n".join(lines) + "\n"


def _reward_lines(entries: tuple[tuple[Any, ...], ...], reward: int | None, refuse: str) -> list[str]:
    """The test that the value ``v{reward}`` of ``rows`` rows (-1: one transition) holds
    only finite rewards, returning ``refuse`` where not (``reward`` None: no lines).
    O(1) for one value or a vector env's step (at most 8 rows)."""
    if reward is None:
        return []
    v = f"v{reward}"
    lines = [
        f"    t = type({v})",
        "    if t is float:",
        f"        if not ISFINITE({v}):",
        f"            return {refuse}",
        "    elif t is ndarray:",
    ]
    lines += ["        " + x for x in _array_reward_lines(entries, reward, refuse, exact=False)]
    return [
        *lines,
        "    elif t is not int and t is not bool:  # a numpy scalar of the field's dtype",
        f"        if not ISFINITE({v}):",
        f"            return {refuse}",
    ]


def _array_reward_lines(
    entries: tuple[tuple[Any, ...], ...], reward: int, refuse: str, exact: bool
) -> list[str]:
    """:func:`_reward_lines` for an array ``v{reward}`` of ``rows`` rows, unindented
    (``exact``: an array of the field's own dtype with at least 2 rows). A vector
    env's step of the field's own float dtype is read as Python floats: their sum
    first (``x - x`` is NaN unless ``x`` is finite), each value only where it is
    not; anything else takes ``REWARDS_FINITE``."""
    v, dtype = f"v{reward}", entries[reward][8]
    if entries[reward][1] or dtype.kind != "f" or dtype.itemsize > 8:
        return [f"if not REWARDS_FINITE({v}):", f"    return {refuse}"]
    return [
        "if rows <= 8:" if exact else f"if 1 < rows <= 8 and {v}.dtype is DTYPE{reward}:",
        f"    s = {v}.tolist()",
        "    x = sum(s)",
        "    if x - x != 0.0 and not FLOATS_FINITE(s):",
        f"        return {refuse}",
        f"elif not REWARDS_FINITE({v}):",
        f"    return {refuse}",
    ]


def _vector_arm(
    entries: tuple[tuple[Any, ...], ...], long_runs: tuple[bool, ...], reward: int | None,
    block: int = 0,
) -> list[str]:  # fmt: skip
    """The first test of :meth:`DirectRows.putter`'s function: a vector env's step
    (:func:`_vector_terms`) checked in one expression, its rewards tested and its
    rows stored; any other values fall through, untouched, to the checks value by
    value (the same rules)."""
    lines = ["    if (", *_joined(_vector_terms(entries), "        "), "    ):"]
    lines += ["        if start + rows > cap:", "            return 0"]
    if reward is not None and entries[reward][8].kind == "f":
        lines += ["        " + x for x in _array_reward_lines(entries, reward, "0", exact=True)]
    values: list[str | None] = [f"v{i}" for i in range(len(entries))]
    lines += ["        " + x for x in _rows_lines(len(entries), long_runs, values, block, "rows")]
    return [*lines, "        return rows"]


_INT64 = np.dtype(np.int64)  # the indices the compiled gather takes (the buffers')
#: rows up to this many bytes are stored as records by default (see :class:`Storage`)
RECORD_ROW_BYTES = 256
#: the share of a record that its padding may take for the default layout to pick records
RECORD_PADDING = 1 / 8
#: runs of at least this many rows are copied into records as opaque items
_ITEM_ROWS = 256


def _copied_storage(
    fields: dict[str, Field], capacity: int, layout: str, state: Mapping[str, np.ndarray]
) -> Storage:
    """A :class:`Storage` of this layout loaded with ``state`` (how a copy of one is made)."""
    out = Storage(fields, capacity, layout=layout)
    out.load_state_dict(state, capacity)
    return out


def record_dtype(fields: Mapping[str, Field]) -> np.dtype[Any]:
    """The structured dtype of one slot stored as a record: the widest-aligned
    fields first, padded to a multiple of that alignment (every field of every
    slot aligned; strides of whole elements, as numpy and torch expect)."""
    order = sorted(fields, key=lambda n: -fields[n].dtype.alignment)
    return np.dtype([(n, fields[n].dtype, fields[n].shape) for n in order], align=True)


def default_layout(fields: Mapping[str, Field]) -> str:
    """:class:`Storage`'s layout for ``layout="auto"``: ``"records"`` for rows of at
    most :data:`RECORD_ROW_BYTES` bytes, of more than one field, whose record
    pads them by at most :data:`RECORD_PADDING` of its bytes (a bool flag beside
    float32 and int64 fields: 45 bytes in a 48-byte record); else ``"columns"``.

    A sampled row costs one or two cache misses as a record against one per
    field in columns: the learner step took 0.80-0.81x the time at 2^20-2^22
    slots for such rows (``benchmarks/layout.py``), for a few bytes per slot.
    """
    row = sum(f.nbytes_per_item for f in fields.values())
    small = 0 < row <= RECORD_ROW_BYTES and len(fields) > 1
    padding = record_dtype(fields).itemsize - row if small else 0
    return "records" if small and padding <= RECORD_PADDING * (row + padding) else "columns"


class Storage:
    """Storage in RAM: preallocated numpy arrays, one view per field in :attr:`columns`.

    The default :class:`ReplayStorage`. Small rows are stored as records
    (``layout="records"``: one structured array, every field of a slot side by
    side), so that reading a sampled row touches one or two cache lines
    instead of one per field: a sample's rows are random, and on a large
    buffer each line is a cache miss. :attr:`columns` are then strided views
    of the records; :meth:`gather` still returns one C-contiguous array per
    field. Large rows (images) gain nothing from it and keep one array per
    field (``layout="columns"``). Not locked: a storage shared by threads needs
    the caller's lock, as the buffers hold theirs around every call.

    Args:
        fields: ``{name: (shape, dtype)}``, ``{name: Field}`` or
            ``{name: {"shape": ..., "dtype": ...}}``; a bare dtype is a scalar.
        capacity: number of slots.
        layout: ``"records"``, ``"columns"`` or ``"auto"`` (the default:
            records for rows of at most :data:`RECORD_ROW_BYTES` bytes, of more
            than one field, that a record pads by at most :data:`RECORD_PADDING`
            of its bytes: e.g. float32 observations, an int64 action and a bool
            flag; else columns). Records put the widest-aligned fields first
            and pad a record to a multiple of that alignment, so that every
            field of every slot is aligned.
    """

    gather_can_fail = False  # numpy takes of written slots
    concurrent_gather = True  # a take only reads

    def __init__(
        self, fields: Mapping[str, FieldLike], capacity: int, *, layout: str = "auto"
    ) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields = make_fields(fields)
        if layout not in ("auto", "records", "columns"):
            raise ValueError(
                f"`layout` must be 'auto', 'records' or 'columns', got layout={layout!r}"
            )
        if layout == "auto":
            layout = default_layout(self.fields)
        self.layout = layout
        # np.zeros maps fresh zero pages lazily: memory is touched as rows are written
        self._records: np.ndarray | None = None
        # the records read as gather reads them, and each field's view of its bytes
        self._opaque: np.ndarray | None = None
        self._unpack: tuple[tuple[str, np.dtype[Any] | None], ...] = ()
        self._items: dict[str, np.ndarray] = {}
        self._puts: dict[str, Callable[[int, Any], None]] | None = None
        self._record_fields: tuple[tuple[str, int, int, np.dtype[Any], tuple[int, ...]], ...] = ()
        self._bytes: tuple[np.ndarray, int] = (np.empty(0, dtype=np.uint8), 0)
        # the compiled gather's plan for the last batch size (see _gather_plan)
        self._plan: tuple[int, np.ndarray, int, tuple[Any, ...]] | None = None
        #: the records as bytes and the bytes of one (records layout; else empty, 0):
        #: what a sampler prefetches of the rows it draws, for :meth:`gather`. Set
        #: with the records, as are ``_opaque`` and ``_bytes``, which gather reads
        #: (code that replaces ``_records`` must set all three again)
        self.record_bytes: tuple[np.ndarray, int] = (np.empty(0, dtype=np.uint8), 0)
        if layout == "records":
            record = record_dtype(self.fields)
            warn_if_too_large(
                self.capacity * record.itemsize, f"a buffer of capacity {self.capacity}"
            )
            self._records = np.zeros(self.capacity, dtype=record)
            self.columns: dict[str, np.ndarray] = {n: self._records[n] for n in self.fields}
            where = record.fields
            assert where is not None
            # A field of an axis or more, seen as one opaque item per slot: a strided
            # copy of items is several times faster than numpy's copy of a strided
            # field of short rows, which goes a row at a time. gather copies such a
            # field out of a block of records as items, then views the copy as
            # (k, *shape); a long run of rows is written into the records as items.
            names = list(where)
            opaque = [n for n in names
                      if self.fields[n].shape != () and self.fields[n].nbytes_per_item]  # fmt: skip
            spec: Any = {  # (numpy.dtype's dict form)
                "names": names, "offsets": [where[n][1] for n in names],
                "formats": [f"V{self.fields[n].nbytes_per_item}" if n in opaque else where[n][0]
                            for n in names],
                "itemsize": record.itemsize,
            }  # fmt: skip
            self._opaque = self._records.view(np.dtype(spec))
            self.record_bytes = (self._records.view(np.uint8), record.itemsize)
            self._bytes = self.record_bytes  # (what gather reads, whatever is prefetched)
            self._items = {n: self._opaque[n] for n in opaque}
            self._unpack = tuple(
                (n, np.dtype((self.fields[n].dtype, self.fields[n].shape)) if n in opaque else None)
                for n in self.fields
            )
            # each field's offset in a record and bytes per row, for the compiled gather
            self._record_fields = tuple(
                (n, where[n][1], f.nbytes_per_item, f.dtype, f.shape)
                for n, f in self.fields.items()
            )
        else:
            warn_if_too_large(
                self.capacity * self.nbytes_per_slot, f"a buffer of capacity {self.capacity}"
            )
            self.columns = {
                name: np.zeros((self.capacity, *f.shape), dtype=f.dtype)
                for name, f in self.fields.items()
            }

    def __reduce__(self) -> tuple[Any, ...]:
        # a copy (copy.deepcopy, pickle) is a new storage of the same layout holding
        # the same rows: its columns must be views of its own records, its writers
        # its own
        state = {k: np.ascontiguousarray(v) for k, v in self.state_dict(self.capacity).items()}
        return (_copied_storage, (self.fields, self.capacity, self.layout, state))

    @property
    def nbytes_per_slot(self) -> int:
        """Bytes of one transition (all fields)."""
        return sum(f.nbytes_per_item for f in self.fields.values())

    def nbytes(self) -> int:
        """Bytes the arrays take when full (pages are mapped as rows are written;
        records: padding included)."""
        if self._records is not None:
            return int(self._records.nbytes)
        return int(sum(c.nbytes for c in self.columns.values()))

    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast; writes nothing. O(B)."""
        return coerce_batch(self.fields, transition, self.capacity)

    def direct_rows(self) -> DirectRows:
        """The fast path of an add: values stored with no cast (see :class:`DirectRows`)."""
        puts = [self._long_putter(n) for n in self.columns] if self._records is not None else None
        return DirectRows(self.fields, self.capacity, self.columns, puts)

    def _putter(self, name: str) -> Callable[[int, Any], None]:
        """``put(start, rows)``: ``columns[name][start : start + len(rows)] = rows``.

        A field of records is a strided view, which numpy fills a row at a
        time; into a field of an axis or more, a long run of C-contiguous rows
        of the field's dtype is copied as opaque items instead (the same
        bytes, several times faster: :meth:`_long_putter`).
        """
        put_items = self._long_putter(name)
        if put_items is not None:
            return put_items
        col = self.columns[name]

        def put(start: int, rows: Any) -> None:
            col[start : start + len(rows)] = rows

        return put

    def _long_putter(self, name: str) -> Callable[[int, Any], None] | None:
        """:meth:`_putter` of a field of records with an axis or more; None for any
        other field, whose slice copy is as fast (a scalar field: numpy copies
        strided scalars as fast as items, and an item view costs a call)."""
        col = self.columns[name]
        items = self._items.get(name)
        if items is None:
            return None
        dtype, ndim, item = col.dtype, col.ndim, items.dtype
        # rows of a field of one axis viewed as items keep a second axis of 1
        target = items.reshape(-1, 1) if ndim == 2 else items

        def put_items(start: int, rows: Any) -> None:
            k = len(rows)
            if k < _ITEM_ROWS or type(rows) is not np.ndarray or rows.dtype != dtype:
                col[start : start + k] = rows
            elif ndim == 2 and rows.flags.c_contiguous:  # (a view, no reshape)
                target[start : start + k] = rows.view(item)
            elif rows.flags.c_contiguous:
                items[start : start + k] = rows.reshape(k, -1).view(item).reshape(k)
            else:
                col[start : start + k] = rows

        return put_items

    def write(self, start: int, prepared: Mapping[str, np.ndarray], k: int) -> None:
        """Write prepared arrays (from :meth:`prepare`) from slot ``start`` on, wrapping. O(B)."""
        first = min(k, self.capacity - start)
        puts = self._puts
        if puts is None:
            puts = self._puts = {n: self._putter(n) for n in self.columns}
        for name, put in puts.items():
            src = prepared[name]
            put(start, src[:first])
            if first < k:
                put(0, src[first:k])

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices`` for every field, C-contiguous. O(B)."""
        opaque = self._opaque
        if opaque is not None:
            if (
                type(indices) is np.ndarray
                and ((dt := indices.dtype) is _INT64 or dt == _INT64)
                and indices.ndim == 1
                and indices.flags.carray  # (C-contiguous, aligned, writeable: one signature)
            ):  # (the buffers' indices: the compiled gather, one pass per field)
                data = self._gather_records(indices)
                if data is not None:
                    return data
            # any other indices (or one outside the slots, which take names): one
            # read of each record, then its fields apart
            block = opaque.take(indices)
            return {
                name: block[name].copy() if shaped is None else block[name].copy().view(shaped)
                for name, shaped in self._unpack
            }
        # take(axis=0) is several times faster than fancy indexing on 2-D columns
        return {name: col.take(indices, axis=0) for name, col in self.columns.items()}

    def _gather_records(self, idx: np.ndarray) -> dict[str, np.ndarray] | None:
        """:meth:`gather` of records at int64 indices: each field's rows copied by one
        compiled pass into its block of one new array, each field a view of its block
        (C-contiguous, aligned). None: no index at all, or one outside the slots."""
        b = idx.shape[0]
        plan = self._plan
        if plan is None or plan[0] != b:
            if b == 0:
                return None
            plan = self._plan = self._gather_plan(b)
        _, spec, nbytes, views = plan
        out = np.empty(nbytes, dtype=np.uint8)
        rows, row_bytes = self._bytes
        if not _records.gather_records(rows, row_bytes, self.capacity, idx, spec, out):
            return None
        new = np.ndarray
        data = {}
        for name, shape, dtype, offset in views:
            data[name] = new(shape, dtype, out, offset)
        return data

    def _gather_plan(self, b: int) -> tuple[int, np.ndarray, int, tuple[Any, ...]]:
        """The compiled gather's plan for batches of ``b`` rows: ``(b, plan, bytes,
        views)``; each field's block starts on a 64-byte boundary of the output
        (see :func:`fastper._kernels.records.gather_records`)."""
        spec: list[int] = []
        views = []
        at = 0
        for name, offset, nb, dtype, shape in self._record_fields:
            spec += [offset, nb, at]
            views.append((name, (b, *shape), dtype, at))
            at += -(-b * nb // 64) * 64
        return b, np.array(spec, dtype=np.int64), at, tuple(views)

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A copy of rows ``lo .. hi-1`` of field ``name``. O(hi - lo)."""
        return self.columns[name][lo:hi].copy()

    def clear(self) -> None:
        """Nothing to do: rows past the ring's size are never read."""

    def state_dict(self, n: int) -> dict[str, Any]:
        """Views (not copies) of the first ``n`` rows of every column."""
        return {f"columns/{name}": col[:n] for name, col in self.columns.items()}

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` rows of every column, for a loader to read a file into in place."""
        return {f"columns/{name}": col[:n] for name, col in self.columns.items()}

    def load_state_dict(self, state: Mapping[str, Any], n: int) -> None:
        """Check ``state``'s columns (names, dtypes, ``n`` rows), then take them. O(N)."""
        check_columns(self.fields, state, n)
        for name, col in self.columns.items():
            a = state[f"columns/{name}"]
            if not np.shares_memory(a, col):  # read in place by the loader: nothing to copy
                col[:n] = a
