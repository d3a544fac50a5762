"""The block's elementwise epilogues, for the batches at which its dense projections are
foundation GEMM launches (kernels/ops/gemv.py; kernels/block.py `GEMV_DENSE`):

    gated_situ a  = bf16(SiTU(g, u)), gu = [g | u] the fp32 rows of h @ W_sgu.T   (shared_gate_up's)
    residual  out = bf16(x + r + s), bf16 in, summed in fp32 in that order        (latent_out's)

Each is the epilogue the fused kernel of kernels/ops/latent_out.py applies, with the same
roundings, so the block's semantics do not change with the choice: shared_gate_up rounds SiTU of
fp32 accumulators once, latent_out adds bf16(n @ W_up.T) and bf16(a @ W_sd.T) to x in fp32 and
rounds once (kernels.reference.residual).

Why they exist: from batch 16 the foundation GEMM's warpgroup design reads these weights at
71-89% of the read ceiling, where the decode mma scheme of the fused kernels gets 39-78%
(evidence_reports/moe_block/round6/). Its epilogue writes y and nothing else, so these few
microseconds of elementwise work follow it.

Both are memory-bound on activations only (at batch 64: 3.1 MB and 2.8 MB). A thread owns one
group of 8 output elements (one 16-byte bf16 vector); a CTA of `threads` threads covers
`threads` groups of one row (grid: groups of the row / threads, rows). Every operand is an
activation written by the previous launch, so every load is a plain coherent one (never the
read-only path: kernels/ops/parts/common.py).

Both are written as tile functions (`tile(item, tidx, smem, ...)`, item = (group block, row)):
the device work of one CTA's groups given the thread's index; the @cute.kernel is the thin
wrapper item = (blockIdx.x, blockIdx.y).
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, coherent_copy_atom, cute, cutlass
from kernels.ops.parts.decode_mma import situ

MAX_BATCH = 64
F32_PER_VECTOR = 4
GATE_LIMIT, UP_LIMIT = 4.0, 25.0  # ModelConfig.situ_gate_limit / situ_up_limit


class _RowwiseOp(OpBase):
    """Shape {"batch", "width"} (width: the output row's elements); a thread per 8 of them."""

    # the tunables' defaults: kernels/manifest.toml [kernels.gated_situ.tunables], [kernels.residual.tunables]
    TUNABLES = ("threads",)

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch, self.width = int(shape["batch"]), int(shape["width"])
        except KeyError as e:
            raise ValueError(f"{self.kernel_name}: shape needs batch and width; missing {e}") from None
        self.threads = int(self.tunables["threads"])
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"{self.kernel_name}: batch {self.batch} outside 1..{MAX_BATCH}")
        if self.width < 1 or self.width % BF16_PER_VECTOR:
            raise ValueError(f"{self.kernel_name}: width {self.width} is not a positive multiple of "
                             f"{BF16_PER_VECTOR} (16-byte vectors)")
        if self.threads % WARP or not WARP <= self.threads <= 1024:
            raise ValueError(f"{self.kernel_name}: threads {self.threads} must be a multiple of {WARP} in 32..1024")
        self.groups = self.width // BF16_PER_VECTOR

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(ceil_div(self.groups, self.threads), self.batch, 1), block=(self.threads, 1, 1))

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory: none (the epilogues are register-only)."""
        return {}


class SituOp(_RowwiseOp):
    """gated_situ: a = bf16(SiTU(gu[:, :width], gu[:, width:])), gu fp32 [batch, 2 * width]."""

    kernel_name = "gated_situ"

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, S = self.batch, self.width
        return {"gu": TensorSpec((T, 2 * S), "float32"), "a": TensorSpec((T, S), "bfloat16")}

    def reference(self, *, gu, a=None, compute_dtype=None):
        """a = SiTU(g, u) of gu's halves in fp32 (float64 for the oracle), then bf16:
        kernels.reference.gated_situ."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        return {"a": reference.gated_situ(gu, gate_limit=GATE_LIMIT, up_limit=UP_LIMIT, **kwargs)}

    @cute.jit
    def __call__(self, mGU: cute.Tensor, mA: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mGU, mA).launch(grid=list(lc.grid), block=list(lc.block))

    @cute.kernel
    def kernel(self, mGU: cute.Tensor, mA: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cx, row, _ = cute.arch.block_idx()
        self.tile((cx, row), tidx, self.allocate_smem(None), mGU, mA)

    @cute.jit
    def tile(self, item, tidx, smem, mGU: cute.Tensor, mA: cute.Tensor):
        """Trace-time: work item `item` = (group block, row), run by `threads` threads (`tidx`
        this one's index); `smem` is unused (`allocate_smem`)."""
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        cx, row = item
        v = cx * self.threads + tidx  # this thread's group of 8 outputs
        half = self.width // F32_PER_VECTOR  # fp32 vectors from a gate element to its up element
        gGU = cute.zipped_divide(mGU, (1, F32_PER_VECTOR))  # ((1, 4), (batch, 2 * width / 4))
        gA = cute.zipped_divide(mA, (1, BF16_PER_VECTOR))
        f_atom = coherent_copy_atom(f32)
        b_atom = coherent_copy_atom(bf16)
        fvec = cute.make_layout(((F32_PER_VECTOR,),))
        if v < self.groups:
            gs = [cute.make_rmem_tensor(fvec, f32) for _ in range(2)]
            us = [cute.make_rmem_tensor(fvec, f32) for _ in range(2)]
            for j in cutlass.range_constexpr(2):  # every load before any arithmetic
                cute.copy(f_atom, gGU[(None, (row, 2 * v + j))], gs[j])
                cute.copy(f_atom, gGU[(None, (row, half + 2 * v + j))], us[j])
            av = cute.make_rmem_tensor(cute.make_layout(((BF16_PER_VECTOR,),)), bf16)
            for j in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(F32_PER_VECTOR):
                    av[j * F32_PER_VECTOR + i] = situ(gs[j][i], us[j][i], GATE_LIMIT, UP_LIMIT).to(bf16)
            cute.copy(b_atom, av, gA[(None, (row, v))])


class ResidualOp(_RowwiseOp):
    """residual: out = bf16(x + r + shared), every operand bf16 [batch, width]."""

    kernel_name = "residual"

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, H = self.batch, self.width
        return {name: TensorSpec((T, H), "bfloat16") for name in ("x", "r", "shared", "out")}

    def reference(self, *, x, r, shared, out=None, compute_dtype=None):
        """out = x + r + shared summed in fp32 (float64 for the oracle): kernels.reference.residual."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        return {"out": reference.residual(x, r, shared, **kwargs)}

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mR, mS, mOut).launch(grid=list(lc.grid), block=list(lc.block))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cx, row, _ = cute.arch.block_idx()
        self.tile((cx, row), tidx, self.allocate_smem(None), mX, mR, mS, mOut)

    @cute.jit
    def tile(self, item, tidx, smem, mX: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor):
        """Trace-time: work item `item` = (group block, row), run by `threads` threads (`tidx`
        this one's index); `smem` is unused (`allocate_smem`)."""
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        cx, row = item
        v = cx * self.threads + tidx
        atom = coherent_copy_atom(bf16)
        vec = cute.make_layout(((BF16_PER_VECTOR,),))
        if v < self.groups:
            ins = [cute.make_rmem_tensor(vec, bf16) for _ in range(3)]
            for j, m in enumerate((mX, mR, mS)):
                cute.copy(atom, cute.zipped_divide(m, (1, BF16_PER_VECTOR))[(None, (row, v))], ins[j])
            y = ins[0].load().to(f32) + ins[1].load().to(f32)
            y = y + ins[2].load().to(f32)
            ov = cute.make_rmem_tensor(vec, bf16)
            ov.store(y.to(bf16))
            cute.copy(atom, ov, cute.zipped_divide(mOut, (1, BF16_PER_VECTOR))[(None, (row, v))])
