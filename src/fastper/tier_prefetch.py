"""The background work of :class:`fastper.tiers.TieredStorage`: promotions decoded and
chunks packed off the sampling path.

:class:`PrefetchMixin` hands jobs (:func:`fastper.tier_codecs.run_job`: decode a
chunk into a reserved hot slot, compress a full hot chunk) to one background
thread with ``prefetch=True``, or runs them inline without it, and installs
their results on the storage's own thread (:meth:`PrefetchMixin.settle`; at
the next storage call otherwise). It also chooses the hot chunks to pack
ahead of their demotion. It is separate because it is the one part of the
storage that runs concurrently: the thread is handed jobs through the queues
here and changes no storage state; what a job did is applied here, on the
storage's thread, when it is installed.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any

import numpy as np

from .tier_chunks import COLD, HOT, ChunkTableMixin
from .tier_codecs import remove_files, run_job

__all__ = ["PrefetchMixin"]


class PrefetchMixin(ChunkTableMixin):
    """Jobs run in the background thread (or inline) and installed (see the module)."""

    _jobs: queue.SimpleQueue[Any]
    _done: queue.SimpleQueue[Any]
    _thread: threading.Thread | None
    _inflight: int

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


def _worker(
    owner: weakref.ref[PrefetchMixin], jobs: queue.SimpleQueue[Any], done: queue.SimpleQueue[Any]
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
