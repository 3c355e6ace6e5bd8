"""Bit and vector operations for the rank tree's nodes (numba only).

A leaf of the rank tree keeps one 64-bit word of live marks, bit ``j`` for
key position ``j`` (:mod:`fastper._kernels.rank_tree`). Its kernels count,
find and select set bits: these are LLVM's own bit-counting intrinsics
(``ctpop``, ``cttz``, ``ctlz``: one instruction each on current x86 and ARM
processors) and a logical shift, on int64 values (bit 63 is the sign bit:
an arithmetic shift would smear it). Signed overflow is never relied on
(numba lets LLVM assume it does not happen).

A search inside a node compares the key with all of the node's keys at once:
one vector load and compare whose result is a bit mask (:func:`gt16` ..), and
the child holding a rank is found by a vector prefix sum of the counts
(:func:`child_at16` ..). numba does not vectorise these loops by itself, and
a binary search waits on each step's load in turn (a 16-child node, in a
tight loop: 28 ns by binary search, 15 counting in a loop; the vector
compare is a handful of instructions).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._jit import njit

_I64 = ir.IntType(64)


def _unary(name: str, flag: bool | None) -> object:
    """An int64 -> int64 intrinsic calling ``llvm.<name>.i64`` (``flag``: its i1 argument)."""

    def typer(typingctx, x):  # type: ignore[no-untyped-def]
        sig = types.int64(types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            val = context.cast(builder, args[0], signature.args[0], types.int64)
            if flag is None:
                fnty = ir.FunctionType(_I64, [_I64])
                call_args = [val]
            else:
                fnty = ir.FunctionType(_I64, [_I64, ir.IntType(1)])
                call_args = [val, ir.Constant(ir.IntType(1), int(flag))]
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.{name}.i64")
            return builder.call(fn, call_args)

        return sig, codegen

    typer.__name__ = name
    return intrinsic(typer)


#: number of set bits of an int64
popcount = _unary("ctpop", None)
#: trailing zero bits of an int64 (64 for 0)
ctz = _unary("cttz", False)
#: leading zero bits of an int64 (64 for 0)
clz = _unary("ctlz", False)


@intrinsic
def lshr(typingctx, x, k):  # pragma: no cover - compiled
    """``x >> k`` shifting in zeros (``0 <= k < 64``; numba's ``>>`` on int64 copies the sign)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        b = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.lshr(a, b)

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def low_bits(k):  # pragma: no cover - compiled
    """The word with bits ``0 .. k-1`` set, for ``0 <= k <= 64``.

    (Not ``(1 << k) - 1``: for ``k = 63`` that subtraction overflows, which
    compiled code may not do.)
    """
    if k <= 0:
        return 0
    return lshr(-1, 64 - k)


@njit(cache=True, nogil=True, inline="always")
def select_bit(x, r):  # pragma: no cover - compiled
    """Position of the ``r``-th (0-based) set bit of ``x``; ``r < popcount(x)``.

    Six halvings, each keeping the half that holds the bit: counts and
    shifts chosen without branches (which half is a coin flip).
    """
    pos = 0
    width = 32
    while width > 0:
        low = popcount(x & ((1 << width) - 1))
        up = 1 if r >= low else 0
        r -= low * up
        x = lshr(x, width * up)
        pos += width * up
        width >>= 1
    return pos


# ---------------------------------------------------------------------------
# whole-node compares: one vector compare over a node's keys, as a bit mask
# ---------------------------------------------------------------------------


def _contiguous(arr: object, dtype: object) -> bool:
    """Is ``arr`` (a numba type) a C-contiguous 1-D array of ``dtype``? The vector
    loads below read memory as that, with no index check."""
    return (
        isinstance(arr, types.Array) and arr.dtype == dtype and arr.ndim == 1
        and arr.layout == "C"
    )  # fmt: skip


def _node_mask(n: int, pred: str, floating: bool) -> object:
    """An intrinsic ``f(arr, base, x)``: bit ``j`` set where ``arr[base + j] <pred> x``,
    for ``j < n``, as an int64 (one vector load and compare: numba does not
    vectorise the loop). ``arr`` is float64 (``floating``) or int32."""

    def typer(typingctx, arr, base, x):  # type: ignore[no-untyped-def]
        if not _contiguous(arr, types.float64 if floating else types.int32):
            return None  # a typing error: the load below reads this element type only
        xty = types.float64 if floating else types.int64
        sig = types.int64(arr, types.int64, xty)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            start = context.cast(builder, args[1], signature.args[1], types.int64)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [start])
            elem = ir.DoubleType() if floating else ir.IntType(32)
            vty = ir.VectorType(elem, n)
            vec = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=4)
            val = context.cast(builder, args[2], signature.args[2], xty)
            if not floating:
                val = builder.trunc(val, elem)
            undef = ir.Constant(vty, ir.Undefined)
            one = builder.insert_element(undef, val, ir.Constant(ir.IntType(32), 0))
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n)
            splat = builder.shuffle_vector(one, undef, zeros)
            if floating:
                cmp = builder.fcmp_ordered(pred, vec, splat)
            else:
                cmp = builder.icmp_signed(pred, vec, splat)
            bits = builder.bitcast(cmp, ir.IntType(n))
            return builder.zext(bits, _I64) if n < 64 else bits

        return sig, codegen

    typer.__name__ = f"mask{n}_{pred}"
    return intrinsic(typer)


#: bits of the n float64 at ``arr[base:]`` greater than / equal to ``x``, and of
#: the n int32 at ``arr[base:]`` at most ``x``, for n = 16, 32, 64
gt16, eq16, le16 = (
    _node_mask(16, ">", True),
    _node_mask(16, "==", True),
    _node_mask(16, "<=", False),
)
gt32, eq32, le32 = (
    _node_mask(32, ">", True),
    _node_mask(32, "==", True),
    _node_mask(32, "<=", False),
)
gt64, eq64, le64 = (
    _node_mask(64, ">", True),
    _node_mask(64, "==", True),
    _node_mask(64, "<=", False),
)


def _child_at(n: int) -> object:
    """An intrinsic ``f(counts, base, r) -> (j, before)`` over the ``n`` int32 counts
    at ``counts[base:]`` and a rank ``r``: ``j`` children have running counts
    at or below ``r`` (so rank ``r`` lies in child ``j``), and ``before`` is
    the running count of the first ``j``.

    The running counts are a vector prefix sum (shifted adds), compared with
    ``r`` at once: no loop, no branch on the data.
    """

    def typer(typingctx, counts, base, r):  # type: ignore[no-untyped-def]
        if not _contiguous(counts, types.int32):
            return None  # a typing error: the load below reads int32 only
        ret = types.UniTuple(types.int64, 2)
        sig = ret(counts, types.int64, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
            i32 = ir.IntType(32)
            vty = ir.VectorType(i32, n)
            lanes_ty = ir.VectorType(i32, n)
            acc = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=4)
            zero = ir.Constant(vty, [0] * n)
            k = 1
            while k < n:
                lanes = ir.Constant(lanes_ty, [i - k if i >= k else n for i in range(n)])
                acc = builder.add(acc, builder.shuffle_vector(acc, zero, lanes))
                k *= 2
            rv = builder.trunc(args[2], i32)
            undef = ir.Constant(vty, ir.Undefined)
            splat = builder.shuffle_vector(
                builder.insert_element(undef, rv, ir.Constant(i32, 0)), undef,
                ir.Constant(lanes_ty, [0] * n),
            )  # fmt: skip
            mty = ir.IntType(n)
            below = builder.bitcast(builder.icmp_signed("<=", acc, splat), mty)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(mty, [mty]), f"llvm.ctpop.i{n}"
            )
            jn = builder.call(fn, [below])
            j = builder.zext(jn, _I64) if n < 64 else jn
            # the running count before child j: lane j - 1 (0 when j = 0)
            last = builder.sub(builder.trunc(j, i32), ir.Constant(i32, 1))
            none = builder.icmp_signed("<", last, ir.Constant(i32, 0))
            val = builder.extract_element(acc, builder.select(none, ir.Constant(i32, 0), last))
            before = builder.sext(builder.select(none, ir.Constant(i32, 0), val), _I64)
            return context.make_tuple(builder, ret, [j, before])

        return sig, codegen

    typer.__name__ = f"child_at{n}"
    return intrinsic(typer)


child_at16 = _child_at(16)
child_at32 = _child_at(32)
child_at64 = _child_at(64)
