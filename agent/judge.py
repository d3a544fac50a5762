"""The loop's judgement of its own change, with the gate's code, before anything is committed.

`judge_change(repo, base, worktree, backends=...)` is the one place the agent asks the gate what
it would say. It calls these public functions of the gate and nothing else of it:

  * `validation.scope.compute_scope(base, None, repo=worktree)`: the change from the BASE revision
    to the worktree's files as they are (untracked files, symlinks, anything a build wrote),
    never from the worktree's HEAD;
  * `validation.gate.policy_at(repo, merge_base)` and `validation.policy.evaluate_policy(scope,
    policy)`: protected paths, the manifest rules, symlinks, submodules, undeclared imports, the
    line bound and the one-kernel rule;
  * the build and the gate's static audit (`validation.gate.default_auditor`) through the
    backends (agent/backends.py), which compile every variant of every touched kernel with the
    compile children in the sandbox (kernels/sandbox.py).

On top of the gate it refuses what the gate cannot see from a working tree: a HEAD that moved
away from the base (something committed behind the loop's back) and changed file modes. It also
builds the base revision's sources, so that a change whose cubin code hashes (kernels/cubin.py)
all equal the base's is known to be code-identical and claims no speedup.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.backends import OK


@dataclass
class Verdict:
    """What the gate would say about the worktree's change (before evidence)."""

    ok: bool
    reasons: list[str] = field(default_factory=list)  # why it is refused (empty when ok)
    kernels: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    built: dict = field(default_factory=dict)  # kernel -> [{variant, cubin_sha256, cubin_code_sha256}]
    code_identical_to_base: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "core.hooksPath=/dev/null", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def mode_changes(worktree: Path, base: str) -> list[str]:
    """Paths whose git file mode differs from the base (tracked and untracked), as reasons."""
    out = []
    raw = _git(worktree, "diff", "--raw", "--no-abbrev", "-z", base).split("\0")
    i = 0
    while i < len(raw) - 1:
        head = raw[i]
        if not head.startswith(":"):
            i += 1
            continue
        old_mode, new_mode, _, _, status = head[1:].split(" ")[:5]
        path = raw[i + 1]
        i += 3 if status[:1] in "RC" else 2
        if old_mode != "000000" and new_mode != "000000" and old_mode != new_mode:
            out.append(f"{path}: file mode changed {old_mode} -> {new_mode}")
    for p in _git(worktree, "ls-files", "--others", "--exclude-standard", "-z").split("\0"):
        full = Path(worktree, p)
        if p and full.is_file() and not full.is_symlink() and full.stat().st_mode & 0o111:
            out.append(f"{p}: a new executable file")
    return out


def _materialise_base(repo: Path, base: str, dest: Path) -> Path:
    """The base revision's kernels/ (a `git archive`), for building the base's variants."""
    data = subprocess.run(["git", "archive", "--format=tar", base, "--", "kernels"], cwd=repo, check=True,
                          capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(dest, filter="data")
    return dest


def _hashes(check) -> list[dict]:
    return [{"variant": b.get("variant"), "cubin_sha256": b.get("cubin_sha256"),
             "cubin_code_sha256": b.get("cubin_code_sha256") or b.get("cubin_sha256")}
            for b in check.data.get("built", [])]


def _scope_judgement(repo: Path, base: str, worktree: Path, kernel: str | None, v: Verdict):
    """Scope and policy of the worktree against `base` into `v`; returns the policy decision."""
    from validation.gate import policy_at
    from validation.policy import ELIGIBLE, NO_KERNEL_CHANGE, evaluate_policy
    from validation.scope import ScopeError, compute_scope, open_repo

    head = _git(worktree, "rev-parse", "HEAD").strip()
    if head != base:
        v.reasons.append(f"the worktree's HEAD moved from the base {base[:12]} to {head[:12]}: something "
                         "committed behind the loop's back")
        return None
    try:
        scope = compute_scope(base, None, repo=worktree)
    except ScopeError as e:
        v.reasons.append(f"scope: {e}")
        return None
    v.files = sorted({p for f in scope.files for p in f.paths()})
    v.lines = scope.lines
    if not scope.files:
        v.reasons.append("the change is empty: nothing differs from the base revision")
        return None
    v.reasons += mode_changes(worktree, base)
    decision = evaluate_policy(scope, policy_at(open_repo(worktree), scope.merge_base))
    v.kernels = list(decision.kernels)
    if decision.status == NO_KERNEL_CHANGE:
        v.reasons.append("no kernel change: the change touches none of the kernel's sources")
    elif decision.status != ELIGIBLE:
        v.reasons += ["the gate would route it to full review: " + str(x) for x in decision.violations]
    elif kernel is not None and list(decision.kernels) != [kernel]:
        v.reasons.append(f"the change touches {', '.join(decision.kernels)}, not only {kernel}")
    return decision


def _fingerprint(worktree: Path, files: list[str]) -> dict:
    out = {}
    for f in files:
        p = Path(worktree, f)
        try:
            st = p.lstat()
            out[f] = (st.st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else str(p.readlink())
                      if p.is_symlink() else None)
        except OSError:
            out[f] = None
    return out


def judge_change(repo: Path, base: str, worktree: Path, *, backends, kernel: str | None = None,
                 scratch: Path | None = None, stage=lambda s: None, record=lambda r: r) -> Verdict:
    """Judge the worktree's change against `base` as the gate would (scope, policy, build of every
    variant of every touched kernel, static audit). `kernel`: the one kernel the run may touch.
    `scratch`: a folder for the base checkout (compared for code identity). `record` sees each
    check result (the session logs it). The scope is judged again after the builds: a change
    that a build made (it should not be able to: the sandbox) is refused, never judged stale."""
    worktree = Path(worktree)
    v = Verdict(ok=False)
    decision = _scope_judgement(repo, base, worktree, kernel, v)
    if v.reasons or decision is None:
        return v
    before = _fingerprint(worktree, v.files)

    identical = True
    for k in decision.kernels:
        stage(f"build {k} (every variant, sandboxed)")
        b = record(backends.build(worktree, k, None))
        if b.status != OK:
            v.reasons.append(f"kernel {k}: build {b.status}: {b.summary[:1500]}")
            continue
        v.built[k] = _hashes(b)
        stage(f"static audit of {k}")
        a = record(backends.audit(worktree, k))
        if a.status != OK:
            v.reasons.append(f"kernel {k}: static audit {a.status}: {a.summary[:1500]}")
        if scratch is not None:
            base_tree = scratch / "base"
            if not base_tree.exists():
                _materialise_base(Path(repo), base, base_tree)
            bb = backends.build(base_tree, k, None)
            base_codes = [x["cubin_code_sha256"] for x in _hashes(bb)] if bb.status == OK else None
            if base_codes != [x["cubin_code_sha256"] for x in v.built[k]]:
                identical = False
        else:
            identical = False

    after = Verdict(ok=False)
    _scope_judgement(repo, base, worktree, kernel, after)
    if after.files != v.files or _fingerprint(worktree, after.files) != before:
        v.reasons.append("the worktree changed while it was built (" + ", ".join(
            sorted(set(after.files) ^ set(v.files)) or after.files)[:500] + ")")
    v.reasons += [r for r in after.reasons if r not in v.reasons]
    v.code_identical_to_base = identical and not v.reasons and bool(v.built)
    if v.code_identical_to_base:
        v.notes.append("every variant's cubin code hash equals the base's: the change cannot be faster")
    v.ok = not v.reasons
    return v
