"""LZ4 blocks made and read in compiled code, for :mod:`fastper.tiers` (numba only).

Imported only when a :class:`fastper.tiers.TieredStorage` uses the lz4 codec
(extra ``fastper[tiers]``): LZ4's own C functions, ``LZ4_decompress_safe``
and ``LZ4_compress_default``, taken from the ``lz4`` package's extension
module (the library behind the codec's Python calls, so both paths read each
other's blocks), are registered with LLVM under names of ours and called
from the kernels below. The decoder never reads past the block's size nor
writes past the destination's capacity, and returns a negative number for a
malformed block. Importing this module raises ImportError where the package
or the symbols are missing (the storage then works in Python).
"""

from __future__ import annotations

import ctypes

import lz4.block._block as _ext
import numpy as np
from llvmlite import binding
from numba import types

from ._jit import njit

_SIG = types.int32(types.intp, types.intp, types.int32, types.int32)
try:
    _lib = ctypes.CDLL(_ext.__file__)
    for _name in ("LZ4_decompress_safe", "LZ4_compress_default"):
        _address = ctypes.cast(getattr(_lib, _name), ctypes.c_void_p).value
        binding.add_symbol(f"fastper_{_name}", _address)
except (AttributeError, OSError) as exc:
    raise ImportError(f"LZ4's C functions are not reachable in {_ext.__file__} ({exc})") from None
# (src, dst, src_size, dst_capacity) -> bytes written, or < 0 for a malformed block
_decompress = types.ExternalFunction("fastper_LZ4_decompress_safe", _SIG)
# (src, dst, src_size, dst_capacity) -> bytes written, or 0 if they do not fit
_compress = types.ExternalFunction("fastper_LZ4_compress_default", _SIG)

WARM = 1


@njit(cache=True, nogil=True, boundscheck=False)
def warm_rows(
    idx, done, tier, open_chunk, rpb, shift, addr, size, nbytes, starts, widths, outs
):  # pragma: no cover - compiled
    """Copy into ``outs`` the rows of ``idx`` (not ``done``) that live in warm chunks.

    Chunk ``idx >> shift``'s tier is ``tier[c]``; a warm block ``g`` (``rpb``
    rows, ``g = idx // rpb``) is ``size[g]`` compressed bytes at address
    ``addr[g]`` (0 bytes: not in memory). Each block is decoded once into a
    scratch buffer of this call (``nbytes`` raw bytes: per field ``f``, its
    ``rpb`` rows of ``widths[f]`` bytes from ``starts[f]``), then its rows are copied to
    ``outs[f][i]`` (uint8 rows) and marked ``done``. Rows of other chunks
    (cold, or ``open_chunk``'s not yet rewritten) are left. Returns (blocks
    decoded, rows copied, -1) or, for a block that does not decode, (blocks,
    rows, i) with ``i`` a row of that block. O(B log B + bytes).
    """
    n = idx.shape[0]
    sel = np.empty(n, dtype=np.int64)
    keys = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        if done[i]:
            continue
        c = idx[i] >> shift
        g = idx[i] // rpb
        if tier[c] != WARM or c == open_chunk or size[g] <= 0:
            continue
        sel[m] = i
        keys[m] = g
        m += 1
    order = np.argsort(keys[:m], kind="mergesort")
    scratch = np.empty(nbytes, dtype=np.uint8)  # per call: gathers may run in parallel
    dst = scratch.ctypes.data
    last = -1
    blocks = 0
    for t in range(m):
        i = sel[order[t]]
        g = keys[order[t]]
        if g != last:
            if _decompress(addr[g], dst, size[g], nbytes) != nbytes:
                return blocks, t, i
            last = g
            blocks += 1
        r = idx[i] - g * rpb
        for f in range(len(outs)):
            row = outs[f][i]
            w = widths[f]
            a = starts[f] + r * w
            src = scratch[a : a + w]  # a view: the loop below is then vectorised
            for k in range(w):
                row[k] = src[k]
        done[i] = True
    return blocks, m, -1


@njit(cache=True, nogil=True, boundscheck=False)
def pack_blocks(cols, rpb, starts, widths, nbytes, arena, ends):  # pragma: no cover - compiled
    """Compress a chunk's rows into LZ4 blocks of ``rpb`` rows, one after another in ``arena``.

    ``cols[f]``: the chunk's rows of field ``f`` as uint8 rows (``widths[f]``
    bytes each); a block's raw bytes are, per field, its ``rpb`` rows from
    ``starts[f]`` (``nbytes`` in all: the layout :func:`warm_rows` reads).
    Block ``j`` ends at ``arena[ends[j]]`` (it starts where block ``j-1``
    ends). ``arena`` must hold ``LZ4_compressBound(nbytes)`` bytes per block.
    Returns the bytes used, or -1 if a block did not compress. O(bytes).
    """
    n_blocks = cols[0].shape[0] // rpb
    bound = arena.shape[0] // n_blocks
    scratch = np.empty(nbytes, dtype=np.uint8)
    used = 0
    for j in range(n_blocks):
        for f in range(len(cols)):
            w = widths[f]
            src = cols[f][j * rpb : (j + 1) * rpb].reshape(rpb * w)
            dst = scratch[starts[f] : starts[f] + rpb * w]  # views: the loop is vectorised
            for k in range(rpb * w):
                dst[k] = src[k]
        got = _compress(scratch.ctypes.data, arena.ctypes.data + used, nbytes, bound)
        if got <= 0:
            return -1
        used += got
        ends[j] = used
    return used
