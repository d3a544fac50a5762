"""What the megakernel's ring stages share (trace-time helpers over the stage region)."""

from kernels.ops.parts import decode_mma as dm
from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass

PARTIALS_SLACK = 16  # one fp32 partials pair's alignment slack, bytes
# The tensor-core stages (out, shared_gu): an item's weight rows are one mma tile of MMA_ROWS rows,
# streamed in pieces of k, each piece of the rows in one ring slot at a row stride padded by
# PAD_BYTES (4 mod 8 16-byte bank groups, so the lanes of a 128-bit load hit distinct groups).
MMA_ROWS = dm.ROWS_PER_TILE
PAD_BYTES = 64


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


def mma_warps(threads: int, *widths: int) -> int:
    """The most warps (halving from the CTA's) that split every width into whole 32-wide k steps;
    a ValueError where none does."""
    warps = threads // WARP
    while warps > 1 and any(w % (dm.K_STEP * warps) for w in widths):
        warps //= 2
    if any(w % (dm.K_STEP * warps) for w in widths):
        raise ValueError(f"megakernel: widths {widths} are not multiples of {dm.K_STEP}")
    return warps


def mma_pieces(width: int, warps: int, slot_bytes: int) -> tuple[int, int]:
    """(k per piece, pieces): the largest piece of a row of `width` that divides it into whole k
    steps of every warp and whose MMA_ROWS rows fit a slot at the padded stride."""
    unit = dm.K_STEP * warps
    best = 0
    for kc in range(unit, width + 1, unit):
        if width % kc == 0 and MMA_ROWS * (kc * 2 + PAD_BYTES) <= slot_bytes:
            best = kc
    if not best:
        raise ValueError(f"megakernel: no piece of a {width}-wide row fits a {slot_bytes}-byte slot "
                         f"in whole steps of {warps} warps")
    return best, width // best


def mma_plan(warps: int, kc: int):
    """One piece's mma plan: one tile of MMA_ROWS weight rows, one tile of tokens."""
    return dm.MmaPlan(warps=warps, row_tiles=1, batch_tiles=1, k=kc, k_unroll=1, prefetch=0)


def copy_piece(dst, bars, slot, srcs, kc: int):
    """Trace-time, the issuing thread: arm the slot for MMA_ROWS x kc bf16 and copy each of `srcs`
    (MMA_ROWS bf16 pointers, the rows' first element of the piece) to dst + r x the padded
    stride."""
    stride = kc + PAD_BYTES // 2
    ring.arm(bars, slot, MMA_ROWS * kc * 2)
    for r, src in enumerate(srcs):
        ring.copy(dst + r * stride, src, kc * 2, bars, slot)


@cute.jit
def mma_piece(acc, slot_vecs, kc: int, acts, k0, width: int, batch: int, warps: int, threads: int, tidx):
    """acc += the piece's weight rows (the slot's vectors `slot_vecs`, at the padded stride) . the
    same k [k0, k0 + kc) of the batch's activation rows (`acts`: shared vectors of rows `width`
    wide), on the first `warps` warps (kernels/ops/parts/decode_mma.py accumulate)."""
    bf16 = cutlass.BFloat16
    w = cute.make_tensor(cute.recast_ptr(slot_vecs.iterator, dtype=bf16),
                         cute.make_layout((MMA_ROWS, kc), stride=(kc + PAD_BYTES // 2, 1)))
    x = cute.make_tensor(cute.recast_ptr(acts.iterator, dtype=bf16) + k0,
                         cute.make_layout((batch, kc), stride=(width, 1)))
    warp, lane = tidx // WARP, tidx % WARP
    g, q = lane // 4, lane % 4
    rows = dm.x_row_slots(1, batch, g, lambda i: i)
    if cutlass.const_expr(warps == threads // WARP):
        dm.accumulate(mma_plan(warps, kc), acc, [(dm.vector_view(w), 0)], dm.vector_view(x), rows, warp, g, q,
                      w_shared=True)
    else:
        if warp < warps:
            dm.accumulate(mma_plan(warps, kc), acc, [(dm.vector_view(w), 0)], dm.vector_view(x), rows, warp, g, q,
                          w_shared=True)


@cute.jit
def mma_publish(sP, acc, kc: int, batch: int, warps: int, tidx):
    """The warps' accumulators to sP [row, token, warp] (decode_mma.store_partials); the caller's
    CTA barrier follows before `dm.sum_partials` reads them."""
    warp, lane = tidx // WARP, tidx % WARP
    if warp < warps:
        dm.store_partials(mma_plan(warps, kc), sP, acc, warp, lane // 4, lane % 4, batch)


def mma_partials(alloc, batch: int, warps: int):
    """fp32 partials [MMA_ROWS, padded batch, warps] from the region allocator."""
    return alloc.allocate_tensor(cutlass.Float32, dm.partials_layout(MMA_ROWS, dm.padded_batch(batch), warps),
                                 byte_alignment=16)


def mma_partials_bytes(batch: int, warps: int) -> int:
    return MMA_ROWS * dm.padded_batch(batch) * warps * 4 + PARTIALS_SLACK
