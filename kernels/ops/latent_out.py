"""The block's output side: latent RMSNorm + up-projection, shared expert on h, residual.

    n   = RMSNorm(c) * gamma_latent                  foundation kernel kernels/ops/rmsnorm.py
    a_s = bf16(SiTU(h @ W_sgu.T))                    `shared_gate_up` (this module)
    out = bf16(x + bf16(n @ W_up.T) + bf16(a_s @ W_sd.T))   `latent_out` (this module)

How far it is fused, and why: the up-projection and the shared expert's down-projection write
the same output rows, so one CTA computes both dot products for its rows (two mma passes over
two weights into two accumulators) and adds the residual in the epilogue: r and the shared
output never go through memory, and the up-projection needs no launch of its own. The latent
RMSNorm stays a launch of the foundation kernel: every up-projection CTA needs the statistics of
whole latent rows, which would otherwise be recomputed by each of the 448 CTAs. The shared
gate/up projection depends only on h, so the block can run it beside the routed experts.

`shared_gate_up` is the dense form of kernels/ops/moe_experts.py's moe_w13: a CTA's row tiles
are half gate rows, half the matching up rows, SiTU in fp32 in the epilogue, `a_s` rounded to bf16
as the reference does. Both kernels use the decode mma scheme of kernels/ops/decode_mma.py with
the warps' partials summed in warp order (deterministic).
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec
from kernels.ops.common import WARP, ceil_div, cute, cutlass
from kernels.ops.decode_mma import (
    BATCH_PER_TILE,
    ROWS_PER_TILE,
    MmaPlan,
    accumulate,
    new_accumulators,
    padded_batch,
    partials_layout,
    situ,
    store_partials,
    sum_partials,
    vector_view,
    x_row_slots,
)

MAX_BATCH = 64
LOAD_GROUP_VECTORS = 16
GATE_LIMIT, UP_LIMIT = 4.0, 25.0  # ModelConfig.situ_gate_limit / situ_up_limit

SHARED_GATE_UP_TUNABLES = {"warps_per_cta": 8, "row_tiles": 2, "k_unroll": 8}
LATENT_OUT_TUNABLES = {"warps_per_cta": 8, "row_tiles": 2, "k_unroll": 8}


def _plan(batch: int, k: int, warps: int, row_tiles: int, k_unroll: int) -> MmaPlan:
    mb = ceil_div(batch, BATCH_PER_TILE)
    xv = sum(1 for t in range(mb) for h in range(2) if t * BATCH_PER_TILE + h * 8 < batch)
    u = max(1, min(k_unroll, LOAD_GROUP_VECTORS // (row_tiles + xv)))
    return MmaPlan(warps=warps, row_tiles=row_tiles, batch_tiles=mb, k=k, k_unroll=u)


def _tunables(name: str, defaults: dict, tunables: dict) -> dict:
    unknown = set(tunables) - set(defaults)
    if unknown:
        raise ValueError(f"{name}: unknown tunables {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **tunables}


class SharedGateUpOp(OpBase):
    """shared_gate_up: a_s = bf16(SiTU(h @ W_sgu.T)); shape {"batch", "hidden", "shared_inter"}."""

    kernel_name = "shared_gate_up"

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **_tunables(self.kernel_name, SHARED_GATE_UP_TUNABLES, tunables))
        try:
            self.batch, self.hidden, self.inter = int(shape["batch"]), int(shape["hidden"]), int(shape["shared_inter"])
        except KeyError as e:
            raise ValueError(f"shared_gate_up: shape needs batch, hidden and shared_inter; missing {e}") from None
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"shared_gate_up: batch {self.batch} outside 1..{MAX_BATCH}")
        self.warps = int(self.tunables["warps_per_cta"])
        self.row_tiles = int(self.tunables["row_tiles"])
        if self.row_tiles % 2:
            raise ValueError("shared_gate_up: row_tiles must be even (half gate, half up)")
        self.half_rows = ROWS_PER_TILE * self.row_tiles // 2
        if self.inter % self.half_rows:
            raise ValueError(f"shared_gate_up: shared_inter {self.inter} is not a multiple of {self.half_rows}")
        self.plan = _plan(self.batch, self.hidden, self.warps, self.row_tiles, int(self.tunables["k_unroll"]))
        self.threads = self.warps * WARP
        self.pb = padded_batch(self.batch)
        self.smem_bytes = 2 * self.half_rows * self.pb * self.warps * 4 + 64

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, H, S = self.batch, self.hidden, self.inter
        return {
            "h": TensorSpec((T, H), "bfloat16"),
            "w_gate_up": TensorSpec((2 * S, H), "bfloat16"),
            "a": TensorSpec((T, S), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.inter // self.half_rows, 1, 1), block=(self.threads, 1, 1),
                            smem_bytes=self.smem_bytes)

    def reference(self, *, h, w_gate_up, a=None, compute_dtype=None):
        """a = SiTU(h @ W_sgu.T): bf16 (float64 for the oracle)."""
        import torch

        cd = compute_dtype or torch.float32
        gu = h.to(cd) @ w_gate_up.to(cd).T
        act = reference.situ(gu[:, : self.inter], gu[:, self.inter:], GATE_LIMIT, UP_LIMIT)
        return {"a": act if cd == torch.float64 else act.to(h.dtype)}

    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mH, mW, mA).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor):
        T, S = self.batch, self.inter
        Rh = self.half_rows
        NH = self.row_tiles // 2
        W = self.warps
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        rb, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4

        smem = cutlass.utils.SmemAllocator()
        sP = smem.allocate_tensor(f32, partials_layout(2 * Rh, self.pb, W), byte_alignment=16)
        gW = vector_view(mW)
        w_tiles = ([(gW, rb * Rh + nt * ROWS_PER_TILE) for nt in range(NH)]
                   + [(gW, S + rb * Rh + nt * ROWS_PER_TILE) for nt in range(NH)])
        acc = new_accumulators(self.plan)
        accumulate(self.plan, acc, w_tiles, vector_view(mH), x_row_slots(self.plan.batch_tiles, T, g, lambda i: i),
                   warp, g, q)
        store_partials(self.plan, sP, acc, warp, g, q, T)
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(ceil_div(Rh * T, self.threads)):
            idx = tidx + j * self.threads
            if idx < Rh * T:
                b = idx // Rh
                r = idx % Rh
                gv = sum_partials(sP, r, b, W)
                uv = sum_partials(sP, Rh + r, b, W)
                mA[b, rb * Rh + r] = situ(gv, uv, GATE_LIMIT, UP_LIMIT).to(bf16)


class LatentOutOp(OpBase):
    """latent_out: out = bf16(x + bf16(n @ W_up.T) + bf16(a_s @ W_sd.T));
    shape {"batch", "hidden", "latent", "shared_inter"}."""

    kernel_name = "latent_out"

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **_tunables(self.kernel_name, LATENT_OUT_TUNABLES, tunables))
        try:
            self.batch = int(shape["batch"])
            self.hidden, self.latent, self.inter = int(shape["hidden"]), int(shape["latent"]), int(shape["shared_inter"])
        except KeyError as e:
            raise ValueError(f"latent_out: shape needs batch, hidden, latent and shared_inter; missing {e}") from None
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"latent_out: batch {self.batch} outside 1..{MAX_BATCH}")
        self.warps = int(self.tunables["warps_per_cta"])
        self.row_tiles = int(self.tunables["row_tiles"])
        self.rows_per_cta = ROWS_PER_TILE * self.row_tiles
        if self.hidden % self.rows_per_cta:
            raise ValueError(f"latent_out: hidden {self.hidden} is not a multiple of {self.rows_per_cta}")
        k_unroll = int(self.tunables["k_unroll"])
        self.plan_up = _plan(self.batch, self.latent, self.warps, self.row_tiles, k_unroll)
        self.plan_down = _plan(self.batch, self.inter, self.warps, self.row_tiles, k_unroll)
        self.threads = self.warps * WARP
        self.pb = padded_batch(self.batch)
        self.smem_bytes = 2 * self.rows_per_cta * self.pb * self.warps * 4 + 64

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, H, L, S = self.batch, self.hidden, self.latent, self.inter
        return {
            "x": TensorSpec((T, H), "bfloat16"),
            "n": TensorSpec((T, L), "bfloat16"),
            "w_up": TensorSpec((H, L), "bfloat16"),
            "a": TensorSpec((T, S), "bfloat16"),
            "w_down": TensorSpec((H, S), "bfloat16"),
            "out": TensorSpec((T, H), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.hidden // self.rows_per_cta, 1, 1), block=(self.threads, 1, 1),
                            smem_bytes=self.smem_bytes)

    def reference(self, *, x, n, w_up, a, w_down, out=None, compute_dtype=None):
        """out = x + r + shared (kernels.reference: linear, the shared expert's down half, residual)."""
        import torch

        cd = compute_dtype or torch.float32
        r = reference.linear(n, w_up, compute_dtype=cd)
        s = a.to(cd) @ w_down.to(cd).T
        s = s if cd == torch.float64 else s.to(x.dtype)
        return {"out": reference.residual(x, r, s, compute_dtype=cd)}

    @cute.jit
    def __call__(self, mX: cute.Tensor, mN: cute.Tensor, mWu: cute.Tensor, mA: cute.Tensor, mWd: cute.Tensor,
                 mOut: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mN, mWu, mA, mWd, mOut).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mN: cute.Tensor, mWu: cute.Tensor, mA: cute.Tensor, mWd: cute.Tensor,
               mOut: cute.Tensor):
        T = self.batch
        R = self.rows_per_cta
        NT = self.row_tiles
        W = self.warps
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4
        row0 = bidx * R

        smem = cutlass.utils.SmemAllocator()
        sP = smem.allocate_tensor(f32, partials_layout(2 * R, self.pb, W), byte_alignment=16)
        rows = x_row_slots(self.plan_up.batch_tiles, T, g, lambda i: i)
        gWu = vector_view(mWu)
        acc_up = new_accumulators(self.plan_up)
        accumulate(self.plan_up, acc_up, [(gWu, row0 + nt * ROWS_PER_TILE) for nt in range(NT)],
                   vector_view(mN), rows, warp, g, q)
        store_partials(self.plan_up, sP, acc_up, warp, g, q, T)
        gWd = vector_view(mWd)
        acc_dn = new_accumulators(self.plan_down)
        accumulate(self.plan_down, acc_dn, [(gWd, row0 + nt * ROWS_PER_TILE) for nt in range(NT)],
                   vector_view(mA), rows, warp, g, q)
        store_partials(self.plan_down, sP, acc_dn, warp, g, q, T, row_offset=R)
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(ceil_div(R * T, self.threads)):
            idx = tidx + j * self.threads
            if idx < R * T:
                b = idx // R
                r = idx % R
                up = sum_partials(sP, r, b, W).to(bf16).to(f32)
                sh = sum_partials(sP, R + r, b, W).to(bf16).to(f32)
                mOut[b, row0 + r] = (mX[b, row0 + r].to(f32) + up + sh).to(bf16)
