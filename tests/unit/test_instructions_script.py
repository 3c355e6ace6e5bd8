"""benchmarks/instructions.py: its worker runs every counted operation on the
current API (the valgrind run itself takes minutes: a benchmark, not a test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_worker_runs_every_operation_and_names_them_in_order() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "instructions.py"), "--worker", "1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    names = [line for line in out.splitlines() if line]
    assert names == [
        "add, one transition",
        "add, 256 rows",
        "add, 1024 rows",
        "n-step add (n=3), one transition",
        "add, one transition (the n-step fields)",
        "n-step add (n=3), 4-env vector step",
        "add, 4 rows (the n-step fields)",
        "SB3 drop-in add, one env",
        "SB3's own ReplayBuffer.add, one env (the reference)",
        "SB3 drop-in add, 4 envs",
        "SB3's own ReplayBuffer.add, 4 envs (the reference)",
        "gather of 256 rows (Storage.gather)",
        "sample(256)",
        "update_priorities(256)",
        "learner step (sample(256) + update)",
        "rank-based step (add + sample(256) + update)",
        "proportional step (add + sample(256) + update; the reference)",
    ]
