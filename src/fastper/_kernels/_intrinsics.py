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


def _x86_64() -> bool:
    """Whether numba compiles for an x86-64 CPU here (it compiles for the host)."""
    import llvmlite.binding as llvm

    return llvm.get_process_triple().split("-")[0] == "x86_64"


@intrinsic
def take_if_ge(typingctx, t, x):  # pragma: no cover
    """``x if t >= x else 0.0`` (float64) without a branch.

    Written as a conditional expression, this select compiled to a
    conditional jump on a Zen 3 (AVX2, no AVX-512; seen in the search's
    assembly): a search whose children are picked by random targets then
    mispredicts about half its steps. Here, on x86-64, the compare makes a
    mask and the mask clears ``x`` (``cmpsd`` and ``andpd``, an SSE2 pair that
    every x86-64 CPU has); on other CPUs it stays a select, which they make
    without a branch (``fcsel`` on Arm). The value is the conditional
    expression's in every case, NaN included (the compare is false: 0.0).
    """

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        tv, xv = args
        f64 = ir.DoubleType()
        if not _x86_64():
            ge = builder.fcmp_ordered(">=", tv, xv)
            return builder.select(ge, xv, ir.Constant(f64, 0.0))
        i32 = ir.IntType(32)
        i8 = ir.IntType(8)
        v2 = ir.VectorType(f64, 2)
        v2i = ir.VectorType(ir.IntType(64), 2)
        cmp = builder.module.declare_intrinsic(
            "llvm.x86.sse2.cmp.sd", fnty=ir.FunctionType(v2, [v2, v2, i8])
        )
        # (lane 1 is never read: left undefined, no instruction clears it)
        undef = ir.Constant(v2, ir.Undefined)
        vx = builder.insert_element(undef, xv, i32(0))
        vt = builder.insert_element(undef, tv, i32(0))
        mask = builder.call(cmp, [vx, vt, i8(2)])  # predicate 2: x <= t, all ones or zero
        kept = builder.and_(builder.bitcast(mask, v2i), builder.bitcast(vx, v2i))
        return builder.extract_element(builder.bitcast(kept, v2), i32(0))

    if t != types.float64 or x != types.float64:
        return None  # a typing error: the code below is for float64 only
    return types.float64(types.float64, types.float64), codegen


def _copy_word_codegen(bits: int):  # type: ignore[no-untyped-def]
    """The code of a copy of ``bits / 8`` bytes from ``src[si]`` to ``dst[di]``."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dty, _, sty, _ = signature.args
        dst = context.make_array(dty)(context, builder, args[0])
        src = context.make_array(sty)(context, builder, args[2])
        dp = cgutils.get_item_pointer(context, builder, dty, dst, [args[1]])
        sp = cgutils.get_item_pointer(context, builder, sty, src, [args[3]])
        word = ir.IntType(bits).as_pointer()
        # align 1: a field's bytes need not be aligned to the word's size
        value = builder.load(builder.bitcast(sp, word), align=1)
        builder.store(value, builder.bitcast(dp, word), align=1)
        return context.get_dummy_value()

    return codegen


def _copy_word_signature(dst, di, src, si):  # type: ignore[no-untyped-def]
    if not (
        isinstance(dst, types.Array) and isinstance(src, types.Array)
        and dst.dtype == types.uint8 and src.dtype == types.uint8
        and dst.ndim == 1 and src.ndim == 1
        and isinstance(di, types.Integer) and isinstance(si, types.Integer)
    ):  # fmt: skip
        return None  # a typing error: the code is for 1-D byte arrays only
    return types.void(dst, di, src, si)


@intrinsic
def copy8(typingctx, dst, di, src, si):  # pragma: no cover
    """``dst[di : di + 8] = src[si : si + 8]`` (uint8 arrays) as one 8-byte load and
    store, at any alignment; no bounds check (the caller's)."""
    sig = _copy_word_signature(dst, di, src, si)
    return None if sig is None else (sig, _copy_word_codegen(64))


@intrinsic
def copy4(typingctx, dst, di, src, si):  # pragma: no cover
    """As :func:`copy8`, for 4 bytes."""
    sig = _copy_word_signature(dst, di, src, si)
    return None if sig is None else (sig, _copy_word_codegen(32))


@intrinsic
def copy2(typingctx, dst, di, src, si):  # pragma: no cover
    """As :func:`copy8`, for 2 bytes."""
    sig = _copy_word_signature(dst, di, src, si)
    return None if sig is None else (sig, _copy_word_codegen(16))
