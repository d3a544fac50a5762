"""`fasttrack sign BUNDLE [--key PATH]` signs a bundle in place (Ed25519); `fasttrack sign
--generate-key` makes a key pair: the private half in .fasttrack/keys/ (ignored), the public half in
validation/trusted_keys/ (to commit)."""

from __future__ import annotations

from pathlib import Path

from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sign", help="sign an evidence bundle (or generate a signing key)",
                              description="Sign an evidence bundle with an Ed25519 key, in place.")
    p.add_argument("bundle", type=Path, nargs="?", metavar="BUNDLE")
    p.add_argument("--key", type=Path, default=None,
                   help="private key (default: $FASTTRACK_SIGNING_KEY, else the only key in .fasttrack/keys/)")
    p.add_argument("--generate-key", action="store_true", help="create a new key pair")


def run(args) -> int:
    from kernels.manifest import REPO_ROOT

    from validation import bundle as B

    if args.generate_key:
        try:
            priv, pub, kid = B.generate_key(REPO_ROOT / B.DEFAULT_KEY_DIR)
        except B.SigningError as e:
            raise UserError(str(e)) from None
        print(f"key {kid}: private {priv.relative_to(REPO_ROOT)} (keep secret, never commit), "
              f"public {pub.relative_to(REPO_ROOT)} (commit it to trust this key)")
        return 0
    if args.bundle is None:
        raise UserError("give BUNDLE to sign, or --generate-key")
    key = args.key or B.default_private_key(REPO_ROOT)
    if key is None:
        raise UserError("no signing key: pass --key, set FASTTRACK_SIGNING_KEY, or run "
                        "`fasttrack sign --generate-key` (one key in .fasttrack/keys/)")
    try:
        bundle = B.load_bundle(args.bundle)
        signed = B.sign_bundle(bundle, key)
    except (B.BundleError, B.SigningError) as e:
        raise UserError(str(e)) from None
    B.write_bundle_atomic(args.bundle, signed)
    print(f"signed {args.bundle} with key {signed['signature']['key_id']}")
    return 0
