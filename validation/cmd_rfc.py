"""`fasttrack rfc`: render the fast-track RFC of a change from its scope, evidence and front-matter."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "rfc",
        help="render the fast-track RFC of a change (Markdown)",
        description="Render rfc_templates/rfc.md.j2 for the change from --base to --head: scope and "
                    "invariants from git and the policy, measured effect from the change's evidence "
                    "bundle, and the parts only an author can write from the front-matter (rfc.toml: "
                    "title, summary, motivation, design, prediction, risks, rollback, alternatives, "
                    "questions, [claim]). Missing author fields show as \"(not provided)\".",
        epilog="exit codes: 0 written, 2 bad input (unknown revision, malformed front-matter)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base", required=True, metavar="REV")
    p.add_argument("--head", metavar="REV", help="default: the working tree")
    p.add_argument("--repo", default=".", metavar="PATH")
    p.add_argument("--front-matter", metavar="FILE",
                   help="the author's TOML front-matter (default: the rfc.toml the change carries)")
    p.add_argument("--out", metavar="FILE", help="write the RFC here (default: stdout)")


def find_evidence(repo, scope, kernels) -> tuple[str | None, dict | None, str]:
    """(path, bundle, note) of the newest committed bundle that measures one of `kernels`,
    preferring bundles whose signature verifies. The cubin binding is the gate's job, not this."""
    from .gate import bundle_kernels, bundles_at, check_signature, trusted_keys_at

    keys = trusted_keys_at(repo, scope.merge_base)
    found = []
    for path, b in bundles_at(repo, scope.head).items():
        if isinstance(b, dict) and bundle_kernels(b) & set(kernels):
            status, kid, why = check_signature(b, keys)
            found.append((status == "ok", str(b.get("created", "")), path, b, status, kid, why))
    if not found:
        return None, None, "no evidence bundle for this change"
    ok, _, path, b, status, kid, why = max(found, key=lambda t: (t[0], t[1]))
    if ok:
        note = (f"bundle `{path}`, signature verified (key {kid}); its binding to the rebuilt "
                "cubins is checked by `fasttrack gate`")
    else:
        note = f"bundle `{path}`, signature NOT verified ({status}: {why}); treat as unconfirmed"
    return path, b, note


def run(args) -> int:
    from .cli import UserError
    from .gate import policy_at
    from .policy import PolicyError, evaluate_policy
    from .rfc import FrontMatterError, find_front_matter, render_rfc
    from .scope import ScopeError, compute_scope, open_repo

    try:
        repo = open_repo(args.repo)
        scope = compute_scope(args.base, args.head, repo=repo.working_tree_dir)
        decision = evaluate_policy(scope, policy_at(repo, scope.merge_base))
        front = find_front_matter(repo, scope, args.front_matter)
    except (ScopeError, PolicyError, FrontMatterError) as e:
        raise UserError(str(e), 2) from None
    path, bundle, note = find_evidence(repo, scope, decision.kernels)
    text = render_rfc(front, scope, decision, bundle, note, path)
    if args.out:
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror}", 2) from None
        print(f"fasttrack rfc: wrote {out}")
    else:
        print(text, end="")
    return 0
