"""Columns as torch tensors on a device: a :class:`~fastper.storage.ReplayStorage`.

Rows stay on the device: ``gather`` returns device tensors, so a sampled
batch never crosses to the host. ``add`` takes

* torch tensors: checked by shape and dtype only, cast with
  :func:`torch.can_cast` rules (e.g. float64 -> float32, int64 -> int32; not
  float -> int). Their values are not inspected: that would need a host sync.
  Tensors on the buffer's device are copied device to device; host tensors
  go through the pinned staging below.
* anything else (numpy arrays, lists, numbers): checked and cast on the host
  as :class:`fastper.Storage` does (a cast that would change a value is
  refused), then copied to the device. On a CUDA device the copy goes
  through a pinned staging tensor per field, reused from call to call (grown
  by doubling when a batch is larger), so the host -> device copy runs
  asynchronously and no call allocates pinned memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validation import check_int
from ..errors import FieldTypeError
from ..storage import (
    Field,
    FieldLike,
    batch_length,
    check_columns,
    check_names,
    coerce_batch,
    make_fields,
    row_count,
    warn_if_too_large,
)
from ._torch import torch

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
    """Columnar storage of torch tensors on ``device`` (see the module docstring).

    Args:
        fields: the field spec, as for :class:`fastper.Storage`.
        capacity: number of slots.
        device: where the columns live (default ``"cpu"``).
    """

    def __init__(self, fields: Mapping[str, FieldLike], capacity: int, device: Any = "cpu") -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields: dict[str, Field] = make_fields(fields)
        self.device = torch.device(device)
        self.dtypes = {name: torch_dtype(name, f.dtype) for name, f in self.fields.items()}
        if self.device.type == "cpu":  # (a GPU's allocator refuses at once, with the sizes)
            per_slot = sum(f.nbytes_per_item for f in self.fields.values())
            warn_if_too_large(self.capacity * per_slot, f"a buffer of capacity {self.capacity}")
        self.columns: dict[str, torch.Tensor] = {
            name: torch.zeros(
                (self.capacity, *f.shape), dtype=self.dtypes[name], device=self.device
            )
            for name, f in self.fields.items()
        }
        self._pinned = self.device.type == "cuda"
        self._staging: dict[str, torch.Tensor] = {}
        self._copied: Any = None  # CUDA event: the last staged copy has left the staging

    def nbytes(self) -> int:
        """Bytes of device memory held by the columns."""
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
        for name, field in self.fields.items():
            t = transition[name]
            lengths[name] = row_count(name, field, tuple(t.shape))
            want = self.dtypes[name]
            if t.dtype != want and not torch.can_cast(t.dtype, want):
                raise FieldTypeError(
                    f"field `{name}` is {want}; a {t.dtype} tensor cannot be cast to it "
                    "without changing values (cast it first)"
                )
            out[name] = t.reshape((1, *field.shape)) if lengths[name] is None else t
        return out, batch_length(lengths, self.capacity)

    def _source(self, name: str, src: Any, k: int) -> torch.Tensor:
        """A tensor holding ``src[:k]`` that can be copied into the column."""
        if isinstance(src, torch.Tensor):
            if not (self._pinned and src.device.type == "cpu"):
                return src[:k]
            arr = src[:k]  # a host tensor: staged like host arrays
        else:
            host = np.ascontiguousarray(src[:k])
            if not host.flags.writeable:  # torch warns on read-only memory; only read here
                host = host.copy()
            arr = torch.from_numpy(host)
        if not self._pinned:
            return arr
        stage = self._staging.get(name)
        if stage is None or stage.shape[0] < k:
            rows = max(k, 2 * (0 if stage is None else stage.shape[0]), 64)
            col = self.columns[name]
            stage = torch.empty((rows, *col.shape[1:]), dtype=col.dtype, pin_memory=True)
            self._staging[name] = stage
        stage[:k].copy_(arr)
        return stage[:k]

    def write(self, start: int, prepared: Mapping[str, Any], k: int) -> None:
        """Write ``k`` prepared rows from slot ``start`` on, wrapping. O(B), no host sync."""
        if self._pinned and self._copied is not None:
            self._copied.synchronize()  # the staging tensors are free again
        first = min(k, self.capacity - start)
        for name, col in self.columns.items():
            src = self._source(name, prepared[name], k)
            col[start : start + first].copy_(src[:first], non_blocking=True)
            if first < k:
                col[: k - first].copy_(src[first:k], non_blocking=True)
        if self._pinned:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    # -- read --------------------------------------------------------------------------
    def gather(self, indices: Any) -> dict[str, torch.Tensor]:
        """Rows at ``indices`` (an int64 tensor on the device) for every field, as new tensors. O(B)."""
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.device)
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
