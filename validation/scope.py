"""Change scope from git: which files a change touches, how many lines, and which kernels own them.

`compute_scope(base, head)` diffs the merge base of `base` and `head` against `head` (as a pull
request shows it), or against the working tree when `head` is None, and maps every changed path
through the kernel manifest (`kernels/manifest.toml`, read at both revisions) to the kernels whose
declared `sources` include it, and records each kernel's build closure at `head` (every file its
sources import) so that the policy can see a change to an undeclared import. Renames, deletions, binary files, symlinks and submodules are
reported as such; deciding what they mean is the policy's job (validation/policy.py), not this
module's.

Errors a user can cause (not a git repository, a revision that does not exist, a shallow clone that
lacks the base, a path outside the repository) raise `ScopeError` with one clear message.
`gitpython` is imported lazily so that GPU-host code importing `validation` does not need it.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from kernels.manifest import Manifest, ManifestError, parse_manifest

MANIFEST_RELPATH = "kernels/manifest.toml"

# git's file modes (the first field of `git diff --raw`).
_MODE_KIND = {"100644": "file", "100755": "file", "120000": "symlink", "160000": "submodule"}
_STATUS = {"A": "added", "M": "modified", "D": "deleted", "R": "renamed", "C": "copied",
           "T": "type_changed"}


class ScopeError(Exception):
    """A change scope cannot be computed for a reason the user can fix."""


@dataclass(frozen=True)
class FileChange:
    """One changed path. `path` is the path at head (at base for a deletion)."""

    path: str
    status: str  # added | modified | deleted | renamed | copied | type_changed
    kind: str  # file | symlink | submodule (at head; at base for a deletion)
    old_path: str | None = None  # the base path of a rename or copy
    old_kind: str | None = None  # the kind at base (None when added)
    added: int = 0  # lines; 0 for binary files
    deleted: int = 0
    binary: bool = False
    symlink_target: str | None = None  # for symlinks at head: where the link points
    owners: tuple[str, ...] = ()  # kernels whose declared sources include path or old_path
    # For a modified Python file under tests/: the test functions it adds, when adding them is
    # all the change does (every statement of the base file unchanged, in order); else None.
    added_tests: tuple[str, ...] | None = None

    @property
    def lines(self) -> int:
        return self.added + self.deleted

    def paths(self) -> tuple[str, ...]:
        """Every repo-relative path this change touches (both sides of a rename)."""
        return (self.path,) if not self.old_path or self.old_path == self.path else (
            self.old_path, self.path)


@dataclass(frozen=True)
class ChangeScope:
    """What a change touches. `head` is None for the working tree."""

    base: str  # the revision the user named, resolved to a commit sha
    merge_base: str  # the commit the diff starts from
    head: str | None
    files: tuple[FileChange, ...]
    base_manifest: Manifest | None = None
    head_manifest: Manifest | None = None
    # Why a manifest could not be read or parsed at a side (None when it parsed or is absent).
    manifest_errors: dict = field(default_factory=dict)
    shallow: bool = False
    # Kernel -> every repo file its build compiles at head (kernels.build.source_closure: the
    # declared sources plus what they import), so that a change to a file a kernel imports without
    # declaring it is seen as a change to that kernel.
    closures: dict = field(default_factory=dict)
    base_closures: dict = field(default_factory=dict)  # the same at the merge base
    # Kernel -> how its code compares between the merge base and head (`compare_code`): None until
    # compared (the policy then falls back to declared-source ownership).
    code: dict | None = None

    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.files)

    def kernels(self) -> dict[str, list[str]]:
        """Kernel name -> the changed paths it owns."""
        out: dict[str, list[str]] = {}
        for f in self.files:
            for k in f.owners:
                out.setdefault(k, []).append(f.path)
        return out

    def file(self, path: str) -> FileChange | None:
        return next((f for f in self.files if path in f.paths()), None)

    def to_dict(self) -> dict:
        return {
            "base": self.base,
            "merge_base": self.merge_base,
            "head": self.head,
            "working_tree": self.head is None,
            "lines": self.lines,
            "kernels": self.kernels(),
            "files": [asdict(f) for f in self.files],
            "manifest_errors": dict(self.manifest_errors),
            "closures": {k: list(v) for k, v in sorted(self.closures.items())},
            "code": None if self.code is None else {
                k: {x: y for x, y in c.items() if x != "head"} for k, c in sorted(self.code.items())},
        }

    def code_changed(self) -> list[str]:
        """Kernels whose code differs between base and head (status other than "same")."""
        return sorted(k for k, c in (self.code or {}).items() if c.get("status") != "same")


# -- repository and revisions ------------------------------------------------------------------

def open_repo(path: str | os.PathLike = "."):
    """The git repository containing `path` (a `git.Repo`); ScopeError if there is none."""
    import git

    p = Path(path)
    if not p.exists():
        raise ScopeError(f"{path}: no such directory")
    try:
        repo = git.Repo(p, search_parent_directories=True)
    except git.InvalidGitRepositoryError:
        raise ScopeError(f"{path} is not inside a git repository") from None
    except git.NoSuchPathError:
        raise ScopeError(f"{path}: no such directory") from None
    if repo.bare:
        raise ScopeError(f"{path} is a bare repository: the gate needs a checkout")
    return repo


def is_shallow(repo) -> bool:
    return repo.git.rev_parse("--is-shallow-repository").strip() == "true"


def resolve_commit(repo, rev: str) -> str:
    """The full sha of commit `rev`; ScopeError naming the revision (and a shallow clone) otherwise."""
    import git

    if not rev or rev.startswith("-"):
        raise ScopeError(f"{rev!r} is not a revision")
    try:
        return repo.git.rev_parse("--verify", "--end-of-options", f"{rev}^{{commit}}").strip()
    except git.GitCommandError:
        if is_shallow(repo):
            raise ScopeError(
                f"revision {rev!r} is not in this shallow clone; fetch the history it needs "
                "(git fetch --unshallow, or actions/checkout with fetch-depth: 0)"
            ) from None
        raise ScopeError(f"revision {rev!r} does not name a commit in this repository") from None


def merge_base(repo, base_sha: str, head_sha: str) -> str:
    """The merge base of two commits; ScopeError when the history between them is missing."""
    import git

    try:
        out = repo.git.merge_base(base_sha, head_sha).strip()
    except git.GitCommandError:
        out = ""
    if not out:
        if is_shallow(repo):
            raise ScopeError(
                f"this shallow clone lacks the history between base {base_sha[:12]} and head "
                f"{head_sha[:12]}; fetch it (git fetch --unshallow, or fetch-depth: 0)"
            )
        raise ScopeError(f"base {base_sha[:12]} and head {head_sha[:12]} share no history")
    return out


def repo_relative(repo, path: str | os.PathLike) -> str:
    """`path` (absolute or relative to the current directory) as a repo-relative POSIX path.

    ScopeError if it lies outside the repository's work tree.
    """
    root = Path(repo.working_tree_dir).resolve()
    p = Path(path)
    full = (p if p.is_absolute() else Path.cwd() / p).resolve()
    try:
        return full.relative_to(root).as_posix()
    except ValueError:
        raise ScopeError(f"{path} is outside the repository") from None


def read_at(repo, rev: str | None, relpath: str) -> bytes | None:
    """The bytes of `relpath` at commit `rev` (the working tree when None); None if absent."""
    if rev is None:
        p = Path(repo.working_tree_dir, relpath)
        try:
            return p.read_bytes() if p.is_file() else None
        except OSError:
            return None
    try:
        blob = repo.commit(rev).tree / relpath
    except KeyError:
        return None
    if blob.type != "blob":
        return None
    return blob.data_stream.read()


def list_at(repo, rev: str | None, prefix: str) -> list[str]:
    """Repo-relative paths of the files under folder `prefix` at `rev` (working tree: tracked +
    untracked, ignoring ignored files)."""
    if rev is None:
        out = repo.git.ls_files("-z", "--cached", "--others", "--exclude-standard", "--", prefix)
    else:
        out = repo.git.ls_tree("-r", "-z", "--name-only", rev, "--", prefix)
    return sorted({p for p in out.split("\0") if p})


# -- the diff ----------------------------------------------------------------------------------

def _parse_raw(text: str) -> list[dict]:
    """Parse `git diff --raw -z` output."""
    toks = text.split("\0")
    out = []
    i = 0
    while i < len(toks):
        head = toks[i]
        if not head:
            i += 1
            continue
        if not head.startswith(":"):
            raise ScopeError(f"unexpected git diff output near {head[:40]!r}")
        old_mode, new_mode, _old_sha, _new_sha, status = head[1:].split(" ")
        letter = status[0]
        if letter in "RC":
            old_path, path = toks[i + 1], toks[i + 2]
            i += 3
        else:
            old_path, path = None, toks[i + 1]
            i += 2
        out.append({"status": letter, "old_mode": old_mode, "new_mode": new_mode,
                    "old_path": old_path, "path": path})
    return out


def _parse_numstat(text: str) -> dict[str, tuple[int, int, bool]]:
    """Parse `git diff --numstat -z` output: head path -> (added, deleted, binary)."""
    toks = text.split("\0")
    out = {}
    i = 0
    while i < len(toks):
        t = toks[i]
        if not t:
            i += 1
            continue
        added, deleted, path = t.split("\t", 2)
        if path == "":  # a rename or copy: the old and new paths follow
            path = toks[i + 2]
            i += 3
        else:
            i += 1
        binary = added == "-"
        out[path] = (0 if binary else int(added), 0 if binary else int(deleted), binary)
    return out


def _kind(mode: str) -> str | None:
    if mode == "000000":
        return None
    return _MODE_KIND.get(mode, "file")


def _count_lines(data: bytes) -> tuple[int, bool]:
    """(lines, binary) of an untracked file, judged the way git judges (a NUL in the first 8000 bytes)."""
    if b"\0" in data[:8000]:
        return 0, True
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0), False


def _load_manifest(repo, rev: str | None, side: str, errors: dict) -> Manifest | None:
    data = read_at(repo, rev, MANIFEST_RELPATH)
    if data is None:
        return None
    try:
        return parse_manifest(data.decode("utf-8"), Path(MANIFEST_RELPATH))
    except (ManifestError, UnicodeDecodeError) as e:
        errors[side] = str(e)
        return None


def compute_scope(base: str, head: str | None = None, *, repo: str | os.PathLike = ".",
                  closures: bool = True) -> ChangeScope:
    """The scope of the change from `base` to `head` (the working tree when `head` is None).

    The diff starts at the merge base of the two (a pull request's diff), detects renames, and
    includes untracked, non-ignored files when diffing the working tree. Every file is mapped to
    the kernels whose manifest `sources` (at base or at head) include its path or its old path.
    Raises ScopeError for a missing repository or revision, or history a shallow clone lacks.
    `closures=False` leaves the kernels' build closures out (`with_closures` adds them): the
    rules that need no closure can answer first.
    """
    r = open_repo(repo)
    shallow = is_shallow(r)
    base_sha = resolve_commit(r, base)
    head_sha = resolve_commit(r, head) if head is not None else None
    mb = merge_base(r, base_sha, head_sha or resolve_commit(r, "HEAD"))

    # Explicit options so that repository config cannot change what is counted.
    opts = ["-z", "-M", "--no-ext-diff", "--no-textconv", "--ignore-submodules=none", "--no-color"]
    revs = [mb, head_sha] if head_sha else [mb]
    raw = _parse_raw(r.git.diff("--raw", "--no-abbrev", *opts, *revs))
    nums = _parse_numstat(r.git.diff("--numstat", *opts, *revs))

    errors: dict = {}
    base_m = _load_manifest(r, mb, "base", errors)
    head_m = _load_manifest(r, head_sha, "head", errors)

    def owners(*paths: str | None) -> tuple[str, ...]:
        names: set[str] = set()
        for m in (base_m, head_m):
            if m is None:
                continue
            for p in paths:
                if p:
                    names.update(m.owners_of(p))
        return tuple(sorted(names))

    def link_target(path: str) -> str | None:
        if head_sha is None:
            try:
                return os.readlink(Path(r.working_tree_dir, path))
            except OSError:
                return None
        data = read_at(r, head_sha, path)
        return data.decode("utf-8", "replace") if data is not None else None

    files = []
    for e in raw:
        letter = e["status"]
        old_kind, new_kind = _kind(e["old_mode"]), _kind(e["new_mode"])
        path = e["path"]
        added, deleted, binary = nums.get(path, (0, 0, False))
        kind = new_kind or old_kind or "file"
        files.append(FileChange(
            path=path,
            status=_STATUS.get(letter, "modified"),
            kind=kind,
            old_path=e["old_path"],
            old_kind=old_kind,
            added=added,
            deleted=deleted,
            binary=binary,
            symlink_target=link_target(path) if new_kind == "symlink" else None,
            owners=owners(path, e["old_path"]),
        ))

    if head_sha is None:
        for path in r.untracked_files:
            full = Path(r.working_tree_dir, path)
            if full.is_symlink():
                files.append(FileChange(path=path, status="added", kind="symlink", added=1,
                                        symlink_target=os.readlink(full), owners=owners(path)))
                continue
            try:
                lines, binary = _count_lines(full.read_bytes())
            except OSError as ex:
                raise ScopeError(f"cannot read untracked file {path}: {ex.strerror}") from None
            files.append(FileChange(path=path, status="added", kind="file", added=lines,
                                    binary=binary, owners=owners(path)))

    for i, f in enumerate(files):
        if f.status == "modified" and f.kind == "file" and f.path.startswith("tests/") and f.path.endswith(".py"):
            old, new = read_at(r, mb, f.path), read_at(r, head_sha, f.path)
            if old is not None and new is not None:
                files[i] = dataclasses.replace(f, added_tests=test_additions(old, new))

    files.sort(key=lambda f: f.path)
    scope = ChangeScope(
        base=base_sha, merge_base=mb, head=head_sha, files=tuple(files),
        base_manifest=base_m, head_manifest=head_m, manifest_errors=errors, shallow=shallow,
    )
    return with_closures(scope, r) if closures else scope


def with_closures(scope: ChangeScope, repo) -> ChangeScope:
    """`scope` with every kernel's build closure at head and at the merge base."""
    r = repo if hasattr(repo, "git") else open_repo(repo)
    return dataclasses.replace(scope, closures=kernel_closures(r, scope.head, scope.head_manifest),
                               base_closures=kernel_closures(r, scope.merge_base, scope.base_manifest))


def test_additions(base: bytes, head: bytes) -> tuple[str, ...] | None:
    """The names of the test functions `head` adds to Python module `base`, when that is all it
    does: every top-level statement of `base` is in `head`, unchanged (as parsed: comments and
    blank lines aside) and in order, and every other statement of `head` is a new top-level
    `def test_*` (decorated or not) whose name `base` does not use. None otherwise (an edited
    assertion, a new import or fixture, a changed helper, a file that does not parse)."""
    import ast

    try:
        old, new = ast.parse(base), ast.parse(head)
    except (SyntaxError, ValueError):
        return None
    old_names = {n.name for n in ast.walk(old) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    old_names |= {t.id for n in ast.walk(old) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    want = [ast.dump(n) for n in old.body]
    added: list[str] = []
    kept: list[str] = []
    for n in new.body:
        d = ast.dump(n)
        if len(kept) < len(want) and d == want[len(kept)]:
            kept.append(d)
        elif (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
              and n.name not in old_names and n.name not in added):
            added.append(n.name)
        else:
            return None
    if kept != want or not added:
        return None
    return tuple(added)


# -- code: what each kernel's rebuilt cubins say -------------------------------------------------

def code_candidates(scope: ChangeScope) -> list[str]:
    """Kernels (declared at both sides) whose build closure, at base or at head, holds a changed
    path, or whose manifest entry differs: the kernels whose code the change may have changed."""
    bm, hm = scope.base_manifest, scope.head_manifest
    if bm is None or hm is None:
        return []
    changed = {p for f in scope.files for p in f.paths()}
    out = set()
    for closures in (scope.closures, scope.base_closures):
        out.update(k for k, cl in closures.items() if changed & set(cl))
    out.update(k for k in set(bm.kernels) & set(hm.kernels) if bm.kernels[k] != hm.kernels[k])
    # A kernel whose closure cannot be computed at a side (a declared source missing) is built,
    # and its build says why it fails.
    for k in set(bm.kernels) & set(hm.kernels):
        if k not in scope.closures or k not in scope.base_closures:
            if changed & (set(bm.kernels[k].sources) | set(hm.kernels[k].sources)):
                out.add(k)
    return sorted(k for k in out if k in bm.kernels and k in hm.kernels)


def export_tree(repo, rev: str, dest: Path) -> Path:
    """Write the Python files of commit `rev` under `dest` (what a kernel build can import)."""
    for item in repo.commit(rev).tree.traverse():
        if item.type == "blob" and item.path.endswith(".py") and item.mode != 0o120000:
            p = Path(dest, item.path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(item.data_stream.read())
    return Path(dest)


def compare_code(scope: ChangeScope, *, repo: str | os.PathLike = ".", root: Path | None = None,
                 build=None, executor=None, jobs: int | None = None, progress=None,
                 kernels: list[str] | None = None, sandbox=None) -> ChangeScope:
    """`scope` with `code` filled: for every kernel of `code_candidates` (or `kernels`), every
    manifest variant built at the merge base and at head (at the tunables it ships with on each
    side: kernels.block.shipped_tunables, the defaults under that side's block plan) and
    compared by cubin code hash (kernels/cubin.py: every ELF section but the line tables).

    code[kernel] = {status, variants, changed, errors, head}: status "same" (every variant's code
    equal), "changed" (some differ, or the variant sets differ), or "build_failed" (a head variant
    does not build: its error in `errors`); `changed` names the differing variants; `head` holds
    the head artifacts (what the gate binds and audits). A base variant that does not build counts
    as changed. `build(requests) -> results` is `kernels.build.build_requests` by default (the
    shared cache `root`, the executor, each compile child inside `sandbox`, a
    kernels.sandbox.Sandbox, when given: the head's sources are untrusted code); tests pass fakes.
    """
    from kernels import build as kb

    r = open_repo(repo)
    names = code_candidates(scope) if kernels is None else list(kernels)
    if not names:
        return dataclasses.replace(scope, code={})
    root = Path(root) if root is not None else Path(r.working_tree_dir) / "build"
    if build is None:
        def build(reqs):
            return kb.build_requests(reqs, root=root, executor=executor, jobs=jobs, progress=progress,
                                     sandbox=sandbox)
    # The exports live for the process (exported_tree): the closures read the same ones.
    trees = {"base": exported_tree(r, scope.merge_base),
             "head": exported_tree(r, scope.head) if scope.head else Path(r.working_tree_dir)}
    # Each variant at the tunables it ships with (the manifest defaults over which each side's
    # block plan sets its per-batch choices; a base that declares no plan: head's choices).
    from kernels.block import shipped_tunables

    plans = {"base": plan_at(r, scope.merge_base), "head": plan_at(r, scope.head)}
    plans["base"] = plans["base"] if plans["base"] is not None else plans["head"]
    reqs, where = [], []
    for k in names:
        for side, man in (("base", scope.base_manifest), ("head", scope.head_manifest)):
            spec = man.kernels[k]
            for shape in spec.shapes:
                reqs.append(kb.BuildRequest(spec, dict(shape), shipped_tunables(spec, shape, plans[side] or {}),
                                            trees[side]))
                where.append((k, side, _canon_shape(shape)))
    results = build(reqs)
    per: dict[str, dict] = {k: {"base": {}, "head": {}, "errors": []} for k in names}
    for (k, side, label), res in zip(where, results):
        if isinstance(res, Exception):
            per[k]["errors"].append(f"{side}: {res}")
            per[k][side][label] = None
        else:
            per[k][side][label] = res
    code = {}
    for k in names:
        b, h = per[k]["base"], per[k]["head"]
        head_failed = any(v is None for v in h.values())
        changed = sorted(lbl for lbl in set(b) | set(h)
                         if b.get(lbl) is None or h.get(lbl) is None
                         or b[lbl].cubin_code_sha256 != h[lbl].cubin_code_sha256)
        status = "build_failed" if head_failed else "changed" if changed else "same"
        code[k] = {"status": status, "variants": len(h), "changed": changed,
                   "errors": [e for e in per[k]["errors"] if e.startswith("head")] or per[k]["errors"],
                   "line_tables_only": sum(1 for lbl in h if lbl not in changed and b.get(lbl) is not None
                                           and b[lbl].cubin_sha256 != h[lbl].cubin_sha256),
                   "head": [x for x in h.values() if x is not None]}
    return dataclasses.replace(scope, code=code)


def _canon_shape(shape: dict) -> str:
    import json

    return json.dumps(shape, sort_keys=True, separators=(",", ":"))


def kernel_closures(repo, rev: str | None, manifest: Manifest | None) -> dict[str, tuple[str, ...]]:
    """Kernel -> the repo-relative files its build compiles at `rev` (the working tree when None):
    `kernels.build.source_closure`, computed over the Python files of that revision. A kernel whose
    closure cannot be computed (a declared source missing) is left out: the policy or the build
    reports that on its own."""
    if manifest is None:
        return {}
    from kernels.build import BuildError, source_closure

    def closures(root: Path) -> dict[str, tuple[str, ...]]:
        out = {}
        for name, spec in sorted(manifest.kernels.items()):
            try:
                out[name] = tuple(source_closure(spec, root))
            except (BuildError, OSError, ValueError):
                continue
        return out

    if rev is None:
        return closures(Path(repo.working_tree_dir))
    return closures(exported_tree(repo, rev))


_EXPORTS: dict = {}


def plan_at(repo, rev: str | None) -> dict | None:
    """The block plan (kernels/block_plan.toml) of commit `rev`, of the working tree when `rev`
    is None; None where that revision declares none or one of a format this checkout cannot read
    (its per-batch choices then come from the other side)."""
    from kernels.block import BlockPlanError, parse_block_plan

    rel = "kernels/block_plan.toml"
    try:
        text = (Path(repo.working_tree_dir, rel).read_text() if rev is None
                else repo.git.show(f"{repo.commit(rev).hexsha}:{rel}"))
    except Exception:  # noqa: BLE001 - absent at that revision (git or OS error)
        return None
    try:
        return parse_block_plan(text, f"{rel} at {rev[:12] if rev else 'the working tree'}")
    except BlockPlanError:
        return None


def exported_tree(repo, rev: str) -> Path:
    """The Python files of commit `rev`, exported once per process into a temporary folder
    (removed at exit): the closures and the base and head builds read the same export."""
    key = (str(Path(repo.git_dir).resolve()), repo.commit(rev).hexsha)
    if key not in _EXPORTS:
        import atexit
        import shutil
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="fasttrack-tree-"))
        atexit.register(shutil.rmtree, d, True)
        _EXPORTS[key] = export_tree(repo, key[1], d)
    return _EXPORTS[key]


def symlink_escapes(path: str, target: str) -> bool:
    """Whether a symlink at repo-relative `path` pointing at `target` leaves the repository."""
    if target.startswith("/"):
        return True
    parts: list[str] = list(PurePosixPath(path).parent.parts)
    for part in PurePosixPath(target).parts:
        if part == "..":
            if not parts:
                return True
            parts.pop()
        elif part != ".":
            parts.append(part)
    return False


def symlink_resolved(path: str, target: str) -> str | None:
    """The repo-relative path a symlink points at, or None when it leaves the repository."""
    if symlink_escapes(path, target):
        return None
    parts: list[str] = list(PurePosixPath(path).parent.parts)
    for part in PurePosixPath(target).parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)
