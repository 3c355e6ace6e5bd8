"""Functions specialised by generated source (the no-cast adds' hot paths).

A hot path that runs once per env step (a single add) pays for every loop,
tuple and attribute lookup in Python. Where its shape depends only on a
layout (the fields, their positions), the module that owns the path writes
the source of a straight-line function for that layout, and this module
compiles it once per source and binds it to the objects it reads (columns,
windows) as its globals. The sources are made by fastper from field facts,
never from user text.
"""

from __future__ import annotations

import functools
from types import CodeType
from typing import Any

__all__ = ["specialise"]


@functools.lru_cache(maxsize=128)
def _compiled(label: str, source: str) -> CodeType:
    """``source`` compiled (objects of one layout share the code, not the data)."""
    return compile(source, f"<fastper.{label}>", "exec")


def specialise(label: str, source: str, constants: dict[str, Any], *names: str) -> tuple[Any, ...]:
    """The functions ``names`` defined by ``source``, reading ``constants`` as their
    globals; ``label`` names the source in tracebacks."""
    namespace = dict(constants)
    exec(_compiled(label, source), namespace)  # noqa: S102
    # (popped: the namespace is the functions' globals, so keeping them in it would
    # be a reference cycle, and what they read would wait for the cycle GC)
    return tuple(namespace.pop(name) for name in names)
