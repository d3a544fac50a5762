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
as the reference does. Both kernels use the decode mma scheme of kernels/ops/parts/decode_mma.py with
the warps' partials summed in warp order (deterministic).

At the smallest batches (batch <= `stream_max_batch`, default 1) both kernels use instead the
"stream" design of kernels/ops/parts/stream.py (the gemv's at batch 1): no tensor cores, a CTA owns
whole output rows and is split into sections of whole warps, one per weight matrix it reads
(shared_gate_up: the gate rows and the matching up rows; latent_out: the W_up rows and the
matching W_sd rows). Every thread issues all of its 16-byte `cp.async` copies (its weight
vectors, and for a section's first row the activation) before the CTA waits once; then fp32
FMAs from shared memory and a warp-order reduction per section, and the epilogue combines the
sections' row totals (SiTU; residual + both projections) with the same roundings as above.
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.parts import stream
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass
from kernels.ops.parts.decode_mma import (
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
from kernels.ops.parts.stream import StreamPlan

MAX_BATCH = 64
LOAD_GROUP_VECTORS = 16
GATE_LIMIT, UP_LIMIT = 4.0, 25.0  # ModelConfig.situ_gate_limit / situ_up_limit

STREAM_SMEM_LIMIT = 227 * 1024  # an sm_90 CTA's shared memory (the launcher opts in past 48 KB)


def _plan(batch: int, k: int, warps: int, row_tiles: int, k_unroll: int) -> MmaPlan:
    mb = ceil_div(batch, BATCH_PER_TILE)
    xv = sum(1 for t in range(mb) for h in range(2) if t * BATCH_PER_TILE + h * 8 < batch)
    u = max(1, min(k_unroll, LOAD_GROUP_VECTORS // (row_tiles + xv)))
    return MmaPlan(warps=warps, row_tiles=row_tiles, batch_tiles=mb, k=k, k_unroll=u)


def _stream_plan(name: str, n: int, k: int, rows: int, row_threads: int) -> StreamPlan:
    """The stream plan of one CTA section: `rows` whole rows of k bf16 (of n), `row_threads`
    threads per row (fewer whole warps when they do not divide the row's 16-byte vectors)."""
    if rows < 1 or rows & (rows - 1) or n % rows:
        raise ValueError(f"{name}: stream_rows {rows} must be a power of two dividing {n}")
    if row_threads < WARP or row_threads % WARP:
        raise ValueError(f"{name}: stream threads per row {row_threads} must be a multiple of {WARP}")
    plan = StreamPlan(n=n, k=k, threads=rows * row_threads, cta_bytes=rows * k * 2)
    if plan.rows != rows:
        raise ValueError(f"{name}: {row_threads} threads per row cannot hold {rows} rows of {k} per CTA")
    return plan


def _check_stream_cta(name: str, threads: int, smem: int) -> None:
    if threads > 1024:
        raise ValueError(f"{name}: the stream CTA would have {threads} threads (at most 1024)")
    if smem > STREAM_SMEM_LIMIT:
        raise ValueError(f"{name}: the stream CTA would need {smem} B of shared memory (at most "
                         f"{STREAM_SMEM_LIMIT}); lower stream_max_batch or stream_rows")


@cute.jit
def _copy_section(plan: StreamPlan, gW, w_row0, vW, gX, vX, batch: int, t):
    """Issue section thread `t`'s copies: its vectors of weight row `w_row0 + t // row_threads`
    (into the section's shared rows) and, for the section's first row, of every activation row."""
    r = t // plan.row_threads
    kv0 = t % plan.row_threads
    stream.copy_row(plan, stream.weight_copy_atom(cutlass.BFloat16), gW, w_row0 + r, vW, r * plan.kv, kv0)
    if r == 0:
        for b in cutlass.range_constexpr(batch):
            stream.copy_row(plan, stream.activation_copy_atom(cutlass.BFloat16), gX, b, vX, b * plan.kv, kv0)


@cute.jit
def _dot_section(plan: StreamPlan, vW, vX, batch: int, sP, t):
    """Section thread `t`'s dot products over its shared vectors, published per warp to sP[b, warp]."""
    r = t // plan.row_threads
    kv0 = t % plan.row_threads
    acc = stream.dot(plan, vW, r * plan.kv, vX, [b * plan.kv for b in range(batch)], kv0)
    stream.publish_partials(acc, sP, t // WARP, t % WARP)


def _smem_rows(smem, k: int, rows: int):
    """A shared-memory buffer of `rows` rows of k bf16, as 16-byte vectors (((8), vectors))."""
    s = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((rows * k,)), byte_alignment=16)
    return cute.zipped_divide(s, (BF16_PER_VECTOR,))


class SharedGateUpOp(OpBase):
    """shared_gate_up: a_s = bf16(SiTU(h @ W_sgu.T)); shape {"batch", "hidden", "shared_inter"}."""

    kernel_name = "shared_gate_up"
    # the tunables' defaults: kernels/manifest.toml [kernels.shared_gate_up.tunables] (stream_*:
    # the stream design up to `stream_max_batch` tokens, `stream_rows` output rows per CTA,
    # `stream_threads` threads per weight row)
    TUNABLES = ("warps_per_cta", "row_tiles", "k_unroll", "stream_max_batch", "stream_rows", "stream_threads")

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch, self.hidden, self.inter = int(shape["batch"]), int(shape["hidden"]), int(shape["shared_inter"])
        except KeyError as e:
            raise ValueError(f"shared_gate_up: shape needs batch, hidden and shared_inter; missing {e}") from None
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"shared_gate_up: batch {self.batch} outside 1..{MAX_BATCH}")
        self.stream = self.batch <= int(self.tunables["stream_max_batch"])
        if self.stream:
            self._plan_stream()
            return
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
        self.grid = self.inter // self.half_rows

    def _plan_stream(self) -> None:
        """Stream design: a CTA owns `stream_rows` gate rows and the same up rows, so SiTU needs
        no second pass; its first section (`stream_threads` threads per row) copies and reduces
        the gate rows and h, the second the up rows. Shared memory: both row sets, h, partials."""
        t = self.tunables
        self.sp = _stream_plan(self.kernel_name, self.inter, self.hidden, int(t["stream_rows"]),
                               int(t["stream_threads"]))
        self.half_rows = self.sp.rows
        self.threads = 2 * self.sp.threads
        self.smem_bytes = (self.sp.smem_bytes(2 * self.sp.rows, self.batch, 2 * self.batch * self.sp.warps))
        self.grid = self.sp.ctas
        _check_stream_cta(self.kernel_name, self.threads, self.smem_bytes)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, H, S = self.batch, self.hidden, self.inter
        return {
            "h": TensorSpec((T, H), "bfloat16"),
            "w_gate_up": TensorSpec((2 * S, H), "bfloat16"),
            "a": TensorSpec((T, S), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.grid, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

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
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mH, mW, mA)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all). Stream design: "gate", "up" (the CTA's W rows), "h" (as 16-byte vectors) and the
        fp32 partials "partials_gate", "partials_up" [batch, warps]; mma design: "partials"."""
        f32 = cutlass.Float32
        if cutlass.const_expr(self.stream):
            P, B = self.sp, self.batch
            vG = _smem_rows(smem, P.k, P.rows)
            vU = _smem_rows(smem, P.k, P.rows)
            vH = _smem_rows(smem, P.k, B)
            sPg = smem.allocate_tensor(f32, cute.make_layout((B, P.warps)), byte_alignment=16)
            sPu = smem.allocate_tensor(f32, cute.make_layout((B, P.warps)), byte_alignment=16)
            return {"gate": vG, "up": vU, "h": vH, "partials_gate": sPg, "partials_up": sPu}
        return {"partials": smem.allocate_tensor(f32, partials_layout(2 * self.half_rows, self.pb, self.warps),
                                                 byte_alignment=16)}

    @cute.jit
    def tile(self, item, tidx, smem, mH, mW, mA):
        """Trace-time: work item `item` (a block of output columns), run by `threads` threads
        (`tidx` this one's index), over the shared memory `smem` (`allocate_smem`)."""
        if cutlass.const_expr(self.stream):
            self._stream_tile(item, tidx, smem, mH, mW, mA)
        else:
            self._mma_tile(item, tidx, smem, mH, mW, mA)

    @cute.jit
    def _stream_tile(self, bidx, tidx, smem, mH, mW, mA):
        """Trace-time: the stream design's work item (see `_plan_stream`)."""
        P = self.sp
        B, S = self.batch, self.inter
        vG, vU, vH = smem["gate"], smem["up"], smem["h"]
        sPg, sPu = smem["partials_gate"], smem["partials_up"]
        gW = cute.zipped_divide(mW, (1, BF16_PER_VECTOR))
        gH = cute.zipped_divide(mH, (1, BF16_PER_VECTOR))
        row0 = bidx * P.rows

        if tidx < P.threads:  # gate section: gate rows and h
            _copy_section(P, gW, row0, vG, gH, vH, B, tidx)
        else:  # up section: the matching up rows
            _copy_section(P, gW, S + row0, vU, gH, vH, 0, tidx - P.threads)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # h was copied by the gate section's first row
        if tidx < P.threads:
            _dot_section(P, vG, vH, B, sPg, tidx)
        else:
            _dot_section(P, vU, vH, B, sPu, tidx - P.threads)
        cute.arch.sync_threads()
        if tidx < P.rows * B:
            for rr in cutlass.range_constexpr(P.rows):
                for bb in cutlass.range_constexpr(B):
                    if tidx == rr * B + bb:
                        a = situ(stream.row_total(P, sPg, rr, bb), stream.row_total(P, sPu, rr, bb),
                                 GATE_LIMIT, UP_LIMIT)
                        mA[bb, row0 + rr] = a.to(cutlass.BFloat16)

    @cute.jit
    def _mma_tile(self, rb, tidx, smem, mH, mW, mA):
        """Trace-time: the mma design's work item (batches past `stream_max_batch`)."""
        T, S = self.batch, self.inter
        Rh = self.half_rows
        NH = self.row_tiles // 2
        W = self.warps
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32

        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4

        sP = smem["partials"]
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
    # the tunables' defaults: kernels/manifest.toml [kernels.latent_out.tunables] (stream_*: as
    # shared_gate_up's, `stream_up_threads` / `stream_down_threads` per W_up / W_sd row)
    TUNABLES = ("warps_per_cta", "row_tiles", "k_unroll", "stream_max_batch", "stream_rows", "stream_up_threads",
                "stream_down_threads")

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch = int(shape["batch"])
            self.hidden, self.latent, self.inter = int(shape["hidden"]), int(shape["latent"]), int(shape["shared_inter"])
        except KeyError as e:
            raise ValueError(f"latent_out: shape needs batch, hidden, latent and shared_inter; missing {e}") from None
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"latent_out: batch {self.batch} outside 1..{MAX_BATCH}")
        self.stream = self.batch <= int(self.tunables["stream_max_batch"])
        if self.stream:
            self._plan_stream()
            return
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
        self.grid = self.hidden // self.rows_per_cta

    def _plan_stream(self) -> None:
        """Stream design: a CTA owns `stream_rows` output rows; its first section
        (`stream_up_threads` threads per row) copies and reduces those rows of W_up and n, the
        second (`stream_down_threads` per row) the same rows of W_sd and a_s (7 KB + 12 KB a
        row at k3). Shared memory: both row sets, n, a_s, partials."""
        t = self.tunables
        rows = int(t["stream_rows"])
        self.sp_up = _stream_plan(self.kernel_name, self.hidden, self.latent, rows, int(t["stream_up_threads"]))
        self.sp_down = _stream_plan(self.kernel_name, self.hidden, self.inter, rows, int(t["stream_down_threads"]))
        B = self.batch
        self.rows_per_cta = rows
        self.threads = self.sp_up.threads + self.sp_down.threads
        self.smem_bytes = (self.sp_up.smem_bytes(rows, B, B * self.sp_up.warps)
                           + self.sp_down.smem_bytes(rows, B, B * self.sp_down.warps))
        self.grid = self.sp_up.ctas
        _check_stream_cta(self.kernel_name, self.threads, self.smem_bytes)

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
        return LaunchConfig(grid=(self.grid, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

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
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mX, mN, mWu, mA, mWd, mOut)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all). Stream design: "w_up", "n", "w_down", "a" (16-byte vectors) and the fp32 partials
        "partials_up", "partials_down" [batch, warps]; mma design: "partials"."""
        f32 = cutlass.Float32
        if cutlass.const_expr(self.stream):
            Pu, Pd, B = self.sp_up, self.sp_down, self.batch
            vWu = _smem_rows(smem, Pu.k, Pu.rows)
            vN = _smem_rows(smem, Pu.k, B)
            vWd = _smem_rows(smem, Pd.k, Pd.rows)
            vA = _smem_rows(smem, Pd.k, B)
            sPu = smem.allocate_tensor(f32, cute.make_layout((B, Pu.warps)), byte_alignment=16)
            sPd = smem.allocate_tensor(f32, cute.make_layout((B, Pd.warps)), byte_alignment=16)
            return {"w_up": vWu, "n": vN, "w_down": vWd, "a": vA, "partials_up": sPu, "partials_down": sPd}
        return {"partials": smem.allocate_tensor(f32, partials_layout(2 * self.rows_per_cta, self.pb, self.warps),
                                                 byte_alignment=16)}

    @cute.jit
    def tile(self, item, tidx, smem, mX, mN, mWu, mA, mWd, mOut):
        """Trace-time: work item `item` (a block of output columns), run by `threads` threads
        (`tidx` this one's index), over the shared memory `smem` (`allocate_smem`)."""
        if cutlass.const_expr(self.stream):
            self._stream_tile(item, tidx, smem, mX, mN, mWu, mA, mWd, mOut)
        else:
            self._mma_tile(item, tidx, smem, mX, mN, mWu, mA, mWd, mOut)

    @cute.jit
    def _stream_tile(self, bidx, tidx, smem, mX, mN, mWu, mA, mWd, mOut):
        """Trace-time: the stream design's work item (see `_plan_stream`)."""
        Pu, Pd = self.sp_up, self.sp_down
        B = self.batch
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        vWu, vN, vWd, vA = smem["w_up"], smem["n"], smem["w_down"], smem["a"]
        sPu, sPd = smem["partials_up"], smem["partials_down"]
        row0 = bidx * Pu.rows

        if tidx < Pu.threads:  # up section: W_up rows and n
            _copy_section(Pu, cute.zipped_divide(mWu, (1, BF16_PER_VECTOR)), row0, vWu,
                          cute.zipped_divide(mN, (1, BF16_PER_VECTOR)), vN, B, tidx)
        else:  # down section: W_sd rows and a_s
            _copy_section(Pd, cute.zipped_divide(mWd, (1, BF16_PER_VECTOR)), row0, vWd,
                          cute.zipped_divide(mA, (1, BF16_PER_VECTOR)), vA, B, tidx - Pu.threads)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # n and a_s were copied by each section's first row
        if tidx < Pu.threads:
            _dot_section(Pu, vWu, vN, B, sPu, tidx)
        else:
            _dot_section(Pd, vWd, vA, B, sPd, tidx - Pu.threads)
        cute.arch.sync_threads()
        if tidx < Pu.rows * B:
            for rr in cutlass.range_constexpr(Pu.rows):
                for bb in cutlass.range_constexpr(B):
                    if tidx == rr * B + bb:
                        up = stream.row_total(Pu, sPu, rr, bb).to(bf16).to(f32)
                        sh = stream.row_total(Pd, sPd, rr, bb).to(bf16).to(f32)
                        mOut[bb, row0 + rr] = (mX[bb, row0 + rr].to(f32) + up + sh).to(bf16)

    @cute.jit
    def _mma_tile(self, bidx, tidx, smem, mX, mN, mWu, mA, mWd, mOut):
        """Trace-time: the mma design's work item (batches past `stream_max_batch`)."""
        T = self.batch
        R = self.rows_per_cta
        NT = self.row_tiles
        W = self.warps
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32

        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4
        row0 = bidx * R

        sP = smem["partials"]
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
