"""Trace-time pieces of a TMA-fed warpgroup-mma ring, for ops whose weight and activation tiles
are chosen at run time (the routed experts' `wg` path, kernels/ops/moe_experts.py).

The scheme is the one of kernels/ops/gemv.py's warpgroup design with TMA (`_wg_tma_body`, read
its docstring; gemv keeps its own copy of these helpers, so that this module's edits do not
change gemv's cubins): W is the wgmma A operand (64 rows per warpgroup), the activations the B
operand (a tile of `n` rows), both k-major in 128-byte-swizzled shared-memory slots that TMA
fills; stage slot s has a full mbarrier (one arrival: the producer's expect-tx of the slot's
bytes, completed by the TMA unit) and an empty one (one arrival per warp once its wgmmas that
read the slot are done). Warp 0 is the producer as a whole (a TMA copy elects its own lane).
"""

from __future__ import annotations

from kernels.ops.parts.common import cute, cutlass

WG_M = 64  # wgmma M: weight rows per warpgroup
SWIZZLE_ALIGN = 1024  # a 128-byte-swizzled shared tile starts on a 1 KB boundary
TMA_BOX_K = 64  # bf16 k per TMA box: one 128-byte swizzle line


def ring_smem_bytes(rows: int, n: int, stage_k: int, stages: int, extra: int = 0) -> int:
    """Dynamic shared memory of a ring: W and x slots (1 KB aligned each), the full and empty
    mbarriers, `extra` bytes (16-byte aligned) and the allocator's slack."""
    return stages * stage_k * 2 * (rows + n) + 2 * SWIZZLE_ALIGN + 2 * stages * 8 + 8 + extra + 16


def layouts(rows: int, n: int, stage_k: int, stages: int):
    """The tiled wgmma (one warpgroup per 64 rows) and the staged W and x slot layouts."""
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.utils import LayoutEnum
    from cutlass.utils import hopper_helpers as sm90

    bf16 = cutlass.BFloat16
    tiler = (rows, n, stage_k)
    mma = sm90.make_trivial_tiled_mma(bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                                      cutlass.Float32, (rows // WG_M, 1, 1), tiler_mn=(WG_M, n))
    lay_w = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, bf16, stages)
    lay_x = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, bf16, stages)
    return mma, lay_w, lay_x


def tma_atom(mT, lay, tile):
    """A TMA tile-load atom over `mT` whose box is one stage's slot of `lay` (`tile` = (rows, k))."""
    from cutlass.cute.nvgpu import cpasync

    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mT, cute.slice_(lay, (None, None, 0)),
                                       tile)


def smem_tensors(smem, lay_w, lay_x, stages: int):
    """W and x rings and the 2 x `stages` mbarriers (full, then empty) from `smem`."""
    bf16 = cutlass.BFloat16
    sW = smem.allocate_tensor(bf16, lay_w.outer, byte_alignment=SWIZZLE_ALIGN, swizzle=lay_w.inner)
    sX = smem.allocate_tensor(bf16, lay_x.outer, byte_alignment=SWIZZLE_ALIGN, swizzle=lay_x.inner)
    bars = smem.allocate_array(cutlass.Int64, 2 * stages)
    return sW, sX, bars


def operands(mma, sW, sX, tidx, rows: int, n: int):
    """The wgmma operand views of the slots, the (row, column) of each accumulator, and the zeroed
    fp32 accumulators."""
    from cutlass.cute.nvgpu import warpgroup

    wg_idx = cute.arch.make_warp_uniform(tidx // 128)
    thr_mma = mma.get_slice(wg_idx * 128)
    tCrA = mma.make_fragment_A(thr_mma.partition_A(sW))
    tCrB = mma.make_fragment_B(thr_mma.partition_B(sX))
    tCc = mma.get_slice(tidx).partition_C(cute.make_identity_tensor((rows, n)))
    acc = cute.make_rmem_tensor(tCc.shape, cutlass.Float32)
    acc.fill(0.0)
    mma.set(warpgroup.Field.ACCUMULATE, True)
    return tCrA, tCrB, tCc, acc


@cute.jit
def init_barriers(bars, stages: int, warps: int, tidx, atoms):
    """Thread 0 prefetches the TMA descriptors and initialises the full (1 arrival) and empty
    (`warps` arrivals) mbarriers; then a CTA barrier."""
    from cutlass.cute.nvgpu import cpasync

    if tidx == 0:
        for a in atoms:
            cpasync.prefetch_descriptor(a)
        for st in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(bars + st, 1)
            cute.arch.mbarrier_init(bars + stages + st, warps)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def issue(tma_w, w_src, w_dst, tma_x, x_src, x_dst, full_bar, tile_bytes: int, w_policy, x_policy):
    """Warp 0, one slot: arm the full barrier with the slot's bytes, then the W and x tile copies
    that complete it (each with its L2 eviction policy)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(full_bar, tile_bytes)
    cute.copy(tma_w, w_src, w_dst, tma_bar_ptr=full_bar, cache_policy=cutlass.Int64(w_policy))
    cute.copy(tma_x, x_src, x_dst, tma_bar_ptr=full_bar, cache_policy=cutlass.Int64(x_policy))


@cute.jit
def consume(mma, acc, tCrA, tCrB, full_bar, empty_bar, slot, parity, k_steps: int, lane):
    """Every thread: wait for the slot, run its wgmmas, wait for them, then each warp's lane 0
    releases the slot."""
    from cutlass.cute.nvgpu import warpgroup

    cute.arch.mbarrier_wait(full_bar, parity)
    warpgroup.fence()
    for kb in cutlass.range_constexpr(k_steps):
        cute.gemm(mma, acc, tCrA[(None, None, kb, slot)], tCrB[(None, None, kb, slot)], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    if lane == 0:
        cute.arch.mbarrier_arrive(empty_bar)


# L2 cache policies of a TMA copy's `.L2::cache_hint` (the createpolicy encodings CUTLASS's
# CacheHintSm90 uses): weights stream through once, activations are read again by other CTAs
TMA_EVICT_FIRST = 0x12F0000000000000
TMA_EVICT_LAST = 0x14F0000000000000
