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
