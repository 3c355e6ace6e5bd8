"""benchmarks/breakdown.py runs end to end (tiny sizes) and writes its table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_breakdown_runs_and_every_cell_is_a_number(tmp_path: Path) -> None:
    out = tmp_path / "breakdown.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "breakdown.py"), "--capacities", "4096",
           "300", "--rounds", "1", "--calls", "5", "--batch-size", "32", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    text = out.read_text()
    assert "| | N = 300 | N = 2^12 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "N = " not in line]
    assert len(rows) == 12
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == 2
        for cell in cells:
            assert re.fullmatch(r"-?\d+(\.\d+)?", cell), row
    levels = next(r for r in rows if r.startswith("| tree levels"))
    assert [c.strip() for c in levels.strip("|").split("|")][1:] == ["3", "4"]
