"""benchmarks/step_ab.py runs end to end (tiny sizes) and writes its table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_ab_runs_and_every_row_has_both_sides_and_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "ab.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_ab.py"), "--base", "HEAD",
           "--capacities", "4096", "--rounds", "1", "--calls", "5", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = out.read_text()
    assert "#### N = 2^12" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "operation" not in line]
    names = [r.strip("|").split("|")[0].strip() for r in rows]
    assert names == [
        "sample, B=32", "update, B=32", "learner step, defaults, B=32",
        "sample, B=256", "update, B=256", "learner step, defaults, B=256",
        'learner step, weight_norm="batch", B=256', 'learner step, max_priority="current", B=256',
    ]  # fmt: skip
    for row in rows:
        base, new, ratio = (c.strip() for c in row.strip("|").split("|")[1:])
        assert float(base) > 0 and float(new) > 0, row
        m = re.fullmatch(r"(\d+\.\d+) \((\d+\.\d+) - (\d+\.\d+)\)", ratio)
        assert m, row
        assert abs(float(m.group(1)) - float(new) / float(base)) < 0.01, row  # one round
