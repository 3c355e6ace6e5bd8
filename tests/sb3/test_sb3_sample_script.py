"""benchmarks/sb3_sample.py runs end to end (tiny sizes) and writes its table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")

ROOT = Path(__file__).resolve().parents[2]


def test_sb3_sample_runs_and_every_row_has_a_time_and_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "sb3_sample.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sb3_sample.py"), "--capacity", "512",
           "--rounds", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "us/call" not in line]
    assert len(rows) == 5
    assert rows[0].startswith("| SB3 ReplayBuffer.sample") and "| 1.00x [1.00, 1.00] |" in rows[0]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d", cells[1]), row
        assert re.fullmatch(r"\d+\.\d\dx \[\d+\.\d\d, \d+\.\d\d\]", cells[2]), row
