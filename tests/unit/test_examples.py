"""The examples run as documented."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_and_learns_priorities() -> None:
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    buf = module.main(steps=400)
    assert len(buf) > 300
    # sampled transitions got their |td| back as priorities: no longer all equal
    assert len(set(buf.priorities(range(len(buf))).round(9))) > 1
    assert buf.sample(16).weights.max() <= 1.0
