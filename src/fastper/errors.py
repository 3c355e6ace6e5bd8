"""Exceptions raised by fastper.

Argument errors are plain :class:`ValueError` / :class:`TypeError`; the classes
here name conditions of the buffer or of a file, and :class:`MissingExtraError`
an optional dependency that is not installed (:func:`require` imports one,
with a one-line install hint).
"""

from __future__ import annotations

import importlib
from typing import Any


class FastPERError(Exception):
    """Base class of fastper's own exceptions."""


class EmptyBufferError(FastPERError, ValueError):
    """Sampling was asked of a buffer that holds no transition."""


class ZeroPriorityError(FastPERError, ValueError):
    """Every stored transition has priority zero, so nothing can be sampled."""


class FieldTypeError(FastPERError, TypeError, ValueError):
    """A value cannot be stored in a field without an unsafe cast.

    Subclasses both :class:`TypeError` (the kind of problem) and
    :class:`ValueError` (what storage raises for any bad transition).
    """


class CheckpointError(FastPERError, ValueError):
    """A checkpoint file is truncated, altered, of an unknown version or malformed."""


class ScheduleNotSerializableError(FastPERError, ValueError):
    """A buffer with a custom (non-fastper) schedule was saved or loaded without one."""


class InvalidIndexError(FastPERError, IndexError, ValueError):
    """An index is out of range, or names a slot that was never written."""


class DiskBufferError(CheckpointError):
    """A disk buffer's directory is not a fastper disk buffer, holds another layout,
    or a truncated or damaged file (see :mod:`fastper.disk`)."""


class DiskFullError(FastPERError, OSError):
    """The disk is full (ENOSPC / EDQUOT): nothing of the failed call was stored."""


class RecoveryWarning(UserWarning):
    """A reopened disk buffer recovered rows past its checkpoint, or lost some."""


class CapacityWarning(UserWarning):
    """A buffer will need more memory when full than this machine has."""


class MissingExtraError(FastPERError, ModuleNotFoundError):
    """An optional dependency is not installed (or fails to import).

    The message is one line naming what needs it and the extra that installs
    it, e.g. ``fastper.device needs the torch extra (torch is not
    installed): pip install "fastper[torch]"``. :attr:`extra` is the extra's
    name, :attr:`name` the module that could not be imported.
    """

    def __init__(self, message: str, *, name: str, extra: str) -> None:
        super().__init__(message, name=name)
        self.extra = extra

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only fields: rebuilt from the message and state, so the error
        # survives a copy or a trip between processes (a Ray shard's import error)
        return (_rebuild_missing_extra, (str(self), self.name or "", self.extra))


def _rebuild_missing_extra(message: str, name: str, extra: str) -> MissingExtraError:
    """``pickle``'s way back to a :class:`MissingExtraError`."""
    return MissingExtraError(message, name=name, extra=extra)


#: the extra that installs each optional module fastper (or its command) imports
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "ray": "ray",
    "gymnasium": "agents",
    "tqdm": "agents",
    "matplotlib": "agents",
    "scipy": "agents",
    "minatar": "minatar",
    "stable_baselines3": "sb3",
    "torchrl": "torchrl",
    "tensordict": "torchrl",
    "rliable": "stats",
    "pandas": "stats",
    "lz4": "tiers",
    "zstandard": "tiers",
    "blosc2": "tiers",
}


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install "fastper[extra]"``, and its form
    in a clone of the repository."""
    return f'pip install "fastper[{extra}]" (in a clone: pip install -e ".[{extra}]")'


def missing_extra(
    feature: str, exc: ImportError, extra: str | None = None, module: str | None = None
) -> MissingExtraError:
    """The one-line :class:`MissingExtraError` for ``exc`` (an import that failed) in ``feature``.

    Args:
        feature: what needs the module, as the user knows it
            (``"fastper.device"``, ``"the lz4 codec"``, ``"fastper train"``).
        exc: the error the import raised.
        extra: the extra that installs it; by default looked up in :data:`EXTRAS`
            from the missing module's top-level name.
        module: the module imported (default: the one ``exc`` names).
    """
    missing = getattr(exc, "name", None) or module or "?"
    top = (module or missing).split(".")[0]
    extra = extra or EXTRAS.get(top) or EXTRAS.get(missing.split(".")[0]) or top
    if isinstance(exc, ModuleNotFoundError) and getattr(exc, "name", None):
        why = f"{missing} is not installed"
    else:  # installed, but its import fails (a broken build, a missing system library)
        lines = str(exc).strip().splitlines()
        why = f"import {module or missing} failed: {lines[0] if lines else type(exc).__name__}"
    return MissingExtraError(
        f"{feature} needs the {extra} extra ({why}): {install_hint(extra)}",
        name=missing,
        extra=extra,
    )


def require(module: str, feature: str, extra: str | None = None) -> Any:
    """Import ``module`` (an optional dependency) and return it; O(1) once imported.

    Raises:
        MissingExtraError: it is not installed or fails to import; one line
            naming ``feature``, the extra (default: from :data:`EXTRAS`) and
            the pip command.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:  # not installed: the one line says it all
        raise missing_extra(feature, exc, extra, module) from None
    except ImportError as exc:  # installed but broken: keep its traceback as the cause
        raise missing_extra(feature, exc, extra, module) from exc
