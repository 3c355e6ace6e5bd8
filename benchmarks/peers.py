"""Peer comparison: fastper vs cpprb, Tianshou and TorchRL prioritized replay.

Usage:
    python benchmarks/peers.py [--quick] [--capacities 2^16 2^20 ...] [--batches 32 256 ...]
                               [--libs fastper cpprb ...] [--out benchmarks/results]

Every library is measured at every capacity in its own fresh process (this
script in worker mode, ``--worker LIB``), one process at a time, in ``--repeats``
rounds that go through all libraries in turn (so that a slow spell of a shared
machine does not hit one library only); the peers are imported only there.
Each worker first checks its library on a small case with known priorities,
then fills a buffer (proportional PER, alpha 0.6, beta 0.4, a CartPole-like
transition of 48 bytes) and times fill, sample, update and the learner step
(sample + update); fastper's worker then times, in the same process, the
memory-latency floor of that step (``latency_floor.py``: the cache lines the
step reads, read at random by B independent chains and nothing else), shown
as ``floor us`` and ``fastper / floor`` in the summary tables and printed at
the end. This process collects the results and writes
``peers.csv``, ``peers.md`` and ``peers.png`` to ``--out``, plus the time to
first sample of a fresh ``python -c "import fastper; ..."`` with numba's cache
warm and cold.

Needs the ``bench`` extra: ``pip install -e '.[bench]'``. With none of the
peer libraries installed it refuses (exit status 2) before running anything;
with some of them it measures those (the others read n/a) and writes the
report only if at least one peer library was measured, so that the committed
results in benchmarks/results are never replaced by a table of n/a. A run of
``--libs fastper`` alone must name another ``--out`` than benchmarks/results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adapters import ADAPTERS
from report import machine_info, versions, write_csv, write_markdown

HERE = Path(__file__).resolve().parent
FULL_CAPACITIES = [2**16, 2**20, 2**22]
FULL_BATCHES = [32, 256, 1024, 4096]

#: The fresh process timed for "time to first sample" (capacity 2^16, add 1000, sample 256).
TTFS_CODE = """
import json, time
t0 = time.perf_counter()
import numpy as np
import fastper
t1 = time.perf_counter()
fields = {"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
          "next_obs": ((4,), np.float32), "done": ((), np.float32)}
buf = fastper.PrioritizedReplayBuffer(2**16, fields, alpha=0.6, beta=0.4, seed=0)
rng = np.random.default_rng(0)
k = 1000
buf.add({"obs": rng.standard_normal((k, 4), dtype=np.float32), "action": rng.integers(0, 2, k),
         "reward": rng.standard_normal(k, dtype=np.float32),
         "next_obs": rng.standard_normal((k, 4), dtype=np.float32),
         "done": np.zeros(k, dtype=np.float32)})
t2 = time.perf_counter()
b = buf.sample(256)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_add_s": t2 - t1, "sample_s": t3 - t2}))
"""


#: The same fresh process without fastper: numpy, numba and one trivial cached
#: kernel (``TTFS_FLOOR_MODULE``); what any numba library pays before its first call.
TTFS_FLOOR_CODE = """
import json, time
t0 = time.perf_counter()
import numpy as np
import numba
import ttfs_floor_kernel
t1 = time.perf_counter()
ttfs_floor_kernel.add_one(np.zeros(4))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t2 - t1}))
"""
TTFS_FLOOR_MODULE = """
from numba import njit


@njit(cache=True, nogil=True)
def add_one(a):
    for i in range(a.shape[0]):
        a[i] += 1.0
"""
#: warm runs timed (after one that fills the cache); the median is reported
TTFS_WARM_RUNS = 5


def parse_size(text: str) -> int:
    """An integer given as ``1048576``, ``2^20`` or ``2**20``."""
    t = text.strip().replace("**", "^")
    if "^" in t:
        base, exp = t.split("^", 1)
        return int(int(base) ** int(exp))
    return int(t)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``--worker`` and friends are internal)."""
    p = argparse.ArgumentParser(
        prog=os.environ.get("FASTPER_PEERS_PROG") or None,  # `fastper bench --peers` sets it
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 2^16, B=256, fewer calls")
    p.add_argument("--capacities", nargs="+", type=parse_size, help="default 2^16 2^20 2^22")
    p.add_argument("--batches", nargs="+", type=int, help="default 32 256 1024 4096")
    p.add_argument("--libs", nargs="+", choices=list(ADAPTERS), help="default: all four")
    p.add_argument("--out", type=Path, help="default benchmarks/results (quick: .../quick)")
    p.add_argument("--calls", type=int, help="timed calls per op (default 300, quick 100)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 30, quick 10)")
    p.add_argument(
        "--prefix", type=int, help="single adds timed where a library cannot add batches (20000)"
    )
    p.add_argument(
        "--repeats", type=int, help="worker processes per library and capacity (3; quick 1)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--no-ttfs", action="store_true", help="skip the time-to-first-sample runs")
    p.add_argument("--worker", choices=list(ADAPTERS), help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=parse_size, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.prog = p.prog
    a.capacities = a.capacities or ([2**16] if a.quick else FULL_CAPACITIES)
    a.batches = a.batches or ([256] if a.quick else FULL_BATCHES)
    a.libs = a.libs or list(ADAPTERS)
    a.out = a.out or (HERE / "results" / "quick" if a.quick else HERE / "results")
    a.calls = a.calls or (100 if a.quick else 300)
    a.warmup = a.warmup if a.warmup is not None else (10 if a.quick else 30)
    a.prefix = a.prefix or (2000 if a.quick else 20000)
    a.repeats = a.repeats or (1 if a.quick else 3)
    return a


def worker_main(a: argparse.Namespace) -> int:
    """Worker mode: measure one library at one capacity, write JSON to ``--result``."""
    import worker

    result = worker.run(a.worker, a.capacity, a.batches, a.calls, a.warmup, a.prefix)
    a.result.write_text(json.dumps(result))
    return 0


def run_worker(lib: str, capacity: int, a: argparse.Namespace) -> dict[str, Any]:
    """Run one worker process; a crash or timeout becomes an error in the result."""
    with tempfile.TemporaryDirectory(prefix="fastper-peers-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            lib,
            "--capacity",
            str(capacity),
            "--batches",
            *map(str, a.batches),
            "--calls",
            str(a.calls),
            "--warmup",
            str(a.warmup),
            "--prefix",
            str(a.prefix),
            "--result",
            str(result_path),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            stderr = proc.stderr
            failed = proc.returncode != 0 or not result_path.exists()
            why = f"worker exited with status {proc.returncode}"
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            failed, why = True, f"worker timed out after {a.timeout:g} s"
        if failed:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            return {
                "lib": lib,
                "capacity": capacity,
                "available": True,
                "error": f"{why}: {tail}" if tail else why,
                "rows": [],
                "process_s": time.perf_counter() - t0,
            }
        result: dict[str, Any] = json.loads(result_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        return result


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the worker processes that measured one library at one capacity.

    Each figure is the median over processes of the per-process figure (per-process
    medians of 300 calls, p90s, fill times, memory); ``calls`` is the total.
    """
    ok = [r for r in runs if r.get("available")]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    out["checks"] = [r["check"] for r in ok if r.get("check")]
    failed = [c for c in out["checks"] if not c.get("ok")]
    out["check"] = failed[0] if failed else (out["checks"][0] if out["checks"] else None)
    out["error"] = "; ".join(r["error"] for r in runs if r.get("error")) or None
    out["processes"] = len(runs)
    out["process_s"] = sum(r.get("process_s", 0.0) for r in runs)
    groups: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for r in ok:
        for row in r.get("rows", []):
            groups.setdefault((row["op"], row["batch"]), []).append(row)
    merged = []
    for rows in groups.values():
        row = dict(rows[0])
        if len(rows) > 1:
            for key in ("median_us", "p90_us", "bytes_per_slot"):
                vals = [x[key] for x in rows if x[key] is not None]
                row[key] = float(statistics.median(vals)) if vals else None
            row["calls"] = sum(x["calls"] for x in rows)
            row["extrapolated"] = any(x["extrapolated"] for x in rows)
            key = "bytes_per_slot" if row["op"] == "memory" else "median_us"
            each = ", ".join(f"{x[key]:.4g}" for x in rows if x[key] is not None)
            row["notes"] = (f"median of {len(rows)} processes ({each}); " + row["notes"]).rstrip(
                "; "
            )
        merged.append(row)
    out["rows"] = merged
    return out


def _fresh_runs(code: str, env: dict[str, str], runs: int) -> dict[str, Any]:
    """Run ``python -c code`` ``runs`` times; the median wall time and printed fields."""
    walls: list[float] = []
    fields: list[dict[str, float]] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        walls.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            return {"error": " | ".join(proc.stderr.strip().splitlines()[-3:])}
        fields.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {"wall_s": statistics.median(walls), "runs": runs}
    out.update({k: statistics.median(f[k] for f in fields) for k in fields[0]})
    out["wall_all_s"] = walls
    return out


def time_to_first_sample() -> dict[str, Any]:
    """Wall time of a fresh ``python -c`` that imports fastper, builds, adds and samples.

    Warm: a numba cache directory filled by a first run, then the median of
    ``TTFS_WARM_RUNS`` runs. Cold: an empty numba cache directory (everything
    compiled in that process), one run. ``floor``: the same warm process with
    numpy, numba and one trivial cached kernel instead of fastper.
    """
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fastper-numba-warm-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        _fresh_runs(TTFS_CODE, env, 1)
        out["warm"] = _fresh_runs(TTFS_CODE, env, TTFS_WARM_RUNS)
        Path(cache, "ttfs_floor_kernel.py").write_text(TTFS_FLOOR_MODULE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cache, env.get("PYTHONPATH")]))
        _fresh_runs(TTFS_FLOOR_CODE, env, 1)
        out["floor"] = _fresh_runs(TTFS_FLOOR_CODE, env, TTFS_WARM_RUNS)
    with tempfile.TemporaryDirectory(prefix="fastper-numba-cold-") as cache:
        out["cold"] = _fresh_runs(TTFS_CODE, dict(os.environ, NUMBA_CACHE_DIR=cache), 1)
    return out


def installed(lib: str) -> bool:
    """Whether the library behind adapter ``lib`` can be found (without importing it)."""
    module = ADAPTERS[lib].distributions[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or hidden package
        return False


def refuse(a: argparse.Namespace, message: str) -> int:
    """One line on stderr, exit status 2; nothing is written."""
    print(f"{a.prog}: error: {message}", file=sys.stderr)
    return 2


INSTALL = "pip install 'fastper[bench]' (in a checkout: pip install -e '.[bench]')"


def check_libraries(a: argparse.Namespace) -> int | None:
    """Before running anything: refuse a run that could only write n/a for the peers.

    Returns the exit status to stop with, or None to go on. Warns (one line)
    when only some of the requested peers are installed.
    """
    peers = [lib for lib in a.libs if lib != "fastper"]
    if not peers:
        if a.out.resolve() == (HERE / "results").resolve():
            return refuse(
                a,
                "--libs fastper alone would replace the peer comparison in "
                f"{a.out} with a fastper-only table; name another --out DIR",
            )
        return None
    missing = [lib for lib in peers if not installed(lib)]
    if missing == peers:
        return refuse(
            a,
            f"no peer library is installed ({', '.join(missing)} missing); install them with "
            f"{INSTALL}, or choose installed ones with --libs; nothing was run or written",
        )
    if missing:
        print(
            f"[peers] not installed: {', '.join(missing)} ({INSTALL}); measuring "
            f"{', '.join(lib for lib in a.libs if lib not in missing)}, the others read n/a",
            file=sys.stderr,
            flush=True,
        )
    return None


def measured(result: dict[str, Any]) -> bool:
    """Whether a merged result holds at least one timing beyond import and first use."""
    return bool(result.get("available")) and any(
        row["op"] not in ("import", "first_use") for row in result.get("rows", [])
    )


def nothing_measured(a: argparse.Namespace, results: list[dict[str, Any]]) -> str | None:
    """Why the report must not be written (no requested peer was measured), or None."""
    peers = [lib for lib in a.libs if lib != "fastper"]
    if not peers or any(r["lib"] in peers and measured(r) for r in results):
        return None
    reasons = {
        r["lib"]: str(r.get("reason") or r.get("error")) for r in results if r["lib"] in peers
    }
    why = "; ".join(f"{lib}: {reason}" for lib, reason in reasons.items())
    return f"no peer library could be measured ({why[:400]}); install them with {INSTALL}"


def floor_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per (N, B) that fastper's worker measured: learner step, floor, ratio."""
    lines = []
    for r in results:
        if r["lib"] != "fastper":
            continue
        rows = {(row["op"], row["batch"]): row["median_us"] for row in r.get("rows", [])}
        for (op, b), floor in sorted(rows.items(), key=lambda x: x[0][1] or 0):
            step = rows.get(("learner_step", b))
            if op != "floor" or not floor or not step:
                continue
            lines.append(
                f"[peers] fastper N={r['capacity']} B={b}: learner step {step:.1f} us, "
                f"floor us {floor:.1f}, fastper / floor {step / floor:.2f}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run every (library, capacity) worker in turn and write the report."""
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)
    stop = check_libraries(a)
    if stop is not None:
        return stop
    t_start = time.perf_counter()
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    unavailable: set[str] = set()
    for rnd in range(1, a.repeats + 1):
        for lib in a.libs:
            for cap in a.capacities:
                if lib in unavailable:
                    break  # the same import would fail at every capacity and in every round
                print(
                    f"[peers] round {rnd}/{a.repeats}: {lib} at N={cap} ...",
                    file=sys.stderr,
                    flush=True,
                )
                r = run_worker(lib, cap, a)
                runs.setdefault((lib, cap), []).append(r)
                state = (
                    "unavailable: " + str(r["reason"])
                    if not r.get("available")
                    else r.get("error") or f"done in {r['process_s']:.1f} s"
                )
                check = r.get("check")
                if check is not None:
                    state += "; check " + ("ok" if check["ok"] else "FAILED")
                print(f"[peers]   {state[:300]}", file=sys.stderr, flush=True)
                if not r.get("available"):
                    unavailable.add(lib)
    results = [merge(rs) for rs in runs.values()]
    problem = nothing_measured(a, results)
    if problem is not None:  # never replace a report with a table of n/a
        return refuse(a, f"{problem}; nothing written to {a.out}")
    ttfs: dict[str, Any] = {}
    if not a.no_ttfs and "fastper" in a.libs:
        print("[peers] time to first sample (fastper) ...", file=sys.stderr, flush=True)
        ttfs = time_to_first_sample()
    total_s = time.perf_counter() - t_start

    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", "benchmarks/peers.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "total_s": total_s,
        "machine": machine_info(),
        "versions": versions(),
        "args": {
            "capacities": a.capacities,
            "batches": a.batches,
            "libs": a.libs,
            "calls": a.calls,
            "warmup": a.warmup,
            "prefix": a.prefix,
            "repeats": a.repeats,
        },
    }
    write_csv(results, a.out / "peers.csv")
    write_markdown(results, ttfs, meta, a.out / "peers.md")
    try:
        from plot import plot

        plot(results, a.out / "peers.png", batch=256 if 256 in a.batches else a.batches[0])
    except ImportError as exc:
        print(f"[peers] no figure: {exc}", file=sys.stderr)
    (a.out / "peers.json").write_text(json.dumps({"meta": meta, "results": results, "ttfs": ttfs}))
    for line in floor_lines(results):
        print(line, file=sys.stderr)
    print(f"[peers] wrote {a.out}/peers.{{csv,md,png,json}} in {total_s:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
