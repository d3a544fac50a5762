"""Trace-time building blocks of the skinny decode GEMM on mma.sync m16n8k16, for ops whose weight
rows and activation rows are chosen at run time (MoE experts, gathered tokens, two GEMMs in one CTA).

The fragment scheme is the one of kernels/ops/gemv.py (read its module docstring): the weight is the
mma's B operand (8 rows per tile), the batch its A operand (16 rows per tile); lane (g = lane/4,
q = lane%4) loads one 16-byte vector of weight row g and of activation rows g and g+8 per 32-wide
k step, and the two halves of each vector feed two mmas, so both operands come straight from
coalesced 16-byte global loads. What this module adds:
  * every weight tile has its own row base (a dynamic value: an expert's rows, the gate and the up
    half of a gated FFN side by side) and its own tensor;
  * every activation row slot is a dynamic row index (a gathered token) or None (static padding);
    a row past the valid count may repeat a valid row: rows of an mma's D depend only on the same
    rows of A, and the epilogue never stores them;
  * the k loop, the register double buffering (next group's loads before this group's mmas) and
    the warp-ordered shared-memory reduction are functions, so a kernel can run them per work item
    inside a persistent loop.

All functions here run at trace time inside a `@cute.kernel` (plain Python decides every branch).
"""

from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, coherent_copy_atom, cute, cutlass, weight_load_atom

K_STEP = 32  # k covered by one pair of m16n8k16 mmas
ROWS_PER_TILE = 8  # mma N
BATCH_PER_TILE = 16  # mma M
VECTORS_PER_STEP = K_STEP // BF16_PER_VECTOR  # 4 lanes (q) per row per step


class MmaPlan:
    """One CTA's mma GEMV shape: `warps` warps split `k` in interleaved 32-wide steps; `row_tiles`
    weight tiles of 8 rows; `batch_tiles` activation tiles of 16 rows; load groups of `k_unroll`
    steps, double-buffered when `prefetch`."""

    def __init__(self, *, warps: int, row_tiles: int, batch_tiles: int, k: int, k_unroll: int,
                 prefetch: int = 1):
        if k % (K_STEP * warps):
            raise ValueError(f"k={k} is not a multiple of {K_STEP} x {warps} warps")
        self.warps = warps
        self.row_tiles = row_tiles
        self.batch_tiles = batch_tiles
        self.k = k
        self.k_unroll = max(1, k_unroll)
        self.prefetch = prefetch
        self.steps_per_warp = k // K_STEP // warps


def vector_view(t):
    """((1, 8), (rows, k / 8)): a row-major 2-D bf16 tensor as 16-byte vectors."""
    return cute.zipped_divide(t, (1, BF16_PER_VECTOR))


def x_row_slots(batch_tiles: int, valid: int, g, row_of):
    """Activation row per (batch tile, half) slot for lane group `g`: `row_of(i)` maps a batch
    position to a tensor row. Slots wholly past `valid` (static) are None; inside a partly valid
    half, lanes past `valid` repeat position `valid - 1`'s row (never stored)."""
    out = []
    for mb in range(batch_tiles):
        for h in range(2):
            b_off = mb * BATCH_PER_TILE + h * 8
            if b_off >= valid:
                out.append(None)
            elif b_off + 8 <= valid:
                out.append(row_of(b_off + g))
            else:
                out.append(row_of(b_off + g % (valid - b_off)))
    return out


def new_accumulators(plan: MmaPlan):
    f32 = cutlass.Float32
    acc = [[cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), f32) for _ in range(plan.row_tiles)]
           for _ in range(plan.batch_tiles)]
    for mb in range(plan.batch_tiles):
        for nt in range(plan.row_tiles):
            acc[mb][nt].fill(0.0)
    return acc


def _load_steps(plan: MmaPlan, w_tiles, gX, x_rows, warp, g, q, first, count, w_shared=False):
    """This lane's loads for `count` k steps from its step `first`: per step, one weight vector per
    tile (read-only path: weights are static in global memory; plain loads where `w_shared`, the
    weights in shared memory) and one activation vector per non-padding slot."""
    bf16 = cutlass.BFloat16
    w_atom = coherent_copy_atom(bf16) if w_shared else weight_load_atom(bf16)
    x_atom = coherent_copy_atom(bf16)
    vec = cute.make_layout(((1, BF16_PER_VECTOR),))
    wv, xv = [], []
    for u in range(count):
        kv = ((first + u) * plan.warps + warp) * VECTORS_PER_STEP + q
        wv_u = []
        for gW, row0 in w_tiles:
            t = cute.make_rmem_tensor(vec, bf16)
            cute.copy(w_atom, gW[(None, (row0 + g, kv))], t)
            wv_u.append(t)
        xv_u = []
        for row in x_rows:
            if row is None:
                xv_u.append(None)
            else:
                t = cute.make_rmem_tensor(vec, bf16)
                cute.copy(x_atom, gX[(None, (row, kv))], t)
                xv_u.append(t)
        wv.append(wv_u)
        xv.append(xv_u)
    return wv, xv


def _mma_steps(plan: MmaPlan, mma, acc, frags):
    """The 2 x batch_tiles x row_tiles mmas of each loaded step (k permuted identically in A and B)."""
    wv, xv = frags
    u32 = cutlass.Uint32
    for u in range(len(wv)):
        mma_step(mma, acc, [None if t is None else cute.recast_tensor(t, u32) for t in xv[u]],
                 [cute.recast_tensor(t, u32) for t in wv[u]])


def mma_step(mma, acc, x32, w32):
    """The mmas of one 32-wide k step, from this lane's 16-byte vectors seen as 4 x u32.

    `x32[2 mb]` / `x32[2 mb + 1]`: activation rows g and g + 8 of batch tile mb (None: padding
    rows, zero registers; a tile whose first half is None is skipped, its D rows are never
    stored); `w32[nt]`: row g of weight tile nt; `acc[mb][nt]` accumulates. The two halves of
    each vector feed two mmas (k slots {2q, 2q+1, 2q+8, 2q+9} hold k = 8q + 0..3, then 8q + 4..7,
    in A and B alike: see kernels/ops/gemv.py's module docstring)."""
    bf16 = cutlass.BFloat16
    u32 = cutlass.Uint32
    for mb in range(len(x32) // 2):
        lo32, hi32 = x32[2 * mb], x32[2 * mb + 1]
        if lo32 is None:
            continue
        for half in range(2):
            # A regs: (row g, k slots 2q,2q+1), (row g+8, same), (row g, 2q+8,2q+9), (row g+8, same)
            a = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, 1)), bf16)
            a32 = cute.recast_tensor(a, u32)
            a32[0] = lo32[2 * half]
            a32[2] = lo32[2 * half + 1]
            a32[1] = u32(0) if hi32 is None else hi32[2 * half]
            a32[3] = u32(0) if hi32 is None else hi32[2 * half + 1]
            for nt in range(len(w32)):
                # B regs: (k slots 2q,2q+1, col g), (2q+8, 2q+9, col g)
                b = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), bf16)
                b32 = cute.recast_tensor(b, u32)
                b32[0] = w32[nt][2 * half]
                b32[1] = w32[nt][2 * half + 1]
                cute.gemm(mma, acc[mb][nt], a, b, acc[mb][nt])


def _flat(frags):
    wv, xv = frags
    return [t for step in wv for t in step] + [t for step in xv for t in step if t is not None]


@cute.jit
def accumulate(plan: MmaPlan, acc, w_tiles, gX, x_rows, warp, g, q, w_shared=False):
    """acc[mb][nt] += x[x_rows] . W[tile rows] over this warp's k steps.

    `w_tiles`: one (vector-view weight tensor, first row) per row tile, in global memory (or in
    shared memory where `w_shared`: a ring slot); `gX`: the vector view of the activations;
    `x_rows`: 2 x batch_tiles row indices or None (see `x_row_slots`).
    """
    mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)))
    U = plan.k_unroll
    n_iter = plan.steps_per_warp // U
    tail = plan.steps_per_warp % U
    ld = (plan, w_tiles, gX, x_rows, warp, g, q)
    if plan.prefetch and n_iter > 1:
        cur = _load_steps(*ld, 0, U, w_shared)
        for it in cutlass.range(n_iter - 1, unroll=1):
            nxt = _load_steps(*ld, (it + 1) * U, U, w_shared)
            _mma_steps(plan, mma, acc, cur)
            for a, b in zip(_flat(cur), _flat(nxt)):
                a.store(b.load())
        if tail > 0:
            last = _load_steps(*ld, n_iter * U, tail, w_shared)
            _mma_steps(plan, mma, acc, cur)
            _mma_steps(plan, mma, acc, last)
        else:
            _mma_steps(plan, mma, acc, cur)
    else:
        for it in cutlass.range(n_iter, unroll=1):
            _mma_steps(plan, mma, acc, _load_steps(*ld, it * U, U, w_shared))
        if tail > 0:
            _mma_steps(plan, mma, acc, _load_steps(*ld, n_iter * U, tail, w_shared))
    return acc


def partials_layout(rows: int, batch: int, warps: int):
    """Shared-memory layout of per-warp fp32 partials [row, batch position, warp]."""
    return cute.make_layout((rows, batch, warps))


def padded_batch(valid: int) -> int:
    """Batch positions the partials buffer holds: `valid` rounded up to a half tile (8)."""
    return -(-valid // 8) * 8


def store_partials(plan: MmaPlan, sP, acc, warp, g, q, valid: int, row_offset: int = 0):
    """Write this warp's accumulators to sP[row_offset + tile row, batch position, warp] for every
    half tile that holds a position below `valid` (static); sP's batch extent must be
    `padded_batch(valid)`. Positions past `valid` hold repeated rows, never read."""
    for mb in range(plan.batch_tiles):
        for nt in range(plan.row_tiles):
            for i in range(4):
                b_off = mb * BATCH_PER_TILE + (i // 2) * 8  # c0,c1: row g; c2,c3: row g + 8
                if b_off < valid:
                    r = row_offset + nt * ROWS_PER_TILE + 2 * q + (i % 2)
                    sP[r, b_off + g, warp] = acc[mb][nt][i]


def sum_partials(sP, r, b, warps: int):
    """Sum of the warps' partials of (row r, batch position b), in warp order (deterministic)."""
    s = sP[r, b, 0]
    for w in range(1, warps):
        s = s + sP[r, b, w]
    return s


def sigmoid(v):
    f32 = cutlass.Float32
    return f32(1.0) / (f32(1.0) + cute.math.exp(-v))


def situ(g, u, gate_limit: float, up_limit: float):
    """SiTU(g, u) = Lg·tanh(g/Lg)·sigmoid(g) · Lu·tanh(u/Lu) in fp32 (kernels.reference.situ)."""
    f32 = cutlass.Float32
    return (f32(gate_limit) * cute.math.tanh(g * f32(1.0 / gate_limit)) * sigmoid(g)
            * (f32(up_limit) * cute.math.tanh(u * f32(1.0 / up_limit))))


def expert_view(mW, e, rows: int, cols: int):
    """Expert `e`'s [rows, cols] matrix of a row-major [E, rows, cols] tensor, addressed in 64 bits
    (the routed experts of k3 hold 2^34 elements: 32-bit offsets would wrap)."""
    # rows * cols is a multiple of 8 elements, so the expert's base keeps the tensor's 16 bytes.
    offset = cute.assume(cutlass.Int64(e) * (rows * cols), divby=BF16_PER_VECTOR)
    base = mW.iterator + offset
    return cute.make_tensor(base, cute.make_layout((rows, cols), stride=(cols, 1)))


__all__ = [
    "BATCH_PER_TILE", "K_STEP", "ROWS_PER_TILE", "WARP", "MmaPlan", "accumulate", "expert_view",
    "new_accumulators", "padded_batch", "partials_layout", "sigmoid", "situ", "store_partials", "sum_partials",
    "vector_view", "x_row_slots",
]
