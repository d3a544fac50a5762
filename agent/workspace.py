"""The isolated place a proposal is written in, and the fence around what it may touch.

`create_worktree` makes a git worktree on a new branch from a base revision, so the proposer never
edits the user's checkout. `KernelScope` decides which paths a proposer may read (files of the
worktree, never `.git`, never through a symlink) and edit (exactly the kernel's declared sources);
every refusal carries the reason, which the loop sends back to the model.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from validation.atomic import write_text_atomic


class WorkspaceError(Exception):
    """The worktree cannot be made or committed (bad revision, not a git repository, ...)."""


class ScopeViolation(Exception):
    """A path the proposer may not read or edit; the message says why."""


@dataclass(frozen=True)
class Worktree:
    repo_root: Path  # the user's repository
    path: Path  # the isolated worktree
    branch: str
    base_sha: str


def _git():
    import git  # gitpython; imported lazily (the GPU host has none)

    return git


# Git hooks never run for the loop's git commands: a hook is code outside any sandbox, run with
# this process's environment. GIT_CONFIG_* is git's documented way to set config per command.
NO_HOOKS_ENV = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.hooksPath", "GIT_CONFIG_VALUE_0": "/dev/null"}


def _no_hooks(repo) -> None:
    repo.git.update_environment(**NO_HOOKS_ENV)


def create_worktree(repo_root: Path, path: Path, branch: str, base: str = "HEAD") -> Worktree:
    """Add a worktree at `path` on a new `branch` starting at `base`; clear errors otherwise."""
    git = _git()
    try:
        repo = git.Repo(repo_root, search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise WorkspaceError(f"{repo_root} is not a git repository") from None
    try:
        base_sha = repo.commit(base).hexsha
    except (git.BadName, ValueError, git.GitCommandError):
        raise WorkspaceError(f"unknown base revision {base!r}") from None
    if branch in [h.name for h in repo.heads]:
        raise WorkspaceError(f"branch {branch!r} already exists")
    if Path(path).exists():
        raise WorkspaceError(f"worktree path {path} already exists")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        _no_hooks(repo)
        repo.git.worktree("add", "-b", branch, str(path), base_sha)
    except git.GitCommandError as e:
        raise WorkspaceError(f"git worktree add failed: {e.stderr.strip() or e}") from None
    return Worktree(Path(repo_root).resolve(), Path(path).resolve(), branch, base_sha)


_BRANCH_SAFE = re.compile(r"[^A-Za-z0-9._/-]+")


def branch_name(kernel: str, run_id: str) -> str:
    return _BRANCH_SAFE.sub("-", f"propose/{kernel}/{run_id}")


def changed_files(worktree: Path) -> list[str]:
    """Repo-relative paths that differ from HEAD in the worktree (modified, added, deleted, untracked)."""
    git = _git()
    repo = git.Repo(worktree)
    out = repo.git.status("--porcelain=v1", "-z", "--untracked-files=all")
    paths = []
    entries = out.split("\0")
    i = 0
    while i < len(entries):
        e = entries[i]
        i += 1
        if not e:
            continue
        code, p = e[:2], e[3:]
        if code[0] in "RC":  # a rename carries its source path next
            i += 1
        paths.append(p)
    return sorted(paths)


def diff_text(worktree: Path, paths: list[str] | None = None) -> str:
    """Unified diff of the worktree against HEAD (tracked files)."""
    repo = _git().Repo(worktree)
    args = ["HEAD", "--"] + (list(paths) if paths else [])
    return repo.git.diff(*args)


def diff_numstat(worktree: Path) -> dict[str, tuple[int, int]]:
    """{path: (added, deleted)} lines against HEAD."""
    repo = _git().Repo(worktree)
    stats = {}
    for line in repo.git.diff("HEAD", "--numstat").splitlines():
        a, d, p = line.split("\t", 2)
        stats[p] = (int(a) if a.isdigit() else 0, int(d) if d.isdigit() else 0)
    return stats


def commit(worktree: Path, paths: list[str], message: str) -> str:
    """Commit exactly `paths` in the worktree; returns the new commit sha.

    Uses the repository's configured identity, or a neutral agent identity when none is set.
    """
    git = _git()
    repo = git.Repo(worktree)
    _no_hooks(repo)
    reader = repo.config_reader()
    name = reader.get_value("user", "name", "") or "fasttrack agent"
    email = reader.get_value("user", "email", "") or "agent@fasttrack.invalid"
    actor = git.Actor(str(name), str(email))
    to_add = [p for p in paths if (Path(worktree) / p).exists()]
    to_remove = [p for p in paths if not (Path(worktree) / p).exists()]
    if to_add:
        repo.git.add("--", *to_add)
    if to_remove:
        repo.git.rm("--cached", "--quiet", "--", *to_remove)
    # skip_hooks: GitPython runs pre-commit/commit-msg hooks itself unless told not to.
    c = repo.index.commit(message, author=actor, committer=actor, skip_hooks=True)
    return c.hexsha


def remove_worktree(wt: Worktree, *, delete_branch: bool = False) -> None:
    git = _git()
    repo = git.Repo(wt.repo_root)
    _no_hooks(repo)
    if Path(wt.path).exists():
        repo.git.worktree("remove", "--force", str(wt.path))
    repo.git.worktree("prune")
    if delete_branch and wt.branch in [h.name for h in repo.heads]:
        repo.git.branch("-D", wt.branch)


class KernelScope:
    """What a proposer may read and edit inside `root`.

    Reading: any regular file under `root` except `.git`, reached without symlinks.
    Editing: only the repo-relative paths in `editable` (a kernel's declared sources).
    """

    def __init__(self, root: Path, editable: tuple[str, ...] | list[str]):
        self.root = Path(root).resolve()
        self.editable = tuple(str(PurePosixPath(p)) for p in editable)

    def _relative(self, path: str) -> PurePosixPath:
        if not isinstance(path, str) or not path.strip():
            raise ScopeViolation("no path given")
        if "\0" in path:
            raise ScopeViolation("path contains a NUL byte")
        p = PurePosixPath(path.strip().replace("\\", "/"))
        if p.is_absolute():
            raise ScopeViolation(
                f"{path!r} is absolute; give a path relative to the repository root"
            )
        if ".." in p.parts:
            raise ScopeViolation(f"{path!r} contains '..'; paths may not leave the repository")
        parts = [x for x in p.parts if x != "."]
        if not parts:
            raise ScopeViolation(f"{path!r} names the repository root, not a file")
        if parts[0] == ".git":
            raise ScopeViolation(f"{path!r} is inside .git, which is not part of the kernel")
        return PurePosixPath(*parts)

    def _walk_no_symlinks(self, rel: PurePosixPath, *, must_exist: bool) -> Path:
        cur = self.root
        for part in rel.parts:
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                if must_exist:
                    raise ScopeViolation(f"{rel} does not exist") from None
                return self.root / rel
            if stat.S_ISLNK(st.st_mode):
                raise ScopeViolation(
                    f"{rel} goes through a symlink ({cur.relative_to(self.root)}); symlinks are refused"
                )
        real = Path(os.path.realpath(cur))
        if real != self.root and self.root not in real.parents:
            raise ScopeViolation(f"{rel} resolves outside the repository")
        return cur

    def readable(self, path: str) -> Path:
        """The absolute path of a file the proposer may read; ScopeViolation otherwise."""
        rel = self._relative(path)
        p = self._walk_no_symlinks(rel, must_exist=True)
        if p.is_dir():
            raise ScopeViolation(f"{rel} is a directory; name a file")
        if not p.is_file():
            raise ScopeViolation(f"{rel} is not a regular file")
        return p

    def editable_path(self, path: str) -> tuple[Path, str]:
        """(absolute path, repo-relative name) of a declared source; ScopeViolation otherwise."""
        rel = self._relative(path)
        name = str(rel)
        if name not in self.editable:
            raise ScopeViolation(
                f"{name} is outside this change's scope: only the kernel's declared sources may be "
                f"edited ({', '.join(self.editable)})"
            )
        p = self._walk_no_symlinks(rel, must_exist=True)
        if not p.is_file():
            raise ScopeViolation(f"{name} is not a regular file")
        return p, name


def write_file_atomic(path: Path, text: str) -> None:
    """Replace a file's text through a temporary file in the same folder, keeping its mode."""
    path = Path(path)
    mode = stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o644
    write_text_atomic(path, text, mode=mode)
