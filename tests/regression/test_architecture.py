"""The package's shape: imports go one way, no private names cross modules, one copy
of each sampling rule.

Regression tests for import cycles (buffers <-> buffer_state <-> disk,
ray_backend <-> ray_limiter <-> ray_router, cliffwalk <-> its report), for a
module that imported the package's ``__version__`` (a cycle through
``fastper/__init__``), for private names imported from other modules, and
for the IS weights and stratified targets written out in several places.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "fastper"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (``from . import x`` names module x)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names) and target in modules:
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    found.discard(name)
    return found


def test_defect_import_cycles_are_gone() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    left = dict(graph)
    while left:  # peel off the modules that import no module still left
        leaves = [m for m, deps in left.items() if not deps & left.keys()]
        assert leaves, "import cycle among " + ", ".join(
            f"{m} -> {sorted(d & left.keys())}" for m, d in sorted(left.items())
        )
        for m in leaves:
            del left[m]


def test_defect_no_private_name_is_imported_from_another_module() -> None:
    bad = []
    for name, path in _modules().items():
        if name.startswith("fastper._kernels"):  # one private package: inlined helpers
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [
                    a.name
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                    and not (node.module is None and node.level)  # a private module: fine
                ]  # fmt: skip
                if private:
                    bad.append(f"{name}:{node.lineno} imports {private}")
    assert bad == []


def test_one_implementation_of_the_sampling_rules() -> None:
    """IS weights and stratified targets are written out only in fastper.policy (and
    the compiled kernels, which evaluate the same expressions in the same order)."""
    weight = re.compile(r"\*\*\s*\(?-\s*beta|pow\(\s*-\s*beta|power\([^)]*-\s*beta")
    target = re.compile(r"\(\s*\w+\s*\+\s*u(\[\w+\])?\s*\)\s*\*")
    bad = []
    for name, path in _modules().items():
        if name == "fastper.policy" or name.startswith("fastper._kernels") or ".agents" in name:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if weight.search(code) or target.search(code):
                bad.append(f"{name}:{i}: {line.strip()}")
    assert bad == []
