"""Hardware counters for the router + down-projection at batch 1 beside a pure read of the same
bytes: what a launch of each carried explorer variant (scripts/router_explore.py, carry
.devcarry/router_x) and the ceiling's Triton read kernel move through DRAM and L2, and how full
the SMs are. A diagnostic for why the stream design reaches 0.94-0.96 of the pure read
(evidence_reports/moe_block/round9/), not a timing: Nsight Compute replays each launch alone.

  PYTHONPATH=. ncu --clock-control none --kernel-name regex:'kernel_cutlass|read_sum' \\
      --metrics <list> --csv --log-file OUT.csv python3 scripts/router_ncu.py ID [ID ...]

(`--clock-control none`: the clocks stay as they are, as METHOD.md asks.) Each variant and the
read run `--launches` times (default 3) on weights rotated past the L2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="+", help="carried explorer variant ids (batch 1)")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)

    import torch
    import triton

    from benchmarks.read_kernel import read_sum_kernel
    from block_explore import _launch_router, _router_buffers
    from kernels.config import get_config
    from router_explore import _entries, _load, _rotated_weights, _tokens

    ents = _entries()
    missing = [i for i in args.ids if i not in ents]
    if missing:  # before any GPU work
        print(f"router_ncu: no carried variant {', '.join(map(repr, missing))}", file=sys.stderr)
        return 2
    cfg = get_config("k3")
    w, wbytes, _nr, wg, wd = _rotated_weights(cfg)
    for ident in args.ids:
        op, k = _load(ents[ident])
        hs = _tokens(cfg, w, op.batch, args.launches)
        b = _router_buffers(op, op.batch, "cuda")
        for i in range(args.launches):
            _launch_router(k, op, hs[i], wg[i % len(wg)], w.bias, wd[i % len(wd)], b)
        torch.cuda.synchronize()
        print(f"{ident}: {args.launches} launches", flush=True)
    nel = wbytes // 4
    bufs = [torch.randint(0, 1 << 20, (nel,), dtype=torch.int32, device="cuda") for _ in range(2)]
    for it in (4, 1):
        grid = (triton.cdiv(nel, 8192 * it),)
        part = torch.empty(grid[0], dtype=torch.int32, device="cuda")
        for i in range(args.launches):
            read_sum_kernel[grid](bufs[i % 2], part, nel, BLOCK=8192, ITERS=it, num_warps=8)
        torch.cuda.synchronize()
        print(f"read of {wbytes} bytes, ITERS={it}: {args.launches} launches", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
