"""`fasttrack check --op OP --impl MODULE:CALLABLE [--device cpu|cuda]`: judge any Python callable
that claims to implement a reference op, with every defence; `fasttrack check --list` lists ops.

Exit 0 when it passes, 1 when it fails (the reasons on stderr), 2 for bad input.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="judge a Python callable that claims to implement a reference op (every defence)",
        description="Judge any Python callable with the signature of a reference op of "
        "kernels.reference (without compute_dtype) over the case matrix, against the float64 oracle "
        "with the bf16 reference as yardstick, with every defence against benchmark hacks. "
        "Exit 0 pass, 1 fail, 2 bad input.",
    )
    p.add_argument("--list", action="store_true", help="print each op with its reference as MODULE:FUNCTION")
    p.add_argument("--op", help="reference op name (see --list)")
    p.add_argument("--impl", metavar="MODULE:CALLABLE", help="the implementation to judge")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", default="tiny", help="model config preset for the shapes (tiny, mini, k3)")
    p.add_argument("--quick", action="store_true", help="one seed and two batch sizes (faster, less coverage)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the full report as JSON")


def load_impl(spec: str):
    """Import MODULE:CALLABLE (the current directory is importable); UserError if it cannot be."""
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise UserError(f"--impl {spec!r} is not of the form MODULE:CALLABLE")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        obj = importlib.import_module(mod)
    except Exception as e:  # any import-time failure of user code is bad input, not our bug
        raise UserError(f"cannot import {mod!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{spec} is not callable")
    return obj


def run(args) -> int:
    from validation.check import check_callable, reference_ops

    ops = reference_ops()
    if args.list:
        width = max(map(len, ops))
        for name, ref in ops.items():
            print(f"{name.ljust(width)}  {ref}")
        return 0
    if not args.op or not args.impl:
        raise UserError("give --op OP and --impl MODULE:CALLABLE (or --list)")
    if args.op not in ops:
        raise UserError(f"unknown op {args.op!r}; ops: {', '.join(ops)}")
    from kernels.config import ConfigError, get_config

    try:
        get_config(args.preset)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device on this host (torch.cuda.is_available() is False)")
    fn = load_impl(args.impl)
    print(f"judging {args.impl} as {args.op} ({ops[args.op]}) on {args.device}, preset {args.preset}",
          file=sys.stderr)
    rep = check_callable(args.op, fn, device=args.device, preset=args.preset, quick=args.quick)
    failed = [c for c in rep.cases if not c.passed]
    print(f"cases: {len(rep.cases) - len(failed)}/{len(rep.cases)} passed")
    for d in rep.checks:
        state = ("pass" if d.applicable else "n/a") if d.passed else "FAIL"
        print(f"  {state:4}  {d.name:20} {d.detail}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"op": args.op, "impl": args.impl, "device": args.device,
                                         "passed": rep.passed, "correctness": rep.correctness(),
                                         "defences": rep.defences()}, indent=1, default=str))
    if rep.passed:
        print(f"PASS: {args.impl} implements {args.op}")
        return 0
    print(f"FAIL: {args.impl} does not pass as {args.op}:", file=sys.stderr)
    for r in rep.failure_reasons():
        print(f"  - {r}", file=sys.stderr)
    return 1
