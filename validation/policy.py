"""The fast-track policy: is a change small and isolated enough to be judged at the design level?

`evaluate_policy(scope, policy)` classifies every changed path of a `ChangeScope` by the rules of
`validation/policy.toml` (the one documented policy file; its header explains the rules) and
returns a `PolicyDecision`:

  eligible          the touched kernels are one kernel, or all lie in one decode path of the
                    manifest (`[paths]`), within the line bound, nothing protected;
  full_review       at least one rule failed; each `Violation` names the file and why;
  no_code_change    kernel sources changed but every kernel builds to the same code at base and
                    head (the scope's `code`, compared by cubin code hash): comments, docstrings,
                    a refactor that generates the same code; existing evidence still binds;
  no_kernel_change  no kernel and no protected path touched (docs, the proposer, non-oracle tests).

A kernel is touched when its code changed (`ChangeScope.code`, filled by
`validation.scope.compare_code`); before the code is compared, when it owns a changed declared
source. Added test files and test functions ride along (companions); a change of an existing
test's lines does not.

An ineligible change is never passed silently: every failing rule is reported, not just the first.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from kernels.manifest import KernelSpec, Manifest

from .scope import MANIFEST_RELPATH, ChangeScope, FileChange, symlink_resolved

POLICY_PATH = Path(__file__).with_name("policy.toml")
POLICY_RELPATH = "validation/policy.toml"

ELIGIBLE, FULL_REVIEW, NO_KERNEL_CHANGE = "eligible", "full_review", "no_kernel_change"
NO_CODE_CHANGE = "no_code_change"


class PolicyError(ValueError):
    """The policy file is malformed."""


@dataclass(frozen=True)
class ProtectedPath:
    pattern: str
    why: str
    exceptions: tuple[str, ...] = ()

    def matches(self, path: str) -> bool:
        return glob_match(self.pattern, path) and not any(glob_match(e, path) for e in self.exceptions)


@dataclass(frozen=True)
class Policy:
    max_changed_lines: int
    max_kernels: int
    protected: tuple[ProtectedPath, ...]
    companion: tuple[str, ...]
    free: tuple[str, ...]
    source: str = POLICY_RELPATH
    # Added files (status "added") matching these ride along as companions wherever they are
    # (new test modules); an existing file's change never does.
    companion_added: tuple[str, ...] = ()  # where it was read from (repo-relative or "<text>")

    def protection(self, path: str) -> ProtectedPath | None:
        return next((p for p in self.protected if p.matches(path)), None)


@dataclass(frozen=True)
class Violation:
    """One failed rule: `rule` is a stable id, `path` the file (or "" for the whole change)."""

    rule: str
    path: str
    why: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.path}: {self.why}" if self.path else f"[{self.rule}] {self.why}"


@dataclass(frozen=True)
class PolicyDecision:
    status: str  # eligible | full_review | no_code_change | no_kernel_change
    kernel: str | None  # the one kernel of an eligible change (the first, for a path's)
    kernels: tuple[str, ...]  # every kernel the change touches
    counted_lines: int  # lines counted against the bound
    max_changed_lines: int
    violations: tuple[Violation, ...]
    # path -> how it was classified (protected / manifest / kernel:<name> / companion / free / other)
    classification: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    path: str | None = None  # the decode path an eligible multi-kernel change lies in
    composite: str | None = None  # that path's composite entry, whose evidence the gate requires
    # kernel -> tunable -> the choices the change adds (bound evidence must cover each)
    new_choices: dict = field(default_factory=dict)
    by_code: bool = False  # whether the touched kernels were decided by their rebuilt code
    stage: str | None = None  # the one stage an eligible change of a staged kernel touches

    @property
    def eligible(self) -> bool:
        return self.status == ELIGIBLE

    def to_dict(self) -> dict:
        d = asdict(self)
        d["violations"] = [asdict(v) for v in self.violations]
        return d


# -- loading -----------------------------------------------------------------------------------

@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(pattern: str, path: str) -> bool:
    """Whether repo-relative `path` matches `pattern` (`*` within a folder, `**` across folders)."""
    return _glob_regex(pattern).match(path) is not None


def parse_policy(text: str, source: str = "<text>") -> Policy:
    """Parse policy TOML; PolicyError naming `source` and the problem otherwise."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{source}: not valid TOML: {e}") from None
    unknown = set(raw) - {"limits", "protected", "companion", "free"}
    if unknown:
        raise PolicyError(f"{source}: unknown section(s) {', '.join(sorted(unknown))}")
    limits = raw.get("limits", {})
    bad = set(limits) - {"max_changed_lines", "max_kernels"}
    if bad:
        raise PolicyError(f"{source}: unknown key(s) in [limits]: {', '.join(sorted(bad))}")
    for key in ("max_changed_lines", "max_kernels"):
        v = limits.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PolicyError(f"{source}: [limits] {key} must be a positive integer, got {v!r}")

    protected = []
    for i, p in enumerate(raw.get("protected", [])):
        if not isinstance(p, dict) or not isinstance(p.get("pattern"), str) or not isinstance(p.get("why"), str):
            raise PolicyError(f"{source}: protected[{i}] needs a string pattern and a string why")
        extra = set(p) - {"pattern", "why", "except"}
        if extra:
            raise PolicyError(f"{source}: protected[{i}] has unknown key(s) {', '.join(sorted(extra))}")
        exc = p.get("except", [])
        if not isinstance(exc, list) or not all(isinstance(e, str) for e in exc):
            raise PolicyError(f"{source}: protected[{i}].except must be a list of patterns")
        protected.append(ProtectedPath(p["pattern"], p["why"], tuple(exc)))

    def patterns(section: str, key: str = "patterns") -> tuple[str, ...]:
        sec = raw.get(section, {})
        pats = sec.get(key, []) if isinstance(sec, dict) else None
        if not isinstance(pats, list) or not all(isinstance(x, str) for x in pats):
            raise PolicyError(f"{source}: [{section}] {key} must be a list of strings")
        return tuple(pats)

    return Policy(
        max_changed_lines=limits["max_changed_lines"],
        max_kernels=limits["max_kernels"],
        protected=tuple(protected),
        companion=patterns("companion"),
        free=patterns("free"),
        source=source,
        companion_added=patterns("companion", "added"),
    )


def load_policy(path: str | Path | None = None) -> Policy:
    """The policy at `path` (default: the packaged validation/policy.toml)."""
    p = Path(path) if path else POLICY_PATH
    try:
        text = p.read_text()
    except OSError as e:
        raise PolicyError(f"cannot read policy {p}: {e.strerror}") from None
    return parse_policy(text, POLICY_RELPATH if path is None else str(path))


# -- the manifest, compared as data ------------------------------------------------------------

def _tunables(k: KernelSpec) -> dict:
    return {t.name: (tuple(t.choices), t.default, tuple(t.explore_only)) for t in k.tunables}


def manifest_changes(base: Manifest | None, head: Manifest | None) -> tuple[list[Violation], dict]:
    """Compare two parsed manifests.

    Returns the violations (semantic changes that need full review) and each kernel's own
    changes, which a fast-track change may make: {kernel: {"defaults": [tunable, ...],
    "new_choices": {tunable: [added choices]}, "new_tunables": [...]}} (new defaults; choices
    added to a tunable without removing any or changing which are explore-only; new tunables,
    whose choices other than the default and the explore-only ones count as new choices).
    """
    path = MANIFEST_RELPATH
    if base is None or head is None:
        side = "added" if base is None else "removed"
        return [Violation("manifest-kernels", path, f"the manifest was {side}")], {}
    out: list[Violation] = []
    own: dict[str, dict] = {}
    for name in sorted(set(base.kernels) - set(head.kernels)):
        out.append(Violation("manifest-kernels", path, f"kernel {name!r} removed from the manifest"))
    for name in sorted(set(head.kernels) - set(base.kernels)):
        out.append(Violation("manifest-kernels", path, f"kernel {name!r} added to the manifest"))
    if base.paths != head.paths:
        names = sorted(n for n in set(base.paths) | set(head.paths) if base.paths.get(n) != head.paths.get(n))
        out.append(Violation("manifest-paths", path,
                             f"decode path(s) {', '.join(names)} changed: which kernels a change may "
                             "touch together, and the composite evidence, are the policy's scope"))
    for name in sorted(set(base.kernels) & set(head.kernels)):
        b, h = base.kernels[name], head.kernels[name]
        if b.params != h.params:
            before = ", ".join(f"{p.name}:{p.role}/{p.direction}" for p in b.params)
            after = ", ".join(f"{p.name}:{p.role}/{p.direction}" for p in h.params)
            out.append(Violation("manifest-roles", path,
                                 f"kernel {name!r}: launch parameters or buffer roles changed "
                                 f"({before} -> {after})"))
        if b.reference != h.reference:
            out.append(Violation("manifest-reference", path,
                                 f"kernel {name!r}: reference changed ({b.reference} -> {h.reference})"))
        if b.op != h.op:
            out.append(Violation("manifest-op", path,
                                 f"kernel {name!r}: op class changed ({b.op} -> {h.op})"))
        if b.sources != h.sources:
            out.append(Violation("manifest-sources", path,
                                 f"kernel {name!r}: declared sources changed, so its scope changed "
                                 f"({', '.join(b.sources)} -> {', '.join(h.sources)})"))
        if b.shapes != h.shapes:
            out.append(Violation("manifest-shapes", path,
                                 f"kernel {name!r}: validation shapes changed "
                                 f"({len(b.shapes)} -> {len(h.shapes)} variants)"))
        if b.syncs_across_ctas != h.syncs_across_ctas:
            out.append(Violation("manifest-sync", path,
                                 f"kernel {name!r}: syncs_across_ctas changed"))
        if b.points_to != h.points_to:
            out.append(Violation("manifest-points-to", path,
                                 f"kernel {name!r}: points_to changed (what each task-table slot points "
                                 "to: the roles the audit checks the table's pointers against)"))
        if b.stages != h.stages:
            out.append(Violation("manifest-stages", path, _stages_change(name, b.stages, h.stages)))
        if b.extra != h.extra:
            keys = sorted(k for k in set(b.extra) | set(h.extra) if b.extra.get(k) != h.extra.get(k))
            out.append(Violation("manifest-tolerances", path,
                                 f"kernel {name!r}: declared field(s) {', '.join(keys)} changed "
                                 "(tolerances and other validation settings)"))
        bt, ht = _tunables(b), _tunables(h)
        if set(bt) - set(ht):
            out.append(Violation("manifest-tunable-range", path,
                                 f"kernel {name!r}: tunable(s) removed ({', '.join(sorted(set(bt) - set(ht)))})"))
            continue
        mine: dict = {"defaults": [], "new_choices": {}, "new_tunables": []}
        for t in sorted(set(ht) - set(bt)):
            # A new tunable: its default is the kernel's code now (the code comparison judges
            # it); its other choices are new choices the evidence must cover.
            mine["new_tunables"].append(t)
            others = [c for c in ht[t][0] if c != ht[t][1] and c not in ht[t][2]]
            if others:
                mine["new_choices"][t] = others
        for t in sorted(set(bt)):
            (bc, bd, be), (hc, hd, he) = bt[t], ht[t]
            if not set(bc) <= set(hc) or be != he:
                out.append(Violation("manifest-tunable-range", path,
                                     f"kernel {name!r}: tunable {t}: choices removed or explore-only "
                                     f"choices changed ({list(bc)} -> {list(hc)})"))
                continue
            added = [c for c in hc if c not in bc and c not in he]
            if added:
                mine["new_choices"][t] = added
            if bd != hd:
                mine["defaults"].append(t)
        if mine["defaults"] or mine["new_choices"] or mine["new_tunables"]:
            own[name] = mine
    return out, own


def _stages_change(name: str, base, head) -> str:
    """Why a change of a kernel's stage declarations needs full review, naming what changed."""
    b, h = {st.name: st for st in base}, {st.name: st for st in head}
    what = [f"stage {n} added" for n in sorted(set(h) - set(b))]
    what += [f"stage {n} removed" for n in sorted(set(b) - set(h))]
    for n in sorted(set(b) & set(h)):
        changed = [f.name for f in fields(b[n]) if getattr(b[n], f.name) != getattr(h[n], f.name)]
        if changed:
            what.append(f"stage {n}: {', '.join(changed)}")
    if not what:
        what.append("the stages' order")
    return (f"kernel {name!r}: stage declarations changed ({'; '.join(what)}): the stages' buffers, "
            "protocol and sources are the kernel's contract between its stages")


def stage_violations(scope: ChangeScope, kernel: str, classification: dict[str, str],
                     changed_defaults=()) -> tuple[list[Violation], str | None]:
    """(violations, the one stage touched) of a change whose only touched kernel is `kernel`.

    For a staged kernel (manifest `stages`), every changed path that is a source of the kernel
    or in its build closure (companions aside) must lie in the sources of exactly one stage, the same for every
    path (a file several stages share touches all of them): then the change is a one-stage
    change. A path in no stage (the kernel's shared code) or paths in two stages go to full
    review. `changed_defaults` (the kernel's tunables whose manifest default changed) count for
    the stage that owns each, or, owned by none, as shared. (None, no violation) for a kernel
    without stages."""
    man = scope.head_manifest
    spec = man.kernels.get(kernel) if man else None
    if spec is None or not spec.stages:
        return [], None
    out: list[Violation] = []
    touched: dict[str, list[str]] = {}  # stage -> changed paths in it
    names = ", ".join(st.name for st in spec.stages)
    closure = set(scope.closures.get(kernel, ())) | set(scope.base_closures.get(kernel, ()))
    for f in scope.files:
        cls = classification.get(f.path, "")
        if cls == "manifest":
            # a default changed in the manifest (`changed_defaults`: manifest_changes' "defaults")
            # is a change of the stage that owns the tunable (`tunables` in its stage entry); a
            # tunable no stage owns is the whole kernel's
            for name in changed_defaults:
                st = spec.stage_of_tunable(name)
                if st is None:
                    out.append(Violation("stage-unassigned", f.path,
                                         f"kernel {kernel!r} is staged ({names}) and its tunable {name!r} "
                                         "belongs to none of its stages: a change of its default reaches "
                                         "every stage"))
                else:
                    touched.setdefault(st, []).append(f"{f.path} ({name})")
            continue
        if cls == "companion":
            continue
        # its declared sources, and any other file its build compiles (a change there is its change)
        if kernel in f.owners or any(p in closure for p in f.paths()):
            stages = sorted({st for p in f.paths() for st in spec.stages_of(p)})
            if not stages:
                out.append(Violation("stage-unassigned", f.path,
                                     f"kernel {kernel!r} is staged ({names}) and {f.path} lies in none of "
                                     "its stages: a change of the kernel's shared code reaches every stage"))
            for st in stages:
                touched.setdefault(st, []).append(f.path)
    if len(touched) > 1:
        detail = "; ".join(f"{st}: {', '.join(ps)}" for st, ps in sorted(touched.items()))
        out.append(Violation("multiple-stages", "",
                             f"kernel {kernel!r}: the change touches {len(touched)} stages ({detail}); a "
                             "fast-track change of a staged kernel touches one stage (a file shared by "
                             "stages touches each of them)"))
    if out or not touched:
        return out, None
    return out, next(iter(touched))


# -- the decision ------------------------------------------------------------------------------

def _classify(f: FileChange, policy: Policy) -> tuple[str, ProtectedPath | None]:
    # Companions first: a new test module, or new test functions added to an existing one
    # (nothing of it changed: FileChange.added_tests), judge nothing that existed before.
    if f.kind == "file" and f.status == "added" and any(glob_match(c, f.path) for c in policy.companion_added):
        return "companion", None
    if f.added_tests:
        return "companion", None
    for p in f.paths():
        prot = policy.protection(p)
        if prot:
            return "protected", prot
    if MANIFEST_RELPATH in f.paths():
        return "manifest", None
    if f.owners:
        return "kernel", None
    if all(any(glob_match(c, p) for c in policy.companion) for p in f.paths()):
        return "companion", None
    if all(any(glob_match(c, p) for c in policy.free) for p in f.paths()):
        return "free", None
    return "other", None


# Kernels `validate` judges with a stage of their own: kernel -> the module whose
# `prepare(base, *, build_root, plan_path, repo_root, log)` writes the plan on the CPU host and
# whose `validate(plan_path, *, build_root, out_dir, timeout_s)` runs it on the GPU host into a
# bundle. Read by `validate KERNEL`, `validate --all` and `no_validation_stage`.
OWN_STAGES = {"megakernel": "validation.mega_stage"}


def own_stage(kernel: str):
    """The stage module of `kernel` (OWN_STAGES), or None for the generic stages."""
    import importlib

    return importlib.import_module(OWN_STAGES[kernel]) if kernel in OWN_STAGES else None


def no_validation_stage(spec: KernelSpec) -> str | None:
    """Why `validate` cannot judge `spec`'s kernel, or None when it can. A kernel that reads a task
    table needs a stage of its own (OWN_STAGES), built on its host launcher: the generic numerics
    would fill the table and its counters with random data. Read by validate, `validate --all` and
    this policy (a change that touches such a kernel can bind no evidence: full review)."""
    if spec.points_to is not None and spec.name not in OWN_STAGES:
        return (f"reads a task table ({', '.join(spec.points_to)}): the generic numerics would fill the table "
                "and its counters with random data; it needs its own validation stage (built on its host "
                "launcher, declared in validation/policy.py OWN_STAGES), which it does not have")
    return None


def evaluate_policy(scope: ChangeScope, policy: Policy | None = None) -> PolicyDecision:
    """Classify every changed path of `scope` and decide: eligible, full_review, no_code_change or
    no_kernel_change.

    Every failing rule becomes a Violation naming the file and why; none is dropped. With
    `scope.code` (the rebuilt code compared), the touched kernels are those whose code changed;
    without it, those owning a changed declared source or whose manifest entry changed.
    """
    policy = policy or load_policy()
    violations: list[Violation] = []
    classification: dict[str, str] = {}
    owned: dict[str, list[str]] = {}  # kernel -> changed declared sources (and manifest)
    counted = 0
    notes: list[str] = []
    own_changes: dict = {}
    kernel_files = False

    for side, err in sorted(scope.manifest_errors.items()):
        violations.append(Violation("manifest-parse", MANIFEST_RELPATH,
                                    f"the manifest does not parse at {side}: {err}"))

    for f in scope.files:
        cls, prot = _classify(f, policy)
        if cls == "kernel":
            classification[f.path] = "kernel:" + ",".join(f.owners)
        else:
            classification[f.path] = cls
        if cls == "companion" and f.added_tests:
            notes.append(f"{f.path}: adds test(s) {', '.join(f.added_tests)} (a companion: nothing existing changed)")

        # Kinds that defeat line-level review, wherever they are (except pure evidence/docs).
        if "submodule" in (f.kind, f.old_kind):
            violations.append(Violation("submodule", f.path,
                                        "a submodule change brings in code from outside the repository"))
        if "symlink" in (f.kind, f.old_kind) and cls not in ("free",):
            target = f.symlink_target
            where = ""
            if target is not None:
                resolved = symlink_resolved(f.path, target)
                where = f" (points at {target!r}" + (", outside the repository)" if resolved is None else ")")
            violations.append(Violation("symlink", f.path,
                                        "a symlink can make a kernel source or a protected file read "
                                        "any other file" + where))

        if cls == "protected":
            violations.append(Violation("protected-path", f.path, prot.why))
        elif cls == "manifest":
            if scope.manifest_errors:
                continue  # already reported as manifest-parse
            mviol, own_changes = manifest_changes(scope.base_manifest, scope.head_manifest)
            violations.extend(mviol)
            for k in own_changes:
                owned.setdefault(k, []).append(f.path)
            if own_changes:
                counted += f.lines
                kernel_files = True
            if not mviol and not own_changes:
                notes.append(f"{f.path}: no semantic change (comments, formatting or descriptions)")
        elif cls == "kernel":
            kernel_files = True
            for k in f.owners:
                owned.setdefault(k, []).append(f.path)
            counted += f.lines
            if f.binary:
                violations.append(Violation("binary", f.path,
                                            "a binary kernel source cannot be reviewed line by line"))
            if f.status == "deleted":
                violations.append(Violation("source-deleted", f.path,
                                            f"a declared source of {', '.join(f.owners)} was deleted"))
            elif f.status in ("renamed", "copied") and f.old_path != f.path:
                violations.append(Violation("source-moved", f.path,
                                            f"{f.status} from {f.old_path}: a kernel's declared "
                                            "sources moved, so its scope changed"))
            elif f.status == "added":
                notes.append(f"{f.path}: new declared source of {', '.join(f.owners)}")
        elif cls == "other":
            violations.append(Violation("unclassified-path", f.path,
                                        "not a declared source of any kernel: shared code whose "
                                        "effect on the kernels is not bounded"))

        # A file a kernel's build compiles (its sources import it) but that the kernel does not
        # declare: its change is that kernel's change, hidden from the line bound. Protected and
        # unclassified paths already went to full review above; another kernel's declared source
        # is judged by the rebuilt code once it is compared.
        if cls in ("companion", "free") or (cls == "kernel" and scope.code is None):
            importers = sorted(k for k, closure in scope.closures.items()
                               if k not in f.owners and any(p in closure for p in f.paths()))
            if importers:
                violations.append(Violation(
                    "undeclared-dependency", f.path,
                    f"compiled into kernel(s) {', '.join(importers)} (imported by their sources) but "
                    "not among their declared sources: declare it in the manifest, or keep kernels "
                    "from importing it"))

    new_choices = {k: c["new_choices"] for k, c in own_changes.items() if c.get("new_choices")}
    if scope.code is not None:
        # A kernel given new tunable choices is touched even when its default variants' code is
        # the same: the evidence must cover the new choices.
        touched = {k: owned.get(k, []) for k in sorted(set(scope.code_changed()) | set(new_choices))}
        same = sorted(k for k, c in scope.code.items() if c.get("status") == "same")
        if same:
            n = sum(int(scope.code[k].get("variants") or 0) for k in same)
            notes.append(f"same code at base and head ({n} variants compared): {', '.join(same)}")
    else:
        touched = owned
    kernels = tuple(sorted(touched))
    path_name = composite = None
    man = scope.head_manifest or scope.base_manifest
    for k in kernels:  # (a head that does not build fails the gate on its compile error instead)
        if ((scope.code or {}).get(k) or {}).get("status") == "build_failed":
            continue
        why = no_validation_stage(man.kernels[k]) if man and k in man.kernels else None
        if why:
            violations.append(Violation("no-validation-stage", "",
                                        f"touches kernel {k}, which {why}: no evidence can bind to it, so a "
                                        "full review judges the change"))
    if len(kernels) > policy.max_kernels:
        paths = [p for p in (man.paths.values() if man else ()) if set(kernels) <= set(p.kernels)]
        if paths:
            path_name, composite = paths[0].name, paths[0].composite
        else:
            detail = "; ".join(f"{k}: {', '.join(sorted(set(v))) or 'its code'}" for k, v in sorted(touched.items()))
            where = ""
            if man and man.paths:
                outside = sorted(k for k in kernels if not man.paths_of(k))
                where = (f"; not in one decode path ({', '.join(outside)} in none)" if outside
                         else "; not all in one decode path")
            violations.append(Violation("multiple-kernels", "",
                                        f"touches {len(kernels)} kernels ({detail}){where}; a fast-track "
                                        f"change touches at most {policy.max_kernels}, or kernels of one "
                                        "decode path"))
    stage = None
    if len(kernels) == 1:
        sviol, stage = stage_violations(scope, kernels[0], classification,
                                        own_changes.get(kernels[0], {}).get("defaults", ()))
        violations.extend(sviol)
        if stage:
            notes.append(f"one-stage change: stage {stage} of kernel {kernels[0]} (its bound, passing "
                         "evidence covers the stage's contract)")
    if counted > policy.max_changed_lines:
        biggest = sorted((f for f in scope.files if classification.get(f.path, "").startswith("kernel")),
                         key=lambda f: -f.lines)
        per_file = ", ".join(f"{f.path} {f.lines}" for f in biggest[:5])
        violations.append(Violation("line-bound", "",
                                    f"{counted} changed lines exceed the bound of "
                                    f"{policy.max_changed_lines} ({per_file})"))

    if violations:
        status = FULL_REVIEW
    elif not kernels:
        status = NO_CODE_CHANGE if (scope.code is not None and kernel_files) else NO_KERNEL_CHANGE
    else:
        status = ELIGIBLE
    return PolicyDecision(
        status=status,
        kernel=kernels[0] if status == ELIGIBLE else None,
        kernels=kernels,
        counted_lines=counted,
        max_changed_lines=policy.max_changed_lines,
        violations=tuple(violations),
        classification=classification,
        notes=tuple(notes),
        path=path_name if status == ELIGIBLE else None,
        composite=composite if status == ELIGIBLE else None,
        new_choices={k: v for k, v in new_choices.items() if k in touched},
        by_code=scope.code is not None,
        stage=stage if status == ELIGIBLE else None,
    )
