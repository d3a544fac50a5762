"""Trace-time building blocks of the "stream" decode GEMV: the design that reads weights at the
smallest batches the way the read-only ceiling reads a buffer (kernels/ops/gemv.py, batch 1).

Why it exists (evidence_reports/foundation/): at batch 1 a weight byte feeds one FMA, so the
tensor cores buy nothing and all that matters is how many bytes are in flight. Loads into
registers do not stay in flight together: ptxas sinks each to its first use (one or two
outstanding per thread) and moves `ld.global.nc` across barriers. So a CTA here owns a few
whole rows (a contiguous block of W), every thread issues all of its 16-byte `cp.async` copies
(weights: `.cg`, L2 only; activations: `.ca`, kept in L1 for the SM's other CTAs) before it
waits once, and only then reads shared memory and runs the fp32 FMAs. Many short CTAs (several
per SM) keep the memory system full and the tail short.

Layout: thread t works on row `t // row_threads` of its CTA and on every `row_threads`-th
16-byte vector of it, starting at vector `t % row_threads`: each warp copy is 512 contiguous
bytes of one row. A thread reads back only the weight vectors it copied itself (its own
cp.async wait orders them); activations copied by other threads need the CTA barrier after the
wait. The row's threads (whole warps) meet by warp shuffles, then in shared memory in warp
order, so every sum runs in a fixed order (bitwise deterministic).

`StreamPlan` is host-side (plain Python); the functions run at trace time inside a
`@cute.kernel` (those with a run-time branch are `@cute.jit`).
"""

from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, coherent_copy_atom, cute, cutlass, warp_allreduce_sum


class StreamPlan:
    """How a CTA covers whole rows of k bf16 weights: `rows` rows per CTA (the largest power of
    two with rows * k * 2 <= `cta_bytes`, at least 1, dividing `n`, leaving >= one warp per
    row), `row_threads` threads per row (whole warps dividing the row's 16-byte vectors,
    at most threads / rows), `vectors` 16-byte vectors per thread; `threads`, `warps` per CTA."""

    def __init__(self, *, n: int, k: int, threads: int, cta_bytes: int):
        if threads % WARP or not WARP <= threads <= 1024 or cta_bytes < 1:
            raise ValueError("stream: threads must be a multiple of 32 up to 1024, the CTA's bytes positive")
        if k % BF16_PER_VECTOR:
            raise ValueError(f"stream: k={k} is not a multiple of {BF16_PER_VECTOR}")
        kv = k // BF16_PER_VECTOR
        rows = 1
        while rows * 2 * k * 2 <= cta_bytes and threads // (rows * 2) >= WARP and n % (rows * 2) == 0:
            rows *= 2
        row_threads = threads // rows
        while kv % row_threads and row_threads > WARP:  # fewer warps rather than a ragged row
            row_threads -= WARP
        if n % rows or kv % row_threads:
            raise ValueError(f"stream: k={k} has {kv} 16-byte vectors per row, not a multiple of "
                             f"{row_threads} threads per row")
        self.n, self.k, self.kv = n, k, kv
        self.rows = rows
        self.row_threads = row_threads
        self.threads = rows * row_threads
        self.warps = self.threads // WARP
        self.warps_per_row = row_threads // WARP
        self.vectors = kv // row_threads
        self.ctas = n // rows

    def smem_bytes(self, w_rows: int, x_rows: int, partials: int) -> int:
        """Shared memory for `w_rows` weight rows and `x_rows` activation rows of k bf16 each and
        `partials` fp32 values, each region 16-byte aligned, plus the allocator's slack."""
        return (w_rows + x_rows) * self.k * 2 + partials * 4 + 64


def weight_copy_atom(dtype):
    """16-byte cp.async global->shared through L2 only (`.cg`): weights are streamed once."""
    return cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), dtype,
        num_bits_per_copy=128)


def activation_copy_atom(dtype):
    """16-byte cp.async global->shared kept in L1 (`.ca`): every CTA of the SM reads the same x."""
    return cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.ALWAYS), dtype,
        num_bits_per_copy=128)


def copy_row(plan: StreamPlan, atom, gV, row, vS, s_base, kv0):
    """Issue this thread's copies of global row `row` of `gV` (a `vector_view`: ((1, 8), (rows,
    k / 8))) into the shared vectors `vS` (((8), vectors)) from vector `s_base`: vectors kv0,
    kv0 + row_threads, ... (`plan.vectors` of them). The caller commits and waits."""
    flat = cute.make_layout((BF16_PER_VECTOR,))
    for j in range(plan.vectors):
        kv = kv0 + j * plan.row_threads
        src = gV[(None, (row, kv))]
        cute.copy(atom, cute.make_tensor(src.iterator, flat), vS[(None, s_base + kv)])


def widen(t):
    """The BF16_PER_VECTOR bf16 of the register vector `t` as fp32 (a TensorSSA), exactly: a
    bf16 is the top half of its fp32, so each 32-bit word of two gives its first element by a
    shift and its second by a mask, one instruction each (the generic conversion spends two on
    the second: a byte permute, then the shift)."""
    u32 = cutlass.Uint32
    words = cute.recast_tensor(t, u32)
    out = cute.make_rmem_tensor(cute.make_layout((BF16_PER_VECTOR,)), u32)
    for i in range(BF16_PER_VECTOR // 2):
        w = words[i]
        out[2 * i] = w << u32(16)
        out[2 * i + 1] = w & u32(0xFFFF0000)
    return cute.recast_tensor(out, cutlass.Float32).load()


def dot(plan: StreamPlan, vW, w_base, vX, x_bases, kv0, w_regs=None):
    """This thread's fp32 partial dot products of its weight vectors (shared, from vector
    `w_base`; or, given `w_regs`, those register tensors, one per vector, `vW` and `w_base`
    unused) with each activation row (shared, from vector `x_bases[b]`), summed in a fixed
    order: vector by vector, element by element. Returns one Float32 per activation row."""
    f32 = cutlass.Float32
    bf16 = cutlass.BFloat16
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = coherent_copy_atom(bf16)
    acc = [f32(0.0) for _ in x_bases]
    for j in range(plan.vectors):
        kv = kv0 + j * plan.row_threads
        if w_regs is None:
            wt = cute.make_rmem_tensor(flat, bf16)
            cute.copy(atom, vW[(None, w_base + kv)], wt)
        else:
            wt = w_regs[j]
        wf = widen(wt)
        for b, xb in enumerate(x_bases):
            xt = cute.make_rmem_tensor(flat, bf16)
            cute.copy(atom, vX[(None, xb + kv)], xt)
            xf = widen(xt)
            for e in range(BF16_PER_VECTOR):
                acc[b] = acc[b] + wf[e] * xf[e]
    return acc


@cute.jit
def publish_partials(acc, sP, warp, lane):
    """Sum each partial over the warp (butterfly) and let lane 0 write it to sP[b, warp]. The
    caller syncs the CTA before `row_total` reads them."""
    totals = [warp_allreduce_sum(a) for a in acc]
    if lane == 0:
        for b in cutlass.range_constexpr(len(totals)):
            sP[b, warp] = totals[b]


def row_total(plan: StreamPlan, sP, r, b):
    """The total of row `r` (of the CTA) for activation row `b`: its warps' sums in warp order."""
    w0 = r * plan.warps_per_row
    s = sP[b, w0]
    for w in range(1, plan.warps_per_row):
        s = s + sP[b, w0 + w]
    return s
