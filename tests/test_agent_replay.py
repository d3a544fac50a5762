"""Replay: a recorded trajectory re-run without a model reproduces the change; divergences are
reported; Ctrl-C stops a run cleanly and keeps what was written."""

from __future__ import annotations

import json
import os
import signal

import pytest
from agent_helpers import API_KEY, FakeBackends, ScriptedAPI, git, make_repo, message, text, tool_use

from agent import cli
from agent.interrupt import InterruptGuard
from agent.loop import RunConfig, run_proposal
from agent.session import RunStopped

EDIT = {"path": "kernels/ops/toy.py", "old_str": "    for v in x:\n        acc += v\n    return acc\n",
        "new_str": "    return sum(x)\n"}
SUBMIT = {"title": "toy: builtin sum", "summary": "s", "motivation": "m", "design": "d",
          "prediction": "-30% time", "predicted_time_change_pct": -30, "risks": "r", "rollback": "SLOW"}


def runs(repo):
    return sorted((repo / ".fasttrack" / "runs").iterdir())


def record_claude_run(repo, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    api = ScriptedAPI([
        message([tool_use("view_file", {"path": "kernels/ops/toy.py"}, "t1")], n=1),
        message([text("edit"), tool_use("edit_file", EDIT, "t2")], n=2),
        message([tool_use("build", {}, "t3")], n=3),
        message([tool_use("submit_proposal", SUBMIT, "t4")], n=4),
    ])
    assert cli.main(["--kernel", "toy", "--goal", "faster", "--repo", str(repo), "--no-progress"],
                    backends=FakeBackends(), http_client=api.client()) == 0
    (run_dir,) = runs(repo)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_replay_reproduces_the_recorded_change_without_a_model(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    run_dir, recorded = record_claude_run(repo, monkeypatch)
    monkeypatch.delenv("ANTHROPIC_API_KEY")  # the replay needs no key and calls no API
    assert cli.main(["--kernel", "toy", "--proposer", "replay", "--trajectory", str(run_dir / "trajectory.jsonl"),
                     "--repo", str(repo), "--no-progress"], backends=FakeBackends()) == 0
    replay_dir = [d for d in runs(repo) if d != run_dir][0]
    replayed = json.loads((replay_dir / "summary.json").read_text())
    assert replayed["outcome"] == "committed" and replayed["replay"]["divergences"] == []
    # Same kernel change, same RFC text.
    a, b = recorded["branch"], replayed["branch"]
    assert git(repo, "diff", a, b, "--", "kernels") == ""
    rfc_a = git(repo, "show", f"{a}:evidence_reports/{recorded['run_id']}/rfc.toml")
    rfc_b = git(repo, "show", f"{b}:evidence_reports/{replayed['run_id']}/rfc.toml")
    assert rfc_a == rfc_b


def test_replay_reports_divergences(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    run_dir, _ = record_claude_run(repo, monkeypatch)
    # Today's audit flags the change: the replayed submission is rejected, and the divergence shown.
    class StricterBackends(FakeBackends):
        def audit(self, root, kernel):
            from agent.backends import FAILED, CheckResult

            return CheckResult("audit", FAILED, "NEW_RULE: finding")

    code = cli.main(["--kernel", "toy", "--proposer", "replay", "--trajectory", str(run_dir / "trajectory.jsonl"),
                     "--repo", str(repo), "--no-progress"], backends=StricterBackends())
    assert code == 1
    replay_dir = [d for d in runs(repo) if d != run_dir][0]
    s = json.loads((replay_dir / "summary.json").read_text())
    names = [d["name"] for d in s["replay"]["divergences"]]
    assert "build" in names and "submit_proposal" in names
    assert s["outcome"] == "no_proposal"


def test_replay_of_a_bad_file_or_other_kernel_is_a_clear_error(tmp_path, monkeypatch, capsys):
    repo = make_repo(tmp_path / "repo")
    bad = tmp_path / "t.jsonl"
    bad.write_text("{}\n")
    assert cli.main(["--kernel", "toy", "--proposer", "replay", "--trajectory", str(bad), "--repo", str(repo)],
                    backends=FakeBackends()) == 2
    assert "not a trajectory event" in capsys.readouterr().err
    assert cli.main(["--kernel", "toy", "--proposer", "replay", "--repo", str(repo)], backends=FakeBackends()) == 2
    run_dir, _ = record_claude_run(repo, monkeypatch)
    assert cli.main(["--kernel", "other", "--proposer", "replay", "--trajectory", str(run_dir / "trajectory.jsonl"),
                     "--repo", str(repo), "--no-progress"], backends=FakeBackends()) == 2


def test_interrupt_guard_defers_ctrl_c_inside_a_critical_section():
    g = InterruptGuard()
    with g:
        with pytest.raises(KeyboardInterrupt):
            with g.critical():
                os.kill(os.getpid(), signal.SIGINT)
                done = True  # still runs: the interrupt waits for the section's end
        assert done and g.interrupted
        with pytest.raises(KeyboardInterrupt):  # outside a section: at once
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
        assert not g.pending


class CtrlCProposer:
    """Edits the kernel, then the user presses Ctrl-C."""

    name = "fake"

    def run(self, session, toolbox):
        toolbox.call("edit_file", EDIT, "e1")
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**7):
            pass
        raise RunStopped("error", "not interrupted?")


def test_ctrl_c_stops_cleanly_and_keeps_what_was_written(tmp_path):
    repo = make_repo(tmp_path / "repo")
    cfg = RunConfig(kernel="toy", goal="g", proposer="fake", repo=repo)
    before = signal.getsignal(signal.SIGINT)  # not always the default: a background job's is SIG_IGN
    result = run_proposal(cfg, CtrlCProposer(), backends=FakeBackends())
    assert result.outcome == "interrupted" and result.exit_code == 130
    s = json.loads((result.run_dir / "summary.json").read_text())
    assert s["outcome"] == "interrupted" and s["attempts"][0]["verdict"] == "abandoned"
    assert result.worktree is None  # an interrupted run commits nothing: only its record stays
    lines = (result.run_dir / "trajectory.jsonl").read_text().splitlines()
    assert "return sum(x)" in "\n".join(lines)  # the edit, kept in the trajectory
    assert json.loads(lines[-1])["kind"] == "end"  # whole lines to the end
    # The handler the run found was restored.
    assert signal.getsignal(signal.SIGINT) is before
