"""shared_gu: a_s = bf16(SiTU(h @ W_sgu.T)), an item COLS columns of a_s: their COLS gate rows of
W_sgu and their COLS up rows, one mma tile of weight rows on the tensor cores
(kernels/ops/parts/decode_mma.py), h in the stage region.

Why the tensor cores and items of several columns: with one gate row and its up row per item,
every thread read back one activation vector per token for each weight vector it multiplied, so
at batch 4 the stage ran at 71% of the read ceiling (evidence_reports/megakernel/stage_rates/).
An item's rows do not fit one ring slot whole, so an item is `chunks` ring entries, pieces of
k of all its rows (kernels/ops/stages/common.py, the helpers of the tensor-core stages); the
warps accumulate across them, and `finish` sums their partials in warp order and applies SiTU
to each column's gate and up sums."""

from kernels.ops.latent_out import GATE_LIMIT, UP_LIMIT
from kernels.ops.parts import decode_mma as dm
from kernels.ops.parts.common import BF16_PER_VECTOR, cute, cutlass
from kernels.ops.stages import common

COLS = common.MMA_ROWS // 2  # a_s columns per item: their gate rows, then their up rows, in one tile


class SharedGuStage:
    """Planned from `op`, the chain's SharedGateUpOp (its widths), for the ring's `slot_bytes`."""

    name = "shared_gu"

    def __init__(self, op, batch: int, threads: int, slot_bytes: int):
        self.op, self.batch, self.threads = op, batch, threads
        self.hidden, self.inter = op.hidden, op.inter
        if batch > dm.BATCH_PER_TILE:
            raise ValueError(f"megakernel shared_gu: batch {batch} past one mma tile of tokens ({dm.BATCH_PER_TILE})")
        if self.inter % COLS:
            raise ValueError(f"megakernel shared_gu: shared_inter {self.inter} is not a multiple of {COLS}")
        self.warps = common.mma_warps(threads, self.hidden)
        self.kc, self.chunks = common.mma_pieces(self.hidden, self.warps, slot_bytes)
        self.cols = COLS
        self.item_bytes = 2 * COLS * self.hidden * 2
        self.entry_bytes = common.MMA_ROWS * (self.kc * 2 + common.PAD_BYTES)
        self.region_bytes = batch * self.hidden * 2 + common.mma_partials_bytes(batch, self.warps) + 32

    def region(self, alloc) -> dict:
        """"x" h's rows, "partials" the warps' fp32 partials ([row, token, warp])."""
        return {"x": common.vectors(alloc, self.batch, self.hidden),
                "partials": common.mma_partials(alloc, self.batch, self.warps)}

    @cute.jit
    def load(self, smem, b, tidx):
        common.copy_acts(((b["h"], smem["x"], self.batch * self.hidden // BF16_PER_VECTOR),), tidx, self.threads)

    @cute.jit
    def issue(self, item, chunk, dst, bars, slot, rt, b):
        """Entry `chunk` of item `item`: k [chunk * kc, + kc) of gate rows item * COLS .. and of
        up rows shared_inter + item * COLS .."""
        H, S = self.hidden, self.inter
        w = b["w_shared_gate_up"].iterator
        k0 = chunk * self.kc
        srcs = [w + cute.assume((item * COLS + r) * H + k0, divby=BF16_PER_VECTOR) for r in range(COLS)]
        srcs += [w + cute.assume((S + item * COLS + r) * H + k0, divby=BF16_PER_VECTOR) for r in range(COLS)]
        common.copy_piece(dst, bars, slot, srcs, self.kc)

    def begin(self, item, tidx, smem, b):
        """The item's accumulator: a warp's mma tile of its 2 x COLS rows x 16 tokens."""
        return dm.new_accumulators(common.mma_plan(self.warps, self.kc))

    def chunk(self, item, c: int, state, tidx, smem, b):
        """Entry c (trace-time): its piece of the rows (slot `smem["w"]`) against the same k of h."""
        common.mma_piece(state, smem["w"], self.kc, smem["x"], c * self.kc, self.hidden, self.batch, self.warps,
                         self.threads, tidx)
        return state

    @cute.jit
    def finish(self, item, state, tidx, smem, b):
        """The warps' partials to shared memory, a CTA barrier, then a thread per (column, token):
        a_s = bf16(SiTU(gate sum, up sum)), each sum in warp order."""
        T = self.batch
        common.mma_publish(smem["partials"], state, self.kc, T, self.warps, tidx)
        cute.arch.sync_threads()
        if tidx < COLS * T:
            j, t = tidx // T, tidx % T
            gate = dm.sum_partials(smem["partials"], j, t, self.warps)
            up = dm.sum_partials(smem["partials"], COLS + j, t, self.warps)
            b["a_shared"][t, item * COLS + j] = dm.situ(gate, up, GATE_LIMIT, UP_LIMIT).to(cutlass.BFloat16)
