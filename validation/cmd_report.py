"""`fasttrack report BUNDLE [--out HTML]`: re-render the HTML evidence report from a bundle alone."""

from __future__ import annotations

from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="render the HTML evidence report of a bundle",
                              description="Render a self-contained HTML report from an evidence bundle.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument("--out", type=Path, default=None, help="output file (default: report.html beside the bundle)")


def run(args) -> int:
    from validation.atomic import write_text_atomic
    from validation.bundle import BundleError, load_bundle
    from validation.report import render_report

    try:
        bundle = load_bundle(args.bundle)
    except BundleError as e:
        raise UserError(str(e)) from None
    out = args.out or args.bundle.with_name("report.html")
    html = render_report(bundle)
    write_text_atomic(out, html)  # an existing report is replaced whole or not at all
    print(f"wrote {out}")
    return 0
