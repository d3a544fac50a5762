"""Benchmark of the decode GEMM (kernels/ops/gemv.py) against torch (cuBLAS) on the GPU host.

    PYTHONPATH=. python benchmarks/benchmark_gemv.py [--plan build/proof_plan.json] [--batch 1 8]
        [--n 3584] [--k 7168] [--check] [--json rows.json]

Times the prebuilt cubins a plan of cases lists (`cases`: kernel, shape, dir; the GPU host has no
DSL to build them), each against `torch.mm` on the same rotated inputs, and prints a table: a
quick look, not evidence (`fasttrack validate gemv` makes the evidence). `GemvCase` also serves
the GPU tests.
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
    """y = x @ w.T at one (batch, n, k, out_dtype): weights fan-in scaled, activations O(1).

    The kernel's scratch (split-K partials) and sync (counters) parameters are sized for the
    variant's `tunables` (defaults when None): partials start as NaN, counters at zero."""

    kernel = "gemv"

    def __init__(self, shape: dict, tunables: dict | None = None):
        import torch

        from kernels.ops.gemv import GemvOp

        super().__init__(shape)
        specs = GemvOp(shape, **(tunables or {})).tensor_specs()
        self.scratch = {name: (tuple(specs[name].shape), getattr(torch, specs[name].dtype))
                        for name in ("partials", "counters")}
        b, n, k = shape["batch"], shape["n"], shape["k"]
        self.out_dtype = shape.get("out_dtype", "bfloat16")
        out_bytes = 2 if self.out_dtype == "bfloat16" else 4
        self.specs = {"x": ((b, k), torch.bfloat16), "w": ((n, k), torch.bfloat16),
                      "y": ((b, n), getattr(torch, self.out_dtype))}
        self.static_bytes = n * k * 2
        self.act_bytes = b * k * 2 + b * n * out_bytes

    def inputs(self, kind: str = "normal") -> dict:
        import torch

        k = self.shape["k"]
        (p_shape, p_dtype), (c_shape, c_dtype) = self.scratch["partials"], self.scratch["counters"]
        return {"x": draw(self.specs["x"][0], self.specs["x"][1], kind),
                "w": draw(self.specs["w"][0], self.specs["w"][1], kind, 1.0 / math.sqrt(k)),
                "partials": torch.full(p_shape, float("nan"), dtype=p_dtype, device="cuda"),
                "counters": torch.zeros(c_shape, dtype=c_dtype, device="cuda")}

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
    from benchmarks.common import check_numerics, format_table, time_against_torch
    from kernels.launch import CubinKernel
    import json

    p = argparse.ArgumentParser(description="time gemv cubins from a proof plan against torch")
    p.add_argument("--plan", default="build/proof_plan.json")
    p.add_argument("--batch", type=int, nargs="*")
    p.add_argument("--n", type=int)
    p.add_argument("--k", type=int)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--check", action="store_true", help="also check numerics (float64 oracle, run twice)")
    p.add_argument("--json", help="write every row (with its timings) to this file")
    args = p.parse_args(argv)
    try:
        cases = json.loads(Path(args.plan).read_text())["cases"]
    except OSError as e:
        print(f"benchmark_gemv: cannot read {args.plan}: {e.strerror} (a JSON with `cases`: kernel, shape, dir)",
              file=sys.stderr)
        return 2
    rows, torch_us = [], {}
    for c in cases:
        s = c["shape"]
        if c["kernel"] != "gemv" or (args.batch and s["batch"] not in args.batch) \
                or (args.n and s["n"] != args.n) or (args.k and s["k"] != args.k):
            continue
        label = f"b{s['batch']} {s['k']}->{s['n']}"
        row = {"shape": label, "tunables": _short(c["tunables"]), "cubin_sha256": c.get("cubin_sha256"),
               "registers": c.get("registers")}
        try:
            kern = CubinKernel.from_dir(REPO / c["dir"])
            case = GemvCase(s, c["tunables"])
            if args.check:
                num = check_numerics(kern, case)
                row["numerics"] = "ok" if num["passed"] else "FAIL"
                row["rel_err"] = max(t["kernel"]["rel_fro"] for t in num["trials"])
            need = label not in torch_us
            t = time_against_torch(kern, case, reps=args.reps, rounds=args.rounds, with_torch=need)
            if need:
                torch_us[label] = t["graph"]["torch"]["median_us"]
            us = t["graph"]["kernel"]["median_us"]
            row.update(us=us, torch_us=torch_us[label], tbps=t["bytes"] / us / 1e6, x=torch_us[label] / us,
                       stream_us=t["stream"]["kernel"]["median_us"])
        except Exception as e:  # one failing variant must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:120]
        rows.append(row)
        print(row, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(format_table(rows, [("shape", "shape", ""), ("tunables", "tunables", ""), ("registers", "regs", ""),
                              ("us", "us", ".2f"), ("torch_us", "torch us", ".2f"), ("tbps", "TB/s", ".3f"),
                              ("x", "vs torch", ".2f"), ("numerics", "num", ""), ("error", "error", "")]))
    return 0


def _short(t: dict) -> str:
    """Tunables in a few characters: the tiled design's when it applies, else the small-batch one's."""
    keys = {"warps_per_cta": "w", "row_tiles": "r", "k_unroll": "u", "prefetch": "p", "tiled_from_batch": "tb",
            "tile_warps": "tw", "tile_row_tiles": "tr", "tile_k_unroll": "tu", "tile_min_ctas": "mc",
            "k_order": "ko"}
    return " ".join(f"{keys.get(k, k)}{v}" for k, v in t.items())


if __name__ == "__main__":
    sys.exit(main())
