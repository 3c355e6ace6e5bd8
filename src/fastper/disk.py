"""Replay storage on disk: capacity limited by the disk, not by RAM.

:class:`DiskStorage` follows :class:`~fastper.storage.ReplayStorage`: one
file per field in a directory, plus a JSON header (the layout) and a durable
row counter. Small fields are mirrored in RAM while they fit ``ram_budget``
(write-through: the file stays the durable copy); the others are read from
the files at every ``gather``. Priorities, trees and the ring stay in the
buffer, in RAM (about 18 bytes per slot for a proportional buffer).

Directory layout::

    fastper-disk.json   {"format": "fastper-disk", "version": 1, "id", "capacity",
                         "fields": [[name, {"shape", "dtype"}], ...], "files": [...]}
    counter.bin         40 bytes: magic, epoch, rows, intent, CRC-32 (little-endian)
    field-000.bin ...   capacity x (bytes of one row), C order, allocated at creation

Explicit reads, not memory maps: measured by ``python -m benchmarks.disk``
(``benchmarks/results/disk.md``; 2-core VM, virtio disk, files of 20,000 rows)

============================================  ==========  =================
B=32 random rows                              ``preadv``  ``mmap``
============================================  ==========  =================
84x84x4 uint8 (28,224 B), in the page cache     267 us      314 us
84x84x4 uint8, evicted (read from the disk)     8.0 ms      341 ms (26 ms
                                                            with MADV_RANDOM)
8 x float32, in the page cache                   90 us        4 us
RSS after 3,000 gathers of image rows            +0 MiB     +538 MiB
============================================  ==========  =================

Writes of 32 image rows: ``pwrite`` 258 us, assignment into a map 210 us,
but every page written through a map stays in the process's RSS (+538 MiB
for 538 MiB written). So rows are read with one ``os.preadv`` per row
straight into the batch (no extra copy) and written with one ``pwrite`` per
field and contiguous run: the page cache holds the hot rows, the kernel
reclaims it under a memory limit, and RSS stays flat. A syscall per row
costs about 3 us, which dominates small rows: hence the RAM mirror of small
fields (``np.take``, as the RAM storage), chosen smallest first. With 3 GiB
of Atari rows under a 1 GiB cgroup limit (page cache counted), add, sample
and update ran with a peak RSS of 171 MiB; the RAM storage was killed.

Crash consistency (a process crash: the page cache survives it). Each
``write`` stores ``intent = max(intent, rows + k)`` in the counter, then the
rows, then ``rows += k``; the counter never covers a row not written. After
a crash mid-write, the stored rows it was overwriting (the oldest, which it
evicted) may be part old, part new: they are *torn*. They are the stored
rows in the slots of rows ``rows .. intent-1``, so the counter itself keeps
them: :func:`open_buffer` drops them at every reopening (they are never
sampled, under any scheme) until later adds overwrite their slots, which
moves ``rows`` past them (``intent`` is never lowered; nothing else is
written for it). A checkpoint (``buffer.save``) fsyncs the files, so rows
it covers also survive power loss; rows written after it survive a process
crash only.

A checkpoint holds a reference instead of the rows: the directory's id, its
epoch and row counter, and its path, relative to the checkpoint's folder
when the two share a folder below the filesystem's root (so a run's folder
copied whole reopens the copy, not the original), else absolute. Loading
writes nothing to a directory before it has checked that it is the one the
checkpoint was taken of (see :func:`load_checkpoint`).

Costs: ``gather`` O(B) syscalls for disk fields; ``write`` O(B) bytes, one
``pwrite`` per disk field (two where the ring wraps) plus two 40-byte counter
writes; RAM: the mirrored fields (``capacity x`` their bytes per slot).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import _disk_files as _files
from . import buffer_state as _bs
from . import checkpoint as _ckpt
from ._disk_files import COUNTER, FORMAT, HEADER, VERSION
from ._validation import check_int, show
from .errors import (
    CheckpointError,
    DiskBufferError,
    RecoveryWarning,
)
from .storage import FieldLike, check_columns, coerce_batch, make_fields

__all__ = [
    "COUNTER", "DEFAULT_RAM_BUDGET", "FORMAT", "HEADER", "VERSION", "DiskStorage",
    "RecoveryReport", "load_checkpoint", "open_buffer", "referenced_directory",
]  # fmt: skip

#: RAM the small-field mirror may take by default (bytes)
DEFAULT_RAM_BUDGET = 64 * 2**20


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`open_buffer` restored, recovered and lost.

    Attributes:
        restored: stored rows whose priorities came from the checkpoint.
        recovered: rows found on disk past the checkpoint (all rows without
            one), re-admitted with the buffer's new-transition priority.
        torn: stored rows that a write interrupted by a crash was
            overwriting, so part old, part new: dropped. They keep their
            slots in the ring but are never sampled, under any scheme, nor
            counted in the number of valid transitions, until an add
            overwrites their slot; every reopening drops them again (the
            directory remembers them) and counts them here.
        pending_dropped: transitions waiting in the checkpoint's n-step
            windows, dropped because rows were added after it (their windows
            had moved on). Windows pending at the crash itself were in the
            process's memory and cannot be counted.
        checkpoint: the checkpoint used, or ``None``.
    """

    restored: int
    recovered: int
    torn: int
    pending_dropped: int
    checkpoint: str | None

    @property
    def lossless(self) -> bool:
        """Nothing recovered, torn or dropped: the buffer is the checkpoint's."""
        return self.recovered == 0 and self.torn == 0 and self.pending_dropped == 0


class DiskStorage:
    """Columnar ring storage in files, one per field (see the module docstring).

    Creates a new disk buffer in ``directory`` (missing or empty). To reopen
    one whose process ended, use :func:`open_buffer` (or :meth:`open` for the
    bare storage). Not locked: the buffer holds its lock around every call.

    Args:
        fields: the field spec, as for :class:`~fastper.storage.Storage`.
        capacity: number of slots; the files take ``capacity`` x the bytes
            of one transition, allocated now.
        directory: where the files go.
        ram_budget: bytes of RAM for mirrors of the smallest fields (whole
            columns, smallest first, while they fit). 0: every field on disk.
        exist_ok: reuse a directory that already holds a disk buffer of this
            layout, starting it empty (its rows are forgotten).

    Raises:
        DiskBufferError: the directory is not empty and not a fastper disk
            buffer, holds another layout, or a damaged file.
        DiskFullError: the files do not fit on the disk (nothing is left behind).
        FileExistsError: the directory holds a disk buffer and not ``exist_ok``.
    """

    #: rows are durable where they are: a checkpoint refers to them (see ``reference_state``)
    persistent = True
    #: ``gather`` only reads (positioned reads, no shared state): it may run while
    #: another thread writes (see :class:`fastper.storage.ReplayStorage`)
    concurrent_gather = True

    def __init__(
        self,
        fields: Mapping[str, FieldLike],
        capacity: int,
        directory: str | os.PathLike[str],
        *,
        ram_budget: int = DEFAULT_RAM_BUDGET,
        exist_ok: bool = False,
    ) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields = make_fields(fields)
        ram_budget = check_int("ram_budget", ram_budget, minimum=0)
        path = Path(directory)
        self._fds: dict[str, int] = {}
        self._counter_fd = -1
        if (path / HEADER).exists():
            header = _files.read_header(path)
            _files.check_layout(path, header, self.fields, self.capacity)
            if not exist_ok:
                raise FileExistsError(
                    f"directory {str(path)!r} already holds a fastper disk buffer: reopen it "
                    "with fastper.disk.open_buffer(directory), or pass exist_ok=True to "
                    "start it empty"
                )
            self._attach(path, header, ram_budget)
            self.clear()
            return
        if path.exists():
            if not path.is_dir():
                raise DiskBufferError(f"{str(path)!r} is not a directory")
            if any(path.iterdir()):
                raise DiskBufferError(
                    f"directory {str(path)!r} is not a fastper disk buffer (no {HEADER}) and "
                    "is not empty: give a new or empty directory"
                )
        header = _files.create(path, self.fields, self.capacity)
        self._attach(path, header, ram_budget)

    @classmethod
    def open(
        cls, directory: str | os.PathLike[str], *, ram_budget: int = DEFAULT_RAM_BUDGET
    ) -> DiskStorage:
        """The storage of an existing disk buffer, with the rows its counter covers.

        A bare storage: a buffer must adopt its rows (:func:`open_buffer` does).
        O(N) reads for the mirrored fields.

        Raises:
            DiskBufferError: not a disk buffer, a damaged or truncated file.
        """
        path = Path(directory)
        if not (path / HEADER).is_file():
            raise DiskBufferError(
                f"directory {str(path)!r} is not a fastper disk buffer (no {HEADER})"
                if path.is_dir()
                else f"disk buffer directory {str(path)!r} does not exist"
            )
        header = _files.read_header(path)
        self = cls.__new__(cls)
        self.capacity = int(header["capacity"])
        self.fields = make_fields(
            {name: (tuple(spec["shape"]), spec["dtype"]) for name, spec in header["fields"]}
        )
        _files.check_layout(path, header, self.fields, self.capacity)
        self._fds = {}
        self._counter_fd = -1
        self._attach(path, header, check_int("ram_budget", ram_budget, minimum=0))
        return self

    def _attach(self, path: Path, header: Mapping[str, Any], ram_budget: int) -> None:
        """Open the files, read the counter, fill the mirrors. O(N) for mirrored fields."""
        self.directory = path
        self.id = str(header["id"])
        self.ram_budget = ram_budget
        self._row = {n: f.nbytes_per_item for n, f in self.fields.items()}
        self._paths = {
            n: path / fname for n, fname in zip(self.fields, header["files"], strict=True)
        }
        self.mirrors: dict[str, np.ndarray] = {}
        try:
            for name, p in self._paths.items():
                self._fds[name] = os.open(p, os.O_RDWR)
            self._counter_fd = os.open(path / COUNTER, os.O_RDWR)
            _files.lock_directory(self._counter_fd, path)
            self.epoch, self.rows, self.intent = self._read_counter()
            self._fill_mirrors(ram_budget)
        except OSError as exc:
            self.close()
            raise DiskBufferError(
                f"disk buffer {str(path)!r}: cannot read its files: {exc}"
            ) from None
        except BaseException:
            self.close()
            raise
        self._files = [n for n in self.fields if self._row[n]]  # zero-size fields have no bytes
        self._recovering = False
        self.recovery: RecoveryReport | None = None

    def _fill_mirrors(self, ram_budget: int) -> None:
        """Mirror the smallest fields while their whole columns fit the budget. O(N) reads."""
        used = 0
        for name in sorted(self.fields, key=lambda n: self._row[n]):
            size = self._row[name] * self.capacity
            if used + size > ram_budget:
                break
            used += size
            col = np.zeros((self.capacity, *self.fields[name].shape), self.fields[name].dtype)
            if (
                size
                and os.preadv(self._fds[name], [col.reshape(-1).view(np.uint8).data], 0) != size
            ):
                raise DiskBufferError(f"{self._paths[name]}: truncated field file")
            self.mirrors[name] = col

    # -- the counter ------------------------------------------------------------
    def _read_counter(self) -> tuple[int, int, int]:
        raw = os.pread(self._counter_fd, _files.COUNTER_RECORD.size, 0)
        if len(raw) != _files.COUNTER_RECORD.size:
            raise DiskBufferError(f"{self.directory / COUNTER}: truncated counter file")
        magic, epoch, rows, intent, crc = _files.COUNTER_RECORD.unpack(raw)
        if magic != _files.MAGIC or crc != zlib.crc32(raw[8:32]) or intent < rows:
            raise DiskBufferError(f"{self.directory / COUNTER}: damaged counter file")
        return int(epoch), int(rows), int(intent)

    def _put_counter(self, epoch: int, rows: int, intent: int) -> None:
        body = struct.pack("<QQQ", epoch, rows, intent)
        record = _files.COUNTER_RECORD.pack(_files.MAGIC, epoch, rows, intent, zlib.crc32(body))
        # one small write inside one page: a process crash cannot split it
        if os.pwrite(self._counter_fd, record, 0) != len(record):  # pragma: no cover
            raise OSError(errno.EIO, "short write of the disk buffer's counter")
        self.epoch, self.rows, self.intent = epoch, rows, intent

    # -- properties ---------------------------------------------------------------
    @property
    def size(self) -> int:
        """Rows the counter covers: ``min(rows, capacity)``."""
        return min(self.rows, self.capacity)

    def torn_slots(self) -> np.ndarray:
        """Slots of the stored rows that a write cut short was overwriting. O(torn).

        Part old, part new until an add overwrites them: a buffer reopened
        by :func:`open_buffer` never samples them (see the module docstring).
        """
        lo, hi = _files.torn_rows(self.rows, self.intent, self.capacity)
        return _slots(lo, hi, self.capacity)

    @property
    def nbytes_per_slot(self) -> int:
        """Bytes of one transition on disk (all fields)."""
        return sum(self._row.values())

    def nbytes(self) -> int:
        """Bytes of RAM held: the mirrored columns (not the files). O(fields)."""
        return int(sum(m.nbytes for m in self.mirrors.values()))

    def disk_nbytes(self) -> int:
        """Bytes the data files take on disk: ``capacity x nbytes_per_slot``."""
        return self.capacity * self.nbytes_per_slot

    # -- the protocol -----------------------------------------------------------------
    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast (as the RAM storage does); writes nothing. O(B)."""
        return coerce_batch(self.fields, transition, self.capacity)

    def _sync_to(self, start: int) -> int:
        """``rows`` such that ``rows % capacity == start`` (the buffer's cursor).

        They differ only after a load of a full ring, whose cursor the rows do
        not say: every slot holds a row, so relabelling their order is exact.
        """
        cap = self.capacity
        if self.rows % cap == start:
            return self.rows
        if self.rows < cap:
            raise ValueError(
                f"the disk storage is out of step with its buffer: it holds {self.rows} rows, so "
                f"the next write goes to slot {self.rows % cap}, got start={start} (a reopened "
                "disk buffer must be adopted by fastper.disk.open_buffer)"
            )
        return self.rows + (start - self.rows) % cap

    def write(self, start: int, prepared: Mapping[str, np.ndarray], k: int) -> None:
        """Write ``k`` prepared rows from slot ``start`` on (wrapping), then count them. O(B).

        Order: counter ``intent``, data (one ``pwrite`` per disk field and
        run), mirrors, counter ``rows``. A failed data write raises before
        ``rows`` moves, so the buffer (which advances its ring after this
        returns) stays as it was. The files are allocated at creation, so
        overwriting needs no space on ext4 / xfs / tmpfs; where it does
        (copy-on-write filesystems) a write that fails after its first field
        leaves the ``k`` oldest slots (those it evicts) part new until the
        next ``add``, and a reopen reports them torn.

        Raises:
            DiskFullError: the disk is full (ENOSPC / EDQUOT).
            OSError: another failed write.
        """
        self._check_open()
        cap = self.capacity
        rows = self._sync_to(start)
        intent = self.intent
        self._put_counter(self.epoch, rows, max(intent, rows + k))
        first = min(k, cap - start)
        wrote = False
        for name in self._files:
            flat = np.ascontiguousarray(prepared[name]).reshape(-1).view(np.uint8).data
            row = self._row[name]
            try:
                _files.pwrite_all(self._fds[name], flat[: first * row], start * row)
                wrote = True
                if first < k:
                    _files.pwrite_all(self._fds[name], flat[first * row : k * row], 0)
            except OSError as exc:
                if not wrote or rows + k <= cap:  # no stored row touched: nothing torn
                    with contextlib.suppress(OSError):
                        self._put_counter(self.epoch, rows, intent)
                raise _files.full_disk(
                    exc,
                    f"while writing field `{name}`: the {k} rows were not added (the ring, the "
                    "priorities and the rows stored before are unchanged); free space on "
                    f"{str(self.directory)!r}, then add again",
                    self._paths[name],
                ) from exc
        for name, col in self.mirrors.items():
            src = prepared[name]
            col[start : start + first] = src[:first]
            if first < k:
                col[: k - first] = src[first:k]
        new_rows = rows + k
        self._put_counter(self.epoch, new_rows, max(self.intent, new_rows))

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices``: one ``preadv`` per row of each disk field. O(B).

        No indices: empty arrays of every field's shape and dtype.
        """
        self._check_open()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        b = idx.shape[0]
        out: dict[str, np.ndarray] = {}
        slots = idx.tolist()
        for name, f in self.fields.items():
            mirror = self.mirrors.get(name)
            if mirror is not None:
                out[name] = mirror.take(idx, axis=0)
                continue
            arr = np.empty((b, *f.shape), dtype=f.dtype)
            row = self._row[name]
            if row and b:
                rows = arr.reshape(b, -1).view(np.uint8)
                fd = self._fds[name]
                for j, s in enumerate(slots):
                    if os.preadv(fd, [rows[j].data], s * row) != row:
                        raise DiskBufferError(
                            f"{self._paths[name]}: truncated field file (slot {s} is past its end)"
                        )
            out[name] = arr
        return out

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A copy of rows ``lo .. hi-1`` of field ``name``: one read. O(hi - lo)."""
        mirror = self.mirrors.get(name)
        if mirror is not None:
            return mirror[lo:hi].copy()
        f = self.fields[name]
        arr = np.empty((hi - lo, *f.shape), dtype=f.dtype)
        nbytes = arr.nbytes
        if (
            nbytes
            and os.preadv(
                self._fds[name], [arr.reshape(-1).view(np.uint8).data], lo * self._row[name]
            )
            != nbytes
        ):
            raise DiskBufferError(f"{self._paths[name]}: truncated field file")
        return arr

    def clear(self) -> None:
        """Forget every row: a new epoch, no rows (durable). O(1)."""
        self._put_counter(self.epoch + 1, 0, 0)

    def _column(self, name: str, n: int, writable: bool) -> np.ndarray:
        mirror = self.mirrors.get(name)
        if mirror is not None:
            return mirror[:n]
        f = self.fields[name]
        if not self._row[name] or n == 0:
            return np.zeros((n, *f.shape), f.dtype)
        path = str(self._paths[name])
        if writable:
            return np.memmap(path, dtype=f.dtype, mode="r+", shape=(n, *f.shape))
        return np.memmap(path, dtype=f.dtype, mode="r", shape=(n, *f.shape))

    def state_dict(self, n: int) -> dict[str, Any]:
        """The first ``n`` rows of every field: mirrors, or read-only maps of the files. O(fields).

        Nothing is read until the arrays are used (pages read through a map
        count in the process's RSS while mapped).
        """
        return {f"columns/{name}": self._column(name, n, False) for name in self.fields}

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """Writable maps of the files (mirrors for mirrored fields), to load rows in place."""
        return {f"columns/{name}": self._column(name, n, True) for name in self.fields}

    def load_state_dict(self, state: Mapping[str, Any], n: int) -> None:
        """Take ``n`` rows from a state's columns, or accept a reference to these files.

        Columns (from any storage's ``state_dict``): written to the files in
        a new epoch, O(N). A reference (from ``reference_state``, in a
        checkpoint of this disk buffer): checked, nothing copied, O(1).

        Raises:
            ValueError: columns of the wrong names, dtypes or rows.
            DiskBufferError: a reference to another disk buffer, to an
                earlier epoch, or one its files have moved past.
        """
        if "reference" in state:
            self._check_reference(state, n)
            return
        check_columns(self.fields, state, n)
        self._put_counter(self.epoch + 1, 0, n)
        for name in self.fields:
            a = state[f"columns/{name}"]
            mirror = self.mirrors.get(name)
            if mirror is not None and not np.shares_memory(a, mirror):
                mirror[:n] = a
            if self._row[name] and n:
                src = np.ascontiguousarray(a if mirror is None else mirror[:n])
                if (
                    isinstance(a, np.memmap)
                    and a.filename
                    and Path(a.filename) == self._paths[name]
                ):
                    a.flush()  # read in place by the loader
                else:
                    _files.pwrite_all(self._fds[name], src.reshape(-1).view(np.uint8).data, 0)
        self._put_counter(self.epoch, n, n)

    def reference_state(
        self, n: int, cursor: int, checkpoint: str | os.PathLike[str] | None = None
    ) -> dict[str, Any]:
        """What a checkpoint holds instead of the rows: this directory and the counter.

        Syncs the counter with the buffer's ``cursor`` (``n`` stored rows),
        then fsyncs the files, so the rows the reference covers survive power
        loss too. O(dirty pages).

        Args:
            n, cursor: the buffer's stored rows and ring cursor.
            checkpoint: the file the reference goes to. The directory is
                recorded relative to the file's folder when the two share a
                folder below the filesystem's root (a run's folder copied or
                moved whole then reopens its own copy), else absolute; without
                it, absolute.
        """
        if n != self.size:
            raise ValueError(f"the buffer holds {n} rows but its disk storage {self.size}")
        rows = self._sync_to(cursor)
        if rows != self.rows:
            self._put_counter(self.epoch, rows, max(self.intent, rows))
        self.sync()
        return {
            "reference": FORMAT,
            "id": self.id,
            "directory": _reference_path(self.directory, checkpoint),
            # the absolute path too: a checkpoint copied alone still finds a buffer that stayed
            "absolute": str(Path(self.directory).resolve()),
            "epoch": self.epoch,
            "rows": self.rows,
        }

    def _check_reference(self, state: Mapping[str, Any], n: int) -> None:
        if state.get("reference") != FORMAT or state.get("id") != self.id:
            raise DiskBufferError(
                f"the checkpoint refers to disk buffer {state.get('id')!r} "
                f"({state.get('directory')!r}), but {str(self.directory)!r} holds {self.id!r}"
            )
        epoch = check_int("epoch", state.get("epoch"), minimum=0)
        rows = check_int("rows", state.get("rows"), minimum=0)
        if epoch != self.epoch or rows > self.rows or n != min(rows, self.capacity):
            raise DiskBufferError(
                f"disk buffer {str(self.directory)!r} was cleared or reloaded after the "
                f"checkpoint (epoch {self.epoch}, {self.rows} rows; the checkpoint: epoch "
                f"{epoch}, {rows} rows): open it without the checkpoint to rebuild"
            )
        if rows < self.rows and not self._recovering:
            raise DiskBufferError(
                f"disk buffer {str(self.directory)!r} holds {self.rows - rows} rows added "
                "after the checkpoint: open it with fastper.disk.open_buffer(directory, "
                "checkpoint) to recover them"
            )

    # -- housekeeping -----------------------------------------------------------------
    def sync(self) -> None:
        """fsync the data files, then the counter: rows counted survive power loss. O(dirty pages)."""
        for fd in self._fds.values():
            os.fsync(fd)
        os.fsync(self._counter_fd)

    def _check_open(self) -> None:
        if self._counter_fd < 0:
            raise DiskBufferError(f"disk storage {str(self.directory)!r} is closed")

    def close(self) -> None:
        """Close the files (the storage cannot be used after). Idempotent."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._counter_fd >= 0:
            os.close(self._counter_fd)
            self._counter_fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (
            f"DiskStorage({str(self.directory)!r}, capacity={self.capacity}, rows={self.rows}, "
            f"fields={list(self.fields)}, mirrored={list(self.mirrors)})"
        )


# -- reopening ------------------------------------------------------------------------


def open_buffer(
    directory: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str] | None = None,
    *,
    ram_budget: int = DEFAULT_RAM_BUDGET,
    alpha: Any = None,
    beta: Any = None,
    buffer_class: type[Any] | None = None,
    **settings: Any,
) -> tuple[Any, RecoveryReport]:
    """Reopen a disk buffer, e.g. after its process died: (the buffer, what was recovered).

    With ``checkpoint`` (a file from ``buffer.save``): the buffer as saved
    (priorities, ring, keys, random state, n-step windows, settings), then
    every row the disk counter holds past it is re-admitted with the
    buffer's new-transition priority (``max_priority``), as ``add`` would
    have given it; so only what was in memory at the crash is lost (n-step
    windows, priority updates since the checkpoint). Without one: a buffer
    of ``buffer_class`` (default :class:`~fastper.PrioritizedReplayBuffer`)
    built from ``settings`` (capacity and fields default to the directory's),
    every row on disk re-admitted with the new-transition priority.

    Either way, stored rows that a write cut short by a crash was
    overwriting (part old, part new) are dropped: they are never sampled,
    under any scheme, until an add overwrites their slot. The directory
    remembers them, so every reopening drops them again (with or without a
    checkpoint) and reports them as ``torn``. Reopening writes nothing to
    the directory: the buffer's first write is its next ``add``. O(N) for
    the priorities, plus reading the mirrored fields.

    Args:
        directory: the disk buffer's directory.
        checkpoint: the last checkpoint of this disk buffer, or ``None``.
        ram_budget: as for :class:`DiskStorage`.
        alpha, beta: schedules instead of the saved ones (needed for a custom
            callable); without a checkpoint, passed to the constructor.
        buffer_class, settings: without a checkpoint, the buffer to build and
            its constructor's arguments.

    Returns:
        ``(buffer, report)``; a :class:`RecoveryReport`, also kept as
        ``buffer.storage.recovery``.

    Raises:
        DiskBufferError: not a disk buffer, a damaged file, or a checkpoint
            of another disk buffer or of an earlier epoch (a clear since).
        CheckpointError: an unreadable checkpoint.
        ValueError, TypeError: settings given with a checkpoint, or bad settings.
    """
    storage = DiskStorage.open(directory, ram_budget=ram_budget)
    try:
        if checkpoint is None:
            buf, base, pending = _rebuild(storage, alpha, beta, buffer_class, settings)
        else:
            if settings or buffer_class is not None:
                raise TypeError(
                    "open_buffer takes no buffer settings with a checkpoint (they are saved in "
                    f"it), got {sorted(settings) + (['buffer_class'] if buffer_class else [])}"
                )
            buf, base, pending = _from_checkpoint(storage, checkpoint, alpha, beta)
        report = _readmit(buf, storage, base, pending, checkpoint)
    except BaseException:
        storage.close()
        raise
    storage.recovery = report
    return buf, report


def _rebuild(
    storage: DiskStorage, alpha: Any, beta: Any, cls: type[Any] | None, settings: dict[str, Any]
) -> tuple[Any, int, int]:
    if cls is None:
        from .buffers import PrioritizedReplayBuffer

        cls = PrioritizedReplayBuffer
    settings.setdefault("capacity", storage.capacity)
    settings.setdefault("fields", storage.fields)
    if alpha is not None:
        settings["alpha"] = alpha
    if beta is not None:
        settings["beta"] = beta
    return cls(storage=storage, **settings), 0, 0


def _from_checkpoint(
    storage: DiskStorage, path: str | os.PathLike[str], alpha: Any, beta: Any
) -> tuple[Any, int, int]:

    def make(state: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
        ref = state.get("storage")
        if not isinstance(ref, Mapping) or ref.get("reference") != FORMAT:
            raise DiskBufferError(
                f"{str(path)!r} is a checkpoint of a buffer in RAM (it holds its rows), not of "
                "a disk buffer: load it with fastper.load"
            )
        if ref.get("id") != storage.id:
            storage._check_reference(ref, 0)  # raises: names both buffers
        buf = _bs.build_buffer(state, alpha, beta, storage=storage)
        n = state["writer"]["size"]
        if not (isinstance(n, int) and 0 <= n <= buf.capacity):
            return buf, {}
        # the priorities only: the file's arrays are read (and its digest checked) before
        # the state is, so nothing of the directory may be offered
        where = {k: v for k, v in buf.state_targets(n).items() if k.startswith("sampler/")}
        return buf, where

    storage._recovering = True
    try:
        buf, state = _bs.read_buffer(path, make, alpha, beta)
    finally:
        storage._recovering = False
    return buf, int(state["storage"]["rows"]), buf.n_pending


def _readmit(
    buf: Any, storage: DiskStorage, base: int, pending: int, checkpoint: Any
) -> RecoveryReport:
    """Give ``buf`` the rows the disk counter holds past row ``base`` (see :func:`open_buffer`).

    ``buf``'s ring holds the rows up to ``base`` (the checkpoint's counter, 0
    for a new buffer). The rows past it are on disk already: the buffer
    adopts them (ring, keys, new-transition priority, as ``add`` would);
    then the torn rows (those in the slots of rows ``rows .. intent-1``, see
    the module docstring) are made invalid. Writes nothing to the directory.
    O(rows re-admitted + rows torn).
    """
    cap = storage.capacity
    disk, intent = storage.rows, storage.intent
    if getattr(buf, "frame_store", None) is not None and disk > base:
        # the frame ring lives in RAM: rows past the checkpoint point at frames that are gone
        raise DiskBufferError(
            f"disk buffer {str(storage.directory)!r} holds {disk - base} row(s) past the "
            "checkpoint of a frame_stack buffer: their frames were in RAM and are lost, and "
            "the rows overwrote slots of the checkpoint's; such a buffer can only be reopened "
            "from a checkpoint taken after its last add"
        )
    left = disk - base
    if (buf.cursor + left) % cap != disk % cap or min(len(buf) + left, cap) != min(disk, cap):
        raise DiskBufferError(
            f"disk buffer {str(storage.directory)!r} ({disk} rows) does not continue the "
            f"buffer's ring (cursor {buf.cursor}, {len(buf)} rows)"
        )
    if left > 0:
        buf.adopt(left)
    readmitted = min(left, cap)  # rows past the last capacity were overwritten on disk
    # stored rows whose slots an interrupted write (rows disk .. intent-1) was overwriting
    t0, t1 = _files.torn_rows(disk, intent, cap)
    torn = _slots(t0, t1, cap)
    lo = max(base, disk - cap)  # the first row re-admitted
    overlap = max(0, t1 - max(t0, lo))
    if torn.size:
        buf.invalidate(torn)
    dropped = buf.drop_pending() if disk > base and pending else 0
    return RecoveryReport(
        restored=int(len(buf) - readmitted - (torn.size - overlap)),
        recovered=int(readmitted - overlap),
        torn=int(torn.size),
        pending_dropped=int(dropped),
        checkpoint=None if checkpoint is None else str(checkpoint),
    )


def _slots(lo: int, hi: int, cap: int) -> np.ndarray:
    """Slots of rows ``lo .. hi-1`` (``hi - lo <= cap``)."""
    return np.arange(lo, hi, dtype=np.int64) % cap


def _reference_path(directory: Path, checkpoint: str | os.PathLike[str] | None) -> str:
    """``directory`` as a checkpoint at ``checkpoint`` records it (see ``reference_state``)."""
    target = directory.resolve()
    if checkpoint is None:
        return str(target)
    folder = Path(checkpoint).resolve().parent
    try:
        common = Path(os.path.commonpath([target, folder]))
    except ValueError:  # pragma: no cover - different drives (Windows)
        return str(target)
    if common == Path(common.anchor):  # nothing in common below the filesystem's root
        return str(target)
    return Path(os.path.relpath(target, folder)).as_posix()


def referenced_directory(
    checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str] | None = None
) -> Path:
    """The disk buffer directory a checkpoint of a disk buffer refers to. O(header).

    A relative reference is resolved against the checkpoint's folder (the
    one it was saved in, when the run's folder was not moved); where no disk
    buffer is found there, the absolute path recorded at the save is tried (a
    checkpoint copied alone). An absolute reference is taken as it is;
    ``directory`` overrides the reference. Reads the
    checkpoint's header only; does not open the directory (:func:`open_buffer`
    then checks that it is the disk buffer the checkpoint was taken of).

    Raises:
        CheckpointError: an unreadable checkpoint or a malformed reference.
        DiskBufferError: a checkpoint of a buffer in RAM.
        TypeError: ``directory`` is not a path.
    """
    if directory is not None and not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"`directory` must be a path (str or os.PathLike), got directory={show(directory)}"
        )
    ref = _ckpt.read_metadata(checkpoint)["state"].get("storage")
    if not isinstance(ref, Mapping) or "reference" not in ref:
        raise DiskBufferError(
            f"{str(checkpoint)!r} is a checkpoint of a buffer in RAM (it holds its rows), not of "
            "a disk buffer: load it with fastper.load, without a directory"
        )
    if directory is not None:
        return Path(directory)
    where = ref.get("directory")
    if not isinstance(where, str) or not where or "\0" in where:
        raise CheckpointError(f"{checkpoint}: malformed disk buffer reference {show(ref)}")
    path = Path(where)
    if path.is_absolute():
        return path
    near = Path(os.path.normpath(Path(checkpoint).resolve().parent / path))
    absolute = ref.get("absolute")
    if (near / HEADER).is_file() or not isinstance(absolute, str) or "\0" in absolute:
        return near
    # the checkpoint was copied without the run's folder: the buffer where it was saved
    # (the id and epoch checks of open_buffer still decide whether it is the right one)
    return Path(absolute) if (Path(absolute) / HEADER).is_file() else near


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    alpha: Any = None,
    beta: Any = None,
    directory: str | os.PathLike[str] | None = None,
) -> Any:
    """:func:`fastper.load` for a checkpoint of a disk buffer: reopen its directory.

    The directory is ``directory`` if given, else the one the checkpoint
    refers to: relative to the checkpoint's folder when the two shared a
    folder below the filesystem's root at the save (a run's folder copied
    or moved whole reopens its own copy), else the absolute path recorded
    (see :func:`referenced_directory`). A directory that is not the disk
    buffer the checkpoint was taken of (another id, a clear since, fewer
    rows) or a checkpoint that does not read back intact is refused;
    loading writes nothing to the directory either way (the buffer's adds
    do). Rows added after the checkpoint are re-admitted and torn rows
    dropped (see :func:`open_buffer`), with a
    :class:`~fastper.errors.RecoveryWarning` saying how many.

    Raises:
        DiskBufferError: the directory is missing, not a disk buffer, or not
            the one the checkpoint was taken of.
        CheckpointError: an unreadable checkpoint.
    """
    where = referenced_directory(path, directory)
    if directory is None and not (where / HEADER).is_file():
        raise DiskBufferError(
            f"{str(path)!r} is a checkpoint of disk buffer directory {str(where)!r}, which "
            f"{'does not exist' if not where.exists() else 'is not a fastper disk buffer'}: "
            "if the directory has moved, give it: "
            "fastper.load(path, directory=...)"
        )
    buf, report = open_buffer(where, path, alpha=alpha, beta=beta)
    if not report.lossless:
        warnings.warn(
            f"disk buffer {str(where)!r} reopened from {str(path)!r}: {report.recovered} "
            f"rows added after the checkpoint re-admitted with the maximum priority, "
            f"{report.torn} rows torn by an interrupted write dropped (never sampled until "
            f"an add overwrites them), {report.pending_dropped} pending n-step transitions "
            "dropped",
            RecoveryWarning,
            stacklevel=3,
        )
    return buf
