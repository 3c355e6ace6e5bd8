"""Run analysis (compare / plot), its statistics, and progress output, on runs written here."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

stats_mod = pytest.importorskip("scipy.stats")

from fastper.agents import analysis, stats  # noqa: E402
from fastper.agents._common import Progress  # noqa: E402
from fastper.cli import main  # noqa: E402

SCIPY = stats.stats_backend("scipy")


def rliable_or_skip() -> stats.Backend:
    found = stats._rliable()
    if isinstance(found, str):
        pytest.skip(found)
    return stats.stats_backend("rliable")


# ---------------------------------------------------------------------------
# fixtures: run directories as `fastper train` writes them
# ---------------------------------------------------------------------------


def write_run(
    root: Path,
    replay: str,
    seed: int,
    episodes: list[tuple[int, float]],
    evals: list[tuple[int, list[float]]] | None = None,
    total: int = 1000,
    finished: bool = True,
) -> Path:
    """A run directory: config.json, episodes.csv, evaluations.csv (if ``evals``), summary.json."""
    d = root / f"dqn-CartPole-v1-{replay}" / f"seed-{seed}"
    d.mkdir(parents=True)
    config = {"seed": seed, "replay": replay, "env_id": "CartPole-v1", "total_steps": total,
              "lr": 1e-3}  # fmt: skip
    record = {"config": config, "algo": "dqn", "env_id": "CartPole-v1", "replay": replay,
              "seed": seed}  # fmt: skip
    (d / "config.json").write_text(json.dumps(record))
    lines = ["step,episode,return,length,wall_s"]
    lines += [f"{s},{i + 1},{r},{10},{0.1 * i:.3f}" for i, (s, r) in enumerate(episodes)]
    (d / "episodes.csv").write_text("\n".join(lines) + "\n")
    if evals is not None:
        lines = ["step,episode,return,length"]
        for s, rets in evals:
            lines += [f"{s},{k + 1},{r},{int(r)}" for k, r in enumerate(rets)]
        (d / "evaluations.csv").write_text("\n".join(lines) + "\n")
    if finished:
        (d / "summary.json").write_text(json.dumps({"steps": total}))
    return d


def ramp(level: float, total: int = 1000, every: int = 20, noise: float = 0.0, seed: int = 0):
    """Training episodes ending every ``every`` steps, returns rising linearly to ``level``."""
    rng = np.random.default_rng(seed)
    steps = np.arange(every, total + 1, every)
    rets = np.clip(level * steps / total + noise * rng.standard_normal(steps.size), 0, 500)
    return [(int(s), float(r)) for s, r in zip(steps, rets, strict=True)]


def two_schemes(root: Path, seeds: int, with_evals: bool = True) -> None:
    """uniform reaches ~100 (evaluations 300 + seed), per ~200 (evaluations 400 + seed)."""
    for replay, level in (("uniform", 100.0), ("per", 200.0)):
        for s in range(seeds):
            evals = [(st, [level + 200 + s - 1, level + 200 + s + 1]) for st in (500, 950)]
            write_run(root, replay, s, ramp(level + 10 * s, seed=s),
                      evals if with_evals else None)  # fmt: skip


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------


def test_iqm_of_known_arrays() -> None:
    # sorted -50 0 | 1 2 3 4 | 5 100: the middle half is 1..4, outliers do not move it
    assert stats.iqm([0, 1, 2, 3, 100, 4, 5, -50]) == pytest.approx(2.5)
    assert stats.iqm(np.arange(1, 9)) == pytest.approx(4.5)
    # runs x tasks: all scores pooled
    assert stats.iqm(np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])) == (
        pytest.approx(np.mean([3.0, 4.0, 10.0, 20.0]))
    )


def test_mean_ci_covers_the_true_mean_at_about_the_nominal_rate() -> None:
    # returns in [0, 500] (500 x Beta(2, 5), mean 500 * 2/7), 30 seeds, 1,000 data sets. A
    # percentile interval has the plug-in width sd * sqrt((n-1)/n) / sqrt(n) x z, so under
    # normality it covers with P(|t_{n-1}| < 1.96 sqrt((n-1)/n)) = 0.938 at n = 30, a little
    # under 95%; the count of covers is tested against that rate (two-sided binomial test)
    from scipy.stats import binomtest, t

    n, trials, true = 30, 1000, 500 * 2 / 7
    expected = 2 * t.cdf(1.959964 * math.sqrt((n - 1) / n), n - 1) - 1
    rng = np.random.default_rng(2026)
    covered = 0
    for k in range(trials):
        x = 500 * rng.beta(2.0, 5.0, n)
        e = stats.mean_ci(x, reps=1000, seed=k)
        covered += e.low <= true <= e.high
    assert 0.93 < expected < 0.95
    assert binomtest(covered, trials, expected).pvalue > 1e-3, (covered, expected)
    # a 90% interval passed off as 95% would fail this test: its rate is far below
    assert binomtest(int(0.90 * trials), trials, expected).pvalue < 1e-3


def test_mean_ci_stays_within_the_data_and_is_reproducible() -> None:
    rng = np.random.default_rng(7)
    for n in (2, 3, 5, 10):
        for k in range(50):
            # bounded returns, often at the bound (CartPole: 500, or a collapse near 0)
            x = np.where(rng.random(n) < 0.7, 500.0, rng.uniform(0, 500, n))
            e = stats.mean_ci(x, seed=k)
            assert x.min() <= e.low <= e.value <= e.high <= x.max()
    # the case a 2-seed t-interval blew past [0, 500]: [-2,351, 2,935]
    e = stats.mean_ci([20.0, 500.0])
    assert 20.0 <= e.low < e.high <= 500.0 and e.value == 260.0
    assert stats.mean_ci([7.0, 7.0, 7.0]) == stats.Estimate(7.0, 7.0, 7.0)
    x = rng.normal(size=8)
    assert stats.mean_ci(x, seed=3) == stats.mean_ci(x, seed=3)  # fixed seed: same interval
    assert stats.mean_ci(x, seed=3) != stats.mean_ci(x, seed=4)
    state = np.random.get_state()[1].copy()  # noqa: NPY002
    stats.mean_ci(x)
    np.testing.assert_array_equal(np.random.get_state()[1], state)  # noqa: NPY002
    one = stats.mean_ci([5.0])
    assert one.value == 5.0 and math.isnan(one.low) and math.isnan(one.high)
    assert stats.mean_ci([1.0, math.inf, 3.0, math.nan]).value == 2.0  # non-finite left out
    assert math.isnan(stats.mean_ci([]).value)
    with pytest.raises(ValueError, match="`reps` must be an integer >= 100"):
        stats.mean_ci(x, reps=10)


def test_mean_band_is_mean_ci_at_every_step() -> None:
    rng = np.random.default_rng(11)
    curves = rng.uniform(0, 500, (6, 40))
    curves[2, :5] = np.nan  # a seed without a value yet: no band there
    mean, lo, hi = stats.mean_band(curves, reps=500, seed=9)
    assert np.isnan(lo[:5]).all() and np.isnan(hi[:5]).all()
    np.testing.assert_allclose(mean[:5], np.nanmean(curves[:, :5], axis=0))
    for j in (5, 17, 39):
        e = stats.mean_ci(curves[:, j], reps=500, seed=9)
        assert (mean[j], lo[j], hi[j]) == pytest.approx((e.value, e.low, e.high), rel=1e-12)
    _, lo1, hi1 = stats.mean_band(curves[:1])  # one seed: no band
    assert np.isnan(lo1).all() and np.isnan(hi1).all()
    with pytest.raises(ValueError, match=r"`curves` must be a \(runs, points\) array"):
        stats.mean_band(np.zeros(3))


def test_iqm_bootstrap_interval_covers_the_true_iqm() -> None:
    # the IQM of a standard normal population is 0: a 95% interval should cover it ~95% of times
    rng = np.random.default_rng(1)
    covered = 0
    trials = 200
    for t in range(trials):
        x = rng.standard_normal(30)
        e = stats.iqm_ci(x, SCIPY, reps=500, seed=t)
        assert x.min() <= e.low <= e.value <= e.high <= x.max()
        covered += e.low <= 0.0 <= e.high
    assert 0.85 <= covered / trials <= 0.99, covered


def test_bootstrap_is_stratified_per_task() -> None:
    # task 0 scores in [0, 1), task 1 in [100, 101): every stratified resample keeps 5 runs of
    # each, so exactly half of all runs beat tau = 50 in every resample (a band of width 0)
    rng = np.random.default_rng(0)
    scores = np.stack([rng.random(5), 100 + rng.random(5)], axis=1)
    prof = stats.performance_profile(scores, np.array([50.0]), SCIPY, reps=300)
    assert (prof.fraction[0], prof.low[0], prof.high[0]) == (0.5, 0.5, 0.5)


def test_median_ci_with_censored_runs() -> None:
    e = stats.median_ci([100.0, 200.0, math.inf], reps=2000)
    assert e.value == 200.0 and e.low == 100.0 and e.high == math.inf


def test_rliable_and_scipy_agree() -> None:
    rl = rliable_or_skip()
    rng = np.random.default_rng(3)
    scores = np.stack([rng.normal(200, 50, 10), rng.normal(400, 30, 10)], axis=1)
    a = stats.iqm_ci(scores, rl, reps=2000, seed=0)
    b = stats.iqm_ci(scores, SCIPY, reps=2000, seed=0)
    assert a.value == b.value == pytest.approx(stats.iqm(scores))  # the same point estimate
    spread = scores.max() - scores.min()  # intervals: two random bootstraps, loosely
    assert abs(a.low - b.low) < 0.05 * spread and abs(a.high - b.high) < 0.05 * spread
    taus = np.linspace(scores.min(), scores.max(), 21)
    pa = stats.performance_profile(scores, taus, rl, reps=500)
    pb = stats.performance_profile(scores, taus, SCIPY, reps=500)
    np.testing.assert_array_equal(pa.fraction, pb.fraction)
    np.testing.assert_allclose(pa.low, pb.low, atol=0.1)
    np.testing.assert_allclose(pa.high, pb.high, atol=0.1)
    # seeded: the same call gives the same interval, and numpy's global RNG is left as it was
    state = np.random.get_state()[1].copy()  # noqa: NPY002
    assert stats.iqm_ci(scores, rl, reps=300, seed=5) == stats.iqm_ci(scores, rl, reps=300, seed=5)
    np.testing.assert_array_equal(np.random.get_state()[1], state)  # noqa: NPY002


def test_backend_falls_back_to_scipy_and_says_why(monkeypatch) -> None:
    monkeypatch.setattr(stats, "_rliable", lambda: "rliable is not installed (pip install x)")
    b = stats.stats_backend()
    assert b.name == "scipy" and "rliable is not installed" in b.note
    with pytest.raises(ValueError, match="`backend`='rliable' cannot be used: rliable is not"):
        stats.stats_backend("rliable")
    with pytest.raises(
        ValueError, match=r"`backend` must be one of \['auto', 'rliable', 'scipy'\]"
    ):
        stats.stats_backend("numpy")


# ---------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------


def test_compare_uses_evaluations_and_says_so(tmp_path, capsys) -> None:
    two_schemes(tmp_path, seeds=2)
    assert main(["compare", str(tmp_path), "--threshold", "150"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if "|" in line}
    # final return = the evaluation at step 950 (in the last 10%): 300 + seed, 400 + seed
    assert "| uniform | 2 | 300.5 [300, 301] (n=2: few)" in rows["uniform"]
    assert "| per | 2 | 400.5 [400, 401] (n=2: few)" in rows["per"]
    assert "returns: greedy evaluations from evaluations.csv" in out
    assert (
        "n=K: few" in out
        and "resampled per task" in out
        and "- 2 seeds per scheme (column n)" in out
    )
    # every evaluation reaches 150: at the first one (step 500)
    assert "| 2/2 | 500 [500, 500] |" in rows["uniform"]
    assert main(["compare", str(tmp_path), "--returns", "train"]) == 0
    out = capsys.readouterr().out
    assert "returns: training episodes (behaviour policy, exploring)." in out
    row = next(ln for ln in out.splitlines() if ln.startswith("| uniform |"))
    assert 90 < float(row.split(" | ")[2].split()[0]) < 115  # training returns near 100, not 300


def test_compare_numbers_match_the_statistics(tmp_path) -> None:
    two_schemes(tmp_path, seeds=6)
    groups = analysis.group_runs(analysis.find_runs([tmp_path]))
    c = analysis.summarise(groups, threshold=None, window=5, backend="scipy")
    assert [s.label for s in c.rows] == ["uniform", "per"] and c.returns.kind == "eval"
    finals = np.array([300.0 + s for s in range(6)])
    assert c.rows[0].finals == tuple(finals)
    assert c.rows[0].final == stats.mean_ci(finals)
    assert c.rows[0].final_iqm == stats.iqm_ci(finals, SCIPY)
    assert c.rows[0].final_iqm.value == pytest.approx(302.5)  # the middle of 300..305
    assert c.threshold == 475.0 and c.rows[0].reached == 0
    table = analysis.compare_table(groups, None, 5, backend="scipy")
    assert "few" not in table and "| n (seeds) |" in table  # 6 seeds: no flag


def test_compare_falls_back_to_training_returns(tmp_path, capsys) -> None:
    two_schemes(tmp_path, seeds=2)
    (tmp_path / "dqn-CartPole-v1-per" / "seed-1" / "evaluations.csv").unlink()
    assert main(["compare", str(tmp_path)]) == 0
    assert "1 of 4 runs have no evaluations.csv" in capsys.readouterr().out
    assert main(["compare", str(tmp_path), "--returns", "eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastper compare: error: --returns eval needs evaluations.csv")
    assert "1 of 4 runs have none, e.g." in err and "\n" not in err


def test_runs_kept_with_their_evaluations_only_serve_evaluation_returns(tmp_path, capsys) -> None:
    two_schemes(tmp_path, seeds=2)
    full = main(["compare", str(tmp_path), "--returns", "eval"]), capsys.readouterr().out
    for ep in tmp_path.rglob("episodes.csv"):
        ep.unlink()  # as a results page might publish them: config + evaluations only
    assert len(analysis.find_runs([tmp_path])) == 4
    assert main(["compare", str(tmp_path)]) == 0  # evaluations everywhere: used
    assert capsys.readouterr().out == full[1] and full[0] == 0  # the same table
    assert main(["compare", str(tmp_path), "--returns", "train"]) == 2
    err = capsys.readouterr().err
    assert "training returns need episodes.csv in every run; 4 of 4 runs" in err
    (tmp_path / "dqn-CartPole-v1-per" / "seed-1" / "evaluations.csv").unlink()
    assert len(analysis.find_runs([tmp_path])) == 3  # config.json alone: not a run
    run = analysis.load_run(tmp_path / "dqn-CartPole-v1-per" / "seed-0")
    assert not run.has_episodes and run.steps.size == 0 and run.has_evaluations
    with pytest.raises(ValueError, match="episodes.csv or evaluations.csv"):
        analysis.load_run(tmp_path / "dqn-CartPole-v1-per" / "seed-1")


def test_compare_into_a_closed_pipe_stops_quietly(tmp_path) -> None:
    two_schemes(tmp_path, seeds=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastper", "compare", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()  # as `| head` does once it has its lines: before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_compare_says_which_library_computed_the_iqm(tmp_path, capsys, monkeypatch) -> None:
    two_schemes(tmp_path, seeds=3)
    monkeypatch.setattr(stats, "_rliable", lambda: "rliable is not installed (pip install x)")
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "scipy" in out and "as rliable is not installed" in out


def test_compare_with_rliable(tmp_path, capsys) -> None:
    backend = rliable_or_skip()
    two_schemes(tmp_path, seeds=3)
    assert main(["compare", str(tmp_path)]) == 0
    assert f"rliable {backend.version}" in capsys.readouterr().out


def test_eval_file_without_its_columns_is_a_clear_error(tmp_path, capsys) -> None:
    d = write_run(tmp_path, "per", 0, ramp(100.0), [(500, [1.0])])
    (d / "evaluations.csv").write_text("step,score\n500,1\n")
    assert main(["compare", str(tmp_path)]) == 1
    assert "must have the columns step,episode,return,length" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------


def test_plot_of_two_seeds_shows_the_seeds_and_stays_in_the_data_range(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    # returns in [0, 500] that a 2-seed t-band would blow far past
    write_run(tmp_path, "per", 0, ramp(500.0, noise=5, seed=0))
    write_run(tmp_path, "per", 1, ramp(20.0, noise=5, seed=1))
    groups = analysis.group_runs(analysis.find_runs([tmp_path]))
    fig, used = analysis.curves_figure(groups, window=5)
    ax = fig.axes[0]
    assert used.kind == "train" and ax.get_ylabel() == "training episode return"
    assert ax.get_xlabel() == "environment steps"
    curves = [ln.get_ydata() for ln in ax.lines]
    lo = min(np.nanmin(c) for c in curves)
    hi = max(np.nanmax(c) for c in curves)
    assert 0 <= lo and hi <= 500
    y0, y1 = ax.get_ylim()
    assert lo - 0.051 * (hi - lo) <= y0 <= lo and hi <= y1 <= hi + 0.051 * (hi - lo)
    assert len(ax.lines) == 3 and len(ax.collections) == 1  # mean, two seeds, the band
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert lo <= band.min() and band.max() <= hi
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["proportional (per), n=2"]
    assert "thin lines: each seed" in ax.get_title() and "95% bootstrap CI" in ax.get_title()


def test_plot_of_many_seeds_draws_a_band_within_the_seeds(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    two_schemes(tmp_path, seeds=6)
    groups = analysis.group_runs(analysis.find_runs([tmp_path]))
    fig, used = analysis.curves_figure(groups, window=5)
    ax = fig.axes[0]
    assert used.kind == "eval" and ax.get_ylabel().startswith("evaluation return")
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # mean + band per scheme
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "uniform, n=6",
        "proportional (per), n=6",
    ]
    assert ax.get_title().startswith("Double DQN on CartPole-v1\ngreedy evaluations")
    y0, y1 = ax.get_ylim()
    assert 290 <= y0 and y1 <= 415  # evaluations 300..305 and 400..405, 5% margin
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert 300 <= band.min() and band.max() <= 305


def test_cli_plot_writes_curves_and_profile(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    two_schemes(tmp_path / "runs", seeds=2)
    png = tmp_path / "out" / "curve.png"
    assert main(["plot", str(tmp_path / "runs"), "-o", str(png), "--profile"]) == 0
    out = capsys.readouterr().out
    assert "returns: greedy evaluations" in out and "curve-profile.png" in out
    for f in (png, tmp_path / "out" / "curve-profile.png"):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "runs"), "-o", str(png), "--profile", "p.txt"]) == 2
    assert "--profile must end in an image type" in capsys.readouterr().err


def test_profile_figure(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    two_schemes(tmp_path, seeds=3)
    groups = analysis.group_runs(analysis.find_runs([tmp_path]))
    fig, used, backend = analysis.profile_figure(groups, backend="scipy")
    ax = fig.axes[0]
    assert used.kind == "eval" and backend.name == "scipy" and "scipy" in ax.get_title()
    uniform, per = (ln.get_ydata() for ln in ax.lines)
    assert uniform[0] == pytest.approx(2 / 3) and per[0] == 1.0  # above the lowest final (300)
    assert per[-1] == 0.0  # nothing beats the highest


# ---------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_writes_a_line_every_tenth(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = Progress(200, "dqn per seed 0")
    p.redraw_s = 0.0
    for step in range(1, 201):
        p.update(step, [1.0, 3.0])
    p.update(200, [1.0, 3.0], force=True)  # the run's end: not the 100% line again
    p.update(200, [1.0, 3.0], force=True)  # closed: nothing
    lines = err.getvalue().splitlines()
    assert [int(ln.split("%")[0].split()[-1]) for ln in lines] == list(range(0, 101, 10))
    assert lines[0].startswith("dqn per seed 0:   0% 0/200 steps")
    assert lines[-1].startswith("dqn per seed 0: 100% 200/200 steps")
    assert lines[-1].endswith("return(10) 2.0]") and "\r" not in err.getvalue()


def test_progress_off_a_terminal_writes_after_line_every_s(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = Progress(10_000, "x")
    p.redraw_s, p.line_every_s = 0.0, 0.0  # every update is "15 s later"
    for step in (1, 2, 3):
        p.update(step, [])
    assert len(err.getvalue().splitlines()) == 4  # start + 3, though far below 10%


def test_progress_on_a_terminal_is_a_tqdm_bar(monkeypatch) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(Progress, "position", 0)
    monkeypatch.setattr(Progress, "leave", True)
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    p = Progress(50, "dqn uniform seed 3")
    p.update(50, [2.0], force=True)
    text = tty.getvalue()
    assert "\r" in text and "dqn uniform seed 3" in text and "50/50" in text
    assert "return(10) 2.0" in text and not p.enabled
    Progress.use_slot(2)  # a pool's worker: its own line, cleared when the run ends
    q = Progress(10, "w")
    assert q._bar.pos in (2, -2) and not q._bar.leave  # tqdm keeps -pos while drawing
    q.update(10, [], force=True)


def test_progress_disabled_writes_nothing(monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = Progress(10, "x", enabled=False)
    p.update(5, [1.0])
    p.update(10, [1.0], force=True)
    assert err.getvalue() == ""


def test_two_workers_show_each_run_while_it_runs(tmp_path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    pytest.importorskip("tqdm")
    cmd = [sys.executable, "-m", "fastper.cli", "train", "dqn", "--replay", "uniform", "per",
           "--seeds", "1", "--steps", "300", "--workers", "2", "--threads", "1",
           "--set", "learning_starts=100", "--set", "hidden=(8,)", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # stderr: not a tty
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("training 2 run(s) of dqn in 2 processes; progress: a line per")
    for run in ("dqn uniform seed 0", "dqn per seed 0"):
        # each run reports from its start, before it ends (not only once done); whether
        # the two runs overlap depends on how fast the pool's second process starts
        start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{run}:   0% 0/300 steps"))
        end = next(i for i, ln in enumerate(lines) if ln.startswith(f"{run}: 100% 300/300 steps"))
        done = next(i for i, ln in enumerate(lines) if ln.startswith("[") and run in ln)
        assert start < end < done, lines
    assert sum(ln.startswith("[") and "/2 " in ln for ln in lines) == 2
