"""The files of a disk buffer (:mod:`fastper.disk`): layout, header, allocation, locking.

Directory layout::

    fastper-disk.json   {"format": "fastper-disk", "version": 1, "id", "capacity",
                         "fields": [[name, {"shape", "dtype"}], ...], "files": [...]}
    counter.bin         40 bytes: magic, epoch, rows, intent, CRC-32 (little-endian)
    field-000.bin ...   capacity x (bytes of one row), C order, allocated at creation

The header is written last, atomically (temporary file, fsync, rename): its
presence is what makes a directory a disk buffer.

The counter is one 40-byte record in one page, rewritten in place by one
``pwrite`` (a process crash cannot split it). ``rows``: rows written in this
epoch (the k-th goes to slot k % capacity); ``intent``: the end of the
furthest write begun, never lowered within an epoch. A write begun and not
finished (``intent > rows``) may have overwritten the stored rows in the
slots of rows ``rows .. intent-1``: those rows are torn (:func:`torn_rows`)
until later writes move ``rows`` past them. Directories of every earlier
release have this layout.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._validation import check_int
from .errors import DiskBufferError, DiskFullError
from .storage import Field, make_fields

FORMAT = "fastper-disk"
#: version of the directory layout; a newer one is refused with a clear error
VERSION = 1
HEADER = "fastper-disk.json"
COUNTER = "counter.bin"

MAGIC = b"FPDCNT01"
COUNTER_RECORD = struct.Struct("<8sQQQI4x")  # magic, epoch, rows, intent, crc32 of the three


def torn_rows(rows: int, intent: int, capacity: int) -> tuple[int, int]:
    """The stored rows ``lo .. hi-1`` that an unfinished write may have overwritten. O(1).

    The write of rows ``rows .. intent-1`` goes to their slots, which hold
    rows ``rows - capacity .. intent - capacity - 1`` when the ring has
    wrapped; ``lo == hi``: none.
    """
    lo = max(rows - capacity, 0)
    return lo, max(min(intent - capacity, rows), lo)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def allocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of disk for a data file: a full disk shows here, at creation."""
    if nbytes == 0:
        return
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, nbytes)  # pragma: no cover - filesystems without fallocate


def lock_directory(fd: int, path: Path) -> None:
    """One storage per directory: two writers would interleave their rows and counters.

    An exclusive ``flock``, released by the kernel when the process dies
    however it dies, so a crashed buffer's directory reopens at once.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DiskBufferError(
            f"disk buffer {str(path)!r} is in use by another storage (in this process or "
            "another): close that one first (buffer.storage.close())"
        ) from None


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def full_disk(exc: OSError, what: str, path: Path) -> OSError:
    """``exc`` as a :class:`DiskFullError` when it is ENOSPC / EDQUOT, else ``exc``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(exc.errno, f"disk full {what}", str(path))
    return exc


# -- the directory ------------------------------------------------------------------


def create(path: Path, fields: Mapping[str, Field], capacity: int) -> dict[str, Any]:
    """Allocate the files, write the counter, then the header (its presence marks a buffer).

    A full disk removes what was made and raises :class:`DiskFullError`.
    """
    made_dir = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "id": uuid.uuid4().hex,
        "capacity": capacity,
        "fields": [[name, f.to_dict()] for name, f in fields.items()],
        "files": [f"field-{i:03d}.bin" for i in range(len(fields))],
    }
    made: list[Path] = []
    try:
        for fname, f in zip(header["files"], fields.values(), strict=True):
            p = path / fname
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            made.append(p)
            try:
                allocate(fd, capacity * f.nbytes_per_item)
            except OSError as exc:
                need = capacity * sum(x.nbytes_per_item for x in fields.values())
                raise full_disk(
                    exc,
                    f"creating a disk buffer of {need / 2**30:.2f} GiB (capacity={capacity}) "
                    f"in {str(path)!r}: nothing was created; use a smaller capacity or free space",
                    p,
                ) from None
            finally:
                os.close(fd)
        body = struct.pack("<QQQ", 0, 0, 0)
        (path / COUNTER).write_bytes(COUNTER_RECORD.pack(MAGIC, 0, 0, 0, zlib.crc32(body)))
        made.append(path / COUNTER)
        tmp = path / f".{HEADER}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(header, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path / HEADER)
    except BaseException:
        for p in made:
            p.unlink(missing_ok=True)
        if made_dir:
            try:
                path.rmdir()
            except OSError:  # pragma: no cover
                pass
        raise
    fsync_dir(path)
    return header


def read_header(path: Path) -> dict[str, Any]:
    try:
        header = json.loads((path / HEADER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DiskBufferError(
            f"{str(path / HEADER)!r}: not a fastper disk header ({exc})"
        ) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DiskBufferError(f"{str(path / HEADER)!r}: not a fastper disk header")
    if header.get("version") != VERSION:
        raise DiskBufferError(
            f"{str(path / HEADER)!r}: disk layout version {header.get('version')!r}, this "
            f"fastper reads version {VERSION}"
        )
    try:
        capacity = check_int("capacity", header["capacity"], minimum=1)
        names = [str(n) for n, _ in header["fields"]]
        files = [str(f) for f in header["files"]]
        str(header["id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DiskBufferError(f"{str(path / HEADER)!r}: malformed header ({exc})") from None
    if len(files) != len(names) or any(os.sep in f or f.startswith(".") for f in files):
        raise DiskBufferError(f"{str(path / HEADER)!r}: malformed header (file names)")
    header["capacity"] = capacity
    return header


def check_layout(
    path: Path, header: Mapping[str, Any], fields: Mapping[str, Field], capacity: int
) -> None:
    """The header's layout must be ``fields`` / ``capacity``, and every file its full size."""
    try:
        theirs = make_fields(
            {str(n): (tuple(spec["shape"]), spec["dtype"]) for n, spec in header["fields"]}
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DiskBufferError(f"{str(path / HEADER)!r}: malformed field spec ({exc})") from None
    if theirs != dict(fields) or header["capacity"] != capacity:
        raise DiskBufferError(
            f"directory {str(path)!r} holds a disk buffer of capacity={header['capacity']} and "
            f"fields {spec(theirs)}, not capacity={capacity} and fields {spec(fields)}"
        )
    for fname, (name, f) in zip(header["files"], theirs.items(), strict=True):
        p = path / fname
        want = capacity * f.nbytes_per_item
        try:
            got = p.stat().st_size
        except OSError:
            raise DiskBufferError(f"field `{name}`'s file {str(p)!r} is missing") from None
        if got != want:
            raise DiskBufferError(
                f"field `{name}`'s file {str(p)!r} is {got} bytes, expected {want} "
                f"({capacity} rows of {f.nbytes_per_item} bytes): "
                + ("truncated" if got < want else "altered")
            )


def spec(fields: Mapping[str, Field]) -> str:
    return "{" + ", ".join(f"{n}: {f.shape} {f.dtype}" for n, f in fields.items()) + "}"
