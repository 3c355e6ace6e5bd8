"""Pickle-free checkpoint files: the file format, and nothing of buffers.

A checkpoint holds one state (see ``PrioritizedReplayBuffer.state_dict``):
nested JSON values, plus numpy arrays named ``part/key``. This module writes
and reads such files; :mod:`fastper.buffers` turns buffers into states and
back. File layout (all integers little-endian)::

    magic      8 bytes   b"\\x89FPCKPT\\n"
    version    u32       FORMAT_VERSION
    hlen       u64       length of the header
    header     hlen      UTF-8 JSON: versions, the state without its arrays,
                         and the array table (name, dtype, shape, offset,
                         nbytes of each array)
    hdigest    32 bytes  SHA-256 of everything above
    data       ...       the arrays' raw bytes, C order, back to back
    digest     32 bytes  SHA-256 of everything above

The trailing digest makes any altered or truncated byte an error; the header
digest lets :func:`read_metadata` (``fastper inspect``) trust the header
without reading the data. Only plain numeric dtypes are accepted, every
declared shape is checked against the file's real size before anything is
allocated, and nothing is ever unpickled.

Versions. 2 (fastper >= 0.2): the state layout above. 1 (fastper 0.1.0):
the same container with another header; :func:`read_state` reads it as a
version-2 state (:func:`upgrade_v1`). Frozen files of each version are kept
under ``tests/fixtures/checkpoints`` and loaded by the tests.

Writing streams the arrays: an array may be a :class:`LazyArray`, read in
chunks of rows while the file is written (a buffer's save holds its lock only
per chunk). Reading is one pass: each array goes straight into the
destination the caller offers (a buffer's own columns), hashed on the way;
the whole-file digest is compared at the end.

Saving writes a temporary file beside the target, fsyncs it and renames it
over the target, so a crash mid-save leaves the previous checkpoint intact.

Temporary files. A save killed outright (SIGKILL, power loss) cannot delete
its temporary file, ``.<target name>.<random>.fpk.tmp``; the next save to the
same target removes such leftovers, so they never pile up (at most one per
target survives a crash). Telling a leftover from the temporary file of a
save still running (another thread, another buffer, another process) relies
on an exclusive ``flock`` that every save holds on its temporary file from
creation to rename: the kernel drops it when its process dies, however it
dies, so a temporary file whose lock can be taken is abandoned. A save that
finds its own new file removed in the instant between creating and locking
it starts over with a new one. Where ``fcntl`` is missing (Windows) leftovers
are not removed. The names are random, not fixed per target, so that two
saves to one path never write into the same temporary file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ._version import __version__
from .errors import CheckpointError

MAGIC = b"\x89FPCKPT\n"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sIQ")
_DIGEST = 32
#: Largest header accepted (and written). A real header is a few KB (fields,
#: array table, schedules, RNG state); the cap bounds what parsing a hostile one
#: costs: JSON of empty objects takes about 22x its size in Python objects, so
#: 4 MiB -> under 100 MiB and well under a second (64 MiB used to take 1.7 GiB).
_MAX_HEADER = 4 * 1024 * 1024
_CHUNK = 1 << 22
#: rows of a LazyArray per read: each read holds a buffer's lock (about 1 ms a MiB)
_LAZY_CHUNK = 1 << 20
_MAX_NDIM = 32  # numpy 1.x's limit
_DTYPE_KINDS = "biuf"

PathLike = str | os.PathLike[str]

try:  # POSIX: advisory locks tell abandoned temporary files from live ones
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_TMP_SUFFIX = ".fpk.tmp"


@dataclass(frozen=True)
class LazyArray:
    """An array written to a file in chunks of rows: ``read(lo, hi)`` returns rows ``lo:hi``."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def is_array(value: Any) -> bool:
    """Whether a state value goes to the array table (a numpy array or a :class:`LazyArray`)."""
    return isinstance(value, np.ndarray | LazyArray)


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _chunks(arr: np.ndarray | LazyArray) -> Any:
    """The array's bytes, as memoryviews of at most about ``_CHUNK`` bytes.

    A C-contiguous array is one view of its own bytes; a strided one (a field
    of record storage) and a :class:`LazyArray` are copied a chunk of rows at
    a time.
    """
    if isinstance(arr, np.ndarray) and (arr.flags.c_contiguous or arr.ndim == 0):
        a = np.ascontiguousarray(arr)
        if a.size:
            yield memoryview(a.reshape(-1).view(np.uint8).data)
        return
    read: Callable[[int, int], np.ndarray] = (
        arr.read if isinstance(arr, LazyArray) else lambda lo, hi: arr[lo:hi]
    )
    rows = arr.shape[0] if arr.shape else 0
    row_bytes = max(1, arr.nbytes // rows) if rows else 1
    step = max(1, _LAZY_CHUNK // row_bytes)
    for lo in range(0, rows, step):
        part = np.ascontiguousarray(read(lo, min(rows, lo + step)), dtype=arr.dtype)
        if part.size:
            yield memoryview(part.reshape(-1).view(np.uint8).data)


def split_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state`` without arrays, its arrays named ``part/key``).

    Arrays may only be values of the dicts directly under the root (a state's
    parts: ``state["storage"]["columns/obs"]`` is array ``storage/columns/obs``).
    """
    meta: dict[str, Any] = {}
    arrays: dict[str, Any] = {}
    for part, value in state.items():
        if isinstance(value, Mapping):
            kept = {}
            for key, v in value.items():
                if is_array(v):
                    arrays[f"{part}/{key}"] = v
                else:
                    kept[key] = v
            value = kept
        elif is_array(value):
            raise ValueError(f"arrays must sit inside a part of the state, got one at `{part}`")
        meta[part] = value
    return meta, arrays


def join_state(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Inverse of :func:`split_state`: put each ``part/key`` array back in its part."""
    state = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in meta.items()}
    for name, arr in arrays.items():
        part, _, key = name.partition("/")
        if not isinstance(state.get(part), dict):
            raise ValueError(f"array `{name}` belongs to no part of the state")
        state[part][key] = arr
    return state


def write_state(path: PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` (JSON values, arrays in its parts) to ``path`` atomically.

    The folder of ``path`` is created (with its parents) if missing.

    Raises:
        FileExistsError: a file stands where a folder of ``path`` must be.
        ValueError: a header larger than :func:`read_state` accepts, or values
            JSON cannot hold (NaN, inf).
    """
    meta, arrays = split_state(state)
    target = Path(path)
    table = []
    offset = 0
    for name, arr in arrays.items():
        dtype = np.dtype(arr.dtype)
        nbytes = int(arr.nbytes)
        table.append(
            {"name": name, "dtype": dtype.str, "shape": list(arr.shape), "offset": offset,
             "nbytes": nbytes}
        )  # fmt: skip
        offset += nbytes
    header_obj = {
        "format": "fastper-checkpoint",
        "format_version": FORMAT_VERSION,
        "fastper_version": __version__,
        "state": meta,
        "arrays": table,
    }
    header = json.dumps(header_obj, sort_keys=True, allow_nan=False).encode("utf-8")
    if len(header) > _MAX_HEADER:
        raise ValueError(
            f"checkpoint header would be {len(header)} bytes, more than the {_MAX_HEADER} "
            "that load() accepts (too many fields or schedule points)"
        )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
    make_parent(target)
    _remove_abandoned_temporaries(target)
    fd, tmp = _create_locked_temporary(target)
    try:
        # the rename happens under the lock, so no cleaner can take the file first
        with os.fdopen(fd, "wb") as f:
            whole = hashlib.sha256()
            head = prefix + header
            hdigest = hashlib.sha256(head).digest()
            for chunk in (head, hdigest):
                f.write(chunk)
                whole.update(chunk)
            for (name, arr), entry in zip(arrays.items(), table, strict=True):
                written = 0
                for view in _chunks(arr):
                    f.write(view)
                    whole.update(view)
                    written += view.nbytes
                if written != entry["nbytes"]:
                    raise ValueError(
                        f"array `{name}` gave {written} bytes, declared {entry['nbytes']}"
                    )
            f.write(whole.digest())
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(target.parent or Path("."))  # make the rename itself durable


def make_parent(target: Path) -> None:
    """Create the folder ``target`` goes in (and its parents) if missing, durably.

    Raises:
        FileExistsError: a file stands where a folder of the path must be
            (the message names it).
    """
    folder = target.parent if str(target.parent) else Path(".")
    if folder.is_dir():
        return
    missing = [p for p in (folder, *folder.parents) if not p.is_dir()]
    for p in missing:
        if p.exists():  # a file (or something else) where a folder must be
            raise FileExistsError(
                f"cannot save to {str(target)!r}: {str(p)!r} is a file, not a folder; "
                "save under another path or move that file"
            )
    folder.mkdir(parents=True, exist_ok=True)
    for p in reversed(missing):  # make each new entry durable in its parent
        fsync_dir(p.parent if str(p.parent) else Path("."))


def fsync_dir(path: PathLike) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable, where the OS can."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - platform dependent
        pass


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}."


def _create_locked_temporary(target: Path) -> tuple[int, str]:
    """A new temporary file beside ``target``, open and exclusively locked."""
    while True:
        fd, tmp = tempfile.mkstemp(
            prefix=_temporary_prefix(target), suffix=_TMP_SUFFIX, dir=target.parent or "."
        )
        if fcntl is None:  # pragma: no cover - Windows
            return fd, tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink > 0:
                return fd, tmp
        except BaseException:
            os.close(fd)
            raise
        # a cleaner took the file between mkstemp and flock: start over
        os.close(fd)  # pragma: no cover - a narrow race


def _remove_abandoned_temporaries(target: Path) -> None:
    """Delete temporary files of ``target`` left by saves that died (see the module doc).

    A file is removed only while this process holds its exclusive lock, which
    a save in progress never gives up before renaming the file away.
    """
    if fcntl is None:  # pragma: no cover - Windows
        return
    folder = target.parent if str(target.parent) else Path(".")
    prefix = _temporary_prefix(target)
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(_TMP_SUFFIX)]
    except OSError:
        return
    for name in names:
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # gone already, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live save holds it
            st = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in header")


def _read_header(
    f: BinaryIO, file_size: int, path: PathLike, whole: Any = None
) -> tuple[dict[str, Any], int, int]:
    raw = f.read(_PREFIX.size)
    if len(raw) < _PREFIX.size:
        raise CheckpointError(
            f"{path}: not a fastper checkpoint (file too short: {file_size} bytes)"
        )
    magic, version, hlen = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a fastper checkpoint (bad magic bytes {magic!r})")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: unsupported checkpoint format version {version} (this fastper reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    data_start = _PREFIX.size + hlen + _DIGEST
    if hlen > _MAX_HEADER:
        raise CheckpointError(
            f"{path}: corrupt checkpoint (header length {hlen} exceeds the limit of {_MAX_HEADER})"
        )
    if data_start + _DIGEST > file_size:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint (header length {hlen})")
    header = f.read(hlen)
    hdigest = f.read(_DIGEST)
    if hashlib.sha256(raw + header).digest() != hdigest:
        raise CheckpointError(f"{path}: corrupt checkpoint (header checksum mismatch)")
    if whole is not None:
        for part in (raw, header, hdigest):
            whole.update(part)
    try:
        meta = json.loads(header.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint header: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), list):
        raise CheckpointError(f"{path}: malformed checkpoint header")
    if version == 2 and (
        not isinstance(meta.get("state"), dict) or meta.get("format") != "fastper-checkpoint"
    ):
        raise CheckpointError(f"{path}: malformed checkpoint header (no state or format name)")
    return meta, data_start, int(version)


def _verify_digest(f: BinaryIO, file_size: int, path: PathLike) -> None:
    f.seek(0)
    h = hashlib.sha256()
    left = file_size - _DIGEST
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise CheckpointError(f"{path}: truncated checkpoint")
        h.update(chunk)
        left -= len(chunk)
    if f.read(_DIGEST) != h.digest():
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint (checksum mismatch)")


def _array_table(
    meta: Mapping[str, Any], blob_size: int, path: PathLike
) -> dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]]:
    out: dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]] = {}
    end = 0
    for entry in meta["arrays"]:
        try:
            name = str(entry["name"])
            dt = np.dtype(str(entry["dtype"]))
            shape = tuple(int(s) for s in entry["shape"])
            offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
        except (KeyError, TypeError, ValueError, OverflowError, SyntaxError) as exc:
            raise CheckpointError(
                f"{path}: malformed array entry {str(entry)[:200]}: {exc}"
            ) from None
        if dt.kind not in _DTYPE_KINDS or dt.hasobject or dt.fields is not None:
            raise CheckpointError(f"{path}: array `{name}` has a forbidden dtype {dt}")
        if (
            len(shape) > _MAX_NDIM
            or any(s < 0 for s in shape)
            or nbytes != math.prod(shape) * dt.itemsize
            # numpy refuses shapes whose product overflows, zeros aside
            or math.prod(max(s, 1) for s in shape) * dt.itemsize >= 2**62
        ):
            raise CheckpointError(
                f"{path}: array `{name}` declares an inconsistent shape {str(shape)[:200]}"
            )
        if offset != end or offset + nbytes > blob_size or name in out:
            raise CheckpointError(f"{path}: array `{name}` lies outside the data section")
        end = offset + nbytes
        out[name] = (dt, shape, offset, nbytes)
    if end != blob_size:
        raise CheckpointError(
            f"{path}: data section size {blob_size} does not match the array table"
        )
    return out


def _state_of(header: Mapping[str, Any], version: int, path: PathLike) -> dict[str, Any]:
    if version == 2:
        return dict(header["state"])
    try:
        return upgrade_v1(header)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed format-1 header: {exc}") from None


def read_metadata(path: PathLike, *, verify: bool = False) -> dict[str, Any]:
    """The checkpoint's header without its arrays, in the current layout.

    Returns ``{"format_version", "fastper_version", "state", "arrays"}``:
    ``state`` is the saved state without arrays (a format-1 header is
    upgraded, see :func:`upgrade_v1`), ``arrays`` the array table as stored.

    Args:
        path: checkpoint file.
        verify: also stream the whole file through the checksum (no arrays
            are loaded either way).

    Raises:
        CheckpointError: not a checkpoint, corrupt, or an unknown version.
    """
    with open(path, "rb") as f:
        # the size of the file opened, not of the path: a save may rename a new
        # file over the path between a stat and an open
        file_size = os.fstat(f.fileno()).st_size
        header, data_start, version = _read_header(f, file_size, path)
        _array_table(header, file_size - data_start - _DIGEST, path)
        if verify:
            _verify_digest(f, file_size, path)
    return {
        "format_version": version,
        "fastper_version": header.get("fastper_version"),
        "state": split_state(_state_of(header, version, path))[0],
        "arrays": header["arrays"],
    }


def read_state(
    path: PathLike,
    targets: Callable[[dict[str, Any]], Mapping[str, np.ndarray]] | None = None,
) -> tuple[dict[str, Any], int]:
    """Read a checkpoint in one pass: (the state, with its arrays; the file's version).

    ``targets(state)`` may offer, by array name, writable arrays to read into
    in place (a buffer's own columns; a strided one is filled a chunk of rows
    at a time); an array whose dtype or shape differs from the file's gets a
    new array instead. Memory: the targets plus the arrays not offered, plus
    one chunk. Format-1 files come
    back as version-2 states and names (:func:`upgrade_v1`); their arrays
    that version 2 does not use are checked and skipped.

    Raises:
        CheckpointError: a truncated, altered or malformed file (checked
            before anything is allocated from the header's sizes, and by the
            whole-file digest at the end).
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size  # of this file (see read_metadata)
        whole = hashlib.sha256()
        header, data_start, version = _read_header(f, file_size, path, whole)
        table = _array_table(header, file_size - data_start - _DIGEST, path)
        state = _state_of(header, version, path)
        offered = dict(targets(state)) if targets is not None else {}
        arrays: dict[str, np.ndarray] = {}
        scratch: bytearray | None = None  # for arrays nobody takes (format-1 extras)
        for name, (dt, shape, _offset, nbytes) in table.items():
            new_name = name if version == 2 else _V1_NAMES(name)
            dest: np.ndarray | None = None
            strided: np.ndarray | None = None  # a target filled through the scratch chunk
            if new_name is not None:
                t = offered.get(new_name)
                ok = (
                    isinstance(t, np.ndarray) and t.dtype == dt and t.shape == shape
                    and t.flags.writeable
                )  # fmt: skip
                target = t if ok and t is not None else np.empty(shape, dtype=dt)
                if not target.flags.c_contiguous:
                    strided = target
                dest = target
            view = (
                memoryview(dest.reshape(-1).view(np.uint8).data)
                if dest is not None and strided is None and nbytes
                else None
            )
            # a strided target takes whole rows per chunk
            row = max(1, nbytes // shape[0]) if strided is not None and shape[0] else 1
            chunk = max(1, _CHUNK // row) * row if strided is not None else _CHUNK
            done = 0
            while done < nbytes:
                step = min(chunk, nbytes - done)
                if view is not None:
                    part = view[done : done + step]
                else:
                    if scratch is None or len(scratch) < step:
                        scratch = bytearray(max(_CHUNK, step))
                    part = memoryview(scratch)[:step]
                got = f.readinto(part)
                if got != step:
                    raise CheckpointError(f"{path}: truncated checkpoint while reading `{name}`")
                whole.update(part)
                if strided is not None:
                    lo = done // row
                    strided[lo : lo + step // row] = np.frombuffer(part, dtype=dt).reshape(
                        (step // row, *shape[1:])
                    )
                done += step
            if dest is not None and new_name is not None:
                arrays[new_name] = dest
        if f.read(_DIGEST) != whole.digest() or f.read(1):
            raise CheckpointError(f"{path}: corrupt or truncated checkpoint (checksum mismatch)")
    try:
        return join_state(state, arrays), version
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------
# format 1 (fastper 0.1.0)
# ---------------------------------------------------------------------------


def _V1_NAMES(name: str) -> str | None:  # noqa: N802 - a table, spelled as one
    """Format-1 array name -> version-2 name (None: not used any more)."""
    part, _, key = name.partition("/")
    if part == "data":
        return f"storage/columns/{key}"
    if part == "sampler":
        return "sampler/priorities" if key == "priorities" else None  # rank order: rebuilt
    if part == "nstep":
        return f"nstep/pending/{key}"
    return None


def _v1_sampler(kind: str, st: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"alpha": st["alpha"]}
    if kind == "rank":  # the order is rebuilt with every change merged: nothing pending
        out.update(
            pending_slots=np.empty(0, dtype=np.int64),
            pending_ranked=np.empty(0, dtype=np.float64),
            samples_since_sort=0,
            last_batch_size=None,
        )
    return out


def upgrade_v1(header: Mapping[str, Any]) -> dict[str, Any]:
    """A format-1 header as a version-2 state (arrays aside).

    Format 1 knew one n-step stream, sampled batches in slot order, applied
    alpha schedules at every sample and gave new items the largest priority
    ever seen: the upgraded state keeps the last three settings as they were
    (``shuffle=False``, ``alpha_every=1``, ``max_priority="ever"``), and
    its n-step window becomes stream 0. A rank-based buffer's order is
    rebuilt from the priorities (pending ``sort_every`` changes are merged).
    """
    s = dict(header["settings"])
    st = header["state"]
    kind = header["buffer"]
    n_step = int(s.pop("n_step"))
    keys = dict(s.pop("nstep_keys") or {})
    rank = {k: s.pop(k) for k in ("sort_every", "segments") if k in s}
    nstep = None
    if n_step > 1:
        nstep = {"n": n_step, "gamma": s["gamma"], **keys, "n_envs": None, "autoreset": None,
                 "discount_field": True}  # fmt: skip
    settings = {
        "capacity": header["capacity"],
        "fields": header["fields"],
        **s,
        "max_priority": "ever",
        "shuffle": False,
        "alpha_every": 1,
        "nstep": nstep,
        **rank,
    }
    return {
        "kind": kind,
        "settings": settings,
        "schedules": {
            "alpha": header["alpha_schedule"],
            "beta": header["beta_schedule"],
            "priority_noise": {"kind": "constant", "value": 0.0},
        },
        "buffer": {
            "scheme": kind,
            "scheme_options": rank,
            "pending_switch": None,
            "max_priority_ever": st["max_priority"],
            "stale_updates": st["stale_updates"],
            "step": st["step"],
            "rng": st["rng"],
        },
        "writer": {
            "size": st["size"],
            "cursor": st["cursor"],
            "total_added": st["total_added"],
            "key_base": st["key_base"],
        },
        "sampler": _v1_sampler(kind, st),
        "storage": {},
        "nstep": None if n_step == 1 else {},
    }
