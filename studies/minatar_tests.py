"""Per-seed figures and tests against uniform for one game of the MinAtar study.

    python studies/minatar_tests.py docs/results/minatar/runs/Breakout > tests_Breakout.md

Reads the runs (``fastper compare``'s loader; greedy evaluations), and writes
markdown: each seed's final return and AUC as ``fastper compare`` computes
them (final: the evaluations in the last 10% of the steps; AUC: the mean of
the evaluation curve on the compare grid), the mean evaluation return of each
scheme at each evaluation, and two-sided Welch t and Mann-Whitney U tests of
proportional and rank-based replay against uniform on both (p-values without
correction; a Bonferroni correction over the four multiplies them by 4).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from fastper.agents import analysis

WINDOW = 100  # compare's default; evaluations are not smoothed by it


def scheme_scores(root: Path) -> dict[str, dict[str, Any]]:
    """Per scheme under ``root``: its runs in seed order, their seeds, final returns and AUCs.

    As ``fastper compare`` computes them from the greedy evaluations (final:
    the evaluations in the last 10% of the steps; AUC: the mean of the
    evaluation curve on the compare grid). Also used by minatar_across.py.
    """
    runs = analysis.find_runs([root])
    grid = analysis.grid_for(runs)
    out = {}
    for g in analysis.group_runs(runs):
        group = sorted(g.runs, key=lambda r: int(r.config.get("seed", 0)))
        out[g.label] = {
            "runs": group,
            "seeds": [int(r.config.get("seed", 0)) for r in group],
            "final": np.array([analysis.final_return(r, "eval") for r in group]),
            "auc": np.array(
                [np.nanmean(analysis.smoothed_curve(r, grid, WINDOW, "eval")) for r in group]
            ),
        }
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    scores = scheme_scores(Path(argv[0]))
    groups = {label: sc["runs"] for label, sc in scores.items()}
    finals = {label: sc["final"] for label, sc in scores.items()}
    aucs = {label: sc["auc"] for label, sc in scores.items()}
    seeds = {label: sc["seeds"] for label, sc in scores.items()}
    evals = {}
    for label, group in groups.items():
        steps = group[0].eval_steps
        same = all(np.array_equal(r.eval_steps, steps) for r in group)
        evals[label] = (steps, np.mean([r.eval_returns for r in group], axis=0) if same else None)
    lines = ["Per seed, final return / AUC:", ""]
    for label in groups:
        f = " ".join(f"{x:.1f}" for x in finals[label])
        a = " ".join(f"{x:.2f}" for x in aucs[label])
        lines.append(f"* {label} (seeds {' '.join(map(str, seeds[label]))}): {f} / {a}")
    steps = next(iter(evals.values()))[0]
    lines += [
        "",
        "Mean evaluation return over the seeds at each evaluation:",
        "",
        "| steps | " + " | ".join(f"{s // 1000}k" for s in steps) + " |",
        "|---|" + "---:|" * len(steps),
    ]
    for label, (_, mean) in evals.items():
        if mean is not None:
            lines.append(f"| {label} | " + " | ".join(f"{m:.2f}" for m in mean) + " |")
    if "uniform" in groups:
        lines += [
            "",
            "Tests against uniform (two-sided; no correction in the p-values):",
            "",
            "| comparison | difference | Welch t | Mann-Whitney U |",
            "|---|---|---:|---:|",
        ]
        for label in [g for g in groups if g != "uniform"]:
            for name, table in (("AUC", aucs), ("final return", finals)):
                a, b = table[label], table["uniform"]
                welch = stats.ttest_ind(a, b, equal_var=False).pvalue
                mwu = stats.mannwhitneyu(a, b, alternative="two-sided").pvalue
                change = (a.mean() / b.mean() - 1) * 100 if b.mean() else float("nan")
                lines.append(
                    f"| {label} vs uniform, {name} | {change:+.0f}% ({a.mean():.2f} vs "
                    f"{b.mean():.2f}) | p = {welch:.3g} | p = {mwu:.3g} |"
                )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
