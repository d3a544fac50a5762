"""Replay the fast-track scope decision over the project's own history, with today's rules.

    python benchmarks/scope_replay.py [--n 60] [--out .fasttrack/scope_replay.jsonl] [--deadline-s S]

For each of the last N commits that touched kernels/ops/ (oldest first, so that a commit's base
builds are the previous commit's head builds: cache hits), the change from its parent is scoped
as the gate scopes it today: today's policy (validation/policy.toml) and today's decode paths
(kernels/manifest.toml [paths], over the kernels each revision declares), and the code compared
by cubin code hash at base and head. To stay affordable the comparison of a kernel stops at its
first variant whose code differs (that is enough to call it touched); a kernel is "same" only
when every manifest variant was compared. Builds go to the shared cache (build/). One JSON line
per commit; a table at the end. Stops starting commits after --deadline-s and reports what
finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def scope_commit(r, sha: str, policy, paths, root: Path, jobs: int | None, build: bool = True):
    from kernels import build as kb
    from validation.policy import evaluate_policy
    from validation.scope import code_candidates, compute_scope, export_tree, with_closures

    t0 = time.monotonic()
    scope = compute_scope(sha + "^", sha, repo=r.working_tree_dir, closures=False)

    def with_paths(m):
        if m is None:
            return None
        ps = {n: dataclasses.replace(p, kernels=tuple(k for k in p.kernels if k in m.kernels))
              for n, p in paths.items()}
        return dataclasses.replace(m, paths=ps)

    scope = dataclasses.replace(scope, base_manifest=with_paths(scope.base_manifest),
                                head_manifest=with_paths(scope.head_manifest))
    from validation.gate import _CODE_DECIDES as code_rules  # the rules the rebuilt code may lift
    final = [v for v in evaluate_policy(scope, policy).violations if v.rule not in code_rules]
    if not final:  # the closures only matter when no other rule decides
        scope = with_closures(scope, r)
        final = [v for v in evaluate_policy(scope, policy).violations if v.rule not in code_rules]
    built = 0
    if not final and code_candidates(scope):
        if not build:
            return None  # needs builds: the second pass
        code = {}
        with tempfile.TemporaryDirectory(prefix="replay-") as d:
            trees = {"base": export_tree(r, scope.merge_base, Path(d, "b")), "head": export_tree(r, sha, Path(d, "h"))}
            for k in code_candidates(scope):
                bs, hs = scope.base_manifest.kernels[k], scope.head_manifest.kernels[k]
                status, changed, n = "same", [], 0
                for shape in hs.shapes:
                    if shape not in bs.shapes:
                        status, changed = "changed", [json.dumps(shape, sort_keys=True)]
                        break
                    reqs = [kb.BuildRequest(bs, dict(shape), bs.tunable_defaults(), trees["base"]),
                            kb.BuildRequest(hs, dict(shape), hs.tunable_defaults(), trees["head"])]
                    a, b = kb.build_requests(reqs, root=root, jobs=jobs)
                    built += sum(1 for x in (a, b) if not isinstance(x, Exception) and not x.cache_hit)
                    n += 1
                    if isinstance(b, Exception):
                        status, changed = "build_failed", [str(b)[:200]]
                        break
                    if isinstance(a, Exception) or a.cubin_code_sha256 != b.cubin_code_sha256:
                        status, changed = "changed", [json.dumps(shape, sort_keys=True)]
                        break
                code[k] = {"status": status, "variants": n, "changed": changed, "errors": [], "head": []}
        scope = dataclasses.replace(scope, code=code)
    d = evaluate_policy(scope, policy)
    return {
        "sha": sha[:12], "subject": r.commit(sha).summary[:80], "status": d.status,
        "kernels": list(d.kernels), "path": d.path, "lines": d.counted_lines,
        "rules": sorted({v.rule for v in d.violations}),
        "violations": [str(v)[:200] for v in d.violations][:6],
        "code": {k: c["status"] for k, c in (scope.code or {}).items()},
        "compiled": built, "seconds": round(time.monotonic() - t0, 1),
    }


def build_cost(r, sha: str) -> int:
    """How many variants the comparison of this commit may build (both sides)."""
    from validation.scope import code_candidates, compute_scope

    try:
        scope = compute_scope(sha + "^", sha, repo=r.working_tree_dir)
    except Exception:
        return 0
    return sum(2 * len(scope.head_manifest.kernels[k].shapes) for k in code_candidates(scope))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--out", type=Path, default=REPO / ".fasttrack" / "scope_replay.jsonl")
    ap.add_argument("--deadline-s", type=float, default=3600)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--root", type=Path, default=REPO / "build")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args(argv)
    if not args.table:
        from kernels.manifest import load_manifest
        from validation.policy import load_policy
        from validation.scope import open_repo

        r = open_repo(REPO)
        shas = r.git.log("--format=%H", "--", "kernels/ops").split()[: args.n][::-1]
        policy, paths = load_policy(), load_manifest().paths
        done = {json.loads(x)["sha"] for x in args.out.read_text().splitlines()} if args.out.exists() else set()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        # First the commits that rules decide without a build (cheap), then those that need builds.
        for build in (False, True):
            if build:  # cheapest first: the fewest variants to compare
                shas = sorted((s for s in shas if s[:12] not in done), key=lambda s: build_cost(r, s))
            for sha in shas:
                if sha[:12] in done:
                    continue
                if time.monotonic() - t0 > args.deadline_s:
                    print(f"deadline: stopped before {sha[:12]}", file=sys.stderr)
                    break
                try:
                    row = scope_commit(r, sha, policy, paths, args.root, args.jobs, build)
                except Exception as e:  # an old revision the scope cannot read: recorded, not fatal
                    row = {"sha": sha[:12], "status": "error", "violations": [f"{type(e).__name__}: {e}"[:300]],
                           "rules": ["error"], "kernels": [], "seconds": 0}
                if row is None:
                    continue
                done.add(row["sha"])
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{row['sha']} {row['status']:<16} {row.get('seconds')}s {','.join(row['rules'])}", flush=True)
    rows = [json.loads(x) for x in args.out.read_text().splitlines()] if args.out.exists() else []
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    counts = Counter(r["status"] for r in rows)
    out = [f"{len(rows)} commits replayed: " + ", ".join(f"{n} {s}" for s, n in counts.most_common()), "",
           "| commit | verdict | touched (by code where it was compared, else by declared sources) | rules that sent it to full review |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['sha']} | {r['status']} | {', '.join(r.get('kernels') or []) or '-'} | "
                   f"{', '.join(r.get('rules') or []) or '-'} |")
    reasons = Counter(rule for r in rows for rule in r.get("rules") or [])
    out += ["", "rules, by commits they sent to full review: "
            + ", ".join(f"{k} {n}" for k, n in reasons.most_common())]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
