"""Replay on a torch device: one learner step (sample + update) of a full buffer.

Usage:
    python benchmarks/device.py [--device cuda|cpu] [--capacity N] [--batch 4096 ...]
                                [--repeats 7] [--block-s 0.1] [--threads T ...] [--quick]
                                [--out benchmarks/results/device.md]

Defaults: ``--device cuda`` when ``torch.cuda.is_available()`` (else ``cpu``),
``--capacity`` 2^24 on cuda and 2^20 on cpu, ``--batch 4096``. One command
measures every variant below in the same process, so each ratio compares
figures of one run.

Buffers. Each buffer is filled to ``--capacity`` with CartPole-like rows
(``fastper._bench.FIELDS``: obs (4,) float32, action int64, reward float32,
next_obs (4,) float32, done float32; 48 bytes a row), in chunks of 2^16 rows
(2^18 on cuda), with the same random priorities |N(0, 1)| + 0.01 given at
``add`` (TorchRL: ``extend`` then ``update_priority``). alpha 0.6, beta 0.4.

One step, the learner's replay work: ``sample(B)``, then
``update_priorities`` of those B slots with |td| errors (|N(0, 1)|, float32,
drawn before the timing: a pool of 16, used in turn; on the device for the
device variants, numpy for the reference). Variants:

1. ``fastper.device.DevicePrioritizedReplayBuffer(backend="torch", validate=False)``
   (sync-free), ``update_priorities(batch.indices, td, keys=batch.keys)``;
2. the same with ``validate=True`` (the default: checked on the device, no read-back);
   on cuda also ``graphed_step(B)`` of it (the step replayed from two CUDA graphs);
3. on the cpu device only, ``backend="numba"`` (the CPU default; ``validate=True``);
4. ``fastper.PrioritizedReplayBuffer`` (host) + ``SampleBatch.to_torch(device)``,
   update from the device td tensor brought back with ``.cpu().numpy()``
   (what a GPU user does without ``fastper.device``);
5. TorchRL: ``ReplayBuffer(storage=LazyTensorStorage(N, device=device),
   sampler=PrioritizedSampler(N, 0.6, 0.4, eps=1e-6))`` (float32 trees, its
   default), ``sample(B, return_info=True)`` + ``update_priority(info["index"], td)``;
   "not installed" / "unavailable" when it cannot run (the run goes on);
6. the reference: ``fastper.PrioritizedReplayBuffer`` alone (numba kernels,
   numpy in and out), ``sample(B)`` + ``update_priorities(indices, td, keys)``.

Timing. Per variant: a warm-up of 3 steps, then a calibration that sets the
steps per block (about ``--block-s`` seconds, 3 to 2000 steps). Then
``--repeats`` rounds, each timing every variant in turn (interleaved: the
machine's speed drifts) in three blocks: the loop step (sample + update),
``sample`` alone, and ``update`` alone (of one batch sampled before the block,
its keys still fresh: nothing is added while timing). A block is timed with
``time.perf_counter`` around all its steps; on cuda ``torch.cuda.synchronize()``
runs before reading the clock at both ends, never inside the block. Reported:
the median over rounds of each block's time per step (us), and the median over
rounds of the round's ratio loop / reference loop.

Operations: after the timing, one step of each variant runs under a
``TorchDispatchMode`` counter: the column ``torch ops / step`` is the number of
ATen operations it dispatched, views and aliases excluded (their schema
returns an alias of an input; they make metadata and launch nothing). On a GPU
each one is at least one kernel launch; the numba and numpy variants dispatch
few or none. (``tests/device/op_count.py`` applies the same rule.)

Syncs (cuda only): after the timing, 20 steps of each device variant run
under ``torch.cuda.set_sync_debug_mode("warn")``; the warnings "called a
synchronizing CUDA operation" recorded (``warnings.catch_warnings``) / 20 is the
syncs per step (the mode's one-time notice that it is a prototype is not one;
the mode is restored afterwards), and the log names the line of each. On the
cpu device: "n/a (CPU device)".

A variant that fails while warming up is left out of that batch size's timing
and reported in the table with its error (the reference must run).

``--threads T [T ...]``: ``torch.set_num_threads`` for a section of the
report each (the buffers are built once). Default: torch's own setting.

Targets: on a GPU, sample + update of 4096 at 2^24 in < 1 ms with zero
syncs (variant 1; evaluated only on cuda at that size); on the CPU device,
every device-buffer variant within 3x of the reference. Results go to
``--out`` as markdown with the machine and the exact command. ``--quick``: a
smoke run (2^12 slots, B = 64, 2 rounds, a few seconds) that writes nothing
unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastper
import fastper.device as fd
from fastper._bench import FIELDS, _batch

HERE = Path(__file__).resolve().parent
ALPHA, BETA, EPS = 0.6, 0.4, 1e-6
TD_POOL = 16
SYNC_STEPS = 20
CPU_TARGET = 3.0  # device buffer on the cpu device: within 3x of the reference
GPU_TARGET_US = 1000.0  # sample + update of 4096 at 2^24
GPU_TARGET_B, GPU_TARGET_N = 4096, 1 << 24
REF = "reference"
DEFAULT_THREADS = torch.get_num_threads()


# -- variants ---------------------------------------------------------------------------
class Variant:
    """One buffer and how a learner samples it and updates it."""

    key = ""
    label = ""
    device_side = True  # does the step hand tensors to the device (sync counting)?

    def sample(self, b: int) -> Any:
        raise NotImplementedError

    def update(self, handle: Any, td: Any) -> None:
        raise NotImplementedError


class DeviceVariant(Variant):
    """``fastper.device.DevicePrioritizedReplayBuffer``."""

    def __init__(self, key: str, label: str, buf: fd.DevicePrioritizedReplayBuffer) -> None:
        self.key, self.label, self.buf = key, label, buf

    def sample(self, b: int) -> fd.DeviceBatch:
        return self.buf.sample(b)

    def update(self, handle: fd.DeviceBatch, td: torch.Tensor) -> None:
        self.buf.update_priorities(handle.indices, td, keys=handle.keys)


class GraphedVariant(Variant):
    """``DevicePrioritizedReplayBuffer.graphed_step``: sample and update from CUDA graphs."""

    def __init__(self, key: str, label: str, buf: fd.DevicePrioritizedReplayBuffer) -> None:
        self.key, self.label, self.buf = key, label, buf
        self.steps: dict[int, fd.GraphedStep] = {}

    def _step(self, b: int) -> fd.GraphedStep:
        if b not in self.steps:
            self.steps[b] = self.buf.graphed_step(b)
        return self.steps[b]

    def sample(self, b: int) -> fd.DeviceBatch:
        return self._step(b).sample()

    def update(self, handle: fd.DeviceBatch, td: torch.Tensor) -> None:
        self._step(len(handle)).update(td)


class HostVariant(Variant):
    """``fastper.PrioritizedReplayBuffer``: numpy only (the reference) or via ``to_torch``."""

    def __init__(
        self,
        key: str,
        label: str,
        buf: fastper.PrioritizedReplayBuffer,
        device: torch.device | None,
    ) -> None:
        self.key, self.label, self.buf, self.device = key, label, buf, device
        self.device_side = device is not None

    def sample(self, b: int) -> tuple[Any, Any]:
        s = self.buf.sample(b)
        return s, (s.to_torch(self.device) if self.device is not None else None)

    def update(self, handle: tuple[Any, Any], td: Any) -> None:
        s, _ = handle
        if self.device is not None:
            td = td.cpu().numpy()
        self.buf.update_priorities(s.indices, td, keys=s.keys)


class TorchrlVariant(Variant):
    """TorchRL's ``ReplayBuffer`` over a ``LazyTensorStorage`` with a ``PrioritizedSampler``."""

    key = "torchrl"

    def __init__(self, rb: Any, version: str) -> None:
        self.rb = rb
        self.label = f"TorchRL {version}: LazyTensorStorage + PrioritizedSampler"

    def sample(self, b: int) -> Any:
        return self.rb.sample(b, return_info=True)

    def update(self, handle: Any, td: torch.Tensor) -> None:
        self.rb.update_priority(handle[1]["index"], td)


# -- building ---------------------------------------------------------------------------
@dataclass
class Setup:
    device: torch.device
    capacity: int
    chunk: int
    rows: dict[str, np.ndarray]  # one chunk of host rows, reused for every chunk
    priorities: np.ndarray  # float64, one per slot

    def device_rows(self) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v).to(self.device) for k, v in self.rows.items()}

    def spans(self) -> list[tuple[int, int]]:
        return [
            (lo, min(self.chunk, self.capacity - lo)) for lo in range(0, self.capacity, self.chunk)
        ]


def make_setup(device: torch.device, capacity: int) -> Setup:
    rng = np.random.default_rng(0)
    chunk = min(capacity, 1 << (18 if device.type == "cuda" else 16))
    pri = np.abs(rng.standard_normal(capacity)) + 0.01
    return Setup(device, capacity, chunk, _batch(rng, chunk), pri)


def fill_device(setup: Setup, backend: str, validate: bool) -> fd.DevicePrioritizedReplayBuffer:
    buf = fd.DevicePrioritizedReplayBuffer(
        setup.capacity, FIELDS, device=setup.device, alpha=ALPHA, beta=BETA, eps=EPS,
        seed=0, validate=validate, backend=backend,
    )  # fmt: skip
    rows = setup.device_rows()
    for lo, k in setup.spans():
        part = rows if k == setup.chunk else {n: t[:k] for n, t in rows.items()}
        buf.add(part, priorities=setup.priorities[lo : lo + k])
    return buf


def fill_host(setup: Setup) -> fastper.PrioritizedReplayBuffer:
    buf = fastper.PrioritizedReplayBuffer(
        setup.capacity, FIELDS, alpha=ALPHA, beta=BETA, eps=EPS, seed=0
    )
    for lo, k in setup.spans():
        part = setup.rows if k == setup.chunk else {n: a[:k] for n, a in setup.rows.items()}
        buf.add(part, priorities=setup.priorities[lo : lo + k])
    return buf


def torchrl_status() -> tuple[str | None, str]:
    """(TorchRL version or None, why it cannot run: "" when it can)."""
    try:
        torchrl = importlib.import_module("torchrl")
        importlib.import_module("tensordict")
    except ImportError as exc:
        return None, f"not installed ({exc})"
    except Exception as exc:  # a broken install must not stop the run
        return None, f"unavailable: import failed: {type(exc).__name__}: {exc}"[:300]
    version = str(getattr(torchrl, "__version__", "?"))
    try:  # its segment trees: a wheel built for another torch fails here
        importlib.import_module("torchrl._torchrl")
    except Exception as exc:
        msg = re.sub(r"\S*/", "", str(exc))  # no directories
        return version, (
            f"unavailable: its C++ extension torchrl._torchrl (the segment trees of "
            f"PrioritizedSampler) does not load with torch {torch.__version__} "
            f"({type(exc).__name__}: {msg[:90]}{'...' if len(msg) > 90 else ''})"
        )
    return version, ""


def fill_torchrl(setup: Setup, version: str) -> TorchrlVariant:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    dev, n = setup.device, setup.capacity
    np.random.seed(0)  # noqa: NPY002 - TorchRL's CPU sampler draws from np.random
    rb = ReplayBuffer(
        storage=LazyTensorStorage(n, device=dev),
        sampler=PrioritizedSampler(n, ALPHA, BETA, eps=EPS),
    )
    rows = setup.device_rows()
    for lo, k in setup.spans():
        part = TensorDict({name: t[:k] for name, t in rows.items()}, batch_size=[k], device=dev)
        index = rb.extend(part)
        # its trees are float32 and refuse float64 priorities
        pri = torch.from_numpy(setup.priorities[lo : lo + k]).to(dev, torch.float32)
        rb.update_priority(index, pri)
    return TorchrlVariant(rb, version)


def build(setup: Setup, notes: dict[str, str]) -> list[Variant]:
    """Every variant, filled; a variant that cannot run is left out with a note."""
    dev = setup.device
    variants: list[Variant] = []
    specs = [("torch_nv", "torch", False), ("torch_v", "torch", True)]
    if dev.type == "cpu":
        specs.append(("numba", "numba", True))
    for key, backend, validate in specs:
        t0 = time.perf_counter()
        buf = fill_device(setup, backend, validate)
        variants.append(DeviceVariant(
            key, f"fastper.device, backend={backend}, validate={validate}", buf
        ))  # fmt: skip
        print(f"  filled {key} in {time.perf_counter() - t0:.1f} s", flush=True)
        if dev.type == "cuda" and key == "torch_v":
            graphed = fill_device(setup, backend, validate)
            variants.append(GraphedVariant(
                "graphed", "fastper.device, backend=torch, validate=True, graphed_step", graphed
            ))  # fmt: skip
    t0 = time.perf_counter()
    host = fill_host(setup)
    print(f"  filled the host buffer in {time.perf_counter() - t0:.1f} s", flush=True)
    variants.append(HostVariant(
        "to_torch", f"fastper CPU buffer + to_torch({dev.type}), td .cpu().numpy()", host, dev
    ))  # fmt: skip
    version, why = torchrl_status()
    if why:
        notes["torchrl"] = why if version is None else f"TorchRL {version}: {why}"
    else:
        assert version is not None
        try:
            t0 = time.perf_counter()
            variants.append(fill_torchrl(setup, version))
            print(f"  filled torchrl in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:  # a peer failing must not stop the run
            notes["torchrl"] = f"TorchRL {version}: failed: {type(exc).__name__}: {exc}"[:300]
    variants.append(HostVariant(REF, "fastper CPU buffer, numpy (reference)", host, None))
    return variants


# -- timing -----------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Pools:
    device: list[torch.Tensor]
    host: list[np.ndarray]

    def for_variant(self, v: Variant) -> list[Any]:
        return self.device if v.device_side else self.host


def make_pools(device: torch.device, b: int) -> Pools:
    gen = torch.Generator().manual_seed(1)
    host = [torch.randn(b, generator=gen).abs() for _ in range(TD_POOL)]
    return Pools([t.to(device) for t in host], [t.numpy() for t in host])


def _block(fn: Callable[[int], None], steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` calls of ``fn(i)``, synchronised at both ends only."""
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        fn(i)
    _sync(device)
    return (time.perf_counter() - t0) / steps


def blocks(v: Variant, b: int, tds: list[Any]) -> dict[str, Callable[[int], None]]:
    """The three timed blocks of a variant: loop (sample + update), sample, update."""
    held = v.sample(b)  # the batch the update-only block updates again and again
    n = len(tds)
    return {
        "loop": lambda i: v.update(v.sample(b), tds[i % n]),
        "sample": lambda i: v.sample(b),
        "update": lambda i: v.update(held, tds[i % n]),
    }


def count_syncs(v: Variant, b: int, tds: list[Any]) -> float:
    """Synchronising CUDA operations per step (``set_sync_debug_mode("warn")``)."""
    v.update(v.sample(b), tds[0])  # allocator and caches warm
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(SYNC_STEPS):
                v.update(v.sample(b), tds[i % len(tds)])
        finally:
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    syncs = [w for w in seen if "called a synchronizing" in str(w.message)]  # not its notice
    for w in syncs:  # where each one came from, in the log
        print(f"    sync in {v.key}: {w.filename}:{w.lineno}: {str(w.message)[:120]}", flush=True)
    return len(syncs) / SYNC_STEPS


class _OpCounter(TorchDispatchMode):
    """Non-view ATen operations dispatched inside the block (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        view = getattr(func, "is_view", False) or any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        self.count += not view
        return func(*args, **(kwargs or {}))


def count_ops(v: Variant, b: int, tds: list[Any]) -> int:
    """Torch operations of one step (sample + update) of a warm variant."""
    v.update(v.sample(b), tds[0])
    with _OpCounter() as counter:
        v.update(v.sample(b), tds[1 % len(tds)])
    return counter.count


@dataclass
class Result:
    key: str
    label: str
    us: dict[str, float] = field(default_factory=dict)  # loop / sample / update
    ratio: float = math.nan
    ratio_range: tuple[float, float] = (math.nan, math.nan)
    syncs: float | None = None
    steps: int = 0
    ops: int | None = None


def measure(
    variants: list[Variant], b: int, repeats: int, block_s: float, device: torch.device,
    failed: dict[str, str],
) -> list[Result]:  # fmt: skip
    pools = make_pools(device, b)
    plans: dict[str, tuple[dict[str, Callable[[int], None]], int]] = {}
    for v in list(variants):
        tds = pools.for_variant(v)
        try:
            fns = blocks(v, b, tds)
            for i in range(3):
                fns["loop"](i)
            per_step = _block(fns["loop"], 3, device)
        except Exception as exc:  # reported in the table; the other variants go on
            if v.key == REF:
                raise
            failed[v.label] = f"failed at B = {b}: {type(exc).__name__}: {exc}"[:300]
            print(f"  {v.label}: {failed[v.label]}", flush=True)
            variants = [w for w in variants if w is not v]
            continue
        steps = int(min(2000, max(3, math.ceil(block_s / max(per_step, 1e-9)))))
        plans[v.key] = (fns, steps)
    times: dict[str, dict[str, list[float]]] = {
        v.key: {"loop": [], "sample": [], "update": []} for v in variants
    }
    for r in range(repeats):
        for v in variants:
            fns, steps = plans[v.key]
            for name in ("loop", "sample", "update"):
                times[v.key][name].append(_block(fns[name], steps, device))
        ref = times[REF]["loop"][-1] * 1e6
        line = ", ".join(f"{v.key} {times[v.key]['loop'][-1] * 1e6:.0f}" for v in variants)
        print(f"    round {r + 1}/{repeats} (us/step, ref {ref:.0f}): {line}", flush=True)
    ref_loop = np.asarray(times[REF]["loop"])
    results = []
    for v in variants:
        t = times[v.key]
        ratios = np.asarray(t["loop"]) / ref_loop
        res = Result(v.key, v.label, steps=plans[v.key][1])
        res.us = {name: float(np.median(t[name])) * 1e6 for name in t}
        res.ratio = float(np.median(ratios))
        res.ratio_range = (float(ratios.min()), float(ratios.max()))
        if device.type == "cuda" and v.device_side:
            res.syncs = count_syncs(v, b, pools.for_variant(v))
        res.ops = count_ops(v, b, pools.for_variant(v))
        results.append(res)
    return results


# -- report -----------------------------------------------------------------------------
def _log2(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def _loadavg() -> str:
    try:
        return ", ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
            f"driver-visible devices {torch.cuda.device_count()})"
        )
    return "the CPU device (torch tensors in host memory)"


def _versions() -> str:
    import numba

    parts = [f"fastper {fastper.__version__}", f"torch {torch.__version__}",
             f"numpy {np.__version__}", f"numba {numba.__version__}",
             f"Python {platform.python_version()}"]  # fmt: skip
    omp = {k: os.environ.get(k, "unset") for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    backend = [
        line.split(":", 1)[1].strip()
        for line in torch.__config__.parallel_info().splitlines()
        if line.startswith("ATen parallel backend")
    ]
    parts.append(
        f"torch intra-op threads by default {DEFAULT_THREADS} (parallel backend "
        f"{backend[0] if backend else '?'}; " + ", ".join(f"{k}={v}" for k, v in omp.items()) + ")"
    )
    return ", ".join(parts)


@dataclass
class Section:
    batch: int
    threads: int
    results: list[Result]
    failed: dict[str, str] = field(default_factory=dict)  # variant label -> its error


def _syncs_cell(r: Result, device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU device)"
    if r.syncs is None:
        return "n/a (host)"
    return f"{r.syncs:g}"


def table(sec: Section, device: torch.device, notes: dict[str, str]) -> list[str]:
    lines = [
        "| variant | sample + update us | ratio vs reference [range] | sample us | update us "
        "| syncs / step | torch ops / step | steps / block |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sec.results:
        ratio = (
            "1 (reference)"
            if r.key == REF
            else f"{r.ratio:.2f} [{r.ratio_range[0]:.2f}, {r.ratio_range[1]:.2f}]"
        )
        lines.append(
            f"| {r.label} | {r.us['loop']:,.0f} | {ratio} | {r.us['sample']:,.0f} "
            f"| {r.us['update']:,.0f} | {_syncs_cell(r, device)} | {r.ops} | {r.steps} |"
        )
    if "torchrl" in notes:
        lines.append(f"| TorchRL | {notes['torchrl']} | - | - | - | - | - | - |")
    for label, why in sec.failed.items():
        lines.append(f"| {label} | {why} | - | - | - | - | - | - |")
    return lines


def targets(sections: list[Section], device: torch.device, capacity: int) -> list[str]:
    out = ["## Targets", ""]
    gpu = "- GPU: sample + update of 4096 at 2^24 in < 1 ms, zero syncs"
    at_target = [s for s in sections if s.batch == GPU_TARGET_B]
    if device.type != "cuda":
        out.append(gpu + " (backend=torch): not evaluated (needs a cuda device).")
    elif capacity != GPU_TARGET_N or not at_target:
        out.append(gpu + f" (backend=torch): not evaluated (this run: N = {_log2(capacity)}, "
                   f"B = {[s.batch for s in sections]}; needs N = 2^24, B = 4096).")  # fmt: skip
    for s in at_target if device.type == "cuda" and capacity == GPU_TARGET_N else []:
        for key, what in (("torch_nv", "backend=torch, validate=False, eager"),
                          ("graphed", "`graphed_step(4096)`, validate=True")):  # fmt: skip
            r = next((r for r in s.results if r.key == key), None)
            head = f"{gpu} ({what}): "
            if r is None:
                out.append(head + "not measured (the variant failed: see the table).")
                continue
            ok = r.us["loop"] < GPU_TARGET_US and r.syncs == 0
            out.append(
                head + f"{r.us['loop']:,.0f} us, {r.syncs:g} syncs / step "
                f"(threads {s.threads}): **{'PASS' if ok else 'FAIL'}**."
            )
    fields = len(FIELDS)
    for batch in dict.fromkeys(s.batch for s in sections):  # once per batch size
        ops = [
            r.ops for s in sections if s.batch == batch for r in s.results
            if r.key in ("torch_nv", "torch_v")
        ]  # fmt: skip
        if not ops:
            out.append(f"- torch back end, B = {batch}: not measured (its variants failed).")
            continue
        out.append(
            f"- torch back end, B = {batch}: {max(ops)} torch operations per step (sample + "
            f"update, {fields} fields gathered at once), the same at any capacity; 2 more while "
            "the last block of 64 slots is partly written. Budget: 40 at B = 256, tested "
            "over capacities, fills and fields (tests/device/test_op_count.py)."
        )
    cpu = "- CPU device: sample + update of the device buffer within 3x of the numba CPU buffer"
    if device.type != "cpu":
        out.append(cpu + ": not evaluated (needs the cpu device).")
        return out
    out.append(cpu + " (ratio: median over rounds of variant / reference):")
    for s in sections:
        cells = []
        for r in s.results:
            if r.key in ("torch_nv", "torch_v", "numba"):
                ok = r.ratio <= CPU_TARGET
                cells.append(f"{r.label.removeprefix('fastper.device, ')} {r.ratio:.2f}x "
                             f"**{'PASS' if ok else 'FAIL'}**")  # fmt: skip
        out.append(f"  - B = {s.batch}, torch threads {s.threads}: " + "; ".join(cells) + ".")
    return out


def report(
    sections: list[Section], args: argparse.Namespace, notes: dict[str, str],
    command: str, seconds: float, load_before: str,
) -> str:  # fmt: skip
    from fastper._bench import cpu_name

    dev = args.device
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Replay on a torch device: sample + update",
        "",
        f"`{command}` on {when} ({seconds:.0f} s in all).",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (`os.cpu_count()`), "
        f"{platform.machine()}; device: {_device_name(dev)}; {_versions()}. "
        f"Load average before the run: {load_before}; after: {_loadavg()}.",
        "",
        f"Buffers: capacity {args.capacity:,} ({_log2(args.capacity)}), full, CartPole-like "
        "rows (`fastper._bench.FIELDS`, 48 bytes a row), priorities |N(0, 1)| + 0.01 given "
        "at the fill, alpha 0.6, beta 0.4, eps 1e-6. One step: `sample(B)` + "
        "`update_priorities` of those B slots with |N(0, 1)| td errors (float32; on the "
        "device for the device-side variants). Each figure: the median over "
        f"{args.repeats} interleaved rounds of one block's time per step (us); ratio: the "
        "median over rounds of the round's variant / reference loop, its range in "
        "brackets. `sample us` / `update us`: blocks of `sample` alone and of `update` "
        "alone (of one batch, again and again). The reference is fastper's CPU buffer "
        "(`fastper.PrioritizedReplayBuffer`, numba kernels) with numpy in and out. "
        "`torch threads`: `torch.set_num_threads` for that section (torch's intra-op "
        "pool, used by the tensor operations of the device buffers, `to_torch` and TorchRL; "
        "not by the numba kernels, nor by the reference). "
        "See the docstring of `benchmarks/device.py` for exactly what is timed.",
    ]
    for s in sections:
        lines += ["", f"## B = {s.batch}, torch threads = {s.threads}", ""]
        lines += table(s, dev, notes)
    lines += ["", *targets(sections, dev, args.capacity)]
    return "\n".join(lines) + "\n"


# -- main -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--capacity", type=int, default=None, help="default 2^24 on cuda, 2^20 on cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[4096])
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--block-s", type=float, default=0.1, help="target seconds per timed block")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="torch.set_num_threads, one report section each (default: torch's)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a small smoke run; writes no file")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    if args.quick:
        args.capacity = args.capacity or 1 << 12
        args.batch, args.repeats, args.block_s = [64], 2, 0.01
    elif args.out is None:
        args.out = HERE / "results" / "device.md"
    if args.capacity is None:
        args.capacity = 1 << 24 if args.device.type == "cuda" else 1 << 20
    threads = args.threads or [torch.get_num_threads()]
    command = "python benchmarks/device.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_before = _loadavg()
    torch.manual_seed(0)
    t_start = time.perf_counter()
    print(f"device {args.device}, N = {_log2(args.capacity)}, B = {args.batch}, "
          f"threads {threads}: filling", flush=True)  # fmt: skip
    notes: dict[str, str] = {}
    variants = build(make_setup(args.device, args.capacity), notes)
    if notes:
        print(f"  {notes}", flush=True)
    sections = []
    for t in threads:
        torch.set_num_threads(t)
        for b in args.batch:
            print(f"  B = {b}, torch threads {t}", flush=True)
            failed: dict[str, str] = {}
            results = measure(variants, b, args.repeats, args.block_s, args.device, failed)
            sections.append(Section(b, t, results, failed))
    del variants
    gc.collect()
    text = report(sections, args, notes, command, time.perf_counter() - t_start, load_before)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
