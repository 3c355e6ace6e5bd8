"""The benchmark figures shown to users are exactly the committed results.

docs/benchmarks.md shows the peer tables (between the peers markers) and the
workloads tables; the README's comparison table shows speed ratios and times
taken from the same run; the GPU guide's table shows the committed GPU run.
Each is checked against benchmarks/results/.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
OPS = {
    "learner step": "learner_step",
    "update": "update",
    "fill": "fill",
    "sample": "sample",
    "memory": "memory",
}


def _peer_rows() -> list[tuple[int, str, list[str], list[str]]]:
    text = PAGE.read_text()
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


def _close(shown: float, actual: float) -> bool:
    # the tables show about three significant digits
    return abs(shown - actual) <= 0.006 * abs(actual) + 5e-4


def test_benchmarks_page_peer_tables_match_committed_csv() -> None:
    rows = _peer_rows()
    values = _csv()
    assert {cap for cap, *_ in rows} == {2**20, 2**22}
    checked = 0
    for capacity, label, libs, cells in rows:
        op = next((v for k, v in OPS.items() if label.startswith(k)), None)
        if op is None:  # fastper's memory-latency floor rows: fastper's own, not in the csv
            assert label.startswith(("floor us", "fastper / floor")), label
            continue
        for lib, cell in zip(libs, cells, strict=True):
            if cell == "n/a":
                assert (lib, capacity, op) not in values
                continue
            shown = float(cell.lstrip("~").replace(",", ""))
            assert _close(shown, values[(lib, capacity, op)]), (lib, capacity, op)
            checked += 1
    assert checked >= 20


def test_readme_comparison_ratios_are_the_committed_run() -> None:
    """Each README row 'fastper time, then peer / fastper' matches peers.csv at 2^20."""
    values = _csv()
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### Compared with other replay libraries", 1)[1].split("\n\n", 2)[1]
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    ops = {"learner step": "learner_step", "sample 256": "sample", "update 256": "update"}
    checked = 0
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        op = next((v for k, v in ops.items() if cells[0].startswith(k)), None)
        if op is None:
            continue
        assert "2^20 slots" in cells[0], cells[0]
        own = values[("fastper", 2**20, op)]
        m = re.fullmatch(r"1x \(([\d.]+) us\)", cells[header.index("fastper")])
        assert m and _close(float(m.group(1)), own), cells
        for lib, cell in zip(header[1:], cells[1:], strict=True):
            key = (lib.lower(), 2**20, op)
            if m := re.fullmatch(r"([\d.]+)x slower", cell):
                assert key in values, (lib, op)
                assert abs(float(m.group(1)) - values[key] / own) <= 0.006, (lib, op, cell)
                checked += 1
            elif lib != "fastper":
                assert key not in values, f"{lib} was measured: show its ratio for {op}"
    assert checked == 6  # cpprb and tianshou, three operations


def test_benchmarks_page_workloads_tables_are_the_committed_run() -> None:
    committed = (ROOT / "benchmarks" / "results" / "workloads.md").read_text()
    page = PAGE.read_text()
    rows = [
        line for line in committed.splitlines() if line.startswith("| ") and "us/call" not in line
    ]
    assert len(rows) >= 24  # two capacities, twelve workloads each
    shown = {line.split("|")[1:6].__repr__() for line in page.splitlines() if line.startswith("| ")}
    missing = [row for row in rows if row.split("|")[1:6].__repr__() not in shown]
    assert not missing, missing


def _device_tables(path: Path) -> dict[int, dict[str, list[str]]]:
    """benchmarks/results/device*.md: per batch size, each variant's cells."""
    tables: dict[int, dict[str, list[str]]] = {}
    batch = 0
    for line in path.read_text().splitlines():
        if m := re.match(r"## B = (\d+),", line):
            batch = int(m.group(1))
            tables[batch] = {}
        elif batch and line.startswith("| ") and not line.startswith("| variant"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            tables[batch][cells[0]] = cells[1:]
    return tables


def test_gpu_guide_figures_are_the_committed_gpu_run() -> None:
    runs = _device_tables(ROOT / "benchmarks" / "results" / "device_cuda.md")
    guide = (ROOT / "docs" / "guides" / "gpu.md").read_text()
    rows = [line for line in guide.splitlines() if re.match(r"\| (256|4096) \|", line)]
    assert len(rows) == 2
    for line in rows:
        batch, graphed, eager, torchrl, cpu = [c.strip() for c in line.strip("|").split("|")]
        run = runs[int(batch)]

        def loop(label: str, run: dict[str, list[str]] = run) -> str:
            return run[label][0] + " us"

        device = "fastper.device, backend=torch, validate="
        assert graphed == loop(device + "True, graphed_step")
        assert eager == f"{loop(device + 'True')[:-3]} / {loop(device + 'False')}"
        (trl,) = [v for k, v in run.items() if k.startswith("TorchRL")]
        assert torchrl == f"{trl[0]} us, {trl[4]} syncs"
        assert cpu == loop("fastper CPU buffer, numpy (reference)")
