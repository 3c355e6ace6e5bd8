"""The one place :mod:`fastper.device` imports torch, with an install hint."""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastper.device needs PyTorch (>= 2.1): pip install 'fastper[torch]' "
        "(or install torch for your CUDA version first, see pytorch.org)"
    ) from exc

__all__ = ["torch"]
