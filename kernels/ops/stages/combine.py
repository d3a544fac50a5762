"""combine: c = bf16(sum_k w_k o_k) in the latent, an item a block of `cols` latent columns of
every token, k in order (moe_w2's combine, kernels/ops/moe_experts.py `combine_one`), after
the wait on w2: o and the weights read from memory, no ring."""

from kernels.ops.moe_experts import combine_one
from kernels.ops.parts.common import cute


class CombineStage:
    name = "combine"

    def __init__(self, batch: int, top_k: int, latent: int, cols: int, threads: int):
        if latent % cols or batch * cols > threads:
            raise ValueError(f"megakernel: combine items of {cols} columns need latent {latent} a multiple of "
                             f"them and batch * {cols} <= {threads} threads")
        self.batch, self.top_k, self.cols = batch, top_k, cols

    @cute.jit
    def item(self, item, tidx, smem, b):
        """A thread per (token, column) of the item's block."""
        C = self.cols
        if tidx < self.batch * C:
            combine_one(b["weights"], b["o"], b["c"], self.top_k, tidx // C, item * C + tidx % C)
