"""Writes the results of `peers.py` as CSV and markdown, with machine info and versions."""

from __future__ import annotations

import csv
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from adapters import ADAPTERS, DATA_BYTES_PER_SLOT, dist_version

CSV_COLUMNS = [
    "lib",
    "version",
    "capacity",
    "batch",
    "op",
    "median_us",
    "p90_us",
    "calls",
    "extrapolated",
    "bytes_per_slot",
    "data_bytes_per_slot",
    "notes",
]
TIMED_OPS = ["sample", "update", "learner_step"]
FLOOR_OP = "floor"  # latency_floor.OP: measured in fastper's worker, one row per batch size
SUMMARY_OPS = [
    ("learner_step", "learner step (sample + update), us/call"),
    ("update", "update, us/call"),
    ("fill", "fill (init + add to capacity), us/transition"),
    ("sample", "sample (indices + weights + data), us/call"),
    ("memory", "memory, RSS bytes/slot"),
]
VERSION_DISTS = [
    "fastper",
    "numpy",
    "numba",
    "cpprb",
    "tianshou",
    "torch",
    "torchrl",
    "tensordict",
    "matplotlib",
]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, str]:
    """Platform, CPU (from lscpu), core count (nproc) and memory."""
    info = {
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "machine": platform.machine(),
        "nproc": _run(["nproc"]).strip() or str(os.cpu_count()),
    }
    wanted = (
        "Model name",
        "CPU(s)",
        "Thread(s) per core",
        "L2 cache",
        "L3 cache",
        "Hypervisor vendor",
    )
    for line in _run(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            info[f"lscpu {key.strip()}"] = value.strip()
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory"] = f"{kb / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return info


def versions() -> dict[str, str]:
    """Installed versions of every library involved (read from metadata, not imported).

    Also the git commit of this checkout (``-dirty`` when it has local changes), since
    an editable fastper install runs whatever the working tree holds.
    """
    out = {d: dist_version(d) for d in VERSION_DISTS}
    root = Path(__file__).resolve().parent.parent
    commit = _run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"])
    out["fastper checkout (git)"] = commit.strip() or "unknown"
    return out


def pow2(n: int) -> str:
    """``2^k`` for powers of two, else the number."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def fmt(v: float | None) -> str:
    """A number with about three significant digits, without exponents."""
    if v is None:
        return "n/a"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _lib_version(result: dict[str, Any]) -> str:
    return str(result.get("versions", {}).get(result["lib"], dist_version(result["lib"])))


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    """One row per lib / capacity / batch / op; unavailable libraries and errors get a row too."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results:
            base = {"lib": r["lib"], "version": _lib_version(r), "capacity": r["capacity"]}
            if not r.get("available"):
                w.writerow({**base, "op": "all", "notes": f"unavailable: {r.get('reason')}"})
                continue
            check = r.get("check")
            if check is not None and not check.get("ok"):
                problems = "; ".join(check.get("problems", []))
                w.writerow({**base, "op": "check", "notes": f"CHECK FAILED: {problems}"})
            for row in r["rows"]:
                w.writerow(
                    {
                        **base,
                        "batch": row["batch"] if row["batch"] is not None else "",
                        "op": row["op"],
                        "median_us": _csv_num(row["median_us"]),
                        "p90_us": _csv_num(row["p90_us"]),
                        "calls": row["calls"],
                        "extrapolated": int(bool(row["extrapolated"])),
                        "bytes_per_slot": _csv_num(row["bytes_per_slot"]),
                        "data_bytes_per_slot": DATA_BYTES_PER_SLOT if row["op"] == "memory" else "",
                        "notes": row["notes"],
                    }
                )
            if r.get("error"):
                w.writerow({**base, "op": "error", "notes": r["error"]})


def _short(text: object, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (peers.csv keeps the full message)."""
    s = str(text).replace("|", "/")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _csv_num(v: float | None) -> str:
    return "" if v is None else f"{v:.4f}"


def _index(results: list[dict[str, Any]]) -> dict[tuple[str, int, int | None, str], dict]:
    """(lib, capacity, batch, op) -> row, over every available result."""
    out: dict[tuple[str, int, int | None, str], dict] = {}
    for r in results:
        for row in r.get("rows", []):
            batch = row["batch"] if row["op"] in TIMED_OPS or row["op"] == FLOOR_OP else None
            out[(r["lib"], r["capacity"], batch, row["op"])] = row
    return out


def _value(row: dict | None) -> float | None:
    if row is None:
        return None
    v = row["bytes_per_slot"] if row["op"] == "memory" else row["median_us"]
    return None if v is None else float(v)


def _cell(row: dict | None, p90: bool = False) -> str:
    v = _value(row)
    if row is None or v is None:
        return "n/a"
    s = fmt(v)
    if p90 and row.get("p90_us") is not None:
        s += f" ({fmt(row['p90_us'])})"
    return ("~" + s) if row.get("extrapolated") else s


def _status(results: list[dict[str, Any]], lib: str) -> dict[str, Any] | None:
    for r in results:
        if r["lib"] == lib:
            return r
    return None


def summary_tables(results: list[dict[str, Any]], batch: int) -> list[str]:
    """Markdown: at N = 2^20 and 2^22 (else the largest N run), B = ``batch``."""
    idx = _index(results)
    libs = [lib for lib in ADAPTERS if _status(results, lib) is not None]
    peers = [lib for lib in libs if lib != "fastper"]
    caps = sorted({r["capacity"] for r in results})
    wanted = [c for c in caps if c in (2**20, 2**22)] or caps[-1:]
    failed = {
        r["lib"]
        for r in results
        for c in (r.get("checks") or ([r["check"]] if r.get("check") else []))
        if not c.get("ok")
    }
    heads = [lib + (" (CHECK FAILED)" if lib in failed else "") for lib in libs]
    lines: list[str] = []
    for cap in wanted:
        lines += [
            f"### N = {pow2(cap)}, B = {batch}",
            "",
            "| op | " + " | ".join(heads) + " | fastest peer | fastest peer / fastper |",
            "|---|" + "---:|" * len(libs) + "---|---:|",
        ]
        for op, label in SUMMARY_OPS:
            b = batch if op in TIMED_OPS else None
            cells = [_cell(idx.get((lib, cap, b, op))) for lib in libs]
            peer_vals = {
                lib: v
                for lib in peers
                if (v := _value(idx.get((lib, cap, b, op)))) is not None and v > 0
            }
            ours = _value(idx.get(("fastper", cap, b, op)))
            if peer_vals:
                best = min(peer_vals, key=lambda k: peer_vals[k])
                ratio = f"{peer_vals[best] / ours:.2f}x" if ours else "n/a"
            else:
                best, ratio = "n/a", "n/a"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {best} | {ratio} |")
        lines += _floor_lines(idx, libs, cap, batch)
        lines.append("")
    lines.append(
        "Medians. A ratio above 1 means fastper is faster (or smaller) than the best peer. "
        "`~` marks a fill extrapolated from single adds; n/a: library unavailable or failed."
    )
    if any(k[3] == FLOOR_OP for k in idx):
        lines += [
            "",
            "floor us: the memory-latency floor of fastper's learner step, measured in its "
            "worker process right after the step (benchmarks/latency_floor.py: the same cache "
            "lines read at random by B independent chains, nothing else); fastper / floor: "
            "the learner step over it.",
        ]
    return lines


def _floor_lines(idx: dict, libs: list[str], cap: int, batch: int) -> list[str]:
    """The summary's floor rows at one N: ``floor us`` and ``fastper / floor``."""
    floor = _value(idx.get(("fastper", cap, batch, FLOOR_OP)))
    if floor is None or "fastper" not in libs:
        return []
    step = _value(idx.get(("fastper", cap, batch, "learner_step")))
    ratio = f"{step / floor:.2f}x" if step and floor > 0 else "n/a"

    def row(label: str, value: str) -> str:
        cells = [value if lib == "fastper" else "-" for lib in libs]
        return f"| {label} | " + " | ".join(cells) + " | - | - |"

    return [row("floor us (memory-latency probe)", fmt(floor)), row("fastper / floor", ratio)]


def _library_table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| library | version | status | correctness check (8 slots, p = 1..8) "
        "| IS weight max over | notes |",
        "|---|---|---|---|---|---|",
    ]
    for lib, cls in ADAPTERS.items():
        r = _status(results, lib)
        if r is None:
            continue
        if not r.get("available"):
            lines.append(
                f"| {lib} | {_lib_version(r)} | **unavailable**: {_short(r.get('reason'))} "
                "| - | - | - |"
            )
            continue
        checks: list[dict[str, Any]] = [
            c
            for x in results
            if x["lib"] == lib
            for c in (x.get("checks") or ([x["check"]] if x.get("check") else []))
        ]
        errors = [
            f"N={pow2(x['capacity'])}: {x['error']}"
            for x in results
            if x["lib"] == lib and x.get("error")
        ]
        status = "ok" if not errors else "**errors**: " + _short("; ".join(errors), 600)
        if not checks:
            check_s, norm = "not run", "-"
        elif all(c["ok"] for c in checks):
            c = checks[0]
            worst = max(x["freq_max_abs_err"] for x in checks)
            check_s = (
                f"passed in all {len(checks)} processes: max abs(freq - P) {worst:.4f} "
                f"<= {c['tolerance']} over {c['samples']:,} draws each; data matches slots"
            )
            norms = {x.get("weight_norm", "-") for x in checks}
            norm = norms.pop() if len(norms) == 1 else "varies: " + ", ".join(sorted(norms))
        else:
            bad = next(c for c in checks if not c["ok"])
            check_s = "**FAILED**: " + _short("; ".join(bad.get("problems", [])), 600)
            norm = bad.get("weight_norm", "-")
        lines.append(f"| {lib} | {_lib_version(r)} | {status} | {check_s} | {norm} | {cls.notes} |")
    return lines


def _op_tables(results: list[dict[str, Any]]) -> list[str]:
    idx = _index(results)
    caps = sorted({r["capacity"] for r in results})
    batches = sorted({k[2] for k in idx if k[2] is not None})
    libs = [lib for lib in ADAPTERS if any(k[0] == lib for k in idx)]
    titles = {
        "sample": "sample: B indices + IS weights + 5 fields gathered",
        "update": "update: B priorities, on the indices of a fresh sample each call",
        "learner_step": "learner step: sample + update",
    }
    lines: list[str] = []
    for op in TIMED_OPS:
        lines += [
            f"### {titles[op]} (us per call, median (p90))",
            "",
            "| library | N | " + " | ".join(f"B={b}" for b in batches) + " |",
            "|---|---|" + "---:|" * len(batches),
        ]
        for lib in libs:
            for cap in caps:
                cells = [_cell(idx.get((lib, cap, b, op)), p90=True) for b in batches]
                if any(c != "n/a" for c in cells):
                    lines.append(f"| {lib} | {pow2(cap)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "### fill: init + add to capacity (us per transition)",
        "",
        "| library | add | " + " | ".join(f"N={pow2(c)}" for c in caps) + " |",
        "|---|---|" + "---:|" * len(caps),
    ]
    for lib in libs:
        rows = [idx.get((lib, c, None, "fill")) for c in caps]
        kind = next(
            (("batches of 1000" if r["batch"] != 1 else "one at a time") for r in rows if r),
            "-",
        )
        lines.append(f"| {lib} | {kind} | " + " | ".join(_cell(r) for r in rows) + " |")
    lines += [
        "",
        "`~`: extrapolated from timed single adds; the buffer is still filled completely "
        "before sample / update are timed:",
        "",
        *[
            f"- {lib} N={pow2(c)}: {_short(row['notes'], 1000)}"
            for lib in libs
            for c in caps
            if (row := idx.get((lib, c, None, "fill"))) and row.get("extrapolated")
        ],
        "",
        f"### memory of the filled buffer (RSS bytes per slot; the data itself is "
        f"{DATA_BYTES_PER_SLOT} bytes/slot)",
        "",
        "| library | " + " | ".join(f"N={pow2(c)}" for c in caps) + " |",
        "|---|" + "---:|" * len(caps),
    ]
    for lib in libs:
        cells = []
        for c in caps:
            row = idx.get((lib, c, None, "memory"))
            v = _value(row)
            cells.append(
                "n/a" if v is None else f"{fmt(v)} (+{fmt(v - DATA_BYTES_PER_SLOT)} over data)"
            )
        lines.append(f"| {lib} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "At small N the RSS delta is dominated by allocator noise; read the largest N.",
        "",
    ]
    return lines


def _startup_tables(results: list[dict[str, Any]], ttfs: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if ttfs:
        lines += [
            "### time to first sample, fastper (fresh `python -c`: import, build 2^16, "
            "add 1000, sample 256)",
            "",
            "| numba cache | process wall (s) | import (s) | build + add (s) | first sample (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        labels = {
            "warm": "warm (median of {runs} runs after one that fills the cache)",
            "cold": "cold (empty NUMBA_CACHE_DIR, 1 run)",
        }
        for key, label in labels.items():
            t = ttfs.get(key, {})
            label = label.format(runs=t.get("runs", "?"))
            if "error" in t:
                lines.append(f"| {label} | failed: {t['error']} | | | |")
            elif t:
                lines.append(
                    f"| {label} | {t['wall_s']:.2f} | {t['import_s']:.2f} | "
                    f"{t['build_add_s']:.2f} | {t['sample_s']:.3f} |"
                )
        floor = ttfs.get("floor", {})
        if floor and "error" not in floor:
            lines += [
                "",
                f"For reference, the same warm process without fastper (numpy, numba and one "
                f"trivial `cache=True` kernel, median of {floor['runs']} runs): "
                f"{floor['wall_s']:.2f} s wall, {floor['import_s']:.2f} s to import, "
                f"{floor['first_call_s']:.2f} s for the first call (loading numba's compiler "
                "to read the cache).",
            ]
        elif "error" in floor:
            lines += ["", f"numba floor run failed: {floor['error']}"]
        lines.append("")
    idx = _index(results)
    lines += [
        "### start-up inside the worker processes (first worker of each library)",
        "",
        "| library | import (s) | first use: build 1024 + add + sample + update (s) |",
        "|---|---:|---:|",
    ]
    for lib in ADAPTERS:
        caps = sorted(c for (lb, c, _, op) in idx if lb == lib and op == "import")
        if caps:
            imp = idx[(lib, caps[0], None, "import")]["median_us"] / 1e6
            first = idx[(lib, caps[0], None, "first_use")]["median_us"] / 1e6
            lines.append(f"| {lib} | {imp:.2f} | {first:.2f} |")
    lines.append("")
    return lines


def write_markdown(
    results: list[dict[str, Any]], ttfs: dict[str, Any], meta: dict[str, Any], path: Path
) -> None:
    """peers.md: summary, libraries and checks, per-op tables, start-up, machine, method."""
    args = meta["args"]
    batch = 256 if 256 in args["batches"] else args["batches"][0]
    lines = [
        "# fastper vs peers: proportional prioritized replay",
        "",
        f"`{meta['command']}` on {meta['date']}; whole run {meta['total_s'] / 60:.1f} min.",
        "",
        "Workload: CartPole-like transitions (obs float32[4], action int64, reward float32, "
        f"next_obs float32[4], done float32: {DATA_BYTES_PER_SLOT} bytes), proportional PER, "
        "alpha 0.6, beta 0.4. Every library runs at every capacity in its own fresh process. "
        f"Timings: median (and p90) of {args['calls']} calls after {args['warmup']} warm-up "
        "calls, after every priority has been set to a random |N(0, 1)|; each figure is the "
        f"median over {args.get('repeats', 1)} worker processes per library and capacity, "
        "run in interleaved rounds.",
        "",
        "## Summary",
        "",
        *summary_tables(results, batch),
        "",
        "## Libraries and correctness checks",
        "",
        *_library_table(results),
        "",
        "## Results by operation",
        "",
        *_op_tables(results),
        "## Start-up",
        "",
        *_startup_tables(results, ttfs),
        "## Machine and versions",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in meta["machine"].items()],
        *[f"| {k} | {v} |" for k, v in meta["versions"].items()],
        "",
        "## Method",
        "",
        "- fill: build the buffer, then add batches of 1000 transitions (the last one partial) "
        "until it is exactly full; reported as total time / capacity. A library whose add takes "
        f"one transition (Tianshou) is timed over the first {args['prefix']} adds and "
        "extrapolated (marked `~`); the rest of the buffer is then filled with its fastest "
        "public bulk path, and every library must hold exactly N transitions before anything "
        "else is timed.",
        "- sample: B draws with replacement; indices, IS weights and all five fields gathered "
        "(numpy arrays or torch tensors, as the library returns them).",
        "- update: B random |td| on the indices of a different, earlier drawn sample each call (8 |td| arrays cycled).",
        "- learner step: sample, then update its indices.",
        "- memory: RSS of the worker after build + fill minus RSS before, divided by N.",
        "- Inputs are converted to each library's native form (dict of arrays, TensorDict, "
        "Tianshou Batch) before timing; converting them is not timed.",
        "- Before timing, each library passes (or fails, reported above) a check on 8 slots "
        "with priorities 1..8: sampled frequencies match p^alpha / sum, gathered data matches "
        "the slots, and IS weights equal (N P)^-beta / max (over the buffer or the batch).",
        "",
    ]
    path.write_text("\n".join(lines))
