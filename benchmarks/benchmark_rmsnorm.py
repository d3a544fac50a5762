"""Benchmark of RMSNorm (kernels/ops/rmsnorm.py) against torch's `F.rms_norm` on the GPU host.

    PYTHONPATH=. python benchmarks/benchmark_rmsnorm.py [--plan build/proof_plan.json] [--batch 1 64]

Times the prebuilt cubins a plan of cases lists (`cases`: kernel, shape, dir), each against torch
on the same rotated inputs, and prints a table: a quick look, not evidence (`fasttrack validate
rmsnorm` makes the evidence). `RMSNormCase` also serves the GPU tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import BenchCase, draw  # noqa: E402

EPS = 1e-5


class RMSNormCase(BenchCase):
    """y = rmsnorm(x) * gamma at one (batch, width); gamma around 1 (uniform in [0, 2))."""

    kernel = "rmsnorm"

    def __init__(self, shape: dict):
        import torch

        super().__init__(shape)
        b, w = shape["batch"], shape["width"]
        self.specs = {"x": ((b, w), torch.bfloat16), "gamma": ((w,), torch.bfloat16),
                      "y": ((b, w), torch.bfloat16)}
        self.static_bytes = w * 2
        self.act_bytes = 2 * b * w * 2

    def inputs(self, kind: str = "normal") -> dict:
        return {"x": draw(self.specs["x"][0], self.specs["x"][1], kind),
                "gamma": draw(self.specs["gamma"][0], self.specs["gamma"][1], "uniform") + 1.0}

    def oracle(self, t: dict):
        import torch

        from kernels import reference

        return reference.rmsnorm(t["x"], t["gamma"], EPS, compute_dtype=torch.float64)

    def torch_path(self, t: dict):
        import torch.nn.functional as F

        return F.rms_norm(t["x"], (self.shape["width"],), t["gamma"], EPS)

    def torch_launch(self):
        import torch.nn.functional as F

        width = self.shape["width"]

        def launch(t, _out):
            F.rms_norm(t["x"], (width,), t["gamma"], EPS)

        return (lambda: None), launch


def main(argv=None) -> int:
    from benchmarks.common import format_table, time_against_torch
    from kernels.launch import CubinKernel

    p = argparse.ArgumentParser(description="time rmsnorm cubins from a proof plan against torch")
    p.add_argument("--plan", default="build/proof_plan.json")
    p.add_argument("--batch", type=int, nargs="*")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args(argv)
    try:
        cases = json.loads(Path(args.plan).read_text())["cases"]
    except OSError as e:
        print(f"benchmark_rmsnorm: cannot read {args.plan}: {e.strerror} (a JSON with `cases`: kernel, shape, dir)",
              file=sys.stderr)
        return 2
    rows = []
    for c in cases:
        s = c["shape"]
        if c["kernel"] != "rmsnorm" or (args.batch and s["batch"] not in args.batch):
            continue
        kern = CubinKernel.from_dir(REPO / c["dir"])
        t = time_against_torch(kern, RMSNormCase(s), reps=args.reps)
        rows.append({"shape": f"b{s['batch']} w{s['width']}", "tunables": c["tunables"],
                     "us": t["graph"]["kernel"]["median_us"], "torch_us": t["graph"]["torch"]["median_us"],
                     "x": t["graph"]["torch"]["median_us"] / t["graph"]["kernel"]["median_us"]})
    print(format_table(rows, [("shape", "shape", ""), ("tunables", "tunables", ""), ("us", "us", ".2f"),
                              ("torch_us", "torch us", ".2f"), ("x", "vs torch", ".2f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
