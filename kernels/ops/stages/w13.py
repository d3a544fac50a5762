"""w13: act = bf16(SiTU(z[token] @ W13_e.T)) for every sorted position, an item (group u,
column block cb): `cols` gate rows of W13_e and the matching up rows (moe_w13's stream plan of
kernels/ops/moe_experts.py ExpertsUpOp), z's rows in the stage region, a group's tokens one at a time. A group past the
launch's n_groups is an empty item (no bytes, no output)."""

from kernels.ops.moe_experts import GATE_LIMIT, UP_LIMIT
from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, cute, cutlass
from kernels.ops.parts.decode_mma import expert_view, situ
from kernels.ops.stages import common


class W13Stage:
    """Planned from `op`, an ExpertsUpOp of the stream design."""

    name = "w13"
    routed = True  # its items' weights are the routing's experts

    def __init__(self, op, threads: int):
        self.op, self.P, self.threads = op, op.stream_plan, threads
        self.batch, self.top_k, self.latent, self.inter = op.batch, op.top_k, op.latent, op.inter
        self.cols = op.stream_cols
        self.blocks = op.col_blocks
        self.item_bytes = 2 * self.cols * self.latent * 2
        self.region_bytes = self.batch * self.latent * 2 + common.partials_bytes(self.batch, threads) + 32

    def region(self, alloc) -> dict:
        """"x" z's rows, "partials"."""
        return {"x": common.vectors(alloc, self.batch, self.latent),
                "partials": common.partials(alloc, self.batch, self.threads)}

    @cute.jit
    def load(self, smem, b, tidx):
        common.copy_acts(((b["z"], smem["x"], self.batch * self.P.kv),), tidx, self.threads)

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """Gate rows cb*cols .. of expert group_expert[u], then up rows inter + cb*cols ..; no
        bytes for a group past n_groups."""
        R, L, I = self.cols, self.latent, self.inter
        u = item // self.blocks
        cb = item % self.blocks
        if u < rt["n_groups"][0]:
            ew = expert_view(b["w13"], rt["group_expert"][u], 2 * I, L).iterator
            ring.arm(bars, slot, self.item_bytes)
            ring.copy(dst, ew + cute.assume(cb * (R * L), divby=BF16_PER_VECTOR), R * L * 2, bars, slot)
            ring.copy(dst + R * L, ew + cute.assume((I + cb * R) * L, divby=BF16_PER_VECTOR), R * L * 2, bars, slot)
        else:
            ring.arm(bars, slot, 0)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """act[pos, cb*cols + c] = bf16(SiTU(gate_c . z[token], up_c . z[token])) for each of the
        group's sorted positions (slot rows 0..cols-1 the gate rows, then the up rows), one
        token at a time: a group's first token, then, behind a CTA barrier each, the rest (a
        group has most often one). An empty item has its barrier too: the partials pair
        alternates per item."""
        T = self.batch
        rt = smem["rt"]
        u = item // self.blocks
        cb = item % self.blocks
        sP = common.alternate(smem["partials"], smem["p"], T, self.threads)
        valid = u < rt["n_groups"][0]  # CTA-uniform
        pos0 = rt["group_start"][u]
        self._token(valid, pos0, 0, cb, tidx, smem, sP, b)
        if cutlass.const_expr(T > 1):
            if valid:
                for c in cutlass.range(1, rt["group_start"][u + 1] - pos0, unroll=1):
                    cute.arch.sync_threads()  # the previous token's epilogue has read the partials
                    self._token(valid, pos0, c, cb, tidx, smem, sP, b)

    @cute.jit
    def _token(self, valid, pos0, c, cb, tidx, smem, sP, b):
        """Sorted position pos0 + c of the item's group: the dot of its z row (row 0 at batch 1)
        with the slot's rows, the warps' partials, a CTA barrier, its act columns."""
        P, R, K = self.P, self.cols, self.top_k
        if valid & (tidx < P.threads):
            if cutlass.const_expr(self.batch == 1):
                xb = 0
            else:
                xb = smem["rt"]["sorted_slots"][pos0 + c] // K * P.kv
            acc = stream.dot(P, smem["w"], tidx // P.row_threads * P.kv, smem["x"], [xb], tidx % P.row_threads)
            stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        if valid & (tidx < R):
            a = situ(stream.row_total(P, sP, tidx, 0), stream.row_total(P, sP, R + tidx, 0), GATE_LIMIT, UP_LIMIT)
            b["act"][pos0 + c, cb * R + tidx] = a.to(cutlass.BFloat16)
