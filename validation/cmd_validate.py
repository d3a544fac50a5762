"""`fasttrack validate KERNEL [--base torch|REV] [--batch N ...]`: build or find the kernel's cubins,
audit them, run numerics + defences + stress and benchmarks on the local GPU (each stage in a
child process with a timeout), and write the evidence bundle and its HTML report.

Against a base revision, across hosts (the CPU host has git and the DSL, the GPU host neither):

    fasttrack validate KERNEL --base REV --prepare          # CPU host: build head + base, write the plan
    PYTHONPATH=. python3 -m validation.cli validate KERNEL --plan build/validate/KERNEL/plan.json --out DIR
                                                            # GPU host, build/KERNEL and the plan carried
    fasttrack sign DIR/bundle.json                          # the runner signs

On one host with git, the DSL and a GPU, `fasttrack validate KERNEL --base REV` does both steps.

Without a GPU it refuses (exit 2) and writes nothing: evidence without its GPU stages is no
evidence, and the default --out is where committed bundles live. Nothing overwrites a signed
bundle: an --out folder that holds one is refused (exit 2). With a GPU: exit 0 when the bundle's
verdict is pass, 1 when it is fail.
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
    p.add_argument("--base", default=None, metavar="torch|REV",
                   help="what to compare against: 'torch' (the torch/cuBLAS path) or a git revision (the "
                        "kernel as it was there, timed interleaved with head: the gate's no-regression evidence)")
    p.add_argument("--prepare", action="store_true",
                   help="with --base REV, on a host with git and the DSL: build head and base and write the "
                        "plan (default build/validate/KERNEL/plan.json) for a GPU host; runs nothing else")
    p.add_argument("--plan", type=Path, default=None,
                   help="run from a plan written by --prepare (GPU host; needs neither git nor the DSL)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="only these batch sizes")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for bundle.json and report.html (default: evidence_reports/<kernel>/)")
    p.add_argument("--build-root", type=Path, default=None, help="build cache (default: build/)")
    p.add_argument("--require-gpu", action="store_true",
                   help="(always so: without a GPU validate refuses, exit 2; kept for scripts that pass it)")
    p.add_argument("--quick", action="store_true", help="one seed per variant (less coverage)")
    p.add_argument("--commit", default=None, help="the commit validated (default: git rev-parse HEAD)")
    p.add_argument("--title", default="", help="the change's title")


def run(args) -> int:
    from kernels.manifest import REPO_ROOT

    from validation.validate import (DEFAULT_BUILD_ROOT, ValidateError, default_plan_path, is_revision,
                                     prepare_base_plan, validate_kernel)

    build_root = args.build_root or DEFAULT_BUILD_ROOT
    if args.prepare:
        if not is_revision(args.base):
            raise UserError("--prepare needs --base REV (a git revision to build the baseline from)")
        if args.plan is not None:
            raise UserError("--prepare writes a plan; --plan runs one: give one of them")
        plan_path = default_plan_path(args.kernel, build_root)
        try:
            plan = prepare_base_plan(args.kernel, args.base, batches=args.batch, build_root=build_root,
                                     plan_path=plan_path)
        except ValidateError as e:
            raise UserError(str(e), 2) from None
        rel = _repo_rel(plan_path, REPO_ROOT)
        print(f"wrote {rel}: {len(plan['variants'])} variant(s), base {plan['base']['sha'][:12]}, "
              f"head {str(plan['head']['sha'])[:12]}")
        print(f"next, on the GPU host (carry {_repo_rel(build_root, REPO_ROOT)}/{args.kernel} and {rel}):\n"
              f"  PYTHONPATH=. python3 -m validation.cli validate {args.kernel} --plan {rel} --out OUT_DIR\n"
              f"then here: fasttrack sign OUT_DIR/bundle.json")
        return 0
    out = args.out or (REPO_ROOT / "evidence_reports" / args.kernel)
    refuse_signed_bundle(out / "bundle.json")
    if args.plan is None:
        from validation.validate import _kernel_variants

        try:
            _kernel_variants(args.kernel, args.batch)  # bad input answers before the GPU question
        except ValidateError as e:
            raise UserError(str(e), 2) from None
        if not cuda_available():
            raise UserError(NO_GPU.format(k=args.kernel), 2)
    try:
        bundle = validate_kernel(args.kernel, base=args.base, batches=args.batch,
                                 build_root=build_root, out_dir=out,
                                 require_gpu=True, quick=args.quick, commit=args.commit,
                                 title=args.title, plan_path=args.plan)
    except ValidateError as e:
        if "no CUDA device" in str(e):
            raise UserError(NO_GPU.format(k=args.kernel), 2) from None
        raise UserError(str(e), 2) from None
    print(f"wrote {out / 'bundle.json'} and {out / 'report.html'}: verdict {bundle['verdict']}")
    for r in bundle["reasons"][:10]:
        print(f"  - {r}", file=sys.stderr)
    gpu_ran = any(s.get("name") == "numerics" for s in bundle["environment"].get("stages", []))
    if not gpu_ran:
        print("no GPU: GPU stages not covered (see not_covered in the bundle)", file=sys.stderr)
        return 0
    return 0 if bundle["verdict"] == "pass" else 1


NO_GPU = ("no CUDA device on this host: fasttrack validate runs numerics, sanitizers and benchmarks on a "
          "GPU and writes nothing without one. Here: `fasttrack validate {k} --base REV --prepare`; on a GPU "
          "host: `PYTHONPATH=. python3 -m validation.cli validate {k} --plan build/validate/{k}/plan.json --out DIR`")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def refuse_signed_bundle(path: Path) -> None:
    """UserError (exit 2) when `path` holds a signed bundle: nothing overwrites one."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return
    if isinstance(data, dict) and data.get("signature"):
        raise UserError(f"{path} is a signed evidence bundle; nothing overwrites a signed bundle: "
                        "choose another --out", 2)


def _repo_rel(path: Path, root: Path) -> str:
    """`path` relative to the repository when it lies inside it (commands to copy stay portable)."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)
