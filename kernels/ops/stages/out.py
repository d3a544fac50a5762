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
each piece of the ROWS rows in one slot at a padded row stride (PAD_BYTES: the lanes of a
128-bit load then hit distinct bank groups). Each warp accumulates its share of a piece's k in
registers across the item's entries (one accumulator for the up sum, one for the down sum,
since each is rounded to bf16 on its own, as latent_out does); the item's `finish` sums the
warps' partials in warp order (deterministic) and a thread per (row, token) adds the residual.

The residual x of every item the worker runs is loaded into the region with n and a_s, once per
stage: a global load in an item's epilogue would put one memory latency on the ring's issuing
thread per item."""

from kernels.ops.parts import decode_mma as dm
from kernels.ops.parts import ring
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, cute, cutlass
from kernels.ops.stages import common

ROWS = dm.ROWS_PER_TILE  # output rows per item: one mma tile of weight rows
PAD_BYTES = 64  # a slot row's padding: its stride is 4 mod 8 16-byte bank groups


def _pieces(width: int, warps: int, slot_bytes: int) -> tuple[int, int]:
    """(k per piece, pieces): the largest piece of a row of `width` that divides it into whole
    k steps of every warp and whose ROWS rows fit a slot at the padded stride."""
    unit = dm.K_STEP * warps
    best = 0
    for kc in range(unit, width + 1, unit):
        if width % kc == 0 and ROWS * (kc * 2 + PAD_BYTES) <= slot_bytes:
            best = kc
    if not best:
        raise ValueError(f"megakernel out: no piece of a {width}-wide row fits a {slot_bytes}-byte slot "
                         f"in whole steps of {warps} warps")
    return best, width // best


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
        warps = threads // WARP
        while warps > 1 and (self.latent % (dm.K_STEP * warps) or self.inter % (dm.K_STEP * warps)):
            warps //= 2
        if self.latent % (dm.K_STEP * warps) or self.inter % (dm.K_STEP * warps):
            raise ValueError(f"megakernel out: latent {self.latent} and shared_inter {self.inter} are not "
                             f"multiples of {dm.K_STEP}")
        self.warps = warps
        self.up = _pieces(self.latent, warps, slot_bytes)
        self.sd = _pieces(self.inter, warps, slot_bytes)
        self.chunks = self.up[1] + self.sd[1]
        self.cols = ROWS
        self.item_bytes = ROWS * (self.latent + self.inter) * 2
        self.entry_bytes = ROWS * (max(self.up[0], self.sd[0]) * 2 + PAD_BYTES)
        self.pb = dm.padded_batch(batch)
        # a worker's items are every workers-th row block (kernels/taskgraph.py mega_range): at
        # most this many, each with ROWS x batch residuals
        self.residuals = -(-(self.hidden // ROWS) // workers) * ROWS * batch
        self.partials_words = ROWS * self.pb * warps
        self.region_bytes = (batch * (self.latent + self.inter) * 2 + 2 * 4 * self.partials_words
                             + 2 * self.residuals + 64)

    def _plan(self, kc: int):
        return dm.MmaPlan(warps=self.warps, row_tiles=1, batch_tiles=1, k=kc, k_unroll=1, prefetch=0)

    def region(self, alloc) -> dict:
        """"n" and "a" (a_s) rows, "pu" and "pd" the warps' fp32 partials of the up and the down
        sums ([row, token, warp]), "res" the residuals of the worker's items (bf16: item, row,
        token)."""
        f32 = cutlass.Float32
        lay = dm.partials_layout(ROWS, self.pb, self.warps)
        return {"n": common.vectors(alloc, self.batch, self.latent), "a": common.vectors(alloc, self.batch, self.inter),
                "pu": alloc.allocate_tensor(f32, lay, byte_alignment=16),
                "pd": alloc.allocate_tensor(f32, lay, byte_alignment=16),
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
        """Entry `chunk` of item `item`: a piece of its ROWS rows, one bulk copy per row at the
        padded stride (the W_up pieces first, then the W_sd pieces)."""
        (ku, nu), (kd, _) = self.up, self.sd
        if chunk < nu:
            self._copy_rows(dst, bars, slot, b["w_up"], item, self.latent, chunk * ku, ku)
        else:
            self._copy_rows(dst, bars, slot, b["w_shared_down"], item, self.inter, (chunk - nu) * kd, kd)

    def _copy_rows(self, dst, bars, slot, mW, item, width: int, k0, kc: int):
        """Trace-time: arm the slot for ROWS x kc bf16 and copy row r's [k0, k0 + kc) of rows
        item * ROWS .. of the [hidden, width] weight `mW` to dst + r x the padded stride."""
        stride = kc + PAD_BYTES // 2
        ring.arm(bars, slot, ROWS * kc * 2)
        for r in range(ROWS):
            src = mW.iterator + cute.assume((item * ROWS + r) * width + k0, divby=BF16_PER_VECTOR)
            ring.copy(dst + r * stride, src, kc * 2, bars, slot)

    def begin(self, item, tidx, smem, b):
        """The item's accumulators: (up, down), each a warp's mma tile of ROWS rows x 16 tokens."""
        return (dm.new_accumulators(self._plan(self.up[0])), dm.new_accumulators(self._plan(self.sd[0])))

    def chunk(self, item, c: int, state, tidx, smem, b):
        """Entry c (trace-time) of the item: its piece of the rows (slot `smem["w"]`) against
        the same k of n (an up piece) or a_s (a down piece), into that sum's accumulator."""
        acc_up, acc_sd = state
        (ku, nu), (kd, _) = self.up, self.sd
        if c < nu:
            kc, k0, width, src, acc = ku, c * ku, self.latent, smem["n"], acc_up
        else:
            kc, k0, width, src, acc = kd, (c - nu) * kd, self.inter, smem["a"], acc_sd
        bf16 = cutlass.BFloat16
        w = cute.make_tensor(cute.recast_ptr(smem["w"].iterator, dtype=bf16),
                             cute.make_layout((ROWS, kc), stride=(kc + PAD_BYTES // 2, 1)))
        x = cute.make_tensor(cute.recast_ptr(src.iterator, dtype=bf16) + k0,
                             cute.make_layout((self.batch, kc), stride=(width, 1)))
        warp, lane = tidx // WARP, tidx % WARP
        g, q = lane // 4, lane % 4
        rows = dm.x_row_slots(1, self.batch, g, lambda i: i)
        args = (self._plan(kc), acc, [(dm.vector_view(w), 0)], dm.vector_view(x), rows, warp, g, q)
        if cutlass.const_expr(self.warps == self.threads // WARP):
            dm.accumulate(*args, w_shared=True)
        else:
            self._some_warps(args, warp)
        return acc_up, acc_sd

    @cute.jit
    def _some_warps(self, args, warp):
        """accumulate on the first `warps` warps only (widths that do not split over them all)."""
        if warp < self.warps:
            dm.accumulate(*args, w_shared=True)

    @cute.jit
    def finish(self, item, state, tidx, smem, b):
        """The warps' partials of both sums to shared memory, a CTA barrier, then a thread per
        (row, token): each sum in warp order rounded to bf16, plus the residual, into out."""
        acc_up, acc_sd = state
        T = self.batch
        warp, lane = tidx // WARP, tidx % WARP
        if warp < self.warps:
            dm.store_partials(self._plan(self.up[0]), smem["pu"], acc_up, warp, lane // 4, lane % 4, T)
            dm.store_partials(self._plan(self.sd[0]), smem["pd"], acc_sd, warp, lane // 4, lane % 4, T)
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
