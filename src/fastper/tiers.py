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
are decoded in Python. ``FASTPER_LZ4_KERNELS=0`` turns the kernels off (lz4
through its Python package; ``prefetch`` then defaults to off): a warm
gather then takes about 2.5x as long (``benchmarks/results/tiers.md``).

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

This module holds :class:`TieredStorage` (its settings, clearing, closing,
its state and :meth:`~TieredStorage.stats`); its parts are each in a module
of their own, one on top of the other:

* :mod:`fastper.tier_warm`: the warm pool (compressed blocks in RAM, their
  addresses for the compiled gather);
* :mod:`fastper.tier_chunks`: the chunk table (each chunk's tier, slot, mass)
  and the packed copies (read back, dropped, spilled to cold files);
* :mod:`fastper.tier_prefetch`: the background thread's jobs (promotions
  decoded, chunks packed ahead) and their installation;
* :mod:`fastper.tier_placement`: placement by mass (rebalance, promotions,
  demotions, the hot slot the ring takes);
* :mod:`fastper.tier_rows`: the rows (``write``, ``gather``, ``read``);
* :mod:`fastper.tier_codecs`: codecs, block layout and cold chunk files.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._validation import check_int, check_real, show
from .storage import Field, FieldLike, check_columns, make_fields
from .tier_chunks import COLD, HOT, TIER_NAMES, WARM
from .tier_chunks import EMPTY as EMPTY  # re-exported with the other tiers' codes
from .tier_codecs import (
    BlockLayout,
    Codec,
    OpenFiles,
    TierDataError,
    available_codecs,
    make_codec,
    remove_files,
)
from .tier_rows import TierRowsMixin

__all__ = ["Codec", "TierDataError", "TieredStorage", "available_codecs", "make_codec"]


def _cleanup(paths: list[str], files: OpenFiles, jobs: queue.SimpleQueue[Any]) -> None:
    """A storage's finalizer: stop its background thread, close and remove its cold files."""
    jobs.put(None)
    files.close_all()
    remove_files(paths)



# -- the storage ------------------------------------------------------------------------
class TieredStorage(TierRowsMixin):
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
