"""The gate over real temporary git repositories: policy routing, evidence binding, exit codes,
outputs; plus the CI workflow's lint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from gate_fixtures import (REPO, commit, commit_bundle, edit_lines, fake_builder, make_bundle,
                           make_repo, new_keypair, shallow_clone, sign, sources_sha256, validator_of, write)
from validation import cli
from validation.gate import (EXIT_ERROR, EXIT_FAIL, EXIT_NOT_ELIGIBLE, EXIT_PASS, AuditOutcome, BuiltVariant,
                             run_gate, write_outputs)


@pytest.fixture()
def signed_repo(tmp_path):
    priv, pem = new_keypair()
    root = tmp_path / "repo"
    base = make_repo(root, public_key_pem=pem)
    return root, base, priv


def change_alpha(root, *, lines=2):
    edit_lines(root, "kernels/ops/alpha.py", lines)


def gate(root, base, head, **kw):
    kw.setdefault("builder", fake_builder(root))
    return run_gate(base, head, repo=root, **kw)


def reasons(v) -> str:
    return "\n".join(v.reasons)


def test_clean_one_kernel_change_with_bound_evidence_passes(signed_repo, tmp_path):
    root, base, priv = signed_repo
    change_alpha(root)
    built = fake_builder(root)("alpha")
    path = commit_bundle(root, sign(make_bundle("alpha", built, base=base), priv))
    write(root, "rfc.toml", 'title = "faster alpha"\n[claim]\nspeedup = false\n')
    head = commit(root, "alpha: faster")
    v = gate(root, base, head)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.kernels == ["alpha"] and v.evidence["bundle"] == path
    assert any("static race audit of alpha: not run" in n for n in v.not_covered)
    written = write_outputs(v, tmp_path / "out")
    data = json.loads(written["verdict.json"].read_text())
    assert data["status"] == "pass" and data["exit_code"] == 0
    assert 'id="verdict">PASS' in written["report.html"].read_text()
    assert "fasttrack gate: pass" in written["pr_comment.md"].read_text()


def test_verdict_names_build_folders_relative_to_the_repository(signed_repo, tmp_path):
    # A verdict is committed as evidence: it must name no absolute path of the machine that ran it.
    import dataclasses

    root, base, priv = signed_repo
    change_alpha(root)
    built = fake_builder(root)("alpha")
    commit_bundle(root, sign(make_bundle("alpha", built, base=base), priv))
    head = commit(root, "alpha: faster")
    inside = [dataclasses.replace(b, build_dir=str(root / "build" / "alpha" / f"k{i}")) for i, b in enumerate(built)]
    from validation.gate import AuditOutcome

    v = gate(root, base, head, builder=lambda k: inside, auditor=lambda k, b: AuditOutcome("pass", "clean"))
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert [b["build_dir"] for b in v.build] == ["build/alpha/k0", "build/alpha/k1"]
    data = json.loads(write_outputs(v, tmp_path / "out")["verdict.json"].read_text())
    assert str(root) not in json.dumps(data["build"])


@pytest.mark.parametrize("what, expect", [
    ("two kernels", ("multiple-kernels", "", "touches 2 kernels (alpha: kernels/ops/alpha.py; beta: kernels/ops/beta.py)")),
    ("reference", ("protected-path", "kernels/reference.py", "reference")),
    ("validator", ("protected-path", "validation/numerics.py", "the validator")),
    ("oracle test", ("protected-path", "tests/test_alpha.py", "oracles")),
    ("roles", ("manifest-roles", "kernels/manifest.toml", "buffer roles")),
    ("ci", ("protected-path", ".github/workflows/pr.yml", "CI configuration")),
    ("shared code", ("unclassified-path", "kernels/ops/base.py", "not a declared source")),
])
def test_ineligible_changes_are_routed_to_full_review(signed_repo, what, expect):
    root, base, _ = signed_repo
    change_alpha(root)
    if what == "two kernels":
        edit_lines(root, "kernels/ops/beta.py", 1)
    elif what == "reference":
        write(root, "kernels/reference.py", "def alpha(x):\n    return x * 0\n")
    elif what == "validator":
        write(root, "validation/numerics.py", "TOLERANCE = 1.0\n")
    elif what == "oracle test":
        write(root, "tests/test_alpha.py", "def test_alpha():\n    pass\n")
    elif what == "roles":
        text = (root / "kernels/manifest.toml").read_text()
        write(root, "kernels/manifest.toml", text.replace('name = "w", role = "static"',
                                                          'name = "w", role = "activation"'))
    elif what == "ci":
        write(root, ".github/workflows/pr.yml", "on: push\n")
    elif what == "shared code":
        write(root, "kernels/ops/base.py", "X = 1\n")
    head = commit(root, what)
    v = gate(root, base, head, builder=lambda k: pytest.fail("an ineligible change must not be built"))
    assert (v.status, v.exit_code) == ("not_eligible", EXIT_NOT_ELIGIBLE)
    rule, path, why = expect
    hits = [x for x in v.policy["violations"] if x["rule"] == rule and x["path"] == path]
    assert hits and why in hits[0]["why"], reasons(v)


def test_line_bound_breach(tmp_path):
    policy = (REPO / "validation/policy.toml").read_text().replace("max_changed_lines = 400",
                                                                   "max_changed_lines = 10")
    root = tmp_path / "repo"
    base = make_repo(root, policy_text=policy)
    change_alpha(root, lines=6)  # 12 changed lines
    head = commit(root, "big")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_NOT_ELIGIBLE
    assert "[line-bound] 12 changed lines exceed the bound of 10 (kernels/ops/alpha.py 12)" in reasons(v)


def test_policy_is_read_at_the_base(tmp_path):
    # Loosening the bound in the same change does not help: the base's policy judges it (and the
    # policy file itself is protected).
    policy = (REPO / "validation/policy.toml").read_text()
    root = tmp_path / "repo"
    base = make_repo(root, policy_text=policy.replace("max_changed_lines = 400", "max_changed_lines = 10"))
    change_alpha(root, lines=6)
    write(root, "validation/policy.toml", policy.replace("max_changed_lines = 400", "max_changed_lines = 1000"))
    head = commit(root, "loosen")
    v = gate(root, base, head)
    rules = {x["rule"] for x in v.policy["violations"]}
    assert v.exit_code == EXIT_NOT_ELIGIBLE and {"line-bound", "protected-path"} <= rules


def test_evidence_for_another_binary_fails_naming_the_kernel(signed_repo):
    root, base, priv = signed_repo
    stale = fake_builder(root)("alpha")  # evidence measured before the last edit
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", stale, base=base), priv))
    head = commit(root, "edited after measuring")
    v = gate(root, base, head)
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL)
    text = reasons(v)
    assert 'kernel alpha variant {"batch":1,"n":64}' in text and "does not match the bundle's" in text


@pytest.mark.parametrize("how, message", [
    ("unsigned", "the bundle is not signed"),
    ("tampered", "does not verify: the bundle was changed after signing"),
    ("untrusted", "is not among the trusted keys"),
])
def test_bundle_must_carry_a_trusted_signature(signed_repo, how, message):
    root, base, priv = signed_repo
    change_alpha(root)
    bundle = make_bundle("alpha", fake_builder(root)("alpha"), base=base)
    if how == "tampered":
        bundle = sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base, verdicts={8: "SLOW"}), priv)
        bundle["benchmark"]["cases"][1]["verdict"] = "SAME"  # hide the regression after signing
        bundle["benchmark"]["passed"] = True
    elif how == "untrusted":
        other, _ = new_keypair()
        bundle = sign(bundle, other)
    commit_bundle(root, bundle)
    head = commit(root, how)
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL and message in reasons(v)
    assert v.evidence["bundle"] is None


def test_no_evidence_fails(signed_repo):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "no evidence")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL
    assert "kernel alpha: no committed evidence bundle under evidence_reports/ measures it" in reasons(v)


@pytest.mark.parametrize("verdicts, claim, message", [
    ({8: "SLOW"}, None, "SLOW (slower beyond noise than the base revision) at: batch 8"),
    ({1: "IMPOSSIBLE"}, None, "IMPOSSIBLE"),
    ({}, "speedup = true\nbatches = [1]", "a speedup is claimed (batches 1) but no claimed case is FAST"),
    ({1: "FAST", 8: "AMBIGUOUS"}, "speedup = true", "the claimed speedup is AMBIGUOUS at: batch 8"),
])
def test_benchmark_results_must_hold(signed_repo, verdicts, claim, message):
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base, verdicts=verdicts), priv))
    if claim:
        write(root, "kernels/ops/rfc.toml", f'title = "x"\n[claim]\n{claim}\n')
    head = commit(root, "bench")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL and message in reasons(v), reasons(v)


def test_claimed_speedup_with_fast_case_passes_and_ambiguous_elsewhere_is_allowed(signed_repo):
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base,
                                         verdicts={1: "FAST", 8: "AMBIGUOUS"}), priv))
    write(root, "rfc.toml", 'title = "x"\n[claim]\nspeedup = true\nbatches = [1]\n')
    head = commit(root, "claim")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_PASS, reasons(v)


# -- the benchmark's baseline must be the change's base revision ------------------------------

def test_torch_baseline_cannot_show_no_regression(signed_repo, tmp_path):
    """A bundle timed against the torch path fails with that reason; its SLOW cases are risks
    (another implementation), not regressions."""
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base="torch",
                                         verdicts={8: "SLOW"}, validator=validator_of(root)), priv))
    head = commit(root, "measured against torch")
    v = gate(root, base, head)
    text = reasons(v)
    assert v.exit_code == EXIT_FAIL
    assert f"benchmark baseline is torch (the torch path), not the base revision {base[:12]}" in text
    assert "SLOW" not in text
    assert v.risks == ["SLOW against torch (another implementation, not a regression) at: batch 8"]
    assert v.baseline["kind"] == "torch" and v.baseline["holds"] is False
    written = write_outputs(v, tmp_path / "out")
    comment = written["pr_comment.md"].read_text()
    assert "Risks (reported to the reviewer, not failures):\n- SLOW against torch" in comment
    assert "| 10.00 | 9.90 | -1.0% | 2.0% | **SLOW** |" in comment
    assert "<h2>Risks</h2>" in written["report.html"].read_text()
    assert json.loads(written["verdict.json"].read_text())["baseline"]["kind"] == "torch"


def test_no_baseline_fails(signed_repo):
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=None), priv))
    head = commit(root, "no base")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL and "benchmark baseline is none" in reasons(v)


def test_bundle_measured_against_an_older_kernel_is_not_replayed(signed_repo):
    """Evidence timed against base0 cannot pass a change based on base1 when the kernel differs
    between the two: head might be slower than base1 and still faster than base0."""
    root, base0, priv = signed_repo
    at_base0 = sources_sha256(root, ["kernels/ops/alpha.py"])
    change_alpha(root, lines=1)
    base1 = commit(root, "a faster alpha, merged")
    edit_lines(root, "kernels/ops/alpha.py", 3)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base0,
                                         base_sources=at_base0), priv))
    head = commit(root, "alpha again, measured against the old base")
    v = gate(root, base1, head)
    text = reasons(v)
    assert v.exit_code == EXIT_FAIL
    assert (f"benchmarked against base {base0[:12]}, not the gate's base {base1[:12]}, and the kernel "
            "differs between them (kernels/ops/alpha.py)") in text
    # Without recorded base sources the equivalence cannot be shown either.
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base0), priv))
    head = commit(root, "same, no base sources")
    assert "records no base source hashes" in reasons(gate(root, base1, head))


def test_bundle_against_an_equivalent_base_passes(signed_repo):
    """A base whose kernel sources hash the same as the gate's base (only docs changed since) is
    an equivalent baseline."""
    root, base0, priv = signed_repo
    at_base0 = sources_sha256(root, ["kernels/ops/alpha.py", "kernels/reference.py"])
    write(root, "README.md", "# demo\n\ndocs only\n")
    base1 = commit(root, "docs")
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base0,
                                         base_sources=at_base0), priv))
    head = commit(root, "alpha")
    v = gate(root, base1, head)
    assert v.exit_code == EXIT_PASS, reasons(v)
    assert v.baseline["equivalence"] == f"same kernel sources as {base1[:12]} (2 files)"
    assert f"timed against base {base1[:12]}" in reasons(v)


def test_revision_baseline_needs_base_binaries(signed_repo):
    root, base, priv = signed_repo
    change_alpha(root)
    b = make_bundle("alpha", fake_builder(root)("alpha"), base=base)
    b["binaries"] = [x for x in b["binaries"] if x["side"] == "head"]
    commit_bundle(root, sign(b, priv))
    head = commit(root, "no base binaries")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL and "records no base binaries of alpha" in reasons(v)


def test_ambiguous_cases_against_the_base_are_reported_as_risks(signed_repo):
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base,
                                         verdicts={8: "AMBIGUOUS"}, validator=validator_of(root)), priv))
    head = commit(root, "x")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_PASS, reasons(v)
    assert v.risks == ["AMBIGUOUS (no difference shown either way) at: batch 8"]


# -- the bundle must come from the validator at the merge base ----------------------------------

def test_bundle_from_the_merge_bases_validator_passes_without_a_validator_risk(signed_repo):
    root, base, priv = signed_repo
    at_base = validator_of(root)
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base, validator=at_base), priv))
    head = commit(root, "alpha")
    v = gate(root, base, head)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.risks == [] and v.evidence["validator_sha256"] == at_base[0]


def test_bundle_from_an_older_validator_does_not_bind(signed_repo):
    """Evidence produced before a tolerance fix must not bind after it, though the cubins (and
    the kernel at the base) are unchanged: the gate names the validator files that differ."""
    root, base0, priv = signed_repo
    before_fix = validator_of(root)
    write(root, "validation/numerics.py", "TOLERANCE = 1e-4\n")  # the fix, merged
    base1 = commit(root, "numerics: tighter tolerance")
    change_alpha(root)
    built = fake_builder(root)("alpha")
    commit_bundle(root, sign(make_bundle("alpha", built, base=base1, validator=before_fix), priv))
    head = commit(root, "alpha, validated before the fix")
    v = gate(root, base1, head)
    text = reasons(v)
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL), text
    assert (f"validated by a different validator: its validator_sha256 {before_fix[0][:16]} is not the "
            f"merge base's {validator_of(root)[0][:16]} (1 file(s) differ: validation/numerics.py)") in text
    assert v.evidence["bundle"] is None
    # Validated again with the merge base's validator, beside the stale bundle: that one binds.
    commit_bundle(root, sign(make_bundle("alpha", built, base=base1, validator=validator_of(root)), priv),
                  name="again")
    head = commit(root, "validated again")
    v = gate(root, base1, head)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.evidence["bundle"] == "evidence_reports/again/bundle.json"


def test_a_validator_file_outside_validation_counts(signed_repo):
    # The oracle is part of the validator: a reference fix invalidates earlier evidence too.
    root, base0, priv = signed_repo
    before_fix = validator_of(root)
    write(root, "kernels/reference.py", "def alpha(x):\n    return x + 0\n")
    base1 = commit(root, "reference fix")
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base1,
                                         validator=before_fix), priv))
    head = commit(root, "alpha")
    text = reasons(gate(root, base1, head))
    assert "validated by a different validator" in text and "kernels/reference.py" in text


def test_bundle_without_a_recorded_validator_binds_with_a_risk(signed_repo, tmp_path):
    # Every bundle committed before the field existed keeps binding; the reviewer is told.
    root, base, priv = signed_repo
    change_alpha(root)
    path = commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base), priv))
    head = commit(root, "alpha")
    v = gate(root, base, head)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.risks == [f"{path}: the bundle does not record the validator that produced it (no "
                       "environment.validator_sha256: written before fasttrack recorded it), so it is not "
                       f"shown to come from the validator at {base[:12]}"]
    assert "does not record the validator" in write_outputs(v, tmp_path / "out")["pr_comment.md"].read_text()


def test_run_gpu_refuses_its_own_bundle_from_another_validator(signed_repo):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "x")
    built = fake_builder(root)("alpha")
    other = ("0" * 64, {"validation/numerics.py": "1" * 64})
    v = gate(root, base, head, run_gpu=True, cuda_available=lambda: True,
             validator=lambda k, b: make_bundle(k, built, base=b, validator=other))
    assert v.exit_code == EXIT_FAIL
    assert "the validator's own bundle: validated by a different validator" in reasons(v)


def test_missing_race_results_and_failing_audit_fail(signed_repo):
    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base, race=False), priv))
    head = commit(root, "no race")
    v = gate(root, base, head, auditor=lambda k, built: AuditOutcome("fail", "static audit found errors",
                                                                     ["R1 nc load of activation x"]))
    text = reasons(v)
    assert v.exit_code == EXIT_FAIL
    assert "no race audit in the bundle" in text and "R1 nc load of activation x" in text


def test_no_kernel_change_exits_zero(signed_repo):
    root, base, _ = signed_repo
    write(root, "README.md", "# demo\n\nmore words\n")
    write(root, "tests/test_agent_loop.py", "def test_x():\n    assert 1\n")
    head = commit(root, "docs")
    v = gate(root, base, head, builder=lambda k: pytest.fail("nothing to build"))
    assert (v.status, v.exit_code) == ("no_kernel_change", EXIT_PASS)


def test_scope_only_stops_before_build(signed_repo):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "x")
    v = gate(root, base, head, scope_only=True, builder=lambda k: pytest.fail("no build in scope-only"))
    assert v.exit_code == EXIT_PASS and "scope only" in reasons(v)


def test_run_gpu_without_a_device_is_an_error(signed_repo):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "x")
    v = gate(root, base, head, run_gpu=True, cuda_available=lambda: False)
    assert v.exit_code == EXIT_ERROR and "--run-gpu needs a CUDA device" in reasons(v)


def test_run_gpu_binds_the_validators_own_bundle(signed_repo):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "x")
    built = fake_builder(root)("alpha")
    asked = []
    v = gate(root, base, head, run_gpu=True, cuda_available=lambda: True,
             validator=lambda k, b: asked.append((k, b)) or make_bundle(k, built, base=b))
    assert v.exit_code == EXIT_PASS, reasons(v)
    assert asked == [("alpha", base)]  # timed against the merge base
    v = gate(root, base, head, run_gpu=True, cuda_available=lambda: True,
             validator=lambda k, b: make_bundle(k, built, base=b, verdicts={1: "SLOW"}))
    assert v.exit_code == EXIT_FAIL


# -- the command line --------------------------------------------------------------------------

def test_cli_malformed_revision_exits_2_and_still_writes_outputs(signed_repo, tmp_path, capsys):
    root, base, _ = signed_repo
    out = tmp_path / "out"
    rc = cli.main(["gate", "--base", "no-such-rev", "--head", base, "--repo", str(root), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "fasttrack gate: revision 'no-such-rev' does not name a commit in this repository"
    assert json.loads((out / "verdict.json").read_text())["status"] == "error"


def test_cli_shallow_clone_missing_the_base_exits_2(signed_repo, tmp_path, capsys):
    root, base, _ = signed_repo
    change_alpha(root)
    head = commit(root, "x")
    clone = tmp_path / "clone"
    shallow_clone(root, clone)
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(clone), "--out", str(tmp_path / "o")])
    assert rc == 2 and "shallow clone" in capsys.readouterr().err


def test_cli_not_eligible_exits_3_with_each_rule(signed_repo, tmp_path, capsys):
    root, base, _ = signed_repo
    write(root, "kernels/reference.py", "def alpha(x):\n    return 2 * x\n")
    write(root, "validation/numerics.py", "TOLERANCE = 1\n")
    head = commit(root, "x")
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 3
    assert "[protected-path] kernels/reference.py:" in out and "[protected-path] validation/numerics.py:" in out
    comment = (tmp_path / "o/pr_comment.md").read_text()
    assert "| `protected-path` | `kernels/reference.py` |" in comment


def test_cli_out_that_is_a_file_is_refused_and_kept(signed_repo, tmp_path, capsys):
    root, base, _ = signed_repo
    write(root, "README.md", "changed\n")
    head = commit(root, "x")
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--out", str(precious)])
    assert rc == 2 and "is not a directory" in capsys.readouterr().err
    assert precious.read_text() == "keep me"


def test_cli_help_documents_exit_codes():
    out = subprocess.run([sys.executable, "-m", "validation.cli", "gate", "--help"],
                         capture_output=True, text=True, cwd=REPO).stdout
    for line in ("0  pass", "1  fail", "2  bad input or infrastructure error", "3  not eligible for fast track"):
        assert line in out


# -- CI workflow -------------------------------------------------------------------------------

def test_pr_workflow_is_valid():
    """Lint the GitHub Actions workflows against the workflow schema (check-jsonschema), and
    with actionlint when it is on PATH."""
    workflows = sorted((REPO / ".github/workflows").glob("*.yml"))
    assert workflows, "no workflows under .github/workflows"
    cj = shutil.which("check-jsonschema")
    if cj is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    res = subprocess.run([cj, "--builtin-schema", "vendor.github-workflows", *map(str, workflows)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    if shutil.which("actionlint"):
        res = subprocess.run(["actionlint", *map(str, workflows)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    text = (REPO / ".github/workflows/pr.yml").read_text()
    assert "fasttrack gate" in text and "[self-hosted, gpu]" in text


def _workflow():
    """pr.yml as data (ruamel.yaml comes with check-jsonschema, a declared dependency)."""
    yaml = pytest.importorskip("ruamel.yaml")
    return yaml.YAML(typ="safe").load((REPO / ".github/workflows/pr.yml").read_text())


def _runs(job: dict) -> str:
    return "\n".join(str(st.get("run", "")) for st in job.get("steps", []))


def test_pr_workflow_validates_against_the_merge_base_in_gate_md_commands():
    """GATE.md's three commands, one job each, timed against the PR's merge base (a bundle timed
    against torch, or against nothing, cannot pass the gate): prepare on a CPU runner, the plan
    run on the GPU runner, the presign check and the signature in the sign job."""
    jobs = _workflow()["jobs"]
    prepare, gpu, sign = (_runs(jobs[k]) for k in ("prepare", "gpu", "sign"))
    steps = [(prepare, 'MERGE_BASE="$(git merge-base "$BASE_SHA" HEAD)"'),
             (prepare, 'fasttrack validate "$KERNEL" --base "$MERGE_BASE" --prepare'),
             (gpu, 'PYTHONPATH=. python3 -m validation.cli validate "$KERNEL" --plan "build/validate/$KERNEL/plan.json"'),
             (sign, 'python -m validation.validate presign "$RUNNER_TEMP/unsigned/bundle.json"'),
             (sign, "fasttrack sign")]
    assert all(s in text for text, s in steps), [s for text, s in steps if s not in text]
    assert sign.index("validation.validate presign") < sign.index("fasttrack sign")
    assert jobs["prepare"]["steps"][0]["with"]["fetch-depth"] == 0  # the merge base must be in the clone
    assert "needs" in jobs["gpu"] and "prepare" in jobs["gpu"]["needs"] and "gpu" in jobs["sign"]["needs"]
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "gpu"] and "--base torch" not in prepare + gpu


BASE_REF = "${{ github.event.pull_request.base.sha }}"


def pr_code_in_job(job: dict) -> list[str]:
    """Why a job of pr.yml may run the pull request's code (empty when it runs none)."""
    why = []
    if "self-hosted" in str(job.get("runs-on")):
        why.append("a self-hosted runner (a persistent machine where PR code ran)")
    for st in job.get("steps", []):
        uses, with_ = str(st.get("uses", "")), st.get("with") or {}
        if uses.startswith("actions/checkout") and with_.get("ref") != BASE_REF:
            why.append(f"checks out {with_.get('ref', 'the PR merge ref')}")
        if uses.startswith("actions/download-artifact") and not str(with_.get("path", "")).startswith("${{ runner.temp }}"):
            why.append(f"downloads an artifact into the checkout ({with_.get('path', '.')}), where it can replace code")
        for cmd in ("git checkout", "git switch", "git worktree", "git reset", "git merge", "git pull", "pytest"):
            if cmd in str(st.get("run", "")):
                why.append(f"runs {cmd!r}")
    return why


def test_no_job_both_runs_pr_code_and_sees_the_signing_secret():
    """A process the PR's build or GPU run leaves behind could read the key or rewrite the bundle:
    the secret lives only in a job on a fresh runner that checks out the base and nothing else."""
    wf = _workflow()
    assert "secrets." not in json.dumps(wf.get("env") or {})  # workflow-wide env reaches every job
    with_secret = {name: job for name, job in wf["jobs"].items() if "secrets." in json.dumps(job)}
    assert list(with_secret) == ["sign"]
    for name, job in with_secret.items():
        assert pr_code_in_job(job) == [], (name, pr_code_in_job(job))
    # The check can fail: the jobs that do run the PR's code are recognised as such.
    assert pr_code_in_job(wf["jobs"]["gpu"]) and pr_code_in_job(wf["jobs"]["prepare"])
    assert pr_code_in_job(wf["jobs"]["gate"])


# -- one real build, end to end ----------------------------------------------------------------

SCALE_MANIFEST = """\
[kernels.scale]
op = "kernels.ops.scale:ScaleOp"
reference = "kernels.reference:scale"
sources = ["kernels/ops/scale.py"]
params = [
  { name = "x", role = "activation" },
  { name = "alpha", role = "scalar" },
  { name = "n", role = "scalar" },
  { name = "y", role = "activation", direction = "out" },
]
[kernels.scale.tunables]
threads = { choices = [64, 128], default = 64 }
[kernels.scale.shapes]
rows = [4]
cols = [64]
"""


@pytest.mark.slow
def test_real_build_binds_signed_evidence_end_to_end(tmp_path, capsys):
    """The default builder compiles the change's kernel with the CuTe DSL, the real static audit
    reads its PTX/SASS, and a bundle signed over those cubin hashes passes; one edit later, the same
    bundle no longer binds."""
    pytest.importorskip("cutlass")
    from kernels.build import build_kernel
    from kernels.manifest import parse_manifest

    priv, pem = new_keypair()
    root = tmp_path / "repo"
    base = make_repo(root, public_key_pem=pem)
    write(root, ".gitignore", "build/\n.fasttrack/\n")
    for rel in ("kernels/__init__.py", "kernels/ops/__init__.py", "kernels/ops/base.py"):
        write(root, rel, (REPO / rel).read_text())
    write(root, "kernels/ops/scale.py", (REPO / "tests/fixtures/scale_op.py").read_text())
    write(root, "kernels/manifest.toml", SCALE_MANIFEST)
    base = commit(root, "scale kernel")

    src = (root / "kernels/ops/scale.py").read_text()
    # Commuting the product generates the same code: no code change, exit 0, nothing to evidence.
    write(root, "kernels/ops/scale.py", src.replace("mX[r, c] * alpha", "alpha * mX[r, c]"))
    same = commit(root, "scale: commute the product")
    out = tmp_path / "out"
    rc = cli.main(["gate", "--base", base, "--head", same, "--repo", str(root), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "NO_CODE_CHANGE" in printed and "builds to the same code" in printed, printed

    write(root, "kernels/ops/scale.py", src.replace("mX[r, c] * alpha + n.to(cutlass.Float32)",
                                                    "mX[r, c] * alpha - n.to(cutlass.Float32)"))
    arts = build_kernel("scale", root=root / "build", repo_root=root, manifest=parse_manifest(SCALE_MANIFEST))
    built = [BuiltVariant(a.kernel, dict(a.shape), dict(a.tunables), a.cubin_sha256) for a in arts]
    commit_bundle(root, sign(make_bundle("scale", built, base=base), priv))
    head = commit(root, "scale: sign flip")

    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["build"][0]["cubin_sha256"] == built[0].cubin_sha256
    assert verdict["audit"]["scale"]["status"] == "pass", verdict["audit"]

    # Edit the kernel again without new evidence: the bundle is for another binary now.
    write(root, "kernels/ops/scale.py", src.replace("mX[r, c] * alpha + n.to(cutlass.Float32)",
                                                    "mX[r, c] * alpha * n.to(cutlass.Float32)"))
    head2 = commit(root, "scale: a product")
    rc = cli.main(["gate", "--base", base, "--head", head2, "--repo", str(root), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 1 and 'kernel scale variant {"cols":64,"rows":4}' in printed, printed


def test_gate_page_shortens_long_binding_problem_lists(signed_repo, tmp_path):
    # A stale bundle over many variants must not bury the page: three problems, then a count.
    root, base, priv = signed_repo
    shapes = {"alpha": [{"batch": b, "n": 64} for b in (1, 2, 4, 8, 16, 32)], "beta": [{"batch": 1}]}
    stale = fake_builder(root, shapes)("alpha")
    commit_bundle(root, sign(make_bundle("alpha", stale, base=base), priv))
    change_alpha(root)
    head = commit(root, "alpha: change after its evidence")
    v = gate(root, base, head, builder=fake_builder(root, shapes))
    assert v.exit_code == EXIT_FAIL
    html = write_outputs(v, tmp_path / "out")["report.html"].read_text()
    assert "and 3 more (all in verdict.json)" in html
    problems = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert "does not match" in json.dumps(problems)


@pytest.mark.parametrize("damage", [
    lambda b: b.update(binaries=5),
    lambda b: b["change"].update(kernel=["alpha"]),
    lambda b: b["binaries"][0].update(kernel=["alpha"]),
    lambda b: b["binaries"][0].update(tunables="threads=128"),
    lambda b: b.pop("correctness"),
])
def test_a_malformed_bundle_is_refused_with_its_reason_not_a_crash(signed_repo, damage):
    # Any bundle committed under evidence_reports/ is read for every gate run: a malformed one
    # (even a signed one) must be reported, and must not hide a good bundle beside it.
    root, base, priv = signed_repo
    change_alpha(root)
    built = fake_builder(root)("alpha")
    bad = make_bundle("alpha", built, base=base)
    damage(bad)
    commit_bundle(root, sign(bad, priv), name="bad")
    head = commit(root, "malformed evidence")
    v = gate(root, base, head)
    assert v.exit_code == EXIT_FAIL and "evidence_reports/bad/bundle.json: not a well-formed" in reasons(v)
    commit_bundle(root, sign(make_bundle("alpha", built, base=base), priv), name="good")
    head = commit(root, "good evidence beside it")
    v = gate(root, base, head)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.evidence["bundle"] == "evidence_reports/good/bundle.json"


def test_cli_prints_the_risks_beside_the_verdict(signed_repo, tmp_path, monkeypatch, capsys):
    # A reviewer reading the terminal sees the risks too, not only verdict.json and the PR comment.
    import validation.gate as G

    root, base, priv = signed_repo
    change_alpha(root)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base), priv))
    head = commit(root, "alpha")
    real = G.run_gate
    monkeypatch.setattr(G, "run_gate", lambda *a, **k: real(*a, builder=fake_builder(root), **k))
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--out", str(tmp_path / "o")])
    assert rc == EXIT_PASS
    assert "  risk: " in capsys.readouterr().out


# -- the done-when cases on a scratch clone of this repository ---------------------------------
# The real kernels and the real gate, one batch per kernel (gate_fixtures.scratch_clone), built
# into the shared cache build/ (base builds of unchanged sources are cache hits there).

@pytest.fixture()
def scratch(tmp_path):
    from gate_fixtures import scratch_clone

    root = tmp_path / "clone"
    return root, scratch_clone(root)


def _scratch_gate(root, base, head):
    return run_gate(base, head, repo=root, build_root=REPO / "build", jobs=2)


def test_scratch_an_edited_assertion_in_an_existing_test_goes_to_full_review(scratch):
    root, base = scratch
    p = root / "tests/test_rmsnorm.py"
    text = p.read_text()
    assert "assert " in text
    write(root, "tests/test_rmsnorm.py", text.replace("assert ", "assert True or ", 1))
    head = commit(root, "loosen an assertion")
    v = _scratch_gate(root, base, head)  # answers before anything compiles
    assert (v.status, v.exit_code) == ("not_eligible", EXIT_NOT_ELIGIBLE), reasons(v)
    assert any(x["rule"] == "protected-path" and x["path"] == "tests/test_rmsnorm.py" for x in v.policy["violations"])
    assert v.cause.startswith("not eligible for fast track: [protected-path] tests/test_rmsnorm.py")


def test_scratch_an_edit_of_the_reference_goes_to_full_review(scratch):
    root, base = scratch
    with open(root / "kernels/reference.py", "a") as f:
        f.write("\n\ndef helper(x):\n    return x\n")
    head = commit(root, "reference: a helper")
    v = _scratch_gate(root, base, head)
    assert (v.status, v.exit_code) == ("not_eligible", EXIT_NOT_ELIGIBLE), reasons(v)
    assert any(x["rule"] == "protected-path" and x["path"] == "kernels/reference.py" for x in v.policy["violations"])


@pytest.mark.slow
def test_scratch_a_comment_only_edit_of_router_py_is_no_code_change(scratch):
    """router.py is a declared source of four kernels (router, moe_w13, moe_w2, router_select):
    all four are rebuilt at base and head, and their code is the same."""
    pytest.importorskip("cutlass")
    root, base = scratch
    p = root / "kernels/ops/router.py"
    write(root, "kernels/ops/router.py", p.read_text().replace('"""', '"""A comment-only edit. ', 1)
          + "\n# a trailing comment\n")
    head = commit(root, "router: comments")
    v = _scratch_gate(root, base, head)
    assert (v.status, v.exit_code) == ("no_code_change", EXIT_PASS), reasons(v)
    assert "no code change" in reasons(v) and "existing evidence still binds" in reasons(v)
    assert {"router", "moe_w13", "moe_w2", "router_select"} <= set(v.scope["code"])
    assert all(c["status"] == "same" for c in v.scope["code"].values())


@pytest.mark.slow
def test_scratch_a_real_change_of_one_kernel_with_a_new_test_file_is_eligible(scratch):
    """It fails only for the evidence it lacks: the new test file rides along uncounted. gated_situ's
    epilogue is a tile the megakernel does not run, so the change touches that one kernel."""
    pytest.importorskip("cutlass")
    root, base = scratch
    src = (root / "kernels/ops/epilogue.py").read_text()
    assert "GATE_LIMIT, UP_LIMIT = 4.0, 25.0" in src
    write(root, "kernels/ops/epilogue.py", src.replace("GATE_LIMIT, UP_LIMIT = 4.0, 25.0", "GATE_LIMIT, UP_LIMIT = 4.0, 24.0"))
    write(root, "tests/test_situ_limit.py", "def test_up_limit():\n    from kernels.ops import epilogue\n"
                                            "    assert epilogue.UP_LIMIT == 24.0\n")
    head = commit(root, "gated_situ: up limit 24, with a test")
    v = _scratch_gate(root, base, head)
    assert v.policy["status"] == "eligible" and v.kernels == ["gated_situ"], reasons(v)
    assert v.policy["classification"]["tests/test_situ_limit.py"] == "companion"
    assert v.scope["code"]["gated_situ"]["status"] == "changed"
    assert v.scope["code"]["residual"]["status"] == "same"  # the other kernel of the same file
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL)
    assert all("gated_situ" in r and "evidence" in r for r in v.reasons), reasons(v)
    assert v.next_command.startswith(f"fasttrack validate gated_situ --base {base[:12]} --prepare")
    assert v.audit["gated_situ"]["status"] == "pass"


def test_scratch_a_change_of_a_tile_the_megakernel_runs_needs_the_megakernels_evidence_too(scratch):
    """rmsnorm's tile is also the megakernel's norm stages: its code changes too. Both are kernels
    of the latentmoe path, so the change is eligible as a path change and fails first on the
    megakernel's missing evidence (its own validation stage would give it)."""
    pytest.importorskip("cutlass")
    root, base = scratch
    src = (root / "kernels/ops/rmsnorm.py").read_text()
    assert "EPS = 1e-5" in src
    write(root, "kernels/ops/rmsnorm.py", src.replace("EPS = 1e-5", "EPS = 1e-6"))
    head = commit(root, "rmsnorm: eps 1e-6")
    v = _scratch_gate(root, base, head)
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL), reasons(v)
    assert v.kernels == ["megakernel", "rmsnorm"] and v.policy["path"] == "latentmoe"
    assert v.scope["code"]["megakernel"]["status"] == "changed"
    assert not v.policy["violations"]
    assert v.cause.startswith("kernel megakernel: no committed evidence")
    assert "fasttrack validate megakernel" in v.next_command


# -- scope by code, decode paths and their composite evidence (fake builds) --------------------

def _code_gate(root, base, head, **kw):
    from gate_fixtures import fake_code_build

    return run_gate(base, head, repo=root, code_build=fake_code_build,
                    auditor=lambda k, b: AuditOutcome("pass", "clean"), **kw)


@pytest.fixture()
def path_repo(tmp_path):
    from gate_fixtures import MANIFEST, PATH_MANIFEST_TAIL

    priv, pem = new_keypair()
    root = tmp_path / "repo"
    make_repo(root, public_key_pem=pem)
    write(root, "kernels/manifest.toml", MANIFEST + PATH_MANIFEST_TAIL)
    return root, commit(root, "a decode path"), priv


def test_a_comment_in_a_kernel_source_is_no_code_change(path_repo):
    root, base, _ = path_repo
    with open(root / "kernels/ops/alpha.py", "a") as f:
        f.write("# why this is so\n")
    v = _code_gate(root, base, commit(root, "comment"))
    assert (v.status, v.exit_code) == ("no_code_change", EXIT_PASS), reasons(v)
    assert "(alpha) builds to the same code at base and head (2 variants" in reasons(v)
    assert "2 differ in their line tables only" in reasons(v)


def test_kernels_of_one_path_need_evidence_for_each_and_for_the_composite(path_repo):
    root, base, priv = path_repo
    edit_lines(root, "kernels/ops/alpha.py", 1)
    edit_lines(root, "kernels/ops/beta.py", 1)
    head = commit(root, "alpha and beta")
    v = _code_gate(root, base, head)
    assert v.policy["status"] == "eligible" and v.policy["path"] == "decode" and v.policy["composite"] == "block"
    assert v.exit_code == EXIT_FAIL
    text = reasons(v)
    for what in ("kernel alpha:", "kernel beta:", "the composite block of path decode:"):
        assert what in text, text
    assert v.cause.startswith("kernel alpha: no committed evidence") and "fasttrack validate alpha" in v.next_command

    # Evidence for each kernel and a composite bundle (change.kernel "block") that ran both.
    from gate_fixtures import built_of

    built = built_of(v)
    val = validator_of(root)
    for k in ("alpha", "beta"):
        commit_bundle(root, sign(make_bundle(k, [b for b in built if b.kernel == k], base=base, validator=val), priv), k)
    block = make_bundle("block", built, base=base, validator=val)
    commit_bundle(root, sign(block, priv), "block")
    head2 = commit(root, "evidence")
    v = _code_gate(root, base, head2)
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), reasons(v)
    assert v.evidence["bound"] == {"alpha": "evidence_reports/alpha/bundle.json",
                                   "beta": "evidence_reports/beta/bundle.json",
                                   "block": "evidence_reports/block/bundle.json"}

    # A composite bundle that did not run a touched kernel does not bind.
    stale = make_bundle("block", [b for b in built if b.kernel == "alpha"], base=base, validator=val)
    commit_bundle(root, sign(stale, priv), "block")
    v = _code_gate(root, base, commit(root, "a composite without beta"))
    assert v.exit_code == EXIT_FAIL and "ran no binary of touched kernel beta" in reasons(v)


def test_kernels_outside_one_path_go_to_full_review(signed_repo):
    root, base, _ = signed_repo  # the plain manifest declares no path
    edit_lines(root, "kernels/ops/alpha.py", 1)
    edit_lines(root, "kernels/ops/beta.py", 1)
    v = _code_gate(root, base, commit(root, "two kernels"))
    assert v.exit_code == EXIT_NOT_ELIGIBLE and "multiple-kernels" in {x["rule"] for x in v.policy["violations"]}


def test_a_new_tunable_choice_needs_bound_evidence_that_measured_it(path_repo):
    root, base, priv = path_repo
    text = (root / "kernels/manifest.toml").read_text()
    write(root, "kernels/manifest.toml", text.replace("choices = [128, 256]", "choices = [128, 256, 512]"))
    edit_lines(root, "kernels/ops/alpha.py", 1)
    head = commit(root, "alpha: a new choice")
    v = _code_gate(root, base, head)
    from gate_fixtures import built_of

    built = built_of(v)
    commit_bundle(root, sign(make_bundle("alpha", built, base=base, validator=validator_of(root)), priv), "alpha")
    v = _code_gate(root, base, commit(root, "evidence of the defaults only"))
    assert v.exit_code == EXIT_FAIL and "the new choice threads=512 is measured by no bound evidence" in reasons(v)
