"""Tables and plots for :mod:`fastper.agents.cliffwalk`: results.csv, summary.md, the PNG.

Imports only numpy at module level; :func:`plot` imports matplotlib.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import missing_extra

#: the run ends when the MSE to the true Q-values falls below this (paper: 1e-3)
THRESHOLD = 1e-3
#: replay schemes, in plotting order
SCHEMES = ("uniform", "rank", "proportional", "greedy", "oracle")
#: alpha used when a scheme is given without one (only proportional and rank use it)
DEFAULT_ALPHA = {"uniform": 0.0, "proportional": 1.0, "rank": 0.7, "greedy": 1.0, "oracle": 0.0}

__all__ = ["CSV_COLUMNS", "plot", "read_results", "summarise", "summary_markdown"]

CSV_COLUMNS = [
    "n", "memory_size", "scheme", "alpha", "beta", "init", "run", "seed", "updates",
    "censored", "final_mse", "seconds",
]  # fmt: skip


def _label(scheme: str, alpha: float, beta: float, init: str) -> str:
    """``scheme``, plus any setting that differs from the defaults."""
    label = scheme
    if scheme in ("proportional", "rank") and alpha != DEFAULT_ALPHA[scheme]:
        label += f" a={alpha:g}"
    if beta > 0.0 and scheme in ("proportional", "rank"):
        label += f" b={beta:g}"
    if init != "max" and scheme in ("proportional", "rank", "greedy"):
        label += f" init={init}"
    return label


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a ``results.csv``, typed."""
    rows = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            rows.append(
                {
                    "n": int(r["n"]),
                    "memory_size": int(r["memory_size"]),
                    "scheme": r["scheme"],
                    "alpha": float(r["alpha"]),
                    "beta": float(r["beta"]),
                    "init": r.get("init") or "max",
                    "run": int(r["run"]),
                    "seed": int(r["seed"]),
                    "updates": int(r["updates"]),
                    "censored": r["censored"] in ("1", "True", "true"),
                    "final_mse": float(r["final_mse"]),
                    "seconds": float(r["seconds"]),
                }
            )
    return rows


def _group_key(row: dict[str, Any]) -> str:
    return _label(row["scheme"], row["alpha"], row["beta"], row["init"])


def _stats(updates: Sequence[float]) -> tuple[float, float, float]:
    """Median and IQR, censored runs counted as +inf (so a median is finite only
    while fewer than half the runs are censored)."""
    arr = np.sort(np.asarray(updates, dtype=np.float64))

    def quantile(q: float) -> float:  # numpy's "linear" method, defined with inf
        h = (arr.shape[0] - 1) * q
        lo, hi = math.floor(h), math.ceil(h)
        if h == lo:
            return float(arr[lo])
        if math.isinf(arr[hi]):
            return math.inf
        return float(arr[lo] + (h - lo) * (arr[hi] - arr[lo]))

    return quantile(0.5), quantile(0.25), quantile(0.75)


def summarise(rows: Iterable[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{label: {n: {memory_size, runs, censored, median, q25, q75, min, max}}}``."""
    groups: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault(_group_key(r), {}).setdefault(r["n"], []).append(r)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for label, by_n in groups.items():
        out[label] = {}
        for n, rs in sorted(by_n.items()):
            ups = [math.inf if r["censored"] else float(r["updates"]) for r in rs]
            med, q25, q75 = _stats(ups)
            out[label][n] = {
                "memory_size": rs[0]["memory_size"],
                "runs": len(rs),
                "censored": sum(r["censored"] for r in rs),
                "median": med,
                "q25": q25,
                "q75": q75,
                "min": min(ups),
                "max": max(ups),
                "seconds": sum(r["seconds"] for r in rs),
            }
    return out


def _runs_per_cell(summ: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Runs per (scheme, n) cell: "10", or "5-10" when cells differ."""
    counts = sorted({c["runs"] for by_n in summ.values() for c in by_n.values()})
    if not counts:
        return "0"
    return str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"


def _order(labels: Iterable[str]) -> list[str]:
    def key(label: str) -> tuple[int, str]:
        base = label.split(" ")[0]
        return (SCHEMES.index(base) if base in SCHEMES else len(SCHEMES), label)

    return sorted(labels, key=key)


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "censored"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _table(
    summ: dict[str, dict[int, dict[str, Any]]],
    labels: list[str],
    ns: list[int],
    cell: Any,
) -> list[str]:
    """One row per n (few schemes) or one row per scheme (many: a sweep)."""
    mem = {n: c["memory_size"] for by_n in summ.values() for n, c in by_n.items()}
    if len(labels) <= len(ns) + 2:
        return [
            "| n | memory | " + " | ".join(labels) + " |",
            "|---:|---:|" + "---:|" * len(labels),
            *(
                f"| {n} | {mem[n]} | " + " | ".join(cell(lab, n) for lab in labels) + " |"
                for n in ns
            ),
        ]
    return [
        "| scheme | " + " | ".join(f"n={n} ({mem[n]})" for n in ns) + " |",
        "|---|" + "---:|" * len(ns),
        *(f"| {lab} | " + " | ".join(cell(lab, n) for n in ns) + " |" for lab in labels),
    ]


def summary_markdown(rows: list[dict[str, Any]], title: str = "Blind Cliffwalk") -> str:
    """Markdown tables: median [IQR] updates per n and scheme, and uniform / scheme."""
    summ = summarise(rows)
    labels = _order(summ)
    ns = sorted({n for by_n in summ.values() for n in by_n})

    def updates(lab: str, n: int) -> str:
        c = summ[lab].get(n)
        if c is None:
            return ""
        text = f"{_fmt(c['median'])} [{_fmt(c['q25'])}-{_fmt(c['q75'])}]"
        if c["censored"]:
            text += f" ({c['censored']}/{c['runs']} censored)"
        return text

    def speedup(lab: str, n: int) -> str:
        u, c = summ["uniform"].get(n), summ[lab].get(n)
        if u is None or c is None or math.isinf(u["median"]) or math.isinf(c["median"]):
            return ""
        return f"{u['median'] / max(c['median'], 1.0):.1f}x"

    per_cell = _runs_per_cell(summ)
    lines = [
        f"# {title}: updates until MSE < {THRESHOLD:g}",
        "",
        f"{per_cell} runs (seeds) per cell. Median [25th-75th percentile] over the runs "
        "(the spread of the runs, not a confidence interval); a censored run (budget "
        "exhausted) counts as +inf. Memory = 2^(n+1) - 2 transitions.",
        "",
        *_table(summ, labels, ns, updates),
    ]
    if "uniform" in summ:
        lines += [
            "",
            "Speed-up: median updates of uniform / median updates of the scheme.",
            "",
            *_table(summ, [lab for lab in labels if lab != "uniform"], ns, speedup),
        ]
    runs = max((c["runs"] for by_n in summ.values() for c in by_n.values()), default=0)
    secs = sum(c["seconds"] for by_n in summ.values() for c in by_n.values())
    lines += [
        "",
        f"{len(rows)} runs (up to {runs} per cell), {secs:,.0f} s of replay in total.",
        "",
    ]
    return "\n".join(lines)


_COLORS = {
    "uniform": "black",
    "rank": "tab:red",
    "proportional": "tab:blue",
    "greedy": "tab:green",
    "oracle": "tab:cyan",
}


def plot(
    rows: list[dict[str, Any]], path: str | os.PathLike[str], title: str | None = None
) -> None:
    """Log-log plot of median updates vs memory size, IQR bands. Imports matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise missing_extra("the Blind Cliffwalk plot", exc, "agents") from None
    summ = summarise(rows)
    fig, ax = plt.subplots(figsize=(8, 6), dpi=150)
    extra = 0
    sizes = sorted({c["memory_size"] for by_n in summ.values() for c in by_n.values()})
    if sizes:
        ax.plot(sizes, sizes, ls=":", lw=1, color="grey", label="updates = memory size")
    for lab in _order(summ):
        by_n = summ[lab]
        pts = [(c["memory_size"], c["median"], c["q25"], c["q75"]) for c in by_n.values()]
        pts = [p for p in pts if not math.isinf(p[1])]
        if not pts:
            continue
        x, med, lo, hi = (np.asarray(v, dtype=np.float64) for v in zip(*pts, strict=True))
        base = lab.split(" ")[0]
        color: Any = _COLORS.get(base) if base == lab else None
        style = "-"
        if color is None:  # a variant: its own colour, dashed
            color = plt.get_cmap("tab20")((2 * extra + 1) % 20 if extra < 10 else extra % 20)
            style = "--"
            extra += 1
        ax.plot(x, med, marker="o", ms=3, lw=1.5, ls=style, color=color, label=lab)
        hi = np.where(np.isinf(hi), np.nan, hi)
        ax.fill_between(x, lo, hi, color=color, alpha=0.18, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("transitions in replay memory (2^(n+1) - 2)")
    ax.set_ylabel(f"updates until MSE < {THRESHOLD:g}")
    runs = _runs_per_cell(summ)
    ax.set_title(
        f"{title or 'Blind Cliffwalk, tabular Q-learning'}\n"
        f"line: median of {runs} runs per point; band: 25th-75th percentile of the runs",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(summ) > 8 else 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
