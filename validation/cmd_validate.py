"""`fasttrack validate KERNEL [--base torch] [--batch N ...]`: build or find the kernel's cubins,
audit them, run numerics + defences + stress and benchmarks on the local GPU (each stage in a
child process with a timeout), and write the evidence bundle and its HTML report.

Without a GPU it says so, runs what needs none (build, hashes, static audit), writes a bundle whose
`not_covered` says what was not run, and exits 0, unless --require-gpu asks for GPU evidence (exit
3). With a GPU: exit 0 when the bundle's verdict is pass, 1 when it is fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "validate",
        help="validate a manifest kernel on the local GPU into an evidence bundle and report",
        description="Build (or find prebuilt) cubins of KERNEL, run the static race audit, then "
        "numerics, defences, stress and benchmarks on the local GPU, and write bundle.json and "
        "report.html.",
    )
    p.add_argument("kernel", metavar="KERNEL")
    p.add_argument("--base", default=None, help="what to compare against: 'torch' (the torch/cuBLAS path)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="only these batch sizes")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for bundle.json and report.html (default: evidence_reports/<kernel>/)")
    p.add_argument("--build-root", type=Path, default=None, help="build cache (default: build/)")
    p.add_argument("--require-gpu", action="store_true", help="fail (exit 3) when there is no GPU")
    p.add_argument("--quick", action="store_true", help="one seed per variant (less coverage)")
    p.add_argument("--commit", default=None, help="the commit validated (default: git rev-parse HEAD)")
    p.add_argument("--title", default="", help="the change's title")


def run(args) -> int:
    from kernels.manifest import REPO_ROOT

    from validation.validate import DEFAULT_BUILD_ROOT, ValidateError, validate_kernel

    out = args.out or (REPO_ROOT / "evidence_reports" / args.kernel)
    try:
        bundle = validate_kernel(args.kernel, base=args.base, batches=args.batch,
                                 build_root=args.build_root or DEFAULT_BUILD_ROOT, out_dir=out,
                                 require_gpu=args.require_gpu, quick=args.quick, commit=args.commit,
                                 title=args.title)
    except ValidateError as e:
        raise UserError(str(e), 3 if "no CUDA device" in str(e) else 2) from None
    print(f"wrote {out / 'bundle.json'} and {out / 'report.html'}: verdict {bundle['verdict']}")
    for r in bundle["reasons"][:10]:
        print(f"  - {r}", file=sys.stderr)
    gpu_ran = any(s.get("name") == "numerics" for s in bundle["environment"].get("stages", []))
    if not gpu_ran:
        print("no GPU: GPU stages not covered (see not_covered in the bundle)", file=sys.stderr)
        return 0
    return 0 if bundle["verdict"] == "pass" else 1
