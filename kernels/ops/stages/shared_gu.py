"""shared_gu: a_s = bf16(SiTU(h @ W_sgu.T)), an item a gate row of W_sgu and its up row (the
stream design of kernels/ops/latent_out.py SharedGateUpOp: a section of threads per row), h in
the stage region."""

from kernels.ops.latent_out import GATE_LIMIT, UP_LIMIT, _dot_section
from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, cute, cutlass
from kernels.ops.parts.decode_mma import situ
from kernels.ops.stages import common


class SharedGuStage:
    """Planned from `op`, a SharedGateUpOp of the stream design with one row per section."""

    name = "shared_gu"

    def __init__(self, op, batch: int, threads: int, slot_vectors: int):
        if op.sp.rows != 1:
            raise ValueError("megakernel: shared_gu's items are one gate row and its up row (stream_rows 1)")
        self.op, self.P, self.batch, self.threads, self.slot_vectors = op, op.sp, batch, threads, slot_vectors
        self.hidden, self.inter = op.hidden, op.inter
        self.cols = 1
        self.item_bytes = 2 * self.hidden * 2
        self.region_bytes = batch * self.hidden * 2 + 2 * common.partials_bytes(batch, threads) + 32

    def region(self, alloc) -> dict:
        """"x" h's rows, "partials" (the gate section's) and "partials2" (the up section's)."""
        return {"x": common.vectors(alloc, self.batch, self.hidden),
                "partials": common.partials(alloc, self.batch, self.threads),
                "partials2": common.partials(alloc, self.batch, self.threads)}

    @cute.jit
    def load(self, smem, b, tidx):
        common.copy_acts(((b["h"], smem["x"], self.batch * self.P.kv),), tidx, self.threads)

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """Gate row `item`, then up row shared_inter + item."""
        H, S = self.hidden, self.inter
        w = b["w_shared_gate_up"].iterator
        ring.arm(bars, slot, self.item_bytes)
        ring.copy(dst, w + cute.assume(item * H, divby=BF16_PER_VECTOR), H * 2, bars, slot)
        ring.copy(dst + H, w + cute.assume((S + item) * H, divby=BF16_PER_VECTOR), H * 2, bars, slot)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """a_s[:, item] = bf16(SiTU(gate . h, up . h)): the gate section (the first P.threads
        threads) reads the slot's first row, the up section its second."""
        P, T = self.P, self.batch
        sPg = common.alternate(smem["partials"], smem["p"], T, self.threads)
        sPu = common.alternate(smem["partials2"], smem["p"], T, self.threads)
        if tidx < P.threads:
            _dot_section(P, smem["w"], smem["x"], T, sPg, tidx)
        elif tidx < 2 * P.threads:
            _dot_section(P, common.offset(smem["w"], self.slot_vectors, P.kv), smem["x"], T, sPu, tidx - P.threads)
        cute.arch.sync_threads()
        if tidx < T:
            a = situ(stream.row_total(P, sPg, 0, tidx), stream.row_total(P, sPu, 0, tidx), GATE_LIMIT, UP_LIMIT)
            b["a_shared"][tidx, item] = a.to(cutlass.BFloat16)
