"""`fasttrack verify BUNDLE [--trusted DIR]`: exit 0 when the bundle is signed by a trusted key and
unchanged since; 1 otherwise (with the reason); 2 for an unreadable bundle."""

from __future__ import annotations

from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="verify an evidence bundle's signature",
                              description="Verify a bundle's Ed25519 signature against the trusted keys.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE")
    p.add_argument("--trusted", type=Path, default=None, help="trusted keys folder (default: validation/trusted_keys/)")


def run(args) -> int:
    from validation import bundle as B

    try:
        bundle = B.load_bundle(args.bundle)
    except B.BundleError as e:
        raise UserError(str(e)) from None
    res = B.verify_bundle(bundle, args.trusted or B.TRUSTED_KEYS_DIR)
    if res.ok:
        print(f"OK: {args.bundle} is signed by trusted key {res.key_id} and unchanged")
        return 0
    print(f"NOT VERIFIED: {args.bundle}: {res.reason}")
    return 1
