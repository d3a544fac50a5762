"""What the megakernel's ring stages share (trace-time helpers over the stage region)."""

from kernels.ops.parts import stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass

PARTIALS_SLACK = 16  # one fp32 partials pair's alignment slack, bytes


def vectors(alloc, rows: int, k: int):
    """`rows` rows of k bf16 from the region allocator `alloc`, as 16-byte vectors (((8), rows * k / 8))."""
    t = alloc.allocate_tensor(cutlass.BFloat16, cute.make_layout((rows * k,)), byte_alignment=16)
    return cute.zipped_divide(t, (BF16_PER_VECTOR,))


def partials(alloc, batch: int, threads: int):
    """Two fp32 [batch, warps] partials buffers, one after the other: a ring item's reduction
    alternates them (`alternate`), so one CTA barrier per item orders it."""
    return alloc.allocate_tensor(cutlass.Float32, cute.make_layout((2 * batch * (threads // WARP),)),
                                 byte_alignment=16)


def partials_bytes(batch: int, threads: int) -> int:
    return 2 * 4 * batch * (threads // WARP) + PARTIALS_SLACK


def alternate(pair, p, batch: int, threads: int):
    """Partials buffer p (0 or 1, run time) of a `partials` pair, fp32 [batch, warps]: item j
    uses buffer j % 2, so its reduction never writes what the previous item's epilogue reads."""
    w = threads // WARP
    return cute.make_tensor(pair.iterator + p * (batch * w), cute.make_layout((batch, w), stride=(w, 1)))


def offset(vecs, total: int, n: int):
    """The ((8), total) vectors view `vecs` from its vector n on (a slot's second weight row set)."""
    flat = cute.make_tensor(vecs.iterator + n * BF16_PER_VECTOR, cute.make_layout(((total - n) * BF16_PER_VECTOR,)))
    return cute.zipped_divide(flat, (BF16_PER_VECTOR,))


@cute.jit
def copy_acts(srcs, tidx, threads: int):
    """Every thread: for each (bf16 global tensor, shared vectors, n) of `srcs`, the tensor's
    first n 16-byte vectors into the shared ones by coherent cp.async (activations: never the
    read-only path), one commit, one wait; the caller's CTA barrier makes them every thread's."""
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = stream.activation_copy_atom(cutlass.BFloat16)
    for src, dst, n in srcs:  # trace-time
        gv = cute.zipped_divide(cute.make_tensor(src.iterator, cute.make_layout((n * BF16_PER_VECTOR,))),
                                (BF16_PER_VECTOR,))
        for q in cutlass.range_constexpr(ceil_div(n, threads)):
            v = tidx + q * threads
            if v < n:
                cute.copy(atom, cute.make_tensor(gv[(None, v)].iterator, flat), dst[(None, v)])
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
