"""out: out = bf16(x + bf16(n @ W_up.T) + bf16(a_s @ W_sd.T)), an item ROWS output rows, on the
tensor cores (mma.sync m16n8k16, kernels/ops/parts/decode_mma.py: the weight rows the mma's
B, the batch's tokens its A), n and a_s in the stage region.

Why the tensor cores and items of several rows: with one output row per item, every thread
read back one activation vector per token for each weight vector it multiplied, so at batch 4
an item read four times its weights' bytes of activations from shared memory and the stage ran
at 59% of the read ceiling (evidence_reports/megakernel/stage_rates/). An item of ROWS rows
reads each activation fragment once for all of them, and its FMAs are a few mmas.

An item's rows do not fit one ring slot whole (ROWS x (latent + shared_inter) bf16), so an item
is `chunks` ring entries: the W_up rows in `up` pieces of k, then the W_sd rows in `sd` pieces,
each piece of the ROWS rows in one slot at a padded row stride (kernels/ops/stages/common.py,
the helpers of the tensor-core stages). Each warp accumulates its share of a piece's k in
registers across the item's entries (one accumulator for the up sum, one for the down sum,
since each is rounded to bf16 on its own, as latent_out does); the item's `finish` sums the
warps' partials in warp order (deterministic) and a thread per (row, token) adds the residual.

The residual x of every item the worker runs is loaded into the region with n and a_s, once per
stage: a global load in an item's epilogue would put one memory latency on the ring's issuing
thread per item."""

from kernels.ops.parts import decode_mma as dm
from kernels.ops.parts.common import BF16_PER_VECTOR, cute, cutlass
from kernels.ops.stages import common

ROWS = common.MMA_ROWS  # output rows per item: one mma tile of weight rows


class OutStage:
    """Planned from `op`, the chain's LatentOutOp (its widths), for the ring's `slot_bytes`."""

    name = "out"

    def __init__(self, op, batch: int, threads: int, slot_bytes: int, workers: int):
        self.op, self.batch, self.threads = op, batch, threads
        self.latent, self.inter, self.hidden = op.latent, op.inter, op.hidden
        if batch > dm.BATCH_PER_TILE:
            raise ValueError(f"megakernel out: batch {batch} past one mma tile of tokens ({dm.BATCH_PER_TILE})")
        if self.hidden % ROWS:
            raise ValueError(f"megakernel out: hidden {self.hidden} is not a multiple of {ROWS} rows")
        self.warps = common.mma_warps(threads, self.latent, self.inter)
        self.up = common.mma_pieces(self.latent, self.warps, slot_bytes)
        self.sd = common.mma_pieces(self.inter, self.warps, slot_bytes)
        self.chunks = self.up[1] + self.sd[1]
        self.cols = ROWS
        self.item_bytes = ROWS * (self.latent + self.inter) * 2
        self.entry_bytes = ROWS * (max(self.up[0], self.sd[0]) * 2 + common.PAD_BYTES)
        # a worker's items are every workers-th row block (kernels/taskgraph.py mega_range): at
        # most this many, each with ROWS x batch residuals
        self.residuals = -(-(self.hidden // ROWS) // workers) * ROWS * batch
        self.region_bytes = (batch * (self.latent + self.inter) * 2 + 2 * common.mma_partials_bytes(batch, self.warps)
                             + 2 * self.residuals + 64)

    def region(self, alloc) -> dict:
        """"n" and "a" (a_s) rows, "pu" and "pd" the warps' fp32 partials of the up and the down
        sums ([row, token, warp]), "res" the residuals of the worker's items (bf16: item, row,
        token)."""
        return {"n": common.vectors(alloc, self.batch, self.latent), "a": common.vectors(alloc, self.batch, self.inter),
                "pu": common.mma_partials(alloc, self.batch, self.warps),
                "pd": common.mma_partials(alloc, self.batch, self.warps),
                "res": alloc.allocate_tensor(cutlass.BFloat16, cute.make_layout((self.residuals,)), byte_alignment=16)}

    @cute.jit
    def load(self, smem, b, tidx):
        """n and a_s by coherent copies; then x[t, i * ROWS + r] for each item i of the worker's
        items `smem["items"]` (lo, hi, step), row r and token t into res[((i - lo) // step * ROWS
        + r) * batch + t], by plain loads."""
        common.copy_acts(((b["n"], smem["n"], self.batch * self.latent // BF16_PER_VECTOR),
                          (b["a_shared"], smem["a"], self.batch * self.inter // BF16_PER_VECTOR)), tidx, self.threads)
        lo, hi, step = smem["items"]
        T = self.batch
        n = (hi - lo + step - 1) // step * ROWS * T
        for q in cutlass.range_constexpr(-(-self.residuals // self.threads)):
            i = tidx + q * self.threads
            if i < n:
                smem["res"][i] = b["x"][i % T, (lo + i // (ROWS * T) * step) * ROWS + i // T % ROWS]

    @cute.jit
    def issue(self, item, chunk, dst, bars, slot, rt, b):
        """Entry `chunk` of item `item`: a piece of its ROWS rows of W_up (the first entries) or
        of W_sd (the rest)."""
        (ku, nu), (kd, _) = self.up, self.sd
        if chunk < nu:
            self._copy(dst, bars, slot, b["w_up"], item, self.latent, chunk * ku, ku)
        else:
            self._copy(dst, bars, slot, b["w_shared_down"], item, self.inter, (chunk - nu) * kd, kd)

    def _copy(self, dst, bars, slot, mW, item, width: int, k0, kc: int):
        srcs = [mW.iterator + cute.assume((item * ROWS + r) * width + k0, divby=BF16_PER_VECTOR) for r in range(ROWS)]
        common.copy_piece(dst, bars, slot, srcs, kc)

    def begin(self, item, tidx, smem, b):
        """The item's accumulators: (up, down), each a warp's mma tile of ROWS rows x 16 tokens."""
        plan = common.mma_plan(self.warps, self.up[0])
        return dm.new_accumulators(plan), dm.new_accumulators(plan)

    def chunk(self, item, c: int, state, tidx, smem, b):
        """Entry c (trace-time) of the item: its piece of the rows (slot `smem["w"]`) against
        the same k of n (an up piece) or a_s (a down piece), into that sum's accumulator."""
        acc_up, acc_sd = state
        (ku, nu), (kd, _) = self.up, self.sd
        if c < nu:
            common.mma_piece(acc_up, smem["w"], ku, smem["n"], c * ku, self.latent, self.batch, self.warps,
                             self.threads, tidx)
        else:
            common.mma_piece(acc_sd, smem["w"], kd, smem["a"], (c - nu) * kd, self.inter, self.batch, self.warps,
                             self.threads, tidx)
        return acc_up, acc_sd

    @cute.jit
    def finish(self, item, state, tidx, smem, b):
        """The warps' partials of both sums to shared memory, a CTA barrier, then a thread per
        (row, token): each sum in warp order rounded to bf16, plus the residual, into out."""
        acc_up, acc_sd = state
        T = self.batch
        common.mma_publish(smem["pu"], acc_up, self.up[0], T, self.warps, tidx)
        common.mma_publish(smem["pd"], acc_sd, self.sd[0], T, self.warps, tidx)
        cute.arch.sync_threads()
        if tidx < ROWS * T:
            r, t = tidx // T, tidx % T
            f32 = cutlass.Float32
            bf16 = cutlass.BFloat16
            lo, _, step = smem["items"]
            up = dm.sum_partials(smem["pu"], r, t, self.warps).to(bf16).to(f32)
            sh = dm.sum_partials(smem["pd"], r, t, self.warps).to(bf16).to(f32)
            res = smem["res"][((item - lo) // step * ROWS + r) * T + t].to(f32)
            b["out"][t, item * ROWS + r] = (res + up + sh).to(bf16)
