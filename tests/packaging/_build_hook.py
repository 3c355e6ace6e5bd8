"""The build hook, setup.py, as a module for the tests (no numba needed to load it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def build_hook() -> Any:
    """setup.py as a module: its helpers, without running ``setup()`` (only as a script)."""
    spec = importlib.util.spec_from_file_location("fastper_build_hook", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
