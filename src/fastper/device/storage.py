"""Columns as torch tensors on a device: a :class:`~fastper.storage.ReplayStorage`.

Rows stay on the device: ``gather`` returns device tensors, so a sampled
batch never crosses to the host. ``add`` takes

* torch tensors: checked by shape and dtype, cast within their kind
  (:func:`torch.can_cast`: e.g. float64 -> float32, int64 -> int32; not
  float -> int or int -> bool: pass a tensor of the field's kind). A cast
  that narrows (float64 -> float32, int64 -> int32, ...) could change
  values: with ``check_values`` (default) they are checked with the rule and
  the message of :class:`fastper.Storage` (a float that would overflow to
  ``inf``, an integer out of range raise :class:`~fastper.errors.FieldTypeError`),
  at the cost of one read-back from the device (a host sync on a GPU); a
  tensor of the field's own dtype, or a widening cast, needs no check and no
  sync. Without ``check_values`` nothing is read back and a narrowing cast
  is torch's. A tensor that tracks gradients is stored detached (the columns
  never join an autograd graph, and ``state_dict`` works). Tensors on the
  buffer's device are copied device to device; host tensors go through the
  pinned staging below.
* anything else (numpy arrays, lists, numbers): checked and cast on the host
  as :class:`fastper.Storage` does (a cast that would change a value is
  refused), then copied to the device. On a CUDA device the copy goes
  through pinned staging, reused from call to call (grown by doubling when a
  batch is larger), so the host -> device copy runs asynchronously and no
  call allocates pinned memory: host values (host tensors too) are laid out
  as whole rows there and cross in one copy (two where the ring wraps), or,
  with a tensor per field, one staging and one copy per field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validation import check_int
from ..buffer_core import check_flag
from ..errors import FieldTypeError
from ..storage import (
    Field,
    FieldLike,
    batch_length,
    check_columns,
    check_names,
    coerce_batch,
    make_fields,
    record_dtype,
    row_count,
    warn_if_too_large,
)
from ._torch import check_device, torch

_NUMPY_TO_TORCH = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` to ``dst`` (allowed by :func:`torch.can_cast`) may
    change a value by overflow: a float type of smaller range, an integer type
    that does not hold every value of ``src``, or an integer type past a float's
    range (int32 -> float16: 65504). Bools never overflow. O(1)."""
    if src == torch.bool:
        return False
    if dst.is_floating_point and not src.is_floating_point:
        return bool(torch.finfo(dst).max < torch.iinfo(src).max)
    if src.is_floating_point:
        return bool(torch.finfo(dst).max < torch.finfo(src).max)
    s, d = torch.iinfo(src), torch.iinfo(dst)
    return d.min > s.min or d.max < s.max


def _on_host(value: Any) -> bool:
    """Whether a prepared value is in host memory (a numpy array, a CPU tensor)."""
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


def _host_tensor(src: Any, k: int) -> torch.Tensor:
    """``src[:k]`` (a numpy array) as a CPU tensor sharing its memory where it can."""
    host = np.ascontiguousarray(src[:k])
    if not host.flags.writeable:  # torch warns on read-only memory; only read here
        host = host.copy()
    return torch.from_numpy(host)


def row_layout(fields: Mapping[str, Field]) -> tuple[tuple[tuple[str, int, int], ...], int] | None:
    """Where each field sits in a row of all fields side by side: ``((name, byte offset,
    bytes), ...)`` and the bytes of a row; None where each field keeps a tensor of its own
    (one field, or fields of no elements at all).

    The CPU buffers' record (:func:`fastper.storage.record_dtype`): fields
    widest-aligned first, a row padded to a multiple of that alignment. Where
    each element's alignment is its size (as on 64-bit machines), every field
    of every row is aligned, and a field of the rows is a view of its dtype;
    elsewhere the fields keep a tensor each. O(fields).
    """
    values = fields.values()
    if (
        len(fields) < 2
        or all(f.nbytes_per_item == 0 for f in values)
        or any(f.dtype.alignment != f.dtype.itemsize for f in values)
    ):
        return None
    record = record_dtype(fields)
    placed, order = record.fields, record.names
    assert placed is not None and order is not None  # (a structured dtype)
    out = tuple((name, placed[name][1], fields[name].nbytes_per_item) for name in order)
    return out, record.itemsize


def torch_dtype(name: str, dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a field's numpy dtype (native byte order)."""
    found = _NUMPY_TO_TORCH.get(np.dtype(dtype).newbyteorder("="))
    if found is None:
        raise TypeError(
            f"field `{name}` has dtype {dtype}, which torch columns do not hold; use one of "
            + ", ".join(str(d) for d in _NUMPY_TO_TORCH)
        )
    return found


class TorchStorage:
    """Storage of torch tensors on ``device`` (see the module docstring).

    A slot's fields lie side by side in one row (:attr:`rows`, see
    :func:`row_layout`), and each column is a view of its field: a gather of
    B slots is one operation (one kernel launch on a GPU) whatever the fields,
    and its fields are views of the gathered rows, as the CPU buffers'
    records are. A row is padded to a multiple of its widest element (at most
    7 bytes). One field, or fields of no elements at all, keep a tensor each.

    Args:
        fields: the field spec, as for :class:`fastper.Storage`.
        capacity: number of slots.
        device: where the columns live (default ``"cpu"``).
        check_values: check the values of a tensor whose dtype narrows to the
            field's (one host sync per such add; see the module docstring).
    """

    def __init__(
        self,
        fields: Mapping[str, FieldLike],
        capacity: int,
        device: Any = "cpu",
        *,
        check_values: bool = True,
    ) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields: dict[str, Field] = make_fields(fields)
        self.device = check_device(device)
        self.check_values = check_flag("check_values", check_values)
        self.dtypes = {name: torch_dtype(name, f.dtype) for name, f in self.fields.items()}
        layout = row_layout(self.fields)
        if self.device.type == "cpu":  # (a GPU's allocator refuses at once, with the sizes)
            per_slot = (
                sum(f.nbytes_per_item for f in self.fields.values())
                if layout is None
                else layout[1]
            )
            warn_if_too_large(self.capacity * per_slot, f"a buffer of capacity {self.capacity}")
        #: every field of a slot side by side: a (capacity, row bytes) uint8 tensor, of
        #: which :attr:`columns` are views (None: a tensor per field, see :func:`row_layout`)
        self.rows: torch.Tensor | None = None
        #: (field, byte offset, bytes) of each field in a row
        self._layout: tuple[tuple[str, int, int], ...] = ()
        self.columns: dict[str, torch.Tensor] = self._make_columns(layout)
        self._pinned = self.device.type == "cuda"
        #: host values cross to the device as whole rows (see :meth:`write`)
        self._stage_rows = self._pinned and self.rows is not None
        self._staging: dict[str, torch.Tensor] = {}
        self._rows_staging: torch.Tensor | None = None
        self._copied: Any = None  # CUDA event: the last staged copy has left the staging
        self._staged_now = False  # (the write in progress has waited for the staging)

    def _make_columns(
        self, layout: tuple[tuple[tuple[str, int, int], ...], int] | None
    ) -> dict[str, torch.Tensor]:
        """The columns, zeroed: views of one tensor of rows where ``layout`` (from
        :func:`row_layout`) places the fields, so that a gather is one operation
        whatever the fields; else a tensor per field."""
        cap, dev = self.capacity, self.device

        def zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> torch.Tensor:
            if dev.type == "cpu":  # zeros whose memory is committed as rows are written
                return torch.from_numpy(np.zeros(shape, dtype=dtype))
            return torch.zeros(shape, dtype=_NUMPY_TO_TORCH[dtype], device=dev)

        if layout is None:
            return {
                name: zeros((cap, *f.shape), np.dtype(f.dtype).newbyteorder("="))
                for name, f in self.fields.items()
            }
        fields, row_bytes = layout
        self.rows = zeros((cap, row_bytes), np.dtype(np.uint8))
        self._layout = fields
        views = self._field_views(self.rows)
        return {name: views[name] for name in self.fields}  # in the fields' order

    def _field_views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field of ``rows`` (a (n, row_bytes) uint8 tensor) as a view of its dtype and
        shape."""
        n = rows.shape[0]
        return {
            name: rows[:, off : off + size]
            .view(self.dtypes[name])
            .view(n, *self.fields[name].shape)
            for name, off, size in self._layout
        }

    def nbytes(self) -> int:
        """Bytes of device memory held by the columns."""
        if self.rows is not None:
            return int(self.rows.numel())
        return int(sum(c.numel() * c.element_size() for c in self.columns.values()))

    # -- add ---------------------------------------------------------------------------
    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """Check and cast one transition or a batch (see the module docstring); writes nothing."""
        if (
            isinstance(transition, Mapping)
            and transition
            and all(isinstance(v, torch.Tensor) for v in transition.values())
        ):
            return self._prepare_tensors(transition)
        return coerce_batch(self.fields, transition, self.capacity)

    def _prepare_tensors(self, transition: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        check_names(self.fields, transition)
        out: dict[str, torch.Tensor] = {}
        lengths: dict[str, int | None] = {}
        narrowed: list[str] = []
        for name, field in self.fields.items():
            t = transition[name].detach()  # the columns never join an autograd graph
            lengths[name] = row_count(name, field, tuple(t.shape))
            want = self.dtypes[name]
            if t.dtype != want:
                if not torch.can_cast(t.dtype, want):
                    raise FieldTypeError(
                        f"field `{name}` is {want}; a {t.dtype} tensor cannot be cast to it "
                        "without changing values (cast it first)"
                    )
                if self.check_values and narrows(t.dtype, want):
                    narrowed.append(name)
            out[name] = t.reshape((1, *field.shape)) if lengths[name] is None else t
        k = batch_length(lengths, self.capacity)
        for name in narrowed:
            self._check_cast(name, out[name])
        return out, k

    def _check_cast(self, name: str, t: torch.Tensor) -> None:
        """Refuse a narrowing cast that would change a value, as :class:`fastper.Storage`
        does (the same rule and message). One read-back from the device. O(B)."""
        want = self.dtypes[name]
        if want.is_floating_point:  # overflow to inf (a float, or an int past float16)
            changed = ~torch.isfinite(t.to(want))
            if t.dtype.is_floating_point:
                changed &= torch.isfinite(t)
        else:
            info = torch.iinfo(want)
            changed = (t < info.min) | (t > info.max)
        if bool(changed.any()):
            # the host rule decides and words the error (FieldTypeError)
            coerce_batch({name: self.fields[name]}, {name: t}, None)

    def _source(self, name: str, src: Any, k: int) -> torch.Tensor:
        """A tensor holding ``src[:k]`` that can be copied into the column."""
        if isinstance(src, torch.Tensor):
            if not (self._pinned and src.device.type == "cpu"):
                return src[:k]
            arr = src[:k]  # a host tensor: staged like host arrays
        else:
            arr = _host_tensor(src, k)
        if not self._pinned:
            return arr
        self._await_staging()
        stage = self._staging.get(name)
        if stage is None or stage.shape[0] < k:
            col = self.columns[name]
            stage = torch.empty(
                (self._stage_size(stage, k), *col.shape[1:]), dtype=col.dtype, pin_memory=True
            )
            self._staging[name] = stage
        stage[:k].copy_(arr)
        return stage[:k]

    def _stage_size(self, stage: torch.Tensor | None, k: int) -> int:
        """Rows of a staging grown for ``k``: doubled, at least 64, at most the capacity."""
        grown = max(2 * (0 if stage is None else stage.shape[0]), 64)
        return max(k, min(grown, self.capacity))

    def _await_staging(self) -> None:
        """Before a write's first use of the staging: wait until the last staged copy
        has left it (the host waits for that copy only, and only when it stages)."""
        if self._copied is not None and not self._staged_now:
            self._copied.synchronize()
        self._staged_now = True

    def _row_stage(self, k: int) -> torch.Tensor:
        """The host staging of ``k`` whole rows (pinned on CUDA), reused from call to call
        and grown by doubling; zeros, so that the rows' padding stays zero."""
        self._await_staging()
        stage = self._rows_staging
        if stage is None or stage.shape[0] < k:
            assert self.rows is not None
            stage = torch.zeros(
                (self._stage_size(stage, k), self.rows.shape[1]),
                dtype=torch.uint8,
                pin_memory=self._pinned,
            )
            self._rows_staging = stage
        return stage[:k]

    def write(self, start: int, prepared: Mapping[str, Any], k: int) -> None:
        """Write ``k`` prepared rows from slot ``start`` on, wrapping. O(B), no host sync
        (on a GPU, a write that stages host values first waits for the previous staged
        copy to leave the staging; device values never wait).

        Host values going to a GPU are laid out as whole rows in a pinned staging
        first, so that they cross in one copy (two where the rows wrap), whatever
        the fields; values already on the device are copied field by field.
        """
        self._staged_now = False
        try:
            self._write(start, prepared, k)
        finally:  # (a write that raised part way may have issued copies from the staging)
            if self._pinned and self._staged_now:  # the staging is free again once this
                # event has passed: recorded on the stream of the GPU holding the rows,
                # where the copies run
                if self._copied is None:
                    self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))

    def _write(self, start: int, prepared: Mapping[str, Any], k: int) -> None:
        first = min(k, self.capacity - start)
        if self._stage_rows and all(_on_host(prepared[name]) for name in self.fields):
            assert self.rows is not None
            stage = self._row_stage(k)
            for name, view in self._field_views(stage).items():
                src = prepared[name]
                if isinstance(src, torch.Tensor):
                    view.copy_(src[:k])
                else:  # (numpy writes through the view: strides and read-only input alike)
                    view.numpy()[...] = src[:k]
            self.rows[start : start + first].copy_(stage[:first], non_blocking=True)
            if first < k:
                self.rows[: k - first].copy_(stage[first:k], non_blocking=True)
        else:
            for name, col in self.columns.items():
                src = self._source(name, prepared[name], k)
                col[start : start + first].copy_(src[:first], non_blocking=True)
                if first < k:
                    col[: k - first].copy_(src[first:k], non_blocking=True)

    # -- read --------------------------------------------------------------------------
    def gather(self, indices: Any) -> dict[str, torch.Tensor]:
        """Rows at ``indices`` (an int64 tensor on the device) for every field, as new tensors. O(B).

        Rows stored side by side are gathered in one operation; each field is
        then a view of the gathered rows (strided across the batch, its own
        dimensions contiguous), as the CPU buffers' records are.
        """
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.device)
        if self.rows is not None:
            views = self._field_views(self.rows.index_select(0, indices))
            return {name: views[name] for name in self.fields}
        return {name: col.index_select(0, indices) for name, col in self.columns.items()}

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A host copy of rows ``lo .. hi-1`` of ``name`` (for checkpoints; syncs). O(hi - lo)."""
        return self.columns[name][lo:hi].cpu().numpy().copy()

    def clear(self) -> None:
        """Nothing to do: rows past the ring's size are never read."""

    def state_dict(self, n: int) -> dict[str, Any]:
        """Host copies of the first ``n`` rows of every column."""
        return {f"columns/{name}": self.read(name, 0, n) for name in self.columns}

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """None: the rows are read on the host, then copied to the device."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], n: int) -> None:
        """Check the arrays (dtype, shape), then copy them to the device."""
        check_columns(self.fields, state, n)
        for name, col in self.columns.items():
            col[:n].copy_(torch.from_numpy(np.ascontiguousarray(state[f"columns/{name}"])))
