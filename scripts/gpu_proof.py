"""Proof of the foundation kernels (rmsnorm, gemv) on a GPU host: numerics against the float64
oracle and speed against torch (cuBLAS) and two bandwidth ceilings measured in the same run.

Two steps, on two hosts:

  python scripts/gpu_proof.py plan [--sweep]          # CPU host with the DSL: build, write the plan
  PYTHONPATH=. python scripts/gpu_proof.py run --out DIR   # GPU host (no DSL): check and time

`plan` builds every manifest variant of the two kernels (default tunables; `--sweep` adds the
tunable variants listed in SWEEP; `--problem N,K` times gemv on other (n, k) instead; `--include OLD_PLAN` adds an earlier plan's cases whose build
folders still exist, to time an earlier design side by side) with kernels/build and writes
build/proof_plan.json: each case's build folder, cubin sha256, build key, and the commit the
sources came from. `run` loads
those cubins through kernels/launch and, per case:
  * numerics: fresh random inputs (two draws, normal and uniform, never zeros), the output
    poisoned with NaN first and checked fully written, compared with the float64 oracle
    (kernels.reference with compute_dtype=float64): max abs error and relative Frobenius error,
    beside the same errors of the bf16 torch path (the yardstick); pass when the kernel's
    relative error is at most max(2 x the yardstick's, a floor of 2^-9 for bf16 outputs or 2^-16
    for fp32) and every element is finite (the policy of validation/tolerances.toml); plus a
    bitwise run-twice determinism check;
  * speed: per-launch CUDA-event medians behind a GPU backlog (benchmarks/common.py), every
    launch reading its own copy of weights and activations, cycling through copies totalling at
    least 4x the L2; torch (`torch.mm`, cuBLAS, bf16 out; `F.rms_norm` for RMSNorm) timed the same
    way on the same copies, interleaved A/B/A/B with the kernel;
  * bytes = weights + activations read + outputs written; TB/s; fraction of the read-only
    streaming ceiling; speedup over torch.
A case that takes longer than `--case-timeout` (a hanging kernel) stops the run with one line
naming it and exit status 3, its name recorded as `hung` in the JSON.
The JSON (written after every case, so a timeout keeps what was measured) records the exact
command, GPU, driver, CUDA runtime and toolkit, torch, commit, and every cubin's sha256. A short
table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.explore_common import invocation  # noqa: E402

PLAN_PATH = Path("build") / "proof_plan.json"
KERNELS = ("rmsnorm", "gemv")
SCHEMA = "fasttrack.gpu_proof/1"

# Tunable variants `plan --sweep` adds: (kernel, batches, tunable grid, problems or None for all).
# Decode GEMM round 3: at batch 1 (and 8) the register ping-pong and the k order across warps;
# from batch 32 a smaller split-K grid (fewer partials).
_GEMV_51MB = [{"n": 3584, "k": 7168}, {"n": 7168, "k": 3584}]
_ROUTER = [{"n": 896, "k": 7168}]
SWEEP = [
    ("gemv", [1], {"prefetch": [1, 2], "k_order": [0, 1]}, _GEMV_51MB),
    ("gemv", [8], {"k_order": [1]}, _GEMV_51MB),
    ("gemv", [32, 64], {"tile_min_ctas": [132]}, _GEMV_51MB + _ROUTER),
]


HANG_EXIT = 3  # exit status of a run stopped by the case watchdog


class CaseWatchdog:
    """Stops the run when one case takes longer than `seconds` (a hanging kernel: an mbarrier
    nobody completes, a spin on a flag nobody sets). A kernel that never finishes blocks the
    next synchronize forever, so nothing in-process can recover: the watchdog records the case
    in the JSON (`hung`, beside every case measured before it), prints one line naming it,
    and exits with HANG_EXIT. Its timer is a Python thread; `faulthandler` backs it 30 s
    later in case the blocked call holds the GIL (it then dumps the stacks and exits 1)."""

    def __init__(self, seconds: float, out_path: Path, doc: dict):
        import threading

        self.seconds, self.out_path, self.doc = seconds, out_path, doc
        self._timer = None
        self._armed: str | None = None
        self._lock = threading.Lock()  # a firing timer and a finishing case never both write

    def arm(self, label: str) -> None:
        import faulthandler
        import threading

        self.cancel()
        if self.seconds <= 0:
            return
        with self._lock:
            self._armed = label
            self._timer = threading.Timer(self.seconds, self._fire, args=(label,))
            self._timer.daemon = True
            self._timer.start()
        faulthandler.dump_traceback_later(self.seconds + 30, exit=True)

    def cancel(self) -> None:
        import faulthandler

        with self._lock:
            self._armed = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                faulthandler.cancel_dump_traceback_later()

    def _fire(self, label: str) -> None:
        with self._lock:  # held until the process exits: the main thread cannot write after us
            if self._armed != label:
                return  # the case finished just in time
            self._stop(label)

    def _stop(self, label: str) -> None:
        import os

        msg = f"case {label} did not finish within {self.seconds:g} s (a hanging kernel?); stopped"
        try:
            self.doc["hung"] = {"case": label, "after_s": self.seconds}
            self.out_path.write_text(json.dumps(self.doc, indent=1))
            msg += f"; the cases before it are in {self.out_path}"
        except Exception as e:  # the message matters more than the note
            msg += f" (could not write {self.out_path}: {e})"
        print(f"gpu_proof: {msg}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)


class ProofError(RuntimeError):
    """A user-fixable problem (no plan, no GPU, a missing build folder)."""


# -- plan (CPU host) -------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _sweep_variants(spec, batches, grid, problems=None):
    names = list(grid)
    for combo in itertools.product(*(grid[n] for n in names)):
        tun = dict(zip(names, combo))
        for shape in spec.shapes:
            if shape["batch"] in batches and (problems is None or any(
                    all(shape.get(k) == v for k, v in prob.items()) for prob in problems)):
                yield dict(shape), tun


def plan(args) -> int:
    """Build the variants and write the plan the GPU host runs."""
    from kernels.build import BuildError, build_kernel, resolve_tunables
    from kernels.manifest import load_manifest
    from kernels.manifest import resolve as resolve_op

    man = load_manifest()
    # Earlier plans first: a missing plan or build folder fails before anything is built.
    included = [c for old_plan in args.include or [] for c in _included_cases(Path(old_plan), args.kernels)]
    groups: list[tuple[str, list[dict], dict]] = []  # (kernel, shapes, tunables)
    extra = _parse_tunables(args.variant or [])
    problems = _parse_problems(args.problem or [])
    if problems and args.kernels != ["gemv"]:
        raise ProofError("--problem applies to gemv alone: add --kernels gemv")
    for k in args.kernels:
        if problems:  # these (n, k) instead of the manifest's, at its batches (or --batch)
            batches = sorted({s["batch"] for s in man.kernel(k).shapes if not args.batch or s["batch"] in args.batch})
            shapes = [{"batch": b, "n": n, "k": kk, "out_dtype": "bfloat16"} for n, kk in problems for b in batches]
        else:
            shapes = [dict(s) for s in man.kernel(k).shapes if not args.batch or s.get("batch") in args.batch]
        groups.append((k, shapes, {}))
        for tun in extra:  # the same shapes again with these tunables, timed beside the defaults
            try:
                groups.append((k, shapes, resolve_tunables(man.kernel(k), tun)))
            except BuildError as e:
                raise ProofError(str(e)) from None
    if args.sweep:
        for k, batches, grid, problems in SWEEP:
            if k not in args.kernels:
                continue
            spec = man.kernel(k)
            by_tun: dict[str, tuple[dict, list]] = {}
            for shape, tun in _sweep_variants(spec, batches, grid, problems):
                full = resolve_tunables(spec, tun)
                try:  # skip combinations the op rejects (e.g. shared memory over the limit)
                    resolve_op(spec.op)(shape, **full)
                except ValueError:
                    continue
                by_tun.setdefault(json.dumps(full, sort_keys=True), (full, []))[1].append(shape)
            for full, shapes in by_tun.values():
                groups.append((k, shapes, full))

    cases, seen = [], set()
    t0 = time.time()
    for k, shapes, tun in groups:
        def progress(done, total, art):
            print(f"  built {art.kernel} {art.shape} {art.tunables} {'(cached)' if art.cache_hit else ''}",
                  flush=True)

        try:
            arts = build_kernel(k, shapes=shapes, tunables=tun or None, root=Path(args.root).resolve(), progress=progress)
        except BuildError as e:
            raise ProofError(str(e)) from None
        for a in arts:
            if a.key in seen:
                continue
            seen.add(a.key)
            cases.append({
                "kernel": a.kernel,
                "shape": a.shape,
                "tunables": a.tunables,
                "default_tunables": a.tunables == man.kernel(a.kernel).tunable_defaults(),
                "dir": str(Path(a.dir).resolve().relative_to(REPO)),
                "build_key": a.key,
                "cubin_sha256": a.meta["hashes"]["cubin_sha256"],
                "cubin_code_sha256": a.cubin_code_sha256,
                "registers": a.meta["resources"]["registers"],
                "spill_bytes": a.meta["resources"]["spill_store_bytes"] + a.meta["resources"]["spill_load_bytes"],
            })
    for c in included:  # an earlier build this plan already lists is timed once
        if c["build_key"] not in seen:
            seen.add(c["build_key"])
            cases.append(c)
    dirty = _git("status", "--porcelain", "--", "kernels", "benchmarks", "scripts")
    out = {
        "schema": SCHEMA + "#plan",
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(dirty),
        "command": invocation("python"),
        "cases": cases,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"plan: {len(cases)} cases in {time.time() - t0:.0f} s -> {path}"
          f"{' (sources dirty: uncommitted changes)' if dirty else ''}")
    return 0


def _parse_problems(items: list[str]) -> list[tuple[int, int]]:
    """`--problem 49152,7168` -> [(49152, 7168)]: gemv's (n, k), bf16 out."""
    out = []
    for item in items:
        parts = item.split(",")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ProofError(f"--problem {item!r}: expected N,K (two positive integers)")
        out.append((int(parts[0]), int(parts[1])))
    return out


def _parse_tunables(items: list[str]) -> list[dict]:
    """`--variant pdl=1 --variant prefetch=2,pdl=1` -> [{"pdl": 1}, {"prefetch": 2, "pdl": 1}]."""
    out = []
    for item in items:
        tun = {}
        for part in item.split(","):
            key, eq, val = part.partition("=")
            if not eq or not key or not val.lstrip("-").isdigit():
                raise ProofError(f"--variant {item!r}: expected NAME=INT[,NAME=INT...]")
            tun[key] = int(val)
        out.append(tun)
    return out


def _included_cases(path: Path, kernels) -> list[dict]:
    """An earlier plan's cases of `kernels` (for side-by-side timing of an earlier design): each
    keeps its own build folder, hashes and tunables, is marked `from_plan` with that plan's
    commit and never counts as a default variant. Raises ProofError when the plan or one of its
    folders is gone."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProofError(f"cannot read the plan to include, {path}: {e}") from None
    out = []
    for c in doc.get("cases", []):
        if c["kernel"] not in kernels:
            continue
        if not (REPO / c["dir"]).is_dir():
            raise ProofError(f"{path}: build folder {c['dir']} is missing (rebuild it at commit {doc.get('commit')})")
        out.append({**c, "default_tunables": False, "from_plan": doc.get("commit")})
    return out


# -- run (GPU host) --------------------------------------------------------------------------


def run(args) -> int:
    """Check and time every case of the plan on this GPU; write JSON under --out."""
    import torch

    from benchmarks.benchmark_gemv import GemvCase
    from benchmarks.benchmark_rmsnorm import RMSNormCase
    from benchmarks.common import (MAX_ERROR_RATIO, REL_FRO_FLOOR, check_numerics, copy_bandwidth,
                                   gpu_environment, launch_floor, read_bandwidth,
                                   time_against_torch)
    from kernels.launch import CubinKernel

    case_types = {"gemv": GemvCase, "rmsnorm": RMSNormCase}

    if not torch.cuda.is_available():
        raise ProofError("no CUDA device: run this on the GPU host")
    try:
        plan_doc = json.loads(Path(args.plan).read_text())
    except OSError as e:
        raise ProofError(f"cannot read the plan {args.plan}: {e.strerror} (run `gpu_proof.py plan` first)") from None
    cases = [c for c in plan_doc["cases"] if c["kernel"] in args.kernels]
    if args.defaults_only:
        cases = [c for c in cases if c["default_tunables"]]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "gpu_proof.json"

    torch.manual_seed(args.seed)
    doc = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": invocation("PYTHONPATH=. python"),
        "plan_command": plan_doc.get("command"),
        "commit": plan_doc.get("commit"),
        "sources_dirty": plan_doc.get("dirty"),
        "environment": gpu_environment(),
        "policy": {"rel_fro_floor": REL_FRO_FLOOR, "max_error_ratio": MAX_ERROR_RATIO,
                   "rule": "rel_fro(kernel) <= max(ratio * rel_fro(torch bf16 path), floor), all finite, "
                           "bitwise run-twice"},
        "timing": {"reps": args.reps, "rounds": args.rounds, "rotation": "copies totalling >= 4x L2",
                   "graph": "median over CUDA-graph replays of (replay time / launches in the graph); the "
                            "serving condition (a decode step runs as one graph); the primary figure",
                   "stream": "median of per-launch CUDA-event times behind a GPU backlog (includes the "
                             "stream's per-launch gap)"},
        "ceilings": {},
        "cases": [],
    }
    print("ceilings ...", flush=True)
    doc["ceilings"]["read"] = read_bandwidth()
    doc["ceilings"]["copy"] = copy_bandwidth()
    doc["ceilings"]["launch_floor"] = launch_floor()
    read_tbps = doc["ceilings"]["read"]["tbps"]
    print(f"read-only {read_tbps:.3f} TB/s ({doc['ceilings']['read']['kernel']}), "
          f"copy {doc['ceilings']['copy']['tbps']:.3f} TB/s, launch floor {doc['ceilings']['launch_floor']}",
          flush=True)

    torch_cache: dict[str, dict] = {}
    watchdog = CaseWatchdog(args.case_timeout, out_path, doc)
    try:
        for i, entry in enumerate(cases):
            watchdog.arm(f"{i + 1}/{len(cases)} {entry['kernel']} {entry['shape']} {entry['tunables']}")
            # The case sizes its scratch (split-K partials, counters) for the variant's tunables.
            case = (GemvCase(entry["shape"], entry["tunables"]) if entry["kernel"] == "gemv"
                    else case_types[entry["kernel"]](entry["shape"]))
            d = REPO / entry["dir"]
            if not d.is_dir():
                raise ProofError(f"build folder {entry['dir']} is missing: carry `build` with the run")
            kern = CubinKernel.from_dir(d)
            if kern.sha256 != entry["cubin_sha256"]:
                raise ProofError(f"{entry['dir']}: cubin sha256 differs from the plan's")
            row = {k: entry[k] for k in ("kernel", "shape", "tunables", "default_tunables", "build_key",
                                         "cubin_sha256", "registers", "spill_bytes")}
            if entry.get("cubin_code_sha256"):
                row["cubin_code_sha256"] = entry["cubin_code_sha256"]
            if entry.get("from_plan"):
                row["from_plan"] = entry["from_plan"]
            try:
                row["numerics"] = check_numerics(kern, case)
                key = json.dumps([entry["kernel"], entry["shape"]], sort_keys=True)
                need_torch = key not in torch_cache
                t = time_against_torch(kern, case, reps=args.reps, rounds=args.rounds, with_torch=need_torch)
                if need_torch:
                    torch_cache[key] = {w: t[w]["torch"] for w in ("graph", "stream")}
                row["timing"] = t
                for way in ("graph", "stream"):
                    t[way]["torch"] = torch_cache[key][way]
                    us, tus = t[way]["kernel"]["median_us"], t[way]["torch"]["median_us"]
                    row[way] = {"us": us, "torch_us": tus, "tbps": t["bytes"] / us / 1e6,
                                "fraction_of_read": t["bytes"] / us / 1e6 / read_tbps,
                                "torch_tbps": t["bytes"] / tus / 1e6, "speedup_vs_torch": tus / us}
            except Exception as e:  # one failing case must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
            watchdog.cancel()
            doc["cases"].append(row)
            out_path.write_text(json.dumps(doc, indent=1))
            print(f"[{i + 1}/{len(cases)}] {entry['kernel']} {entry['shape']} {entry['tunables']}: "
                  + (row.get("error") or f"graph {row['graph']['us']:.2f} us ({row['graph']['fraction_of_read']:.1%} "
                     f"of read, x{row['graph']['speedup_vs_torch']:.2f} vs torch), stream {row['stream']['us']:.2f} us "
                     f"(x{row['stream']['speedup_vs_torch']:.2f}), numerics {'ok' if row['numerics']['passed'] else 'FAIL'}"),
                  flush=True)
    finally:
        watchdog.cancel()  # an error or an interrupt leaves no timer behind

    doc["passed_numerics"] = all(c.get("numerics", {}).get("passed") for c in doc["cases"])
    out_path.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out_path}")
    print(summary_table(doc))
    return 0 if doc["passed_numerics"] else 1



def summary_table(doc: dict, *, best_only: bool = True) -> str:
    """The short table: per kernel and shape, the default variant (or the fastest, with --sweep)."""
    from benchmarks.common import format_table

    rows = []
    defaults = {c["kernel"]: c["tunables"] for c in doc["cases"] if c.get("default_tunables")}
    for c in doc["cases"]:
        if "error" in c:
            rows.append({"case": _label(c), "err": c["error"][:40]})
            continue
        tr = max(c["numerics"]["trials"], key=lambda t: t["kernel"]["rel_fro"])
        g, st = c["graph"], c["stream"]
        rows.append({
            "case": _label(c), "tun": _tun(c, defaults.get(c["kernel"], {})),
            "us": g["us"], "torch_us": g["torch_us"], "tbps": g["tbps"], "read": g["fraction_of_read"],
            "x": g["speedup_vs_torch"], "sus": st["us"], "sx": st["speedup_vs_torch"],
            "rel": tr["kernel"]["rel_fro"], "trel": tr["torch_path"]["rel_fro"],
            "ok": "ok" if c["numerics"]["passed"] else "FAIL",
        })
    cols = [("case", "case", ""), ("tun", "tunables", ""), ("us", "us", ".2f"), ("torch_us", "torch", ".2f"),
            ("tbps", "TB/s", ".3f"), ("read", "of read", ".1%"), ("x", "vs torch", ".2f"),
            ("sus", "stream us", ".2f"), ("sx", "vs torch", ".2f"),
            ("rel", "rel err", ".2e"), ("trel", "torch err", ".2e"), ("ok", "num", ""), ("err", "error", "")]
    c = doc["ceilings"]
    head = (f"{doc['environment']['gpu']}, driver {doc['environment']['driver']}, read ceiling "
            f"{c['read']['tbps']:.3f} TB/s, copy {c['copy']['tbps']:.3f} TB/s; columns 3-7: CUDA-graph "
            f"replay, then per-launch stream events")
    return head + "\n" + format_table(rows, cols)


def _label(c: dict) -> str:
    s = c["shape"]
    if c["kernel"] == "gemv":
        return f"gemv b{s['batch']} {s['k']}->{s['n']}{' f32' if s.get('out_dtype') == 'float32' else ''}"
    return f"rmsnorm b{s['batch']} w{s['width']}"


def _tun(case: dict, defaults: dict) -> str:
    """The tunables that differ from this run's defaults ('' for a default variant); an earlier
    plan's case is prefixed with its commit."""
    short = {"warps_per_cta": "w", "row_tiles": "r", "k_unroll": "u", "prefetch": "p", "threads": "t",
             "tiled_from_batch": "tb", "tile_warps": "tw", "tile_row_tiles": "tr", "tile_k_unroll": "tu",
             "tile_min_ctas": "mc", "tile_stages": "st", "k_order": "ko"}
    t = case["tunables"]
    diff = " ".join(f"{short.get(k, k)}{v}" for k, v in t.items() if defaults.get(k) != v)
    if case.get("from_plan"):
        return f"@{case['from_plan'][:7]} {diff}".strip()
    return "" if case.get("default_tunables") else diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("plan", help="build the variants and write the plan (CPU host, needs the DSL)")
    pp.add_argument("--sweep", action="store_true", help="add the tunable variants of SWEEP")
    pp.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    pp.add_argument("--root", default="build", help="build cache root (default: build)")
    pp.add_argument("--out", default=str(PLAN_PATH))
    pp.add_argument("--batch", type=int, nargs="+", help="only the manifest shapes of these batch sizes")
    pp.add_argument("--problem", action="append", metavar="N,K",
                    help="gemv only: time y = x @ W.T with W of N x K (bf16) at the manifest's batches "
                         "(or --batch) instead of the manifest's problems (repeatable)")
    pp.add_argument("--variant", action="append", metavar="NAME=INT[,NAME=INT]",
                    help="also build the (selected) manifest shapes with these tunables (repeatable)")
    pp.add_argument("--include", nargs="*", metavar="OLD_PLAN",
                    help="also list an earlier plan's cases (their build folders must exist)")
    pr = sub.add_parser("run", help="check and time the plan's cubins (GPU host, no DSL)")
    pr.add_argument("--plan", default=str(PLAN_PATH))
    pr.add_argument("--out", required=True, help="folder for gpu_proof.json")
    pr.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    pr.add_argument("--defaults-only", action="store_true", help="skip sweep variants")
    pr.add_argument("--reps", type=int, default=100, help="timed launches per round")
    pr.add_argument("--rounds", type=int, default=2, help="interleaved kernel/torch rounds")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--case-timeout", type=float, default=180.0,
                    help="seconds one case may take before the run stops as hung (exit 3; 0: no limit)")
    pt = sub.add_parser("table", help="print the table of a gpu_proof.json")
    pt.add_argument("json")
    args = p.parse_args(argv)
    try:
        if args.step == "plan":
            return plan(args)
        if args.step == "run":
            return run(args)
        print(summary_table(json.loads(Path(args.json).read_text())))
        return 0
    except ProofError as e:
        print(f"gpu_proof: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
