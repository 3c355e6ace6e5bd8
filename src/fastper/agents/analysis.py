"""Learning curves across seeds: loading runs, metrics with confidence intervals, plots.

A run is a directory holding ``config.json`` and ``episodes.csv`` (written by
``fastper train``). Runs are grouped by ``(algo, env_id, replay)`` plus any
other setting that differs between runs of the same scheme, so runs with
different hyperparameters never end up averaged together silently.

Curves: each seed's return at step t is the mean of its last ``window``
finished episodes (a step function of t); the plot shows the mean across
seeds and a 95% confidence interval (Student t). Metrics per seed:

* final return: mean return of the episodes in the last 10% of the steps;
* area under the curve: the mean of the smoothed curve over the step grid
  (the average smoothed return during training; higher is better);
* steps to threshold: the first step at which the mean of the last
  ``window`` episodes reaches the threshold (censored if never).

Numbers across seeds are reported as mean and 95% t-interval; steps to
threshold as the median with a bootstrap interval (censored runs count as
never reaching, i.e. +inf) and the count of seeds that reached it.
Only numpy is needed, except for plotting (matplotlib).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._common import CONFIG_JSON, EPISODES_CSV, REPLAYS, SUMMARY_JSON

# two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """Student t quantile for a two-sided 95% interval (normal beyond 30 df)."""
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass
class Run:
    """One training run: its settings and episode log."""

    path: Path
    config: dict[str, Any]
    meta: dict[str, Any]
    steps: np.ndarray  # step at which each episode ended
    returns: np.ndarray  # return of each episode

    @property
    def total_steps(self) -> int:
        return int(self.config.get("total_steps", self.steps[-1] if self.steps.size else 0))


@dataclass
class Group:
    """Runs of one scheme: same algorithm, environment, replay and settings."""

    label: str
    runs: list[Run] = field(default_factory=list)


def load_run(path: str | Path) -> Run:
    """Read one run directory. Raises ValueError if it is not one."""
    p = Path(path)
    cfg_file, ep_file = p / CONFIG_JSON, p / EPISODES_CSV
    if not cfg_file.is_file() or not ep_file.is_file():
        raise ValueError(
            f"`path` must be a run directory with {CONFIG_JSON} and {EPISODES_CSV}, got {p}"
        )
    record = json.loads(cfg_file.read_text())
    steps, returns = [], []
    with open(ep_file, newline="") as fh:
        for row in csv.DictReader(fh):
            steps.append(int(row["step"]))
            returns.append(float(row["return"]))
    return Run(
        path=p,
        config=dict(record.get("config", {})),
        meta={k: v for k, v in record.items() if k != "config"},
        steps=np.asarray(steps, dtype=np.int64),
        returns=np.asarray(returns, dtype=np.float64),
    )


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
            if not (cfg.parent / EPISODES_CSV).is_file():
                continue
            if not include_unfinished and not (cfg.parent / SUMMARY_JSON).is_file():
                unfinished += 1
                continue
            found[cfg.parent.resolve()] = load_run(cfg.parent)
    if unfinished:
        print(f"note: left out {unfinished} unfinished run(s) (no {SUMMARY_JSON})", file=sys.stderr)
    if not found:
        raise ValueError(f"no finished runs ({CONFIG_JSON} + {EPISODES_CSV}) found under {dirs}")
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


def smoothed_curve(run: Run, grid: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` episodes finished by each grid step (NaN before the first)."""
    if run.returns.size == 0:
        return np.full(grid.shape, np.nan)
    c = np.concatenate([[0.0], np.cumsum(run.returns)])
    k = np.arange(1, run.returns.size + 1)
    lo = np.maximum(k - window, 0)
    ma = (c[k] - c[lo]) / (k - lo)
    pos = np.searchsorted(run.steps, grid, side="right")  # episodes finished by each step
    out = np.full(grid.shape, np.nan)
    ok = pos > 0
    out[ok] = ma[pos[ok] - 1]
    return out


def steps_to_threshold(run: Run, threshold: float, window: int) -> float:
    """First step where the mean of the last ``window`` episodes >= threshold (inf if never).

    Only full windows count: the first ``window - 1`` episodes cannot qualify.
    """
    if run.returns.size < window:
        return math.inf
    c = np.concatenate([[0.0], np.cumsum(run.returns)])
    ma = (c[window:] - c[:-window]) / window
    hit = np.nonzero(ma >= threshold)[0]
    return float(run.steps[hit[0] + window - 1]) if hit.size else math.inf


def mean_ci(x: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% t-interval of finite values (NaN interval for fewer than 2)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size < 2:
        return m, math.nan, math.nan
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - half, m + half


def median_ci(x: np.ndarray, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Median and 95% percentile-bootstrap interval; +inf entries allowed (censored)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(x, size=(n_boot, x.size), replace=True), axis=1)
    # no interpolation between order statistics: they may be +inf
    lo = float(np.percentile(boots, 2.5, method="lower"))
    hi = float(np.percentile(boots, 97.5, method="higher"))
    return float(np.median(x)), lo, hi


@dataclass
class Summary:
    label: str
    n: int
    final: tuple[float, float, float]
    auc: tuple[float, float, float]
    reached: int
    to_threshold: tuple[float, float, float]


def grid_for(runs: Sequence[Run], points: int = 200) -> np.ndarray:
    total = min(r.total_steps for r in runs)
    return np.linspace(total / points, total, points).round().astype(np.int64)


def summarise(
    groups: Sequence[Group], threshold: float | None, window: int
) -> tuple[list[Summary], float | None]:
    """Per-group metrics (see the module docstring) and the threshold used."""
    all_runs = [r for g in groups for r in g.runs]
    grid = grid_for(all_runs)
    if threshold is None:
        threshold = default_threshold(all_runs[0].meta.get("env_id", ""))
    out = []
    for g in groups:
        finals, aucs, tts = [], [], []
        for r in g.runs:
            tail = r.steps > 0.9 * r.total_steps
            finals.append(float(r.returns[tail].mean()) if tail.any() else math.nan)
            curve = smoothed_curve(r, grid, window)
            aucs.append(float(np.nanmean(curve)) if np.isfinite(curve).any() else math.nan)
            if threshold is not None:
                tts.append(steps_to_threshold(r, threshold, window))
        tt_arr = np.asarray(tts)
        out.append(
            Summary(
                label=g.label,
                n=len(g.runs),
                final=mean_ci(np.asarray(finals)),
                auc=mean_ci(np.asarray(aucs)),
                reached=int(np.isfinite(tt_arr).sum()),
                to_threshold=median_ci(tt_arr) if tts else (math.nan,) * 3,
            )
        )
    return out, threshold


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


def _fmt_ci(t: tuple[float, float, float]) -> str:
    m, lo, hi = t
    if math.isnan(lo):
        return _fmt(m)
    return f"{_fmt(m)} [{_fmt(lo)}, {_fmt(hi)}]"


def compare_table(groups: Sequence[Group], threshold: float | None, window: int) -> str:
    """A markdown table of final return, AUC and steps to threshold (95% CIs)."""
    rows, thr = summarise(groups, threshold, window)
    head = [
        "scheme",
        "seeds",
        "final return (last 10%)",
        "AUC (mean smoothed return)",
    ]
    if thr is not None:
        head += [f"reached {thr:g}", f"steps to {thr:g} (median)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        cells = [s.label, str(s.n), _fmt_ci(s.final), _fmt_ci(s.auc)]
        if thr is not None:
            cells += [f"{s.reached}/{s.n}", _fmt_ci(s.to_threshold)]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        f"\nMeans with 95% t-intervals across seeds; smoothing window {window} episodes"
        + (
            "; steps to threshold: median with a 95% bootstrap interval, 'never' = not reached"
            if thr is not None
            else ""
        )
        + "."
    )
    return "\n".join(lines) + "\n" + note


def plot(groups: Sequence[Group], out: str | Path, window: int, title: str | None = None) -> Path:
    """Mean smoothed return and 95% CI across seeds, one line per group; writes ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_runs = [r for g in groups for r in g.runs]
    grid = grid_for(all_runs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for g in groups:
        curves = np.stack([smoothed_curve(r, grid, window) for r in g.runs])
        n = np.isfinite(curves).sum(axis=0)
        filled = np.where(np.isfinite(curves), curves, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = filled.sum(axis=0) / n
            var = ((filled - mean) ** 2 * np.isfinite(curves)).sum(axis=0) / (n - 1)
        sd = np.sqrt(np.where(n > 1, var, 0.0))
        half = (
            np.array([t975(int(k) - 1) if k > 1 else 0.0 for k in n])
            * sd
            / np.sqrt(np.maximum(n, 1))
        )
        line = ax.plot(grid, mean, label=f"{g.label} (n={len(g.runs)})")[0]
        if len(g.runs) > 1:
            ax.fill_between(grid, mean - half, mean + half, color=line.get_color(), alpha=0.2)
    env = all_runs[0].meta.get("env_id", "")
    algo = {"dqn": "Double DQN", "sac": "SAC"}.get(all_runs[0].meta.get("algo", ""), "")
    ax.set_title(title or f"{algo} on {env}: mean of last {window} episodes, 95% CI")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
