"""Compare the readers that can set the read-only streaming ceiling, on the GPU host.

    PYTHONPATH=. python benchmarks/read_ceiling.py [--gib 2 8] [--json OUT]

The ceiling (benchmarks/common.py read_bandwidth) is the fastest of its readers; a kernel measured
above it is flagged IMPOSSIBLE. This measures each candidate reader (register loads through
Triton, torch's sum, cp.async.bulk at several chunk sizes, stage counts and CTAs per SM) over
buffers of the given sizes, side by side in one run, so that the readers the ceiling keeps are the
strongest ones measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[2.0, 8.0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch
    import triton

    from benchmarks.common import gpu_environment, time_graph, time_launches
    from benchmarks.read_kernel import bulk_reader, read_sum_kernel

    rows = []
    for gib in args.gib:
        n = int(gib * (1 << 30)) // 4
        src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
        readers = {}
        block, iters = 8192, 4
        grid = (triton.cdiv(n, block * iters),)
        partial = torch.empty(grid[0], dtype=torch.int32, device="cuda")
        readers["triton read-sum"] = lambda _i: read_sum_kernel[grid](src, partial, n, BLOCK=block, ITERS=iters,
                                                                      num_warps=8)
        bf = src.view(torch.bfloat16)
        readers["torch sum"] = lambda _i: bf.sum(dtype=torch.float32)
        for chunk in (16 << 10, 32 << 10, 64 << 10):
            for stages, per_sm in ((4, 1), (6, 1), (3, 2)):
                if chunk * stages > 200 << 10:
                    continue
                name = f"bulk chunk={chunk >> 10}K stages={stages} ctas/sm={per_sm}"
                try:
                    readers[name] = bulk_reader(src, chunk=chunk, stages=stages, ctas_per_sm=per_sm)
                except Exception as e:  # a configuration that does not build or fit: recorded
                    rows.append({"gib": gib, "reader": name, "error": f"{type(e).__name__}: {e}"[:300]})
        for name, launch in readers.items():
            try:
                t = time_launches(launch, reps=args.reps, warmup=3)
                g = time_graph(launch, launches=4, replays=max(5, args.reps // 2), warmup=1)
            except Exception as e:
                rows.append({"gib": gib, "reader": name, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{gib:4.1f} GiB  {name:<40} ERROR {e}", flush=True)
                continue
            row = {"gib": gib, "reader": name, "bytes": n * 4, "events": t.summary(), "graph": g.summary(),
                   "tbps_events": n * 4 / t.median_us / 1e6, "tbps_graph": n * 4 / g.median_us / 1e6}
            rows.append(row)
            print(f"{gib:4.1f} GiB  {name:<40} {row['tbps_events']:.3f} TB/s (events)  "
                  f"{row['tbps_graph']:.3f} TB/s (graph)", flush=True)
        del src, partial, bf, readers
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"environment": gpu_environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
