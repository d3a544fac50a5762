"""Split-K decode GEMV with a last-CTA-reduces epilogue: y = x @ W.T for skinny, deep shapes.

The router shape (W [896, 7168]) has too few rows to fill 132 SMs with one CTA per row tile,
so k is split too: CTA (tile, split) computes the partial sums of `rows_per_cta` rows over one
k chunk and writes them to `partials[split, b, row]` (scratch). Then, after a CTA barrier,
thread 0 adds 1 to the tile's gpu-scope counter with acq_rel semantics (releasing this CTA's
partials, acquiring the others'); the CTA that sees `splits - 1` arrived last: it resets the
counter to 0 with a release store (ready for the next launch; no CTA of this launch reads it
again), and after a CTA barrier that broadcasts the verdict its threads sum the partials of
their outputs in split order 0..splits-1, a fixed order, so the result is bitwise
deterministic. The host zeroes `counters` once; every launch leaves them zero.

Per CTA: `warps` warps, each owning `rows_per_warp` rows; each lane keeps every 16-byte weight
load of its rows in flight (W through the non-coherent path: it is static), x through plain
loads, fp32 accumulation, butterfly warp reductions.

Mutants (compile-time, for the race audit only; never tunables):
  relaxed_atomic     the arrival add is relaxed and unfenced (publishes nothing, acquires nothing);
  missing_barrier    no CTA barrier between the partial stores and thread 0's arrival add;
  nc_partials        the last CTA reads the partials through non-coherent loads;
  divergent_barrier  the barrier that broadcasts the verdict is inside `if tidx == 0`
                     (compile-only: it would hang).
"""

from __future__ import annotations

import torch

from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import cute, cutlass

MUTANTS = ("relaxed_atomic", "missing_barrier", "nc_partials", "divergent_barrier")
WARP = 32
VEC = 8  # bf16 per 16-byte load
MAX_BATCH = 8  # accumulators live in registers: rows_per_warp * batch per lane
SMEM_BYTES = 16  # the last-CTA verdict, broadcast through dynamic shared memory


def splitk_gemv_ref(x, w):
    """y = x @ w.T with fp32 accumulation, fp32 out."""
    return x.float() @ w.float().t()


class SplitKGemvOp(OpBase):
    kernel_name = "splitk_gemv"
    # the tunables' defaults: kernels/manifest.toml [kernels.splitk_gemv.tunables]
    TUNABLES = ("splits", "warps", "rows_per_warp")

    def __init__(self, shape: dict, mutant: str | None = None, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        if mutant is not None and mutant not in MUTANTS:
            raise ValueError(f"unknown splitk_gemv mutant {mutant!r}; mutants are {', '.join(MUTANTS)}")
        self.mutant = mutant
        self.batch, self.n, self.k = int(shape["batch"]), int(shape["n"]), int(shape["k"])
        self.splits = int(self.tunables["splits"])
        self.warps = int(self.tunables["warps"])
        self.rows_per_warp = int(self.tunables["rows_per_warp"])
        self.rows_per_cta = self.warps * self.rows_per_warp
        if self.batch > MAX_BATCH:
            raise ValueError(f"splitk_gemv: batch {self.batch} > {MAX_BATCH} (register accumulators)")
        if self.n % self.rows_per_cta:
            raise ValueError(f"splitk_gemv: n {self.n} is not a multiple of rows_per_cta {self.rows_per_cta}")
        if self.k % (self.splits * WARP * VEC):
            raise ValueError(f"splitk_gemv: k {self.k} does not split into {self.splits} chunks of 32 lanes x {VEC}")
        if self.rows_per_cta * self.batch > self.warps * WARP:
            raise ValueError("splitk_gemv: rows_per_cta * batch outputs exceed the CTA's threads")
        self.tiles = self.n // self.rows_per_cta
        self.k_chunk = self.k // self.splits
        self.n_vec = self.k_chunk // (WARP * VEC)

    def variant_key(self) -> str:
        return super().variant_key() + (f"_mut{self.mutant}" if self.mutant else "")

    def tensor_specs(self):
        return {
            "x": TensorSpec((self.batch, self.k), "bfloat16"),
            "w": TensorSpec((self.n, self.k), "bfloat16"),
            "y": TensorSpec((self.batch, self.n), "float32"),
            "partials": TensorSpec((self.splits, self.batch, self.n), "float32"),
            "counters": TensorSpec((self.tiles,), "int32"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.tiles, self.splits, 1), block=(self.warps * WARP, 1, 1),
                            smem_bytes=SMEM_BYTES)

    def reference(self, x, w, y=None, partials=None, counters=None):
        return {"y": splitk_gemv_ref(x, w)}

    @staticmethod
    def make_inputs(op: "SplitKGemvOp", device="cpu", seed: int = 0) -> dict:
        g = torch.Generator(device="cpu").manual_seed(seed)
        t = {
            "x": torch.randn((op.batch, op.k), generator=g).to(torch.bfloat16).to(device),
            "w": (torch.randn((op.n, op.k), generator=g) * 0.05).to(torch.bfloat16).to(device),
            "y": torch.full((op.batch, op.n), float("nan"), device=device),
            "partials": torch.full((op.splits, op.batch, op.n), float("nan"), device=device),
            "counters": torch.zeros((op.tiles,), dtype=torch.int32, device=device),
        }
        return t

    # -- device code --------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mP: cute.Tensor, mC: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mW, mY, mP, mC).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mP: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tile, split, _ = cute.arch.block_idx()
        lane = tidx % WARP
        warp = tidx // WARP
        f32 = cutlass.Float32
        w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), cutlass.BFloat16, num_bits_per_copy=128, invariant=True)
        x_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
        smem = cutlass.utils.SmemAllocator()
        sLast = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)

        row0 = tile * self.rows_per_cta + warp * self.rows_per_warp
        vec0 = split * (self.k_chunk // VEC)  # first 8-element vector of this split
        # Every weight load of this lane first (all in flight), then x and the FMAs.
        wv = cute.make_rmem_tensor((VEC, self.n_vec, self.rows_per_warp), cutlass.BFloat16)
        for r in cutlass.range_constexpr(self.rows_per_warp):
            for i in cutlass.range_constexpr(self.n_vec):
                cute.copy(w_atom, cute.local_tile(mW[row0 + r, None], (VEC,), (vec0 + i * WARP + lane,)),
                          wv[None, i, r])
        acc = cute.make_rmem_tensor((self.rows_per_warp, self.batch), f32)
        acc.fill(0.0)
        for b in cutlass.range_constexpr(self.batch):
            for i in cutlass.range_constexpr(self.n_vec):
                xv = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                cute.copy(x_atom, cute.local_tile(mX[b, None], (VEC,), (vec0 + i * WARP + lane,)), xv)
                for r in cutlass.range_constexpr(self.rows_per_warp):
                    for e in cutlass.range_constexpr(VEC):
                        acc[r, b] += f32(wv[e, i, r]) * f32(xv[e])
        for r in cutlass.range_constexpr(self.rows_per_warp):
            for b in cutlass.range_constexpr(self.batch):
                v = acc[r, b]
                for sh in cutlass.range_constexpr(5):
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> sh)
                if lane == 0:
                    mP[split, b, row0 + r] = v

        # Arrival: this CTA's partials are written (barrier), then one acq_rel add.
        if cutlass.const_expr(self.mutant != "missing_barrier"):
            cute.arch.sync_threads()
        if tidx == 0:
            if cutlass.const_expr(self.mutant == "relaxed_atomic"):
                old = cute.arch.atomic_add(mC.iterator + tile, cutlass.Int32(1), sem="relaxed", scope="gpu")
            else:
                old = cute.arch.atomic_add(mC.iterator + tile, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            last = cutlass.Int32(0)
            if old == self.splits - 1:
                last = cutlass.Int32(1)
                # Every CTA of this tile has arrived: nothing reads the counter again this launch.
                cute.arch.store(mC.iterator + tile, cutlass.Int32(0), sem="release", scope="gpu")
            sLast[0] = last
            if cutlass.const_expr(self.mutant == "divergent_barrier"):
                cute.arch.sync_threads()
        if cutlass.const_expr(self.mutant != "divergent_barrier"):
            cute.arch.sync_threads()
        if sLast[0] == 1:
            # Last CTA: outputs (row, b) of this tile, summed in split order (deterministic).
            if tidx < self.rows_per_cta * self.batch:
                rr = tidx % self.rows_per_cta
                bb = tidx // self.rows_per_cta
                row = tile * self.rows_per_cta + rr
                total = f32(0.0)
                for s in cutlass.range_constexpr(self.splits):
                    if cutlass.const_expr(self.mutant == "nc_partials"):
                        pv = cute.make_rmem_tensor((1,), f32)
                        nc_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), f32, num_bits_per_copy=32, invariant=True)
                        cute.copy(nc_atom, cute.local_tile(mP[s, bb, None], (1,), (row,)), pv)
                        total = total + pv[0]
                    else:
                        total = total + mP[s, bb, row]
                mY[bb, row] = total


def _mutant_class(mutant: str) -> type:
    """A subclass with `mutant` fixed, so the real build (which takes "module:Class") builds it."""
    return type(f"SplitKGemvOp_{mutant}", (SplitKGemvOp,), {
        "__init__": lambda self, shape, **tun: SplitKGemvOp.__init__(self, shape, mutant=mutant, **tun),
        "__module__": __name__,
    })


MUTANT_OPS = {m: _mutant_class(m) for m in MUTANTS}
globals().update({cls.__name__: cls for cls in MUTANT_OPS.values()})
