"""Self-benchmark of fastper's buffers (same as `fastper bench`).

Usage: python benchmarks/bench_core.py [--capacity N] [--batch-size B] [--kind KIND]
"""

from __future__ import annotations

import sys

from fastper.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
