"""The published results (docs/results): no machine paths, links that resolve, seeds stated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

#: an absolute path on some machine: /work/..., /tmp/..., /home/..., C:\Users\...
MACHINE_PATH = re.compile(
    r"(?:^|[\s`'\"(=:,\[])(/(?:work|tmp|home|root|Users|mnt|scratch|private|var/folders)/"
    r"|[A-Za-z]:\\(?:Users|work)\\)"
)
#: markdown links and images: [text](target) / ![alt](target), target without a title
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _text_files() -> list[Path]:
    return [p for p in sorted(RESULTS.rglob("*")) if p.is_file() and p.suffix != ".png"]


def _pages() -> list[Path]:
    """The results pages written by the studies here (the SB3 pages have their own tests)."""
    sb3 = RESULTS / "sb3"
    return [p for p in sorted(RESULTS.rglob("*.md")) if sb3 not in p.parents]


def test_the_results_exist() -> None:
    # the checks below would pass on an empty folder: make sure they look at the pages
    assert len(_pages()) >= 20 and (RESULTS / "index.md").is_file()


def test_no_results_file_names_a_path_on_the_machine_it_was_made_on() -> None:
    found = []
    for path in _text_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not found, "paths must be relative to the repository (or OUT=...):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "runs are in `/root/fastper-runs/minatar`",
        "OUT=/work/runs bash studies/minatar.sh",
        "see (/home/me/x)",
        "saved to C:\\Users\\me\\runs",
        "/tmp/out/curve.png",
    ],
)
def test_the_scan_finds_machine_paths(line: str) -> None:
    assert MACHINE_PATH.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "`docs/results/minatar/runs`",
        "OUT=runs/minatar bash studies/minatar.sh",
        "10/work/s",
        "and/or tmp/home",
        "[curve](curve.png)",
    ],
)
def test_the_scan_leaves_relative_paths(line: str) -> None:
    assert not MACHINE_PATH.search(line)


def test_every_relative_link_in_the_results_pages_points_to_a_file_under_docs() -> None:
    # a strict MkDocs build fails on a link to a missing page or to a file outside docs/
    bad = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # https:, mailto:, an anchor on the same page
            file = (page.parent / target.split("#")[0]).resolve()
            if not file.is_file() or DOCS.resolve() not in file.parents:
                bad.append(f"{page.relative_to(ROOT)}: ({target})")
    assert not bad, "links must point to an existing file under docs/:\n" + "\n".join(bad)


def test_every_comparison_table_states_its_seeds() -> None:
    # compare_*.md: an "n (seeds)" column; verdicts: an n column; across games: runs x games
    tables = [p for p in _pages() if p.name.startswith(("compare", "verdicts"))]
    assert tables
    for page in tables:
        header = next(ln for ln in page.read_text().splitlines() if ln.startswith("| "))
        cells = [c.strip() for c in header.strip("|").split("|")]
        assert "n (seeds)" in cells or "n" in cells, f"{page.relative_to(ROOT)}: {header}"
    across = (RESULTS / "minatar" / "across_games.md").read_text()
    assert "| n (runs x games) |" in across


def _study(name: str, monkeypatch):
    """A module of studies/ (they import each other by name), loaded from its file."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "studies"))
    return importlib.import_module(name)


def test_the_generators_write_no_machine_path(tmp_path, capsys, monkeypatch) -> None:
    # the tables are built from runs anywhere on the machine (OUT=/abs/path): the pages written
    # must not name that place
    pytest.importorskip("scipy.stats")
    from fastper.agents import analysis, stats
    from tests.agents.test_analysis import write_run

    # scipy's bootstrap, not rliable's (slower); the paths written do not depend on it
    monkeypatch.setattr(stats, "_rliable", lambda: "rliable is not used in this test")
    root = tmp_path / "runs"
    for game in ("GameA", "GameB"):
        for replay, level in (("uniform", 100.0), ("per", 120.0), ("rank", 110.0)):
            for seed in range(3):
                evals = [(st, [level + seed + st / 100]) for st in (500, 1000)]
                ramp = [(st, level * st / 1000) for st in range(50, 1001, 50)]
                write_run(root / game, replay, seed, ramp, evals)
    groups = analysis.group_runs(analysis.find_runs([root / "GameA"]))
    outputs = {"compare": analysis.compare_table(groups, None, 5, backend="scipy")}
    for script, arg in (("minatar_tests", root / "GameA"), ("minatar_across", root)):
        assert _study(script, monkeypatch).main([str(arg)]) == 0
        outputs[script] = capsys.readouterr().out
    assert "| per vs uniform, final return |" in outputs["minatar_tests"]
    assert "| rank | 3 x 2 |" in outputs["minatar_across"]
    for name, text in outputs.items():
        assert str(tmp_path) not in text and not MACHINE_PATH.search(text), (name, text)
