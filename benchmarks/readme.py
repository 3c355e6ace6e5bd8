"""Copy the peer-benchmark summary (benchmarks/results/peers.md) into README.md.

The README shows the same tables, from the same run, as the committed CSV;
``tests/unit/test_readme_benchmarks.py`` checks that they agree. Run after a
full ``python benchmarks/peers.py``:

    python benchmarks/readme.py
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


def sync(readme: Path, peers_md: Path) -> bool:
    """Replace the README block between the markers; True if it changed."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    block = summary_block(peers_md.read_text()).replace("### ", "#### ")
    new = f"{head}{START}\n{block}\n{END}{tail}"
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = sync(ROOT / "README.md", ROOT / "benchmarks" / "results" / "peers.md")
    print("README.md updated" if changed else "README.md already up to date", file=sys.stderr)
