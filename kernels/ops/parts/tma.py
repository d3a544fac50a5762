"""Buffers a kernel reads by TMA: what the op declares, what the launcher encodes.

A `TmaTensorSpec` is a `TensorSpec` (row-major, static shape) with a `TensorMap`: the kernel takes
the buffer as the by-value 128-byte tensor map (CUtensorMap) a CuTe TMA atom compiles to, not
as a pointer. The launcher encodes it from the tensor (`kernels/launch.py` `tensor_map_args`,
`cuTensorMapEncodeTiled`: the tensor's dims innermost first, its row pitches, this box, element
strides 1, no interleave, this swizzle and L2 promotion, no out-of-bounds fill); the kernel's TMA
atom was built by the DSL with the same box and swizzle from the same static layout, and the
build refuses any other PTX parameter for it (`kernels/build.py` `_zip_params`).

A module of its own, not part of `kernels/ops/base.py`: every kernel's cubin carries the text of
the sources it was built from, so an edit to base.py would change every kernel's cubin bytes
and unbind the evidence that names them (this one is imported by the ops that use TMA only).
No DSL import here: the GPU host uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.ops.base import TensorSpec


@dataclass(frozen=True)
class TensorMap:
    """How a TMA box reads the buffer."""

    box: tuple[int, ...]  # elements per copy, innermost dim first (each 1..256)
    swizzle: int = 128  # bytes: 0 (none), 32, 64 or 128; the box's inner extent must not exceed it
    l2_promotion: int = 256  # bytes the L2 fetches per request: 0 (none), 64, 128 or 256

    def to_dict(self) -> dict:
        d = {"box": list(self.box), "swizzle": self.swizzle}
        if self.l2_promotion != 256:  # absent: 256, the driver's usual choice
            d["l2_promotion"] = self.l2_promotion
        return d


@dataclass(frozen=True)
class TmaTensorSpec(TensorSpec):
    """A buffer parameter the kernel reads by TMA through `tma` (None: an ordinary pointer)."""

    tma: TensorMap | None = None

    def to_dict(self) -> dict:
        d = super().to_dict()
        if self.tma is not None:
            d["tma"] = self.tma.to_dict()
        return d
