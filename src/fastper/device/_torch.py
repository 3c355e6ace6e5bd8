"""The one place :mod:`fastper.device` imports torch, with an install hint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import require

if TYPE_CHECKING:
    import torch
else:
    # one line if missing: fastper.device needs the torch extra (...): pip install
    # "fastper[torch]" (for a GPU, first the torch build for your CUDA, see pytorch.org)
    torch = require("torch", "fastper.device")

__all__ = ["check_device", "torch"]


def check_device(device: Any) -> torch.device:
    """``device`` as a :class:`torch.device` this machine can use, or a ValueError
    that names it, says why not and what to pass instead. The device comes back
    as torch puts tensors on it, so that they compare equal to it: ``"cuda"``
    with the current GPU's index (``cuda:0``), ``"cpu:0"`` as ``cpu``. O(1) (a
    non-CPU, non-CUDA device is probed with an empty tensor).

    Raises:
        ValueError: not a device name, CUDA asked for where it is not available
            (no GPU, or a torch build without CUDA), a GPU index past the
            last GPU, or another device type torch cannot allocate on here.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"`device` must name a torch device (e.g. 'cpu' or 'cuda'), got device={device!r}"
        ) from exc
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" too: torch's CPU tensors carry no index
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise ValueError(
                f"`device` must be a device available on this machine, got device={device!r}: "
                f"CUDA is not available ({why}); pass device='cpu' (or install a CUDA build "
                "of torch on a machine with an NVIDIA GPU)"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"`device` must be one of the {count} CUDA device(s) of this machine "
                f"('cuda:0' .. 'cuda:{count - 1}'), got device={device!r}"
            )
        # "cuda" names the current GPU: resolved to it, so that the tensors the
        # buffer makes (on "cuda:0", say) compare equal to the buffer's device
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    try:
        probe = torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"`device` must be a device available on this machine, got device={device!r}: "
            f"torch cannot allocate on it ({first}); pass device='cpu'"
        ) from None
    return probe.device  # where torch puts that device's tensors (its index resolved)
