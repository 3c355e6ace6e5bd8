"""The disk tier (fastper.disk): reads vs maps, and a buffer 3x larger than its memory cap.

Usage:
    python -m benchmarks.disk [--data-gib 3] [--cap-gib 1] [--steps 3000]
                              [--io-rows 20000] [--dir DIR] [--quick]
                              [--out benchmarks/results/disk.md]

(a) Explicit reads vs memory maps, the choice :mod:`fastper.disk` makes. A
file of ``--io-rows`` rows of 84x84x4 uint8 (Atari frames, 28,224 bytes) and
one of 8 float32 (32 bytes), allocated with ``posix_fallocate``. Timed: writes
of 32 consecutive rows (``os.pwrite`` vs assignment into a ``np.memmap``),
and the gather of B=32 random rows (``os.preadv`` into the batch, one call a
row, vs ``np.memmap.take``), with the file in the page cache (read through
first) and evicted (``posix_fadvise(DONTNEED)`` before every gather; a map is
made afresh each time, with and without ``MADV_RANDOM``). Also the growth of
VmRSS over 3,000 gathers (pages read through a map count in RSS; a ``pread``
copies into the batch and leaves them in the page cache).

(b) Memory cap. A child process runs a PrioritizedReplayBuffer on a
``DiskStorage`` of Atari-shaped transitions (obs 84x84x4 uint8, action int64,
reward float32, done bool: 28,237 bytes a slot; obs on disk, the rest
mirrored in RAM) whose data is ``--data-gib`` GiB, under a memory limit of
``--cap-gib`` GiB: a cgroup where this machine lets us make one (cgroup v1
``memory.limit_in_bytes`` or v2 ``memory.max``, which also count the page
cache), else only the buffer's own ``ram_budget``. It fills the ring once
(adds of 64 transitions, each followed by a sample of 32 and an update of
their priorities), then runs ``--steps`` more add / sample / update rounds.
VmRSS is read from ``/proc/self/status`` every 50 rounds (its peak VmHWM at
the end); under a cgroup, its peak usage too. As a control, a second child
runs the same workload with the default RAM storage under the same cgroup:
the kernel kills it when its rows outgrow the cap.

Results go to ``--out`` as markdown, with the machine and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import fastper
from fastper.disk import DiskStorage

REPO = Path(__file__).resolve().parents[1]
FIELDS = {
    "obs": ((84, 84, 4), np.uint8),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
ADD = 64
BATCH = 32


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


# -- (a) reads vs maps -----------------------------------------------------------------


def io_compare(directory: Path, n: int) -> list[dict[str, Any]]:
    results = []
    for name, shape, dt in (
        ("84x84x4 uint8", (84, 84, 4), np.uint8),
        ("8 float32", (8,), np.float32),
    ):
        row = int(np.prod(shape)) * np.dtype(dt).itemsize
        path = directory / "io.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, n * row)
        rng = np.random.default_rng(0)
        block = rng.integers(0, 255, (BATCH, *shape)).astype(dt)
        r: dict[str, Any] = {"field": name, "row_bytes": row}
        t = time.perf_counter()
        for i in range(n // BATCH):
            os.pwrite(fd, block.data, i * BATCH * row)
        r["pwrite_us"] = (time.perf_counter() - t) / (n // BATCH) * 1e6
        mm = np.memmap(path, dtype=dt, mode="r+", shape=(n, *shape))
        before = rss()[0]
        t = time.perf_counter()
        for i in range(n // BATCH):
            mm[i * BATCH : (i + 1) * BATCH] = block
        r["mmap_write_us"] = (time.perf_counter() - t) / (n // BATCH) * 1e6
        r["mmap_write_rss_mib"] = (rss()[0] - before) / 2**20
        del mm
        out = np.empty((BATCH, *shape), dt)
        rows = out.reshape(BATCH, -1).view(np.uint8)

        def pread(idx: np.ndarray, fd: int = fd, rows: np.ndarray = rows, row: int = row) -> None:
            for j, s in enumerate(idx.tolist()):
                os.preadv(fd, [rows[j].data], s * row)

        with open(path, "rb") as f:  # into the page cache
            while f.read(1 << 24):
                pass
        mm = np.memmap(path, dtype=dt, mode="r", shape=(n, *shape))
        for label in ("preadv", "mmap"):
            times = []
            for _ in range(300):
                idx = rng.integers(0, n, BATCH)
                t = time.perf_counter()
                pread(idx) if label == "preadv" else mm.take(idx, axis=0, out=out)
                times.append(time.perf_counter() - t)
            r[f"{label}_hot_us"] = float(np.median(times)) * 1e6
        del mm
        for label in ("preadv", "mmap", "mmap MADV_RANDOM"):
            times = []
            for _ in range(30):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                idx = rng.integers(0, n, BATCH)
                if label == "preadv":
                    t = time.perf_counter()
                    pread(idx)
                    times.append(time.perf_counter() - t)
                    continue
                m = mmap.mmap(fd, n * row, prot=mmap.PROT_READ)
                if label.endswith("RANDOM"):
                    m.madvise(mmap.MADV_RANDOM)
                a = np.frombuffer(m, dtype=dt).reshape(n, *shape)
                t = time.perf_counter()
                a.take(idx, axis=0, out=out)
                times.append(time.perf_counter() - t)
                del a
                m.close()
            r[f"{label}_cold_us"] = float(np.median(times)) * 1e6
        for label in ("preadv", "mmap"):
            mm = np.memmap(path, dtype=dt, mode="r", shape=(n, *shape))
            before = rss()[0]
            for _ in range(3000):
                idx = rng.integers(0, n, BATCH)
                pread(idx) if label == "preadv" else mm.take(idx, axis=0, out=out)
            r[f"{label}_rss_mib"] = (rss()[0] - before) / 2**20
            del mm
        os.close(fd)
        path.unlink()
        results.append(r)
        print(json.dumps(r), flush=True)
    return results


# -- (b) a buffer 3x its memory cap ----------------------------------------------------


def make_cgroup(limit: int) -> tuple[str, Path] | None:
    """A memory cgroup limited to ``limit`` bytes, if this machine lets us make one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    name = f"fastper-disk-{os.getpid()}"
    for line in lines:  # cgroup v1 memory controller
        _, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            for base in (
                Path("/sys/fs/cgroup/memory") / path.lstrip("/"),
                Path("/sys/fs/cgroup/memory"),
            ):
                try:
                    (base / name).mkdir()
                    (base / name / "memory.limit_in_bytes").write_text(str(limit))
                    return "v1", base / name
                except OSError:
                    continue
    for line in lines:  # cgroup v2
        if line.startswith("0::"):
            base = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            try:
                (base / name).mkdir()
                (base / name / "memory.max").write_text(str(limit))
                (base / name / "memory.swap.max").write_text("0")
                return "v2", base / name
            except OSError:
                return None
    return None


def worker(args: argparse.Namespace) -> None:
    if args.cgroup:
        Path(args.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    cap_slots = int(args.data_gib * 2**30) // sum(
        int(np.prod(s)) * np.dtype(d).itemsize for s, d in FIELDS.values()
    )
    budget = args.ram_budget
    storage = None
    if args.worker == "disk":
        storage = DiskStorage(FIELDS, cap_slots, Path(args.dir) / "buffer", ram_budget=budget)
    buf = fastper.PrioritizedReplayBuffer(
        cap_slots, FIELDS, alpha=0.6, beta=0.4, seed=0, storage=storage
    )
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (256, 84, 84, 4), dtype=np.uint8)
    base_rss = rss()[0]
    peak_rss = base_rss
    add_s = sample_s = 0.0
    lat: list[float] = []
    rounds = -(-cap_slots // ADD) + args.steps
    t0 = time.perf_counter()
    for i in range(rounds):
        at = (i * ADD) % 256
        obs = pool[at : at + ADD] if at + ADD <= 256 else np.roll(pool, -at, axis=0)[:ADD]
        t = time.perf_counter()
        buf.add(
            {
                "obs": obs,
                "action": np.full(ADD, i % 6),
                "reward": np.ones(ADD),
                "done": np.zeros(ADD, bool),
            }
        )
        t1 = time.perf_counter()
        s = buf.sample(BATCH)
        t2 = time.perf_counter()
        buf.update_priorities(s.indices, rng.random(BATCH) + 0.01, keys=s.keys)
        add_s += t1 - t
        sample_s += t2 - t1
        if i * ADD >= cap_slots:
            lat.append(t2 - t1)
        if i % 50 == 0:
            peak_rss = max(peak_rss, rss()[0])
            if i % 2000 == 0:
                print(f"round {i}/{rounds}: {buf.total_added:,} rows, RSS {rss()[0] / 2**20:.0f} MiB",
                      file=sys.stderr, flush=True)  # fmt: skip
    total = time.perf_counter() - t0
    cur, hwm = rss()
    out = {
        "capacity": cap_slots,
        "data_bytes": cap_slots * sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in FIELDS.values()),
        "rounds": rounds, "added": buf.total_added, "seconds": total,
        "add_ms": add_s / rounds * 1e3, "sample_ms": sample_s / rounds * 1e3,
        "write_mib_s": buf.total_added * 28237 / add_s / 2**20,
        "steady_sample_ms": {str(q): float(np.percentile(lat, q)) * 1e3 for q in (50, 90, 99)} if lat else {},
        "rss_start": base_rss, "rss_peak_sampled": max(peak_rss, cur), "rss_end": cur, "vmhwm": hwm,
        "storage_nbytes": buf.nbytes()["data"], "index_nbytes": buf.nbytes()["index"],
    }  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def run_child(kind: str, args: argparse.Namespace, cgroup: Path | None, tmp: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.disk", "--worker", kind, "--dir", tmp,
           "--data-gib", str(args.data_gib), "--steps", str(args.steps),
           "--ram-budget", str(args.ram_budget)]  # fmt: skip
    if cgroup is not None:
        cmd += ["--cgroup", str(cgroup)]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    sys.stderr.write(p.stderr[-2000:])
    res: dict[str, Any] = {"returncode": p.returncode, "wall_s": time.perf_counter() - t}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    return res


def cgroup_peak(kind: str, path: Path) -> dict[str, int]:
    names = (
        ("memory.max_usage_in_bytes", "memory.failcnt")
        if kind == "v1"
        else ("memory.peak", "memory.events")
    )
    out = {}
    for n in names:
        try:
            text = (path / n).read_text()
        except OSError:
            continue
        out[n] = (
            int(text.split()[0])
            if n != "memory.events"
            else int(dict(line.split() for line in text.splitlines()).get("oom_kill", 0))
        )
    return out


def reset_cgroup(kind: str, path: Path) -> None:
    if kind == "v1":
        for n in ("memory.max_usage_in_bytes", "memory.failcnt"):
            try:
                (path / n).write_text("0")
            except OSError:
                pass


# -- report ------------------------------------------------------------------------------


def mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def render(
    args: argparse.Namespace, io: list[dict[str, Any]], cap: dict[str, Any], total: float
) -> str:
    cmd = "python -m benchmarks.disk " + " ".join(sys.argv[1:])
    lines = [
        "# Disk tier: explicit reads vs maps; a buffer 3x its memory cap",
        "",
        f"`{cmd.strip()}` on {datetime.date.today().isoformat()}: {os.cpu_count()} cores, "
        f"{platform.machine()}, Linux {platform.release()}, python {platform.python_version()}, "
        f"numpy {np.__version__}, fastper {fastper.__version__}; files in `{args.dir or tempfile.gettempdir()}` "
        f"(a virtio disk of a shared VM); {total:.0f} s in all. Medians of 300 gathers (cached) / 30 "
        "(evicted).",
        "",
        f"## Reads and writes: `preadv` vs `mmap` ({args.io_rows:,}-row files)",
        "",
        "| rows of | write 32 rows: pwrite / map us | RSS after writing through the map "
        "| gather 32, cached: preadv / map us | gather 32, evicted: preadv / map / map+MADV_RANDOM us "
        "| RSS growth, 3,000 gathers: preadv / map |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in io:
        lines.append(
            f"| {r['field']} ({r['row_bytes']:,} B) | {r['pwrite_us']:,.0f} / {r['mmap_write_us']:,.0f} "
            f"| +{r['mmap_write_rss_mib']:,.0f} MiB | {r['preadv_hot_us']:,.0f} / {r['mmap_hot_us']:,.0f} "
            f"| {r['preadv_cold_us']:,.0f} / {r['mmap_cold_us']:,.0f} / {r['mmap MADV_RANDOM_cold_us']:,.0f} "
            f"| +{r['preadv_rss_mib']:,.0f} / +{r['mmap_rss_mib']:,.0f} MiB |"
        )
    lines += [
        "",
        "Hence fastper.disk reads rows with `os.preadv` (no RSS growth, no readahead of "
        "neighbours a random gather never uses) and writes with `pwrite`; small fields, where a "
        "syscall per row dominates, are mirrored in RAM within `ram_budget`.",
        "",
        f"## A buffer of {args.data_gib:g} GiB under a {args.cap_gib:g} GiB memory cap",
        "",
        f"Limit: {cap['how']}. Workload: fill the ring once, then {args.steps:,} more rounds; "
        f"each round adds {ADD}, samples {BATCH} and updates their priorities. "
        f"`ram_budget` {mib(args.ram_budget)}.",
        "",
        "| storage | exit | data | rows added | RSS start / peak / end | VmHWM | cgroup peak (with page cache) "
        "| add 64 ms | sample 32 ms (mean) | steady sample 32 p50 / p90 / p99 ms | write MiB/s | time s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, r in cap["runs"].items():
        if "rss_end" not in r:
            lines.append(
                f"| {kind} | {r['returncode']} (killed: out of memory) | {args.data_gib:g} GiB | - | - | - "
                f"| {mib(r['cgroup'].get('memory.max_usage_in_bytes', r['cgroup'].get('memory.peak', 0)))} "
                f"| - | - | - | - | {r['wall_s']:.0f} |"
            )
            continue
        st = r["steady_sample_ms"]
        peak = r["cgroup"].get("memory.max_usage_in_bytes", r["cgroup"].get("memory.peak"))
        lines.append(
            f"| {kind} | {r['returncode']} | {r['data_bytes'] / 2**30:.2f} GiB | {r['added']:,} "
            f"| {mib(r['rss_start'])} / {mib(r['rss_peak_sampled'])} / {mib(r['rss_end'])} | {mib(r['vmhwm'])} "
            f"| {mib(peak) if peak else 'n/a'} | {r['add_ms']:.2f} | {r['sample_ms']:.2f} "
            f"| {st.get('50', 0):.2f} / {st.get('90', 0):.2f} / {st.get('99', 0):.2f} "
            f"| {r['write_mib_s']:,.0f} | {r['seconds']:.0f} |"
        )
    disk = cap["runs"].get("DiskStorage", {})
    if "vmhwm" in disk:
        ok = disk["vmhwm"] < args.cap_gib * 2**30
        lines += [
            "",
            f"Target: RSS under the cap with data {args.data_gib / args.cap_gib:.0f}x the cap: "
            f"{'met' if ok else 'missed'} (peak RSS {mib(disk['vmhwm'])} vs cap {mib(args.cap_gib * 2**30)}; "
            f"RAM held by the buffer: storage {mib(disk['storage_nbytes'])}, priorities and trees "
            f"{mib(disk['index_nbytes'])}, {disk['index_nbytes'] / disk['capacity']:.1f} B a slot).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-gib", type=float, default=3.0)
    ap.add_argument("--cap-gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3000, help="rounds after the ring is full")
    ap.add_argument("--io-rows", type=int, default=20000)
    ap.add_argument("--ram-budget", type=int, default=16 * 2**20)
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temp dir)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/disk.md"))
    ap.add_argument("--quick", action="store_true", help="0.3 GiB vs 0.1 GiB, printed only")
    ap.add_argument("--no-ram-control", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.data_gib, args.cap_gib, args.steps, args.io_rows = 0.3, 0.1, 300, 4000
        args.ram_budget = min(args.ram_budget, 2 * 2**20)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        io = io_compare(Path(tmp), args.io_rows)
        limit = int(args.cap_gib * 2**30)
        made = make_cgroup(limit)
        runs: dict[str, Any] = {}
        how = (
            f"cgroup {made[0]} `{made[1]}`, {mib(limit)} (page cache counted)"
            if made
            else f"none could be made here: the buffer's `ram_budget` only, RSS measured against {mib(limit)}"
        )
        try:
            kinds = ["DiskStorage"] + ([] if args.no_ram_control or not made else ["RAM Storage"])
            for kind in kinds:
                if made:
                    reset_cgroup(*made)
                r = run_child(
                    "disk" if kind == "DiskStorage" else "ram", args, made[1] if made else None, tmp
                )
                r["cgroup"] = cgroup_peak(*made) if made else {}
                runs[kind] = r
                print(kind, json.dumps(r), flush=True)
        finally:
            if made:
                try:
                    made[1].rmdir()
                except OSError:
                    pass
    text = render(args, io, {"how": how, "runs": runs}, time.perf_counter() - t0)
    if args.quick:
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
