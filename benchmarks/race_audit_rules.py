"""Time the static race audit over every manifest kernel, per rule group.

    python benchmarks/race_audit_rules.py [--repeat N] [--json]

Builds (or takes from the build cache) each manifest kernel's default variant, then audits its
PTX and SASS `--repeat` times and prints the median seconds per kernel and, summed over the
kernels, per analysis (parse, cfg+provenance, and each rule group `check_function` times). The
build is outside the timing. Run from the repository root with it on PYTHONPATH; on an older
tree whose audit reports no per-rule timings only the totals print. `step-keys` is the per-step
ordering rule's own analysis (induction variables, validation/race/steps.py); its key checks
run inside `ordering`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from kernels.manifest import load_manifest
    from validation.race.artifacts import audit_artifact, build_variant_of

    man = load_manifest()
    per_kernel, per_rule = {}, {}
    for name, spec in man.kernels.items():
        art = build_variant_of(spec)
        runs, rules = [], []
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            rep = audit_artifact(art, spec)
            runs.append(time.perf_counter() - t0)
            rules.append(getattr(rep, "timings", {}) or {})
        per_kernel[name] = statistics.median(runs)
        for key in set().union(*rules):
            per_rule[key] = per_rule.get(key, 0.0) + statistics.median(r.get(key, 0.0) for r in rules)
    total = sum(per_kernel.values())
    if args.json:
        json.dump({"total_s": total, "kernels": per_kernel, "rules": per_rule}, sys.stdout, indent=2)
        print()
        return 0
    for name, s in per_kernel.items():
        print(f"{name:16s} {s:8.3f} s")
    print(f"{'total':16s} {total:8.3f} s (audit only, median of {args.repeat})")
    for key, s in sorted(per_rule.items(), key=lambda kv: -kv[1]):
        print(f"  {key:18s} {s:8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
