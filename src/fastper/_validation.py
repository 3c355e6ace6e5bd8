"""Argument checks and their messages, in one place.

Messages read "`name` must <constraint>, got name=<value>". Every check here
runs before any state is touched, so a failing call changes nothing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ._kernels import ring as _ring
from .errors import InvalidIndexError

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

_MAX_SHOW = 8


def show(value: Any) -> str:
    """A short repr of ``value`` for error messages."""
    if isinstance(value, np.ndarray):
        if value.size <= _MAX_SHOW:
            return f"array({value.tolist()!r}, dtype={value.dtype})"
        return f"array(shape={value.shape}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"`{name}` must be an integer, got {name}={show(value)}")
    ivalue = int(value)
    if minimum is not None and ivalue < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {name}={ivalue}")
    return ivalue


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_min: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {name}={show(value)}")
    fvalue = float(value)
    if not math.isfinite(fvalue):
        raise ValueError(f"`{name}` must be finite, got {name}={fvalue!r}")
    if minimum is not None:
        if strict_min and not fvalue > minimum:
            raise ValueError(f"`{name}` must be > {minimum}, got {name}={fvalue!r}")
        if not strict_min and fvalue < minimum:
            raise ValueError(f"`{name}` must be >= {minimum}, got {name}={fvalue!r}")
    if maximum is not None and fvalue > maximum:
        raise ValueError(f"`{name}` must be <= {maximum}, got {name}={fvalue!r}")
    return fvalue


def as_index_array(
    name: str, indices: Any, limit: int, *, written: int | None = None
) -> np.ndarray:
    """``indices`` as a 1-D int64 array, each in ``[0, limit)`` (and ``< written``).

    Not always a copy: an array that already is one (int64, C-contiguous) comes
    back as it is, so a caller that keeps or changes it copies it first."""
    arr = _to_numpy(indices)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got {name} with shape {arr.shape}")
    if arr.size and not (np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"`{name}` must hold integers, got {name} with dtype {arr.dtype}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    lo = int(arr.min())
    hi = int(arr.max())
    if lo < 0 or hi >= limit:
        bad = arr[(arr < 0) | (arr >= limit)]
        raise InvalidIndexError(
            f"`{name}` must lie in [0, {limit}), got out-of-range {name}={show(bad[:_MAX_SHOW])}"
        )
    if written is not None and hi >= written:
        bad = arr[arr >= written]
        filled = "nothing is stored yet" if written == 0 else f"slots 0 to {written - 1} are filled"
        raise InvalidIndexError(
            f"`{name}` must name written slots ({filled}), "
            f"got never-written {name}={show(bad[:_MAX_SHOW])}"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_value_array(name: str, values: Any, length: int, *, nonnegative: bool = True) -> np.ndarray:
    """1-D float64 copy of ``values`` of ``length`` entries, finite (and >= 0)."""
    arr = _to_numpy(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got {name} with shape {arr.shape}")
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        if arr.size:
            raise TypeError(f"`{name}` must hold real numbers, got {name} with dtype {arr.dtype}")
    if arr.shape[0] != length:
        raise ValueError(
            f"`{name}` must have {length} entries (one per index), got {name} with {arr.shape[0]}"
        )
    out = np.array(arr, dtype=np.float64, copy=True)
    finite = np.isfinite(out)
    if not finite.all():
        raise ValueError(
            f"`{name}` must be finite, got non-finite {name}={show(out[~finite][:_MAX_SHOW])}"
        )
    if nonnegative:
        out += 0.0  # -0.0 -> +0.0: stored leaves never carry a negative sign
    if nonnegative and out.size and out.min() < 0:
        raise ValueError(
            f"`{name}` must be >= 0, got negative {name}={show(out[out < 0][:_MAX_SHOW])}"
        )
    return out


def _to_numpy(value: Any) -> npt.NDArray[Any]:
    """numpy view of arrays, lists, scalars and (duck-typed) torch tensors.

    Tensors are detached first (a tensor that tracks gradients, e.g. a loss,
    is read as its values) and copied to the host.
    """
    if isinstance(value, np.ndarray):
        return value
    # torch tensors (and other array libraries) without importing them here
    detach = getattr(value, "detach", None)
    if detach is not None and hasattr(value, "cpu") and hasattr(value, "numpy"):
        t = detach().cpu()
        if getattr(t, "is_floating_point", lambda: False)() and t.element_size() < 4:
            # bfloat16 / float8 have no numpy dtype; float32 holds each value exactly
            # (float16 too), and the field's cast rules apply to the result
            t = t.float()
        return np.asarray(t.numpy())
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cannot convert {show(value)} to an array: {exc}") from None


to_numpy = _to_numpy


def dtype_error(name: str, kinds: str, dtype: Any) -> TypeError:
    """The error for values of the wrong kind: ``kinds`` ``"iu"`` (integers) or ``"iuf"``.

    ``dtype`` is shown as given (a numpy or a torch dtype): every front end
    refuses with this message.
    """
    what = "integers" if kinds == "iu" else "real numbers"
    return TypeError(f"`{name}` must hold {what}, got {name} with dtype {dtype}")


def ndim_error(name: str, shape: tuple[int, ...]) -> ValueError:
    """The error for an argument that must be 1-D (every front end)."""
    return ValueError(f"`{name}` must be 1-D, got {name} with shape {tuple(shape)}")


_INT64 = np.dtype(np.int64)
_FLOAT64 = np.dtype(np.float64)


def as_1d(name: str, value: Any, kinds: str) -> np.ndarray:
    """Cheap conversion to a 1-D int64 / float64 array; ranges are checked later.

    A torch tensor is detached and copied to the host (see :func:`to_numpy`).
    """
    dtype = _INT64 if kinds == "iu" else _FLOAT64
    if type(value) is np.ndarray and value.ndim == 1:
        d = value.dtype
        if d is dtype or d == dtype:
            return value  # the common case: arrays straight from a SampleBatch
    arr = to_numpy(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ndim_error(name, arr.shape)
    if arr.dtype.kind not in kinds and arr.size:
        raise dtype_error(name, kinds, arr.dtype)
    return np.ascontiguousarray(arr, dtype=dtype)


def nstep_key_args(nstep_keys: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"truncated": None}`` and ``{"truncated_key": None}`` both name a role."""
    out: dict[str, Any] = {}
    roles = ("reward", "next_obs", "terminated", "truncated")
    for key, value in dict(nstep_keys or {}).items():
        role = key[: -len("_key")] if isinstance(key, str) and key.endswith("_key") else key
        if role not in roles:
            raise ValueError(
                f"`nstep_keys` names roles among {list(roles)}, got nstep_keys key {key!r}"
            )
        if value is not None and not isinstance(value, str):
            raise TypeError(
                f"`nstep_keys` values must be field names or None, got "
                f"nstep_keys[{key!r}]={show(value)}"
            )
        out[f"{role}_key"] = value
    return out


#: the constructor option that lets non-finite rewards in
NONFINITE_OPTION = "allow_nonfinite_rewards"


def floats_finite(floats: list[float]) -> bool:
    """Whether every Python float in ``floats`` (a few rewards) is finite. One sum:
    a NaN or an inf makes it non-finite, and so can finite float64 values that
    overflow it, so each value is tested only then."""
    return math.isfinite(sum(floats)) or all(map(math.isfinite, floats))


def rewards_finite(values: np.ndarray) -> bool:
    """Whether every reward in ``values`` (any shape) is finite; integers pass unread.

    O(1) for one value (no numpy call), O(B) for a batch.
    """
    dtype = values.dtype
    if dtype.kind != "f":
        return True
    size = values.size
    if dtype.itemsize <= 8:  # (a longdouble is no Python float: it takes numpy below)
        if size == 1:
            return math.isfinite(values.item())
        if size <= 8:  # a vector env's step: Python floats beat a compiled call's dispatch
            return floats_finite(values.tolist() if values.ndim == 1 else values.ravel().tolist())
    flat = values.ravel()
    if (dtype == _F32 or dtype == _F64) and flat.flags.writeable:
        # one compiled pass (for the two types the kernel cache holds; a read-only
        # array would be a third to compile)
        return bool(_ring.all_finite(flat))
    # a sum of squares is finite only if every value is (no inf - inf can cancel):
    # one BLAS call; an overflow (|r| > 1e19 in float32) falls to the exact test
    with np.errstate(over="ignore", invalid="ignore"):
        squares = flat.dot(flat)
    return math.isfinite(squares) or bool(np.isfinite(flat).all())


def check_finite_rewards(field: str, values: np.ndarray) -> None:
    """Refuse NaN / inf in the rewards of an add (``values``: the field's rows, any shape).

    O(1) for one value (no numpy call), O(B) for a batch; integers pass unread.

    Raises:
        ValueError: a reward is NaN or infinite; names the rows and the opt-out.
    """
    if rewards_finite(values):
        return
    per_row = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(-1, 1)
    rows = np.flatnonzero(~np.isfinite(per_row).all(axis=1))
    bad = per_row[rows][~np.isfinite(per_row[rows])]
    shown = ", ".join(str(float(v)) for v in bad[:_MAX_SHOW])
    where = f" in rows {rows[:_MAX_SHOW].tolist()}" if values.size > 1 else ""
    raise ValueError(
        f"`{field}` must be finite (a NaN or inf reward makes every return, TD target and "
        f"priority computed from it NaN or inf), got {field}={shown}{where}; "
        f"nothing was stored. Fix the environment or wrapper that produces it, or pass "
        f"{NONFINITE_OPTION}=True to the buffer to store such rewards as given"
    )


def nstep_key_names(nstep_keys: Mapping[str, Any] | None) -> dict[str, str]:
    """How the user wrote each role of ``nstep_keys`` (``"nstep_keys['reward']"``), for messages."""
    names: dict[str, str] = {}
    for key in dict(nstep_keys or {}):
        if isinstance(key, str):
            role = key[: -len("_key")] if key.endswith("_key") else key
            names[role] = f"nstep_keys[{key!r}]"
    return names


def unwrap_batch(indices: Any, keys: Any) -> tuple[Any, Any]:
    """``update_priorities(batch, td)``: a sampled batch stands for its indices and keys.

    Any batch of fastper's (host, device or sharded) has ``indices`` and
    ``keys``; other values pass through. Giving ``keys`` beside a batch is
    refused: the batch's own keys are the ones that match its indices.
    """
    if isinstance(indices, np.ndarray | list | tuple) or not (
        hasattr(indices, "indices") and hasattr(indices, "keys")
    ):
        return indices, keys
    if keys is not None:
        raise ValueError(
            "`keys` must not be given with a sampled batch (its own keys are used), "
            f"got keys={show(keys)}"
        )
    return indices.indices, indices.keys


def check_row_ids(env_ids: Any, k: int) -> None:
    """``add``'s ``env_ids`` without stream tracking: one integer per row, or None. O(k)."""
    if env_ids is None:
        return
    ids = to_numpy(env_ids).reshape(-1)
    if ids.shape[0] != k or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"`env_ids` must hold one integer per row ({k}), got env_ids={show(ids)}")
