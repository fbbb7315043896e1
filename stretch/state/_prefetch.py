"""A numba intrinsic for LLVM's prefetch (private).

The fused state kernels are bound by memory latency: each row's key index slot, key and record
sit at random addresses. Hashing a chunk of rows first and prefetching their slots lets the CPU
wait for many cache misses at once instead of one after another.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, array, index):
    """Hint that ``array[index]`` will be read and written soon (no effect on results)."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ary = context.make_array(arrty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]], wraparound=False)
        i8p = ir.PointerType(ir.IntType(8))
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        # rw=1 (write), locality=3 (keep in all cache levels), cache type=1 (data)
        builder.call(
            fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        )
        return context.get_dummy_value()

    return sig, codegen
