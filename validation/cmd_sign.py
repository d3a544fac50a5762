"""`fasttrack sign BUNDLE [--key PATH] [--plan PLAN]` signs a bundle in place (Ed25519);
`fasttrack sign --generate-key [--key-dir DIR] [--trust]` makes a key pair.

Signing refuses (exit 2, the bundle untouched): a bundle that already carries a signature (one
that verifies is signed; one that does not was changed after signing, and signing it again would
launder the change); and a bundle timed against a base revision that does not match its plan
(validation/validate.py `presign_problems`: kernel, base, and every head and base cubin the plan
built), the plan given by --plan or, by default, build/validate/<kernel>/plan.json.

The private key is written outside the repository (default ~/.config/fasttrack/keys/, or
--key-dir; a folder inside the repository is refused), mode 0600. Its public half goes into
validation/trusted_keys/ only with --trust; otherwise it is written beside the private key and
the command says how to trust it.
"""

from __future__ import annotations

import os
from pathlib import Path

from validation.cli import UserError

USER_KEY_DIR = Path("~/.config/fasttrack/keys")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sign", help="sign an evidence bundle (or generate a signing key)",
                              description="Sign an evidence bundle with an Ed25519 key, in place.")
    p.add_argument("bundle", type=Path, nargs="?", metavar="BUNDLE")
    p.add_argument("--key", type=Path, default=None,
                   help="private key (default: $FASTTRACK_SIGNING_KEY, else the only key in the key folder)")
    p.add_argument("--plan", type=Path, default=None,
                   help="the plan the bundle was run from (default: build/validate/<kernel>/plan.json)")
    p.add_argument("--generate-key", action="store_true", help="create a new key pair")
    p.add_argument("--key-dir", type=Path, default=None,
                   help=f"where --generate-key writes the private key (default: {USER_KEY_DIR}; never inside the repository)")
    p.add_argument("--trust", action="store_true",
                   help="with --generate-key: also add the public key to validation/trusted_keys/ (to commit)")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def key_dir(args_dir: Path | None) -> Path:
    return (args_dir or Path(os.environ.get("FASTTRACK_KEY_DIR") or USER_KEY_DIR)).expanduser()


def generate(args, repo_root: Path) -> int:
    from validation import bundle as B

    kdir = key_dir(args.key_dir)
    if _inside(kdir, repo_root):
        raise UserError(f"--key-dir {kdir} is inside the repository; a private key never is (choose a "
                        f"folder outside it, e.g. {USER_KEY_DIR})", 2)
    try:
        priv, pub, kid = B.generate_key(kdir, B.TRUSTED_KEYS_DIR if args.trust else kdir)
    except B.SigningError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot write the key pair under {kdir}: {e.strerror}") from None
    print(f"key {kid}: private {priv} (keep secret; never commit it)")
    if args.trust:
        print(f"  public {pub.relative_to(repo_root) if _inside(pub, repo_root) else pub}: commit it to trust this key")
    else:
        print(f"  public {pub}; to trust it, copy it to validation/trusted_keys/ and commit it "
              "(or generate with --trust)")
    return 0


def default_key(repo_root: Path) -> Path | None:
    from validation import bundle as B

    env = os.environ.get(B.KEY_ENV)
    if env:
        return Path(env)
    for d in (key_dir(None), repo_root / B.DEFAULT_KEY_DIR):
        keys = sorted(d.glob("*.pem")) if d.is_dir() else []
        if len(keys) == 1:
            return keys[0]
    return None


def plan_problems(bundle: dict, plan_path: Path | None, repo_root: Path) -> list[str]:
    """Why the bundle does not match its plan (empty when it does, or when it was not run from
    one: a bundle timed against torch or nothing)."""
    import json

    from validation import validate as V

    change = bundle.get("change") or {}
    base = change.get("base")
    if not base or base in ("torch", "none"):
        return []
    kernel = change.get("kernel") or "KERNEL"
    path = plan_path or V.default_plan_path(kernel, repo_root / "build")
    try:
        plan = json.loads(Path(path).read_text())
    except OSError:
        return [f"it was timed against base {str(base)[:12]}, but its plan {path} cannot be read "
                "(give the plan it was run from with --plan)"]
    except ValueError as e:
        return [f"its plan {path} is not valid JSON ({e})"]
    return [f"{p} (plan {path})" for p in V.presign_problems({**bundle, "signature": None}, plan)]


def run(args) -> int:
    from kernels.manifest import REPO_ROOT

    from validation import bundle as B

    if args.generate_key:
        return generate(args, REPO_ROOT)
    if args.bundle is None:
        raise UserError("give BUNDLE to sign, or --generate-key")
    try:
        bundle = B.load_bundle(args.bundle)
    except B.BundleError as e:
        raise UserError(str(e)) from None
    if bundle.get("signature"):
        res = B.verify_bundle(bundle, B.TRUSTED_KEYS_DIR)
        if res.ok:
            raise UserError(f"{args.bundle} is already signed by trusted key {res.key_id} and unchanged since: "
                            "nothing to sign (a signed bundle is never signed again)", 2)
        raise UserError(f"{args.bundle} already carries a signature, which does not verify ({res.reason}): "
                        "signing it again would vouch for whatever changed it; validate again instead", 2)
    problems = plan_problems(bundle, args.plan, REPO_ROOT)
    if problems:
        raise UserError(f"{args.bundle} does not match its plan: " + "; ".join(problems[:4])
                        + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""), 2)
    key = args.key or default_key(REPO_ROOT)
    if key is None:
        raise UserError("no signing key: pass --key, set FASTTRACK_SIGNING_KEY, or run "
                        f"`fasttrack sign --generate-key` (one key in {USER_KEY_DIR})")
    try:
        signed = B.sign_bundle(bundle, key)
    except B.SigningError as e:
        raise UserError(str(e)) from None
    B.write_bundle_atomic(args.bundle, signed)
    print(f"signed {args.bundle} with key {signed['signature']['key_id']}")
    return 0
