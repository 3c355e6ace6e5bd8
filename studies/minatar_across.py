"""Across games of the MinAtar study: IQM of scores relative to uniform replay.

    python studies/minatar_across.py [docs/results/minatar/runs] > across_games.md

For every game directory with finished runs of all three schemes, each run's
final return and AUC (as ``fastper compare`` computes them from the greedy
evaluations) are divided by the mean of uniform replay's runs on that game
(so 1.0 is uniform's average there; MinAtar has no human scores to normalise
by). Per scheme the scores form a runs x games matrix; its interquartile
mean (IQM) with a 95% stratified bootstrap interval (rliable when installed,
else scipy; resampling runs within each game) summarises the games, as
rliable's aggregate metrics do. Uniform's own IQM is near, not exactly, 1:
its runs spread around their mean.
A game where uniform's mean return or AUC is not above 0 is left out and
named below the table: a ratio to it would mean nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from minatar_tests import scheme_scores  # this folder: run as python studies/...

from fastper.agents import stats

SCHEMES = ("uniform", "per", "rank")


def game_scores(root: Path) -> dict[str, dict[str, np.ndarray]] | None:
    """{scheme: {"final": per-run, "auc": per-run}} for one game, or None if a scheme is missing."""
    scores = scheme_scores(root)
    if not all(s in scores for s in SCHEMES):
        return None
    return {s: {"final": scores[s]["final"], "auc": scores[s]["auc"]} for s in SCHEMES}


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "docs/results/minatar/runs")
    games, left_out = {}, []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        got = game_scores(d)
        if got is None:
            continue
        if min(got["uniform"]["final"].mean(), got["uniform"]["auc"].mean()) <= 0:
            # a ratio to uniform's mean means nothing when that mean is not positive
            left_out.append(d.name)
            continue
        games[d.name] = got
    if not games:
        print(f"no game with finished runs of {', '.join(SCHEMES)} under {root}", file=sys.stderr)
        return 1
    backend = stats.stats_backend("auto")
    n = min(len(g[s]["final"]) for g in games.values() for s in SCHEMES)
    lines = [
        f"Games: {', '.join(games)} ({n} runs (seeds) per scheme and game; scores divided by "
        f"uniform's mean on the game; IQM [95% percentile bootstrap CI, runs resampled within "
        f"each game, fixed seed], {backend.note})",
        "",
        "| scheme | n (runs x games) | final return: IQM [CI] | AUC: IQM [CI] | "
        "final return per game (mean) |",
        "|---|---|---|---|---|",
    ]
    for s in SCHEMES:
        cols = {}
        for metric in ("final", "auc"):
            mat = np.column_stack(
                [g[s][metric][:n] / g["uniform"][metric].mean() for g in games.values()]
            )
            est = stats.iqm_ci(mat, backend)
            cols[metric] = f"{est.value:.2f} [{est.low:.2f}, {est.high:.2f}]"
        per_game = ", ".join(
            f"{name} {g[s]['final'].mean() / g['uniform']['final'].mean():.2f}"
            for name, g in games.items()
        )
        lines.append(f"| {s} | {n} x {len(games)} | {cols['final']} | {cols['auc']} | {per_game} |")
    if left_out:
        lines += ["", f"Left out (uniform's mean return or AUC not above 0): {', '.join(left_out)}"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
