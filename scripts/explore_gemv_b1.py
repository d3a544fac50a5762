"""Exploration on a GPU host: what a batch-1 decode GEMV can reach on the 51 MB shapes, measured
side by side in one run with the read-only streaming ceiling.

Not a deliverable kernel: Triton stands in for access patterns before one is written in CuTe DSL
(the GPU host has triton; kernels/ops holds the real kernels). Measured, per shape, under
CUDA-graph replay of >= 20 back-to-back launches each on its own rotated weight copy (the
condition of scripts/gpu_proof.py):
  * `read`: the ceiling's own Triton read-sum kernel over one weight copy (the same bytes): what a
    pure streaming read of exactly this many bytes reaches per launch, ramp and drain included;
  * `torch`: torch.mm (cuBLAS);
  * `tri bn=.. bk=.. w=..`: a row-streaming GEMV: each program owns `bn` rows and walks k in
    `bk`-wide chunks, so every warp load is contiguous along one row (unlike the mma fragment
    layout of kernels/ops/gemv.py, where one warp load touches 8 rows x 64 bytes).

    PYTHONPATH=. python scripts/explore_gemv_b1.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = [(3584, 7168), (7168, 3584)]  # (n, k): 7168->3584 and 3584->7168
CONFIGS = [  # (rows per program, k chunk, warps, split-k)
    (1, 1024, 4, 1), (1, 2048, 8, 1), (2, 1024, 4, 1), (2, 1024, 8, 1), (4, 512, 4, 1),
    (4, 1024, 8, 1), (8, 512, 8, 1), (8, 256, 4, 1), (16, 256, 8, 1), (2, 512, 4, 1),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args(argv)

    import torch
    import triton
    import triton.language as tl

    from benchmarks.common import (gpu_environment, l2_bytes, read_bandwidth, rotation_count,
                                   time_graph)
    from benchmarks.read_kernel import read_sum_kernel

    @triton.jit
    def gemv_rows(w, x, y, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in tl.range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            wt = tl.load(w + rows[:, None].to(tl.int64) * K + ks[None, :], cache_modifier=".cg")
            xt = tl.load(x + ks)
            acc += wt.to(tl.float32) * xt.to(tl.float32)[None, :]
        tl.store(y + rows, tl.sum(acc, 1).to(tl.bfloat16))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"environment": gpu_environment(), "command": " ".join(sys.argv), "cases": []}
    ceiling = read_bandwidth()
    doc["read_ceiling"] = ceiling
    tb = ceiling["tbps"]
    print(f"read ceiling {tb:.3f} TB/s ({ceiling['kernel']})", flush=True)

    def record(name, n, k, nbytes, t):
        us = t.median_us
        summary = t.summary()
        summary["samples"] = summary.pop("n")  # the summary's n is its sample count, not the rows
        row = {"case": name, "n": n, "k": k, "bytes": nbytes, **summary,
               "tbps": nbytes / us / 1e6, "of_read": nbytes / us / 1e6 / tb}
        doc["cases"].append(row)
        print(f"{n:5d}x{k:5d} {name:24s} {us:7.2f} us  {row['tbps']:.3f} TB/s  {100 * row['of_read']:5.1f}%",
              flush=True)
        (out_dir / "explore_gemv_b1.json").write_text(json.dumps(doc, indent=1))

    for n, k in SHAPES:
        wbytes = n * k * 2
        copies = rotation_count(wbytes + 4 * (n + k), l2_bytes())
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        xs = [torch.randn(1, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        ys = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = wbytes + 2 * (n + k)
        launches = max(copies, 20)
        ref = (xs[0].double() @ ws[0].double().T)

        nel = wbytes // 4
        block, iters = 8192, 4
        grid = (triton.cdiv(nel, block * iters),)
        partial = torch.empty(grid[0], dtype=torch.int32, device="cuda")
        as_i32 = [w.view(torch.int32).view(-1) for w in ws]
        for it in (4, 2, 1):
            g = (triton.cdiv(nel, block * it),)
            part = torch.empty(g[0], dtype=torch.int32, device="cuda")
            t = time_graph(lambda i, g=g, part=part, it=it: read_sum_kernel[g](as_i32[i % copies], part, nel,
                                                                            BLOCK=block, ITERS=it, num_warps=8),
                           launches=launches, replays=args.replays)
            record(f"read iters={it}", n, k, wbytes, t)
        t = time_graph(lambda i: torch.mm(xs[i % copies], ws[i % copies].T, out=ys[i % copies]),
                       launches=launches, replays=args.replays)
        record("torch", n, k, nbytes, t)
        for bn, bk, nw, _sk in CONFIGS:
            if k % bk or n % bn:
                continue
            grid = (n // bn,)

            def launch(i, bn=bn, bk=bk, nw=nw, grid=grid):
                gemv_rows[grid](ws[i % copies], xs[i % copies], ys[i % copies], n, K=k, BN=bn, BK=bk,
                                num_warps=nw)

            try:
                launch(0)
                torch.cuda.synchronize()
                err = ((ys[0].double() - ref).norm() / ref.norm()).item()
                t = time_graph(launch, launches=launches, replays=args.replays)
            except Exception as e:  # an unsupported config: record and go on
                print(f"tri bn={bn} bk={bk} w={nw}: {type(e).__name__}: {e}", flush=True)
                continue
            record(f"tri bn={bn} bk={bk} w={nw}", n, k, nbytes, t)
            doc["cases"][-1]["rel_err"] = err
        del ws, xs, ys, as_i32
        torch.cuda.empty_cache()
    (out_dir / "explore_gemv_b1.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
