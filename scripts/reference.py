"""Write docs/reference.md: every public name of fastper, from its docstring.

Usage:
    python scripts/reference.py [--check]

The modules and names listed in ``PUBLIC`` (each module's ``__all__`` where it
has one) are documented: the signature and the docstring of each function
and class, and of each public method and property of a class. ``--check``
exits 1 when docs/reference.md differs from what this script writes (a test
runs it), so the reference cannot fall behind the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "docs" / "reference.md"

#: module -> names (None: the module's ``__all__``)
PUBLIC: dict[str, list[str] | None] = {
    "fastper": None,
    "fastper.schedules": ["constant", "linear", "cosine", "piecewise", "step", "Schedule"],
    "fastper.nstep": ["NStepWriter", "autoreset_mode"],
    "fastper.spaces": None,
    "fastper.writer": ["RingWriter"],
    "fastper.storage": ["coerce_batch"],
    "fastper.device": None,
    "fastper.compat.dopamine": None,
    "fastper.compat.sb3": None,
    "fastper.limiter": None,
    "fastper.distributed": None,
    "fastper.frames": ["FrameStore", "default_frame_capacity"],
    "fastper.disk": None,
    "fastper.tiers": None,
}


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _signature(name: str, obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    return f"{name}{sig}"


def _members(cls: type) -> list[tuple[str, Any]]:
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property | staticmethod | classmethod) or inspect.isfunction(member):
            out.append((name, member))
    # inherited public API from fastper's own private bases (_Buffer, BufferCore, mixins)
    for base in cls.__mro__[1:]:
        if (
            base.__module__.startswith("fastper")
            and base.__name__.startswith("_")
            or (
                base.__module__.startswith("fastper")
                and (base.__name__ == "BufferCore" or base.__name__.endswith("Mixin"))
            )
        ):
            for name, member in vars(base).items():
                if name.startswith("_") or any(name == n for n, _ in out):
                    continue
                if isinstance(member, property | classmethod) or inspect.isfunction(member):
                    out.append((name, member))
    return out


def _class(module: str, name: str, cls: type) -> list[str]:
    lines = [f"### `{module}.{name}`", ""]
    lines += [f"```python\nclass {_signature(name, cls)}\n```", "", _doc(cls), ""]
    for mname, member in _members(cls):
        if mname == "__init__":
            continue
        if isinstance(member, property):
            lines += [f"- **`{mname}`** (property): {_first(member.fget)}"]
        else:
            func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            lines += [f"- **`{_signature(mname, func)}`**: {_first(func)}"]
    return [*lines, ""]


def _first(obj: Any) -> str:
    """The docstring's first paragraph, on one line."""
    doc = _doc(obj)
    return " ".join(doc.split("\n\n", 1)[0].split()) if doc else "(no docstring)"


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Every public name of fastper, generated from the docstrings by "
        "`python scripts/reference.py` (a test checks it is current). Costs are in the "
        "docstrings; measured figures live in `benchmarks/results/`.",
        "",
    ]
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _first(module), ""]
        for name in names if names is not None else list(module.__all__):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            if inspect.isclass(obj):
                lines += _class(module_name, name, obj)
            elif inspect.isfunction(obj) or callable(obj):
                lines += [
                    f"### `{module_name}.{name}`",
                    "",
                    f"```python\n{_signature(name, obj)}\n```",
                    "",
                    _doc(obj),
                    "",
                ]
            elif inspect.ismodule(obj):
                lines += [f"### `{module_name}.{name}`", "", f"Module: see `{obj.__name__}`.", ""]
            else:
                lines += [f"### `{module_name}.{name}`", "", f"`{obj!r}`", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print("docs/reference.md is stale: run python scripts/reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
