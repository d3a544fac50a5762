"""How long the gate's static verdict takes for a one-kernel change (scope, base and head builds
of the touched kernel's variants, static audit), on a scratch clone of this repository.

    python benchmarks/gate_static.py [--runs 2] [--jobs N] [--executor local|ray] [--profile FILE]

The change: gated_situ's SiTU up limit (kernels/ops/epilogue.py UP_LIMIT), a real code change of
one kernel, all of its manifest variants; residual, the other kernel of that file, is rebuilt and
found the same. (rmsnorm's tile would not do: the megakernel runs it too, so a change of it
touches two kernels.) The first run warms the shared cache (build/) with the base builds; each
timed run then edits the limit to a value not built before, so the head builds are cold and the
base builds warm: the cache a gate meets on a pull request. The last line
repeats a run's head (fully warm). Prints the gate's own timings (verdict.scope.timings) and the
wall time; the machine's load average beside them. `--profile FILE` writes a cProfile of the
fully warm repeat (read it with `python -m pstats FILE`, e.g. `sort cumulative`, `stats 40`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--executor", default=None)
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of the fully warm repeat to FILE")
    args = ap.parse_args(argv)
    from gate_fixtures import commit, scratch_clone, write

    from kernels.build import make_executor
    from validation.gate import run_gate

    executor = make_executor(args.executor, args.jobs)
    with tempfile.TemporaryDirectory(prefix="gate-bench-") as d:
        root = Path(d) / "clone"
        base = scratch_clone(root, batches=None, one_problem=())
        src = (root / "kernels/ops/epilogue.py").read_text()
        line = "GATE_LIMIT, UP_LIMIT = 4.0, 25.0"
        assert line in src, "kernels/ops/epilogue.py no longer declares the limits this benchmark edits"
        stamp = int(time.time()) % 100000

        def run(label: str, limit: str, new: bool = True, profile: str | None = None):
            if new:
                write(root, "kernels/ops/epilogue.py", src.replace(line, f"GATE_LIMIT, UP_LIMIT = 4.0, {limit}"))
                head = commit(root, f"gated_situ: up limit {limit}")
            else:
                head = run.last
            run.last = head
            prof = None
            if profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = time.monotonic()
            v = run_gate(base, head, repo=root, build_root=REPO / "build", executor=executor, jobs=args.jobs)
            wall = time.monotonic() - t0
            if prof is not None:
                prof.disable()
                prof.dump_stats(profile)
            t = v.scope.get("timings", {})
            n = (v.scope.get("code") or {}).get("gated_situ", {}).get("variants")
            print(f"{label:<34} static {t.get('static_s', float('nan')):6.1f} s (scope+builds {t.get('scope_s')} s, "
                  f"audit {t.get('build_audit_s')} s), gate wall {wall:6.1f} s, {n} variants, "
                  f"verdict {v.status}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

        run("warm-up (base and head cold)", f"24.{stamp}1")
        for i in range(args.runs):
            run(f"run {i + 1} (base warm, head cold)", f"24.{stamp}{i + 2}")
        run("repeat (base and head warm)", "", new=False, profile=args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
