"""Skinny decode GEMM `y = x @ W.T` on the tensor cores: bf16 x [batch, k] and W [n, k], fp32
accumulation, y [batch, n] in bf16 or fp32.

Why tensor cores at every batch: at batch 64 a CUDA-core GEMV is arithmetic-bound (2*64*n*k flops
on ~60 TFLOP/s of fp32 FMA against the weight bytes at ~4.6 TB/s), while warp-level `mma.sync`
m16n8k16 has ample headroom even when most of its M rows are padding at batch 1.

Layout of one warp's work, per 32-wide k step:
  * W is the mma's B operand (n = 8 weight rows per tile), the batch is its M operand (16 rows per
    tile, rows past `batch` are zero registers, never loaded).
  * Each lane (g = lane / 4, q = lane % 4) loads one 16-byte vector of W row g, k in
    [base + 8q, base + 8q + 8), and the same k range of x rows g and g + 8. The two halves of each
    16-byte vector feed two mmas. A dot product does not care in which order its k terms are
    summed, so k is permuted freely as long as A and B use the same permutation: the mma's k slots
    {2q, 2q+1, 2q+8, 2q+9} (which the m16n8k16 fragments give lane q for both A and B) hold
    k = base + 8q + {0,1,2,3} in the first mma and base + 8q + {4,5,6,7} in the second. So both
    operands come straight from coalesced 16-byte global loads, with no shuffles and no shared
    memory; W goes through the read-only path (`ld.global.nc`), x through plain loads.
  * A CTA owns `8 * row_tiles` weight rows (doubled past batch 16); its warps split k
    (interleaved 32-wide steps); each warp issues its loads in groups of up to `k_unroll` steps
    and, with `prefetch`, issues the next group before the current group's mmas, so two groups
    are in flight; the partial sums meet in shared memory, summed in warp order (deterministic:
    the same bits on every run). How the tunables adapt to the batch: see `GemvOp.__init__`.

Measured on an H200 (evidence_reports/foundation/): at batch 1 the kernel streams W at about the
rate of the read-only ceiling minus a fixed per-launch cost; from batch 32 on, re-reading x per
CTA makes it slower than cuBLAS (a smem/wgmma design is the next step).
"""

from kernels import reference
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec
from kernels.ops.common import (
    BF16_PER_VECTOR,
    WARP,
    ceil_div,
    coherent_copy_atom,
    cute,
    cutlass,
    weight_load_atom,
)

K_STEP = 32  # k covered by one pair of m16n8k16 mmas (two halves of a 16-byte vector per lane)
ROWS_PER_TILE = 8  # mma N: weight rows per tile
BATCH_PER_TILE = 16  # mma M: batch rows per tile
MAX_BATCH = 64
SMEM_LIMIT = 48 * 1024  # static-launch limit; more would need an opt-in attribute
FILL_CTAS = 132  # SMs of an H100/H200 SXM: fewer CTAs leave SMs idle
LOAD_GROUP_VECTORS = 16  # 16-byte vectors per lane in one load group (x2 live with prefetch)

# Host-side tunables; must equal the manifest's defaults (kernels/manifest.toml [kernels.gemv]).
DEFAULT_TUNABLES = {"warps_per_cta": 8, "row_tiles": 2, "k_unroll": 8, "prefetch": 1}

OUT_DTYPES = ("bfloat16", "float32")


class GemvOp(OpBase):
    """One variant of the decode GEMM: shape {"batch", "n", "k", "out_dtype"} plus tunables."""

    kernel_name = "gemv"

    def __init__(self, shape: dict, **tunables):
        unknown = set(tunables) - set(DEFAULT_TUNABLES)
        if unknown:
            raise ValueError(f"gemv: unknown tunables {sorted(unknown)}; known: {sorted(DEFAULT_TUNABLES)}")
        super().__init__(shape, **{**DEFAULT_TUNABLES, **tunables})
        try:
            self.batch, self.n, self.k = int(shape["batch"]), int(shape["n"]), int(shape["k"])
        except KeyError as e:
            raise ValueError(f"gemv: shape needs batch, n and k; missing {e}") from None
        self.out_dtype = shape.get("out_dtype", "bfloat16")
        warps = int(self.tunables["warps_per_cta"])
        row_tiles = int(self.tunables["row_tiles"])
        k_unroll = int(self.tunables["k_unroll"])
        self.prefetch = int(self.tunables["prefetch"])

        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"gemv: out_dtype {self.out_dtype!r} not in {OUT_DTYPES}")
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"gemv: batch {self.batch} outside 1..{MAX_BATCH}")
        if min(warps, row_tiles, k_unroll) < 1:
            raise ValueError("gemv: tunables must be positive")

        # The tunables are one setting for every batch; what they mean adapts to the batch:
        #  * row tiles per CTA double past one 16-row batch tile: each activation fragment then
        #    feeds twice the weight rows (the L1/L2 traffic of x per CTA is batch/rows times W's),
        #    and halve while the grid would have fewer CTAs than FILL_CTAS (the router's 896 rows);
        #  * a load group holds at most k_unroll steps and at most LOAD_GROUP_VECTORS 16-byte
        #    vectors per lane (registers: prefetch keeps two groups live);
        #  * warps halve until their fp32 partials fit the static shared-memory limit.
        self.batch_tiles = ceil_div(self.batch, BATCH_PER_TILE)
        self.row_tiles = row_tiles * (1 if self.batch_tiles == 1 else 2)
        while self.row_tiles > 1 and self.n // (ROWS_PER_TILE * self.row_tiles) < FILL_CTAS:
            self.row_tiles //= 2  # fewer rows per CTA rather than idle SMs
        self.rows_per_cta = ROWS_PER_TILE * self.row_tiles
        x_vectors = sum(1 for mb in range(self.batch_tiles) for h in range(2)
                        if mb * BATCH_PER_TILE + h * 8 < self.batch)
        self.k_unroll = max(1, min(k_unroll, LOAD_GROUP_VECTORS // (self.row_tiles + x_vectors)))
        self.warps = warps
        while self.warps > 1 and self.warps * self.batch * self.rows_per_cta * 4 > SMEM_LIMIT:
            self.warps //= 2

        if self.n % self.rows_per_cta:
            raise ValueError(f"gemv: n={self.n} is not a multiple of {self.rows_per_cta} rows per CTA")
        if self.k % (K_STEP * self.warps):
            raise ValueError(
                f"gemv: k={self.k} is not a multiple of {K_STEP} x {self.warps} warps (k steps split evenly)"
            )
        self.steps_per_warp = self.k // K_STEP // self.warps
        self.threads = WARP * self.warps
        self.smem_bytes = self.warps * self.batch * self.rows_per_cta * 4
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(
                f"gemv: batch {self.batch} x {self.rows_per_cta} rows of fp32 partials need "
                f"{self.smem_bytes} B of shared memory (limit {SMEM_LIMIT})"
            )

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        return {
            "x": TensorSpec((self.batch, self.k), "bfloat16"),
            "w": TensorSpec((self.n, self.k), "bfloat16"),
            "y": TensorSpec((self.batch, self.n), self.out_dtype),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(
            grid=(self.n // self.rows_per_cta, 1, 1),
            block=(self.threads, 1, 1),
            smem_bytes=self.smem_bytes,
        )

    def reference(self, *, x, w, y=None, compute_dtype=None):
        """Expected y from the pure-torch reference (fp32 accumulation; float64 for the oracle)."""
        import torch

        out = getattr(torch, self.out_dtype)
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        return {"y": reference.linear(x, w, out_dtype=out, **kwargs)}

    # -- device code ------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mW, mY).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor):
        B = self.batch
        R = self.rows_per_cta
        NT = self.row_tiles
        MB = self.batch_tiles
        U = self.k_unroll
        W = self.warps
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        u32 = cutlass.Uint32

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4
        row0 = bidx * R

        # ((1, 8), (rows, k / 8)): one 16-byte vector per index.
        gW = cute.zipped_divide(mW, (1, BF16_PER_VECTOR))
        gX = cute.zipped_divide(mX, (1, BF16_PER_VECTOR))
        w_atom = weight_load_atom(bf16)
        x_atom = coherent_copy_atom(bf16)
        mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(bf16, f32, (16, 8, 16)))

        acc = [[cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), f32) for _ in range(NT)]
               for _ in range(MB)]
        for mb in cutlass.range_constexpr(MB):
            for nt in cutlass.range_constexpr(NT):
                acc[mb][nt].fill(0.0)

        # x rows this lane loads per (batch tile, half). Rows past `batch` only feed accumulator
        # rows that are never stored, so a partly valid half re-reads a valid row (no branch) and
        # a wholly invalid half is zero registers, not loaded.
        x_rows = []
        for mb in cutlass.range_constexpr(MB):
            for h in cutlass.range_constexpr(2):
                b_off = mb * BATCH_PER_TILE + h * 8
                if cutlass.const_expr(b_off >= B):
                    x_rows.append(None)
                elif cutlass.const_expr(b_off + 8 <= B):
                    x_rows.append(b_off + g)
                else:
                    x_rows.append(b_off + g % (B - b_off))

        # --- main loop ------------------------------------------------------------------------
        # Each group is U k-steps: U x (NT weight + up to 2*MB activation) 16-byte loads per lane,
        # then 2*MB*NT mmas per step. With `prefetch`, the next group's loads are issued before
        # the current group's mmas (register double buffering), so loads stay in flight across
        # the loop's back edge instead of ptxas interleaving each load with its first use.
        n_iter = self.steps_per_warp // U
        tail = self.steps_per_warp % U
        ld = (gW, gX, w_atom, x_atom, warp, g, q, row0, x_rows)
        if cutlass.const_expr(self.prefetch and n_iter > 1):
            cur = self._load_steps(*ld, 0, U)
            for it in cutlass.range(n_iter - 1, unroll=1):
                nxt = self._load_steps(*ld, (it + 1) * U, U)
                self._mma_steps(mma, acc, cur)
                for a, b in zip(_flat(cur), _flat(nxt)):
                    a.store(b.load())
            if cutlass.const_expr(tail > 0):
                last = self._load_steps(*ld, n_iter * U, tail)
                self._mma_steps(mma, acc, cur)
                self._mma_steps(mma, acc, last)
            else:
                self._mma_steps(mma, acc, cur)
        else:
            for it in cutlass.range(n_iter, unroll=1):
                self._mma_steps(mma, acc, self._load_steps(*ld, it * U, U))
            if cutlass.const_expr(tail > 0):
                self._mma_steps(mma, acc, self._load_steps(*ld, n_iter * U, tail))

        # --- reduce the warps' partials in shared memory, in warp order ----------------------
        smem = cutlass.memory.SmemAllocator()
        sP = smem.allocate_tensor(f32, cute.make_layout((R, B, W)), byte_alignment=16)
        for mb in cutlass.range_constexpr(MB):
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    b_off = mb * BATCH_PER_TILE + (i // 2) * 8  # c0,c1: row g; c2,c3: row g + 8
                    if cutlass.const_expr(b_off < B):
                        r = nt * ROWS_PER_TILE + 2 * q + (i % 2)
                        if cutlass.const_expr(b_off + 8 <= B):
                            sP[r, b_off + g, warp] = acc[mb][nt][i]
                        else:
                            if g < B - b_off:
                                sP[r, b_off + g, warp] = acc[mb][nt][i]
        cute.arch.sync_threads()

        total = B * R
        T = self.threads
        for j in cutlass.range_constexpr(ceil_div(total, T)):
            idx = tidx + j * T
            if idx < total:
                b = idx // R
                r = idx % R
                s = sP[r, b, 0]
                for w in cutlass.range_constexpr(1, W):
                    s = s + sP[r, b, w]
                mY[b, row0 + r] = s.to(mY.element_type)

    def _load_steps(self, gW, gX, w_atom, x_atom, warp, g, q, row0, x_rows, first, count):
        """Trace-time helper: issue this lane's loads for `count` k steps from its step `first`.

        Returns (w, x): per step, NT weight vectors and one activation vector per x row slot
        (None for padding rows). Plain Python: every branch here is decided at trace time.
        """
        W = self.warps
        bf16 = cutlass.BFloat16
        vec = cute.make_layout(((1, BF16_PER_VECTOR),))
        wv, xv = [], []
        for u in range(count):
            kv = ((first + u) * W + warp) * (K_STEP // BF16_PER_VECTOR) + q
            wv_u = []
            for nt in range(self.row_tiles):
                t = cute.make_rmem_tensor(vec, bf16)
                cute.copy(w_atom, gW[(None, (row0 + nt * ROWS_PER_TILE + g, kv))], t)
                wv_u.append(t)
            xv_u = []
            for row in x_rows:
                if row is None:
                    xv_u.append(None)
                else:
                    t = cute.make_rmem_tensor(vec, bf16)
                    cute.copy(x_atom, gX[(None, (row, kv))], t)
                    xv_u.append(t)
            wv.append(wv_u)
            xv.append(xv_u)
        return wv, xv

    def _mma_steps(self, mma, acc, frags):
        """Trace-time helper: the 2*MB*NT mmas of each loaded k step (see the module docstring)."""
        wv, xv = frags
        bf16 = cutlass.BFloat16
        u32 = cutlass.Uint32
        for u in range(len(wv)):
            w32 = [cute.recast_tensor(t, u32) for t in wv[u]]
            for mb in range(self.batch_tiles):
                lo32 = cute.recast_tensor(xv[u][2 * mb], u32)
                hi = xv[u][2 * mb + 1]
                hi32 = None if hi is None else cute.recast_tensor(hi, u32)
                for half in range(2):
                    # A regs: (row g, k slots 2q,2q+1), (row g+8, same), (row g, 2q+8,2q+9), (row g+8, same)
                    a = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, 1)), bf16)
                    a32 = cute.recast_tensor(a, u32)
                    a32[0] = lo32[2 * half]
                    a32[2] = lo32[2 * half + 1]
                    a32[1] = u32(0) if hi32 is None else hi32[2 * half]
                    a32[3] = u32(0) if hi32 is None else hi32[2 * half + 1]
                    for nt in range(self.row_tiles):
                        # B regs: (k slots 2q,2q+1, col g), (2q+8, 2q+9, col g)
                        bfrag = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 1)), bf16)
                        b32 = cute.recast_tensor(bfrag, u32)
                        b32[0] = w32[nt][2 * half]
                        b32[1] = w32[nt][2 * half + 1]
                        cute.gemm(mma, acc[mb][nt], a, bfrag, acc[mb][nt])


def _flat(frags):
    """The loaded vectors of a (w, x) fragment group, in a fixed order (padding slots skipped)."""
    wv, xv = frags
    return [t for step in wv for t in step] + [t for step in xv for t in step if t is not None]
