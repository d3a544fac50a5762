"""Planted mutants of shipped kernels, for the race audit's tests: each is a subclass of a
shipped op named `<Op>_<mutant>` that overrides one trace-time seam of it so that the kernel
reads something the previous launch writes before `griddepcontrol.wait`, the hazard
programmatic dependent launch invites. The shipped ops contain no mutant code; the audit finds
these by name (validation/race/artifacts.py `mutant_op`, `fasttrack audit KERNEL --mutant M`),
and tests/test_race_static.py and tests/test_moe_experts.py check that the static audit flags them.
"""

from kernels.ops.gemv import TMA_EVICT_FIRST, TMA_EVICT_LAST, GemvOp, _issue_here
from kernels.ops.moe_experts import ExpertsUpOp
from kernels.ops.parts.common import cute, cutlass

# kernel -> its op's planted mutants
MUTANTS = {"gemv": ("x_before_wait",), "moe_w13": ("routing_before_wait",)}


class GemvOp_x_before_wait(GemvOp):  # noqa: N801 (the audit finds it by this name)
    """gemv issuing its first x loads before griddepcontrol.wait, in every design (with pdl)."""

    def _stream_wait_then_x(self, mX, vX, r, kv0):
        self._stream_copy_x(mX, vX, r, kv0)
        self._pdl_wait()

    def _first_loads(self, bufs, ld):
        if not self.pdl:
            return super()._first_loads(bufs, ld)
        gW, gX, _w_atom, x_atom, *rest = ld
        self._load_into(bufs, gW, gX, x_atom, x_atom, *rest, 0)
        _issue_here([t for step in bufs[0] for t in step] + [t for step in bufs[1] for t in step if t is not None])
        self._pdl_wait()

    @cute.jit
    def _wg_prologue(self, warp, full, tile_bytes, kt0, tma_w, tWg, tWs, tma_x, tXg, tXs):
        if warp == 0:
            for st in cutlass.range_constexpr(self.stages):
                if cutlass.const_expr(st < self.groups):
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + st, tile_bytes)
                    self._tma_copy(tma_w, tWg[(None, kt0 + st)], tWs[(None, st)], full + st, TMA_EVICT_FIRST)
                    self._tma_copy(tma_x, tXg[(None, kt0 + st)], tXs[(None, st)], full + st, TMA_EVICT_LAST)
        self._pdl_wait()


class ExpertsUpOp_routing_before_wait(ExpertsUpOp):  # noqa: N801 (the audit finds it by this name)
    """moe_w13's stream path, always with pdl, reading its group's expert id (the router's
    output) before griddepcontrol.wait."""

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **{**tunables, "pdl": 1})

    def _expert_before_wait(self, u, mGroupExpert):
        return mGroupExpert[u]


# -- the megakernel's mutants (issue 25): each breaks one stage's protocol --------------------
from kernels.ops.megakernel import BUFFERS, MegakernelOp  # noqa: E402
from kernels.ops.parts.common import BF16_PER_VECTOR, coherent_copy_atom, weight_load_atom  # noqa: E402

MUTANTS["megakernel"] = ("nc_activation", "missing_wait", "early_release", "undeclared_read")


def _buf(bufs, name: str):
    return bufs[BUFFERS.index(name)]


class MegakernelOp_nc_activation(MegakernelOp):  # noqa: N801 (the audit finds it by this name)
    """norm_latent also reads its row of c (w2's output) through ld.global.nc, the read-only
    path valid only for static weights: in program order after its wait, but the compiler may
    hoist such a load above the spin (the motivating bug). The vector goes to n, so it stays."""

    @cute.jit
    def _item(self, stage, item, tidx, smem, bufs):
        if cutlass.const_expr(stage == "norm_latent"):
            bf16 = cutlass.BFloat16
            gC = cute.zipped_divide(_buf(bufs, "c"), (1, BF16_PER_VECTOR))
            gN = cute.zipped_divide(_buf(bufs, "n"), (1, BF16_PER_VECTOR))
            v = cute.make_rmem_tensor(cute.make_layout(((BF16_PER_VECTOR,),)), bf16)
            cute.copy(weight_load_atom(bf16), gC[(None, (item, tidx))], v)
            MegakernelOp._item(self, stage, item, tidx, smem, bufs)
            cute.copy(coherent_copy_atom(bf16), v, gN[(None, (item, tidx))])
        else:
            MegakernelOp._item(self, stage, item, tidx, smem, bufs)


class MegakernelOp_missing_wait(MegakernelOp):  # noqa: N801
    """norm_latent does not wait for w2 before reading c."""

    def _deps(self, stage: str) -> tuple[str, ...]:
        return () if stage == "norm_latent" else MegakernelOp._deps(self, stage)


class MegakernelOp_early_release(MegakernelOp):  # noqa: N801
    """A stage's counter is released by thread 0 with no CTA barrier first: before the other
    threads' writes of the items it covers."""

    @cute.jit
    def _signal(self, mCounters, si, tidx, count=1):
        if tidx == 0:
            cute.arch.red(mCounters.iterator + si, cutlass.Int32(count), op="add", dtype="s32", sem="release",
                          scope="gpu")


class MegakernelOp_undeclared_read(MegakernelOp):  # noqa: N801
    """The down stage also reads logits (router_rows' output, which neither down's declaration
    nor its waits cover: down waits for norm_pre only), one word per item, into its first z
    column. Ordered by an acquire in its iteration, so only the stages' declarations show it."""

    @cute.jit
    def _item(self, stage, item, tidx, smem, bufs):
        MegakernelOp._item(self, stage, item, tidx, smem, bufs)
        if cutlass.const_expr(stage == "down"):
            if tidx == 0:
                v = _buf(bufs, "routing")[0][0, item]
                _buf(bufs, "z")[0, item * self.stages.cols["down"]] = v.to(cutlass.BFloat16)
