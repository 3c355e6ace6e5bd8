"""The result of ``sample``: a frozen batch of gathered rows, weights and keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleBatch:
    """One sampled minibatch.

    Attributes:
        data: ``{field: array}``, each with a leading ``batch_size`` dimension
            (copies: writing to them does not touch the buffer).
        indices: slots sampled (int64), to pass back to ``update_priorities``.
        weights: importance-sampling weights (float64).
        probabilities: P(i) of each sampled slot (float64).
        keys: insertion counter of each slot's occupant (int64); pass it back
            so that updates for overwritten slots are dropped.
    """

    data: dict[str, np.ndarray]
    indices: np.ndarray
    weights: np.ndarray
    probabilities: np.ndarray
    keys: np.ndarray

    def __getitem__(self, field: str) -> np.ndarray:
        return self.data[field]

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """``data`` plus ``weights`` / ``indices`` as torch tensors (imports torch)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("to_torch needs PyTorch: pip install 'fastper[agents]'") from exc
        out = {k: torch.as_tensor(v, device=device) for k, v in self.data.items()}
        out["weights"] = torch.as_tensor(self.weights, device=device)
        out["indices"] = torch.as_tensor(self.indices, device=device)
        return out


@dataclass(frozen=True)
class MassSample:
    """A buffer's part of a sample drawn over several buffers (see ``sample_mass``).

    Attributes:
        data: ``{field: array}`` of the rows found (copies).
        indices: slots found (int64).
        keys: insertion counter of each slot's occupant (int64).
        masses: each slot's sampling mass: ``p_i ** alpha`` (proportional),
            1.0 (uniform). float64.
        total: the buffer's whole mass when the slots were found.
        min_mass: its smallest positive mass then (``inf`` when empty).
        size: transitions it held then.
        added: transitions ever added to it then.
    """

    data: dict[str, np.ndarray]
    indices: np.ndarray
    keys: np.ndarray
    masses: np.ndarray
    total: float
    min_mass: float
    size: int
    added: int

    def __len__(self) -> int:
        return int(self.indices.shape[0])
