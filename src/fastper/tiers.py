"""Priority-aware hot / warm / cold storage: a :class:`~fastper.storage.ReplayStorage`.

The payload lives in *chunks* of ``chunk_size`` consecutive slots, aligned
with the sum tree (a node of level ``l`` holds the mass of ``8**l`` aligned
leaves, so with ``chunk_size`` a power of 8 the mass under every chunk is one
level of the tree, read in O(N / chunk_size)). A chunk is in one tier:

* **hot**: uncompressed rows in a preallocated RAM pool (``hot_bytes``);
* **warm**: compressed bytes in RAM (``warm_bytes`` of compressed data);
* **cold**: compressed bytes on disk, one file per chunk in ``cold_dir``.

Inside a chunk, rows are compressed in *blocks* of ``rows_per_block`` rows
(about ``block_bytes`` of raw data, each field on its own so a codec sees
one dtype): a gathered row of a warm or cold chunk costs one block's
decompression (and, cold, one ``pread`` of its bytes), never the chunk's.
With the lz4 codec the heavy work runs in compiled code that calls LZ4's own
C functions (:mod:`fastper._kernels.lz4`, outside the interpreter lock): the
warm rows of a gather are decoded in one call straight into the batch (each
block once, no Python per row), a promotion decodes a chunk straight into its
hot slot, a demotion compresses a chunk in one call. A warm row then costs
about what a hot one does. Cold rows of a gather, and every codec but lz4,
are decoded in Python.

Writes go to the *open* chunk, which is always hot. When the ring enters a
chunk that holds rows (it wraps), the chunk is first made hot again: its rows
not yet overwritten stay readable. A hot slot is freed by demoting the hot
chunk of least known mass (the oldest first among chunks not yet weighed).

Placement follows the sampling mass (:meth:`TieredStorage.rebalance`, which
a buffer calls every ``rebalance_every`` samples with
``sampler.chunk_masses(chunk_size, n)``): the heaviest chunks hot up to
``hot_bytes``, the next warm up to ``warm_bytes``, the rest cold. Hysteresis:
a chunk displaces a hot (warm) one only if its mass exceeds the displaced
chunk's by the factor ``hysteresis``, masses are averaged over rebalances
(``smoothing``), and at most ``max_moves`` chunks move per rebalance; so a
small or one-off change of mass moves nothing.

With ``prefetch=False`` moves are made inline: a promotion is decoded and a
demotion compressed when the placement decides it (in ``sample``, every
``rebalance_every`` calls) or when the ring needs a hot slot (in ``add``).
With ``prefetch=True`` one background thread does that work instead: a
promotion is decoded into a reserved hot slot while the learner works on the
batch just sampled (until it is installed, at the next storage call, the
chunk is served from where it was), and the full hot chunks next in line for
demotion (``pack_ahead`` of them, least mass first) are compressed ahead of
time (their copies kept in ``warm_bytes``, or in their cold files when warm
RAM is short), so a demotion costs nothing on the sampling path. Nothing is
compressed on the sampling path: a rebalance swaps out only hot chunks that
have a packed copy (the others it would swap out are packed in the
background, ready for the next rebalance), and the ring, needing a hot slot,
frees one with a copy among the chunks about as light as the lightest
(within ``hysteresis``); the ring never writes a chunk while it is being
packed (it waits). The thread pays off
where its work runs outside the interpreter lock, in the compiled lz4 kernels:
the default (``prefetch=None``) turns it on with them and off otherwise. On
the 2-CPU machine of ``benchmarks/results/tiers.md`` the thread gave a faster
training loop than inline moves in 37 of 50 paired configurations of five
runs with the compiled kernels, and a slower one in all 20 of two runs
before them, when its work was Python (its share of the interpreter lock
slowed the learner more than the work it took away). What a
batch returns never depends on where a row is or on the thread: only the
speed does. It does not guess the next batch's rows: those depend on the
priorities the learner is about to write. Cold files stay open between
gathers (up to 64, least recently used closed first).

Codecs are optional (extra ``fastper[tiers]``: lz4, zstandard, blosc2) and
imported only when a storage is made; ``codec="auto"`` takes lz4 (fastest
to decompress in ``benchmarks/results/tiers.md``), else zstandard, blosc2,
and falls back to the standard library's zlib with a note.
"""

from __future__ import annotations

import ctypes
import os
import queue
import secrets
import tempfile
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._kernels.tiers import hot_rows
from ._validation import check_int, check_real, show
from .storage import Field, FieldLike, check_columns, coerce_batch, make_fields
from .tier_codecs import (
    BlockLayout,
    Codec,
    OpenFiles,
    TierDataError,
    available_codecs,
    make_codec,
    remove_files,
    run_job,
    write_chunk_file,
)

__all__ = ["Codec", "TierDataError", "TieredStorage", "available_codecs", "make_codec"]

HOT, WARM, COLD, EMPTY = 0, 1, 2, 3
TIER_NAMES = ("hot", "warm", "cold")


def _cleanup(paths: list[str], files: OpenFiles, jobs: queue.SimpleQueue[Any]) -> None:
    """A storage's finalizer: stop its background thread, close and remove its cold files."""
    jobs.put(None)
    files.close_all()
    remove_files(paths)


def _bytes_offset() -> int | None:
    """Where a bytes object's data starts, from its ``id`` (CPython: its address),
    checked against ctypes on probes; None where that does not hold."""
    off = bytes.__basicsize__ - 1  # PyBytesObject: the header, then the bytes
    probes = [b"", b"x", bytes(range(7)), bytes(1000)]
    ok = all(ctypes.cast(ctypes.c_char_p(p), ctypes.c_void_p).value == id(p) + off for p in probes)
    return off if ok else None


_BYTES_OFFSET = _bytes_offset()


def _addresses(pieces: tuple[bytes, ...]) -> list[int]:
    """Addresses of the data of bytes objects (stable while they live: bytes never move)."""
    if _BYTES_OFFSET is not None:  # ~0.1 us a piece against ~1 us through ctypes
        return [id(p) + _BYTES_OFFSET for p in pieces]
    cast, void, char = ctypes.cast, ctypes.c_void_p, ctypes.c_char_p
    return [cast(char(p), void).value or 0 for p in pieces]  # c_char_p: no copy


class _WarmPieces(dict[int, tuple[bytes, ...]]):
    """Warm chunks' compressed blocks (chunk -> a tuple of bytes, one per block),
    with each block's address and size kept in arrays for the compiled gather.

    The arrays are written on every change of the dict (set, delete, pop,
    clear: the only ones the storage makes; a chunk's pieces are a tuple, not
    changed in place), so an address is in them exactly while its bytes
    object is held here (bytes never move); with ``track`` False they stay
    empty (no compiled decoder).
    """

    def __init__(self, n_blocks: int, per_chunk: int, track: bool) -> None:
        super().__init__()
        self.per_chunk, self.track = per_chunk, track
        self.addr = np.zeros(n_blocks if track else 0, dtype=np.int64)
        self.size = np.zeros(n_blocks if track else 0, dtype=np.int64)
        #: bytes of all the pieces held (kept with every change: O(1) to read)
        self.nbytes = 0

    def _mark(self, c: int, pieces: tuple[bytes, ...] | None) -> None:
        if not self.track:
            return
        at = slice(c * self.per_chunk, (c + 1) * self.per_chunk)
        if pieces is None:
            self.addr[at] = 0
            self.size[at] = 0
        else:
            self.addr[at] = _addresses(pieces)
            self.size[at] = [len(p) for p in pieces]

    def __setitem__(self, c: int, pieces: Sequence[bytes]) -> None:
        pieces = tuple(pieces)
        if self.track and not all(type(p) is bytes for p in pieces):
            raise TypeError("warm pieces must be bytes (immutable: their addresses stay valid)")
        self._mark(c, None)
        self.nbytes -= sum(len(p) for p in super().get(c, ()))
        super().__setitem__(c, pieces)
        self.nbytes += sum(len(p) for p in pieces)
        self._mark(c, pieces)

    def __delitem__(self, c: int) -> None:
        self.pop(c)  # KeyError if absent, as dict's

    def pop(self, c: int, *default: Any) -> Any:
        if c not in self:
            return super().pop(c, *default)  # the default, or KeyError
        pieces = super().pop(c)
        self.nbytes -= sum(len(p) for p in pieces)
        self._mark(c, None)
        return pieces

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0
        self.addr[:] = 0
        self.size[:] = 0


# -- the storage ------------------------------------------------------------------------
class TieredStorage:
    """Hot / warm / cold chunked storage placed by sampling mass (see the module docstring).

    Args:
        fields: the field spec, as for :class:`~fastper.storage.Storage`.
        capacity: number of slots.
        chunk_size: slots per chunk, a power of 2 (a power of 8 reads the tree
            directly); the unit of placement.
        hot_bytes: RAM for uncompressed chunks (at least one chunk is hot:
            the one being written).
        warm_bytes: RAM for compressed chunks.
        cold_dir: directory for cold chunk files (created; must not hold
            chunk files already). ``None``: a temporary directory, removed
            with the storage.
        codec: ``"auto"``, ``"lz4"``, ``"zstd"``, ``"blosc2"`` or ``"zlib"``.
        block_bytes: raw bytes per compressed block (rounded to a power-of-2
            number of rows within a chunk).
        rebalance_every: samples between two rebalances (see :attr:`wants_masses`).
        hysteresis: factor (>= 1) by which a chunk's mass must exceed the
            mass of the chunk it displaces.
        smoothing: weight of the latest masses in the average placement uses
            (``avg += smoothing * (mass - avg)`` at each rebalance; 1: no
            averaging). Priorities are noisy (each sampled slot gets a new
            |TD|): averaging stops chunks moving for a one-off change.
        max_moves: most chunks promoted per rebalance (None: no limit).
        prefetch: decode promotions and compress chunks ahead of their
            demotion in a background thread. ``None`` (default): on where
            the codec has compiled kernels (lz4: the thread's work then runs
            outside the interpreter lock), off otherwise (moves inline); see
            the module docstring.
        pack_ahead: with ``prefetch``: how many full hot chunks, least mass
            first (the next to be demoted), are compressed ahead of their
            demotion, so that it costs nothing on the sampling path (less the
            free hot slots: none while the hot pool has room); a chunk
            demoted without a copy is compressed then. ``None``: every chunk
            as soon as the ring fills it (most background work: worth it
            when nearly every chunk is demoted, a small hot tier).

    Raises:
        ValueError, TypeError: bad arguments; ``cold_dir`` holding chunk files.
    """

    def __init__(
        self,
        fields: Mapping[str, FieldLike],
        capacity: int,
        *,
        chunk_size: int = 64,
        hot_bytes: int = 1 << 30,
        warm_bytes: int = 1 << 30,
        cold_dir: str | os.PathLike[str] | None = None,
        codec: str = "auto",
        block_bytes: int = 1 << 15,
        rebalance_every: int = 64,
        hysteresis: float = 1.5,
        smoothing: float = 0.5,
        max_moves: int | None = 8,
        prefetch: bool | None = None,
        pack_ahead: int | None = 16,
    ) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.fields: dict[str, Field] = make_fields(fields)
        cs = check_int("chunk_size", chunk_size, minimum=1)
        if cs & (cs - 1):
            raise ValueError(f"`chunk_size` must be a power of 2, got chunk_size={cs}")
        self.chunk_size = cs
        self._shift = cs.bit_length() - 1
        self.hot_bytes = check_int("hot_bytes", hot_bytes, minimum=0)
        self.warm_bytes = check_int("warm_bytes", warm_bytes, minimum=0)
        block = check_int("block_bytes", block_bytes, minimum=1)
        self.rebalance_every = check_int("rebalance_every", rebalance_every, minimum=1)
        self.hysteresis = check_real("hysteresis", hysteresis, minimum=1.0)
        self.smoothing = check_real(
            "smoothing", smoothing, minimum=0.0, maximum=1.0, strict_min=True
        )
        self.max_moves = None if max_moves is None else check_int("max_moves", max_moves, minimum=1)
        if prefetch is not None and not isinstance(prefetch, bool):
            raise TypeError(f"`prefetch` must be a bool or None, got prefetch={show(prefetch)}")
        self.pack_ahead = (
            None if pack_ahead is None else check_int("pack_ahead", pack_ahead, minimum=0)
        )
        if not isinstance(codec, str):
            raise TypeError(f"`codec` must be a string, got codec={show(codec)}")
        self.codec = make_codec(codec)
        compiled = self.codec.warm_rows is not None and self.codec.pack_blocks is not None
        self.prefetch: bool = compiled if prefetch is None else prefetch

        self.row_bytes = sum(f.nbytes_per_item for f in self.fields.values())
        self._blocks = BlockLayout(self.fields, cs, block, self.codec)
        # the warm rows of a gather decoded in compiled code where the codec has it
        self._warm_gather = self.codec.warm_rows
        self.rows_per_block = self._blocks.rows_per_block
        self.blocks_per_chunk = self._blocks.per_chunk
        self.n_chunks = -(-self.capacity // cs)
        self.chunk_bytes = cs * self.row_bytes
        self.n_hot_slots = min(self.n_chunks, max(1, self.hot_bytes // max(self.chunk_bytes, 1)))

        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if cold_dir is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="fastper-cold-")
            self.cold_dir = self._tmpdir.name
        else:
            self.cold_dir = os.fspath(cold_dir)
            os.makedirs(self.cold_dir, exist_ok=True)
            taken = [f for f in os.listdir(self.cold_dir) if f.endswith(".fpc")]
            if taken:
                raise ValueError(
                    f"`cold_dir` must not hold chunk files already (another storage's?), got "
                    f"cold_dir={self.cold_dir!r} with {len(taken)} .fpc files"
                )
        self._pool = {
            name: np.zeros((self.n_hot_slots * cs, *f.shape), dtype=f.dtype)
            for name, f in self.fields.items()
        }
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._inflight = 0
        # for the finalizer: both mutated in place, never replaced
        self._cold_paths: list[str] = []
        self._files = OpenFiles()
        self._reset_state()
        self._finalizer = weakref.finalize(
            self, _cleanup, self._cold_paths, self._files, self._jobs
        )

    # -- state ----------------------------------------------------------------------
    def _reset_state(self) -> None:
        c = self.n_chunks
        # cold files of this state: a fresh name prefix, never reused
        self._prefix = os.path.join(self.cold_dir, secrets.token_hex(4) + "-")
        self._tier = np.full(c, EMPTY, dtype=np.int8)
        self._slot = np.full(c, -1, dtype=np.int64)
        self._mass = np.zeros(c, dtype=np.float64)  # for placement (inf: not yet weighed)
        self._avg = np.full(c, np.nan, dtype=np.float64)  # averaged masses (nan: none yet)
        self._weighed = np.zeros(c, dtype=np.float64)  # the last masses given, for stats
        self._seq = np.zeros(c, dtype=np.int64)  # when a chunk was last opened
        self._comp = np.zeros(c, dtype=np.int64)  # compressed bytes (warm / cold)
        self._pending = np.zeros(c, dtype=np.bool_)  # a promotion in flight
        self._packing = np.zeros(c, dtype=np.bool_)  # a background pack in flight
        self._sealed = False  # the open chunk is full and was handed to the packer
        self._comp_est = self.chunk_bytes  # compressed size of the last chunk packed
        self._slot_owner = np.full(self.n_hot_slots, -1, dtype=np.int64)  # -2: reserved
        self._warm = _WarmPieces(
            c * self.blocks_per_chunk, self.blocks_per_chunk, track=self._warm_gather is not None
        )
        self._cold: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._open = -1
        self._old: tuple[int, Any, str] | None = None  # the open chunk's rows not yet rewritten
        self._fill = 0  # rows of the open chunk written since it was opened (from row 0)
        self._opened = 0
        self._gathers_since = 0
        self._counts = {
            "rows_hot": 0, "rows_warm": 0, "rows_cold": 0, "decompressions": 0,
            "disk_bytes_read": 0, "disk_bytes_written": 0, "promotions": 0, "demotions": 0,
            "rebalances": 0, "packs": 0, "inline_packs": 0, "prefetch_failures": 0,
            "rebalance_errors": 0, "spill_errors": 0,
        }  # fmt: skip

    def _path(self, c: int) -> str:
        return f"{self._prefix}{c:07d}.fpc"

    # -- protocol: writing ------------------------------------------------------------------
    def prepare(self, transition: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
        """Validate and cast one transition or a batch; writes nothing. O(B)."""
        return coerce_batch(self.fields, transition, self.capacity)

    def write(self, start: int, prepared: Mapping[str, np.ndarray], k: int) -> None:
        """Write ``k`` prepared rows from slot ``start`` on (wrapping). O(k) amortised.

        Entering a chunk makes it hot (the open chunk) and may demote another
        (one chunk compressed per ``chunk_size`` rows written). A chunk that
        held rows is not decoded: its rows not yet overwritten are served from
        where they were until the ring has passed them. Writes out of ring
        order (never made by a buffer) may have to decode them, the one way
        this can fail (:class:`TierDataError`).
        """
        self._install(wait=False)
        cs, cap = self.chunk_size, self.capacity
        done = 0
        while done < k:
            slot0 = (start + done) % cap
            c = slot0 >> self._shift
            lo = slot0 - (c << self._shift)
            end = min((c + 1) * cs, cap) - c * cs
            m = min(k - done, end - lo)
            if c != self._open:
                self._open_chunk(c)
            elif self._sealed:  # rewritten without being reopened (a one-chunk ring)
                self._unseal(c)
            if lo > self._fill:  # a gap: the old rows below `lo` must be decoded first
                self._merge_old()
            base = int(self._slot[c]) * cs + lo
            for name, pool in self._pool.items():
                pool[base : base + m] = prepared[name][done : done + m]
            self._fill = max(self._fill, lo + m)
            if self._old is not None and self._fill >= end:
                self._drop_old()
            if lo + m == end and self._fill >= end:
                self._seal(c)
            done += m

    def _open_chunk(self, c: int) -> None:
        """Make chunk ``c`` the open (hot, pinned) chunk."""
        if self._pending[c]:  # its promotion must land first
            self._install(wait=True)
        if self._old is not None:
            self._merge_old()
        self._open = -1
        self._sealed = False
        self._fill = self.chunk_size
        if self._tier[c] == HOT:
            if self._packing[c]:  # the packer reads the rows about to be rewritten
                self._install(wait=True)
            self._drop_packed(c)  # its kept copy goes stale
        else:
            tier = int(self._tier[c])
            old = self._source(c) if tier in (WARM, COLD) else None
            slot = self._free_slot(exclude=c)
            if old is None:
                for pool in self._pool.values():
                    pool[slot * self.chunk_size : (slot + 1) * self.chunk_size] = 0
            self._warm.pop(c, None)  # the old rows live on in `_old` (a cold file stays)
            self._cold.pop(c, None)
            self._comp[c] = 0
            self._tier[c], self._slot[c] = HOT, slot
            self._slot_owner[slot] = c
            if old is not None:
                self._old, self._fill = old, 0
        self._open = c
        self._opened += 1
        self._seq[c] = self._opened
        self._mass[c] = np.inf  # unknown until weighed: kept hot until the next rebalance
        self._avg[c] = np.nan  # new rows: the average starts again

    def _merge_old(self) -> None:
        """Decode the open chunk's old rows from ``_fill`` on into its hot slot."""
        assert self._old is not None
        rows = self._decode_source(self._old)
        base, lo = int(self._slot[self._open]) * self.chunk_size, self._fill
        for name, pool in self._pool.items():
            pool[base + lo : base + self.chunk_size] = rows[name][lo:]
        self._fill = self.chunk_size
        self._drop_old()

    def _drop_old(self) -> None:
        assert self._old is not None
        tier, _, path = self._old
        self._old = None
        if tier == COLD:
            self._remove_file(path)

    def _remove_file(self, path: str) -> None:
        self._files.forget(path)
        remove_files([path])
        if path in self._cold_paths:
            self._cold_paths.remove(path)

    def _seal(self, c: int) -> None:
        """The open chunk ``c`` is full: it may be packed from now on."""
        self._sealed = True
        if self.pack_ahead is None:
            self._pack_in_background(c)
        else:
            self._pack_ahead()

    def _pack_ahead(self) -> None:
        """Pack the full hot chunks of least mass (the next to be demoted: the
        order of :meth:`_free_slot`) in the background: ``pack_ahead`` of them,
        less the free hot slots. O(C log C)."""
        if not self.prefetch or not self.pack_ahead:
            return
        # free hot slots are taken before anything is demoted: no copy needed for them
        need = self.pack_ahead - int(np.count_nonzero(self._slot_owner == -1))
        if need <= 0:
            return
        hot = np.flatnonzero((self._tier == HOT) & ~self._pending)
        if self._open >= 0 and not self._sealed:
            hot = hot[hot != self._open]
        order = hot[np.lexsort((self._seq[hot], self._mass[hot]))[:need]]
        for c in order.tolist():
            self._pack_in_background(c)

    def _pack_in_background(self, c: int) -> None:
        """Compress hot chunk ``c`` in the background (its copy kept, as after a
        promotion), unless it has a copy or one is on the way."""
        if not self.prefetch or c in self._warm or c in self._cold or self._packing[c]:
            return
        base = int(self._slot[c]) * self.chunk_size
        source = [p[base : base + self.chunk_size] for p in self._pool.values()]
        # a copy that would overflow warm_bytes goes to its cold file instead
        to_disk = self._warm_used() + self._comp_est > self.warm_bytes
        self._packing[c] = True
        self._submit(("pack", c, int(self._seq[c]), source, self._path(c) if to_disk else ""))

    def _unseal(self, c: int) -> None:
        if self._packing[c]:
            self._install(wait=True)
        self._drop_packed(c)
        self._sealed = False

    def _free_slot(self, exclude: int) -> int:
        free = np.flatnonzero(self._slot_owner == -1)
        if free.size:
            return int(free[0])
        hot = np.flatnonzero((self._tier == HOT) & ~self._pending)
        hot = hot[hot != exclude]
        if not hot.size:
            raise RuntimeError("no hot slot to free")  # unreachable: n_hot_slots >= 1
        # least mass first; among equal (unweighed: inf) masses the oldest
        order = hot[np.lexsort((self._seq[hot], self._mass[hot]))]
        victim = int(order[0])
        if self.prefetch:  # among the next in line, one already packed costs nothing
            near = order[: max(1, self.pack_ahead or 0)]
            # ... if it is about as light (within the hysteresis factor)
            near = near[self._mass[near] <= self.hysteresis * self._mass[victim]].tolist()
            copied = [c for c in near if c in self._warm or c in self._cold]
            idle = [c for c in near if not self._packing[c]]
            victim = (copied or idle or near)[0]
        slot = int(self._slot[victim])
        self._demote(victim)
        return slot

    # -- moves ----------------------------------------------------------------------------
    def _pack(self, c: int) -> list[bytes]:
        """Compress hot chunk ``c``: one piece per block, its fields' rows one after another."""
        base = int(self._slot[c]) * self.chunk_size
        return self._blocks.pack([p[base : base + self.chunk_size] for p in self._pool.values()])

    def _demote(self, c: int) -> None:
        """Hot chunk ``c`` to warm (then warm overflow to cold), or back to its cold file.

        A chunk not written since it was packed still has its packed copy
        (kept at promotion): the demotion then costs nothing. Frees its slot.
        """
        if self._packing[c]:  # its packed copy is on the way
            self._install(wait=True)
        if c not in self._cold and c not in self._warm:
            self._warm[c] = pieces = self._pack(c)  # before the slot is let go
            self._counts["inline_packs"] += 1
            self._comp[c] = sum(len(p) for p in pieces)
        self._slot_owner[self._slot[c]] = -1
        self._slot[c] = -1
        if c == self._open:
            self._open = -1
            self._sealed = False
        self._counts["demotions"] += 1
        if c in self._cold:
            self._tier[c] = COLD
            return
        self._tier[c] = WARM
        self._spill()

    def _warm_used(self) -> int:
        """RAM held by compressed chunks: warm ones and the copies kept for hot ones. O(1)."""
        return self._warm.nbytes

    def _spill(self) -> None:
        """While compressed RAM exceeds ``warm_bytes``: drop the kept copies of hot
        chunks (least mass first: a copy only saves a demotion's compression), then
        least-mass warm chunks to disk. O(C log C)."""
        # the copies of promotions in flight become kept copies (and give way) when installed
        moving = int(self._comp[self._pending & (self._tier == WARM)].sum())
        excess = self._warm_used() - moving - self.warm_bytes
        if excess <= 0:
            return
        kept = np.fromiter((c for c in self._warm if self._tier[c] == HOT), dtype=np.int64)
        for c in kept[np.lexsort((self._seq[kept], self._mass[kept]))].tolist():
            excess -= int(self._comp[c])
            del self._warm[c]
            self._comp[c] = 0
            if excess <= 0:
                return
        warm = np.flatnonzero((self._tier == WARM) & ~self._pending)
        order = warm[np.lexsort((self._seq[warm], self._mass[warm]))]
        n = int(np.searchsorted(np.cumsum(self._comp[order]), excess)) + 1
        try:
            for c in order[:n].tolist():
                self._to_cold(c)
        except OSError as exc:  # e.g. a full disk: stay in RAM (over budget), say so once
            self._counts["spill_errors"] += 1
            if self._counts["spill_errors"] == 1:
                warnings.warn(
                    f"fastper.tiers: cannot write cold chunks to {self.cold_dir!r} ({exc}); "
                    "keeping them warm, over warm_bytes",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _to_cold(self, c: int) -> None:
        pieces = self._warm[c]
        path = self._path(c)
        self._files.forget(path)
        offsets, crcs = write_chunk_file(path, pieces)  # raises before anything changes
        self._cold_paths.append(path)
        del self._warm[c]
        self._cold[c] = (offsets, crcs)
        self._tier[c] = COLD
        self._counts["disk_bytes_written"] += int(offsets[-1])

    def _drop_packed(self, c: int) -> None:
        self._warm.pop(c, None)
        if self._cold.pop(c, None) is not None:
            self._remove_file(self._path(c))
        self._comp[c] = 0

    def _source(self, c: int) -> tuple[int, Any, str]:
        """(tier, warm pieces or cold index, file) of the packed rows of chunk ``c``."""
        if c == self._open and self._old is not None:
            return self._old
        tier = int(self._tier[c])
        if tier == WARM:
            return tier, self._warm[c], ""
        return tier, self._cold[c], self._path(c)

    def _pieces(self, src: tuple[int, Any, str], which: np.ndarray | list[int]) -> list[bytes]:
        """The packed blocks ``which`` of a chunk (read from its file when cold)."""
        tier, packed, path = src
        which = which.tolist() if isinstance(which, np.ndarray) else which
        if tier == WARM:
            return [packed[j] for j in which]
        out = self._files.read(path, packed[0], packed[1], which)
        self._counts["disk_bytes_read"] += sum(len(p) for p in out)
        return out

    def _decode(self, pieces: list[bytes], where: str, count: bool = True) -> dict[str, np.ndarray]:
        """Decode blocks: ``{field: (len(pieces), rows_per_block, *shape)}``. O(bytes)."""
        if count:  # not from the background thread: install counts its work
            self._counts["decompressions"] += len(pieces)
        return self._blocks.decode(pieces, where)

    @staticmethod
    def _where(src: tuple[int, Any, str]) -> str:
        return f"cold chunk file {src[2]!r}" if src[0] == COLD else "a warm chunk"

    def _decode_source(self, src: tuple[int, Any, str]) -> dict[str, np.ndarray]:
        """Every row of a packed chunk: ``{field: (chunk_size, *shape)}``."""
        rows = self._decode(self._pieces(src, np.arange(self.blocks_per_chunk)), self._where(src))
        return {name: r.reshape(self.chunk_size, *r.shape[2:]) for name, r in rows.items()}

    # -- protocol: reading ------------------------------------------------------------------
    def gather(self, indices: Any) -> dict[str, np.ndarray]:
        """Copies of the rows at ``indices`` for every field. O(B) plus one block per cold/warm block hit.

        Raises:
            TierDataError: a cold chunk file is missing, truncated or corrupted.
        """
        self._install(wait=False)
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        self._gathers_since += 1
        n = idx.shape[0]
        rows = np.empty(n, dtype=np.int64)
        hot = np.empty(n, dtype=np.bool_)
        shadowed = self._open if self._old is not None else -1  # rows not yet rewritten
        n_hot = hot_rows(idx, self._tier, self._slot, self._shift, shadowed, self._fill, rows, hot)
        # one take over the whole batch (as the RAM storage): the few rows from
        # warm / cold chunks are then written over their placeholders
        out = {name: pool.take(rows, axis=0) for name, pool in self._pool.items()}
        self._counts["rows_hot"] += n_hot
        if n_hot == n:
            return out
        rpb, bpc = self.rows_per_block, self.blocks_per_chunk
        dst = [(out[name].reshape(n, -1).view(np.uint8), a, w) for name, a, w in self._blocks.cuts]
        if self._warm_gather is not None:  # warm rows: one compiled call, C decoder
            blocks, got, bad = self._warm_gather(
                idx, hot, self._tier, shadowed, rpb, self._shift, self._warm.addr,
                self._warm.size, self._blocks.nbytes, self._blocks.starts, self._blocks.widths,
                tuple(d for d, _, _ in dst),
            )  # fmt: skip
            if bad >= 0:
                g = int(idx[bad]) // rpb
                self._blocks.refuse(self._warm[g // bpc][g % bpc], self._where((WARM, None, "")))
            self._counts["decompressions"] += blocks
            self._counts["rows_warm"] += got
            n_hot += got
            if n_hot == n:
                return out
        # the other rows (cold; warm without a C decoder), one at a time (numpy's
        # per-call cost would dominate): each block decoded once, each row copied
        # straight from it into `out`
        sel = np.flatnonzero(~hot)
        dec, nbytes = self.codec.decompress, self._blocks.nbytes
        raws: dict[int, Any] = {}
        sources: dict[int, tuple[int, Any, str]] = {}
        cold = 0
        for pos, slot in zip(sel.tolist(), idx[sel].tolist(), strict=True):
            g, r = divmod(slot, rpb)  # block g of the ring, row r in it
            c = g // bpc
            src = sources.get(c)
            if src is None:
                src = sources[c] = self._source(c)
            cold += src[0] == COLD
            raw = raws.get(g)
            if raw is None:
                piece = src[1][g % bpc] if src[0] == WARM else self._pieces(src, [g % bpc])[0]
                try:
                    data = dec(piece, nbytes)
                except Exception:  # the codecs raise their own error types
                    data = b""
                if len(data) != nbytes:  # says what is wrong, naming the chunk
                    self._blocks.refuse(piece, self._where(src))
                raw = raws[g] = np.frombuffer(data, dtype=np.uint8)
            for d, a, w in dst:
                d[pos] = raw[a + r * w : a + (r + 1) * w]
        self._counts["decompressions"] += len(raws)
        self._counts["rows_cold"] += cold
        self._counts["rows_warm"] += n - n_hot - cold
        return out

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """A copy of rows ``lo .. hi-1`` of field ``name`` (decompressing as needed). O(hi - lo)."""
        self._install(wait=True)
        f = self.fields[name]
        out = np.empty((hi - lo, *f.shape), dtype=f.dtype)
        cs = self.chunk_size
        for c in range(lo >> self._shift, -(-hi // cs)):
            a, b = max(lo, c * cs), min(hi, (c + 1) * cs)
            if self._tier[c] == HOT:
                base = int(self._slot[c]) * cs - c * cs
                out[a - lo : b - lo] = self._pool[name][base + a : base + b]
                if c == self._open and self._old is not None and b > c * cs + self._fill:
                    s = max(a, c * cs + self._fill)  # rows the ring has not reached yet
                    rows = self._decode_source(self._old)[name]
                    out[s - lo : b - lo] = rows[s - c * cs : b - c * cs]
            elif self._tier[c] == EMPTY:
                out[a - lo : b - lo] = 0
            else:
                rows = self._decode_source(self._source(c))[name]
                out[a - lo : b - lo] = rows[a - c * cs : b - c * cs]
        return out

    # -- placement ----------------------------------------------------------------------------
    @property
    def mass_chunk_size(self) -> int:
        """The chunk size a buffer passes to ``sampler.chunk_masses`` for :meth:`rebalance`."""
        return self.chunk_size

    @property
    def wants_masses(self) -> bool:
        """True once ``rebalance_every`` gathers passed since the last rebalance. O(1).

        The buffer calls, after a sample (see :class:`fastper.storage.PlacedByMass`),
        ``rebalance(sampler.chunk_masses(mass_chunk_size, len(buffer)))``.
        """
        return self._gathers_since >= self.rebalance_every

    def rebalance(self, masses: Any) -> None:
        """Place chunks by their sampling mass, with hysteresis. O(C log C), C chunks.

        Best effort: never raises for a disk error (the chunk stays warm;
        counted in ``stats()["rebalance_errors"]``). Promotions are decoded
        in the background with ``prefetch=True``.

        Args:
            masses: the mass under each chunk (length ``n_chunks``), e.g.
                ``sampler.chunk_masses(chunk_size, n)``.

        Raises:
            ValueError: ``masses`` of the wrong length, negative or not finite.
        """
        m = np.asarray(masses, dtype=np.float64)
        if m.shape != (self.n_chunks,) or not (np.isfinite(m).all() and (m >= 0).all()):
            raise ValueError(
                f"`masses` must be {self.n_chunks} finite values >= 0 (one per chunk), "
                f"got masses={show(m)}"
            )
        self._install(wait=False)  # chunks still in flight are left where they are
        self._gathers_since = 0
        self._counts["rebalances"] += 1
        avg = self._avg
        fresh = np.isnan(avg)
        avg[fresh] = m[fresh]
        avg[~fresh] += self.smoothing * (m[~fresh] - avg[~fresh])
        self._mass[:] = avg
        self._weighed = m.copy()
        if self._open >= 0:
            self._mass[self._open] = np.inf  # pinned: being written
        try:
            self._place_hot()
            self._place_warm()
        except OSError:
            self._counts["rebalance_errors"] += 1
        self._pack_ahead()

    def _left(self, used: int) -> int:
        return 1 << 62 if self.max_moves is None else self.max_moves - used

    def _swaps(self, cand: np.ndarray, held: np.ndarray, limit: int) -> int:
        """How many of ``cand`` (heaviest first) displace ``held`` (lightest first)."""
        k = min(cand.shape[0], held.shape[0], limit)
        wins = self._mass[cand[:k]] > self.hysteresis * self._mass[held[:k]]
        return int(np.argmin(wins)) if not wins.all() else k

    def _place_hot(self) -> None:
        """Promote the heaviest warm / cold chunks into free hot slots, then swap
        while a candidate outweighs the lightest hot chunk by ``hysteresis``.

        With ``prefetch``, only hot chunks with a packed copy are swapped out
        (a demotion then compresses nothing on the sampling path); those that
        would have been swapped but have none are packed in the background,
        ready for the next rebalance.
        """
        held = np.flatnonzero(self._tier == HOT)
        held = held[held != self._open]
        held = held[np.argsort(self._mass[held], kind="stable")]
        cand = np.flatnonzero(((self._tier == WARM) | (self._tier == COLD)) & ~self._pending)
        cand = cand[np.argsort(-self._mass[cand], kind="stable")]
        cand = cand[self._mass[cand] > 0]
        free = int(np.count_nonzero(self._slot_owner == -1))
        fill = min(free, cand.shape[0], self._left(0))
        if self.prefetch:
            copied = np.array([c in self._warm or c in self._cold for c in held.tolist()], bool)
            wanted = held[: self._swaps(cand[fill:], held, self._left(fill))]
            for c in wanted[~copied[: wanted.shape[0]]].tolist():
                self._pack_in_background(c)  # no-op while its pack is in flight
            held = held[copied]
        n_swap = self._swaps(cand[fill:], held, self._left(fill))
        for c in held[:n_swap].tolist():
            self._demote(c)
        for c in cand[: fill + n_swap].tolist():
            self._promote(c)

    def _place_warm(self) -> None:
        warm = np.flatnonzero((self._tier == WARM) & ~self._pending)
        warm = warm[np.argsort(self._mass[warm], kind="stable")]
        cold = np.flatnonzero((self._tier == COLD) & ~self._pending)
        cold = cold[np.argsort(-self._mass[cold], kind="stable")]
        # kept copies of hot chunks (and of promotions in flight) give way to warm chunks
        room = self.warm_bytes - int(self._comp[warm].sum())
        n_fill = int(np.searchsorted(np.cumsum(self._comp[cold]), room, side="right"))
        if self.max_moves is not None:
            n_fill = min(n_fill, self.max_moves)
        n_swap = self._swaps(cold[n_fill:], warm, self._left(n_fill))
        for c in cold[: n_fill + n_swap].tolist():
            self._to_warm(c)
        self._spill()

    def _to_warm(self, c: int) -> None:
        pieces = self._pieces(self._source(c), np.arange(self.blocks_per_chunk))
        self._drop_packed(c)
        self._warm[c] = pieces
        self._comp[c] = sum(len(p) for p in pieces)
        self._tier[c] = WARM

    def _promote(self, c: int) -> None:
        """Warm / cold chunk ``c`` into a free hot slot: in the background with ``prefetch``."""
        free = np.flatnonzero(self._slot_owner == -1)
        if not free.size:
            return
        slot = int(free[0])
        self._slot_owner[slot] = -2  # reserved until installed
        base = slot * self.chunk_size
        target = {name: p[base : base + self.chunk_size] for name, p in self._pool.items()}
        tier = int(self._tier[c])
        source = self._warm[c] if tier == WARM else self._cold[c]
        self._pending[c] = True
        path = self._path(c) if tier == COLD else ""
        self._submit(("promote", c, slot, path, source, target))

    def _submit(self, job: tuple[Any, ...]) -> None:
        """Run ``job`` in the background thread (inline without ``prefetch``)."""
        self._inflight += 1
        if self.prefetch:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_worker, args=(weakref.ref(self), self._jobs, self._done),
                    name="fastper-tiers-prefetch", daemon=True,
                )  # fmt: skip
                self._thread.start()
            self._jobs.put(job)
        else:
            self._done.put(run_job(self._blocks, job))
            self._install(wait=False)

    def _install_pack(self, c: int, gen: int, result: Any, err: BaseException | None) -> None:
        self._packing[c] = False
        if err is not None:
            if isinstance(err, OSError):  # its cold file could not be written: no copy kept
                self._counts["spill_errors"] += 1
                return
            raise err  # a codec failing to compress is a bug: surface it
        pieces, path, index = result
        if self._seq[c] != gen or self._tier[c] != HOT or c in self._warm or c in self._cold:
            if path:  # rewritten (or given a copy) meanwhile: this one is stale
                remove_files([path])
            return
        size = sum(len(p) for p in pieces)
        self._comp[c], self._comp_est = size, size
        self._counts["packs"] += 1
        if path:
            self._cold[c] = index
            self._cold_paths.append(path)
            self._counts["disk_bytes_written"] += int(index[0][-1])
        else:
            self._warm[c] = pieces
            self._spill()

    def _install(self, wait: bool) -> None:
        """Apply finished jobs (all of them, waiting, with ``wait``). O(jobs)."""
        if not wait and (not self._inflight or self._done.empty()):
            return  # the common case, kept cheap: every gather and write asks
        while self._inflight:
            try:
                kind, c, slot, result, err = self._done.get(block=wait)
            except queue.Empty:
                return
            self._inflight -= 1
            if kind == "pack":
                self._install_pack(c, slot, result, err)
                continue
            self._pending[c] = False
            if err is not None:
                self._slot_owner[slot] = -1
                self._counts["prefetch_failures"] += 1
                continue
            if self._tier[c] == COLD:
                self._counts["disk_bytes_read"] += int(self._cold[c][0][-1])
            # the packed copy stays (a file, or bytes counted in warm_bytes): a
            # demotion before the ring rewrites the chunk costs nothing
            self._tier[c], self._slot[c] = HOT, slot
            self._slot_owner[slot] = c
            self._counts["promotions"] += 1
            self._counts["decompressions"] += self.blocks_per_chunk
            if self._warm_used() > self.warm_bytes:  # its kept copy gives way to warm chunks
                self._spill()

    def settle(self) -> None:
        """Wait for the promotions in flight and install them. O(moves in flight)."""
        self._install(wait=True)

    # -- protocol: the rest ------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every row and remove the cold files."""
        self._install(wait=True)
        self._files.close_all()
        remove_files(self._cold_paths)
        self._cold_paths.clear()
        self._reset_state()

    def nbytes(self) -> int:
        """Bytes of RAM held: the hot pool plus the compressed chunks in RAM. O(C)."""
        return int(sum(p.nbytes for p in self._pool.values())) + self._warm_used()

    def close(self) -> None:
        """Stop the prefetch thread and remove this storage's cold files."""
        self._install(wait=True)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._finalizer()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    def state_dict(self, n: int) -> dict[str, Any]:
        """Rows ``0 .. n-1`` of every column, decompressed: O(N) time and memory.

        ``buffer.save`` does not call it: it streams rows through :meth:`read`.
        """
        return {f"columns/{name}": self.read(name, 0, n) for name in self.fields}

    def state_targets(self, n: int) -> dict[str, np.ndarray]:
        """None: rows are not held in arrays a loader could read into."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], n: int) -> None:
        """Check ``state``'s columns, then take rows ``0 .. n-1`` (placed as written). O(N).

        Raises:
            ValueError: the columns do not match the fields or ``n``.
        """
        check_columns(self.fields, state, n)
        self._install(wait=True)
        self._files.close_all()
        old_paths = list(self._cold_paths)
        self._cold_paths.clear()
        self._reset_state()
        cs = self.chunk_size
        # whole chunks into a fresh state: nothing to decode, so nothing can fail
        for lo in range(0, n, cs):
            hi = min(n, lo + cs)
            rows = {name: state[f"columns/{name}"][lo:hi] for name in self.fields}
            self.write(lo, rows, hi - lo)
        remove_files(old_paths)

    # -- sizing ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What sizing needs: hit rates per tier, predicted mass per tier, bytes, counts. O(C).

        ``hit_rate``: fraction of gathered rows served from each tier;
        ``mass_fraction``: the share of the masses given to the last
        :meth:`rebalance` in each tier, by where the chunks are now (what the
        tree predicts the hit rates to be); ``bytes``: RAM of the hot pool in
        use (uncompressed), RAM of compressed chunks (``warm``: warm chunks
        and the packed copies kept for hot ones, all within ``warm_bytes``)
        and bytes of cold files on disk (``cold``, including files kept for
        hot chunks); ``chunks``: chunks per tier. The rest are counters, among
        them ``packs`` (chunks compressed in the background, ahead of a
        demotion) and ``inline_packs`` (demotions that compressed the chunk
        on the spot: every demotion without ``prefetch``; with it, raise
        ``pack_ahead`` if they are many).
        """
        self._install(wait=False)
        counts = dict(self._counts)
        rows = np.array([counts["rows_hot"], counts["rows_warm"], counts["rows_cold"]], float)
        total = rows.sum()
        w = self._weighed
        per_tier = np.array([w[self._tier == t].sum() for t in (HOT, WARM, COLD)])
        chunks = {n: int(np.count_nonzero(self._tier == t)) for t, n in enumerate(TIER_NAMES)}
        return {
            "hit_rate": {
                n: float(rows[t] / total) if total else 0.0 for t, n in enumerate(TIER_NAMES)
            },
            "mass_fraction": {
                n: float(per_tier[t] / per_tier.sum()) if per_tier.sum() > 0 else 0.0
                for t, n in enumerate(TIER_NAMES)
            },
            "bytes": {
                "hot": chunks["hot"] * self.chunk_bytes,
                "warm": self._warm_used(),
                "cold": int(sum(int(o[-1]) for o in (v[0] for v in self._cold.values()))),
            },
            "chunks": chunks,
            "codec": self.codec.name,
            **counts,
        }


def _worker(
    owner: weakref.ref[TieredStorage], jobs: queue.SimpleQueue[Any], done: queue.SimpleQueue[Any]
) -> None:
    """The prefetch thread: decode promotions; the storage installs them."""
    while True:
        job = jobs.get()
        if job is None:
            return
        storage = owner()
        if storage is None:
            return
        result = run_job(storage._blocks, job)
        del storage
        done.put(result)
