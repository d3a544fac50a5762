"""RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * gamma, bf16 in and out, fp32 inside.

One CTA per row: a decode batch has at most 64 rows of at most 7168 elements (14 KB), so the
kernel is latency-bound and a row never needs more than one CTA. Each thread loads its 16-byte
vectors of x (plain loads: x is an activation) and gamma (read-only path: gamma is a static
weight) before any arithmetic, so all of a row's loads are in flight at once. The sum of squares
goes thread -> warp (butterfly shuffles) -> CTA (one fp32 per warp in shared memory, summed by
every thread in warp order, so the statistic is bitwise the same on every run). The output is
rounded once, like the reference: (x * rstd) * gamma in fp32, then bf16.

Written as a tile function (`tile(item, tidx, smem, ...)`): the device work of one row, given the
thread's index and the shared memory the caller allocated (`allocate_smem`); the @cute.kernel is
the thin wrapper item = blockIdx.x.
"""

from kernels import reference
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import (
    BF16_PER_VECTOR,
    WARP,
    ceil_div,
    coherent_copy_atom,
    cute,
    cutlass,
    warp_allreduce_sum,
    weight_load_atom,
)

EPS = 1e-5  # baked in at compile time (ARCHITECTURE.md: both RMSNorms use eps 1e-5)
MAX_BATCH = 64


class RMSNormOp(OpBase):
    """One variant of RMSNorm: shape {"batch", "width"} plus tunables."""

    kernel_name = "rmsnorm"
    # the tunables' defaults: kernels/manifest.toml [kernels.rmsnorm.tunables]
    TUNABLES = ("threads",)

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch, self.width = int(shape["batch"]), int(shape["width"])
        except KeyError as e:
            raise ValueError(f"rmsnorm: shape needs batch and width; missing {e}") from None
        self.threads = int(self.tunables["threads"])
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"rmsnorm: batch {self.batch} outside 1..{MAX_BATCH}")
        if self.width % BF16_PER_VECTOR:
            raise ValueError(f"rmsnorm: width {self.width} is not a multiple of {BF16_PER_VECTOR} (16-byte vectors)")
        if self.threads % WARP or not WARP <= self.threads <= 1024:
            raise ValueError(f"rmsnorm: threads {self.threads} must be a multiple of {WARP} in 32..1024")
        self.vectors = self.width // BF16_PER_VECTOR
        self.vectors_per_thread = ceil_div(self.vectors, self.threads)
        self.warps = self.threads // WARP

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        return {
            "x": TensorSpec((self.batch, self.width), "bfloat16"),
            "gamma": TensorSpec((self.width,), "bfloat16"),
            "y": TensorSpec((self.batch, self.width), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.batch, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.warps * 4)

    def reference(self, *, x, gamma, y=None, compute_dtype=None):
        """Expected y from the pure-torch reference (fp32 statistics; float64 for the oracle)."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        return {"y": reference.rmsnorm(x, gamma, EPS, **kwargs)}

    # -- device code ------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mG: cute.Tensor, mY: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mG, mY).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mG: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mX, mG, mY)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all): "warp_sums" (fp32 [warps], one partial sum of squares per warp)."""
        return {"warp_sums": smem.allocate_tensor(cutlass.Float32, cute.make_layout((self.warps,)), byte_alignment=16)}

    @cute.jit
    def tile(self, item, tidx, smem, mX: cute.Tensor, mG: cute.Tensor, mY: cute.Tensor):
        """Trace-time: work item `item` (the row), run by `threads` threads (`tidx` this one's
        index), over the shared memory `smem` (`allocate_smem`)."""
        T = self.threads
        V = self.vectors_per_thread
        NV = self.vectors
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32

        row = item
        warp = tidx // WARP
        lane = tidx % WARP

        gX = cute.zipped_divide(mX, (1, BF16_PER_VECTOR))  # ((1, 8), (batch, width / 8))
        gY = cute.zipped_divide(mY, (1, BF16_PER_VECTOR))
        gG = cute.zipped_divide(mG, (BF16_PER_VECTOR,))  # ((8,), (width / 8,))
        x_atom = coherent_copy_atom(bf16)
        g_atom = weight_load_atom(bf16)
        gvec = cute.make_layout(((BF16_PER_VECTOR,),))

        # All loads first. Vector j of this thread is tidx + j*T; only the last may be past the row.
        xs = [cute.make_rmem_tensor(gvec, bf16) for _ in range(V)]
        gs = [cute.make_rmem_tensor(gvec, bf16) for _ in range(V)]
        for j in cutlass.range_constexpr(V):
            if cutlass.const_expr((j + 1) * T <= NV):
                cute.copy(x_atom, gX[(None, (row, tidx + j * T))], xs[j])
                cute.copy(g_atom, gG[(None, tidx + j * T)], gs[j])
            else:
                xs[j].fill(0.0)  # contributes nothing to the sum of squares
                gs[j].fill(0.0)
                if tidx + j * T < NV:
                    cute.copy(x_atom, gX[(None, (row, tidx + j * T))], xs[j])
                    cute.copy(g_atom, gG[(None, tidx + j * T)], gs[j])

        ss = f32(0.0)
        for j in cutlass.range_constexpr(V):
            xf = xs[j].load().to(f32)
            ss = ss + (xf * xf).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        ss = warp_allreduce_sum(ss)

        sW = smem["warp_sums"]
        if lane == 0:
            sW[warp] = ss
        cute.arch.sync_threads()
        total = sW[0]
        for w in cutlass.range_constexpr(1, self.warps):
            total = total + sW[w]
        rstd = cute.math.rsqrt(total * f32(1.0 / self.width) + f32(EPS))

        for j in cutlass.range_constexpr(V):
            yv = cute.make_rmem_tensor(gvec, bf16)
            yv.store(((xs[j].load().to(f32) * rstd) * gs[j].load().to(f32)).to(bf16))
            if cutlass.const_expr((j + 1) * T <= NV):
                cute.copy(x_atom, yv, gY[(None, (row, tidx + j * T))])
            else:
                if tidx + j * T < NV:
                    cute.copy(x_atom, yv, gY[(None, (row, tidx + j * T))])
