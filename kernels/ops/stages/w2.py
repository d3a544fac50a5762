"""w2: o[slot] = act[pos] @ W2_e.T in fp32 for every sorted position, an item (group u, row block
rb): `rows` rows of W2_e (moe_w2's stream plan of kernels/ops/moe_experts.py ExpertsDownOp); the
group's act rows are copied into the stage region when an item's group is not the previous
item's (a worker's items run through a group's row blocks in order). The combine is a stage of
its own (kernels/ops/stages/combine.py). A group past the launch's n_groups is an empty item."""

from kernels.ops.parts import ring, stream
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass
from kernels.ops.parts.decode_mma import expert_view, vector_view
from kernels.ops.stages import common


class W2Stage:
    """Planned from `op`, an ExpertsDownOp of the stream design."""

    name = "w2"
    routed = True  # its items' weights are the routing's experts

    def __init__(self, op, threads: int):
        self.op, self.P, self.threads = op, op.stream_plan, threads
        self.batch, self.latent, self.inter = op.batch, op.latent, op.inter
        self.cols = op.rows_per_cta
        self.blocks = op.row_blocks
        self.item_bytes = self.cols * self.inter * 2
        self.region_bytes = self.batch * self.inter * 2 + 16 + common.partials_bytes(self.batch, threads) + 48

    def region(self, alloc) -> dict:
        """"x" the act rows of one group (a slot per token of the batch), "group" the group
        whose rows "x" holds, "partials"."""
        return {"x": common.vectors(alloc, self.batch, self.inter),
                "group": alloc.allocate_tensor(cutlass.Int32, cute.make_layout((4,)), byte_alignment=16),
                "partials": common.partials(alloc, self.batch, self.threads)}

    @cute.jit
    def load(self, smem, b, tidx):
        """No group's rows yet (they come per group, `item`)."""
        if tidx == 0:
            smem["group"][0] = cutlass.Int32(-1)

    @cute.jit
    def issue(self, item, dst, bars, slot, rt, b):
        """Rows rb*rows .. of expert group_expert[u]: one contiguous block; no bytes for a group
        past n_groups."""
        u = item // self.blocks
        rb = item % self.blocks
        if u < rt["n_groups"][0]:
            ew = expert_view(b["w2"], rt["group_expert"][u], self.latent, self.inter).iterator
            ring.arm(bars, slot, self.item_bytes)
            ring.copy(dst, ew + cute.assume(rb * (self.cols * self.inter), divby=BF16_PER_VECTOR), self.item_bytes,
                      bars, slot)
        else:
            ring.arm(bars, slot, 0)

    @cute.jit
    def item(self, item, tidx, smem, b):
        """o[sorted_slots[pos], rb*rows + c] = row c . act[pos] for each of the group's sorted
        positions, one token at a time as w13's (kernels/ops/stages/w13.py); the group's act
        rows (a slot per token, the last repeated past the group's) are copied first where "x"
        holds another group's."""
        P, T = self.P, self.batch
        rt = smem["rt"]
        u = item // self.blocks
        rb = item % self.blocks
        sP = common.alternate(smem["partials"], smem["p"], T, self.threads)
        valid = u < rt["n_groups"][0]  # CTA-uniform
        pos0 = rt["group_start"][u]
        cnt = rt["group_start"][u + 1] - pos0
        if valid:
            if smem["group"][0] != u:  # CTA-uniform: another group's rows are loaded
                gA = vector_view(b["act"])
                atom = stream.activation_copy_atom(cutlass.BFloat16)
                for s in cutlass.range_constexpr(T):
                    row = pos0 + cutlass.min(s, cnt - 1)
                    for q in cutlass.range_constexpr(ceil_div(P.kv, self.threads)):
                        v = tidx + q * self.threads
                        if v < P.kv:
                            cute.copy(atom, cute.make_tensor(gA[(None, (row, v))].iterator,
                                                             cute.make_layout((BF16_PER_VECTOR,))),
                                      smem["x"][(None, s * P.kv + v)])
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.sync_threads()  # every thread has read "group"; the rows are everyone's
                if tidx == 0:
                    smem["group"][0] = u
        self._token(valid, pos0, 0, rb, tidx, smem, sP, b)
        if cutlass.const_expr(T > 1):
            if valid:
                for c in cutlass.range(1, cnt, unroll=1):
                    cute.arch.sync_threads()  # the previous token's epilogue has read the partials
                    self._token(valid, pos0, c, rb, tidx, smem, sP, b)

    @cute.jit
    def _token(self, valid, pos0, c, rb, tidx, smem, sP, b):
        """Sorted position pos0 + c of the item's group (its act row in slot c): the dot, the
        warps' partials, a CTA barrier, its o columns."""
        P, R = self.P, self.cols
        if valid & (tidx < P.threads):
            acc = stream.dot(P, smem["w"], tidx // P.row_threads * P.kv, smem["x"], [c * P.kv], tidx % P.row_threads)
            stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        if valid & (tidx < R):
            b["o"][smem["rt"]["sorted_slots"][pos0 + c], rb * R + tidx] = stream.row_total(P, sP, tidx, 0)
