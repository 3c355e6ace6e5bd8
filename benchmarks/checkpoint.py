"""Checkpoints that do not stop the world (item 12) and loads in one pass (item 13).

Usage:
    python benchmarks/checkpoint.py [--capacity 4194304] [--saves 3] [--quick]
                                    [--dir DIR] [--out benchmarks/results/checkpoint.md]

(a) Adds during saves. A proportional buffer of ``--capacity`` CartPole-like
transitions (``fastper._bench.FIELDS``), filled with batches of 65536 given
``priorities=``. An *actor* thread loops ``add`` (one transition per call,
then in a second run batches of 16) and times every call with
``time.perf_counter``, while the main thread calls ``save`` ``--saves``
times, 0.2 s apart. Reported: the latency of the adds that overlapped a save
(max, p99, median), the same over the adds between saves (the actor with the
machine to itself, as a floor), the save durations and the file size. As a
reference in the same run, each variant again with the buffer's lock held
around the whole ``save`` (a wrapper in this script: ``with buf._lock:
buf.save(path)``; the lock is re-entrant, so the save runs unchanged inside),
which is what ``save`` did before (lock held for write + hash + fsync).
To tell where a long add comes from, the run also records how long the save
held the lock (its snapshot, ``_state_dict``; each chunk of rows,
``_SaveGuard.read``: wrappers that call them unchanged) and Python's full
garbage collections (``gc.callbacks``).

(b) Load memory, time and read passes. In a fresh interpreter
(``subprocess.run([sys.executable, "-c", ...])``): numpy and fastper
imported, ``/proc/self/clear_refs`` reset with ``5`` (the peak, VmHWM, then
restarts from the current RSS; if that fails, the peak is ``ru_maxrss``),
then ``fastper.load(path)``. Reported against the file size: the peak RSS
increase during the load (VmHWM after - VmRSS before), the RSS increase that
stays (the loaded buffer), and the bytes the process read (``rchar`` of
``/proc/self/io``, which counts every read call, from the page cache or not):
1.0 means the file was read once. Linux only.

Results go to ``--out`` as a markdown table with the machine and the command.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import fastper
from fastper._bench import FIELDS  # the CartPole-like workload of `fastper bench`
from fastper.buffer_state import _SaveGuard

FILL_BATCH = 65536
REPO = Path(__file__).resolve().parents[1]


def make_buffer(capacity: int, seed: int = 0) -> fastper.PrioritizedReplayBuffer:
    """A proportional buffer filled to ``capacity`` with random rows and priorities."""
    rng = np.random.default_rng(seed)
    buf = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=0.6, beta=0.4, seed=seed)
    done = 0
    while done < capacity:
        k = min(FILL_BATCH, capacity - done)
        batch = {
            "obs": rng.standard_normal((k, 4), dtype=np.float32),
            "action": rng.integers(0, 2, k),
            "reward": rng.standard_normal(k, dtype=np.float32),
            "next_obs": rng.standard_normal((k, 4), dtype=np.float32),
            "done": (rng.random(k) < 0.01).astype(np.float32),
        }
        buf.add(batch, priorities=rng.random(k) + 0.05)
        done += k
    return buf


def transition(k: int) -> dict[str, np.ndarray | float | int]:
    """What the actor adds: one transition (k=0) or a batch of k."""
    if k == 0:
        return {"obs": np.ones(4, np.float32), "action": 1, "reward": 1.0,
                "next_obs": np.ones(4, np.float32), "done": 0.0}  # fmt: skip
    return {
        "obs": np.ones((k, 4), np.float32),
        "action": np.ones(k, np.int64),
        "reward": np.ones(k, np.float32),
        "next_obs": np.ones((k, 4), np.float32),
        "done": np.zeros(k, np.float32),
    }


def save_whole_lock(buf: fastper.PrioritizedReplayBuffer, path: Path) -> None:
    """The old behaviour: the buffer's lock held for the whole save."""
    with buf._lock:
        buf.save(path)


def _stats_ms(lat: np.ndarray) -> dict[str, float]:
    if lat.size == 0:
        return {"n": 0, "max": float("nan"), "p99": float("nan"), "median": float("nan")}
    ms = lat * 1e3
    return {
        "n": int(ms.size),
        "max": float(ms.max()),
        "p99": float(np.percentile(ms, 99)),
        "median": float(np.median(ms)),
    }


class _Probes:
    """What a run records besides add latencies: GC pauses, and how long the save held the lock.

    The lock holds are timed by wrappers that call the originals unchanged:
    ``buf._state_dict`` (the snapshot, taken under the lock) and
    ``_SaveGuard.read`` (one chunk of rows, called under the lock).
    """

    def __init__(self, buf: fastper.PrioritizedReplayBuffer) -> None:
        self.buf = buf
        self.gc: list[tuple[float, float, int]] = []
        self.snapshot: list[float] = []
        self.chunks: list[float] = []
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc.append((self._gc_start, time.perf_counter(), info["generation"]))

    def __enter__(self) -> _Probes:
        buf, orig_state = self.buf, self.buf._state_dict
        orig_read = _SaveGuard.read
        snapshot, chunks = self.snapshot, self.chunks

        def state_dict(*a: Any, **kw: Any) -> object:
            t0 = time.perf_counter()
            out = orig_state(*a, **kw)
            snapshot.append(time.perf_counter() - t0)
            return out

        def read(guard: _SaveGuard, *a: object) -> np.ndarray:
            t0 = time.perf_counter()
            out = orig_read(guard, *a)
            chunks.append(time.perf_counter() - t0)
            return out

        buf._state_dict = state_dict  # type: ignore[method-assign]
        self._orig_read = orig_read
        _SaveGuard.read = read  # type: ignore[method-assign]
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)
        _SaveGuard.read = self._orig_read  # type: ignore[method-assign]
        del self.buf._state_dict


def run_saves(
    buf: fastper.PrioritizedReplayBuffer, path: Path, batch: int, saves: int, whole_lock: bool
) -> dict[str, object]:
    """The actor adds in a loop while the main thread saves ``saves`` times."""
    tr = transition(batch)
    stop = threading.Event()
    starts: list[float] = []
    lats: list[float] = []

    def actor() -> None:
        add, clock = buf.add, time.perf_counter
        while not stop.is_set():
            t0 = clock()
            add(tr)
            t1 = clock()
            starts.append(t0)
            lats.append(t1 - t0)

    save = save_whole_lock if whole_lock else type(buf).save
    windows = []
    with _Probes(buf) as probes:
        th = threading.Thread(target=actor, daemon=True)
        th.start()
        time.sleep(0.2)
        for _ in range(saves):
            t0 = time.perf_counter()
            save(buf, path)
            t1 = time.perf_counter()
            windows.append((t0, t1))
            time.sleep(0.2)
        stop.set()
        th.join()
    s = np.asarray(starts)
    lat = np.asarray(lats)
    during = np.zeros(s.shape[0], dtype=bool)
    for t0, t1 in windows:
        during |= (s < t1) & (s + lat > t0)  # the add overlapped this save
    in_gc = np.zeros(s.shape[0], dtype=bool)
    for g0, g1, gen in probes.gc:
        if gen == 2:
            in_gc |= (s < g1) & (s + lat > g0)
    gc2 = [g1 - g0 for g0, g1, gen in probes.gc if gen == 2]
    return {
        "during": _stats_ms(lat[during]),
        "during_no_gc": _stats_ms(lat[during & ~in_gc]),
        "between": _stats_ms(lat[~during]),
        "saves_s": [t1 - t0 for t0, t1 in windows],
        "snapshot_ms": 1e3 * max(probes.snapshot, default=float("nan")),
        "chunk_ms": 1e3 * max(probes.chunks, default=float("nan")),
        "chunks": len(probes.chunks) // max(1, saves),
        "gc2": (len(gc2), 1e3 * max(gc2, default=0.0)),
        "file_bytes": path.stat().st_size,
        "whole_lock": whole_lock,
    }


_LOAD_PROBE = r"""
import json, os, resource, sys, time
import numpy as np
import fastper

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

def rchar():
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")

path, warmup = sys.argv[1], sys.argv[2]
if warmup:  # numba kernels loaded, lazy imports done: what follows is the load itself
    fastper.load(warmup).sample(4)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    how = "VmHWM after clear_refs"
except OSError:
    how = "ru_maxrss"
rss0 = status("VmRSS")
peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
r0 = rchar()
t0 = time.perf_counter()
buf = fastper.load(path)
t1 = time.perf_counter()
r1 = rchar()
if how == "ru_maxrss":
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if peak <= peak0:  # the load never went above what the process reached before
        peak = rss0
else:
    peak = status("VmHWM")
print(json.dumps({"how": how, "rss_before": rss0, "peak": peak, "rss_after": status("VmRSS"),
                  "rchar": r1 - r0, "load_s": t1 - t0, "len": len(buf),
                  "buffer_bytes": sum(buf.nbytes().values())}))
"""


def measure_load(path: Path, warmup: Path | None) -> dict[str, float]:
    """Peak and final RSS increase, bytes read and time of ``fastper.load`` in a fresh process.

    ``warmup``: a small checkpoint loaded (and sampled) first, so that compiling
    or loading the numba kernels and lazy imports are not counted.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, str(path), "" if warmup is None else str(warmup)],
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    res = json.loads(out.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    res["file_bytes"] = size
    res["warm"] = warmup is not None
    res["peak_ratio"] = (res["peak"] - res["rss_before"]) / size
    res["after_ratio"] = (res["rss_after"] - res["rss_before"]) / size
    res["read_ratio"] = res["rchar"] / size
    res["peak_over_buffer"] = (res["peak"] - res["rss_before"]) / res["buffer_bytes"]
    return res


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fmt(x: float) -> str:
    return f"{x:,.2f}" if x < 100 else f"{x:,.0f}"


def render(args: argparse.Namespace, saves: dict, loads: list[dict], total_s: float) -> str:
    cmd = "python benchmarks/checkpoint.py " + " ".join(sys.argv[1:])
    try:
        load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        load_avg = "n/a"
    lines = [
        "# Checkpoints: adds during a save, load memory",
        "",
        f"`{cmd.strip()}` on {datetime.date.today().isoformat()}: {os.cpu_count()} cores "
        f"(`nproc`), {platform.machine()}, python {platform.python_version()}, "
        f"numpy {np.__version__}, fastper {fastper.__version__}; load average before the run "
        f"{load_avg}; {total_s:.0f} s in all.",
        "",
        f"Buffer: PrioritizedReplayBuffer, capacity {args.capacity:,} (full), fields of "
        "`fastper._bench.FIELDS` (CartPole-like: 48 bytes a row in the file, plus 8 of "
        "priority); "
        f"file {_mib(saves['file_bytes'])}; written to `{args.dir or tempfile.gettempdir()}`.",
        "",
        "## Adds while the buffer is being saved",
        "",
        f"An actor thread loops `add` while the main thread calls `save` {args.saves} times. "
        "Latency of each `add` call (time.perf_counter around it), over the calls that "
        "overlapped a save; `between saves`: the other calls (the same thread, no save running).",
        "",
        "| save | add | adds during saves | max ms | p99 ms | median ms "
        "| max ms, adds clear of a GC pause | between saves: max / median ms "
        "| save held the lock: snapshot / longest chunk ms | gen-2 GCs (longest ms) "
        "| save durations s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (label, batch), r in saves["runs"].items():
        d, c, b = r["during"], r["during_no_gc"], r["between"]
        held = "whole save" if r["whole_lock"] else f"{r['snapshot_ms']:.1f} / {r['chunk_ms']:.1f}"
        n_gc, gc_ms = r["gc2"]
        lines.append(
            f"| {label} | {'1 transition' if batch == 0 else f'batch of {batch}'} | {d['n']:,} | "
            f"{_fmt(d['max'])} | {_fmt(d['p99'])} | {d['median']:.3f} | {_fmt(c['max'])} | "
            f"{_fmt(b['max'])} / {b['median']:.3f} | {held} | {n_gc} ({gc_ms:.0f}) | "
            f"{', '.join(f'{s:.2f}' for s in r['saves_s'])} |"
        )
    lines += [
        "",
        "`lock held for the whole save (old behaviour)` is `with buf._lock: buf.save(path)` "
        "(a wrapper in this script): what `save` did before, when it held the lock for the "
        "write, the hashing and the fsync. `save held the lock`: the longest snapshot "
        "(`_state_dict`, which copies the priorities) and the longest chunk of rows "
        "(`_SaveGuard.read`), timed by wrappers around them. `gen-2 GCs`: full collections "
        "of Python's cyclic garbage collector during the run (`gc.callbacks`); an add that "
        "overlaps one waits for it whatever the save does, hence the column without them.",
        "",
        "## Load: memory, read passes, time",
        "",
        "`fastper.load(path)` in a fresh interpreter (numpy and fastper imported first); "
        "peak: VmHWM after resetting it (`/proc/self/clear_refs`), minus VmRSS before; "
        "read: `rchar` of `/proc/self/io` (bytes returned by read calls, page cache or not). "
        "Warm: the process first loads and samples a 1024-slot checkpoint, so the numba "
        "kernels are loaded and lazy imports done before the measured load; cold: the "
        "measured load is the process's first (kernels and modules are read then too).",
        "",
        "| process | file | peak RSS increase / file | RSS increase kept / file "
        "| peak RSS increase / buffer's nbytes | bytes read / file | load s | peak measured by |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in loads:
        kind = "warm (a 1024-slot file loaded first)" if r["warm"] else "cold (first load)"
        lines.append(
            f"| {kind} | {_mib(r['file_bytes'])} | {r['peak_ratio']:.3f} | "
            f"{r['after_ratio']:.3f} | {r['peak_over_buffer']:.3f} | {r['read_ratio']:.4f} | {r['load_s']:.2f} | {r['how']} |"
        )
    new = [r for (label, _), r in saves["runs"].items() if not r["whole_lock"]]
    worst = max(r["during"]["max"] for r in new)
    snap = max(r["snapshot_ms"] for r in new)
    chunk = max(r["chunk_ms"] for r in new)
    warm = [r for r in loads if r["warm"]] or loads
    peak = max(r["peak_ratio"] for r in warm)
    floor = max(r["buffer_bytes"] / r["file_bytes"] for r in warm)
    read = max(r["read_ratio"] for r in warm)
    lines += [
        "",
        "Targets: max add latency during a save of a 2^22 buffer <= 50 ms; "
        "load peak RSS <= 1.2x the file size, the file read once.",
        "",
        f"This run: max add latency during the new saves {worst:.1f} ms "
        f"({'met' if worst <= 50 else 'missed'}; the save held the lock up to {snap:.1f} ms "
        f"for its snapshot and {chunk:.1f} ms for a chunk of rows). Load (warm): peak RSS "
        f"increase {peak:.3f}x the file ({'met' if peak <= 1.2 else 'missed'}), where the "
        f"loaded buffer's own nbytes are {floor:.3f}x the file; {read:.4f}x the file read.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, default=2**22)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--loads", type=int, default=2, help="warm fresh-process loads (plus 1 cold)")
    p.add_argument("--dir", default=None, help="folder for the checkpoint (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/checkpoint.md"))
    p.add_argument("--quick", action="store_true", help="2^16 slots, 1 save, 1 load, no file")
    args = p.parse_args()
    if args.quick:
        args.capacity, args.saves, args.loads = 2**16, 1, 1
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "buffer.fpk"
        t0 = time.perf_counter()
        buf = make_buffer(args.capacity)
        print(f"filled {args.capacity:,} slots in {time.perf_counter() - t0:.1f} s", flush=True)
        runs = {}
        for label, whole in (
            ("snapshot + chunks (new)", False),
            ("lock held for the whole save (old behaviour)", True),
        ):
            for batch in (0, 16):
                r = run_saves(buf, path, batch, args.saves, whole)
                runs[(label, batch)] = r
                d = r["during"]
                print(
                    f"{label:46s} batch={batch:2d}: adds during saves {d['n']:7d}  "
                    f"max {d['max']:9.2f} ms (clear of GC {r['during_no_gc']['max']:.2f})  "
                    f"p99 {d['p99']:8.3f} ms  median {d['median']:.3f} ms  "
                    f"snapshot {r['snapshot_ms']:.1f} ms  chunk {r['chunk_ms']:.1f} ms  "
                    f"gc2 {r['gc2']}  saves {', '.join(f'{s:.2f}' for s in r['saves_s'])} s",
                    flush=True,
                )
        file_bytes = path.stat().st_size
        del buf  # the child process loads the last file written
        warm = Path(tmp) / "warmup.fpk"
        make_buffer(1024).save(warm)
        loads = []
        for i in range(args.loads + 1):
            r = measure_load(path, None if i == args.loads else warm)
            loads.append(r)
            print(
                f"load ({'warm' if r['warm'] else 'cold'}): peak +{r['peak_ratio']:.3f}x file, "
                f"kept +{r['after_ratio']:.3f}x, read {r['read_ratio']:.4f}x, "
                f"{r['load_s']:.2f} s ({r['how']})",
                flush=True,
            )
    text = render(args, {"runs": runs, "file_bytes": file_bytes}, loads,
                  time.perf_counter() - t_start)  # fmt: skip
    if args.quick:
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
