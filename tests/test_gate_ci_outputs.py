"""`fasttrack gate --github-output`: the verdict as CI step outputs, every touched kernel a JSON
list the workflow's matrix reads."""

from __future__ import annotations

import json

import pytest

from gate_fixtures import MANIFEST, PATH_MANIFEST_TAIL, REPO, commit, edit_lines, make_repo, write
from validation import cli
from validation.gate import GateVerdict, ci_outputs


@pytest.fixture()
def fake_builds(monkeypatch):
    from gate_fixtures import fake_code_build
    from kernels import build as kb
    from kernels.sandbox import Sandbox

    monkeypatch.setattr(kb, "build_requests", lambda reqs, **kw: fake_code_build(reqs))
    monkeypatch.setattr(Sandbox, "problem", lambda self: None)


def _outputs(path) -> dict:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_scope_outputs_every_kernel_of_a_path_change_and_the_composite(tmp_path, fake_builds, capsys):
    root = tmp_path / "repo"
    make_repo(root)
    write(root, "kernels/manifest.toml", MANIFEST + PATH_MANIFEST_TAIL)
    base = commit(root, "a decode path")
    edit_lines(root, "kernels/ops/alpha.py", 2)
    edit_lines(root, "kernels/ops/beta.py", 2)
    head = commit(root, "alpha and beta")
    gh = tmp_path / "github_output"
    gh.write_text("earlier=kept\n")  # appended to, as $GITHUB_OUTPUT is
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--scope-only",
                   "--out", str(tmp_path / "out"), "--github-output", str(gh)])
    assert rc == 0, capsys.readouterr().out
    out = _outputs(gh)
    assert out["earlier"] == "kept" and out["status"] == "pass"
    assert json.loads(out["kernels"]) == ["alpha", "beta"]
    assert json.loads(out["targets"]) == ["alpha", "beta", "block"]


def test_not_eligible_outputs_no_kernels(tmp_path, fake_builds, capsys):
    root = tmp_path / "repo"
    base = make_repo(root)
    write(root, "tests/test_alpha.py", "def test_alpha():\n    assert False or True\n")
    head = commit(root, "loosen a test")
    gh = tmp_path / "github_output"
    rc = cli.main(["gate", "--base", base, "--head", head, "--repo", str(root), "--scope-only",
                   "--out", str(tmp_path / "out"), "--github-output", str(gh)])
    assert rc == 3
    assert _outputs(gh) == {"status": "not_eligible", "kernels": "[]", "targets": "[]"}


def test_ci_outputs_of_a_one_kernel_verdict():
    v = GateVerdict("pass", 0, [], kernels=["rmsnorm"], policy={"composite": None})
    assert ci_outputs(v) == {"status": "pass", "kernels": '["rmsnorm"]', "targets": '["rmsnorm"]'}


def test_pr_workflow_matrix_reads_the_gates_outputs():
    yaml = pytest.importorskip("ruamel.yaml")
    wf = yaml.YAML(typ="safe").load((REPO / ".github/workflows/pr.yml").read_text())
    scope = wf["jobs"]["scope"]
    assert "--github-output \"$GITHUB_OUTPUT\"" in "\n".join(str(s.get("run", "")) for s in scope["steps"])
    assert set(scope["outputs"]) == {"status", "kernels", "targets"}
    for job in ("prepare", "gpu", "sign"):
        assert wf["jobs"][job]["strategy"]["matrix"]["target"] == "${{ fromJSON(needs.scope.outputs.targets) }}"
        assert "needs.scope.outputs.kernel }}" not in json.dumps(wf["jobs"][job])
