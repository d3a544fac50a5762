"""The gate's own builds run the change's code (untrusted) in kernels/sandbox.py's sandbox."""

from __future__ import annotations

import pytest

from gate_fixtures import REPO, commit, edit_lines, make_repo, write
from kernels.sandbox import Sandbox
from validation import cli
from validation.gate import EXIT_ERROR, EXIT_FAIL, run_gate

needs_bwrap = pytest.mark.skipif(Sandbox().problem() is not None,
                                 reason=f"the sandbox cannot run here: {Sandbox().problem()}")


def _alpha_change(tmp_path):
    root = tmp_path / "repo"
    base = make_repo(root)
    edit_lines(root, "kernels/ops/alpha.py", 2)
    return root, base, commit(root, "alpha: a change")


def test_without_bubblewrap_the_gate_refuses_to_build_and_names_the_opt_out(tmp_path):
    root, base, head = _alpha_change(tmp_path)
    v = run_gate(base, head, repo=root, sandbox=Sandbox(bwrap="no-such-bwrap-here"))
    assert (v.status, v.exit_code) == ("error", EXIT_ERROR)
    assert "only inside a sandbox" in v.cause and "bubblewrap (bwrap) is not installed" in v.cause
    assert "--no-sandbox" in v.cause


def test_the_gates_real_builds_carry_its_sandbox(tmp_path, monkeypatch):
    # Every build request of compare_code goes through kernels.build.build_requests with the
    # gate's sandbox (the default one hides the repository's key store).
    from gate_fixtures import fake_code_build
    from kernels import build as kb

    root, base, head = _alpha_change(tmp_path)
    seen = []

    def recording(reqs, **kw):
        seen.append(kw.get("sandbox"))
        return fake_code_build(reqs)

    monkeypatch.setattr(kb, "build_requests", recording)
    monkeypatch.setattr(Sandbox, "problem", lambda self: None)
    run_gate(base, head, repo=root, scope_only=True)
    assert seen and all(isinstance(s, Sandbox) for s in seen)
    assert seen[0].key_roots == (str(root),)
    seen.clear()
    run_gate(base, head, repo=root, scope_only=True, sandbox=None)  # the documented opt-out
    assert seen == [None]


def test_cli_documents_the_sandbox_opt_out(capsys):
    with pytest.raises(SystemExit):
        cli.main(["gate", "--help"])
    out = capsys.readouterr().out
    assert "--no-sandbox" in out and "bubblewrap" in out


@needs_bwrap
@pytest.mark.parametrize("sandboxed", [True, False])
def test_a_head_source_cannot_read_a_secret_or_a_file_outside_the_tree_during_the_gates_build(
        tmp_path, monkeypatch, sandboxed):
    """The head's rmsnorm.py reads an environment secret and a file outside the tree when the
    build imports it, and reports what it read through the build error. Sandboxed (the default)
    it reads nothing; the unsandboxed run shows the probe would have seen both."""
    pytest.importorskip("cutlass")
    from gate_fixtures import scratch_clone

    root = tmp_path / "clone"
    base = scratch_clone(root)
    secret_file = tmp_path / "outside" / "secret.txt"
    secret_file.parent.mkdir()
    secret_file.write_text("file-secret-7f3a")
    monkeypatch.setenv("FASTTRACK_TEST_SECRET", "env-secret-91c2")
    src = root / "kernels/ops/rmsnorm.py"
    probe = ("import os\n"
             "def _read(p):\n"
             "    try:\n"
             "        return open(p).read()\n"
             "    except OSError as e:\n"
             "        return type(e).__name__\n"
             "raise RuntimeError('probe:' + repr(os.environ.get('FASTTRACK_TEST_SECRET')) + ':' + "
             f"_read({str(secret_file)!r}))\n")
    write(root, "kernels/ops/rmsnorm.py", probe + src.read_text())
    head = commit(root, "rmsnorm: a build-time probe")
    kw = {} if sandboxed else {"sandbox": None}
    v = run_gate(base, head, repo=root, build_root=REPO / "build", jobs=1, **kw)
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL), v.reasons
    text = "\n".join(v.reasons)
    assert "probe:" in text  # the payload ran, inside the build
    if sandboxed:
        assert "env-secret-91c2" not in text and "file-secret-7f3a" not in text
        assert "probe:None:FileNotFoundError" in text
    else:
        assert "env-secret-91c2" in text and "file-secret-7f3a" in text
