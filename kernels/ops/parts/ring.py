"""Trace-time building blocks of a weight ring: a persistent CTA streams the static weights of
its work items, one item per slot, through `slots` shared-memory slots filled by bulk copies
(`cp.async.bulk`, the copy engine, no tensor map) that complete on one mbarrier per slot.

Why it exists (docs/decisions.md, the megakernel): a decode step reads its weights once, so
all that matters is how many bytes are in flight per SM. The read ceiling itself is a bulk-copy
reader with four 32 KiB chunks in flight per SM and one CTA per SM (benchmarks/read_kernel.py).
A persistent kernel that copies an item, waits for it and computes it before copying the next
keeps one item in flight; with the ring, one thread issues item j + slots - 1 while item j is
computed, so `slots - 1` items are always in flight, and since weights are static the copies
of the next stage's first items are issued before the stage's wait (activations are never
copied by the ring: the caller loads them after its waits, by coherent loads).

Protocol, for a ring of `slots` slots and items numbered j = 0, 1, ... in the order both sides
walk them:
  * issue (one thread): item j goes to slot j % slots; the thread arms the slot's mbarrier with
    the item's bytes (`mbarrier.arrive.expect_tx`) and issues its copies, which complete the
    phase; an item with no bytes (a routed expert's item past the launch's groups) arrives
    without bytes, so the phase completes at once;
  * consume (every thread): wait on slot j % slots for phase parity (j // slots) % 2, read the
    item's weights from shared memory;
  * reuse: item j + slots overwrites slot j % slots; the caller issues it only after a CTA
    barrier that follows every thread's reads of item j (generic-proxy reads, then the copy
    engine's writes, ordered by that barrier as in every TMA pipeline).
`RingPlan` is host-side (plain Python); the functions run at trace time in a `@cute.kernel`.
"""

from kernels.ops.parts.common import HAVE_DSL, cute, cutlass

MBARRIER_BYTES = 8
# L2 eviction policy of a streamed weight (read once per step): evict first (the createpolicy
# encoding the TMA paths use, kernels/ops/parts/wg_ring.py)
EVICT_FIRST = 0x12F0000000000000


class RingPlan:
    """`slots` slots of `slot_bytes` each (16-byte multiples), then one mbarrier per slot:
    `smem_bytes` in all, from a 128-byte aligned base."""

    def __init__(self, *, slots: int, slot_bytes: int):
        if slots < 2:
            raise ValueError(f"ring: at least 2 slots (one in flight while one is computed), got {slots}")
        if slot_bytes < 16 or slot_bytes % 128:
            raise ValueError(f"ring: a slot's bytes must be a positive multiple of 128, got {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.bars_offset = slots * slot_bytes
        self.smem_bytes = self.bars_offset + slots * MBARRIER_BYTES


def smem_tensors(base, plan: RingPlan):
    """Trace-time: the ring's slots as one bf16 tensor (slot s at element s * slot_bytes / 2)
    and its mbarriers (an Int64 pointer), over shared memory from the byte pointer `base`."""
    slots = cute.make_tensor(cute.recast_ptr(base, dtype=cutlass.BFloat16),
                             cute.make_layout((plan.slots * plan.slot_bytes // 2,)))
    bars = cute.recast_ptr(base + plan.bars_offset, dtype=cutlass.Int64)
    return slots, bars


@cute.jit
def init(bars, plan: RingPlan, tidx):
    """Thread 0 initialises every slot's mbarrier (one arrival: the issuing thread's), then a
    CTA barrier; before any other use."""
    if tidx == 0:
        for s in cutlass.range_constexpr(plan.slots):
            cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def slot_ptr(slots, plan: RingPlan, slot):
    """Trace-time: a bf16 pointer to the first element of slot `slot` (run-time index)."""
    return slots.iterator + cute.assume(slot * (plan.slot_bytes // 2), divby=plan.slot_bytes // 2)


def arm(bars, slot, nbytes: int):
    """Trace-time, the issuing thread: arm slot `slot`'s mbarrier with the `nbytes` its copies
    will bring (0: an empty item, its phase completes at once)."""
    if nbytes:
        cute.arch.mbarrier_arrive_and_expect_tx(bars + slot, nbytes)
    else:
        cute.arch.mbarrier_arrive(bars + slot)


def copy(dst, src, nbytes: int, bars, slot):
    """Trace-time, the issuing thread: one bulk copy of `nbytes` (a multiple of 16) from the
    global bf16 pointer `src` to the shared bf16 pointer `dst`, completing on slot `slot`'s
    mbarrier; the source is a static weight, marked evict-first in L2."""
    from cutlass.experimental.primitives import nvvm_wrapper

    nvvm_wrapper.cp_async_bulk_shared_cluster_global(dst, src, bars + slot, nbytes, l2_cache_hint=EVICT_FIRST)


def wait(bars, plan: RingPlan, j):
    """Trace-time, every thread: wait until item `j`'s slot holds it (its phase has completed)."""
    cute.arch.mbarrier_wait(bars + j % plan.slots, (j // plan.slots) % 2)


