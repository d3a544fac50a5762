"""`fasttrack gate`: may this change be fast-tracked, and does its GPU evidence hold?"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_CODES = """\
exit codes:
  0  pass: eligible, rebuilt, bound to signed evidence that passes (or: no kernel change, or
     no code change: every kernel builds to the same code at base and head)
  1  fail: the kernel does not build, the audit or the evidence fails, or no evidence binds
  2  bad input or infrastructure error (unknown revision, shallow clone, no GPU for --run-gpu)
  3  not eligible for fast track: route to full review (each failing rule is listed)

outputs (under --out): verdict.json, report.html, pr_comment.md
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gate",
        help="judge a change: scope policy, build, static audit, evidence binding",
        description="Judge the change from --base to --head: is it eligible for fast track (one "
                    "kernel, within the line bound, nothing protected touched), does the kernel "
                    "build, and does a committed, signed evidence bundle bind to the rebuilt cubins "
                    "and pass?",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", required=True, metavar="REV", help="the revision the change is based on")
    p.add_argument("--head", metavar="REV",
                   help="the revision to judge (default: the working tree, untracked files included)")
    p.add_argument("--repo", default=".", metavar="PATH", help="the repository (default: .)")
    p.add_argument("--out", metavar="DIR",
                   help="where to write verdict.json, report.html, pr_comment.md "
                        "(default: <repo>/.fasttrack/gate)")
    p.add_argument("--run-gpu", action="store_true",
                   help="on a GPU host: run the validator here instead of binding committed evidence")
    p.add_argument("--scope-only", action="store_true",
                   help="stop after the scope policy (CI runs this from the trusted base first)")
    p.add_argument("--front-matter", metavar="FILE",
                   help="the RFC front-matter (TOML) holding the speedup claim "
                        "(default: the rfc.toml the change carries)")
    p.add_argument("--json", action="store_true", help="print verdict.json to stdout")
    p.add_argument("--github-output", metavar="FILE",
                   help="append the verdict as step outputs to FILE ($GITHUB_OUTPUT): status=, "
                        "kernels=<JSON list of every touched kernel> and targets=<JSON list of the "
                        "validate entries the evidence needs>, each list usable as a job matrix")
    p.add_argument("--executor", metavar="local|ray|ray:ADDRESS", default=None,
                   help="where variants compile (default: $FASTTRACK_BUILD_EXECUTOR, else local processes)")
    p.add_argument("--jobs", type=int, default=None, help="local compile processes (default: CPU count, at most 4)")
    p.add_argument("--no-sandbox", action="store_true",
                   help="build the change's code without bubblewrap (kernels/sandbox.py), for hosts that "
                        "lack it; by default every compile child runs sandboxed, and the gate exits 2 "
                        "where the sandbox cannot run")


def run(args) -> int:
    from .cli import UserError
    from .gate import DEFAULT_OUT, EXIT_ERROR, GateError, ci_outputs, run_gate, write_outputs

    executor = None
    if args.executor:
        from kernels.build import BuildError, make_executor

        try:
            executor = make_executor(args.executor, args.jobs)
        except BuildError as e:
            raise UserError(str(e), EXIT_ERROR) from None
    verdict = run_gate(args.base, args.head, repo=args.repo, run_gpu=args.run_gpu,
                       scope_only=args.scope_only, front_matter=args.front_matter,
                       executor=executor, jobs=args.jobs,
                       **({"sandbox": None} if args.no_sandbox else {}))
    if args.out:
        out = Path(args.out)
    else:
        repo_dir = Path(args.repo)
        out = (repo_dir / DEFAULT_OUT) if (repo_dir / ".git").exists() else DEFAULT_OUT
    try:
        written = write_outputs(verdict, out)
    except GateError as e:
        raise UserError(str(e), EXIT_ERROR) from None
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e.strerror}", EXIT_ERROR) from None

    if args.github_output:
        try:
            with open(args.github_output, "a", encoding="utf-8") as f:
                f.writelines(f"{k}={v}\n" for k, v in ci_outputs(verdict).items())
        except OSError as e:
            raise UserError(f"cannot write to {args.github_output}: {e.strerror}", EXIT_ERROR) from None
    if verdict.status == "error":
        print(f"fasttrack gate: ERROR (exit {verdict.exit_code}); outputs in {out}")
        raise UserError("; ".join(verdict.reasons), verdict.exit_code)
    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2, sort_keys=True))
    else:
        print(f"fasttrack gate: {verdict.status.upper()} (exit {verdict.exit_code})")
        if verdict.cause:  # a failure leads with its one cause and the command that addresses it
            print(f"  cause: {verdict.cause}")
            if verdict.next_command:
                print(f"  next: {verdict.next_command}")
        for r in verdict.reasons:
            print(f"  {r}")
        for n in verdict.risks:
            print(f"  risk: {n}")
        for n in verdict.not_covered:
            print(f"  not covered: {n}")
        print(f"  report: {written['report.html']}")
        print(f"  verdict: {written['verdict.json']}  PR comment: {written['pr_comment.md']}")
    sys.stdout.flush()
    return verdict.exit_code
