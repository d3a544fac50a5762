"""`fasttrack validate`: build (or find prebuilt) cubins, audit them, run the GPU stages isolated,
and write the evidence bundle and its report.

On a CPU host with the DSL: builds every requested variant (content-addressed, cache hits are
free), runs the static race audit and records the hashes; without a GPU it says so and records the
GPU stages as not covered. On the GPU host (no DSL, no gitpython, no cryptography): finds the
prebuilt folders under `build/` whose recorded source hashes match the checkout, and runs the
numerics and benchmark stages, each in a child process with a timeout.

Base revision (`--base REV`): the benchmark's baseline is the kernel as it was at REV. The CPU host
prepares (`prepare_base_plan`): it builds head (this checkout) and base (a temporary git worktree
at REV, built by that worktree's own `kernels/build.py` into the same content-addressed build
root) and writes a plan, `build/validate/<kernel>/plan.json`, naming both sides' build folders and
cubin hashes. The GPU host runs from the carried plan (`load_base_plan`: every folder's cubin must
still hash to what the plan recorded) and times base and head interleaved in one process; the
bundle lists both sides' `binaries` and the base's source hashes, so the gate can tell whether it
was measured against the base it judges.
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
from .block_stage import BLOCK_SCHEMA as BLOCK_PLAN_SCHEMA  # the composite `block`'s plan
from .isolate import run_stage

DEFAULT_BUILD_ROOT = REPO_ROOT / "build"
NUMERICS_TIMEOUT_S = 420
BENCH_TIMEOUT_S = 420
PLAN_SCHEMA = "fasttrack.validate-plan/1"
# Plans whose `variants` list one kernel's head and base builds: the generic one, and the
# megakernel's (validation/mega_stage.py: that plan plus task tables, model check and the chain).
KERNEL_PLAN_SCHEMAS = (PLAN_SCHEMA, "fasttrack.mega-plan/1")
NON_REVISION_BASES = (None, "torch")
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
    """The build folder of (kernel, variant, the tunables it ships with) whose recorded source
    hashes match the checkout at `repo_root` (so a stale build of older sources is never judged)."""
    from kernels.block import plan_in_tree, shipped_tunables

    tun = shipped_tunables(spec, variant, plan_in_tree(repo_root) or {})
    for meta_path in sorted((build_root / spec.name).glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if meta.get("variant") == variant and meta.get("tunables", {}) == tun and _sources_match(meta, repo_root):
            return meta_path.parent
    return None


def build_shipped(spec: KernelSpec, variants: list[dict], *, build_root: Path, repo_root: Path,
                  override: dict | None = None) -> list:
    """Build (or find cached) each of `variants` of `spec` at the tunables it ships with
    (kernels.block.shipped_tunables under the block plan of the checkout at `repo_root`), with
    `override` over them; one build call per distinct set of tunables, artifacts in the order of
    `variants`. Raises kernels.build.BuildError."""
    from kernels import build as kbuild
    from kernels.block import plan_in_tree, shipped_tunables

    plan = plan_in_tree(repo_root) or {}
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(variants):
        groups.setdefault(json.dumps({**shipped_tunables(spec, v, plan), **(override or {})}, sort_keys=True),
                          []).append(i)
    out: list = [None] * len(variants)
    manifest = load_manifest(Path(repo_root) / "kernels" / "manifest.toml")
    for key, idxs in groups.items():
        arts = kbuild.build_kernel(spec.name, shapes=[variants[i] for i in idxs], root=build_root,
                                   repo_root=repo_root, tunables=json.loads(key), manifest=manifest)
        for i, a in zip(idxs, arts):
            out[i] = a
    return out


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
            arts = build_shipped(spec, variants, build_root=build_root, repo_root=repo_root)
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


# -- base revision: prepare on the CPU host, load on the GPU host ----------------------------------

def is_revision(base: str | None) -> bool:
    """True when `base` names a git revision (not None, not the torch path)."""
    return base not in NON_REVISION_BASES


def default_plan_path(kernel: str, build_root: Path = DEFAULT_BUILD_ROOT) -> Path:
    return Path(build_root) / "validate" / kernel / "plan.json"


# Runs inside the base worktree with that revision's own code first on sys.path.
_BASE_BUILD_SCRIPT = """
import json, sys
from pathlib import Path
wt, kernel, root, reqs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sys.path.insert(0, wt)
import kernels
if Path(kernels.__file__).resolve().parent != Path(wt, "kernels").resolve():
    raise SystemExit(f"imported kernels from {kernels.__file__}, not from the base worktree")
from kernels.build import build_kernel
try:  # a revision without kernels/block_plan.toml: its block's own per-batch choices, where it has them
    from kernels.block import block_tunables
except ImportError:
    block_tunables = None
for r in reqs:  # [shape, tunables, own]: own, take the revision's kernels.block.block_tunables
    if r[2] and block_tunables is not None and r[0].get("batch") is not None:  # no batch: not a block launch
        r[1] = block_tunables(kernel, r[0]["batch"])
out, groups = [None] * len(reqs), {}
for i, (shape, tunables, _) in enumerate(reqs):  # one build call per tunables
    groups.setdefault(json.dumps(tunables, sort_keys=True), []).append(i)
for key, idxs in groups.items():
    arts = build_kernel(kernel, shapes=[reqs[i][0] for i in idxs], tunables=json.loads(key),
                        root=Path(root), repo_root=Path(wt))
    for i, a in zip(idxs, arts):
        out[i] = {"variant": a.shape, "tunables": a.tunables, "key": a.key, "dir": str(a.dir),
                  "cubin_sha256": a.cubin_sha256, "cubin_code_sha256": getattr(a, "cubin_code_sha256", None),
                  "sources": a.meta.get("sources")}
print("@@ARTIFACTS@@" + json.dumps(out))
"""


def _build_at_revision(kernel: str, sha: str, variants: list[dict], build_root: Path, repo_root: Path,
                       log: Callable[[str], None], head_plan: dict | None = None) -> list[dict]:
    """Build `variants` of `kernel` as it was at commit `sha`: a temporary detached worktree, built by
    that revision's own kernels/build.py (its sources) into `build_root`, each variant at the
    tunables it ships with there (kernels.block.shipped_tunables: that revision's manifest
    defaults under its block plan). A revision that declares no block plan but whose
    kernels/block.py has `block_tunables(kernel, batch)` (before the plan was a table: 83f6b15)
    builds what its own block launched; one with neither takes `head_plan`'s choices. Head's plan
    at such a base would be wrong: 83f6b15 reads moe_w2's `wg` only with `stream` 0, so head's
    `wg = 1` there built its stream design and its bundle compared two designs."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fasttrack-base-") as tmp:
        wt = Path(tmp) / "wt"
        r = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(wt), sha], cwd=repo_root,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ValidateError(f"cannot check out base {sha[:12]} in a worktree: {r.stderr.strip()[-300:]}")
        try:
            if _git(["cat-file", "-e", f"{sha}:kernels/manifest.toml"], repo_root) is None:
                raise ValidateError(f"base {sha[:12]} has no kernels/manifest.toml")
            from kernels.manifest import parse_manifest

            try:
                bspec = parse_manifest((wt / "kernels" / "manifest.toml").read_text()).kernel(kernel)
            except ManifestError as e:
                raise ValidateError(f"kernel {kernel} at base {sha[:12]}: {e}") from None
            from kernels.block import BlockPlanError, plan_in_tree, shipped_tunables

            try:
                bplan = plan_in_tree(wt)
            except BlockPlanError:  # a plan of another format: that revision's choices are not readable here
                bplan = None
            own = bplan is None  # the revision's own block tables (kernels.block.block_tunables), else head's plan
            bplan = head_plan if bplan is None else bplan
            reqs = [[v, shipped_tunables(bspec, v, bplan or {}), own] for v in variants]
            log(f"building {len(variants)} variant(s) of {kernel} at base {sha[:12]} (its own kernels/build.py)")
            proc = subprocess.run([sys.executable, "-c", _BASE_BUILD_SCRIPT, str(wt), kernel,
                                   str(Path(build_root).resolve()), json.dumps(reqs)],
                                  cwd=wt, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("@@ARTIFACTS@@")), None)
            if proc.returncode != 0 or line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise ValidateError(f"the base revision {sha[:12]} does not build {kernel}: {tail[0][:400]}")
            return json.loads(line[len("@@ARTIFACTS@@"):])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=repo_root, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=repo_root, capture_output=True)


def _rel(path: Path, root: Path) -> str:
    return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()


def prepare_base_plan(kernel: str, base: str, *, batches: list[int] | None = None,
                      build_root: Path = DEFAULT_BUILD_ROOT, repo_root: Path = REPO_ROOT,
                      plan_path: Path | None = None,
                      log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                      tunables: dict | None = None, minis: bool = True) -> dict:
    """CPU host (git + the DSL): build head (the checkout) and base (revision `base`) of every
    requested variant into `build_root`, and write the plan the GPU host runs from.

    `tunables` (name -> value, `validate --tunables`): head is built with these over the manifest
    defaults (a non-default variant, explored on the GPU), base with the base revision's defaults,
    so the bundle says whether that variant beats the default. `minis`: also build the kernel's
    mini variants (validation.sanitize), which the GPU host runs under the four sanitizers.

    The plan names, per variant, both sides' build folders (relative to `build_root`), build keys
    and cubin hashes, plus the base commit, its kernel source hashes and the head commit. Raises
    ValidateError for an unknown kernel, batch or revision, a kernel absent at the base, a build
    that fails on either side, or no DSL here.
    """
    repo_root, build_root = Path(repo_root), Path(build_root)
    spec, variants = _kernel_variants(kernel, batches, repo_root)
    sha = _git(["rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], repo_root)
    if not sha:
        raise ValidateError(f"--base {base!r} does not name a commit in this repository")
    try:
        from kernels import build as kbuild
    except ImportError as e:  # pragma: no cover - kernels.build imports no DSL
        raise ValidateError(f"cannot build: {e}") from None
    try:
        kbuild.dsl_version()
    except kbuild.BuildError as e:
        raise ValidateError(f"--base {base}: the base and head cubins are built here, and {e}") from None
    log(f"building {len(variants)} variant(s) of {kernel} at head (this checkout)")
    from kernels.block import plan_in_tree

    try:
        head = build_shipped(spec, variants, build_root=build_root, repo_root=repo_root, override=tunables)
    except kbuild.BuildError as e:
        raise ValidateError(f"head does not build: {e}") from None
    based = _build_at_revision(kernel, sha, variants, build_root, repo_root, log, plan_in_tree(repo_root))
    base_sources = based[0]["sources"] if based else {}
    head_sha = _git(["rev-parse", "HEAD"], repo_root)
    closure = sorted((head[0].meta.get("sources") or {}) if head else [])
    dirty = _git(["status", "--porcelain", "--", *closure], repo_root) if closure else ""
    plan = {
        "schema": PLAN_SCHEMA, "kernel": kernel, "created": B.utc_now(),
        "base": {"ref": base, "sha": sha, "sources_sha256": base_sources},
        "head": {"sha": head_sha, "dirty": bool(dirty) if dirty is not None else None,
                 "sources_sha256": head[0].meta.get("sources") if head else {},
                 "tunables_override": dict(tunables or {})},
        "variants": [{
            "variant": dict(h.shape),
            "head": {"dir": _rel(h.dir, build_root), "tunables": h.tunables, "build_key": h.key,
                     "cubin_sha256": h.cubin_sha256, "cubin_code_sha256": h.cubin_code_sha256},
            "base": {"dir": _rel(b["dir"], build_root), "tunables": b["tunables"], "build_key": b["key"],
                     "cubin_sha256": b["cubin_sha256"], "cubin_code_sha256": b.get("cubin_code_sha256")},
        } for h, b in zip(head, based)],
    }
    # The static audit here, where PTX and SASS are (the carry holds cubins and metadata only).
    hspec = load_manifest(repo_root / "kernels" / "manifest.toml").kernel(kernel)
    plan["static_race_audit"] = static_race_audit(hspec, [Prebuilt(dict(h.shape), Path(h.dir), h.meta, "built")
                                                         for h in head])
    if minis:
        from .sanitize import build_minis

        entries, failures = build_minis([kernel], build_root, repo_root, log)
        plan["sanitize"] = {"entries": entries, "failures": failures}
    path = Path(plan_path) if plan_path else default_plan_path(kernel, build_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    same = sum(1 for v in plan["variants"] if v["head"]["cubin_sha256"] == v["base"]["cubin_sha256"])
    log(f"plan: {path.name} in {path.parent.name}/ ({len(plan['variants'])} variant(s), base {sha[:12]}, head {str(head_sha)[:12]}"
        + (f"; {same} with identical base and head cubins" if same else "") + ")")
    return plan


def _plan_build(side: str, entry: dict, build_root: Path, kernel: str) -> Prebuilt:
    """One side of a plan entry as a Prebuilt, after checking its folder still holds that cubin."""
    d = Path(build_root) / entry[side]["dir"]
    what = f"plan {side} build {entry[side]['dir']} ({entry['variant']})"
    try:
        meta = json.loads((d / "meta.json").read_text())
        digest = _sha256(d / "kernel.cubin")
    except (OSError, ValueError) as e:
        raise ValidateError(f"{what}: cannot read it ({e}); carry {Path(build_root).name}/{kernel} with the plan") from None
    if digest != entry[side]["cubin_sha256"] or meta.get("hashes", {}).get("cubin_sha256") != digest:
        raise ValidateError(f"{what}: its cubin no longer hashes to the plan's {entry[side]['cubin_sha256'][:16]}; "
                            "prepare again")
    if meta.get("kernel") != kernel or meta.get("variant") != entry["variant"]:
        raise ValidateError(f"{what}: the folder holds {meta.get('kernel')} {meta.get('variant')}")
    return Prebuilt(dict(entry["variant"]), d, meta, "planned")


def load_base_plan(path: Path, kernel: str, build_root: Path = DEFAULT_BUILD_ROOT,
                   batches: list[int] | None = None) -> tuple[dict, list[Prebuilt], list[Prebuilt]]:
    """GPU host: read a plan written by `prepare_base_plan` and return (plan, head builds, base
    builds), each build checked against the cubin hash the plan recorded. Needs neither git nor
    the DSL. Raises ValidateError for a missing or malformed plan, another kernel, or a folder
    whose cubin changed."""
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValidateError(f"cannot read plan {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValidateError(f"plan {path} is not valid JSON ({e})") from None
    if not isinstance(plan, dict) or plan.get("schema") != PLAN_SCHEMA:
        raise ValidateError(f"{path} is not a validate plan ({PLAN_SCHEMA})")
    if plan.get("kernel") != kernel:
        raise ValidateError(f"plan {path} is for kernel {plan.get('kernel')!r}, not {kernel!r}")
    entries = plan.get("variants") or []
    if batches:
        entries = [e for e in entries if e["variant"].get("batch") in batches]
    if not entries:
        raise ValidateError(f"plan {path} holds no variant" + (f" with batch {batches}" if batches else ""))
    head = [_plan_build("head", e, build_root, kernel) for e in entries]
    base = [_plan_build("base", e, build_root, kernel) for e in entries]
    return plan, head, base


def _kernel_variants(kernel: str, batches: list[int] | None,
                     repo_root: Path = REPO_ROOT) -> tuple[KernelSpec, list[dict]]:
    """The kernel's manifest entry (the manifest of the checkout at `repo_root`) and its variants,
    only those of `batches` when given."""
    try:
        spec = load_manifest(Path(repo_root) / "kernels" / "manifest.toml").kernel(kernel)
    except ManifestError as e:
        raise ValidateError(str(e)) from None
    from .policy import no_validation_stage

    why = no_validation_stage(spec)
    if why:
        raise ValidateError(f"kernel {kernel} {why}")
    variants = [dict(v) for v in spec.shapes]
    if batches:
        unknown = sorted(set(batches) - {v.get("batch") for v in variants})
        if unknown:
            raise ValidateError(f"kernel {kernel} declares no variant with batch {unknown} "
                                f"(declared: {sorted({v.get('batch') for v in variants})})")
        variants = [v for v in variants if v.get("batch") in batches]
    return spec, variants


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
                    plan_path: Path | None = None,
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                    numerics_timeout_s: float = NUMERICS_TIMEOUT_S,
                    bench_timeout_s: float = BENCH_TIMEOUT_S, seeds: tuple[int, ...] | None = None,
                    dynamic_result: dict | None = None) -> dict:
    """Validate manifest kernel `kernel` and return its (unsigned) evidence bundle.

    `base`: None (no comparison), "torch" (the torch/cuBLAS path on the same GPU), or a git
    revision: the kernel as it was there, timed interleaved with head. A revision needs a plan:
    `plan_path` (written by `prepare_base_plan` on a CPU host and carried here), else one is
    prepared here (git and the DSL needed). Writes bundle.json (atomically) and report.html into
    `out_dir` when given. Raises ValidateError for an unknown kernel, a batch it does not declare,
    no cubin and no way to build one, a plan that does not hold, or (with `require_gpu`) no GPU.

    `seeds`: the numerics seeds (default: validation.numerics.DEFAULT_SEEDS; the bundle records
    them). `dynamic_result`: a sanitize stage's result (validation.sanitize) that covers this
    kernel's mini variants; it becomes the bundle's race.dynamic.
    """
    spec, variants = _kernel_variants(kernel, batches, Path(repo_root))
    plan = None
    if plan_path is not None and base == "torch":
        raise ValidateError("--plan times head against the plan's base revision; --base torch contradicts it")
    if plan_path is not None or is_revision(base):
        if plan_path is None:
            plan_path = default_plan_path(kernel, build_root)
            prepare_base_plan(kernel, base, batches=batches, build_root=Path(build_root),
                              repo_root=Path(repo_root), plan_path=plan_path, log=log)
        plan, plan_head, plan_base = load_base_plan(Path(plan_path), kernel, Path(build_root), batches)
        if is_revision(base) and base not in (plan["base"]["ref"], plan["base"]["sha"]) \
                and not plan["base"]["sha"].startswith(base):
            raise ValidateError(f"--base {base} but plan {plan_path} was prepared against "
                                f"{plan['base']['ref']} ({plan['base']['sha'][:12]})")
        base = plan["base"]["sha"]
        commit = plan["head"]["sha"]

    import torch  # after the cheap checks: bad input answers fast

    has_gpu = torch.cuda.is_available()
    if require_gpu and not has_gpu:
        raise ValidateError("no CUDA device on this host, and GPU evidence was required (--require-gpu)")
    if plan is not None:
        builds, base_builds = plan_head, plan_base
        log(f"using the plan's {len(builds)} head and base variant(s) of {kernel} (base {base[:12]})")
    else:
        builds, base_builds = resolve_builds(spec, variants, Path(build_root), Path(repo_root), log), []

    def binary(b: Prebuilt, side: str) -> dict:
        return {"kernel": kernel, "side": side, "variant": b.variant, "tunables": b.meta.get("tunables", {}),
                "build_key": b.meta.get("key"), "cubin_sha256": b.meta["hashes"]["cubin_sha256"],
                "cubin_code_sha256": b.meta["hashes"].get("cubin_code_sha256")}

    binaries = [binary(b, "head") for b in builds] + [binary(b, "base") for b in base_builds]
    not_covered: list[str] = []
    extra_reasons: list[str] = []
    have_ptx = all((b.dir / "kernel.ptx").is_file() for b in builds)
    if not have_ptx and plan is not None and plan.get("static_race_audit") is not None:
        # a carry without PTX/SASS: the audit the preparing host ran on the same cubins
        static = {**plan["static_race_audit"], "where": "the host that prepared the plan (same cubins)"}
    elif not have_ptx:
        static = None
        not_covered.append("race.static: no PTX/SASS beside the cubins and no audit in the plan (prepare again)")
    else:
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
        if seeds:
            argv += ["--seeds", *map(str, seeds)]
        log(f"numerics + defences on {len(dirs)} variant(s) (child process, timeout {numerics_timeout_s:.0f} s)")
        st = run_stage("numerics", argv + ["--out", str(work / "numerics.json")], result_path=work / "numerics.json",
                       log_path=work / "numerics.log", timeout_s=numerics_timeout_s, cwd=repo_root)
        stages.append(st.to_dict())
        log(f"stage numerics: {'ok' if st.ok else 'FAILED ' + st.reason} ({st.seconds:.0f} s)")
        if st.ok:
            vs = st.result["variants"]
            cases = [c for v in vs for c in v["cases"]]
            correctness = {"passed": bool(cases) and all(c["passed"] for c in cases),
                           "policy": st.result["policy"], "cases": cases,
                           "seeds": list(seeds) if seeds else None}
            checks = merge_checks(vs)
            defences = {"passed": all(c["passed"] for c in checks), "checks": checks}
            stress = {"passed": all(v["stress"]["passed"] for v in vs),
                      "runs_per_variant": vs[0]["stress"]["runs"] if vs else 0,
                      "failing_variants": [v["label"] for v in vs if not v["stress"]["passed"]],
                      "sync_left_nonzero": sum(v["stress"].get("sync_left_nonzero", 0) for v in vs)}
        else:
            extra_reasons.append(st.reason)
            correctness = {"passed": False, "policy": None, "cases": [], "stage_failure": st.to_dict()}
            defences = {"passed": False, "checks": [], "stage_failure": st.reason}
        bargv = ["-m", "validation.gpu_stages", "bench", *sum((["--build-dir", d] for d in dirs), []),
                 "--base", "revision" if plan is not None else (base or "none"),
                 *sum((["--base-build-dir", str(b.dir)] for b in base_builds), [])]
        log(f"benchmarks on {len(dirs)} variant(s), base {base or 'none'} (child process, timeout {bench_timeout_s:.0f} s)")
        st = run_stage("bench", bargv + ["--out", str(work / "bench.json")], result_path=work / "bench.json",
                       log_path=work / "bench.log", timeout_s=bench_timeout_s, cwd=repo_root)
        stages.append(st.to_dict())
        log(f"stage bench: {'ok' if st.ok else 'FAILED ' + st.reason} ({st.seconds:.0f} s)")
        if st.ok:
            from .bench import ALPHA, MAX_NOISE, MIN_EFFECT, benchmark_passed

            cases = st.result["cases"]
            # SLOW fails a comparison with a base revision (a regression); against the torch path
            # (another implementation) it is information for the reviewer, shown as a risk.
            slow_fails = base != "torch"
            ok, why = benchmark_passed(cases, allow_slow=not slow_fails)
            baseline = ({"kind": "revision", "sha": base, "ref": plan["base"]["ref"]} if plan is not None
                        else {"kind": base or "none"})
            benchmark = {"ceilings": st.result["ceilings"], "cases": cases, "passed": ok and bool(cases),
                         "base_name": (f"{kernel} at base revision {base[:12]} ({plan['base']['ref']})"
                                       if plan is not None else st.result.get("base_name")),
                         "baseline": baseline,
                         "policy": {"min_effect": MIN_EFFECT, "alpha": ALPHA, "max_noise": MAX_NOISE,
                                    "test": "two-sided Mann-Whitney U", "slow_fails": slow_fails}}
            extra_reasons += why
            env.update(st.result["environment"])
            if base is None:
                not_covered.append("benchmark verdicts: no base given, every case is AMBIGUOUS by construction")
            elif base == "torch":
                not_covered.append("no regression against a previous revision: the benchmark baseline is the "
                                   "torch path, so SLOW cases are risks, not regressions (validate --base REV)")
            if not all(c["l2_rotated"] for c in cases):
                small = [c["name"] for c in cases if not c["l2_rotated"]]
                not_covered.append(f"L2 rotation capped at {cases[0]['copies'] if cases else 0}+ copies for "
                                   f"{len(small)} small variant(s): their inputs may be served from the L2")
        else:
            extra_reasons.append(st.reason)
            benchmark = {"ceilings": {}, "cases": [], "passed": False, "stage_failure": st.to_dict()}
    from .sanitize import dynamic_section, run_isolated

    if dynamic_result is None and has_gpu and plan is not None and (plan.get("sanitize") or {}).get("entries"):
        log(f"sanitizers on {len(plan['sanitize']['entries'])} mini variant(s) (child process)")
        dynamic_result = run_isolated(plan["sanitize"]["entries"], plan["sanitize"].get("failures", []),
                                      Path(build_root), work / "sanitize", budget_s=numerics_timeout_s)
        stages.append(dynamic_result.get("stage") or {"name": "sanitize", "ok": False})
        log(f"stage sanitize: {'ok' if dynamic_result.get('passed') else 'NOT CLEAN or failed'}")

    dynamic = dynamic_section(dynamic_result, kernel, [
        f for f in (dynamic_result or {}).get("build_failures") or [] if f.split(" ", 2)[1].strip("(") == kernel])
    race = None
    if static is not None or stress is not None or dynamic is not None:
        race = {"passed": all(x is None or x["passed"] for x in (static, stress, dynamic)),
                "static": static, "dynamic": dynamic, "stress": stress}
    if dynamic is None:
        not_covered.append("race.dynamic: compute-sanitizer (memcheck, racecheck, synccheck, initcheck) not run "
                           "for this kernel (validate --all runs them on its mini variants)")
    if stress is None:
        not_covered.append("race.stress: needs a GPU")
    not_covered.append("unseen shapes: a cubin is built for one declared shape; evidence binds per variant hash")
    not_covered.append("GPU-configuration axis: one configuration (the validating host's GPU) measured")
    meta0 = builds[0].meta if builds else {}
    head = commit or _git(["rev-parse", "HEAD"], Path(repo_root))
    # With --commit (a GPU host's copy of the tree) git's view of the copy is not the checkout's:
    # dirtiness is unknown there; the sources the cubins were built from are recorded instead.
    dirty_out = None if commit else _git(["status", "--porcelain", "--", *spec.sources], Path(repo_root))
    dirty = bool(dirty_out) if dirty_out is not None else None
    if plan is not None:  # git's view from the host that prepared the plan, not this copy's
        dirty = plan["head"].get("dirty")
    # Which validator produced these results, from the tree that ran them (its child stages
    # import validation/ and kernels/ from repo_root): the gate refuses a bundle whose validator
    # is not the one at its merge base.
    validator_sha256, validator_sources = B.validator_fingerprint_of_tree(repo_root)
    env.update({"dsl_version": meta0.get("dsl_version"), "commit": head,
                "dirty": dirty,
                "validator_sha256": validator_sha256,
                "validator_sources_sha256": validator_sources,
                "build_sources_sha256": meta0.get("sources"),
                "hostname_hash": env.get("hostname_hash") or hashlib.sha256(platform.node().encode()).hexdigest()[:16],
                "stages": stages})
    change = {"kernel": kernel, "base": base, "head": head, "files": list(spec.sources),
              "title": title or f"validate {kernel}", "summary": summary or spec.description}
    if plan is not None and plan["head"].get("tunables_override"):
        change["tunables_override"] = plan["head"]["tunables_override"]
        change["title"] = title or (f"validate {kernel} with " + ", ".join(
            f"{k}={v}" for k, v in plan["head"]["tunables_override"].items()) + " against the default")
    if plan is not None:
        # What the gate compares with its own base: the kernel's source closure at this base.
        change["base_ref"] = plan["base"]["ref"]
        change["base_sources_sha256"] = plan["base"]["sources_sha256"]
    bundle = B.new_bundle(change=change, environment=env, binaries=binaries, correctness=correctness,
                          defences=defences, race=race, benchmark=benchmark, not_covered=not_covered,
                          reasons_extra=extra_reasons)
    if out_dir is not None:
        B.write_bundle_atomic(Path(out_dir) / "bundle.json", bundle)
        from .report import render_report

        (Path(out_dir) / "report.html").write_text(render_report(bundle))
    return bundle


# -- before signing: the checks of the CI job that signs (it runs no code of the change) -----------

def _binaries_of(entries) -> set[tuple[str, str]]:
    """{(variant as canonical JSON, cubin sha256)} of (variant, sha256) pairs."""
    return {(json.dumps(v, sort_keys=True), str(h)) for v, h in entries}


def _kernel_variant(kernel, variant) -> dict:
    """A binary's identity besides its hash: its kernel and variant in one mapping."""
    return {"kernel": kernel, **variant} if isinstance(variant, dict) else {"kernel": kernel, "variant": variant}


def presign_problems(bundle: dict, plan: dict, *, merge_base: str | None = None,
                     validator: tuple[str, dict[str, str]] | None = None) -> list[str]:
    """Why `bundle` (unsigned, written by the GPU job) must not be signed; empty when it may.

    It must be a well-formed, unsigned bundle of the plan's kernel, timed against the plan's base
    revision (which must be `merge_base`, when given), whose head and base binaries are exactly
    the plan's (kernel, variant and cubin sha256 of each on each side: a kernel plan's variants, the
    composite `block`'s every case at every batch), produced by `validator` (the validator's
    fingerprint at the merge base, when given). Reads data only: nothing of the bundle or the plan
    is executed.
    """
    problems = B.schema_problems(bundle)
    if problems:
        return ["not a well-formed bundle: " + "; ".join(problems[:4])]
    composite = plan.get("schema") == BLOCK_PLAN_SCHEMA if isinstance(plan, dict) else False
    try:
        kernel, base_sha = plan["kernel"], plan["base"]["sha"]
        # (kernel, variant, cubin sha256) per side: the block's every case of every batch, each a
        # kernel of its own; a kernel's plan, its variants
        entries = {side: ([(c["kernel"], c["shape"], c["cubin_sha256"]) for e in plan["batches"] for c in e[side]["cases"]]
                          if composite else [(kernel, e["variant"], e[side]["cubin_sha256"]) for e in plan["variants"]])
                   for side in ("head", "base")}
        planned = {side: _binaries_of([(_kernel_variant(k, v), h) for k, v, h in entries[side]])
                   for side in ("head", "base")}
    except (KeyError, TypeError) as e:
        return [f"the plan is malformed ({type(e).__name__}: {e}); it is not a {PLAN_SCHEMA} "
                f"or {BLOCK_PLAN_SCHEMA} plan"]
    if plan.get("schema") not in KERNEL_PLAN_SCHEMAS + (BLOCK_PLAN_SCHEMA,):
        problems.append(f"the plan is not one of {', '.join(KERNEL_PLAN_SCHEMAS + (BLOCK_PLAN_SCHEMA,))}")
    if bundle.get("signature"):
        problems.append("the bundle is already signed")
    change = bundle["change"]
    if change.get("kernel") != kernel:
        problems.append(f"the bundle is for kernel {change.get('kernel')!r}, the plan for {kernel!r}")
    if change.get("base") != base_sha:
        problems.append(f"the bundle was timed against {str(change.get('base'))[:12]}, not the plan's base {str(base_sha)[:12]}")
    if merge_base is not None and base_sha != merge_base:
        problems.append(f"the plan was prepared against {str(base_sha)[:12]}, not the merge base {merge_base[:12]}")
    for side in ("head", "base"):  # a binary of another kernel than the plan's is not the plan's
        recorded = _binaries_of([(_kernel_variant(b.get("kernel"), b.get("variant")), b.get("cubin_sha256"))
                                 for b in bundle["binaries"] if isinstance(b, dict) and b.get("side") == side])
        for variant, sha in sorted(planned[side] - recorded):
            problems.append(f"{side} binary {variant} {sha[:16]} of the plan is not in the bundle")
        for variant, sha in sorted(recorded - planned[side]):
            problems.append(f"{side} binary {variant} {sha[:16]} of the bundle is not the plan's")
    if validator is not None:
        if not B.validator_recorded(bundle):
            problems.append("the bundle does not record the validator that produced it (environment.validator_sha256)")
        problems += B.validator_mismatch(bundle, *validator)
    return problems


def presign_main(argv: list[str] | None = None) -> int:
    """`python -m validation.validate presign BUNDLE --plan PLAN --base REV --head REV [--repo DIR]`:
    exit 0 when the bundle may be signed (`presign_problems` against the merge base of REV and
    REV, whose validator is read from git), 1 with every reason when not, 2 on bad input."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m validation.validate presign",
                                 description="Check an unsigned bundle against its plan and the merge base's "
                                             "validator before signing it.")
    ap.add_argument("command", choices=["presign"])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--base", required=True, help="the pull request's base revision")
    ap.add_argument("--head", required=True, help="the pull request's head revision")
    ap.add_argument("--repo", default=".", help="a checkout holding both revisions (default: .)")
    args = ap.parse_args(argv)

    def error(msg: str) -> int:
        print(f"presign: {msg}", file=sys.stderr)
        return 2

    try:
        bundle = B.load_bundle(args.bundle)
    except B.BundleError as e:
        return error(str(e))
    try:
        plan = json.loads(args.plan.read_text())
    except OSError as e:
        return error(f"cannot read plan {args.plan}: {e.strerror}")
    except ValueError as e:
        return error(f"plan {args.plan} is not valid JSON ({e})")
    import git

    from .gate import validator_at
    from .scope import ScopeError, open_repo

    try:
        repo = open_repo(args.repo)
        merge_base = repo.git.merge_base(args.base, args.head).strip()
    except ScopeError as e:
        return error(str(e))
    except git.GitCommandError:
        return error(f"no merge base of {args.base} and {args.head} in {args.repo} (fetch both revisions)")
    problems = presign_problems(bundle, plan if isinstance(plan, dict) else {}, merge_base=merge_base,
                                validator=validator_at(repo, merge_base))
    if problems:
        print(f"presign: refusing to sign {args.bundle}:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"presign: {args.bundle} may be signed: the plan's {len(plan['variants'])} variant(s), base "
          f"{merge_base[:12]}, validator {bundle['environment']['validator_sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(presign_main())
