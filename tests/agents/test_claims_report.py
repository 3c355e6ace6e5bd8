"""The claims study's decision code (studies/claims_report.py): Holm, the verdict rule, metrics."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy.stats")

from tests.agents.test_analysis import write_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_report():
    spec = importlib.util.spec_from_file_location(
        "claims_report", ROOT / "studies" / "claims_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["claims_report"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


report = load_report()


def test_holm_by_hand() -> None:
    # sorted 0.01, 0.03, 0.04 of m = 3 finite: 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04)
    got = report.holm([0.01, 0.04, 0.03, float("nan")])
    assert got[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(got[3])
    assert report.holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_welch_matches_the_formula() -> None:
    a, b = np.array([1.0, 2.0, 4.0, 7.0]), np.array([0.0, 1.0, 1.5])
    p, lo, hi = report.welch(a, b)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    from scipy import stats

    t = (a.mean() - b.mean()) / se
    assert p == pytest.approx(2 * stats.t.sf(abs(t), df))
    q = stats.t.ppf(0.975, df)
    assert (lo, hi) == pytest.approx((a.mean() - b.mean() - q * se, a.mean() - b.mean() + q * se))
    assert all(math.isnan(x) for x in report.welch(a, np.array([1.0])))


def test_verdict_rule() -> None:
    base = np.array([100.0, 101.0, 99.0, 100.5, 99.5])
    # clearly better, corrected p small: supported
    better = base + 30.0
    assert report.verdict(better, base, 0.15, 1e-4) == "supported"
    # better but the correction takes the p-value over 0.05: not supported only if the gain
    # is ruled out; +30% with a claimed +15% is not ruled out -> inconclusive
    assert report.verdict(better, base, 0.15, 0.2) == "inconclusive"
    # level with the base and tight: the claimed +15% (and the +10% default) is ruled out
    level = base + np.array([0.5, -0.5, 0.2, -0.2, 0.0])
    assert report.verdict(level, base, 0.15, 0.9) == "not supported"
    assert report.verdict(level, base, None, 0.9) == "not supported"
    # wide: the interval holds both no gain and the claimed gain
    wide = np.array([60.0, 150.0, 90.0, 140.0, 80.0])
    assert report.verdict(wide, base, 0.15, 0.9) == "inconclusive"
    # worse and significant is never "supported"
    assert report.verdict(base - 30.0, base, 0.15, 1e-4) == "not supported"


def test_negative_returns_gain_is_towards_zero() -> None:
    # Pendulum: -150 -> -130 is 13% closer to 0; a claimed 12% is within reach
    base = np.array([-150.0, -151.0, -149.0, -150.5, -149.5])
    arm = base + 20.0
    assert report.verdict(arm, base, 0.12, 1e-3) == "supported"
    assert report.verdict(base + 1.0 + np.array([0, 0.1, -0.1, 0.2, -0.2]), base, 0.12, 0.5) == (
        "not supported"
    )


def test_report_from_runs(tmp_path, capsys) -> None:
    # batch_norm: primary metric "early" = the mean evaluation over the first half
    root = tmp_path / "claims"
    for arm, early, late in (("buffer", 100.0, 300.0), ("batch", 200.0, 300.0)):
        for s in range(5):
            evals = [(st, [early + s]) for st in (250, 500)]
            evals += [(st, [late + s]) for st in (750, 1000)]
            write_run(root / "batch_norm" / arm, "per", s, [(1000, 1.0)], evals)
    assert report.main([str(root)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| batch_norm |"))
    # early: 102 vs 202 per arm mean; difference exact and constant: p tiny, supported
    assert "| early |" in row and "**supported**" in row
    assert "buffer 102" in row and "batch 202" in row
    assert "+98%" in row
    early = report.scores(report.load_arm(root / "batch_norm" / "buffer"), "early")
    np.testing.assert_allclose(early, [100.0, 101.0, 102.0, 103.0, 104.0])
    final = report.scores(report.load_arm(root / "batch_norm" / "batch"), "final")
    np.testing.assert_allclose(final, [300.0, 301.0, 302.0, 303.0, 304.0])


def test_report_without_runs_says_so(tmp_path, capsys) -> None:
    assert report.main([str(tmp_path)]) == 1
    assert "no claim with finished runs" in capsys.readouterr().err


def test_stage_two_metric_seed_filter_and_ceiling(tmp_path, capsys) -> None:
    # grad_clip: stage 1 judges final return, stage 2 the AUC; seeds 0-4 and 5-9 differ
    root = tmp_path / "claims"
    for arm, final in (("norm10", 500.0), ("is_half", 500.0)):
        for s in range(10):
            early = 100.0 + s + (50.0 if arm == "is_half" and s >= 5 else 0.0)
            evals = [(500, [early]), (1000, [final])]
            write_run(root / "grad_clip" / arm, "per", s, [(1000, 1.0)], evals)
    assert report.main([str(root), "--stage", "1", "--seeds", "0-4"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| grad_clip |"))
    # both arms at 500: +10% does not fit under CartPole's 500, and the table says so
    assert "| final |" in row and "| no |" in row and "**not supported**" in row
    assert report.main([str(root), "--stage", "2", "--seeds", "5-9"]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("| grad_clip |"))
    assert out.startswith("Stage 2, seeds 5-9.")
    assert "| auc |" in row and "| yes |" in row and "**supported**" in row
    assert "seeds [5, 6, 7, 8, 9]" in out
    with pytest.raises(SystemExit):
        report.main([str(root), "--seeds", "9-5"])
    assert "LO <= HI" in capsys.readouterr().err


def test_stage_two_judges_new_priority_on_the_last_td_arm(tmp_path, capsys) -> None:
    root = tmp_path / "claims"
    for arm, level in (("ever", 100.0), ("max_td", 100.0), ("last_td", 300.0)):
        for s in range(5):
            write_run(
                root / "new_priority" / arm,
                "per",
                s,
                [(1000, 1.0)],
                [(st, [level + s]) for st in (500, 1000)],
            )
    assert report.main([str(root), "--stage", "1"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| new_priority"))
    assert "max_td 102" in row and "**supported**" not in row
    assert report.main([str(root), "--stage", "2"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| new_priority"))
    assert "last_td 302" in row and "**supported**" in row


def test_attainable() -> None:
    assert report.attainable(np.array([400.0]), 0.2, "CartPole-v1")
    assert not report.attainable(np.array([460.0]), None, "CartPole-v1")
    assert report.attainable(np.array([-150.0]), 0.12, "Pendulum-v1")
    assert report.attainable(np.array([1e9]), 0.5, "Unknown-v0")
