"""w2: o[slot] = act[pos] @ W2_e.T in fp32 for every sorted position, an item (group u, row block
rb): `rows` rows of W2_e (moe_w2's rows per item, kernels/ops/moe_experts.py ExpertsDownOp), a warp
per row; each lane reads its vectors of the group's act row from memory. The combine is a stage of
its own (kernels/ops/stages/combine.py). The ring claims the launch's groups' items only."""

from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, cute, cutlass, warp_allreduce_sum
from kernels.ops.parts.decode_mma import expert_view
from kernels.ops.parts.stream import StreamPlan


class W2Stage:
    """Planned from `op`, an ExpertsDownOp of the stream design: its rows per item, each read by
    one warp (so its sum is the warp's and no partials go through shared memory)."""

    name = "w2"
    routed = True  # its items' weights are the routing's experts

    def __init__(self, op, threads: int):
        rows = op.rows_per_cta
        if rows * WARP > threads:
            raise ValueError(f"megakernel: w2 items of {rows} rows need {rows} warps, more than {threads // WARP}")
        self.op, self.threads = op, threads
        self.P = StreamPlan(n=op.latent, k=op.inter, threads=rows * WARP, cta_bytes=rows * op.inter * 2)
        self.batch, self.latent, self.inter = op.batch, op.latent, op.inter
        self.cols = rows
        self.blocks = op.row_blocks
        self.item_bytes = rows * self.inter * 2
        self.region_bytes = 0

    def region(self, alloc) -> dict:
        return {}

    @cute.jit
    def load(self, smem, b, tidx):
        """Nothing: each item reads its group's act rows itself."""
        pass

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """Rows rb*rows .. of expert group_expert[u]: one contiguous block (the ring claims only
        the launch's groups' items)."""
        u = item // self.blocks
        rb = item % self.blocks
        ew = expert_view(b["w2"], rt["group_expert"][u], self.latent, self.inter).iterator
        ring.arm(bars, slot, self.item_bytes)
        ring.copy(dst, ew + cute.assume(rb * (self.cols * self.inter), divby=BF16_PER_VECTOR), self.item_bytes,
                  bars, slot)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """o[sorted_slots[pos], rb*rows + r] = row r . act[pos] for each of the group's sorted
        positions: warp r reads slot row r and its lanes' vectors of the act row from memory
        (coherent loads after the stage's wait: the same few kilobytes for every item of a
        group, mostly L1 hits), sums over the warp and lane 0 stores; then a CTA barrier (the
        slot is free). Nothing goes through shared memory but the slot."""
        P, I = self.P, self.inter
        rt = smem["rt"]
        u = item // self.blocks
        rb = item % self.blocks
        pos0 = rt["group_start"][u]
        if tidx < P.threads:
            r = tidx // WARP
            lane = tidx % WARP
            for c in cutlass.range(rt["group_start"][u + 1] - pos0, unroll=1):
                row = cute.make_tensor(b["act"].iterator + cute.assume((pos0 + c) * I, divby=BF16_PER_VECTOR),
                                       cute.make_layout((I,)))
                acc = stream.dot(P, smem["w"], r * P.kv, cute.zipped_divide(row, (BF16_PER_VECTOR,)), [0], lane)
                total = warp_allreduce_sum(acc[0])
                if lane == 0:
                    b["o"][rt["sorted_slots"][pos0 + c], rb * self.cols + r] = total
        cute.arch.sync_threads()
