"""Trace-time pieces of the "bulk" streaming engine: persistent CTAs that read whole weight rows
by bulk copy into a ring of row slots, for a decode GEMV at the smallest batches (kernels/ops/
router.py's stream design with `stream_engine` 1).

Why a second engine beside kernels/ops/stream.py: the stream engine's many short CTAs each copy
their rows, wait, compute and exit, so an SM's bytes in flight dip at every CTA's compute, exit
and launch, and every CTA fetches x again; at batch 1 it reached 0.94-0.96 of a pure read of
the same bytes (evidence_reports/moe_block/round8/). Here a CTA is launched once per SM and keeps
`stages` rows in flight all the time: a row is one `cp.async.bulk` (the copy engine moves its
bytes; no thread issues a per-16-byte copy), x is read once per CTA into registers.

Work: the rows of the matrices the op reads, concatenated (the router's W_g first, then W_down),
dealt round robin: CTA c owns rows c, c + ctas, c + 2 * ctas, ... in that order, so every CTA
reads its rows of the first matrix first and they are all done early in the launch.

Roles: warps 0 .. `warps`-1 consume, warp `warps` produces.
  * Ring slot s (one row of k bf16) has a full mbarrier (one arrival: the producer's expect-tx
    of the row's bytes, completed by the copy) and an empty one (one arrival per consumer warp).
  * The producer (lane 0 issues; the whole warp waits, so that every thread of the CTA reaches
    the pdl trigger at the same point) first fills every slot, then, per row i of its CTA:
    waits on slot i % stages's empty barrier, sums the consumer warps' partials of row i in
    warp order, stores the row's outputs, and refills the slot with row i + stages.
  * Consumer lane l of warp w owns the 16-byte vectors (w * V + j) * 32 + l, j < V, of every
    row (each j: 512 contiguous bytes per warp, no bank conflict), with the same slice of x in
    registers (fp32, read after the pdl wait). Per row: wait on the full barrier, fp32 FMAs in a
    fixed order, the warp's butterfly sum, lane 0 writes the partial and arrives on the empty
    barrier (release: the producer's wait acquires the partial).
Every sum runs in a fixed order, so a run gives the same bits every time. The slot's bytes are
written by the copy engine (async proxy) and read by plain shared loads; the full barrier orders
the read after the write, the empty barrier the next write after the read.

`BulkPlan` is host-side (plain Python); the functions run at trace time inside a `@cute.kernel`.
"""

from kernels.ops.common import BF16_PER_VECTOR, WARP, ceil_div, coherent_copy_atom, cute, cutlass

RING_ALIGN = 128  # bytes: a bulk copy needs 16; a slot starts on a 128-byte line


class BulkPlan:
    """`ctas` persistent CTAs over `rows` rows of k bf16 (the matrices' rows concatenated),
    `stages` row slots each, `warps` consumer warps (+1 producer), for `batch` activation rows."""

    def __init__(self, *, rows: int, k: int, ctas: int, stages: int, warps: int, batch: int):
        if min(rows, ctas, stages, warps, batch) < 1:
            raise ValueError("bulk: rows, ctas, stages, warps and batch must be positive")
        if k % BF16_PER_VECTOR:
            raise ValueError(f"bulk: k={k} is not a multiple of {BF16_PER_VECTOR}")
        kv = k // BF16_PER_VECTOR
        if kv % (warps * WARP):
            raise ValueError(f"bulk: k={k} has {kv} 16-byte vectors per row, not a multiple of "
                             f"{warps} consumer warps x {WARP} lanes")
        if (warps + 1) * WARP > 1024:
            raise ValueError(f"bulk: {warps} consumer warps and the producer exceed 1024 threads")
        self.rows, self.k, self.kv = rows, k, kv
        self.ctas, self.stages, self.warps, self.batch = ctas, stages, warps, batch
        self.vectors = kv // (warps * WARP)  # V: 16-byte vectors per lane per row
        self.threads = (warps + 1) * WARP
        self.row_bytes = k * 2
        self.max_rows_per_cta = ceil_div(rows, ctas)

    def rows_of(self, c: int, first: int = 0, end: int | None = None) -> int:
        """How many of rows [first, end) CTA c owns (rows c, c + ctas, ...): the host's model of
        the kernel's loop bounds."""
        end = self.rows if end is None else end
        return sum(1 for u in range(c, self.rows, self.ctas) if first <= u < end)

    def ring_elems(self) -> int:
        return self.stages * self.k

    def smem_bytes(self, union_elems: int) -> int:
        """The ring (or `union_elems` bf16, if larger: what else reuses it), the partials
        [stages, batch, warps] fp32, 2 * stages mbarriers, alignment slack."""
        ring = max(self.ring_elems(), union_elems) * 2
        partials = ceil_div(self.stages * self.batch * self.warps * 4, 16) * 16
        return ring + RING_ALIGN + partials + 2 * self.stages * 8 + 64


def init_barriers(plan: BulkPlan, full, empty):
    """Trace-time, one thread: initialise the full (1 arrival) and empty (`warps` arrivals)
    barrier of every slot; the caller syncs the CTA after."""
    for st in range(plan.stages):
        cute.arch.mbarrier_init(full + st, 1)
        cute.arch.mbarrier_init(empty + st, plan.warps)
    cute.arch.mbarrier_init_fence()


def issue_row(plan: BulkPlan, src, ring, slot, full):
    """Trace-time, one thread: expect the row's bytes on slot `slot`'s full barrier and copy
    global row `src` (a bf16 pointer to its first element) into the slot by one bulk copy."""
    from cutlass.experimental import primitives as prims

    bar = full + slot
    cute.arch.mbarrier_arrive_and_expect_tx(bar, plan.row_bytes)
    prims.cp_async_bulk_shared_cluster_global(ring.iterator + slot * plan.k, src, bar, plan.row_bytes)


def load_x(plan: BulkPlan, mX, warp, lane):
    """Trace-time, a consumer lane: its slice of every activation row of x [batch, k] (plain
    coherent loads: x is an activation), as fp32 vectors xs[b][j]."""
    bf16 = cutlass.BFloat16
    f32 = cutlass.Float32
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = coherent_copy_atom(bf16)
    gX = cute.zipped_divide(mX, (1, BF16_PER_VECTOR))
    xs = []
    for b in range(plan.batch):
        row = []
        for j in range(plan.vectors):
            kv = (warp * plan.vectors + j) * WARP + lane
            xt = cute.make_rmem_tensor(flat, bf16)
            src = gX[(None, (b, kv))]
            cute.copy(atom, cute.make_tensor(src.iterator, flat), xt)
            row.append(xt.load().to(f32))
        xs.append(row)
    return xs


def dot_slot(plan: BulkPlan, vR, slot, xs, warp, lane):
    """Trace-time, a consumer lane: its fp32 partial dot products of ring slot `slot`'s row
    (vR: the ring as 16-byte vectors) with each activation row, vector by vector, element by
    element. Returns one Float32 per activation row."""
    f32 = cutlass.Float32
    bf16 = cutlass.BFloat16
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = coherent_copy_atom(bf16)
    acc = [f32(0.0) for _ in range(plan.batch)]
    for j in range(plan.vectors):
        kv = (warp * plan.vectors + j) * WARP + lane
        wt = cute.make_rmem_tensor(flat, bf16)
        cute.copy(atom, vR[(None, slot * plan.kv + kv)], wt)
        wf = wt.load().to(f32)
        for b in range(plan.batch):
            for e in range(BF16_PER_VECTOR):
                acc[b] = acc[b] + wf[e] * xs[b][j][e]
    return acc
