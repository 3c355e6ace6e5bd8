"""Low-level numba intrinsics used by the kernels."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _prefetch_codegen(write: int):  # type: ignore[no-untyped-def]
    """The code of a prefetch of ``arr[idx]``'s line: for reading (0) or writing (1)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aryty, _ = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # read or write access, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(write), i32(3), i32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch(typingctx, arr, idx):  # pragma: no cover
    """Hint the CPU to fetch ``arr[idx]``'s cache line (no effect on results).

    Batched searches know the next level's address one whole pass before they
    read it; prefetching it then overlaps the cache misses of many items.
    """
    return types.void(arr, idx), _prefetch_codegen(0)


@intrinsic
def prefetch_w(typingctx, arr, idx):  # pragma: no cover
    """Hint the CPU to fetch ``arr[idx]``'s cache line for writing (no effect on results):
    the line arrives ready to be modified."""
    return types.void(arr, idx), _prefetch_codegen(1)
