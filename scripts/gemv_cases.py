"""Run chosen gemv cases of a proof plan on the GPU host, under a tool that attaches to the
process: `launch` for a profiler, `check` for compute-sanitizer.

    # a profiler: each case's cubin a few times, and cuBLAS on the same shape with --torch
    PYTHONPATH=. ncu --section SpeedOfLight --csv --page details \\
        python scripts/gemv_cases.py launch PLAN.json 12 57 --torch > ncu.csv
    # a sanitizer: each case checked against the float64 oracle (one draw, run twice)
    PYTHONPATH=. PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck \\
        --report-api-errors no python scripts/gemv_cases.py check PLAN.json 12 57

Cases are indices into the plan's `cases` (`gpu_proof.py plan` writes it); each line printed
says which case ran, so the tool's output can be matched to cases. `check` exits 1 when a case
fails its numerics.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("launch", "check"))
    ap.add_argument("plan", help="a plan written by `gpu_proof.py plan`")
    ap.add_argument("cases", nargs="+", type=int, help="indices into the plan's cases")
    ap.add_argument("--launches", type=int, default=2, help="launch: launches per case")
    ap.add_argument("--torch", action="store_true", help="launch: also torch's path on each case's shape")
    ap.add_argument("--drop-cluster", action="store_true",
                    help="launch: launch without the metadata's thread block cluster (a misuse the "
                         "clustered kernels must refuse: they trap)")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.benchmark_gemv import GemvCase
    from benchmarks.common import check_numerics
    from kernels.launch import CubinKernel

    if not torch.cuda.is_available():
        print("gemv_cases: no CUDA device: run this on the GPU host", file=sys.stderr)
        return 2
    try:
        plan = json.loads(Path(args.plan).read_text())
        picked = [(i, plan["cases"][i]) for i in args.cases]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"gemv_cases: cannot take cases {args.cases} from {args.plan}: {e}", file=sys.stderr)
        return 2
    failed = 0
    for i, c in picked:
        kern = CubinKernel.from_dir(REPO / c["dir"])
        case = GemvCase(c["shape"], c["tunables"])
        label = f"case {i}: gemv {c['shape']} {c['tunables']}"
        if args.mode == "check":
            res = check_numerics(kern, case, trials=("normal",))
            failed += not res["passed"]
            print(f"{label}: {'passed' if res['passed'] else 'FAILED ' + json.dumps(res)}", flush=True)
            continue
        t = case.inputs()
        y = torch.empty(case.specs["y"][0], dtype=case.specs["y"][1], device="cuda")
        torch.cuda.synchronize()
        if args.drop_cluster:
            kern.launch.pop("cluster", None)
        try:
            for _ in range(args.launches):
                kern(t["x"], t["w"], y, t["partials"], t["counters"])
            torch.cuda.synchronize()
        except Exception as e:  # a trap leaves the context unusable: report and stop
            print(f"{label}: the launch failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            return 1
        print(f"{label}: {args.launches} launches", flush=True)
        if args.torch:
            for _ in range(args.launches):
                case.torch_path(t)
            torch.cuda.synchronize()
            print(f"case {i}: {args.launches} launches of the torch path", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
