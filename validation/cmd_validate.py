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
    p.add_argument("kernel", metavar="KERNEL", nargs="?", default=None,
                   help="a manifest kernel, or `block` (the whole chain at every decode batch)")
    p.add_argument("--all", action="store_true",
                   help="every manifest kernel, the block and the mini sanitizer variants: with --prepare "
                        "--base REV --root DIR, prepare every plan and one carry under DIR; without --prepare, "
                        "run DIR's plans (GPU host) into --out")
    p.add_argument("--root", type=Path, default=None, help="with --all: the folder of the plans and the carry")
    p.add_argument("--budget-s", type=float, default=560.0, help="with --all (run): total seconds")
    p.add_argument("--only", default="", help="with --all: comma-separated plan names (kernels, sanitize, "
                                                 "block) to prepare or to run")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="numerics seeds (default 0 1)")
    p.add_argument("--tunables", nargs="+", default=None, metavar="NAME=VALUE",
                   help="with --base REV --prepare: build head with these tunables (a non-default variant) "
                        "and validate it against the base's defaults")
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

    build_root = args.build_root or _carried(args) or DEFAULT_BUILD_ROOT
    tunables = _parse_tunables(args.tunables)
    if tunables and not args.prepare:
        raise UserError("--tunables builds head with them: give it with --base REV --prepare (then run the plan)")
    if args.all:
        return _run_all(args, tunables)
    if args.kernel is None:
        raise UserError("give a KERNEL (or `block`), or --all")
    if args.kernel == "block":
        return _run_block(args, build_root)
    from validation.policy import own_stage

    stage = own_stage(args.kernel)
    if stage is not None:
        return _run_own_stage(args, build_root, stage, tunables)
    if args.prepare:
        if not is_revision(args.base):
            raise UserError("--prepare needs --base REV (a git revision to build the baseline from)")
        if args.plan is not None:
            raise UserError("--prepare writes a plan; --plan runs one: give one of them")
        plan_path = default_plan_path(args.kernel, build_root)
        try:
            plan = prepare_base_plan(args.kernel, args.base, batches=args.batch, build_root=build_root,
                                     plan_path=plan_path, tunables=tunables)
        except ValidateError as e:
            raise UserError(str(e), 2) from None
        rel = _repo_rel(plan_path, REPO_ROOT)
        print(f"wrote {rel}: {len(plan['variants'])} variant(s), base {plan['base']['sha'][:12]}, "
              f"head {str(plan['head']['sha'])[:12]}")
        _print_next(args.kernel, plan_path, build_root, plan, f"fasttrack sign OUT_DIR/bundle.json --plan {rel}")
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
                                 title=args.title, plan_path=args.plan,
                                 seeds=tuple(args.seeds) if args.seeds else None)
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


def _carried(args) -> Path | None:
    """With --plan and no --build-root: the builds carried beside the plan (validation.plan
    plan_build_root), unpacked; None without a carry there (the default build root then)."""
    if args.plan is None or args.prepare or args.all:
        return None
    from validation.plan import PlanError, plan_build_root

    try:
        return plan_build_root(args.plan)
    except PlanError as e:
        raise UserError(str(e), 2) from None


def _print_next(kernel: str, plan_path: Path, build_root: Path, plan: dict, then: str) -> None:
    """After a prepare: the plan's carry beside it (validation.plan carry_plan) and the commands
    for the GPU host and back here."""
    from kernels.manifest import REPO_ROOT

    from validation.plan import PlanError, carry_note, carry_plan

    try:
        carry = carry_plan(plan_path, build_root, plan)
    except PlanError as e:
        raise UserError(f"the plan is written, but its carry is not: {e}", 2) from None
    rel = _repo_rel(plan_path, REPO_ROOT)
    folder = _repo_rel(Path(plan_path).parent, REPO_ROOT)
    print(f"carry: {folder} ({carry['folders']} build folders, {carry_note(carry)})")
    print(f"next, on the GPU host (carry {folder}):\n"
          f"  PYTHONPATH=. python3 -m validation.cli validate {kernel} --plan {rel} --out OUT_DIR\n"
          f"then here: {then}")


def _repo_rel(path: Path, root: Path) -> str:
    """`path` relative to the repository when it lies inside it (commands to copy stay portable)."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def _parse_tunables(items) -> dict:
    out = {}
    for it in items or []:
        name, sep, value = it.partition("=")
        if not sep or not name:
            raise UserError(f"--tunables {it!r}: write NAME=VALUE")
        try:
            out[name] = int(value)
        except ValueError:
            raise UserError(f"--tunables {it!r}: the value must be an integer") from None
    return out


def _run_all(args, tunables: dict) -> int:
    from validation.plan import PlanError, prepare_all, run_all
    from validation.validate import ValidateError

    if args.root is None:
        raise UserError("--all needs --root DIR (the folder of the plans and the carry)")
    try:
        if args.prepare:
            if args.base is None or args.base == "torch":
                raise UserError("--all --prepare needs --base REV")
            only = [x for x in args.only.split(",") if x]
            kernels = [x for x in only if x not in ("block", "sanitize")] if only else None
            if only and not kernels and "sanitize" not in only and "block" not in only:
                raise UserError("--only names nothing to prepare")
            doc = prepare_all(args.base, args.root, tunables=tunables or None,
                              kernels=kernels if kernels or not only else [],
                              with_block=not only or "block" in only,
                              with_sanitize=not only or "sanitize" in only)
            print(f"prepared {', '.join(doc['prepared'])} under {args.root}"
                  + (f"; FAILED: {', '.join(doc['failed'])}" if doc["failed"] else "")
                  + f"; carry {args.root} ({doc['carry']['archive_bytes'] / (1 << 20):.1f} MiB)")
            print(f"next, on the GPU host: PYTHONPATH=. python3 -m validation.plan run --root {args.root} "
                  f"--out OUT_DIR --budget-s 560")
            return 1 if doc["failed"] else 0
        if args.out is None:
            raise UserError("--all (run) needs --out DIR")
        s = run_all(args.root, args.out, budget_s=args.budget_s,
                    only=[x for x in args.only.split(",") if x] or None, seeds=tuple(args.seeds or (0, 1)))
    except (PlanError, ValidateError) as e:
        raise UserError(str(e), 2) from None
    bad = [n for n, r in s["results"].items() if r.get("verdict") == "fail" or "error" in r]
    return 1 if bad else 0


def _run_own_stage(args, build_root, stage, tunables: dict) -> int:
    """A kernel with a stage of its own (validation/policy.py OWN_STAGES): --prepare here (head
    with `tunables` over its defaults), --plan on the GPU host."""
    from kernels.manifest import REPO_ROOT

    from validation.validate import ValidateError, default_plan_path, is_revision

    k = args.kernel
    try:
        if args.prepare:
            if not is_revision(args.base):
                raise UserError(f"validate {k} --prepare needs --base REV (a git revision to build the baseline from)")
            if args.plan is not None:
                raise UserError("--prepare writes a plan; --plan runs one: give one of them")
            path = default_plan_path(k, build_root)
            path.parent.mkdir(parents=True, exist_ok=True)
            plan = stage.prepare(args.base, build_root=build_root, plan_path=path, batches=args.batch,
                                 tunables=tunables or None)
            rel = _repo_rel(path, REPO_ROOT)
            print(f"wrote {rel}: {len(plan['variants'])} variant(s), base {plan['base']['sha'][:12]}")
            _print_next(k, path, build_root, plan, f"fasttrack sign OUT_DIR/bundle.json --plan {rel}")
            return 0
        if args.plan is None:
            raise UserError(f"validate {k} runs from a plan: `fasttrack validate {k} --base REV --prepare` here, "
                            "then --plan P on the GPU host")
        out = args.out or (REPO_ROOT / "evidence_reports" / k)
        refuse_signed_bundle(out / "bundle.json")
        if not cuda_available():
            raise UserError(NO_GPU.format(k=k), 2)
        b = stage.validate(args.plan, build_root=build_root, out_dir=out, batches=args.batch)
    except ValidateError as e:
        raise UserError(str(e), 2) from None
    print(f"wrote {out / 'bundle.json'} and {out / 'report.html'}: verdict {b['verdict']}")
    for r in b["reasons"][:10]:
        print(f"  - {r}", file=sys.stderr)
    return 0 if b["verdict"] == "pass" else 1


def _run_block(args, build_root) -> int:
    from kernels.manifest import REPO_ROOT

    from validation.block_stage import BlockError, prepare_block_plan, validate_block
    from validation.validate import ValidateError

    try:
        if args.prepare:
            if args.base is None or args.base == "torch":
                raise UserError("validate block --prepare needs --base REV")
            path = build_root / "validate" / "block" / "plan.json"
            plan = prepare_block_plan(args.base, build_root=build_root, plan_path=path)
            print(f"wrote {_repo_rel(path, REPO_ROOT)}")
            _print_next("block", path, build_root, plan, "fasttrack sign OUT_DIR/bundle.json")
            return 0
        if args.plan is None:
            raise UserError("validate block runs from a plan: --base REV --prepare here, then --plan P there")
        out = args.out or (Path(args.plan).parent / "out")
        b = validate_block(args.plan, build_root=build_root, out_dir=out)
    except (BlockError, ValidateError) as e:
        raise UserError(str(e), 2) from None
    print(f"wrote {out / 'bundle.json'}: verdict {b['verdict']}")
    return 0 if b["verdict"] == "pass" else 1
