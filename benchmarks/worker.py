"""The measuring side of `peers.py`: one library at one capacity, in a fresh process.

`run` imports the library, times its first use, runs the correctness check,
then builds and fills a buffer of ``capacity`` (measuring the RSS it adds),
randomises every priority and times sample / update / learner step for each
batch size. It returns a JSON-able dict; `peers.py --worker` writes it to a file.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from adapters import ADAPTERS, DATA_BYTES_PER_SLOT, Adapter, make_chunk
from checks import check_adapter

FILL_BATCH = 1000  # transitions per batched add while filling
PRIME_CHUNK = 65536  # slots per update while randomising priorities before timing
N_TD = 8  # distinct |td| arrays cycled through by the timed updates


@dataclass
class Row:
    """One measurement; becomes one row of peers.csv."""

    op: str
    batch: int | None
    median_us: float | None
    p90_us: float | None
    calls: int
    extrapolated: bool = False
    bytes_per_slot: float | None = None
    notes: str = ""


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; else peak RSS).

    Freed heap memory is handed back to the OS first (glibc ``malloc_trim``, where
    available), so that what a fill path allocated and freed is not counted.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux fallback
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def time_calls(fn: Callable[[], object], calls: int, warmup: int) -> np.ndarray:
    """Microseconds of each of ``calls`` calls of ``fn``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    gc.collect()
    out = np.empty(calls)
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        fn()
        out[i] = (clock() - t0) / 1e3
    return out


def summary(op: str, batch: int | None, us: np.ndarray, notes: str = "") -> Row:
    """Median and p90 of per-call times."""
    return Row(op, batch, float(np.median(us)), float(np.percentile(us, 90)), len(us), notes=notes)


def _first_use(cls: type[Adapter], alpha: float, beta: float, seed: int) -> Adapter:
    """Build a small buffer, add, sample and update once (JIT compiles, lazy imports)."""
    ad = cls(1024, alpha, beta, seed)
    chunk = make_chunk(np.random.default_rng(seed), 256)
    if cls.batched_add:
        ad.add_batch(ad.native_batch(chunk))
    else:
        for row in ad.native_rows(chunk):
            ad.add_one(row)
    s = ad.sample(32)
    ad.update(s, ad.native_priorities(np.ones(32)))
    return ad


def _fill(
    cls: type[Adapter],
    proto: Adapter,
    capacity: int,
    alpha: float,
    beta: float,
    seed: int,
    prefix: int,
) -> tuple[Adapter, Row, float]:
    """Build and fill a buffer to ``capacity``; returns it, the fill row and RSS added."""
    rng = np.random.default_rng(seed)
    chunk = make_chunk(rng, FILL_BATCH)
    clock = time.perf_counter_ns
    # Native inputs are made before the first RSS reading and kept alive past the second.
    inputs: list[Any] = []
    if cls.batched_add:
        full = proto.native_batch(chunk)
        rem = capacity % FILL_BATCH
        last = proto.native_batch({k: v[:rem] for k, v in chunk.items()}) if rem else None
        inputs += [full, last]
        rss0 = rss_bytes()
        t0 = clock()
        ad = cls(capacity, alpha, beta, seed)
        init_ns = clock() - t0
        per_call = []
        for _ in range(capacity // FILL_BATCH):
            t0 = clock()
            ad.add_batch(full)
            per_call.append(clock() - t0)
        if last is not None:
            t0 = clock()
            ad.add_batch(last)
            per_call.append(clock() - t0)
        total_ns = init_ns + sum(per_call)
        per_tr = np.asarray(per_call[: capacity // FILL_BATCH], dtype=np.float64) / 1e3
        per_tr /= FILL_BATCH
        note = (
            f"median_us = (init + all adds) / capacity; p90_us = p90 of per-call time / "
            f"{FILL_BATCH}; init {init_ns / 1e6:.2f} ms, total {total_ns / 1e9:.2f} s"
        )
        row = Row(
            "fill",
            FILL_BATCH,
            total_ns / 1e3 / capacity,
            float(np.percentile(per_tr, 90)) if len(per_tr) else None,
            len(per_call),
            notes=note,
        )
    else:
        k = min(prefix, capacity)
        rows = proto.native_rows(make_chunk(rng, k))
        inputs.append(rows)
        gc.collect()  # before freezing: the rows (and nothing collectable) go to the frozen set
        gc.freeze()  # the prepared rows are not the library's garbage: keep them out of GC passes
        rss0 = rss_bytes()
        t0 = clock()
        ad = cls(capacity, alpha, beta, seed)
        init_ns = clock() - t0
        per_add = np.empty(k)
        for i, r in enumerate(rows):
            t0 = clock()
            ad.add_one(r)
            per_add[i] = clock() - t0
        # The first add may allocate the whole storage: count it once, extrapolate the rest.
        steady = per_add[1:].mean() if k > 1 else per_add[0]
        est_ns = float(init_ns + per_add[0] + steady * (capacity - 1))
        gc.unfreeze()
        t_rest = time.perf_counter()
        how = ad.fill_rest(lambda m: make_chunk(rng, m), capacity - k)
        rest_s = time.perf_counter() - t_rest
        note = (
            f"one transition per add: median_us = (init + first add + mean of adds 2..{k} "
            f"x (capacity - 1)) / capacity, p90_us = p90 of those {k} adds; "
            f"init {init_ns / 1e6:.2f} ms, first add {per_add[0] / 1e6:.2f} ms, estimated total "
            f"{est_ns / 1e9:.1f} s; buffer then completed with {how} in {rest_s:.1f} s"
        )
        row = Row(
            "fill",
            1,
            est_ns / 1e3 / capacity,
            float(np.percentile(per_add[1:] if k > 1 else per_add, 90)) / 1e3,
            k,
            extrapolated=k < capacity,
            notes=note,
        )
    if len(ad) != capacity:
        raise RuntimeError(f"{cls.name}: buffer holds {len(ad)} after filling {capacity}")
    added = rss_bytes() - rss0
    inputs.clear()
    return ad, row, added / capacity


def _prime(ad: Adapter, capacity: int, rng: np.random.Generator) -> None:
    """Give every slot a random priority |N(0, 1)|, so that the trees are not flat."""
    for start in range(0, capacity, PRIME_CHUNK):
        idx = np.arange(start, min(start + PRIME_CHUNK, capacity), dtype=np.int64)
        ad.set_priorities(idx, np.abs(rng.standard_normal(len(idx))))


def _time_ops(
    ad: Adapter, batches: list[int], calls: int, warmup: int, rng: np.random.Generator
) -> list[Row]:
    """Median / p90 of sample, update and learner step for each batch size."""
    rows: list[Row] = []
    turn = itertools.count()  # cycles the timed updates through N_TD |td| arrays
    for b in batches:
        tds = [ad.native_priorities(np.abs(rng.standard_normal(b))) for _ in range(N_TD)]

        def sample(b: int = b) -> None:
            ad.sample(b)

        rows.append(summary("sample", b, time_calls(sample, calls, warmup)))

        # Each timed update gets the indices of its own, fresh sample, as in
        # training: updating one batch over and over would time a tree whose
        # paths stay in cache.
        fresh = iter([ad.sample(b) for _ in range(calls + warmup)])

        def update(fresh: Any = fresh, tds: list[Any] = tds) -> None:
            ad.update(next(fresh), tds[next(turn) % N_TD])

        rows.append(summary("update", b, time_calls(update, calls, warmup)))

        def step(b: int = b, tds: list[Any] = tds) -> None:
            s = ad.sample(b)
            ad.update(s, tds[next(turn) % N_TD])

        rows.append(summary("learner_step", b, time_calls(step, calls, warmup)))
    return rows


def run(
    lib: str,
    capacity: int,
    batches: list[int],
    calls: int,
    warmup: int,
    prefix: int,
    alpha: float = 0.6,
    beta: float = 0.4,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure library ``lib`` at ``capacity``; never raises (errors go in the result)."""
    cls = ADAPTERS[lib]
    out: dict[str, Any] = {
        "lib": lib,
        "capacity": capacity,
        "available": False,
        "reason": None,
        "versions": cls.versions(),
        "adapter_notes": cls.notes,
        "data_bytes_per_slot": DATA_BYTES_PER_SLOT,
        "rows": [],
    }
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    try:
        cls.import_library()
    except BaseException as exc:  # noqa: BLE001 - any import failure means "unavailable"
        out["reason"] = f"import failed: {type(exc).__name__}: {exc}"
        return out
    import_s = time.perf_counter() - t0
    out["versions"] = cls.versions()
    t0 = time.perf_counter()
    try:
        proto = _first_use(cls, alpha, beta, seed)
    except BaseException as exc:  # noqa: BLE001
        out["reason"] = f"first use failed: {type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        return out
    first_s = time.perf_counter() - t0
    out["available"] = True
    rows = [
        Row("import", None, import_s * 1e6, None, 1, notes="import of the library, fresh process"),
        Row(
            "first_use",
            None,
            first_s * 1e6,
            None,
            1,
            notes="build 1024 slots + add 256 + sample 32 + update, right after import",
        ),
    ]
    try:
        out["check"] = check_adapter(cls, alpha, beta)
    except BaseException as exc:  # noqa: BLE001 - a crashing check is a failed check
        out["check"] = {
            "ok": False,
            "problems": [f"check raised {type(exc).__name__}: {exc}"],
            "traceback": traceback.format_exc(),
        }
    try:
        ad, fill_row, mem = _fill(cls, proto, capacity, alpha, beta, seed, prefix)
        rows.append(fill_row)
        rows.append(
            Row(
                "memory",
                None,
                None,
                None,
                1,
                bytes_per_slot=mem,
                notes="RSS added by build + fill, per slot",
            )
        )
        rng = np.random.default_rng(seed + 1)
        _prime(ad, capacity, rng)
        rows.extend(_time_ops(ad, batches, calls, warmup, rng))
        if lib == "fastper":  # in the same process, beside the step: its memory-latency floor
            import latency_floor

            probe = latency_floor.Floor(capacity)
            for b in batches:
                us = probe.time_calls(b, calls, warmup, seed)
                rows.append(summary(latency_floor.OP, b, us, probe.describe()))
            del probe
    except BaseException as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    out["rows"] = [asdict(r) for r in rows]
    out["wall_s"] = time.perf_counter() - t_start
    return out
