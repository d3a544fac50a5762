"""Change scope from real temporary git repositories, and the policy's decision on it."""

from __future__ import annotations

import os

import pytest

from gate_fixtures import commit, edit_lines, git, make_repo, shallow_clone, write
from validation.policy import (ELIGIBLE, FULL_REVIEW, NO_KERNEL_CHANGE, PolicyError, evaluate_policy,
                               glob_match, load_policy, parse_policy)
from validation.scope import ScopeError, compute_scope, open_repo, repo_relative, symlink_escapes


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    base = make_repo(root)
    return root, base


def rules(decision) -> set[str]:
    return {v.rule for v in decision.violations}


def test_one_kernel_change_is_mapped_and_eligible(repo):
    root, base = repo
    edit_lines(root, "kernels/ops/alpha.py", 3)
    head = commit(root, "tune alpha")
    scope = compute_scope(base, head, repo=root)
    assert [(f.path, f.status, f.added, f.deleted, f.owners) for f in scope.files] == [
        ("kernels/ops/alpha.py", "modified", 3, 3, ("alpha",))]
    assert scope.kernels() == {"alpha": ["kernels/ops/alpha.py"]}
    d = evaluate_policy(scope, load_policy())
    assert d.status == ELIGIBLE and d.kernel == "alpha" and d.counted_lines == 6


def test_working_tree_includes_untracked_files(repo):
    root, base = repo
    edit_lines(root, "kernels/ops/alpha.py", 1)
    write(root, "notes.md", "a\nb\n")
    scope = compute_scope(base, None, repo=root)
    assert scope.head is None
    assert {f.path: f.lines for f in scope.files} == {"kernels/ops/alpha.py": 2, "notes.md": 2}


def test_diff_starts_at_the_merge_base(repo):
    # The base branch moved on after the change branched: its commits are not the change's.
    root, base = repo
    git(root, "checkout", "-q", "-b", "feature")
    edit_lines(root, "kernels/ops/alpha.py", 1)
    head = commit(root, "change")
    git(root, "checkout", "-q", "main")
    write(root, "validation/numerics.py", "TOLERANCE = 1.0\n")
    main_tip = commit(root, "unrelated change on main")
    scope = compute_scope(main_tip, head, repo=root)
    assert scope.merge_base == base
    assert [f.path for f in scope.files] == ["kernels/ops/alpha.py"]


def test_rename_deletion_binary_symlink_submodule(repo, tmp_path):
    root, base = repo
    git(root, "mv", "kernels/ops/beta.py", "kernels/ops/gamma.py")
    os.remove(root / "README.md")
    write(root, "evidence_reports/x/plot.png", b"\x89PNG\x00\x01\x02")
    os.symlink("../../../etc/passwd", root / "kernels/ops/leak.py")
    sub = tmp_path / "sub"
    make_repo(sub)
    git(root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "third_party/sub")
    head = commit(root, "many kinds")
    scope = compute_scope(base, head, repo=root)
    by_path = {f.path: f for f in scope.files}
    ren = by_path["kernels/ops/gamma.py"]
    assert (ren.status, ren.old_path, ren.owners) == ("renamed", "kernels/ops/beta.py", ("beta",))
    assert by_path["README.md"].status == "deleted"
    assert by_path["evidence_reports/x/plot.png"].binary
    link = by_path["kernels/ops/leak.py"]
    assert link.kind == "symlink" and link.symlink_target == "../../../etc/passwd"
    assert by_path["third_party/sub"].kind == "submodule"

    d = evaluate_policy(scope, load_policy())
    assert d.status == FULL_REVIEW
    why = {(v.rule, v.path) for v in d.violations}
    assert ("source-moved", "kernels/ops/gamma.py") in why
    assert ("symlink", "kernels/ops/leak.py") in why
    assert ("submodule", "third_party/sub") in why
    assert ("protected-path", ".gitmodules") in why
    leak = next(v for v in d.violations if v.rule == "symlink")
    assert "outside the repository" in leak.why


def test_binary_kernel_source_and_deleted_source_need_full_review(repo):
    root, base = repo
    write(root, "kernels/ops/alpha.py", b"\x00\x01binary")
    os.remove(root / "kernels/ops/beta.py")
    head = commit(root, "binary and delete")
    d = evaluate_policy(compute_scope(base, head, repo=root), load_policy())
    assert {("binary", "kernels/ops/alpha.py"), ("source-deleted", "kernels/ops/beta.py")} <= {
        (v.rule, v.path) for v in d.violations}


def test_nonexistent_revision(repo):
    root, base = repo
    with pytest.raises(ScopeError, match="'no-such-rev' does not name a commit"):
        compute_scope("no-such-rev", base, repo=root)
    with pytest.raises(ScopeError, match="is not a revision"):
        compute_scope("--output=/tmp/x", base, repo=root)


def test_shallow_clone_missing_the_base(repo, tmp_path):
    root, base = repo
    edit_lines(root, "kernels/ops/alpha.py", 1)
    head = commit(root, "change")
    clone = tmp_path / "clone"
    shallow_clone(root, clone)
    with pytest.raises(ScopeError, match="shallow clone"):
        compute_scope(base, head, repo=clone)


def test_not_a_repository_and_paths_outside(repo, tmp_path):
    root, _ = repo
    outside = tmp_path / "plain"
    outside.mkdir()
    with pytest.raises(ScopeError, match="not inside a git repository"):
        open_repo(outside)
    with pytest.raises(ScopeError, match="no such directory"):
        open_repo(tmp_path / "missing")
    r = open_repo(root / "kernels")  # a subfolder finds its repository
    assert repo_relative(r, root / "kernels/ops/alpha.py") == "kernels/ops/alpha.py"
    with pytest.raises(ScopeError, match="outside the repository"):
        repo_relative(r, outside)
    assert symlink_escapes("kernels/ops/a.py", "../../../x")
    assert not symlink_escapes("kernels/ops/a.py", "../base.py")
    assert symlink_escapes("a.py", "/etc/passwd")


def test_manifest_compared_as_data(repo):
    root, base = repo
    text = (root / "kernels/manifest.toml").read_text()
    # A tunable default of one kernel: that kernel's own change.
    write(root, "kernels/manifest.toml", text.replace("default = 128", "default = 256"))
    h1 = commit(root, "default")
    d = evaluate_policy(compute_scope(base, h1, repo=root), load_policy())
    assert d.status == ELIGIBLE and d.kernel == "alpha"
    # A comment only: no semantic change, nothing touched.
    git(root, "reset", "-q", "--hard", base)
    write(root, "kernels/manifest.toml", "# a comment\n" + text)
    h2 = commit(root, "comment")
    d = evaluate_policy(compute_scope(base, h2, repo=root), load_policy())
    assert d.status == NO_KERNEL_CHANGE and d.notes
    # New choices for a tunable: that kernel's own change, recorded for the evidence to cover.
    git(root, "reset", "-q", "--hard", base)
    write(root, "kernels/manifest.toml", text.replace("choices = [128, 256]", "choices = [128, 256, 1024]"))
    h5 = commit(root, "widened")
    d = evaluate_policy(compute_scope(base, h5, repo=root), load_policy())
    assert d.status == ELIGIBLE and d.kernel == "alpha" and d.new_choices == {"alpha": {"threads": [1024]}}
    # Choices narrowed, reference swapped, a tolerance added, a kernel added.
    git(root, "reset", "-q", "--hard", base)
    changed = (text.replace("choices = [128, 256]", "choices = [128]")
               .replace("kernels.reference:beta", "kernels.reference:alpha")
               .replace('[kernels.beta.shapes]', 'tolerance = 0.5\n[kernels.beta.shapes]')
               + '\n[kernels.gamma]\nop = "a:B"\nreference = "a:c"\nsources = []\nparams = []\n'
                 '[kernels.gamma.shapes]\nbatch = [1]\n')
    write(root, "kernels/manifest.toml", changed)
    h3 = commit(root, "many")
    d = evaluate_policy(compute_scope(base, h3, repo=root), load_policy())
    assert {"manifest-tunable-range", "manifest-reference", "manifest-tolerances",
            "manifest-kernels"} <= rules(d)
    # A manifest that no longer parses.
    git(root, "reset", "-q", "--hard", base)
    write(root, "kernels/manifest.toml", text + "\n[kernels.broken\n")
    h4 = commit(root, "broken")
    d = evaluate_policy(compute_scope(base, h4, repo=root), load_policy())
    assert rules(d) == {"manifest-parse"}


def test_buffer_role_change_needs_full_review(repo):
    root, base = repo
    text = (root / "kernels/manifest.toml").read_text()
    write(root, "kernels/manifest.toml",
          text.replace('{ name = "x", role = "activation" },\n  { name = "w", role = "static" }',
                       '{ name = "x", role = "static" },\n  { name = "w", role = "static" }', 1))
    edit_lines(root, "kernels/ops/alpha.py", 1)
    head = commit(root, "x is static now")
    d = evaluate_policy(compute_scope(base, head, repo=root), load_policy())
    assert d.status == FULL_REVIEW
    roles = [v for v in d.violations if v.rule == "manifest-roles"]
    assert roles and "x:activation/in" in roles[0].why and "x:static/in" in roles[0].why


def test_glob_and_policy_file():
    assert glob_match("validation/**", "validation/race/x.py")
    assert glob_match("**/rfc.toml", "rfc.toml") and glob_match("**/rfc.toml", "a/b/rfc.toml")
    assert not glob_match("tests/test_agent_*.py", "tests/sub/test_agent_x.py")
    assert not glob_match("kernels/reference.py", "kernels/reference.pyc")
    p = load_policy()
    assert p.protection("validation/gate.py") and p.protection("tests/test_gemv.py")
    assert p.protection("tests/test_agent_loop.py") is None
    with pytest.raises(PolicyError, match="max_changed_lines must be a positive integer"):
        parse_policy("[limits]\nmax_changed_lines = 0\nmax_kernels = 1\n")
    with pytest.raises(PolicyError, match="unknown section"):
        parse_policy("[limits]\nmax_changed_lines = 1\nmax_kernels = 1\n[oops]\n")


def test_a_file_a_kernel_imports_without_declaring_it_is_that_kernels_change(repo):
    # alpha's source imports a helper from free paths (the proposer's folder) and from beta's
    # declared source: both are compiled into alpha's cubins, so changing either changes alpha,
    # and neither may ride along uncounted or pass as "no kernel change".
    root, base = repo
    src = (root / "kernels/ops/alpha.py").read_text()
    write(root, "kernels/ops/alpha.py", "from agent.helper import X\nfrom kernels.ops.beta import LINE_0\n" + src)
    write(root, "agent/helper.py", "X = 1\n")
    b1 = commit(root, "alpha imports a helper")
    assert "agent/helper.py" in compute_scope(base, b1, repo=root).closures["alpha"]

    # The helper alone (1000 lines of kernel code the line bound never sees).
    write(root, "agent/helper.py", "X = 2\n" + "".join(f"Y{i} = {i}\n" for i in range(1000)))
    h1 = commit(root, "helper grows")
    d = evaluate_policy(compute_scope(b1, h1, repo=root), load_policy())
    assert d.status == FULL_REVIEW
    assert [(v.rule, v.path) for v in d.violations] == [("undeclared-dependency", "agent/helper.py")]
    assert "alpha" in d.violations[0].why

    # beta's own source: beta's change, and alpha's too.
    git(root, "reset", "-q", "--hard", b1)
    edit_lines(root, "kernels/ops/beta.py", 1)
    h2 = commit(root, "beta")
    d = evaluate_policy(compute_scope(b1, h2, repo=root), load_policy())
    assert d.status == FULL_REVIEW and "undeclared-dependency" in rules(d)

    # An import added in the working tree is seen too (the closure of the working tree).
    git(root, "reset", "-q", "--hard", b1)
    write(root, "evidence_reports/x/fast.py", "Z = 1\n")
    write(root, "kernels/ops/alpha.py", "from evidence_reports.x.fast import Z\n" + src)
    d = evaluate_policy(compute_scope(b1, None, repo=root), load_policy())
    assert ("undeclared-dependency", "evidence_reports/x/fast.py") in {(v.rule, v.path) for v in d.violations}

    # A kernel that imports nothing undeclared stays eligible.
    git(root, "checkout", "-q", "--", ".")
    git(root, "clean", "-qfd")
    edit_lines(root, "kernels/ops/alpha.py", 3)  # its first two lines are the imports
    d = evaluate_policy(compute_scope(b1, None, repo=root), load_policy())
    assert d.status == ELIGIBLE and d.kernel == "alpha"


def test_new_tunables_count_as_new_choices_and_removed_ones_go_to_full_review(repo):
    root, base = repo
    text = (root / "kernels/manifest.toml").read_text()
    write(root, "kernels/manifest.toml", text.replace(
        "threads = { choices = [128, 256], default = 128 }",
        "threads = { choices = [128, 256], default = 128 }\nunroll = { choices = [1, 2, 4, 8], default = 1, explore_only = [8] }"))
    h1 = commit(root, "new tunable")
    d = evaluate_policy(compute_scope(base, h1, repo=root), load_policy())
    assert d.status == ELIGIBLE and d.new_choices == {"alpha": {"unroll": [2, 4]}}
    git(root, "reset", "-q", "--hard", base)
    write(root, "kernels/manifest.toml", text.replace("threads = { choices = [128, 256], default = 128 }\n", ""))
    h2 = commit(root, "tunable removed")
    d = evaluate_policy(compute_scope(base, h2, repo=root), load_policy())
    assert "manifest-tunable-range" in rules(d) and "removed" in str(d.violations)


def test_added_test_functions_ride_along_but_edited_ones_do_not(repo):
    from validation.scope import test_additions

    base = b"import pytest\n\n\ndef test_a():\n    assert 1 == 1\n"
    assert test_additions(base, base + b"\n\n# why\ndef test_b():\n    assert 2 == 2\n") == ("test_b",)
    assert test_additions(base, base.replace(b"1 == 1", b"1 == 1 or True")) is None  # edited assertion
    assert test_additions(base, base + b"\nimport os\n") is None  # not a test function
    assert test_additions(base, base + b"\ndef test_a():\n    pass\n") is None  # shadows an existing test
    root, sha = repo
    write(root, "tests/test_alpha.py", (root / "tests/test_alpha.py").read_text() + "\n\ndef test_more():\n    assert True\n")
    write(root, "tests/test_new_thing.py", "def test_new():\n    assert True\n")
    edit_lines(root, "kernels/ops/alpha.py", 1)
    d = evaluate_policy(compute_scope(sha, commit(root, "tests ride along"), repo=root), load_policy())
    assert d.status == ELIGIBLE and d.counted_lines == 2, d.violations
    assert d.classification["tests/test_alpha.py"] == d.classification["tests/test_new_thing.py"] == "companion"
