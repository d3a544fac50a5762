"""out: out = bf16(x + bf16(n @ W_up.T) + bf16(a_s @ W_sd.T)), an item one output row: its row of
W_up and its row of W_sd (the stream design of kernels/ops/latent_out.py LatentOutOp: a section
of threads per weight), n and a_s in the stage region.

The residual x of every item the worker runs is loaded into the region with n and a_s, once per
stage: a global load in an item's epilogue would put one memory latency (about a microsecond
under the ring's load) on the ring's issuing thread per item, and so on every item."""

from kernels.ops.latent_out import _dot_section
from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, cute, cutlass
from kernels.ops.stages import common


class OutStage:
    """Planned from `op`, a LatentOutOp of the stream design with one row per section."""

    name = "out"

    def __init__(self, op, batch: int, threads: int, slot_vectors: int, workers: int):
        if op.rows_per_cta != 1:
            raise ValueError("megakernel: out's items are one output row (stream_rows 1)")
        self.op, self.Pu, self.Pd = op, op.sp_up, op.sp_down
        self.batch, self.threads, self.slot_vectors = batch, threads, slot_vectors
        self.latent, self.inter = op.latent, op.inter
        self.cols = 1
        self.item_bytes = (self.latent + self.inter) * 2
        # a worker's items are every workers-th row (kernels/taskgraph.py mega_range): at most
        # this many, each with `batch` residuals
        self.residuals = -(-op.hidden // workers) * batch
        self.region_bytes = (batch * (self.latent + self.inter) * 2 + 2 * common.partials_bytes(batch, threads)
                             + 2 * self.residuals + 64)

    def region(self, alloc) -> dict:
        """"n" and "a" (a_s) rows, "partials" (the up section's) and "partials2" (the down
        section's), "res" the residuals of the worker's items (bf16, item-major, a token's
        after another's)."""
        return {"n": common.vectors(alloc, self.batch, self.latent), "a": common.vectors(alloc, self.batch, self.inter),
                "partials": common.partials(alloc, self.batch, self.threads),
                "partials2": common.partials(alloc, self.batch, self.threads),
                "res": alloc.allocate_tensor(cutlass.BFloat16, cute.make_layout((self.residuals,)), byte_alignment=16)}

    @cute.jit
    def load(self, smem, b, tidx):
        """n and a_s by coherent copies; then x[t, i] for each item i of the worker's items
        `smem["items"]` (lo, hi, step) and token t into res[(i - lo) // step * batch + t], by
        plain loads."""
        common.copy_acts(((b["n"], smem["n"], self.batch * self.Pu.kv),
                          (b["a_shared"], smem["a"], self.batch * self.Pd.kv)), tidx, self.threads)
        lo, hi, step = smem["items"]
        T = self.batch
        n = (hi - lo + step - 1) // step * T
        for q in cutlass.range_constexpr(-(-self.residuals // self.threads)):
            i = tidx + q * self.threads
            if i < n:
                smem["res"][i] = b["x"][i % T, lo + i // T * step]

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """W_up row `item` (latent wide), then W_sd row `item` (shared_inter wide)."""
        L, S = self.latent, self.inter
        ring.arm(bars, slot, self.item_bytes)
        ring.copy(dst, b["w_up"].iterator + cute.assume(item * L, divby=BF16_PER_VECTOR), L * 2, bars, slot)
        ring.copy(dst + L, b["w_shared_down"].iterator + cute.assume(item * S, divby=BF16_PER_VECTOR), S * 2, bars,
                  slot)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """The up section (the first Pu.threads threads) reads the slot's W_up row against n,
        the down section the W_sd row after it against a_s; then a thread per token rounds each
        to bf16 and adds the residual (from the region), as latent_out does."""
        Pu, Pd, T = self.Pu, self.Pd, self.batch
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        sPu = common.alternate(smem["partials"], smem["p"], T, self.threads)
        sPd = common.alternate(smem["partials2"], smem["p"], T, self.threads)
        if tidx < Pu.threads:
            _dot_section(Pu, smem["w"], smem["n"], T, sPu, tidx)
        elif tidx < Pu.threads + Pd.threads:
            _dot_section(Pd, common.offset(smem["w"], self.slot_vectors, Pu.kv), smem["a"], T, sPd,
                         tidx - Pu.threads)
        cute.arch.sync_threads()
        if tidx < T:
            lo, _, step = smem["items"]
            up = stream.row_total(Pu, sPu, 0, tidx).to(bf16).to(f32)
            sh = stream.row_total(Pd, sPd, 0, tidx).to(bf16).to(f32)
            res = smem["res"][(item - lo) // step * T + tidx].to(f32)
            b["out"][tidx, item] = (res + up + sh).to(bf16)
