"""What ``sample`` returns, and the two halves of a sample drawn in two steps.

* :class:`SampleBatch`: a frozen batch of gathered rows, weights and keys;
  ``buffer.draw`` returns one without rows (``data`` empty).
* :class:`Gathered`: the rows of a draw, with which of them still hold the
  transition drawn (``buffer.gather``). A caller that must not hold a lock while rows are
  read (:class:`~fastper.limiter.RateLimitedBuffer`) draws under the lock and
  gathers after releasing it.
* :func:`check_batch_size`: the size check of ``sample``, so that an absurd
  ``batch_size`` fails with a message, not with an allocation error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._validation import check_int
from .errors import require
from .storage import physical_memory

_new = object.__new__

__all__ = [
    "DRAW_NBYTES",
    "MAX_BATCH_SIZE",
    "Gathered",
    "MassSample",
    "SampleBatch",
    "check_batch_size",
    "max_batch_size",
]

#: the most draws one sample may ask for, whatever the memory (draw more in pieces)
MAX_BATCH_SIZE = 1 << 24
#: bytes a sample holds per draw besides the row: uniform, index, key,
#: probability, weight and shuffle position (8 bytes each)
DRAW_NBYTES = 48
#: batches this small, of rows this small, pass without arithmetic (a hot-path shortcut)
SMALL_BATCH = 1 << 16
SMALL_ROW = 4096
#: ``to_torch`` entries besides the fields
BATCH_KEYS = ("weights", "indices", "keys", "probabilities")


@functools.lru_cache(maxsize=1)
def _memory() -> int:
    return physical_memory()


def max_batch_size(row_nbytes: int = 0) -> int:
    """The largest ``batch_size`` a sample of rows of ``row_nbytes`` bytes may ask for. O(1).

    A batch is allocated whole: its rows and :data:`DRAW_NBYTES` per draw
    must fit in this machine's memory, and it is never above
    :data:`MAX_BATCH_SIZE`.
    """
    return int(min(MAX_BATCH_SIZE, _memory() // (max(int(row_nbytes), 0) + DRAW_NBYTES)))


def check_batch_size(batch_size: Any, row_nbytes: int = 0) -> int:
    """``batch_size`` as an int in ``[1, max_batch_size(row_nbytes)]``, else a clear error. O(1).

    Raises:
        TypeError: not an integer.
        ValueError: below 1, or larger than :func:`max_batch_size` (the
            message names the limit and why).
    """
    b = batch_size if type(batch_size) is int else check_int("batch_size", batch_size, minimum=1)
    if b < 1:
        check_int("batch_size", b, minimum=1)
    if b <= SMALL_BATCH and row_nbytes <= SMALL_ROW:
        return b  # far below any limit: no arithmetic on the hot path
    limit = max_batch_size(row_nbytes)
    if b > limit:
        per = max(int(row_nbytes), 0) + DRAW_NBYTES
        why = (
            f"at most {MAX_BATCH_SIZE} draws a call"
            if limit == MAX_BATCH_SIZE
            else f"a batch is allocated whole, {per} bytes a draw with its row, in this "
            f"machine's {_memory() / 2**30:.1f} GiB of memory"
        )
        raise ValueError(
            f"`batch_size` must be <= {limit} (draw large batches in pieces: {why}), "
            f"got batch_size={b}"
        )
    return b


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
        beta: the IS exponent of ``weights`` (``None`` where not recorded).
        staleness: learner steps whose priority updates the draw could not
            see (0 for every local buffer and for strict sharded sampling;
            at most the pipeline's bound for pipelined sharded sampling, see
            :class:`fastper.distributed.ShardedReplayBuffer`).
    """

    data: dict[str, np.ndarray]
    indices: np.ndarray
    weights: np.ndarray
    probabilities: np.ndarray
    keys: np.ndarray
    beta: float | None = None
    staleness: int = 0

    @classmethod
    def _made(
        cls, data: dict[str, np.ndarray], indices: np.ndarray, weights: np.ndarray,
        probabilities: np.ndarray, keys: np.ndarray, beta: float | None,
    ) -> SampleBatch:  # fmt: skip
        """The batch a buffer has just drawn: what ``SampleBatch(...)`` makes, without
        the frozen class's seven guarded attribute sets (0.6 us of every sample)."""
        batch = _new(cls)
        d = batch.__dict__
        d["data"] = data
        d["indices"] = indices
        d["weights"] = weights
        d["probabilities"] = probabilities
        d["keys"] = keys
        d["beta"] = beta
        d["staleness"] = 0
        return batch

    def __getitem__(self, field: str) -> np.ndarray:
        return self.data[field]

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def to_torch(self, device: Any = "cpu") -> dict[str, Any]:
        """``data`` plus ``weights``, ``indices``, ``keys`` and ``probabilities`` as torch tensors.

        Every tensor is on ``device``. Pass the keys back with the indices,
        ``buffer.update_priorities(out["indices"], td, keys=out["keys"])``
        (tensors on any device, ``td`` may require grad), so that updates for
        slots overwritten since the sample are dropped. O(B) (imports torch).

        Raises:
            ImportError: PyTorch is not installed.
            ValueError: a field is named like one of the batch's own entries
                (``weights``, ``indices``, ``keys``, ``probabilities``).
        """
        torch = require("torch", "SampleBatch.to_torch", "torch")
        clash = [k for k in BATCH_KEYS if k in self.data]
        if clash:
            raise ValueError(
                f"field names must differ from the batch's own entries {list(BATCH_KEYS)} to be "
                f"handed to torch, got fields {clash}: rename them"
            )
        cpu = torch.device(device).type == "cpu"

        def wrap(v: Any) -> Any:
            # on the CPU a numpy array's own memory, as as_tensor shares it, at a third
            # of its cost
            if cpu and type(v) is np.ndarray:
                return torch.from_numpy(v)
            return torch.as_tensor(v, device=device)

        out = {k: wrap(v) for k, v in self.data.items()}
        out["weights"] = wrap(self.weights)
        out["indices"] = wrap(self.indices)
        out["keys"] = wrap(self.keys)
        out["probabilities"] = wrap(self.probabilities)
        return out


class Gathered(NamedTuple):
    """The second half of a sample: the rows of drawn slots (``buffer.gather``).

    Attributes:
        data: ``{field: array}``, one row per draw (copies).
        fresh: bool, one per draw: False where the slot was overwritten since
            the draw (its row is then another transition's and must not be used).
    """

    data: dict[str, np.ndarray]
    fresh: np.ndarray


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
