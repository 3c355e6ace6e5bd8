"""The README's benchmark tables show exactly the committed results."""

from __future__ import annotations

import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = {
    "learner step": "learner_step",
    "update": "update",
    "fill": "fill",
    "sample": "sample",
    "memory": "memory",
}


def _readme_rows() -> list[tuple[int, str, list[str], list[str]]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- peers:start -->", 1)[1].split("<!-- peers:end -->", 1)[0]
    rows = []
    capacity, libs = 0, []
    for line in block.splitlines():
        if m := re.match(r"#+ N = 2\^(\d+), B = 256", line):
            capacity = 2 ** int(m.group(1))
        elif line.startswith("| op |"):
            libs = [c.strip().split(" ")[0] for c in line.strip("|").split("|")[1:-2]]
        elif line.startswith("| ") and not line.startswith("|---") and libs:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((capacity, cells[0], libs, cells[1 : 1 + len(libs)]))
    return rows


def _csv() -> dict[tuple[str, int, str], float]:
    out = {}
    with open(ROOT / "benchmarks" / "results" / "peers.csv") as f:
        for r in csv.DictReader(f):
            if r["op"] == "memory" and r["bytes_per_slot"]:
                out[(r["lib"], int(r["capacity"]), "memory")] = float(r["bytes_per_slot"])
            elif r["median_us"] and (r["op"] == "fill" or r["batch"] == "256"):
                out[(r["lib"], int(r["capacity"]), r["op"])] = float(r["median_us"])
    return out


def test_readme_tables_match_committed_csv() -> None:
    rows = _readme_rows()
    values = _csv()
    assert {cap for cap, *_ in rows} == {2**20, 2**22}
    checked = 0
    for capacity, label, libs, cells in rows:
        op = next(v for k, v in OPS.items() if label.startswith(k))
        for lib, cell in zip(libs, cells, strict=True):
            if cell == "n/a":
                assert (lib, capacity, op) not in values
                continue
            shown = float(cell.lstrip("~").replace(",", ""))
            actual = values[(lib, capacity, op)]
            # the tables show about three significant digits
            assert abs(shown - actual) <= 0.006 * abs(actual) + 5e-4, (lib, capacity, op)
            checked += 1
    assert checked >= 20


def test_readme_workloads_tables_are_the_committed_run() -> None:
    committed = (ROOT / "benchmarks" / "results" / "workloads.md").read_text()
    rows = [line for line in committed.splitlines() if line.startswith("| ")]
    assert len(rows) >= 14  # two capacities, seven workloads each
    readme = (ROOT / "README.md").read_text()
    missing = [row for row in rows if row not in readme]
    assert not missing, missing
