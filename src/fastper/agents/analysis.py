"""Learning curves across seeds: loading runs, metrics with confidence intervals, plots.

A run is a directory holding ``config.json`` and ``episodes.csv`` (written by
``fastper train``), and ``evaluations.csv`` when the agent evaluated its
greedy policy during training (a run kept with ``evaluations.csv`` only is
read too: it serves evaluation returns). Runs are grouped by ``(algo, env_id,
replay)`` plus any other setting that differs between runs of the same
scheme, so runs with different hyperparameters never end up averaged
together silently.

Which returns. Evaluation returns (``evaluations.csv``: one row per greedy
evaluation episode, columns ``step,episode,return,length``; each evaluation
counts as the mean of its episodes) are used when every run has them, the
training episodes (the behaviour policy, exploring) otherwise; ``returns=``
picks one, and every output says which was used.

Curves: a seed's curve at step t is the mean of its last ``window`` training
episodes finished by t, or its latest evaluation by t (evaluations are not
smoothed further: each already averages several episodes). Metrics per seed:

* final return: the mean of the evaluations (or training episodes) in the
  last 10% of the steps (the last evaluation if none falls there);
* area under the curve: the mean of the curve over the step grid (the
  average return during training; higher is better);
* steps to threshold: the first step at which the curve reaches the
  threshold (for training episodes only full windows count; +inf if never).

Across seeds (``n`` of them), every interval is a 95% percentile bootstrap
over the seeds with a fixed seed (:mod:`fastper.agents.stats`), so the same
runs give the same table: the final return as a mean
(:func:`~fastper.agents.stats.mean_ci`) and as an interquartile mean (IQM:
the mean of the middle 50% of the runs, stratified per task; rliable, extra
``stats``, when it imports, else scipy; the output names the one used); AUC
as a mean; steps to threshold as the median (never reaching = +inf). A
bootstrap interval of the mean never leaves the range of the seeds' values,
so an interval of a bounded return stays within its bounds.

Few seeds: below 5 seeds a bootstrap interval is too narrow (it cannot leave
the seeds' range, and from 2 seeds it is close to that range); tables flag
it ``(n=2: few)``. Plots draw the mean and the same 95% bootstrap band
(:func:`~fastper.agents.stats.mean_band`), and below 5 seeds each seed's
curve too. The y-axis always follows the curves drawn.

Needs numpy and scipy; plots need matplotlib; rliable is optional.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._common import CONFIG_JSON, EPISODES_CSV, REPLAYS, SUMMARY_JSON
from .stats import (
    BOOTSTRAP_REPS,
    CONFIDENCE,
    FEW_SEEDS,
    Backend,
    Estimate,
    iqm_ci,
    mean_band,
    mean_ci,
    median_ci,
    performance_profile,
    stats_backend,
)

EVALUATIONS_CSV = "evaluations.csv"
#: ``returns=`` choices: greedy evaluations or training (behaviour-policy) episodes
RETURNS = ("eval", "train")


@dataclass
class Run:
    """One training run: its settings, training episodes and evaluations."""

    path: Path
    config: dict[str, Any]
    meta: dict[str, Any]
    steps: np.ndarray  # step at which each training episode ended
    returns: np.ndarray  # return of each training episode
    eval_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    eval_returns: np.ndarray = field(default_factory=lambda: np.zeros(0))  # mean per evaluation
    eval_episodes: int = 0  # episodes per evaluation (the most seen)
    has_episodes: bool = True  # an episodes.csv was there (its rows may be none)

    @property
    def total_steps(self) -> int:
        return int(self.config.get("total_steps", self.steps[-1] if self.steps.size else 0))

    @property
    def has_evaluations(self) -> bool:
        return self.eval_steps.size > 0

    def points(self, returns: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, returns) of the training episodes or of the evaluations."""
        if returns == "eval":
            return self.eval_steps, self.eval_returns
        return self.steps, self.returns


@dataclass
class Group:
    """Runs of one scheme: same algorithm, environment, replay and settings."""

    label: str
    runs: list[Run] = field(default_factory=list)


def _read_csv(path: Path, needed: Sequence[str]) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in needed if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{path} must have the columns {','.join(needed)}, got {reader.fieldnames}"
            )
        return list(reader)


def _read_evaluations(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Each evaluation's step and mean return, and the most episodes one had."""
    by_step: dict[int, list[float]] = {}
    for row in _read_csv(path, ("step", "episode", "return", "length")):
        by_step.setdefault(int(row["step"]), []).append(float(row["return"]))
    steps = np.array(sorted(by_step), dtype=np.int64)
    means = np.array([np.mean(by_step[int(s)]) for s in steps], dtype=np.float64)
    return steps, means, max((len(v) for v in by_step.values()), default=0)


def _is_run(p: Path) -> bool:
    """A run directory: ``config.json`` and the episodes, the evaluations or both."""
    has_log = (p / EPISODES_CSV).is_file() or (p / EVALUATIONS_CSV).is_file()
    return (p / CONFIG_JSON).is_file() and has_log


def load_run(path: str | Path) -> Run:
    """Read one run directory: ``config.json`` with ``episodes.csv``, ``evaluations.csv`` or both.

    A run kept with its evaluations only (e.g. published without the
    training-episode log) serves evaluation returns; asking it for training
    returns is refused by :func:`choose_returns`.

    Raises:
        ValueError: not a run directory, or a CSV without its columns.
    """
    p = Path(path)
    cfg_file, ep_file = p / CONFIG_JSON, p / EPISODES_CSV
    if not _is_run(p):
        raise ValueError(
            f"`path` must be a run directory with {CONFIG_JSON} and {EPISODES_CSV} or "
            f"{EVALUATIONS_CSV}, got {p}"
        )
    record = json.loads(cfg_file.read_text())
    rows = _read_csv(ep_file, ("step", "return")) if ep_file.is_file() else []
    run = Run(
        path=p,
        config=dict(record.get("config", {})),
        meta={k: v for k, v in record.items() if k != "config"},
        steps=np.array([int(r["step"]) for r in rows], dtype=np.int64),
        returns=np.array([float(r["return"]) for r in rows], dtype=np.float64),
        has_episodes=ep_file.is_file(),
    )
    if (p / EVALUATIONS_CSV).is_file():
        run.eval_steps, run.eval_returns, run.eval_episodes = _read_evaluations(p / EVALUATIONS_CSV)
    return run


def find_runs(dirs: Iterable[str | Path], include_unfinished: bool = False) -> list[Run]:
    """Every run directory at or below the given directories, sorted by path.

    Runs without ``summary.json`` are still running (or died) and are left
    out unless ``include_unfinished``; a note on stderr says how many.
    """
    dirs = list(dirs)
    found: dict[Path, Run] = {}
    unfinished = 0
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise ValueError(f"`dirs` must exist, got {root}")
        for cfg in sorted(root.rglob(CONFIG_JSON)):
            if not _is_run(cfg.parent):
                continue
            if not include_unfinished and not (cfg.parent / SUMMARY_JSON).is_file():
                unfinished += 1
                continue
            found[cfg.parent.resolve()] = load_run(cfg.parent)
    if unfinished:
        print(f"note: left out {unfinished} unfinished run(s) (no {SUMMARY_JSON})", file=sys.stderr)
    if not found:
        raise ValueError(
            f"no finished runs ({CONFIG_JSON} + {EPISODES_CSV} or {EVALUATIONS_CSV}) "
            f"found under {dirs}"
        )
    return [found[k] for k in sorted(found)]


# not grouping keys: seeds vary by design, replay and env are in the base key, and
# runs of one scheme with different lengths stay one scheme (curves cut to the shortest)
_IGNORED = {"seed", "device", "replay", "env_id", "total_steps"}


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Group runs by (algo, env, replay) and every other differing setting."""
    keys: dict[tuple[Any, ...], Group] = {}
    all_keys = sorted({k for r in runs for k in r.config} - _IGNORED)
    varying = [
        k for k in all_keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1
    ]
    one_env = len({(r.meta.get("algo"), r.meta.get("env_id")) for r in runs}) == 1
    for r in runs:
        base = (r.meta.get("algo", "?"), r.meta.get("env_id", "?"), r.meta.get("replay", "?"))
        extra = tuple((k, json.dumps(r.config.get(k), sort_keys=True)) for k in varying)
        key = base + extra
        if key not in keys:
            label = base[2] if one_env else " ".join(map(str, base))
            if extra:
                label += " (" + ", ".join(f"{k}={v}" for k, v in extra) + ")"
            keys[key] = Group(label)
        keys[key].runs.append(r)
    order = {name: i for i, name in enumerate(REPLAYS)}
    return sorted(
        keys.values(), key=lambda g: (order.get(g.runs[0].meta.get("replay", ""), 9), g.label)
    )


# ---------------------------------------------------------------------------
# which returns
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReturnsUsed:
    """The returns an analysis used: ``kind`` is "eval" or "train"; ``note`` says so."""

    kind: str
    note: str
    label: str  # y-axis label


def choose_returns(runs: Sequence[Run], returns: str | None = None) -> ReturnsUsed:
    """Evaluation returns if asked for or (``returns=None``) if every run has them, else training.

    Raises:
        ValueError: ``returns`` not in :data:`RETURNS`, "eval" while some
            run has no evaluations, or training returns (asked for, or the
            fallback) while some run has no ``episodes.csv``.
    """
    if returns is not None and returns not in RETURNS:
        raise ValueError(f"`returns` must be one of {list(RETURNS)}, got returns={returns!r}")
    lacking = [r for r in runs if not r.has_evaluations]
    if returns == "eval" and lacking:
        raise ValueError(
            f"--returns eval needs {EVALUATIONS_CSV} with at least one row in every run; "
            f"{len(lacking)} of {len(runs)} runs have none, e.g. {lacking[0].path}"
        )
    if returns == "eval" or (returns is None and not lacking):
        k = max(r.eval_episodes for r in runs)
        return ReturnsUsed(
            "eval",
            f"returns: greedy evaluations from {EVALUATIONS_CSV}, each the mean of its "
            f"episodes ({k} at most)",
            f"evaluation return (greedy, mean of {k} episodes)",
        )
    no_log = [r for r in runs if not r.has_episodes]
    if no_log:
        raise ValueError(
            f"training returns need {EPISODES_CSV} in every run; {len(no_log)} of {len(runs)} "
            f"runs have only {EVALUATIONS_CSV}, e.g. {no_log[0].path}"
            + ("" if returns == "train" else f", and {len(lacking)} have no evaluations")
        )
    why = (
        ""
        if returns == "train"
        else f"; {len(lacking)} of {len(runs)} runs have no {EVALUATIONS_CSV}"
        if len(lacking) < len(runs)
        else f"; no {EVALUATIONS_CSV} in these runs"
    )
    return ReturnsUsed(
        "train",
        f"returns: training episodes (behaviour policy, exploring){why}",
        "training episode return",
    )


# ---------------------------------------------------------------------------
# per-run metrics
# ---------------------------------------------------------------------------


def _moving(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each index (fewer at the start)."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    k = np.arange(1, values.size + 1)
    lo = np.maximum(k - window, 0)
    return (c[k] - c[lo]) / (k - lo)


def smoothed_curve(run: Run, grid: np.ndarray, window: int, returns: str = "train") -> np.ndarray:
    """The run's curve at each grid step (NaN before its first episode or evaluation).

    Training: the mean of the last ``window`` episodes finished by the step.
    Evaluations: the latest evaluation by the step (``window`` is not used).
    """
    steps, values = run.points(returns)
    if values.size == 0:
        return np.full(grid.shape, np.nan)
    ma = _moving(values, window if returns == "train" else 1)
    pos = np.searchsorted(steps, grid, side="right")  # points up to each step
    out = np.full(grid.shape, np.nan)
    ok = pos > 0
    out[ok] = ma[pos[ok] - 1]
    return out


def steps_to_threshold(run: Run, threshold: float, window: int, returns: str = "train") -> float:
    """First step where the curve >= threshold (inf if never).

    Training episodes: only full windows count (the first ``window - 1``
    episodes cannot qualify). Evaluations: the first evaluation that does.
    """
    steps, values = run.points(returns)
    w = window if returns == "train" else 1
    if values.size < w:
        return math.inf
    c = np.concatenate([[0.0], np.cumsum(values)])
    ma = (c[w:] - c[:-w]) / w
    hit = np.nonzero(ma >= threshold)[0]
    return float(steps[hit[0] + w - 1]) if hit.size else math.inf


def final_return(run: Run, returns: str = "train") -> float:
    """Mean return in the last 10% of the run's steps (evaluations: the last one if none there)."""
    steps, values = run.points(returns)
    tail = steps > 0.9 * run.total_steps
    if tail.any():
        return float(values[tail].mean())
    if returns == "eval" and values.size:
        return float(values[-1])
    return math.nan


def grid_for(runs: Sequence[Run], points: int = 200) -> np.ndarray:
    """``points`` evenly spaced steps up to the shortest run's length."""
    total = min(r.total_steps for r in runs)
    return np.linspace(total / points, total, points).round().astype(np.int64)


# ---------------------------------------------------------------------------
# the comparison table
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """One scheme's metrics across its ``n`` seeds (see the module docstring)."""

    label: str
    n: int
    finals: tuple[float, ...]  # each seed's final return
    final: Estimate  # mean, bootstrap interval
    final_iqm: Estimate  # IQM, stratified bootstrap interval
    auc: Estimate  # mean, bootstrap interval
    reached: int
    to_threshold: Estimate  # median, bootstrap interval


@dataclass(frozen=True)
class Comparison:
    """Per-scheme summaries and what they were computed from."""

    rows: list[Summary]
    threshold: float | None
    window: int
    returns: ReturnsUsed
    backend: Backend


def summarise(
    groups: Sequence[Group],
    threshold: float | None,
    window: int,
    returns: str | None = None,
    backend: str = "auto",
    reps: int = BOOTSTRAP_REPS,
) -> Comparison:
    """Per-group metrics (see the module docstring).

    ``threshold=None`` takes the environment's registered reward threshold,
    if any; ``returns`` and ``backend``: see :func:`choose_returns` and
    :func:`stats_backend`.
    """
    all_runs = [r for g in groups for r in g.runs]
    used = choose_returns(all_runs, returns)
    kind = used.kind
    stats_by = stats_backend(backend)
    grid = grid_for(all_runs)
    if threshold is None:
        threshold = default_threshold(all_runs[0].meta.get("env_id", ""))
    out = []
    for g in groups:
        finals = np.array([final_return(r, kind) for r in g.runs])
        curves = [smoothed_curve(r, grid, window, kind) for r in g.runs]
        aucs = [float(np.nanmean(c)) if np.isfinite(c).any() else math.nan for c in curves]
        tts = np.array(
            [steps_to_threshold(r, threshold, window, kind) for r in g.runs]
            if threshold is not None
            else []
        )
        ok = finals[np.isfinite(finals)]
        out.append(
            Summary(
                label=g.label,
                n=len(g.runs),
                finals=tuple(float(f) for f in finals),
                final=mean_ci(finals, reps),
                final_iqm=iqm_ci(ok, stats_by, reps) if ok.size else Estimate(math.nan),
                auc=mean_ci(np.array(aucs), reps),
                reached=int(np.isfinite(tts).sum()),
                to_threshold=median_ci(tts) if tts.size else Estimate(math.nan),
            )
        )
    return Comparison(out, threshold, window, used, stats_by)


def default_threshold(env_id: str) -> float | None:
    """The environment's registered reward threshold, if gymnasium knows one."""
    try:
        import gymnasium as gym

        return gym.spec(env_id).reward_threshold
    except Exception:  # noqa: BLE001 - unknown env or no gymnasium: no threshold
        return None


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "never"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _fmt_ci(e: Estimate, flag_n: int | None = None) -> str:
    if math.isnan(e.low):
        return _fmt(e.value)
    text = f"{_fmt(e.value)} [{_fmt(e.low)}, {_fmt(e.high)}]"
    if flag_n is not None and flag_n < FEW_SEEDS:
        text += f" (n={flag_n}: few)"
    return text


def compare_table(
    groups: Sequence[Group],
    threshold: float | None,
    window: int,
    returns: str | None = None,
    backend: str = "auto",
) -> str:
    """A markdown table, one row per scheme, and notes saying what was computed how.

    Columns: n (seeds), final return as mean and as IQM, AUC as mean, each
    with a 95% bootstrap interval over seeds, and, with a threshold, how many
    seeds reached it and the median steps to it.
    """
    c = summarise(groups, threshold, window, returns, backend)
    thr = c.threshold
    head = [
        "scheme",
        "n (seeds)",
        "final return: mean [95% CI]",
        "final return: IQM [95% CI]",
        "AUC: mean [95% CI]",
    ]
    if thr is not None:
        head += [f"reached {thr:g}", f"steps to {thr:g}: median [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in c.rows:
        cells = [s.label, str(s.n), _fmt_ci(s.final, s.n), _fmt_ci(s.final_iqm, s.n),
                 _fmt_ci(s.auc, s.n)]  # fmt: skip
        if thr is not None:
            cells += [f"{s.reached}/{s.n}", _fmt_ci(s.to_threshold)]
        lines.append("| " + " | ".join(cells) + " |")
    kind = "evaluations" if c.returns.kind == "eval" else "training episodes"
    smooth = (
        "each evaluation as is"
        if c.returns.kind == "eval"
        else f"moving average of {window} episodes"
    )
    seeds = sorted({s.n for s in c.rows})
    per_scheme = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    notes = [
        "",
        f"- {per_scheme} seed{'' if seeds == [1] else 's'} per scheme (column n).",
        f"- {c.returns.note}.",
        f"- CIs: {CONFIDENCE:.0%} percentile bootstrap over seeds ({BOOTSTRAP_REPS:,} resamples, "
        "fixed seed: the same runs give the same table); an interval of a mean stays within "
        "the seeds' lowest and highest value.",
        f"- final return: per seed, the mean of the {kind} in the last 10% of the steps; "
        "its mean, and its IQM (mean of the middle 50% of seeds, resampled per task; "
        f"{c.backend.note}).",
        f"- AUC: the mean of each seed's curve ({smooth}) over the steps.",
    ]
    if any(s.n < FEW_SEEDS for s in c.rows):
        notes.append(
            f"- (n=K: few): fewer than {FEW_SEEDS} seeds. A bootstrap interval from so few is "
            "too narrow (it cannot leave the seeds' range; from 2 seeds it is about that "
            "range): read it as the spread seen, not as 95% confidence. Run more seeds to "
            "settle a comparison."
        )
    if thr is not None:
        notes.append(
            f"- steps to {thr:g}: first step where the curve ({smooth}) reaches it; median "
            "with a 95% bootstrap interval (its bounds are seeds' values), 'never' = not reached."
        )
    return "\n".join(lines) + "\n" + "\n".join(notes)


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(runs: Sequence[Run]) -> str:
    env = runs[0].meta.get("env_id", "")
    algo = {"dqn": "Double DQN", "sac": "SAC"}.get(runs[0].meta.get("algo", ""), "")
    return f"{algo} on {env}".strip()


#: legend names of the replay schemes (other labels are shown as they are)
SCHEME_NAMES = {"uniform": "uniform", "per": "proportional (per)", "rank": "rank-based (rank)"}


def _legend(label: str, n: int) -> str:
    return f"{SCHEME_NAMES.get(label, label)}, n={n}"


def _steps_axis(ax: Any) -> None:
    """x-axis of environment steps, ticks as 10k / 1.5M."""
    from matplotlib.ticker import FuncFormatter

    def fmt(x: float, _pos: object) -> str:
        if abs(x) >= 1e6:
            return f"{x / 1e6:g}M"
        return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"

    ax.xaxis.set_major_formatter(FuncFormatter(fmt))
    ax.set_xlabel("environment steps")


def curves_figure(
    groups: Sequence[Group], window: int, title: str | None = None, returns: str | None = None
) -> tuple[Any, ReturnsUsed]:
    """The learning-curve figure (matplotlib) and the returns it shows.

    One colour per group, ``n=K`` (seeds) in its legend entry: the mean
    across seeds and its 95% percentile bootstrap band (the tables' interval,
    :func:`~fastper.agents.stats.mean_band`); below :data:`FEW_SEEDS` seeds
    each seed's curve too, thin. The title is ``title`` (default: algorithm
    and environment) over a line saying what is drawn; the y-limits are those
    of what is drawn, with a 5% margin.
    """
    plt = _pyplot()
    all_runs = [r for g in groups for r in g.runs]
    used = choose_returns(all_runs, returns)
    grid = grid_for(all_runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    drawn: list[np.ndarray] = []
    few = False
    for g in groups:
        curves = np.stack([smoothed_curve(r, grid, window, used.kind) for r in g.runs])
        n = len(g.runs)
        mean, band_lo, band_hi = mean_band(curves)
        line = ax.plot(grid, mean, lw=2, label=_legend(g.label, n))[0]
        ax.fill_between(grid, band_lo, band_hi, color=line.get_color(), alpha=0.2, lw=0)
        drawn += [mean, band_lo, band_hi]
        if n < FEW_SEEDS:
            few = True
            for c in curves:
                ax.plot(grid, c, lw=0.7, alpha=0.4, color=line.get_color())
            drawn.append(curves.ravel())
    values = np.concatenate(drawn)
    values = values[np.isfinite(values)]
    if values.size:
        lo, hi = float(values.min()), float(values.max())
        pad = 0.05 * (hi - lo) or max(1.0, abs(hi) * 0.05)
        ax.set_ylim(lo - pad, hi + pad)
    how = (
        "greedy evaluations"
        if used.kind == "eval"
        else f"training episodes, moving average of {window}"
    )
    shown = f"line: mean over seeds; band: {CONFIDENCE:.0%} bootstrap CI of the mean"
    if few:
        shown += f"; thin lines: each seed (n < {FEW_SEEDS})"
    ax.set_title(f"{title or _title(all_runs)}\n{how}\n{shown}", fontsize=10)
    _steps_axis(ax)
    ax.set_ylabel(used.label)
    ax.grid(alpha=0.3)
    ax.legend(title="replay", fontsize=9)
    fig.tight_layout()
    return fig, used


def _save(fig: Any, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    _pyplot().close(fig)
    return out


def plot(
    groups: Sequence[Group],
    out: str | Path,
    window: int,
    title: str | None = None,
    returns: str | None = None,
) -> Path:
    """Write the learning curves (see :func:`curves_figure`) to ``out``; returns its path."""
    fig, _ = curves_figure(groups, window, title, returns)
    return _save(fig, out)


def profile_figure(
    groups: Sequence[Group],
    returns: str | None = None,
    backend: str = "auto",
    points: int = 101,
    title: str | None = None,
) -> tuple[Any, ReturnsUsed, Backend]:
    """The performance profile of the seeds' final returns, one line per group.

    For each tau between the lowest and highest final return: the fraction of
    a group's seeds whose final return exceeds tau, with a 95% stratified
    bootstrap band (rliable, or scipy; the title says which). ``title``
    replaces the default (algorithm and environment) in the title's first line.
    """
    plt = _pyplot()
    all_runs = [r for g in groups for r in g.runs]
    used = choose_returns(all_runs, returns)
    bk = stats_backend(backend)
    finals: Mapping[str, np.ndarray] = {
        g.label: np.array([final_return(r, used.kind) for r in g.runs]) for g in groups
    }
    finite = np.concatenate([f[np.isfinite(f)] for f in finals.values()])
    if finite.size == 0:
        raise ValueError("no run has a final return to profile (runs too short?)")
    taus = np.linspace(float(finite.min()), float(finite.max()), points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, f in finals.items():
        f = f[np.isfinite(f)]
        if f.size == 0:
            continue
        prof = performance_profile(f, taus, bk)
        line = ax.plot(
            taus, prof.fraction, lw=2, drawstyle="steps-post", label=_legend(label, f.size)
        )[0]
        ax.fill_between(
            taus, prof.low, prof.high, step="post", color=line.get_color(), alpha=0.2, lw=0
        )
    kind = "greedy evaluations" if used.kind == "eval" else "training episodes"
    ax.set_title(
        f"{title or _title(all_runs)}: performance profile of the final return\n"
        f"{kind}; band: {CONFIDENCE:.0%} bootstrap CI over runs ({bk.name} {bk.version})",
        fontsize=10,
    )
    source = "greedy evaluation" if used.kind == "eval" else "training episode"
    ax.set_xlabel(f"final return τ ({source} return)")
    ax.set_ylabel("fraction of runs with final return > τ")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(title="replay", fontsize=9)
    fig.tight_layout()
    return fig, used, bk


def plot_profile(
    groups: Sequence[Group],
    out: str | Path,
    returns: str | None = None,
    backend: str = "auto",
    title: str | None = None,
) -> Path:
    """Write the performance profile (see :func:`profile_figure`) to ``out``; returns its path."""
    fig, _, _ = profile_figure(groups, returns, backend, title=title)
    return _save(fig, out)
