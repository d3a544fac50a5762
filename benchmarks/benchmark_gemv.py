"""Benchmark of the decode GEMM (kernels/ops/gemv.py) against torch (cuBLAS) on the GPU host.

    PYTHONPATH=. python benchmarks/benchmark_gemv.py [--plan build/proof_plan.json] [--batch 1 8]
        [--n 3584] [--k 7168]

Times the prebuilt cubins listed in the plan that `scripts/gpu_proof.py plan` wrote (the GPU host
has no DSL to build them), each against `torch.mm` on the same rotated inputs, and prints a table.
`GemvCase` is also what scripts/gpu_proof.py checks and times.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import BenchCase, draw  # noqa: E402


class GemvCase(BenchCase):
    """y = x @ w.T at one (batch, n, k, out_dtype): weights fan-in scaled, activations O(1)."""

    kernel = "gemv"

    def __init__(self, shape: dict):
        import torch

        super().__init__(shape)
        b, n, k = shape["batch"], shape["n"], shape["k"]
        self.out_dtype = shape.get("out_dtype", "bfloat16")
        out_bytes = 2 if self.out_dtype == "bfloat16" else 4
        self.specs = {"x": ((b, k), torch.bfloat16), "w": ((n, k), torch.bfloat16),
                      "y": ((b, n), getattr(torch, self.out_dtype))}
        self.static_bytes = n * k * 2
        self.act_bytes = b * k * 2 + b * n * out_bytes

    def inputs(self, kind: str = "normal") -> dict:
        k = self.shape["k"]
        return {"x": draw(self.specs["x"][0], self.specs["x"][1], kind),
                "w": draw(self.specs["w"][0], self.specs["w"][1], kind, 1.0 / math.sqrt(k))}

    def oracle(self, t: dict):
        import torch

        from kernels import reference

        return reference.linear(t["x"], t["w"], compute_dtype=torch.float64)

    def torch_path(self, t: dict):
        import torch
        import torch.nn.functional as F

        from kernels import reference

        if self.out_dtype == "float32":  # the router's fp32 logits: the reference's fp32 path
            return reference.linear(t["x"], t["w"], out_dtype=torch.float32)
        return F.linear(t["x"], t["w"])  # cuBLAS, bf16 out

    def torch_launch(self):
        import torch

        # bf16 output for every shape, the router's too: the cheapest cuBLAS call for these
        # operands, so the comparison is never tilted towards the kernel.
        shape = self.specs["y"][0]

        def make_out():
            return torch.empty(shape, dtype=torch.bfloat16, device="cuda")

        def launch(t, out):
            torch.mm(t["x"], t["w"].t(), out=out)

        return make_out, launch


def main(argv=None) -> int:
    from benchmarks.common import format_table, time_against_torch
    from kernels.launch import CubinKernel
    import json

    p = argparse.ArgumentParser(description="time gemv cubins from a proof plan against torch")
    p.add_argument("--plan", default="build/proof_plan.json")
    p.add_argument("--batch", type=int, nargs="*")
    p.add_argument("--n", type=int)
    p.add_argument("--k", type=int)
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args(argv)
    try:
        cases = json.loads(Path(args.plan).read_text())["cases"]
    except OSError as e:
        print(f"benchmark_gemv: cannot read {args.plan}: {e.strerror} (run scripts/gpu_proof.py plan)",
              file=sys.stderr)
        return 2
    rows = []
    for c in cases:
        s = c["shape"]
        if c["kernel"] != "gemv" or (args.batch and s["batch"] not in args.batch) \
                or (args.n and s["n"] != args.n) or (args.k and s["k"] != args.k):
            continue
        kern = CubinKernel.from_dir(REPO / c["dir"])
        t = time_against_torch(kern, GemvCase(s), reps=args.reps)
        rows.append({"shape": f"b{s['batch']} {s['k']}->{s['n']}", "tunables": c["tunables"],
                     "us": t["graph"]["kernel"]["median_us"], "torch_us": t["graph"]["torch"]["median_us"],
                     "tbps": t["bytes"] / t["graph"]["kernel"]["median_us"] / 1e6,
                     "x": t["graph"]["torch"]["median_us"] / t["graph"]["kernel"]["median_us"]})
    print(format_table(rows, [("shape", "shape", ""), ("tunables", "tunables", ""), ("us", "us", ".2f"),
                              ("torch_us", "torch us", ".2f"), ("tbps", "TB/s", ".3f"), ("x", "vs torch", ".2f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
