"""benchmarks/device.py runs end to end (smoke sizes) and reports every variant."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_device_benchmark_smoke_run_reports_each_variant(tmp_path: Path) -> None:
    out = tmp_path / "device.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "device.py"), "--device", "cpu", "--quick",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for variant in ("backend=torch, validate=False", "backend=numba", "(reference)"):
        row = next(line for line in text.splitlines() if variant in line and line.startswith("|"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"[\d,]+", cells[1]), row  # a measured time per step
    assert "CPU device:" in text and ("PASS" in text or "FAIL" in text)
