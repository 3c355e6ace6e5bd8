"""Exceptions raised by fastper.

Argument errors are plain :class:`ValueError` / :class:`TypeError`; the classes
here name conditions of the buffer or of a file.
"""

from __future__ import annotations


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
