"""DSL helpers the foundation ops share (16-byte global loads, warp reductions).

The ops must import on the GPU host, which has no `nvidia-cutlass-dsl`: there they are used
only for `tensor_specs()`, `launch_config()` and `reference()`, and the prebuilt cubin runs
through kernels/launch. So the DSL is imported when present; when it is not, `cute` is an inert
stand-in whose `jit`/`kernel` decorators return the function unchanged and whose `Tensor` is a
plain annotation (kernel bodies are then never called). The ops use `@cute.jit`/`@cute.kernel`
directly: the DSL locates a decorated method by the decorator's calling frame, so it must not be
wrapped in a helper.
"""

from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute

    HAVE_DSL = True
except ImportError:  # GPU host: specs and references only

    class _InertCute:
        """Just enough of `cutlass.cute` for an op module to be defined without the DSL."""

        Tensor = object

        @staticmethod
        def jit(fn):
            return fn

        @staticmethod
        def kernel(fn):
            return fn

    cutlass = None
    cute = _InertCute()
    HAVE_DSL = False

VECTOR_BYTES = 16  # one ld/st.global.v4.b32
BF16_PER_VECTOR = VECTOR_BYTES // 2
WARP = 32


def weight_load_atom(dtype):
    """16-byte global->register copy through the non-coherent (read-only) path.

    Only buffers the manifest declares `static` (weights, read-only for the whole launch) may use
    it: the race audit flags `ld.global.nc` from any other parameter.
    """
    return cute.make_copy_atom(
        cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=VECTOR_BYTES * 8, invariant=True
    )


def coherent_copy_atom(dtype):
    """16-byte plain (coherent) global<->register copy, for activations and outputs."""
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=VECTOR_BYTES * 8)


def warp_allreduce_sum(val):
    """Butterfly sum over the 32 lanes of a warp; every lane gets the same (deterministic) total."""
    offset = WARP // 2
    while offset >= 1:  # trace-time loop: five shuffles
        val = val + cute.arch.shuffle_sync_bfly(val, offset=offset)
        offset //= 2
    return val


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
