"""The fast-track gate: scope policy, build, static audit, and GPU evidence bound to cubin hashes.

`run_gate(base, head)` walks one change through:

  1. scope + policy (validation/scope.py, validation/policy.py; the policy is read at the merge
     base, so a change cannot loosen it): not eligible -> exit 3, every failing rule listed;
     nothing kernel-related touched -> "no kernel change", exit 0;
  2. build: the touched kernel's manifest variants are rebuilt (kernels/build.py) from the checkout,
     which must match `head` under kernels/; every compile child (it imports the change's
     sources: untrusted code) runs inside kernels/sandbox.py's bubblewrap sandbox, as the agent's
     builds do (no network, a clean environment, no key store, nothing of the repository but the
     staged sources); no bubblewrap -> exit 2, unless the caller opts out (`sandbox=None`,
     `fasttrack gate --no-sandbox`);
  3. static race audit of the rebuilt binaries (validation/race), "not run" while it is absent;
  4. evidence: a committed bundle under evidence_reports/ (read at head) whose signature verifies
     against the trusted keys (read at the merge base), whose head cubin hashes equal the
     rebuilt ones for every variant, and whose validator fingerprint is the merge base's
     validator's (none recorded: a risk, for bundles older than the field); its correctness,
     defences, race and benchmark results must
     pass. "No regression beyond noise at any batch size" is a statement about the base revision
     against head, so the benchmark's baseline must be the kernel at the gate's merge base (the
     bundle's `change.base` is that commit, or the kernel's source hashes recorded for its base
     equal the merge base's): a bundle timed against torch (or nothing) fails, its SLOW cases
     kept as risks. Against the base revision no case may be SLOW; none may be IMPOSSIBLE; a
     claimed speedup needs a FAST and no AMBIGUOUS case among the claimed batches. With `run_gpu`
     and a CUDA device, the validator produces the evidence, timed against the merge base.

Exit codes: 0 pass (or no kernel change), 1 fail, 2 bad input or infrastructure error,
3 not eligible for fast track. Build, audit, validator and clock are seams (arguments) so that
tests can stub the slow parts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from .atomic import write_text_atomic
from .policy import (ELIGIBLE, FULL_REVIEW, NO_CODE_CHANGE, NO_KERNEL_CHANGE, POLICY_RELPATH, PolicyDecision,
                     PolicyError, evaluate_policy, load_policy, parse_policy)
from .rfc import FrontMatter, FrontMatterError, SpeedupClaim, case_batch, find_front_matter
from .scope import ChangeScope, ScopeError, compute_scope, list_at, open_repo, read_at

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_NOT_ELIGIBLE = 0, 1, 2, 3
EVIDENCE_DIR = "evidence_reports"
TRUSTED_KEYS_DIR = "validation/trusted_keys"
BUNDLE_SCHEMA = "fasttrack.evidence/1"
DEFAULT_OUT = Path(".fasttrack/gate")


class GateError(Exception):
    """Bad input or missing infrastructure (exit 2)."""


@dataclass(frozen=True)
class BuiltVariant:
    """One rebuilt binary: what the bundle's `binaries` entries are matched against."""

    kernel: str
    variant: dict
    tunables: dict
    cubin_sha256: str
    build_key: str | None = None
    build_dir: str | None = None  # the build folder (kernel.ptx, kernel.sass), for the static audit
    cubin_code_sha256: str | None = None  # every section but the line tables (kernels/cubin.py)


class KernelBuildFailed(Exception):
    """The touched kernel does not build (the change's fault: a failed gate, not an error)."""


@dataclass
class AuditOutcome:
    status: str  # pass | fail | not_run
    detail: str
    findings: list[str] = field(default_factory=list)


@dataclass
class BundleCheck:
    """One candidate bundle and why it was, or was not, bound to the rebuilt binaries."""

    path: str
    signature: str  # ok | unsigned | invalid | untrusted | unchecked
    key_id: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def bound(self) -> bool:
        return self.signature == "ok" and not self.problems


@dataclass
class GateVerdict:
    status: str  # pass | fail | not_eligible | no_kernel_change | error
    exit_code: int
    reasons: list[str]
    base: str | None = None
    head: str | None = None
    merge_base: str | None = None
    kernels: list[str] = field(default_factory=list)
    scope: dict | None = None
    policy: dict | None = None
    build: list[dict] = field(default_factory=list)
    audit: dict | None = None
    evidence: dict | None = None
    claim: dict | None = None
    baseline: dict | None = None  # what the bound bundle was timed against, and why it is (not) the base
    risks: list[str] = field(default_factory=list)  # reported to the reviewer, not failures
    not_covered: list[str] = field(default_factory=list)
    # A failure's one cause (the first thing a reader sees) and the command that addresses it;
    # `reasons` keeps every failure, `details` what explains them (candidate bundles' problems).
    cause: str | None = None
    next_command: str | None = None
    details: list[str] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    bundle: dict | None = field(default=None, repr=False)  # the bound bundle (not in verdict.json)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("bundle")
        d["schema"] = "fasttrack.gate-verdict/1"
        return d


# -- bundles: the contract (validation/BUNDLE.md), with validation.bundle when it is there ------

def canonical_json(bundle: dict) -> bytes:
    """The signed bytes: the bundle without `signature`, sorted keys, no whitespace, UTF-8."""
    body = {k: v for k, v in bundle.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def key_id_of(public_key) -> str:
    """sha256 of the raw Ed25519 public key, hex, first 16 characters."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def verify_signature(bundle: dict, trusted_keys: dict[str, bytes]) -> tuple[str, str | None, str]:
    """(status, key_id, reason) for a bundle against PEM public keys keyed by file name.

    status is ok, unsigned, untrusted (no trusted key has its key_id) or invalid (the bytes were
    changed after signing, or the signature is malformed).
    """
    sig = bundle.get("signature")
    if not sig:
        return "unsigned", None, "the bundle is not signed"
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519" or not isinstance(sig.get("value"), str):
        return "invalid", None, "the signature is not an ed25519 signature object"
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    kid = sig.get("key_id")
    for name, pem in sorted(trusted_keys.items()):
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError:
            continue  # not a key: a README or such beside the keys
        if not isinstance(key, Ed25519PublicKey) or key_id_of(key) != kid:
            continue
        try:
            key.verify(base64.b64decode(sig["value"], validate=True), canonical_json(bundle))
        except (InvalidSignature, ValueError):
            return "invalid", kid, f"the signature by key {kid} does not verify: the bundle was changed after signing"
        return "ok", kid, ""
    return "untrusted", kid, f"signed by key {kid!r}, which is not among the trusted keys"


def check_signature(bundle: dict, trusted_keys: dict[str, bytes]) -> tuple[str, str | None, str]:
    """Verify through validation.bundle when it exists (it owns the contract), else our reading of it."""
    try:
        from . import bundle as bundle_mod
    except ImportError:
        bundle_mod = None
    fn = getattr(bundle_mod, "verify_bundle", None)
    if fn is None:
        return verify_signature(bundle, trusted_keys)
    if not bundle.get("signature"):
        return "unsigned", None, "the bundle is not signed"
    with tempfile.TemporaryDirectory() as d:
        for name, pem in trusted_keys.items():
            Path(d, Path(name).name).write_bytes(pem)
        res = fn(bundle, d)
    if getattr(res, "ok", False):
        return "ok", getattr(res, "key_id", None), ""
    reason = str(getattr(res, "reason", "") or "the signature does not verify")
    status = "untrusted" if "trust" in reason.lower() else "invalid"
    return status, getattr(res, "key_id", None), reason


def _canon(d) -> str:
    return json.dumps(d or {}, sort_keys=True, separators=(",", ":"))


def bind_bundle(bundle: dict, built: list[BuiltVariant], defaults: dict[str, dict]) -> list[str]:
    """Problems binding `bundle` to the rebuilt binaries; empty when every variant matches.

    Each rebuilt (kernel, variant, tunables) must appear among the bundle's head binaries with the
    same cubin sha256. Tunables missing from a bundle entry mean the manifest defaults.
    """
    entries = {}
    for b in bundle.get("binaries") or []:
        if not isinstance(b, dict) or b.get("side", "head") != "head":
            continue
        k = b.get("kernel")
        tun = {**defaults.get(k, {}), **(b.get("tunables") or {})}
        entries[(k, _canon(b.get("variant")), _canon(tun))] = (b.get("cubin_sha256"), b.get("cubin_code_sha256"))
    problems = []
    for v in built:
        tun = {**defaults.get(v.kernel, {}), **(v.tunables or {})}
        key = (v.kernel, _canon(v.variant), _canon(tun))
        label = f"kernel {v.kernel} variant {_canon(v.variant)}"
        if v.tunables:
            label += f" tunables {_canon(v.tunables)}"
        if key not in entries:
            problems.append(f"{label}: not measured by this bundle")
            continue
        sha, code = entries[key]
        # The code hash binds too: a rebuilt cubin whose line tables alone differ (a comment
        # moved a line) is the binary the bundle measured.
        if sha != v.cubin_sha256 and not (code and v.cubin_code_sha256 and code == v.cubin_code_sha256):
            entries[key] = sha
        else:
            continue
        if entries[key] != v.cubin_sha256:
            problems.append(f"{label}: rebuilt cubin sha256 {v.cubin_sha256[:16]} does not match "
                            f"the bundle's {str(entries[key])[:16]}: the evidence is for another binary")
    return problems


@dataclass
class BundleJudgement:
    """What the gate concludes from a bound bundle's results."""

    failures: list[str] = field(default_factory=list)
    risks: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    baseline: dict = field(default_factory=dict)


def _short(sha) -> str:
    return str(sha)[:12]


def bundle_baseline(bundle: dict) -> dict:
    """{kind, sha, ref}: what the bundle's benchmark timed head against. `kind` is "revision" (a
    previous revision of the kernel), "torch" (the torch/cuBLAS path) or "none"."""
    bench = bundle.get("benchmark") if isinstance(bundle.get("benchmark"), dict) else {}
    declared = bench.get("baseline") if isinstance(bench.get("baseline"), dict) else {}
    change = bundle.get("change") if isinstance(bundle.get("change"), dict) else {}
    base = change.get("base")
    kind = declared.get("kind")
    if kind is None:  # bundles written before `baseline` existed: read change.base
        kind = "none" if base in (None, "", "none") else "torch" if base == "torch" else "revision"
    return {"kind": kind, "sha": base if kind == "revision" else None, "ref": change.get("base_ref")}


def baseline_problems(bundle: dict, kernel: str, merge_base: str,
                      read_base_file: Callable[[str], bytes | None]) -> tuple[list[str], dict]:
    """(failures, baseline) for the bundle's benchmark baseline against the gate's merge base.

    The baseline holds when it is a revision of the kernel equal to `merge_base`, or one whose
    kernel sources (the hashes the bundle recorded for its base build) are byte-identical at
    `merge_base` (`read_base_file(path)` reads a file there): an ancestor-equivalent base. A
    torch or missing baseline, another base, or base binaries not recorded fail.
    """
    bl = bundle_baseline(bundle)
    if bl["kind"] != "revision":
        what = "the torch path" if bl["kind"] == "torch" else "nothing (no base was timed)"
        return ([f"benchmark baseline is {bl['kind']} ({what}), not the base revision {_short(merge_base)}: "
                 "the bundle cannot show no regression against the base; validate with "
                 f"`fasttrack validate {kernel} --base {_short(merge_base)}`"], {**bl, "holds": False})
    fails: list[str] = []
    sha = str(bl["sha"])
    # A path's composite bundle (change.kernel "block") records the binaries of the kernels it ran.
    composite = kernel not in {b.get("kernel") for b in bundle.get("binaries") or [] if isinstance(b, dict)}
    if not [b for b in bundle.get("binaries") or [] if isinstance(b, dict) and b.get("side") == "base"
            and (composite or b.get("kernel") == kernel)]:
        fails.append(f"the bundle names base {_short(sha)} but records no base binaries of {kernel}")
    if sha == merge_base:
        return fails, {**bl, "holds": not fails, "equivalence": "same commit"}
    recorded = (bundle.get("change") or {}).get("base_sources_sha256")
    if not isinstance(recorded, dict) or not recorded:
        fails.append(f"benchmarked against base {_short(sha)}, not the gate's base {_short(merge_base)}, and "
                     "the bundle records no base source hashes to show the two kernels are the same")
        return fails, {**bl, "holds": False}
    differ = []
    for path, digest in sorted(recorded.items()):
        data = read_base_file(path)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            differ.append(path)
    if differ:
        fails.append(f"benchmarked against base {_short(sha)}, not the gate's base {_short(merge_base)}, and "
                     f"the kernel differs between them ({', '.join(differ[:4])}"
                     f"{' ...' if len(differ) > 4 else ''}): the evidence does not compare with this base")
        return fails, {**bl, "holds": False, "differing_sources": differ}
    return fails, {**bl, "holds": not fails,
                   "equivalence": f"same kernel sources as {_short(merge_base)} ({len(recorded)} files)"}


def judge_results(bundle: dict, claim: SpeedupClaim, *, kernel: str | None = None,
                  merge_base: str | None = None,
                  read_base_file: Callable[[str], bytes | None] | None = None) -> BundleJudgement:
    """Failures, risks and what was not covered, from a bound bundle's results.

    With `merge_base` (the gate always gives it), the benchmark must be timed against that base
    (`baseline_problems`); SLOW fails only against a base revision (a regression) and is a risk
    against anything else (another implementation says nothing about regression).
    """
    j = BundleJudgement(not_covered=[str(x) for x in bundle.get("not_covered") or []])
    fails, risks = j.failures, j.risks
    if bundle.get("verdict") != "pass":
        why = "; ".join(str(r) for r in bundle.get("reasons") or []) or "no reason given"
        fails.append(f"the bundle's own verdict is {bundle.get('verdict')!r}: {why}")
    corr = bundle.get("correctness")
    if not isinstance(corr, dict) or corr.get("passed") is not True:
        fails.append("correctness did not pass" if isinstance(corr, dict) else "no correctness results")
    defences = bundle.get("defences")
    if defences is None:
        j.not_covered.append("benchmark-hack defences: not run")
    elif not isinstance(defences, dict) or defences.get("passed") is not True:
        fails.append("the defences against benchmark hacks did not pass")
    race = bundle.get("race")
    if race is None:
        fails.append("no race audit in the bundle (race is null): race freedom is not shown")
    elif not isinstance(race, dict) or race.get("passed") is not True:
        fails.append("the race audit did not pass")
    bench = bundle.get("benchmark")
    if not isinstance(bench, dict):
        fails.append("no benchmark results")
        return j
    if merge_base is not None:
        f, j.baseline = baseline_problems(bundle, kernel or str((bundle.get("change") or {}).get("kernel")),
                                          merge_base, read_base_file or (lambda _p: None))
        fails += f
    against_base = j.baseline.get("kind", bundle_baseline(bundle)["kind"]) == "revision"
    if bench.get("passed") is not True:
        fails.append("the benchmark did not pass")
    cases = [c for c in bench.get("cases") or [] if isinstance(c, dict)]
    if not cases:
        fails.append("the benchmark has no cases")

    def label(c: dict) -> str:
        b = case_batch(c)
        return c.get("name") or (f"batch {b}" if b is not None else _canon(c.get("variant")))

    slow = [label(c) for c in cases if c.get("verdict") == "SLOW"]
    if slow and against_base:
        fails.append(f"SLOW (slower beyond noise than the base revision) at: {', '.join(slow)}")
    elif slow:
        risks.append(f"SLOW against {j.baseline.get('kind') or bundle_baseline(bundle)['kind']} (another "
                     f"implementation, not a regression) at: {', '.join(slow)}")
    impossible = [label(c) for c in cases if c.get("verdict") == "IMPOSSIBLE"]
    if impossible:
        fails.append(f"IMPOSSIBLE (faster than the measured bandwidth ceiling allows) at: {', '.join(impossible)}")
    amb = [label(c) for c in cases if c.get("verdict") == "AMBIGUOUS"]
    if amb and against_base:
        risks.append(f"AMBIGUOUS (no difference shown either way) at: {', '.join(amb)}")
    if claim.speedup:
        claimed = [c for c in cases if claim.batches is None or case_batch(c) in claim.batches]
        where = "all cases" if claim.batches is None else "batches " + ", ".join(map(str, claim.batches))
        if not claimed:
            fails.append(f"the claimed speedup ({where}) has no measured case")
        else:
            amb = [label(c) for c in claimed if c.get("verdict") == "AMBIGUOUS"]
            if amb:
                fails.append(f"the claimed speedup is AMBIGUOUS at: {', '.join(amb)}")
            if not any(c.get("verdict") == "FAST" for c in claimed):
                fails.append(f"a speedup is claimed ({where}) but no claimed case is FAST")
    return j


# -- seams: build, audit, validator ------------------------------------------------------------

Builder = Callable[[str], list[BuiltVariant]]
Auditor = Callable[[str, list], AuditOutcome]


def _repo_relative_build(entry: dict, repo_root: Path) -> dict:
    """A rebuilt variant as the verdict records it: its build folder relative to the repository
    when it lies inside it, so a committed verdict names no path of the machine that ran it."""
    d = entry.get("build_dir")
    if d:
        try:
            entry["build_dir"] = Path(d).resolve().relative_to(repo_root.resolve()).as_posix()
        except ValueError:
            pass
    return entry


DEFAULT_SANDBOX = "default"  # run_gate's `sandbox`: kernels.sandbox.Sandbox hiding the repository's key store


def gate_sandbox(sandbox, repo_root: Path):
    """The sandbox the gate's compile children run in: `sandbox` itself, or for DEFAULT_SANDBOX a
    kernels.sandbox.Sandbox that also hides `repo_root`'s key store; None when the caller opted
    out (`sandbox=None`). GateError (exit 2) when it cannot run here: the gate never runs the
    change's code unsandboxed unless told to."""
    if sandbox is None:
        return None
    from kernels.sandbox import Sandbox

    sb = Sandbox(key_roots=(str(repo_root),)) if sandbox == DEFAULT_SANDBOX else sandbox
    problem = sb.problem()
    if problem:
        raise GateError(f"the gate builds the change's code only inside a sandbox, and it cannot run here: "
                        f"{problem}; on a host without bubblewrap, `fasttrack gate --no-sandbox` builds "
                        "unsandboxed (the head's code then runs with this process's environment and files)")
    return sb


def default_builder(repo_root: Path, manifest=None, sandbox=None) -> Builder:
    """A builder of every manifest variant of a kernel with kernels/build.py (default tunables),
    compiling the sources of the checkout at `repo_root` into its `build/` cache, each compile
    child inside `sandbox` (a kernels.sandbox.Sandbox) when given."""

    def build(kernel: str) -> list[BuiltVariant]:
        try:
            from kernels import build as kbuild
        except ImportError as e:
            raise GateError(f"cannot build: kernels.build is not importable ({e})") from None
        try:
            arts = kbuild.build_kernel(kernel, root=Path(repo_root) / "build", manifest=manifest,
                                       repo_root=Path(repo_root), sandbox=sandbox)
        except kbuild.BuildError as e:
            raise KernelBuildFailed(str(e)) from None
        except ImportError as e:  # the DSL is missing: infrastructure, not the change
            raise GateError(f"cannot build {kernel}: {e}") from None
        return [BuiltVariant(kernel=a.kernel, variant=dict(a.shape), tunables=dict(a.tunables or {}),
                             cubin_sha256=a.cubin_sha256, build_key=a.key, build_dir=str(a.dir))
                for a in arts]

    return build


def default_auditor(manifest) -> Auditor:
    """The static race audit (validation.race) of every rebuilt variant, against the roles the
    manifest declares; "not run" when the audit or the build folders are not available."""

    def audit(kernel: str, built: list[BuiltVariant]) -> AuditOutcome:
        try:
            from .race.artifacts import audit_artifact
        except ImportError as e:
            return AuditOutcome("not_run", f"the static race audit is not available ({e})")
        if manifest is None or not built or any(b.build_dir is None for b in built):
            return AuditOutcome("not_run", "no build folders to audit")
        spec = manifest.kernel(kernel)
        findings: list[str] = []
        for b in built:
            d = Path(b.build_dir)
            art = SimpleNamespace(paths={"ptx": d / "kernel.ptx", "sass": d / "kernel.sass"})
            rep = audit_artifact(art, spec, kernel=f"{kernel} {_canon(b.variant)}")
            findings += [f"{kernel} {_canon(b.variant)}: {f}" for f in rep.errors]
        if findings:
            return AuditOutcome("fail", "the static race audit found errors", findings)
        return AuditOutcome("pass", f"static race audit clean on {len(built)} variants")

    return audit


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def default_validator(kernel: str, base: str) -> dict:
    """Run the validator on this GPU host against base revision `base` and return its (unsigned)
    evidence bundle."""
    try:
        from . import validate as vmod  # type: ignore[attr-defined]
    except ImportError:
        raise GateError("--run-gpu: the validator (validation.validate) is not available") from None
    fn = getattr(vmod, "validate_kernel", None)
    if fn is None:
        raise GateError("--run-gpu: validation.validate has no validate_kernel(kernel)")
    try:
        return fn(kernel, base=base)
    except vmod.ValidateError as e:
        raise GateError(f"--run-gpu: {e}") from None


# -- the gate ----------------------------------------------------------------------------------

def policy_at(repo, rev: str):
    """The policy as committed at `rev` (the packaged default when that commit has none)."""
    data = read_at(repo, rev, POLICY_RELPATH)
    if data is None:
        return load_policy()
    return parse_policy(data.decode("utf-8"), f"{POLICY_RELPATH} at {rev[:12]}")


def trusted_keys_at(repo, rev: str) -> dict[str, bytes]:
    """Repo-relative path -> PEM bytes of the trusted public keys committed at `rev`."""
    keys = {}
    for p in list_at(repo, rev, TRUSTED_KEYS_DIR):
        if p.endswith(".pub"):
            keys[p] = read_at(repo, rev, p) or b""
    return keys


def validator_at(repo, rev: str | None) -> tuple[str, dict[str, str]]:
    """(validator_sha256, path -> sha256) of the validator's source files at `rev` (the working
    tree when None), as `fasttrack validate` records them from the tree it ran."""
    from .bundle import validator_fingerprint

    return validator_fingerprint(lambda top: list_at(repo, rev, top), lambda p: read_at(repo, rev, p))


def bundles_at(repo, rev: str | None) -> dict[str, dict | str]:
    """repo-relative path -> parsed bundle, or the reason it could not be read."""
    out: dict[str, dict | str] = {}
    for p in list_at(repo, rev, EVIDENCE_DIR):
        if not p.endswith("bundle.json"):
            continue
        data = read_at(repo, rev, p)
        try:
            b = json.loads((data or b"").decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            out[p] = f"not valid JSON: {e}"
            continue
        if not isinstance(b, dict) or b.get("schema") != BUNDLE_SCHEMA:
            out[p] = f"not a {BUNDLE_SCHEMA} bundle"
            continue
        problems = bundle_shape_problems(b)
        if problems:
            out[p] = f"not a well-formed {BUNDLE_SCHEMA} bundle: " + "; ".join(problems[:3])
            continue
        out[p] = b
    return out


def bundle_shape_problems(b: dict) -> list[str]:
    """What keeps the gate from reading `b` (validation/BUNDLE.md's schema, plus the types the
    binding reads): a malformed committed bundle is refused with its reason, never a crash."""
    from .bundle import schema_problems

    problems = schema_problems(b)
    if problems:
        return problems
    kernel = b["change"].get("kernel")
    if kernel is not None and not isinstance(kernel, str):
        problems.append("change.kernel must be a string")
    for i, x in enumerate(b["binaries"]):
        if not isinstance(x["kernel"], str) or not isinstance(x["cubin_sha256"], str):
            problems.append(f"binaries[{i}]: kernel and cubin_sha256 must be strings")
        if not isinstance(x["variant"], dict) or not isinstance(x["tunables"], (dict, type(None))):
            problems.append(f"binaries[{i}]: variant must be an object, tunables an object or null")
    return problems


def bundle_kernels(b: dict) -> set[str]:
    """The kernels a bundle says it measured."""
    names = {x.get("kernel") for x in b.get("binaries") or [] if isinstance(x, dict)}
    ch = b.get("change")
    if isinstance(ch, dict) and ch.get("kernel"):
        names.add(ch["kernel"])
    return names


def _check_checkout(repo, head: str | None) -> None:
    """The build compiles the checkout: under kernels/ it must be exactly `head`."""
    import git

    if head is None:
        return
    try:
        repo.git.diff("--quiet", head, "--", "kernels")
    except git.GitCommandError:
        raise GateError(f"the checkout's kernels/ differs from head {head[:12]}; the gate builds the "
                        "checkout, so check out the head first") from None
    stray = [p for p in repo.git.ls_files("--others", "--exclude-standard", "--", "kernels").split("\n") if p]
    if stray:
        raise GateError(f"untracked files under kernels/ would be built but are not in head: {stray[0]}")


def run_gate(base: str, head: str | None = None, *, repo: str | os.PathLike = ".",
             run_gpu: bool = False, scope_only: bool = False, front_matter: str | None = None,
             builder: Builder | None = None, auditor: Auditor | None = None,
             validator: Callable[[str, str], dict] | None = None,
             cuda_available: Callable[[], bool] = _cuda_available,
             code_build: Callable | None = None, executor=None, jobs: int | None = None,
             build_root: str | os.PathLike | None = None, sandbox=DEFAULT_SANDBOX) -> GateVerdict:
    """Judge the change from `base` to `head` (the working tree when None). Never raises for a
    user's error: those become a verdict with status "error" and exit code 2.

    The touched kernels are decided by their rebuilt code (`validation.scope.compare_code`: base
    and head builds into the shared cache `build_root`, default <repo>/build, on `executor`);
    `code_build(requests) -> results` replaces the build (tests). A `builder(kernel)` without a
    `code_build` judges by declared-source ownership instead, as before the code was compared.
    Real builds run their compile children in `sandbox` (`gate_sandbox`: by default bubblewrap,
    an error where it cannot run; None builds unsandboxed)."""
    try:
        return _run_gate(base, head, repo=repo, run_gpu=run_gpu, scope_only=scope_only,
                         front_matter=front_matter, builder=builder, auditor=auditor,
                         validator=validator, cuda_available=cuda_available, code_build=code_build,
                         executor=executor, jobs=jobs, build_root=build_root, sandbox=sandbox)
    except (GateError, ScopeError, PolicyError, FrontMatterError) as e:
        return GateVerdict("error", EXIT_ERROR, [str(e)], base=base, head=head, cause=str(e))


# Violations the rebuilt code can lift: which kernels a change touches is the code's to say.
# (A staged kernel's stage rules apply once the code says that kernel alone is touched.)
_CODE_DECIDES = {"multiple-kernels", "undeclared-dependency", "line-bound", "multiple-stages", "stage-unassigned",
                 "no-validation-stage"}


def _built_from_code(scope: ChangeScope, kernels, repo_root: Path) -> tuple[list[BuiltVariant], list[str]]:
    built, fails = [], []
    for k in kernels:
        c = (scope.code or {}).get(k) or {}
        if c.get("status") == "build_failed":
            fails.append(f"kernel {k} does not build at head: {(c.get('errors') or ['?'])[0]}")
            continue
        for a in c.get("head") or []:
            built.append(BuiltVariant(kernel=a.kernel, variant=dict(a.shape), tunables=dict(a.tunables or {}),
                                      cubin_sha256=a.cubin_sha256, build_key=a.key, build_dir=str(a.dir),
                                      cubin_code_sha256=a.cubin_code_sha256))
    return built, fails


def _validate_command(kernel: str, merge_base: str) -> str:
    return (f"fasttrack validate {kernel} --base {_short(merge_base)} --prepare   "
            f"(then on a GPU host: --plan ...; fasttrack sign; commit the bundle under {EVIDENCE_DIR}/)")


def _run_gate(base, head, *, repo, run_gpu, scope_only, front_matter, builder, auditor, validator,
              cuda_available, code_build, executor, jobs, build_root, sandbox) -> GateVerdict:
    import time

    t0 = time.monotonic()
    r = open_repo(repo)
    repo_root = Path(r.working_tree_dir)
    scope: ChangeScope = compute_scope(base, head, repo=r.working_tree_dir, closures=False)
    policy = policy_at(r, scope.merge_base)
    decision: PolicyDecision = evaluate_policy(scope, policy)
    by_code = builder is None or code_build is not None
    resolved: list = []

    def sandboxed():
        """The build sandbox, checked once, only when something really compiles."""
        if not resolved:
            resolved.append(gate_sandbox(sandbox, repo_root))
        return resolved[0]
    timings: dict[str, float] = {"scope_s": 0.0}
    # Rules no build can lift (protected paths, the manifest's semantics, ...) answer before
    # anything compiles, and before the closures are read; otherwise the code decides which
    # kernels the change touches.
    final = [x for x in decision.violations if x.rule not in _CODE_DECIDES]
    if not final:
        from .scope import with_closures

        scope = with_closures(scope, r)
        decision = evaluate_policy(scope, policy)
        final = [x for x in decision.violations if x.rule not in _CODE_DECIDES]
    if by_code and not final:
        from .scope import code_candidates, compare_code

        if code_candidates(scope):
            try:
                scope = compare_code(scope, repo=r.working_tree_dir, build=code_build, executor=executor,
                                     jobs=jobs, root=Path(build_root) if build_root else repo_root / "build",
                                     sandbox=None if code_build else sandboxed())
            except ImportError as e:
                raise GateError(f"cannot build to compare the code: {e}") from None
            decision = evaluate_policy(scope, policy)
    timings["scope_s"] = round(time.monotonic() - t0, 2)
    v = GateVerdict("error", EXIT_ERROR, [], base=scope.base, head=scope.head,
                    merge_base=scope.merge_base, kernels=list(decision.kernels),
                    scope=scope.to_dict(), policy=decision.to_dict())
    v.scope["timings"] = timings
    if decision.status == FULL_REVIEW:
        v.status, v.exit_code = "not_eligible", EXIT_NOT_ELIGIBLE
        v.reasons = ["not eligible for fast track; route to full review:"] + [str(x) for x in decision.violations]
        v.cause = f"not eligible for fast track: {decision.violations[0]}" + (
            f" (and {len(decision.violations) - 1} more rule(s))" if len(decision.violations) > 1 else "")
        v.next_command = "request a full review (the violations below say why), or split the change"
        return v
    if decision.status == NO_KERNEL_CHANGE:
        v.status, v.exit_code = "no_kernel_change", EXIT_PASS
        v.reasons = ["no kernel change: nothing to fast-track, and nothing protected was touched"]
        return v
    if decision.status == NO_CODE_CHANGE:
        same = sorted((scope.code or {}))
        n = sum(int(scope.code[k].get("variants") or 0) for k in same)
        lt = sum(int(scope.code[k].get("line_tables_only") or 0) for k in same)
        v.status, v.exit_code = "no_code_change", EXIT_PASS
        v.reasons = [f"no code change: every kernel whose build closure the change touches "
                     f"({', '.join(same)}) builds to the same code at base and head ({n} variants "
                     f"compared by cubin code hash; {lt} differ in their line tables only), so the "
                     "existing evidence still binds"]
        return v
    assert decision.status == ELIGIBLE
    what = (f"kernels {', '.join(decision.kernels)} of decode path {decision.path} (composite "
            f"{decision.composite})" if decision.path else
            f"stage {decision.stage} of kernel {decision.kernel} (a one-stage change)" if decision.stage
            else f"kernel {decision.kernel}")
    if scope_only:
        v.status, v.exit_code = "pass", EXIT_PASS
        v.reasons = [f"eligible for fast track: {what}, {decision.counted_lines} lines "
                     f"(scope only: {'code compared; ' if decision.by_code else ''}audit and evidence not checked)"]
        v.not_covered.append("--scope-only: static audit and evidence were not checked")
        return v

    front: FrontMatter = find_front_matter(r, scope, front_matter)
    v.claim = front.claim.to_dict()
    fails: list[str] = []

    # 2. build
    t1 = time.monotonic()
    built: list[BuiltVariant] = []
    if decision.by_code:
        built, fails = _built_from_code(scope, decision.kernels, repo_root)
    else:
        if builder is None:
            _check_checkout(r, scope.head)
            builder = default_builder(repo_root, scope.head_manifest, sandboxed())
        for k in decision.kernels:
            try:
                built.extend(builder(k))
            except KernelBuildFailed as e:
                fails.append(f"kernel {k} does not build: {e}")
    v.build = [_repo_relative_build(asdict(b), repo_root) for b in built]
    if fails:
        v.status, v.exit_code, v.reasons = "fail", EXIT_FAIL, fails
        v.cause, v.next_command = fails[0], f"fasttrack build {decision.kernels[0]}   (the compile error, with its file and line)"
        return v

    # 3. static audit
    auditor = auditor or default_auditor(scope.head_manifest)
    outcomes = {k: auditor(k, [b for b in built if b.kernel == k]) for k in decision.kernels}
    v.audit = {k: asdict(o) for k, o in outcomes.items()}
    for k, o in outcomes.items():
        if o.status == "fail":
            fails.append(f"kernel {k}: {o.detail}: " + "; ".join(o.findings[:5]))
        elif o.status == "not_run":
            v.not_covered.append(f"static race audit of {k}: not run ({o.detail})")
    timings["build_audit_s"] = round(time.monotonic() - t1, 2)
    timings["static_s"] = round(time.monotonic() - t0, 2)

    # 4. evidence
    manifest = scope.head_manifest or scope.base_manifest
    defaults = {k: manifest.kernel(k).tunable_defaults() for k in decision.kernels} if manifest else {}
    composites = {p.composite for p in manifest.paths.values()} if manifest else set()

    from .bundle import validator_mismatch, validator_recorded

    # The evidence must come from the validator as it is at the merge base: a bundle produced
    # before a defence or tolerance fix must not bind because its cubins did not change.
    base_validator = validator_at(r, scope.merge_base)
    next_cmds: list[str] = []

    def judge(bundle: dict, kernel: str, prefix: str = "") -> None:
        if not validator_recorded(bundle):
            v.risks.append(f"{prefix}the bundle does not record the validator that produced it (no "
                           "environment.validator_sha256: written before fasttrack recorded it), so it is "
                           f"not shown to come from the validator at {_short(scope.merge_base)}")
        j = judge_results(bundle, front.claim, kernel=kernel, merge_base=scope.merge_base,
                          read_base_file=lambda path: read_at(r, scope.merge_base, path))
        fails.extend(prefix + x for x in j.failures)
        if j.failures:
            next_cmds.append(_validate_command(kernel, scope.merge_base))
        v.risks += j.risks
        v.not_covered += j.not_covered
        v.baseline = j.baseline

    bound_bundles: list[dict] = []
    if run_gpu:
        if not cuda_available():
            raise GateError("--run-gpu needs a CUDA device, and none is visible")
        bundle = None
        for k in decision.kernels:
            bundle = (validator or default_validator)(k, scope.merge_base)
            problems = bind_bundle(bundle, [b for b in built if b.kernel == k], defaults)
            problems += validator_mismatch(bundle, *base_validator)
            fails += [f"the validator's own bundle: {p}" for p in problems]
            judge(bundle, k)
            bound_bundles.append(bundle)
        v.bundle = bundle
        v.evidence = {"source": "validator run by this gate (--run-gpu)", "bundle": None, "candidates": [],
                      "validator_sha256": base_validator[0]}
        if decision.composite:
            v.not_covered.append(f"--run-gpu: the composite {decision.composite} of path {decision.path} "
                                 f"is not validated by the gate; commit its signed bundle")
    else:
        keys = trusted_keys_at(r, scope.merge_base)
        bundles = bundles_at(r, scope.head)
        v.evidence = {"source": "committed bundle", "bundle": None, "trusted_keys": len(keys),
                      "candidates": [], "validator_sha256": base_validator[0], "bound": {}}
        entries = [(k, False) for k in decision.kernels] + ([(decision.composite, True)] if decision.composite else [])
        rebuild = _head_rebuilder(r, scope, code_build, executor, jobs,
                                  Path(build_root) if build_root else repo_root / "build",
                                  sandboxed) if decision.by_code else None
        for k, is_composite in entries:
            checks: list[BundleCheck] = []
            bound: tuple[str, dict] | None = None
            for path, b in sorted(bundles.items()):
                if isinstance(b, str):
                    checks.append(BundleCheck(path, "unchecked", problems=[b]))
                    continue
                named = (b.get("change") or {}).get("kernel")
                if is_composite:
                    if named != k:
                        continue
                elif k not in bundle_kernels(b) or named in composites:
                    continue
                status, kid, why = check_signature(b, keys)
                c = BundleCheck(path, status, kid, [why] if why else [])
                if is_composite:
                    c.problems += bind_composite(b, decision.kernels, built, defaults, rebuild)
                else:
                    c.problems += bind_bundle(b, [x for x in built if x.kernel == k], defaults)
                c.problems += validator_mismatch(b, *base_validator)
                checks.append(c)
                if c.bound and (bound is None or str(b.get("created", "")) > str(bound[1].get("created", ""))):
                    bound = (path, b)
            v.evidence["candidates"] += [asdict(c) | {"bound": c.bound, "for": k} for c in checks]
            what_k = f"the composite {k} of path {decision.path}" if is_composite else f"kernel {k}"
            if bound is None:
                judged = [c for c in checks if c.signature != "unchecked"]
                if not judged:
                    unread = [c for c in checks if c.signature == "unchecked"]
                    fails.append(f"{what_k}: no committed evidence bundle under {EVIDENCE_DIR}/ measures it"
                                 + (f" (unreadable: {unread[0].path}: {unread[0].problems[0]}"
                                    + (f"; +{len(unread) - 1} more" if len(unread) > 1 else "") + ")"
                                    if unread else ""))
                    v.details += [f"{c.path}: {p}" for c in unread for p in c.problems]
                else:
                    best = min(judged, key=lambda c: len(c.problems))
                    more = len(best.problems) - 1
                    fails.append(f"{what_k}: no committed evidence binds; closest {best.path}: {best.problems[0]}"
                                 + (f" (+{more} more problem(s); {len(judged) - 1} other candidate(s))"
                                    if more or len(judged) > 1 else ""))
                    v.details += [f"{c.path}: {p}" for c in checks for p in c.problems]
                next_cmds.append(_validate_command(k, scope.merge_base))
                continue
            v.evidence["bound"][k] = bound[0]
            if not is_composite or v.evidence["bundle"] is None:
                v.evidence["bundle"] = bound[0]
                v.bundle = bound[1]
            bound_bundles.append(bound[1])
            judge(bound[1], k, f"{bound[0]}: ")

    # New tunable choices must be measured by bound evidence (or be the new default, which the
    # binding of the default variants covers).
    for k, tunables in sorted(decision.new_choices.items()):
        for t, values in sorted(tunables.items()):
            for val in values:
                if defaults.get(k, {}).get(t) == val:
                    continue
                seen = any(isinstance(x, dict) and x.get("kernel") == k and x.get("side", "head") == "head"
                           and {**defaults.get(k, {}), **(x.get("tunables") or {})}.get(t) == val
                           for bb in bound_bundles for x in bb.get("binaries") or [])
                if not seen:
                    fails.append(f"kernel {k}: the new choice {t}={val!r} is measured by no bound evidence")
                    next_cmds.append(_validate_command(k, scope.merge_base))

    if fails:
        v.status, v.exit_code, v.reasons = "fail", EXIT_FAIL, fails
        v.cause = fails[0] + (f" (and {len(fails) - 1} more failure(s))" if len(fails) > 1 else "")
        v.next_command = next_cmds[0] if next_cmds else None
    else:
        v.status, v.exit_code = "pass", EXIT_PASS
        where = ", ".join(sorted(set((v.evidence.get("bound") or {}).values()))) or v.evidence["source"]
        v.reasons = [f"{what}: {len(built)} variants rebuilt, bound to "
                     f"{where}; correctness, race and benchmark results pass, timed against base "
                     f"{_short(scope.merge_base)} ({(v.baseline or {}).get('equivalence', 'the base')})"]
    return v


def _head_rebuilder(r, scope: ChangeScope, code_build, executor, jobs, root: Path, sandboxed=lambda: None):
    """Builds (kernel, variant, tunables) at head into the shared cache: what a composite bundle
    ran at other tunables than the manifest defaults (compile children in `sandboxed()`)."""
    def rebuild(want: list[tuple[str, dict, dict]]) -> dict:
        import tempfile

        from kernels import build as kb

        from .scope import export_tree

        man = scope.head_manifest
        out: dict = {}
        with tempfile.TemporaryDirectory(prefix="fasttrack-rebuild-") as d:
            tree = export_tree(r, scope.head, Path(d)) if scope.head else Path(r.working_tree_dir)
            reqs, keys = [], []
            for k, variant, tunables in want:
                spec = man.kernel(k)
                try:
                    tun = kb.resolve_tunables(spec, tunables)
                except kb.BuildError as e:
                    out[(k, _canon(variant), _canon({**spec.tunable_defaults(), **tunables}))] = str(e)
                    continue
                reqs.append(kb.BuildRequest(spec, dict(variant), tun, tree))
                keys.append((k, _canon(variant), _canon(tun)))
            results = (code_build or (lambda q: kb.build_requests(q, root=root, executor=executor, jobs=jobs,
                                                                  sandbox=sandboxed())))(reqs)
        for kk, a in zip(keys, results):
            out[kk] = str(a) if isinstance(a, Exception) else BuiltVariant(
                kernel=a.kernel, variant=dict(a.shape), tunables=dict(a.tunables or {}), cubin_sha256=a.cubin_sha256,
                build_key=a.key, build_dir=str(a.dir), cubin_code_sha256=a.cubin_code_sha256)
        return out

    return rebuild


def bind_composite(bundle: dict, touched, built: list[BuiltVariant], defaults: dict[str, dict],
                   rebuild: Callable[[list[tuple[str, dict, dict]]], dict] | None = None) -> list[str]:
    """Problems binding a decode path's composite bundle (change.kernel = the path's composite,
    e.g. "block") to the change: it must have run every touched kernel (a head binary of each),
    and each of its head binaries of a touched kernel must be a cubin this head builds (same
    kernel, variant and tunables as a rebuilt variant, and the same cubin sha256 or code
    sha256). Binaries at other tunables than the manifest defaults (the block's own choices per
    batch) are built at head by `rebuild([(kernel, variant, tunables)]) -> {key: BuiltVariant or
    error text}`. Binaries of untouched kernels keep their code (the scope shows it)."""
    def key(k, variant, tunables):
        return (k, _canon(variant), _canon({**defaults.get(k, {}), **(tunables or {})}))

    rebuilt: dict = {key(b.kernel, b.variant, b.tunables): b for b in built}
    heads = [x for x in bundle.get("binaries") or [] if isinstance(x, dict) and x.get("side", "head") == "head"]
    want = [(x["kernel"], x.get("variant") or {}, x.get("tunables") or {}) for x in heads
            if x.get("kernel") in touched and key(x["kernel"], x.get("variant"), x.get("tunables")) not in rebuilt]
    if want and rebuild is not None:
        rebuilt.update(rebuild(want))
    problems = []
    for k in touched:
        mine = [x for x in heads if x.get("kernel") == k]
        if not mine:
            problems.append(f"the composite bundle ran no binary of touched kernel {k}")
            continue
        for x in mine:
            tun = {**defaults.get(k, {}), **(x.get("tunables") or {})}
            label = f"kernel {k} variant {_canon(x.get('variant'))}"
            b = rebuilt.get((k, _canon(x.get("variant")), _canon(tun)))
            if b is None or isinstance(b, str):
                problems.append(f"{label} tunables {_canon(x.get('tunables'))}: not rebuilt at head"
                                + (f" ({b})" if b else ""))
            elif x.get("cubin_sha256") != b.cubin_sha256 and not (
                    x.get("cubin_code_sha256") and x.get("cubin_code_sha256") == b.cubin_code_sha256):
                problems.append(f"{label}: rebuilt cubin sha256 {b.cubin_sha256[:16]} does not match the "
                                f"composite bundle's {str(x.get('cubin_sha256'))[:16]}: the evidence is for another binary")
    return problems


# -- outputs -----------------------------------------------------------------------------------

def render_outputs(v: GateVerdict) -> dict[str, str]:
    """file name -> text: verdict.json, report.html, pr_comment.md (and evidence.html when
    validation/report.py can render the bound bundle)."""
    from .rfc import benchmark_rows, template_env

    env = template_env()
    d = v.to_dict()
    ctx = {"v": d, "rows": benchmark_rows(v.bundle), "evidence_page": None}
    out = {"verdict.json": json.dumps(d, indent=2, sort_keys=True) + "\n"}
    if v.bundle is not None:
        try:
            from .report import render_report  # type: ignore[attr-defined]
        except ImportError:
            render_report = None
        if render_report is not None:
            bound = (v.evidence or {}).get("bundle")
            cand = next((c for c in (v.evidence or {}).get("candidates") or [] if c.get("path") == bound), {})
            trust = {"signature": {"status": "ok", "key_id": cand.get("key_id"), "reason": ""} if cand.get("bound")
                     else {"status": "unsigned", "reason": "the validator's own bundle (--run-gpu), not signed"},
                     "binding": {"status": "bound" if cand.get("bound") else "not_checked",
                                 "detail": f"the gate bound it to the {len(v.build)} variant(s) it rebuilt"
                                 if cand.get("bound") else "checked by the gate above"}}
            out["evidence.html"] = render_report(v.bundle, trust)
            ctx["evidence_page"] = "evidence.html"
    out["report.html"] = env.get_template("gate.html.j2").render(**ctx)
    out["pr_comment.md"] = env.get_template("pr_comment.md.j2").render(**ctx)
    return out


def ci_outputs(v: GateVerdict | dict) -> dict[str, str]:
    """The verdict as CI step outputs (name -> one-line value): `status`; `kernels`, the JSON
    list of every touched kernel of an eligible change (empty otherwise), usable as a job
    matrix; `targets`, the `fasttrack validate` entries its evidence needs (those kernels, then
    the decode path's composite when the change spans a path)."""
    d = v.to_dict() if isinstance(v, GateVerdict) else v
    eligible = d.get("status") == "pass"
    kernels = [str(k) for k in d.get("kernels") or []] if eligible else []
    composite = (d.get("policy") or {}).get("composite") if eligible else None
    targets = kernels + ([str(composite)] if composite else [])
    compact = {"separators": (",", ":")}
    return {"status": str(d.get("status")), "kernels": json.dumps(kernels, **compact),
            "targets": json.dumps(targets, **compact)}


def write_outputs(v: GateVerdict, out_dir: str | os.PathLike = DEFAULT_OUT) -> dict[str, Path]:
    """Write the verdict, the HTML report and the PR comment under `out_dir` (each atomically)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise GateError(f"--out {out_dir} exists and is not a directory")
    written = {}
    for name, text in render_outputs(v).items():
        write_text_atomic(out / name, text)
        written[name] = out / name
    return written
