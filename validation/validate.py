"""`fasttrack validate`: build (or find prebuilt) cubins, audit them, run the GPU stages isolated,
and write the evidence bundle and its report.

On a CPU host with the DSL: builds every requested variant (content-addressed, cache hits are
free), runs the static race audit and records the hashes; without a GPU it says so and records the
GPU stages as not covered. On the GPU host (no DSL, no gitpython, no cryptography): finds the
prebuilt folders under `build/` whose recorded source hashes match the checkout, and runs the
numerics and benchmark stages, each in a child process with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernels.manifest import REPO_ROOT, KernelSpec, ManifestError, load_manifest

from . import bundle as B
from .isolate import run_stage

DEFAULT_BUILD_ROOT = REPO_ROOT / "build"
NUMERICS_TIMEOUT_S = 420
BENCH_TIMEOUT_S = 420
DEFENCE_ORDER = ("poisoned_outputs", "input_mutation", "output_aliasing", "both_orders",
                 "reshuffled_inputs", "unseen_shapes", "precision_vs_oracle", "determinism",
                 "work_after_return")


class ValidateError(RuntimeError):
    """Something the user can fix: unknown kernel, no cubin for a variant and no way to build it."""


@dataclass
class Prebuilt:
    variant: dict
    dir: Path
    meta: dict
    how: str  # "built" | "prebuilt"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sources_match(meta: dict, repo_root: Path) -> bool:
    for rel, digest in (meta.get("sources") or {}).items():
        p = repo_root / rel
        if not p.is_file() or _sha256(p) != digest:
            return False
    return bool(meta.get("sources"))


def find_prebuilt(spec: KernelSpec, variant: dict, build_root: Path, repo_root: Path) -> Path | None:
    """The build folder of (kernel, variant, default tunables) whose recorded source hashes match
    the checkout at `repo_root` (so a stale build of older sources is never judged)."""
    tun = spec.tunable_defaults()
    for meta_path in sorted((build_root / spec.name).glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if meta.get("variant") == variant and meta.get("tunables", {}) == tun and _sources_match(meta, repo_root):
            return meta_path.parent
    return None


def resolve_builds(spec: KernelSpec, variants: list[dict], build_root: Path, repo_root: Path,
                   log: Callable[[str], None]) -> list[Prebuilt]:
    """Build every variant here if the DSL is importable, else use matching prebuilt folders."""
    try:
        from kernels import build as kbuild
        import cutlass  # noqa: F401  (the build's child processes need it)
        can_build = True
    except ImportError:
        can_build = False
    if can_build:
        log(f"building {len(variants)} variant(s) of {spec.name} (cached builds are reused)")
        try:
            arts = kbuild.build_kernel(spec.name, shapes=variants, root=build_root, repo_root=repo_root)
        except kbuild.BuildError as e:
            raise ValidateError(f"build failed: {e}") from None
        return [Prebuilt(dict(a.shape), Path(a.dir), a.meta, "built") for a in arts]
    out, missing = [], []
    for v in variants:
        d = find_prebuilt(spec, v, build_root, repo_root)
        if d is None:
            missing.append(v)
        else:
            out.append(Prebuilt(v, d, json.loads((d / "meta.json").read_text()), "prebuilt"))
    if missing:
        raise ValidateError(
            f"no prebuilt cubin of {spec.name} matching this checkout for {len(missing)} variant(s) "
            f"(e.g. {missing[0]}) under {build_root.name}/, and nvidia-cutlass-dsl is not installed "
            "here to build them: run `fasttrack build` on a host with the DSL and carry build/")
    log(f"using {len(out)} prebuilt variant(s) of {spec.name} from {build_root.name}/")
    return out


def static_race_audit(spec: KernelSpec, builds: list[Prebuilt]) -> dict | None:
    """The static race audit of every variant's PTX/SASS (None when validation.race is absent)."""
    try:
        from types import SimpleNamespace

        from .race.artifacts import audit_artifact
    except ImportError:
        return None
    findings, checked = [], 0
    for b in builds:
        art = SimpleNamespace(paths={"ptx": b.dir / "kernel.ptx", "sass": b.dir / "kernel.sass"})
        try:
            rep = audit_artifact(art, spec, kernel=f"{spec.name} {b.variant}")
        except Exception as e:  # an audit crash is a failed audit, with its reason
            findings.append(f"{b.variant}: audit error {type(e).__name__}: {e}")
            continue
        checked += 1
        findings += [f"{b.variant}: {f}" for f in rep.errors]
    return {"passed": not findings, "variants": checked, "findings": findings[:50]}


def _git(args: list[str], repo_root: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def merge_checks(variants: list[dict]) -> list[dict]:
    """One entry per defence over all variants: passed only if it passed on every variant."""
    merged = []
    for name in DEFENCE_ORDER:
        rows = [(v["label"], c) for v in variants for c in v["checks"] if c["name"] == name]
        if not rows:
            continue
        bad = [(lbl, c) for lbl, c in rows if not c["passed"]]
        applicable = any(c["applicable"] for _, c in rows)
        if bad:
            detail = f"[{bad[0][0]}] {bad[0][1]['detail']}" + (f" (+{len(bad) - 1} more variants)" if len(bad) > 1 else "")
        else:
            detail = f"{len(rows)} variant(s): {rows[0][1]['detail']}"
        merged.append({"name": name, "passed": not bad, "applicable": applicable, "detail": detail,
                       "cases": [x for _, c in rows for x in c["cases"]][:200]})
    return merged


def validate_kernel(kernel: str, *, base: str | None = None, batches: list[int] | None = None,
                    build_root: Path = DEFAULT_BUILD_ROOT, repo_root: Path = REPO_ROOT,
                    out_dir: Path | None = None, require_gpu: bool = False, quick: bool = False,
                    commit: str | None = None, title: str = "", summary: str = "",
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                    numerics_timeout_s: float = NUMERICS_TIMEOUT_S,
                    bench_timeout_s: float = BENCH_TIMEOUT_S) -> dict:
    """Validate manifest kernel `kernel` and return its (unsigned) evidence bundle.

    `base`: None (no comparison), "torch" (the torch/cuBLAS path on the same GPU). Writes
    bundle.json (atomically) and report.html into `out_dir` when given. Raises ValidateError for
    an unknown kernel, a batch it does not declare, no cubin and no way to build one, or (with
    `require_gpu`) no GPU.
    """
    try:
        spec = load_manifest().kernel(kernel)
    except ManifestError as e:
        raise ValidateError(str(e)) from None
    if base not in (None, "torch"):
        raise ValidateError(f"--base {base!r}: only 'torch' (the torch/cuBLAS path on the same GPU) is "
                            "supported; comparing against another revision's cubins is not implemented yet")
    variants = [dict(v) for v in spec.shapes]
    if batches:
        unknown = sorted(set(batches) - {v.get("batch") for v in variants})
        if unknown:
            raise ValidateError(f"kernel {kernel} declares no variant with batch {unknown} "
                                f"(declared: {sorted({v.get('batch') for v in variants})})")
        variants = [v for v in variants if v.get("batch") in batches]

    import torch  # after the cheap checks: bad input answers fast

    has_gpu = torch.cuda.is_available()
    if require_gpu and not has_gpu:
        raise ValidateError("no CUDA device on this host, and GPU evidence was required (--require-gpu)")
    builds = resolve_builds(spec, variants, Path(build_root), Path(repo_root), log)
    binaries = [{"kernel": kernel, "side": "head", "variant": b.variant, "tunables": b.meta.get("tunables", {}),
                 "build_key": b.meta.get("key"), "cubin_sha256": b.meta["hashes"]["cubin_sha256"]}
                for b in builds]
    not_covered: list[str] = []
    extra_reasons: list[str] = []
    static = static_race_audit(spec, builds)
    if static is None:
        not_covered.append("race.static: the static race audit (validation.race) is not available here")

    correctness = defences = benchmark = None
    stress = None
    env = {"gpu": None, "gpu_count": 0, "sm_count": 0, "driver": None, "cuda_runtime": torch.version.cuda,
           "torch": torch.__version__}
    stages = []
    work = Path(build_root) / "validate" / kernel  # stage results and logs (not evidence)
    work.mkdir(parents=True, exist_ok=True)
    dirs = [str(b.dir) for b in builds]
    if not has_gpu:
        log("no CUDA device on this host: ran the build, hashes and static audit only; "
            "numerics, defences and benchmarks are not covered")
        not_covered.append("GPU stages (numerics, defences, stress, benchmarks): no CUDA device on the validating host")
    else:
        argv = ["-m", "validation.gpu_stages", "numerics", *sum((["--build-dir", d] for d in dirs), [])]
        if quick:
            argv.append("--quick")
        log(f"numerics + defences on {len(dirs)} variant(s) (child process, timeout {numerics_timeout_s:.0f} s)")
        st = run_stage("numerics", argv + ["--out", str(work / "numerics.json")], result_path=work / "numerics.json",
                       log_path=work / "numerics.log", timeout_s=numerics_timeout_s, cwd=repo_root)
        stages.append(st.to_dict())
        if st.ok:
            vs = st.result["variants"]
            cases = [c for v in vs for c in v["cases"]]
            correctness = {"passed": bool(cases) and all(c["passed"] for c in cases),
                           "policy": st.result["policy"], "cases": cases}
            checks = merge_checks(vs)
            defences = {"passed": all(c["passed"] for c in checks), "checks": checks}
            stress = {"passed": all(v["stress"]["passed"] for v in vs),
                      "runs_per_variant": vs[0]["stress"]["runs"] if vs else 0,
                      "failing_variants": [v["label"] for v in vs if not v["stress"]["passed"]]}
        else:
            extra_reasons.append(st.reason)
            correctness = {"passed": False, "policy": None, "cases": [], "stage_failure": st.to_dict()}
            defences = {"passed": False, "checks": [], "stage_failure": st.reason}
        bargv = ["-m", "validation.gpu_stages", "bench", *sum((["--build-dir", d] for d in dirs), []),
                 "--base", base or "none"]
        log(f"benchmarks on {len(dirs)} variant(s), base {base or 'none'} (child process, timeout {bench_timeout_s:.0f} s)")
        st = run_stage("bench", bargv + ["--out", str(work / "bench.json")], result_path=work / "bench.json",
                       log_path=work / "bench.log", timeout_s=bench_timeout_s, cwd=repo_root)
        stages.append(st.to_dict())
        if st.ok:
            from .bench import ALPHA, MAX_NOISE, MIN_EFFECT, benchmark_passed

            cases = st.result["cases"]
            # SLOW fails a comparison with a base revision (a regression); against the torch path
            # (another implementation) it is information for the reviewer, shown as a risk.
            slow_fails = base != "torch"
            ok, why = benchmark_passed(cases, allow_slow=not slow_fails)
            benchmark = {"ceilings": st.result["ceilings"], "cases": cases, "passed": ok and bool(cases),
                         "base_name": st.result.get("base_name"),
                         "policy": {"min_effect": MIN_EFFECT, "alpha": ALPHA, "max_noise": MAX_NOISE,
                                    "test": "two-sided Mann-Whitney U", "slow_fails": slow_fails}}
            extra_reasons += why
            env.update(st.result["environment"])
            if base is None:
                not_covered.append("benchmark verdicts: no base given, every case is AMBIGUOUS by construction")
            if not all(c["l2_rotated"] for c in cases):
                small = [c["name"] for c in cases if not c["l2_rotated"]]
                not_covered.append(f"L2 rotation capped at {cases[0]['copies'] if cases else 0}+ copies for "
                                   f"{len(small)} small variant(s): their inputs may be served from the L2")
        else:
            extra_reasons.append(st.reason)
            benchmark = {"ceilings": {}, "cases": [], "passed": False, "stage_failure": st.to_dict()}
    race = None
    if static is not None or stress is not None:
        race = {"passed": (static is None or static["passed"]) and (stress is None or stress["passed"]),
                "static": static, "dynamic": None, "stress": stress}
    not_covered.append("race.dynamic: compute-sanitizer (memcheck, racecheck, synccheck, initcheck) not run by validate")
    if stress is None:
        not_covered.append("race.stress: needs a GPU")
    not_covered.append("unseen shapes: a cubin is built for one declared shape; evidence binds per variant hash")
    not_covered.append("GPU-configuration axis: one configuration (the validating host's GPU) measured")
    meta0 = builds[0].meta if builds else {}
    head = commit or _git(["rev-parse", "HEAD"], Path(repo_root))
    # With --commit (a GPU host's copy of the tree) git's view of the copy is not the checkout's:
    # dirtiness is unknown there; the sources the cubins were built from are recorded instead.
    dirty_out = None if commit else _git(["status", "--porcelain", "--", *spec.sources], Path(repo_root))
    env.update({"dsl_version": meta0.get("dsl_version"), "commit": head,
                "dirty": bool(dirty_out) if dirty_out is not None else None,
                "build_sources_sha256": meta0.get("sources"),
                "hostname_hash": env.get("hostname_hash") or hashlib.sha256(platform.node().encode()).hexdigest()[:16],
                "stages": stages})
    change = {"kernel": kernel, "base": base, "head": head, "files": list(spec.sources),
              "title": title or f"validate {kernel}", "summary": summary or spec.description}
    bundle = B.new_bundle(change=change, environment=env, binaries=binaries, correctness=correctness,
                          defences=defences, race=race, benchmark=benchmark, not_covered=not_covered,
                          reasons_extra=extra_reasons)
    if out_dir is not None:
        B.write_bundle_atomic(Path(out_dir) / "bundle.json", bundle)
        from .report import render_report

        (Path(out_dir) / "report.html").write_text(render_report(bundle))
    return bundle
