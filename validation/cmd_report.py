"""`fasttrack report BUNDLE [--out HTML]`: render the HTML evidence report of a bundle, with its
signature verified against the trusted keys and its cubins compared with this checkout's builds;
the page and the output say both."""

from __future__ import annotations

from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="render the HTML evidence report of a bundle",
                              description="Render a self-contained HTML report from an evidence bundle.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument("--out", type=Path, default=None, help="output file (default: report.html beside the bundle)")
    p.add_argument("--trusted", type=Path, default=None, help="trusted keys folder (default: validation/trusted_keys/)")
    p.add_argument("--build-root", type=Path, default=None,
                   help="build cache whose cubins the bundle's binaries are compared with (default: build/)")


def run(args) -> int:
    from validation.atomic import write_text_atomic
    from validation.bundle import BundleError, load_bundle
    from kernels.manifest import REPO_ROOT

    from validation.bundle import TRUSTED_KEYS_DIR
    from validation.report import check_trust, render_report

    try:
        bundle = load_bundle(args.bundle)
    except BundleError as e:
        raise UserError(str(e)) from None
    out = args.out or args.bundle.with_name("report.html")
    trust = check_trust(bundle, args.trusted or TRUSTED_KEYS_DIR, args.build_root or REPO_ROOT / "build")
    html = render_report(bundle, trust)
    write_text_atomic(out, html)  # an existing report is replaced whole or not at all
    sig, bind = trust["signature"], trust["binding"]
    print(f"wrote {out}")
    print(f"  signature: {'verifies, key ' + str(sig['key_id']) if sig['status'] == 'ok' else sig['reason']}")
    print(f"  cubin binding: {bind['status']}: {bind.get('detail', '')}")
    return 0
