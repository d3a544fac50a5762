"""`fasttrack audit`: the static race audit of a manifest kernel or of a standalone PTX/cubin.

    fasttrack audit KERNEL [--mutant M] [--json]
    fasttrack audit --all [--json]
    fasttrack audit --ptx F.ptx [--cubin F.cubin] [--param NAME_OR_INDEX=ROLE[:DIRECTION] ...]
                    [--points-to TABLE=STRIDE:OFFSET=ROLE,OFFSET=ROLE...] [--json]

Exit 0 when clean, 1 when any finding has severity error, 2 for bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from validation.cli import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="static race audit of built PTX and SASS",
                       description="Static race audit (PTX and SASS) against parameter roles.")
    p.add_argument("kernel", nargs="?", help="manifest kernel to build and audit")
    p.add_argument("--all", action="store_true", help="audit every manifest kernel")
    p.add_argument("--mutant", help="audit a planted mutant of KERNEL (tests and evidence)")
    p.add_argument("--ptx", type=Path, help="standalone PTX file to audit")
    p.add_argument("--cubin", type=Path, help="its cubin (audits the SASS too)")
    p.add_argument("--param", action="append", default=[], metavar="NAME_OR_INDEX=ROLE[:DIRECTION]",
                   help="role of a PTX parameter (static, activation, sync, scratch, scalar, tagged), "
                        "optionally its direction (in, out, inout: a store to an input is an error); "
                        "parameters not named are activation")
    p.add_argument("--points-to", action="append", default=[], metavar="TABLE=STRIDE:OFF=ROLE,...",
                   help="a task table parameter: entries of STRIDE bytes whose 8 bytes at each OFF "
                        "hold a pointer to a buffer of ROLE (scalar: not a pointer); see "
                        "validation/race/MODEL.md")
    p.add_argument("--entry", help="PTX entry to audit when the file has several")
    p.add_argument("--json", action="store_true", help="print machine-readable findings")


def _parse_params(items: list[str]) -> tuple[dict, dict]:
    roles, dirs = {}, {}
    for it in items:
        key, sep, role = it.partition("=")
        if not sep or not key or not role:
            raise UserError(f"--param {it!r}: expected NAME_OR_INDEX=ROLE[:DIRECTION]")
        role, _, direction = role.partition(":")
        roles[key.strip()] = role.strip()
        if direction.strip():
            dirs[key.strip()] = direction.strip()
    return roles, dirs


def _parse_points_to(items: list[str]) -> dict | None:
    out = {}
    for it in items:
        table, sep, rest = it.partition("=")
        stride, sep2, slots = rest.partition(":")
        try:
            decl = {"stride": int(stride, 0), "slots": {}}
            for part in slots.split(","):
                off, sep3, role = part.partition("=")
                if not sep3:
                    raise ValueError
                decl["slots"][int(off, 0)] = role.strip()
        except ValueError:
            raise UserError(f"--points-to {it!r}: expected TABLE=STRIDE:OFFSET=ROLE[,OFFSET=ROLE...]") from None
        if not sep or not sep2 or not table:
            raise UserError(f"--points-to {it!r}: expected TABLE=STRIDE:OFFSET=ROLE[,OFFSET=ROLE...]")
        out[table.strip()] = decl
    return out or None


def _standalone(args):
    from validation.race.audit import AuditInputError, audit_ptx
    from validation.race.sass import SassError, disassemble

    try:
        text = args.ptx.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read PTX {args.ptx}: {getattr(e, 'strerror', None) or e}") from None
    sass = None
    if args.cubin is not None:
        try:
            sass = disassemble(args.cubin)
        except SassError as e:
            raise UserError(str(e)) from None
    roles, dirs = _parse_params(args.param)
    try:
        return [audit_ptx(text, roles, sass_text=sass, entry=args.entry, kernel=args.ptx.name,
                          directions=dirs or None, points_to=_parse_points_to(args.points_to))]
    except AuditInputError as e:
        raise UserError(str(e)) from None


def _manifest(args):
    from kernels.build import BuildError
    from kernels.manifest import ManifestError, load_manifest
    from validation.race.artifacts import audit_kernel

    if args.param or args.cubin or args.entry or args.points_to:
        raise UserError("--param, --points-to, --cubin and --entry go with --ptx")
    try:
        man = load_manifest()
        names = list(man.kernels) if args.all else [args.kernel]
        if args.mutant and args.all:
            raise UserError("--mutant needs one KERNEL, not --all")
        for n in names:
            man.kernel(n)
        return [audit_kernel(n, mutant=args.mutant, manifest=man) for n in names]
    except (ManifestError, BuildError) as e:
        raise UserError(str(e)) from None


def run(args) -> int:
    if args.ptx is not None:
        if args.kernel or args.all or args.mutant:
            raise UserError("give either KERNEL/--all or --ptx, not both")
        reports = _standalone(args)
    elif args.kernel or args.all:
        reports = _manifest(args)
    else:
        raise UserError("name a KERNEL, --all, or --ptx FILE")
    if args.json:
        json.dump({"clean": all(r.clean for r in reports), "reports": [r.to_dict() for r in reports]},
                  sys.stdout, indent=2)
        print()
    else:
        for r in reports:
            status = "clean" if r.clean else f"{len(r.errors)} error(s)"
            print(f"{r.kernel}: {status} ({'+'.join(r.checked)}, {r.seconds:.2f} s)")
            for f in r.findings:
                print(f"  {f}")
    return 0 if all(r.clean for r in reports) else 1
