"""What every CuTe DSL op shares: its contract with the AOT build, the launcher and the validator.

An op is a QuACK-style class (see STYLE.md):
  * `__init__(shape, **tunables)` computes host-side tunables from one validation variant
    (`shape` is one dict of the manifest's `shapes`, e.g. {"batch": 4, "n": 3584, "k": 7168});
  * `tensor_specs()` declares every launch parameter in manifest order: buffers with their
    shape and dtype (static row-major layouts, so a tensor is one 8-byte pointer in the cubin),
    scalars with their value;
  * `launch_config()` returns grid, block and dynamic shared memory; the `@cute.jit __call__`
    must launch with exactly these values, since the AOT launcher reads them from the metadata;
  * `@cute.jit __call__(*params)` launches `@cute.kernel kernel(...)`;
  * `reference(**tensors)` maps the parameter tensors to the pure-torch reference and returns the
    expected outputs keyed by output parameter name.
This module imports no DSL at import time, so the GPU host (no `nvidia-cutlass-dsl`) can use
`TensorSpec`/`LaunchConfig`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DTYPES = ("bfloat16", "float32", "int32", "uint32", "int64", "float16")


@dataclass(frozen=True)
class TensorSpec:
    """A buffer parameter: row-major (last dim contiguous), static shape."""

    shape: tuple[int, ...]
    dtype: str  # one of DTYPES (torch attribute name)
    # How a `sync` buffer is used, where not as counters and flags guarding other data:
    # "tagged", every word its own flag (0 until written; the static audit's role "tagged",
    # validation/race/rules.py); "claims", every word a work counter that hands out item indices
    # by atomic adds and orders nothing (the audit's role "claims"). Recorded in meta.json only
    # when set.
    protocol: str | None = field(default=None, kw_only=True)

    def to_dict(self) -> dict:
        d = {"kind": "tensor", "shape": list(self.shape), "dtype": self.dtype}
        if self.protocol is not None:
            d["protocol"] = self.protocol
        return d

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self) -> int:
        return self.numel() * {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4,
                               "uint32": 4, "int64": 8}[self.dtype]


@dataclass(frozen=True)
class ScalarSpec:
    """A by-value parameter."""

    dtype: str  # "int32" | "float32" | "int64"
    value: Any

    def to_dict(self) -> dict:
        return {"kind": "scalar", "dtype": self.dtype, "value": self.value}


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0  # dynamic shared memory requested at launch
    cooperative: bool = False  # persistent kernels that need every CTA resident
    # Programmatic dependent launch: the launcher sets PROGRAMMATIC_STREAM_SERIALIZATION, so this
    # launch may start while the previous kernel in the stream drains. Only for kernels that read
    # nothing but static weights and write nothing before `griddepcontrol.wait`.
    pdl: bool = False
    # Thread block clusters of this many CTAs (x, y, z), co-scheduled and sharing their shared
    # memory (distributed shared memory); None: no cluster.
    cluster: tuple[int, int, int] | None = None
    # Preferred shared-memory carveout, percent of the SM's maximum (the launcher sets
    # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT): fewer CTAs per SM by shared memory while
    # L1 keeps the rest; None: the driver's choice.
    smem_carveout: int | None = None

    def to_dict(self) -> dict:
        """The launch as meta.json records it; `pdl`, `cluster` and `smem_carveout` only when set, so the
        metadata of every plain launch keeps its earlier form (the launcher reads a missing
        `pdl` as false and a missing `cluster` as none)."""
        d = asdict(self)
        if not self.pdl:
            del d["pdl"]
        if self.cluster is None:
            del d["cluster"]
        else:
            d["cluster"] = list(self.cluster)
        if self.smem_carveout is None:
            del d["smem_carveout"]
        return d


def fake_tensor(spec: TensorSpec):
    """A CuTe fake tensor with the static row-major layout `spec` describes (compile only)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    dt = {
        "bfloat16": cutlass.BFloat16,
        "float16": cutlass.Float16,
        "float32": cutlass.Float32,
        "int32": cutlass.Int32,
        "uint32": cutlass.Uint32,
        "int64": cutlass.Int64,
    }[spec.dtype]
    rank = len(spec.shape)
    # stride_order gives each mode's rank in stride magnitude: last dim fastest (row-major).
    return make_fake_compact_tensor(
        dt, spec.shape, stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=16
    )


def fake_scalar(spec: ScalarSpec):
    import cutlass

    return {"int32": cutlass.Int32, "int64": cutlass.Int64, "float32": cutlass.Float32}[
        spec.dtype
    ](spec.value)


def op_tunables(kernel: str, names, given: dict) -> dict:
    """`given` over kernel `kernel`'s manifest defaults (kernels/manifest.toml
    [kernels.<kernel>.tunables], the one place they are declared; read only for a tunable `given`
    lacks: the build always passes every one); a ValueError names a tunable not in `names` (the
    op's known tunables)."""
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(f"{kernel}: unknown tunables {sorted(unknown)}; known: {sorted(names)}")
    if set(names) <= set(given):
        return dict(given)
    from kernels.manifest import load_manifest

    return {**load_manifest().kernel(kernel).tunable_defaults(), **given}


class OpBase:
    """Base for op classes. Subclasses set `kernel_name` and implement the contract above."""

    kernel_name: str = ""

    def __init__(self, shape: dict, **tunables):
        self.shape = dict(shape)
        self.tunables = dict(tunables)

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec | ScalarSpec]:
        raise NotImplementedError

    def host_params(self) -> dict:
        """Parameters whose contents the host plans (name -> nested lists, in the parameter's
        dtype), which random inputs must not replace: e.g. a persistent kernel's task table.
        None by default."""
        return {}

    def launch_config(self) -> LaunchConfig:
        raise NotImplementedError

    def reference(self, **tensors):
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def fake_args(self) -> tuple:
        out = []
        for spec in self.tensor_specs().values():
            out.append(fake_tensor(spec) if isinstance(spec, TensorSpec) else fake_scalar(spec))
        return tuple(out)

    def variant_key(self) -> str:
        parts = [f"{k}{v}" for k, v in sorted(self.shape.items())]
        parts += [f"{k}{v}" for k, v in sorted(self.tunables.items())]
        return "_".join(str(p) for p in parts)
