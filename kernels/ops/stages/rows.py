"""router_rows and down: y = h @ W.T, an item a block of whole rows of W (the router's stream
plans of W_g and W_down), h in the stage region, y in fp32 (logits) or bf16 (z)."""

from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, cute
from kernels.ops.stages import common


class RowsStage:
    """One of the router's two row stages: `plan` (a StreamPlan of the router's), the weight
    buffer `weight` and output buffer `output` by kernel parameter name."""

    def __init__(self, name: str, plan, weight: str, output: str, batch: int, threads: int):
        self.name, self.P, self.weight, self.output = name, plan, weight, output
        self.batch, self.threads = batch, threads
        self.cols = plan.rows
        self.item_bytes = plan.rows * plan.k * 2
        self.region_bytes = batch * plan.k * 2 + common.partials_bytes(batch, threads) + 32

    def region(self, alloc) -> dict:
        """"x" h's rows, "partials" the reduction's pair."""
        return {"x": common.vectors(alloc, self.batch, self.P.k), "partials": common.partials(alloc, self.batch,
                                                                                              self.threads)}

    @cute.jit
    def load(self, smem, b, tidx):
        common.copy_acts(((b["h"], smem["x"], self.batch * self.P.kv),), tidx, self.threads)

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """Rows item * rows .. of W: one contiguous block."""
        ring.arm(bars, slot, self.item_bytes)
        src = b[self.weight].iterator + cute.assume(item * (self.P.rows * self.P.k), divby=BF16_PER_VECTOR)
        ring.copy(dst, src, self.item_bytes, bars, slot)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """Each thread's vectors of its row (stream.dot), the warps' partials, one barrier, then
        a thread per (row, token) sums its row in warp order and stores y."""
        P, T = self.P, self.batch
        mY = b[self.output]
        sP = common.alternate(smem["partials"], smem["p"], T, self.threads)
        if tidx < P.threads:
            acc = stream.dot(P, smem["w"], tidx // P.row_threads * P.kv, smem["x"], [t * P.kv for t in range(T)],
                             tidx % P.row_threads)
            stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        if tidx < P.rows * T:
            rr = tidx // T
            bb = tidx % T
            mY[bb, item * P.rows + rr] = stream.row_total(P, sP, rr, bb).to(mY.element_type)
