"""docs/reference.md documents every public name and is current (scripts/reference.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")  # fastper.device is part of the reference

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("reference", ROOT / "scripts" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_current_and_every_public_name_has_a_docstring() -> None:
    ref = _script()
    text = ref.render()
    assert (ROOT / "docs" / "reference.md").read_text() == text, (
        "docs/reference.md is stale: run python scripts/reference.py"
    )
    assert "(no docstring)" not in text
    import fastper
    import fastper.device

    for module in (fastper, fastper.device):
        for name in module.__all__:
            if not name.startswith("__"):
                assert f"`{module.__name__}.{name}`" in text, name
