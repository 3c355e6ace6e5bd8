"""One adapter per replay library, behind a common interface, for `peers.py`.

Every adapter builds a proportional prioritized replay buffer for the same
CartPole-like workload (`FIELDS`) and exposes the operations the benchmark
times: add (batched or one transition), sample (indices + IS weights + all five
fields materialised), update priorities, and the fastest public way to fill
what is left of the buffer.

The peer libraries (cpprb, Tianshou, TorchRL) are imported only inside the
adapter constructors, so importing this module costs numpy and nothing else;
`peers.py` constructs adapters only in its worker processes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

import numpy as np

#: The workload: field -> (shape, dtype), as fastper's field specs spell it.
FIELDS: dict[str, tuple[tuple[int, ...], type[np.generic]]] = {
    "obs": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((4,), np.float32),
    "done": ((), np.float32),
}

#: Bytes of transition data per slot (what an ideal columnar store needs).
DATA_BYTES_PER_SLOT: int = sum(
    int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    for shape, dtype in FIELDS.values()
)

Chunk = dict[str, np.ndarray]


def make_chunk(rng: np.random.Generator, k: int) -> Chunk:
    """``k`` random transitions of the workload, one array per field."""
    return {
        "obs": rng.standard_normal((k, 4), dtype=np.float32),
        "action": rng.integers(0, 2, k, dtype=np.int64),
        "reward": rng.standard_normal(k, dtype=np.float32),
        "next_obs": rng.standard_normal((k, 4), dtype=np.float32),
        "done": (rng.random(k) < 0.01).astype(np.float32),
    }


def dist_version(name: str) -> str:
    """Installed version of distribution ``name`` (without importing it), or "missing"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


@dataclass(frozen=True)
class Sample:
    """One sampled minibatch, as every adapter returns it.

    Attributes:
        indices: slots sampled, in the library's own index type.
        weights: importance-sampling weights (numpy array or tensor).
        data: workload field name -> the library's materialised array or tensor.
        token: whatever the library needs back at update time (fastper: keys).
    """

    indices: Any
    weights: Any
    data: Mapping[str, Any]
    token: Any = None


class Adapter(ABC):
    """A proportional PER buffer of one library, filled with the workload.

    Subclasses import their library in ``__init__``. Inputs are converted to the
    library's native form once, outside the timed calls (``native_batch``,
    ``native_rows``, ``native_priorities``), so that timings measure the buffer.
    """

    #: Short name used on the command line, in tables and in the figure.
    name: ClassVar[str]
    #: Distributions whose versions the report lists for this library.
    distributions: ClassVar[tuple[str, ...]]
    #: Whether ``add_batch`` exists (else the fill is extrapolated from ``add_one``).
    batched_add: ClassVar[bool] = True
    #: How the library normalises IS weights, and other layout notes for the report.
    notes: ClassVar[str] = ""

    @abstractmethod
    def __init__(self, capacity: int, alpha: float, beta: float, seed: int) -> None:
        """Build an empty buffer of ``capacity`` slots."""

    @classmethod
    def import_library(cls) -> None:
        """Import the library (and its compiled parts); raises if it is unusable."""
        importlib.import_module(cls.distributions[0])

    @classmethod
    def versions(cls) -> dict[str, str]:
        """Versions of the library and the distributions it depends on."""
        return {d: dist_version(d) for d in cls.distributions}

    def native_batch(self, chunk: Chunk) -> Any:
        """``chunk`` as this library's ``add_batch`` takes it."""
        return chunk

    def native_rows(self, chunk: Chunk) -> list[Any]:
        """``chunk`` as a list of single transitions for ``add_one``."""
        return [{k: v[i] for k, v in chunk.items()} for i in range(len(chunk["reward"]))]

    def native_priorities(self, values: np.ndarray) -> Any:
        """Priorities / |td| as this library's update takes them."""
        return values

    def add_batch(self, batch: Any) -> None:
        """Add a batch of transitions prepared by ``native_batch``."""
        raise NotImplementedError(f"{self.name} has no batched add")

    def add_one(self, row: Any) -> None:
        """Add one transition prepared by ``native_rows``."""
        raise NotImplementedError(f"{self.name}: add_one")

    def fill_rest(self, make: Callable[[int], Chunk], count: int) -> str:
        """Add ``count`` more transitions the fastest public way; returns a note.

        The default adds batches of 1000 with ``add_batch``. ``make(k)`` returns
        ``k`` fresh transitions.
        """
        done = 0
        while done < count:
            k = min(1000, count - done)
            self.add_batch(self.native_batch(make(k)))
            done += k
        return "add_batch(1000)"

    @abstractmethod
    def __len__(self) -> int:
        """Number of transitions held."""

    @abstractmethod
    def sample(self, batch_size: int) -> Sample:
        """Sample indices, IS weights and all five fields (materialised)."""

    @abstractmethod
    def update(self, sample: Sample, priorities: Any) -> None:
        """Set new priorities (from ``native_priorities``) for a sample's indices."""

    @abstractmethod
    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set priorities of arbitrary slots (numpy in); used by checks and priming."""


class FastperAdapter(Adapter):
    """``fastper.PrioritizedReplayBuffer`` (columnar numpy storage, numba trees)."""

    name = "fastper"
    distributions = ("fastper", "numpy", "numba")
    notes = "weights normalised by the max over the buffer (min tree)"

    @classmethod
    def versions(cls) -> dict[str, str]:
        """As for any library, fastper's own version read from the code that runs: an
        editable install's metadata keeps the version it was installed at."""
        from fastper._version import __version__

        return {**super().versions(), "fastper": __version__}

    def __init__(self, capacity: int, alpha: float, beta: float, seed: int) -> None:
        import fastper

        self._buf = fastper.PrioritizedReplayBuffer(
            capacity, FIELDS, alpha=alpha, beta=beta, seed=seed
        )

    def add_batch(self, batch: Any) -> None:
        self._buf.add(batch)

    def add_one(self, row: Any) -> None:
        self._buf.add(row)

    def __len__(self) -> int:
        return len(self._buf)

    def sample(self, batch_size: int) -> Sample:
        b = self._buf.sample(batch_size)
        return Sample(b.indices, b.weights, b.data, b.keys)

    def update(self, sample: Sample, priorities: Any) -> None:
        self._buf.update_priorities(sample.indices, priorities, keys=sample.token)

    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        self._buf.update_priorities(indices, priorities)


class CpprbAdapter(Adapter):
    """``cpprb.PrioritizedReplayBuffer`` (C++ segment trees, Cython bindings)."""

    name = "cpprb"
    distributions = ("cpprb", "numpy")
    notes = "scalar fields stored as shape (1,); weights normalised by the max over the buffer"

    def __init__(self, capacity: int, alpha: float, beta: float, seed: int) -> None:
        import cpprb

        env_dict = {
            name: {"shape": shape if shape else 1, "dtype": dtype}
            for name, (shape, dtype) in FIELDS.items()
        }
        # eps as fastper's (cpprb's default is 1e-4), so both store the same p^alpha.
        self._buf = cpprb.PrioritizedReplayBuffer(capacity, env_dict, alpha=alpha, eps=1e-6)
        self._beta = beta

    def add_batch(self, batch: Any) -> None:
        self._buf.add(**batch)

    def add_one(self, row: Any) -> None:
        self._buf.add(**row)

    def __len__(self) -> int:
        return int(self._buf.get_stored_size())

    def sample(self, batch_size: int) -> Sample:
        out = self._buf.sample(batch_size, beta=self._beta)
        data = {name: out[name] for name in FIELDS}
        return Sample(out["indexes"], out["weights"], data)

    def update(self, sample: Sample, priorities: Any) -> None:
        self._buf.update_priorities(sample.indices, priorities)

    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        self._buf.update_priorities(indices, priorities)


class TianshouAdapter(Adapter):
    """``tianshou.data.PrioritizedReplayBuffer`` (Batch storage, numba segment tree).

    Its ``add`` takes one transition at a time, so the timed fill is a prefix of
    single adds (extrapolated); the rest of the buffer is then filled with the
    public ``ReplayBuffer.from_data`` + ``PrioritizedReplayBuffer.update`` pair.
    """

    name = "tianshou"
    distributions = ("tianshou", "numpy", "numba", "torch")
    batched_add = False
    notes = (
        "add() takes one transition; done stored as terminated/truncated/done bools, "
        "reward widened to float64 by Tianshou; weights normalised by the batch max "
        "(weight_norm=True, the default)"
    )

    def __init__(self, capacity: int, alpha: float, beta: float, seed: int) -> None:
        import tianshou.data as tsd

        np.random.seed(seed)  # noqa: NPY002 - Tianshou samples from the global np.random
        self._tsd = tsd
        self._buf = tsd.PrioritizedReplayBuffer(capacity, alpha=alpha, beta=beta)

    @classmethod
    def import_library(cls) -> None:
        importlib.import_module("tianshou.data")

    def native_rows(self, chunk: Chunk) -> list[Any]:
        batch_cls = self._tsd.Batch
        return [
            batch_cls(
                obs=chunk["obs"][i],
                act=chunk["action"][i],
                rew=chunk["reward"][i],
                terminated=bool(chunk["done"][i]),
                truncated=False,
                obs_next=chunk["next_obs"][i],
            )
            for i in range(len(chunk["reward"]))
        ]

    def add_one(self, row: Any) -> None:
        self._buf.add(row)

    def fill_rest(self, make: Callable[[int], Chunk], count: int) -> str:
        if count <= 0:
            return "nothing left to fill"
        c = make(count)
        term = c["done"] > 0
        src = self._tsd.ReplayBuffer.from_data(
            obs=c["obs"],
            act=c["action"],
            rew=c["reward"],
            terminated=term,
            truncated=np.zeros(count, dtype=bool),
            done=term,
            obs_next=c["next_obs"],
        )
        self._buf.update(src)
        return "ReplayBuffer.from_data + update()"

    def __len__(self) -> int:
        return len(self._buf)

    def sample(self, batch_size: int) -> Sample:
        batch, indices = self._buf.sample(batch_size)
        data = {
            "obs": batch.obs,
            "action": batch.act,
            "reward": batch.rew,
            "next_obs": batch.obs_next,
            "done": batch.done,
        }
        return Sample(indices, batch.weight, data)

    def update(self, sample: Sample, priorities: Any) -> None:
        self._buf.update_weight(sample.indices, priorities)

    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        self._buf.update_weight(indices, priorities)


class TorchrlAdapter(Adapter):
    """``torchrl.data.PrioritizedReplayBuffer`` over a ``LazyTensorStorage`` of TensorDicts.

    TorchRL's prioritized sampler needs its C++ extension (``torchrl._torchrl``:
    the segment trees); ``import_library`` imports it explicitly so that a wheel
    built against another torch is reported as unavailable, not as a crash.
    """

    name = "torchrl"
    distributions = ("torchrl", "tensordict", "torch", "numpy")
    notes = "tensors via TensorDict; weights (p_i / p_min)^-beta, i.e. max over the buffer"

    def __init__(self, capacity: int, alpha: float, beta: float, seed: int) -> None:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

        torch.manual_seed(seed)
        np.random.seed(seed)  # noqa: NPY002 - the CPU sampler draws from np.random
        self._torch = torch
        self._td_cls = TensorDict
        self._buf = PrioritizedReplayBuffer(
            alpha=alpha, beta=beta, eps=1e-6, storage=LazyTensorStorage(capacity)
        )

    @classmethod
    def import_library(cls) -> None:
        importlib.import_module("torchrl")
        try:
            importlib.import_module("torchrl._torchrl")
        except ImportError as exc:
            torch = importlib.import_module("torch")
            raise ImportError(
                f"TorchRL's C++ extension torchrl._torchrl (its segment trees, needed by "
                f"PrioritizedSampler) does not load with torch {torch.__version__}: {exc}"
            ) from exc

    def native_batch(self, chunk: Chunk) -> Any:
        k = len(chunk["reward"])
        tensors = {name: self._torch.from_numpy(v) for name, v in chunk.items()}
        return self._td_cls(tensors, batch_size=[k])

    def native_rows(self, chunk: Chunk) -> list[Any]:
        td = self.native_batch(chunk)
        return [td[i] for i in range(td.batch_size[0])]

    def native_priorities(self, values: np.ndarray) -> Any:
        return self._torch.from_numpy(values)

    def add_batch(self, batch: Any) -> None:
        self._buf.extend(batch)

    def add_one(self, row: Any) -> None:
        self._buf.add(row)

    def __len__(self) -> int:
        return len(self._buf)

    def sample(self, batch_size: int) -> Sample:
        td, info = self._buf.sample(batch_size, return_info=True)
        data = {name: td[name] for name in FIELDS}
        return Sample(info["index"], info["priority_weight"], data)

    def update(self, sample: Sample, priorities: Any) -> None:
        self._buf.update_priority(sample.indices, priorities)

    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        self._buf.update_priority(
            self._torch.from_numpy(indices), self._torch.from_numpy(priorities)
        )


#: Every adapter, by name, in report order (fastper first).
ADAPTERS: dict[str, type[Adapter]] = {
    cls.name: cls for cls in (FastperAdapter, CpprbAdapter, TianshouAdapter, TorchrlAdapter)
}


def to_numpy(value: Any) -> np.ndarray:
    """A numpy copy-or-view of an array, tensor or array-like (for checks only)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)
