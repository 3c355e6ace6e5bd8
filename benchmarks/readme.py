"""Copy the peer-benchmark summary (benchmarks/results/peers.md) into docs/benchmarks.md.

The benchmarks page shows the same tables, from the same run, as the committed CSV;
``tests/unit/test_readme_benchmarks.py`` checks that they agree. Run after a
full ``python benchmarks/peers.py``:

    python benchmarks/readme.py

It refuses (exit status 2, docs/benchmarks.md untouched) when peers.md measured no
peer library, i.e. every "fastest peer" cell of its summary reads n/a.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- peers:start -->"
END = "<!-- peers:end -->"


def summary_block(peers_md: str) -> str:
    """The '## Summary' section of peers.md, without its heading."""
    match = re.search(r"^## Summary\n(.*?)(?=^## )", peers_md, flags=re.S | re.M)
    if match is None:
        raise ValueError("peers.md has no '## Summary' section")
    return match.group(1).strip()


def check_measured(block: str) -> None:
    """ValueError unless some row of the summary tables names a fastest peer (not n/a)."""
    peers = []
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith("| op |"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 3:
                peers.append(cells[-2])  # the "fastest peer" column
    if not any(p != "n/a" for p in peers):
        raise ValueError(
            "peers.md measured no peer library (every 'fastest peer' cell is n/a); run "
            "python benchmarks/peers.py with them installed (pip install 'fastper[bench]') first"
        )


def sync(readme: Path, peers_md: Path) -> bool:
    """Replace the block between the markers; True if it changed."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    block = summary_block(peers_md.read_text()).replace("### ", "#### ")
    check_measured(block)
    new = f"{head}{START}\n{block}\n{END}{tail}"
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    try:
        changed = sync(ROOT / "docs" / "benchmarks.md", ROOT / "benchmarks" / "results" / "peers.md")
    except (ValueError, OSError) as exc:
        print(f"readme.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print("docs/benchmarks.md updated" if changed else "docs/benchmarks.md already up to date", file=sys.stderr)
