"""All of the validator's evidence in one or two GPU calls: prepare every plan here, carry one
small folder, run every plan there within a time budget.

    fasttrack validate --all --base REV --prepare --root DIR      # CPU host: git + the DSL
    PYTHONPATH=. python3 -m validation.plan run --root DIR --out OUT --budget-s 560   # GPU host

`prepare_all` writes, under DIR (fresh: it refuses a folder that already holds a plan):
  plans/<kernel>.json   one `fasttrack.validate-plan/1` plan per manifest kernel (head and base
                        built, validation.validate.prepare_base_plan), into the shared build cache;
  plans/sanitize.json   the mini variants the sanitizers run (validation.sanitize);
  plans/block.json      the block at every decode batch, head and base (validation.block_stage);
  carry.tar.xz          kernel.cubin + meta.json of every build folder the plans name (no PTX or
                        SASS; identical folders once, identical cubins stored once as hard links);
  prepare.json          what was prepared, what failed to, the archive's size.
Only DIR is carried (64 MiB at most a device call carries; `prepare` says the size).

`run_all` (GPU host: no DSL, no git) unpacks the archive into DIR/builds when it is not there,
then runs the sanitizers, each kernel's plan and the block's in turn, writes each bundle
(OUT/<name>/bundle.json + report.html) as soon as it finishes, prints a progress line per stage
with its wall time, and stops starting work when the budget left is below what a plan needs:
what it skips is listed in OUT/summary.json as not covered (run it in a second call with
`--only`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable

SCHEMA = "fasttrack.validate-all/1"
SANITIZE_SCHEMA = "fasttrack.sanitize-plan/1"
ARCHIVE = "carry.tar.xz"
CARRY_FILES = ("kernel.cubin", "meta.json")
CARRY_LIMIT = 64 << 20
# Seconds a plan is given at least; below that budget left it is skipped (not covered).
MIN_SECONDS = {"sanitize": 120, "block": 240}
MIN_KERNEL_SECONDS = 60


class PlanError(RuntimeError):
    """Something the user can fix (a folder that is not fresh, no plans, a bad archive)."""


def _log(m: str) -> None:
    print(m, file=sys.stderr, flush=True)


# -- CPU host --------------------------------------------------------------------------------------

def plan_dirs(plan: dict) -> list[str]:
    """Every build folder (relative to the build root) a plan names."""
    if plan.get("schema") == SANITIZE_SCHEMA:
        return [e["dir"] for e in plan.get("entries", [])]
    dirs = [e["dir"] for e in (plan.get("sanitize") or {}).get("entries", [])]
    for v in plan.get("variants", []):
        for side in ("head", "base"):
            if side in v:
                dirs.append(v[side]["dir"])
    for b in plan.get("batches", []):  # the block plan
        for side in ("head", "base"):
            dirs += [c["dir"] for c in b.get(side, {}).get("cases", [])]
    for b in plan.get("chain", []):  # a megakernel plan's yardstick (validation/mega_stage.py)
        dirs += [c["dir"] for c in b.get("cases", [])]
    return dirs


def make_carry(root: Path, build_root: Path, plans: list[dict]) -> dict:
    """Pack kernel.cubin + meta.json of every folder the plans name into root/carry.tar.xz.
    Folders are stored once; equal cubins in different folders once (hard links)."""
    root, build_root = Path(root), Path(build_root)
    stage = root / "builds"
    if stage.exists():
        shutil.rmtree(stage)
    seen_cubin: dict[str, Path] = {}
    dirs = sorted({d for p in plans for d in plan_dirs(p)})
    import hashlib
    import os

    raw = 0
    for d in dirs:
        src, dst = build_root / d, stage / d
        dst.mkdir(parents=True, exist_ok=True)
        for f in CARRY_FILES:
            if not (src / f).is_file():
                raise PlanError(f"{d}/{f} is missing under the build root")
        data = (src / "kernel.cubin").read_bytes()
        h = hashlib.sha256(data).hexdigest()
        if h in seen_cubin:
            os.link(seen_cubin[h], dst / "kernel.cubin")
        else:
            (dst / "kernel.cubin").write_bytes(data)
            seen_cubin[h] = dst / "kernel.cubin"
            raw += len(data)
        shutil.copy2(src / "meta.json", dst / "meta.json")
        raw += (dst / "meta.json").stat().st_size
    arc = root / ARCHIVE
    with tarfile.open(arc, "w:xz") as tf:
        tf.add(stage, arcname="builds")
    shutil.rmtree(stage)
    return {"folders": len(dirs), "distinct_cubins": len(seen_cubin), "raw_bytes": raw,
            "archive": ARCHIVE, "archive_bytes": arc.stat().st_size}


def prepare_all(base: str, root: Path, *, kernels: list[str] | None = None, with_block: bool = True,
                with_sanitize: bool = True, tunables: dict | None = None, build_root: Path | None = None,
                repo_root: Path | None = None, log: Callable[[str], None] = _log,
                prepare_kernel=None, prepare_block=None, build_minis=None) -> dict:
    """CPU host: every plan under `root` (see the module docstring). A kernel that does not
    prepare (a build failure at head or base) is listed in prepare.json and the others still are.
    `prepare_kernel`, `prepare_block`, `build_minis` are for tests (defaults: the real ones)."""
    from kernels.manifest import REPO_ROOT, load_manifest

    from .validate import DEFAULT_BUILD_ROOT, ValidateError, prepare_base_plan

    repo_root = Path(repo_root or REPO_ROOT)
    build_root = Path(build_root or DEFAULT_BUILD_ROOT)
    root = Path(root)
    if (root / "plans").exists() and any((root / "plans").iterdir()):
        raise PlanError(f"{root} already holds plans: give a fresh --root (nothing was overwritten)")
    (root / "plans").mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(repo_root / "kernels" / "manifest.toml")
    from .policy import no_validation_stage

    unjudged = {k: why for k, spec in manifest.kernels.items() if (why := no_validation_stage(spec))}
    names = list(kernels) if kernels is not None else [k for k in manifest.kernels if k not in unjudged]
    not_covered = {k: why for k, why in unjudged.items() if k not in names}  # (one named in `kernels` fails)
    for k, why in not_covered.items():
        log(f"prepare {k}: not covered ({why})")
    injected = prepare_kernel is not None  # a test's: it prepares every kernel
    if prepare_kernel is None:  # the base resolved once: commits made while preparing do not move it
        from .validate import _git

        sha = _git(["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], repo_root)
        if not sha:
            raise PlanError(f"--base {base!r} does not name a commit in this repository")
        base = sha
        prepare_kernel = lambda k, path: prepare_base_plan(  # noqa: E731
            k, sha, build_root=build_root, repo_root=repo_root, plan_path=path, log=log, tunables=tunables,
            minis=False)
    done, failed, plans = [], {}, []
    t0 = time.time()
    from .policy import own_stage

    for k in names:
        path = root / "plans" / f"{k}.json"
        stage = None if injected else own_stage(k)
        try:
            if stage is not None:  # its own plan; its minis go with the others' (plans/sanitize.json)
                plans.append(stage.prepare(base, build_root=build_root, plan_path=path, repo_root=repo_root,
                                           log=log, minis=False, tunables=tunables))
            else:
                plans.append(prepare_kernel(k, path))
            done.append(k)
        except (ValidateError, PlanError) as e:
            failed[k] = str(e)
            log(f"prepare {k}: FAILED {e}")
        log(f"prepare {k}: {time.time() - t0:.0f} s so far")
    if with_sanitize:
        if build_minis is None:
            from .sanitize import build_minis as _bm

            build_minis = lambda ks: _bm(ks, build_root, repo_root, log)  # noqa: E731
        entries, failures = build_minis(names or None)
        sp = {"schema": SANITIZE_SCHEMA, "entries": entries, "failures": failures}
        (root / "plans" / "sanitize.json").write_text(json.dumps(sp, indent=1) + "\n")
        plans.append(sp)
        done.append("sanitize")
    if with_block:
        try:
            if prepare_block is None:
                from .block_stage import prepare_block_plan

                prepare_block = lambda path: prepare_block_plan(  # noqa: E731
                    base, build_root=build_root, repo_root=repo_root, plan_path=path, log=log)
            plans.append(prepare_block(root / "plans" / "block.json"))
            done.append("block")
        except (ValidateError, PlanError) as e:
            failed["block"] = str(e)
            log(f"prepare block: FAILED {e}")
    carry = make_carry(root, build_root, plans)
    doc = {"schema": SCHEMA, "base": base, "prepared": done, "failed": failed,
           "not_covered": not_covered, "carry": carry,
           "seconds": round(time.time() - t0, 1)}
    (root / "prepare.json").write_text(json.dumps(doc, indent=1) + "\n")
    log(f"carry: {carry['folders']} folders, {carry['distinct_cubins']} distinct cubins, "
        f"{carry['raw_bytes'] / (1 << 20):.1f} MiB raw, {ARCHIVE} "
        + carry_note(carry, "prepare fewer kernels per root"))
    return doc


def carry_plan(plan_path: Path, build_root: Path, plan: dict) -> dict:
    """CPU host: the carry of one plan (`fasttrack validate K --prepare`), beside it: its
    folder's carry.tar.xz, the cubin and metadata of every build folder the plan names, what
    `plan_build_root` unpacks on the GPU host. The whole build cache would not fit a device
    call; this holds only what the plan runs."""
    return make_carry(Path(plan_path).parent, build_root, [plan])


def carry_note(carry: dict, advice: str = "") -> str:
    """The carry's size for a prepare's message, with a warning (and `advice`) past what a
    device call carries."""
    mib = carry["archive_bytes"] / (1 << 20)
    if carry["archive_bytes"] <= CARRY_LIMIT:
        return f"{mib:.1f} MiB"
    return f"{mib:.1f} MiB (OVER the 64 MiB a device call carries{': ' + advice if advice else ''})"


# -- GPU host --------------------------------------------------------------------------------------

def plan_build_root(plan_path: Path) -> Path | None:
    """GPU host: the build folders carried beside a plan (its folder's carry.tar.xz, unpacked
    afresh into builds/, so a machine that kept an older unpacking runs the carry it was
    given), or None when the plan has no carry beside it."""
    folder = Path(plan_path).parent
    if (folder / ARCHIVE).is_file():
        if (folder / "builds").exists():
            shutil.rmtree(folder / "builds")
        return unpack(folder)
    return folder / "builds" if (folder / "builds").is_dir() else None


def unpack(root: Path) -> Path:
    """DIR/builds, unpacked from DIR/carry.tar.xz when absent (members checked to stay inside)."""
    root = Path(root)
    builds = root / "builds"
    if builds.is_dir():
        return builds
    arc = root / ARCHIVE
    if not arc.is_file():
        raise PlanError(f"{root} has neither builds/ nor {ARCHIVE}: carry the folder `prepare` wrote")
    try:
        with tarfile.open(arc, "r:xz") as tf:
            for m in tf.getmembers():
                if m.name.startswith("/") or ".." in Path(m.name).parts or not m.name.startswith("builds"):
                    raise PlanError(f"{ARCHIVE}: member {m.name!r} would land outside {root}/builds")
            tf.extractall(root)
    except (tarfile.TarError, EOFError, OSError) as e:
        shutil.rmtree(builds, ignore_errors=True)  # no half-unpacked folder to be taken for a carry
        raise PlanError(f"{arc} cannot be unpacked ({e}): carry it again") from None
    return builds


def ordered_plans(root: Path, only: list[str] | None = None) -> list[tuple[str, Path]]:
    """(name, plan path): sanitize first (its verdicts go into every kernel's bundle), the
    kernels in manifest order, the block last."""
    pdir = Path(root) / "plans"
    if not pdir.is_dir():
        raise PlanError(f"{root}/plans is missing: run `fasttrack validate --all --base REV --prepare --root {root}`")
    found = {p.stem: p for p in sorted(pdir.glob("*.json"))}
    try:
        from kernels.manifest import load_manifest

        order = list(load_manifest().kernels)
    except Exception:  # noqa: BLE001
        order = []
    names = (["sanitize"] if "sanitize" in found else []) + [k for k in order if k in found] + \
        sorted(k for k in found if k not in order and k not in ("sanitize", "block")) + \
        (["block"] if "block" in found else [])
    if only:
        unknown = sorted(set(only) - set(found))
        if unknown:
            raise PlanError(f"--only names no plan under {pdir}: {', '.join(unknown)} (plans: {', '.join(names)})")
        names = [n for n in names if n in only]
    return [(n, found[n]) for n in names]


def run_all(root: Path, out: Path, *, budget_s: float = 560.0, only: list[str] | None = None,
            seeds: tuple[int, ...] = (0, 1), runners: dict | None = None,
            clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = _log) -> dict:
    """GPU host: every plan under `root` in order within `budget_s`; returns the summary written
    to OUT/summary.json. `runners[name](plan_path, build_root, out_dir, budget_left_s, dynamic)`
    are for tests (defaults: sanitize, validate_kernel, the block stage)."""
    t0 = clock()
    root, out = Path(root), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    builds = unpack(root)
    plans = ordered_plans(root, only)
    runners = dict(runners or {})
    summary = {"schema": SCHEMA + "#run", "budget_s": budget_s, "seeds": list(seeds), "results": {},
               "not_covered": []}
    dynamic = None
    from .policy import own_stage

    def left() -> float:
        return budget_s - (clock() - t0)

    def write():
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    for name, path in plans:
        need = MIN_SECONDS.get(name, MIN_KERNEL_SECONDS)
        if left() < need:
            why = f"{name}: skipped, {left():.0f} s of the {budget_s:.0f} s budget left (needs {need} s): run it in another call with --only {name}"
            summary["not_covered"].append(why)
            summary["results"][name] = {"skipped": True, "reason": why}
            log(f"[{clock() - t0:6.0f} s] {why}")
            write()
            continue
        t1 = clock()
        log(f"[{t1 - t0:6.0f} s] {name}: start ({left():.0f} s left)")
        try:
            if name == "sanitize":
                fn = runners.get("sanitize", _run_sanitize)
                dynamic = fn(path, builds, out / "sanitize", left())
                res = {"passed": bool(dynamic.get("passed")), "per_kernel": {
                    k: v.get("passed") for k, v in dynamic.get("per_kernel", {}).items()}}
            elif name == "block":
                fn = runners.get("block", _run_block)
                res = fn(path, builds, out / "block", left(), seeds)
            elif own_stage(name) is not None:
                fn = runners.get("own", _run_own)
                res = fn(name, path, builds, out / name, left(), dynamic)
            else:
                fn = runners.get("kernel", _run_kernel)
                res = fn(name, path, builds, out / name, left(), dynamic, seeds)
        except Exception as e:  # noqa: BLE001 - one plan's failure must not lose the others
            import traceback

            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        res["seconds"] = round(clock() - t1, 1)
        summary["results"][name] = res
        log(f"[{clock() - t0:6.0f} s] {name}: {res.get('verdict') or ('ERROR ' + res['error'] if 'error' in res else 'done')} "
            f"({res['seconds']:.0f} s)")
        write()
    summary["seconds"] = round(clock() - t0, 1)
    write()
    return summary


def _run_sanitize(path: Path, builds: Path, out_dir: Path, left_s: float) -> dict:
    from .sanitize import run_isolated

    plan = json.loads(Path(path).read_text())
    return run_isolated(plan["entries"], plan.get("failures", []), builds, out_dir, left_s)


def _run_kernel(name: str, path: Path, builds: Path, out_dir: Path, left_s: float, dynamic, seeds) -> dict:
    from .validate import validate_kernel

    numerics_t = max(30.0, min(420.0, left_s * 0.6))
    bench_t = max(30.0, min(420.0, left_s - numerics_t - 10))
    b = validate_kernel(name, build_root=builds, out_dir=out_dir, plan_path=path, seeds=seeds,
                        numerics_timeout_s=numerics_t, bench_timeout_s=bench_t, dynamic_result=dynamic)
    return {"verdict": b["verdict"], "reasons": b["reasons"][:10], "bundle": str(out_dir / "bundle.json")}


def _run_own(name: str, path: Path, builds: Path, out_dir: Path, left_s: float, dynamic) -> dict:
    from .policy import own_stage

    b = own_stage(name).validate(path, build_root=builds, out_dir=out_dir, timeout_s=max(60.0, left_s - 15),
                                 dynamic_result=dynamic)
    return {"verdict": b["verdict"], "reasons": b["reasons"][:10], "bundle": str(out_dir / "bundle.json")}


def _run_block(path: Path, builds: Path, out_dir: Path, left_s: float, seeds) -> dict:
    from .block_stage import validate_block

    b = validate_block(path, build_root=builds, out_dir=out_dir, timeout_s=max(60.0, left_s - 15))
    return {"verdict": b["verdict"], "reasons": b["reasons"][:10], "bundle": str(out_dir / "bundle.json")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m validation.plan",
                                 description="Run every prepared plan on the GPU host within a time budget.")
    ap.add_argument("step", choices=("run",))
    ap.add_argument("--root", type=Path, required=True, help="the folder `validate --all --prepare` wrote")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--only", default="", help="comma-separated plan names (kernels, sanitize, block)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    a = ap.parse_args(argv)
    try:
        s = run_all(a.root, a.out, budget_s=a.budget_s, only=[x for x in a.only.split(",") if x] or None,
                    seeds=tuple(a.seeds))
    except PlanError as e:
        print(f"validate --all: {e}", file=sys.stderr)
        return 2
    bad = [n for n, r in s["results"].items() if r.get("verdict") == "fail" or "error" in r]
    print(f"validate --all: {len(s['results'])} plan(s), {len(s['not_covered'])} skipped, "
          f"{len(bad)} failed or in error{': ' + ', '.join(bad) if bad else ''}; {a.out}/summary.json")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
