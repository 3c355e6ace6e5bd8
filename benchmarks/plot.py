"""peers.png: time vs capacity (log-log), one subplot per op, one line per library."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from adapters import ADAPTERS  # noqa: E402

PANELS = [
    ("fill", "fill: init + add to capacity", "time per transition (µs, median)"),
    ("sample", "sample: indices + weights + data", "time per call (µs, median)"),
    ("update", "update priorities", "time per call (µs, median)"),
    ("learner_step", "learner step: sample + update", "time per call (µs, median)"),
    ("memory", "memory of the filled buffer", "resident memory per slot (bytes)"),
]
#: an absolute path's folders (a reason's file names keep their last two parts only)
_FOLDERS = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+(?=[\w.+-]+/[\w.+-]+)")
COLORS = {"fastper": "C3", "cpprb": "C0", "tianshou": "C2", "torchrl": "C1"}


def plot(results: list[dict[str, Any]], path: Path, batch: int = 256) -> None:
    """Write the figure for batch size ``batch`` (fill and memory do not depend on it)."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    flat = list(axes.flat)
    for ax, (op, title, unit) in zip(flat, PANELS, strict=False):
        for lib in ADAPTERS:
            pts = []
            for r in results:
                if r["lib"] != lib:
                    continue
                for row in r.get("rows", []):
                    if row["op"] != op or (op not in ("fill", "memory") and row["batch"] != batch):
                        continue
                    v = row["bytes_per_slot"] if op == "memory" else row["median_us"]
                    if v is not None and v > 0:
                        pts.append((r["capacity"], v, bool(row["extrapolated"])))
            if not pts:
                continue
            pts.sort()
            xs, ys, ex = zip(*pts, strict=True)
            extrapolated = any(ex)
            label = lib + (" (extrapolated)" if extrapolated else "")
            ax.plot(
                xs,
                ys,
                marker="o",
                linestyle="--" if extrapolated else "-",
                markerfacecolor="none" if extrapolated else COLORS[lib],
                color=COLORS[lib],
                label=label,
            )
        ax.set_xscale("log", base=2)
        if op != "memory":
            ax.set_yscale("log")
        title_b = f"{title} (B={batch})" if op not in ("fill", "memory") else title
        ax.set_title(title_b, fontsize=10)
        ax.set_xlabel("buffer capacity N (transitions)")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    notes = flat[-1]
    notes.axis("off")
    lines = ["Libraries not measured:"]
    seen: set[str] = set()
    for r in results:
        if not r.get("available") and r["lib"] not in seen:
            seen.add(r["lib"])
            reason = _FOLDERS.sub("", str(r.get("reason")))  # no machine paths in the figure
            lines.append(f"{r['lib']}: " + _wrap(reason, 60))
    if len(lines) == 1:
        lines = ["All libraries measured."]
    lines += ["", "Medians; dashed, hollow: fill extrapolated", "from timed single adds."]
    notes.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=8, family="monospace")
    fig.suptitle("fastper vs peers: proportional PER (alpha 0.6, beta 0.4), lower is better")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _wrap(text: str, width: int, max_lines: int = 4) -> str:
    """Hard-wrap ``text`` to ``width`` columns, at most ``max_lines`` lines."""
    chunks = [text[i : i + width] for i in range(0, len(text), width)]
    if len(chunks) > max_lines:
        chunks = chunks[:max_lines]
        chunks[-1] = chunks[-1][:-3] + "..."
    return "\n  ".join(chunks)
