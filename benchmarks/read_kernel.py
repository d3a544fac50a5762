"""A Triton kernel that reads every byte of a buffer once: the read-only streaming ceiling.

Imported lazily by benchmarks/common.py (triton exists only on the GPU host).
"""

import triton
import triton.language as tl


@triton.jit
def read_sum_kernel(src, partial, n_elem, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS blocks of int32 words (16-byte vector loads) and writes one word:
    the bytes written are negligible, every load stays live."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for it in tl.range(ITERS):
        offs = base + it * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n_elem, other=0)
    tl.store(partial + pid, tl.sum(acc, 0))
