"""Statistics across seeds: bootstrap intervals of the mean, IQM, profiles.

Every interval here is a 95% percentile bootstrap over runs (seeds), with a
fixed seed, so the same runs always give the same table:

* the mean (:func:`mean_ci`, and :func:`mean_band` for a learning curve at
  every step): runs resampled with replacement, numpy only. The bootstrap
  means of bounded returns lie between the lowest and highest run, so the
  interval never leaves the range of the data (a return in [0, 500] never
  gets an interval below 0 or above 500), whatever the number of seeds;
* the IQM (interquartile mean, ``scipy.stats.trim_mean(scores.ravel(),
  0.25)``) and performance profiles: a (runs, tasks) matrix (a 1-D array is
  one task) resampled per task (stratified). rliable (extra ``stats``:
  ``get_interval_estimates``, ``metrics.aggregate_iqm``,
  ``create_performance_profile``) computes them when it imports; otherwise
  the same definitions run on ``scipy.stats.bootstrap``, and
  :class:`Backend` says which ran and why. rliable draws from numpy's
  global RNG, which is seeded for the call and restored after it.

A bootstrap interval from few seeds is too narrow rather than too wide: it
cannot leave the seeds' range, and from 2 seeds it is close to that range.
Below :data:`FEW_SEEDS` seeds, read it as the spread seen, not as 95%
confidence.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

#: ``backend=`` choices for IQM intervals and performance profiles
BACKENDS = ("auto", "rliable", "scipy")
#: bootstrap resamples (rliable's default for performance profiles)
BOOTSTRAP_REPS = 2000
CONFIDENCE = 0.95
#: below this many seeds a bootstrap interval is too narrow (tables and plots say so)
FEW_SEEDS = 5
STATS_HINT = "pip install 'fastper[stats]'"


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its 95% interval (NaN bounds: no interval)."""

    value: float
    low: float = math.nan
    high: float = math.nan


@dataclass(frozen=True)
class Backend:
    """Who computes IQM intervals and performance profiles: ``name`` and a note saying why."""

    name: str  # "rliable" or "scipy"
    version: str
    note: str


@cache
def _rliable() -> tuple[Any, Any, str] | str:
    """rliable's (library, metrics, version), or why it cannot be used."""
    try:
        from importlib.metadata import version

        from rliable import library, metrics

        return library, metrics, version("rliable")
    except ImportError:
        return f"rliable is not installed ({STATS_HINT})"
    except Exception as exc:  # noqa: BLE001 - e.g. its arch dependency broken by pandas
        return f"rliable is installed but fails to import ({type(exc).__name__}: {exc})"


def _rliable_modules() -> tuple[Any, Any]:
    """rliable's (library, metrics) modules; ValueError saying why if it cannot be used."""
    found = _rliable()
    if isinstance(found, str):
        raise ValueError(f"`backend`='rliable' cannot be used: {found}")
    return found[0], found[1]


def stats_backend(backend: str = "auto") -> Backend:
    """The backend ``backend`` names; "auto" is rliable when it imports, else scipy.

    Raises:
        ValueError: an unknown name, or "rliable" when it cannot be imported.
    """
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {list(BACKENDS)}, got backend={backend!r}")
    import scipy

    found = _rliable() if backend != "scipy" else "scipy was asked for"
    if isinstance(found, tuple):
        return Backend("rliable", found[2], f"rliable {found[2]}")
    if backend == "rliable":
        raise ValueError(f"`backend`='rliable' cannot be used: {found}")
    return Backend("scipy", scipy.__version__, f"scipy {scipy.__version__}, as {found}")


def _finite(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """The finite values of ``x`` as a 1-D float64 array."""
    a = np.ravel(np.asarray(x, dtype=np.float64))
    return a[np.isfinite(a)]


def _bootstrap_means(values: np.ndarray, reps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """95% percentile bootstrap interval of the mean over rows of ``values`` (runs, k).

    Runs are resampled with replacement (``reps`` times, one draw of counts
    shared by every column), so each column's bootstrap means are weighted
    means of its own values; their 2.5% and 97.5% quantiles are the bounds,
    clipped to the column's range against floating-point rounding. O(reps * runs * k).
    """
    n = values.shape[0]
    draws = np.random.default_rng(seed).integers(0, n, size=(reps, n))
    flat = (np.arange(reps)[:, None] * n + draws).ravel()
    weights = np.bincount(flat, minlength=reps * n).reshape(reps, n) / n  # (reps, runs)
    boots = weights @ values  # (reps, k): each resample's mean
    tail = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(boots, [tail, 1 - tail], axis=0)
    low, high = values.min(axis=0), values.max(axis=0)
    return np.clip(lo, low, high), np.clip(hi, low, high)


def _check_reps(reps: int) -> None:
    if isinstance(reps, bool) or not isinstance(reps, int | np.integer) or reps < 100:
        raise ValueError(
            f"`reps` must be an integer >= 100 (bootstrap resamples), got reps={reps!r}"
        )


def mean_ci(x: Sequence[float] | np.ndarray, reps: int = BOOTSTRAP_REPS, seed: int = 0) -> Estimate:
    """Mean of the finite values and its 95% percentile bootstrap interval over them.

    No interval below 2 values. The bounds lie within [min, max] of the
    values. Cost: O(reps * n).
    """
    _check_reps(reps)
    a = _finite(x)
    if a.size == 0:
        return Estimate(math.nan)
    m = float(a.mean())
    if a.size < 2:
        return Estimate(m)
    lo, hi = _bootstrap_means(a[:, None], reps, seed)
    return Estimate(m, float(lo[0]), float(hi[0]))


def mean_band(
    curves: np.ndarray, reps: int = BOOTSTRAP_REPS, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean across runs (rows) at each column and its 95% bootstrap band (:func:`mean_ci`'s).

    ``curves`` is (runs, points) with NaN where a run has no value yet. The
    mean is taken over the finite values; the band only where every run has
    one (NaN elsewhere) and from 2 runs on. At each column the band equals
    :func:`mean_ci` of that column with the same ``reps`` and ``seed``.
    Cost: O(reps * runs * points).
    """
    _check_reps(reps)
    c = np.asarray(curves, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0:
        raise ValueError(f"`curves` must be a (runs, points) array, got shape {c.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)  # all-NaN columns
        mean = np.asarray(np.nanmean(c, axis=0))
    lo = np.full(mean.shape, np.nan)
    hi = np.full(mean.shape, np.nan)
    ok = np.isfinite(c).all(axis=0)
    if c.shape[0] >= 2 and ok.any():
        lo[ok], hi[ok] = _bootstrap_means(c[:, ok], reps, seed)
    return mean, lo, hi


def iqm(scores: Sequence[float] | np.ndarray) -> float:
    """Interquartile mean of all scores (runs x tasks flattened): 25% cut at each end. O(n log n)."""
    from scipy import stats

    return float(stats.trim_mean(np.ravel(np.asarray(scores, dtype=np.float64)), 0.25))


def _as_matrix(scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """Scores as a (runs, tasks) matrix: a 1-D array is one task."""
    a = np.asarray(scores, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.shape[0] == 0 or not np.isfinite(a).all():
        raise ValueError(f"`scores` must be a finite (runs, tasks) array, got shape {a.shape}")
    return a


def _scipy_bootstrap(
    scores: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], reps: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap over runs, stratified per task, with ``scipy.stats.bootstrap``.

    Each task's column is one sample, resampled on its own (``paired=False``);
    ``statistic`` maps (..., runs, tasks) to (...) or (..., k).
    """
    from scipy import stats

    def stat(*cols: np.ndarray, axis: int = -1) -> np.ndarray:
        x = np.stack([np.moveaxis(c, axis, -1) for c in cols], axis=-1)
        out = np.asarray(statistic(x))
        return out if out.ndim == x.ndim - 2 else np.moveaxis(out, -1, 0)

    with warnings.catch_warnings():  # identical resamples: a point interval, not a problem
        warnings.simplefilter("ignore")
        res = stats.bootstrap(
            tuple(scores.T), stat, n_resamples=reps, method="percentile", vectorized=True,
            paired=False, confidence_level=CONFIDENCE, rng=np.random.default_rng(seed),
        )  # fmt: skip
    return np.asarray(res.confidence_interval.low), np.asarray(res.confidence_interval.high)


def _with_numpy_seed(seed: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with numpy's global RNG seeded (rliable draws from it), then restore it."""
    state = np.random.get_state()  # noqa: NPY002 - rliable uses the global RNG
    np.random.seed(seed)  # noqa: NPY002
    try:
        return fn()
    finally:
        np.random.set_state(state)  # noqa: NPY002


def iqm_ci(
    scores: Sequence[float] | np.ndarray,
    backend: Backend | None = None,
    reps: int = BOOTSTRAP_REPS,
    seed: int = 0,
) -> Estimate:
    """IQM of ``scores`` (runs, or runs x tasks) with a 95% stratified percentile bootstrap interval.

    rliable's ``get_interval_estimates`` with ``metrics.aggregate_iqm``, or the
    same with scipy (:func:`iqm`, ``scipy.stats.bootstrap``). No interval for
    fewer than 2 runs. Cost: O(reps * runs * tasks).
    """
    a = _as_matrix(scores)
    backend = backend or stats_backend()
    if a.shape[0] < 2:
        return Estimate(iqm(a))
    if backend.name == "rliable":
        library, metrics = _rliable_modules()

        def aggregate(s: np.ndarray) -> np.ndarray:
            return np.array([metrics.aggregate_iqm(s)])

        point, ci = _with_numpy_seed(
            seed, lambda: library.get_interval_estimates({"x": a}, aggregate, reps=reps)
        )
        return Estimate(float(point["x"][0]), float(ci["x"][0, 0]), float(ci["x"][1, 0]))

    def stat(x: np.ndarray) -> np.ndarray:
        from scipy import stats

        return np.asarray(stats.trim_mean(x.reshape(*x.shape[:-2], -1), 0.25, axis=-1))

    lo, hi = _scipy_bootstrap(a, stat, reps, seed)
    return Estimate(iqm(a), float(lo), float(hi))


@dataclass(frozen=True)
class Profile:
    """A performance profile: fraction of runs scoring above each tau, with a 95% band."""

    taus: np.ndarray
    fraction: np.ndarray
    low: np.ndarray
    high: np.ndarray


def performance_profile(
    scores: Sequence[float] | np.ndarray,
    taus: np.ndarray,
    backend: Backend | None = None,
    reps: int = BOOTSTRAP_REPS,
    seed: int = 0,
) -> Profile:
    """Fraction of runs (all tasks) with a score > tau, for each tau, and its bootstrap band.

    rliable's ``create_performance_profile`` (score distributions), or the same
    with scipy. Cost: O(reps * runs * tasks * len(taus)).
    """
    a = _as_matrix(scores)
    taus = np.asarray(taus, dtype=np.float64)
    backend = backend or stats_backend()
    frac = (a.reshape(-1)[:, None] > taus).mean(axis=0)
    if a.shape[0] < 2:
        return Profile(taus, frac, frac.copy(), frac.copy())
    if backend.name == "rliable":
        library, _ = _rliable_modules()
        prof, ci = _with_numpy_seed(
            seed, lambda: library.create_performance_profile({"x": a}, taus, reps=reps)
        )
        return Profile(taus, np.asarray(prof["x"]), np.asarray(ci["x"][0]), np.asarray(ci["x"][1]))

    def stat(x: np.ndarray) -> np.ndarray:
        flat = x.reshape(*x.shape[:-2], -1)
        return np.asarray((flat[..., None] > taus).mean(axis=-2))

    lo, hi = _scipy_bootstrap(a, stat, reps, seed)
    return Profile(taus, frac, lo, hi)


def median_ci(x: Sequence[float] | np.ndarray, reps: int = 10_000, seed: int = 0) -> Estimate:
    """Median and 95% percentile-bootstrap interval (``scipy.stats.bootstrap``); +inf allowed.

    +inf stands for a censored value (never reached); the interval's bounds
    are order statistics of the bootstrap medians (no interpolation, which
    +inf would turn into NaN).
    """
    from scipy import stats

    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        return Estimate(math.nan)
    if a.size < 2:
        return Estimate(float(np.median(a)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = stats.bootstrap(
            (a,), np.median, n_resamples=reps, method="percentile", vectorized=True,
            rng=np.random.default_rng(seed),
        )  # fmt: skip
    boots = np.asarray(res.bootstrap_distribution)
    tail = 100 * (1 - CONFIDENCE) / 2
    lo = float(np.percentile(boots, tail, method="lower"))
    hi = float(np.percentile(boots, 100 - tail, method="higher"))
    return Estimate(float(np.median(a)), lo, hi)
