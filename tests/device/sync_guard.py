"""A guard that makes host-synchronising tensor calls raise, on any device.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` catches a sync when it
happens. On the CPU device nothing synchronises, so the guard looks for the
calls that *would* synchronise on a GPU: reading a value back to Python
(``item``, ``tolist``, ``bool`` / ``int`` / ``float`` of a tensor, ``numpy``,
moves to the host) and operations whose output shape depends on the data
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
one-argument ``where``, ``repeat_interleave`` without ``output_size``).
Every tensor call inside the ``with`` block goes through the mode's
``__torch_function__``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class HostSyncError(AssertionError):
    """A call that would synchronise with the host ran inside :class:`forbid_sync`."""


_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
    torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.argwhere,
    torch.Tensor.argwhere, torch.Tensor.__array__, torch.Tensor.__format__,
    torch.Tensor.__repr__,
}  # fmt: skip


def _is_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, tuple | list):
        return any(_is_mask(i) for i in index)
    return False


class forbid_sync(TorchFunctionMode):
    """Raise :class:`HostSyncError` on any call that would sync with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        name = getattr(func, "__name__", repr(func))
        if func in _READS:
            raise HostSyncError(f"host sync: {name}")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_mask(args[1]):
            raise HostSyncError(f"host sync: boolean-mask indexing ({name})")
        if func is torch.where and len(args) + len(kwargs) == 1:
            raise HostSyncError("host sync: one-argument torch.where")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and (
            "output_size" not in kwargs
        ):
            raise HostSyncError("host sync: repeat_interleave without output_size")
        if func in (torch.Tensor.to, torch.Tensor.copy_):
            dev = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.device | str)]
            src = args[0]
            if (
                isinstance(src, torch.Tensor)
                and src.device.type != "cpu"
                and any(torch.device(d).type == "cpu" for d in dev)
            ):
                raise HostSyncError(f"host sync: device -> host copy ({name})")
        return func(*args, **kwargs)
