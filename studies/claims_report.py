"""Verdicts on the proposed PER variants (studies/claims.sh), from the runs.

    python studies/claims_report.py [ROOT] [--stage 1|2] [--seeds LO-HI] > verdicts.md

ROOT (default runs/claims) holds ``<claim>/<arm>/<run>/seed-<k>/``; ``--seeds``
keeps the runs whose seed lies in LO..HI (default: every seed found).

For every claim with finished runs of both arms, the baseline arm (the
paper's recipe) and the claimed arm are compared on the claim's primary
metric, fixed here before any run finished:

* ``final``: the greedy evaluations in the last 10% of the steps (``fastper
  compare``'s final return);
* ``early``: the mean of the evaluation curve over the first half of the run
  ("sample efficiency early");
* ``auc``: the mean of the evaluation curve over the whole run (secondary for
  every claim).

Gains are relative to the baseline arm's mean: (arm - base) / |base| (on
Pendulum, whose returns are negative, a return 12% closer to 0 is +12%).
Tests are two-sided Welch t (with its 95% interval on the difference of
means) and Mann-Whitney U; the six primary p-values are also Holm-corrected.

Verdict rule (primary metric):

* **supported**: the arm is better and the Holm-corrected Welch p < 0.05;
* **not supported**: the 95% interval's upper end lies below the claimed gain
  (the claimed size is excluded; for claims that give no size, a gain of 10%
  is taken as the smallest worth having);
* **inconclusive**: anything else (the interval holds both no gain and the
  claimed gain).

Stage 2 (``--stage 2``, docs/results/claims/README.md), fixed after stage 1
was seen and before any of its runs: the four CartPole claims that stage 1
judged on final return, which sits at CartPole's ceiling of 500, are judged
on ``auc``; the other two keep their metric. ``new_priority``'s arm is
``last_td`` (the largest priority of the latest learning batch): stage 1's
``max_td`` arm trained bit for bit as its baseline did. Each table also says
whether the claimed gain fits under the environment's highest return
(``CEILING``): where it does not, "not supported" is forced by the ceiling and
says nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy import stats as sps

from fastper.agents import analysis, stats

SMALLEST_GAIN = 0.10  # for claims without a size
CEILING = {"CartPole-v1": 500.0, "Pendulum-v1": 0.0}  # the highest return an episode can have
STAGE2_METRIC = {
    "adaptive_alpha": "auc",
    "hybrid": "auc",
    "grad_clip": "auc",
    "new_priority": "auc",
}
# stage 1's max_td arm trained bit for bit as its baseline did (new transitions pass the
# top priority on): stage 2 tests the claim with the latest batch's max instead
STAGE2_ARM = {"new_priority": "last_td"}


@dataclass(frozen=True)
class Claim:
    name: str
    text: str
    base: str  # arm directory of the baseline
    arm: str  # arm directory of the claimed change
    metric: str  # "final", "early" or "auc"
    gain: float | None  # the claimed relative gain, None when the seed gives none


CLAIMS = (
    Claim(
        "cosine_beta",
        "cosine annealing of beta beats linear by ~12% final return",
        "linear",
        "cosine",
        "final",
        0.12,
    ),
    Claim(
        "batch_norm",
        "IS weights normalised by the batch max give ~15% better sample efficiency early",
        "buffer",
        "batch",
        "early",
        0.15,
    ),
    Claim(
        "adaptive_alpha",
        "an adaptive alpha schedule (lower early, higher late) gains ~14%",
        "constant",
        "adaptive",
        "final",
        0.14,
    ),
    Claim(
        "hybrid",
        "rank-based early, proportional later, Gaussian noise on priorities late",
        "proportional",
        "hybrid",
        "final",
        None,
    ),
    Claim("grad_clip", "clip gradients at 0.5 x max IS weight", "norm10", "is_half", "final", None),
    Claim(
        "new_priority",
        "new priority = max TD error + 1e-5 (vs the max priority ever seen)",
        "ever",
        "max_td",
        "final",
        None,
    ),
)


def scores(runs: list[analysis.Run], metric: str) -> np.ndarray:
    """Per run (seed order), the metric from its greedy evaluations."""
    grid = analysis.grid_for(runs)
    if metric == "final":
        return np.array([analysis.final_return(r, "eval") for r in runs])
    if metric == "early":
        grid = grid[grid <= grid[-1] / 2]
    return np.array([np.nanmean(analysis.smoothed_curve(r, grid, 1, "eval")) for r in runs])


def for_stage(claim: Claim, stage: int) -> Claim:
    """The claim as stage 1 or 2 judges it: stage 2's arm and primary metric where they differ."""
    if stage == 1:
        return claim
    return replace(
        claim,
        arm=STAGE2_ARM.get(claim.name, claim.arm),
        metric=STAGE2_METRIC.get(claim.name, claim.metric),
    )


def needed(base: np.ndarray, gain: float | None) -> float:
    """The claimed gain in the metric's units: ``gain`` (None: ``SMALLEST_GAIN``) x |base mean|."""
    return (gain if gain is not None else SMALLEST_GAIN) * abs(base.mean())


def load_arm(path: Path, seeds: tuple[int, int] | None = None) -> list[analysis.Run]:
    """The finished runs under ``path`` in seed order, only seeds in ``seeds`` (inclusive) if given."""
    runs = analysis.find_runs([path]) if path.is_dir() else []
    if seeds is not None:
        runs = [r for r in runs if seeds[0] <= int(r.config.get("seed", 0)) <= seeds[1]]
    return sorted(runs, key=lambda r: int(r.config.get("seed", 0)))


def attainable(base: np.ndarray, gain: float | None, env: str) -> bool:
    """Whether base mean + the claimed gain stays within the environment's highest return."""
    return bool(base.mean() + needed(base, gain) <= CEILING.get(env, np.inf))


def parse_seeds(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be LO-HI or K, got {text!r}") from None
    if pair[0] > pair[1]:
        raise argparse.ArgumentTypeError(f"--seeds must have LO <= HI, got {text!r}")
    return pair


@dataclass
class Result:
    claim: Claim
    base: dict[str, np.ndarray]
    arm: dict[str, np.ndarray]
    seeds: tuple[list[int], list[int]]
    env: str
    steps: int
    p_welch: float = float("nan")
    p_holm: float = float("nan")
    verdict: str = "inconclusive"


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Two-sided Welch p-value and 95% interval of mean(a) - mean(b) (NaN below 2 runs each)."""
    if a.size < 2 or b.size < 2:
        return float("nan"), float("nan"), float("nan")
    t = sps.ttest_ind(a, b, equal_var=False)
    ci = t.confidence_interval(0.95)
    return float(t.pvalue), float(ci.low), float(ci.high)


def holm(p: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN, not counted)."""
    idx = [i for i, x in enumerate(p) if np.isfinite(x)]
    order = sorted(idx, key=lambda i: p[i])
    out = [float("nan")] * len(p)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * p[i]))
        out[i] = running
    return out


def verdict(arm: np.ndarray, base: np.ndarray, gain: float | None, p_holm: float) -> str:
    """The verdict rule of the module docstring on one claim's primary metric.

    ``gain`` is the claimed relative gain (None: ``SMALLEST_GAIN``); ``p_holm`` the
    claim's Holm-corrected Welch p-value.
    """
    _, _, hi = welch(arm, base)
    if arm.mean() > base.mean() and p_holm < 0.05:
        return "supported"
    if np.isfinite(hi) and hi < needed(base, gain):
        return "not supported"
    return "inconclusive"


def fmt_est(e: stats.Estimate) -> str:
    if np.isfinite(e.low):
        return f"{e.value:.4g} [{e.low:.4g}, {e.high:.4g}]"
    return f"{e.value:.4g}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="claims_report.py", description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default="runs/claims", type=Path)
    parser.add_argument("--stage", type=int, choices=(1, 2), default=1)
    parser.add_argument("--seeds", type=parse_seeds, default=None, help="LO-HI (inclusive)")
    args = parser.parse_args(argv)
    root, stage = args.root, args.stage
    backend = stats.stats_backend("auto")
    results = []
    for c in (for_stage(c0, stage) for c0 in CLAIMS):
        base = load_arm(root / c.name / c.base, args.seeds)
        arm = load_arm(root / c.name / c.arm, args.seeds)
        if not base or not arm:
            continue
        r = Result(
            c,
            {m: scores(base, m) for m in ("final", "early", "auc")},
            {m: scores(arm, m) for m in ("final", "early", "auc")},
            (
                [int(x.config.get("seed", 0)) for x in base],
                [int(x.config.get("seed", 0)) for x in arm],
            ),
            str(base[0].meta.get("env_id", "?")),
            base[0].total_steps,
        )
        r.p_welch = welch(r.arm[c.metric], r.base[c.metric])[0]
        results.append(r)
    if not results:
        print(f"no claim with finished runs of both arms under {root}", file=sys.stderr)
        return 1
    for r, p in zip(results, holm([r.p_welch for r in results]), strict=True):
        r.p_holm = p
        r.verdict = verdict(r.arm[r.claim.metric], r.base[r.claim.metric], r.claim.gain, p)
    seeds = "every seed found" if args.seeds is None else f"seeds {args.seeds[0]}-{args.seeds[1]}"
    lines = [
        f"Stage {stage}, {seeds}. Primary metric per claim as fixed in "
        f"`studies/claims_report.py`; n = seeds per arm; mean and IQM with 95% percentile "
        f"bootstrap intervals over seeds (fixed seed; IQM: {backend.note}); "
        f"gain = (arm - base) / |base|, with Welch's 95% interval of the difference of means; "
        f"Welch and Mann-Whitney two-sided; Holm over the "
        f"{len(results)} primary tests; 'fits' = whether base + the claimed gain stays within "
        f"the environment's highest return (where not, 'not supported' is forced by the ceiling).",
        "",
        "| claim | env, steps | metric | n | base: mean [CI] | arm: mean [CI] | gain [95% CI] | "
        "claimed | fits | Welch p (Holm) | MWU p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.claim
        a, b = r.arm[c.metric], r.base[c.metric]
        _, lo, hi = welch(a, b)
        mwu = (
            sps.mannwhitneyu(a, b, alternative="two-sided").pvalue
            if min(a.size, b.size)
            else np.nan
        )
        scale = abs(b.mean()) or np.nan
        gain = f"{(a.mean() - b.mean()) / scale:+.0%} [{lo / scale:+.0%}, {hi / scale:+.0%}]"
        claimed = f"+{c.gain:.0%}" if c.gain is not None else f"none (>= +{SMALLEST_GAIN:.0%})"
        lines.append(
            f"| {c.name} | {r.env}, {r.steps:,} | {c.metric} | {b.size} / {a.size} | {c.base} "
            f"{fmt_est(stats.mean_ci(b))} | {c.arm} {fmt_est(stats.mean_ci(a))} | {gain} | "
            f"{claimed} | {'yes' if attainable(b, c.gain, r.env) else 'no'} | "
            f"{r.p_welch:.3g} ({r.p_holm:.3g}) | {mwu:.3g} | **{r.verdict}** |"
        )
    for r in results:
        c = r.claim
        lines += [
            "",
            f'## {c.name}: "{c.text}"',
            "",
            f"{r.env}, {r.steps:,} steps; base `{c.base}` seeds {r.seeds[0]}, arm `{c.arm}` "
            f"seeds {r.seeds[1]}; primary metric `{c.metric}`.",
            "",
            "| metric | arm | n | per seed | mean [95% CI] | IQM [95% CI] |",
            "|---|---|---|---|---|---|",
        ]
        for m in ("final", "early", "auc"):
            for name, v in ((c.base, r.base[m]), (c.arm, r.arm[m])):
                per = " ".join(f"{x:.4g}" for x in v)
                lines.append(
                    f"| {m} | {name} | {v.size} | {per} | {fmt_est(stats.mean_ci(v))} | "
                    f"{fmt_est(stats.iqm_ci(v, backend))} |"
                )
        lines += [
            "",
            "| metric | gain | Welch p | 95% CI of the difference | Mann-Whitney p |",
            "|---|---|---:|---|---:|",
        ]
        for m in ("final", "early", "auc"):
            a, b = r.arm[m], r.base[m]
            p, lo, hi = welch(a, b)
            mwu = sps.mannwhitneyu(a, b, alternative="two-sided").pvalue
            scale = abs(b.mean()) or np.nan
            lines.append(
                f"| {m} | {(a.mean() - b.mean()) / scale:+.1%} | {p:.3g} | "
                f"[{lo:.4g}, {hi:.4g}] | {mwu:.3g} |"
            )
        lines += ["", f"Verdict: **{r.verdict}**."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
