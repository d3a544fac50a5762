"""Persistent producer/consumer kernel: the cross-CTA pattern of the decode megakernel in small.

Every CTA stays resident for all `steps`. Producer CTAs (the first `producers`) write one
stage per step, `stage[j] = x[step, j] * gamma[j]` (fp32), each its own slice; consumer CTAs
(the other `consumers`) read the whole stage and compute `y[step, r] = stage . w[r]` for their
rows. One stage buffer is reused every step, so the protocol runs both ways through two
gpu-scope counters in `flags`:
  flags[0] "ready": each producer, after a CTA barrier, adds 1 with release; consumers spin on
           it with acquire (every thread) until it reaches producers * (step + 1);
  flags[1] "done":  each consumer, after a CTA barrier, adds 1 with release; a producer's
           thread 0 spins on it with acquire until it reaches consumers * step, then a CTA
           barrier, before overwriting the stage.
The host zeroes `flags` before each launch. All CTAs must be co-resident: the grid (producers
+ consumers CTAs) is kept far below the SM count.

Mutants (compile-time, for the race audit's tests and evidence only; never a tunable):
  nc_activation     consumers read the stage through a non-coherent (invariant) load: the
                    compiler may hoist it above the spin (the motivating bug);
  load_before_wait  consumers read the stage before spinning on "ready";
  relaxed_spin      consumers spin with a relaxed load and no acquire fence;
  relaxed_publish   producers publish "ready" with a relaxed add and no release fence;
  missing_barrier   producers publish "ready" with no CTA barrier after the stage writes.
"""

from __future__ import annotations

import torch

from kernels.ops.base import LaunchConfig, OpBase, TensorSpec
from kernels.ops.parts.common import cute, cutlass

MUTANTS = ("nc_activation", "load_before_wait", "relaxed_spin", "relaxed_publish", "missing_barrier")
THREADS = 128
VEC = 4  # fp32 stage elements per vector load (16 bytes)


def prodcons_ref(x, gamma, w):
    """y[s] = (x[s] * gamma) @ w.T in fp32 (the stage is fp32, as in the kernel)."""
    return (x.float() * gamma.float()) @ w.float().t()


class ProdConsOp(OpBase):
    kernel_name = "prodcons"

    def __init__(self, shape: dict, mutant: str | None = None, **tunables):
        super().__init__(shape, **tunables)
        if mutant is not None and mutant not in MUTANTS:
            raise ValueError(f"unknown prodcons mutant {mutant!r}; mutants are {', '.join(MUTANTS)}")
        self.mutant = mutant
        self.steps = int(shape["steps"])
        self.width = int(shape["width"])
        self.rows = int(shape["rows"])
        self.producers = int(shape.get("producers", 2))
        self.consumers = int(shape.get("consumers", 4))
        warps = THREADS // 32
        if self.width % (self.producers * THREADS) or self.width % (32 * VEC):
            raise ValueError(f"width {self.width} must split into {self.producers} producers x {THREADS} threads "
                             f"and into 32 lanes x {VEC}")
        if self.rows % (self.consumers * warps):
            raise ValueError(f"rows {self.rows} must split into {self.consumers} consumers x {warps} warps")
        if self.producers + self.consumers > 64:
            raise ValueError("producers + consumers must stay far below the SM count (co-residency)")
        self.rows_per_warp = self.rows // (self.consumers * warps)

    def variant_key(self) -> str:
        return super().variant_key() + (f"_mut{self.mutant}" if self.mutant else "")

    def tensor_specs(self):
        return {
            "x": TensorSpec((self.steps, self.width), "bfloat16"),
            "gamma": TensorSpec((self.width,), "bfloat16"),
            "w": TensorSpec((self.rows, self.width), "bfloat16"),
            "stage": TensorSpec((self.width,), "float32"),
            "flags": TensorSpec((2,), "int32"),
            "y": TensorSpec((self.steps, self.rows), "float32"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.producers + self.consumers, 1, 1), block=(THREADS, 1, 1),
                            cooperative=True)

    def reference(self, x, gamma, w, stage=None, flags=None, y=None):
        return {"y": prodcons_ref(x, gamma, w)}

    @staticmethod
    def make_inputs(op: "ProdConsOp", device="cpu", seed: int = 0) -> dict:
        """Random inputs (and poisoned outputs) for one launch."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        specs = op.tensor_specs()
        t = {}
        for name in ("x", "gamma", "w"):
            s = specs[name]
            t[name] = torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)).to(device)
        t["stage"] = torch.full(specs["stage"].shape, float("nan"), device=device)
        t["flags"] = torch.zeros(specs["flags"].shape, dtype=torch.int32, device=device)
        t["y"] = torch.full(specs["y"].shape, float("nan"), device=device)
        return t

    # -- device code --------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mX: cute.Tensor, mGamma: cute.Tensor, mW: cute.Tensor, mStage: cute.Tensor,
               mFlags: cute.Tensor, mY: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mX, mGamma, mW, mStage, mFlags, mY).launch(grid=list(lc.grid), block=list(lc.block))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mGamma: cute.Tensor, mW: cute.Tensor, mStage: cute.Tensor,
               mFlags: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ready = mFlags.iterator
        done = mFlags.iterator + 1
        # Static weights are read-only for the launch: non-coherent loads are allowed there.
        w_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), cutlass.BFloat16, num_bits_per_copy=64, invariant=True)
        stage_atom = cute.make_copy_atom(
            cute.nvgpu.CopyG2ROp(), cutlass.Float32, num_bits_per_copy=128,
            invariant=cutlass.const_expr(self.mutant == "nc_activation"))
        per_producer = self.width // self.producers
        if bidx < self.producers:
            # ---------------- producer ----------------
            for step in cutlass.range(self.steps):
                if tidx == 0:
                    # The stage may be overwritten once every consumer finished the previous step.
                    need = cutlass.Int32(self.consumers) * step
                    seen = cute.arch.load(done, cutlass.Int32, sem="acquire", scope="gpu")
                    while seen < need:
                        seen = cute.arch.load(done, cutlass.Int32, sem="acquire", scope="gpu")
                cute.arch.sync_threads()
                for i in cutlass.range_constexpr(per_producer // THREADS):
                    j = bidx * per_producer + i * THREADS + tidx
                    mStage[j] = cutlass.Float32(mX[step, j]) * cutlass.Float32(mGamma[j])
                if cutlass.const_expr(self.mutant != "missing_barrier"):
                    cute.arch.sync_threads()
                if tidx == 0:
                    if cutlass.const_expr(self.mutant == "relaxed_publish"):
                        cute.arch.red(ready, cutlass.Int32(1), op="add", dtype="s32", sem="relaxed", scope="gpu")
                    else:
                        cute.arch.red(ready, cutlass.Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
        else:
            # ---------------- consumer ----------------
            c = bidx - self.producers
            lane = tidx % 32
            warp = tidx // 32
            row0 = (c * (THREADS // 32) + warp) * self.rows_per_warp
            n_vec = self.width // (32 * VEC)
            for step in cutlass.range(self.steps):
                sv = cute.make_rmem_tensor((VEC, n_vec), cutlass.Float32)
                if cutlass.const_expr(self.mutant == "load_before_wait"):
                    for i in cutlass.range_constexpr(n_vec):
                        cute.copy(stage_atom, cute.local_tile(mStage, (VEC,), (i * 32 + lane,)), sv[None, i])
                need = cutlass.Int32(self.producers) * (step + 1)
                if cutlass.const_expr(self.mutant == "relaxed_spin"):
                    seen = cute.arch.load(ready, cutlass.Int32, sem="relaxed", scope="gpu")
                    while seen < need:
                        seen = cute.arch.load(ready, cutlass.Int32, sem="relaxed", scope="gpu")
                else:
                    # Every thread acquires for itself: no CTA barrier needed before the reads.
                    seen = cute.arch.load(ready, cutlass.Int32, sem="acquire", scope="gpu")
                    while seen < need:
                        seen = cute.arch.load(ready, cutlass.Int32, sem="acquire", scope="gpu")
                if cutlass.const_expr(self.mutant != "load_before_wait"):
                    for i in cutlass.range_constexpr(n_vec):
                        cute.copy(stage_atom, cute.local_tile(mStage, (VEC,), (i * 32 + lane,)), sv[None, i])
                for r in cutlass.range_constexpr(self.rows_per_warp):
                    row = row0 + r
                    acc = cutlass.Float32(0.0)
                    for i in cutlass.range_constexpr(n_vec):
                        wv = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                        cute.copy(w_atom, cute.local_tile(mW[row, None], (VEC,), (i * 32 + lane,)), wv)
                        for e in cutlass.range_constexpr(VEC):
                            acc += sv[e, i] * cutlass.Float32(wv[e])
                    acc = cute.arch.warp_reduction_sum(acc)
                    if lane == 0:
                        mY[step, row] = acc
                # Every thread's stage reads complete before the stage may be overwritten.
                cute.arch.sync_threads()
                if tidx == 0:
                    cute.arch.red(done, cutlass.Int32(1), op="add", dtype="s32", sem="release", scope="gpu")



def _mutant_class(mutant: str) -> type:
    """A subclass with `mutant` fixed, so the real build (which takes "module:Class") builds it."""
    return type(f"ProdConsOp_{mutant}", (ProdConsOp,), {
        "__init__": lambda self, shape, **tun: ProdConsOp.__init__(self, shape, mutant=mutant, **tun),
        "__module__": __name__,
    })


MUTANT_OPS = {m: _mutant_class(m) for m in MUTANTS}
globals().update({cls.__name__: cls for cls in MUTANT_OPS.values()})
