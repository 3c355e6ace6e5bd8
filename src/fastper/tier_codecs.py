"""Codecs and cold chunk files for :mod:`fastper.tiers`.

Codecs are optional packages (extra ``fastper[tiers]``: lz4, zstandard,
blosc2), imported only when a codec is made; zlib (standard library) is the
fallback. With lz4, compiled kernels call LZ4's C functions directly (see
:class:`Codec`); the environment variable ``FASTPER_LZ4_KERNELS=0`` turns
them off (the lz4 package's Python calls then do all the work, with the same
results, and storages move chunks inline by default); ``1`` or unset: on
where they load. A cold chunk file holds one chunk's compressed blocks behind a
small index (offsets, CRC32 of each block): one file per chunk, written to a
temporary name and renamed, so a reader sees the old file or the new one,
never a mix; the index is also kept in RAM, so a gather reads only the
blocks it needs (one ``pread`` each) and checks each against its CRC.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ._validation import show
from .errors import FastPERError, install_hint, missing_extra

__all__ = ["BlockLayout", "Codec", "OpenFiles", "TierDataError", "available_codecs", "make_codec"]

_MAGIC = b"FPTIER1\n"
_HEAD = struct.Struct("<8sQ")  # magic, number of pieces


class TierDataError(FastPERError, OSError):
    """A cold chunk file is missing, truncated or corrupted (the message names it)."""


# -- codecs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Codec:
    """A block codec: ``compress(data, itemsize) -> bytes``, ``decompress(data, nbytes)``.

    Both must be thread-safe (the prefetch thread decompresses).
    ``warm_rows`` / ``pack_blocks``: where the format has them, compiled
    kernels calling its C library (:func:`fastper._kernels.lz4.warm_rows`:
    the warm rows of a gather and promotions, decoded straight from RAM;
    :func:`fastper._kernels.lz4.pack_blocks`: a chunk compressed in one
    call); ``None``: ``decompress`` / ``compress`` do it (also where the
    environment variable ``FASTPER_LZ4_KERNELS`` is ``0`` when the codec is made).
    """

    name: str
    compress: Callable[[Any, int], bytes]
    decompress: Callable[[bytes, int], bytes]
    warm_rows: Any = None
    pack_blocks: Any = None


def _lz4() -> Codec:
    import lz4.block as lzb  # releases the GIL

    def comp(data: Any, itemsize: int) -> bytes:
        return bytes(lzb.compress(data, store_size=False))

    def decomp(data: bytes, nbytes: int) -> bytes:
        return bytes(lzb.decompress(data, uncompressed_size=nbytes))

    return Codec("lz4", comp, decomp, *(_lz4_kernels() if _lz4_kernels_wanted() else (None, None)))


#: the environment variable that turns lz4's compiled kernels off ("0") or on ("1", unset)
LZ4_KERNELS_ENV = "FASTPER_LZ4_KERNELS"


def _lz4_kernels_wanted() -> bool:
    """False where ``FASTPER_LZ4_KERNELS=0``; read each time a codec is made."""
    value = os.environ.get(LZ4_KERNELS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"`{LZ4_KERNELS_ENV}` must be 0 (lz4 through its Python package only) or 1 "
            f"(compiled kernels where they load), got {LZ4_KERNELS_ENV}={value!r}"
        )
    return value != "0"


@functools.cache  # once per process
def _lz4_kernels() -> tuple[Any, Any]:
    """The compiled kernels of :mod:`fastper._kernels.lz4` (``warm_rows``,
    ``pack_blocks``), or ``(None, None)`` where LZ4's C functions are not
    reachable or fail a round trip with the Python codec (the storage then
    works in Python, with the same results)."""
    try:
        import lz4.block as lzb

        from ._kernels.lz4 import pack_blocks, warm_rows

        # one chunk of 4 rows, 2 fields (3 and 5 bytes a row), 2 rows per block
        cols = (np.arange(12, dtype=np.uint8).reshape(4, 3), np.ones((4, 5), dtype=np.uint8))
        starts, widths = np.array([0, 6]), np.array([3, 5])
        ends = np.zeros(2, dtype=np.int64)
        arena = np.zeros(2 * (16 + 16), dtype=np.uint8)
        used = pack_blocks(cols, 2, starts, widths, 16, arena, ends)
        pieces = [arena[a:b].tobytes() for a, b in zip([0, ends[0]], ends, strict=True)]
        raw = [np.concatenate([c[j : j + 2].ravel() for c in cols]) for j in (0, 2)]
        held = [np.frombuffer(p, dtype=np.uint8) for p in pieces]
        out = (np.zeros((4, 3), dtype=np.uint8), np.zeros((4, 5), dtype=np.uint8))
        got = warm_rows(
            np.arange(4, dtype=np.int64), np.zeros(4, dtype=np.bool_), np.ones(1, np.int8),
            -1, 2, 2, np.array([h.ctypes.data for h in held]),
            np.array([len(p) for p in pieces]), 16, starts, widths, out,
        )  # fmt: skip
        ok = used == ends[-1] and tuple(got) == (2, 4, -1)
        ok = ok and all(np.array_equal(o, c) for o, c in zip(out, cols, strict=True))
        ok = ok and all(
            lzb.decompress(p, uncompressed_size=16) == r.tobytes()
            for p, r in zip(pieces, raw, strict=True)
        )
        if not ok:
            return None, None
    except Exception:  # noqa: BLE001 - whatever fails (a numba or lz4 build): work in Python
        return None, None
    return warm_rows, pack_blocks


def _zstd() -> Codec:
    import zstandard as zstd

    local = threading.local()  # (de)compressor objects are not thread-safe

    def comp(data: Any, itemsize: int) -> bytes:
        c = getattr(local, "c", None)
        if c is None:
            c = local.c = zstd.ZstdCompressor(level=1)
        return bytes(c.compress(data))

    def decomp(data: bytes, nbytes: int) -> bytes:
        d = getattr(local, "d", None)
        if d is None:
            d = local.d = zstd.ZstdDecompressor()
        return bytes(d.decompress(data, max_output_size=nbytes))

    return Codec("zstd", comp, decomp)


def _blosc2() -> Codec:
    import blosc2

    def comp(data: Any, itemsize: int) -> bytes:
        size = itemsize if len(data) % itemsize == 0 else 1  # blosc2 needs a multiple
        out = blosc2.compress(
            data, typesize=size, clevel=5, filter=blosc2.Filter.SHUFFLE, codec=blosc2.Codec.LZ4
        )
        return bytes(out)

    def decomp(data: bytes, nbytes: int) -> bytes:
        return bytes(blosc2.decompress(data))

    return Codec("blosc2", comp, decomp)


def _zlib() -> Codec:
    def comp(data: Any, itemsize: int) -> bytes:
        return zlib.compress(data, 1)

    def decomp(data: bytes, nbytes: int) -> bytes:
        return zlib.decompress(data, bufsize=max(nbytes, 1))

    return Codec("zlib", comp, decomp)


_MAKERS: dict[str, Callable[[], Codec]] = {
    "lz4": _lz4,
    "zstd": _zstd,
    "blosc2": _blosc2,
    "zlib": _zlib,
}
#: ``codec="auto"`` takes the first installed, in this order (see the benchmark)
AUTO_ORDER = ("lz4", "zstd", "blosc2")


def make_codec(name: str) -> Codec:
    """The codec ``name`` (``"auto"``, ``"lz4"``, ``"zstd"``, ``"blosc2"`` or ``"zlib"``).

    Raises:
        ValueError: an unknown name; for lz4 (and ``"auto"``), the environment
            variable ``FASTPER_LZ4_KERNELS`` set to something but 0 or 1.
        MissingExtraError: the codec's package is not installed (one line with
            the install hint).
    """
    if name == "auto":
        for candidate in AUTO_ORDER:
            try:
                return _MAKERS[candidate]()
            except ImportError:
                continue
        warnings.warn(
            "fastper.tiers: no lz4 / zstandard / blosc2 installed, using zlib (slower); "
            f"{install_hint('tiers')}",
            stacklevel=3,
        )
        return _zlib()
    if name not in _MAKERS:
        raise ValueError(f"`codec` must be one of {['auto', *_MAKERS]}, got codec={show(name)}")
    try:
        return _MAKERS[name]()
    except ImportError as exc:
        raise missing_extra(f"fastper.tiers' codec {name!r}", exc, "tiers") from None


def available_codecs() -> list[str]:
    """Names of the codecs whose packages are installed (zlib always is)."""
    out = []
    for name, maker in _MAKERS.items():
        try:
            maker()
        except ImportError:
            continue
        out.append(name)
    return out


# -- cold files -----------------------------------------------------------------------
def write_chunk_file(path: str, pieces: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Write ``pieces`` atomically (temporary file, fsync-free rename); return (offsets, crcs)."""
    sizes = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    head = _HEAD.size + 8 * (len(pieces) + 1) + 4 * len(pieces)
    offsets = np.empty(len(pieces) + 1, dtype=np.int64)
    offsets[0] = head
    np.cumsum(sizes, out=offsets[1:])
    offsets[1:] += head
    crcs = np.fromiter((zlib.crc32(p) for p in pieces), dtype=np.uint32, count=len(pieces))
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, len(pieces)))
            f.write(offsets.astype("<i8").tobytes())
            f.write(crcs.astype("<u4").tobytes())
            for p in pieces:
                f.write(p)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return offsets, crcs


def open_chunk_file(path: str, offsets: np.ndarray) -> int:
    """Open a chunk file for :func:`read_fd`; checks its size against the index. Returns the fd."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise TierDataError(f"cold chunk file {path!r} cannot be opened: {exc}") from None
    try:
        size = os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        raise
    if size != int(offsets[-1]):
        os.close(fd)
        raise TierDataError(
            f"cold chunk file {path!r} is truncated or altered: {size} bytes, "
            f"expected {int(offsets[-1])}"
        )
    return fd


def read_fd(
    fd: int, path: str, offsets: np.ndarray, crcs: np.ndarray, which: list[int]
) -> list[bytes]:
    """Pieces ``which`` of an open chunk file, each checked against its CRC32 (one pread each).

    The size is checked again (one ``fstat``): a file truncated while open is named as such.
    """
    size = os.fstat(fd).st_size
    if size != int(offsets[-1]):
        raise TierDataError(
            f"cold chunk file {path!r} is truncated or altered: {size} bytes, "
            f"expected {int(offsets[-1])}"
        )
    out = []
    for j in which:
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        data = os.pread(fd, hi - lo, lo)
        if len(data) != hi - lo:  # the file shrank since it was opened
            raise TierDataError(
                f"cold chunk file {path!r} is truncated or altered: piece {j} reads "
                f"{len(data)} of {hi - lo} bytes"
            )
        if zlib.crc32(data) != int(crcs[j]):
            raise TierDataError(
                f"cold chunk file {path!r} is corrupted: piece {j} fails its checksum"
            )
        out.append(data)
    return out


def read_pieces(path: str, offsets: np.ndarray, crcs: np.ndarray, which: np.ndarray) -> list[bytes]:
    """Pieces ``which`` of a chunk file, checked against the index kept in RAM."""
    fd = open_chunk_file(path, offsets)
    try:
        return read_fd(fd, path, offsets, crcs, which.tolist())
    finally:
        os.close(fd)


def remove_files(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


class OpenFiles:
    """Cold chunk files kept open between gathers (at most ``limit``, least recently
    used closed first): a gather then costs one ``fstat`` and a ``pread`` per block,
    not an ``open``. Not thread-safe: the storage's thread only."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self.fds: dict[str, int] = {}  # least recently used first

    def read(
        self, path: str, offsets: np.ndarray, crcs: np.ndarray, which: list[int]
    ) -> list[bytes]:
        fd = self.fds.pop(path, None)  # re-inserted last
        if fd is None:
            fd = open_chunk_file(path, offsets)
            if len(self.fds) >= self.limit:
                os.close(self.fds.pop(next(iter(self.fds))))
        self.fds[path] = fd
        return read_fd(fd, path, offsets, crcs, which)

    def forget(self, path: str) -> None:
        """Close ``path`` if open (before it is removed or replaced)."""
        fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


# -- blocks ---------------------------------------------------------------------------
class BlockLayout:
    """How a chunk's rows are cut into compressed blocks.

    A block holds ``rows_per_block`` consecutive rows (a power of 2, about
    ``block_bytes`` of raw data), each field's rows one after another, so a
    codec sees one dtype at a time. Thread-safe: it holds no mutable state
    but a per-thread arena for compiled packs.
    """

    def __init__(
        self, fields: Mapping[str, Any], chunk_size: int, block_bytes: int, codec: Codec
    ) -> None:
        self.fields, self.codec, self.chunk_size = dict(fields), codec, chunk_size
        row_bytes = sum(f.nbytes_per_item for f in self.fields.values())
        rows = max(1, block_bytes // max(row_bytes, 1))
        self.rows_per_block = rpb = min(chunk_size, 1 << (rows.bit_length() - 1))
        self.per_chunk = chunk_size // rpb
        sizes = np.array([f.nbytes_per_item for f in self.fields.values()]) * rpb
        ends = np.cumsum(sizes)
        starts = (ends - sizes).tolist()
        self.spans = list(zip(starts, ends.tolist(), strict=True))
        self.nbytes = int(ends[-1])
        #: per field: (name, offset of its rows in a block, bytes per row)
        self.cuts = [
            (name, int(a), int(f.nbytes_per_item))
            for (name, f), a in zip(self.fields.items(), starts, strict=True)
        ]
        # blosc2 shuffles by type size: the widest item of the fields
        self.typesize = max(int(f.dtype.itemsize) for f in self.fields.values())
        #: per field, as arrays for the compiled kernels: offset in a block, bytes per row
        self.starts = np.array([a for _, a, _ in self.cuts], dtype=np.int64)
        self.widths = np.array([w for _, _, w in self.cuts], dtype=np.int64)
        self.shift = chunk_size.bit_length() - 1  # chunk_size is a power of 2
        self._local = threading.local()  # compiled packs' output arena, per thread

    @staticmethod
    def as_bytes(cols: Any) -> tuple[np.ndarray, ...]:
        """Per field, its rows as uint8 rows (views of C-contiguous arrays)."""
        return tuple(c.reshape(c.shape[0], -1).view(np.uint8) for c in cols)

    def pack(self, cols: list[np.ndarray]) -> list[bytes]:
        """Compress one chunk's rows, given per field: one piece per block. O(bytes).

        In compiled code where the codec has it (into this thread's arena,
        then one bytes object per block), else with the codec's ``compress``.
        """
        kernel = self.codec.pack_blocks
        if kernel is not None:
            nbytes = self.nbytes
            arena = getattr(self._local, "arena", None)
            if arena is None:  # LZ4_compressBound of a block, per block
                arena = self._local.arena = np.empty(
                    self.per_chunk * (nbytes + nbytes // 255 + 16), dtype=np.uint8
                )
            ends = np.empty(self.per_chunk, dtype=np.int64)
            rpb = self.rows_per_block
            used = kernel(self.as_bytes(cols), rpb, self.starts, self.widths, nbytes, arena, ends)
            if used >= 0:
                cuts = ends.tolist()
                return [arena[a:b].tobytes() for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
        rpb, comp, size = self.rows_per_block, self.codec.compress, self.typesize
        pieces = []
        for lo in range(0, self.chunk_size, rpb):
            raw = b"".join([p[lo : lo + rpb].reshape(-1).view(np.uint8).data for p in cols])
            pieces.append(comp(raw, size))
        return pieces

    def decode_raw(self, pieces: list[bytes], where: str | list[str]) -> list[np.ndarray]:
        """Decode blocks, each checked for its size: uint8 views of the bytes. O(bytes).

        ``where`` names the source (of each piece) in error messages.
        """
        nbytes, dec = self.nbytes, self.codec.decompress
        out = []
        for i, piece in enumerate(pieces):
            try:
                raw = dec(piece, nbytes)
            except Exception as exc:  # the codecs raise their own error types
                w = where if isinstance(where, str) else where[i]
                raise TierDataError(f"{w}: a block does not decompress ({exc})") from None
            if len(raw) != nbytes:
                w = where if isinstance(where, str) else where[i]
                raise TierDataError(
                    f"{w}: a block decompresses to {len(raw)} bytes, expected {nbytes}"
                )
            out.append(np.frombuffer(raw, dtype=np.uint8))
        return out

    def refuse(self, piece: bytes | None, where: str) -> NoReturn:
        """Raise :class:`TierDataError` for a block that did not decode, with the
        codec's own message where ``piece`` (the block) gives one."""
        if piece is not None:
            self.decode_raw([piece], where)
        raise TierDataError(f"{where}: a block does not decompress")

    def decode_into(
        self, pieces: Sequence[bytes], target: Mapping[str, np.ndarray], where: str
    ) -> None:
        """Decode a whole chunk's blocks into ``target`` (per field, ``chunk_size`` rows).

        In compiled code where the codec has it (each block decoded once, its
        rows copied straight into ``target``), else through :meth:`decode`.

        Raises:
            TierDataError: a block does not decode (``where`` names the source).
        """
        kernel, cs = self.codec.warm_rows, self.chunk_size
        whole = len(pieces) == self.per_chunk and all(type(p) is bytes for p in pieces)
        if kernel is not None and whole:
            held = [np.frombuffer(p, dtype=np.uint8) for p in pieces]  # alive: `pieces`
            _, got, bad = kernel(
                np.arange(cs, dtype=np.int64), np.zeros(cs, dtype=np.bool_),
                np.ones(1, dtype=np.int8), -1, self.rows_per_block, self.shift,
                np.array([h.ctypes.data for h in held], dtype=np.int64),
                np.array([h.size for h in held], dtype=np.int64), self.nbytes,
                self.starts, self.widths, self.as_bytes(target[n] for n, _, _ in self.cuts),
            )  # fmt: skip
            if bad < 0 and got == cs:
                return
            self.refuse(pieces[bad // self.rows_per_block] if bad >= 0 else None, where)
        rows = self.decode(list(pieces), where)
        for name, t in target.items():
            t[...] = rows[name].reshape(t.shape)

    def decode(self, pieces: list[bytes], where: str | list[str]) -> dict[str, np.ndarray]:
        """Decode blocks: ``{field: (len(pieces), rows_per_block, *shape)}`` views. O(bytes)."""
        staging = np.empty((len(pieces), self.nbytes), dtype=np.uint8)
        for i, raw in enumerate(self.decode_raw(pieces, where)):
            staging[i] = raw
        n, rpb = len(pieces), self.rows_per_block
        return {
            name: staging[:, a:b].view(f.dtype).reshape(n, rpb, *f.shape)
            for (name, f), (a, b) in zip(self.fields.items(), self.spans, strict=True)
        }


# -- background jobs --------------------------------------------------------------------
def run_job(blocks: BlockLayout, job: tuple[Any, ...]) -> tuple[Any, ...]:
    """Run a storage's job (any thread; it changes no storage state).

    ``("pack", chunk, gen, cols, path)``: compress a full hot chunk's rows
    (and write its cold file when ``path``); ``("promote", chunk, slot, path,
    source, target)``: decode a warm (``source`` its pieces) or cold
    (``path``, ``source`` its index) chunk into ``target``, its reserved hot
    rows. Returns ``(kind, chunk, gen or slot, result, error)``.
    """
    kind, c, tag = job[0], job[1], job[2]
    try:
        if kind == "pack":
            cols, path = job[3], job[4]
            pieces = blocks.pack(cols)
            index = write_chunk_file(path, pieces) if path else None
            return (kind, c, tag, (pieces, path, index), None)
        path, source, target = job[3], job[4], job[5]
        if path:
            pieces = read_pieces(path, source[0], source[1], np.arange(blocks.per_chunk))
            where = f"cold chunk file {path!r}"
        else:
            pieces, where = source, f"warm chunk {c}"
        blocks.decode_into(pieces, target, where)
    except Exception as exc:  # reported at install: nothing moved
        return (kind, c, tag, None, exc)
    return (kind, c, tag, None, None)
