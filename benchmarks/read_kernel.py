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


# A bulk-copy reader: the streaming path the warpgroup kernels use (cp.async.bulk into shared
# memory, completion on an mbarrier), which reads DRAM faster than 16-byte register loads. One
# thread per CTA keeps STAGES chunks in flight; nothing is written but one word per CTA. Built by
# NVRTC through cupy on the GPU host (for the device it runs on: sm_90 has cp.async.bulk).
BULK_READ_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(32, 1)
bulk_read(const unsigned char* __restrict__ src, unsigned long long n_chunks, int* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar[STAGES];
  if (threadIdx.x != 0) return;
  unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  unsigned bars = (unsigned)__cvta_generic_to_shared(bar);
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(bars + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  unsigned long long first = blockIdx.x, step = gridDim.x;
  unsigned long long mine = first < n_chunks ? (n_chunks - first + step - 1) / step : 0;
  auto issue = [&](unsigned long long k) {
    int s = (int)(k % STAGES);
    const unsigned char* g = src + (first + k * step) * (unsigned long long)CHUNK;
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(bars + 8 * s), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(base + s * CHUNK), "l"(g), "r"(CHUNK), "r"(bars + 8 * s) : "memory");
  };
  for (unsigned long long k = 0; k < mine && k < STAGES; ++k) issue(k);
  int acc = 0;
  for (unsigned long long k = 0; k < mine; ++k) {
    int s = (int)(k % STAGES);
    unsigned parity = (unsigned)((k / STAGES) & 1);
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bars + 8 * s), "r"(parity) : "memory");
    acc += ((volatile int*)(smem + s * CHUNK))[0];
    if (k + STAGES < mine) issue(k + STAGES);
  }
  out[blockIdx.x] = acc;
}
"""


def bulk_reader(src, *, chunk: int = 32 << 10, stages: int = 6, ctas_per_sm: int = 1):
    """launch(i) reading every byte of the CUDA tensor `src` (a multiple of `chunk` bytes) once
    through cp.async.bulk on torch's current stream; the kernel is compiled on first call."""
    import cupy
    import torch

    nbytes = src.numel() * src.element_size()
    if nbytes % chunk:
        raise ValueError(f"bulk_reader: {nbytes} bytes is not a multiple of the {chunk}-byte chunk")
    mod = cupy.RawModule(code=BULK_READ_SOURCE, options=("--std=c++17",
                                                         f"-DSTAGES={stages}", f"-DCHUNK={chunk}"))
    kern = mod.get_function("bulk_read")
    smem = chunk * stages
    kern.max_dynamic_shared_size_bytes = smem
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    grid = sms * ctas_per_sm
    out = torch.empty(grid, dtype=torch.int32, device=src.device)
    n_chunks = cupy.uint64(nbytes // chunk)

    src_cp, out_cp = cupy.asarray(src.view(-1)), cupy.asarray(out)

    def launch(_i):
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kern((grid,), (32,), (src_cp, n_chunks, out_cp), shared_mem=smem)

    return launch
