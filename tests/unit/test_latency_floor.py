"""benchmarks/latency_floor.py: the regions the probe reads, a run, and how the peer
report shows it beside the learner step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastper._kernels.tree import layout

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import latency_floor
    import peers
    import report

    return latency_floor, report, peers


@pytest.mark.parametrize("capacity", [1000, 2**20, 2**22])
def test_regions_are_the_lines_a_step_reads(bench: Any, capacity: int) -> None:
    latency_floor, _, _ = bench
    regions = dict(latency_floor.step_regions(capacity))
    n_leaves, offs, depth = layout(capacity)
    # the sum and min trees' levels, the leaves, the row, the raw priorities: the
    # benchmark's 48-byte rows are stored as records, one line read per row
    assert len(regions) == 2 * depth + 1 + 1 + 1
    assert regions["leaves"] == n_leaves // 8 == regions["raw priorities"]
    assert regions[f"sum level {depth}"] == regions[f"min level {depth}"] == 1  # the root's line
    assert regions["sum level 1"] == int(offs[2] - offs[1]) // 8
    assert regions["records"] == -(-capacity * 48 // 64)
    assert not any(name.startswith("column") for name in regions)


def test_probe_times_every_call_and_maps_its_pages(bench: Any) -> None:
    latency_floor, _, _ = bench
    probe = latency_floor.Floor(4096)
    assert probe.nbytes == sum(n for _, n in probe.regions) * 64
    us = probe.time_calls(32, calls=7, warmup=2)
    assert us.shape == (7,) and (us > 0).all() and np.isfinite(us).all()
    assert "dependent random line reads per draw" in probe.describe()


def _result(step: float | None, floor: float | None) -> dict[str, Any]:
    rows = []
    for op, v in (("learner_step", step), ("floor", floor)):
        if v is not None:
            rows.append({"op": op, "batch": 256, "median_us": v, "p90_us": v, "calls": 3,
                         "extrapolated": False, "bytes_per_slot": None, "notes": ""})  # fmt: skip
    return {"lib": "fastper", "capacity": 2**20, "available": True, "rows": rows}


def test_summary_table_shows_floor_and_ratio(bench: Any) -> None:
    _, report, peers = bench
    lines = report.summary_tables([_result(80.0, 50.0)], 256)
    assert "| floor us (memory-latency probe) | 50.0 | - | - |" in lines
    assert "| fastper / floor | 1.60x | - | - |" in lines
    assert peers.floor_lines([_result(80.0, 50.0)]) == [
        "[peers] fastper N=1048576 B=256: learner step 80.0 us, floor us 50.0, fastper / floor 1.60"
    ]


def test_summary_table_without_a_floor_is_unchanged(bench: Any) -> None:
    _, report, peers = bench
    lines = report.summary_tables([_result(80.0, None)], 256)
    assert not any("floor" in line for line in lines)
    assert peers.floor_lines([_result(80.0, None)]) == []
