"""Pickle-free checkpoints.

File layout (all integers little-endian)::

    magic      8 bytes   b"\\x89FPCKPT\\n"
    version    u32       FORMAT_VERSION
    hlen       u64       length of the header
    header     hlen      UTF-8 JSON: settings, state, and the array table
                         (name, dtype, shape, offset, nbytes of each array)
    hdigest    32 bytes  SHA-256 of everything above
    data       ...       the arrays' raw bytes, C order, back to back
    digest     32 bytes  SHA-256 of everything above

The trailing digest makes any altered or truncated byte an error; the header
digest lets :func:`read_metadata` (``fastper inspect``) trust the header
without reading the data. Only plain numeric dtypes are accepted, every
declared shape is checked against the file's real size before anything is
allocated, and nothing is ever unpickled.

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
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from . import __version__
from . import schedules as _sched
from ._validation import check_int, check_real
from .errors import CheckpointError, ScheduleNotSerializableError

MAGIC = b"\x89FPCKPT\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ")
_DIGEST = 32
#: Largest header accepted (and written). A real header is a few KB (fields,
#: array table, schedules, RNG state); the cap bounds what parsing a hostile one
#: costs: JSON of empty objects takes about 22x its size in Python objects, so
#: 4 MiB -> under 100 MiB and well under a second (64 MiB used to take 1.7 GiB).
_MAX_HEADER = 4 * 1024 * 1024
_CHUNK = 1 << 22
_MAX_NDIM = 32  # numpy 1.x's limit
_MAX_KEY = 2**62  # key counters stay far inside int64 (10^18 transitions)
_DTYPE_KINDS = "biuf"

PathLike = str | os.PathLike[str]

try:  # POSIX: advisory locks tell abandoned temporary files from live ones
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_TMP_SUFFIX = ".fpk.tmp"


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _write_file(path: PathLike, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    target = Path(path)
    table = []
    offset = 0
    blobs = []
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        table.append(
            {
                "name": name,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offset,
                "nbytes": a.nbytes,
            }
        )
        offset += a.nbytes
        blobs.append(a)
    header = json.dumps({**meta, "arrays": table}, sort_keys=True, allow_nan=False).encode("utf-8")
    if len(header) > _MAX_HEADER:
        raise ValueError(
            f"checkpoint header would be {len(header)} bytes, more than the {_MAX_HEADER} "
            "that load() accepts (too many fields or schedule points)"
        )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
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
            for a in blobs:
                view = memoryview(a.reshape(-1).view(np.uint8).data) if a.size else memoryview(b"")
                f.write(view)
                whole.update(view)
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
    try:  # make the rename itself durable
        dfd = os.open(target.parent or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
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


def _read_header(f: BinaryIO, file_size: int, path: PathLike) -> tuple[dict[str, Any], int]:
    raw = f.read(_PREFIX.size)
    if len(raw) < _PREFIX.size:
        raise CheckpointError(
            f"{path}: not a fastper checkpoint (file too short: {file_size} bytes)"
        )
    magic, version, hlen = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a fastper checkpoint (bad magic bytes {magic!r})")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unsupported checkpoint format version {version} (this fastper reads {FORMAT_VERSION})"
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
    try:
        meta = json.loads(header.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint header: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), list):
        raise CheckpointError(f"{path}: malformed checkpoint header")
    return meta, data_start


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
        if offset != end or offset + nbytes > blob_size:
            raise CheckpointError(f"{path}: array `{name}` lies outside the data section")
        end = offset + nbytes
        out[name] = (dt, shape, offset, nbytes)
    if end != blob_size:
        raise CheckpointError(
            f"{path}: data section size {blob_size} does not match the array table"
        )
    return out


def read_metadata(path: PathLike, *, verify: bool = False) -> dict[str, Any]:
    """The checkpoint's header (settings, state, array table) without its arrays.

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
        meta, data_start = _read_header(f, file_size, path)
        _array_table(meta, file_size - data_start - _DIGEST, path)
        if verify:
            _verify_digest(f, file_size, path)
    return meta


def read_file(path: PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Verify and read a checkpoint: (metadata, arrays). Memory ~ file size."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size  # of this file (see read_metadata)
        meta, data_start = _read_header(f, file_size, path)
        table = _array_table(meta, file_size - data_start - _DIGEST, path)
        _verify_digest(f, file_size, path)
        arrays: dict[str, np.ndarray] = {}
        for name, (dt, shape, offset, nbytes) in table.items():
            arr = np.empty(shape, dtype=dt)
            f.seek(data_start + offset)
            if nbytes and f.readinto(arr.reshape(-1).view(np.uint8).data) != nbytes:
                raise CheckpointError(f"{path}: truncated checkpoint while reading `{name}`")
            arrays[name] = arr
    return meta, arrays


# ---------------------------------------------------------------------------
# buffers <-> (meta, arrays)
# ---------------------------------------------------------------------------


def save_buffer(buffer: Any, path: PathLike) -> None:
    """Checkpoint ``buffer`` to ``path`` (see the module docstring)."""
    from .buffers import _Buffer

    assert isinstance(buffer, _Buffer)
    b = buffer
    n = len(b)
    nstep = b._nstep
    input_fields = nstep.fields if nstep is not None else b._storage.fields
    meta = {
        "format": "fastper-checkpoint",
        "format_version": FORMAT_VERSION,
        "fastper_version": __version__,
        "buffer": b.kind,
        "capacity": b.capacity,
        "fields": [[k, f.to_dict()] for k, f in input_fields.items()],
        "settings": {
            "eps": b._eps,
            "clip": b._clip,
            "stratified": b._stratified,
            "weight_norm": b._weight_norm,
            "n_step": 1 if nstep is None else nstep.n,
            "gamma": b._gamma,
            "seed": b._seed,
            "nstep_keys": None
            if nstep is None
            else {k: v for k, v in nstep.settings().items() if k.endswith("_key")},
            **b._sampler_settings(),
        },
        "alpha_schedule": _sched.to_dict(b._alpha_schedule),
        "beta_schedule": _sched.to_dict(b._beta_schedule),
        "state": {
            "size": n,
            "cursor": b._storage.cursor,
            "total_added": b._added,
            "key_base": b._key_base,
            "max_priority": b._max_priority,
            "stale_updates": b._stale_updates,
            "step": b._step,
            "alpha": b._sampler.alpha,
            "rng": b._rng.bit_generator.state,
            "sampler": b._sampler.state_meta(),
            "n_pending": b.n_pending,
        },
    }
    arrays: dict[str, np.ndarray] = {}
    for name, col in b._storage.columns.items():
        arrays[f"data/{name}"] = col[:n]
    for name, arr in b._sampler.state_arrays(n).items():
        arrays[f"sampler/{name}"] = arr
    if nstep is not None:
        for name, arr in nstep.pending.items():
            arrays[f"nstep/{name}"] = arr
    _write_file(path, meta, arrays)


def load(
    path: PathLike,
    *,
    alpha: Callable[[int], float] | float | None = None,
    beta: Callable[[int], float] | float | None = None,
) -> Any:
    """Load a buffer saved with ``buffer.save(path)``.

    The loaded buffer holds the same contents, priorities, keys, cursor,
    settings, schedules, step and random state, so it continues with exactly
    the samples the original would have drawn.

    Args:
        path: checkpoint file.
        alpha, beta: schedules to use instead of the saved ones; needed when
            the buffer was saved with a custom callable schedule.

    Raises:
        CheckpointError: a truncated, altered or malformed file, or an
            unknown format version (a ValueError).
        ScheduleNotSerializableError: a custom schedule was saved and none
            was given.
    """
    meta, arrays = read_file(path)
    try:
        return _restore(meta, arrays, alpha, beta)
    except (ScheduleNotSerializableError, CheckpointError):
        raise
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        OverflowError,
        SyntaxError,
        RecursionError,
    ) as exc:
        raise CheckpointError(f"{path}: inconsistent checkpoint contents: {exc}") from None


def _schedule(saved: dict[str, Any], given: Any, name: str) -> Any:
    if given is not None:
        return given
    if saved.get("kind") == "callable":
        raise ScheduleNotSerializableError(
            f"the buffer was saved with a custom `{name}` schedule ({saved.get('repr')}); "
            f"pass it again: fastper.load(path, {name}=...)"
        )
    return _sched.from_dict(saved)


def _check_size(meta: dict[str, Any]) -> None:
    """Refuse a header whose buffer could not fit in this machine's memory.

    The arrays in the file only cover the stored slots; the capacity is taken
    from the header, so a forged header could otherwise ask for terabytes.
    """
    capacity = int(meta["capacity"])
    per_slot = 64  # keys, raw priorities and two trees, generously
    for _, spec in meta["fields"]:
        per_slot += math.prod(int(x) for x in spec["shape"]) * np.dtype(str(spec["dtype"])).itemsize
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        physical = 1 << 40
    if capacity < 1 or capacity * per_slot > physical:
        raise CheckpointError(
            f"checkpoint declares capacity={capacity} ({capacity * per_slot / 2**30:.1f} GiB), "
            f"more than this machine's memory ({physical / 2**30:.1f} GiB)"
        )


def _restore(meta: dict[str, Any], arrays: dict[str, np.ndarray], alpha: Any, beta: Any) -> Any:
    from .buffers import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer

    classes = {c.kind: c for c in (ReplayBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer)}
    kind = meta.get("buffer")
    if kind not in classes:
        raise CheckpointError(f"unknown buffer kind {kind!r} in checkpoint")
    _check_size(meta)
    s = dict(meta["settings"])
    extra = {}
    if kind == "rank":
        extra = {"sort_every": s.pop("sort_every"), "segments": s.pop("segments")}
    nstep_keys = s.pop("nstep_keys")
    buf = classes[kind](
        int(meta["capacity"]),
        {str(k): (tuple(v["shape"]), v["dtype"]) for k, v in meta["fields"]},
        alpha=_schedule(meta["alpha_schedule"], alpha, "alpha"),
        beta=_schedule(meta["beta_schedule"], beta, "beta"),
        nstep_keys=nstep_keys,
        **s,
        **extra,
    )
    st = meta["state"]
    n, cap = int(st["size"]), buf.capacity
    cursor, added = int(st["cursor"]), int(st["total_added"])
    key_base = int(st["key_base"])
    since_clear = added - key_base
    if added > _MAX_KEY:
        # keys are int64 in the kernels: a larger counter would load and then
        # make every sample and update fail with OverflowError
        raise CheckpointError(f"key counter total_added={added} exceeds {_MAX_KEY}")
    if not (0 <= key_base <= added and n == min(since_clear, cap) and cursor == since_clear % cap):
        raise CheckpointError(
            f"inconsistent ring state size={n} cursor={cursor} added={added} key_base={key_base}"
        )
    expected = {f"data/{k}" for k in buf._storage.fields}
    expected |= {f"sampler/{k}" for k in buf._sampler.state_arrays(0)}
    if buf._nstep is not None:
        expected |= {f"nstep/{k}" for k in buf._nstep.fields}
    if set(arrays) != expected:
        raise CheckpointError(f"checkpoint arrays {sorted(arrays)} do not match {sorted(expected)}")
    for name, field in buf._storage.fields.items():
        a = arrays[f"data/{name}"]
        if a.dtype != field.dtype or a.shape != (n, *field.shape):
            raise CheckpointError(
                f"array data/{name} has {a.dtype}{a.shape}, expected {field.dtype}{(n, *field.shape)}"
            )
    prio = arrays["sampler/priorities"]
    if (
        prio.shape != (n,)
        or prio.dtype != np.float64
        or not np.isfinite(prio).all()
        or (n and prio.min() < 0)
    ):
        raise CheckpointError("checkpoint priorities must be finite, >= 0 and one per stored slot")
    max_p = float(st["max_priority"])
    if not (math.isfinite(max_p) and max_p >= 1.0 and (n == 0 or max_p >= prio.max())):
        raise CheckpointError(f"checkpoint max_priority={max_p!r} is inconsistent")
    pending = {}
    if buf._nstep is not None:
        for name, field in buf._nstep.fields.items():
            a = arrays[f"nstep/{name}"]
            if a.dtype != field.dtype or a.shape[1:] != field.shape or a.shape[0] >= buf._nstep.n:
                raise CheckpointError(f"array nstep/{name} is inconsistent")
            pending[name] = a
        if len({a.shape[0] for a in pending.values()}) != 1:
            raise CheckpointError("n-step pending arrays differ in length")
    # all checks passed: fill the buffer
    for name in buf._storage.fields:
        buf._storage.columns[name][:n] = arrays[f"data/{name}"]
    buf._storage.size, buf._storage.cursor = n, cursor
    buf._added = added
    buf._key_base = key_base
    buf._max_priority = max_p
    buf._stale_updates = check_int("stale_updates", st["stale_updates"], minimum=0)
    buf._step = check_int("step", st["step"], minimum=0)
    buf._sampler.alpha = check_real("alpha", st["alpha"], minimum=0.0)
    sampler_arrays = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("sampler/")}
    buf._sampler.load_state(sampler_arrays, st["sampler"], n)
    if buf._nstep is not None:
        buf._nstep.pending = pending
    try:
        buf._rng.bit_generator.state = st["rng"]
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint random state is invalid: {exc}") from None
    return buf
