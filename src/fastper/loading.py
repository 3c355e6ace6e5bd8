"""``fastper.load``: a checkpoint file back into a buffer, whatever holds its rows.

A checkpoint either holds its rows (:func:`fastper.buffer_state.load_file`)
or refers to a disk buffer's directory (:func:`fastper.disk.load_checkpoint`);
this module reads the header and sends the file to the one that knows it.
It sits above both, so neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import checkpoint as _ckpt
from . import schedules as _sched
from .buffer_state import load_file
from .disk import load_checkpoint
from .errors import CheckpointError

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    *,
    alpha: _sched.ScheduleLike | None = None,
    beta: _sched.ScheduleLike | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Any:
    """Load a buffer saved with ``buffer.save(path)``.

    The loaded buffer holds the same contents, priorities, keys, cursor,
    settings, schedules, step and random state, so it continues with exactly
    the samples the original would have drawn. The file is read once, rows and
    priorities straight into the new buffer: memory peaks at about the loaded
    buffer's own size. Files of every earlier format version load (format 1:
    fastper 0.1.0; see :func:`fastper.checkpoint.upgrade_v1`). A checkpoint
    of a disk buffer holds no rows: its directory is reopened, rows added
    after the checkpoint re-admitted (:func:`fastper.disk.load_checkpoint`).
    Never unpickles anything.

    Args:
        path: checkpoint file.
        alpha, beta: schedules to use instead of the saved ones; needed when
            the buffer was saved with a custom callable schedule.
        directory: for a checkpoint of a disk buffer, its directory (default:
            the one the checkpoint names, relative to the checkpoint's folder
            when it was saved beside it). Loading writes nothing before every
            check of the directory against the checkpoint passed.

    Raises:
        CheckpointError: a truncated, altered or malformed file, or an
            unknown format version (a ValueError).
        ScheduleNotSerializableError: a custom schedule was saved and none
            was given.
        ValueError: ``directory`` given for a checkpoint that holds its rows.
    """
    if _is_disk_reference(path):  # a disk buffer's checkpoint: reopen its directory
        return load_checkpoint(path, alpha=alpha, beta=beta, directory=directory)
    if directory is not None:
        raise ValueError(
            f"`directory` is only for a checkpoint of a disk buffer; {str(path)!r} holds its "
            f"rows, got directory={str(directory)!r}"
        )
    return load_file(path, alpha, beta)


def _is_disk_reference(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint refers to a disk buffer's files instead of holding rows. O(header)."""
    try:
        storage = _ckpt.read_metadata(path)["state"].get("storage")
    except (CheckpointError, OSError, AttributeError):
        return False  # load_file reports what is wrong with the file
    return isinstance(storage, Mapping) and "reference" in storage
